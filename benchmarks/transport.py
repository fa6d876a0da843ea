"""RPS over UDP against gloo under REAL packet loss: 4 processes in a private network namespace whose
loopback drops packets at random (an iptables rule), one RPS round and a whole training run.

    .venv/bin/python benchmarks/transport.py --json runs/transport.json --plot runs/transport.png   # 40 minutes
    .venv/bin/python benchmarks/transport.py --quick        # about 6 minutes: 1e6 values, 3 loss rates, 300 steps
    .venv/bin/python benchmarks/transport.py --part rounds --json runs/transport-rounds.json   # or --part train
    .venv/bin/python benchmarks/transport.py --from-json runs/transport-rounds.json runs/transport-train.json \
        --plot docs/transport.png                           # print and plot again, measure nothing
    .venv/bin/python benchmarks/transport.py --keep-gso --part rounds --losses 0   # only the batching-on rows
    .venv/bin/python benchmarks/transport.py --part train --every-packet --losses 0 0.05 0.1   # TCP dropped too

Needs root, unshare, ip and iptables; without them it prints one line saying what is missing and exits
with status 2. It re-executes itself under ``unshare --net``: inside, only a loopback exists, with a
1500-byte MTU and ``gso_max_segs 1`` (after the batching-on rows, below), and the rule

    iptables -A INPUT -i lo -p PROTO -m statistic --mode random --probability P -j DROP

drops the data plane under test: PROTO tcp for the gloo rows, udp for the udp rows (``--every-packet``: all, in
the train part, as a real lossy network drops the control plane's TCP too). No traffic leaves it.
``gso_max_segs 1`` makes the kernel cut every GSO batch (UDP's 44-datagram sends, TCP's 64 KB segments) into
1500-byte packets before the device, so that the rule drops single packets as a real network would, not
whole batches; it also takes the batching away, which makes both transports slower than on a NIC that
offloads it. So the rounds part first measures, on the same loopback with its GSO left on (the kernel's batching,
as a NIC that offloads it gives), what its loss-0 rounds take (the "batching on" table), with the machine's own
UDP limit beside it: one process sending 1472-byte datagrams to another with GSO and GRO
(``benchmarks/udp_probe.py``'s wire part, case c), the Gbit/s that the udp rows' all-ranks rates are compared
with. Then ``gso_max_segs 1`` and the loss grid. ``--keep-gso`` runs the batching-on rows alone.

rounds  one round of each operation on a [1, n] float32 row per rank, interleaved (gloo rps, gloo
        all_reduce, udp rps, gloo rps, ...), each under its own rule set between barriers; the round
        time is the slowest rank's, from a barrier to its result. gloo rps is today's
        ``DistComm.block_average`` (every block delivered; the loss is TCP's), all_reduce is
        ``torch.distributed.all_reduce`` (in place), udp rps ``UdpDistComm.block_average`` (RPS on what really
        arrived, the adaptive deadline agreed over gloo); both rps calls give their row up (``overwrite``),
        as the training loop's exchange does, and every rank's allocator keeps freed memory
        (``tune_allocator``), as ``shaky train``'s ranks do. The udp rows' Gbit/s: what a round moves out of
        every rank, 2 (W - 1) / W of the row, all ranks together, over the round's time. Median of ``--repeats``, after two warm-up
        rounds in the first cell of each size. A round is stopped when one of its gloo waits passes
        ``--timeout`` (the process group's timeout) or the round passes ``--timeout`` + 10 s: it reads
        "timeout", the processes are restarted and the same operation at larger sizes and higher loss
        is skipped.
train   ``torchrun -m shaky train --backend dist`` on digits with an MLP, 4 workers, ``--steps``: reliable
        allreduce over gloo (TCP dropped) against rps over udp (UDP dropped); wall time of the whole
        torchrun command (each in its own pid namespace, killed whole after ``--train-timeout``) and the
        final test accuracy from the run directory's summary.json. ``--launcher shaky``: ``shaky launch``
        starts the ranks instead (the way survivors train on: the run's store in a keeper process, not in
        torchrun's agent and rank 0).

Prints Markdown tables of medians and ratios, all measured in this run (the machine is noisy: compare
ratios within a run); ``--json`` keeps every number (rewritten after each measurement, so an interrupted
run keeps what it measured), ``--from-json`` prints and plots them again. docs/transport.md shows a run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import multiprocessing as mp
import os
import platform
import queue
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORLD = 4
OPS = ("gloo_rps", "all_reduce", "udp_rps")
OP_LABELS = {"gloo_rps": "gloo rps", "all_reduce": "gloo all_reduce", "udp_rps": "udp rps"}
OP_PROTO = {"gloo_rps": "tcp", "all_reduce": "tcp", "udp_rps": "udp"}
RUNS = {"gloo": ("tcp", ["--strategy", "allreduce"]), "udp": ("udp", ["--strategy", "rps", "--transport", "udp"])}
RUN_LABELS = {"gloo": "allreduce on gloo", "udp": "rps on udp"}
INSIDE = "SHAKY_TRANSPORT_OUTER_NETNS"
"""The network namespace the benchmark was started in, handed to its re-executed self, which refuses to set
iptables rules unless it is in another one."""
PARTS = ("rounds", "train")
SNMP = ("Udp:RcvbufErrors", "Tcp:InSegs", "Tcp:RetransSegs")
"""The /proc/net/snmp counters kept: UDP datagrams a full receive buffer dropped, TCP segments that arrived,
TCP segments sent again."""
WARM_UP = 2
"""Rounds not measured in the first cell of each size that a set of processes runs: they warm buffers and
connections, and let the udp deadline adapt from its initial 1 s (a phase of 1e7 values can take longer on
2 cores; its late datagrams then arrive during the next round). Kept apart in the JSON."""
SLACK_S = 10.0
"""How much longer than ``--timeout`` the parent waits for a round before killing the processes itself
(a gloo wait longer than ``--timeout``, the process group's own timeout, usually ends it first)."""


# ------------------------------------------------------------------------------------------ the namespace

PACKAGES = {"unshare": "util-linux", "ip": "iproute2", "iptables": "iptables"}
"""The Debian package of each tool a namespace benchmark runs."""


def _unavailable(tools: tuple[str, ...] = ("unshare", "ip", "iptables"),
                 what: str = "a network namespace and an iptables rule") -> str:
    """Why this machine cannot run a benchmark that needs ``tools`` in a network namespace ("" if it can)."""
    if os.geteuid() != 0:
        return f"needs root ({what})"
    for tool in tools:
        if shutil.which(tool) is None:
            return f"needs {tool} (apt-get install {' '.join(PACKAGES[t] for t in tools)})"
    if subprocess.run(["unshare", "--net", "true"], capture_output=True).returncode != 0:
        return "needs unshare --net (creating a network namespace failed)"
    return ""


def _netns() -> str:
    return os.readlink("/proc/self/ns/net")


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


def _setup_namespace(mtu: int) -> None:
    _sh("ip", "link", "set", "lo", "up", "mtu", str(mtu))


def datagram_bytes(mtu: int) -> int:
    """The largest UDP datagram an IPv4 path of this MTU carries whole (what ``dist.datagram_bytes`` should be)."""
    return min(mtu - 28, 65507)


def _cut_batches() -> None:
    """Per-packet loss from here on: the kernel cuts every GSO batch into 1500-byte packets before lo."""
    _sh("ip", "link", "set", "dev", "lo", "gso_max_segs", "1")


WIRE_DATAGRAMS = 300_000
"""Datagrams (1472 bytes each, 440 MB) a wire measurement sends; its best of WIRE_REPEATS is the limit."""
WIRE_REPEATS = 3


def measure_wire() -> dict[str, Any]:
    """The machine's own UDP limit on this loopback: one process sending 1472-byte datagrams to another with GSO
    (44 a send) and GRO on the receiving socket, from Python (``benchmarks/udp_probe.py``'s wire part, case c):
    Gbit/s of payload that arrived, the best of WIRE_REPEATS."""
    if str(ROOT / "benchmarks") not in sys.path:      # so that the spawned processes import it by name too
        sys.path.insert(0, str(ROOT / "benchmarks"))
    probe = importlib.import_module("udp_probe")
    ctx = mp.get_context("spawn")
    runs = [probe._wire(ctx, senders=1, gso=True, gro=True, total=WIRE_DATAGRAMS) for _ in range(WIRE_REPEATS)]
    best = max(runs)
    return {"gbit_s": best[0], "lost": best[1], "datagrams_per_recv": best[2], "runs_gbit_s": [r[0] for r in runs],
            "datagram_bytes": probe.DGRAM, "datagrams": WIRE_DATAGRAMS}


def udp_gbit_s(n: int, seconds: float | None) -> float | None:
    """What one udp rps round of ``n`` float32 values moves, all ranks together, in Gbit/s: every rank sends
    2 (W - 1) / W of its row (its blocks to their servers, then its block's average to the others)."""
    return None if seconds is None else WORLD * 2 * (WORLD - 1) / WORLD * n * 4 * 8 / seconds / 1e9


def set_loss(proto: str, p: float) -> None:
    """Drops packets of ``proto`` (tcp, udp or all) on the loopback with probability ``p``; p = 0: no rule."""
    _sh("iptables", "-F", "INPUT")
    if p > 0:
        _sh("iptables", "-A", "INPUT", "-i", "lo", "-p", proto, "-m", "statistic", "--mode", "random",
            "--probability", repr(p), "-j", "DROP")


def packet_counters() -> Counter[str]:
    """This namespace's packet counters: the loss rule's drops (0 without a rule) and /proc/net/snmp's
    UDP and TCP ones that say where the rest went."""
    rules = subprocess.run(["iptables", "-nvxL", "INPUT"], check=True, capture_output=True, text=True).stdout
    lines = rules.splitlines()
    counters = Counter({"dropped": int(lines[2].split()[0]) if len(lines) > 2 else 0})
    snmp = Path("/proc/net/snmp").read_text().splitlines()
    for head, values in zip(snmp[::2], snmp[1::2]):
        proto, *names = head.split()
        for name, value in zip(names, values.split()[1:]):
            if f"{proto}{name}" in SNMP:
                counters[f"{proto}{name}"] = int(value)
    return counters


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------ one round

def _udp_totals(stats: list[Any]) -> dict[str, Any]:
    """One rank's measured udp rounds: datagram counts, how the phases closed, the seconds of each part."""
    closed = Counter(c for s in stats for c in s.closed_by)
    return {"sent": sum(s.sent for s in stats), "received": sum(s.received for s in stats),
            "expected": sum(sum(s.expected) for s in stats), "late": sum(s.late for s in stats),
            "rejected": sum(s.rejected for s in stats), "closed_by": dict(closed),
            **{k: sum(getattr(s, k) for s in stats) for k in ("phase1_s", "average_s", "phase2_s")}}


def _sum_ranks(totals: list[dict[str, Any]]) -> dict[str, Any]:
    out = {k: sum(t[k] for t in totals) for k in totals[0] if k != "closed_by"}
    out["closed_by"] = dict(sum((Counter(t["closed_by"]) for t in totals), Counter()))
    return out


def _rank_main(rank: int, port: int, plan: list[tuple[int, float, list[str]]], repeats: int, timeout_s: float,
               events: Any, dgram: int = 1472) -> None:
    """One rank: every (size, loss) cell of ``plan``, its operations interleaved; rank 0 sets the rules and
    reports each round's start and each cell's times to the parent."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    from shaky.comm.gloo import DistComm  # noqa: PLC0415
    from shaky.comm.udp.comm import UdpDistComm  # noqa: PLC0415
    from shaky.comm.udp.exchange import UdpOptions  # noqa: PLC0415
    from shaky.config import NetworkConfig  # noqa: PLC0415
    from shaky.network.model import NetworkModel  # noqa: PLC0415

    from shaky.vectorized import tune_allocator  # noqa: PLC0415

    torch.set_num_threads(1)
    tune_allocator()        # as shaky train does in every rank: freed memory is kept, not faulted in again
    cell: tuple[int, float, str] | None = None
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=timedelta(seconds=timeout_s))
        comm = DistComm()
        links = NetworkModel(NetworkConfig(), WORLD, seed=0).sample(0)
        # One udp comm per size, as a training run has one: its adaptive deadline learns that size's rounds.
        udp: UdpDistComm | None = None
        udp_size = 0
        warm_size = 0
        for n, p, ops in plan:
            x = torch.randn(1, n, generator=torch.Generator().manual_seed(rank))
            y = x.clone()
            if udp is not None and udp_size != n:
                udp.close()
                udp = None
            if "udp_rps" in ops and udp is None:
                udp, udp_size = UdpDistComm(host="127.0.0.1", announce=False,
                                            options=UdpOptions(datagram_bytes=dgram)), n
                seg = udp.segment_bytes
                sample = NetworkModel(NetworkConfig(segment_bytes=seg), WORLD, seed=0, dim=n, itemsize=4).sample(0)
            fns: dict[str, Callable[[], object]] = {
                "gloo_rps": lambda x=x: comm.block_average(x, links.up, links.down, overwrite=True),
                "all_reduce": lambda y=y: dist.all_reduce(y),
                "udp_rps": lambda x=x: udp.block_average(x, sample.up, sample.down, segment_bytes=seg,
                                                         overwrite=True)}
            times: dict[str, list[float]] = {op: [] for op in ops}
            warm_times: dict[str, list[float]] = {op: [] for op in ops}
            packets: dict[str, Counter[str]] = {op: Counter() for op in ops}
            stats: list[Any] = []
            warm_stats: list[Any] = []
            warm_up = WARM_UP if n != warm_size else 0
            warm_size = n
            for r in range(warm_up + repeats):
                for op in ops:
                    cell = (n, p, op)
                    dist.barrier()
                    if rank == 0:
                        set_loss(OP_PROTO[op], p)
                        events.put(("start", cell, time.monotonic()))
                        before = packet_counters()
                    dist.barrier()
                    t0 = time.perf_counter()
                    fns[op]()
                    took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                    dist.barrier()                              # every rank done before the rule goes
                    if rank == 0:
                        after = packet_counters()
                        set_loss(OP_PROTO[op], 0.0)
                    dist.barrier()
                    dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank's round, on a clean network
                    (times if r >= warm_up else warm_times)[op].append(float(took))
                    if r >= warm_up and rank == 0:
                        packets[op].update(after - before)
                    if op == "udp_rps":
                        (stats if r >= warm_up else warm_stats).append(udp.last_stats)
            cell = None
            per_rank: list[Any] = [None] * WORLD
            dist.all_gather_object(per_rank, (_udp_totals(stats), _udp_totals(warm_stats)))
            if rank == 0:
                events.put(("cell", (n, p), times, warm_times, {op: dict(c) for op, c in packets.items()},
                            per_rank if "udp_rps" in ops else None))
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 (reported to the parent, which ends the group)
        events.put(("failed", rank, cell, f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None


def _dominated(op: str, n: int, p: float, timed_out: set[tuple[str, int, float]]) -> bool:
    return any(o == op and m <= n and q <= p for o, m, q in timed_out)


def run_rounds(sizes: list[int], losses: list[float], repeats: int, timeout_s: float,
               save: Callable[[list[dict[str, Any]]], None], dgram: int = 1472) -> None:
    """Every (op, size, loss): its round times, or why there are none; ``save`` gets the rows so far after each
    cell. Restarts the processes after a timeout."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "shaky.comm.gloo", "shaky.comm.udp.comm", "shaky.network.model"])
    results: dict[tuple[str, int, float], dict[str, Any]] = {}
    timed_out: set[tuple[str, int, float]] = set()
    cells = [(n, p) for n in sizes for p in losses]

    def rows() -> list[dict[str, Any]]:
        return [{"op": op, "size": n, "loss": p, **results[(op, n, p)]}
                for n, p in cells for op in OPS if (op, n, p) in results]

    while True:
        plan = []
        for n, p in cells:
            ops = []
            for op in OPS:
                if (op, n, p) in results:
                    continue
                if _dominated(op, n, p, timed_out):
                    results[(op, n, p)] = {"status": "skipped"}
                else:
                    ops.append(op)
            if ops:
                plan.append((n, p, ops))
        if not plan:
            break
        events = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_rank_main, args=(r, port, plan, repeats, timeout_s, events, dgram), daemon=True)
                 for r in range(WORLD)]
        for proc in procs:
            proc.start()
        failure = _watch(procs, events, plan, results, timeout_s, lambda: save(rows()))
        for proc in procs:
            proc.kill()
            proc.join()
        set_loss("tcp", 0.0)
        if failure is not None:
            (n, p, op), record = failure
            results[(op, n, p)] = record
            if record["status"] == "timeout":
                timed_out.add((op, n, p))
            print(f"  {OP_LABELS[op]} {n:.0e} at loss {p:g}: {record['status']} ({record['why']}); "
                  f"restarting the processes", flush=True)
    save(rows())


