"""The simulated wall clock: compute time, the time each exchange takes on the network, and overlap.

Latency and bandwidth never slow the simulator down; they only move this clock.
The formulas are in docs/clock.md. In short:

* A *phase* is one round of messages that cross the network at once (one
  all-to-all phase of RPS's block exchange, or one hop of a ring all-reduce).
  Every worker has one network port: it sends its messages of a phase one after
  another and receives them one after another (sending and receiving overlap).
  A phase lasts until the busiest port has moved its bytes, each message at its
  link's bandwidth, plus the longest latency among that port's links.
* A reliable transport that lost a message in a phase waits a retransmission
  timeout (``retransmit_timeout_ms`` plus the lost link's round trip) and resends
  the lost messages; an unreliable one never waits: what was lost is lost.
* With segments (``network.segment_bytes``), a link's message is its segments
  back to back; a lost segment is resent alone (reliable) or just lost.
* An *exchange* is a step's phases, one after another. Exchanges share the
  ports, so their bytes go one exchange at a time, in launch order (FIFO); their
  latencies overlap: an exchange launched while another is in flight starts when
  the ports have sent the earlier one's bytes, not when it has arrived.
* An exchange launched at step n with delay t is needed at the end of step
  n + t - 1: it overlaps the compute of the next t - 1 steps, and the workers
  wait only for what has not arrived by then. t = 1 is a synchronous exchange.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from shaky.network.model import NetworkModel
from shaky.schedule import Schedule


class _Fixed(NamedTuple):
    """What a phase's ``link_bytes`` alone decide."""

    sent: np.ndarray
    messages: int
    total_bytes: np.float64


class _PerArray:
    """``fn(array)``, computed once for each read-only array that owns its data, kept while it lives here.

    A run's traffic arrays are made once and cached (``shaky.strategies.exchange``'s ``_block_link_bytes`` and
    ``_ring_link_bytes``, read-only): what depends on them alone need not be recomputed every step (the clock
    and the counters took 0.2 ms of a 2 ms step for the MLP at W = 16). Any other array is computed afresh.
    """

    def __init__(self, fn: Callable[[np.ndarray], Any], size: int = 256) -> None:
        self.fn, self.size = fn, size
        self._memo: dict[int, tuple[np.ndarray, Any]] = {}

    def __call__(self, array: np.ndarray) -> Any:
        if array.flags.writeable or not array.flags.owndata:
            return self.fn(array)
        hit = self._memo.get(id(array))
        if hit is not None and hit[0] is array:
            return hit[1]
        if len(self._memo) >= self.size:
            self._memo.clear()
        value = self.fn(array)
        self._memo[id(array)] = (array, value)
        return value


def _fixed(link_bytes: np.ndarray) -> _Fixed:
    sent = link_bytes > 0
    sent.flags.writeable = False
    return _Fixed(sent, int(sent.sum()), link_bytes.sum())


_FIXED = _PerArray(_fixed)


@dataclass(frozen=True, slots=True)
class PhaseTraffic:
    """One phase of an exchange: every message that crossed the network at once."""

    link_bytes: np.ndarray
    """float [W, W]: bytes of message [a, b] in this phase, sent on link a -> b (0 where nothing is sent); with
    segments [W, W, S]: the bytes of its segment k (each segment with bytes is a message)."""
    delivered: torch.Tensor
    """bool, the shape of ``link_bytes``: whether the message (segment) arrived."""
    reliable: bool
    """True if a lost message is detected and resent (TCP-like), False if it is just lost."""
    route: tuple[np.ndarray, np.ndarray] | None = None
    """(sender, receiver), int [W, W] each: the link that message [a, b] travels on, where it is not a -> b
    (a block exchange with a dead worker's block moved: message [i, j] is worker i's block j, on the link
    to the block's server, which carries another block too); None: link a -> b."""

    def __post_init__(self) -> None:
        if self.link_bytes.shape != tuple(self.delivered.shape):
            raise ValueError(f"PhaseTraffic: link_bytes {list(self.link_bytes.shape)} and delivered "
                             f"{list(self.delivered.shape)} must have the same shape")

    @property
    def sent(self) -> np.ndarray:
        return _FIXED(self.link_bytes).sent

    @property
    def lost(self) -> np.ndarray:
        return self.sent & ~self.delivered.numpy()

    @property
    def messages(self) -> int:
        return _FIXED(self.link_bytes).messages

    @property
    def dropped(self) -> int:
        return int(np.count_nonzero(self.lost))

    @property
    def bytes_sent(self) -> int:
        """Bytes put on the wire; a lost message counts, and a resent one counts again."""
        total = _FIXED(self.link_bytes).total_bytes
        if self.reliable:
            total += self.link_bytes[self.lost].sum()
        return int(total)


