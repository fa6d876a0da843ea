"""Scalability from the simulated clock alone, without training a model.

Scalability is the throughput of W workers divided by W times the throughput of
one worker that never communicates, in simulated time (docs/clock.md). Each
strategy's exchange is priced from its real traffic pattern for a message of
``num_params`` float32 values: ``allreduce`` a reliable ring all-reduce every
step; ``local-sgd`` RPS's two all-to-all phases every ``period`` steps, waited
for at once; ``dts`` the same exchange every ``period`` steps, needed ``delay``
steps after its launch. No message is lost here; ``shaky train`` adds losses.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from shaky.config import MAX_SCALE_PERIOD, RunConfig, config_from_dict, load_toml, parse_value, set_dotted
from shaky.errors import BadInput
from shaky.geometry import LinkSample
from shaky.network.clock import Clock, PhaseTraffic, hiding_period, scalability
from shaky.network.model import NetworkModel, link_matrices
from shaky.network.presets import region_of_workers
from shaky.outputs import check_writable
from shaky.strategies.exchange import block_exchange_traffic, ring_allreduce_traffic

STRATEGIES = ("allreduce", "local-sgd", "dts")


@dataclass(frozen=True, slots=True)
class Workload:
    """What one step costs apart from the network."""

    num_params: int
    """Values in one message (the model or its gradient), float32."""
    compute_ms: float
    """Compute time of one step on one worker."""


def _traffic(strategy: str, num_workers: int, num_params: int) -> tuple[PhaseTraffic, ...]:
    """The phases of one exchange of ``strategy`` with every message delivered."""
    x = torch.empty(0, num_params)  # only the shape and element size matter
    everything = torch.ones(num_workers, num_workers, dtype=torch.bool)
    links = LinkSample(0, everything, everything)
    if strategy == "allreduce":
        return ring_allreduce_traffic(x, num_workers, links)
    return block_exchange_traffic(x, num_workers, links, reliable=False)


def _clock(cfg: RunConfig, work: Workload, wan_latency_ms: float | None) -> Clock:
    """A clock for ``cfg``'s network; with ``wan_latency_ms``, every link between sites gets that latency."""
    network = NetworkModel(cfg.network, cfg.num_workers, seed=cfg.seed)
    if wan_latency_ms is not None:
        latency, _ = link_matrices(cfg.network, cfg.num_workers)
        site = np.asarray(region_of_workers(len(cfg.network.regions), cfg.num_workers) if cfg.network.regions
                          else range(cfg.num_workers))
        network.latency_ms = np.where(site[:, None] != site[None, :], wan_latency_ms, latency)
    return Clock(network, work.compute_ms, cfg.network.retransmit_timeout_ms)


def exchange_seconds(strategy: str, cfg: RunConfig, work: Workload, wan_latency_ms: float | None = None) -> float:
    """Seconds one exchange of ``strategy`` takes on ``cfg``'s network with nothing lost."""
    return _clock(cfg, work, wan_latency_ms).exchange_seconds(_traffic(strategy, cfg.num_workers, work.num_params))


def recommended_period(cfg: RunConfig, work: Workload) -> int:
    """DTS's period d and delay t that hide one exchange behind compute: ceil(exchange / compute) + 1."""
    return hiding_period(exchange_seconds("dts", cfg, work), work.compute_ms)


def strategy_scalability(strategy: str, cfg: RunConfig, work: Workload, *, period: int, delay: int,
                         wan_latency_ms: float | None = None) -> float:
    """Scalability of ``strategy`` on ``cfg``'s network (local-sgd uses ``period``, dts also ``delay``)."""
    clock = _clock(cfg, work, wan_latency_ms)
    exchange = clock.exchange_seconds(_traffic(strategy, cfg.num_workers, work.num_params))
    if strategy == "allreduce":
        return scalability(clock, exchange)
    return scalability(clock, exchange, period=period, delay=delay if strategy == "dts" else 1)


def network_config(values: dict[str, Any], num_workers: int) -> RunConfig:
    """A validated config holding just a network of ``num_workers`` (ValueError/TypeError naming the field)."""
    return config_from_dict({**values, "num_workers": num_workers})


