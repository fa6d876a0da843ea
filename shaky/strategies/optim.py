"""Optimizer stages: the local optimizers every worker runs (SGD, AdamW) and the outer optimizer.

Each is an init/update pair over ``[w, D]`` tensors whose state is a NamedTuple
that declares its worker-axis fields (see ``shaky.strategies.state``).

* ``update(params, grads, state)`` -> the new parameters; ``delta`` -> the change
  it would make (for strategies that exchange the sum of a period's updates).
* :class:`SGD` can also run column by column (:class:`ColumnwiseOptimizer`): the
  training loop's optimizer-in-backward path applies it to each parameter's
  columns as the backward pass produces their gradient. The SGD rule is written
  once (``SGD._rule``); every form runs it, so all forms give identical numbers.
* :class:`OuterSGD` is DiLoCo's outer step (Douillard et al., 2023): SGD with
  Nesterov momentum on the pseudo-gradient, the model at the last average minus
  the average of the local models.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple, Protocol, runtime_checkable

import torch

from shaky.config import OptimConfig

InPlaceUpdate = Callable[[slice, torch.Tensor], None]


class SGDState(NamedTuple):
    count: int
    """Updates applied so far; drives the learning-rate schedule."""
    momentum: torch.Tensor | None
    """Per-worker heavy-ball buffer [w, D]; None when momentum is 0."""

    WORKER_AXIS = ("momentum",)


class AdamWState(NamedTuple):
    count: int
    """Updates applied so far; drives the learning-rate schedule and the bias correction."""
    exp_avg: torch.Tensor
    """Per-worker first moment [w, D]."""
    exp_avg_sq: torch.Tensor
    """Per-worker second moment [w, D]."""

    WORKER_AXIS = ("exp_avg", "exp_avg_sq")


def _lr(cfg: OptimConfig, count: int) -> float:
    """The learning rate of update number ``count``: linear warm-up, then step decay."""
    lr = cfg.lr * min(1.0, (count + 1) / cfg.warmup_steps) if cfg.warmup_steps else cfg.lr
    return lr * cfg.decay_factor ** sum(count >= s for s in cfg.decay_steps)


class LocalOptimizer(Protocol):
    cfg: OptimConfig

    def lr(self, count: int) -> float: ...

    def init(self, params: torch.Tensor) -> NamedTuple: ...

    def update(self, params: torch.Tensor, grads: torch.Tensor, state: NamedTuple, *,
               overwrite_grads: bool = False) -> tuple[torch.Tensor, NamedTuple]: ...

    def delta(self, params: torch.Tensor, grads: torch.Tensor,
              state: NamedTuple) -> tuple[torch.Tensor, NamedTuple]: ...


@runtime_checkable
class ColumnwiseOptimizer(Protocol):
    """A local optimizer that can update a parameter's columns alone, in place (the fused backward path)."""

    def columns(self, params: torch.Tensor, state: NamedTuple) -> tuple[InPlaceUpdate, NamedTuple]: ...


class SGD:
    """SGD with optional momentum and weight decay (torch.optim.SGD's rule), warm-up and step decay."""

    def __init__(self, cfg: OptimConfig) -> None:
        self.cfg = cfg

    def lr(self, count: int) -> float:
        return _lr(self.cfg, count)

    def init(self, params: torch.Tensor) -> SGDState:
        return SGDState(0, torch.zeros_like(params) if self.cfg.momentum else None)

    def _rule(self, lr: float, params: torch.Tensor, grads: torch.Tensor, momentum: torch.Tensor | None,
              new_momentum: torch.Tensor | None, out: torch.Tensor | None, *, in_place: bool,
              delta: bool = False) -> torch.Tensor:
        """The one SGD rule: direction d = g + wd * p, then the heavy-ball buffer m' = d + mu * m (written into
        ``new_momentum``) and d = m'; returns p - lr * d (or -lr * d with ``delta``), written into ``out``.

        ``in_place``: ``grads`` may be overwritten (the column path, which owns it).
        """
        c = self.cfg
        d = grads
        if c.weight_decay:
            d = grads.add_(params, alpha=c.weight_decay) if in_place else grads.add(params, alpha=c.weight_decay)
        if momentum is not None:
            # torch.optim.SGD seeds the buffer with the first gradient; d + m * 0 is the same.
            # One fused pass over [w, D] (torch.optim's mul_ then add_ takes two).
            d = torch.add(d, momentum, alpha=c.momentum, out=new_momentum)
        if delta:
            return torch.mul(d, -lr, out=out) if out is not None else torch.mul(d, -lr)
        return torch.add(params, d, alpha=-lr, out=out) if out is not None else torch.add(params, d, alpha=-lr)

    def update(self, params: torch.Tensor, grads: torch.Tensor, state: SGDState, *,
               overwrite_grads: bool = False) -> tuple[torch.Tensor, SGDState]:
        """``params - lr * direction`` and the new state; ``params`` and the state's tensors are left alone.

        With ``overwrite_grads`` the result is written into ``grads``'s storage (when it
        has ``params``'s shape, dtype and a dense layout) instead of a new tensor.
        """
        buf = None if state.momentum is None else torch.empty_like(state.momentum)
        out = grads if overwrite_grads and _same_dense_layout(grads, params) else None
        new = self._rule(self.lr(state.count), params, grads, state.momentum, buf, out, in_place=False)
        return new, SGDState(state.count + 1, buf)

    def delta(self, params: torch.Tensor, grads: torch.Tensor, state: SGDState) -> tuple[torch.Tensor, SGDState]:
        """The change ``update`` would make to ``params`` (-lr * direction)."""
        buf = None if state.momentum is None else torch.empty_like(state.momentum)
        change = self._rule(self.lr(state.count), params, grads, state.momentum, buf, None, in_place=False,
                            delta=True)
        return change, SGDState(state.count + 1, buf)

    def columns(self, params: torch.Tensor, state: SGDState) -> tuple[InPlaceUpdate, SGDState]:
        """``update`` applied in place, one column slice at a time: ``apply(columns, grad)`` sets
        ``params[:, columns]`` (and the momentum buffer's columns) to what ``update`` gives for them, by the same
        rule, so the numbers are identical. ``grad`` is consumed. The caller owns ``params`` and the state's
        tensors, and calls ``apply`` once for every column.
        """
        buf, lr = state.momentum, self.lr(state.count)

        def apply(columns: slice, grad: torch.Tensor) -> None:
            p = params[:, columns]
            b = None if buf is None else buf[:, columns]
            self._rule(lr, p, grad, b, b, p, in_place=True)

        return apply, SGDState(state.count + 1, buf)


