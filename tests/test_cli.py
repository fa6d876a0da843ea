"""Tests for the command line (shaky.cli): one-line errors with exit status 2, and the run directory.

Bad input must print exactly one line to stderr, ``shaky: error: ...``, naming the
setting and the bad value; return 2; print no traceback; and leave the file
system as it was (no ``runs/``, no half-written run directory). Every test runs
with the working directory set to its own tmp_path, so a default ``runs/`` would
land there and be seen.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch

from shaky.cli import DEMO_RUNS, main
from shaky.config import config_from_dict, load_toml
from shaky.inject import InterruptedRun
from shaky.rundir import load_checkpoint

SUMMARY_KEYS = ("final_test_accuracy", "final_test_loss", "final_train_loss", "consensus_distance",
                "bytes_sent", "messages_dropped", "sim_time_s", "wall_time_s", "steps")
RUN_FILES = ("config.toml", "metrics.jsonl", "summary.json", "shards.json", "checkpoint.pt", "trace.npz",
             "machines.json")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None for directories)."""
    return {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes()) for p in sorted(root.rglob("*"))}


@pytest.fixture
def cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def bad_input(argv: list[str], capsys: pytest.CaptureFixture[str], root: Path) -> str:
    """Runs ``shaky`` on bad input, checks the error contract, and returns the one error line."""
    before = _snapshot(root)
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, (rc, out, err)
    assert "Traceback" not in err and "Traceback" not in out
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("shaky: error: "), err
    assert out == "", out
    assert not (root / "runs").exists()
    assert _snapshot(root) == before, "bad input changed the file system"
    return lines[0]


# ---------------------------------------------------------------------------
# Bad flags and settings


