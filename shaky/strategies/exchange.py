"""Exchange stages: how ``[w, D]`` tensors are averaged across workers, and when.

An exchange is started and later completed. ``start`` launches it through the
Comm and returns a handle (``shaky.comm.base.Handle``) with the traffic it puts
on the network; ``__call__`` also applies the exchange's schedule and waits for
the result that is due this step (None when nothing is due). The two ways to
average, both weighted by the round's membership (a dead worker weighs 0):

* :class:`ReliableMean`: the exact mean, a ring all-reduce over a transport that
  resends what it loses (loss costs time on the clock, never accuracy);
* :class:`LossyBlockAverage`: RPS's two-phase block average (Yu et al., ICML
  2019) over the lossy network, a dead server's block served by its successor.

Wrappers compose them: ``every(period, e)`` launches every period-th step;
``delayed(t, e)`` applies what was launched at step n at the end of step
n + t - 1, keeping the handles in flight in its state (a real transport's
exchange runs meanwhile); ``outer(opt, e)`` passes the averaged models through
an outer optimizer (DiLoCo). A schedule is read from one :class:`Schedule`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from shaky.comm import quant
from shaky.comm.base import Comm, Done, Handle
from shaky.comm.quant import ValueFormat
from shaky.geometry import LinkSample, block_sizes, segment_values
from shaky.network.clock import PhaseTraffic
from shaky.network.faults import Membership, Round
from shaky.strategies.optim import OuterSGD, OuterState
from shaky.schedule import Schedule

Then = Callable[[torch.Tensor], torch.Tensor] | None
"""A function applied to an exchange's result when it completes (None: the result as it is)."""


@dataclass(frozen=True, slots=True)
class StepStats:
    """The exchange a step launched, phase by phase, for the counters and the clock."""

    phases: tuple[PhaseTraffic, ...] = ()
    """The exchange's rounds of messages, in order (empty: the step sends nothing)."""
    delay: int = 1
    """The exchange is needed at the end of step n + delay - 1 (1: at the end of this step, synchronous)."""

    @property
    def bytes_sent(self) -> int:
        return sum(p.bytes_sent for p in self.phases)

    @property
    def messages_sent(self) -> int:
        """Messages put on the wire: segments when the round's masks are segment-level."""
        return sum(p.messages for p in self.phases)

    @property
    def messages_dropped(self) -> int:
        return sum(p.dropped for p in self.phases)


def observed(stats: StepStats, drawn: LinkSample, seen: LinkSample) -> StepStats:
    """``stats`` of a step whose exchange ran on a transport that observed its masks (udp) rather than
    drawing them: each phase that read the drawn masks reads what arrived instead, so the counters and the
    clock count the real losses."""
    swap = {id(drawn.up): seen.up, id(drawn.down): seen.down}
    return dataclasses.replace(stats, phases=tuple(
        dataclasses.replace(p, delivered=swap.get(id(p.delivered), p.delivered)) for p in stats.phases))


class _Then(NamedTuple):
    """A started exchange whose result goes through ``fn`` when it completes."""

    handle: Handle
    fn: Callable[[torch.Tensor], torch.Tensor]

    def wait(self) -> torch.Tensor:
        return self.fn(self.handle.wait())


def then(handle: Handle, fn: Then) -> Handle:
    """``handle`` with ``fn`` applied to its result (at once if the result is already here)."""
    if fn is None:
        return handle
    if isinstance(handle, Done):
        return Done(fn(handle.value))
    return _Then(handle, fn)


class Exchange(Protocol):
    """An exchange stage: ``init`` its state, ``start`` it, or run it for a step (``__call__``)."""

    schedule: Schedule

    def init(self, x: torch.Tensor) -> Any: ...

    def start(self, x: torch.Tensor, comm: Comm, rnd: Round, state: Any, *, overwrite: bool = False,
              fn: Then = None) -> tuple[Handle, Any, StepStats]: ...

    def __call__(self, x: torch.Tensor, comm: Comm, rnd: Round, state: Any, *, overwrite: bool = False,
                 fn: Then = None) -> tuple[torch.Tensor | None, Any, StepStats]: ...


