"""Sweeps: a grid over any config fields, run in parallel processes, resumable.

A sweep file is TOML::

    description = \"\"\"What this grid measures and why.\"\"\"
    kind = "train"                      # or "scale": scalability from the clock alone
    [base]                              # any RunConfig settings
    steps = 600
    [grid]                              # dotted keys -> lists; the runs are the cartesian product
    "strategy.name" = ["rps", "lossy-allreduce"]
    "network.drop_rate" = [0.0, 0.1]
    seed = [0, 1, 2]

plus optional ``[[claim]]``, ``[[plot]]`` and ``table`` entries that
``shaky report`` reads (see ``shaky.report``). A grid value may be a table: it
is merged into the base's table of that name, so one axis can set several
fields at once (``strategy = [{name = "allreduce"}, {name = "dts", delay = 8}]``).

Every run lives in ``<out>/<sweep name>/<key=value,...>`` (the sweep name is the
file's stem). A run is finished when its ``summary.json`` exists; a run
directory without one is resumed from its checkpoint, or deleted and run again,
so an interrupted sweep picks up where it stopped. The whole grid is validated
(every combination must build a valid config) before anything is written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import math
import multiprocessing
import os
import re
import signal
import sys
import time
import tomllib
import typing
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import tomli_w

from shaky.config import (MAX_SCALE_PERIOD, RunConfig, _build, config_from_dict, load_toml, parse_value, set_dotted,
                          to_dict)
from shaky.interrupt import Stopped, exit_quietly
from shaky.resumable import check_finished, check_finished_data, config_digest, summary_fields, values_digest
from shaky.rundir import (CHECKPOINT_FILE, CONFIG_FILE, RUN_FILES, SUMMARY_FILE, atomic_write, load_run_config,
                          write_json)
from shaky.sweep_spec import check_sweep_spec

SWEEP_FILE = "sweep.toml"
"""The resolved sweep (grid, claims, plots) saved in the sweep directory, for ``shaky report``."""
KINDS = ("train", "scale")
_TOP_KEYS = ("description", "kind", "base", "grid", "labels", "claim", "plot", "table")


@dataclass(frozen=True, kw_only=True, slots=True)
class ScaleConfig:
    """What a ``kind = "scale"`` run needs beyond the network: the workload and the WAN latency."""

    num_params: int = 25_600_000
    """Values in one message, float32 (default: ResNet-50)."""
    wan_latency_ms: float = -1.0
    """One-way latency of every link between regions (between workers without regions); negative = as configured."""
    recommended: bool = False
    """dts and local-sgd: use t = d = ceil(exchange / compute) + 1 from the clock (on the network as configured,
    before wan_latency_ms) instead of strategy.delay and strategy.period."""

    def __post_init__(self) -> None:
        if self.num_params < 1:
            raise ValueError(f"scale.num_params must be >= 1, got {self.num_params}")
        if math.isnan(self.wan_latency_ms) or math.isinf(self.wan_latency_ms):
            raise ValueError(f"scale.wan_latency_ms must be a finite number, got {self.wan_latency_ms!r}")


@dataclass(frozen=True, slots=True)
class Point:
    """One run of a sweep: its directory name, its grid values, and its full settings."""

    name: str
    """Directory name: ``key=value`` for each grid axis, joined by commas."""
    params: dict[str, Any]
    """Grid key -> this run's value."""
    values: dict[str, Any]
    """The resolved settings (RunConfig as nested dicts, plus ``scale`` for kind scale)."""

    def get(self, key: str) -> Any:
        """The setting at a dotted key (``network.drop_rate``), or a KeyError."""
        node: Any = self.values
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                raise KeyError(key)
            node = node[part]
        return node


