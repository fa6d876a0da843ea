"""Backends that move tensors between workers."""

from shaky.comm.base import Comm, block_sizes
from shaky.comm.sim import SimComm

__all__ = ["Comm", "SimComm", "block_sizes"]