class _Immediate:
    """An exchange that is launched every step and waited for in the same step."""

    schedule = Schedule()

    def init(self, x: torch.Tensor) -> tuple[()]:
        return ()

    def start(self, x: torch.Tensor, comm: Comm, rnd: Round, state: Any, *, overwrite: bool = False,
              fn: Then = None) -> tuple[Handle, Any, StepStats]:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor, comm: Comm, rnd: Round, state: Any, *, overwrite: bool = False,
                 fn: Then = None) -> tuple[torch.Tensor | None, Any, StepStats]:
        handle, state, stats = self.start(x, comm, rnd, state, overwrite=overwrite, fn=fn)
        return handle.wait(), state, stats


class MeanReference(NamedTuple):
    """A quantized exact mean's reference (:func:`shaky.comm.quant.quantized_mean`)."""

    ref: torch.Tensor
    """[w, D]: the exchange's last result, alike on every live worker."""
    held: torch.Tensor
    """[w, 1], the rows' dtype: 1 where the worker holds ``ref`` (it took the last result), else 0."""
    carry: torch.Tensor
    """[w, D]: what the worker's rounding left out last time, sent with the next difference."""

    WORKER_AXIS = ("ref", "held", "carry")


class ReliableMean(_Immediate):
    """The exact (weighted) mean over live workers: a ring all-reduce over a transport that resends.

    ``fmt``: the values travel in that format (``strategy.value_dtype``), as differences from the last result
    (:func:`shaky.comm.quant.quantized_mean`); None: as the rows hold them."""

    def __init__(self, fmt: ValueFormat | None = None) -> None:
        self.fmt = fmt

    def __repr__(self) -> str:
        return "reliable_mean()" if self.fmt is None else f"reliable_mean({self.fmt.name!r})"

    def init(self, x: torch.Tensor) -> Any:
        if self.fmt is None:
            return ()
        return MeanReference(torch.zeros_like(x), x.new_zeros(x.shape[0], 1), torch.zeros_like(x))

    def start(self, x: torch.Tensor, comm: Comm, rnd: Round, state: Any, *, overwrite: bool = False,
              fn: Then = None) -> tuple[Handle, Any, StepStats]:
        if self.fmt is None:
            handle = comm.start_mean(x, rnd.members.weights)
            return then(handle, fn), state, StepStats(ring_allreduce_traffic(x, comm.num_workers, rnd.links,
                                                                             rnd.members))
        result, ref, held, carry, rounded = quant.quantized_mean(comm, x, rnd.members, *state, self.fmt,
                                                                 rnd.links.segment_bytes)
        stats = StepStats(ring_allreduce_traffic(x, comm.num_workers, rnd.links, rnd.members, fmt=self.fmt,
                                                 rounded=rounded))
        return then(Done(result), fn), MeanReference(ref, held, carry), stats


class BlockStreams(NamedTuple):
    """A quantized block average's streams (:func:`shaky.comm.quant.quantized_block_average`)."""

    ref: torch.Tensor
    """[w, D]: each worker's reference, the last value of each segment it took from the segment's server."""
    sync: torch.Tensor
    """[w, W, S], the rows' dtype: 1 + the server whose stream value of that segment of the block the worker
    holds (0: none)."""
    carry: torch.Tensor
    """[w, D]: what the worker's rounding left out of each value it last sent (as a sender or as the value's
    server), sent with the next difference."""

    WORKER_AXIS = ("ref", "sync", "carry")


