"""Agreement among the udp transport's survivors: rounds of small sealed records in a store rank 0 hosts.

:class:`Quorum` runs the rounds (every live rank's record, or a tombstone for a rank whose heartbeat went silent:
:mod:`shaky.membership.heartbeat`), and agrees on the ranks started again to take back; :class:`ControlStore` is
the store it runs them in. ``shaky.comm.udp.control.QuorumControl`` carries the control plane's traffic (each
exchange's masks, means, gathers) in those rounds, and hands what they agreed on to
:class:`shaky.membership.Agreed`.
"""

from __future__ import annotations

import hmac
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import NamedTuple

import torch.distributed as dist

from shaky.comm.udp.sockets import bind_first_free
from shaky.membership.heartbeat import HEARTBEAT_JOIN_S
from shaky.membership.mail import MAIL_RECORD_BYTES, RoundMail

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


class NotTakenBack(RuntimeError):
    """A process started again for a dead rank was not taken back (the run ended first, or its store is gone)."""


class LeftBehind(RuntimeError):
    """This rank was declared dead by the others (its heartbeat stopped for longer than the timeout, e.g. while
    its process was frozen) and the run went on without it."""


class ForgedRecord(RuntimeError):
    """A value in the control store did not verify against the run's key: something outside the run wrote it.
    The rank stops rather than average it (the store, torch's TCPStore, takes writes from whoever reaches it)."""


MAIL_LOOK_S = 0.5
"""A round waiting by mail for a record this late asks the store, then every as long, whether a process started
again asks for the missing rank, and whether this rank was left out."""
SWEEP_LAG = 64
"""Rounds kept in the store past the last one every survivor has taken in: a record that went by mail may still
be on its way to the store (its TCP connection retransmitting) when the others are done with its round, and a
key deleted before its append arrives would stay."""

