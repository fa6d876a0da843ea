"""What is exchanged: a local optimizer and an exchange stage composed into a strategy.

Three compositions cover every algorithm in the registry (``shaky.strategies``):

* :class:`AverageGradients`: g_i <- exchange(g)_i, then the local optimizer
  (synchronous SGD and its lossy variant);
* :class:`AverageModels`: every worker takes a local step, then the new models
  go through the exchange (RPS, local SGD, RI-SGD, DiLoCo with an outer step);
* :class:`AverageUpdates`: every worker applies its own update at once and
  accumulates it; the exchange averages the accumulated updates and each worker
  swaps its own for the average when it arrives (DTS).

A strategy's ``step(params, grads, state, comm, rnd)`` never modifies ``params``
or the tensors of ``state``; ``grads`` is the step's to consume (it may
overwrite it and return its storage as the new parameters), which saves a
full-size allocation and a pass over memory every step (docs/performance.md).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, TypeVar

import torch

from shaky.comm.base import Comm
from shaky.network.faults import Round
from shaky.strategies.exchange import Exchange, StepStats
from shaky.strategies.optim import ColumnwiseOptimizer, InPlaceUpdate, LocalOptimizer

S = TypeVar("S")


class Strategy(Protocol[S]):
    """A distributed algorithm as an init/step pair over [w, D] tensors (see the module docstring)."""

    name: str
    opt: LocalOptimizer
    exchange: Exchange

    def init(self, params: torch.Tensor) -> S: ...

    def step(self, params: torch.Tensor, grads: torch.Tensor, state: S, comm: Comm,
             rnd: Round) -> tuple[torch.Tensor, S, StepStats]: ...


class ComposedState(NamedTuple):
    opt: Any
    """The local optimizer's state."""
    exchange: Any
    """The exchange's state (handles in flight, an outer optimizer's anchor)."""


class AverageGradients:
    """x_i <- local optimizer step with the exchanged gradient (every step: the gradient of the others is needed)."""

    def __init__(self, name: str, opt: LocalOptimizer, exchange: Exchange) -> None:
        self.name, self.opt, self.exchange = name, opt, exchange

    def __repr__(self) -> str:
        return f"AverageGradients({self.name!r}, {type(self.opt).__name__}, {self.exchange!r})"

    def init(self, params: torch.Tensor) -> ComposedState:
        return ComposedState(self.opt.init(params), self.exchange.init(params))

    def step(self, params: torch.Tensor, grads: torch.Tensor, state: ComposedState, comm: Comm,
             rnd: Round) -> tuple[torch.Tensor, ComposedState, StepStats]:
        averaged, exchange, stats = self.exchange(grads, comm, rnd, state.exchange)
        params, opt = self.opt.update(params, grads if averaged is None else averaged, state.opt)
        return params, ComposedState(opt, exchange), stats


class AverageModels:
    """v_i = local optimizer step of x_i; then x_i <- exchange(v)_i where the exchange delivers, else v_i."""

    def __init__(self, name: str, opt: LocalOptimizer, exchange: Exchange) -> None:
        self.name, self.opt, self.exchange = name, opt, exchange
        self.columnwise = isinstance(opt, ColumnwiseOptimizer)
        """Whether the local step can run inside the backward pass, column by column (see ``columns``). Found
        once: an isinstance check against a runtime Protocol costs tens of microseconds, every step."""

    def __repr__(self) -> str:
        return f"AverageModels({self.name!r}, {type(self.opt).__name__}, {self.exchange!r})"

    def init(self, params: torch.Tensor) -> ComposedState:
        return ComposedState(self.opt.init(params), self.exchange.init(params))

    def step(self, params: torch.Tensor, grads: torch.Tensor, state: ComposedState, comm: Comm,
             rnd: Round) -> tuple[torch.Tensor, ComposedState, StepStats]:
        # The new local models go into the gradient buffer (the step owns it) and are averaged in place:
        # no full-size tensor is allocated in the step.
        local, opt = self.opt.update(params, grads, state.opt, overwrite_grads=True)
        return self.after_local(local, ComposedState(opt, state.exchange), comm, rnd)

    def columns(self, params: torch.Tensor, state: ComposedState) -> tuple[InPlaceUpdate, ComposedState]:
        """This step's local update, to be applied in place to ``params`` column slice by column slice while the
        backward pass runs (the training loop's fused path); then :meth:`after_local`."""
        apply, opt = self.opt.columns(params, state.opt)  # type: ignore[attr-defined]
        return apply, ComposedState(opt, state.exchange)

    def after_local(self, local: torch.Tensor, state: ComposedState, comm: Comm,
                    rnd: Round) -> tuple[torch.Tensor, ComposedState, StepStats]:
        """The rest of the step once every worker holds its new local model ``local`` (the caller's to give up)."""
        averaged, exchange, stats = self.exchange(local, comm, rnd, state.exchange, overwrite=True)
        if averaged is None:
            averaged = local
        elif not averaged.is_contiguous():  # an exact mean is one row broadcast: the next step writes in place
            averaged = local.copy_(averaged)
        return averaged, ComposedState(state.opt, exchange), stats


class UpdatesState(NamedTuple):
    opt: Any
    """The local optimizer's state."""
    accumulated: torch.Tensor
    """[w, D]: the worker's own updates since the last exchange was launched (U_i of the running period)."""
    exchange: Any
    """The exchange's state (the averages in flight)."""

    WORKER_AXIS = ("accumulated",)
    SYNC_ON_REJOIN = ("accumulated",)


class AverageUpdates:
    """Every step x_i <- x_i + u_i (its own update at once) and U_i += u_i; when the exchange of the U launched at
    step n is due, x_i <- x_i - U_i(n) + avg_j U_j(n) (``correction``), or x_i <- x_i + avg_j U_j(n) with only
    the averages applied (no correction: plain stale SGD)."""

    def __init__(self, name: str, opt: LocalOptimizer, exchange: Exchange, *, correction: bool = True) -> None:
        self.name, self.opt, self.exchange, self.correction = name, opt, exchange, correction

    def __repr__(self) -> str:
        return (f"AverageUpdates({self.name!r}, {type(self.opt).__name__}, {self.exchange!r}, "
                f"correction={self.correction})")

    def init(self, params: torch.Tensor) -> UpdatesState:
        return UpdatesState(self.opt.init(params), torch.zeros_like(params), self.exchange.init(params))

    def step(self, params: torch.Tensor, grads: torch.Tensor, state: UpdatesState, comm: Comm,
             rnd: Round) -> tuple[torch.Tensor, UpdatesState, StepStats]:
        update, opt = self.opt.delta(params, grads, state.opt)
        accumulated = state.accumulated + update
        # Without the correction a worker never applies its own update, only the averages.
        change = update if self.correction else torch.zeros_like(update)
        # Bound now: on a real transport the exchange completes steps later, after ``accumulated`` was reset.
        swap = (lambda averaged, mine=accumulated: averaged - mine) if self.correction else None
        arrived, exchange, stats = self.exchange(accumulated, comm, rnd, state.exchange, fn=swap)
        if arrived is not None:
            change = change + arrived
        if self.exchange.schedule.launches(rnd.step):
            accumulated = torch.zeros_like(accumulated)
        return params + change, UpdatesState(opt, accumulated, exchange), stats
