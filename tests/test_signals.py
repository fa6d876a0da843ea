"""SIGINT and SIGTERM at 50 seeded moments spread over the whole life of a ``shaky train`` and of a ``shaky sweep``:
Python starting and loading torch, the run directory being made, training, checkpoints, the summary, the process
ending. Every stop gives one line and the signal's status (130, 143), or the command finishes and, where the
signal came as it was ending, says so with status 0; nothing half-written is left (no ``*.tmp`` anywhere); and
the same command (``--resume`` for a run) then ends with every number of the run never stopped.

The one moment no program can answer is Python's own start-up, before it has run a line of shaky (its site
imports, the console script's first import: some 40 ms): there SIGINT is Python's KeyboardInterrupt traceback
and SIGTERM ends the process, before anything was written. Those outcomes are accepted only as that: a
traceback whose every frame is Python's own or a module being imported, and no directory made.

The moments are drawn from the seed over 1.05 times the life of a reference run measured in the same test (a
slower machine stretches them alike). Slow (minutes: each moment starts Python and torch), so ``kill`` marked:
``make test-kill`` runs them.
"""

from __future__ import annotations

import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import assert_same_run, default_sigint

pytestmark = pytest.mark.kill

MOMENTS = 50
SEED = 20261127
SHAKY = str(Path(sys.executable).with_name("shaky"))
STATUS = {signal.SIGINT: 130, signal.SIGTERM: 143}

TRAIN = ["train", "--workers", "4", "--steps", "600", "--eval-every", "100", "--checkpoint-every", "100",
         "--drop-rate", "0.1", "--set", "network.compute_ms=1.0", "--quiet"]
SWEEP = """
[base]
steps = 300
num_workers = 4
eval_every = 100
checkpoint_every = 100
network = {compute_ms = 1.0, drop_rate = 0.1}
[grid]
seed = [0, 1]
"""


def _start(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([SHAKY, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_sigint)


def _life(args: list[str], cwd: Path) -> float:
    """Seconds from start to end of the reference (it must succeed)."""
    t0 = time.perf_counter()
    proc = _start(args, cwd)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]
    return time.perf_counter() - t0


def _signal_at(proc: subprocess.Popen[str], delay: float, signum: int) -> tuple[int, str, bool]:
    """(status, stderr, whether the signal was sent: False where the process had ended first)."""
    try:
        proc.wait(timeout=delay)
        sent = False
    except subprocess.TimeoutExpired:
        proc.send_signal(signum)
        sent = True
    _, err = proc.communicate(timeout=180)
    return proc.returncode, err, sent


_FRAME = re.compile(r'^  File "([^"]+)", line \d+, in (\S+)$')


def _python_start_up(code: int, err: str, signum: int) -> bool:
    """The process ended in Python's own start-up, before shaky's handlers: killed by SIGTERM without a word, or
    a KeyboardInterrupt raised while modules were being imported (every frame Python's own, frozen, or a module's
    top level)."""
    if code == -signum and not err:
        return True
    lines = err.strip().splitlines()
    if code not in (1, -signal.SIGINT) or signum != signal.SIGINT or not lines or lines[-1] != "KeyboardInterrupt":
        return False
    frames = [m.groups() for m in map(_FRAME.match, lines) if m]
    stdlib = str(Path(re.__file__).parent)
    return bool(frames) and all(path.startswith(("<frozen ", stdlib)) or func == "<module>" for path, func in frames)


def _check_outcome(code: int, err: str, signum: int, made: Path) -> str:
    """What the stop was ('stopped', 'finished' or 'start-up'), after checking its line, status and files."""
    assert "Traceback" not in err or _python_start_up(code, err, signum), err[-3000:]
    leftovers = sorted(str(p) for p in made.rglob("*.tmp")) if made.exists() else []
    assert not leftovers, leftovers
    if _python_start_up(code, err, signum):
        assert not made.exists(), "Python's start-up wrote nothing of shaky's"
        return "start-up"
    lines = err.strip().splitlines()
    assert all(line.startswith("shaky: ") for line in lines), err
    if code == 0:   # it finished: said if the signal came as it was ending (or it had ended before the signal)
        assert len(lines) <= 1 and all("received as" in line for line in lines), err
        return "finished"
    assert code == STATUS[signum], (code, err)
    assert len(lines) == 1, err
    return "stopped"


def test_a_run_stopped_at_50_moments_of_its_life_says_so_and_resumes_identical(tmp_path: Path) -> None:
    life = _life([*TRAIN, "--out", "ref"], tmp_path)
    rng = random.Random(SEED)
    seen = []
    for i in range(MOMENTS):
        delay, signum = rng.uniform(0.0, 1.05 * life), rng.choice((signal.SIGINT, signal.SIGTERM))
        run = tmp_path / f"run{i}"
        code, err, sent = _signal_at(_start([*TRAIN, "--out", run.name], tmp_path), delay, signum)
        what = _check_outcome(code, err, signum, run) if sent else "ended first"
        if not sent:
            assert code == 0, err
        if run.exists() and not (run / "summary.json").exists():
            proc = _start(["train", "--resume", run.name, "--quiet"], tmp_path)
            _, err = proc.communicate(timeout=600)
            assert proc.returncode == 0, (i, delay, what, err[-2000:])
        if run.exists():
            assert_same_run(run, tmp_path / "ref")
        seen.append((round(delay, 2), signal.Signals(signum).name, what))
    # The moments cover the run's life: stopped in training, and at its start and end.
    assert sum(what == "stopped" for *_, what in seen) >= MOMENTS // 2, seen


def test_a_sweep_stopped_at_50_moments_of_its_life_says_so_and_ends_identical(tmp_path: Path) -> None:
    (tmp_path / "grid.toml").write_text(SWEEP)
    sweep = ["sweep", "grid.toml", "--jobs", "2", "--quiet"]
    life = _life([*sweep, "--out", "ref"], tmp_path)
    rng = random.Random(SEED + 1)
    seen = []
    for i in range(MOMENTS):
        delay, signum = rng.uniform(0.0, 1.05 * life), rng.choice((signal.SIGINT, signal.SIGTERM))
        out = tmp_path / f"out{i}"
        code, err, sent = _signal_at(_start([*sweep, "--out", out.name], tmp_path), delay, signum)
        what = _check_outcome(code, err, signum, out) if sent else "ended first"
        if not sent:
            assert code == 0, err
        if what in ("stopped", "start-up"):     # the same command again finishes what is left
            proc = _start([*sweep, "--out", out.name], tmp_path)
            _, err = proc.communicate(timeout=600)
            assert proc.returncode == 0, (i, delay, what, err[-2000:])
        for seed in (0, 1):
            assert_same_run(out / "grid" / f"seed={seed}", tmp_path / "ref" / "grid" / f"seed={seed}")
        seen.append((round(delay, 2), signal.Signals(signum).name, what))
    assert sum(what == "stopped" for *_, what in seen) >= MOMENTS // 2, seen
