"""The lossy data plane: RPS's two-phase block average as UDP datagrams, closed by deadlines.

RPS (Yu et al., ICML 2019) lets the network lose messages instead of resending them; this module is the
transport that actually does so. One :class:`UdpExchange` per rank binds one UDP socket and runs
:meth:`UdpExchange.block_average`:

- Phase 1: every rank cuts its row into W blocks (``block_sizes``) and each block into segments of
  ``segment_length(segment_bytes, itemsize)`` values (``segment_counts``), and sends block j's segments,
  one datagram each, to the rank that serves block j. The server averages each segment over the senders
  whose segment arrived before the phase closed (its own always counts), weighted by ``weights``.
- Phase 2: each server sends its averages to every rank; a rank takes the average of each segment that
  arrived before the phase closed and keeps its own values for the rest.

Nothing is ever resent. A phase closes when every expected datagram has arrived, when every sender's
final datagrams have arrived (the rest were lost: one sender's datagrams travel in order, so nothing
sent before them is still on the way; OptiReduce's early close), or at its deadline, whichever comes
first. The very last datagram of each sender's stream to a receiver goes with a copy (with
``UdpOptions.final_copies`` of them after a round in which this rank lost more than 1% of what it expected),
the copies flagged as repeats (and tagged as themselves): it is the one that says "that was all", and when it
and its copies are lost the receiver waits ``UdpOptions.final_grace_s`` for it (it may only be late): with p^2
or p^3 instead of p. A repeat whose original arrived is dropped without a count. What arrived is
reported as masks, which are the segment-level delivery masks of the simulator
(``LinkSample``) for this rank's links:

- ``up_obs`` bool [W, B, S], B the blocks this rank serves (in block order; 1 with the default servers):
  ``up_obs[i, t, k]`` = sender i's segment k of the t-th of them reached this rank in phase 1, i.e. that
  block's column ``up[:, j, :]`` of the run's [W, W, S] mask (sender, block, segment). Its own row is True.
- ``down_obs`` bool [W, S]: ``down_obs[j, k]`` = the average of block j's segment k reached this rank in
  phase 2, i.e. ``down[:, rank, :]`` of the [W, W, S] mask (block, worker, segment). The rows of the blocks
  it serves are True.

S = max(1, max_j S_j); padding entries (k >= S_j) are True. The masks are per block, as the simulator's are
(``LinkSample``): each block is a message of its own, so a rank that serves two (a dead rank's successor)
averages each over the senders whose segments of that block arrived, and a rank takes each block's average
where it arrived. With the default servers (rank j serves block j) the link and the block are the same thing.
:func:`run_masks` puts every rank's observations together.

The datagrams, and which of them are used, are described in :mod:`shaky.comm.udp.wire`.

Speed (``benchmarks/udp_probe.py`` and ``benchmarks/transport.py`` measure it): a block's datagrams are built
in one buffer with numpy (headers, payload copies) and tagged in one call. The compiled path
(``shaky/comm/_fastpath.c``, built by the install where a C compiler and OpenSSL's headers are found;
``UdpOptions.compiled``) sends them with ``sendmmsg``, several UDP segmentation offload sends (``UDP_SEGMENT``: up
to 44 datagrams of 1472 bytes each) a system call, and receives with ``recvmmsg`` on a socket with ``UDP_GRO``,
so that the kernel hands over up to 64 datagrams of one sender as one coalesced buffer; in C it cuts them apart,
checks each (header, address, round, place, tag) and copies its payload where the round puts it
(``shaky_drain``), and hands back to Python only what it does not take as it is (a repeat, another round, a
duplicate, anything to reject), which the rules below handle one by one. Python's path (no compiled library) sends
with ``sendmsg`` and GSO, takes coalesced batches (``UDP_GRO``) where the kernel forms them, checks a batch of one
sender's consecutive segments with one comparison of its headers, and goes datagram by datagram otherwise.

One call at a time per exchange. The call may run in a background thread while the caller computes;
the compiled path releases the GIL while it hashes and receives, the rest holds it, so it overlaps with
work that releases the GIL (torch's kernels), not with Python. Only this rank's deadline proposal is here
(:class:`AdaptiveDeadline`): ranks agree on a deadline over the control plane.
"""

from __future__ import annotations

import ctypes
import errno
import hmac
import math
import os
import select
import socket
import struct
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from shaky.comm import rps
from shaky.comm.udp.sockets import (_CMSG_SPACE, _MSG_TRUNC, _RECV_BUFFER, _SO_RCVBUFFORCE, _SO_SNDBUFFORCE,
                                    _SOL_UDP, _UDP_GRO, _UDP_SEGMENT, MAX_DATAGRAM_BYTES, MAX_GSO_SEGMENTS,
                                    RECV_BATCH, _batches, DelayLine, _has_gso, _resolve, _set_buffer,
                                    bind_first_free)
from shaky.comm import quant as _quant
from shaky.comm.udp.wire import (DTYPE_CODES, FINAL_DATAGRAMS, FLAG_FINAL, FLAG_REPEAT, HEADER, KEY_BYTES, MAGIC,
                                 OVERHEAD_BYTES, PHASES, ROUNDED_CODES, TAG_BYTES, VERSION, _Mac, _Packed)
from shaky.geometry import block_sizes, own_parts, segment_counts, segment_length
from shaky.native import FASTPATH


_GRO_SEGMENTS = 64
"""The most datagrams the kernel coalesces into one receive (UDP_GRO)."""
_REST_BYTES = 16 << 20
"""At most this many bytes of rows for a compiled receive's datagrams that go to the rules in Python."""
LOSSY_ROUND = 0.01
"""A round that lost more than this fraction of the datagrams a rank expected makes it send every copy of its
streams' last datagrams in the next (``UdpOptions.final_copies``)."""
_SEND_MESSAGES = 4
"""GSO sends (of up to 44 datagrams of 1472 bytes each) one compiled send takes to one destination before the
next destination's turn (and a receive); 4 a system call (sendmmsg)."""


class _CRound(ctypes.Structure):
    """``shaky_round`` of shaky/comm/_fastpath.c: a round's placement table for the compiled receive."""

    _fields_ = [("run", ctypes.c_uint64), ("round", ctypes.c_uint64), ("W", ctypes.c_uint32),
                ("payload", ctypes.c_uint32), ("dtype", ctypes.c_uint32), ("open1", ctypes.c_uint32),
                ("open2", ctypes.c_uint32), ("peer_keys", ctypes.c_void_p), ("dest", ctypes.c_void_p),
                ("got", ctypes.c_void_p), ("nseg", ctypes.c_void_p), ("lastlen", ctypes.c_void_p),
                ("count", ctypes.c_void_p), ("final", ctypes.c_void_p), ("last", ctypes.c_void_p)]


