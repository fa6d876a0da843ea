"""DTS's overlap on a real transport: steps per second of synchronous and delayed averaging over udp, against an
emulated one-way latency, beside the simulated clock's prediction of the same runs.

    .venv/bin/python benchmarks/overlap.py --json runs/overlap.json --plot docs/overlap.png   # about 20 minutes
    .venv/bin/python benchmarks/overlap.py --quick          # about 6 minutes: latencies 0 and 100 ms, 60 steps
    .venv/bin/python benchmarks/overlap.py --from-json runs/overlap.json --plot docs/overlap.png   # measure nothing

Needs root, unshare and ip; without them it prints one line saying what is missing and exits with status 2. It
re-executes itself under ``unshare --net``: inside, only a loopback exists (1500-byte MTU). No traffic leaves it,
and nothing is lost (no iptables rule): the latency is the variable.

Every run is ``torchrun -m shaky train --backend dist --transport udp`` with 4 processes on digits, a CNN and
batch 256 per worker (about 45 ms a step when the 4 processes share this machine's 2 cores), with
``dist.emulate_latency = true`` and ``network.latency_ms`` set to the latency of the column: each rank's delay
line holds every datagram that long before it leaves, and each request of a control round (the masks of each
exchange, with the loss means riding in them) waits that long before it goes to the store rank 0 hosts and
after its answer (application-level emulation: the kernel here has no netem). The simulated clock models the
data plane only: a round's two round trips to rank 0 are shaky's, not the algorithms', and where no delay
hides them they are the difference between the measured and predicted columns.
Rows: ``allreduce`` is dts with t = 1 (a synchronous average every step over the same udp transport: the
exchange is RPS's block average either way), dts with t = 2, 4, 8, 16 and d = 1 (an average launched every
step, applied t - 1 steps later, running in the background meanwhile), and local SGD with tau = 8.

Measured: seconds per step from the run's own wall time less its evaluations (``summary.json``'s ``wall_time_s -
eval_time_s`` over its steps: the start-up of torchrun and Python excluded, and so are the evaluations at step 0
and at the end, which the clock does not model; the last one's rounds of means wait for every exchange still in
flight, about a second at 100 ms, each printed as "eval s"), the seconds it waited for exchanges (``wait_s``, rank 0), and
whether the simulator replaying the run's trace ends at its parameters (the largest absolute difference).
Predicted: the run's own simulated clock (``sim_time_s`` over its steps), with two numbers calibrated first in
the same harness and then held fixed: ``network.compute_ms`` from a run that never communicates (its seconds
per step), and ``network.exchange_compute_ms`` from dts t = 16 at 0 ms, whose delay hides the whole exchange
but the time it takes of the cores (packing, tagging, receiving: on 2 cores shared by 4 ranks no delay hides
that); every link gets 10 Gbit/s (a loopback's bytes cost the cores, not a wire). That one setting matches by
construction; every other one is a prediction. Prints Markdown tables of the ratios, all measured in this run; ``--json`` keeps every
number (rewritten after each run), ``--from-json`` prints and plots them again. docs/transport.md shows a run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from transport import _free_port, _netns, _sh, _unavailable, save_json  # noqa: E402 (a sibling script, not a package)

WORLD = 4
INSIDE = "SHAKY_OVERLAP_OUTER_NETNS"
"""The network namespace the benchmark was started in, handed to its re-executed self."""
BASE = ["--dataset", "digits", "--model", "cnn", "--batch-size", "256", "--workers", str(WORLD)]
ROWS: dict[str, list[str]] = {
    "allreduce (t = 1)": ["--strategy", "dts", "--set", "strategy.delay=1"],
    "dts t = 2": ["--strategy", "dts", "--set", "strategy.delay=2"],
    "dts t = 4": ["--strategy", "dts", "--set", "strategy.delay=4"],
    "dts t = 8": ["--strategy", "dts", "--set", "strategy.delay=8"],
    "dts t = 16": ["--strategy", "dts", "--set", "strategy.delay=16"],
    "local-sgd tau = 8": ["--strategy", "local-sgd", "--set", "strategy.period=8"],
}
SILENT = ["--strategy", "local-sgd", "--set", "strategy.period=1000000"]
"""The calibration run of the compute: local SGD whose period never comes, so nothing is ever exchanged."""
HIDDEN = "dts t = 16"
"""The calibration run of an exchange's compute: at 0 ms its 15 steps of delay hide the whole exchange but the
cores' time it takes, which is then the step's time less the silent run's."""
CHECK_ROW, CHECK_LATENCY_MS = "dts t = 8", 100.0
"""The setting whose replay is checked on the MLP too."""
BANDWIDTH_MBPS = 10000.0
"""The clock's bandwidth of every link: a loopback's bytes cost the cores (exchange_compute_ms), not a wire."""


