"""The udp transport's two control planes: what an exchange's masks, the means, the gathers and the barriers
travel on (the block averages themselves are datagrams: :mod:`shaky.comm.udp.comm`).

- :class:`GlooControl`: gloo's collectives. A dead rank stops every rank, as on the gloo transport.
- :class:`QuorumControl` (live membership, ``dist.heartbeat_timeout_s``): rounds of sealed records in a store
  rank 0 hosts (:class:`shaky.membership.quorum.Quorum`). A rank whose heartbeat went silent is left out and the
  survivors go on; a process started again for it is taken back at a step's start. It is the
  :class:`shaky.membership.Agreement` that :class:`shaky.membership.Agreed` asks each step.

The comm picks neither: whoever builds it (:func:`shaky.comm.udp.comm.udp_comm`) gives it one.
"""

from __future__ import annotations

import collections
import io
import struct
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch
import torch.distributed as dist

from shaky.comm.base import Handle, MeanHandle
from shaky.comm.gloo import DistComm, _InFlight, world_timeout
from shaky.membership.heartbeat import HEARTBEAT_S, Heartbeat
from shaky.membership.mail import RoundMail
from shaky.network.clock import mail_round_seconds
from shaky.membership.quorum import (ControlStore, ForgedRecord, NotTakenBack, Quorum,
                                     RoundResult)

if TYPE_CHECKING:
    from shaky.comm.udp.comm import UdpDistComm