def python_path_warning(options: UdpOptions) -> str | None:
    """One line for a run whose data plane falls back to Python because the install did not build the compiled
    path (None when it uses it, or was told not to)."""
    if options.compiled and FASTPATH is None:
        return ("the udp fast path (shaky/comm/_fastpath.c) was not built by this install: the data plane runs "
                "in Python, several times slower (install a C compiler and OpenSSL's headers, e.g. apt-get install "
                "gcc libssl-dev, then reinstall shaky)")
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class UdpOptions:
    """How the data plane uses the network (every rank of a run must use the same ``datagram_bytes``)."""

    datagram_bytes: int = 1472
    """UDP payload bytes of a full datagram: header, segment and tag. 1472 fits a 1500-byte MTU (IPv4);
    the segment is ``datagram_bytes - 52`` bytes (``UdpExchange.segment_bytes``)."""
    buffer_bytes: int = 32 << 20
    """Receive and send buffer asked of the kernel (SO_RCVBUFFORCE where permitted, else capped at
    net.core.rmem_max / wmem_max); ``UdpExchange.info()`` says what was granted."""
    send_rate_mbps: float | None = None
    """Pace this rank's sending to this rate (a token bucket, one batch of burst); None: no pacing
    beyond interleaving destinations and receiving between batches."""
    offload: bool = True
    """Use UDP segmentation offload (UDP_SEGMENT) to send and receive coalescing (UDP_GRO) where the
    kernel has them; False sends and receives one datagram per system call."""
    final_copies: int = 2
    """Copies of a stream's very last datagram sent right after it, once this rank's previous round lost more
    than 1% of what it expected (one copy before and otherwise): the receiver waits ``final_grace_s`` only when
    all of them were lost (p^3 with two). A step of 4 ranks has 24 streams, so at 10% loss on every packet one
    copy left a grace wait in a fifth of the steps (about 5 ms a step of 19); two copies, in 2%."""
    final_grace_s: float = 0.02
    """When a sender's very last datagram was lost but another of its final ones arrived, wait this long
    (from when every sender got that far) for the rest before closing the phase early. The final datagrams
    leave back to back, so this only has to cover a sender being descheduled between two of them; it
    is waited only in phases whose last datagram from some sender was lost."""
    max_held: int = 1 << 16
    """At most this many authentic datagrams of later rounds are kept for when their round starts."""
    compiled: bool = True
    """Use the compiled fast path (``shaky/comm/_fastpath.c``: tags in C, ``sendmmsg`` and ``recvmmsg``, and every
    datagram of a receive checked and placed in C) where the install built it; False, or where it was not built:
    the same rules, datagram by datagram in Python. Both give the same results."""

    def __post_init__(self) -> None:
        _int_in("datagram_bytes", self.datagram_bytes, OVERHEAD_BYTES + 8, MAX_DATAGRAM_BYTES)
        _int_in("buffer_bytes", self.buffer_bytes, 1, 1 << 31)
        _int_in("max_held", self.max_held, 0, 1 << 30)
        _int_in("final_copies", self.final_copies, 0, 8)
        if self.send_rate_mbps is not None and not (_is_real(self.send_rate_mbps) and
                                                    0 < self.send_rate_mbps < math.inf):
            raise ValueError(f"send_rate_mbps must be a positive number or None, got {self.send_rate_mbps!r}")
        for name in ("offload", "compiled"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not (_is_real(self.final_grace_s) and 0 <= self.final_grace_s < math.inf):
            raise ValueError(f"final_grace_s must be a number >= 0, got {self.final_grace_s!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ExchangeStats:
    """What one :meth:`UdpExchange.block_average` call did (datagrams, not bytes)."""

    sent: int
    """Datagrams this rank sent, both phases (not counting ``repeated``)."""
    received: int
    """Datagrams that arrived in time and were used."""
    late: int
    """Authentic datagrams that arrived after their phase closed (this round's, or the previous round's
    first copy): counted, not used."""
    rejected: int
    """Datagrams dropped for one of ``REJECT_REASONS`` (see ``rejected_by``)."""
    rejected_by: dict[str, int]
    """``rejected`` by reason (only reasons that occurred)."""
    expected: tuple[int, int]
    """Datagrams this rank expected in phase 1 (as a server) and phase 2 (as a worker)."""
    closed_by: tuple[str, str]
    """How each phase closed: "complete" (all arrived), "final" (every sender's last datagrams are in,
    some datagrams were lost) or "deadline"."""
    phase1_s: float
    """Seconds from the start of the call until phase 1 closed (this rank's sending included)."""
    average_s: float
    """Seconds spent averaging and packing the averages between the phases."""
    phase2_s: float
    """Seconds from the start of phase 2 until it closed."""
    dropped_by_hook: int = 0
    """Datagrams the test-only ``fault`` hook dropped (not in ``sent``)."""
    repeated: int = 0
    """Copies of a stream's very last datagram this rank sent (see the module docstring)."""
    grace_s: float = 0.0
    """Seconds the phases waited in ``UdpOptions.final_grace_s`` (a sender's very last datagram and its
    repeat missing while its other final datagrams were in), both phases."""
    bytes_sent: int = 0
    """UDP payload bytes this rank sent, both phases (headers and tags included, the repeats too)."""


class AdaptiveDeadline:
    """This rank's proposal for a phase's deadline, from how long its recent phases took (OptiReduce-style).

    OptiReduce (Warraich et al., NSDI 2025) bounds every round of its all-reduce by a timeout estimated
    from completed rounds, so that a lost packet costs a bounded wait and a slow round does not stall
    training. Here: the ``percentile`` of the last ``window`` phase times times ``margin``, within
    [``floor_s``, ``cap_s``]. A phase closed by its deadline only says "longer than that"; when more of
    the window than the percentile leaves out (5% at 95) closed that way, the deadline was too short
    and the proposal is the last proposal times ``growth``. Phases that close early because every
    sender's final datagrams arrived are completed phases, so ordinary loss does not inflate it.

    The ranks must agree on one deadline (the caller's control plane, e.g. the max of all proposals
    by an all-reduce); this class holds only this rank's view.
    """

    def __init__(self, *, initial_s: float = 1.0, window: int = 32, percentile: float = 95.0, margin: float = 1.5,
                 floor_s: float = 0.005, cap_s: float = 10.0, growth: float = 2.0) -> None:
        for name, value in (("initial_s", initial_s), ("floor_s", floor_s), ("cap_s", cap_s)):
            if not (_is_real(value) and 0 < value < math.inf):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if floor_s > cap_s:
            raise ValueError(f"floor_s must be <= cap_s, got floor_s {floor_s} and cap_s {cap_s}")
        _int_in("window", window, 1, 1 << 20)
        if not (_is_real(percentile) and 0 < percentile <= 100):
            raise ValueError(f"percentile must be in (0, 100], got {percentile!r}")
        for name, value in (("margin", margin), ("growth", growth)):
            if not (_is_real(value) and 1 <= value < math.inf):
                raise ValueError(f"{name} must be a number >= 1, got {value!r}")
        self.percentile, self.margin, self.growth = float(percentile), float(margin), float(growth)
        self.floor_s, self.cap_s = float(floor_s), float(cap_s)
        self._samples: deque[tuple[float, bool]] = deque(maxlen=window)
        self._current = min(max(float(initial_s), self.floor_s), self.cap_s)

    def observe(self, seconds: float, *, complete: bool) -> None:
        """One phase's time; ``complete`` False if its deadline closed it."""
        if not (_is_real(seconds) and 0 <= seconds < math.inf):
            raise ValueError(f"seconds must be a number >= 0, got {seconds!r}")
        self._samples.append((float(seconds), bool(complete)))

    def observe_stats(self, stats: ExchangeStats) -> None:
        """Both phases of one exchange."""
        self.observe(stats.phase1_s, complete=stats.closed_by[0] != "deadline")
        self.observe(stats.phase2_s, complete=stats.closed_by[1] != "deadline")

    def propose(self) -> float:
        """This rank's proposal for the next phases' deadline, in seconds."""
        if self._samples:
            censored = sum(1 for _, complete in self._samples if not complete)
            if censored > len(self._samples) * (1 - self.percentile / 100):
                proposal = self._current * self.growth
            else:
                times = np.array([s for s, _ in self._samples])
                proposal = float(np.percentile(times, self.percentile)) * self.margin
            self._current = min(max(proposal, self.floor_s), self.cap_s)
        return self._current


Fault = Callable[[int, int, int, int], "str | None"]
"""Test-only hook: (phase, block, segment, destination rank) -> None to send, "drop" or "hold" (sent at the
end of this rank's call, after its phase 2 closed)."""


@dataclass
class QuantState:
    """This rank's part of a quantized block average's streams (``strategy.value_dtype``; the rule is
    :func:`shaky.comm.quant.quantized_block_average`'s, row by row): :meth:`UdpExchange.block_average` with it
    sends rounded differences where the rule says so and updates it in place."""

    fmt: _quant.ValueFormat
    ref: np.ndarray
    """[D]: this rank's reference row."""
    carry: np.ndarray
    """[D]: what its rounding left out (error feedback)."""
    sync: np.ndarray
    """[W blocks, S], the row's dtype: 1 + the server whose stream value of that segment this rank holds, 0: none."""
    present: bool = True
    """False for a rank back from the dead this round: it holds no stream."""


class UdpExchange:
    """One rank's end of the UDP data plane: a bound socket, the peers' addresses, a key and a run id.

    Typical use (the control plane carries addresses and the key)::

        ex = UdpExchange(rank=r, num_workers=W, key=key, run_id=run, host="10.0.0.5", ports=range(29500, 29600))
        store.set(f"udp/{r}", f"{ex.address[0]}:{ex.address[1]}")
        ex.connect([parse(store.get(f"udp/{i}")) for i in range(W)])
        new_row, up_obs, down_obs, stats = ex.block_average(row, round, deadline_s=0.5)
    """

    def __init__(self, *, rank: int, num_workers: int, key: bytes, run_id: int, host: str, ports: range,
                 options: UdpOptions | None = None, latency_s: Sequence[float] | None = None) -> None:
        """Binds the socket on ``host`` at the first free port of ``ports``.

        ``latency_s``: latency emulation, for tests and benchmarks on one machine (the kernel here has no
        netem): one number per rank, the one-way latency in seconds of the link from this rank to it. Every
        datagram is then held in an application-level delay line (a thread) and leaves that long after it
        was handed over, one datagram per system call (all zeros: the delay line's path with no delay, as a
        baseline). None: no delay line.

        Raises:
            ValueError / TypeError: an argument is out of range or of the wrong type (named).
            OSError: no port of ``ports`` is free on ``host`` (the message names the range), or ``host``
                is not an address of this machine.
        """
        _int_in("num_workers", num_workers, 1, 1 << 16)
        _int_in("rank", rank, 0, num_workers - 1)
        if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
            raise ValueError(f"key must be {KEY_BYTES} bytes, got "
                             f"{f'{len(key)} bytes' if isinstance(key, (bytes, bytearray)) else type(key).__name__}")
        _int_in("run_id", run_id, 0, (1 << 64) - 1)
        if not isinstance(ports, range) or len(ports) == 0 or ports.start < 1 or ports[-1] > 65535:
            raise ValueError(f"ports must be a non-empty range of ports in [1, 65535], got {ports!r}")
        options = UdpOptions() if options is None else options
        if not isinstance(options, UdpOptions):
            raise TypeError(f"options must be a UdpOptions, got {type(options).__name__}")
        if sys.byteorder != "little":
            raise RuntimeError("the UDP data plane sends raw little-endian floats; this machine is big-endian")
        delays = _check_latency(latency_s, num_workers)
        self.rank, self.num_workers, self.run_id, self.options = rank, num_workers, run_id, options
        self._fast = options.compiled and FASTPATH is not None
        self._mac = _Mac(bytes(key), compiled=self._fast)
        self._ip = _resolve(host, "host")
        if self._ip == "0.0.0.0":
            raise ValueError("host must be the address the other ranks reach this one at, not a wildcard "
                             f"(got {host!r}): datagrams are accepted only from the peers' own addresses")
        self.sock = bind_first_free(self._ip, ports)
        try:
            self._rcvbuf = _set_buffer(self.sock, socket.SO_RCVBUF, _SO_RCVBUFFORCE, options.buffer_bytes)
            self._sndbuf = _set_buffer(self.sock, socket.SO_SNDBUF, _SO_SNDBUFFORCE, options.buffer_bytes)
            self._gso = self._gro = False
            if options.offload:
                self._gso = _has_gso(self.sock)
            if options.offload:
                try:
                    self.sock.setsockopt(_SOL_UDP, _UDP_GRO, 1)
                    self._gro = True
                except OSError:
                    pass
            self.sock.setblocking(False)
        except BaseException:
            self.sock.close()
            raise
        self._latency = delays
        self._line = DelayLine(self.sock) if delays is not None else None
        if self._line is not None:
            self._gso = False       # each datagram is held on its own
        self.address: tuple[str, int] = self.sock.getsockname()[:2]
        """This rank's (ip, port): announce it to the other ranks."""
        self.segment_bytes = options.datagram_bytes - OVERHEAD_BYTES
        """Payload bytes of a full segment: the simulator's ``network.segment_bytes`` for the same masks."""
        self.fault: Fault | None = None
        """Test-only: decides the fate of each outgoing datagram (see :data:`Fault`)."""
        self._peers: list[tuple[str, int]] | None = None
        self._addr_rank: dict[tuple[str, int], int] = {}
        self._poll = select.poll()
        self._poll.register(self.sock, select.POLLIN)
        self._rbuf = bytearray(_RECV_BUFFER)
        self._rmv = memoryview(self._rbuf)
        if self._fast:
            # The compiled receive: up to RECV_BATCH messages a system call, each as long as the kernel's coalesced
            # batches may be; what the round does not take as it is comes back in rows of one datagram for the
            # rules in Python (room for every datagram of one full receive).
            stride = MAX_DATAGRAM_BYTES + 29 if self._gro else options.datagram_bytes
            per_msg = _GRO_SEGMENTS if self._gro else 1
            rest = max(per_msg, min(RECV_BATCH * per_msg, _REST_BYTES // options.datagram_bytes))
            msgs = RECV_BATCH // 4 if self._gro else RECV_BATCH      # 1 MiB of coalesced batches a call
            self._batch = np.empty((msgs, stride), np.uint8)
            self._rest = np.empty((rest, options.datagram_bytes), np.uint8)
            self._rlens = np.empty(rest, np.uint32)
            self._raddrs = np.empty(rest, np.uint64)
            self._rcount = ctypes.c_int()
            self._closed_round = _CRound(W=num_workers, open1=0, open2=0)
            self._closed_out = [np.zeros(2 * num_workers, t) for t in (np.uint32, np.uint8, np.uint8)]
            self._closed_round.count, self._closed_round.final, self._closed_round.last = \
                (a.ctypes.data for a in self._closed_out)
            self._bargs = (self._batch.ctypes.data, stride, msgs, per_msg, self._rest.ctypes.data,
                           options.datagram_bytes, rest, self._rlens.ctypes.data, self._raddrs.ctypes.data,
                           ctypes.addressof(self._rcount))
        self._peer_keys = np.zeros(0, np.uint64)
        self._buffers: dict[object, np.ndarray] = {}
        self._cur: _Round | None = None
        self._prev: _Round | None = None
        self._last_round = -1
        self._copies = min(1, self.options.final_copies)
        """Copies of each stream's very last datagram this round sends (``UdpOptions.final_copies``)."""
        self.lossy = False
        """Whether the last round lost more than :data:`LOSSY_ROUND` of the datagrams this rank expected."""
        self._later: list[tuple[bytes, int, tuple]] = []     # (datagram or GRO batch, its segment size or 0, sender)
        self._later_count = 0
        self._delayed: list[tuple[bytes, tuple[str, int]]] = []     # the fault hook's "hold"
        self._st: _Counters = _Counters()
        self._next_send = 0.0
        self._max_gso = min(MAX_GSO_SEGMENTS, MAX_DATAGRAM_BYTES // options.datagram_bytes)

    # ------------------------------------------------------------------------------------------ set-up

    def connect(self, peers: Sequence[tuple[str, int]]) -> None:
        """Every rank's (host, port) in rank order (this rank's own entry included, not used).

        Datagrams are accepted only from these addresses, so each must be the address the peer sends
        from: the host it bound (not a wildcard), as an IPv4 address or a name that resolves to one.
        """
        if len(peers) != self.num_workers:
            raise ValueError(f"peers must have one (host, port) per rank ({self.num_workers}), got {len(peers)}")
        resolved = []
        for i, peer in enumerate(peers):
            if not (isinstance(peer, (tuple, list)) and len(peer) == 2):
                raise ValueError(f"peers[{i}] must be (host, port), got {peer!r}")
            host, port = peer
            _int_in(f"peers[{i}] port", port, 1, 65535)
            resolved.append((_resolve(host, f"peers[{i}] host"), int(port)))
        if len(set(resolved)) != len(resolved):
            raise ValueError(f"peers must be distinct addresses, got {resolved}")
        self._peers = resolved
        self._addr_rank = {addr: i for i, addr in enumerate(resolved) if i != self.rank}
        self._addr_int = {addr: (int.from_bytes(socket.inet_aton(addr[0]), "big"), addr[1]) for addr in resolved}
        # Each rank's address as the compiled receive reports it (address << 16 | port); this rank's own: none.
        self._peer_keys = np.array([0 if i == self.rank else
                                    int.from_bytes(socket.inet_aton(ip), "big") << 16 | port
                                    for i, (ip, port) in enumerate(resolved)], np.uint64)

    def info(self) -> dict[str, object]:
        """What the kernel granted: address, buffer sizes, whether GSO/GRO are in use, values a datagram."""
        return {"address": f"{self.address[0]}:{self.address[1]}", "rcvbuf_bytes": self._rcvbuf,
                "sndbuf_bytes": self._sndbuf, "gso": self._gso, "gro": self._gro, "compiled": self._fast,
                "datagram_bytes": self.options.datagram_bytes, "segment_bytes": self.segment_bytes,
                "float32_per_datagram": segment_length(self.segment_bytes, 4)}

    def close(self) -> None:
        if self._line is not None:
            self._line.close()
        self.sock.close()

    def __enter__(self) -> UdpExchange:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------------------------------- exchange

    def block_average(self, row: torch.Tensor, round: int, *, deadline_s: float,  # noqa: A002 (the paper's word)
                      weights: torch.Tensor | Sequence[float] | None = None,
                      servers: torch.Tensor | Sequence[int] | None = None,
                      out: torch.Tensor | None = None, quant: QuantState | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, ExchangeStats]:
        """One RPS exchange of this rank's ``row`` with every other rank; see the module docstring.

        Args:
            row: this rank's values, 1-D, contiguous, on the CPU, float16/32/64 (every rank the same
                length and dtype).
            round: the exchange's number; strictly increasing from call to call, the same on every rank.
            deadline_s: each phase closes at the latest this many seconds after it started.
            weights: [W] each sender's weight in the servers' averages (None: equal). A rank of weight 0
                is out of the round (a dead worker): it is not waited for (its data would count for
                nothing) and no average is sent to it.
            servers: [W] the rank serving each block (None: rank j serves block j); the same on every rank.
            out: where to write the result (1-D like ``row``, not overlapping it); None: a new tensor.
            quant: send the values as rounded differences from the streams (:class:`QuantState`, updated in
                place; datagram by datagram in Python); None: as the row holds them.

        Returns:
            (new_row, up_obs, down_obs, stats): the averaged row; the masks, bool [W, B, S] and [W, S],
            described in the module docstring; the counters.
        """
        if self._peers is None:
            raise RuntimeError("UdpExchange.connect(peers) must be called before block_average")
        x = _check_row(row)
        rnd = _check_round(round, self._last_round)
        if not (_is_real(deadline_s) and 0 < deadline_s < math.inf):
            raise ValueError(f"deadline_s must be a positive number of seconds, got {deadline_s!r}")
        srv = _check_servers(servers, self.num_workers)
        w = _check_weights(weights, self.num_workers, x.dtype)
        result = _check_out(out, row) if out is not None else torch.empty_like(row)
        try:
            if quant is None:
                up_obs, down_obs, stats = self._exchange(x, result.numpy(), rnd, srv, w, deadline_s)
            else:
                up_obs, down_obs, stats = self._exchange_quant(x, result.numpy(), rnd, srv, w, deadline_s, quant)
        finally:
            self._cur = None
        return result, torch.from_numpy(up_obs), torch.from_numpy(down_obs), stats

    def _exchange(self, x: np.ndarray, res: np.ndarray, rnd: int, srv: list[int], w: np.ndarray | None,
                  deadline_s: float) -> tuple[np.ndarray, np.ndarray, ExchangeStats]:
        W, me = self.num_workers, self.rank
        t_start = time.perf_counter()
        self._st = _Counters()
        state = _Round(rnd, self.run_id, x, res, srv, w, me, W, self.segment_bytes, recv=self._recv_buffers)
        self._cur = state
        if self._fast:
            state.build_table(self._peer_keys)
        self._take_stash()

        # Phase 1: my blocks to their servers, interleaved with receiving theirs.
        jobs = []
        for s in _rotation(me, W):
            blocks = [j for j in range(W) if srv[j] == s and state.nseg[j] > 0]
            for j in blocks:
                arr = self._pack(("p1", j), 1, j, state, x[state.starts[j]:state.starts[j] + state.sizes[j]])
                jobs.append((s, j, arr))
        self._send_all(jobs, state, phase=1)
        closed1 = self._wait(state, 1, t_start + deadline_s)
        state.open1 = False
        t1 = time.perf_counter()

        # Between the phases: my averages, and their datagrams (one set for every rank).
        up_obs = state.up_mask()
        mine = [j for j in range(W) if srv[j] == me]
        jobs2 = []
        for t, j in enumerate(mine):
            if not state.nseg[j]:
                continue
            avg = res[state.starts[j]:state.starts[j] + state.sizes[j]]
            state.average(j, up_obs[:, t], avg)
            arr = self._pack(("p2", j), 2, j, state, avg)
            jobs2.extend((r, j, arr) for r in _rotation(me, W) if w is None or w[r] != 0)
        t2 = time.perf_counter()

        # Phase 2: my averages to every rank, interleaved with receiving the other servers'.
        self._send_all(jobs2, state, phase=2)
        closed2 = self._wait(state, 2, t2 + deadline_s)
        state.open2 = False
        t3 = time.perf_counter()
        down_obs = state.down_mask()
        state.keep_own_where_lost(down_obs)
        return up_obs, down_obs, self._end_round(state, (closed1, closed2), (t_start, t1, t2, t3))

    def _end_round(self, state: _Round, closed_by: tuple[str, str], times: tuple[float, ...]) -> ExchangeStats:
        """The round is over: kept as the previous one (without buffers), the fault hook's held datagrams sent,
        and its counters."""
        self._prev = state.finished()
        self._cur = None
        expected = state.expected1 + state.expected2
        self.lossy = self._st.received < expected * (1 - LOSSY_ROUND)
        self._copies = self.options.final_copies if self.lossy else min(1, self.options.final_copies)
        self._last_round = state.round
        delayed, self._delayed = self._delayed, []
        for data, addr in delayed:
            self._send_one(memoryview(data), addr)
        t_start, t1, t2, t3 = times
        return self._st.freeze(expected=(state.expected1, state.expected2), closed_by=closed_by,
                               phase1_s=t1 - t_start, average_s=t2 - t1, phase2_s=t3 - t2)

    def _exchange_quant(self, x: np.ndarray, res: np.ndarray, rnd: int, srv: list[int], w: np.ndarray | None,
                        deadline_s: float, q: QuantState) -> tuple[np.ndarray, np.ndarray, ExchangeStats]:
        """:meth:`_exchange` with rounded differences (:func:`shaky.comm.quant.quantized_block_average`'s rule for
        this rank's row): a group of ``P`` segments goes as one datagram of rounded values (``ROUNDED_CODES``,
        at the group's first segment) or as ``P`` datagrams of whole values (the row's dtype), built, sent and
        read in Python."""
        W, me, fmt = self.num_workers, self.rank, q.fmt
        t_start = time.perf_counter()
        self._st = _Counters()
        state = _Round(rnd, self.run_id, x, res, srv, w, me, W, self.segment_bytes, recv=self._recv_buffers,
                       fmt=fmt)
        self._cur = state
        self._take_stash()
        dim, seg, P, dtype = x.size, state.seg, state.parts, torch.from_numpy(x[:0]).dtype
        groups = _quant.scale_groups(dim, W, seg, fmt, state.itemsize)
        ids = groups[0].numpy() if groups is not None else None
        stream_of = np.asarray(srv, np.float64)[:, None] + 1                     # [block, 1]
        insync = (q.sync == stream_of) if q.present else np.zeros(q.sync.shape, bool)   # [block, S]
        gsync = _quant.in_groups(torch.from_numpy(insync), P).numpy()           # rounded: the whole group
        spread = _quant.spread_index(dim, W, seg, state.S).numpy()

        def per_value(mask: np.ndarray) -> np.ndarray:        # [block, S] -> [D]
            return mask.reshape(-1)[spread]

        def rounded_payload(codes: np.ndarray, scales: np.ndarray | None, a: int, b: int) -> bytes:
            if scales is None:
                return codes[a:b].tobytes()
            return codes[a:b].tobytes() + scales[ids[a]:ids[b - 1] + 1].astype("<f4").tobytes()

        def encode(d: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
            """Q(d) of a row: its codes as bytes to send (int8, or 16-bit floats viewed as int16), the int8 scales,
            and deq(Q(d))."""
            codes, scales = _quant.encode(torch.from_numpy(d)[None], fmt, groups)
            back = _quant.decode(codes, scales, dtype, groups)[0].numpy()
            raw = codes[0].view(torch.int16) if codes.dtype in (torch.bfloat16, torch.float16) else codes[0]
            return raw.numpy(), None if scales is None else scales[0].numpy(), back

        def grams(j: int, whole: np.ndarray, values: np.ndarray, codes: np.ndarray, scales: np.ndarray | None
                  ) -> list[tuple[int, bytes, int]]:
            """Block j's datagrams, (first segment, payload, dtype byte): a group whole (``whole`` at its first
            segment) as one datagram a segment of ``values``, else one datagram of its rounded ``codes``."""
            out = []
            for k in range(0, state.nseg[j], P):
                if whole[k]:
                    for m in range(k, min(k + P, state.nseg[j])):
                        a, b = state.span(j, m, 1)
                        out.append((m, values[a:b].tobytes(), state.dtcode))
                else:
                    a, b = state.span(j, k, P)
                    out.append((k, rounded_payload(codes, scales, a, b), state.qcode))
            return out

        # Phase 1: my values of every block I do not serve, a group rounded where I hold its stream on all of it.
        d = x - q.ref + q.carry
        codes, scales, d_back = encode(d)
        rounded_pos = per_value(gsync)
        carry = np.where(rounded_pos, d - d_back, 0).astype(q.carry.dtype)
        sends: list[tuple[int, list[bytes]]] = []
        for s_ in _rotation(me, W):
            out: list[bytes] = []
            for j in [j for j in range(W) if srv[j] == s_ and state.nseg[j] > 0]:
                out.extend(self._datagrams(state, 1, j, grams(j, ~gsync[j], x, codes, scales)))
            if out:
                sends.append((s_, out))
        self._send_datagrams(sends, phase=1)
        closed1 = self._wait(state, 1, t_start + deadline_s)
        state.open1 = False
        t1 = time.perf_counter()

        # Between the phases: decode what came rounded, average, the streams' new values.
        up_obs = state.up_mask()
        mine = [j for j in range(W) if srv[j] == me]
        sends2: dict[int, list[bytes]] = {r: [] for r in _rotation(me, W) if w is None or w[r] != 0}
        for t, j in enumerate(mine):
            if not state.nseg[j]:
                continue
            lo, hi = state.starts[j], state.starts[j] + state.sizes[j]
            vals = state.recv[j].view(x.dtype)                              # [W, nseg * seg]
            raw = state.recv[j]                                             # the same bytes
            used = up_obs[:, t].copy()
            for i, k in zip(*np.nonzero(state.rounded1[j] & up_obs[:, t, :state.nseg[j]])):
                if k % P:
                    continue                    # (a group's later segments: its datagram is at its first)
                a, b = state.span(j, k, P)
                if not gsync[j, k]:
                    used[i, k:k + P] = False    # a rounded segment of a stream this server does not hold
                    continue
                n = b - a
                payload = bytes(raw[i, k * state.payload:k * state.payload + state.rounded_bytes(j, k)])
                vals[i, k * seg:k * seg + n] = q.ref[a:b] + self._decoded(payload, fmt, n, dtype, ids, a, b)
            avg = res[lo:hi]
            state.average(j, used, avg)
            target = np.zeros(dim, x.dtype)
            target[lo:hi] = avg + q.carry[lo:hi] - q.ref[lo:hi]
            codes2, scales2, step = encode(target)
            streaming = per_value(gsync)[lo:hi]
            new = np.where(streaming, q.ref[lo:hi] + step[lo:hi], avg)
            carry[lo:hi] = np.where(streaming, target[lo:hi] - step[lo:hi], 0)
            avg[:] = new                                                    # (res[lo:hi]: what goes out whole)
            for r in sends2:
                came_whole = up_obs[r, t, :state.nseg[j]] & ~state.rounded1[j][r]
                whole = ~gsync[j, :state.nseg[j]] | \
                    _quant.any_in_groups(torch.from_numpy(came_whole), P).numpy()
                sends2[r].extend(self._datagrams(state, 2, j, grams(j, whole, res, codes2, scales2)))
        t2 = time.perf_counter()

        # Phase 2: my blocks' new values to every rank, whole or rounded.
        self._send_datagrams([(r, g) for r, g in sends2.items() if g], phase=2)
        closed2 = self._wait(state, 2, t2 + deadline_s)
        state.open2 = False
        t3 = time.perf_counter()
        down_obs = state.down_mask()
        take = down_obs.copy()
        for j in range(W):
            if srv[j] == me:
                continue
            for k in np.flatnonzero(state.got2[j, :state.nseg[j]] & state.rounded2[j, :state.nseg[j]]):
                if k % P:
                    continue
                a, b = state.span(j, k, P)
                payload = bytes(state.res_u8[a * state.itemsize:a * state.itemsize + state.rounded_bytes(j, k)])
                res[a:b] = q.ref[a:b] + self._decoded(payload, fmt, b - a, dtype, ids, a, b)
                # q_t is of use only where this rank holds the stream: elsewhere it keeps its own values
                take[j, k:k + P] &= insync[j, k:k + P]
        state.keep_own_where_lost(take)
        # The streams this rank now holds: every segment it took, its own blocks' included.
        q.ref = np.where(per_value(take), res, q.ref)
        q.sync = np.where(take, stream_of, 0.0).astype(q.sync.dtype)
        q.carry = carry
        return up_obs, down_obs, self._end_round(state, (closed1, closed2), (t_start, t1, t2, t3))

    @staticmethod
    def _decoded(payload: bytes, fmt, n: int, dtype: torch.dtype, ids: np.ndarray | None, a: int, b: int
                 ) -> np.ndarray:
        """deq of one rounded segment's payload (n values at [a, b) of the row; int8's scales after them)."""
        if not fmt.scale_bytes:
            raw = torch.frombuffer(bytearray(payload), dtype=torch.int16).view(fmt.dtype)
            return raw.to(dtype).numpy()
        codes = torch.frombuffer(bytearray(payload[:n]), dtype=torch.int8)
        scales = torch.frombuffer(bytearray(payload[n:]), dtype=torch.float32)
        per_value = torch.from_numpy(ids[a:b] - ids[a])
        return (codes.to(dtype) * scales.to(dtype)[per_value]).numpy()

    def _datagrams(self, state: _Round, phase: int, block: int, grams: list[tuple[int, bytes, int]]
                   ) -> list[bytes]:
        """Block ``block``'s datagrams of this phase, (first segment, payload, dtype byte) each, in the order of
        their segments: the headers :meth:`_Round.headers` gives, each with its own dtype byte and length (a
        rounded group's with the final flag where any of its segments' has it); the very last one with this
        round's copies (``_copies``), flagged as repeats (tagged as themselves)."""
        heads = state.headers(phase, block, self.rank)
        out = []
        for k, payload, code in grams:
            head = bytearray(heads[k].tobytes())
            head[4] = code
            if code == state.qcode:
                head[5] = int(np.bitwise_or.reduce(heads[k:k + state.parts, 5]))
            head[32:36] = struct.pack("<I", len(payload))
            body = bytes(head) + payload
            out.append(body + self._mac.tag(memoryview(body)))
        if out and out[-1][5] & FLAG_FINAL:       # (the last covers the block's last segment)
            copy = bytearray(out[-1][:-TAG_BYTES])
            copy[5] |= FLAG_REPEAT
            out.extend([bytes(copy) + self._mac.tag(memoryview(copy))] * self._copies)
        return out

    def _send_datagrams(self, sends: list[tuple[int, list[bytes]]], *, phase: int) -> None:
        """Each destination's datagrams, 16 at a time to each in turn, receiving between."""
        queues = [(dest, deque(grams)) for dest, grams in sends]
        while queues:
            still = []
            for dest, q in queues:
                for _ in range(min(16, len(q))):
                    data = q.popleft()
                    flags, block, k = data[5], int.from_bytes(data[24:28], "little"), \
                        int.from_bytes(data[28:32], "little")
                    fate = self.fault(phase, block, k, dest) if self.fault is not None else None
                    if fate == "drop":
                        self._st.dropped_by_hook += 1
                    elif fate == "hold":
                        self._delayed.append((data, self._peers[dest]))
                    elif self._send_one(memoryview(data), self._peers[dest]) and flags & FLAG_REPEAT:
                        self._st.sent -= 1
                        self._st.repeated += 1
                if q:
                    still.append((dest, q))
                self._drain()
            queues = still

    # --------------------------------------------------------------------------------------- sending

    def _buffer(self, key: object, nbytes: int) -> np.ndarray:
        buf = self._buffers.get(key)
        if buf is None or buf.size < nbytes:
            buf = self._buffers[key] = np.empty(nbytes, np.uint8)
        return buf[:nbytes]

    def _recv_buffers(self, j: int, shape: tuple[int, int], dtype: np.dtype) -> np.ndarray:
        nbytes = shape[0] * shape[1] * dtype.itemsize
        return self._buffer(("recv", j), nbytes).view(dtype).reshape(shape)

    def _pack(self, key: object, phase: int, block: int, state: _Round, values: np.ndarray) -> _Packed:
        """Block ``block``'s datagrams for ``values`` in one buffer: headers, payloads, tags."""
        seg, psize, nseg = state.seg, state.payload, state.nseg[block]
        size = OVERHEAD_BYTES + psize
        buf = self._buffer(key, nseg * size)
        rows = buf.reshape(nseg, size)
        whole = values.size // seg
        raw = values.view(np.uint8)
        last_len = raw.size - whole * psize     # bytes in a shorter last segment (0: none)
        flat = memoryview(buf)
        if self._fast:      # headers, payloads and tags in one pass in C
            heads = state.headers(phase, block, self.rank)
            FASTPATH.shaky_pack(self._mac._cp, buf.ctypes.data, size, heads.ctypes.data, values.ctypes.data, raw.size,
                                psize, nseg)
        else:
            self._pack_rows(rows, flat, state.headers(phase, block, self.rank), raw, whole, psize, last_len)
        last = OVERHEAD_BYTES + last_len if last_len else size
        repeat = None
        if rows[-1, 5] & FLAG_FINAL:        # the stream's very last datagram: its copy, flagged and tagged
            copy = bytearray(flat[(nseg - 1) * size:(nseg - 1) * size + last])
            copy[5] |= FLAG_REPEAT
            copy[-TAG_BYTES:] = self._mac.tag(memoryview(copy)[:-TAG_BYTES])
            repeat = bytes(copy)
        return _Packed(flat, size, nseg, last, phase, block, repeat, buf.ctypes.data)

    def _pack_rows(self, rows: np.ndarray, flat: memoryview, heads: np.ndarray, raw: np.ndarray, whole: int,
                   psize: int, last_len: int) -> None:
        """:meth:`_pack`'s rows in Python and numpy: payloads, headers, then the tags."""
        size = rows.shape[1]
        if whole:
            rows[:whole, HEADER.size:HEADER.size + psize] = raw[:whole * psize].reshape(whole, psize)
        if last_len:
            rows[whole, HEADER.size:HEADER.size + last_len] = raw[whole * psize:]
        rows[:, :HEADER.size] = heads
        if whole:
            tags = self._mac.tags(flat, range(0, whole * size, size), size - TAG_BYTES)
            rows[:whole, size - TAG_BYTES:] = np.frombuffer(tags, np.uint8).reshape(whole, TAG_BYTES)
        if last_len:
            o, end = whole * size, whole * size + HEADER.size + last_len
            flat[end:end + TAG_BYTES] = self._mac.tag(flat[o:end])

    def _send_all(self, jobs: list[tuple[int, int, _Packed]], state: _Round, *, phase: int) -> None:
        """Sends every job's datagrams, one batch per destination in turn, receiving between batches."""
        queues = []
        most = self._max_gso if self._gso else 16
        if self._compiled_send():
            most *= _SEND_MESSAGES
        for dest, _j, packed in jobs:
            queues.append((dest, packed, deque(_batches(packed.count, most))))
        # Blocks of the same destination go one after the other (its final datagrams come last).
        order: dict[int, list] = {}
        for dest, packed, q in queues:
            order.setdefault(dest, []).append((packed, q))
        active = [(dest, order[dest]) for dest in order]
        while active:
            still = []
            for dest, parts in active:
                packed, q = parts[0]
                first, count, one_by_one = q.popleft()
                self._send_rows(packed, first, count, dest, one_by_one)
                if not q:
                    parts.pop(0)
                if parts:
                    still.append((dest, parts))
                self._drain()
            active = still

    def _send_rows(self, packed: _Packed, first: int, count: int, dest: int, one_by_one: bool) -> None:
        """Rows ``first`` to ``first + count`` to ``dest``, and the repeats after the last row."""
        self._send_plain(packed, first, count, dest, one_by_one)
        if packed.repeat is None or first + count != packed.count:
            return
        for _ in range(self._copies):
            k = packed.count - 1
            fate = self.fault(packed.phase, packed.block, k, dest) if self.fault is not None else None
            if fate == "drop":
                self._st.dropped_by_hook += 1
            elif fate == "hold":
                self._delayed.append((packed.repeat, self._peers[dest]))
            elif self._send_one(memoryview(packed.repeat), self._peers[dest]):
                self._st.sent -= 1
                self._st.repeated += 1

    def _send_plain(self, packed: _Packed, first: int, count: int, dest: int, one_by_one: bool) -> None:
        addr = self._peers[dest]
        if self.fault is not None:
            fates = [self.fault(packed.phase, packed.block, k, dest) for k in range(first, first + count)]
            k = first
            for fate, run in _runs(fates):
                if fate is None:
                    self._send_batch(packed, k, run, addr, one_by_one)
                elif fate == "drop":
                    self._st.dropped_by_hook += run
                elif fate == "hold":
                    for kk in range(k, k + run):
                        o = kk * packed.size
                        self._delayed.append((bytes(packed.view[o:o + packed.length(kk)]), addr))
                else:
                    raise ValueError(f"fault hook must return None, 'drop' or 'hold', got {fate!r}")
                k += run
            return
        self._send_batch(packed, first, count, addr, one_by_one)

    def _compiled_send(self) -> bool:
        """Whether sends go through ``shaky_send`` (sendmmsg: many GSO sends a system call): the compiled path, with
        no pacing and no delay line (the fault hook goes row by row in :meth:`_send_plain` either way)."""
        return self._fast and self._line is None and self.options.send_rate_mbps is None

    def _send_compiled(self, packed: _Packed, first: int, count: int, addr: tuple[str, int], one_by_one: bool) -> None:
        """Rows ``first`` to ``first + count`` with ``shaky_send``: up to ``_SEND_MESSAGES`` GSO sends (or single
        datagrams, ``one_by_one``) a system call, waiting for room in the send buffer (receiving meanwhile)."""
        ip, port = self._addr_int[addr]
        send, fd = FASTPATH.shaky_send, self.sock.fileno()
        k, end = first, first + count
        while k < end:
            segs = 1 if one_by_one or not self._gso else self._max_gso
            n = send(fd, packed.address, packed.size, packed.count, packed.last, k, end - k, ip, port, segs,
                     _SEND_MESSAGES)
            if n > 0:
                self._st.sent += n
                self._st.bytes_sent += packed.length(k + n - 1) + (n - 1) * packed.size
                k += n
            elif -n in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
                self._wait_for_room()
            elif -n == errno.ENOBUFS:
                time.sleep(0.0001)
                self._drain()
            elif -n in (errno.ECONNREFUSED, errno.ECONNRESET):
                k += min(segs, end - k)     # an ICMP error from an earlier datagram: this send is lost, as any may be
            elif segs > 1 and -n in (errno.EIO, errno.EINVAL, errno.EMSGSIZE, errno.ENOPROTOOPT, errno.EOPNOTSUPP):
                self._gso = False     # the path or the device cannot segment: one datagram per message from now on
            else:
                raise OSError(-n, os.strerror(-n))

    def _send_batch(self, packed: _Packed, first: int, count: int, addr: tuple[str, int], one_by_one: bool) -> None:
        if self._compiled_send():
            self._send_compiled(packed, first, count, addr, one_by_one)
            return
        o = first * packed.size
        end = o + (count - 1) * packed.size + packed.length(first + count - 1)
        self._pace(end - o)
        if count > 1 and self._gso and not one_by_one:
            data = packed.view[o:end]
            try:
                self._retrying(lambda: self.sock.sendmsg([data], [(_SOL_UDP, _UDP_SEGMENT,
                                                                   struct.pack("H", packed.size))], 0, addr))
                self._st.sent += count
                self._st.bytes_sent += end - o
                return
            except (ConnectionRefusedError, ConnectionResetError):
                return      # an ICMP error from an earlier datagram: this batch is lost, as any may be
            except OSError as exc:
                if exc.errno not in (errno.EIO, errno.EINVAL, errno.EMSGSIZE, errno.ENOPROTOOPT,
                                     errno.EOPNOTSUPP):
                    raise
                self._gso = False     # the path or the device cannot segment: one datagram per call from now on
        for k in range(first, first + count):
            a = k * packed.size
            self._send_one(packed.view[a:a + packed.length(k)], addr)

    def _send_one(self, data: memoryview, addr: tuple[str, int]) -> bool:
        """Sends one datagram; False where an ICMP error from an earlier datagram came back instead (that one
        was lost; this one was not sent)."""
        if self._line is not None:
            self._line.put(bytes(data), addr, self._latency[self._addr_rank[addr]])
            self._st.sent += 1
            self._st.bytes_sent += len(data)
            return True
        try:
            self._retrying(lambda: self.sock.sendto(data, addr))
            self._st.sent += 1
            self._st.bytes_sent += len(data)
            return True
        except (ConnectionRefusedError, ConnectionResetError):
            return False

    def _wait_for_room(self) -> None:
        """Up to 10 ms for room in the send buffer, then whatever arrived meanwhile is received."""
        self._poll.modify(self.sock, select.POLLIN | select.POLLOUT)
        try:
            self._poll.poll(10)
        finally:
            self._poll.modify(self.sock, select.POLLIN)
        self._drain()

    def _retrying(self, send: Callable[[], object]) -> None:
        """Sends, waiting for room in the send buffer (receiving meanwhile) when the kernel has none."""
        while True:
            try:
                send()
                return
            except (BlockingIOError, InterruptedError):
                self._wait_for_room()
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:
                    raise
                time.sleep(0.0001)
                self._drain()

    def _pace(self, nbytes: int) -> None:
        rate = self.options.send_rate_mbps
        if rate is None:
            return
        now = time.perf_counter()
        while self._next_send > now:
            self._receive(self._next_send - now)
            now = time.perf_counter()
        self._next_send = max(self._next_send, now) + nbytes * 8 / (rate * 1e6)

    # ------------------------------------------------------------------------------------- receiving

    def _wait(self, state: _Round, phase: int, deadline: float) -> str:
        """Receives until the phase is complete ("complete"), every sender's last datagram is in or, where it
        was lost, one of its final datagrams and ``final_grace_s`` have passed ("final"), or the deadline
        ("deadline"); returns which."""
        progress = state.progress[phase]
        self._drain()
        grace_from = grace_until = None
        while True:
            if progress.pending == 0:
                if grace_from is not None:
                    self._st.grace_s += time.perf_counter() - grace_from
                return "complete" if progress.missing() == 0 else "final"
            if progress.unsettled == 0 and grace_until is None:
                grace_from = time.perf_counter()
                grace_until = grace_from + self.options.final_grace_s
            now = time.perf_counter()
            if grace_from is not None and (now >= grace_until or now >= deadline):
                self._st.grace_s += now - grace_from
            if grace_until is not None and now >= grace_until:
                return "final"
            if now >= deadline:
                return "deadline"
            until = deadline if grace_until is None else min(deadline, grace_until)
            self._receive(until - now)

    def _receive(self, timeout_s: float) -> None:
        if self._poll.poll(max(0, math.ceil(timeout_s * 1000))):
            self._drain()

    def _drain(self) -> None:
        """Handles every datagram waiting in the socket, without blocking."""
        if self._fast:
            self._drain_batches()
            return
        sock, mv = self.sock, self._rmv
        while True:
            try:
                if self._gro:
                    n, anc, flags, addr = sock.recvmsg_into([mv], _CMSG_SPACE)
                    if flags & _MSG_TRUNC:
                        self._reject("malformed")
                        continue
                    seg = 0
                    for level, kind, data in anc:
                        if level == _SOL_UDP and kind == _UDP_GRO and len(data) >= 4:
                            seg = struct.unpack_from("i", data)[0]
                    if 0 < seg < n:
                        self._on_batch(mv, n, seg, addr)
                        continue
                else:
                    n, addr = sock.recvfrom_into(mv)
            except (BlockingIOError, InterruptedError):
                return
            except (ConnectionRefusedError, ConnectionResetError):
                continue
            self._on_datagram(mv[:n], addr[:2], None)

    def _drain_batches(self) -> None:
        """The compiled path of :meth:`_drain` (``shaky_drain``): many coalesced datagrams a system call; those
        the round takes as they are (this run's and round's, an open phase, from the address of the sender the
        header names, where the round's geometry puts them, not received before, tag valid) are placed and
        counted in C; every other datagram comes back to :meth:`_on_datagram`, which applies the rules."""
        drain, fd, mac = FASTPATH.shaky_drain, self.sock.fileno(), self._mac._cp
        state = self._cur
        if state is not None and state.table is not None:
            table, outs = state.table, state.table_out
            table.open1, table.open2 = state.open1, state.open2
        else:
            table, outs = self._closed_round, self._closed_out
        ref = ctypes.addressof(table)
        while True:
            placed = drain(fd, mac, ref, *self._bargs)
            rest = self._rcount.value
            if placed > 0:
                count, final, last = outs
                for ps in np.flatnonzero(count).tolist():
                    phase, sender = 1 + ps // self.num_workers, ps % self.num_workers
                    state.progress[phase].arrived(sender, int(count[ps]), final=bool(final[ps]), last=bool(last[ps]))
                self._st.received += placed
            if rest:
                self._on_rest(rest)
            if placed < 0:
                if -placed in (errno.ECONNREFUSED, errno.ECONNRESET):
                    continue        # an ICMP error from an earlier datagram: that one is lost
                raise OSError(-placed, os.strerror(-placed))
            if rest <= len(self._rlens) - self._bargs[3]:
                return      # the socket is empty (shaky_drain stops early only when the rows might run out)

    def _on_rest(self, n: int) -> None:
        """The datagrams of a compiled receive that the round did not take as they were, one by one."""
        rows, lens, addrs = self._rest, self._rlens, self._raddrs
        for i in range(n):
            length, a = int(lens[i]), int(addrs[i])
            if length > rows.shape[1]:
                self._reject("malformed")       # longer than any datagram of the run: cut by the receive
                continue
            addr = (socket.inet_ntoa((a >> 16).to_bytes(4, "big")), a & 0xFFFF)
            self._on_datagram(memoryview(rows[i])[:length], addr, None)

    def _reject(self, reason: str, count: int = 1) -> None:
        self._st.rejected += count
        self._st.rejected_by[reason] = self._st.rejected_by.get(reason, 0) + count

    def _on_batch(self, mv: memoryview, n: int, size: int, addr: tuple) -> None:
        """A GRO batch: datagrams of ``size`` bytes from one address (the last may be shorter)."""
        addr = addr[:2]
        peer = self._addr_rank.get(addr)
        if peer is None:
            self._reject("unknown_sender", -(-n // size))
            return
        state = self._cur
        if state is not None and size >= OVERHEAD_BYTES and int.from_bytes(mv[16:24], "little") > state.round \
                and int.from_bytes(mv[8:16], "little") == self.run_id \
                and hmac.compare_digest(self._mac.tag(mv[:size - TAG_BYTES]), mv[size - TAG_BYTES:size]):
            # A faster peer's next round (its first datagram is authentic): kept whole until that round starts.
            self._keep_for_later(bytes(mv[:n]), size, addr, -(-n // size))
            return
        if not self._fast_batch(mv, n, size, peer):
            for o in range(0, n, size):
                self._on_datagram(mv[o:min(o + size, n)], addr, peer)

    def _fast_batch(self, mv: memoryview, n: int, size: int, peer: int) -> bool:
        """A batch of one sender's consecutive segments of one block, all as expected: headers compared with the
        ones the sender must have written, tags in one loop, payloads copied with one numpy copy. False
        (nothing done) for anything else, which then goes datagram by datagram."""
        state = self._cur
        hs = HEADER.size
        m = -(-n // size)
        last = n - (m - 1) * size - OVERHEAD_BYTES        # the last datagram's payload bytes
        if state is None or size != OVERHEAD_BYTES + state.payload or last < 0:
            return False
        _magic, _version, phase, _dtcode, _flags, sender, _run, _rnd, block, k0, _length = HEADER.unpack_from(mv, 0)
        if sender != peer:
            return False
        target = state.target(phase, block, sender)
        if target is None:
            return False
        dest, got, nseg = target
        if k0 + m > nseg or last != state.seg_bytes(block, k0 + m - 1) or got[k0:k0 + m].any():
            return False
        expected = state.headers(phase, block, sender)[k0:k0 + m]
        if np.ndarray((m, hs), np.uint8, mv, 0, (size, 1)).tobytes() != expected.tobytes():
            return False
        psize = state.payload
        full = m if last == psize else m - 1
        tail = full * size
        mac = self._mac
        ours = mac.tags(mv, range(0, tail, size), hs + psize)
        theirs = np.ndarray((full, TAG_BYTES), np.uint8, mv, hs + psize, (size, 1)).tobytes()
        if full < m:
            ours += mac.tag(mv[tail:tail + hs + last])
            theirs += bytes(mv[n - TAG_BYTES:n])
        if not hmac.compare_digest(ours, theirs):
            return False
        if full:
            dest[k0 * psize:(k0 + full) * psize].reshape(full, psize)[:] = \
                np.ndarray((full, psize), np.uint8, mv, hs, (size, 1))
        if full < m:
            start = (k0 + full) * psize
            dest[start:start + last] = np.frombuffer(mv, np.uint8, count=last, offset=tail + hs)
        got[k0:k0 + m] = True
        state.progress[phase].arrived(sender, m, final=bool(expected[-1, 5]),
                                      last=bool(expected[-1, 5]) and k0 + m == nseg)
        self._st.received += m
        return True

    def _on_datagram(self, d: memoryview, addr: tuple, peer: int | None) -> None:
        n = len(d)
        if n < OVERHEAD_BYTES:
            self._reject("malformed")
            return
        if peer is None:
            peer = self._addr_rank.get(addr)
            if peer is None:
                self._reject("unknown_sender")
                return
        h = HEADER.unpack_from(d, 0)
        if h[0] != MAGIC or h[1] != VERSION or h[10] != n - OVERHEAD_BYTES or h[2] not in PHASES or \
                h[4] & ~(FLAG_FINAL | FLAG_REPEAT):
            self._reject("malformed")
            return
        if h[5] != peer:
            self._reject("unknown_sender")
            return
        if h[6] != self.run_id:
            self._reject("wrong_run")
            return
        if not hmac.compare_digest(self._mac.tag(d[:n - TAG_BYTES]), d[n - TAG_BYTES:]):
            self._reject("bad_tag")
            return
        self._accept(h, d, addr)

    def _keep_for_later(self, data: bytes, size: int, addr: tuple, count: int) -> None:
        if self._later_count + count > self.options.max_held:
            self._reject("future_round", count)
        else:
            self._later.append((data, size, addr))
            self._later_count += count

    def _accept(self, h: tuple, d: memoryview, addr: tuple) -> None:
        """An authentic datagram: used, late, held for a later round, or rejected for its round or place."""
        _m, _v, phase, dtcode, flags, sender, _run, rnd, block, k, length = h
        cur = self._cur
        if cur is not None and rnd == cur.round:
            state = cur
        elif rnd > (cur.round if cur is not None else self._last_round):
            self._keep_for_later(bytes(d), 0, addr, 1)
            return
        elif self._prev is not None and rnd == self._prev.round:
            state = self._prev
        else:
            self._reject("past_round")
            return
        target = state.target(phase, block, sender, any_state=True)
        rounded = state.qcode is not None and dtcode == state.qcode
        if target is None or not (dtcode == state.dtcode or rounded) or k >= target[2] or \
                (rounded and k % state.parts) or \
                length != (state.rounded_bytes(block, k) if rounded else state.seg_bytes(block, k)):
            self._reject("malformed")
            return
        dest, got, nseg = target
        n = state.covers(block, k, dtcode)
        if flags & FLAG_REPEAT and not (flags & FLAG_FINAL and k + n == nseg):
            self._reject("malformed")       # only a stream's very last datagram is repeated
            return
        if got[k:k + n].any():
            if not flags & FLAG_REPEAT:     # a repeat whose original arrived: as expected, not counted
                self._reject("duplicate")
            return
        got[k:k + n] = True
        if state is not cur or not state.is_open(phase):
            self._st.late += 1
            return
        start = k * state.payload
        memoryview(dest)[start:start + length] = d[HEADER.size:HEADER.size + length]
        if rounded:
            state.mark_rounded(phase, block, sender, k, n)
        final = bool(flags & FLAG_FINAL)
        state.progress[phase].arrived(sender, n, final=final, last=final and k + n == nseg)
        self._st.received += 1

    def _take_stash(self) -> None:
        """What arrived during an earlier call for a later round: handled now (a still later round's is kept)."""
        later, self._later, self._later_count = self._later, [], 0
        for data, size, addr in later:
            if size:
                self._on_batch(memoryview(data), len(data), size, addr)
            else:
                self._on_datagram(memoryview(data), addr, None)


# ------------------------------------------------------------------------------------------- a round
class _Round:
    """One exchange's geometry, receive buffers and what has arrived.

    Phase 1 (this rank as a server): ``recv[j]`` [W, S_j * seg] holds each sender's block j (its own row
    included at averaging), ``got1[j]`` [W, S_j] which segments arrived. Phase 2 (as a worker): the
    servers' averages land straight in ``res`` (the result), ``got2`` [W blocks, S] which arrived.
    """

    def __init__(self, number: int, run_id: int, x: np.ndarray, res: np.ndarray, srv: list[int],
                 weights: np.ndarray | None, me: int, W: int, segment_bytes: int, *, recv: Callable,
                 fmt: _quant.ValueFormat | None = None) -> None:
        self.round, self.run_id, self.me, self.W, self.srv, self.weights = number, run_id, me, W, srv, weights
        self.table: _CRound | None = None
        self._headers: dict[tuple[int, int, int], np.ndarray] = {}
        self.x, self.res = x, res
        self.dtcode = DTYPE_CODES[x.dtype]
        self.itemsize = x.dtype.itemsize
        # A quantized round's segments of whole values leave room for int8's scale (shaky.comm.quant.fine_length).
        self.seg = _quant.fine_length(segment_bytes, self.itemsize, fmt)
        self.payload = self.seg * self.itemsize
        self.sizes = block_sizes(x.size, W)
        self.starts = [0] * W
        for j in range(1, W):
            self.starts[j] = self.starts[j - 1] + self.sizes[j - 1]
        self.nseg = segment_counts(x.size, W, self.seg) if x.size else [0] * W
        self.S = max(1, *self.nseg)
        self.served = [j for j in range(W) if srv[j] == me and self.nseg[j] > 0]
        self.got1 = {j: np.zeros((W, self.nseg[j]), bool) for j in self.served}
        self.recv = {j: recv(j, (W, self.nseg[j] * self.seg), x.dtype).view(np.uint8) for j in self.served}
        self.got2 = np.zeros((W, self.S), bool)
        self.res_u8 = res.view(np.uint8)
        self.open1 = self.open2 = True
        self.qcode: int | None = None       # a quantized round's (:meth:`quantize`): the dtype byte of rounded data
        self.fmt = None
        self.parts = 1                      # segments a datagram of rounded values holds
        # Who is waited for: every other rank that sends me something (phase 1: not a sender of weight 0).
        per_sender1 = sum(self.nseg[j] for j in self.served)
        self.exp1 = [0 if i == me or (weights is not None and weights[i] == 0) else per_sender1 for i in range(W)]
        out = weights is not None and weights[me] == 0     # this rank is out of the round: it gets nothing
        self.exp2 = [0 if s == me or out else sum(self.nseg[j] for j in range(W) if srv[j] == s) for s in range(W)]
        self.progress = {1: _Progress(self.exp1), 2: _Progress(self.exp2)}
        self.expected1 = sum(self.exp1)
        self.expected2 = sum(self.exp2)
        if fmt is not None:
            self.quantize(fmt)

    def build_table(self, peer_keys: np.ndarray) -> None:
        """The placement table of the compiled receive (``shaky_round``): for each (phase, block, sender) that
        :meth:`target` accepts, where its segments go and which of them arrived."""
        W = self.W
        dest = np.zeros((2, W, W), np.uint64)
        got = np.zeros((2, W, W), np.uint64)
        nseg = np.zeros((2, W, W), np.uint32)
        lastlen = np.zeros((2, W, W), np.uint32)
        for phase in PHASES:
            for block in range(W):
                if not self.nseg[block]:
                    continue
                for sender in range(W):
                    where = self.target(phase, block, sender, any_state=True)
                    if where is None or where[0] is None:
                        continue
                    e = (phase - 1, block, sender)
                    dest[e] = where[0].ctypes.data
                    got[e] = where[1].ctypes.data
                    nseg[e] = where[2]
                    lastlen[e] = self.seg_bytes(block, where[2] - 1)
        out = [np.zeros(2 * W, t) for t in (np.uint32, np.uint8, np.uint8)]
        keep = (peer_keys, dest, got, nseg, lastlen, *out)
        self.table = _CRound(run=self.run_id, round=self.round, W=W, payload=self.payload, dtype=self.dtcode,
                             open1=1, open2=1, peer_keys=peer_keys.ctypes.data, dest=dest.ctypes.data,
                             got=got.ctypes.data, nseg=nseg.ctypes.data, lastlen=lastlen.ctypes.data,
                             count=out[0].ctypes.data, final=out[1].ctypes.data, last=out[2].ctypes.data)
        self.table_out, self._table_arrays = out, keep

    def finished(self) -> _Round:
        """What the next round needs of this one (to tell late datagrams from repeated ones): no buffers."""
        self.table = self.table_out = self._table_arrays = None
        self.x = self.res = self.res_u8 = None
        self.recv, self._headers = {}, {}
        self.open1 = self.open2 = False
        return self

    def is_open(self, phase: int) -> bool:
        return self.open1 if phase == 1 else self.open2

    def headers(self, phase: int, block: int, sender: int) -> np.ndarray:
        """[S_j, 36] the headers of the sender's datagrams of this block and phase, exactly as it writes them.

        The final flag goes on the last ``FINAL_DATAGRAMS`` of the block's server's last block: a sender sends
        a receiver its blocks in increasing order (phase 1: the blocks that receiver serves; phase 2: the
        blocks the sender serves)."""
        key = (phase, block, sender)
        heads = self._headers.get(key)
        if heads is None:
            nseg = self.nseg[block]
            heads = np.empty((nseg, HEADER.size), np.uint8)
            heads[:] = np.frombuffer(HEADER.pack(MAGIC, VERSION, phase, self.dtcode, 0, sender, self.run_id,
                                                 self.round, block, 0, self.payload), np.uint8)
            heads[:, 28:32] = np.arange(nseg, dtype="<u4").view(np.uint8).reshape(nseg, 4)
            server = self.srv[block]
            if block == max(j for j in range(self.W) if self.srv[j] == server and self.nseg[j]):
                heads[max(0, nseg - FINAL_DATAGRAMS):, 5] = FLAG_FINAL
            last = self.seg_bytes(block, nseg - 1)
            heads[-1, 32:36] = np.frombuffer(struct.pack("<I", last), np.uint8)
            self._headers[key] = heads
        return heads

    def seg_bytes(self, block: int, k: int) -> int:
        n = self.sizes[block]
        return (min((k + 1) * self.seg, n) - k * self.seg) * self.itemsize

    def span(self, block: int, k: int, n: int) -> tuple[int, int]:
        """The row's values [a, b) in segments k .. k + n - 1 of ``block`` (fewer at its end)."""
        a = self.starts[block] + k * self.seg
        return a, min(a + n * self.seg, self.starts[block] + self.sizes[block])

    def quantize(self, fmt) -> None:
        """This round carries rounded differences in ``fmt`` beside whole values (``strategy.value_dtype``): a
        group of :func:`shaky.comm.quant.parts` segments a datagram, at its first segment."""
        self.fmt, self.qcode = fmt, ROUNDED_CODES[fmt.name]
        self.parts = _quant.parts(fmt, self.itemsize) if self.seg else 1
        self.rounded1 = {j: np.zeros((self.W, self.nseg[j]), bool) for j in self.served}
        self.rounded2 = np.zeros((self.W, self.S), bool)

    def rounded_bytes(self, block: int, k: int) -> int:
        """The payload bytes of the group of segments from k of ``block`` as rounded differences (values and their
        scale)."""
        a, b = self.span(block, k, self.parts)
        return int(self.fmt.bytes_of(b - a, _quant.scale_group(self.seg, self.fmt, self.itemsize)))

    def covers(self, block: int, k: int, code: int) -> int:
        """How many segments the datagram at segment k of ``block`` with dtype byte ``code`` holds."""
        return min(self.parts, self.nseg[block] - k) if code == self.qcode and self.qcode is not None else 1

    def mark_rounded(self, phase: int, block: int, sender: int, k: int, n: int) -> None:
        if phase == 1:
            self.rounded1[block][sender, k:k + n] = True
        else:
            self.rounded2[block, k:k + n] = True

    def target(self, phase: int, block: int, sender: int, any_state: bool = False
               ) -> tuple[np.ndarray | None, np.ndarray, int] | None:
        """(destination bytes, arrival row, segments) of a datagram that fits this round, else None.
        Without ``any_state``: only for a phase still open."""
        if not (0 <= block < self.W) or sender == self.me or not (0 <= sender < self.W):
            return None
        if phase == 1:
            if self.srv[block] != self.me or block not in self.got1 or not (any_state or self.open1):
                return None
            recv = self.recv.get(block)
            return (recv[sender] if recv is not None else None), self.got1[block][sender], self.nseg[block]
        if phase == 2:
            if self.srv[block] != sender or not (any_state or self.open2):
                return None
            dest = None
            if self.res_u8 is not None:
                start = self.starts[block] * self.itemsize
                dest = self.res_u8[start:start + self.sizes[block] * self.itemsize]
            return dest, self.got2[block], self.nseg[block]
        return None

    def up_mask(self) -> np.ndarray:
        """[W senders, blocks this rank serves (in block order), S]: sender i's segment k of that block arrived
        (its own always: it never travels; padding True)."""
        mine = [j for j in range(self.W) if self.srv[j] == self.me]
        up = np.ones((self.W, len(mine), self.S), bool)
        for t, j in enumerate(mine):
            if self.nseg[j]:
                up[:, t, :self.nseg[j]] = self.got1[j]
        up[self.me] = True
        return up

    def down_mask(self) -> np.ndarray:
        """[W blocks, S]: the average of block j's segment k reached this rank (True for the blocks it serves, and
        padding)."""
        down = np.ones((self.W, self.S), bool)
        for j in range(self.W):
            if self.srv[j] != self.me and self.nseg[j]:
                down[j, :self.nseg[j]] = self.got2[j, :self.nseg[j]]
        return down

    def average(self, j: int, up: np.ndarray, out: np.ndarray) -> None:
        """Block j's average per segment over the senders whose segment of it arrived (``up``, [W senders, S]:
        block j's column of :meth:`up_mask`; weighted), into ``out`` (:func:`shaky.comm.rps.server_average`; a
        segment that arrived from no sender of nonzero weight is NaN, as the simulator gives)."""
        nseg, n = self.nseg[j], self.sizes[j]
        vals = self.recv[j].view(self.x.dtype)          # [W, nseg * seg]
        vals[self.me, :n] = self.x[self.starts[j]:self.starts[j] + n]
        lost = ~up[:, :nseg]
        lost[self.me] = False
        if lost.any():   # what a lost segment's buffer holds is stale (maybe NaN): 0 times it must be 0
            vals.reshape(self.W, nseg, self.seg)[lost] = 0
        values = torch.from_numpy(vals[:, :n])
        weights = None if self.weights is None else torch.from_numpy(self.weights)
        arrived = up[:, :nseg]
        if (arrived == arrived[:, :1]).all():    # every segment from the same senders: one product for the block
            arrived = arrived[:, :1]
        share = rps.shares(torch.from_numpy(np.ascontiguousarray(arrived[:, None])), weights, values.dtype)
        rps.server_average(share, values[None], self.seg, out=torch.from_numpy(out)[None])

    def keep_own_where_lost(self, down: np.ndarray) -> None:
        """Where a server's average of a segment did not arrive, this rank keeps its own values
        (:func:`shaky.comm.rps.keep_own_where_lost`: the averages arrived in place, in ``res``)."""
        lost = ~down
        for j in range(self.W):
            if self.srv[j] == self.me or not self.nseg[j] or not lost[j, :self.nseg[j]].any():
                continue
            a, n = self.starts[j], self.sizes[j]
            rps.keep_own_where_lost(None, torch.from_numpy(self.x[a:a + n]).view(1, 1, n),
                                    torch.from_numpy(lost[j, :self.nseg[j]]).view(1, 1, -1), self.seg,
                                    out=torch.from_numpy(self.res[a:a + n]).view(1, 1, n))


def run_masks(ups: Sequence[torch.Tensor], downs: Sequence[torch.Tensor], servers: Sequence[int],
              gone: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's observations of one exchange (its ``up_obs`` and ``down_obs``, by rank) as the run's masks,
    ``LinkSample``'s per-block [W, W, S] ``up`` and ``down``, which the simulator replays exactly.

    ``ups[r]`` [W, c, S] holds the columns of the blocks rank r serves, in block order (c at least their number:
    a record may be padded to the most blocks any rank serves, so that every rank's is of one size). ``gone``: ranks
    that left no observations (dead before they were gathered: theirs are stand-ins): nothing of what they
    served went out, so every rank keeps its own values of those blocks, and the masks say so.
    """
    w = len(servers)
    srv = torch.as_tensor(list(servers), dtype=torch.int64)
    column = torch.zeros(w, dtype=torch.int64)   # block j is the column-th block its server serves
    for j in range(w):
        column[j] = int((srv[:j] == srv[j]).sum())
    most = max(1, *(u.shape[1] for u in ups))
    every_up = torch.stack([u if u.shape[1] == most else                 # [rank, sender, c, S]
                            torch.cat([u, u.new_ones(u.shape[0], most - u.shape[1], u.shape[2])], dim=1) for u in ups])
    up = every_up[srv, :, column].transpose(0, 1).contiguous()          # [sender, block, S]
    down = torch.stack(list(downs)).transpose(0, 1).contiguous()        # [block, worker, S]
    own = torch.from_numpy(own_parts(srv.tolist()))[..., None]
    for j in range(w):
        if int(srv[j]) in gone:
            down[j] = False
    return up | own, down | own.transpose(0, 1)


class _Progress:
    """How far each sender's stream of one phase has come: waited for, finishing (one of its final datagrams is
    in), or done (all of it, or its very last datagram, is in: what is still missing was lost)."""

    __slots__ = ("expected", "count", "stage", "pending", "unsettled")

    def __init__(self, expected: list[int]) -> None:
        self.expected = expected
        self.count = [0] * len(expected)
        self.stage = [2 if e == 0 else 0 for e in expected]
        self.pending = self.stage.count(0)      # senders not done
        self.unsettled = self.pending           # senders with none of their final datagrams in

    def arrived(self, sender: int, count: int, final: bool, last: bool) -> None:
        self.count[sender] += count
        stage = self.stage[sender]
        if stage == 2:
            return
        if last or self.count[sender] >= self.expected[sender]:
            self.stage[sender] = 2
            self.pending -= 1
            self.unsettled -= stage == 0
        elif final and stage == 0:
            self.stage[sender] = 1
            self.unsettled -= 1

    def missing(self) -> int:
        """Datagrams of waited-for senders not (yet) here."""
        return sum(e - c for e, c in zip(self.expected, self.count) if e)


@dataclass(slots=True)
class _Counters:
    bytes_sent: int = 0
    sent: int = 0
    received: int = 0
    late: int = 0
    rejected: int = 0
    dropped_by_hook: int = 0
    repeated: int = 0
    grace_s: float = 0.0
    rejected_by: dict[str, int] = field(default_factory=dict)

    def freeze(self, **timing) -> ExchangeStats:
        return ExchangeStats(sent=self.sent, received=self.received, late=self.late, rejected=self.rejected,
                             rejected_by=dict(self.rejected_by), dropped_by_hook=self.dropped_by_hook,
                             repeated=self.repeated, grace_s=self.grace_s, bytes_sent=self.bytes_sent, **timing)


# ------------------------------------------------------------------------------------------ helpers
def _runs(values: list) -> list[tuple[object, int]]:
    out: list[tuple[object, int]] = []
    for v in values:
        if out and out[-1][0] == v:
            out[-1] = (v, out[-1][1] + 1)
        else:
            out.append((v, 1))
    return out


def _rotation(me: int, W: int) -> list[int]:
    """The other ranks, starting after ``me``: ranks start on different destinations."""
    return [(me + d) % W for d in range(1, W)]


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def _int_in(name: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")


def _check_latency(latency_s: object, W: int) -> list[float] | None:
    """``latency_s`` as W non-negative finite seconds (None stays None)."""
    if latency_s is None:
        return None
    if isinstance(latency_s, (str, bytes)) or not isinstance(latency_s, Sequence) or len(latency_s) != W:
        raise ValueError(f"latency_s must hold one one-way latency per rank ({W}), got {latency_s!r}")
    delays = []
    for r, value in enumerate(latency_s):
        if not (_is_real(value) and 0 <= value < math.inf):
            raise ValueError(f"latency_s[{r}] must be a number of seconds >= 0, got {value!r}")
        delays.append(float(value))
    return delays


def _check_row(row: object) -> np.ndarray:
    if not isinstance(row, torch.Tensor):
        raise TypeError(f"row must be a torch.Tensor, got {type(row).__name__}")
    if row.dim() != 1 or not row.is_contiguous() or row.device.type != "cpu":
        raise ValueError(f"row must be 1-D, contiguous and on the CPU, got shape {list(row.shape)} on {row.device}"
                         f"{'' if row.is_contiguous() else ' (not contiguous)'}")
    x = row.detach().numpy()
    if x.dtype not in DTYPE_CODES:
        raise TypeError(f"row must be float16, float32 or float64, got {row.dtype}")
    return x


def _check_round(value: object, last: int) -> int:
    _int_in("round", value, 0, (1 << 64) - 1)
    if value <= last:
        raise ValueError(f"round must increase from call to call: got {value} after {last}")
    return int(value)


def _check_servers(servers: object, W: int) -> list[int]:
    if servers is None:
        return list(range(W))
    values = servers.tolist() if isinstance(servers, torch.Tensor) else list(servers)
    if len(values) != W or any(isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < W for s in values):
        raise ValueError(f"servers must be {W} ranks in [0, {W}), got {values}")
    return values


def _check_weights(weights: object, W: int, dtype: np.dtype) -> np.ndarray | None:
    if weights is None:
        return None
    w = weights.detach().cpu().numpy() if isinstance(weights, torch.Tensor) else np.asarray(weights)
    if w.shape != (W,) or not np.issubdtype(w.dtype, np.number) or not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError(f"weights must be {W} finite numbers >= 0, got {w.tolist()}")
    return w.astype(dtype)


def _check_out(out: object, row: torch.Tensor) -> torch.Tensor:
    if not isinstance(out, torch.Tensor) or out.shape != row.shape or out.dtype != row.dtype or \
            not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError(f"out must be a contiguous CPU tensor like row ({list(row.shape)}, {row.dtype})")
    a, b = out.data_ptr(), row.data_ptr()
    if a < b + row.numel() * row.element_size() and b < a + out.numel() * out.element_size():
        raise ValueError("out must not overlap row (row supplies the values whose average was lost)")
    return out
