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

import atexit
import contextlib
import os
import signal
import sys
import threading
from types import FrameType
from typing import Any, Callable, Iterator, NoReturn

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
def raising() -> Iterator[None]:
    """While inside (in the main thread), SIGINT raises KeyboardInterrupt and SIGTERM raises :class:`Stopped`
    where the program is, so that ``finally`` blocks and cleanup run (Python's default for SIGTERM is to die on
    the spot; and :func:`exiting`, the command line's policy outside, ends the process at once). A
    :class:`SignalWatch` entered inside takes precedence while it lasts. A signal the process ignores stays
    ignored."""
    def handle(signum: int, frame: FrameType | None) -> None:
        if _importing(frame):   # an exception inside an import can abort the process (C++ code under it)
            exit_at_once(signum, frame)
            return
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Stopped(signum)

    with _handled_by(handle):
        yield


_writing = 0
"""How many file writes (:func:`uninterrupted`) are under way in this process."""
_held: list[int] = []
"""A signal :func:`exiting` received during a write, acted on once the write ends."""
_ended: str | None = None
"""Set by :func:`ended`: the command's work is done, and a signal now changes nothing."""
_end_code = 0
"""The status the process ends with once its work is done."""


def exit_at_once(signum: int, frame: FrameType | None = None) -> None:
    """The handler of :func:`exiting`: one line and status 128 + the signal's number, at once (but never in the
    middle of a file write: :func:`uninterrupted`). After :func:`ended`, status 0 and a line that says the
    signal came when the work was done (and the command's own status)."""
    if _writing:
        _held.append(signum)
        return
    name = signal.Signals(signum).name
    if _quiet:
        os._exit(128 + signum)
    if _ended is not None:
        _flush()
        os.write(2, f"shaky: {name} received as shaky was ending; {_ended}\n".encode())
        os._exit(_end_code)
    os.write(2, f"shaky: {'interrupted' if signum == signal.SIGINT else f'stopped by {name}'}\n".encode())
    os._exit(128 + signum)


def _importing(frame: FrameType | None) -> bool:
    """Whether the code a signal interrupted is loading a module: an exception raised there can be swallowed by
    the C code it crosses, or abort the process (torch's pybind11 module init: "terminate called")."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def exit_quietly(signum: int, frame: FrameType | None = None) -> None:
    """:func:`exit_at_once` without its line: for a process whose parent says why it stopped (a sweep's worker)."""
    global _quiet
    _quiet = True
    exit_at_once(signum, frame)


_quiet = False
"""Set by :func:`exit_quietly`: the exit says nothing."""


def _flush() -> None:
    """What the command printed, out before the process ends (a write the signal interrupted is lost)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, RuntimeError):  # a closed pipe; a reentrant flush
            pass


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """A file write: :func:`exiting`'s exit at once waits for its end (the file is then whole, or removed), so
    that no stop leaves a temporary file behind. The other policies raise or record, and the write's own
    cleanup (``shaky.rundir.atomic_write``) handles what they raise."""
    global _writing
    _writing += 1
    try:
        yield
    finally:
        _writing -= 1
        if not _writing and _held:
            exit_at_once(_held[0])


def ended(note: str, code: int = 0) -> None:
    """The command's work is done (a run's summary is written): a signal from now on ends the process with
    status ``code`` and a line with ``note``."""
    global _ended, _end_code
    _ended, _end_code = note, code


@contextlib.contextmanager
def exiting() -> Iterator[None]:
    """While inside (in the main thread), SIGINT and SIGTERM end the process at once with one line and status
    128 + the signal's number (:func:`exit_at_once`): for a command's start (loading torch, scikit-learn), where
    nothing has been written yet, and its end. An exception raised by a signal in the middle of an import can be
    swallowed by the C code it interrupts and leave the module half loaded (numpy's lazy submodules then recurse
    without end on their next use), so the start is never interrupted by an exception. A signal the process
    ignores stays ignored."""
    with _handled_by(exit_at_once):
        yield


@contextlib.contextmanager
def _handled_by(handler: Callable[[int, FrameType | None], None]) -> Iterator[None]:
    """While inside (in the main thread), ``handler`` answers SIGINT and SIGTERM; the handlers before come back on
    leaving. A signal the process ignores stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, handler) for s in SIGNALS if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for signum, previous in old.items():
            signal.signal(signum, previous)


def run_command(main: Callable[[], int]) -> NoReturn:
    """The ``shaky`` process: ``main`` between an exit at once for the start (Python loading shaky, torch) and for
    the end (after ``main`` returned), and the process ended with ``os._exit``: Python's own shutdown (torch's
    teardown, a second or more) restores the default handlers, under which a signal killed a finished run
    without a word (status -15). Nothing is left to do then but the exit functions the modules registered, which
    run first: every file is closed and written."""
    for signum in SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:    # an ignored signal stays ignored (nohup)
            signal.signal(signum, exit_at_once)
    code = main()
    ended(_ended or "it had done its work", code if _ended is None else _end_code)
    atexit._run_exitfuncs()     # what the modules asked to run at exit (multiprocessing's semaphores, ...)
    _flush()
    os._exit(code)
