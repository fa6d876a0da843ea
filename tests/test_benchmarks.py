"""The benchmark scripts still run: each at its smallest settings, as a user would start it.

Nothing else runs them, and a script that stops working is found only when someone needs its numbers
(``benchmarks/loop.py`` stopped at W = 64 for a while, after the batch-size check came in). The timings
themselves are not checked: a test never asserts a time.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, timeout: float = 240) -> str:
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_the_simulator_benchmark_prints_its_table_and_json(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    text = _run("benchmarks/sim.py", "--quick", "--models", "mlp", "--workers", "4", "--no-gloo", "--no-memory",
                "--no-vmap", "--json", str(out))
    assert re.search(r"^\s*mlp\s+4\s+[\d.]+", text, re.MULTILINE), text
    row = json.loads(out.read_text())["rows"][0]
    assert (row["case"], row["W"]) == ("mlp", 4) and row["a"] > 0 and row["c"] > 0


def test_the_loop_benchmark_runs_at_w_64_with_a_batch_digits_shards_hold() -> None:
    text = _run("benchmarks/loop.py", "--workers", "4", "64", "--steps", "20", "--repeats", "1")
    rows = {int(m[0]): int(m[1]) for m in re.findall(r"^\s*(\d+)\s+(\d+)\s+default\s+[\d.]+", text, re.MULTILINE)}
    assert rows == {4: 32, 64: 16}, text