class LossyBlockAverage(_Immediate):
    """RPS's two-phase block average over the lossy network, with failed servers' blocks moved on.

    ``overwrite``: ``x`` is the caller's to give up; the average may be computed in its storage. ``fmt``: the
    values travel in that format (``strategy.value_dtype``), as differences from each segment's stream
    (:func:`shaky.comm.quant.quantized_block_average`); None: as the rows hold them.
    """

    def __init__(self, fmt: ValueFormat | None = None) -> None:
        self.fmt = fmt

    def __repr__(self) -> str:
        return "lossy_block_average()" if self.fmt is None else f"lossy_block_average({self.fmt.name!r})"

    def init(self, x: torch.Tensor) -> Any:
        if self.fmt is None:
            return ()
        # (the segments' count is known at the first round: until then no worker is in sync)
        return BlockStreams(torch.zeros_like(x), x.new_zeros(x.shape[0], 1, 1), torch.zeros_like(x))

    def start(self, x: torch.Tensor, comm: Comm, rnd: Round, state: Any, *, overwrite: bool = False,
              fn: Then = None) -> tuple[Handle, Any, StepStats]:
        m, links = rnd.members, rnd.links
        if self.fmt is not None:
            average = getattr(comm, "server_averages", None)
            if average is not None:        # the simulator: every row at once
                out, ref, sync, carry, up_q, down_q = quant.quantized_block_average(average, x, links, m, *state,
                                                                                    self.fmt)
            elif hasattr(comm, "quantized_block_average"):      # udp: this rank's row, by the same rule
                out, ref, sync, carry, up_q, down_q = comm.quantized_block_average(x, links, m, *state, self.fmt)
            else:
                raise ValueError(f"strategy.value_dtype = {self.fmt.name!r} needs backend sim or dist.transport udp: "
                                 f"this transport ({type(comm).__name__}) sends values as the model holds them")
            stats = StepStats(block_exchange_traffic(x, comm.num_workers, links, m, reliable=False, fmt=self.fmt,
                                                     rounded=(up_q, down_q)))
            return then(Done(out), fn), BlockStreams(ref, sync, carry), stats
        # Segment masks need their segments' size; block masks keep the call as it always was.
        segments = {"segment_bytes": links.segment_bytes} if links.segment_bytes else {}
        handle = comm.start_block_average(x, links.up, links.down, weights=m.weights,
                                          servers=None if m.all_live else m.servers, overwrite=overwrite, **segments)
        stats = StepStats(block_exchange_traffic(x, comm.num_workers, rnd.links, m, reliable=False))
        return then(handle, fn), state, stats


def reliable_mean(fmt: ValueFormat | None = None) -> ReliableMean:
    return ReliableMean(fmt)


def lossy_block_average(fmt: ValueFormat | None = None) -> LossyBlockAverage:
    return LossyBlockAverage(fmt)


class Every:
    """``inner`` launched at the end of every ``period``-th step only (local SGD's tau, DTS's d)."""

    def __init__(self, period: int, inner: Exchange) -> None:
        self.inner = inner
        self.schedule = dataclasses.replace(inner.schedule, period=period)

    def __repr__(self) -> str:
        return f"every({self.schedule.period}, {self.inner!r})"

    def init(self, x: torch.Tensor) -> Any:
        return self.inner.init(x)

    def start(self, x: torch.Tensor, comm: Comm, rnd: Round, state: Any, *, overwrite: bool = False,
              fn: Then = None) -> tuple[Handle, Any, StepStats]:
        return self.inner.start(x, comm, rnd, state, overwrite=overwrite, fn=fn)

    def __call__(self, x: torch.Tensor, comm: Comm, rnd: Round, state: Any, *, overwrite: bool = False,
                 fn: Then = None) -> tuple[torch.Tensor | None, Any, StepStats]:
        if not self.schedule.launches(rnd.step):
            return None, state, StepStats()
        return self.inner(x, comm, rnd, state, overwrite=overwrite, fn=fn)


class DelayedState(NamedTuple):
    inner: Any
    """The wrapped exchange's state."""
    slots: tuple[Handle, ...]
    """The exchanges in flight: launch k sits in slot k mod S, S = ceil((t - 1) / d) (none when t = 1).
    A checkpoint stores their results; a rejoining worker takes the live workers' average of them."""

    WORKER_AXIS = ("slots",)
    SYNC_ON_REJOIN = ("slots",)


