"""How an idle OpenMP thread waits (shaky/waiting.py): spin while the cores are the run's own, sleep while
another program wants them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shaky.waiting import CALM, OTHERS, SURE, Policy, others_cores

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _clean_env() -> dict[str, str]:
    """The environment of a user who set no OpenMP policy (make test sets PASSIVE for its own processes)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "MALLOC_"))}


def test_the_policy_sleeps_once_another_program_is_sure_and_spins_again_after_calm() -> None:
    p = Policy(cpus=2, threads=2)
    assert not p.spinning                                # asleep until it has looked
    assert p.look(0.1, 0.0)                              # the first quiet look: spin
    assert p.look(0.2, OTHERS * 0.9)                     # the odd daemon is not a program that wants the cores
    assert p.look(0.3, 0.7)                              # one look over the line may be the ticks' rounding
    assert p.look(0.4, 0.0)
    for k in range(SURE - 1):
        assert p.look(0.5 + 0.01 * k, 0.7)
    assert not p.look(0.6, 0.7)                          # SURE looks in a row: a program busy on one core, sleep
    assert not p.look(0.7, 0.0)                          # quiet again, but not for CALM seconds yet
    assert not p.look(0.7 + CALM * 0.9, 0.0)
    assert not p.look(0.7 + CALM * 0.95, 1.0)            # busy again (one look is enough while asleep): start over
    assert not p.look(0.8 + CALM * 1.5, 0.0)
    assert not p.look(0.8 + CALM * 2.4, 0.0)
    assert p.look(0.8 + CALM * 2.6, 0.0)                 # CALM seconds without another program: spin


def test_a_policy_that_finds_another_program_at_its_first_look_stays_asleep() -> None:
    p = Policy(cpus=2, threads=2)
    assert not p.look(0.1, 1.0)
    assert not p.look(0.2, 0.0)


def test_a_team_that_leaves_cores_free_spins_beside_another_program() -> None:
    """Two threads on eight CPUs take nothing another program on five cores wants; on six they would."""
    p = Policy(cpus=8, threads=2)
    assert p.look(0.1, 5.0)
    assert p.look(0.2, 5.9)
    assert p.look(0.3, 6.1 + OTHERS)
    assert not p.look(0.4, 6.1 + OTHERS)


def test_other_programs_work_is_the_cpus_busy_time_less_the_process_own() -> None:
    # (monotonic s, CPUs' busy s, own CPU s): in 0.5 s the CPUs were busy 0.9 s, 0.4 s of it this process
    assert others_cores((10.0, 100.0, 3.0), (10.5, 100.9, 3.4)) == pytest.approx(1.0)
    assert others_cores((10.0, 100.0, 3.0), (10.5, 100.3, 3.4)) == 0.0     # tick rounding: never below 0


_SPIN_PROBE = """
import os, resource, sys, time
from shaky.cli import process_settings
from shaky import waiting
process_settings()
import torch
print("threads", torch.get_num_threads())
print("found", waiting.state.where is not None, waiting.state.why_not or "-", os.environ.get("GOMP_SPINCOUNT"))
if waiting.state.where is not None:
    waiting._stop.set(); time.sleep(2 * waiting.PERIOD)       # the watcher stops; this probe sets the spin itself
    x = torch.ones(500_000)           # large enough to run on every thread (torch's grain is 32768), small work
    def cpu_s(spinning):
        waiting._set_spin(waiting.state.where, spinning)
        x.add_(1); time.sleep(0.05)
        r = resource.getrusage(resource.RUSAGE_SELF); before = r.ru_utime + r.ru_stime
        for _ in range(50):
            x.add_(1)              # a parallel region on every thread of the team
            time.sleep(0.002)      # then a gap: the other threads spin through it, or sleep
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime - before
    print("cpu", cpu_s(True), cpu_s(False))
"""