def _train(out: Path, flags: list[str], steps: int, timeout_s: float, env: dict[str, str]) -> dict[str, Any]:
    """One torchrun in its own pid namespace (a timeout kills all of it); the summary, or why there is none."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    cmd = ["unshare", "--pid", "--fork", "--kill-child", torchrun, "--nproc-per-node", str(WORLD), "--master-addr",
           "127.0.0.1", "--master-port", str(_free_port()), "-m", "shaky", "train", "--backend", "dist",
           "--transport", "udp", *BASE, *flags, "--steps", str(steps), "--eval-every", str(steps),
           "--out", str(out), "--quiet"]
    with open(out.with_name(out.name + ".log"), "w+") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return {"status": "timeout"}
        if rc != 0:
            log.seek(0)
            return {"status": "error", "why": f"exit status {rc}: {log.read()[-1500:]}"}
    summary = json.loads((out / "summary.json").read_text())
    return {"status": "ok", "steps": summary["steps"], "wall_s": summary["wall_time_s"] - summary["eval_time_s"],
            "eval_s": summary["eval_time_s"],
            "sim_s": summary["sim_time_s"], "compute_ms": summary["compute_ms"], "wait_s": summary["wait_s"],
            "sim_wait_s": summary["sim_wait_s"], "accuracy": summary["final_test_accuracy"],
            "udp": summary["udp"]}


def _replay_difference(out: Path, env: dict[str, str]) -> dict[str, Any] | None:
    """How far the run's parameters are from the simulator's replay of its trace: the largest absolute
    difference, and whether they are allclose at rtol = atol = 1e-5."""
    import torch  # noqa: PLC0415

    from shaky.rundir import load_checkpoint  # noqa: PLC0415

    replay = out.with_name(out.name + "-replay")
    proc = subprocess.run([sys.executable, "-m", "shaky", "train", "--config", str(out / "config.toml"),
                           "--backend", "sim", "--transport", "gloo", "--set", "dist.emulate_latency=false",
                           "--replay-trace", str(out), "--out", str(replay), "--quiet"],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        print(f"  replay failed: {proc.stderr[-500:]}", flush=True)
        return None
    real, replayed = load_checkpoint(out)["params"], load_checkpoint(replay)["params"]
    return {"max_abs_diff": float((real - replayed).abs().max()),
            "allclose": bool(torch.allclose(real, replayed, rtol=1e-5, atol=1e-5))}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Calibrates, then runs every (row, latency); with ``--json`` the file holds every number so far."""
    import torch  # noqa: PLC0415

    _sh("ip", "link", "set", "lo", "up", "mtu", "1500")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}
    data: dict[str, Any] = {"meta": {
        "command": shlex.join([".venv/bin/python", "benchmarks/overlap.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__, "python": platform.python_version(),
        "cores": os.cpu_count(), "load_before": os.getloadavg()[0], "steps": args.steps,
        "latencies_ms": args.latencies, "model": "digits, cnn, batch 256 per worker, 4 workers"}, "rows": []}

    def save() -> None:
        save_json(args.json, data)

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="shaky-overlap-") as tmp:
        common = ["--set", "dist.emulate_latency=true", "--set", "network.latency_ms=0"]
        silent = _train(Path(tmp) / "silent", [*SILENT, *common], args.steps, args.timeout, env)
        if silent["status"] != "ok":
            raise SystemExit(f"the calibration run (no exchange) failed: {silent}")
        compute_ms = silent["wall_s"] / silent["steps"] * 1e3
        print(f"calibration: a step without exchanges takes {compute_ms:.1f} ms (network.compute_ms)", flush=True)
        hidden = _train(Path(tmp) / "hidden", [*ROWS[HIDDEN], *common], args.steps, args.timeout, env)
        if hidden["status"] != "ok":
            raise SystemExit(f"the calibration run ({HIDDEN}, 0 ms) failed: {hidden}")
        exchange_compute_ms = max(0.0, hidden["wall_s"] / hidden["steps"] * 1e3 - compute_ms)
        print(f"calibration: an exchange that the delay hides still adds {exchange_compute_ms:.1f} ms of the cores' "
              f"time to a step (network.exchange_compute_ms)", flush=True)
        data["calibration"] = {"compute_ms": compute_ms, "exchange_compute_ms": exchange_compute_ms,
                               "bandwidth_mbps": BANDWIDTH_MBPS, "silent": silent, "hidden": hidden}
        save()
        for latency in args.latencies:
            for name, flags in ROWS.items():
                out = Path(tmp) / f"{name.split()[0]}-{flags[-1].split('=')[1]}-{latency:g}"
                record: dict[str, Any] = {"row": name, "latency_ms": latency}
                record.update(_train(out, [*flags, "--set", "dist.emulate_latency=true", "--set",
                                           f"network.latency_ms={latency}", "--set",
                                           f"network.compute_ms={compute_ms}", "--set",
                                           f"network.exchange_compute_ms={exchange_compute_ms}", "--set",
                                           f"network.bandwidth_mbps={BANDWIDTH_MBPS}"],
                                    args.steps, args.timeout, env))
                if record["status"] == "ok" and not args.no_replay:
                    record["replay"] = _replay_difference(out, env)
                data["rows"].append(record)
                save()
                shown = (f"{record['wall_s'] / record['steps'] * 1e3:.1f} ms a step (clock "
                         f"{record['sim_s'] / record['steps'] * 1e3:.1f}), eval s {record['eval_s']:.2f}, "
                         f"replay {record.get('replay')}"
                         if record["status"] == "ok" else record)
                print(f"  {name}, {latency:g} ms: {shown}", flush=True)
        if not args.no_replay:
            # The CNN's vectorized simulator and a process of its own round differently (a gloo run and the
            # simulator differ by about 1e-5 after 100 steps, with no udp at all), so the replay's equality is
            # also checked on the MLP, where the two backends agree to float32's last bits.
            for name, model in (("gloo, no udp", None), ("mlp", ["--model", "mlp", "--batch-size", "32"])):
                out = Path(tmp) / f"check-{name.split(',')[0]}"
                if model is None:
                    flags = [*ROWS[CHECK_ROW], "--transport", "gloo"]
                    record = {"check": "cnn on gloo (no udp): the backends' own difference", "latency_ms": 0.0}
                else:
                    flags = [*ROWS[CHECK_ROW], *model, "--set", "dist.emulate_latency=true", "--set",
                             f"network.latency_ms={CHECK_LATENCY_MS}"]
                    record = {"check": f"mlp, {CHECK_ROW}, {CHECK_LATENCY_MS:g} ms", "latency_ms": CHECK_LATENCY_MS}
                record.update(_train(out, flags, args.steps, args.timeout, env))
                if record["status"] == "ok":
                    record["replay"] = _replay_difference(out, env)
                data.setdefault("checks", []).append(record)
                save()
                print(f"  check {record['check']}: {record.get('replay', record)}", flush=True)
    data["meta"].update(took_s=time.perf_counter() - t0, load_after=os.getloadavg()[0])
    save()
    return data


# ------------------------------------------------------------------------------------------ output

def _get(data: dict[str, Any], row: str, latency: float) -> dict[str, Any] | None:
    for rec in data["rows"]:
        if rec["row"] == row and rec["latency_ms"] == latency and rec["status"] == "ok":
            return rec
    return None


def _rate(rec: dict[str, Any] | None) -> float | None:
    return rec["steps"] / rec["wall_s"] if rec else None


def report(data: dict[str, Any]) -> None:
    meta, cal = data["meta"], data.get("calibration", {})
    latencies = meta["latencies_ms"]
    print(f"\n{meta['model']}, {meta['steps']} steps a run, {meta['date']}, {meta['cores']} cores; a step without "
          f"exchanges: {cal.get('compute_ms', float('nan')):.1f} ms; the cores' time of a hidden exchange: "
          f"{cal.get('exchange_compute_ms', float('nan')):.1f} ms\n")
    print("Steps per second (measured), and as a fraction of the same row at 0 ms:\n")
    header = ["row", *[f"{lat:g} ms" for lat in latencies]]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in ROWS:
        base = _rate(_get(data, row, 0.0))
        cells = []
        for lat in latencies:
            rate = _rate(_get(data, row, lat))
            cells.append("-" if rate is None else f"{rate:.2f}" + (f" ({rate / base:.2f})" if base else ""))
        print("| " + " | ".join([row, *cells]) + " |")
    print("\nSeconds per step, measured / predicted by the simulated clock (ratio); wait_s measured / predicted; "
          "the replay's largest parameter difference:\n")
    header = ["row", "latency", "measured s/step", "clock s/step", "clock / measured", "wait_s", "sim_wait_s",
              "replay max |diff| (allclose 1e-5)", "accuracy"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for lat in latencies:
        for row in ROWS:
            rec = _get(data, row, lat)
            if rec is None:
                print(f"| {row} | {lat:g} ms | failed | | | | | | |")
                continue
            measured, predicted = rec["wall_s"] / rec["steps"], rec["sim_s"] / rec["steps"]
            calibrated = " (calibrated)" if row == HIDDEN and lat == 0 else ""
            print(f"| {row} | {lat:g} ms | {measured:.4f} | {predicted:.4f} | {predicted / measured:.2f}{calibrated} "
                  f"| {rec['wait_s']:.2f} | {rec['sim_wait_s']:.2f} | {_replayed(rec)} | {rec['accuracy']:.3f} |")
    if data.get("checks"):
        print("\nThe simulator's replay, checked where the two backends compute alike:\n")
        print("| run | steps/s | replay max |diff| (allclose 1e-5) |")
        print("|---|---|---|")
        for rec in data["checks"]:
            rate = f"{_rate(rec):.2f}" if rec["status"] == "ok" else rec["status"]
            print(f"| {rec['check']} | {rate} | {_replayed(rec)} |")


def _replayed(rec: dict[str, Any]) -> str:
    replay = rec.get("replay")
    if not replay:
        return "-"
    return f"{replay['max_abs_diff']:.1e} ({'yes' if replay['allclose'] else 'no'})"


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    latencies = data["meta"]["latencies_ms"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for k, row in enumerate(ROWS):
        pts = [(lat, _rate(_get(data, row, lat))) for lat in latencies]
        pts = [(lat, r) for lat, r in pts if r is not None]
        if not pts:
            continue
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=row)
        predicted = [(lat, rec["steps"] / rec["sim_s"]) for lat in latencies
                     if (rec := _get(data, row, lat)) is not None]
        ax.plot([p[0] for p in predicted], [p[1] for p in predicted], ls=":", color=line.get_color())
    ax.set_xlabel("emulated one-way latency between every pair (ms)")
    ax.set_ylabel("steps per second (dotted: the clock's prediction)")
    ax.set_title("udp, 4 processes: delayed averaging hides the latency")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="latencies 0 and 100 ms, 60 steps")
    parser.add_argument("--latencies", type=float, nargs="+", help="one-way latencies in ms (default 0 25 100 200)")
    parser.add_argument("--steps", type=int, help="steps a run (default 100)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take (default 600)")
    parser.add_argument("--no-replay", action="store_true", help="skip the simulator's replay of each run")
    parser.add_argument("--plot", type=Path, help="write the plot here (PNG)")
    parser.add_argument("--json", type=Path, help="write every measured number here (after every run)")
    parser.add_argument("--from-json", type=Path, help="measure nothing: print and plot this file's numbers")
    args = parser.parse_args()
    if args.latencies is None:
        args.latencies = [0.0, 100.0] if args.quick else [0.0, 25.0, 100.0, 200.0]
    if args.steps is None:
        args.steps = 60 if args.quick else 100
    if 0.0 not in args.latencies:
        parser.error("--latencies must include 0 (the ratios are against 0 ms)")
    if args.steps < 20:
        parser.error(f"--steps must be at least 20, got {args.steps}")

    if args.from_json is not None:
        data = json.loads(args.from_json.read_text())
    elif INSIDE not in os.environ:
        why = _unavailable(("unshare", "ip"), "a network namespace")   # no iptables: nothing is dropped here
        if why:
            print(f"benchmarks/overlap.py: skipped: {why}")
            return 2
        env = {**os.environ, INSIDE: _netns()}
        return subprocess.run(["unshare", "--net", sys.executable, __file__, *sys.argv[1:]], env=env).returncode
    else:
        if _netns() == os.environ[INSIDE]:
            raise SystemExit(f"{INSIDE} is set but this process is in the namespace it was started in")
        data = measure(args)
    report(data)
    if args.plot is not None:
        plot(data, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