class Delayed:
    """``inner``'s exchange launched at the end of step n is applied at the end of step n + t - 1 (DTS's delay).

    Meanwhile its handle waits in the state, so on a real transport the exchange
    runs in the background while the next t - 1 steps compute.
    """

    def __init__(self, delay: int, inner: Exchange) -> None:
        self.inner = inner
        self.schedule = dataclasses.replace(inner.schedule, delay=delay)

    def __repr__(self) -> str:
        return f"delayed({self.schedule.delay}, {self.inner!r})"

    def init(self, x: torch.Tensor) -> DelayedState:
        return DelayedState(self.inner.init(x), tuple(Done(torch.zeros_like(x)) for _ in range(self.schedule.slots)))

    def start(self, x: torch.Tensor, comm: Comm, rnd: Round, state: Any, *, overwrite: bool = False,
              fn: Then = None) -> tuple[Handle, Any, StepStats]:
        raise TypeError("delayed(...) cannot be started inside another delay; compose one delayed(t) with t summed")

    def __call__(self, x: torch.Tensor, comm: Comm, rnd: Round, state: DelayedState, *, overwrite: bool = False,
                 fn: Then = None) -> tuple[torch.Tensor | None, DelayedState, StepStats]:
        schedule = self.schedule
        if schedule.delay == 1:
            result, inner, stats = self.inner(x, comm, rnd, state.inner, overwrite=overwrite, fn=fn)
            return result, DelayedState(inner, state.slots), stats
        due = schedule.due_index(rnd.step)
        if not schedule.launches(rnd.step):
            return (None if due is None else state.slots[due % schedule.slots].wait()), state, StepStats()
        # Launched before the due one is waited for (a real exchange then leaves while the worker waits, as
        # the clock has it); the due handle is read first: with S * d = t - 1 the two share a slot.
        # Not in x's storage: the result must outlive this step.
        waiting = None if due is None else state.slots[due % schedule.slots]
        handle, inner, stats = self.inner.start(x, comm, rnd, state.inner, overwrite=False, fn=fn)
        launch = schedule.launch_index(rnd.step)
        slots = list(state.slots)
        slots[launch % schedule.slots] = handle
        result = None if waiting is None else waiting.wait()
        return result, DelayedState(inner, tuple(slots)), dataclasses.replace(stats, delay=schedule.delay)


class OuterOptState(NamedTuple):
    inner: Any
    """The wrapped exchange's state."""
    outer: OuterState
    """The outer optimizer's state (its anchor and momentum)."""


class Outer:
    """The averaged models go through an outer optimizer (DiLoCo): what ``inner`` returns is the average of the
    local models; the result is the outer optimizer's new model from it."""

    def __init__(self, opt: OuterSGD, inner: Exchange) -> None:
        self.opt = opt
        self.inner = inner
        self.schedule = inner.schedule

    def __repr__(self) -> str:
        return f"outer({self.opt!r}, {self.inner!r})"

    def init(self, x: torch.Tensor) -> OuterOptState:
        return OuterOptState(self.inner.init(x), self.opt.init(x))

    def start(self, x: torch.Tensor, comm: Comm, rnd: Round, state: Any, *, overwrite: bool = False,
              fn: Then = None) -> tuple[Handle, Any, StepStats]:
        raise TypeError("an outer optimizer steps where its exchange completes: put delayed(...) inside outer(...)")

    def __call__(self, x: torch.Tensor, comm: Comm, rnd: Round, state: OuterOptState, *, overwrite: bool = False,
                 fn: Then = None) -> tuple[torch.Tensor | None, OuterOptState, StepStats]:
        averaged, inner, stats = self.inner(x, comm, rnd, state.inner, overwrite=overwrite)
        if averaged is None:
            return None, OuterOptState(inner, state.outer), stats
        new, outer = self.opt.update(averaged, state.outer)
        return (new if fn is None else fn(new)), OuterOptState(inner, outer), stats


def every(period: int, inner: Exchange) -> Every:
    return Every(period, inner)


def delayed(delay: int, inner: Exchange) -> Delayed:
    return Delayed(delay, inner)


def outer(opt: OuterSGD, inner: Exchange) -> Outer:
    return Outer(opt, inner)


# --------------------------------------------------------------------------------------------------------------
# The traffic of an exchange, for the clock and the counters