@dataclass(frozen=True, slots=True)
class Sweep:
    """A validated sweep file."""

    name: str
    """The file's stem; the sweep directory's name."""
    source: str
    """The file it was read from."""
    description: str
    kind: str
    base: dict[str, Any]
    grid: tuple[tuple[str, tuple[Any, ...]], ...]
    """(dotted key, values) per axis, in file order."""
    claims: tuple[dict[str, Any], ...] = ()
    plots: tuple[dict[str, Any], ...] = ()
    table: tuple[str, ...] = ()
    points: tuple[Point, ...] = ()
    labels: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    """Grid key -> {value as in run names -> text} for legends and tables, e.g. {"scale.wan_latency_ms" = {"-1" = "measured"}}."""

    def to_toml(self) -> str:
        doc = {"name": self.name, "source": self.source, "description": self.description, "kind": self.kind,
               "base": self.base, "grid": {k: list(v) for k, v in self.grid}}
        if self.table:
            doc["table"] = list(self.table)
        if self.labels:
            doc["labels"] = dict(self.labels)
        if self.claims:
            doc["claim"] = list(self.claims)
        if self.plots:
            doc["plot"] = list(self.plots)
        return tomli_w.dumps(doc)


# ---------------------------------------------------------------------------
# Reading and expanding a sweep file.

def _known_key(key: str, kind: str) -> bool:
    """Whether a dotted key names a setting (or a table of settings) of a run of ``kind``."""
    cls: Any = RunConfig
    parts = key.split(".")
    if kind == "scale" and parts[0] == "scale":
        cls, parts = ScaleConfig, parts[1:]
    for part in parts:
        if cls is None:
            return False
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return False
        cls = hints[part] if dataclasses.is_dataclass(hints[part]) else None
    return True


def _merge(base: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    """A deep copy of ``base`` with ``value`` at ``key``; a table value is merged into the table there."""
    out = json.loads(json.dumps(base))
    if isinstance(value, dict):
        node = out
        for part in key.split("."):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"{key}: {part} is a value, not a table")
            node = child
        node.update(json.loads(json.dumps(value)))
    else:
        set_dotted(out, key, json.loads(json.dumps(value)))
    return out


def _label(value: Any) -> str:
    """A grid value as a short, file-name-safe string."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, dict):
        return "+".join(f"{k}-{_label(v)}" for k, v in value.items())
    if isinstance(value, list):
        return "none" if not value else "+".join(_label(v) for v in value)
    return str(value)


def point_name(params: dict[str, Any]) -> str:
    """The directory name of a run: ``key=value`` per grid axis, joined by commas, safe in a file name."""
    name = ",".join(f"{k}={_label(v)}" for k, v in params.items())
    name = re.sub(r"[^A-Za-z0-9._=,+-]", "_", name)
    if len(name) > 120:  # file systems cap names at 255 bytes; keep it readable and unique
        digest = hashlib.sha1(json.dumps(params, sort_keys=True).encode()).hexdigest()[:10]
        name = f"{name[:100]}...{digest}"
    return name


def build_run(values: dict[str, Any], kind: str) -> tuple[RunConfig, ScaleConfig | None]:
    """The validated config of one run (ValueError/TypeError naming the field)."""
    if kind == "scale":
        rest = dict(values)
        scale_values = rest.pop("scale", {})
        if not isinstance(scale_values, dict):
            raise TypeError(f"scale must be a table of settings, got {scale_values!r}")
        scale_cfg = _build(ScaleConfig, scale_values, prefix="scale.")
        cfg = config_from_dict(rest)
        from shaky.scale import STRATEGIES  # noqa: PLC0415

        if cfg.strategy.name not in STRATEGIES:
            raise ValueError(f"strategy.name must be one of {', '.join(STRATEGIES)} in a scale sweep; "
                             f"got {cfg.strategy.name!r}")
        if cfg.network.compute_ms <= 0:
            raise ValueError(f"network.compute_ms must be > 0 in a scale sweep (the compute a step stands for), "
                             f"got {cfg.network.compute_ms:g}")
        for key in ("period", "delay"):
            if getattr(cfg.strategy, key) > MAX_SCALE_PERIOD:
                raise ValueError(f"strategy.{key} must be at most {MAX_SCALE_PERIOD} in a scale sweep, "
                                 f"got {getattr(cfg.strategy, key)}")
        if scale_cfg.recommended and _recommended_period(cfg, scale_cfg) > MAX_SCALE_PERIOD:
            raise ValueError(f"scale.recommended: the recommended t = d = {_recommended_period(cfg, scale_cfg)} "
                             f"is above {MAX_SCALE_PERIOD} (network.compute_ms {cfg.network.compute_ms:g} is small "
                             "against one exchange); set scale.recommended = false or a larger network.compute_ms")
        return cfg, scale_cfg
    return config_from_dict(values), None


def resolved_values(cfg: RunConfig, scale_cfg: ScaleConfig | None) -> dict[str, Any]:
    """What a run directory's config.toml holds for this run."""
    values = to_dict(cfg)
    if scale_cfg is not None:
        values["scale"] = to_dict(scale_cfg)
    return values


