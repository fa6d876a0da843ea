"""Walking a strategy's state by what its fields declare, never by tensor shapes.

A stage's state is a NamedTuple. ``WORKER_AXIS`` names its fields whose tensors
carry the leading worker axis ([w, ...]: one row per local worker); checkpoints
gather those fields, a resume slices them, and a dead worker's rows of them are
kept unchanged. ``SYNC_ON_REJOIN`` names the fields that a rejoining worker takes
from the live workers' average (as it takes their average model). Fields that
are themselves stage states are walked by their own declarations; anything else
(a step count, a number) passes through untouched. An exchange still in flight
in a declared field (a handle other than ``Done``) is waited for and walked as
its result: a checkpoint stores what the exchange delivers, never the exchange.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shaky.comm.base import Done

WORKER_AXIS = "WORKER_AXIS"
SYNC_ON_REJOIN = "SYNC_ON_REJOIN"


def _is_state(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def _all(value: Any, fn: Callable[..., Any], others: tuple[Any, ...]) -> Any:
    """``fn`` over every tensor of a declared field (a tensor, None, a tuple of them, a nested state)."""
    value, others = _settled(value), tuple(_settled(o) for o in others)
    if isinstance(value, torch.Tensor):
        return fn(value, *others)
    if _is_state(value):
        return _walk(value, fn, others, WORKER_AXIS)
    if isinstance(value, tuple):
        return tuple(_all(v, fn, tuple(o[k] for o in others)) for k, v in enumerate(value))
    return value


def _settled(value: Any) -> Any:
    """A handle still in flight as its result (a ``Done``); anything else as it is."""
    return value if isinstance(value, Done) or not callable(getattr(value, "wait", None)) else Done(value.wait())


def _walk(state: Any, fn: Callable[..., Any], others: tuple[Any, ...], attr: str) -> Any:
    if not _is_state(state):
        return state
    declared = getattr(type(state), attr, ())
    fields = []
    for k, (name, value) in enumerate(zip(state._fields, state)):
        parts = tuple(o[k] for o in others)
        if name in declared:
            fields.append(_all(value, fn, parts))
        elif _is_state(value):
            fields.append(_walk(value, fn, parts, attr))
        else:
            fields.append(value)
    return type(state)(*fields)


def map_rows(state: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``state`` with ``fn`` applied to every tensor that carries the worker axis."""
    return _walk(state, fn, (), WORKER_AXIS)


def zip_rows(new: Any, old: Any, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Any:
    """``new`` with ``fn(new_tensor, old_tensor)`` in place of every worker-axis tensor (same structure)."""
    return _walk(new, fn, (old,), WORKER_AXIS)


def map_synced(state: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``state`` with ``fn`` applied to the tensors a rejoining worker takes from the live workers."""
    return _walk(state, fn, (), SYNC_ON_REJOIN)


def map_rejoined(state: Any, synced: Callable[[torch.Tensor], torch.Tensor],
                 rest: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``state`` with ``synced`` applied to the tensors a rejoining worker takes from the live workers, and
    ``rest`` to every other tensor that carries the worker axis (what a worker restarted as a new process, its
    memory lost, takes from them as well)."""
    if not _is_state(state):
        return state
    axis, sync = getattr(type(state), WORKER_AXIS, ()), getattr(type(state), SYNC_ON_REJOIN, ())
    fields = []
    for name, value in zip(state._fields, state):
        if name in sync:
            fields.append(_all(value, synced, ()))
        elif name in axis:
            fields.append(_all(value, rest, ()))
        else:
            fields.append(map_rejoined(value, synced, rest))
    return type(state)(*fields)
