"""The run directory: its file names, atomic writes, the checkpoint, the metrics and the summary.

A run directory holds ``config.toml`` (the resolved config), ``shards.json``
(which samples each worker holds), ``metrics.jsonl`` (one line per evaluation),
``checkpoint.pt`` and ``trace.npz`` (the delivery masks so far, replayable with
``network.trace``), and ``summary.json`` once the run is finished. ``shaky train``,
``shaky sweep`` and ``shaky report`` all read and write it through this module.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shaky.config import RunConfig, config_from_dict, load_toml, to_toml

CONFIG_FILE = "config.toml"
CHECKPOINT_FILE = "checkpoint.pt"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
SHARDS_FILE = "shards.json"
TRACE_FILE = "trace.npz"
RUN_FILES = frozenset(n + t for n in (CONFIG_FILE, SHARDS_FILE, METRICS_FILE, SUMMARY_FILE, CHECKPOINT_FILE,
                                      TRACE_FILE) for t in ("", ".tmp"))
"""Every file a run writes (and its temporary twin while it is being written)."""


def atomic_write(path: Path, write: Callable[[Any], None], mode: str = "w") -> None:
    """Writes ``path`` through a temporary file that replaces it only once complete and on disk."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, mode) as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write(path, lambda f: f.write(json.dumps(data, indent=2) + "\n"))


def new_run_dir(base: str | Path) -> Path:
    """``base`` if it does not exist yet, else ``base-1``, ``base-2``, ...: never overwrites a run."""
    base = Path(base)
    candidate, i = base, 0
    while candidate.exists():
        i += 1
        candidate = base.with_name(f"{base.name}-{i}")
    return candidate