@dataclass(frozen=True, slots=True)
class Sweep:
    """Scalability of each strategy at each point of one axis."""

    axis: str
    """What varies: the x label of the plot and the first column of the table."""
    points: tuple[float, ...]
    values: dict[str, tuple[float, ...]]
    """Strategy -> scalability at each point."""


def sweep_latency(values: dict[str, Any], num_workers: int, latencies_ms: Sequence[float], work: Workload, *,
                  period: int, delay: int) -> Sweep:
    """Scalability against the one-way latency of every link between regions (between workers, without regions)."""
    cfg = network_config(values, num_workers)
    table = {s: tuple(strategy_scalability(s, cfg, work, period=period, delay=delay, wan_latency_ms=lat)
                      for lat in latencies_ms) for s in STRATEGIES}
    return Sweep("one-way latency between regions (ms)", tuple(latencies_ms), table)


def sweep_workers(values: dict[str, Any], worker_counts: Sequence[int], work: Workload, *,
                  period: int, delay: int) -> Sweep:
    """Scalability against the number of workers, on the network as configured."""
    cfgs = [network_config(values, w) for w in worker_counts]
    table = {s: tuple(strategy_scalability(s, cfg, work, period=period, delay=delay) for cfg in cfgs)
             for s in STRATEGIES}
    return Sweep("workers W", tuple(float(w) for w in worker_counts), table)


def labels(period: int, delay: int) -> dict[str, str]:
    return {"allreduce": "allreduce (ring, every step)", "local-sgd": f"local-sgd (tau = {period})",
            "dts": f"dts (t = {delay}, d = {period})"}


