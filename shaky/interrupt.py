"""Stopping a run cleanly on SIGINT (Ctrl-C) and SIGTERM (Slurm, Kubernetes, a sweep that is stopped).

The first signal only asks: the loop finishes the step it is in, writes a
checkpoint and raises :class:`Stopped`, which the command line turns into one
line saying how to resume and an exit status of 128 + the signal's number. A
second Ctrl-C stops at once (KeyboardInterrupt), keeping the last checkpoint
written. On the dist backend every rank stops after the same step: the request
travels in a one-value all-reduce each step, so a signal that reaches one rank
stops them all.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from types import FrameType
from typing import Any, Iterator

from shaky.progress import say

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(Exception):
    """A run stopped on a signal after writing its checkpoint (nothing is lost); or, with no step, a command
    stopped by a signal between runs (:func:`raising`)."""

    def __init__(self, signum: int, step: int | None = None, steps: int | None = None) -> None:
        self.signum, self.step, self.steps = signum, step, steps
        name = signal.Signals(signum).name
        super().__init__(f"stopped by {name}" if step is None else
                         f"stopped by {name} after step {step} of {steps}; a checkpoint at step {step} was written")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class SignalWatch:
    """While entered (in the main thread), SIGINT and SIGTERM are recorded instead of stopping the process.

    A signal the process ignores stays ignored (``nohup``; a sweep's workers ignore SIGINT and stop on the
    SIGTERM their parent sends). Elsewhere (a thread of the user's own program) it installs nothing and never asks to stop.
    """

    def __init__(self, *, announce: bool = True) -> None:
        self.received: int | None = None
        self.announce = announce
        self._old: dict[int, Any] = {}

    def __enter__(self) -> SignalWatch:
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                if signal.getsignal(signum) is not signal.SIG_IGN:  # an ignored signal stays ignored (nohup)
                    self._old[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._old.items():
            signal.signal(signum, handler)
        self._old.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
            if self.announce:
                say(f"\nshaky: {signal.Signals(signum).name} received: stopping after this step and writing a "
                    "checkpoint (Ctrl-C again to stop at once)")
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt


@contextlib.contextmanager
def raising(signum: int = signal.SIGTERM) -> Iterator[None]:
    """While inside (in the main thread), ``signum`` raises :class:`Stopped` where the program is, as Ctrl-C
    raises KeyboardInterrupt, so that ``finally`` blocks and cleanup run (Python's default for SIGTERM is to
    die on the spot). A :class:`SignalWatch` entered inside takes precedence while it lasts."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signum) is signal.SIG_IGN:
        yield
        return

    def handle(signum: int, frame: FrameType | None) -> None:
        raise Stopped(signum)

    old = signal.signal(signum, handle)
    try:
        yield
    finally:
        signal.signal(signum, old)


@contextlib.contextmanager
def exiting() -> Iterator[None]:
    """While inside (in the main thread), SIGINT and SIGTERM end the process at once with one line and status
    128 + the signal's number: for a command's start (loading torch, scikit-learn), where nothing has been
    written yet. An exception raised by a signal in the middle of an import can be swallowed by the C code
    it interrupts and leave the module half loaded (numpy's lazy submodules then recurse without end on
    their next use), so the start is never interrupted by an exception. A signal the process ignores stays
    ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, frame: FrameType | None) -> None:
        word = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
        os.write(2, f"shaky: {word}\n".encode())
        os._exit(128 + signum)

    old = {s: signal.signal(s, handle) for s in SIGNALS if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for signum, handler in old.items():
            signal.signal(signum, handler)
