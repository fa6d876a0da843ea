"""Tests for ``shaky sweep``: grid expansion, validation, resume of a half-finished sweep, parallel runs,
and the paper-scale experiment files on tiny data."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shaky.cli import main
from shaky.config import config_from_dict
from shaky.data import synthetic_text
from shaky.inject import Fault, FaultInjector
from shaky.sweep import Task, execute, load_sweep, parse_sweep, point_name, run_sweeps
from shaky.train import prepare, train

from conftest import unmeasured

ROOT = Path(__file__).resolve().parent.parent
TINY_BASE = {"num_workers": 2, "steps": 20, "batch_size": 8, "eval_every": 10, "checkpoint_every": 10,
             "network": {"compute_ms": 1.0, "preset": "lossy"}}


def _sweep(grid: dict[str, Any], base: dict[str, Any] | None = None, **extra: Any):
    return parse_sweep({"base": base if base is not None else TINY_BASE, "grid": grid, **extra}, "tiny", "tiny.toml")


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_grid_is_the_product_of_its_axes_over_the_base() -> None:
    sweep = _sweep({"strategy.name": ["rps", "lossy-allreduce"], "network.drop_rate": [0.0, 0.1, 0.3],
                    "seed": [0, 1]})
    assert len(sweep.points) == 12
    names = [p.name for p in sweep.points]
    assert names[:3] == ["strategy.name=rps,network.drop_rate=0,seed=0", "strategy.name=rps,network.drop_rate=0,seed=1",
                         "strategy.name=rps,network.drop_rate=0.1,seed=0"]
    assert len(set(names)) == 12
    p = sweep.points[-1]
    assert p.params == {"strategy.name": "lossy-allreduce", "network.drop_rate": 0.3, "seed": 1}
    # The base survives where the grid does not reach, the preset fills the rest, the grid wins.
    assert p.values["steps"] == 20 and p.values["num_workers"] == 2
    assert p.values["network"]["drop_rate"] == 0.3 and p.values["network"]["latency_ms"] == 0.5
    assert p.values["strategy"]["name"] == "lossy-allreduce" and p.values["seed"] == 1
    assert config_from_dict(p.values).network.drop_rate == 0.3


def test_table_valued_axis_merges_into_the_base_table() -> None:
    base = {**TINY_BASE, "strategy": {"name": "dts", "period": 2}}
    sweep = _sweep({"strategy": [{"delay": 1}, {"delay": 4, "correction": False}]}, base)
    picked = [{k: p.values["strategy"][k] for k in ("name", "period", "delay", "correction")} for p in sweep.points]
    assert picked == [{"name": "dts", "period": 2, "delay": 1, "correction": True},
                      {"name": "dts", "period": 2, "delay": 4, "correction": False}]
    assert [p.name for p in sweep.points] == ["strategy=delay-1", "strategy=delay-4+correction-false"]
    # A nested [grid.network] table reads as dotted keys.
    nested = _sweep({"network": {"drop_rate": [0.0, 0.2]}})
    assert [p.params for p in nested.points] == [{"network.drop_rate": 0.0}, {"network.drop_rate": 0.2}]


def test_overrides_narrow_an_axis_or_set_the_base() -> None:
    sweep = parse_sweep({"base": TINY_BASE, "grid": {"seed": [0, 1, 2], "network.drop_rate": [0.0, 0.1]}},
                        "tiny", "tiny.toml", [("seed", 1), ("steps", 7)])
    assert [p.params for p in sweep.points] == [{"seed": 1, "network.drop_rate": 0.0}, {"seed": 1, "network.drop_rate": 0.1}]
    assert all(p.values["steps"] == 7 for p in sweep.points)


def test_long_names_stay_short_and_distinct() -> None:
    a = point_name({"failures": [{"worker": w, "step": 5} for w in range(12)]})
    b = point_name({"failures": [{"worker": w, "step": 6} for w in range(12)]})
    assert len(a) <= 120 and a != b
    assert point_name({"data.path": "a/b c"}) == "data.path=a_b_c"


BAD_SWEEPS = [
    ('[grid]\n"strategy.nme" = ["rps"]\n', "grid key 'strategy.nme' is not a setting"),
    ('[grid]\nnum_wokers = [2]\n', "grid key 'num_wokers' is not a setting"),
    ('[base]\nsteps = 5\n[grid]\n', "grid is empty"),
    ('[base]\nsteps = 5\n', "grid is missing"),
    ('[grid]\nseed = 3\n', "grid value of 'seed' must be a list of values, got 3"),
    ('[grid]\nseed = []\n', "grid value of 'seed' is an empty list"),
    ('[grid]\n"network.drop_rate" = [0.1, 1.5]\n', "run network.drop_rate=1.5: network.drop_rate must be in [0, 1), got 1.5"),
    ('[base]\nstepz = 5\n[grid]\nseed = [0]\n', "stepz is not a setting"),
    ('grdi = 1\n[grid]\nseed = [0]\n', "grdi is not a sweep setting"),
    ('kind = "trian"\n[grid]\nseed = [0]\n', "kind must be one of train, scale; got 'trian'"),
    ('[grid]\nseed = [0]\n[[claim]]\nid = "x"\ntitle = "t"\npaper = "p"\nours = "{a}"\nholds = ["a > 0"]\n'
     '[claim.values]\na = { where = { seed = 5 } }\n', "values.a.where = {'seed': 5} matches no run of the grid"),
    ('[grid]\nseed = [0]\n[[plot]]\nkind = "final"\nx = "steps"\n', "plot[0].x must be a grid key"),
    ('[grid]\nseed = [0]\n[labels]\nsteps = { "1" = "one" }\n', "labels.steps: 'steps' is not a grid key"),
]


@pytest.mark.parametrize("text, message", BAD_SWEEPS)
def test_bad_sweep_files_exit_2_naming_the_field(text: str, message: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    path = _write(tmp_path / "bad.toml", text)
    assert main(["sweep", str(path), "--out", "sweeps"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("shaky: error: ") and message in err, err
    assert str(path) in err  # the line names the file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.toml"]  # nothing written


def test_cli_refuses_bad_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    good = _write(tmp_path / "good.toml", "[grid]\nseed = [0]\n")
    for argv, message in ((["sweep", str(good), "--jobs", "0"], "--jobs must be >= 1, got 0"),
                          (["sweep", str(good), "--set", "nope"], "--set expects KEY=VALUE, got 'nope'"),
                          (["sweep", str(good), "--set", "stepz=3"], "--set stepz: not a setting"),
                          (["sweep", str(tmp_path / "missing.toml")], "cannot be read"),
                          (["sweep", str(good), str(good)], "two sweep files are named 'good'")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and message in err, (argv, err)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("axis, value, message", [
    ("num_workers", 5000, "num_workers (5000)"),                  # more workers than samples: empty shards
    ("model.name", "lstm", "lstm"),                                # a text model on digits
    ("data.dataset", "text", "data.path"),                         # the text data set without its file
    ("network.trace", "no/such/run", "network.trace"),             # a trace that is not there
])
def test_a_sweep_checks_every_runs_full_setup_before_writing(axis: str, value: Any, message: str, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """One bad point among good ones: the sweep stops before anything is written, naming that run."""
    monkeypatch.chdir(tmp_path)
    grid = f'"{axis}" = [' + (f"{value}" if isinstance(value, int) else f'"{value}"') + "]\nseed = [0, 1]\n"
    path = _write(tmp_path / "mixed.toml", "[base]\nsteps = 5\nnum_workers = 2\nbatch_size = 8\n[grid]\n" + grid)
    assert main(["sweep", str(path), "--out", "sweeps", "--jobs", "1"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("shaky: error: ") and "mixed" in err and "seed=0" in err and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mixed.toml"]  # nothing written


class Counting:
    """A runner that records what it ran (the sweep's own ``execute`` does the work)."""

    def __init__(self) -> None:
        self.ran: list[tuple[str, bool]] = []

    def __call__(self, task: Task) -> dict[str, Any]:
        self.ran.append((task.name, task.resume))
        return execute(task)


def _summaries(root: Path) -> dict[str, dict[str, Any]]:
    return {p.parent.name: unmeasured(json.loads(p.read_text()))
            for p in sorted(root.glob("*/summary.json"))}


def test_an_interrupted_sweep_resumes_only_what_is_unfinished(tmp_path: Path) -> None:
    sweep = _sweep({"strategy.name": ["rps", "lossy-allreduce"], "network.drop_rate": [0.0, 0.3]})
    out = tmp_path / "sweeps"
    first = Counting()
    outcome = run_sweeps([sweep], out, jobs=1, progress=False, runner=first)
    assert outcome.ran == 4 and outcome.skipped == 0 and not outcome.failed
    assert len(first.ran) == 4 and (out / "tiny" / "sweep.toml").is_file()
    root = out / "tiny"
    before = _summaries(root)
    mtimes = {name: (root / name / "summary.json").stat().st_mtime_ns for name in before}
    a, b, c, _ = (p.name for p in sweep.points)
    # a: killed after its last checkpoint, before the summary (resumed from the checkpoint).
    (root / a / "summary.json").unlink()
    # b: killed mid-run by an injected fault after step 10: a checkpoint at step 10, metrics past it.
    shutil.rmtree(root / b)
    with pytest.raises(Exception, match="injected fault"):
        train(prepare(config_from_dict(sweep.points[1].values)), root / b, progress=False, faults=FaultInjector((Fault("stop", 10),)))
    (root / b / "checkpoint.pt").unlink()  # ... and even that checkpoint lost: run again from scratch
    # c: killed at step 10 with its checkpoint: resumed, and bit-identical to the uninterrupted run.
    shutil.rmtree(root / c)
    with pytest.raises(Exception, match="injected fault"):
        train(prepare(config_from_dict(sweep.points[2].values)), root / c, progress=False, faults=FaultInjector((Fault("stop", 10),)))
    assert not (root / c / "summary.json").exists()

    second = Counting()
    outcome = run_sweeps([sweep], out, jobs=1, progress=False, runner=second)
    assert outcome.ran == 3 and outcome.skipped == 1
    assert sorted(second.ran) == sorted([(a, True), (b, False), (c, True)])
    assert _summaries(root) == before  # the same numbers as the sweep that was never interrupted
    untouched = [n for n in before if n not in (a, b, c)]
    assert all((root / n / "summary.json").stat().st_mtime_ns == mtimes[n] for n in untouched)

    third = Counting()
    assert run_sweeps([sweep], out, jobs=1, progress=False, runner=third).skipped == 4 and third.ran == []


def test_run_directories_of_another_config_or_with_stray_files_are_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    path = _write(tmp_path / "s.toml", "[base]\nnum_workers = 2\nsteps = 4\nbatch_size = 4\neval_every = 2\n"
                  "network = { compute_ms = 1.0 }\n[grid]\nseed = [0]\n")
    assert main(["sweep", str(path), "--out", "sw", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["sweep", str(path), "--out", "sw", "--set", "steps=6"]) == 2
    err = capsys.readouterr().err
    assert "holds a run of another config (steps = 4 there, 6 in the sweep)" in err, err
    run_dir = tmp_path / "sw" / "s" / "seed=0"
    (run_dir / "summary.json").unlink()
    (run_dir / "checkpoint.pt").unlink()
    (run_dir / "notes.txt").write_text("mine")
    assert main(["sweep", str(path), "--out", "sw"]) == 2
    assert "holds 'notes.txt', which a run never writes" in capsys.readouterr().err
    assert (run_dir / "notes.txt").read_text() == "mine"


def test_a_finished_run_on_data_that_changed_since_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A sweep takes a finished run as done only if its data is what the run trained on: the text at data.path
    edited since gives one line, status 2, and the run is left as it was."""
    monkeypatch.chdir(tmp_path)
    text = tmp_path / "text.txt"
    text.write_text(synthetic_text(4000), encoding="ascii")
    path = _write(tmp_path / "s.toml", "[base]\nnum_workers = 2\nsteps = 2\nbatch_size = 4\neval_every = 1\n"
                  f'data = {{ dataset = "bytes", path = "{text}", max_len = 8 }}\nmodel = {{ name = "gpt" }}\n'
                  "network = { compute_ms = 1.0 }\n[grid]\nseed = [0]\n")
    assert main(["sweep", str(path), "--out", "sw", "--quiet"]) == 0
    run_dir = tmp_path / "sw" / "s" / "seed=0"
    summary = (run_dir / "summary.json").read_bytes()
    assert main(["sweep", str(path), "--out", "sw", "--quiet"]) == 0          # the same text: finished
    assert (run_dir / "summary.json").read_bytes() == summary
    capsys.readouterr()
    text.write_text(synthetic_text(4000)[::-1], encoding="ascii")
    assert main(["sweep", str(path), "--out", "sw", "--quiet"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "finished on other bytes data than data.path" in err[0], err
    assert (run_dir / "summary.json").read_bytes() == summary


def test_parallel_processes_give_the_numbers_of_one_process(tmp_path: Path) -> None:
    sweep = _sweep({"strategy.name": ["rps", "lossy-allreduce"]}, {**TINY_BASE, "network": {"compute_ms": 1.0,
                   "drop_rate": 0.2}})
    inline = run_sweeps([sweep], tmp_path / "one", jobs=1, progress=False)
    pooled = run_sweeps([sweep], tmp_path / "two", jobs=2, progress=False)
    assert inline.ran == pooled.ran == 2 and not pooled.failed
    assert _summaries(tmp_path / "one" / "tiny") == _summaries(tmp_path / "two" / "tiny")
    pickle.dumps(Task("s", "n", "train", "d", sweep.points[0].values, False, 1.0))  # what crosses into a process


def test_a_run_that_diverges_is_a_finished_result(tmp_path: Path) -> None:
    sweep = _sweep({"optim.lr": [1e30]}, {**TINY_BASE, "eval_every": 2})
    outcome = run_sweeps([sweep], tmp_path, jobs=1, progress=False)
    assert outcome.ran == 1 and not outcome.failed
    summary = json.loads((tmp_path / "tiny" / sweep.points[0].name / "summary.json").read_text())
    assert summary["diverged"] is True and "diverged" in summary["error"]
    assert run_sweeps([sweep], tmp_path, jobs=1, progress=False).skipped == 1


def test_scale_sweeps_price_the_clock_alone(tmp_path: Path) -> None:
    from shaky import scale

    doc = {"kind": "scale", "base": {"num_workers": 8, "network": {"preset": "geo4", "compute_ms": 300.0},
                                     "scale": {"num_params": 1_000_000, "recommended": True}},
           "grid": {"strategy": [{"name": "allreduce"}, {"name": "dts"}], "scale.wan_latency_ms": [-1.0, 500.0]}}
    sweep = parse_sweep(doc, "sc", "sc.toml")
    run_sweeps([sweep], tmp_path, jobs=1, progress=False)
    got = {p.name: json.loads((tmp_path / "sc" / p.name / "summary.json").read_text()) for p in sweep.points}
    cfg = config_from_dict({"num_workers": 8, "network": {"preset": "geo4", "compute_ms": 300.0}})
    work = scale.Workload(1_000_000, 300.0)
    t = scale.recommended_period(cfg, work)
    dts = got["strategy=name-dts,scale.wan_latency_ms=500"]
    assert dts["delay"] == dts["period"] == t
    assert dts["scalability"] == scale.strategy_scalability("dts", cfg, work, period=t, delay=t, wan_latency_ms=500.0)
    ar = got["strategy=name-allreduce,scale.wan_latency_ms=-1"]
    assert ar["scalability"] == scale.strategy_scalability("allreduce", cfg, work, period=1, delay=1)
    with pytest.raises(ValueError, match="strategy.name must be one of allreduce, local-sgd, dts in a scale sweep"):
        parse_sweep({**doc, "grid": {"strategy.name": ["rps"]}}, "sc", "sc.toml")
    with pytest.raises(ValueError, match="grid key 'scale.num_param' is not a setting"):
        parse_sweep({**doc, "grid": {"scale.num_param": [3]}}, "sc", "sc.toml")
    with pytest.raises(ValueError, match="scale.num_param is not a setting"):
        parse_sweep({**doc, "base": {**doc["base"], "scale": {"num_param": 3}}}, "sc", "sc.toml")
    with pytest.raises(ValueError, match="network.compute_ms must be > 0 in a scale sweep"):
        parse_sweep({**doc, "base": {**doc["base"], "network": {"preset": "geo4"}}}, "sc", "sc.toml")


def test_every_experiment_file_is_a_valid_sweep() -> None:
    files = sorted((ROOT / "experiments").glob("**/*.toml"))
    assert len(files) >= 8
    for path in files:
        sweep = load_sweep(path)
        assert sweep.description.strip() and sweep.points, path
        assert sweep.claims, path


def _tiny_cifar(root: Path) -> Path:
    rng = np.random.default_rng(0)
    root.mkdir()
    for name, n in (("data_batch_1", 32), ("test_batch", 8)):  # 2 images for each of 16 workers (batch 2)
        with open(root / name, "wb") as f:
            pickle.dump({b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                         b"labels": [int(i) for i in rng.integers(0, 10, n)]}, f)
    return root


def _tiny_text(path: Path) -> Path:
    words = ["flights", "from", "boston", "to", "denver", "fare", "cheapest", "ticket", "ground", "service"]
    rng = np.random.default_rng(0)
    lines = [f"{label}\t{' '.join(rng.choice(words, 6))}" for label in ["atis_flight", "atis_airfare"] * 20]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("name, data", [("rps_resnet110_cifar10", "cifar"), ("rps_lstm_atis", "text")])
def test_paper_scale_configs_run_on_tiny_data(name: str, data: str, tmp_path: Path) -> None:
    """The paper-scale sweeps, unchanged but for the data path, a few steps, tiny batches and one grid point.

    ResNet-110 keeps its depth and its 16 workers: one step with 2 images per worker (about 10 s on 2 cores).
    """
    path = _tiny_cifar(tmp_path / "cifar") if data == "cifar" else _tiny_text(tmp_path / "atis.tsv")
    overrides = [("data.path", str(path)), ("steps", 1), ("batch_size", 2), ("eval_every", 1),
                 ("checkpoint_every", 1), ("network.compute_ms", 1.0), ("optim.warmup_steps", 0),
                 ("optim.decay_steps", [1]), ("strategy.name", "rps"), ("network.drop_rate", 0.3), ("seed", 0)]
    sweep = load_sweep(ROOT / "experiments" / "paper" / f"{name}.toml", overrides)
    assert len(sweep.points) == 1
    outcome = run_sweeps([sweep], tmp_path / "sweeps", jobs=1, progress=False)
    assert outcome.ran == 1 and not outcome.failed, outcome.failed
    summary = json.loads((tmp_path / "sweeps" / name / sweep.points[0].name / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["model"] == ("resnet110" if data == "cifar" else "lstm")
    assert summary["num_workers"] == (16 if data == "cifar" else 8)
    assert 0.0 <= summary["final_test_accuracy"] <= 1.0


GPT_EXPERIMENTS = ("gpt_drop_rate", "gpt_diloco")


def test_the_gpt_experiments_read_the_text_make_reproduce_writes() -> None:
    """experiments/gpt_*.toml read the file the Makefile writes from synthetic_text and checks against a SHA-256
    (so that no download is needed, and kept runs are never mixed with runs on other text): the path, size and
    digest are the Makefile's in every run and in each description, and synthetic_text's."""
    var = dict(re.findall(r"^(SYNTHETIC_\w+) := (\S+)$", (ROOT / "Makefile").read_text(), re.M))
    size, digest = int(var["SYNTHETIC_BYTES"]), var["SYNTHETIC_SHA256"]
    assert hashlib.sha256(synthetic_text(size).encode("ascii")).hexdigest() == digest
    for name in GPT_EXPERIMENTS:
        sweep = load_sweep(ROOT / "experiments" / f"{name}.toml")
        assert {p.values["data"]["path"] for p in sweep.points} == {var["SYNTHETIC_TEXT"]}, name
        description = " ".join(sweep.description.split())
        assert f"{var['SYNTHETIC_TEXT']}, the first {size:,} bytes" in description, name
        assert f"SHA-256 {digest}" in description, name


@pytest.mark.parametrize("name", GPT_EXPERIMENTS)
def test_gpt_experiments_run_on_tiny_text(name: str, tmp_path: Path) -> None:
    """The gpt sweeps as written but for the text (20 kB of synthetic_text), 2 steps and one seed."""
    path = tmp_path / "text.txt"
    path.write_text(synthetic_text(20_000), encoding="ascii")
    overrides = [("data.path", str(path)), ("steps", 2), ("eval_every", 1), ("seed", 0)]
    sweep = load_sweep(ROOT / "experiments" / f"{name}.toml", overrides)
    outcome = run_sweeps([sweep], tmp_path / "sweeps", jobs=1, progress=False)
    assert outcome.ran == len(sweep.points) and not outcome.failed, outcome.failed
    for point in sweep.points:
        summary = json.loads((tmp_path / "sweeps" / name / point.name / "summary.json").read_text())
        assert (summary["model"], summary["dataset"], summary["num_workers"], summary["steps"]) == ("gpt", "bytes", 8, 2)
        assert math.isfinite(summary["final_test_perplexity"]) and not summary["diverged"]
    # Without the file's own table, a sweep of language-model runs shows the perplexity after the loss.
    from shaky.report import SweepRuns, sweep_table  # noqa: PLC0415

    runs = SweepRuns(tmp_path / "sweeps" / name)
    runs.sweep = dataclasses.replace(runs.sweep, table=())
    header = [cell.strip() for cell in sweep_table(runs).splitlines()[0].strip("|").split("|")]
    assert header[header.index("test loss") + 1] == "perplexity", header
