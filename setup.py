"""The one compiled part of shaky, optional: shaky/comm/_fastpath.c, the UDP data plane's per-datagram work, the
copies that end the simulator's block average, the delivery masks' seeded draws and the sampler's permutations
(loaded with ctypes by shaky/native.py; shaky/comm/udp.py, shaky/comm/sim.py, shaky/network/model.py and
shaky/sampler.py do the same in Python, torch and numpy where it was not built). It needs a C compiler
and OpenSSL's libcrypto with its headers (Debian: libssl-dev); without them the install goes on without it
and says so."""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """An extension that does not build is skipped with a warning that says what that means."""

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001 (no compiler, no headers, no libcrypto: the Python path)
            self.warn(f"shaky: the UDP fast path (shaky/comm/_fastpath.c) was not built ({exc}); "
                      "the UDP data plane runs in Python, the simulator's block average in torch, its masks' draws and "
                      "the sampler in numpy (same results, slower)")


setup(ext_modules=[Extension("shaky.comm._fastpath", ["shaky/comm/_fastpath.c"], libraries=["crypto"],
                             extra_compile_args=["-O2"], optional=True)],
      cmdclass={"build_ext": OptionalBuildExt})
