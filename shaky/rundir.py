"""The run directory: its file names, atomic writes, the checkpoint, the metrics and the summary.

A run directory holds ``config.toml`` (the resolved config), ``shards.json``
(which samples each worker holds), ``metrics.jsonl`` (one line per evaluation),
``checkpoint.pt`` and ``trace.npz`` (the delivery masks so far, replayable with
``network.trace``), and ``summary.json`` once the run is finished. ``shaky train``,
``shaky sweep`` and ``shaky report`` all read and write it through this module.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import io
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from shaky.interrupt import uninterrupted
from shaky.config import (MACHINE_SETTINGS, RunConfig, config_from_dict, first_difference, load_toml, to_dict,
                          to_toml)

if TYPE_CHECKING:
    import numpy as np

CONFIG_FILE = "config.toml"
CHECKPOINT_FILE = "checkpoint.pt"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
SHARDS_FILE = "shards.json"
TRACE_FILE = "trace.npz"
MACHINES_FILE = "machines.json"
"""What each rank read on its own machine: its machine settings (``shaky.config.MACHINE_SETTINGS``) and the
digests of its data and trace (``shaky.setup.inputs_digest``), by rank, as of the run's latest start."""
RUN_FILES = frozenset(n + t for n in (CONFIG_FILE, SHARDS_FILE, METRICS_FILE, SUMMARY_FILE, CHECKPOINT_FILE,
                                      TRACE_FILE, MACHINES_FILE) for t in ("", ".tmp"))
"""Every file a run writes (and its temporary twin while it is being written)."""


def atomic_write(path: Path, write: Callable[[Any], None], mode: str = "w") -> None:
    """Writes ``path`` through a temporary file that replaces it only once complete and on disk.

    If anything goes wrong (no space left, a read-only directory, an interrupt) the temporary file is
    removed and ``path`` is as it was; an OSError becomes :class:`WriteError`, one line naming the path.
    """
    tmp = path.with_name(path.name + ".tmp")
    with uninterrupted():   # a stop that ends the process at once waits for the write to end
        try:
            with open(tmp, mode) as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(path)
        except BaseException as exc:
            tmp.unlink(missing_ok=True)
            if isinstance(exc, OSError):
                raise WriteError(path, exc) from None
            raise


class BadCheckpoint(ValueError):
    """A checkpoint that is whole (its checksum holds) but cannot be this run's: found before anything of the
    run is changed, and said in one line (status 2)."""


class WriteError(OSError):
    """A file of a run could not be written (no space left, read-only, no permission): one line naming it."""

    def __init__(self, path: Path, exc: OSError) -> None:
        super().__init__(exc.errno, f"cannot write {path}: {exc.strerror or exc}")
        self.path = path

    def __str__(self) -> str:
        return str(self.strerror)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """``data`` as strict JSON (:func:`finite`), written whole or not at all."""
    atomic_write(path, lambda f: f.write(json.dumps(finite(data), indent=2, allow_nan=False) + "\n"))


def new_run_dir(base: str | Path) -> Path:
    """``base`` if it does not exist yet, else ``base-1``, ``base-2``, ...: never overwrites a run."""
    base = Path(base)
    candidate, i = base, 0
    while candidate.exists():
        i += 1
        candidate = base.with_name(f"{base.name}-{i}")
    return candidate


_HELD: dict[str, int] = {}
"""Directories this process holds, by path: the open descriptor whose lock is the claim."""


def claim_dir(path: str | Path, *, fresh: bool = False, what: str = "run directory") -> Path:
    """Makes this process the one writer of ``path`` (an advisory lock, released when the process ends or by
    :func:`release_dir`); ``fresh``: the directory is created and must be empty. ValueError in one line when
    another process holds it, or it is not fresh."""
    path = Path(path)
    if fresh:
        blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
        if blocker is not None:
            raise ValueError(f"{what} {str(path)!r} cannot be created: {str(blocker)!r} is a file")
        path.mkdir(parents=True, exist_ok=True)
    key = str(path.resolve())
    if key in _HELD:
        return path
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ValueError(f"{what} {str(path)!r} is in use by another shaky process; wait for it to end, "
                         "or pick another directory") from None
    if fresh and any(path.iterdir()):
        os.close(fd)
        raise ValueError(f"{what} {str(path)!r} already exists and is not empty; pick another directory or "
                         "--resume it")
    _HELD[key] = fd
    return path