class Quorum:
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
        host, port = address      # the control store's (:class:`ControlStore`)
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
        """This process's own longest pause lately (``Heartbeat.paused_s``), where it has a heartbeat."""
        self.rank, self.prefix, self.timeout_s = rank, prefix, timeout_s
        self.live: tuple[int, ...] = tuple(range(num_workers))
        """The ranks alive as of the last round taken in, the same on every survivor (set by the comm)."""
        self._seq = 0
        self.live_key = f"{prefix}/live"
        """The live ranks as of the last change (every survivor writes the same): a rank that wakes after the
        rounds that left it out were cleaned away learns it here."""
        self.num_workers = num_workers
        self.mail: RoundMail | None = None
        """Where the rounds' records also travel as datagrams (:mod:`shaky.membership.mail`), set by the control
        plane; None: by the store alone."""
        self.mail_rounds = 0
        """Rounds that every live rank's record reached by mail (no store request waited for)."""
        self.store_rounds = 0
        """Rounds the store decided (a rank missing, one taken back, a record too large for mail)."""
        self.asking: frozenset[int] = frozenset()
        """The ranks out of the run for which a process started again asks to be taken back, as the heartbeat
        thread last looked (:meth:`look_for_joins`)."""

    def look_for_joins(self, store: dist.Store) -> None:
        """In the heartbeat thread, every beat (in its client): which ranks out of the run a process started again
        asks to take back (their join key is there). A round that may take ranks back carries what this rank
        saw, so that it needs no store request of its own (:meth:`round`)."""
        out = [r for r in range(self.num_workers) if r not in self.live]
        self.asking = frozenset(r for r in out if store.check([self.join_key(r)]))

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
        done = [k for k in self._swept if k < below - SWEEP_LAG]
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
        machine: ``Heartbeat.paused_s``) and they left it out meanwhile. Asked, not waited for: the rounds that
        left it out may be cleaned away, and a round in flight across the pause waits out its own timeout."""
        if self._paused_s is not None and self._paused_s() > self.timeout_s:
            self._check_still_live(store)
            self._paused_s(reset=True)

    def _check_still_live(self, store: dist.Store) -> None:
        if store.check([self.live_key]) and \
                str(self.rank) not in self.opened(self.live_key, store.get(self.live_key)).decode().split(","):
            raise self._left_behind()

    def leave(self, hosts: bool) -> None:
        """This rank's last use of the store. A rank whose process hosts the store (``hosts``: rank 0 under
        torchrun's agent store) waits until every other live rank says it is done with it (at most
        ``timeout_s``; a rank may have died since the last round): a store that went first would take the
        others' last round with it, and with packet loss they can be that far behind (they stopped with "rank 0
        ... is gone" after a finished run). The keeper waits for every heartbeat to stop by itself."""
        self._sweeper.stop()
        try:
            if not hosts:
                self._store.set(f"{self.prefix}/left/{self.rank}", "1")
                return
            others = [f"{self.prefix}/left/{r}" for r in self.live if r != self.rank]
            if others:
                self._store.wait(others, timedelta(seconds=self.timeout_s))
        except RuntimeError:    # the store is gone, or a rank died after the last round: nothing to wait for
            pass

    def round(self, seq: int, record: bytes, live: Sequence[int], admit: bool, *,
              by_store: bool = False) -> RoundResult:
        """Writes this rank's ``record`` in round ``seq`` (:meth:`take_seq`) and returns the round's records, by
        rank: those of the ``live`` ranks (as of the last round taken in when it was submitted) that were not
        declared dead in it. Rounds may run at once, in different threads; each of them agrees on its own
        records, and the comm takes them in in order (a rank is live after a round if it was before and its
        record is in). ``admit``: the round may take in ranks started again (the first round submitted in
        each step). The records travel by mail too (:attr:`mail`), unless ``by_store`` or a record is over
        MAIL_RECORD_BYTES: a round heard from every live rank by mail is done without waiting for the store.
        A round that may take ranks back while some are out carries in each record which of them this rank saw
        a process started again ask for (:attr:`asking`), and takes back those that any record names."""
        store, key = self.client(), f"{self.prefix}/{seq}"
        self.ask_if_paused(store)
        t0 = time.perf_counter()
        ranks = [self.rank, *(r for r in live if r != self.rank)]      # this rank's own key read first
        keys = [f"{key}/{r}" for r in ranks]
        asks = [r for r in range(self.num_workers) if r not in live] if admit else []
        if asks:    # a byte for each rank out of the run: whether this rank saw a process ask to take it back
            record = bytes(r in self.asking for r in asks) + record
        mail = self.mail if not by_store and len(record) <= MAIL_RECORD_BYTES else None
        if mail is None:
            self._hold(1)       # the append goes with the multi_get's first request: no answer of its own
        # First into the store (no answer: nothing waits), then by mail: a record heard by mail is in the store.
        store.append(keys[0], self.entry(keys[0], _RECORD + record))
        if mail is not None and len(ranks) > 1:
            mail.post(seq, record, ranks[1:])
            heard = mail.wait(seq, ranks[1:], self._mail_gives_up(store))
            if heard is not None:   # every live rank's record: the round is the one the store holds
                self.mail_rounds += 1
                return self._result({self.rank: record, **heard}, asks, keys[:1], t0)
        elif mail is not None:
            self.mail_rounds += 1
            return self._result({self.rank: record}, asks, keys[:1], t0)
        self.store_rounds += 1
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
        return self._result(records, asks, mine, t0)

    @staticmethod
    def _result(records: dict[int, bytes], asks: list[int], keys: list[str], t0: float) -> RoundResult:
        """A round's result from its records. With ``asks`` (the ranks out of the run, in a round that may take
        ranks back) each record starts with a byte for each: whether its rank saw a process started again ask
        for it. Every survivor holds the same records, so every survivor takes back the same ranks: those that
        any record names."""
        n = len(asks)
        admitted = tuple(r for i, r in enumerate(asks) if any(record[i] for record in records.values()))
        return RoundResult({r: record[n:] for r, record in records.items()}, admitted, keys,
                           time.perf_counter() - t0)

    def _mail_gives_up(self, store: dist.Store) -> Callable[[list[int]], bool]:
        """When a round waiting for records by mail goes to the store instead: a missing rank's heartbeat went
        silent for the timeout (the store decides whether its record came first), the round waited that long
        (a live rank whose mail does not get through, a port a firewall closes: the store has its record), or,
        looked at every :data:`MAIL_LOOK_S` once a record is that late, a process started again asks for a
        missing rank (its old one is gone) or the others left this rank out (LeftBehind: they no longer send it
        theirs)."""
        started, looked = time.monotonic(), [time.monotonic()]

        def give_up(missing: list[int]) -> bool:
            now = time.monotonic()
            if now - started >= self.timeout_s or any(self._silent_s(r) >= self.timeout_s for r in missing):
                return True     # (a live rank unheard that long: its mail does not get through; the store has it)
            if now - started < MAIL_LOOK_S or now - looked[0] < MAIL_LOOK_S:
                return False
            looked[0] = now
            self._check_still_live(store)
            return bool(store.check([self.join_key(r) for r in missing]))
        return give_up

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


