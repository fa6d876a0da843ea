"""Run directories as a hostile user meets them: two writers at once, damaged checkpoints, an edited config,
torn or damaged metrics. Each ends in one line and exit 2 with nothing overwritten, or in the right result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from shaky.cli import main
from shaky.rundir import CHECKPOINT_FILE, METRICS_FILE, claim_dir, load_checkpoint, read_metrics, release_dir

from conftest import unmeasured

ARGS = ["--workers", "4", "--steps", "40", "--eval-every", "10", "--checkpoint-every", "20", "--quiet",
        "--set", "network.compute_ms=1.0"]


def _errors(capsys) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("rundir") / "run"
    assert main(["train", *ARGS, "--out", str(run_dir)]) == 0
    return run_dir


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def _snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.mark.parametrize("damage,expected", [
    ("flip", "fails its checksum"),
    ("truncate", "fails its checksum"),
    ("empty", "not a shaky checkpoint"),
    ("foreign", "not a shaky checkpoint"),
])
def test_a_damaged_checkpoint_is_refused_in_one_line(damage: str, expected: str, finished: Path, tmp_path: Path,
                                                     capsys) -> None:
    run_dir = _copy(finished, tmp_path / "run")
    path = run_dir / CHECKPOINT_FILE
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    elif damage == "truncate":
        data = data[: len(data) - 100]
    elif damage == "empty":
        data = bytearray()
    else:
        buf = tmp_path / "other.pt"
        torch.save({"params": torch.zeros(3)}, buf)
        data = bytearray(buf.read_bytes())
    path.write_bytes(bytes(data))
    before = _snapshot(run_dir)
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir)]) == 2
    lines = _errors(capsys)
    assert len(lines) == 1 and expected in lines[0] and str(path) in lines[0], lines
    assert _snapshot(run_dir) == before  # nothing overwritten


def _rewrite_checkpoint(path: Path, edit) -> None:
    """The checkpoint with ``edit`` applied to its contents, and a checksum that holds (as if another run or
    another program had written it)."""
    from shaky.rundir import save_checkpoint  # noqa: PLC0415

    blob = load_checkpoint(path.parent)
    edit(blob)
    save_checkpoint(path.parent, blob)


@pytest.mark.parametrize("edit,expected", [
    ("step", "its counters say step 1000000000000, outside the run's 0..40"),
    ("negative", "its counters say step -1, outside the run's 0..40"),
    ("shape", "holds parameters [4, 7] torch.float32, but this run's model has [4, "),
    ("dtype", "torch.float64, but this run's model has"),
])
def test_a_checkpoint_that_is_not_this_run_s_is_refused_in_one_line(edit: str, expected: str, finished: Path,
                                                                    tmp_path: Path, capsys) -> None:
    """Its checksum holds, but its counters or parameters cannot be this run's: one line, status 2, nothing
    changed, and nothing sized by the numbers in it (step 10**12 made a resume allocate until it was killed)."""
    run_dir = _copy(finished, tmp_path / "run")
    path = run_dir / CHECKPOINT_FILE

    def change(blob: dict) -> None:
        if edit in ("step", "negative"):
            blob["counters"]["step"] = 10**12 if edit == "step" else -1
        elif edit == "shape":
            blob["params"] = torch.zeros(4, 7)
        else:
            blob["params"] = blob["params"].double()
    _rewrite_checkpoint(path, change)
    before = _snapshot(run_dir)
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir)]) == 2
    lines = _errors(capsys)
    assert len(lines) == 1 and expected in lines[0] and str(path) in lines[0], lines
    assert _snapshot(run_dir) == before


@pytest.mark.parametrize("key,value", [("num_workers", "8"), ("lr", "0.2")])
def test_resume_refuses_an_edited_config(key: str, value: str, finished: Path, tmp_path: Path, capsys) -> None:
    run_dir = _copy(finished, tmp_path / "run")
    text = (run_dir / "config.toml").read_text()
    lines = text.splitlines()
    index = next(i for i, line in enumerate(lines) if line.split("=")[0].strip() == key)
    lines[index] = f"{key} = {value}"
    (run_dir / "config.toml").write_text("\n".join(lines) + "\n")
    before = _snapshot(run_dir)
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir)]) == 2
    errors = _errors(capsys)
    assert len(errors) == 1 and f"{key} = {float(value) if key == 'lr' else int(value)!r}" in errors[0], errors
    assert "the checkpoint was trained with" in errors[0]
    assert _snapshot(run_dir) == before


def test_a_torn_last_metrics_line_is_trimmed_on_resume(tmp_path: Path, capsys) -> None:
    whole = tmp_path / "whole"
    assert main(["train", *ARGS, "--out", str(whole)]) == 0
    cut = tmp_path / "cut"
    env = {**os.environ, "SHAKY_INJECT_FAULT": "exit:0:30"}  # dies before step 30: checkpoint at 20, evals to 30
    proc = subprocess.run([sys.executable, "-m", "shaky", "train", *ARGS, "--out", str(cut)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 17, proc.stderr[-1500:]
    with open(cut / METRICS_FILE, "a") as f:  # what a process killed in the middle of a write leaves
        f.write('{"step": 40, "test_acc')
    assert main(["train", "--resume", str(cut)]) == 0
    strip = lambda rows: [unmeasured(r) for r in rows]  # noqa: E731
    assert strip(read_metrics(cut)) == strip(read_metrics(whole))
    assert torch.equal(load_checkpoint(cut)["params"], load_checkpoint(whole)["params"])


def test_a_damaged_metrics_line_is_named(finished: Path, tmp_path: Path, capsys) -> None:
    run_dir = _copy(finished, tmp_path / "run")
    lines = (run_dir / METRICS_FILE).read_text().splitlines()
    lines[1] = lines[1][:15]
    (run_dir / METRICS_FILE).write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=rf"{METRICS_FILE}, line 2: not a metrics row"):
        read_metrics(run_dir)
    capsys.readouterr()
    assert main(["report", str(run_dir), "--out", str(tmp_path / "report")]) == 2
    errors = _errors(capsys)
    assert len(errors) == 1 and "line 2" in errors[0], errors


def test_a_run_directory_has_one_writer(tmp_path: Path, capsys) -> None:
    """While one process holds a run directory, a second `shaky train` on it gets one line and exit 2."""
    run_dir = claim_dir(tmp_path / "busy", fresh=True)
    try:
        proc = subprocess.run([sys.executable, "-m", "shaky", "train", *ARGS, "--out", str(run_dir)],
                              capture_output=True, text=True, timeout=120)
    finally:
        release_dir(run_dir)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "in use by another shaky process" in lines[0], proc.stderr
    assert not any(run_dir.iterdir())  # nothing written into it


SWEEP = textwrap.dedent("""
    description = "two tiny runs"
    [base]
    num_workers = 2
    steps = 400
    eval_every = 100
    network = { compute_ms = 1.0 }
    [grid]
    seed = [0, 1]
    [[claim]]
    id = "any"
    title = "a run"
    paper = "-"
    ours = "{acc:.2f}"
    holds = ["acc > 0"]
    [claim.values]
    acc = { where = { seed = 0 } }