def table(sweep: Sweep, period: int, delay: int) -> str:
    """A Markdown table of one sweep, aligned for a terminal too."""
    names = labels(period, delay)
    body = [[sweep.axis] + [names[s] for s in STRATEGIES]]
    body += [[f"{p:g}"] + [f"{sweep.values[s][k]:.4f}" for s in STRATEGIES] for k, p in enumerate(sweep.points)]
    widths = [max(len(r[i]) for r in body) for i in range(len(body[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in body]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def plot(sweeps: Sequence[Sweep], out: Path, *, period: int, delay: int, title: str,
         subtitles: Sequence[str] = ()) -> Path:
    """One panel per sweep: scalability of each strategy against the swept quantity."""
    import matplotlib  # noqa: PLC0415 (plotting is optional work)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    names = labels(period, delay)
    fig, axes = plt.subplots(1, len(sweeps), figsize=(5.6 * len(sweeps), 4.8), constrained_layout=True,
                             squeeze=False)
    styles = {"allreduce": ("-", "o"), "local-sgd": ("--", "s"), "dts": ("-.", "^")}
    for k, (ax, sweep) in enumerate(zip(axes[0], sweeps)):
        for s in STRATEGIES:
            line, marker = styles[s]
            ax.plot(sweep.points, sweep.values[s], linestyle=line, marker=marker, label=names[s])
        # allreduce hugs the axis on a WAN: print its values at both ends.
        for i, align in ((0, "left"), (-1, "right")):
            ax.annotate(f"{sweep.values['allreduce'][i]:.3f}", (sweep.points[i], sweep.values["allreduce"][i]),
                        textcoords="offset points", xytext=(0, 7), ha=align, fontsize=8)
        if k < len(subtitles):
            ax.set_title(subtitles[k], fontsize=10)
        ax.set_xlabel(sweep.axis)
        ax.set_ylabel("scalability (throughput / W x one worker's)")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        if sweep.axis.startswith("workers"):
            ax.set_xscale("log", base=2)
            ax.set_xticks(sweep.points, [f"{p:g}" for p in sweep.points])
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="outside lower center", ncols=len(STRATEGIES))
    fig.suptitle(title)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


MAX_SCALE_WORKERS = 256
MAX_SCALE_PARAMS = 1e12
"""A trillion float32 values (4 TB) per message: beyond any model, and what the traffic model can size."""


def _command_network(args: argparse.Namespace) -> tuple[dict[str, Any], int | None]:
    """The network settings for ``shaky scale`` (file, then preset, then --set) and the file's num_workers."""
    values: dict[str, Any] = {}
    file_workers = None
    if args.config:
        loaded = load_toml(args.config)
        values = {"network": loaded.get("network", {})}
        file_workers = loaded.get("num_workers")
        if file_workers is not None and (isinstance(file_workers, bool) or not isinstance(file_workers, int)):
            raise BadInput(f"num_workers must be an integer, got {file_workers!r} (in {args.config})")
    if args.preset is not None or not args.config:
        set_dotted(values, "network.preset", args.preset if args.preset is not None else "geo4")
    for item in args.set:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise BadInput(f"--set expects KEY=VALUE, got {item!r}")
        if not key.startswith("network."):
            raise BadInput(f"scale: --set takes network settings only (network.KEY=VALUE), got {key!r}")
        set_dotted(values, key, parse_value(text.strip()))
    return values, file_workers


def command_inputs(args: argparse.Namespace) -> tuple[dict[str, Any], int, list[int], list[float], Path]:
    """Checks ``shaky scale``'s flags: network values, W, the worker counts, the latencies, the plot path."""
    try:
        values, file_workers = _command_network(args)
    except (ValueError, TypeError) as exc:
        raise BadInput(str(exc)) from None
    workers = args.workers if args.workers is not None else (file_workers if file_workers is not None else 32)
    counts = args.worker_counts or ([workers] if file_workers is not None else [4, 8, 16, 32, 64])
    latencies = args.latencies_ms if args.latencies_ms is not None else [0, 50, 100] + list(range(200, 1001, 100))
    # The clock holds a W x W matrix for each of a ring's 2(W-1) hops: 256 workers already take 270 MB.
    in_range = f"in [1, {MAX_SCALE_WORKERS}]"
    checks = [("--workers", workers, 1 <= workers <= MAX_SCALE_WORKERS, in_range),
              ("--params", args.params, 1 <= args.params <= MAX_SCALE_PARAMS, f"in [1, {MAX_SCALE_PARAMS:g}]"),
              ("--compute-ms", args.compute_ms, 0 < args.compute_ms < float("inf"), "a positive number"),
              ("--delay", args.delay, args.delay is None or args.delay >= 1, ">= 1"),
              ("--period", args.period, args.period is None or args.period >= 1, ">= 1"),
              ("--delay", args.delay, args.delay is None or args.delay <= MAX_SCALE_PERIOD,
               f"at most {MAX_SCALE_PERIOD}"),
              ("--period", args.period, args.period is None or args.period <= MAX_SCALE_PERIOD,
               f"at most {MAX_SCALE_PERIOD}")]
    checks += [("--worker-counts", w, 1 <= w <= MAX_SCALE_WORKERS, in_range) for w in counts]
    checks += [("--latencies-ms", v, 0 <= v < float("inf"), "a number >= 0") for v in latencies]
    for flag, value, ok, expected in checks:
        if not ok:
            raise BadInput(f"{flag} must be {expected}, got {value!r}")
    out = Path(args.out)
    blocker = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if out.is_dir() or blocker is not None:
        raise BadInput(f"--out {str(out)!r} cannot be written: {str(blocker or out)!r} is "
                       f"{'a file' if blocker else 'a directory'}")
    # The plot's format follows the name; a table goes beside it as .md, so the name must say .png.
    if out.suffix.lower() != ".png":
        raise BadInput(f"--out must name a .png file (the Markdown table goes beside it, as "
                       f"{out.with_suffix('.md').name}), got {str(out)!r}")
    check_writable("--out", out, directory=False)
    if out.with_suffix(".md").is_dir():
        raise BadInput(f"--out {str(out)!r}: its table would go to {str(out.with_suffix('.md'))!r}, a directory")
    check_writable("--out", out.with_suffix(".md"), directory=False)
    return values, workers, counts, latencies, out