def test_unknown_dataset(cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    msg = bad_input(["train", "--dataset", "nope"], capsys, cwd)
    assert "data.dataset" in msg and "'nope'" in msg


@pytest.mark.parametrize("value", ["1.5", "-0.1", "1.0", "nan"])
def test_drop_rate_out_of_range(cwd: Path, capsys: pytest.CaptureFixture[str], value: str) -> None:
    msg = bad_input(["train", "--drop-rate", value], capsys, cwd)
    assert "network.drop_rate" in msg and "[0, 1)" in msg
    assert msg.endswith(f"got {float(value)!r}")


def test_more_workers_than_samples(cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    msg = bad_input(["train", "--dataset", "iris", "--workers", "500"], capsys, cwd)
    assert "num_workers" in msg and "500" in msg
    assert "120" in msg  # iris: 150 samples, 20% held out for testing


@pytest.mark.parametrize(("toml_text", "name"), [
    ("[network]\ndrop_rat = 0.1\n", "network.drop_rat"),
    ("stepz = 5\n", "stepz"),
    ("[optim]\nlearning_rate = 0.1\n", "optim.learning_rate"),
    ("[nonsense]\nx = 1\n", "nonsense"),
], ids=["section", "top-level", "optim", "unknown-section"])
def test_unknown_key_in_config_file(cwd: Path, capsys: pytest.CaptureFixture[str], toml_text: str,
                                    name: str) -> None:
    (cwd / "bad.toml").write_text(toml_text)
    msg = bad_input(["train", "--config", "bad.toml"], capsys, cwd)
    assert msg.startswith(f"shaky: error: {name} is not a setting"), msg


@pytest.mark.parametrize(("toml_text", "name", "value"), [
    ('steps = "many"\n', "steps", "'many'"),
    ("num_workers = 2.5\n", "num_workers", "2.5"),
    ("[optim]\nlr = true\n", "optim.lr", "True"),
    ('[network]\ndrop_rate = "high"\n', "network.drop_rate", "'high'"),
    ("network = 3\n", "network", "3"),
], ids=["str-for-int", "float-for-int", "bool-for-float", "str-for-float", "value-for-table"])
def test_wrong_type_in_config_file(cwd: Path, capsys: pytest.CaptureFixture[str], toml_text: str, name: str,
                                   value: str) -> None:
    (cwd / "bad.toml").write_text(toml_text)
    msg = bad_input(["train", "--config", "bad.toml"], capsys, cwd)
    assert msg.startswith(f"shaky: error: {name} must be"), msg
    assert msg.endswith(value), msg


def test_malformed_toml(cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (cwd / "broken.toml").write_text("steps = = 3\n[network\n")
    msg = bad_input(["train", "--config", "broken.toml"], capsys, cwd)
    assert "broken.toml" in msg and "not valid TOML" in msg and "line 1" in msg


def test_missing_config_file(cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    msg = bad_input(["train", "--config", "missing.toml"], capsys, cwd)
    assert "missing.toml" in msg and "cannot be read" in msg


def test_config_file_is_a_directory(cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (cwd / "cfgdir").mkdir()
    msg = bad_input(["train", "--config", "cfgdir"], capsys, cwd)
    assert "'cfgdir'" in msg and "cannot be read" in msg


def test_config_file_not_utf8_names_the_file(cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (cwd / "latin1.toml").write_bytes(b"\xff\xfesteps = 3\n")
    msg = bad_input(["train", "--config", "latin1.toml"], capsys, cwd)
    assert "latin1.toml" in msg


def test_cifar10_data_path_does_not_exist(cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = cwd / "does-not-exist"
    msg = bad_input(["train", "--dataset", "cifar10", "--data-path", str(missing)], capsys, cwd)
    assert "data.path" in msg and repr(str(missing)) in msg and "not a directory" in msg


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:x", "CUDA"])
def test_a_device_that_is_not_cpu_cuda_or_cuda_n_is_refused(device: str, cwd: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    msg = bad_input(["train", "--device", device], capsys, cwd)
    assert msg == f"shaky: error: device must be cpu, cuda or cuda:N (N a GPU's index); got {device!r}"


def test_a_cuda_device_this_machine_lacks_is_one_line(cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without CUDA, --device cuda says so; with it, a GPU index past the last one is named."""
    device = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"
    msg = bad_input(["train", "--device", device, "--steps", "2"], capsys, cwd)
    assert msg.startswith(f"shaky: error: device {device!r}: ")
    assert ("CUDA is not available here" in msg) != torch.cuda.is_available()


def test_cifar10_without_data_path(cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    msg = bad_input(["train", "--dataset", "cifar10"], capsys, cwd)
    assert "data.path" in msg and "cifar10" in msg and msg.endswith("got ''")


def test_cifar10_data_path_missing_batches(cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (cwd / "cifar").mkdir()
    (cwd / "cifar" / "data_batch_1").write_bytes(b"not a pickle")
    msg = bad_input(["train", "--dataset", "cifar10", "--data-path", "cifar"], capsys, cwd)
    assert f"data.path '{cwd / 'cifar'}'" in msg and "missing" in msg and "test_batch" in msg


@pytest.mark.parametrize(("flag", "name"), [("--strategy", "strategy.name"), ("--model", "model.name"),
                                            ("--partition", "data.partition"), ("--preset", "network.preset")])
def test_unknown_names(cwd: Path, capsys: pytest.CaptureFixture[str], flag: str, name: str) -> None:
    msg = bad_input(["train", flag, "bogus"], capsys, cwd)
    assert msg.startswith(f"shaky: error: {name} must be one of "), msg
    assert msg.endswith("'bogus'"), msg


@pytest.mark.parametrize("item", ["foo", "=3", ""])
def test_set_without_key_value(cwd: Path, capsys: pytest.CaptureFixture[str], item: str) -> None:
    msg = bad_input(["train", "--set", item], capsys, cwd)
    assert msg == f"shaky: error: --set expects KEY=VALUE, got {item!r}"


def test_set_unknown_setting(cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    msg = bad_input(["train", "--set", "network.nonexistent=1"], capsys, cwd)
    assert msg.startswith("shaky: error: network.nonexistent is not a setting"), msg


@pytest.mark.parametrize(("item", "expected"), [
    ("network.latency_ms=-5", "network.latency_ms must be in [0, inf), got -5.0"),
    ("optim.decay_steps=[30, 10]", "optim.decay_steps must be increasing positive steps, got [30, 10]"),
    ("network.drop_rate=[[0.1, 0.2], [0.3, 0.4]]", "network.drop_rate is a 2x2 matrix but num_workers is 8"),
    ("steps=1e3", "steps must be an integer, got 1000.0"),
    ("seed=-1", "seed must be in [0, 2**32); got -1"),
])
def test_set_bad_values(cwd: Path, capsys: pytest.CaptureFixture[str], item: str, expected: str) -> None:
    msg = bad_input(["train", "--set", item], capsys, cwd)
    assert msg == f"shaky: error: {expected}"


def test_set_into_a_value(cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (cwd / "c.toml").write_text("steps = 3\n")
    msg = bad_input(["train", "--config", "c.toml", "--set", "steps.x=1"], capsys, cwd)
    assert msg == "shaky: error: steps.x: steps is a value, not a table"


def test_out_existing_non_empty_directory(cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = cwd / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("precious\n")
    msg = bad_input(["train", "--steps", "2", "--out", str(out)], capsys, cwd)
    assert repr(str(out)) in msg and "not empty" in msg
    assert (out / "notes.txt").read_text() == "precious\n"
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_out_existing_empty_directory_kept_on_bad_input(cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (cwd / "empty").mkdir()
    bad_input(["train", "--dataset", "iris", "--workers", "500", "--out", "empty"], capsys, cwd)
    assert (cwd / "empty").is_dir()


def test_out_below_a_file(cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (cwd / "afile").write_text("x\n")
    msg = bad_input(["train", "--steps", "2", "--quiet", "--out", "afile/run"], capsys, cwd)
    assert "afile/run" in msg


def test_resume_of_a_run_stopped_before_its_first_checkpoint_starts_it_again(cwd: Path) -> None:
    d = cwd / "somedir"
    d.mkdir()
    (d / "config.toml").write_text("steps = 3\nnum_workers = 2\n[network]\ncompute_ms = 1.0\n")
    assert main(["train", "--resume", str(d), "--quiet"]) == 0
    assert json.loads((d / "summary.json").read_text())["steps"] == 3


@pytest.mark.parametrize("kind", ["missing", "empty", "config-and-other-files", "other-files"])
def test_resume_not_a_run(cwd: Path, capsys: pytest.CaptureFixture[str], kind: str) -> None:
    d = cwd / "somedir"
    if kind != "missing":
        d.mkdir()
    if kind == "config-and-other-files":
        (d / "config.toml").write_text("steps = 3\n")
    if kind in ("other-files", "config-and-other-files"):
        (d / "notes.txt").write_text("hello\n")
    msg = bad_input(["train", "--resume", str(d)], capsys, cwd)
    assert msg.startswith(f"shaky: error: resume: {str(d)!r}"), msg
    if kind == "config-and-other-files":
        assert msg.endswith("has no checkpoint.pt to resume from, and holds 'notes.txt', which a run never writes")
    else:
        assert msg.endswith("is not a run directory (no config.toml)")


def test_demo_bad_steps(cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    msg = bad_input(["demo", "--steps", "0", "--out", "demo"], capsys, cwd)
    assert msg == "shaky: error: --steps must be >= 1, got 0"
    msg = bad_input(["demo", "--steps", str(10**12), "--out", "demo"], capsys, cwd)
    assert msg.startswith("shaky: error: --steps 1000000000000: steps must be at most 1000000000"), msg


def test_demo_out_is_a_file(cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (cwd / "notes").write_text("precious\n")
    msg = bad_input(["demo", "--steps", "2", "--quiet", "--out", "notes"], capsys, cwd)
    assert msg.startswith("shaky: error: --out 'notes' is a file"), msg
    msg = bad_input(["demo", "--steps", "2", "--quiet", "--out", "notes/demo"], capsys, cwd)
    assert "'notes' is a file" in msg


# Row by row: inputs that once failed with a traceback or were silently accepted.


def test_model_that_cannot_read_the_data(cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (cwd / "t.tsv").write_text("".join(f"{'pos' if i % 2 else 'neg'}\tword{i} other\n" for i in range(40)))
    msg = bad_input(["train", "--dataset", "text", "--data-path", "t.tsv", "--model", "mlp", "--steps", "2"],
                    capsys, cwd)
    assert msg == "shaky: error: model.name 'mlp' reads features but data.dataset 'text' holds token ids; " \
                  "models for text: lstm"
    msg = bad_input(["train", "--dataset", "iris", "--model", "lstm"], capsys, cwd)
    assert "model.name 'lstm'" in msg and "'iris'" in msg


@pytest.mark.parametrize(("argv", "expected"), [
    (["--steps", "1000000000000000"], "steps must be at most 1000000000 (a billion), got 1000000000000000"),
    (["--set", "steps=1e15"], "steps must be an integer, got 1000000000000000.0"),
    (["--set", "steps=99999999999999999999999"], "steps must be at most 1000000000"),
    (["--set", "model.hidden=1000000000"], "model.hidden must be at most 8192"),
    (["--strategy", "dts", "--set", "strategy.delay=1000000000"], "strategy.delay must be at most 4096"),
])
def test_absurdly_large_values(cwd: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                               expected: str) -> None:
    assert expected in bad_input(["train", *argv], capsys, cwd)


def test_the_largest_steps_allocate_nothing_per_step() -> None:
    """Nothing a run builds before its first step grows with steps: the trace buffer, the failure schedule and
    the batch sampler at the last step of a run of MAX_STEPS steps."""
    import numpy as np

    from shaky.config import MAX_STEPS
    from shaky.network.faults import FailureSchedule
    from shaky.network.model import MaskLog
    from shaky.sampler import BatchSampler

    cfg = config_from_dict({"steps": MAX_STEPS, "failures": [{"worker": 0, "step": MAX_STEPS - 1}]})
    log = MaskLog(cfg.num_workers, cfg.steps)
    assert log.packed()["up"].base.nbytes <= 1 << 20
    members = FailureSchedule(cfg.failures, cfg.num_workers, cfg.steps)
    assert members.live(MAX_STEPS - 1).tolist() == [False] + [True] * 7
    shards = [np.arange(w * 100, (w + 1) * 100) for w in range(cfg.num_workers)]
    sampler = BatchSampler(shards, list(range(cfg.num_workers)), cfg.worker_batch_sizes(), cfg.seed)
    batch = sampler.indices(MAX_STEPS - 1)
    assert batch.shape == (8, 32) and all(set(row.tolist()) <= set(s.tolist()) for row, s in zip(batch, shards))


def test_batch_larger_than_a_shard(cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    msg = bad_input(["train", "--batch-size", "5000"], capsys, cwd)  # digits: 1437 samples over 8 workers
    assert msg.startswith("shaky: error: batch_size 5000 is larger than the smallest shard (179 samples"), msg
    msg = bad_input(["train", "--workers", "2", "--set", "batch_sizes=[8, 900]"], capsys, cwd)
    assert msg.startswith("shaky: error: batch_sizes[1] = 900 is larger than worker 1's shard"), msg


def test_data_path_for_a_dataset_that_reads_no_file(cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (cwd / "x.tsv").write_text("a\tb\n")
    msg = bad_input(["train", "--dataset", "digits", "--data-path", "x.tsv"], capsys, cwd)
    assert "data.path" in msg and "digits" in msg and f"'{cwd / 'x.tsv'}'" in msg


@pytest.mark.parametrize(("out", "expected"), [
    ("s.txt", "--out must name a .png file (the Markdown table goes beside it, as s.md), got 's.txt'"),
    ("plots", "--out must name a .png file"),
    ("/proc/shaky-test/s.png", "--out '/proc/shaky-test/s.png' cannot be written"),
    ("afile/s.png", "'afile' is a file"),
])
def test_scale_out(cwd: Path, capsys: pytest.CaptureFixture[str], out: str, expected: str) -> None:
    (cwd / "afile").write_text("x\n")
    assert expected in bad_input(["scale", "--latencies-ms", "0", "--worker-counts", "4", "--out", out], capsys, cwd)


def test_scale_absurd_periods(cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "--params must be in [1, 1e+12], got 1e+30" in bad_input(["scale", "--params", "1e30"], capsys, cwd)
    assert "--delay must be at most 1000" in bad_input(["scale", "--delay", "100000"], capsys, cwd)
    msg = bad_input(["scale", "--compute-ms", "1e-6"], capsys, cwd)  # the recommended t = d would be ~1e10
    assert "recommended t = d" in msg and "--compute-ms" in msg


def test_replayed_run_states_what_was_dropped(cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = ["train", "--steps", "10", "--workers", "2", "--dataset", "iris", "--model", "logreg", "--quiet"]
    assert main([*common, "--drop-rate", "0.3", "--out", "lossy"]) == 0
    assert main([*common, "--replay-trace", "lossy", "--out", "replay"]) == 0
    capsys.readouterr()
    summary = json.loads((cwd / "replay" / "summary.json").read_text())
    assert summary["messages_dropped"] > 0
    assert summary["drop_rate"] == "trace"  # not the config's 0.0, which did not decide what was lost
    assert summary["measured_drop_rate"] == summary["messages_dropped"] / summary["messages_sent"]
    assert summary["trace"] == str((cwd / "lossy").resolve())


def test_diverged_run_writes_valid_json_and_reports(cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["train", "--steps", "10", "--workers", "2", "--dataset", "iris", "--model", "mlp", "--lr", "1e38",
            "--eval-every", "5", "--quiet", "--out", "div"]
    assert main(argv) == 4  # a result, not bad input and not a crash (a launcher does not start it again)
    assert "diverged" in capsys.readouterr().err
    text = (cwd / "div" / "summary.json").read_text()
    summary = json.loads(text, parse_constant=lambda c: pytest.fail(f"summary.json holds {c}"))
    assert summary["diverged"] is True and summary["final_test_loss"] is None
    assert main(["report", "div", "--out", "rep"]) == 0
    assert "| div | " in (cwd / "rep" / "report.md").read_text().replace("  ", " ")


def test_subprocess_exit_status(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "shaky", "train", "--dataset", "nope"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("shaky: error: data.dataset") and "'nope'" in lines[0]
    assert proc.stdout == ""
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------
# A successful run and its directory

RUN_ARGS = ["train", "--steps", "20", "--eval-every", "10", "--workers", "4", "--quiet"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, str]:
    """One small run, shared by the tests below (they must not modify it)."""
    root = tmp_path_factory.mktemp("cli-run")
    d = root / "run"
    stdout = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(stdout):
        mp.chdir(root)
        rc = main([*RUN_ARGS, "--out", str(d)])
    return d, rc, stdout.getvalue()


def test_run_returns_zero_and_writes_files(finished_run: tuple[Path, int, str]) -> None:
    d, rc, out = finished_run
    assert rc == 0
    assert out == f"run directory: {d}\n"  # --quiet: no progress and no summary dump
    assert sorted(p.name for p in d.iterdir()) == sorted(RUN_FILES)  # no stray .tmp files
    assert not (d.parent / "runs").exists()


def test_run_metrics(finished_run: tuple[Path, int, str]) -> None:
    d, _, _ = finished_run
    rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 10, 20]
    assert rows[0]["train_loss"] is None and rows[0]["bytes_sent"] == 0
    assert all(0.0 <= r["test_accuracy"] <= 1.0 for r in rows)
    assert rows[1]["bytes_sent"] < rows[2]["bytes_sent"]


def test_run_summary(finished_run: tuple[Path, int, str]) -> None:
    d, _, _ = finished_run
    summary = json.loads((d / "summary.json").read_text())
    missing = [k for k in SUMMARY_KEYS if k not in summary]
    assert not missing
    assert summary["steps"] == 20 and summary["num_workers"] == 4
    last = json.loads((d / "metrics.jsonl").read_text().splitlines()[-1])
    assert summary["final_test_accuracy"] == last["test_accuracy"]
    assert summary["final_test_loss"] == last["test_loss"]
    assert summary["bytes_sent"] == last["bytes_sent"] > 0
    assert summary["messages_dropped"] == 0  # default drop_rate 0


def test_run_shards(finished_run: tuple[Path, int, str]) -> None:
    d, _, _ = finished_run
    shards = json.loads((d / "shards.json").read_text())
    assert [s["worker"] for s in shards] == [0, 1, 2, 3]
    sets = [set(s["indices"]) for s in shards]
    assert all(len(s) == e["num_samples"] == len(e["indices"]) == sum(e["class_counts"]) > 0
               for s, e in zip(sets, shards))
    union = set().union(*sets)
    assert len(union) == sum(len(s) for s in sets)  # pairwise disjoint
    assert union == set(range(len(union)))  # together they cover the training set


def test_run_checkpoint_and_trace(finished_run: tuple[Path, int, str]) -> None:
    d, _, _ = finished_run
    ckpt = load_checkpoint(d)
    assert ckpt["counters"]["step"] == 20
    assert ckpt["params"].shape[0] == 4
    with np.load(d / "trace.npz") as z:
        assert int(z["num_workers"]) == 4
        assert z["up"].shape[0] >= 20


def test_run_saved_config_equals_flags(finished_run: tuple[Path, int, str]) -> None:
    d, _, _ = finished_run
    saved = config_from_dict(load_toml(d / "config.toml"))
    expected = config_from_dict({"steps": 20, "eval_every": 10, "num_workers": 4})
    assert saved == expected
    assert tomllib.loads((d / "config.toml").read_text())["num_workers"] == 4


@pytest.mark.parametrize("extra", [["--steps", "30"], ["--out", "elsewhere"], ["--set", "steps=30"],
                                   ["--workers", "2"], ["--config", "c.toml"]])
def test_resume_with_extra_flag(finished_run: tuple[Path, int, str], cwd: Path,
                                capsys: pytest.CaptureFixture[str], extra: list[str]) -> None:
    d, _, _ = finished_run
    (cwd / "c.toml").write_text("steps = 30\n")
    before = _snapshot(d)
    msg = bad_input(["train", "--resume", str(d), *extra], capsys, cwd)
    flag = extra[0]
    assert msg.startswith("shaky: error: --resume") and f"; drop {flag}" in msg, msg
    assert msg.endswith("(only a machine's own settings may be given: --data-path, --replay-trace, --device, "
                        "--key-file, --set dist.ports=, --set dist.host=)"), msg
    assert _snapshot(d) == before


def test_a_resume_may_move_the_data_but_not_change_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """--data-path may be given with --resume (the data moved): the run goes on from its checkpoint to the
    uninterrupted run's bits, and config.toml names the new path for the next resume. A path that holds other
    data stops the resume with one line (status 2), and nothing is written."""
    from test_train import write_text_set

    data = write_text_set(tmp_path / "data.tsv")
    moved, other = tmp_path / "moved.tsv", tmp_path / "other.tsv"
    shutil.copy(data, moved)
    other.write_text(data.read_text().replace("\n", "\nneg\tan extra line\n", 1))
    args = ["train", "--dataset", "text", "--model", "lstm", "--batch-size", "8", "--workers", "2", "--steps", "20",
            "--eval-every", "10", "--checkpoint-every", "10", "--set", "model.hidden=16", "--set", "data.max_len=8",
            "--quiet", "--data-path", str(data)]
    assert main([*args, "--out", str(tmp_path / "whole")]) == 0
    monkeypatch.setenv("SHAKY_INJECT_FAULT", "stop:0:15")
    with pytest.raises(InterruptedRun):     # as a killed process: the checkpoint of step 10 is the last
        main([*args, "--out", str(tmp_path / "run")])
    monkeypatch.delenv("SHAKY_INJECT_FAULT")
    run = tmp_path / "run"
    capsys.readouterr()
    before = _snapshot(run)
    assert main(["train", "--resume", str(run), "--data-path", str(other), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"shaky: error: --resume {run}: its data.path '{other}' holds other text data than the run "
                          f"was trained on (sha256 "), err
    assert err.endswith(f" at '{data}'); a resume goes on with the same data\n"), err
    assert _snapshot(run) == before
    assert main(["train", "--resume", str(run), "--data-path", str(moved), "--quiet"]) == 0
    assert torch.equal(load_checkpoint(run)["params"], load_checkpoint(tmp_path / "whole")["params"])
    assert config_from_dict(load_toml(run / "config.toml")).data.path == str(moved)
    assert json.loads((run / "machines.json").read_text())["0"]["settings"]["data.path"] == str(moved)


def test_resume_with_a_damaged_machines_file_stops_with_one_line(finished_run: tuple[Path, int, str], tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "copy"
    shutil.copytree(finished_run[0], d)
    (d / "machines.json").write_text('{"0": {"settings": 1}}')
    before = _snapshot(d)
    assert main(["train", "--resume", str(d), "--quiet"]) == 2
    assert capsys.readouterr().err == f"shaky: error: resume: {d / 'machines.json'} is damaged (TypeError: " \
                                      "'int' object is not iterable)\n"
    assert _snapshot(d) == before


def test_resume_finished_run(finished_run: tuple[Path, int, str], tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "copy"
    shutil.copytree(finished_run[0], d)
    metrics = (d / "metrics.jsonl").read_text()
    assert main(["train", "--resume", str(d), "--quiet"]) == 0
    assert capsys.readouterr().err == ""
    assert (d / "metrics.jsonl").read_text() == metrics  # nothing repeated, nothing lost
    assert json.loads((d / "summary.json").read_text())["steps"] == 20


def test_flags_override_config_file(cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (cwd / "c.toml").write_text("steps = 7\nnum_workers = 2\n[network]\ncompute_ms = 1.0\n")
    d = cwd / "run"
    assert main(["train", "--config", "c.toml", "--steps", "5", "--eval-every", "100", "--quiet",
                 "--out", str(d)]) == 0
    assert capsys.readouterr().err == ""
    saved = config_from_dict(load_toml(d / "config.toml"))
    assert saved.steps == 5 and saved.num_workers == 2 and saved.network.compute_ms == 1.0
    assert json.loads((d / "summary.json").read_text())["steps"] == 5
    rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 5]


def test_default_out_directory(cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["train", "--steps", "1", "--workers", "2", "--quiet", "--set", "network.compute_ms=1"]
    assert main(argv) == 0
    assert main(argv) == 0  # a second run never overwrites the first
    out = capsys.readouterr().out.splitlines()
    first, second = Path("runs/digits-mlp-rps-w2-drop0-seed0"), Path("runs/digits-mlp-rps-w2-drop0-seed0-1")
    assert out == [f"run directory: {first}", f"run directory: {second}"]
    assert (cwd / first / "summary.json").is_file() and (cwd / second / "summary.json").is_file()


# ---------------------------------------------------------------------------
# shaky demo


def test_demo(cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The brief's three runs must be there; a later commit added a fourth (reliable allreduce at drop 0.1),
    # so the expected rows follow DEMO_RUNS in order.
    names = [name for name, _, _ in DEMO_RUNS]
    for required in ("allreduce, drop 0", "rps, drop 0.1", "lossy-allreduce, drop 0.1"):
        assert required in names
    out = cwd / "demo"
    assert main(["demo", "--steps", "20", "--quiet", "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    table = (out / "table.md").read_text()
    lines = table.splitlines()
    assert len(lines) == 2 + len(DEMO_RUNS)  # header, separator, one row per run
    assert lines[0].startswith("| run") and "final acc" in lines[0]
    assert set(lines[1]) <= {"|", "-"}
    assert all(line.startswith("|") and line.endswith("|") for line in lines)
    assert [line.split("|")[1].strip() for line in lines[2:]] == names
    assert table.strip() in stdout
    png = (out / "accuracy.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 1000
    run_dirs = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert run_dirs == sorted(f"{strategy}-drop{drop:g}" for _, strategy, drop in DEMO_RUNS)
    assert {"allreduce-drop0", "rps-drop0.1", "lossy-allreduce-drop0.1"} <= set(run_dirs)
    for name in run_dirs:
        summary = json.loads((out / name / "summary.json").read_text())
        assert summary["steps"] == 20 and summary["num_workers"] == 8
        assert (summary["messages_dropped"] == 0) == (name == "allreduce-drop0"), (name, summary)
        steps = [json.loads(r)["step"] for r in (out / name / "metrics.jsonl").read_text().splitlines()]
        assert steps == list(range(21))  # eval_every = steps // 20 = 1
    assert not (cwd / "runs").exists()


def test_versions_are_the_same_on_the_command_line_in_the_api_and_in_a_summary(tmp_path: Path) -> None:
    """``shaky --version`` prints the installed shaky, torch and Python in one line, status 0, without loading
    torch; ``shaky.__version__`` is that shaky, and a run's summary.json carries the same versions."""
    import platform  # noqa: PLC0415
    from importlib import metadata  # noqa: PLC0415

    import shaky  # noqa: PLC0415

    proc = subprocess.run([sys.executable, "-c", "import sys; from shaky.cli import main\n"
                           "try:\n    main(['--version'])\nexcept SystemExit as e:\n"
                           "    print('torch loaded' if 'torch' in sys.modules else 'no torch', e.code)"],
                          capture_output=True, text=True, timeout=60)
    expected = {"shaky": metadata.version("shaky"), "torch": metadata.version("torch"),
                "python": platform.python_version()}
    assert proc.stdout.splitlines() == [
        f"shaky {expected['shaky']} (torch {expected['torch']}, Python {expected['python']})", "no torch 0"], proc
    assert main(["train", "--workers", "2", "--steps", "4", "--eval-every", "2", "--quiet", "--out",
                 str(tmp_path / "run")]) == 0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["versions"] == expected
    assert shaky.__version__ == expected["shaky"]
