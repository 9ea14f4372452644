"""The keys of a compressed sync, declared once for every algorithm that sends one (a config base class)."""

from __future__ import annotations

from pydantic import Field
from typing_extensions import Annotated, Literal

from ..settings import HookConfig
from .codec import Codec


class PayloadFields(HookConfig):
    """The keys of a compressed sync, declared once for every algorithm that sends one (a config base class)."""

    payload: Literal["fp32", "bf16", "int8", "int4", "int2", "topk"] = Field("fp32", description=(
        "how the sync sends the pseudo-gradient: fp32 (exact), bf16 (2 bytes/element), int8 / int4 / int2 (8, 4, 2 "
        "bits per element, packed, + one fp32 scale per payload_block elements; int2 is ternary), topk (the "
        "largest topk_density of each topk_chunk, as 2-byte indices + values); anything but fp32 is averaged by "
        "the ranks themselves (payload_exchange)"))
    payload_block: Annotated[int, Field(ge=8, description=(
        "int8/int4/int2: elements per scale (error per element <= absmax of its block / (2q), q = 127, 7, 1)"))] = 256
    payload_rounding: Literal["nearest", "stochastic"] = Field("nearest", description=(
        "int8/int4/int2 (and topk's values): round to nearest, or stochastically (unbiased; its random numbers "
        "seeded by the rank and the step, so a resume draws the same)"))
    topk_density: Annotated[float, Field(gt=0.0, le=1.0, description=(
        "topk: the share of each chunk sent (SparseLoCo: 0.01-0.03); pair it with error_feedback"))] = 0.01
    topk_chunk: Annotated[int, Field(ge=16, le=65536, description=(
        "topk: elements per chunk, each chunk sending its own largest (indices are 2 bytes)"))] = 4096
    topk_values: Literal["fp32", "bf16", "int8", "int4", "int2"] = Field("fp32", description=(
        "topk: how the chosen values travel (int codecs: one scale per chunk)"))

    payload_exchange: Literal["auto", "allgather", "two_step"] = Field("auto", description=(
        "how a compressed payload is averaged: allgather (each rank receives every rank's payload: (s-1) x payload "
        "bytes for s ranks), two_step (an all-to-all of pieces, each rank averaging one, then an allgather of the "
        "re-encoded means: under 2 x payload whatever the world, a second rounding, carried by error_feedback), "
        "auto (two_step from 3 ranks in the averaging group)"))

    def inactive_keys(self):
        idle = dict(super().inactive_keys())
        ints = ("int8", "int4", "int2")
        if self.payload not in ints:
            idle["payload_block"] = "with payload int8, int4 or int2 (one scale per block)"
        if self.payload not in ints and not (self.payload == "topk" and self.topk_values in ints):
            idle["payload_rounding"] = "with payload int8, int4 or int2, or topk with int topk_values"
        if self.payload != "topk":
            idle.update({k: "with payload topk" for k in ("topk_density", "topk_chunk", "topk_values")})
        if self.payload == "fp32":
            idle["payload_exchange"] = "with a compressed payload (fp32 is averaged by one allreduce)"
        return idle

    @property
    def codec(self) -> "Codec":
        """The payload's :class:`Codec`."""
        return Codec(self.payload, self.payload_block, self.payload_rounding, self.topk_density, self.topk_chunk,
                     self.topk_values, self.payload_exchange)
