"""The torch.distributed backend: one worker per process, rows of shape [1, ...].

This is the only module that imports torch.distributed. RPS's two phases are
an ``all_to_all_single`` (block j goes to the rank that serves it) and
point-to-point sends of each server's average to every rank: the messages of
the paper's two phases, on the same links. Every rank holds the same global
delivery masks (drawn from the run seed), so the receiving side applies them:
a block that "did not arrive" is simply left out of the average, exactly as in
the simulator, and both backends agree round by round.

:class:`UdpDistComm` moves the block averages to the UDP data plane
(``shaky.comm.udp``) instead: the loss is the network's, and the masks are what
arrived, gathered from every rank after each exchange. The rest (exact means,
checkpoints, evaluation, the deadline agreement) stays on gloo, or, with live
membership (``shaky train``'s default on udp), goes through a store that rank 0
hosts (:class:`_ControlStore`) in :class:`_Quorum` rounds: a rank that dies is left out and the survivors train
on, and a process started again for it is taken back (``shaky.job.rendezvous.run_in_progress``,
:meth:`UdpDistComm.welcome`)."""

from __future__ import annotations

import collections
import hashlib
import hmac
import io
import json
import os
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from shaky.comm import rps
from shaky.comm.base import Done
from shaky.comm.udp.exchange import (AdaptiveDeadline, ExchangeStats, UdpExchange, UdpOptions,
                                     python_path_warning)
from shaky.comm.udp.sockets import bind_first_free
from shaky.config import DistConfig
from shaky.geometry import LinkSample, block_sizes
from shaky.progress import say


HEARTBEAT_S = 0.25
"""How often each rank's heartbeat thread writes to the rendezvous store (with live membership, the control
store: :class:`_ControlStore`)."""
HEARTBEAT_JOIN_S = 10.0
"""How long closing a comm waits for its heartbeat thread's store call in progress (TCP's retransmissions)."""


class _Reduced:
    """An all-reduce in flight; ``wait`` gives the mean."""

    settled = False     # each rank sees it complete at its own time
    carried = False

    def __init__(self, comm: DistComm, work: dist.Work, total: torch.Tensor,
                 denominator: torch.Tensor | float) -> None:
        self._comm, self._work, self._total, self._denominator = comm, work, total, denominator

    def wait(self) -> torch.Tensor:
        t0 = time.perf_counter()
        self._work.wait()
        self._comm.wait_s += time.perf_counter() - t0
        return self._total / self._denominator


def _world_timeout() -> timedelta:
    """The default process group's timeout (init_process_group's), for the groups this module makes: a new group
    would otherwise wait torch's 30 minutes for a rank that died."""
    try:
        return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):      # another torch's internals: its default
        return dist.default_pg_timeout


class _InFlight:
    """An exchange (or a control round) running in a thread of its comm; ``wait()`` gives its result: the first
    call completes it (``complete(future)``: waits, counts, and on udp gathers or takes in the masks), later
    calls return the same tensor."""

    def __init__(self, future: Any, complete: Callable[[Any], torch.Tensor]) -> None:
        self._future, self._complete = future, complete
        self._value: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._value is None:
            self._value = self._complete(self._future)
        return self._value


class _Carried:
    """A mean that travels in the comm's next control round, in the records that round exchanges anyway (the
    masks of an exchange), or in a round of its own if ``wait()`` comes first (:meth:`UdpDistComm.start_mean`
    with ``deferred``)."""

    def __init__(self, comm: UdpDistComm, x: torch.Tensor, weights: torch.Tensor | None) -> None:
        self._comm, self.x, self.weights = comm, x.contiguous(), weights
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
            self._comm._take(self.round)
        elif self.value is None:
            self._comm._carry_pending()
        if self.value is None:  # the round that carries it resolves it
            raise RuntimeError("a deferred mean was not carried by the control round")
        return self.value


class _ControlRound:
    """A control round (:meth:`UdpDistComm._submit`): numbered, and its record's contents fixed, in the training
    loop's order (the same on every rank); run at once, or in a control thread (an exchange's, once the
    exchange is done) while the loop computes; taken in (:meth:`UdpDistComm._take`) in order."""

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


