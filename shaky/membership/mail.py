"""Control rounds' records as datagrams between the ranks: a round in which every live rank is heard costs no
TCP round trip.

A :class:`~shaky.membership.quorum.Quorum` round gathers one small record from every live rank. Its store (TCP to
rank 0's process) is what decides a round in which a rank may have died: every record is appended there, and a
rank found silent gets a tombstone, the key's first entry deciding. But most rounds lose nobody, and for those a
store is only a slow way to hand each rank the others' records: with a fraction of every packet lost, TCP waits
out its retransmission timers, and with latency each round costs two round trips to rank 0.

:class:`RoundMail` carries the same records as datagrams on a UDP socket of each rank's own. A rank appends its
record to the store (a request without an answer: nothing is waited for) and *then* sends it to every live rank,
twice; a rank that misses one asks its sender for it again (``N``, every :data:`ASK_AGAIN_S` plus the link's
round trip) until it has every live rank's, or until a missing rank's heartbeat has been silent for the timeout
(or a process started again asks for its rank): only then does the round go to the store, which decides it as
before. So a round that gets every record by mail has the records the store holds (each rank's append went into
its TCP connection before its datagrams left, and the kernel delivers what a killed process wrote), and every
rank, whichever way it took the round in, ends it with the same records.

Every datagram is sealed with the run's key (HMAC-SHA256, 16 bytes, as the store's values: ``Quorum.seal``) over
its run, kind, sender, round and record, and is taken only from a rank's known address: nothing from outside the
run is ever used.

A record larger than one datagram (an evaluation's mean of the model, a checkpoint's gather of rows) travels in
fragments of :data:`FRAGMENT_BYTES`, each sealed on its own, sent once (the bytes are many, and a receive buffer
filled twice over loses more than it gains), and put together by the receiver; a receiver that misses some asks
the sender for those by number. Only a record over :data:`MAIL_RECORD_BYTES` goes by the store alone.
"""

from __future__ import annotations

import fcntl
import hmac
import math
import socket
import struct
import termios
import threading
import time
from collections.abc import Callable, Sequence

from shaky.comm.udp.sockets import _SO_RCVBUFFORCE, _SO_SNDBUFFORCE, DelayLine, _set_buffer, bind_first_free

ASK_AGAIN_S = 0.005
"""How long a rank waits for a record it misses before it asks the sender again (plus the link's round trip
where latency is emulated), and again after that: a record lost on its way costs about this much."""
FRAGMENT_BYTES = 1200
"""The most of a record one datagram carries (with its header and tag it fits any path's MTU)."""
MAIL_RECORD_BYTES = 1 << 20
"""The largest record sent by mail (874 fragments); a larger one goes by the store alone."""
COPIES = 2
"""A record of one datagram is sent this many times: with a fraction p of packets lost, it is missed with
p ** 2. A record of several fragments is sent once, and what is missed is asked for again."""
LOSSY_COPIES = 3
"""Copies of a one-datagram record while the data plane finds the network lossy (its last round lost more than
1%: ``UdpExchange.lossy``, which also sends more copies of its streams' last datagrams): missed with p ** 3.
At 10% of every packet lost, 2 copies left about 1 round in 8 of 4 ranks waiting 5 ms to ask again."""
BUFFER_BYTES = 4 << 20
"""Receive and send buffer asked of the kernel for the mail socket (past the sysctl cap where this process
may): a record of many fragments arrives from every rank at once."""

_MAGIC = b"shkM"
_HEADER = struct.Struct("<4scHqHH")     # magic, kind (R: a fragment of a record, N: asking for one), sender,
                                        # round, fragment, fragments (R); an N's body: the fragments missed
_ASKED = struct.Struct("<H")
_MOST_ASKED = FRAGMENT_BYTES // _ASKED.size
_TAG_BYTES = 16
_KEEP_ROUNDS = 4096
"""Rounds of this rank's own records kept to be sent again (a peer asks only for rounds in flight)."""