class ControlPlane(Protocol):
    """What a :class:`~shaky.comm.udp.comm.UdpDistComm` sends on its control plane."""

    def round_seconds(self, latency_ms: Any) -> float:
        """Seconds of the round that every exchange waits for after its datagrams, under the network's one-way
        latencies (the simulated clock adds it): 0 on gloo (not modelled), a round by mail with a quorum."""
        ...
    agreement: Any
    """What the survivors agree on (:class:`shaky.membership.Agreement`), or None where a dead rank stops the run."""

    def start(self, joining: bool, fingerprint: str) -> None:
        """The comm is built: every rank waits for the others (or a rank started again asks to be taken back)."""
        ...

    def exchanged(self, future: Future, lane: int, step: int, row: torch.Tensor,
                  servers: torch.Tensor | None) -> Handle:
        """The handle of an exchange running in ``future`` (on lane ``lane``): its ``wait()`` gathers every
        rank's masks and completes it (:meth:`UdpDistComm.finish`)."""
        ...

    def all_gather(self, x: torch.Tensor, *, fill: float | Callable[[int], torch.Tensor] | None
                   ) -> list[torch.Tensor]:
        """Every rank's ``x``, in rank order (a dead rank's is ``fill``: a value, a function of the rank, or None,
        the mean of the others')."""
        ...

    def mean(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor: ...

    def start_mean(self, x: torch.Tensor, weights: torch.Tensor | None = None, *,
                   deferred: bool = False) -> MeanHandle: ...

    def gather(self, x: torch.Tensor) -> torch.Tensor: ...

    def barrier(self) -> None: ...

    def stats(self, before: dict[str, Any] | None) -> dict[str, Any]:
        """What this control plane adds to the transport's statistics."""
        ...

    def close(self, close_data: Callable[[], None]) -> None:
        """Stops, calling ``close_data`` (the comm's lanes and sockets) where it must come in the order."""
        ...


class GlooControl:
    """The control plane on gloo's collectives (the rendezvous's process group)."""

    agreement = None

    def round_seconds(self, latency_ms: Any) -> float:
        return 0.0

    def __init__(self, comm: UdpDistComm) -> None:
        self._comm = comm
        self._gloo = DistComm()

    def start(self, joining: bool, fingerprint: str) -> None:
        dist.barrier()

    def exchanged(self, future: Future, lane: int, step: int, row: torch.Tensor,
                  servers: torch.Tensor | None) -> Handle:
        return _InFlight(future, lambda done: self._complete(done, step, row, servers))

    def _complete(self, future: Future, step: int, row: torch.Tensor, servers: torch.Tensor | None) -> torch.Tensor:
        """Waits for the exchange, then gathers every rank's masks and deadline proposal (a collective)."""
        comm = self._comm
        t0 = time.perf_counter()
        result = future.result()
        comm.wait_s += time.perf_counter() - t0
        parts = self.all_gather(comm.mask_record(result, servers), fill=None)
        return comm.finish(result, parts, (), step, row, servers)

    def all_gather(self, x: torch.Tensor, *, fill: float | Callable[[int], torch.Tensor] | None
                   ) -> list[torch.Tensor]:
        parts = [torch.empty_like(x) for _ in range(self._comm.num_workers)]
        dist.all_gather(parts, x.contiguous())
        return parts

    def mean(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        return self._gloo.mean(x, weights)

    def start_mean(self, x: torch.Tensor, weights: torch.Tensor | None = None, *,
                   deferred: bool = False) -> MeanHandle:
        return self._gloo.start_mean(x, weights, deferred=deferred)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return self._gloo.gather(x)

    def barrier(self) -> None:
        dist.barrier()

    def stats(self, before: dict[str, Any] | None) -> dict[str, Any]:
        return {}

    def close(self, close_data: Callable[[], None]) -> None:
        close_data()
        self._gloo.close()


class _Carried:
    """A mean that travels in the next control round, in the records that round exchanges anyway (the masks of
    an exchange), or in a round of its own if ``wait()`` comes first (:meth:`QuorumControl.start_mean` with
    ``deferred``)."""

    def __init__(self, control: QuorumControl, x: torch.Tensor, weights: torch.Tensor | None) -> None:
        self._control, self.x, self.weights = control, x.contiguous(), weights
        self.payload = self.x.numpy().tobytes()
        self.value: torch.Tensor | None = None
        self.round: _ControlRound | None = None
        """The round that carries it, once one was submitted."""

    @property
    def settled(self) -> bool:
        """Carried by a control round (the same round on every rank)."""
        return self.value is not None

    @property
    def carried(self) -> bool:
        """A round was submitted with it (taken in where the training loop waits for that round's exchange)."""
        return self.round is not None

    def wait(self) -> torch.Tensor:
        if self.value is None and self.round is not None:
            self._control._take(self.round)
        elif self.value is None:
            self._control._carry_pending()
        if self.value is None:  # the round that carries it resolves it
            raise RuntimeError("a deferred mean was not carried by the control round")
        return self.value


class _ControlRound:
    """A control round (:meth:`QuorumControl._submit`): numbered, and its record's contents fixed, in the training
    loop's order (the same on every rank); run at once, or in a control thread (an exchange's, once the
    exchange is done) while the loop computes; taken in (:meth:`QuorumControl._take`) in order."""

    def __init__(self, seq: int, carried: list[_Carried]) -> None:
        self.seq, self.carried = seq, carried
        self.tail = sum(len(mean.payload) for mean in carried)
        self.future: Future = Future()
        self.taken: _Taken | None = None


class _Taken(NamedTuple):
    parts: dict[int, bytes]
    """Each live rank's own part of its record (without the deferred means)."""
    live: tuple[int, ...]
    """The live ranks after the round."""
    extra: Any
    """What the round's submitter had it carry back (an exchange's result)."""


class QuorumControl:
    """The control plane of live membership: every exchange's masks, the means, gathers and barriers go round in
    :class:`~shaky.membership.quorum.Quorum` rounds in a store rank 0 hosts (on the first free TCP port of
    ``dist.ports`` at its ``dist.host``), and the survivors agree there on who is in.

    An exchange's masks go round in its lane's control thread as soon as the exchange is done (the round of a
    delayed exchange is hidden by the steps of its delay too), and the rounds are taken in, in the order they were
    submitted, where the training loop waits for them. ``heartbeat`` (not started: this starts it in the control
    store, watching the others') tells the quorum who went silent; a rank silent for ``timeout_s`` is left out.
    """

    def __init__(self, comm: UdpDistComm, heartbeat: Heartbeat, timeout_s: float, *, key: bytes, run_id: int,
                 host: str, ports: range, lanes: int, latency_s: list[float] | None, joining: bool) -> None:
        if not 0 < timeout_s < float("inf"):
            raise ValueError(f"heartbeat_timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self._comm = comm
        me, w = comm.rank, comm.num_workers
        self._store = ControlStore(comm.store, f"{comm.prefix}/control", me, host, ports,
                                   (world_timeout() if not joining else comm.store.timeout).total_seconds(), joining)
        self._threads = [ThreadPoolExecutor(1, thread_name_prefix=f"shaky-udp-control{k}") for k in range(lanes)]
        """A thread for each lane that runs its exchanges' control rounds once they are done, so that a delayed
        exchange's round (two round trips to rank 0's store) is hidden by the steps too."""
        # The heartbeat in a client of its own: the quorum's blocks in its waits.
        self.heartbeat = heartbeat.start(dist.TCPStore(*self._store.address, is_master=False,
                                                       timeout=timedelta(seconds=self._store.timeout_s)),
                                         watching=True)
        self._quorum = Quorum(heartbeat.silent_s, me, w, f"{comm.prefix}/q", timeout_s, self._store.timeout_s,
                              self._store.address, key, run_id,
                              latency_s=latency_s[0] if latency_s and me != 0 else 0.0, paused_s=heartbeat.paused_s)
        # The rounds' records by mail too (shaky.membership.mail): a round that hears every live rank costs no
        # TCP round trip. Its address goes where the data plane's are (the rendezvous store).
        try:
            self._mail = RoundMail(me, w, key, run_id.to_bytes(8, "big"), host, ports, latency_s,
                                   lossy=lambda: any(ex.lossy for ex in comm.exchanges))
        except OSError as exc:
            raise ValueError(f"rank {me} cannot open its control plane's UDP socket: {exc} (see dist.ports and "
                             "dist.host)") from None
        comm.store.set(self._mail_key(me), f"{self._mail.address[0]} {self._mail.address[1]}")
        # Read back on the same connection (the store serves it in order): the address is in before this rank
        # asks to be taken back, in another store, so that the survivors never learn a dead process's instead.
        comm.store.get(self._mail_key(me))
        self._quorum.mail = self._mail
        heartbeat.looks.append(self._quorum.look_for_joins)
        # Progress marks too: a request a step to the rendezvous store, which torchrun's agent may host, would
        # wait out TCP's 200 ms after each lost answer (ControlStore).
        heartbeat.marks = self._quorum.store
        self.agreement = self
        for done in [pool.submit(self._quorum.connect) for pool in self._threads]:
            done.result()       # every thread that runs rounds, connected before the first
        self._step = 0
        self._changes: list[tuple[int, torch.Tensor]] = []
        self._pending: list[_Carried] = []
        """Deferred means waiting for the next control round (:meth:`start_mean`)."""
        self._rounds: collections.deque[_ControlRound] = collections.deque()
        """The control rounds submitted and not yet taken in, in order."""
        self._admitting = False
        """The next round submitted may take in ranks started again (set at each step's start: every rank's
        first round of a step is the same round)."""
        self._admitted: tuple[int, ...] = ()
        """Ranks started again that a round taken in agreed to take back: they join at the next step's start."""
        self.membership_log: list[dict[str, object]] = []
        """Each membership change: the step from which it holds, the live ranks, the ranks taken back, and how
        long the control round that agreed on it took (most of it waiting for the dead rank's heartbeat to go
        stale)."""
        self.join_wait_s = 0.0
        """A rank started again: seconds from its request to be taken back to the survivors' welcome."""
        self._asked_at = 0.0

    def start(self, joining: bool, fingerprint: str) -> None:
        if not joining:
            dist.barrier()
            self._learn_mail()
            return
        self._quorum.store.set(self._quorum.join_key(self._comm.rank), fingerprint)
        self._asked_at = time.monotonic()

    def round_seconds(self, latency_ms: Any) -> float:
        """A round by mail: every rank's record straight to every other (one that goes to the store, when a
        rank is missing, waits for the heartbeat timeout anyway)."""
        return mail_round_seconds(latency_ms)

    def close(self, close_data: Callable[[], None]) -> None:
        self.heartbeat.close()
        close_data()
        for pool in self._threads:
            pool.shutdown(wait=True, cancel_futures=True)
        self._quorum.leave(self._store.hosted)
        self._mail.close()
        self._store.close()

    def _mail_key(self, rank: int) -> str:
        return f"{self._comm.prefix}/mail/{rank}"

    def _learn_mail(self) -> None:
        """Every rank's mail address, from the rendezvous store (at the start, and when ranks are taken back)."""
        peers = {}
        for r in range(self._comm.num_workers):
            host, port = self._comm.store.get(self._mail_key(r)).decode().split(" ")
            peers[r] = (host, int(port))
        self._mail.set_peers(peers)

    # ------------------------------------------------------------------ the agreement (shaky.membership.Agreed)

    def on_step(self, step: int, *, admit: bool = True) -> None:
        """A step starts: its progress is marked, and its first control round may take ranks back (unless
        ``admit`` is False: a loop that cannot hand its state over, :class:`shaky.membership.Agreed`)."""
        self.heartbeat.mark(step)
        self._step = step
        self._admitting = admit

    def take_admitted(self) -> tuple[int, ...]:
        """The ranks started again that the survivors agreed to take back (in a round of the last step, the
        same on every rank): :meth:`welcome` them now, at the step's start."""
        joiners, self._admitted = self._admitted, ()
        return joiners

    def welcome(self, joiners: Sequence[int], snapshot: dict[str, Any]) -> None:
        """Takes ``joiners`` back from this step (every live rank calls it, at the same step, with nothing in
        flight): the lowest live rank hands each the run's state, ``snapshot`` (the training loop's) with the
        control plane's own (the next round's number, the live ranks, the next exchange's number and deadline);
        every rank learns their new addresses, and the change is recorded (:meth:`take_membership`)."""
        q, t0 = self._quorum, time.perf_counter()
        self._drain()
        live = tuple(sorted({*q.live, *joiners}))
        self._admitted = tuple(r for r in self._admitted if r not in live)
        entry: dict[str, object] = {"step": self._step, "live": list(live), "rejoined": list(joiners),
                                    "round_s": 0.0}
        if self._comm.rank == q.live[0]:
            buffer = io.BytesIO()
            torch.save({"train": snapshot, "comm": {
                "seq": q.seq, "live": live, **self._comm.handover_state(),
                "membership_log": [*self.membership_log, entry]}}, buffer)
            q.publish_live(live)
            for r in joiners:
                q.store.set(q.welcome_key(r), q.seal(q.welcome_key(r), buffer.getvalue()))
                q.store.delete_key(q.join_key(r))
        q.resume_at(q.seq, live)
        entry["round_s"] = round(time.perf_counter() - t0, 3)     # what handing the state over cost this rank
        self._comm.reconnect()
        self._learn_mail()
        now, seen = time.monotonic(), self.heartbeat.seen
        for r in joiners:   # its request to join is its latest sign of life: silent from now on, if at all
            seen[r] = (seen.get(r, (None, now))[0], now)
        self._changed(live, entry)

    def await_welcome(self, timeout_s: float, *, ended_key: str) -> dict[str, Any]:
        """A rank started again: waits until the survivors take it back and returns the training loop's part of
        what they handed over (:meth:`welcome`). Raises NotTakenBack when the run ends first (``ended_key`` in
        the rendezvous store: ``shaky.job.rendezvous``), its store goes, or ``timeout_s`` passes."""
        q, me = self._quorum, self._comm.rank
        deadline = time.monotonic() + timeout_s
        try:
            while not q.store.check([q.welcome_key(me)]):
                if self._comm.store.check([ended_key]):
                    raise NotTakenBack(f"the run ended before rank {me} was taken back")
                if time.monotonic() > deadline:
                    raise NotTakenBack(f"rank {me} was not taken back within {timeout_s:g} s (dist.timeout_s): "
                                       f"the survivors take a rank back at a step's start once its old process "
                                       f"is seen dead")
                time.sleep(0.02)
            data = q.opened(q.welcome_key(me), q.store.get(q.welcome_key(me)))
            q.store.delete_key(q.welcome_key(me))
            self.join_wait_s = time.monotonic() - self._asked_at
        except (NotTakenBack, ForgedRecord):
            raise
        except RuntimeError:     # the store went away with its host
            raise NotTakenBack(f"rank {me} was not taken back: the run's control store is gone") from None
        handed = torch.load(io.BytesIO(data), weights_only=False)
        control = handed["comm"]
        q.resume_at(control["seq"], control["live"])
        self._step = handed["train"]["counters"]["step"]
        self._comm.take_over(control, self._step)
        self.membership_log = control["membership_log"][:-1]
        self._comm.reconnect()
        self._learn_mail()
        self._changed(control["live"], control["membership_log"][-1])
        return handed["train"]

    def _changed(self, live: Sequence[int], entry: dict[str, object]) -> None:
        """A membership change at ``entry["step"]``: recorded for :meth:`take_membership` and the summary."""
        mask = torch.zeros(self._comm.num_workers, dtype=torch.bool)
        mask[list(live)] = True
        self._changes.append((int(entry["step"]), mask))     # type: ignore[call-overload]
        self.membership_log.append(entry)

    def take_membership(self) -> list[tuple[int, torch.Tensor]]:
        """Membership changes the survivors agreed on since the last call: (the step from which it holds, bool
        [W] live)."""
        done, self._changes = self._changes, []
        return done

    # ------------------------------------------------------------------ an exchange's masks

    def exchanged(self, future: Future, lane: int, step: int, row: torch.Tensor,
                  servers: torch.Tensor | None) -> Handle:
        # The masks' round runs in the lane's control thread as soon as the exchange is done: a delayed
        # exchange's wait then finds it taken care of too.
        rnd = self._submit(lambda: self._exchanged(future, servers), thread=lane)
        return _InFlight(rnd, lambda done: self._completed_round(done, step, row, servers))

    def _exchanged(self, future: Future, servers: torch.Tensor | None) -> tuple[bytes, Any]:
        """In a control thread: the exchange's result, and this rank's part of its masks' round."""
        result = future.result()
        return self._comm.mask_record(result, servers).numpy().tobytes(), result

    def _completed_round(self, rnd: _ControlRound, step: int, row: torch.Tensor,
                         servers: torch.Tensor | None) -> torch.Tensor:
        """The result of the exchange launched at ``step`` from ``row``: waits for it and for its masks' round
        (which ran in a control thread), and takes the round in. A rank found dead in that round left no record
        of what reached it, so the averages it served in this exchange count as lost: every rank keeps its own
        values of those blocks, and the masks say so (the simulator's replay then computes the same)."""
        comm = self._comm
        t0 = time.perf_counter()
        taken = self._take(rnd)
        comm.wait_s += time.perf_counter() - t0
        size = len(taken.parts[comm.rank])
        parts = [torch.frombuffer(bytearray(taken.parts[r]), dtype=torch.uint8) if r in taken.live else
                 _nothing_arrived(size) for r in range(comm.num_workers)]
        gone = tuple(r for r in range(comm.num_workers) if r not in taken.live)
        return comm.finish(taken.extra, parts, gone, step, row, servers)

    # ------------------------------------------------------------------ rounds

    def all_gather(self, x: torch.Tensor, *, fill: float | Callable[[int], torch.Tensor] | None
                   ) -> list[torch.Tensor]:
        """Every rank's ``x`` (the same shape and dtype on every rank), in rank order; the ranks that are dead or
        were just left out give ``fill`` (a value, a function of the rank, or None: the mean of the others'
        values)."""
        w = self._comm.num_workers
        self._drain()   # the rounds in flight come first
        own = x.contiguous().numpy().tobytes()
        taken = self._take(self._submit(lambda: (own, None)))
        got = {r: _from_bytes(taken.parts[r], x) for r in taken.live}
        if len(got) == w:
            return [got[r] for r in range(w)]
        if callable(fill):
            return [got[r] if r in got else fill(r) for r in range(w)]
        stand_in = torch.stack(list(got.values())).mean(dim=0) if fill is None else torch.full_like(x, fill)
        return [got.get(r, stand_in) for r in range(w)]

    def _submit(self, own: Callable[[], tuple[bytes, Any]], thread: int | None = None, *,
                by_store: bool = False) -> _ControlRound:
        """A control round, submitted: numbered, with the deferred means that ride in it (their values follow
        this rank's part of the record, in the order they were started: the same on every rank, which starts
        them at the same points) and whether it may take ranks back, all fixed here, on the training loop's
        thread. ``own()`` gives this rank's part of the record and what the round carries back to the caller;
        it runs, with the round, in control thread ``thread`` (None: here, at once)."""
        q = self._quorum
        carried, self._pending = self._pending, []
        admit, self._admitting = self._admitting, False
        # Each record starts with the first round this rank has not taken in: a round every survivor has taken
        # in is done with, and its keys go (Quorum.sweep).
        head = struct.pack("<q", self._rounds[0].seq if self._rounds else q.seq)
        rnd, live = _ControlRound(q.take_seq(), carried), q.live
        tail = b"".join(mean.payload for mean in carried)
        for mean in carried:
            mean.round = rnd

        def run() -> tuple[RoundResult, Any]:
            mine, extra = own()
            return q.round(rnd.seq, head + mine + tail, live, admit, by_store=by_store), extra

        self._rounds.append(rnd)
        if thread is None:
            try:
                rnd.future.set_result(run())
            except Exception as exc:    # raised where the round is taken in, in order
                rnd.future.set_exception(exc)
        else:
            rnd.future = self._threads[thread].submit(run)
        return rnd

    def _take(self, rnd: _ControlRound) -> _Taken:
        """Round ``rnd``, taken in, with every round submitted before it (waiting for them), in order."""
        while rnd.taken is None:
            self._take_in(self._rounds[0])
        return rnd.taken

    def _drain(self) -> None:
        """Every round submitted, taken in."""
        while self._rounds:
            self._take_in(self._rounds[0])

    def _take_in(self, rnd: _ControlRound) -> None:
        """The oldest round not yet taken in: the ranks live after it are those live before it whose records it
        holds (rounds that ran at once may each have left out a dead rank, or, for a rank that a round before
        left out and that woke up, not), the same on every survivor, who all take rounds in in the same order.
        A membership change holds from the next step."""
        q = self._quorum
        while True:
            try:
                result, extra = rnd.future.result(timeout=HEARTBEAT_S)
                break
            except TimeoutError:    # (a round that ran across a pause of this process)
                q.ask_if_paused(q.client())
        self._rounds.popleft()
        self._mail.taken_below(rnd.seq + 1)
        records = result.records
        size = len(records[self._comm.rank])
        live = tuple(r for r in q.live if r in records)
        for r in live:
            if len(records[r]) != size:
                raise RuntimeError(f"control round: rank {r}'s record has {len(records[r])} bytes where this "
                                   f"rank's has {size} (the ranks' control calls differ)")
        below = min(struct.unpack_from("<q", records[r])[0] for r in live)
        q.sweep(rnd.seq, result.keys, below=below)
        self._mail.done_below(below)
        # Rounds in flight when a rank was taken back may have agreed to take it back too: once is enough.
        if taken_back := [r for r in result.admitted if r not in q.live]:
            self._admitted = tuple(sorted({*self._admitted, *taken_back}))
        if live != q.live:
            q.live = live
            q.publish_live(live)
            self._changed(live, {"step": self._step + 1, "live": list(live), "round_s": round(result.seconds, 3)})
        end = size - rnd.tail
        for mean in rnd.carried:
            stop = end + len(mean.payload)
            mean.value = self._mean_from({r: records[r][end:stop] for r in live}, mean.x, mean.weights)
            end = stop
        rnd.taken = _Taken({r: records[r][8:size - rnd.tail] for r in live}, live, extra)

    # ------------------------------------------------------------------ means, gathers, barriers

    def mean(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        parts = self.all_gather(x, fill=0)
        return _live_mean(parts, self._quorum.live, weights)

    def start_mean(self, x: torch.Tensor, weights: torch.Tensor | None = None, *,
                   deferred: bool = False) -> MeanHandle:
        """A mean is a control round: at once, or with ``deferred`` in the next control round that any call
        makes (the masks of an exchange, say), in the records that round exchanges anyway, so that it costs no
        round of its own; ``wait()`` makes one if none came first. The live ranks are that round's."""
        if not deferred:    # a round of its own, in a control thread: a delayed mean is waited for later
            own, like = x.contiguous().numpy().tobytes(), x.contiguous()
            rnd = self._submit(lambda: (own, None), thread=self._quorum.seq % len(self._threads))
            return _InFlight(rnd, lambda done: self._mean_of(done, like, weights))   # type: ignore[return-value]
        mean = _Carried(self, x, weights)
        self._pending.append(mean)
        return mean

    def _mean_of(self, rnd: _ControlRound, like: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        return self._mean_from(self._take(rnd).parts, like, weights)

    def _mean_from(self, parts: dict[int, bytes], like: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        """The mean of the live ranks' values (``parts``, by rank, as bytes of ``like``'s shape and dtype)."""
        rows = [_from_bytes(parts[r], like) if r in parts else torch.zeros_like(like)
                for r in range(self._comm.num_workers)]
        return _live_mean(rows, sorted(parts), weights)

    def _carry_pending(self) -> None:
        """A control round for the deferred means alone."""
        self.all_gather(torch.empty(0, dtype=torch.uint8), fill=0)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """All workers' rows; a dead rank's row is the mean of the live ones (what it would take when it
        rejoins)."""
        return torch.cat(self.all_gather(x, fill=None))

    def barrier(self) -> None:
        """Every live rank got here: a quorum round that the store decides. It ends a run (``shaky train``, an
        averager's ``close``): a rank past it closes its mail, so a record of it lost on the way could not be
        asked for again, and the store keeps every record until every live rank is done with it."""
        self._drain()   # the rounds in flight come first
        self._take(self._submit(lambda: (b"", None), by_store=True))

    def stats(self, before: dict[str, Any] | None) -> dict[str, Any]:
        """The membership changes, and the control rounds (each a wait on the control store, two round trips:
        what a step costs on a WAN)."""
        return {"membership_changes": [*(before or {}).get("membership_changes", []), *self.membership_log],
                "control_rounds": int((before or {}).get("control_rounds", 0)) + self._quorum.seq,
                **{name: int((before or {}).get(name, 0)) + value for name, value in (
                    ("control_rounds_by_mail", self._quorum.mail_rounds),
                    ("control_rounds_by_store", self._quorum.store_rounds),
                    ("control_mail_asked_again", self._mail.asked),
                    ("control_mail_rejected", self._mail.rejected))},
                "store_rto_min_ms": self._quorum.store_rto_min_ms}     # this rank's (None: the kernel's 200 ms)


def _nothing_arrived(size: int) -> torch.Tensor:
    """A dead rank's part of a masks round (``size`` bytes, as every rank's): nothing reached it (its own parts
    never travel: ``run_masks`` makes them True), and no proposal."""
    return torch.zeros(size, dtype=torch.uint8)


def _from_bytes(data: bytes, like: torch.Tensor) -> torch.Tensor:
    """A tensor of ``like``'s shape and dtype from its bytes (a copy)."""
    if not data:
        return torch.empty_like(like)
    return torch.frombuffer(bytearray(data), dtype=like.dtype).view(like.shape)


def _live_mean(parts: Sequence[torch.Tensor], live: Sequence[int], weights: torch.Tensor | None) -> torch.Tensor:
    """The (``weights``-weighted) mean of the live ranks' ``parts``, added up in rank order."""
    live = list(live)
    if weights is None:
        return sum(parts[r] for r in live) / len(live)   # type: ignore[return-value]
    w = weights.to(parts[0].dtype)
    return sum(parts[r] * w[r] for r in live) / w[live].sum()   # type: ignore[return-value]
