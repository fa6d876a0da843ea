"""The simulator backend: all W workers' rows live in one [W, D] tensor."""

from __future__ import annotations

import torch

from shaky.comm.base import Done, block_sizes


class SimComm:
    """Comm for W workers held in one process; every exchange is a few tensor ops."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
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
                            overwrite: bool = False) -> Done:
        return Done(self.block_average(x, up, down, weights=weights, servers=servers, overwrite=overwrite))

    def on_step(self, step: int) -> None:
        """Nothing to report: every worker lives in this process."""

    def block_average(self, x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *,
                      weights: torch.Tensor | None = None, servers: torch.Tensor | None = None,
                      overwrite: bool = False) -> torch.Tensor:
        if servers is not None:  # block j travels on the links of the worker that serves it
            up, down = up[:, servers], down[servers, :]
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
