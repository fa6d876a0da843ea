"""Backends that move tensors between workers."""

from shaky.comm.base import Comm
from shaky.comm.sim import SimComm
from shaky.geometry import block_sizes

__all__ = ["Comm", "SimComm", "block_sizes"]