def _watch(procs: list[Any], events: Any, plan: list[tuple[int, float, list[str]]],
           results: dict[tuple[str, int, float], dict[str, Any]], timeout_s: float, saved: Callable[[], None]
           ) -> tuple[tuple[int, float, str], dict[str, Any]] | None:
    """Collects the cells of one process group into ``results`` (calling ``saved`` after each) until it
    finishes (None) or a round fails or overruns: then that round's cell and its record."""
    current: tuple[int, float, str] | None = None
    started = heard = time.monotonic()
    remaining = len(plan)
    while remaining:
        try:
            event = events.get(timeout=1.0)
        except queue.Empty:
            silent = time.monotonic() - heard
            if current is not None and time.monotonic() - started > timeout_s + SLACK_S:
                return current, {"status": "timeout", "why": f"no result after {timeout_s + SLACK_S:.0f} s"}
            if current is None and silent > timeout_s + SLACK_S:
                raise RuntimeError(f"the ranks made no progress for {silent:.0f} s outside any round")
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead and current is not None:
                return current, {"status": "error", "why": f"a rank exited with status {dead[0]}"}
            if dead:
                raise RuntimeError(f"a rank exited with status {dead[0]} outside any round")
            continue
        heard = time.monotonic()
        kind = event[0]
        if kind == "start":
            current, started = event[1], event[2]
        elif kind == "cell":
            (n, p), times, warm_times, packets, per_rank = event[1:]
            for op, t in times.items():
                results[(op, n, p)] = {"status": "ok", "times": t, "packets": packets[op],
                                       "warm_up_times": warm_times[op]}
            if per_rank is not None:
                results[("udp_rps", n, p)].update(udp=_sum_ranks([r[0] for r in per_rank]),
                                                  warm_up_udp=_sum_ranks([r[1] for r in per_rank]))
            print(f"  {n:.0e} values, loss {p:g}: " + ", ".join(
                f"{OP_LABELS[op]} {statistics.median(t):.4f} s" for op, t in times.items()), flush=True)
            saved()
            current = None
            remaining -= 1
        else:
            _, rank, cell, why = event
            if cell is None:
                raise RuntimeError(f"rank {rank} failed outside any round: {why}")
            elapsed = time.monotonic() - started
            status = "timeout" if "timed out" in why.lower() or elapsed >= timeout_s else "error"
            return cell, {"status": status, "why": f"rank {rank} after {elapsed:.0f} s: {why[:200]}"}
    return None