def _message_bytes(sizes: list[int], seg_len: int, itemsize: int, fmt: ValueFormat | None) -> np.ndarray:
    """float [block] (or [block, segment] with ``seg_len`` > 0): the bytes of each message of blocks of ``sizes``
    values, at ``itemsize`` bytes each, or rounded in ``fmt``: a rounded message holds :func:`quant.parts`
    segments (its bytes at its first; 0, no message, at the others) and its scale."""
    if not seg_len:
        values = np.asarray(sizes, dtype=np.float64)
        return fmt.bytes_of(values).astype(np.float64) if fmt is not None else values * itemsize
    values = segment_values(sizes, seg_len)
    if fmt is None:
        return values * itemsize
    packed = quant.rounded_values(values, quant.parts(fmt, itemsize))
    group = quant.scale_group(seg_len, fmt, itemsize)
    return fmt.bytes_of(packed, group).astype(np.float64)


@lru_cache(maxsize=64)
def _block_link_bytes(dim: int, num_workers: int, itemsize: int, servers: tuple[int, ...] | None,
                      live: tuple[bool, ...] | None, seg_len: int = 0, fmt: ValueFormat | None = None
                      ) -> tuple[np.ndarray, np.ndarray, tuple[tuple[np.ndarray, np.ndarray], ...] | None]:
    """Bytes of each message in the two phases, up's [worker i, block j] and down's [block j, worker i]: [W, W],
    or [W, W, S] per segment with ``seg_len`` > 0; and the links they travel on where servers moved (up's
    and down's ``PhaseTraffic.route``; None: block j's server is j, and a message's index is its link).
    ``fmt``: the values in that format (with their scales), not ``itemsize`` bytes each."""
    sizes = _message_bytes(block_sizes(dim, num_workers), seg_len, itemsize, fmt)   # [block(, segment)]
    routes = None
    if servers is None and live is None:
        off_diagonal = ~np.eye(num_workers, dtype=bool)
        if seg_len:
            off_diagonal = off_diagonal[..., None]
        up = np.where(off_diagonal, sizes[None, :], 0.0)    # worker i -> server j carries block j
        down = np.where(off_diagonal, sizes[:, None], 0.0)  # server j -> worker i carries block j
    else:
        srv = np.asarray(servers if servers is not None else range(num_workers))
        alive = np.asarray(live if live is not None else [True] * num_workers)
        # [worker i, block j]: i sends block j to its server (and gets it back) if i lives and is not the server.
        # Each block is a message of its own: a server of two blocks gets two messages on one link.
        carries = alive[:, None] & (np.arange(num_workers)[:, None] != srv[None, :])
        if seg_len:
            carries = carries[..., None]
        up = np.where(carries, sizes[None], 0.0)
        down = np.swapaxes(up, 0, 1).copy()
        workers = np.broadcast_to(np.arange(num_workers)[:, None], (num_workers, num_workers))
        to_server = np.broadcast_to(srv[None, :], (num_workers, num_workers))
        routes = ((workers, to_server), (to_server.T, workers.T))
    up.flags.writeable = down.flags.writeable = False
    return up, down, routes


def block_exchange_traffic(params: torch.Tensor, num_workers: int, links: LinkSample,
                           members: Membership | None = None, *, reliable: bool, fmt: ValueFormat | None = None,
                           rounded: tuple[torch.Tensor, torch.Tensor] | None = None
                           ) -> tuple[PhaseTraffic, PhaseTraffic]:
    """The two phases of a block exchange of a [.., D] tensor among ``num_workers``.

    A reliable all-reduce (reduce-scatter then all-gather) moves the same blocks as
    RPS's two phases: (W-1)/W of the vector out of and into each worker per phase.
    With segment masks ([W, W, S], ``links.segment_bytes`` > 0) the traffic is per segment:
    each segment is a message, and its bytes are the values it really holds. Each block is a message of its
    own (the masks are per block): with a dead worker's block moved, its successor's links carry two.

    ``fmt`` and ``rounded``: the values travel in ``fmt`` (in the same segments, of fewer bytes) where
    ``rounded`` (up's and down's masks, bool like ``links``'s) says so, at the rows' own precision elsewhere
    (:func:`shaky.comm.quant.quantized_block_average`).
    """
    some_dead = members is not None and not members.all_live
    servers = tuple(members.servers.tolist()) if some_dead else None
    live = tuple(members.live.tolist()) if some_dead else None
    dim, itemsize = params.shape[-1], params.element_size()
    seg_len = quant.fine_length(links.segment_bytes, itemsize, fmt)
    up, down, routes = _block_link_bytes(dim, num_workers, itemsize, servers, live, seg_len)
    if fmt is not None:
        up_q, down_q, _ = _block_link_bytes(dim, num_workers, itemsize, servers, live, seg_len, fmt)
        up = np.where(rounded[0].numpy(), up_q, up)      # a group sent rounded: one message, at its first part
        down = np.where(rounded[1].numpy(), down_q, down)
    up_route, down_route = routes if routes is not None else (None, None)
    return (PhaseTraffic(up, links.up, reliable, up_route), PhaseTraffic(down, links.down, reliable, down_route))


