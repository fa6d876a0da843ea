"""The simulator backend: all W workers' rows live in one [W, D] tensor."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np
import torch

from shaky import native
from shaky.comm.base import Done, on_device
from shaky.geometry import block_groups, block_sizes, segment_counts, segment_length


@lru_cache(maxsize=64)
def _block_bytes(dim: int, num_workers: int, itemsize: int) -> tuple[np.ndarray, int]:
    """int64 [W]: each block's size in bytes, and its address (kept alive here: the C call reads it there)."""
    out = np.asarray(block_sizes(dim, num_workers), dtype=np.int64) * itemsize
    out.flags.writeable = False
    return out, out.ctypes.data


WHERE_ON_CPU = False
"""Whether the CPU too takes :func:`_take_where_delivered` (the tests check it gives the CPU path's bits); the CPU
copies only the lost blocks, which is faster there."""


def _take_where_delivered(out: torch.Tensor, x: torch.Tensor, avg: torch.Tensor, lost: torch.Tensor,
                          groups: tuple[tuple[int, int, int, int], ...]) -> torch.Tensor:
    """``out[i, block j] = x[i, block j] if lost[i, j] else avg[block j]``: the block average's last part as one
    elementwise choice per group of blocks (the GPU's path: no ``nonzero``, which waits for the GPU, and no
    gather or scatter). Copies only, so the CPU path's bits; ``out`` may be ``x`` (each element is read before
    it is written)."""
    w = x.shape[0]
    for first, last, start, size in groups:
        nb, stop = last - first, start + (last - first) * size
        torch.where(lost[:, first:last, None], x[:, start:stop].view(w, nb, size),
                    avg[start:stop].view(1, nb, size), out=out[:, start:stop].view(w, nb, size))
    return out


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

    def block_average(self, x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *,
                      weights: torch.Tensor | None = None, servers: torch.Tensor | None = None,
                      overwrite: bool = False, segment_bytes: int = 0) -> torch.Tensor:
        if servers is not None:  # block j travels on the links of the worker that serves it
            up, down = up[:, servers], down[servers, :]
        if x.device.type != "cpu":   # the masks (and weights) are drawn on the host: the average runs where x is
            up, down = on_device(up, x.device), on_device(down, x.device)
            weights = None if weights is None else on_device(weights, x.device)
        if segment_bytes:
            return self._segment_average(x, up, down, weights, overwrite, segment_bytes)
        w, dim = x.shape
        lib = native.FASTPATH
        # (the C paths read the masks as bytes: bool masks only, as LinkSample makes them)
        compiled = lib is not None and x.device.type == "cpu" and up.dtype == down.dtype == torch.bool
        if compiled and weights is None and x.dtype in (torch.float32, torch.float64):
            # In C where the install built it: counts and divisions, so torch's bits (shaky_block_shares)
            share, up_bytes = x.new_empty(w, 1, w), up.contiguous()   # (kept alive through the call)
            lib.shaky_block_shares(up_bytes.data_ptr(), w, share.data_ptr(), x.element_size())
        else:
            up_f = up.to(x.dtype) if weights is None else up.to(x.dtype) * weights.to(x.dtype)[:, None]
            share = (up_f / up_f.sum(0)).T.unsqueeze(1).contiguous()
        # share: [servers, 1, senders], each arrival's weight in its server's average
        groups = block_groups(dim, w)
        # Every server's average of its block, side by side in one row (read before anything is written: ``out``
        # may be ``x``) ...
        avg = x.new_empty(dim)
        for first, last, start, size in groups:
            blocks = x[:, start:start + (last - first) * size].view(w, last - first, size)
            # (a fresh bmm, then copied: bmm's out= at an offset summed 1 ulp apart here and there)
            avg[start:start + (last - first) * size] = torch.bmm(share[first:last], blocks.transpose(0, 1)).view(-1)
        # ... taken by every worker, except where it was lost: there it keeps its own block.
        out = x if overwrite and x.is_contiguous() else torch.empty_like(x)
        if x.device.type != "cpu" or WHERE_ON_CPU:
            return _take_where_delivered(out, x, avg, ~down.T, groups)
        if compiled and x.stride(1) == 1 and out.stride(1) == 1:
            # One pass in C, row by row and block by block (shaky_take_averages): copies only, so the bits of the
            # torch path below, without its nonzero, gather and scatter per group of blocks.
            down_bytes = down.contiguous()                          # (kept alive through the call)
            lib.shaky_take_averages(out.data_ptr(), x.data_ptr(), avg.data_ptr(), down_bytes.data_ptr(),
                                    _block_bytes(dim, w, x.element_size())[1], w,
                                    out.stride(0) * out.element_size(), x.stride(0) * x.element_size())
            return out
        lost = ~down.T                                       # [workers, servers]: the average did not come back
        kept = []   # the blocks whose average was lost, copied before ``out`` is written
        for first, last, start, size in groups:
            blocks = x[:, start:start + (last - first) * size].view(w, last - first, size)
            workers, servers = lost[:, first:last].nonzero(as_tuple=True)
            kept.append((workers, servers, blocks[workers, servers]) if len(workers) else None)
        out.copy_(avg.expand(w, dim))
        for (first, last, start, size), lost_here in zip(groups, kept):
            if lost_here is not None:
                workers, servers, values = lost_here
                out[:, start:start + (last - first) * size].view(w, last - first, size)[workers, servers] = values
        return out

    def _segment_average(self, x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor | None,
                         overwrite: bool, segment_bytes: int) -> torch.Tensor:
        """:meth:`block_average` per segment: masks [W, W, S] (servers already applied), block j cut into segments."""
        w, dim = x.shape
        seg = segment_length(segment_bytes, x.element_size())
        num_segments = max(1, *segment_counts(dim, w, seg))
        if up.shape != (w, w, num_segments) or down.shape != up.shape:
            raise ValueError(f"segment masks must be [{w}, {w}, {num_segments}] for {w} workers, {dim} values of "
                             f"{x.element_size()} bytes and segment_bytes {segment_bytes} ({seg} values a segment); "
                             f"got up {list(up.shape)}, down {list(down.shape)}")
        up_f = up.to(x.dtype) if weights is None else up.to(x.dtype) * weights.to(x.dtype)[:, None, None]
        share = up_f / up_f.sum(0)              # [senders, servers, segments]: each arrival's weight
        lost = ~down.transpose(0, 1)            # [workers, servers, segments]: the average did not come back
        out = x if overwrite and x.is_contiguous() else torch.empty_like(x)
        for first, last, start, size in block_groups(dim, w):
            nb = last - first
            stop = start + nb * size
            blocks = x[:, start:stop].view(w, nb, size)
            target = out[:, start:stop].view_as(blocks)
            # A block's whole segments are one [W, blocks, segments, seg] view; a shorter last one is another.
            whole, rest = divmod(size, seg)
            pieces = ([(0, whole, seg)] if whole else []) + ([(whole, 1, rest)] if rest else [])
            for k0, count, length in pieces:
                cut = slice(k0 * seg, k0 * seg + count * length)
                src = blocks[:, :, cut].unflatten(2, (count, length))   # [senders, blocks, segments, length]
                dst = target[:, :, cut].unflatten(2, (count, length))
                # Every server's average of every segment ...
                if count == 1:  # one segment per block: the block rule's batched matrix product, bit for bit
                    avg = torch.bmm(share[:, first:last, k0].T.unsqueeze(1).contiguous(),
                                    src[:, :, 0].transpose(0, 1))                    # [servers, 1, length]
                else:  # many short segments: a weighted sum over the senders (tiny matrix products are slow)
                    avg = (src * share[:, first:last, k0:k0 + count, None]).sum(0)  # [servers, segments, length]
                # ... taken by every worker except where it was lost: there it keeps its own segment. One pass,
                # element by element, so ``dst`` may be ``src`` itself.
                torch.where(lost[:, first:last, k0:k0 + count, None], src, avg.view(nb, count, length), out=dst)
        return out
