"""shaky's one compiled library, optional: ``shaky/comm/_fastpath.c``, loaded with ctypes.

This loader sits at the package's top, below both ``shaky.comm`` and ``shaky.network`` (which must not import
``shaky.comm``); the library itself is still built next to its source, in ``shaky/comm/`` (``setup.py``).

The install builds it where a C compiler and OpenSSL's headers are found (``setup.py``). It holds the UDP data
plane's per-datagram work (``shaky.comm.udp``), the arrival shares and the copies around the simulator's block
average (``shaky.comm.sim``), numpy's seeded uniform draws for the delivery masks (``SeededUniform``, used by
``shaky.network.model``) and the mini-batch sampler's keyed permutations (``shaky.sampler``). Where it was not
built, each does the same work in Python, torch or numpy, with the same results.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
from pathlib import Path

import numpy as np


def _load() -> ctypes.CDLL | None:
    """The compiled library, or None where the install did not build it."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = Path(__file__).parent / "comm" / ("_fastpath" + suffix)
        if path.is_file():
            break
    else:
        return None
    try:
        lib = ctypes.CDLL(str(path))       # CDLL: every call releases the GIL
    except OSError:
        return None
    p, size, i64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64
    try:
        lib.shaky_mac_size.argtypes, lib.shaky_mac_size.restype = [], size
        lib.shaky_mac_init.argtypes, lib.shaky_mac_init.restype = [p, ctypes.c_char_p, size], ctypes.c_int
        lib.shaky_mac_free.argtypes, lib.shaky_mac_free.restype = [p], None
        lib.shaky_tags.argtypes, lib.shaky_tags.restype = [p, p, size, p, size, size, p], None
        lib.shaky_pack.argtypes, lib.shaky_pack.restype = [p, p, size, p, p, size, size, size], None
        lib.shaky_drain.argtypes = [ctypes.c_int, p, p, p, size, ctypes.c_int, ctypes.c_int, p, size, ctypes.c_int, p, p,
                                     p]
        lib.shaky_drain.restype = ctypes.c_long
        u32 = ctypes.c_uint32
        lib.shaky_send.argtypes = [ctypes.c_int, p, size, size, size, size, size, u32, u32, ctypes.c_int, ctypes.c_int]
        lib.shaky_send.restype = ctypes.c_long
        lib.shaky_block_shares.argtypes, lib.shaky_block_shares.restype = [p, i64, p, i64], None
        lib.shaky_take_averages.argtypes, lib.shaky_take_averages.restype = [p, p, p, p, p, i64, i64, i64], None
        lib.shaky_uniform.argtypes, lib.shaky_uniform.restype = [p, i64, p, i64, p, i64], ctypes.c_int
        lib.shaky_batch_indices.argtypes = [p, i64, i64, i64, i64, p, p, p, p, i64]
        lib.shaky_batch_indices.restype = None
    except AttributeError:     # built from an older _fastpath.c: reinstall to rebuild it
        return None
    return lib


FASTPATH = _load()
"""The compiled library where the install built it, else None (``UdpExchange.info()["compiled"]``)."""


def _words(n: int) -> list[int]:
    """``n`` >= 0 as numpy's SeedSequence reads an int of its entropy: 32-bit words, least significant first."""
    if n < 0:
        raise ValueError(f"seed entropy must be >= 0; got {n}")
    words = [n & 0xFFFFFFFF]
    while n > 0xFFFFFFFF:
        n >>= 32
        words.append(n & 0xFFFFFFFF)
    return words


def _compiled_uniform(prefix: np.ndarray, keys: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray | None:
    """``shaky_uniform``'s draws for the entropy ``prefix`` (uint32 words) then ``keys``; None where the entropy
    is longer than the C path takes (64 words). A key outside uint64 raises, as in numpy."""
    out, words = np.empty(shape), np.array(keys, dtype=np.uint64)
    rc = FASTPATH.shaky_uniform(prefix.ctypes.data, len(prefix), words.ctypes.data,  # type: ignore[union-attr]
                                len(words), out.ctypes.data, out.size)
    return out if rc == 0 else None


class SeededUniform:
    """``draw(shape, *keys)``: ``np.random.default_rng([*ints, *keys]).random(shape)``, the same float64 values,
    computed in C where the library was built (``shaky_uniform``: about 1 us where numpy takes 15 us to build the
    generator), else by numpy. For streams that seed a fresh generator per round (the delivery masks)."""

    def __init__(self, *ints: int) -> None:
        self.ints = ints
        self._prefix = np.asarray([w for i in ints for w in _words(i)], dtype=np.uint32)
        self.compiled = UNIFORM_MATCHES_NUMPY

    def __call__(self, shape: tuple[int, ...], *keys: int) -> np.ndarray:
        out = _compiled_uniform(self._prefix, keys, shape) if self.compiled else None
        return np.random.default_rng([*self.ints, *keys]).random(shape) if out is None else out


def _uniform_matches_numpy() -> bool:
    """Whether ``shaky_uniform`` draws numpy's numbers (checked once: if numpy ever changed its streams, the C
    path would stand aside rather than give other masks than numpy's)."""
    if FASTPATH is None:
        return False
    for ints in ((0, 7, 0), (12345, 0x6E6574, 2**32 + 5, 1), (2**40 + 3, 2**63)):
        prefix = np.asarray([w for i in ints[:-1] for w in _words(i)], dtype=np.uint32)
        out = _compiled_uniform(prefix, ints[-1:], (9,))
        if out is None or not np.array_equal(out, np.random.default_rng(list(ints)).random(9)):
            return False
    return True


UNIFORM_MATCHES_NUMPY = _uniform_matches_numpy()