class RoundMail:
    """This rank's mailbox for control rounds' records (:class:`~shaky.membership.quorum.Quorum`).

    ``host``/``ports``: where its UDP socket binds (the first free port); ``key``/``run``: the run's udp key and
    id; ``latency_s``: the one-way latency to emulate to each rank (``dist.emulate_latency``), or None;
    ``lossy``: whether the network loses datagrams now (:data:`LOSSY_COPIES` copies then)."""

    def __init__(self, rank: int, num_workers: int, key: bytes, run: bytes, host: str, ports: range,
                 latency_s: Sequence[float] | None = None, lossy: Callable[[], bool] = lambda: False) -> None:
        self.rank, self.num_workers = rank, num_workers
        self._lossy = lossy
        self._key, self._run = key, run
        self._sock = bind_first_free(host, ports, socket.SOCK_DGRAM)
        self._sock.settimeout(0.2)
        _set_buffer(self._sock, socket.SO_RCVBUF, _SO_RCVBUFFORCE, BUFFER_BYTES)
        _set_buffer(self._sock, socket.SO_SNDBUF, _SO_SNDBUFFORCE, BUFFER_BYTES)
        self.address: tuple[str, int] = self._sock.getsockname()
        self._delays = list(latency_s) if latency_s and any(latency_s) else None
        self._line = DelayLine(self._sock) if self._delays else None
        self._peers: dict[int, tuple[str, int]] = {}
        self._cv = threading.Condition()
        self._got: dict[int, dict[int, bytes]] = {}
        """Records heard, by round, then by sender."""
        self._parts: dict[int, dict[int, tuple[int, dict[int, bytes]]]] = {}
        """Records not yet whole, by round, then by sender: their count of fragments, and those heard, by
        number."""
        self._mine: dict[int, list[bytes]] = {}
        """This rank's datagrams of recent rounds (a record's fragments), to send again when asked."""
        self._sent_all_at: dict[tuple[int, int], float] = {}
        """When this rank last sent all of its record of a recent round of several fragments, by round and
        receiver."""
        self._heard_at: dict[tuple[int, int], float] = {}
        """When the last fragment of a record not yet whole arrived, by round and sender."""
        self._floor = 0
        """Rounds below it are taken in: what comes for them is dropped."""
        self.rejected = 0
        """Datagrams dropped: not from a rank's address, too short, or not sealed with the run's key."""
        self.asked = 0
        """Times this rank asked a sender for a record again."""
        self._closed = False
        self._thread = threading.Thread(target=self._receive, name="shaky-round-mail", daemon=True)
        self._thread.start()

    def set_peers(self, peers: dict[int, tuple[str, int]]) -> None:
        """Every rank's mail address (at the start, and when ranks are taken back: theirs changed)."""
        with self._cv:
            self._peers = {r: (a[0], int(a[1])) for r, a in peers.items() if r != self.rank}

    def post(self, seq: int, record: bytes, to: Sequence[int]) -> None:
        """This rank's ``record`` of round ``seq`` (at most :data:`MAIL_RECORD_BYTES`), sent to the ranks
        ``to``: each :data:`COPIES` (:data:`LOSSY_COPIES`) times if it fits one datagram, else in fragments,
        once."""
        if len(record) > MAIL_RECORD_BYTES:
            raise ValueError(f"a record of {len(record)} bytes is over MAIL_RECORD_BYTES = {MAIL_RECORD_BYTES}")
        count = max(1, -(-len(record) // FRAGMENT_BYTES))
        data = [self._seal(b"R", seq, record[i * FRAGMENT_BYTES:(i + 1) * FRAGMENT_BYTES], i, count)
                for i in range(count)]
        with self._cv:
            self._mine[seq] = data
            if len(self._mine) > _KEEP_ROUNDS:
                for old in sorted(self._mine)[:len(self._mine) - _KEEP_ROUNDS]:
                    del self._mine[old]
        for _ in range(1 if count > 1 else LOSSY_COPIES if self._lossy() else COPIES):
            for r in to:
                for datagram in data:
                    self._send(datagram, r)
        if count > 1:
            with self._cv:
                self._sent_all_at.update(((seq, r), time.monotonic()) for r in to)

    def wait(self, seq: int, ranks: Sequence[int], give_up: Callable[[list[int]], bool]) -> dict[int, bytes] | None:
        """The records of round ``seq`` from every rank of ``ranks``, waiting for them and asking their senders
        again for those that do not come; None once ``give_up(missing)`` says so (asked every 50 ms while
        records are missing: a missing rank's heartbeat went silent, the round must go to the store)."""
        asked_at = {r: time.monotonic() for r in ranks}
        times_asked = dict.fromkeys(ranks, 0)
        looked_at = time.monotonic()
        with self._cv:
            while True:
                got = self._got.get(seq, {})
                missing = [r for r in ranks if r not in got]
                if not missing:
                    return {r: got[r] for r in ranks}
                now = time.monotonic()
                if now - looked_at >= 0.05:
                    looked_at = now
                    self._cv.release()
                    try:
                        if give_up(missing):
                            return None
                    finally:
                        self._cv.acquire()
                    continue
                # A record is asked for once it has been quiet a while, twice as long after each of the first
                # asks (5, 10, 20, 20 ... ms), and, while datagrams wait unread in the socket (this rank's
                # receiving thread is behind: what it asks for may be there), not before four times as long.
                due = [r for r in missing if now - self._quiet_since(seq, r, asked_at[r]) >=
                       self._ask_every(r, times_asked[r])]
                if due and self._unread():
                    due = [r for r in due if now - self._quiet_since(seq, r, asked_at[r]) >=
                           4 * self._ask_every(r, times_asked[r])]
                for r in due:
                    asked_at[r] = now
                    times_asked[r] += 1
                if due:
                    asks = [(r, self._ask(seq, r)) for r in due]
                    self.asked += len(due)
                    self._cv.release()
                    try:
                        for _ in range(self._copies()):
                            for r, ask in asks:
                                self._send(ask, r)
                    finally:
                        self._cv.acquire()
                    continue
                wake = min([self._quiet_since(seq, r, asked_at[r]) + self._ask_every(r, times_asked[r])
                            for r in missing] + [looked_at + 0.05])
                self._cv.wait(max(wake - now, 0.0005))

    def taken_below(self, seq: int) -> None:
        """Every round below ``seq`` is taken in: their records are dropped, and datagrams for them ignored."""
        with self._cv:
            if seq > self._floor:
                self._floor = seq
                for held in (self._got, self._parts):
                    for old in [s for s in held if s < seq]:
                        del held[old]
                for old in [k for k in self._heard_at if k[0] < seq]:
                    del self._heard_at[old]

    def done_below(self, seq: int) -> None:
        """Every live rank has taken in every round below ``seq``: none will ask for this rank's records of
        them again."""
        with self._cv:
            for old in [s for s in self._mine if s < seq]:
                del self._mine[old]
            for old in [k for k in self._sent_all_at if k[0] < seq]:
                del self._sent_all_at[old]

    def close(self) -> None:
        self._closed = True
        try:    # wakes the receiving thread now, not at its next timeout
            self._sock.sendto(b"", self._sock.getsockname())
        except OSError:
            pass
        if self._line is not None:
            self._line.close()
        self._thread.join(timeout=1.0)
        self._sock.close()

    # ------------------------------------------------------------------------------------------------------------

    def _copies(self) -> int:
        """Copies of an ask, and of what is sent again for one: two while the network is lossy."""
        return 2 if self._lossy() else 1

    def _ask_every(self, r: int, times_asked: int) -> float:
        return self._ask_after(r) * min(2 ** times_asked, 4)

    def _ask_after(self, r: int) -> float:
        return ASK_AGAIN_S + (2 * self._delays[r] if self._delays else 0.0)

    def _send(self, data: bytes, r: int) -> None:
        addr = self._peers.get(r)
        if addr is None:
            return
        if self._line is not None and self._delays is not None:
            self._line.put(data, addr, self._delays[r])
            return
        try:
            self._sock.sendto(data, addr)
        except OSError:     # a full buffer, an ICMP error from an earlier datagram: this one is lost
            pass

    def _unread(self) -> bool:
        """Whether a datagram waits in the socket, not yet taken by the receiving thread."""
        try:
            return struct.unpack("i", fcntl.ioctl(self._sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0] > 0
        except OSError:
            return False

    def _quiet_since(self, seq: int, r: int, asked_at: float) -> float:
        """Since when rank ``r``'s record of round ``seq`` has been quiet: the last ask for it, or the last of
        its fragments to arrive if later (a record still coming in is not asked for)."""
        return max(asked_at, self._heard_at.get((seq, r), asked_at))

    def _ask(self, seq: int, r: int) -> bytes:
        """An ask for rank ``r``'s record of round ``seq``: the fragments missed (the first
        :data:`_MOST_ASKED`; the rest in a later ask), or none named (all of them) if none came yet."""
        held = self._parts.get(seq, {}).get(r)
        if held is None:
            return self._seal(b"N", seq, b"")
        count, parts = held
        missed = [i for i in range(count) if i not in parts][:_MOST_ASKED]
        return self._seal(b"N", seq, b"".join(_ASKED.pack(i) for i in missed))

    def _seal(self, kind: bytes, seq: int, record: bytes, index: int = 0, count: int = 1) -> bytes:
        head = _HEADER.pack(_MAGIC, kind, self.rank, seq, index, count)
        return head + record + self._tag(head, record)

    def _tag(self, head: bytes, record: bytes) -> bytes:
        return hmac.digest(self._key, b"shaky round mail\0" + self._run + head + record, "sha256")[:_TAG_BYTES]

    def _receive(self) -> None:
        while not self._closed:
            try:
                data, addr = self._sock.recvfrom(65535)
            except TimeoutError:
                continue
            except OSError:     # closed, or an ICMP error from an earlier send
                if self._closed:
                    return
                continue
            if self._closed:
                return
            self._take(data, addr)

    def _take(self, data: bytes, addr: tuple[str, int]) -> None:
        if len(data) < _HEADER.size + _TAG_BYTES:
            self.rejected += 1
            return
        head, record, tag = data[:_HEADER.size], data[_HEADER.size:-_TAG_BYTES], data[-_TAG_BYTES:]
        magic, kind, sender, seq, index, count = _HEADER.unpack(head)
        with self._cv:
            if magic != _MAGIC or self._peers.get(sender) != addr or kind not in (b"R", b"N") or \
                    not hmac.compare_digest(tag, self._tag(head, record)):
                self.rejected += 1
                return
            again: list[bytes] = []
            if kind == b"N":
                mine = self._mine.get(seq)
                # An ask for all of a record of several fragments that crossed them on their way (sent all
                # of it lately) is not answered: the asker, once they are in, asks for what it misses by number.
                now = time.monotonic()
                crossed = not record and now - self._sent_all_at.get((seq, sender), -math.inf) < ASK_AGAIN_S
                if mine is not None and len(record) % _ASKED.size == 0 and not crossed:
                    asked = [i for (i,) in _ASKED.iter_unpack(record)] if record else range(len(mine))
                    again = [mine[i] for i in asked if i < len(mine)] or mine    # (none of them: all)
                    if len(again) == len(mine) > 1:
                        self._sent_all_at[seq, sender] = now
            elif seq >= self._floor and sender not in self._got.get(seq, {}):
                self._fragment(seq, sender, index, count, record)
        for _ in range(self._copies() if again else 0):
            for datagram in again:
                self._send(datagram, sender)

    def _fragment(self, seq: int, sender: int, index: int, count: int, record: bytes) -> None:
        """Fragment ``index`` of ``count`` of ``sender``'s record of round ``seq``, kept (under the lock) until
        the record is whole. A fragment that disagrees with the others (their count, a size that no record of
        :data:`MAIL_RECORD_BYTES` has) is rejected: sealed with the run's key, it can come only from a rank
        that does not follow this protocol."""
        last = count - 1
        if not (index < count <= -(-MAIL_RECORD_BYTES // FRAGMENT_BYTES)) or len(record) > FRAGMENT_BYTES or \
                (index < last and len(record) != FRAGMENT_BYTES):
            self.rejected += 1
            return
        if count == 1:
            whole: bytes | None = record
        else:
            held, parts = self._parts.setdefault(seq, {}).setdefault(sender, (count, {}))
            if held != count:
                self.rejected += 1
                return
            parts.setdefault(index, record)
            self._heard_at[seq, sender] = time.monotonic()
            whole = None
            if len(parts) == count:
                whole = b"".join(parts[i] for i in range(count))
                del self._parts[seq][sender]
                self._heard_at.pop((seq, sender), None)
        if whole is not None:
            self._got.setdefault(seq, {})[sender] = whole
            self._cv.notify_all()