# ------------------------------------------------------------------------------------------ training

def _last_step(run_dir: Path) -> int | None:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return int(json.loads(lines[-1])["step"]) if lines else None
    except (OSError, ValueError, KeyError):
        return None


def run_training(losses: list[float], steps: int, timeout_s: float,
                 save: Callable[[list[dict[str, Any]]], None], runs: list[str], every_packet: bool = False,
                 launcher: str = "torchrun") -> None:
    """One torchrun (``launcher`` "shaky": ``shaky launch``) per (transport, loss), each in its own pid
    namespace (a timeout kills all of it); ``save`` gets the rows so far after each. ``every_packet``: the rule
    drops every protocol's packets (a real lossy network's), not only the run's data plane's."""
    start = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", str(WORLD), "--master-addr",
             "127.0.0.1", "--master-port", "{port}", "-m", "shaky", "train"] if launcher == "torchrun" else \
        [sys.executable, "-m", "shaky", "launch", "--nproc-per-node", str(WORLD), "--master-port", "{port}", "train"]
    out: list[dict[str, Any]] = []
    for p in losses:
        for name in runs:
            proto, flags = RUNS[name]
            with tempfile.TemporaryDirectory(prefix="shaky-transport-") as tmp:
                run_dir = Path(tmp) / "run"
                port = str(_free_port())
                cmd = ["unshare", "--pid", "--fork", "--kill-child", *(port if a == "{port}" else a for a in start),
                       "--backend", "dist", *flags, "--workers", str(WORLD), "--steps", str(steps),
                       "--out", str(run_dir), "--quiet"]
                set_loss("all" if every_packet else proto, p)
                with open(Path(tmp) / "log", "w+") as log:
                    t0 = time.perf_counter()
                    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
                    try:
                        rc = proc.wait(timeout=timeout_s)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
                        rc = None
                    wall = time.perf_counter() - t0
                    set_loss(proto, 0.0)
                    record: dict[str, Any] = {"run": name, "loss": p, "steps": steps, "wall_s": wall,
                                              "dropped": "all" if every_packet else proto, "launcher": launcher}
                    if rc is None:
                        record.update(status="timeout", last_step=_last_step(run_dir))
                    elif rc != 0:
                        log.seek(0)
                        record.update(status="error", why=f"exit status {rc}: {log.read()[-1500:]}")
                    else:
                        summary = json.loads((run_dir / "summary.json").read_text())
                        record.update(status="ok", accuracy=summary["final_test_accuracy"],
                                      train_s=summary["wall_time_s"], udp=summary.get("udp"),
                                      steps_s=summary["wall_time_s"] - (summary.get("eval_time_s") or 0.0))
                out.append(record)
                save(out)
                print(f"  {RUN_LABELS[name]}, loss {p:g}: {record['status']}, {wall:.1f} s "
                      f"{record.get('why', '')[-300:]}", flush=True)