class ClockState(NamedTuple):
    """Everything the clock carries from one step to the next; a checkpoint stores it."""

    step: int = 0
    """Steps simulated so far."""
    now_s: float = 0.0
    """Simulated seconds at the end of the last step."""
    network_free_s: float = 0.0
    """When the ports have sent the bytes of every exchange launched so far (their bytes go one exchange at a
    time; their latencies overlap)."""
    pending: tuple[tuple[int, float], ...] = ()
    """Exchanges in flight: (the step at whose end it is needed, its arrival time in seconds)."""


class Clock:
    """Accumulates simulated seconds from compute time and each step's exchanges."""

    def __init__(self, network: NetworkModel, compute_ms: float, retransmit_timeout_ms: float, *,
                 exchange_compute_ms: float = 0.0, control_round_s: float = 0.0) -> None:
        self.latency_s = network.latency_ms / 1e3
        self.bytes_per_s = network.bandwidth_mbps * 1e6 / 8
        self.compute_s = compute_ms / 1e3
        self.exchange_compute_s = exchange_compute_ms / 1e3
        """Compute that launching an exchange adds to its step (a software data plane's CPU)."""
        self.rto_s = retransmit_timeout_ms / 1e3
        self.control_round_s = control_round_s
        """What each exchange waits after its messages for the transport's control round (the comm's
        ``control_round_seconds``; 0 where it has none): latency only, the ports stay free for the next
        exchange."""
        self.state = ClockState()
        self.last_wait_s = 0.0
        """Seconds the last step waited, past its compute, for the exchanges due at its end."""
        self._sent_s = _PerArray(self._every_message_s)

    def _every_message_s(self, link_bytes: np.ndarray,
                         route: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[float, float]:
        """(seconds, seconds without the latencies) of one round of every message of ``link_bytes``."""
        sent = _FIXED(link_bytes).sent
        return (self._transfer_s(link_bytes, sent, route=route),
                self._transfer_s(link_bytes, sent, latency=False, route=route))

    def _transfer_s(self, link_bytes: np.ndarray, mask: np.ndarray, *, latency: bool = True,
                    route: tuple[np.ndarray, np.ndarray] | None = None) -> float:
        """One round of the messages in ``mask``: the busiest port's bytes plus its longest latency.

        With segments ([W, W, S]) a link carries the bytes of its segments in ``mask``, back to back. ``route``:
        the link of each message (``PhaseTraffic.route``), where it is not its index.
        """
        if not mask.any():
            return 0.0
        if mask.ndim == 3:
            link_bytes, mask = np.where(mask, link_bytes, 0.0).sum(axis=2), mask.any(axis=2)
        if route is not None:
            return self._routed_s(link_bytes, mask, latency, route)
        tx = np.where(mask, link_bytes / self.bytes_per_s, 0.0)
        lat = np.where(mask, self.latency_s if latency else 0.0, 0.0)
        send = tx.sum(axis=1) + lat.max(axis=1)   # sender i: its messages back to back, the farthest one last
        receive = tx.sum(axis=0) + lat.max(axis=0)
        return float(max(send.max(), receive.max()))

    def _routed_s(self, message_bytes: np.ndarray, mask: np.ndarray, latency: bool,
                  route: tuple[np.ndarray, np.ndarray]) -> float:
        """:meth:`_transfer_s` of messages that travel on the links ``route`` names: each port's messages
        back to back, the farthest one last."""
        snd, rcv = (r.reshape(-1) for r in route)
        tx = np.where(mask, message_bytes / self.bytes_per_s[route], 0.0).reshape(-1)
        lat = np.where(mask, self.latency_s[route] if latency else 0.0, 0.0).reshape(-1)
        w = self.latency_s.shape[0]
        ports = []
        for port in (snd, rcv):
            farthest = np.zeros(w)
            np.maximum.at(farthest, port, lat)
            ports.append(np.bincount(port, tx, minlength=w) + farthest)
        return float(max(ports[0].max(), ports[1].max()))

    def phase_seconds(self, phase: PhaseTraffic) -> float:
        """Seconds until every worker holds what it will get from this phase."""
        route = phase.route
        every = self._sent_s(phase.link_bytes) if route is None else self._every_message_s(phase.link_bytes, route)
        seconds = every[0]
        lost = phase.lost if phase.reliable else None
        if lost is not None and lost.any():
            # TCP's timeout is at least its minimum RTO plus a round trip (Linux: 200 ms + RTT). With segments,
            # one timeout for the phase too, after which only the lost segments are resent.
            lost_links = lost if lost.ndim == 2 else lost.any(axis=2)
            latency = self.latency_s if route is None else self.latency_s[route]
            timeout = self.rto_s + 2.0 * float(latency[lost_links].max())
            seconds += timeout + self._transfer_s(phase.link_bytes, lost, route=route)
        return seconds

    def exchange_seconds(self, phases: tuple[PhaseTraffic, ...]) -> float:
        """One exchange: its phases one after another (each needs what the one before delivered)."""
        return sum((self.phase_seconds(p) for p in phases), 0.0)

    def busy_seconds(self, phases: tuple[PhaseTraffic, ...]) -> float:
        """The part of :meth:`exchange_seconds` during which the exchange occupies the workers' ports: its bytes
        (and, on a reliable transport, the resent ones), without the latencies and timeouts it waits through."""
        total = 0.0
        for phase in phases:
            route = phase.route
            total += (self._sent_s(phase.link_bytes) if route is None
                      else self._every_message_s(phase.link_bytes, route))[1]
            lost = phase.lost if phase.reliable else None
            if lost is not None and lost.any():
                total += self._transfer_s(phase.link_bytes, lost, latency=False, route=route)
        return total

    def advance(self, phases: tuple[PhaseTraffic, ...], delay: int = 1) -> float:
        """Simulates one step that launches the exchange ``phases`` (none if empty); returns the time after it."""
        if not phases:
            return self.tick(None, delay)
        return self.tick(self.exchange_seconds(phases) + self.control_round_s, delay,
                         busy_s=self.busy_seconds(phases))

    def tick(self, exchange_s: float | None, delay: int = 1, *, busy_s: float | None = None) -> float:
        """One step: compute, launch an exchange lasting ``exchange_s`` (None: none), wait for what is due.

        The exchange is needed at the end of step ``step + delay - 1``. It starts when
        the compute ends or when the network has finished sending the exchanges before it,
        whichever is later, and arrives ``exchange_s`` later. Of that, only ``busy_s`` (its
        bytes on the ports; None: all of it) keeps the network from the next exchange: the
        latencies of exchanges in flight overlap (pipeline), their bytes do not. The step
        ends when its compute is done and every exchange due at this step has arrived.
        Returns the simulated seconds at the end of the step.
        """
        if delay < 1:
            raise ValueError(f"delay must be >= 1, got {delay}")
        s = self.state
        compute_end = s.now_s + self.compute_s + (self.exchange_compute_s if exchange_s is not None else 0.0)
        network_free, pending = s.network_free_s, s.pending
        if exchange_s is not None:
            start = max(compute_end, network_free)
            network_free = start + (exchange_s if busy_s is None else min(busy_s, exchange_s))
            pending = pending + ((s.step + delay - 1, start + exchange_s),)
        end = max([compute_end] + [arrival for due, arrival in pending if due <= s.step])
        self.state = ClockState(s.step + 1, end, network_free, tuple(p for p in pending if p[0] > s.step))
        self.last_wait_s = end - compute_end
        return end


def mail_round_seconds(latency_ms: np.ndarray | float) -> float:
    """Seconds of a control round whose records go straight from every rank to every other (the udp transport's
    rounds by mail, ``shaky.membership.mail``): every rank sends its record at once, and the round ends when the
    last one arrives, the slowest link's one-way latency (ms, a number or [W, W])."""
    lat = np.asarray(latency_ms, dtype=np.float64) / 1e3
    if lat.ndim == 0:
        return float(lat)
    off = lat[~np.eye(len(lat), dtype=bool)]
    return float(off.max()) if off.size else 0.0


def scalability(clock: Clock, exchange_s: float | None, *, period: int = 1, delay: int = 1,
                steps: int = 0) -> float:
    """Throughput of W workers over W times that of one worker without communication, in simulated time.

    Every worker computes one mini-batch per step, so the ratio is the compute time of
    ``steps`` steps over the simulated time they take: an exchange of ``exchange_s``
    seconds is launched every ``period`` steps and needed ``delay`` steps later. The
    clock starts afresh; ``steps`` = 0 picks enough steps (at least 100 exchanges) for
    the start-up, when nothing is due yet, to weigh under 1%.
    """
    schedule = Schedule(period=period, delay=delay)
    if clock.compute_s <= 0:
        raise ValueError(f"scalability needs a positive compute time, got {clock.compute_s * 1e3:g} ms")
    steps = steps or max(2000, 100 * period, 100 * delay)
    clock.state = ClockState()
    end = 0.0
    for step in range(steps):
        launch = exchange_s is not None and schedule.launches(step)
        end = clock.tick(exchange_s if launch else None, schedule.delay)
    return steps * clock.compute_s / end


def hiding_period(exchange_s: float, compute_ms: float) -> int:
    """The smallest period (and delay) whose compute hides one exchange: ceil(exchange / compute) + 1.

    With period d = delay t = this value, an exchange launched at the end of a period
    has the next t - 1 steps of compute to arrive in, and the network has finished it
    before the next one is launched, so no worker ever waits (docs/clock.md).
    """
    if compute_ms <= 0:
        raise ValueError(f"compute_ms must be > 0, got {compute_ms}")
    return max(1, math.ceil(exchange_s / (compute_ms / 1e3) - 1e-9) + 1)
