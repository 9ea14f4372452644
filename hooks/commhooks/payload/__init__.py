"""Compressed sync payloads, one module family with a one-way call graph: :mod:`.codec` (how a payload is encoded,
and the compressed means both algorithms call: :func:`start_mean`, :func:`start_change_mean`,
:func:`compressed_mean`) calls :mod:`.exchange` (the two-step exchange, handed the codec), never the other way;
:mod:`.fields` declares the config keys."""

from .codec import (CODECS, DENSE_BITS, EXCHANGES, TWO_STEP_FROM, Codec, compressed_mean, decode, encode, flat_into,
                    payload_nbytes, resolve, reused, round_trip, start_change_mean, start_mean, write_flat)
from .exchange import OwnerFeedback, TwoStep, piece_numel
from .fields import PayloadFields

__all__ = ["CODECS", "DENSE_BITS", "EXCHANGES", "TWO_STEP_FROM", "Codec", "OwnerFeedback", "PayloadFields", "TwoStep",
           "compressed_mean", "decode", "encode", "flat_into", "payload_nbytes", "piece_numel", "resolve", "reused",
           "round_trip", "start_change_mean", "start_mean", "write_flat"]