# ------------------------------------------------------------------------------------------ output

def save_json(path: Path | None, data: dict[str, Any]) -> None:
    """``data`` into ``path`` (None: nowhere), replacing it whole: an interrupted run keeps what it measured."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(path)


def _table(header: list[str], rows: list[list[str]]) -> None:
    """A Markdown table, padded to line up in a terminal too."""
    width = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, width)) + " |")
    print("|" + "|".join("-" * (w + 1) + ":" for w in width) + "|")
    for r in rows:
        print("| " + " | ".join(c.rjust(w) for c, w in zip(r, width)) + " |")


def _median(rec: dict[str, Any] | None) -> float | None:
    return statistics.median(rec["times"]) if rec is not None and rec["status"] == "ok" else None


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b is not None else "-"


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.2f}%" if whole else "-"


def print_rounds(rows: list[dict[str, Any]]) -> None:
    got = {(r["op"], r["size"], r["loss"]): r for r in rows}

    def get(key: tuple[str, int, float]) -> dict[str, Any]:
        return got.get(key, {"status": "not run", "times": []})

    cells = sorted({(r["size"], r["loss"]) for r in rows})
    times, packets = [], []
    for n, p in cells:
        line = [f"{n:.0e}", f"{p:g}"]
        for op in OPS:
            rec = get((op, n, p))
            t = _median(rec)
            line += [f"{t:.4f}" if t is not None else rec["status"], _ratio(t, _median(get((op, n, 0.0))))]
        udp_t = _median(get(("udp_rps", n, p)))
        gbit = udp_gbit_s(n, udp_t)
        times.append(line + [_ratio(udp_t, _median(get(("all_reduce", n, p)))), f"{gbit:.2f}" if gbit else "-"])
        line = [f"{n:.0e}", f"{p:g}"]
        for op in ("gloo_rps", "all_reduce"):
            rec = get((op, n, p))
            c = rec.get("packets", {})
            arrived = c.get("Tcp:InSegs", 0) + c.get("dropped", 0)
            line += ([_pct(c.get("dropped", 0), arrived), f"{c.get('Tcp:RetransSegs', 0) / len(rec['times']):.0f}"]
                     if rec["status"] == "ok" else ["-", "-"])
        rec = get(("udp_rps", n, p))
        if rec["status"] == "ok":
            c, u = rec["packets"], rec["udp"]
            line += [_pct(c.get("dropped", 0), u["sent"]), _pct(c.get("Udp:RcvbufErrors", 0), u["sent"]),
                     _pct(u["expected"] - u["received"], u["expected"]), str(u["late"]),
                     ", ".join(f"{k} {v}" for k, v in sorted(u["closed_by"].items()))]
        else:
            line += ["-"] * 5
        packets.append(line)
    _table(["values", "loss", "gloo rps s", "x0", "gloo all_reduce s", "x0", "udp rps s", "x0", "udp / all_reduce",
            "udp Gbit/s"], times)
    print("\nmedian seconds of a round (the slowest rank's); x0: over the same operation at loss 0; "
          "udp / all_reduce: at the same loss\n")
    _table(["values", "loss", "gloo rps: TCP dropped", "resent/round", "all_reduce: TCP dropped", "resent/round",
            "udp: dropped by rule", "by full rcvbuf", "not used", "late", "phases closed"], packets)
    print("\nover the measured rounds: TCP dropped = segments the rule dropped / segments that reached lo's INPUT; "
          "resent/round: TCP segments retransmitted;\nudp: datagrams the rule dropped, and that a full receive "
          "buffer dropped, / datagrams sent; not used: 1 - datagrams used / datagrams expected;\nlate: arrived "
          "after their phase closed; phases closed: both phases of every rank's rounds")


def _steps(r: dict[str, Any], b: dict[str, Any] | None) -> list[str]:
    """A training run's seconds of steps (its evaluations left out) and their ratio to ``b``'s; "-" for a record
    written before summary.json had eval_time_s."""
    if r.get("steps_s") is None:
        return ["-", "-"]
    return [f"{r['steps_s']:.1f}", _ratio(r["steps_s"], b and b.get("steps_s"))]


def print_training(rows: list[dict[str, Any]]) -> None:
    base = {r["run"]: r for r in rows if r["loss"] == 0.0 and r["status"] == "ok"}
    table = []
    for r in sorted(rows, key=lambda r: (r["run"], r["loss"])):
        b = base.get(r["run"])
        line = [RUN_LABELS[r["run"]], f"{r['loss']:g}"]
        if r["status"] == "ok":
            udp = r.get("udp")
            line += [f"{r['wall_s']:.1f}", _ratio(r["wall_s"], b and b["wall_s"]), f"{r['train_s']:.1f}",
                     _ratio(r["train_s"], b and b["train_s"]), *_steps(r, b), f"{r['accuracy']:.4f}",
                     f"{(r['accuracy'] - b['accuracy']) * 100:+.1f}" if b else "-",
                     f"{udp['observed_loss']:.4f}" if udp else "-"]
        else:
            reached = f", last evaluated step {r['last_step']}" if r.get("last_step") is not None else ""
            line += [f"{r['status']} at {r['wall_s']:.0f}{reached}", "-", "-", "-", "-", "-", "-", "-", "-"]
        table.append(line)
    _table(["run", "loss", "wall s", "x0", "train s", "x0", "steps s", "x0", "test accuracy", "points",
            "udp not used"], table)
    dropped = sorted({r.get("dropped", "the run's own protocol") for r in rows})
    print(f"\npackets dropped: {', '.join(dropped)}")
    launched = sorted({r.get("launcher", "torchrun") for r in rows})
    print(f"{rows[0]['steps']} steps, started by {', '.join(launched)}; wall s: the whole launch command (start-up "
          "included); train s: the training "
          "loop (summary.json's wall_time_s); steps s: its steps alone (wall_time_s - eval_time_s: the evaluations,\n"
          "every 50 steps, take rounds of means; on udp they go by mail since 2026-11-28, before to rank 0's store over TCP);\nx0: over the same run at loss 0; points: test accuracy minus the same "
          "run's at loss 0, in percentage points;\nudp not used: summary.json's observed_loss (1 - datagrams used / "
          "expected)")


def plot(data: dict[str, Any], path: Path) -> None:
    """Round time against loss rate, one line per operation and size; training wall time, if measured."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    import matplotlib.ticker  # noqa: PLC0415

    panels = [(k, data[k]) for k in PARTS if data.get(k) and data[k]["rows"]]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    colors = {"gloo_rps": "tab:blue", "all_reduce": "tab:green", "udp_rps": "tab:red",
              "gloo": "tab:green", "udp": "tab:red"}
    for ax, (kind, part) in zip(axes[0], panels):
        rows, timeout_s = part["rows"], part["meta"]["timeout_s"]
        losses = sorted({r["loss"] for r in rows})
        pos = {p: i for i, p in enumerate(losses)}       # loss rates evenly spaced: 0 has no place on a log axis
        if kind == "rounds":
            lines = [((op, n), f"{OP_LABELS[op]}, {n:.0e} values", colors[op], dash)
                     for op in OPS for n, dash in zip(sorted({r["size"] for r in rows}), ("-", "--", ":"))]
            key, value = (lambda r: (r["op"], r["size"])), _median
            ax.set_ylabel("one round, slowest rank (s, median)")
            ax.set_title(f"one round, {WORLD} processes, float32")
        else:
            lines = [(name, RUN_LABELS[name], colors[name], "-") for name in RUNS]
            key, value = (lambda r: r["run"]), (lambda r: r["wall_s"] if r["status"] == "ok" else None)
            ax.set_ylabel("torchrun wall time (s)")
            ax.set_title(f"training: digits MLP, {WORLD} workers, {part['meta']['steps']} steps")
        for i, (which, label, color, dash) in enumerate(lines):
            mine = [r for r in rows if key(r) == which]
            pts = [(pos[r["loss"]], value(r)) for r in mine if value(r) is not None]
            if pts:
                ax.plot(*zip(*pts), dash, marker="o", color=color, label=label)
            for r in mine:
                if r["status"] == "timeout":       # nudged sideways, so that coinciding timeouts all show
                    x = pos[r["loss"]] + 0.08 * (i - (len(lines) - 1) / 2)
                    ax.plot(x, timeout_s, "x", color=color, markersize=9, mew=2)
                    if r.get("last_step") is not None:
                        ax.annotate(f"step {r['last_step']}", (x, timeout_s), textcoords="offset points",
                                    xytext=(0, -14), ha="center", fontsize=8, color=color)
        ax.axhline(timeout_s, color="grey", lw=0.8, ls=":")
        ax.text(0, timeout_s, f" x: timeout ({timeout_s:g} s)", va="bottom", fontsize=8, color="grey")
        ax.set_xticks(range(len(losses)), [f"{p:g}" for p in losses])
        ax.set_xlim(-0.4, len(losses) - 0.6)
        ax.set_yscale("log")
        for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):   # 0.2, 0.3, 0.5, 1, 2, ...
            axis(matplotlib.ticker.FuncFormatter(
                lambda v, _: f"{v:g}" if v > 0 and round(v / 10 ** math.floor(math.log10(v))) in (1, 2, 3, 5) else ""))
        ax.set_xlabel("loss rate (the data plane's packets dropped at random)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0, 0.93))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def print_batched(rows: list[dict[str, Any]], wire: dict[str, Any] | None) -> None:
    """The loss-0 rounds with the kernel's batching on, and the udp rows' rate against the machine's limit."""
    limit = wire["gbit_s"] if wire else None
    if wire:
        print(f"the machine's UDP limit here: {limit:.1f} Gbit/s of payload, one process to another, "
              f"{wire['datagram_bytes']}-byte datagrams with GSO and GRO (benchmarks/udp_probe.py's wire part, "
              f"case c; best of " + ", ".join(f"{g:.1f}" for g in wire["runs_gbit_s"]) + ")\n")
    got = {(r["op"], r["size"]): r for r in rows}
    table = []
    for n in sorted({r["size"] for r in rows}):
        t = {op: _median(got.get((op, n))) for op in OPS}
        gbit = udp_gbit_s(n, t["udp_rps"])
        table.append([f"{n:.0e}", *(f"{t[op]:.4f}" if t[op] is not None else got.get((op, n), {}).get("status", "-")
                                    for op in OPS),
                      _ratio(t["udp_rps"], t["all_reduce"]), f"{gbit:.2f}" if gbit is not None else "-",
                      _ratio(gbit, limit)])
    _table(["values", "gloo rps s", "gloo all_reduce s", "udp rps s", "udp / all_reduce", "udp Gbit/s, all ranks",
            "/ the limit"], table)
    print("\nloss 0, lo's GSO left on (the kernel's batching, as a NIC that offloads it gives); median seconds of a "
          "round (the slowest rank's); udp Gbit/s: 2 (W - 1) / W of the row out of every rank, all ranks, over the "
          "round's time")


def report(data: dict[str, Any]) -> None:
    """Each part's command, machine and tables."""
    for kind in ("batched", *PARTS):
        part = data.get(kind)
        if not part:
            continue
        meta = part["meta"]
        gso = "lo's GSO left on: NOT per-packet loss" if meta["gso_max_segs"] is None else "gso_max_segs 1"
        state = f"took {meta['took_s']:.0f} s" if "took_s" in meta else "UNFINISHED"
        print(f"\n{meta['command']}\n{meta['date']}: {WORLD} processes on a private loopback (mtu "
              f"{meta.get('mtu', 1500)}, udp datagrams of {meta.get('datagram_bytes', 1472)} bytes, {gso}), "
              f"torch {meta['torch']}, {meta['cores']} cores; {state}, load average {meta['load_before']:.1f} "
              f"before" + (f", {meta['load_after']:.1f} after" if "load_after" in meta else ""))
        if kind == "batched":
            print(f"one round at loss 0 with the kernel's batching on, median of {meta['repeats']} (after {WARM_UP} "
                  f"warm-up rounds at each size), timeout {meta['timeout_s']:g} s\n")
            print_batched(part["rows"], data.get("wire"))
        elif kind == "rounds":
            print(f"one round, median of {meta['repeats']} (after {WARM_UP} warm-up rounds at each size), "
                  f"timeout {meta['timeout_s']:g} s\n")
            print_rounds(part["rows"])
        else:
            print(f"training, timeout {meta['timeout_s']:g} s\n")
            print_training(part["rows"])


# ------------------------------------------------------------------------------------------ main

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("rounds", "train", "all"), default="all")
    parser.add_argument("--quick", action="store_true",
                        help="sizes 1e6, losses 0 0.01 0.1, 3 repeats, 300 steps, shorter timeouts")
    parser.add_argument("--sizes", type=float, nargs="+", help="float32 values a row (default 1e6 1e7)")
    parser.add_argument("--losses", type=float, nargs="+", help="loss rates (default 0 0.001 0.01 0.05 0.1)")
    parser.add_argument("--repeats", type=int, help="measured rounds per cell (default 5)")
    parser.add_argument("--timeout", type=float, help="seconds one round may take (default 60)")
    parser.add_argument("--steps", type=int, help="training steps (default 1000)")
    parser.add_argument("--runs", nargs="+", choices=tuple(RUNS), default=list(RUNS),
                        help="training runs to make (default: all)")
    parser.add_argument("--train-timeout", type=float, help="seconds one training run may take (default 600)")
    parser.add_argument("--every-packet", action="store_true",
                        help="train part: drop every protocol's packets (TCP too), not only the run's data plane's")
    parser.add_argument("--launcher", choices=("torchrun", "shaky"), default="torchrun",
                        help="train part: what starts the ranks (default torchrun; shaky: shaky launch)")
    parser.add_argument("--keep-gso", action="store_true",
                        help="leave lo's GSO on throughout: the rounds part measures only its batching-on rows "
                             "(loss 0); a training run's rule then drops whole batches")
    parser.add_argument("--mtu", type=int, default=1500,
                        help="lo's MTU (default 1500; 9000: jumbo frames; 65536: loopback's own); the udp rows' "
                             "datagrams are as large as it allows (MTU - 28 bytes, at most 65507)")
    parser.add_argument("--plot", type=Path, help="write the plot here (PNG)")
    parser.add_argument("--json", type=Path, help="write every measured number here (after every measurement)")
    parser.add_argument("--from-json", type=Path, nargs="+",
                        help="measure nothing: print and plot the numbers of these files (a later file's parts "
                             "replace an earlier one's)")
    args = parser.parse_args()
    quick = args.quick
    defaults = {"sizes": [1e6] if quick else [1e6, 1e7], "losses": [0.0, 0.01, 0.1] if quick else
                [0.0, 0.001, 0.01, 0.05, 0.1], "repeats": 3 if quick else 5, "timeout": 20.0 if quick else 60.0,
                "steps": 300 if quick else 1000, "train_timeout": 120.0 if quick else 600.0}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if 0.0 not in args.losses:
        parser.error("--losses must include 0 (the ratios are against loss 0)")
    if not 576 <= args.mtu <= 65536:
        parser.error(f"--mtu must be in [576, 65536] (IPv4's least and loopback's most), got {args.mtu}")

    if args.from_json is not None:
        data = {}
        for path in args.from_json:
            data.update(json.loads(path.read_text()))
    elif INSIDE not in os.environ:
        why = _unavailable()
        if why:
            print(f"benchmarks/transport.py: skipped: {why}")
            return 2
        # TORCH_CPP_LOG_LEVEL: c10d warns on every connection that the namespace has no name for 127.0.0.1.
        env = {"TORCH_CPP_LOG_LEVEL": "ERROR", **os.environ, INSIDE: _netns()}
        return subprocess.run(["unshare", "--net", sys.executable, __file__, *sys.argv[1:]], env=env).returncode
    else:
        if _netns() == os.environ[INSIDE]:
            raise SystemExit(f"{INSIDE} is set but this process is in the namespace it was started in: refusing "
                             "to set iptables rules there")
        data = measure(args)
    report(data)
    if args.plot is not None:
        plot(data, args.plot)
    return 0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the parts asked for; with ``--json``, the file holds every number measured so far."""
    import torch  # noqa: PLC0415

    _setup_namespace(args.mtu)
    dgram = datagram_bytes(args.mtu)
    data: dict[str, Any] = {}
    cut = False

    def save() -> None:
        save_json(args.json, data)

    def start(kind: str, gso_max_segs: int | None) -> dict[str, Any]:
        meta = {"command": shlex.join([".venv/bin/python", "benchmarks/transport.py", *sys.argv[1:]]),
                "date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__,
                "python": platform.python_version(), "cores": os.cpu_count(), "load_before": os.getloadavg()[0],
                "gso_max_segs": gso_max_segs, "mtu": args.mtu, "datagram_bytes": dgram, "t0": time.perf_counter()}
        data[kind] = {"meta": meta, "rows": []}
        print(f"{kind} ...", flush=True)
        return data[kind]

    def keeper(part: dict[str, Any]) -> Callable[[list[dict[str, Any]]], None]:
        def keep(rows: list[dict[str, Any]]) -> None:
            part["rows"] = list(rows)
            save()
        return keep

    def done(part: dict[str, Any]) -> None:
        meta = part["meta"]
        meta.update(took_s=time.perf_counter() - meta.pop("t0"), load_after=os.getloadavg()[0])
        save()

    for kind in PARTS:
        if args.part not in (kind, "all"):
            continue
        if kind == "rounds":
            # The kernel's batching on (lo's GSO as it is): the machine's UDP limit, then the loss-0 rounds.
            print("wire ...", flush=True)
            data["wire"] = measure_wire()
            save()
            part = start("batched", None)
            part["meta"].update(repeats=args.repeats, timeout_s=args.timeout)
            run_rounds([int(s) for s in args.sizes], [0.0], args.repeats, args.timeout, keeper(part), dgram)
            done(part)
            if args.keep_gso:
                continue
        if not args.keep_gso and not cut:
            _cut_batches()
            cut = True
        part = start(kind, None if args.keep_gso else 1)
        if kind == "rounds":
            part["meta"].update(repeats=args.repeats, timeout_s=args.timeout)
            run_rounds([int(s) for s in args.sizes], args.losses, args.repeats, args.timeout, keeper(part), dgram)
        else:
            part["meta"].update(steps=args.steps, timeout_s=args.train_timeout)
            run_training(args.losses, args.steps, args.train_timeout, keeper(part), args.runs, args.every_packet,
                         args.launcher)
        done(part)
    return data


if __name__ == "__main__":
    sys.exit(main())