def parse_sweep(doc: dict[str, Any], name: str, source: str,
                overrides: Sequence[tuple[str, Any]] = ()) -> Sweep:
    """Checks a sweep document and expands its grid; every error names the file and the field."""
    where = source

    def bad(msg: str) -> ValueError:
        return ValueError(f"{where}: {msg}")

    unknown = sorted(set(doc) - set(_TOP_KEYS))
    if unknown:
        raise bad(f"{unknown[0]} is not a sweep setting (known: {', '.join(_TOP_KEYS)})")
    kind = doc.get("kind", "train")
    if kind not in KINDS:
        raise bad(f"kind must be one of {', '.join(KINDS)}; got {kind!r}")
    description = doc.get("description", "")
    if not isinstance(description, str):
        raise bad(f"description must be a string, got {description!r}")
    base = doc.get("base", {})
    if not isinstance(base, dict):
        raise bad(f"base must be a table of settings, got {base!r}")
    grid_doc = doc.get("grid")
    if grid_doc is None:
        raise bad("grid is missing: add a [grid] table of dotted keys -> lists of values")
    if not isinstance(grid_doc, dict):
        raise bad(f"grid must be a table of dotted keys -> lists, got {grid_doc!r}")
    if not grid_doc:
        raise bad("grid is empty: give at least one key with a list of values")
    grid: dict[str, tuple[Any, ...]] = {}
    for key, values in _flatten_grid(grid_doc):
        if not _known_key(key, kind):
            raise bad(f"grid key {key!r} is not a setting")
        if not isinstance(values, list):
            raise bad(f"grid value of {key!r} must be a list of values, got {values!r}")
        if not values:
            raise bad(f"grid value of {key!r} is an empty list: the grid would have no runs")
        grid[key] = tuple(values)
    narrowed = False
    for key, value in overrides:
        if not _known_key(key, kind):
            raise bad(f"--set {key}: not a setting")
        narrowed = narrowed or key in grid
        if key in grid:
            grid[key] = (value,)
        else:
            base = _merge(base, key, value)
    table = doc.get("table", [])
    if not isinstance(table, list) or not all(isinstance(t, str) for t in table):
        raise bad(f"table must be a list of summary keys, got {table!r}")
    labels = doc.get("labels", {})
    if not isinstance(labels, dict):
        raise bad(f"labels must be a table of grid key -> {{value = text}}, got {labels!r}")
    for key, texts in labels.items():
        if key not in grid:
            raise bad(f"labels.{key}: {key!r} is not a grid key")
        if not isinstance(texts, dict) or not all(isinstance(t, str) for t in texts.values()):
            raise bad(f"labels.{key} must be a table of value -> text, got {texts!r}")
    claims, plots = doc.get("claim", []), doc.get("plot", [])
    for label, items in (("claim", claims), ("plot", plots)):
        if not isinstance(items, list) or not all(isinstance(c, dict) for c in items):
            raise bad(f"{label} must be an array of tables ([[{label}]]), got {items!r}")

    points = []
    keys = list(grid)
    for combo in itertools.product(*(grid[k] for k in keys)):
        params = dict(zip(keys, combo))
        values = base
        for k, v in params.items():
            try:
                values = _merge(values, k, v)
            except ValueError as exc:
                raise bad(str(exc)) from None
        pname = point_name(params)
        try:
            cfg, scale_cfg = build_run(values, kind)
        except (ValueError, TypeError) as exc:
            raise bad(f"run {pname}: {exc}") from None
        points.append(Point(pname, params, resolved_values(cfg, scale_cfg)))
    names = [p.name for p in points]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise bad(f"two runs of the grid get the same directory name {dup!r}; give the grid values distinct labels")
    sweep = Sweep(name, source, description, kind, base, tuple(grid.items()), tuple(claims), tuple(plots),
                  tuple(table), tuple(points), labels)
    try:
        # A grid narrowed by --set may leave a claim or a plot without runs; the file as written may not.
        check_sweep_spec(sweep, lambda key: _known_key(key, sweep.kind), require_runs=not narrowed)
    except (ValueError, TypeError) as exc:
        raise bad(str(exc)) from None
    return sweep


