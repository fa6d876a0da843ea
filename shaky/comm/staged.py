"""A host-only Comm (gloo, the udp transport) in front of a run whose tensors live on a GPU.

``StagedComm(inner, device)`` is the Comm the training loop sees on a GPU rank:
each exchange copies its rows into pinned host memory (one copy, waited for:
the host side reads them next), runs on ``inner`` as on a CPU rank, and its
result crosses back to the GPU without waiting (``on_device``). Everything
that is not an exchange (membership, observed masks, statistics) is the inner
Comm's. The numbers are the CPU rank's: copies change no bit.
"""

from __future__ import annotations

from typing import Any

import torch

from shaky.comm.base import Done, Handle, on_device


def to_host(x: torch.Tensor) -> torch.Tensor:
    """``x`` in pinned host memory (from a GPU; a host tensor as it is), copied once the GPU work before it is
    done."""
    if x.device.type == "cpu":
        return x
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    torch.cuda.current_stream(x.device).synchronize()
    return host


class _Back:
    """A handle of the inner Comm whose result moves to the device when it is waited for."""

    def __init__(self, handle: Handle, device: torch.device) -> None:
        self._handle, self._device = handle, device

    @property
    def settled(self) -> bool:
        return self._handle.settled     # type: ignore[attr-defined]  (a mean's handle: MeanHandle)

    @property
    def carried(self) -> bool:
        return self._handle.carried     # type: ignore[attr-defined]

    def wait(self) -> torch.Tensor:
        return on_device(self._handle.wait(), self._device)


class StagedComm:
    """``inner``'s exchanges for rows on ``device``, staged through pinned host memory (see the module)."""

    def __init__(self, inner: Any, device: torch.device) -> None:
        self.inner, self.device = inner, device

    def __getattr__(self, name: str) -> Any:     # rank, rows, num_workers, wait_s, membership, statistics...
        return getattr(self.inner, name)

    def _back(self, handle: Handle) -> Handle:
        return Done(on_device(handle.value, self.device)) if isinstance(handle, Done) else _Back(handle, self.device)

    def mean(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        return on_device(self.inner.mean(to_host(x), weights), x.device)

    def start_mean(self, x: torch.Tensor, weights: torch.Tensor | None = None, *, deferred: bool = False) -> Handle:
        return self._back(self.inner.start_mean(to_host(x), weights, deferred=deferred))

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return on_device(self.inner.gather(to_host(x)), x.device)

    def block_average(self, x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return on_device(self.inner.block_average(to_host(x), up, down, **kwargs), x.device)

    def start_block_average(self, x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, **kwargs: Any) -> Handle:
        # The host copy is the exchange's own: the inner Comm may read it in the background after this returns.
        return self._back(self.inner.start_block_average(to_host(x), up, down, **{**kwargs, "overwrite": True}))
