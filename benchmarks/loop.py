"""The whole training loop against the hardware limit: `shaky train` end to end beside benchmarks/sim.py's (c).

    .venv/bin/python benchmarks/loop.py                     # W = 16 and 64, default settings, 3 repeats
    .venv/bin/python benchmarks/loop.py --variants default OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1
    .venv/bin/python benchmarks/loop.py --no-busy           # the quiet runs alone
    .venv/bin/python benchmarks/loop.py --variants default GOMP_SPINCOUNT=300000   # the adapted wait beside the spin
    .venv/bin/python benchmarks/loop.py --variants default tree=../old   # beside another checkout's shaky

Each repeat runs, one after another so that load from other programs hits them
alike: ``shaky train --strategy rps --drop-rate 0.1 --workers W --steps STEPS
--quiet`` on digits with an MLP (the defaults otherwise: evaluation every 50
steps, the sampler, the masks, the clock and the metrics all included), once per
variant (``default``: no environment variable set, what a user gets; any other
variant: ``NAME=VALUE`` pairs joined by ``,`` added to the environment; the pair
``tree=DIR`` runs the shaky of another checkout instead, to compare versions), and
then ``benchmarks/sim.py``'s limit (c) for the same W (one model at batch
W x B, forward, backward and an SGD step, torch's default threads). Unless
``--no-busy``, every train run is made a second time right after, with another
program busy on one core beside it (a Python process spinning in a loop: a
browser tab, a second sweep, a CI job), and the table shows its median against
the quiet runs' ("busy/quiet"): what a shared machine does to a run. B is 32, the
default, where the 1,437 training samples of digits give every worker a shard of
at least 32; beyond 44 workers it is the largest power of two a shard holds (16 at
W = 64, whose shards hold 22), or ``--batch-size``. A run's
milliseconds per step are summary.json's ``wall_time_s`` over its steps. The
table shows the median and the fastest of the repeats, and their ratio to (c).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _pairs(variant: str) -> dict[str, str]:
    return {} if variant == "default" else dict(pair.partition("=")[::2] for pair in variant.split(","))


def _env(variant: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "MALLOC_"))}
    env.update({k: v for k, v in _pairs(variant).items() if k != "tree"})
    return env


def _tree(variant: str) -> Path:
    """The checkout whose shaky a variant runs (``python -m shaky`` imports it from the working directory)."""
    return Path(_pairs(variant).get("tree", ROOT)).resolve()


def batch_for(workers: int, asked: int | None) -> int:
    """``asked``, else 32 where digits' shards hold it, else the largest power of two they hold."""
    if asked is not None:
        return asked
    sys.path.insert(0, str(ROOT))
    from shaky.data import load_dataset  # noqa: PLC0415 (scikit-learn: only when needed)

    shard = len(load_dataset("digits", seed=0).y_train) // workers
    batch = 32
    while batch > 1 and batch > shard:
        batch //= 2
    return batch


BUSY = "while True: pass"
"""The other program of a busy run: one core's worth of work that never sleeps."""


