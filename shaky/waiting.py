"""How an idle OpenMP thread waits: spin while the cores are the run's own, sleep while another program wants them.

torch's CPU kernels run in OpenMP parallel regions (a step of the MLP on digits
at W = 16 has about 20). Between two regions a thread of the team waits, and
GNU OpenMP (the libgomp torch ships) decides how once, when torch loads:

* spin for about 3 ms (its default), so the next region starts at once. Fastest
  while the run has the cores to itself; but when another program keeps one of
  them busy, a spinning thread waits for a team mate that lost its core to the
  other program, and every region can wait out a time slice: 100x slower a step
  on two cores of an idle host, 3-16x on this VM (docs/performance.md);
* sleep at once (``OMP_WAIT_POLICY=PASSIVE``): a shared machine costs little,
  but every region wakes a sleeping thread, 60-170 us each on this VM, 1.5-2.6x
  a quiet step of that MLP.

Neither is right for a run that does not know whether the machine will be shared.
So a ``shaky`` command chooses while it runs: a thread of this module looks at
the CPUs the process may use every ``PERIOD`` seconds (``/proc/stat`` less the
process's own CPU time) and lets the team spin while nothing else wants those
cores, and sleep from the second period in a row where something does (back to
spinning after ``CALM`` seconds without). The wait changes no number a run computes, only
how long a step takes; the thread count, which would, is never touched.

libgomp has no call that sets the spin at run time: it reads ``GOMP_SPINCOUNT``
once, into a variable it reads again at every wait. :func:`prepare` puts a
marker value there (``MARKER``: a spin of about 10 us, close to sleeping, which
is what stays if anything below fails), and after torch has loaded
:func:`start` looks for that value in libgomp's writable data and changes it
from then on, only if it is found exactly once (else it leaves the process as
it is and says so in :data:`state`). The marker leaves the environment once torch
has loaded, so the processes this one starts (a sweep's workers, which run one
thread each) get libgomp's own default. A policy the user set
(``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``) is left alone, and so is a process whose
OpenMP is not libgomp.
"""

from __future__ import annotations

import ctypes
import os
import resource
import struct
import sys
import threading
import time
from dataclasses import dataclass

MARKER = 1009
"""The spin ``prepare`` gives libgomp until ``start`` finds where it keeps it (a short spin: close to sleeping)."""
SPIN = 300_000
"""libgomp's own default spin count (about 3 ms): used while the cores are the run's own."""
SLEEP = 0
"""No spin (what ``OMP_WAIT_POLICY=PASSIVE`` gives): used while another program wants the cores."""
PERIOD = 0.1
"""Seconds between two looks at the CPUs."""
CALM = 0.5
"""Seconds without another program before the team spins again."""
SURE = 2
"""Looks in a row that must find another program before a spinning team sleeps (one look's tick counts can
be off by a few hundredths of a second a CPU: a single look over the line is often nothing)."""
OTHERS = 0.3
"""Cores' worth of other programs' work on this process's CPUs, beyond those its threads leave free, that
counts as a program that wants them (below it: the odd daemon, the kernel, a terminal)."""


@dataclass
class WaitState:
    """What this module did in this process (for tests, benchmarks and the curious)."""

    prepared: bool = False
    where: int | None = None            # the address of libgomp's spin count, once found
    why_not: str = ""                   # why the spin is not adapted, when it is not
    spinning: bool = False
    looks: int = 0


state = WaitState()
_lock = threading.Lock()


def prepare() -> bool:
    """Before torch loads: give libgomp the marker spin, unless the user chose a wait policy. True if it did."""
    if "torch" in sys.modules:     # its libgomp has read its environment already: the marker would not be there
        state.why_not = "torch was loaded before the wait could be prepared"
        return False
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        state.why_not = "the environment sets the wait policy"
        return False
    os.environ["GOMP_SPINCOUNT"] = str(MARKER)
    state.prepared = True
    return True


def _find_spin_count() -> int | None:
    """The address of torch's libgomp's spin count: the one aligned word of its writable data that holds
    ``MARKER``. None unless exactly one such word is found (in the libgomp beside torch's libraries if one is
    loaded, else in any libgomp: another copy, such as scikit-learn's, loads later or read its spin before)."""
    import torch  # noqa: PLC0415

    marker = struct.pack("<Q", MARKER)
    torch_dir = os.path.realpath(os.path.dirname(torch.__file__))
    found: list[int] = []
    beside: list[int] = []
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or not parts[1].startswith("rw") or "libgomp" not in os.path.basename(parts[5]):
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        data = ctypes.string_at(lo, hi - lo)
        at = data.find(marker)
        while at != -1:
            if (lo + at) % 8 == 0:
                found.append(lo + at)
                if os.path.realpath(parts[5]).startswith(torch_dir + os.sep):
                    beside.append(lo + at)
            at = data.find(marker, at + 1)
    words = beside or found
    return words[0] if len(words) == 1 else None


