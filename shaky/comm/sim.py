"""The simulator backend: all W workers' rows live in one [W, D] tensor."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np
import torch

from shaky import native
from shaky.comm import rps
from shaky.comm.base import Done, on_device
from shaky.geometry import block_groups, block_sizes, segment_counts, segment_length


@lru_cache(maxsize=64)
def _block_bytes(dim: int, num_workers: int, itemsize: int) -> tuple[np.ndarray, int]:
    """int64 [W]: each block's size in bytes, and its address (kept alive here: the C call reads it there)."""
    out = np.asarray(block_sizes(dim, num_workers), dtype=np.int64) * itemsize
    out.flags.writeable = False
    return out, out.ctypes.data


WHERE_ON_CPU = False
"""Whether the CPU too takes :func:`shaky.comm.rps.keep_own_where_lost` where the compiled copy would run (the
tests check both give the same bits); the compiled one copies only the lost blocks, which is faster there."""


def _averages(x: torch.Tensor, share: torch.Tensor, seg: int) -> torch.Tensor:
    """Every server's average of its block (:func:`shaky.comm.rps.server_average` with ``share``, rps.shares's
    [blocks, S, senders]), side by side in one row [D]: each group of equal blocks one batched product."""
    w, dim = x.shape
    avg = x.new_empty(dim)
    for first, last, start, size in block_groups(dim, w):
        nb, stop = last - first, start + (last - first) * size
        rps.server_average(share[first:last], x[:, start:stop].view(w, nb, size).transpose(0, 1), seg,
                           out=avg[start:stop].view(nb, size))
    return avg


class SimComm:
    """Comm for W workers held in one process; every exchange is a few tensor ops."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.wait_s = 0.0   # every exchange completes when it starts
        self.rows = torch.arange(num_workers)

    def mean(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        if weights is None:
            return x.mean(dim=0, keepdim=True).expand_as(x)
        w = on_device(weights, x.device).to(x.dtype).reshape(-1, *([1] * (x.dim() - 1)))
        return ((x * w).sum(dim=0, keepdim=True) / w.sum()).expand_as(x)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def broadcast(self, value: Any) -> Any:
        return value

    def start_mean(self, x: torch.Tensor, weights: torch.Tensor | None = None, *, deferred: bool = False) -> Done:
        return Done(self.mean(x, weights))

    def start_block_average(self, x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *,
                            weights: torch.Tensor | None = None, servers: torch.Tensor | None = None,
                            overwrite: bool = False, segment_bytes: int = 0) -> Done:
        return Done(self.block_average(x, up, down, weights=weights, servers=servers, overwrite=overwrite,
                                       segment_bytes=segment_bytes))

    def server_averages(self, x: torch.Tensor, up: torch.Tensor, weights: torch.Tensor | None,
                        servers: torch.Tensor, seg: int) -> torch.Tensor:
        """Phase 1 alone (:func:`shaky.comm.rps.shares`, :func:`~shaky.comm.rps.server_average`): every value's
        server average [D] over the senders whose segment of ``seg`` values (0: block) arrived, ``up`` per block
        with each server's own part delivered (the quantized exchange, :mod:`shaky.comm.quant`, does phase 2)."""
        weights = None if weights is None else on_device(weights, x.device)
        return _averages(x, rps.shares(on_device(up, x.device), weights, x.dtype), seg)

    def block_average(self, x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *,
                      weights: torch.Tensor | None = None, servers: torch.Tensor | None = None,
                      overwrite: bool = False, segment_bytes: int = 0) -> torch.Tensor:
        """RPS's rule (:mod:`shaky.comm.rps`) over every block at once: each group of equal blocks is one
        batched average and one elementwise choice, no Python loop over the workers."""
        if servers is not None:  # (the masks are per block; a server's own part of a block never travels)
            up, down = rps.own_parts_delivered(up, down, servers)
        if x.device.type != "cpu":   # the masks (and weights) are drawn on the host: the average runs where x is
            up, down = on_device(up, x.device), on_device(down, x.device)
            weights = None if weights is None else on_device(weights, x.device)
        w, dim = x.shape
        seg = segment_length(segment_bytes, x.element_size())
        if segment_bytes:
            num_segments = max(1, *segment_counts(dim, w, seg))
            if up.shape != (w, w, num_segments) or down.shape != up.shape:
                raise ValueError(f"segment masks must be [{w}, {w}, {num_segments}] for {w} workers, {dim} values "
                                 f"of {x.element_size()} bytes and segment_bytes {segment_bytes} ({seg} values a "
                                 f"segment); got up {list(up.shape)}, down {list(down.shape)}")
        lib = native.FASTPATH
        # (the C paths read the masks as bytes: bool masks only, as LinkSample makes them; one message a block)
        compiled = (lib is not None and not segment_bytes and x.device.type == "cpu"
                    and up.dtype == down.dtype == torch.bool)
        if compiled and weights is None and x.dtype in (torch.float32, torch.float64):
            # rps.shares in C where the install built it: counts and divisions, so torch's bits
            share, up_bytes = x.new_empty(w, 1, w), up.contiguous()   # (kept alive through the call)
            lib.shaky_block_shares(up_bytes.data_ptr(), w, share.data_ptr(), x.element_size())
        else:
            share = rps.shares(up, weights, x.dtype)               # [servers, S, senders]
        groups = block_groups(dim, w)
        # Every server's average of its block, side by side in one row (read before anything is written: ``out``
        # may be ``x``) ...
        avg = _averages(x, share, seg)
        # ... taken by every worker, except where it was lost: there it keeps its own block.
        out = x if overwrite and x.is_contiguous() else torch.empty_like(x)
        if compiled and not WHERE_ON_CPU and x.stride(1) == 1 and out.stride(1) == 1:
            # rps.keep_own_where_lost in C (shaky_take_averages), row by row and block by block: copies only.
            down_bytes = down.contiguous()                          # (kept alive through the call)
            lib.shaky_take_averages(out.data_ptr(), x.data_ptr(), avg.data_ptr(), down_bytes.data_ptr(),
                                    _block_bytes(dim, w, x.element_size())[1], w,
                                    out.stride(0) * out.element_size(), x.stride(0) * x.element_size())
            return out
        lost = ~down.transpose(0, 1)                       # [workers, servers(, S)]: the average did not come back
        if not segment_bytes:
            lost = lost[..., None]
        for first, last, start, size in groups:
            nb, stop = last - first, start + (last - first) * size
            rps.keep_own_where_lost(avg[start:stop].view(nb, size), x[:, start:stop].view(w, nb, size),
                                    lost[:, first:last], seg, out=out[:, start:stop].view(w, nb, size))
        return out
