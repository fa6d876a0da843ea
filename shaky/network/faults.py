"""Membership: who is alive in a round, who serves each block, who rejoined, and the averaging weights.

Membership is one explicit value per round (:class:`Membership`), handed to the
strategies beside the round's delivery masks (:class:`Round`). In the simulator
and on the dist backend it comes from the failure schedule: a failed worker
stops computing and sending from its failure step until its rejoin step. RPS-style
block exchanges need a server for every block: block j is served by worker j
while it lives, else by the next live worker in cyclic order (j+1, j+2, ...),
which is what a ring of successors in a real system does. Every rank derives the
same membership from the schedule alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shaky.config import FailureConfig
from shaky.geometry import LinkSample


@dataclass(frozen=True, slots=True)
class Membership:
    """Who takes part in one round, the same value on every rank."""

    live: torch.Tensor
    """bool [W]: workers alive this round. A dead worker neither computes, changes nor sends."""
    servers: torch.Tensor
    """int64 [W]: the worker serving block j (j itself while it lives, else its next live successor)."""
    rejoined: torch.Tensor
    """bool [W]: workers that come back this round (dead in the last round, alive now)."""
    weights: torch.Tensor | None
    """float64 [W]: each worker's weight in an average (its batch size if weighted, 1 otherwise; 0 if dead);
    None when every worker lives and weighs the same (the plain mean)."""
    all_live: bool
    """Every worker lives (``live`` is all True); the common case, checked without touching the tensor."""
    any_rejoined: bool
    """Some worker rejoins this round."""
    restarted: torch.Tensor | None = None
    """bool [W]: the workers of ``rejoined`` that come back as new processes (their memory lost): they take the
    live workers' average of all their strategy state, not only of the fields declared SYNC_ON_REJOIN (None:
    none does)."""
    any_restarted: bool = False
    """Some worker rejoins this round as a new process."""

    @staticmethod
    def everyone(num_workers: int, sample_weights: torch.Tensor | None = None) -> Membership:
        """Every worker alive, block j served by worker j."""
        return Membership(torch.ones(num_workers, dtype=torch.bool), torch.arange(num_workers),
                          torch.zeros(num_workers, dtype=torch.bool), sample_weights, True, False)


@dataclass(frozen=True, slots=True)
class Round:
    """What a strategy knows of the round it runs in: its index, its delivery masks and its membership."""

    step: int
    """The step (round) index, from 0."""
    links: LinkSample
    """Which messages of the round's two phases arrive."""
    members: Membership
    """Who is alive, who serves which block, who rejoined, and the averaging weights."""


def successor_servers(live: torch.Tensor) -> torch.Tensor:
    """int64 [W]: the live worker that serves each block (the block's own worker, or its next live successor)."""
    w = live.shape[0]
    candidates = (torch.arange(w)[:, None] + torch.arange(w)[None, :]) % w   # [block, k] -> j + k
    first_live = live[candidates].to(torch.int8).argmax(dim=1)               # first k with a live worker
    return candidates[torch.arange(w), first_live]


class FailureSchedule:
    """The configured failures as a membership per round."""

    def __init__(self, failures: tuple[FailureConfig, ...], num_workers: int, num_steps: int,
                 sample_weights: torch.Tensor | None = None) -> None:
        self.num_workers = num_workers
        self.sample_weights = sample_weights
        """float64 [W]: each worker's weight in an average (its batch size), or None for equal weights."""
        # One row per failure event, not per step: a run of 1e15 steps costs nothing to describe.
        self._spans = [(f.worker, f.step, f.rejoin if f.rejoin != -1 else None, f.restart) for f in failures]
        self.enabled = bool(failures)
        self._everyone = Membership.everyone(num_workers, sample_weights)

    def observe(self, step: int, live: torch.Tensor) -> None:
        """A membership change seen at run time (a real transport's survivors agreed on it): from ``step`` on,
        exactly the workers in ``live`` (bool [W]) are alive, until the next change. A worker that comes back
        is a new process (``restart``): the one that died is gone with its memory."""
        was = self.live(step)
        for worker in range(self.num_workers):
            if was[worker] and not live[worker]:
                self._spans.append((worker, step, None, False))
            elif live[worker] and not was[worker]:
                self._spans = [(w, a, step, True) if w == worker and b is None and a <= step else (w, a, b, r)
                               for w, a, b, r in self._spans]
        self.enabled = True

    @property
    def failures(self) -> list[dict[str, int | bool]]:
        """The schedule as ``[[failures]]`` tables (``RunConfig.failures``), observed changes included: the
        simulator replays a real run's membership with them."""
        return [{"worker": w, "step": a, "rejoin": -1 if b is None else b, "restart": r}
                for w, a, b, r in self._spans]

    def adopt(self, failures: list[dict[str, int | bool]]) -> None:
        """Takes another schedule's :attr:`failures` in place of this one's (a rank taken back takes the
        survivors')."""
        self._spans = [(int(f["worker"]), int(f["step"]), None if f["rejoin"] == -1 else int(f["rejoin"]),
                        bool(f["restart"])) for f in failures]
        self.enabled = bool(self._spans)

    def live(self, step: int) -> torch.Tensor:
        """bool [W]: who is alive at ``step``."""
        alive = torch.ones(self.num_workers, dtype=torch.bool)
        for worker, start, stop, _ in self._spans:
            if start <= step and (stop is None or step < stop):
                alive[worker] = False
        return alive

    def _restarted(self, step: int) -> torch.Tensor:
        """bool [W]: who comes back at ``step`` as a new process."""
        fresh = torch.zeros(self.num_workers, dtype=torch.bool)
        for worker, _, stop, restart in self._spans:
            if restart and stop == step:
                fresh[worker] = True
        return fresh

    def membership(self, step: int) -> Membership:
        """The membership of ``step``."""
        if not self.enabled:
            return self._everyone
        live = self.live(step)
        rejoined = live & ~self.live(step - 1) if step > 0 else torch.zeros_like(live)
        all_live, any_rejoined = bool(live.all()), bool(rejoined.any())
        restarted = rejoined & self._restarted(step) if any_rejoined else torch.zeros_like(live)
        if all_live and not any_rejoined:
            return self._everyone
        weights = live.to(torch.float64)
        if self.sample_weights is not None:
            weights = weights * self.sample_weights
        elif all_live:
            weights = None
        return Membership(live, successor_servers(live) if not all_live else torch.arange(self.num_workers),
                          rejoined, weights, all_live, any_rejoined, restarted, bool(restarted.any()))
