"""The simulator backend: all W workers' rows live in one [W, D] tensor."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from shaky.comm import native
from shaky.comm.base import Done, block_sizes, segment_counts, segment_length

if TYPE_CHECKING:
    from shaky.network.model import LinkSample


@lru_cache(maxsize=64)
def _block_bytes(sizes: tuple[int, ...], itemsize: int) -> np.ndarray:
    """int64 [W]: each block's size in bytes (kept alive here: the C call reads it by address)."""
    out = np.asarray(sizes, dtype=np.int64) * itemsize
    out.flags.writeable = False
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
        w = weights.to(x.dtype).reshape(-1, *([1] * (x.dim() - 1)))
        return ((x * w).sum(dim=0, keepdim=True) / w.sum()).expand_as(x)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def start_mean(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> Done:
        return Done(self.mean(x, weights))

    def start_block_average(self, x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *,
                            weights: torch.Tensor | None = None, servers: torch.Tensor | None = None,
                            overwrite: bool = False, segment_bytes: int = 0) -> Done:
        return Done(self.block_average(x, up, down, weights=weights, servers=servers, overwrite=overwrite,
                                       segment_bytes=segment_bytes))

    def on_step(self, step: int) -> None:
        """Nothing to report: every worker lives in this process."""

    def take_observed(self) -> list[tuple[int, LinkSample]]:
        """Nothing: the masks that applied are the drawn ones."""
        return []

    def take_membership(self) -> list[tuple[int, torch.Tensor]]:
        """Nothing: the failure schedule is the membership."""
        return []

    def take_admitted(self) -> tuple[int, ...]:
        """Nothing: the failure schedule says who rejoins."""
        return ()

    def welcome(self, joiners: Sequence[int], snapshot: dict[str, Any]) -> None:
        """Never called (:meth:`take_admitted` admits no one)."""
        raise RuntimeError("the simulator takes no process back: its failure schedule says who rejoins")

    def transport_stats(self, before: dict[str, int | float] | None = None) -> dict[str, int | float]:
        """Nothing: the simulator's losses are drawn, not observed."""
        return {}

    def block_average(self, x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *,
                      weights: torch.Tensor | None = None, servers: torch.Tensor | None = None,
                      overwrite: bool = False, segment_bytes: int = 0) -> torch.Tensor:
        if servers is not None:  # block j travels on the links of the worker that serves it
            up, down = up[:, servers], down[servers, :]
        if segment_bytes:
            return self._segment_average(x, up, down, weights, overwrite, segment_bytes)
        w, dim = x.shape
        sizes = block_sizes(dim, w)
        # Blocks come in at most two sizes (larger ones first), so each group is a
        # plain reshape [W senders, blocks, size]: no gather, no Python loop over workers.
        big = sizes.count(sizes[0])
        groups = [(0, big, sizes[0]), (big, w, sizes[-1])] if big < w else [(0, w, sizes[0])]
        up_f = up.to(x.dtype) if weights is None else up.to(x.dtype) * weights.to(x.dtype)[:, None]
        share = (up_f / up_f.sum(0)).T.unsqueeze(1).contiguous()  # [servers, 1, senders]: each arrival's weight
        lost = ~down.T                                       # [workers, servers]: the average did not come back
        out = x if overwrite and x.is_contiguous() else torch.empty_like(x)
        if native.FASTPATH is not None and x.device.type == "cpu" and x.stride(1) == 1 and out.stride(1) == 1:
            return self._take_blocks(native.FASTPATH, x, out, share, lost, groups, sizes)
        start = 0
        for first, last, size in groups:
            if size == 0:
                continue
            stop = start + (last - first) * size
            blocks = x[:, start:stop].view(w, last - first, size)
            target = out[:, start:stop].view_as(blocks)
            # Every worker gets every server's average (one batched matrix product over the servers) ...
            avg = torch.bmm(share[first:last], blocks.transpose(0, 1))     # [servers, 1, size]
            # ... except where it was lost: there it keeps its own block (a copy of those blocks only,
            # taken before the averages are written, since ``target`` may be ``blocks`` itself).
            workers, servers = lost[:, first:last].nonzero(as_tuple=True)
            kept = blocks[workers, servers] if len(workers) else None
            target.copy_(avg.transpose(0, 1).expand_as(blocks))
            if kept is not None:
                target[workers, servers] = kept
            start = stop
        return out

    @staticmethod
    def _take_blocks(lib: Any, x: torch.Tensor, out: torch.Tensor, share: torch.Tensor, lost: torch.Tensor,
                     groups: list[tuple[int, int, int]], sizes: list[int]) -> torch.Tensor:
        """:meth:`block_average`'s rule with its copies in C (``shaky_take_blocks``, where the install built it):
        the averages from the same batched matrix products, then each worker's row written in one pass, block
        by block, from the averages or, where one was lost, from its own values. The same bits as the torch path
        (the rest is copies) without its nonzero, gather and scatter per group of blocks."""
        w, dim = x.shape
        avg = x.new_empty(dim)                               # every server's average of its block, side by side
        start = 0
        for first, last, size in groups:
            if size == 0:
                continue
            stop = start + (last - first) * size
            blocks = x[:, start:stop].view(w, last - first, size)
            # (not bmm's out=: written at an offset, its sums came out 1 ulp apart here and there)
            avg[start:stop] = torch.bmm(share[first:last], blocks.transpose(0, 1)).view(-1)
            start = stop
        lost = lost.contiguous()                             # bool: a byte each, [worker, server]
        block_bytes = _block_bytes(tuple(sizes), x.element_size())
        lib.shaky_take_blocks(out.data_ptr(), x.data_ptr(), avg.data_ptr(), lost.data_ptr(), block_bytes.ctypes.data,
                              w, out.stride(0) * out.element_size(), x.stride(0) * x.element_size())
        return out

    def _segment_average(self, x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor | None,
                         overwrite: bool, segment_bytes: int) -> torch.Tensor:
        """:meth:`block_average` per segment: masks [W, W, S] (servers already applied), block j cut into segments."""
        w, dim = x.shape
        sizes = block_sizes(dim, w)
        seg = segment_length(segment_bytes, x.element_size())
        num_segments = max(1, *segment_counts(dim, w, seg))
        if up.shape != (w, w, num_segments) or down.shape != up.shape:
            raise ValueError(f"segment masks must be [{w}, {w}, {num_segments}] for {w} workers, {dim} values of "
                             f"{x.element_size()} bytes and segment_bytes {segment_bytes} ({seg} values a segment); "
                             f"got up {list(up.shape)}, down {list(down.shape)}")
        big = sizes.count(sizes[0])
        groups = [(0, big, sizes[0]), (big, w, sizes[-1])] if big < w else [(0, w, sizes[0])]
        up_f = up.to(x.dtype) if weights is None else up.to(x.dtype) * weights.to(x.dtype)[:, None, None]
        share = up_f / up_f.sum(0)              # [senders, servers, segments]: each arrival's weight
        lost = ~down.transpose(0, 1)            # [workers, servers, segments]: the average did not come back
        out = x if overwrite and x.is_contiguous() else torch.empty_like(x)
        start = 0
        for first, last, size in groups:
            if size == 0:
                continue
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
            start = stop
        return out
