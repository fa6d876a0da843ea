"""The datagram format of the UDP data plane: header, payload, tag; and which datagrams are used.

Datagrams (:data:`HEADER`, then the payload, then the tag)::

    offset size  field
    0      2     magic b"SK"
    2      1     version (2)
    3      1     phase (1: to the server, 2: the server's average)
    4      1     dtype (1 float16, 2 float32, 3 float64: the values; 16 float32, 17 bfloat16, 18 float16,
                        19 int8: rounded differences from the stream, see ``ROUNDED_CODES``)
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
    36+n   16    tag: AES-256-GMAC of header + payload (see below)

The tag is OpenSSL's AES-256-GCM tag of an empty plaintext with header + payload as the associated data
(GMAC), under the sender's key for the round, HMAC-SHA256(key, "shaky udp gmac\\0" || run id || sender ||
round) (little-endian 8, 2 and 8 bytes), with the 12-byte nonce phase || flags || block || segment || 0 0
(1, 1, 4, 4 and 2 bytes): every field the key and nonce take is in the header it authenticates. Version 1
was the same header with HMAC-SHA256(key, header + payload)[:16] as the tag, 2.5 times the cost a datagram.

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
import ctypes.util
import hmac
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
VERSION = 2
TAG_BYTES = 16
"""AES-256-GMAC's tag (GCM's full 128 bits)."""
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
ROUNDED_CODES = {"float32": 16, "bfloat16": 17, "float16": 18, "int8": 19}
"""The dtype byte of a segment of rounded differences (``strategy.value_dtype``, :mod:`shaky.comm.quant`): its
values in that type (little-endian), and for int8 the float32 scale of each of its groups of 256 after them."""
KEY_BYTES = 32

REJECT_REASONS = ("malformed", "unknown_sender", "wrong_run", "bad_tag", "past_round", "future_round",
                  "duplicate")
"""Why a datagram was dropped: bad length/layout/phase/geometry; not from the address of the peer it names;
another run's; tag does not verify; a round before the previous one; a later round when the holding
space is full; already received."""


def _libcrypto() -> ctypes.CDLL | None:
    """OpenSSL's libcrypto, the one Python's hashlib runs on (already in this process), for the tag where the
    compiled library was not built; None where it cannot be found."""
    try:
        import _hashlib  # noqa: F401, PLC0415 (loads libcrypto into the process)
        with open("/proc/self/maps") as maps:
            paths = [line.split()[-1] for line in maps if "libcrypto" in line and "/" in line]
    except (ImportError, OSError):
        paths = []
    found = ctypes.util.find_library("crypto")
    for path in [*paths, *([found] if found else [])]:
        try:
            lib = ctypes.CDLL(path)
            p, i = ctypes.c_void_p, ctypes.c_int
            lib.EVP_CIPHER_CTX_new.argtypes, lib.EVP_CIPHER_CTX_new.restype = [], p
            lib.EVP_CIPHER_CTX_free.argtypes, lib.EVP_CIPHER_CTX_free.restype = [p], None
            lib.EVP_aes_256_gcm.argtypes, lib.EVP_aes_256_gcm.restype = [], p
            lib.EVP_EncryptInit_ex.argtypes, lib.EVP_EncryptInit_ex.restype = [p, p, p, p, p], i
            lib.EVP_EncryptUpdate.argtypes, lib.EVP_EncryptUpdate.restype = [p, p, p, p, i], i
            lib.EVP_EncryptFinal_ex.argtypes, lib.EVP_EncryptFinal_ex.restype = [p, p, p], i
            lib.EVP_CIPHER_CTX_ctrl.argtypes, lib.EVP_CIPHER_CTX_ctrl.restype = [p, i, i, p], i
            return lib
        except (OSError, AttributeError):
            continue
    return None


_EVP_CTRL_GCM_GET_TAG = 0x10
_KEY_LABEL = b"shaky udp gmac\0"
_ROUND_KEY = struct.Struct("<QHQ")
"""run, sender, round: what follows the label in a round key's derivation."""
_KEY_CACHE = 64
"""Round keys (with their GCM contexts) a MAC keeps: this round's and the last one's of every sender, as a rule."""


def round_key(key: bytes, run: int, sender: int, rnd: int) -> bytes:
    """The AES-256 key of ``sender``'s datagrams in round ``rnd`` of run ``run``:
    HMAC-SHA256(key, "shaky udp gmac\\0" || run || sender || round), little-endian 8, 2 and 8 bytes."""
    return hmac.digest(key, _KEY_LABEL + _ROUND_KEY.pack(run, sender, rnd), "sha256")


def nonce(header: bytes | memoryview) -> bytes:
    """A datagram's 12-byte GCM nonce, from its header: phase, flags, block, segment, two zero bytes."""
    return bytes((header[3], header[5])) + bytes(header[24:32]) + b"\0\0"


