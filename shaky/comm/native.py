"""shaky's one compiled library, optional: ``shaky/comm/_fastpath.c``, loaded with ctypes.

The install builds it where a C compiler and OpenSSL's headers are found (``setup.py``). It holds the UDP data
plane's per-datagram work (``shaky.comm.udp``) and the copies that finish the simulator's block average
(``shaky.comm.sim``). Where it was not built, both do the same work in Python and torch, with the same results.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
from pathlib import Path


def _load() -> ctypes.CDLL | None:
    """The compiled library, or None where the install did not build it."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = Path(__file__).with_name("_fastpath" + suffix)
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
        lib.shaky_tags.argtypes, lib.shaky_tags.restype = [p, p, size, p, size, size, p], None
        lib.shaky_recv.argtypes = [ctypes.c_int, p, size, ctypes.c_int, p, p]
        lib.shaky_recv.restype = ctypes.c_int
        lib.shaky_check.argtypes = [p, p, size, p, p, ctypes.c_int, ctypes.c_uint32, ctypes.c_uint64,
                                    ctypes.c_uint64, ctypes.c_uint8, ctypes.c_uint32, p, ctypes.c_uint32, p, p, p, p]
        lib.shaky_check.restype = ctypes.c_int
        lib.shaky_take_blocks.argtypes, lib.shaky_take_blocks.restype = [p, p, p, p, p, i64, i64, i64], None
    except AttributeError:     # built from an older _fastpath.c: reinstall to rebuild it
        return None
    return lib


FASTPATH = _load()
"""The compiled library where the install built it, else None (``UdpExchange.info()["compiled"]``)."""
