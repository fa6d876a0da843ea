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
run is ever used. A record too large for one datagram (a gather of model rows) goes by the store alone.
"""

from __future__ import annotations

import hmac
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence

from shaky.comm.udp.sockets import DelayLine, bind_first_free

ASK_AGAIN_S = 0.005
"""How long a rank waits for a record it misses before it asks the sender again (plus the link's round trip
where latency is emulated), and again after that: a record lost on its way costs about this much."""
MAIL_RECORD_BYTES = 1200
"""The largest record sent by mail (a datagram of it fits any path's MTU); a larger one goes by the store."""
COPIES = 2
"""Each record is sent this many times: with a fraction p of packets lost, a record is missed with p ** 2."""

_MAGIC = b"shkM"
_HEADER = struct.Struct("<4scHq")       # magic, kind (R: a record, N: asking for one), sender, round
_TAG_BYTES = 16
_KEEP_ROUNDS = 4096
"""Rounds of this rank's own records kept to be sent again (a peer asks only for rounds in flight)."""


class RoundMail:
    """This rank's mailbox for control rounds' records (:class:`~shaky.membership.quorum.Quorum`).

    ``host``/``ports``: where its UDP socket binds (the first free port); ``key``/``run``: the run's udp key and
    id; ``latency_s``: the one-way latency to emulate to each rank (``dist.emulate_latency``), or None."""

    def __init__(self, rank: int, num_workers: int, key: bytes, run: bytes, host: str, ports: range,
                 latency_s: Sequence[float] | None = None) -> None:
        self.rank, self.num_workers = rank, num_workers
        self._key, self._run = key, run
        self._sock = bind_first_free(host, ports, socket.SOCK_DGRAM)
        self._sock.settimeout(0.2)
        self.address: tuple[str, int] = self._sock.getsockname()
        self._delays = list(latency_s) if latency_s and any(latency_s) else None
        self._line = DelayLine(self._sock) if self._delays else None
        self._peers: dict[int, tuple[str, int]] = {}
        self._cv = threading.Condition()
        self._got: dict[int, dict[int, bytes]] = {}
        """Records heard, by round, then by sender."""
        self._mine: dict[int, bytes] = {}
        """This rank's datagrams of recent rounds, to send again when asked."""
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
        """This rank's ``record`` of round ``seq``, sent to the ranks ``to`` (each :data:`COPIES` times)."""
        data = self._seal(b"R", seq, record)
        with self._cv:
            self._mine[seq] = data
            if len(self._mine) > _KEEP_ROUNDS:
                for old in sorted(self._mine)[:len(self._mine) - _KEEP_ROUNDS]:
                    del self._mine[old]
        for _ in range(COPIES):
            for r in to:
                self._send(data, r)

    def wait(self, seq: int, ranks: Sequence[int], give_up: Callable[[list[int]], bool]) -> dict[int, bytes] | None:
        """The records of round ``seq`` from every rank of ``ranks``, waiting for them and asking their senders
        again for those that do not come; None once ``give_up(missing)`` says so (asked every 50 ms while
        records are missing: a missing rank's heartbeat went silent, the round must go to the store)."""
        asked_at = {r: time.monotonic() for r in ranks}
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
                due = []
                for r in missing:
                    if now - asked_at[r] >= self._ask_after(r):
                        asked_at[r] = now
                        due.append(r)
                if due:
                    ask = self._seal(b"N", seq, b"")
                    self.asked += len(due)
                    self._cv.release()
                    try:
                        for r in due:
                            self._send(ask, r)
                    finally:
                        self._cv.acquire()
                    continue
                wake = min([asked_at[r] + self._ask_after(r) for r in missing] + [looked_at + 0.05])
                self._cv.wait(max(wake - now, 0.0005))

    def taken_below(self, seq: int) -> None:
        """Every round below ``seq`` is taken in: their records are dropped, and datagrams for them ignored."""
        with self._cv:
            if seq > self._floor:
                self._floor = seq
                for old in [s for s in self._got if s < seq]:
                    del self._got[old]

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

    def _seal(self, kind: bytes, seq: int, record: bytes) -> bytes:
        head = _HEADER.pack(_MAGIC, kind, self.rank, seq)
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
        magic, kind, sender, seq = _HEADER.unpack(head)
        with self._cv:
            if magic != _MAGIC or self._peers.get(sender) != addr or kind not in (b"R", b"N") or \
                    not hmac.compare_digest(tag, self._tag(head, record)):
                self.rejected += 1
                return
            if kind == b"N":
                again = self._mine.get(seq)
            else:
                again = None
                if seq >= self._floor:
                    self._got.setdefault(seq, {}).setdefault(sender, record)
                    self._cv.notify_all()
        if again is not None:
            self._send(again, sender)
