"""The datagram format of the UDP data plane: header, payload, tag; and which datagrams are used.

Datagrams (:data:`HEADER`, then the payload, then the tag)::

    offset size  field
    0      2     magic b"SK"
    2      1     version (1)
    3      1     phase (1: to the server, 2: the server's average)
    4      1     dtype (1 float16, 2 float32, 3 float64)
    5      1     flags (bit 0: one of the sender's final datagrams to this receiver in this phase;
                        bit 1: a repeat of the very last one, see
                        :mod:`shaky.comm.udp.exchange`)
    6      2     sender rank
    8      8     run id
    16     8     round
    24     4     block
    28     4     segment index in the block
    32     4     payload length in bytes
    36     n     payload: the segment's values, raw little-endian floats
    36+n   16    tag: HMAC-SHA256(key, header + payload), first 16 bytes (RFC 4868's truncation)

Little-endian, struct format ``<2sBBBBHQQIII``; at the default 1472-byte datagram (a 1500-byte MTU less
the IPv4 and UDP headers) a segment holds 1420 bytes: 355 float32 or 177 float64 values.

A datagram is used only if it has the right length and layout, comes from the address of the peer its
header names, carries this run's id and a valid tag, belongs to the current round and a phase still open,
fits the round's geometry (block served by the sender or by this rank, segment in range, length of that
segment) and was not received before. Anything else is counted and dropped (``ExchangeStats.rejected``
with the reason), or counted as late when it is authentic but arrived after its phase closed (this
round's, or the previous round's first copy); it never raises. Authentic datagrams of a later round
(a faster peer already on its next exchange) are kept, a bounded number, until that round starts. The
phase-2 average is the same message to every rank, so its datagrams are tagged once and name no
receiver: a copy relayed to another rank of the same run gives it that same average. (``UdpExchange``'s
receive paths, in :mod:`shaky.comm.udp.exchange`, apply these rules.)
"""

from __future__ import annotations

import ctypes
import hashlib
import struct

import numpy as np

from shaky.native import FASTPATH

HEADER = struct.Struct("<2sBBBBHQQIII")
"""magic, version, phase, dtype, flags, sender, run id, round, block, segment, payload bytes (36 bytes)."""
_HEADER_DTYPE = np.dtype([("magic", "S2"), ("version", "u1"), ("phase", "u1"), ("dtype", "u1"), ("flags", "u1"),
                          ("sender", "<u2"), ("run", "<u8"), ("round", "<u8"), ("block", "<u4"), ("seg", "<u4"),
                          ("length", "<u4")])
"""``HEADER`` as a numpy record (the compiled path reads a batch's headers at once)."""
MAGIC = b"SK"
VERSION = 1
TAG_BYTES = 16
"""HMAC-SHA256 truncated to 128 bits."""
OVERHEAD_BYTES = HEADER.size + TAG_BYTES
FLAG_FINAL = 1
"""Set on the sender's last ``FINAL_DATAGRAMS`` datagrams to a receiver in a phase."""
FLAG_REPEAT = 2
"""Set on the copy of the sender's very last datagram to a receiver in a phase (sent right after it)."""
FINAL_DATAGRAMS = 4
"""How many datagrams at the end of each sender's stream say "that was all": the receiver may close the
phase early once it has one of them from every sender; all of them are lost with probability p^4."""
PHASES = (1, 2)
DTYPE_CODES = {np.dtype(np.float16): 1, np.dtype(np.float32): 2, np.dtype(np.float64): 3}
KEY_BYTES = 32

REJECT_REASONS = ("malformed", "unknown_sender", "wrong_run", "bad_tag", "past_round", "future_round",
                  "duplicate")
"""Why a datagram was dropped: bad length/layout/phase/geometry; not from the address of the peer it names;
another run's; tag does not verify; a round before the previous one; a later round when the holding
space is full; already received."""


class _Mac:
    """HMAC-SHA256 (RFC 2104) of a datagram, truncated to 16 bytes.

    The pads' states are hashed once and copied per datagram: the same computation as
    ``hmac.digest(key, msg, "sha256")[:16]`` (a test checks it), about 1.9 microseconds per 1472-byte
    datagram against 3.6 for ``hmac.digest`` (whose OpenSSL 3 set-up is per call) and 2.8 for keyed
    BLAKE2b, which has no SHA extensions to run on (``benchmarks/udp_probe.py --only mac``).
    """

    __slots__ = ("_inner", "_outer", "_c", "_cp")

    def __init__(self, key: bytes, compiled: bool = False) -> None:
        block = key.ljust(64, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in block))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in block))
        self._c = None
        if compiled and FASTPATH is not None:      # the same pad states, in C (``tags`` and ``tags_of``)
            self._c = ctypes.create_string_buffer(FASTPATH.shaky_mac_size())
            if FASTPATH.shaky_mac_init(self._c, bytes(key), len(key)) != 0:
                raise ValueError("the MAC key must be at most 64 bytes")
            self._cp = ctypes.addressof(self._c)

    def tag(self, data: memoryview | bytes) -> bytes:
        inner = self._inner.copy()
        inner.update(data)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()[:TAG_BYTES]

    def tags(self, buf: memoryview, offsets: range, length: int) -> bytes:
        """The tags of ``buf[o:o + length]`` for each offset, concatenated (one loop, no calls per datagram)."""
        if self._c is not None and len(offsets):
            out = np.empty(len(offsets) * TAG_BYTES, np.uint8)
            base = np.frombuffer(buf, np.uint8).ctypes.data + offsets.start
            FASTPATH.shaky_tags(self._cp, base, offsets.step, None, length, len(offsets), out.ctypes.data)
            return out.tobytes()
        icopy, ocopy = self._inner.copy, self._outer.copy
        out = []
        append = out.append
        for o in offsets:
            inner = icopy()
            inner.update(buf[o:o + length])
            outer = ocopy()
            outer.update(inner.digest())
            append(outer.digest()[:TAG_BYTES])
        return b"".join(out)

    def tags_of(self, rows: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """[n, 16] the tags of ``rows[i, :lengths[i]]`` (rows: C-contiguous uint8 [n, stride]); compiled only."""
        n = rows.shape[0]
        out = np.empty((n, TAG_BYTES), np.uint8)
        FASTPATH.shaky_tags(self._cp, rows.ctypes.data, rows.shape[1], lengths.ctypes.data, 0, n, out.ctypes.data)
        return out


class _Packed:
    """One block's datagrams in one buffer: rows of ``size`` bytes, the last ``last`` bytes long; ``repeat``: the
    flagged copy of the last row where it ends a stream (else None)."""

    __slots__ = ("view", "size", "count", "last", "phase", "block", "repeat")

    def __init__(self, view: memoryview, size: int, count: int, last: int, phase: int, block: int,
                 repeat: bytes | None) -> None:
        self.view, self.size, self.count, self.last, self.phase, self.block = view, size, count, last, phase, block
        self.repeat = repeat

    def length(self, k: int) -> int:
        return self.last if k == self.count - 1 else self.size