""")


def test_two_sweeps_cannot_share_a_directory(tmp_path: Path) -> None:
    """While a sweep holds its directory (here: this test process holds it, as a running sweep does), a second
    sweep into it is refused in one line, before it touches a run; once it is free, the sweep runs."""
    spec = tmp_path / "tiny.toml"
    spec.write_text(SWEEP)
    out = tmp_path / "sweeps"
    cmd = [sys.executable, "-m", "shaky", "sweep", str(spec), "--out", str(out), "--jobs", "1", "--quiet"]
    held = claim_dir(out / "tiny", fresh=True)
    try:
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    finally:
        release_dir(held)
    lines = [line for line in second.stderr.splitlines() if line.strip()]
    assert second.returncode == 2 and len(lines) == 1 and "in use by another shaky process" in lines[0], \
        second.stderr
    assert not any((out / "tiny").iterdir())
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-1500:]
    for run in (out / "tiny").iterdir():
        if run.is_dir():
            assert [r["step"] for r in read_metrics(run)] == [0, 100, 200, 300, 400], run
    assert json.loads((out / "tiny" / "seed=0" / "summary.json").read_text())["steps"] == 400


def _strict(text: str) -> object:
    """``text`` parsed as strict JSON: NaN, Infinity and -Infinity are not JSON (jq rejects them)."""
    def refuse(token: str) -> None:
        raise ValueError(f"not JSON: {token}")
    return json.loads(text, parse_constant=refuse)


def test_metrics_and_summaries_are_strict_json(tmp_path: Path) -> None:
    """A number that is not finite (a diverged loss; a step's seconds over a link of no bandwidth) is written as
    null, in lists and tables too; the row in memory keeps it (the loop's divergence check reads it there)."""
    from shaky.rundir import METRICS_FILE, append_metrics, read_metrics, truncate_metrics, write_json  # noqa: PLC0415

    row = {"step": 1, "test_loss": float("nan"), "sim_time_s": float("inf"),
           "worker_test_accuracy": [0.5, -float("inf")], "udp": {"grace_wait_s": float("nan"), "sent": 3}}
    append_metrics(tmp_path, row)
    append_metrics(tmp_path, {**row, "step": 2})
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert [_strict(line) for line in lines][0] == {"step": 1, "test_loss": None, "sim_time_s": None,
                                                    "worker_test_accuracy": [0.5, None],
                                                    "udp": {"grace_wait_s": None, "sent": 3}}
    assert row["test_loss"] != row["test_loss"]       # still NaN in memory
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    truncate_metrics(tmp_path, 1)                      # the rewrite a resume makes is strict too
    assert [_strict(line)["step"] for line in (tmp_path / METRICS_FILE).read_text().splitlines()] == [1]
    write_json(tmp_path / "summary.json", {"final_test_loss": float("nan"), "udp": {"x": float("inf")}})
    assert _strict((tmp_path / "summary.json").read_text()) == {"final_test_loss": None, "udp": {"x": None}}