def _set_spin(where: int, spinning: bool) -> None:
    ctypes.c_uint64.from_address(where).value = SPIN if spinning else SLEEP
    state.spinning = spinning


class _Cpus:
    """Busy time of the CPUs this process may run on, from ``/proc/stat``, and the process's own CPU time."""

    def __init__(self) -> None:
        self.cpus = {f"cpu{i}" for i in os.sched_getaffinity(0)}
        self.tick = os.sysconf("SC_CLK_TCK")

    def busy_s(self) -> float:
        total = 0
        with open("/proc/stat", encoding="ascii") as stat:
            for line in stat:
                if not line.startswith("cpu"):
                    break
                name, *ticks = line.split()
                if name in self.cpus:
                    # user nice system idle iowait irq softirq steal ...: busy is all but idle, iowait and steal
                    t = [int(x) for x in ticks[:8]]
                    total += t[0] + t[1] + t[2] + t[5] + t[6]
        return total / self.tick

    @staticmethod
    def own_s() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime


def others_cores(before: tuple[float, float, float], after: tuple[float, float, float]) -> float:
    """Cores' worth of other programs' work between two samples ``(monotonic s, CPUs' busy s, own CPU s)``."""
    wall = after[0] - before[0]
    if wall <= 0:
        return 0.0
    return max(0.0, (after[1] - before[1]) - (after[2] - before[2])) / wall


class Policy:
    """When a team of ``threads`` OpenMP threads on ``cpus`` CPUs should spin: once ``SURE`` looks in a row
    find another program's work on those CPUs beyond what the team leaves free (more than ``OTHERS`` cores'
    worth), sleep; after ``CALM`` seconds without, spin again. It starts asleep and spins after its first
    quiet look."""

    def __init__(self, cpus: int, threads: int) -> None:
        self.room = max(0, cpus - threads) + OTHERS
        self.spinning = False
        self.looked = False
        self.over = 0                       # looks in a row that found other work beyond the room
        self.calm_since: float | None = None

    def look(self, now: float, others: float) -> bool:
        """Whether to spin after a look at ``now`` (seconds) that found ``others`` cores of other work."""
        self.over = self.over + 1 if others > self.room else 0
        if self.over:
            self.calm_since = None
            if self.over >= SURE or not self.looked:
                self.spinning = False
        elif not self.spinning:
            self.calm_since = now if self.calm_since is None else self.calm_since
            self.spinning = not self.looked or now - self.calm_since >= CALM
        self.looked = True
        return self.spinning


def _watch(where: int, threads: int, stop: threading.Event) -> None:
    cpus = _Cpus()
    policy = Policy(len(cpus.cpus), threads)
    sample = (time.monotonic(), cpus.busy_s(), cpus.own_s())
    while not stop.wait(PERIOD):
        now = (time.monotonic(), cpus.busy_s(), cpus.own_s())
        spinning = policy.look(now[0], others_cores(sample, now))
        sample = now
        state.looks += 1
        if spinning != state.spinning:
            _set_spin(where, spinning)


_stop = threading.Event()


def start(threads: int | None = None) -> bool:
    """After torch loads: find libgomp's spin count and watch the CPUs from a daemon thread. True if watching.

    Args:
        threads: the OpenMP team's size (``torch.get_num_threads()`` when not given).
    """
    import torch  # noqa: PLC0415

    if threads is None:
        threads = torch.get_num_threads()
    with _lock:
        if not state.prepared or state.where is not None:
            return state.where is not None
        if os.environ.get("GOMP_SPINCOUNT") == str(MARKER):
            del os.environ["GOMP_SPINCOUNT"]    # read by the libgomp loaded now; not for the processes this one starts
        if threads <= 1:      # a team of one never waits for a mate (a torch.distributed rank, as a rule)
            state.why_not = "one OpenMP thread: nothing waits"
            return False
        where = _find_spin_count()
        if where is None:
            state.why_not = "libgomp's spin count was not found (another OpenMP, or another libgomp)"
            return False
        state.where = where
        ctypes.c_uint64.from_address(where).value = SLEEP
        threading.Thread(target=_watch, args=(where, threads, _stop), name="shaky-wait", daemon=True).start()
        return True