class DistComm:
    """Comm for one worker per torch.distributed process (gloo on CPU, NCCL on GPU)."""

    def __init__(self, *, heartbeat: bool = False, joining: JoinStore | None = None) -> None:
        """``heartbeat``: a thread beats in the rendezvous store, so that :meth:`diagnose_failure` can tell
        a rank that died from one that hangs (``shaky train`` turns it on; a user's own loop need not).
        ``joining``: this process was started again for a dead rank of a run in progress (``shaky.job``):
        it has no process group, only the rendezvous store (a udp run takes it back, :class:`UdpDistComm`)."""
        if joining is not None:
            self.rank, self.num_workers, self._store = joining.rank, joining.num_workers, joining.store
        elif not dist.is_initialized():
            raise RuntimeError("DistComm needs torch.distributed to be initialised (start with torchrun)")
        else:
            self.rank, self.num_workers = dist.get_rank(), dist.get_world_size()
            self._store = rendezvous_store()
        self.rows = torch.tensor([self.rank])
        self._buffers: dict[str, torch.Tensor] = {}
        self._data: dist.ProcessGroup | None = None
        self._data_thread: ThreadPoolExecutor | None = None
        self.wait_s = 0.0
        """Seconds spent blocked waiting for exchanges (a gloo block average blocks for all of it)."""
        # A heartbeat in the rendezvous store, from a thread: after a collective fails, the ranks whose
        # heartbeat stopped are the ones that died (a kill -9, a crash, a SIGSTOP), whatever step they reached.
        self._beating = threading.Event()
        self._heartbeat = heartbeat
        self.watching = False
        """The heartbeat thread also notes when every other rank's heartbeat last moved (:meth:`silent_s`)."""
        self._beats_seen: dict[int, tuple[int, float]] = {}
        self._looked_at = 0.0
        self._last_beat = time.monotonic()
        self._longest_gap = 0.0
        """The longest time between two of this process's beats since :meth:`paused_s` last reset it."""
        self._beater: threading.Thread | None = None
        self._beat_store = self._store
        """Where the heartbeats are (the rendezvous store; with live membership, the control store)."""
        if heartbeat:
            self._start_heartbeat(self._store)

    def _start_heartbeat(self, store: dist.Store) -> None:
        """Beats in ``store`` from now on, from a thread (with a client of its own where a wait may block
        another: a beat must never wait behind one)."""
        self._heartbeat, self._beat_store = True, store
        self._last_beat = time.monotonic()
        self._beater = threading.Thread(target=self._beat, name="shaky-heartbeat", daemon=True)
        self._beater.start()

    def _beat(self) -> None:
        key = f"shaky/beat/{self.rank}"
        others = [r for r in range(self.num_workers) if r != self.rank]
        store = self._beat_store
        while True:
            now = time.monotonic()
            self._longest_gap, self._last_beat = max(self._longest_gap, now - self._last_beat), now
            try:
                store.add(key, 1)
                if self.watching:     # live membership: when each other rank's heartbeat last moved
                    now = time.monotonic()
                    # A beat seen moving now moved after the last look: its silence counts from then, so a
                    # dead rank is found silent within the timeout of its last beat, not a look later.
                    before = self._looked_at or now
                    for r in others:
                        beat = int(store.add(f"shaky/beat/{r}", 0))
                        if self._beats_seen.get(r, (None,))[0] != beat:
                            self._beats_seen[r] = (beat, before)
                    self._looked_at = now
            except RuntimeError:  # the store is gone (its host died, or the job ended)
                return
            if self._beating.wait(HEARTBEAT_S):
                return

    def paused_s(self, reset: bool = False) -> float:
        """The longest this process has lately gone without a beat, a gap still under way included: a SIGSTOP or
        a stalled machine stops the heartbeat thread too, and a pause past ``dist.heartbeat_timeout_s`` may have
        got this rank left out. ``reset``: from now on, count only later gaps."""
        paused = max(self._longest_gap, time.monotonic() - self._last_beat)
        if reset:
            self._longest_gap = 0.0
        return paused

    def silent_s(self, rank: int) -> float:
        """How long ``rank``'s heartbeat has not moved (with :attr:`watching`; 0 before the first look): from
        the look before the one that saw it last move (an upper bound: it moved after that look) to now, but
        never past one beat after this thread's last look, so a pause of this process (SIGSTOP, a stalled
        machine) is not taken for silence of the others."""
        seen = self._beats_seen.get(rank)
        return 0.0 if seen is None else min(time.monotonic(), self._looked_at + HEARTBEAT_S) - seen[1]

    def close(self) -> None:
        """Stops the heartbeat and the exchange thread (before the process group is destroyed)."""
        self._beating.set()
        if self._beater is not None:
            # Waited for: a daemon thread still inside a store call when the interpreter exits aborts the
            # process ("terminate called without an active exception"), which a lossy network made likely.
            self._beater.join(timeout=HEARTBEAT_JOIN_S)
        if self._data_thread is not None:
            self._data_thread.shutdown(wait=False, cancel_futures=True)

    def _buffer(self, name: str, size: int, like: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < size or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._buffers[name] = like.new_empty(size)
        return buf[:size]

    @property
    def _progress_store(self) -> dist.Store:
        """Where :meth:`on_step` marks this rank's progress: the rendezvous store."""
        return self._store

    def on_step(self, step: int) -> None:
        """Marks this rank's progress in the store where survivors of a failure read it (a request a step)."""
        self._progress_store.set(f"shaky/step/{self.rank}", str(step))

    def publish_run(self, record: dict[str, Any], *, key: str) -> None:
        """Rank 0: what a process started again for a dead rank needs to know of the run (its directory, its
        config, the measured compute time), at ``key`` in the rendezvous store (``shaky.job.rendezvous``)."""
        self._store.set(key, json.dumps(record))

    def end_run(self, *, key: str) -> None:
        """Rank 0, the run finished: a process still waiting to be taken back learns that it will not be (``key``:
        the job's, ``shaky.job.rendezvous``)."""
        self._store.set(key, "1")

    def barrier(self) -> None:
        """Every rank got here."""
        dist.barrier()

    def diagnose_failure(self, timeout_s: float) -> tuple[int, int] | None:
        """After a collective failed: which rank stopped, and after which step.

        A rank whose heartbeat stopped (it died, or its process was frozen) is the one; if every heartbeat
        goes on, the rank that reported the lowest step (it hangs while its process lives). Reads both from
        where they are written (the rendezvous store; with live membership, the control store rank 0 hosts).
        Rank 0 may host the store, so it waits until every other survivor has read it before returning; None if
        the store is gone.
        """
        try:
            dead: list[int] = []
            if self._heartbeat:
                others = [r for r in range(self.num_workers) if r != self.rank]
                beats = self._beat_store
                before = {r: beats.add(f"shaky/beat/{r}", 0) for r in others}
                time.sleep(4 * HEARTBEAT_S)
                dead = [r for r in others if beats.add(f"shaky/beat/{r}", 0) == before[r]]
            marks = self._progress_store
            steps = [int(marks.get(f"shaky/step/{r}")) if marks.check([f"shaky/step/{r}"]) else -1
                     for r in range(self.num_workers)]
            failed = min(dead or range(self.num_workers), key=lambda r: (steps[r], r))
            self._store.set(f"shaky/diagnosed/{self.rank}", "1")
            if self.rank == 0:
                waiting = [f"shaky/diagnosed/{r}" for r in range(1, self.num_workers) if r != failed and r not in dead]
                # Polled, not store.wait: a wait holds the store client, which would stall this rank's heartbeat.
                deadline = time.monotonic() + timeout_s
                while waiting and not self._store.check(waiting) and time.monotonic() < deadline:
                    time.sleep(0.05)
        except RuntimeError:  # the store went away with its host
            return None
        return failed, steps[failed]

    def mean(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        if weights is None:
            total = x.clone()
            dist.all_reduce(total)
            return total / self.num_workers
        w = weights.to(x.dtype)
        total = x * w[self.rank]
        dist.all_reduce(total)
        return total / w.sum()

    def start_mean(self, x: torch.Tensor, weights: torch.Tensor | None = None, *,
                   deferred: bool = False) -> _Reduced:
        """:meth:`mean` as gloo's asynchronous all-reduce: it runs while the caller goes on (``deferred``, a
        mean nobody needs soon, changes nothing here)."""
        if weights is None:
            total, denominator = x.clone(), float(self.num_workers)
        else:
            w = weights.to(x.dtype)
            total, denominator = x * w[self.rank], w.sum()
        return _Reduced(self, dist.all_reduce(total, async_op=True), total, denominator)

    def start_block_average(self, x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *,
                            weights: torch.Tensor | None = None, servers: torch.Tensor | None = None,
                            overwrite: bool = False) -> _InFlight:
        """:meth:`block_average`, in the background: a thread runs its two phases on a process group of their
        own, in launch order (the default group's collectives, such as the loss mean and evaluation, go on
        meanwhile), and ``wait()`` blocks only for what has not arrived. The first call creates that group, a
        collective: every rank starts its exchanges at the same steps, as a schedule makes them. Unless the
        caller gives ``x`` up (``overwrite``), the thread reads a copy of it."""
        if self._data is None:
            self._data = dist.new_group(backend=dist.get_backend(), timeout=_world_timeout())
            self._data_thread = ThreadPoolExecutor(1, thread_name_prefix="shaky-exchange")
        future = self._data_thread.submit(self._block_average, x if overwrite else x.clone(), up, down, weights,
                                          servers, self._data, "background")
        return _InFlight(future, self._waited)

    def _waited(self, future: Future) -> torch.Tensor:
        t0 = time.perf_counter()
        value = future.result()
        self.wait_s += time.perf_counter() - t0
        return value

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """All workers' rows, [W, ...], on every rank (for checkpoints)."""
        parts = [torch.empty_like(x) for _ in range(self.num_workers)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts)

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (pickled, over gloo: every rank is there when a run resumes)."""
        return broadcast_object(value)

    def block_average(self, x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *,
                      weights: torch.Tensor | None = None, servers: torch.Tensor | None = None,
                      overwrite: bool = False) -> torch.Tensor:
        # ``overwrite`` is allowed, not required: the result here is always a fresh tensor (phase 2
        # receives into it while ``x`` still supplies the blocks whose average was lost).
        t0 = time.perf_counter()
        out = self._block_average(x, up, down, weights, servers, None, "received")
        self.wait_s += time.perf_counter() - t0
        return out

    def _block_average(self, x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor | None,
                       servers: torch.Tensor | None, group: dist.ProcessGroup | None, staging: str) -> torch.Tensor:
        """RPS's two phases on ``group`` (None: the default one), staged in the buffer named ``staging``."""
        w, me = self.num_workers, self.rank
        row = x[0]
        sizes = block_sizes(row.numel(), w)
        srv = servers.tolist() if servers is not None else list(range(w))
        # all_to_all_single lays data out by destination rank: order the blocks by their server.
        order = sorted(range(w), key=lambda j: srv[j])
        per_rank = [sum(sizes[j] for j in range(w) if srv[j] == r) for r in range(w)]
        starts = [sum(sizes[:j]) for j in range(w)]
        if order != list(range(w)):
            row = torch.cat([row[starts[j]:starts[j] + sizes[j]] for j in order])
        mine = per_rank[me]

        # Phase 1: every rank sends me the blocks I serve; I average those that arrived.
        # The staging buffer persists across calls: fresh large tensors cost a page fault
        # per 4 KiB, which on a busy machine takes longer than the exchange itself.
        received = self._buffer(staging, w * mine, row)
        dist.all_to_all_single(received, row.contiguous(), output_split_sizes=[mine] * w,
                               input_split_sizes=per_rank, group=group)
        share = rps.shares(up[:, me:me + 1, None], weights, x.dtype)   # [1, senders, 1]: each arrival's weight

        # Phase 2: I send my average to every rank and get every server's back, in ``order`` layout: the
        # average is computed straight into my piece of the result and sent from there, and every server's
        # arrives straight into its piece, with no staging copies. (An all_to_all_single would need the
        # average copied w times into a send buffer; gloo's all-gather allocates and page-faults a
        # full-size buffer on every call: both took longer on the benchmark.)
        out = row.new_empty(row.numel())
        piece = [sum(per_rank[:r]) for r in range(w)]
        avg = out[piece[me]:piece[me] + mine]
        rps.server_average(share, received.view(1, w, mine), out=avg.view(1, mine))
        requests = []
        for r in range(w):
            if r != me:
                if mine:
                    requests.append(dist.isend(avg, r, group=group))
                if per_rank[r]:
                    requests.append(dist.irecv(out[piece[r]:piece[r] + per_rank[r]], r, group=group))
        for request in requests:
            request.wait()
        # Where a server's average was lost, keep my own block (only those blocks: no full-size mask).
        pos, lost = 0, torch.ones(1, 1, 1, dtype=torch.bool)
        for j in order:
            if not down[srv[j], me]:
                rps.keep_own_where_lost(None, row[pos:pos + sizes[j]].view(1, 1, sizes[j]), lost,
                                        out=out[pos:pos + sizes[j]].view(1, 1, sizes[j]))
            pos += sizes[j]
        if order != list(range(w)):
            unpermuted = torch.empty_like(out)
            pos = 0
            for j in order:
                unpermuted[starts[j]:starts[j] + sizes[j]] = out[pos:pos + sizes[j]]
                pos += sizes[j]
            out = unpermuted
        return out[None]


MAX_LANES = 64
"""The most udp exchanges one run may have in flight at once (sockets and threads per rank)."""

KEY_ENV = "SHAKY_KEY"
"""The environment variable that holds the udp key material when ``dist.key_file`` is not given."""
MIN_KEY_BYTES = 16
"""Key material shorter than this (after stripping white space) is refused."""
DEFAULT_PORTS = DistConfig().port_range()
"""The UDP ports a rank may bind by default (``dist.ports``)."""


def load_key(key_file: str = "", key_text: str | None = None) -> bytes | None:
    """The udp key from ``key_file`` (``dist.key_file``) or else ``key_text`` (``$SHAKY_KEY``, which the caller
    read); None if neither is given.

    The material (a file's bytes or the variable's text, white space stripped at both ends, at least
    16 bytes) is hashed with SHA-256 into the 32-byte HMAC key, so ``head -c 32 /dev/urandom`` and
    ``openssl rand -hex 32`` both make a good one. Raises ValueError naming the file or variable.
    """
    if key_file:
        try:
            material = Path(key_file).read_bytes()
        except OSError as exc:
            raise ValueError(f"dist.key_file {key_file!r} cannot be read: {exc.strerror or exc}") from None
        where = f"dist.key_file {key_file!r}"
    elif key_text is not None:
        material, where = key_text.encode(), f"the environment variable {KEY_ENV}"
    else:
        return None
    material = material.strip()
    if len(material) < MIN_KEY_BYTES:
        raise ValueError(f"{where} holds {'no key' if not material else f'{len(material)} bytes'}; a key needs at "
                         f"least {MIN_KEY_BYTES} (make one with: head -c 32 /dev/urandom > shaky.key)")
    return hashlib.sha256(b"shaky udp key\0" + material).digest()


def agreed_key(key_file: str = "", key_text: str | None = None) -> bytes | None:
    """:func:`load_key` on every rank (a collective): a key file one rank cannot read stops every rank with the
    same ValueError, which names that rank, instead of leaving the others waiting for it."""
    key, error = None, ""
    try:
        key = load_key(key_file, key_text)
    except ValueError as exc:
        error = str(exc)
    errors = [""] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    found = [(r, e) for r, e in enumerate(errors) if e]
    if found:
        raise ValueError(f"rank {found[0][0]}: {found[0][1]}")
    return key


def local_address(master: str = "127.0.0.1") -> str:
    """The IPv4 address this machine uses to reach ``master`` (MASTER_ADDR; 127.0.0.1 when that is this
    machine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((master, 9))   # a UDP connect sends nothing: it only picks the route
        except OSError as exc:
            raise ValueError(f"cannot find this machine's address towards MASTER_ADDR {master!r} ({exc}); "
                             "set dist.host") from None
        return str(probe.getsockname()[0])


STORE_RTO_MIN_MS = 5.0
"""TCP's minimum retransmission timeout on the control store's connections. Linux's own is 200 ms, far above
the round trip of a network near enough to train over: with 5% of packets lost, a control request waited 31 ms
on average (p90 207 ms) with it and 3.6 ms (p90 16 ms) with this (docs/transport.md)."""
_TCP_RTO_MIN_US = 45
"""The socket option TCP_RTO_MIN_US (linux/tcp.h, Linux 6.11 on); an older kernel refuses it."""


def store_sockets(port: int) -> Iterator[socket.socket]:
    """Every TCP socket of this process to or from ``port``, each a duplicate of its descriptor (an option set on
    it is set on the socket itself), closed when the caller moves on. torch's TCPStore keeps its sockets to
    itself, so they are found in /proc/self/fd (nothing where there is no /proc)."""
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in fds:
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:     # closed meanwhile, or not a socket Python knows
            continue
        with sock:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                ends = (sock.getsockname()[1], sock.getpeername()[1])
            except OSError:     # a listening socket
                ends = (sock.getsockname()[1], None)
            if port in ends:
                yield sock


def shorten_store_retransmits(port: int) -> float | None:
    """Sets :data:`STORE_RTO_MIN_MS` on every :func:`store_sockets` of ``port`` (the control store's): this
    process's clients and, in the process that hosts the store, its listening socket, which the connections it
    accepts later inherit it from, and those it accepted so far. Returns the minimum the kernel now holds, in
    milliseconds (it rounds up to its timer's tick), or None where the kernel or the system has no such
    option: TCP's own 200 ms then applies, which only makes a lossy control plane slower."""
    held: float | None = None
    for sock in store_sockets(port):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, _TCP_RTO_MIN_US, int(STORE_RTO_MIN_MS * 1000))
            held = sock.getsockopt(socket.IPPROTO_TCP, _TCP_RTO_MIN_US) / 1000
        except OSError:     # no TCP_RTO_MIN_US in this kernel
            return None
    return held


def rendezvous_store() -> dist.Store:
    """The rendezvous store itself (MASTER_ADDR:MASTER_PORT's), under the prefixes torch's process groups add:
    shaky's keys live there, where a process started again for a dead rank, which has no process group, reads
    them with a plain client."""
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


class JoinStore(NamedTuple):
    """What a process started again for a dead rank has instead of a process group: the rendezvous store."""

    store: dist.Store
    """The rendezvous store (:func:`rendezvous_store`)."""
    rank: int
    num_workers: int
    record: dict[str, Any]
    """The run record rank 0 published (:meth:`DistComm.publish_run`)."""


class NotTakenBack(RuntimeError):
    """A process started again for a dead rank was not taken back (the run ended first, or its store is gone)."""


class LeftBehind(RuntimeError):
    """This rank was declared dead by the others (its heartbeat stopped for longer than the timeout, e.g. while
    its process was frozen) and the run went on without it."""


class ForgedRecord(RuntimeError):
    """A value in the control store did not verify against the run's key: something outside the run wrote it.
    The rank stops rather than average it (the store, torch's TCPStore, takes writes from whoever reaches it)."""


CONTROL_ROUND_TRIPS = 2
"""Round trips to rank 0's control store in a common round (:meth:`_Quorum.round`): the append goes with the
read's wait, whose answer comes when every rank's record is in, then the read."""


class _Quorum:
    """The udp transport's control plane when ranks may die: rounds of small records in the control store.

    Every live rank appends its record of a round to a key of its own, and the key's first entry decides it
    (:meth:`entry`, :meth:`first`). A rank waits for the other live ranks' keys, but only until the first of
    their ranks could be stale; a rank whose heartbeat (a thread of its own, independent of its training loop)
    has not moved for ``timeout_s`` is declared dead by appending a tombstone to its key. Either its record or
    the tombstone came first, the store holds them in that order, and every rank reads the same: each round
    ends with the same records on every survivor (torchft's quorum, with a store key per rank in place of a
    lighthouse), and a rank that finds its own key's first entry a tombstone knows it was left out. Rounds may
    run at once (the comm's control threads: a delayed exchange's round runs while the next ones start), each
    in its thread's client (:meth:`client`); the comm takes them in in order, and a rank stays live while every
    round holds its record. Every value it writes is sealed with the run's key (:meth:`seal`): the store takes
    writes from whoever reaches it, and a value that does not verify stops the rank (ForgedRecord). The common
    round is two store requests on one connection, two round trips: the append, which has no answer, and one
    ``multi_get`` sent right behind it, which waits for every key of the round (this rank's own is there: the
    store serves a connection's requests in order) and then reads them. The old rounds' keys are deleted by a
    thread with a store client of its own, off the round's path.
    """

    def __init__(self, silent_s: Callable[[int], float], rank: int, num_workers: int, prefix: str, timeout_s: float,
                 store_timeout_s: float, address: tuple[str, int], key: bytes, run_id: int,
                 latency_s: float = 0.0, paused_s: Callable[..., float] | None = None) -> None:
        host, port = address      # the control store's (:class:`_ControlStore`)
        self._latency_s = latency_s
        """The one-way latency to emulate between this rank and the store (``dist.emulate_latency``): a round's
        append and read wait it once before they go (together), and three times after the read's answer (a
        ``multi_get`` is a wait, then a read: two round trips)."""
        self._key, self._run, self._address = key, run_id.to_bytes(8, "big"), f"{host}:{port}"
        # A client of its own: its waits block it, and the heartbeat thread must never wait behind them.
        self._store_timeout = timedelta(seconds=store_timeout_s)
        self._store = dist.TCPStore(host, port, is_master=False, timeout=self._store_timeout)
        self._owner, self._local, self._host, self._port = threading.current_thread(), threading.local(), host, port
        self.store_rto_min_ms = shorten_store_retransmits(port)
        """TCP's minimum retransmission timeout on the control store's connections, in milliseconds (None: the
        kernel's own, 200 ms). Set by the control plane, which a lossy network makes wait on it: a DistComm
        without live membership (gloo, a user's RPSAverager) leaves the process's sockets alone."""
        self._sweeper = _Sweeper(host, port, store_timeout_s)
        self._swept: dict[int, list[str]] = {}
        """The keys of each round taken in that this rank deletes once every survivor has taken it in."""
        self._silent_s = silent_s
        self._paused_s = paused_s
        """This process's own longest pause lately (``DistComm.paused_s``), where it has a heartbeat."""
        self.rank, self.prefix, self.timeout_s = rank, prefix, timeout_s
        self.live: tuple[int, ...] = tuple(range(num_workers))
        """The ranks alive as of the last round taken in, the same on every survivor (set by the comm)."""
        self._seq = 0
        self.live_key = f"{prefix}/live"
        """The live ranks as of the last change (every survivor writes the same): a rank that wakes after the
        rounds that left it out were cleaned away learns it here."""
        self.num_workers = num_workers

    def join_key(self, rank: int) -> str:
        """Where a process started again for ``rank`` asks to be taken back."""
        return f"{self.prefix}/join/{rank}"

    def welcome_key(self, rank: int) -> str:
        """Where the survivors hand a process started again for ``rank`` the run's state."""
        return f"{self.prefix}/welcome/{rank}"

    @property
    def store(self) -> dist.Store:
        return self._store

    def client(self) -> dist.Store:
        """This thread's client of the store: rounds run in several threads at once (a control thread for each
        lane), and a client makes one request at a time."""
        if threading.current_thread() is self._owner:
            return self._store
        store = getattr(self._local, "store", None)
        if store is None:
            store = self._local.store = dist.TCPStore(self._host, self._port, is_master=False,
                                                      timeout=self._store_timeout)
            shorten_store_retransmits(self._port)
        return store

    @property
    def seq(self) -> int:
        """The number of the next round."""
        return self._seq

    def take_seq(self) -> int:
        """The next round's number, taken (rounds are numbered in the order they are submitted, the same on
        every rank)."""
        self._seq += 1
        return self._seq - 1

    def publish_live(self, live: Sequence[int]) -> None:
        """The live ranks after a change (every survivor writes the same)."""
        self._store.set(self.live_key, self.seal(self.live_key, ",".join(map(str, live)).encode()))

    def sweep(self, seq: int, keys: list[str], below: int) -> None:
        """Round ``seq``'s ``keys`` (this rank's to delete) are kept until every survivor has taken in the
        round; ``below``: every survivor has taken in each round before it."""
        self._swept[seq] = keys
        done = [k for k in self._swept if k < below]
        if done:
            self._sweeper.delete([key for k in sorted(done) for key in self._swept.pop(k)])

    def resume_at(self, seq: int, live: Sequence[int]) -> None:
        """A rank taken back: its next round is ``seq``, with the ranks ``live``."""
        self._seq, self.live = seq, tuple(live)

    def _left_behind(self) -> LeftBehind:
        return LeftBehind(f"rank {self.rank} was declared dead by the others (its heartbeat stopped for more than "
                          f"dist.heartbeat_timeout_s = {self.timeout_s:g} s) and the run went on without it")

    def seal(self, name: str, value: bytes) -> bytes:
        """``value`` as it is written under the key ``name``: followed by a tag (HMAC-SHA256 with the run's udp
        key, truncated to 16 bytes, as the data plane's datagrams) that binds it to this run and that key."""
        return value + self._tag(name, value)

    def opened(self, name: str, sealed: bytes) -> bytes:
        """The value that :meth:`seal` wrote under ``name``; ForgedRecord where the tag does not verify."""
        value, tag = sealed[:-_SEAL_BYTES], sealed[-_SEAL_BYTES:]
        if len(sealed) < _SEAL_BYTES or not hmac.compare_digest(tag, self._tag(name, value)):
            raise ForgedRecord(f"the control store's {name!r} does not verify against the run's key: something "
                               f"outside the run wrote it (the store at {self._address} takes writes from whoever "
                               "reaches that address; see dist.host), and this rank stops rather than use it")
        return value

    def _tag(self, name: str, value: bytes) -> bytes:
        message = b"shaky control\0" + self._run + name.encode() + b"\0" + value
        return hmac.digest(self._key, message, "sha256")[:_SEAL_BYTES]

    def ask_if_paused(self, store: dist.Store) -> None:
        """LeftBehind if this process stood still longer than the others wait for a beat (a SIGSTOP, a stalled
        machine: ``DistComm.paused_s``) and they left it out meanwhile. Asked, not waited for: the rounds that
        left it out may be cleaned away, and a round in flight across the pause waits out its own timeout."""
        if self._paused_s is not None and self._paused_s() > self.timeout_s:
            self._check_still_live(store)
            self._paused_s(reset=True)

    def _check_still_live(self, store: dist.Store) -> None:
        if store.check([self.live_key]) and \
                str(self.rank) not in self.opened(self.live_key, store.get(self.live_key)).decode().split(","):
            raise self._left_behind()

    def leave(self) -> None:
        """This rank's last use of the store. Rank 0, whose process hosts the store, waits until every
        other live rank says it is done with it (at most ``timeout_s``; a rank may have died since the last
        round): a store that went first would take the others' last round with it, and with packet loss they
        can be that far behind (they stopped with "rank 0 ... is gone" after a finished run)."""
        self._sweeper.stop()
        try:
            if self.rank != 0:
                self._store.set(f"{self.prefix}/left/{self.rank}", "1")
                return
            others = [f"{self.prefix}/left/{r}" for r in self.live if r != self.rank]
            if others:
                self._store.wait(others, timedelta(seconds=self.timeout_s))
        except RuntimeError:    # the store is gone, or a rank died after the last round: nothing to wait for
            pass

    def round(self, seq: int, record: bytes, live: Sequence[int], admit: bool) -> _RoundResult:
        """Writes this rank's ``record`` in round ``seq`` (:meth:`take_seq`) and returns the round's records, by
        rank: those of the ``live`` ranks (as of the last round taken in when it was submitted) that were not
        declared dead in it. Rounds may run at once, in different threads; each of them agrees on its own
        records, and the comm takes them in in order (a rank is live after a round if it was before and its
        record is in). ``admit``: the round may take in ranks started again (the first round submitted in
        each step)."""
        store, key = self.client(), f"{self.prefix}/{seq}"
        self.ask_if_paused(store)
        t0 = time.perf_counter()
        ranks = [self.rank, *(r for r in live if r != self.rank)]      # this rank's own key read first
        keys = [f"{key}/{r}" for r in ranks]
        self._hold(1)       # the append goes with the multi_get's first request: no answer of its own
        store.append(keys[0], self.entry(keys[0], _RECORD + record))
        missing, values = ranks[1:], None       # values: every key of the round, read (in ``ranks``' order)
        replaced: set[int] = set()      # missing ranks for which a new process asks to be taken back
        while missing:
            # Wait for the records of the ranks whose heartbeat still moves, until the first of them would be
            # stale: a wait runs out only when a rank is really suspect.
            pending = [r for r in missing if self._silent_s(r) < self.timeout_s and r not in replaced]
            if not pending:
                break                               # every rank still missing is dead
            try:
                until = timedelta(seconds=max(0.05, min(self.timeout_s - self._silent_s(r) for r in pending)))
                if pending == ranks[1:]:    # the common round: a multi_get waits for its keys, then reads them
                    values, missing = self._multi_get(store, keys, until), []
                    self._hold(3)
                else:
                    store.wait([f"{key}/{r}" for r in pending], until)
                    missing = [r for r in missing if r not in pending and not store.check([f"{key}/{r}"])]
            except dist.DistStoreError:             # it ran out (the store itself raises other errors)
                self._check_still_live(store)       # a rank woken after the others left it out
                missing = [r for r in missing if not store.check([f"{key}/{r}"])]
                # A process started again for a rank beats that rank's heartbeat: its old one is gone.
                replaced |= {r for r in missing if store.check([self.join_key(r)])}
        if missing:
            self._check_still_live(store)
        for r in missing:   # dead: unless its record came first (then the key's first entry is the record)
            store.append(f"{key}/{r}", self.entry(f"{key}/{r}", _DEAD))
        if values is None:
            values = store.multi_get(keys)
        records: dict[int, bytes] = {}
        for r, name, value in zip(ranks, keys, values, strict=True):
            value = self.first(name, value)
            if value[:1] == _RECORD:
                records[r] = value[1:]
        if self.rank not in records:
            raise self._left_behind()       # the others declared this rank dead first
        included = tuple(sorted(records))
        mine = [keys[0]]
        if self.rank == included[0]:      # the lowest survivor deletes what the dead left in the round
            mine += [f"{key}/{r}" for r in live if r not in records]
        admitted: tuple[int, ...] = ()
        dead = [r for r in range(self.num_workers) if r not in live]
        if admit and dead:    # every survivor asks, and the first answer holds: "+" and the ranks to take back
            joining = ",".join(str(r) for r in dead if store.check([self.join_key(r)]))
            agreed = self.opened(f"{key}/admit", store.compare_set(
                f"{key}/admit", "", self.seal(f"{key}/admit", f"+{joining}".encode()))).decode()[1:]
            admitted = tuple(map(int, agreed.split(","))) if agreed else ()
            if self.rank == included[0]:
                mine.append(f"{key}/admit")
        return _RoundResult(records, admitted, mine, time.perf_counter() - t0)

    def entry(self, name: str, value: bytes) -> bytes:
        """``value`` sealed for the key ``name`` (:meth:`seal`) and framed to be appended to it: its length in
        four bytes, then the sealed value."""
        sealed = self.seal(name, value)
        return len(sealed).to_bytes(_FRAME_BYTES, "big") + sealed

    def first(self, name: str, appended: bytes) -> bytes:
        """The value of the first entry (:meth:`entry`) appended to the key ``name``, which decides the key;
        ForgedRecord where it does not verify, or is not an entry."""
        size = int.from_bytes(appended[:_FRAME_BYTES], "big")
        whole = len(appended) >= _FRAME_BYTES + size
        return self.opened(name, appended[_FRAME_BYTES:_FRAME_BYTES + size] if whole else b"")

    def connect(self) -> None:
        """Opens this thread's client of the store now, at the start: opening a TCP connection is the one
        request whose loss waits seconds (SYN is resent after 1 s, then 2)."""
        self.client()


    def _hold(self, times: int) -> None:
        """The emulated latency of ``times`` one-way trips to the store (none unless ``dist.emulate_latency``)."""
        if self._latency_s:
            time.sleep(times * self._latency_s)

    def _multi_get(self, store: dist.Store, keys: list[str], timeout: timedelta) -> list[bytes]:
        """``keys``' values, waiting at most ``timeout`` for them to be written (DistStoreError when it runs out).
        A multi_get waits for its keys before it reads them, with the client's timeout: a ``wait`` of its own
        first would cost one more round trip to the store (a round is then three, not four)."""
        store.set_timeout(timeout)
        try:
            return store.multi_get(keys)
        finally:
            store.set_timeout(self._store_timeout)


class _RoundResult(NamedTuple):
    records: dict[int, bytes]
    """The round's records, by rank (this rank's own included)."""
    admitted: tuple[int, ...]
    """Ranks started again that the round agreed to take back."""
    keys: list[str]
    """The round's keys this rank deletes once every survivor has taken the round in."""
    seconds: float
    """How long the round took this rank."""


_SEAL_BYTES = 16
"""The tag that follows every value the control plane writes (:meth:`_Quorum.seal`)."""
_FRAME_BYTES = 4
"""The length before each entry appended to a control round's key (:meth:`_Quorum.entry`)."""
_RECORD, _DEAD = b"R", b"D"
"""The first byte of an entry of a control round's key: a rank's record follows, or the rank was declared dead
(the key's first entry decides which)."""


class _ControlStore:
    """Where the control plane's rounds (:class:`_Quorum`) are held: a TCPStore that rank 0 hosts in its own
    process, on the first free TCP port of ``dist.ports`` at its address (``dist.host``). Every rank learns
    the address from the rendezvous store (``key``), a process started again for a rank too.

    Not the rendezvous store itself: torchrun's agent hosts that one, out of reach of shaky's processes, and
    with packets lost its answers wait TCP's 200 ms minimum before they are sent again (shaky lowers it on the
    sockets of its own processes only, :func:`shorten_store_retransmits`); 4 ranks, 5% of packets lost,
    ``torchrun --standalone``: about 200 ms a step, against about 40 with the rounds in rank 0's process.
    Rank 0 cannot move anyway (it writes the run directory), so hosting the rounds costs no survival.
    """

    def __init__(self, rendezvous: dist.Store, key: str, rank: int, host: str, ports: range, timeout_s: float,
                 joining: bool) -> None:
        self.timeout_s = timeout_s
        self._server: dist.TCPStore | None = None
        if rank == 0 and not joining:
            listener = None
            try:
                listener = bind_first_free(host, ports, socket.SOCK_STREAM)
                listener.listen(1024)
                port = listener.getsockname()[1]
                # The store serves on this socket (its address and port are the ones chosen here) and closes it.
                self._server = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                             master_listen_fd=listener.fileno(), timeout=timedelta(seconds=timeout_s))
                listener.detach()
                rendezvous.set(key, f"ok {host} {port}")
            except (OSError, RuntimeError) as exc:
                if listener is not None:
                    listener.close()
                rendezvous.set(key, f"error {' '.join(str(exc).split())[:200]}")
        status, _, rest = rendezvous.get(key).decode().partition(" ")
        if status != "ok":
            raise ValueError(f"rank 0 cannot open the control plane's TCP port: {rest} (see dist.ports and "
                             "dist.host)")
        host, port = rest.rsplit(" ", 1)
        self.address = (host, int(port))
        """The control store's (host, port)."""

    def close(self) -> None:
        """Rank 0: stops serving (after every other live rank is done with it, :meth:`_Quorum.leave`)."""
        self._server = None


class _Sweeper:
    """Deletes the keys of old control rounds from the control store, from a thread with a store client of
    its own: a round's path makes no request for it, and a delete that TCP has to retransmit delays nothing."""

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self._host, self._port, self._timeout_s = host, port, timeout_s
        self._keys: queue.SimpleQueue[list[str] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def delete(self, keys: list[str]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="shaky-quorum-sweeper", daemon=True)
            self._thread.start()
        self._keys.put(keys)

    def _run(self) -> None:
        try:
            store = dist.TCPStore(self._host, self._port, is_master=False,
                                  timeout=timedelta(seconds=self._timeout_s))
            shorten_store_retransmits(self._port)
            while (keys := self._keys.get()) is not None:
                for key in keys:
                    store.delete_key(key)
        except RuntimeError:    # the store is gone (its host ended the run): nothing left to delete
            return

    def stop(self) -> None:
        """Stops after the deletes asked for so far (waits at most HEARTBEAT_JOIN_S: a thread still inside a
        store call when the interpreter exits aborts the process)."""
        if self._thread is not None:
            self._keys.put(None)
            self._thread.join(timeout=HEARTBEAT_JOIN_S)


class UdpDistComm(DistComm):
    """DistComm whose block averages travel as UDP datagrams (``shaky.comm.udp``): real loss, never resent.

    Built by every rank together (it exchanges addresses, the key's fingerprint and, without a key, the
    key itself through the rendezvous store). Each :meth:`block_average` is one :class:`UdpExchange`
    round: the result follows RPS's rule on what really arrived, and the masks of every rank are gathered
    over gloo afterwards (:attr:`observed`, in the simulator's [W, W, S] layout, for the run's trace).
    The same gather carries each rank's deadline proposal for the next round, so the ranks agree on it
    (the largest proposal) without another collective. Means, gathers and checkpoints stay on gloo, unless
    ``heartbeat_timeout_s`` moves them, the masks included, to a store rank 0 hosts (live membership): then
    an exchange's masks go round in its lane's control thread as soon as the exchange is done (the round of a
    delayed exchange is hidden by the steps of its delay too), and the rounds are taken in, in the order they
    were submitted, where the training loop waits for them.
    """

    _instances = 0   # per process: every rank builds its comms in the same order, so the store keys agree

    def __init__(self, *, deadline_ms: float | None = None, key: bytes | None = None, ports: range | None = None,
                 host: str | None = None, options: UdpOptions | None = None, heartbeat: bool = False,
                 announce: bool = True, lanes: int = 1, latency_s: list[float] | None = None,
                 heartbeat_timeout_s: float | None = None, joining: JoinStore | None = None,
                 master_addr: str = "127.0.0.1") -> None:
        """``deadline_ms``: a fixed phase deadline (None: adaptive; the first round, with no history, gets
        :func:`first_deadline_s` of its row). ``key``: 32 bytes
        (``load_key``); None: rank 0 makes one for this run and hands it out through the store, and every
        rank says so on stderr (``announce``). ``ports``: the range a rank binds the first free port of.
        ``host``: this rank's address as the others reach it (None: ``local_address(master_addr)``, the one
        this machine reaches ``master_addr``, MASTER_ADDR, from).
        ``lanes``: exchanges that may be in flight at once (a delayed exchange's slots): each lane is a
        socket of its own, driven by a thread of its own, so that the exchanges launched at consecutive
        steps overlap each other as well as the compute (their latencies pipeline). ``latency_s``: the
        one-way latency to emulate towards each rank (``UdpExchange``'s delay line, and with live membership
        the control rounds' requests to rank 0's store: :class:`_Quorum`; None: none).
        ``heartbeat_timeout_s``: live membership (needs ``heartbeat``): the control plane (means, gathers, the
        masks) goes through :class:`_Quorum` rounds in a store rank 0 hosts (on the first free TCP port of
        ``ports`` at its ``host``) instead of gloo, and a rank whose
        heartbeat stops for this long is left out: the survivors go on (:meth:`take_membership`). None: gloo,
        and a dead rank stops every rank, as on the gloo transport. ``joining``: this process was started again
        for a dead rank of a run in progress (needs ``heartbeat_timeout_s``): it asks the survivors to take it
        back, and :meth:`await_welcome` waits until they do.

        Raises ValueError (the same on every rank, naming the rank) when a rank cannot bind a port, or the
        ranks' keys differ."""
        if deadline_ms is not None and not 0 < deadline_ms < float("inf"):
            raise ValueError(f"deadline_ms must be a positive number of milliseconds, got {deadline_ms!r}")
        if joining is not None and heartbeat_timeout_s is None:
            raise ValueError("a rank started again can join only with live membership (heartbeat_timeout_s)")
        # With live membership the heartbeat starts once the control store is up, and beats there.
        super().__init__(heartbeat=heartbeat and heartbeat_timeout_s is None, joining=joining)
        UdpDistComm._instances += 1
        prefix = self._prefix = f"shaky/udp/{UdpDistComm._instances}"
        store, me, w = self._store, self.rank, self.num_workers
        if me == 0 and joining is None:
            store.set(f"{prefix}/run", os.urandom(8).hex())
            if key is None:
                store.set(f"{prefix}/key", os.urandom(32).hex())
        run_id = int(store.get(f"{prefix}/run").decode(), 16)
        if key is None:
            key = bytes.fromhex(store.get(f"{prefix}/key").decode())
            if announce:
                say(f"shaky: rank {me}: the udp key was handed out through the rendezvous store, which is not "
                    f"encrypted; give every node dist.key_file or {KEY_ENV} to keep it off the network")
        fingerprint = hashlib.sha256(b"shaky key fingerprint\0" + key).hexdigest()[:16]
        if heartbeat_timeout_s is not None and not (heartbeat and 0 < heartbeat_timeout_s < float("inf")):
            raise ValueError(f"heartbeat_timeout_s must be a positive number of seconds with heartbeat=True, got "
                             f"{heartbeat_timeout_s!r} (heartbeat={heartbeat})")
        if isinstance(lanes, bool) or not isinstance(lanes, int) or not 1 <= lanes <= MAX_LANES:
            raise ValueError(f"lanes must be an integer in [1, {MAX_LANES}], got {lanes!r}")
        exchanges: list[UdpExchange] = []
        try:
            address = host or local_address(master_addr)
            for _ in range(lanes):
                exchanges.append(UdpExchange(rank=me, num_workers=w, key=key, run_id=run_id, host=address,
                                             ports=ports or DEFAULT_PORTS, options=options, latency_s=latency_s))
            where = " ".join(f"{ex.address[0]} {ex.address[1]}" for ex in exchanges)
            store.set(f"{prefix}/addr/{me}", f"ok {fingerprint} {where}")
        except (OSError, ValueError) as exc:
            store.set(f"{prefix}/addr/{me}", f"error {exc}")
        self.exchanges: list[UdpExchange] = exchanges
        """This rank's ends of the data plane, one per lane."""
        try:
            self._connect(fingerprint)       # a socket this rank could not open is an error entry of its own
            self._control = None if heartbeat_timeout_s is None else _ControlStore(
                store, f"{prefix}/control", me, address, ports or DEFAULT_PORTS,
                (_world_timeout() if joining is None else self._store.timeout).total_seconds(), joining is not None)
        except ValueError:
            super().close()
            for ex in exchanges:
                ex.close()
            raise
        self.exchange: UdpExchange = exchanges[0]
        """The first lane's exchange (every lane has the same options)."""
        self._threads = [ThreadPoolExecutor(1, thread_name_prefix=f"shaky-udp-lane{k}") for k in range(lanes)]
        self._control_threads = [] if self._control is None else [
            ThreadPoolExecutor(1, thread_name_prefix=f"shaky-udp-control{k}") for k in range(lanes)]
        """With live membership: a thread for each lane that runs its exchanges' control rounds once they are done,
        so that a delayed exchange's round (two round trips to rank 0's store) is hidden by the steps too."""
        self._completed: list[tuple[int, LinkSample]] = []
        self._step = 0
        self.segment_bytes = self.exchange.segment_bytes
        """The bytes of a datagram's segment: the unit of loss (``network.segment_bytes`` of the masks)."""
        self._fixed_s = None if deadline_ms is None else deadline_ms / 1000
        self._adaptive = AdaptiveDeadline()
        self._adaptive_lock = threading.Lock()     # the control threads observe exchanges that end at once
        self._deadline_s = self._fixed_s or self._adaptive.propose()
        self._round = 0
        self._observed: LinkSample | None = None
        self.last_stats: ExchangeStats | None = None
        """The counters of the last exchange (this rank's)."""
        self._totals = {"sent": 0, "received": 0, "expected": 0, "late": 0, "rejected": 0, "closed_by_deadline": 0,
                        "repeated": 0, "grace_s": 0.0}
        if self._control is not None:    # a client of its own: the quorum's blocks in its waits
            self._start_heartbeat(dist.TCPStore(*self._control.address, is_master=False,
                                                timeout=timedelta(seconds=self._control.timeout_s)))
        self._quorum = None if self._control is None else _Quorum(
            self.silent_s, me, w, f"{prefix}/q", heartbeat_timeout_s, self._control.timeout_s, self._control.address,
            key, run_id, latency_s=latency_s[0] if latency_s and me != 0 else 0.0, paused_s=self.paused_s)
        self.watching = self._quorum is not None
        self.control_round_trips = 0 if self._quorum is None else CONTROL_ROUND_TRIPS
        if self._quorum is not None:    # every thread that runs rounds, connected before the first
            for done in [pool.submit(self._quorum.connect) for pool in self._control_threads]:
                done.result()
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
        if joining is None:
            dist.barrier()
        else:
            self._quorum.store.set(self._quorum.join_key(me), fingerprint)
            self._asked_at = time.monotonic()
        self.join_wait_s = 0.0
        """A rank started again: seconds from its request to be taken back to the survivors' welcome."""

    def _connect(self, fingerprint: str) -> None:
        """Every lane learns every rank's address from the store (at the start, and whenever ranks are taken
        back: theirs changed). Raises ValueError naming a rank that could not open its socket, or when the
        ranks' keys differ."""
        entries = [self._store.get(f"{self._prefix}/addr/{r}").decode().split(" ", 1) for r in range(self.num_workers)]
        errors = [(r, rest) for r, (status, rest) in enumerate(entries) if status != "ok"]
        if errors:
            r, why = errors[0]
            raise ValueError(f"rank {r} cannot open its udp socket: {why} (see dist.ports and dist.host)")
        fields = [rest.split(" ") for _, rest in entries]
        if len({f[0] for f in fields}) > 1 or fields[self.rank][0] != fingerprint:
            raise ValueError("the ranks hold different udp keys (dist.key_file or SHAKY_KEY differs between "
                             "nodes): every datagram would be rejected")
        for lane, ex in enumerate(self.exchanges):
            ex.connect([(f[1 + 2 * lane], int(f[2 + 2 * lane])) for f in fields])
        self._fingerprint = fingerprint

    @property
    def deadline_s(self) -> float:
        """The deadline of the next exchange's phases, in seconds (the same on every rank)."""
        return self._deadline_s

    @property
    def observed(self) -> LinkSample | None:
        """The masks that arrived in the last exchange, every rank's ([W, W, S]); None before the first."""
        return self._observed

    def info(self) -> dict[str, object]:
        """This rank's first socket: address, granted buffers, GSO/GRO (``UdpExchange.info``), and the lanes."""
        return {**self.exchange.info(), "lanes": len(self.exchanges)}

    def close(self) -> None:
        super().close()
        for pool in [*self._threads, *self._control_threads]:
            pool.shutdown(wait=True, cancel_futures=True)
        for ex in self.exchanges:
            ex.close()
        if self._quorum is not None:
            self._quorum.leave()
        if self._control is not None:
            self._control.close()

    @property
    def _progress_store(self) -> dist.Store:
        """With live membership, the control store: a request a step to the rendezvous store, which torchrun's
        agent may host, would wait out TCP's 200 ms after each lost answer (:class:`_ControlStore`)."""
        return self._store if self._quorum is None else self._quorum.store

    @property
    def agreement(self) -> UdpDistComm | None:
        """With live membership, what the survivors agree on (``shaky.membership.Agreement``: changes of the live
        ranks, ranks taken back), which :class:`shaky.membership.Agreed` takes in; None without."""
        return None if self._quorum is None else self

    def on_step(self, step: int) -> None:
        super().on_step(step)
        self._step = step
        self._admitting = True

    # ------------------------------------------------------------------ ranks taken back

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
        if q is None:
            raise RuntimeError("ranks are taken back only with live membership")
        self._drain()
        live = tuple(sorted({*q.live, *joiners}))
        self._admitted = tuple(r for r in self._admitted if r not in live)
        entry: dict[str, object] = {"step": self._step, "live": list(live), "rejoined": list(joiners),
                                    "round_s": 0.0}
        if self.rank == q.live[0]:
            buffer = io.BytesIO()
            torch.save({"train": snapshot, "comm": {
                "seq": q.seq, "live": live, "round": self._round, "deadline_s": self._deadline_s,
                "membership_log": [*self.membership_log, entry]}}, buffer)
            q.publish_live(live)
            for r in joiners:
                q.store.set(q.welcome_key(r), q.seal(q.welcome_key(r), buffer.getvalue()))
                q.store.delete_key(q.join_key(r))
        q.resume_at(q.seq, live)
        entry["round_s"] = round(time.perf_counter() - t0, 3)     # what handing the state over cost this rank
        self._connect(self._fingerprint)
        now = time.monotonic()
        for r in joiners:   # its request to join is its latest sign of life: silent from now on, if at all
            self._beats_seen[r] = (self._beats_seen.get(r, (None, now))[0], now)
        self._changed(live, entry)

    def await_welcome(self, timeout_s: float, *, ended_key: str) -> dict[str, Any]:
        """A rank started again: waits until the survivors take it back and returns the training loop's part of
        what they handed over (:meth:`welcome`). Raises NotTakenBack when the run ends first (``ended_key`` is
        set in the rendezvous store), its store goes, or ``timeout_s`` passes."""
        q, me = self._quorum, self.rank
        if q is None:
            raise RuntimeError("ranks are taken back only with live membership")
        deadline = time.monotonic() + timeout_s
        try:
            while not q.store.check([q.welcome_key(me)]):
                if self._store.check([ended_key]):
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
        self._round, self._deadline_s = control["round"], control["deadline_s"]
        self._adaptive = AdaptiveDeadline(initial_s=control["deadline_s"])
        self._step = handed["train"]["counters"]["step"]
        self.membership_log = control["membership_log"][:-1]
        self._connect(self._fingerprint)
        self._changed(control["live"], control["membership_log"][-1])
        return handed["train"]

    def _changed(self, live: Sequence[int], entry: dict[str, object]) -> None:
        """A membership change at ``entry["step"]``: recorded for :meth:`take_membership` and the summary."""
        mask = torch.zeros(self.num_workers, dtype=torch.bool)
        mask[list(live)] = True
        self._changes.append((int(entry["step"]), mask))     # type: ignore[call-overload]
        self.membership_log.append(entry)

    def take_observed(self) -> list[tuple[int, LinkSample]]:
        """The masks of the exchanges completed since the last call (what really arrived), each with the step
        it was launched at: an exchange that runs in the background completes steps after its launch."""
        done, self._completed = self._completed, []
        return done

    def start_block_average(self, x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *,
                            weights: torch.Tensor | None = None, servers: torch.Tensor | None = None,
                            overwrite: bool = False, segment_bytes: int = 0) -> _InFlight:
        """:meth:`block_average`, launched in the background: the exchange runs in its lane's thread while the
        caller computes, and ``wait()`` blocks only for what has not arrived yet (then gathers the masks, a
        collective: every rank waits for its handles in the same order, as a schedule makes them). Unless the
        caller gives ``x`` up (``overwrite``), the lane reads a copy of it."""
        return self._launch(x, weights, servers, segment_bytes, copy=not overwrite)

    def block_average(self, x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *,
                      weights: torch.Tensor | None = None, servers: torch.Tensor | None = None,
                      overwrite: bool = False, segment_bytes: int = 0) -> torch.Tensor:
        """RPS's exchange over UDP. ``up`` and ``down`` (the drawn masks) are not used: the loss is the
        network's, and :attr:`observed` holds what arrived. ``segment_bytes`` must be :attr:`segment_bytes`
        (the run's ``network.segment_bytes``), so that the caller's masks and counters have its layout."""
        # ``overwrite`` is allowed, not required: the result is a fresh tensor (``x`` supplies the segments
        # whose average was lost while the result is received).
        return self._launch(x, weights, servers, segment_bytes, copy=False).wait()

    def _launch(self, x: torch.Tensor, weights: torch.Tensor | None, servers: torch.Tensor | None,
                segment_bytes: int, *, copy: bool) -> _InFlight:
        if segment_bytes != self.segment_bytes:
            raise ValueError(f"the udp transport's unit of loss is a {self.segment_bytes}-byte segment; "
                             f"block_average was called with segment_bytes={segment_bytes} "
                             f"(set network.segment_bytes = {self.segment_bytes})")
        deadline = self._deadline_s
        if self._fixed_s is None and self._round == 0:
            deadline = max(deadline, first_deadline_s(x[0].numel() * x.element_size()))
        # A background exchange reads its row while the caller goes on, so it gets a copy of its own.
        row = x[0].clone() if copy else x[0].contiguous()
        k = self._round % len(self.exchanges)
        future = self._threads[k].submit(self.exchanges[k].block_average, row, self._round, deadline_s=deadline,
                                         weights=weights, servers=servers)
        self._round += 1
        step = self._step
        if self._quorum is None:
            return _InFlight(future, lambda done: self._complete(done, step, row, servers))
        # With live membership the masks' round runs in the lane's control thread as soon as the exchange is
        # done: a delayed exchange's wait then finds it taken care of too.
        rnd = self._submit(lambda: self._exchanged(future), thread=k)
        return _InFlight(rnd, lambda done: self._completed_round(done, step, row, servers))

    def _propose(self, stats: ExchangeStats) -> float:
        """This rank's proposal of the next exchange's deadline, having seen ``stats``."""
        if self._fixed_s is not None:
            return self._fixed_s
        with self._adaptive_lock:
            self._adaptive.observe_stats(stats)
            return self._adaptive.propose()

    def _exchanged(self, future: Future) -> tuple[bytes, Any]:
        """In a control thread: the exchange's result, and this rank's part of its masks' round."""
        result = future.result()
        _, up_obs, down_obs, stats = result
        return _mask_record(up_obs, down_obs, self._propose(stats)).numpy().tobytes(), result

    def _complete(self, future: Future, step: int, row: torch.Tensor, servers: torch.Tensor | None) -> torch.Tensor:
        """The result of the exchange launched at ``step`` from ``row`` (gloo's control plane): waits for it,
        counts it, gathers every rank's masks and the next deadline (a collective)."""
        t0 = time.perf_counter()
        result = future.result()
        self.wait_s += time.perf_counter() - t0
        _, up_obs, down_obs, stats = result
        parts = self._all_gather(_mask_record(up_obs, down_obs, self._propose(stats)), fill=None)
        return self._finish(result, parts, (), step, row, servers)

    def _completed_round(self, rnd: _ControlRound, step: int, row: torch.Tensor,
                         servers: torch.Tensor | None) -> torch.Tensor:
        """The result of the exchange launched at ``step`` from ``row`` (live membership): waits for it and for
        its masks' round (which ran in a control thread), and takes the round in. A rank found dead in that
        round left no record of what reached it, so the averages it served in this exchange count as lost:
        every rank keeps its own values of those blocks, and the masks say so (the simulator's replay then
        computes the same)."""
        t0 = time.perf_counter()
        taken = self._take(rnd)
        self.wait_s += time.perf_counter() - t0
        _, up_obs, _, _ = taken.extra
        w, nseg = up_obs.shape
        parts = [torch.frombuffer(bytearray(taken.parts[r]), dtype=torch.uint8) if r in taken.live else
                 _nothing_arrived(r, w, nseg) for r in range(self.num_workers)]
        gone = tuple(r for r in range(self.num_workers) if r not in taken.live)
        return self._finish(taken.extra, parts, gone, step, row, servers)

    def _finish(self, result: tuple[torch.Tensor, torch.Tensor, torch.Tensor, ExchangeStats],
                parts: list[torch.Tensor], gone: tuple[int, ...], step: int, row: torch.Tensor,
                servers: torch.Tensor | None) -> torch.Tensor:
        """Counts an exchange, and makes every rank's masks (``parts``) the run's; ``gone``: the ranks that left
        no record (dead), whose blocks every rank keeps its own values of."""
        new, up_obs, _, stats = result
        self.last_stats = stats
        t = self._totals
        t["sent"] += stats.sent
        t["received"] += stats.received
        t["expected"] += sum(stats.expected)
        t["late"] += stats.late
        t["rejected"] += stats.rejected
        t["closed_by_deadline"] += sum(c == "deadline" for c in stats.closed_by)
        t["repeated"] += stats.repeated
        t["grace_s"] += stats.grace_s
        self._observed = self._masks_from(parts, up_obs.shape, step, gone)
        self._completed.append((step, self._observed))
        if gone:
            w = self.num_workers
            srv = servers.tolist() if servers is not None else list(range(w))
            sizes = block_sizes(row.numel(), w)
            for j in range(w):
                if srv[j] in gone:
                    start = sum(sizes[:j])
                    new[start:start + sizes[j]] = row[start:start + sizes[j]]
        return new[None]

    # ------------------------------------------------------------------ the control plane (gloo, or a quorum)

    def _all_gather(self, x: torch.Tensor, *,
                    fill: float | Callable[[int], torch.Tensor] | None) -> list[torch.Tensor]:
        """Every rank's ``x`` (the same shape and dtype on every rank), in rank order. With live membership,
        the ranks that are dead or were just left out give ``fill`` (a value, a function of the rank, or None:
        the mean of the others' values)."""
        if self._quorum is None:
            parts = [torch.empty_like(x) for _ in range(self.num_workers)]
            dist.all_gather(parts, x.contiguous())
            return parts
        self._drain()   # the rounds in flight come first
        own = x.contiguous().numpy().tobytes()
        taken = self._take(self._submit(lambda: (own, None)))
        got = {r: _from_bytes(taken.parts[r], x) for r in taken.live}
        if len(got) == self.num_workers:
            return [got[r] for r in range(self.num_workers)]
        if callable(fill):
            return [got[r] if r in got else fill(r) for r in range(self.num_workers)]
        stand_in = torch.stack(list(got.values())).mean(dim=0) if fill is None else torch.full_like(x, fill)
        return [got.get(r, stand_in) for r in range(self.num_workers)]

    def _submit(self, own: Callable[[], tuple[bytes, Any]], thread: int | None = None) -> _ControlRound:
        """A control round, submitted: numbered, with the deferred means that ride in it (their values follow
        this rank's part of the record, in the order they were started: the same on every rank, which starts
        them at the same points) and whether it may take ranks back, all fixed here, on the training loop's
        thread. ``own()`` gives this rank's part of the record and what the round carries back to the caller;
        it runs, with the round, in control thread ``thread`` (None: here, at once)."""
        q = self._rounds_quorum()
        carried, self._pending = self._pending, []
        admit, self._admitting = self._admitting, False
        # Each record starts with the first round this rank has not taken in: a round every survivor has taken
        # in is done with, and its keys go (:meth:`_Quorum.sweep`).
        head = struct.pack("<q", self._rounds[0].seq if self._rounds else q.seq)
        rnd, live = _ControlRound(q.take_seq(), carried), q.live
        tail = b"".join(mean.payload for mean in carried)
        for mean in carried:
            mean.round = rnd

        def run() -> tuple[_RoundResult, Any]:
            mine, extra = own()
            return q.round(rnd.seq, head + mine + tail, live, admit), extra

        self._rounds.append(rnd)
        if thread is None:
            try:
                rnd.future.set_result(run())
            except Exception as exc:    # raised where the round is taken in, in order
                rnd.future.set_exception(exc)
        else:
            rnd.future = self._control_threads[thread].submit(run)
        return rnd

    def _rounds_quorum(self) -> _Quorum:
        if self._quorum is None:    # a programming error: gloo's control plane makes no rounds
            raise RuntimeError("control rounds need live membership (heartbeat_timeout_s)")
        return self._quorum

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
        while True:
            try:
                result, extra = rnd.future.result(timeout=HEARTBEAT_S)
                break
            except TimeoutError:    # (a round that ran across a pause of this process)
                self._rounds_quorum().ask_if_paused(self._rounds_quorum().client())
        self._rounds.popleft()
        q, records = self._rounds_quorum(), result.records
        size = len(records[self.rank])
        live = tuple(r for r in q.live if r in records)
        for r in live:
            if len(records[r]) != size:
                raise RuntimeError(f"control round: rank {r}'s record has {len(records[r])} bytes where this "
                                   f"rank's has {size} (the ranks' control calls differ)")
        q.sweep(rnd.seq, result.keys, below=min(struct.unpack_from("<q", records[r])[0] for r in live))
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

    def take_membership(self) -> list[tuple[int, torch.Tensor]]:
        """Membership changes the survivors agreed on since the last call: (the step from which it holds, bool
        [W] live). Empty without live membership."""
        done, self._changes = self._changes, []
        return done

    def mean(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        if self._quorum is None:
            return super().mean(x, weights)
        parts = self._all_gather(x, fill=0)
        return _live_mean(parts, self._quorum.live, weights)

    def start_mean(self, x: torch.Tensor, weights: torch.Tensor | None = None, *,  # type: ignore[override]
                   deferred: bool = False) -> Done | _Reduced | _Carried:
        """:meth:`mean`, started. With live membership a mean is a control round: at once, or with
        ``deferred`` in the next control round that any call makes (the masks of an exchange, say), in the
        records that round exchanges anyway, so that it costs no round of its own; ``wait()`` makes one if
        none came first. The live ranks are that round's."""
        if self._quorum is None:
            return super().start_mean(x, weights)
        if not deferred:    # a round of its own, in a control thread: a delayed mean is waited for later
            own, like = x.contiguous().numpy().tobytes(), x.contiguous()
            rnd = self._submit(lambda: (own, None), thread=self._quorum.seq % len(self._control_threads))
            return _InFlight(rnd, lambda done: self._mean_of(done, like, weights))
        mean = _Carried(self, x, weights)
        self._pending.append(mean)
        return mean

    def _mean_of(self, rnd: _ControlRound, like: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        return self._mean_from(self._take(rnd).parts, like, weights)

    def _mean_from(self, parts: dict[int, bytes], like: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        """The mean of the live ranks' values (``parts``, by rank, as bytes of ``like``'s shape and dtype)."""
        rows = [_from_bytes(parts[r], like) if r in parts else torch.zeros_like(like) for r in range(self.num_workers)]
        return _live_mean(rows, sorted(parts), weights)

    def _carry_pending(self) -> None:
        """A control round for the deferred means alone."""
        self._all_gather(torch.empty(0, dtype=torch.uint8), fill=0)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """All workers' rows; with live membership a dead rank's row is the mean of the live ones (what it would
        take when it rejoins)."""
        if self._quorum is None:
            return super().gather(x)
        return torch.cat(self._all_gather(x, fill=None))

    def barrier(self) -> None:
        """Every live rank got here (a gloo barrier, or a quorum round)."""
        if self._quorum is None:
            dist.barrier()
        else:
            self._all_gather(torch.empty(0, dtype=torch.uint8), fill=0)

    def _masks_from(self, parts: list[torch.Tensor], shape: torch.Size, step: int,
                    gone: tuple[int, ...]) -> LinkSample:
        """Every rank's observed masks (:func:`_mask_record`, ``shape`` [W, S] each) as the run's [W, W, S]
        masks, and the agreed deadline of the next round (the largest proposal). ``gone``: the ranks that left no
        record (dead): nothing reached them, and what they served counts as lost."""
        w, nseg = shape
        every = torch.stack(parts)                                  # [rank, 2 W S + 8]
        n = w * nseg
        # Rank r's up_obs[i, k] is up[sender i, server r, k]; its down_obs[s, k] is down[server s, worker r, k].
        up = every[:, :n].view(w, w, nseg).transpose(0, 1).bool().contiguous()
        down = every[:, n:2 * n].view(w, w, nseg).transpose(0, 1).bool().contiguous()
        self._deadline_s = max(struct.unpack("<d", bytes(p[2 * n:].tolist()))[0] for p in parts if p[2 * n:].any())
        for r in gone:
            down[r] = False
            down[r, r] = True
        return LinkSample(step, up, down, self.segment_bytes)

    def transport_stats(self, before: dict[str, Any] | None = None) -> dict[str, Any]:
        """The run's datagram counters summed over the ranks (a collective), plus ``before`` (the same table
        from the run's checkpoint, when it was resumed), the observed loss rate 1 - received / expected, and
        with live membership the changes (:attr:`membership_log`)."""
        names = list(self._totals)
        total = torch.stack(self._all_gather(torch.tensor([float(self._totals[k]) for k in names],
                                                          dtype=torch.float64), fill=0)).sum(dim=0)
        t = dict(zip(names, (v if k.endswith("_s") else int(v) for k, v in zip(names, total.tolist())), strict=True))
        out: dict[str, int | float] = {
            "datagrams_sent": t["sent"], "datagrams_received": t["received"], "datagrams_expected": t["expected"],
            "late": t["late"], "rejected": t["rejected"], "phases_closed_by_deadline": t["closed_by_deadline"],
            "datagrams_repeated": t["repeated"], "grace_wait_s": round(t["grace_s"], 6)}
        for key, value in (before or {}).items():
            if key in out:
                out[key] += value if key.endswith("_s") else int(value)
        expected = out["datagrams_expected"]
        out["observed_loss"] = 1 - out["datagrams_received"] / expected if expected else 0.0
        if self._quorum is not None:
            out["membership_changes"] = [*(before or {}).get("membership_changes", []), *self.membership_log]
            # Each is a wait on the control store (two round trips): what a step costs on a WAN.
            out["control_rounds"] = int((before or {}).get("control_rounds", 0)) + self._quorum.seq
            out["store_rto_min_ms"] = self._quorum.store_rto_min_ms     # this rank's (None: the kernel's 200 ms)
        return out


FIRST_DEADLINE_S = 1.0
FIRST_DEADLINE_S_PER_MB = 0.1


def first_deadline_s(row_bytes: int) -> float:
    """The adaptive deadline's first round, which has no earlier rounds to learn from: 1 s plus 0.1 s per MB
    of the row (a 1e7-value float32 row: 5 s), so that a large model's first phases are not closed while
    most of their datagrams are still on the way. A phase that completes does not wait for it."""
    return FIRST_DEADLINE_S + FIRST_DEADLINE_S_PER_MB * row_bytes / 1e6


def udp_comm(settings: DistConfig, *, heartbeat: bool = False, lanes: int = 1,
             latency_ms: Sequence[Sequence[float]] | None = None, joining: JoinStore | None = None,
             key_text: str | None = None, master_addr: str = "127.0.0.1") -> UdpDistComm:
    """The udp transport's comm for the ``[dist]`` settings, built by every rank together (a collective):
    ``shaky train --transport udp`` and ``RPSAverager(transport="udp")`` both start it here. A key file that
    one rank cannot read, a rank with no free port or keys that differ raise the same ValueError on every rank.

    ``lanes``: exchanges in flight at once (:class:`UdpDistComm`; more than :data:`MAX_LANES` are capped, the
    rest queue). ``latency_ms``: the network model's [W, W] one-way latencies, emulated where
    ``settings.emulate_latency`` (required then). ``joining``: a process started again for a dead rank
    (``shaky.job.rendezvous.run_in_progress``), built alone (it reads the others' addresses and asks to be taken
    back). ``key_text``: ``$SHAKY_KEY`` (:func:`load_key`); ``master_addr``: MASTER_ADDR (:func:`local_address`),
    both as the caller read them from the environment."""
    options = UdpOptions(datagram_bytes=settings.datagram_bytes, send_rate_mbps=settings.send_rate_mbps or None)
    latency_s = None
    if settings.emulate_latency:
        if latency_ms is None:
            raise ValueError("dist.emulate_latency needs the network's latencies (network.latency_ms)")
        latency_s = [float(v) / 1e3 for v in latency_ms[dist.get_rank() if joining is None else joining.rank]]
    comm = UdpDistComm(deadline_ms=None if settings.deadline_ms == "adaptive" else float(settings.deadline_ms),
                       key=(agreed_key(settings.key_file, key_text) if joining is None
                            else load_key(settings.key_file, key_text)),
                       ports=settings.port_range(), host=settings.host or None,
                       heartbeat=heartbeat, options=options, lanes=min(max(1, lanes), MAX_LANES),
                       latency_s=latency_s, heartbeat_timeout_s=settings.heartbeat_timeout_s if heartbeat else None,
                       joining=joining, master_addr=master_addr)
    warning = python_path_warning(options)
    if warning and comm.rank == 0:
        say(f"shaky: warning: {warning}")
    return comm


def broadcast_object(value: object) -> object:
    """Rank 0's ``value`` on every rank (a run directory, a measured compute time)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_object(value: object) -> list[object]:
    """Every rank's ``value``, by rank, on every rank."""
    values: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _mask_record(up_obs: torch.Tensor, down_obs: torch.Tensor, proposal: float) -> torch.Tensor:
    """A rank's part of an exchange's masks round: what reached it ([W, S] each), and its deadline proposal."""
    return torch.cat([up_obs.reshape(-1).to(torch.uint8), down_obs.reshape(-1).to(torch.uint8),
                      torch.frombuffer(bytearray(struct.pack("<d", proposal)), dtype=torch.uint8)])


def _nothing_arrived(rank: int, w: int, nseg: int) -> torch.Tensor:
    """A dead rank's part of a masks round: only its own links, and no proposal."""
    own = torch.zeros(2, w, nseg, dtype=torch.uint8)
    own[:, rank] = 1
    return torch.cat([own.reshape(-1), torch.zeros(8, dtype=torch.uint8)])


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
