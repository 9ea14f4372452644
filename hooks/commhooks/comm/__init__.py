"""Backend-agnostic collectives (:class:`Comm`) and the byte meter."""

from .base import CollectiveError, Comm, Group, Meter, Work

__all__ = ["CollectiveError", "Comm", "Group", "Meter", "Work", "TorchComm"]


def __getattr__(name):
    if name == "TorchComm":
        from .torch_dist import TorchComm

        return TorchComm
    raise AttributeError(name)
