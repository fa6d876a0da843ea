"""DTS: delayed and temporally sparse updates, Zhu, Lu, Lin and Han, "Distributed Training
Across the World" (2019), in the accumulated-update form of Delayed Gradient Averaging
(Zhu et al., NeurIPS 2021).

Update rule, per worker i, with u the SGD update -lr * g (momentum and weight decay
included, kept per worker) and U_i the sum of worker i's updates over a period:

    every step:       x_i <- x_i + u_i                               (its own fresh update, at once)
    at step n + t - 1, for the average launched at the end of a period at step n:
                      x_i <- x_i - U_i(n) + avg_j U_j(n)              (swap its own update for the average)

With period d = 1 this is the paper's delayed update, w(n) = w(n-1) - lr (g(n-1) - g(n-t) + gbar(n-t)),
for plain SGD; t = 1 is synchronous SGD, and for plain SGD with t = 1 a period d is local SGD
with tau = d. Without the correction a worker applies only the averages, x_i <- x_i + avg_j U_j(n)
at step n + t - 1, which is plain stale SGD (for d = 1: w(n) = w(n-1) - lr gbar(n-t)).

The averages go through RPS's two lossy phases (``lossy_average``), so drops apply: where
a block of the average is lost, the worker keeps its own update for that block.

A worker that rejoins after a failure gets the live workers' average model from the
training loop; here it also takes their average accumulated update and in-flight
corrections, so that it ends up where they do once those land.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch

from shaky.comm.base import Comm
from shaky.network.model import LinkSample
from shaky.strategies.base import SGDState, SGDStrategy, StepStats


class DTSState(NamedTuple):
    """What a DTS worker carries between steps; a checkpoint stores it, so a resume keeps averages in flight."""

    sgd: SGDState
    """The per-worker SGD state (step count, momentum)."""
    accumulated: torch.Tensor
    """[w, D]: the worker's own updates since the last average was launched (U_i of the running period)."""
    in_flight: torch.Tensor
    """[w, S, D]: what each launched, not yet applied average will change (avg - U_i, or avg without
    the correction); launch k sits in slot k mod S, S = ceil((t - 1) / d) slots (none when t = 1)."""
    dead: frozenset[int] = frozenset()
    """The workers (global indices) that were dead in the last step, to spot one that rejoins. Global, the
    same on every rank, and not a tensor or tuple, so the training loop passes it through untouched."""


class DTS(SGDStrategy):
    name = "dts"

    @property
    def delay(self) -> int:
        return self.cfg.delay

    @property
    def period(self) -> int:
        return self.cfg.period

    @property
    def slots(self) -> int:
        """Launches in flight at once: those of the last t - 1 steps, one every d steps."""
        return math.ceil((self.delay - 1) / self.period)

    def init(self, params: torch.Tensor) -> DTSState:
        w, dim = params.shape
        return DTSState(self.sgd.init(params), torch.zeros_like(params),
                        params.new_zeros(w, self.slots, dim))

    def _launch_index(self, step: int) -> int | None:
        """Which launch (0, 1, ...) happens at the end of ``step``, or None if no period ends there."""
        return (step + 1) // self.period - 1 if step >= 0 and (step + 1) % self.period == 0 else None

    def step(self, params: torch.Tensor, grads: torch.Tensor, state: DTSState, comm: Comm,
             links: LinkSample) -> tuple[torch.Tensor, DTSState, StepStats]:
        step = state.sgd.count
        accumulated, in_flight = self._rejoin(state, comm, links)
        update, sgd_state = self.sgd.delta(params, grads, state.sgd)
        accumulated = accumulated + update
        # Without the correction a worker never applies its own update, only the averages.
        change = update if self.cfg.correction else torch.zeros_like(update)

        due = self._launch_index(step - (self.delay - 1))
        if self.delay > 1 and due is not None:
            change = change + in_flight[:, due % self.slots]

        stats = StepStats()
        launch = self._launch_index(step)
        if launch is not None:
            averaged, stats = self.lossy_average(accumulated, comm, links)
            swap = averaged - accumulated if self.cfg.correction else averaged
            if self.delay == 1:
                change = change + swap
            else:
                # Written after the due slot was read: with S * d = t - 1 the two are the same slot.
                in_flight = in_flight.index_copy(1, torch.tensor([launch % self.slots]), swap[:, None])
            accumulated = torch.zeros_like(accumulated)
            stats = dataclasses.replace(stats, delay=self.delay)
        dead = frozenset() if links.live is None else frozenset(torch.nonzero(~links.live)[:, 0].tolist())
        return params + change, DTSState(sgd_state, accumulated, in_flight, dead), stats

    def _rejoin(self, state: DTSState, comm: Comm, links: LinkSample) -> tuple[torch.Tensor, torch.Tensor]:
        """The state's accumulated updates and in-flight corrections, with rejoining workers' rows set to the
        average over the workers alive in the last step (as the training loop sets their model)."""
        # Decided from global masks only, so every rank agrees (comm.mean below is a collective).
        rejoined = sorted(w for w in state.dead if links.live is None or bool(links.live[w]))
        if not rejoined:
            return state.accumulated, state.in_flight
        was_live = torch.ones(comm.num_workers, dtype=torch.bool)
        was_live[sorted(state.dead)] = False
        weights = was_live.to(state.accumulated.dtype)
        rows = torch.isin(comm.rows, torch.tensor(rejoined))
        return (torch.where(rows[:, None], comm.mean(state.accumulated, weights), state.accumulated),
                torch.where(rows[:, None, None], comm.mean(state.in_flight, weights), state.in_flight))