def test_the_command_line_finds_libgomps_spin_and_the_spin_reaches_its_threads() -> None:
    """The CLI's process settings find where libgomp keeps its spin count, and what is written there is what
    the team's idle threads do: set to spin, they burn the gaps between regions (about 2 ms of CPU for each
    thread beside the caller after each of 50 regions); set to sleep, they do not."""
    proc = subprocess.run([sys.executable, "-c", _SPIN_PROBE], capture_output=True, text=True, timeout=120,
                          env=_clean_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.split("\n")
    if lines[0] == "threads 1":
        pytest.skip("one OpenMP thread on this machine: no team to wait")
    assert lines[1] == "found True - None", proc.stdout      # the marker is not left to the processes it starts
    spin_s, sleep_s = (float(v) for v in lines[2].split()[1:])
    # Both runs do the same 50 regions of work; spinning adds the gaps: 50 gaps of 2 ms on each thread beside the
    # caller, 0.1 s of CPU on two cores. Half of that is the line (a preempted spinner burns less, never more);
    # the sleeping team adds nothing, so the difference is the spin's own cost.
    assert spin_s - sleep_s > 0.05, (spin_s, sleep_s)


_BUSY_PROBE = """
import os, subprocess, sys, time
from shaky.cli import process_settings
from shaky import waiting
process_settings()
if waiting.state.where is None:
    print("not watching:", waiting.state.why_not); sys.exit(0)
busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in os.sched_getaffinity(0)]
try:
    deadline = time.monotonic() + 20
    looks = waiting.state.looks
    while time.monotonic() < deadline and (waiting.state.spinning or waiting.state.looks < looks + 3):
        time.sleep(waiting.PERIOD)
    print("asleep", not waiting.state.spinning, "after", waiting.state.looks - looks > 0)
finally:
    for p in busy:
        p.kill()
"""


def test_with_a_program_busy_on_every_cpu_the_team_sleeps() -> None:
    """With another program busy on every CPU the process may use, the watcher puts the team to sleep (its
    first look finds them, or a later one: bounded by 20 s)."""
    proc = subprocess.run([sys.executable, "-c", _BUSY_PROBE], capture_output=True, text=True, timeout=120,
                          env=_clean_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    if "one OpenMP thread" in proc.stdout:
        pytest.skip("one OpenMP thread on this machine: no team to wait")
    assert proc.stdout.split() == ["asleep", "True", "after", "True"], proc.stdout


@pytest.mark.parametrize("given", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "5000"}])
def test_a_policy_the_user_set_is_left_alone(given: dict[str, str]) -> None:
    code = ("import os; from shaky.cli import process_settings; from shaky import waiting; process_settings(); "
            "print(waiting.state.where, os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**_clean_env(), **given}, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["None", given.get("OMP_WAIT_POLICY", "None"), given.get("GOMP_SPINCOUNT", "None")]



def test_torch_loaded_before_the_marker_leaves_the_process_alone() -> None:
    """libgomp reads its spin when torch loads: a process that loaded torch first keeps its own wait (no word is
    searched for, none written)."""
    code = ("import torch; from shaky.cli import process_settings; from shaky import waiting; "
            "process_settings(); import os; print(waiting.state.where, os.environ.get('GOMP_SPINCOUNT'), '|', "
            "waiting.state.why_not)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=_clean_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "None None | torch was loaded before the wait could be prepared", proc.stdout


def test_a_process_of_one_thread_starts_no_watcher() -> None:
    """A team of one thread never waits for a mate (torch.distributed ranks run so, as a rule): no thread is
    started, so such a rank still forks its keeper (shaky.job.keeper forks only a process of one thread)."""
    code = ("import threading; from shaky.cli import process_settings; from shaky import waiting; "
            "process_settings(shared_cores=True); print(waiting.state.where, threading.active_count(), "
            "waiting.state.why_not)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**_clean_env(), "OMP_NUM_THREADS": "1"}, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "None 1 one OpenMP thread: nothing waits", proc.stdout