class AdamW:
    """AdamW (torch.optim.AdamW's rule: decoupled weight decay, bias-corrected moments), warm-up and step decay."""

    def __init__(self, cfg: OptimConfig) -> None:
        self.cfg = cfg

    def lr(self, count: int) -> float:
        return _lr(self.cfg, count)

    def init(self, params: torch.Tensor) -> AdamWState:
        return AdamWState(0, torch.zeros_like(params), torch.zeros_like(params))

    def update(self, params: torch.Tensor, grads: torch.Tensor, state: AdamWState, *,
               overwrite_grads: bool = False) -> tuple[torch.Tensor, AdamWState]:
        c, lr, t = self.cfg, self.lr(state.count), state.count + 1
        exp_avg = torch.lerp(state.exp_avg, grads, 1 - c.beta1)
        exp_avg_sq = state.exp_avg_sq.mul(c.beta2).addcmul_(grads, grads, value=1 - c.beta2)
        denom = (exp_avg_sq.sqrt() / math.sqrt(1 - c.beta2 ** t)).add_(c.eps)
        new = params.mul(1 - lr * c.weight_decay) if c.weight_decay else params.clone()
        new.addcdiv_(exp_avg, denom, value=-lr / (1 - c.beta1 ** t))
        return new, AdamWState(t, exp_avg, exp_avg_sq)

    def delta(self, params: torch.Tensor, grads: torch.Tensor,
              state: AdamWState) -> tuple[torch.Tensor, AdamWState]:
        new, state = self.update(params, grads, state)
        return new.sub_(params), state


LOCAL_OPTIMIZERS: dict[str, Callable[[OptimConfig], LocalOptimizer]] = {"sgd": SGD, "adamw": AdamW}


class OuterState(NamedTuple):
    anchor: torch.Tensor
    """[w, D]: each worker's model at the last outer step (where its local steps started)."""
    momentum: torch.Tensor | None
    """[w, D]: the outer heavy-ball buffer; None without momentum."""

    WORKER_AXIS = ("anchor", "momentum")
    SYNC_ON_REJOIN = ("anchor", "momentum")  # a rejoining worker starts from the live workers' last outer step


class OuterSGD:
    """DiLoCo's outer optimizer: SGD, optionally with (Nesterov) momentum, on the pseudo-gradient.

    With the pseudo-gradient g = anchor - average, ``m' = g + mu * m`` and the step
    s = g + mu * m' (Nesterov) or m'; the new model is anchor - lr * s, computed as
    average + (g - lr * s), the same in exact arithmetic, so that lr = 1 without
    momentum gives the average itself bit for bit (plain model averaging).
    """

    def __init__(self, lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True) -> None:
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < math.inf:
            raise ValueError(f"outer lr must be a positive number, got {lr!r}")
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
            raise ValueError(f"outer momentum must be in [0, 1), got {momentum!r}")
        if nesterov and not momentum:
            nesterov = False  # Nesterov without momentum is plain SGD
        self.lr, self.momentum, self.nesterov = float(lr), float(momentum), bool(nesterov)

    def __repr__(self) -> str:
        return f"OuterSGD(lr={self.lr}, momentum={self.momentum}, nesterov={self.nesterov})"

    def init(self, params: torch.Tensor) -> OuterState:
        # A copy: the training loop updates its parameters in place, the anchor must stay.
        return OuterState(params.clone(), torch.zeros_like(params) if self.momentum else None)

    def update(self, averaged: torch.Tensor, state: OuterState) -> tuple[torch.Tensor, OuterState]:
        """The new models from the averaged local models; the returned tensor is the caller's (the anchor is kept
        apart)."""
        pseudo_grad = state.anchor - averaged
        buf = state.momentum
        step = pseudo_grad
        if buf is not None:
            buf = torch.add(pseudo_grad, buf, alpha=self.momentum)
            step = torch.add(pseudo_grad, buf, alpha=self.momentum) if self.nesterov else buf
        # pseudo_grad is this call's own tensor; without momentum ``step`` is pseudo_grad itself (g - lr * g).
        new = averaged + pseudo_grad.sub_(step, alpha=self.lr)
        return new, OuterState(new.clone(), buf)


def _same_dense_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` can take ``b``'s values in place: same shape and dtype, contiguous, not a broadcast view."""
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and a.is_contiguous() \
        and not a.requires_grad