def release_dir(path: str | Path) -> None:
    """Gives up the claim :func:`claim_dir` made (a no-op if this process does not hold ``path``)."""
    fd = _HELD.pop(str(Path(path).resolve()), None)
    if fd is not None:
        os.close(fd)


def create(run_dir: Path, cfg: RunConfig, shards: list[dict[str, Any]], *, again: bool = False,
           machines: dict[int, Any] | None = None) -> None:
    """A fresh run directory with the resolved config, the shard description and empty metrics (and
    ``machines``: :data:`MACHINES_FILE`).

    ``again``: the directory holds this run's files but no checkpoint (it was stopped before its first):
    they are written anew. If a write fails (no space, read-only) the files written so far are removed,
    so the same command works once there is room.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    if not again and any(run_dir.iterdir()):
        raise FileExistsError(f"run directory {str(run_dir)!r} is not empty")
    written = []
    try:
        # config.toml first: a process killed in between leaves a directory that --resume starts again.
        for name, text in ((CONFIG_FILE, to_toml(cfg)), (SHARDS_FILE, json.dumps(shards)), (METRICS_FILE, ""),
                           *([(MACHINES_FILE, _machines_text(machines))] if machines else [])):
            atomic_write(run_dir / name, lambda f, text=text: f.write(text))
            written.append(run_dir / name)
    except BaseException:
        if not again:
            for path in written:
                path.unlink(missing_ok=True)
        raise


def _machines_text(machines: dict[int, Any]) -> str:
    return json.dumps({str(rank): value for rank, value in sorted(machines.items())}, indent=1, sort_keys=True)


def record_start(run_dir: Path, cfg: RunConfig, machines: dict[int, Any] | None) -> None:
    """A resumed run's start: config.toml anew (a machine setting may have changed: the data moved, another
    device) and ``machines`` (:data:`MACHINES_FILE`), for the next resume to read."""
    atomic_write(run_dir / CONFIG_FILE, lambda f: f.write(to_toml(cfg)))
    if machines:
        atomic_write(run_dir / MACHINES_FILE, lambda f: f.write(_machines_text(machines)))


def read_machines(run_dir: Path) -> dict[int, Any]:
    """:data:`MACHINES_FILE` by rank; empty where the run has none (one started before shaky wrote it)."""
    path = Path(run_dir) / MACHINES_FILE
    if not path.exists():
        return {}
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
        return {int(rank): {"settings": dict(v["settings"]), "inputs": dict(v["inputs"])}
                for rank, v in values.items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        why = f"{type(exc).__name__}: {' '.join(str(exc).split())[:80]}"
        raise ValueError(f"resume: {path} is damaged ({why})") from None


def load_run_config(run_dir: str | Path) -> RunConfig:
    """The resolved config saved in a run directory, checked against its checkpoint before a resume: the
    checkpoint must be whole (its checksum) and config.toml must say what the checkpoint was trained with.
    A run with no checkpoint yet (stopped before its first) resumes from step 0 with its config.toml."""
    d = Path(run_dir)
    if not (d / CONFIG_FILE).is_file():
        raise ValueError(f"resume: {str(d)!r} is not a run directory (no {CONFIG_FILE})")
    try:
        cfg = config_from_dict(load_toml(d / CONFIG_FILE))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"resume: {d / CONFIG_FILE}: {exc}") from None
    if not (d / CHECKPOINT_FILE).exists():
        stray = sorted(p.name for p in d.iterdir() if p.name not in RUN_FILES)
        if not stray:
            return cfg  # a run stopped before its first checkpoint: it starts again from step 0
        raise ValueError(f"resume: {str(d)!r} has no {CHECKPOINT_FILE} to resume from, and holds {stray[0]!r}, "
                         "which a run never writes")
    ckpt = load_checkpoint(d)
    saved = ckpt.get("config")
    if not isinstance(saved, dict):
        raise ValueError(f"resume: {d / CHECKPOINT_FILE} holds no config to check {CONFIG_FILE} against")
    changed = first_difference(to_dict(cfg), saved, ignore=MACHINE_SETTINGS)   # a machine's own may change
    if changed is not None:
        key, now, then = changed
        raise ValueError(f"resume: {d / CONFIG_FILE} sets {key} = {now!r} but the checkpoint was trained with "
                         f"{then!r}; a resume continues the same run (start a new run to change it)")
    _check_metrics(d, cfg, ckpt)
    return cfg


def _check_metrics(run_dir: Path, cfg: RunConfig, ckpt: dict[str, Any]) -> None:
    """metrics.jsonl must hold every evaluation up to the checkpoint's step (a resume keeps those rows and
    writes the rest); a row cut short after that step is a write the stopped process did not finish."""
    try:
        step = int(ckpt["counters"]["step"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"resume: {run_dir / CHECKPOINT_FILE}: not a shaky checkpoint (no step)") from None
    # Before anything is sized by it: a step past the run's end would have the resume draw that many rounds.
    if not 0 <= step <= cfg.steps:
        raise ValueError(f"resume: {run_dir / CHECKPOINT_FILE}: its counters say step {step}, outside the run's "
                         f"0..{cfg.steps} (steps in {CONFIG_FILE}); the file was not written by this run")
    rows = read_metrics(run_dir, trim_torn=True)
    have = {r["step"] for r in rows if isinstance(r["step"], int) and r["step"] <= step}
    want = {0, *range(cfg.eval_every, step + 1, cfg.eval_every)} | ({step} if step == cfg.steps else set())
    missing = sorted(want - have)
    if missing:
        raise ValueError(f"{run_dir / METRICS_FILE}: the evaluation at step {missing[0]} is missing, but the "
                         f"checkpoint is at step {step} (the file is damaged); nothing was resumed")


# ---------------------------------------------------------------------------------------------------------------
# Metrics


def finite(value: Any) -> Any:
    """``value`` as strict JSON holds it: a float that is not finite (a diverged loss, the time of a step over a
    link of no bandwidth) is None, in lists and tables too. JSON has no NaN or infinity, and tools (jq, a
    browser's JSON.parse) reject the tokens Python's json writes for them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def _metrics_line(row: dict[str, Any]) -> str:
    return json.dumps(finite(row), allow_nan=False) + "\n"


def append_metrics(run_dir: Path, row: dict[str, Any]) -> None:
    """Appends one line (strict JSON: :func:`finite`); a line cut short (no space left, a kill) is trimmed when
    the run resumes."""
    path = run_dir / METRICS_FILE
    try:
        with open(path, "a") as f:
            f.write(_metrics_line(row))
    except OSError as exc:
        raise WriteError(path, exc) from None


def read_metrics(run_dir: str | Path, *, trim_torn: bool = False) -> list[dict[str, Any]]:
    """The evaluations a run wrote, in order. A line that is not JSON is an error naming the file and line,
    except, with ``trim_torn``, a last line without its newline (a write the process did not finish)."""
    path = Path(run_dir) / METRICS_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ValueError(f"{path}: missing (the run wrote no evaluations)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot be read ({exc})") from None
    lines = text.split("\n")
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or "step" not in row:
                raise ValueError("not a metrics row")
        except ValueError:
            if trim_torn and number == len(lines):  # the last line, with no newline after it: torn
                break
            raise ValueError(f"{path}, line {number}: not a metrics row (the file is damaged)") from None
        rows.append(row)
    return rows


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Drops metrics lines written after the checkpoint at ``step`` (and a torn last line), so a resumed run
    does not repeat them."""
    present = (run_dir / METRICS_FILE).exists()
    rows = [r for r in read_metrics(run_dir, trim_torn=True) if r["step"] <= step] if present else []
    atomic_write(run_dir / METRICS_FILE, lambda f: f.writelines(_metrics_line(r) for r in rows))


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
    wait_s: float = 0.0
    """Wall seconds the workers spent blocked waiting for exchanges (rank 0's)."""
    sim_wait_s: float = 0.0
    """The simulated clock's seconds of waiting for exchanges (the same quantity, predicted)."""
    eval_s: float = 0.0
    """Wall seconds spent in evaluations (part of ``wall_time_s``): their rounds of means, which first take in
    every exchange still in flight, and the forward passes."""
    transport: dict[str, Any] = dataclasses.field(default_factory=dict)
    """What a real lossy transport counted up to the checkpoint (``Observed.transport_stats``; empty on gloo and
    the simulator)."""


_CHECKPOINT_HEADER = b"shaky checkpoint 1 sha256="


def save_checkpoint(run_dir: Path, blob: dict[str, Any]) -> None:
    """Writes ``checkpoint.pt`` atomically (params, state, counters, config, clock): a header line with the
    SHA-256 of the rest, then torch.save's bytes."""
    import torch  # noqa: PLC0415 (keep this module importable without torch for report-only use)

    buf = io.BytesIO()
    torch.save(blob, buf)
    payload = buf.getbuffer()
    digest = hashlib.sha256(payload).hexdigest().encode()

    def write(f: Any) -> None:
        f.write(_CHECKPOINT_HEADER + digest + b"\n")
        f.write(payload)
    atomic_write(run_dir / CHECKPOINT_FILE, write, "wb")


def load_checkpoint(run_dir: str | Path) -> dict[str, Any]:
    """The checkpoint's contents, after checking them against the checksum they were written with
    (ValueError naming the file when it is damaged, truncated or not a shaky checkpoint)."""
    import torch  # noqa: PLC0415

    path = Path(run_dir) / CHECKPOINT_FILE
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    header, newline, payload = data.partition(b"\n")
    if not newline or not header.startswith(_CHECKPOINT_HEADER):
        raise ValueError(f"{path}: not a shaky checkpoint (empty, cut short, or written by something else)")
    if hashlib.sha256(payload).hexdigest().encode() != header[len(_CHECKPOINT_HEADER):]:
        raise ValueError(f"{path}: fails its checksum (the file is damaged); nothing was resumed")
    try:
        blob = torch.load(io.BytesIO(payload), weights_only=False, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - whatever unpickling raises, the file is unusable
        raise ValueError(f"{path}: cannot be loaded ({type(exc).__name__})") from None
    if not isinstance(blob, dict) or not {"params", "state", "counters"} <= set(blob):
        raise ValueError(f"{path}: not a shaky checkpoint (params, state or counters missing)")
    return blob


# ---------------------------------------------------------------------------------------------------------------
# Trace


class Trace(NamedTuple):
    """A trace as :func:`load_trace` reads it."""

    up: Any
    """uint8 [rounds, S * ceil(W*W/8)]: the packed phase-1 masks (``shaky.network.model.MaskLog``)."""
    down: Any
    """The phase-2 masks, alike."""
    by_block: bool
    """The masks are per block (``shaky.geometry.LinkSample``); False: a trace written before blocks were
    messages of their own, whose masks are per link (``TraceNetwork`` replays it with each block on its
    server's link)."""


def save_trace(run_dir: Path, packed: dict[str, np.ndarray], num_workers: int) -> None:
    """Writes the packed masks atomically into ``run_dir/trace.npz`` (:func:`atomic_write`).

    The file holds ``up`` and ``down`` (see ``shaky.network.model.MaskLog``), ``num_workers``, ``num_segments``
    (S), ``segment_bytes`` and ``by_block`` (1: the masks are per block); a trace written before segments
    existed has neither of those two and reads as S = 1, 0, and one written before blocks were messages of
    their own has no ``by_block`` (its masks are per link).
    """
    import numpy as np  # noqa: PLC0415 (keep this module light for the launcher)

    extra = {"num_segments": np.int64(packed.get("num_segments", 1)),
             "segment_bytes": np.int64(packed.get("segment_bytes", 0)),
             "by_block": np.int64(packed.get("by_block", 1))}
    atomic_write(Path(run_dir) / TRACE_FILE, lambda f: np.savez_compressed(
        f, up=packed["up"], down=packed["down"], num_workers=np.int64(num_workers), **extra), "wb")


def load_trace(path: str, num_workers: int, steps: int, *, segment_bytes: int | None = None) -> Trace:
    """Reads a trace from a run directory (or a trace.npz file), checking it fits this run.

    Returns the packed ``up`` and ``down`` rows ([rounds, S * ceil(W*W/8)] uint8, see
    ``shaky.network.model.MaskLog``) and their layout (:class:`Trace`). With ``segment_bytes`` (this run's
    ``network.segment_bytes``), the trace must have been recorded with it.
    """
    import numpy as np  # noqa: PLC0415

    p = Path(path)
    f = p / TRACE_FILE if p.is_dir() else p
    try:
        with np.load(f) as z:
            up, down, w = z["up"], z["down"], int(z["num_workers"])
            num_segments = int(z["num_segments"]) if "num_segments" in z else 1
            recorded_bytes = int(z["segment_bytes"]) if "segment_bytes" in z else 0
            by_block = int(z["by_block"]) if "by_block" in z else 0
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise ValueError(f"network.trace: cannot read a trace from {path!r} ({exc})") from None
    if w != num_workers:
        raise ValueError(f"network.trace {path!r} was recorded with {w} workers, but num_workers is {num_workers}")
    if up.shape[0] < steps:
        raise ValueError(f"network.trace {path!r} holds {up.shape[0]} rounds, fewer than steps = {steps}")
    width = num_segments * ((w * w + 7) // 8)
    if num_segments < 1 or up.ndim != 2 or up.shape[1] != width or down.shape != up.shape:
        raise ValueError(f"network.trace {path!r}: up {list(up.shape)} and down {list(down.shape)} are not the "
                         f"packed masks of {w} workers and {num_segments} segments per block (rows of {width} bytes)")
    if segment_bytes is not None and segment_bytes != recorded_bytes:
        raise ValueError(f"network.trace {path!r} was recorded with network.segment_bytes = {recorded_bytes}, "
                         f"but network.segment_bytes is {segment_bytes}")
    if by_block not in (0, 1):
        raise ValueError(f"network.trace {path!r}: by_block must be 0 or 1, got {by_block}")
    return Trace(up, down, bool(by_block))


# ---------------------------------------------------------------------------------------------------------------
# Summary


@dataclass(frozen=True, kw_only=True, slots=True)
class Summary:
    """What ``summary.json`` holds: the run's final evaluation, its totals and what it was."""

    final_test_accuracy: float
    """Test accuracy of the average model at the last evaluation."""
    final_test_loss: float
    """Mean cross-entropy per test sample (next-token prediction: per token)."""
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
    """The configured drop rate, "matrix" for a per-link matrix, "trace" when the delivery masks were replayed
    from ``trace`` (network.drop_rate is then not what happened: see measured_drop_rate), or "real" on the udp
    transport, whose losses are the network's (measured_drop_rate counts them)."""
    num_parameters: int | None
    diverged: bool = False
    """The loss stopped being finite; the run ended there (a result, not a crash)."""
    error: str = ""
    """Why it ended early, in one line."""
    measured_drop_rate: float | None = None
    """The fraction of the messages sent that were lost (None when none were sent)."""
    trace: str = ""
    """The trace whose delivery masks were replayed (network.trace), as an absolute path; "" if none."""
    transport: str = ""
    """dist backend: the data plane (dist.transport, gloo or udp); "" on the simulator."""
    wait_s: float | None = None
    """Wall seconds rank 0 spent blocked waiting for exchanges still in flight (the dist backend; None on the
    simulator, whose exchanges are not waited for)."""
    sim_wait_s: float = 0.0
    """The simulated clock's prediction of the same: seconds a step waited for an exchange past its compute."""
    eval_time_s: float | None = None
    """Wall seconds of ``wall_time_s`` spent in evaluations, the last one's included (on the dist backend, their
    rounds of means, which first wait for every exchange still in flight); ``wall_time_s - eval_time_s`` is the
    time the steps took, which the simulated clock predicts. None in a summary written before shaky recorded it."""
    udp: dict[str, Any] | None = None
    """dist.transport udp: the datagrams of the run, every rank's summed (sent, received, the observed loss
    rate 1 - received / expected, late, rejected, phases closed by their deadline); None otherwise."""
    final_test_perplexity: float | None = None
    """Next-token prediction (a target per position, e.g. the bytes data set): exp(final_test_loss); None for a
    classifier."""
    versions: dict[str, str] | None = None
    """shaky, torch and Python of the process that wrote it (:func:`versions`; rank 0's on the dist backend);
    None in a summary written before shaky recorded them."""
    config_sha256: str | None = None
    """The digest of the config it is the result of, but the machine's own settings
    (``shaky.resumable.config_digest``): a sweep takes a run as finished only where it is its config.toml's; None
    in a summary written before shaky recorded it."""

    @staticmethod
    def from_run(cfg: RunConfig, last: dict[str, Any], counters: Counters, *, compute_ms: float,
                 num_parameters: int, diverged: bool = False, error: str = "",
                 udp: dict[str, Any] | None = None, config_sha256: str | None = None) -> Summary:
        """The summary of a run whose last evaluation is ``last`` (a metrics row) and whose totals are ``counters``
        (``config_sha256``: ``shaky.resumable.config_digest(cfg)``)."""
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
            drop_rate=("trace" if cfg.network.trace else "real" if udp else cfg.network.drop_rate
                       if isinstance(cfg.network.drop_rate, float) else "matrix"),
            num_parameters=num_parameters, diverged=diverged, error=error,
            measured_drop_rate=(counters.messages_dropped / counters.messages_sent if counters.messages_sent
                                else None),
            trace=str(Path(cfg.network.trace).resolve()) if cfg.network.trace else "",
            transport=cfg.dist.transport if cfg.backend == "dist" else "", udp=udp or None,
            wait_s=round(counters.wait_s, 6) if cfg.backend == "dist" else None,
            sim_wait_s=round(counters.sim_wait_s, 6), eval_time_s=round(counters.eval_s, 6),
            final_test_perplexity=last.get("test_perplexity"),
            versions=versions(), config_sha256=config_sha256)

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain values; a number that is not finite (a diverged run's loss) becomes None, since
        JSON has no NaN or infinity (``diverged`` and ``error`` say why)."""
        return {f.name: finite(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def write(self, run_dir: Path) -> None:
        write_json(run_dir / SUMMARY_FILE, self.to_dict())


def versions() -> dict[str, str]:
    """The versions of shaky, torch and Python here, from the installed packages' metadata (torch is not
    imported); "not installed" for a package that has none (shaky run from a source tree)."""
    import platform  # noqa: PLC0415
    from importlib import metadata  # noqa: PLC0415

    def installed(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return {"shaky": installed("shaky"), "torch": installed("torch"), "python": platform.python_version()}


def read_summary(run_dir: str | Path) -> dict[str, Any]:
    """A finished run's summary.json, a JSON object; ValueError naming the file when it is missing, unreadable,
    not JSON or not an object. NaN and infinity (which older versions wrote for a diverged run's loss) read as
    None, as written now."""
    path = Path(run_dir) / SUMMARY_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{path}: missing (the run has not finished)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot be read ({exc})") from None
    try:
        summary = json.loads(text, parse_constant=lambda _: None)
    except ValueError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc}); the file is damaged") from None
    if not isinstance(summary, dict):
        raise ValueError(f"{path}: not a run summary (a JSON object), got {type(summary).__name__}")
    return summary