class _Mac:
    """The tag of a datagram (wire version 2): AES-256-GMAC, OpenSSL's AES-256-GCM tag of an empty plaintext with
    the datagram (header and payload) as associated data, under the sender's key for that round
    (:func:`round_key`, run, sender and round read from the header) and the nonce its header gives
    (:func:`nonce`). Within one sender's round every datagram has a nonce of its own, and a nonce is only
    used again for the same bytes (a phase-2 average goes to every rank as one message), which GCM needs; a
    key of its own per sender and round keeps what would leak if a sender ever sent other bytes under a
    round it had already used (a process started again in a round it had begun) to that sender's round.

    About 0.5 microseconds a 1472-byte datagram in C against 1.2 for the HMAC-SHA256 of wire version 1, and
    4x less a byte from 9000-byte datagrams on (``benchmarks/udp_probe.py --only mac``). Compiled: the keyed
    contexts live in C (``shaky_tags``, and the receive path's check); else OpenSSL's libcrypto called through
    ctypes, the same bytes.
    """

    __slots__ = ("_key", "_c", "_cp", "_lib", "_ctxs", "_n", "_scratch", "_out", "__weakref__")

    def __init__(self, key: bytes, compiled: bool = False) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"the MAC key must be {KEY_BYTES} bytes, got {len(key)}")
        self._key = bytes(key)
        self._c = None
        self._lib = None
        self._ctxs: dict[tuple[int, int, int], int] = {}
        self._n, self._scratch, self._out = ctypes.byref(ctypes.c_int()), ctypes.create_string_buffer(16), \
            ctypes.create_string_buffer(TAG_BYTES)
        if compiled and FASTPATH is not None:
            self._c = ctypes.create_string_buffer(FASTPATH.shaky_mac_size())
            FASTPATH.shaky_mac_init(self._c, self._key, len(self._key))
            self._cp = ctypes.addressof(self._c)
        else:
            self._lib = _LIBCRYPTO
            if self._lib is None:
                raise RuntimeError("the udp transport's tag (AES-256-GMAC) needs OpenSSL's libcrypto, which this "
                                   "Python does not load (reinstall Python with its ssl and hashlib modules)")

    def __del__(self) -> None:
        try:
            if self._c is not None:
                FASTPATH.shaky_mac_free(self._c)
                self._c = None
            if self._lib is not None:
                for ctx in self._ctxs.values():
                    self._lib.EVP_CIPHER_CTX_free(ctx)
                self._ctxs = {}
        except (AttributeError, TypeError):     # at interpreter exit the module's globals may be gone already
            pass

    def _context(self, run: int, sender: int, rnd: int) -> int:
        ident = (run, sender, rnd)
        ctx = self._ctxs.pop(ident, None)
        if ctx is None:
            lib = self._lib
            ctx = lib.EVP_CIPHER_CTX_new() if len(self._ctxs) < _KEY_CACHE else \
                self._ctxs.pop(next(iter(self._ctxs)))      # the least recently used one, keyed again
            if not ctx or lib.EVP_EncryptInit_ex(ctx, lib.EVP_aes_256_gcm(), None,
                                                 round_key(self._key, run, sender, rnd), None) != 1:
                raise MemoryError("OpenSSL could not set up an AES-256-GCM context")
        self._ctxs[ident] = ctx
        return ctx

    def tag(self, data: memoryview | bytes) -> bytes:
        """The tag of ``data`` (a header and its payload); 16 zero bytes, which never verify, for fewer bytes than a
        header."""
        if self._c is not None:
            out = ctypes.create_string_buffer(TAG_BYTES)
            msg = bytes(data)
            FASTPATH.shaky_tags(self._cp, msg, 0, None, len(msg), 1, out)
            return out.raw
        msg = bytes(data)
        if len(msg) < HEADER.size:
            return bytes(TAG_BYTES)
        sender, run, rnd = _ROUND_KEY_FIELDS.unpack_from(msg, 6)
        ident = (run, sender, rnd)
        ctxs = self._ctxs
        ctx = ctxs[ident] if ident in ctxs else self._context(run, sender, rnd)
        lib, n, out = self._lib, self._n, self._out
        if (lib.EVP_EncryptInit_ex(ctx, None, None, None, nonce(msg)) != 1
                or lib.EVP_EncryptUpdate(ctx, None, n, msg, len(msg)) != 1
                or lib.EVP_EncryptFinal_ex(ctx, self._scratch, n) != 1
                or lib.EVP_CIPHER_CTX_ctrl(ctx, _EVP_CTRL_GCM_GET_TAG, TAG_BYTES, out) != 1):
            return bytes(TAG_BYTES)
        return out.raw

    def tags(self, buf: memoryview, offsets: range, length: int) -> bytes:
        """The tags of ``buf[o:o + length]`` for each offset, concatenated (compiled: one call)."""
        if self._c is not None and len(offsets):
            out = np.empty(len(offsets) * TAG_BYTES, np.uint8)
            base = np.frombuffer(buf, np.uint8).ctypes.data + offsets.start
            FASTPATH.shaky_tags(self._cp, base, offsets.step, None, length, len(offsets), out.ctypes.data)
            return out.tobytes()
        return b"".join(self.tag(buf[o:o + length]) for o in offsets)

    def tags_of(self, rows: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """[n, 16] the tags of ``rows[i, :lengths[i]]`` (rows: C-contiguous uint8 [n, stride]); compiled only."""
        n = rows.shape[0]
        out = np.empty((n, TAG_BYTES), np.uint8)
        FASTPATH.shaky_tags(self._cp, rows.ctypes.data, rows.shape[1], lengths.ctypes.data, 0, n, out.ctypes.data)
        return out


_ROUND_KEY_FIELDS = struct.Struct("<HQQ")
"""sender, run id, round: the header's bytes 6 to 24."""
_LIBCRYPTO = _libcrypto()


class _Packed:
    """One block's datagrams in one buffer: rows of ``size`` bytes, the last ``last`` bytes long; ``repeat``: the
    flagged copy of the last row where it ends a stream (else None)."""

    __slots__ = ("view", "size", "count", "last", "phase", "block", "repeat", "address")

    def __init__(self, view: memoryview, size: int, count: int, last: int, phase: int, block: int,
                 repeat: bytes | None, address: int = 0) -> None:
        self.view, self.size, self.count, self.last, self.phase, self.block = view, size, count, last, phase, block
        self.repeat = repeat
        self.address = address
        """Where the rows start in memory (for the compiled send)."""

    def length(self, k: int) -> int:
        return self.last if k == self.count - 1 else self.size