def _flatten_grid(grid: dict[str, Any], prefix: str = "") -> Iterable[tuple[str, Any]]:
    """Grid entries as (dotted key, value); ``[grid.network] drop_rate = [...]`` reads as network.drop_rate."""
    for key, value in grid.items():
        if isinstance(value, dict):
            yield from _flatten_grid(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def load_sweep(path: str | Path, overrides: Sequence[tuple[str, Any]] = ()) -> Sweep:
    """Reads and validates a sweep file (ValueError naming the file and the field)."""
    p = Path(path)
    doc = load_toml(p)
    return parse_sweep(doc, p.stem, str(p), overrides)


def load_saved_sweep(sweep_dir: str | Path) -> Sweep:
    """The sweep a ``shaky sweep`` run saved in its directory."""
    d = Path(sweep_dir)
    doc = load_toml(d / SWEEP_FILE)
    name, source = doc.pop("name", d.name), doc.pop("source", str(d / SWEEP_FILE))
    return parse_sweep(doc, name, source)


def parse_overrides(items: Sequence[str]) -> list[tuple[str, Any]]:
    """``KEY=VALUE`` strings as (key, TOML value) pairs."""
    out = []
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        out.append((key.strip(), parse_value(text.strip())))
    return out


# ---------------------------------------------------------------------------
# Running.

@dataclass(frozen=True, slots=True)
class Task:
    """One run to do, as plain data that crosses into a worker process."""

    sweep: str
    name: str
    kind: str
    run_dir: str
    values: dict[str, Any]
    resume: bool
    cost: float


def run_status(run_dir: Path, values: dict[str, Any], kind: str = "train") -> str:
    """``done``, ``resume``, ``fresh`` (nothing there) or ``restart`` (half-written, no checkpoint).

    Raises ValueError if the directory holds a run of a different config, or files a run never writes, or fails
    the resume check (``shaky.resumable``: a checkpoint or metrics that are not this run's, a summary of another
    config), in one line naming the file.
    """
    if not run_dir.exists():
        return "fresh"
    if not run_dir.is_dir():
        raise ValueError(f"{str(run_dir)!r} is a file, not a run directory")
    config_path = run_dir / CONFIG_FILE
    if config_path.is_file():
        try:
            saved = tomllib.loads(config_path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeError):
            saved = None  # torn while being written: the run never started
        if saved is not None and saved != values:
            raise ValueError(f"{str(run_dir)!r} holds a run of another config ({_first_difference(saved, values)}); "
                             "delete it or sweep into another --out")
        if saved is not None and (run_dir / SUMMARY_FILE).is_file():
            _check_finished(run_dir, values, kind)
            return "done"
        if saved is not None and (run_dir / CHECKPOINT_FILE).is_file():
            load_run_config(run_dir)    # the checkpoint is this run's, and metrics.jsonl holds its rows
            return "resume"
    stray = sorted(p.name for p in run_dir.iterdir() if p.name not in RUN_FILES)
    if stray:
        raise ValueError(f"{str(run_dir)!r} is unfinished but holds {stray[0]!r}, which a run never writes; "
                         "move it away or delete the directory")
    return "restart"


def _check_finished(run_dir: Path, values: dict[str, Any], kind: str) -> None:
    """A run is finished when its summary is the summary of its own config (``shaky.resumable.check_finished``),
    trained on the data that config reads now (``check_finished_data``)."""
    if kind == "train":
        cfg, _ = build_run(values, kind)
        check_finished(run_dir, config_digest(cfg), summary_fields(cfg))
        check_finished_data(run_dir, cfg, _data_digest)
    else:
        check_finished(run_dir, values_digest(values), {"strategy": values.get("strategy", {}).get("name")})


_DATA_DIGESTS: dict[str, str] = {}
""":func:`_data_digest`'s results during one :func:`plan`, by the settings that decide a run's data."""


def _data_digest(cfg: RunConfig) -> str:
    """:func:`shaky.setup.data_digest` of the data ``cfg`` reads now, read once per distinct data settings (a
    sweep's finished runs share a handful)."""
    from shaky.setup import data_digest, read_data  # noqa: PLC0415 (torch)

    key = json.dumps([to_dict(cfg.data), cfg.seed, cfg.dtype], sort_keys=True)
    if key not in _DATA_DIGESTS:
        _DATA_DIGESTS[key] = data_digest(read_data(cfg))
    return _DATA_DIGESTS[key]


def _first_difference(a: Any, b: Any, prefix: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                return f"{prefix}{key} only in {'the sweep' if key in b else 'the directory'}"
            if a[key] != b[key]:
                return _first_difference(a[key], b[key], f"{prefix}{key}.")
        return "equal"
    return f"{prefix.rstrip('.')} = {a!r} there, {b!r} in the sweep"


def _cost(values: dict[str, Any], kind: str) -> float:
    """A rough run time, so the longest runs start first and the pool finishes together."""
    if kind != "train":
        return 0.0
    return float(values.get("num_workers", 8)) * float(values.get("steps", 600)) * float(values.get("batch_size", 32))


def plan(sweeps: Sequence[Sweep], out: Path) -> tuple[list[Task], int]:
    """The runs still to do (longest first) and how many are already finished; checks every run directory."""
    _DATA_DIGESTS.clear()   # (read afresh by every plan: a file may have changed since the last one)
    tasks, done = [], 0
    for sweep in sweeps:
        for point in sweep.points:
            run_dir = out / sweep.name / point.name
            status = run_status(run_dir, point.values, sweep.kind)
            if status == "done":
                done += 1
                continue
            tasks.append(Task(sweep.name, point.name, sweep.kind, str(run_dir), point.values, status == "resume",
                              _cost(point.values, sweep.kind)))
    tasks.sort(key=lambda t: -t.cost)
    return tasks, done


def check_setups(tasks: Sequence[Task]) -> None:
    """Builds every training run's full setup (data, files, shards, model against data, network, trace) before
    anything is written, so a run that cannot start fails the sweep now, in one line naming it, and not
    after other runs were written; and measures the compute time the runs that do not set
    ``network.compute_ms`` will share (``shaky.setup.measured_compute_ms``), here, before the workers start
    and load the cores."""
    from shaky.resumable import check_resume  # noqa: PLC0415
    from shaky.setup import measured_compute_ms, prepare  # noqa: PLC0415

    for task in tasks:
        if task.kind != "train":
            continue
        cfg, _ = build_run(task.values, task.kind)
        try:
            setup = prepare(cfg, measure=False)
            if task.resume:     # the rest of the resume check: the checkpoint fits the model, the data is the same
                check_resume(setup, Path(task.run_dir))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{task.sweep}/{task.name}: {exc}") from None
        if setup.compute_ms < 0:
            measured_compute_ms(setup)


def _clear_run_dir(run_dir: Path) -> None:
    """Deletes a half-written run directory (only files a run writes; checked by ``run_status``)."""
    if run_dir.exists():
        for p in run_dir.iterdir():
            if p.name in RUN_FILES and p.is_file():
                p.unlink()
        run_dir.rmdir()


def execute_tuned(task: Task) -> dict[str, Any]:
    """:func:`execute` in a process the command line owns: freed memory is kept for the next step's tensors
    (glibc malloc settings, process-wide; see docs/performance.md)."""
    from shaky.vectorized import tune_allocator  # noqa: PLC0415

    tune_allocator()
    return execute(task)


def execute(task: Task) -> dict[str, Any]:
    """Runs one task in this process on one thread, and returns its summary.

    One thread per run: the sweep runs one process per core, and torch's default of
    a thread per core would make the processes fight over the cores. It also keeps
    the numbers of a run independent of how many processes the sweep used. The
    thread count is restored afterwards; no other process setting is touched.
    """
    import torch  # noqa: PLC0415

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _execute(task)
    finally:
        torch.set_num_threads(threads)


def _execute(task: Task) -> dict[str, Any]:
    run_dir = Path(task.run_dir)
    cfg, scale_cfg = build_run(task.values, task.kind)
    if not task.resume:
        _clear_run_dir(run_dir)
    if task.kind == "scale" and scale_cfg is not None:  # build_run returns one for kind scale
        return _execute_scale(cfg, scale_cfg, run_dir)
    from shaky.resumable import read_inputs  # noqa: PLC0415
    from shaky.rundir import claim_dir, read_summary, release_dir  # noqa: PLC0415
    from shaky.train import prepare, train  # noqa: PLC0415

    setup = prepare(cfg)
    setup.machines = {0: read_inputs(setup)}    # the digests of its data, which a resume checks (check_setups)
    # The run's one writer while it trains (a `shaky train --resume` of it meanwhile is refused).
    claim_dir(run_dir, fresh=not task.resume)
    try:
        return train(setup, run_dir, resume=task.resume, progress=False)
    except FloatingPointError:
        # A run that diverges is a result, not a crash: train wrote its summary (diverged, where and why),
        # so the sweep counts it as finished.
        return read_summary(run_dir)
    finally:
        release_dir(run_dir)  # the worker process goes on to other runs


def _recommended_period(cfg: RunConfig, scale_cfg: ScaleConfig) -> int:
    """DTS's t = d that hides one exchange behind compute, for the network as configured."""
    from shaky import scale  # noqa: PLC0415

    work = scale.Workload(scale_cfg.num_params, cfg.network.compute_ms)
    return int(scale.hiding_period(scale.exchange_seconds("dts", cfg, work), work.compute_ms))


def _execute_scale(cfg: RunConfig, scale_cfg: ScaleConfig, run_dir: Path) -> dict[str, Any]:
    from shaky import scale  # noqa: PLC0415

    t0 = time.perf_counter()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / CONFIG_FILE).write_text(tomli_w.dumps(resolved_values(cfg, scale_cfg)))
    work = scale.Workload(scale_cfg.num_params, cfg.network.compute_ms)
    latency = scale_cfg.wan_latency_ms if scale_cfg.wan_latency_ms >= 0 else None
    # Recommended for the network as configured, then kept at every swept latency (as a deployment would).
    recommended = _recommended_period(cfg, scale_cfg)
    period, delay = cfg.strategy.period, cfg.strategy.delay
    if scale_cfg.recommended and cfg.strategy.name != "allreduce":
        period = recommended
        delay = recommended if cfg.strategy.name == "dts" else 1
    value = scale.strategy_scalability(cfg.strategy.name, cfg, work, period=period, delay=delay,
                                       wan_latency_ms=latency)
    summary = {"scalability": value, "strategy": cfg.strategy.name, "period": period, "delay": delay,
               "recommended_period": recommended, "num_workers": cfg.num_workers,
               "exchange_s": scale.exchange_seconds(cfg.strategy.name, cfg, work, latency),
               "wan_latency_ms": scale_cfg.wan_latency_ms, "compute_ms": cfg.network.compute_ms,
               "num_params": scale_cfg.num_params, "wall_time_s": time.perf_counter() - t0,
               "config_sha256": values_digest(resolved_values(cfg, scale_cfg))}
    write_json(run_dir / SUMMARY_FILE, summary)
    return summary


def default_jobs() -> int:
    """The cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class _Bar:
    """A progress bar over runs on a terminal, one line per finished run otherwise."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.count, self.enabled = total, 0, enabled
        self.bar = None
        if enabled and total and sys.stderr.isatty():
            from tqdm import tqdm  # noqa: PLC0415

            self.bar = tqdm(total=total, unit="run", desc="sweep", dynamic_ncols=True)

    def update(self, task: Task, summary: dict[str, Any] | None, seconds: float, error: str = "") -> None:
        self.count += 1
        if not self.enabled:
            return
        if error:
            what = f"FAILED: {error}"
        elif summary is not None and "final_test_accuracy" in summary:
            what = f"acc {summary['final_test_accuracy']:.4f}" + (" (diverged)" if summary.get("diverged") else "")
        elif summary is not None and "scalability" in summary:
            what = f"scalability {summary['scalability']:.4f}"
        else:
            what = "done"
        line = f"[{self.count}/{self.total}] {task.sweep}/{task.name}: {what} ({seconds:.1f} s)"
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(f"{task.sweep}: {what}", refresh=True)
            if error:
                self.bar.write(line, file=sys.stderr)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@dataclass
class Outcome:
    """What ``run_sweeps`` did."""

    ran: int = 0
    skipped: int = 0
    failed: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    """(sweep/run, error) of each run that raised."""
    wall_s: float = 0.0


def run_sweeps(sweeps: Sequence[Sweep], out: str | Path, *, jobs: int | None = None, progress: bool = True,
               runner: Callable[[Task], dict[str, Any]] = execute) -> Outcome:
    """Runs every unfinished run of ``sweeps`` under ``out``, ``jobs`` processes at a time (default: the cores)."""
    out = Path(out)
    t0 = time.perf_counter()
    tasks, done = plan(sweeps, out)
    for sweep in sweeps:  # the report reads the grid, the claims and the plots from here
        sweep_dir = out / sweep.name
        sweep_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(sweep_dir / SWEEP_FILE, lambda f, text=sweep.to_toml(): f.write(text))
    jobs = max(1, min(jobs or default_jobs(), len(tasks) or 1))
    total = len(tasks) + done
    if progress:
        print(f"{', '.join(s.name for s in sweeps)}: {total} runs, {done} finished, {len(tasks)} to run "
              f"({jobs} process{'es' if jobs > 1 else ''})", flush=True)
    outcome = Outcome(skipped=done)
    bar = _Bar(len(tasks), progress)
    try:
        if jobs == 1:
            for task in tasks:
                start = time.perf_counter()
                try:
                    summary = runner(task)
                except (KeyboardInterrupt, SystemExit, Stopped):
                    raise
                except Exception as exc:  # noqa: BLE001 (one broken run must not stop the others)
                    outcome.failed.append((f"{task.sweep}/{task.name}", f"{type(exc).__name__}: {exc}"))
                    bar.update(task, None, time.perf_counter() - start, str(exc))
                    continue
                outcome.ran += 1
                bar.update(task, summary, time.perf_counter() - start)
        else:
            _run_pool(tasks, jobs, runner, bar, outcome)
    finally:
        bar.close()
    outcome.wall_s = time.perf_counter() - t0
    return outcome


def _run_pool(tasks: list[Task], jobs: int, runner: Callable[[Task], dict[str, Any]], bar: _Bar,
              outcome: Outcome) -> None:
    # spawn, not fork: a forked child inherits torch's thread pools and locks from the parent.
    ctx = multiprocessing.get_context("spawn")
    _start_resource_tracker()
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_worker_init,
                               initargs=(os.getpid(),))
    pending: dict[Future[dict[str, Any]], tuple[Task, float]] = {}
    queue = list(tasks)
    try:
        while queue or pending:
            while queue and len(pending) < jobs:
                task = queue.pop(0)
                pending[pool.submit(_in_worker, runner, os.getpid(), task)] = (task, time.perf_counter())
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                task, start = pending.pop(future)
                try:
                    summary = future.result()
                except Exception as exc:  # noqa: BLE001
                    outcome.failed.append((f"{task.sweep}/{task.name}", f"{type(exc).__name__}: {exc}"))
                    bar.update(task, None, time.perf_counter() - start, str(exc))
                    continue
                outcome.ran += 1
                bar.update(task, summary, time.perf_counter() - start)
        pool.shutdown(wait=True)    # in the try: a signal while it waits for the pool's thread is a stop too
    except BaseException:
        # Stopped (Ctrl-C, SIGTERM) or failed: stop our own worker processes, by handle, and wait for them
        # (bounded) before leaving. SIGTERM makes a worker's run finish its step and write a checkpoint,
        # which the next sweep resumes; a worker that does not end in time is killed.
        processes = list((getattr(pool, "_processes", None) or {}).values())
        for process in processes:
            process.terminate()
        _stop_unregistered_workers({p.pid for p in processes})
        pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + WORKER_STOP_S
        alive = processes
        while alive and time.monotonic() < deadline:
            alive[0].join(0.25)
            alive = [p for p in alive if p.is_alive()]
            for process in alive:  # again: a worker whose run has stopped waits for work, and SIGTERM ends it
                process.terminate()
        for process in alive:
            process.kill()
            process.join(5)
        # Every worker is gone: the pool's thread notices and closes its queues, here rather than in an exit
        # function (the shaky process ends with os._exit once its exit functions ran; semaphores left open then
        # are reported by multiprocessing's resource tracker as leaked).
        pool.shutdown(wait=True)
        raise


