"""Shared helpers for the tests: small, fast runs on the bundled digits data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from shaky.config import RunConfig, config_from_dict
from shaky.inject import Fault, FaultInjector
from shaky.network.faults import Membership, Round
from shaky.network.model import LinkSample
from shaky.train import CHECKPOINT_FILE, prepare, read_metrics, train


def make_config(**overrides: Any) -> RunConfig:
    """A digits/mlp config for tests; dotted keys via dict nesting (network={"drop_rate": 0.1})."""
    values: dict[str, Any] = {"num_workers": 4, "steps": 50, "batch_size": 16, "eval_every": 25,
                              "network": {"compute_ms": 1.0}}
    for key, value in overrides.items():
        if isinstance(value, dict):
            values[key] = {**values.get(key, {}), **value}
        else:
            values[key] = value
    return config_from_dict(values)


def run(cfg: RunConfig, run_dir: Path, **kwargs: Any) -> tuple[dict[str, Any], torch.Tensor, list[dict[str, Any]]]:
    """Trains and returns (summary, final params [W, D], metrics rows)."""
    summary = train(prepare(cfg), run_dir, progress=False, **kwargs)
    params = torch.load(run_dir / CHECKPOINT_FILE, weights_only=False)["params"]
    return summary, params, read_metrics(run_dir)


def without_wall_time(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "wall_time_s"} for r in rows]


def everyone(links: LinkSample, step: int | None = None) -> Round:
    """A round in which every worker lives, with these delivery masks."""
    return Round(links.round if step is None else step, links, Membership.everyone(links.up.shape[0]))


def stop_at(step: int) -> FaultInjector:
    """Faults that end a run after ``step`` steps, as a killed process would (no final checkpoint)."""
    return FaultInjector((Fault("stop", step),))


@pytest.fixture
def tmp_run(tmp_path: Path):
    counter = iter(range(1000))
    return lambda: tmp_path / f"run{next(counter)}"