@lru_cache(maxsize=64)
def _ring_link_bytes(dim: int, num_workers: int, itemsize: int,
                     order: tuple[int, ...], seg_len: int = 0, fmt: ValueFormat | None = None
                     ) -> tuple[np.ndarray, ...]:
    """Bytes on each link in each of the 2(n-1) hops of a ring all-reduce over the workers ``order``:
    [W, W] each, or [W, W, S] per segment of the chunks with ``seg_len`` > 0 (``fmt``: values in that format)."""
    n = len(order)
    sizes = _message_bytes(block_sizes(dim, n), seg_len, itemsize, fmt)   # [chunk(, segment)]
    hops = []
    # Reduce-scatter hop s: the k-th worker of the ring passes its partial sum of chunk k - s on;
    # all-gather hop s: it passes the finished chunk k + 1 - s on.
    for first_chunk in (0, 1):
        for s in range(n - 1):
            link = np.zeros((num_workers, num_workers) + sizes.shape[1:])
            for k in range(n):
                link[order[k], order[(k + 1) % n]] = sizes[(k + first_chunk - s) % n]
            link.flags.writeable = False
            hops.append(link)
    return tuple(hops)


def ring_allreduce_traffic(x: torch.Tensor, num_workers: int, links: LinkSample,
                           members: Membership | None = None, *, fmt: ValueFormat | None = None,
                           rounded: bool = True) -> tuple[PhaseTraffic, ...]:
    """The 2(n-1) hops of a reliable ring all-reduce (reduce-scatter, then all-gather) of a [.., D] tensor.

    The ring runs over the n live workers in index order; in every hop each sends one
    chunk of about D/n values to the next, so a hop lasts as long as the ring's slowest
    link. Messages, bytes and losses match the block exchange (2n(n-1) messages of a
    chunk each). Whether a hop's message arrived is read from the round's masks: hop s
    of the reduce-scatter takes sender i's draw in ``up`` towards the (s+1)-th live
    worker after it, the all-gather the same in ``down``, so every draw is used once
    (with a per-link drop matrix, a ring message is lost at the rate of one of its
    sender's links in turn; see docs/clock.md). With segment masks each chunk is cut
    into segments like a block, and its segment k takes that draw's segment k mod S
    (a chunk has more segments than a block only when workers are dead). ``fmt``: the values travel in that
    format (``strategy.value_dtype``; in the same segments, of fewer bytes), or, with ``rounded``
    False, in that format's segments at the rows' own precision (a quantized mean's first round).
    """
    order = tuple(range(num_workers)) if members is None or members.all_live else \
        tuple(torch.nonzero(members.live)[:, 0].tolist())
    n = len(order)
    if n < 2:
        return ()
    seg_len = quant.fine_length(links.segment_bytes, x.element_size(), fmt)
    hops = _ring_link_bytes(x.shape[-1], num_workers, x.element_size(), order, seg_len, fmt if rounded else None)
    ring = torch.tensor(order)
    senders, receivers = ring, ring.roll(-1)
    pick = torch.arange(hops[0].shape[2]) % links.up.shape[2] if seg_len else None
    phases = []
    for h, link in enumerate(hops):
        mask = links.up if h < n - 1 else links.down
        s = h % (n - 1)
        delivered = torch.ones(link.shape, dtype=torch.bool)
        drawn = mask[senders, ring.roll(-(s + 1))]
        delivered[senders, receivers] = drawn if pick is None else drawn[:, pick]
        phases.append(PhaseTraffic(link, delivered, True))
    return tuple(phases)