class RoundResult(NamedTuple):
    records: dict[int, bytes]
    """The round's records, by rank (this rank's own included)."""
    admitted: tuple[int, ...]
    """Ranks started again that the round agreed to take back."""
    keys: list[str]
    """The round's keys this rank deletes once every survivor has taken the round in."""
    seconds: float
    """How long the round took this rank."""


_SEAL_BYTES = 16
"""The tag that follows every value the control plane writes (:meth:`Quorum.seal`)."""
_FRAME_BYTES = 4
"""The length before each entry appended to a control round's key (:meth:`Quorum.entry`)."""
_RECORD, _DEAD = b"R", b"D"
"""The first byte of an entry of a control round's key: a rank's record follows, or the rank was declared dead
(the key's first entry decides which)."""


KEEPER_ADDRESS_KEY = "shaky/keeper"
"""Set in the rendezvous store by a rank 0 whose keeper serves it (``shaky.job.keeper``): "MASTER_ADDR
MASTER_PORT", where the control rounds go too."""


class ControlStore:
    """Where the control plane's rounds (:class:`Quorum`) are held, an address every rank learns from the
    rendezvous store (``key``), a process started again for a rank too.

    - Ranks started by hand or by ``shaky launch``: the rendezvous store itself, which the keeper serves
      (:mod:`shaky.job.keeper`), a process of its own that outlives any rank, rank 0 included, and whose
      sockets have TCP's retransmission timeout lowered (:func:`shorten_store_retransmits`).
    - Under torchrun's agent, which hosts the rendezvous store out of reach of shaky's processes (with packets
      lost, its answers wait TCP's 200 ms minimum before they are sent again; 4 ranks, 5% of packets lost,
      ``torchrun --standalone``: about 200 ms a step, against about 40 with the rounds in rank 0's process): a
      TCPStore that rank 0 hosts in its own process, on the first free TCP port of ``dist.ports`` at its
      address (``dist.host``). torchrun's agent stops every rank when one fails, so this costs no survival.
    """

    def __init__(self, rendezvous: dist.Store, key: str, rank: int, host: str, ports: range, timeout_s: float,
                 joining: bool) -> None:
        self.timeout_s = timeout_s
        self._server: dist.TCPStore | None = None
        kept = rank == 0 and not joining and rendezvous.check([KEEPER_ADDRESS_KEY])
        self.hosted = rank == 0 and not joining and not kept
        """Whether this process hosts the store (rank 0 under torchrun's agent store); else the keeper does."""
        if kept:     # the rendezvous store, in the keeper's process
            rendezvous.set(key, f"ok {rendezvous.get(KEEPER_ADDRESS_KEY).decode()}")
        elif self.hosted:
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
        """Stops serving, where this process hosts the store (after every other live rank is done with it,
        :meth:`Quorum.leave`)."""
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