def _stop_unregistered_workers(known: set[int | None]) -> None:
    """SIGTERM to this process's children that multiprocessing is still spawning for the pool (a stop that
    came while a worker was being started: the pool does not hold it yet, and it would wake to its parent's
    closed pipe and print a traceback). Before ``_worker_init`` runs SIGTERM ends such a child without a word."""
    me = str(os.getpid())
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit() or int(entry.name) in known:
            continue
        try:
            ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if ppid == me and b"spawn_main" in cmdline:
            with contextlib.suppress(OSError):
                os.kill(int(entry.name), signal.SIGTERM)


def _start_resource_tracker() -> None:
    """Starts multiprocessing's resource tracker (it removes the pool's semaphores once this process is gone) with
    its stderr on /dev/null. A sweep stopped at once (a signal while it loads a module, or as it ends: shaky's
    process ends with ``os._exit``) leaves the semaphores to it, and it would print two lines of warnings after
    the sweep's one line for each; it removes them all the same."""
    from multiprocessing import resource_tracker  # noqa: PLC0415

    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        resource_tracker.ensure_running()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _in_worker(runner: Callable[[Task], dict[str, Any]], parent: int, task: Task) -> dict[str, Any]:
    """``runner(task)`` in a worker process, which exits when the task ends if the sweep process is gone.

    A worker whose parent was killed (SIGKILL: no clean-up) gets SIGTERM from the kernel
    (``_worker_init``), stops its run after the step with a checkpoint, and would then wait for its next
    task forever: the pool's queues are pipes the worker itself holds both ends of, so no end-of-file
    ever comes. It leaves instead."""
    try:
        return runner(task)
    finally:
        if os.getppid() != parent:
            os._exit(1)


WORKER_STOP_S = 60.0
"""How long a stopped sweep waits for each worker to write its checkpoint before killing it."""


def _worker_init(parent: int) -> None:
    """Runs first in each worker process: it ends with its parent, and leaves Ctrl-C to it.

    The kernel sends the worker SIGTERM when the sweep process dies, even by SIGKILL (Linux's
    PR_SET_PDEATHSIG); the run under way then stops after its step with a checkpoint, and outside its loop the
    worker ends at once, but not in the middle of a file write (``shaky.interrupt.exit_quietly``: what it leaves,
    a run directory being made or a checkpoint without a summary, the sweep's next start redoes or resumes; an
    exception raised there instead could land in torch's import and abort the process). SIGINT is
    ignored: a Ctrl-C reaches every process of the terminal, and the parent stops the workers itself.
    """
    import ctypes  # noqa: PLC0415
    import signal  # noqa: PLC0415

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, exit_quietly)    # outside a run's loop: at once, but never in a file write
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):  # not Linux: the worker notices its parent is gone at its next task
        pass
    if os.getppid() != parent:  # the parent died before the line above took effect
        os._exit(1)