def create(run_dir: Path, cfg: RunConfig, shards: list[dict[str, Any]]) -> None:
    """A fresh run directory with the resolved config, the shard description and empty metrics."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if any(run_dir.iterdir()):
        raise FileExistsError(f"run directory {str(run_dir)!r} is not empty")
    (run_dir / CONFIG_FILE).write_text(to_toml(cfg))
    (run_dir / SHARDS_FILE).write_text(json.dumps(shards))
    (run_dir / METRICS_FILE).write_text("")


def load_run_config(run_dir: str | Path) -> RunConfig:
    """The resolved config saved in a run directory, checked that a checkpoint is there to resume."""
    d = Path(run_dir)
    if not (d / CONFIG_FILE).is_file():
        raise ValueError(f"resume: {str(d)!r} is not a run directory (no {CONFIG_FILE})")
    if not (d / CHECKPOINT_FILE).is_file():
        raise ValueError(f"resume: {str(d)!r} has no {CHECKPOINT_FILE} to resume from")
    return config_from_dict(load_toml(d / CONFIG_FILE))


# ---------------------------------------------------------------------------------------------------------------
# Metrics


def append_metrics(run_dir: Path, row: dict[str, Any]) -> None:
    with open(run_dir / METRICS_FILE, "a") as f:
        f.write(json.dumps(row) + "\n")


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The evaluations a run wrote, in order."""
    path = Path(run_dir) / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Drops metrics lines written after the checkpoint at ``step``, so a resumed run does not repeat them."""
    rows = [r for r in read_metrics(run_dir) if r["step"] <= step] if (run_dir / METRICS_FILE).exists() else []
    atomic_write(run_dir / METRICS_FILE, lambda f: f.writelines(json.dumps(r) + "\n" for r in rows))


# ---------------------------------------------------------------------------------------------------------------
# Checkpoint


@dataclass
class Counters:
    """Cumulative totals of a run; a checkpoint carries them."""

    step: int = 0
    sim_time_s: float = 0.0
    wall_time_s: float = 0.0
    bytes_sent: int = 0
    messages_sent: int = 0
    messages_dropped: int = 0
    train_loss_sum: float = 0.0
    train_loss_count: int = 0
    comm_rounds: int = 0
    rounds_to_target: int = -1


def save_checkpoint(run_dir: Path, blob: dict[str, Any]) -> None:
    """Writes ``checkpoint.pt`` atomically (params, state, counters, config, clock)."""
    import torch  # noqa: PLC0415 (keep this module importable without torch for report-only use)

    atomic_write(run_dir / CHECKPOINT_FILE, lambda f: torch.save(blob, f), "wb")


def load_checkpoint(run_dir: Path) -> dict[str, Any]:
    import torch  # noqa: PLC0415

    return torch.load(run_dir / CHECKPOINT_FILE, weights_only=False)


# ---------------------------------------------------------------------------------------------------------------
# Summary


@dataclass(frozen=True, kw_only=True, slots=True)
class Summary:
    """What ``summary.json`` holds: the run's final evaluation, its totals and what it was."""

    final_test_accuracy: float
    """Test accuracy of the average model at the last evaluation."""
    final_test_loss: float
    final_train_loss: float | None
    """Mean training loss over the steps since the evaluation before the last."""
    final_worker_test_accuracy: float | None
    """Mean over live workers of each worker's own test accuracy."""
    consensus_distance: float
    """Mean squared distance of the workers' models from their average."""
    bytes_sent: int
    comm_rounds: int
    """Steps that launched an exchange."""
    rounds_to_target: int | None
    """Exchanges until the test accuracy first reached target_accuracy (None: never, or no target)."""
    target_accuracy: float | None
    live_workers: int | None
    coverage: float | None
    """Fraction of the training samples held by live workers."""
    messages_sent: int | None
    messages_dropped: int
    sim_time_s: float
    """Simulated seconds (docs/clock.md)."""
    wall_time_s: float
    steps: int
    scalability: float | None
    """Throughput over W times that of one worker that never communicates (docs/clock.md)."""
    compute_ms: float | None
    strategy: str
    num_workers: int
    dataset: str | None
    model: str | None
    seed: int
    drop_rate: float | str | None
    """The configured drop rate, or "matrix" for a per-link matrix."""
    num_parameters: int | None
    diverged: bool = False
    """The loss stopped being finite; the run ended there (a result, not a crash)."""
    error: str = ""
    """Why it ended early, in one line."""

    @staticmethod
    def from_run(cfg: RunConfig, last: dict[str, Any], counters: Counters, *, compute_ms: float,
                 num_parameters: int, diverged: bool = False, error: str = "") -> Summary:
        """The summary of a run whose last evaluation is ``last`` (a metrics row) and whose totals are ``counters``."""
        return Summary(
            final_test_accuracy=last["test_accuracy"], final_test_loss=last["test_loss"],
            final_train_loss=last["train_loss"], final_worker_test_accuracy=last["worker_test_accuracy"],
            consensus_distance=last["consensus_distance"], bytes_sent=counters.bytes_sent,
            comm_rounds=counters.comm_rounds,
            rounds_to_target=counters.rounds_to_target if counters.rounds_to_target >= 0 else None,
            target_accuracy=cfg.target_accuracy, live_workers=last["live_workers"], coverage=last["coverage"],
            messages_sent=counters.messages_sent, messages_dropped=counters.messages_dropped,
            sim_time_s=counters.sim_time_s, wall_time_s=last["wall_time_s"], steps=counters.step,
            scalability=counters.step * compute_ms / 1e3 / counters.sim_time_s if counters.sim_time_s else None,
            compute_ms=compute_ms, strategy=cfg.strategy.name, num_workers=cfg.num_workers,
            dataset=cfg.data.dataset, model=cfg.model.name, seed=cfg.seed,
            drop_rate=cfg.network.drop_rate if isinstance(cfg.network.drop_rate, float) else "matrix",
            num_parameters=num_parameters, diverged=diverged, error=error)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def write(self, run_dir: Path) -> None:
        write_json(run_dir / SUMMARY_FILE, self.to_dict())


def read_summary(run_dir: str | Path) -> dict[str, Any]:
    """A finished run's summary.json."""
    return json.loads((Path(run_dir) / SUMMARY_FILE).read_text())
