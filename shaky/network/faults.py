"""Worker failures on a schedule: who is alive in a round, and who serves a dead server's block.

A failed worker stops computing and sending from its failure step until its
rejoin step. RPS-style block exchanges need a server for every block: block j
is served by worker j while it lives, else by the next live worker in cyclic
order (j+1, j+2, ...), which is what a ring of successors in a real system
does. Every rank derives the same assignment from the schedule alone.
"""

from __future__ import annotations

import dataclasses

import torch

from shaky.config import FailureConfig
from shaky.network.model import LinkSample


class FailureSchedule:
    """Applies the configured failures to each round's link sample."""

    def __init__(self, failures: tuple[FailureConfig, ...], num_workers: int, num_steps: int) -> None:
        self.num_workers = num_workers
        alive = torch.ones(num_steps + 1, num_workers, dtype=torch.bool)
        for f in failures:
            stop = f.rejoin if f.rejoin != -1 else num_steps + 1
            alive[f.step:stop, f.worker] = False
        self._alive = alive
        self.enabled = bool(failures)

    def live(self, step: int) -> torch.Tensor:
        """bool [W]: who is alive at ``step``."""
        return self._alive[min(step, len(self._alive) - 1)]

    def rejoined(self, step: int) -> torch.Tensor:
        """bool [W]: workers that come back at ``step`` (dead at step - 1, alive now)."""
        if step == 0:
            return torch.zeros(self.num_workers, dtype=torch.bool)
        return self.live(step) & ~self.live(step - 1)

    def servers(self, live: torch.Tensor) -> torch.Tensor:
        """int64 [W]: the live worker that serves each block (the block's own worker, or its successor)."""
        w = self.num_workers
        candidates = (torch.arange(w)[:, None] + torch.arange(w)[None, :]) % w   # [block, k] -> j + k
        first_live = live[candidates].to(torch.int8).argmax(dim=1)               # first k with a live worker
        return candidates[torch.arange(w), first_live]

    def apply(self, links: LinkSample) -> LinkSample:
        """The round's sample with ``live`` and ``servers`` filled in (unchanged without failures)."""
        if not self.enabled:
            return links
        live = self.live(links.round)
        if bool(live.all()):
            return links
        return dataclasses.replace(links, live=live, servers=self.servers(live))
