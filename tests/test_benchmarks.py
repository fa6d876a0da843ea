"""The benchmark scripts still run: ``benchmarks/loop.py`` at its smallest settings, as a user would start it
(it runs ``shaky train`` and ``benchmarks/sim.py --quick``, and reads the latter's JSON), and
``benchmarks/breakdown.py`` (which instruments the loop by the names of its functions).

Nothing else runs them, and a script that stops working is found only when someone needs its numbers
(``benchmarks/loop.py`` stopped at W = 64 for a while, after the batch-size check came in). The timings
themselves are not checked: a test never asserts a time.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_loop_benchmark_runs_at_w_64_with_a_batch_digits_shards_hold() -> None:
    proc = subprocess.run([sys.executable, "benchmarks/loop.py", "--workers", "64", "--steps", "20", "--repeats", "1",
                           "--no-busy"],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = re.findall(r"^\s*(\d+)\s+(\d+)\s+default\s+([\d.]+)\s+[\d.]+\s+([\d.]+)", proc.stdout, re.MULTILINE)
    assert [(int(w), int(b)) for w, b, _, _ in rows] == [(64, 16)], proc.stdout
    assert all(float(ms) > 0 and float(c) > 0 for _, _, ms, c in rows)


def test_the_loop_benchmark_keeps_the_default_batch_where_shards_hold_it() -> None:
    spec = importlib.util.spec_from_file_location("loop_benchmark", ROOT / "benchmarks" / "loop.py")
    assert spec is not None and spec.loader is not None
    loop = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loop)
    # digits trains on 1,437 samples: 44 workers get shards of 32, 45 of 31
    assert [loop.batch_for(w, None) for w in (4, 16, 44, 45, 64, 200)] == [32, 32, 32, 16, 16, 4]
    assert loop.batch_for(64, 8) == 8


def test_the_breakdown_benchmark_times_every_part_of_the_loop() -> None:
    proc = subprocess.run([sys.executable, "benchmarks/breakdown.py", "--workers", "4", "--drop-rate", "0.1",
                           "--steps", "60", "--eval-every", "20"],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = dict(re.findall(r"^\s*([a-z ]+?)\s+([\d.]+)\s+\d+%$", proc.stdout, re.MULTILINE))
    parts = ["step", "block average", "bmm and baddbmm", "evaluation", "masks", "mask log", "sampler", "loss mean",
             "clock"]
    assert set(rows) == {*parts, "rest", "loop"}, proc.stdout
    # Every part was called (a renamed function would leave its part at 0), and none is counted inside another
    # (the rest, the loop less the parts, would come out negative and not match the pattern above).
    assert all(float(rows[p]) > 0 for p in parts), proc.stdout
    assert float(rows["block average"]) < float(rows["step"]) < float(rows["loop"]), proc.stdout
    # The step's matrix products are a part of the step.
    assert float(rows["bmm and baddbmm"]) < float(rows["step"]), proc.stdout