def train_ms(workers: int, batch: int, steps: int, variant: str, scratch: Path, busy: bool = False) -> float:
    """ms per step of one ``shaky train`` run; ``busy``: with a process spinning on one core beside it."""
    out = scratch / f"{variant}-{workers}".replace("=", "_").replace(",", "+").replace("/", "_")
    cmd = [sys.executable, "-m", "shaky", "train", "--strategy", "rps", "--drop-rate", "0.1", "--workers",
           str(workers), "--batch-size", str(batch), "--steps", str(steps), "--quiet", "--out", str(out)]
    subprocess.run(["rm", "-rf", str(out)], check=True)
    spinner = subprocess.Popen([sys.executable, "-c", BUSY]) if busy else None
    try:
        proc = subprocess.run(cmd, env=_env(variant), cwd=_tree(variant), capture_output=True, text=True,
                              timeout=1800)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    if proc.returncode:
        raise SystemExit(f"benchmarks/loop.py: {' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return 1e3 * summary["wall_time_s"] / summary["steps"]


def limit_ms(workers: int, batch: int, scratch: Path) -> tuple[float, float]:
    """(median, fastest) ms of (c) from benchmarks/sim.py, run as a user runs it."""
    out = scratch / f"sim-{workers}.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "sim.py"), "--quick", "--models", "mlp", "--workers",
           str(workers), "--batch", str(batch), "--no-gloo", "--no-memory", "--no-vmap", "--json", str(out)]
    proc = subprocess.run(cmd, env=_env("default"), cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"benchmarks/loop.py: {' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    row = json.loads(out.read_text())["rows"][0]
    return row["c"], row["c_min"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--steps", type=int, default=1000, help="steps of each shaky train run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=None,
                        help="per worker (default: 32 where digits' shards hold it, else what they hold)")
    parser.add_argument("--variants", nargs="+", default=["default"],
                        help="'default' (no environment variable) or NAME=VALUE[,NAME=VALUE...]")
    parser.add_argument("--no-busy", action="store_true",
                        help="skip the runs with another program busy on one core")
    args = parser.parse_args(argv)
    for v in args.variants:
        if v != "default" and not all("=" in pair for pair in v.split(",")):
            parser.error(f"--variants: {v!r} is not 'default' or NAME=VALUE[,NAME=VALUE...]")
        if not (_tree(v) / "shaky" / "__main__.py").is_file():
            parser.error(f"--variants: tree={_tree(v)} holds no shaky checkout (shaky/__main__.py)")
    if args.batch_size is not None and args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1; got {args.batch_size}")
    batches = {w: batch_for(w, args.batch_size) for w in args.workers}
    print(f"shaky benchmarks/loop.py: {os.cpu_count()} CPUs, digits mlp rps drop 0.1, {args.steps} steps, "
          f"{args.repeats} repeats, load average {os.getloadavg()[0]:.1f}", flush=True)
    runs: dict[tuple[int, str], list[float]] = {}
    busy: dict[tuple[int, str], list[float]] = {}
    limits: dict[int, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="shaky-loop-") as tmp:
        scratch = Path(tmp)
        for r in range(args.repeats):
            for w in args.workers:
                for v in args.variants:
                    runs.setdefault((w, v), []).append(train_ms(w, batches[w], args.steps, v, scratch))
                    if not args.no_busy:
                        busy.setdefault((w, v), []).append(train_ms(w, batches[w], args.steps, v, scratch, busy=True))
                limits.setdefault(w, []).append(limit_ms(w, batches[w], scratch))
                print(f"  repeat {r + 1} W={w} B={batches[w]}: "
                      + ", ".join(f"{v} {runs[(w, v)][-1]:.2f}" + (f" (busy {busy[(w, v)][-1]:.2f})" if busy else "")
                                  for v in args.variants) + f", c {limits[w][-1][0]:.2f} ms", flush=True)
    print()
    header = (f"{'W':>3} {'B':>3}  {'variant':<32} {'ms/step':>8} {'min':>6} {'c ms':>6} {'c min':>6} {'ratio':>6} "
              f"{'min ratio':>9}" + (f" {'busy ms':>8} {'busy max':>8} {'busy/quiet':>10}" if busy else ""))
    print(header)
    print("-" * len(header))
    for w in args.workers:
        c = statistics.median(m for m, _ in limits[w])
        c_min = min(m for _, m in limits[w])
        for v in args.variants:
            ms = statistics.median(runs[(w, v)])
            fastest = min(runs[(w, v)])
            line = (f"{w:>3} {batches[w]:>3}  {v:<32} {ms:>8.2f} {fastest:>6.2f} {c:>6.2f} {c_min:>6.2f} {ms / c:>6.2f} "
                    f"{fastest / c_min:>9.2f}")
            if busy:
                b = statistics.median(busy[(w, v)])
                line += f" {b:>8.2f} {max(busy[(w, v)]):>8.2f} {b / ms:>10.2f}"
            print(line)
    print(f"\nratio: median ms per step of shaky train over the median of (c); min ratio: fastest over fastest; "
          f"busy: the same runs with a process spinning on one core beside them, busy/quiet their medians' ratio. "
          f"load average now {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
