"""Tests for ``shaky report``: plots and tables from sweeps and runs, claim checks, and REPRODUCTION.md."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from shaky.claims import evaluate, names_in
from shaky.cli import main
from shaky.report import write_report
from shaky.sweep import load_sweep, parse_sweep, run_sweeps

ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

TINY = """
description = "Two strategies at two drop rates, two seeds: a tiny sweep for the report tests."
[labels]
"strategy.name" = { rps = "rps (models)" }
[base]
num_workers = 2
steps = 20
batch_size = 8
eval_every = 10
network = { compute_ms = 1.0, preset = "lossy" }
[grid]
"strategy.name" = ["rps", "lossy-allreduce"]
"network.drop_rate" = [0.0, 0.3]
seed = [0, 1]

[[claim]]
id = "same-at-zero"
title = "At drop 0 the two strategies are the same algorithm"
paper = "exact equivalence"
ours = "rps {r0:.2%}, lossy-allreduce {g0:.2%} (n = {r0_n:.0f})"
holds = ["abs(r0 - g0) < 1e-9", "r0_sd >= 0"]
[claim.values]
r0 = { where = { "strategy.name" = "rps", "network.drop_rate" = 0.0 } }
g0 = { where = { "strategy.name" = "lossy-allreduce", "network.drop_rate" = 0.0 } }

[[claim]]
id = "impossible"
title = "Drops cost rps more than 100 points"
paper = "nobody says this"
ours = "rps loses {loss:.2%}"
holds = ["loss > 1"]
[claim.values]
r0 = { where = { "strategy.name" = "rps", "network.drop_rate" = 0.0 } }
r3 = { metric = "final_test_accuracy", where = { "strategy.name" = "rps", "network.drop_rate" = 0.3 } }
loss = "r0 - r3"

[[plot]]
name = "final"
kind = "final"
title = "final accuracy"
x = "network.drop_rate"
lines = "strategy.name"

[[plot]]
name = "curves"
kind = "curves"
where = { "network.drop_rate" = 0.3 }
"""


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("report")
    (root / "tiny.toml").write_text(TINY)
    outcome = run_sweeps([load_sweep(root / "tiny.toml")], root / "sweeps", jobs=1, progress=False)
    assert outcome.ran == 8
    return root


def test_report_writes_plots_table_and_verdicts(swept: Path) -> None:
    out = swept / "report"
    result = write_report([swept / "sweeps" / "tiny"], out)
    names = sorted(p.name for p in result["plots"])
    assert names == ["tiny-curves.png", "tiny-final.png"]
    for png in result["plots"]:
        assert png.read_bytes().startswith(PNG_MAGIC) and png.stat().st_size < 150_000
    text = (out / "report.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| rps") or line.startswith("| lossy")]
    assert len(rows) == 4  # one per (strategy, drop rate), seeds averaged
    assert rows[0].split("|")[1].strip() == "rps (models)" and "2/2" in rows[0]
    assert "±" in rows[0]
    assert "![final accuracy](tiny-final.png)" in text
    same, impossible = result["verdicts"]
    assert same.holds is True and same.why == "" and "(n = 2)" in same.ours
    assert same.values["r0"] == same.values["g0"]
    assert impossible.holds is False
    assert impossible.why.startswith("`loss > 1` is false (loss = ")
    summaries = [json.loads(p.read_text())["final_test_accuracy"]
                 for p in (swept / "sweeps" / "tiny").glob("strategy.name=rps,network.drop_rate=0,seed=*/summary.json")]
    assert impossible.values["r0"] == pytest.approx(sum(summaries) / 2)


def test_reproduction_page_has_a_row_per_claim_and_links_that_resolve(swept: Path) -> None:
    page = swept / "REPRODUCTION.md"
    plots = swept / "docs" / "plots"
    assert main(["report", str(swept / "sweeps" / "tiny"), "--out", str(plots), "--reproduction", str(page)]) == 0
    text = page.read_text()
    assert "do not edit by hand" in text
    table = [line for line in text.splitlines() if line.startswith("| **")]
    assert len(table) == 2
    assert table[0].endswith("| holds |") and "exact equivalence" in table[0]
    assert "**does not hold**: `loss > 1` is false" in table[1]
    for target in [line.split("](")[1].rstrip(")") for line in text.splitlines() if line.startswith("![")]:
        assert (page.parent / target).is_file(), target
    assert "[tiny.toml](tiny.toml)" in table[0]  # the experiment file, relative to the page
    assert "Two strategies at two drop rates" in text


def test_report_on_plain_run_directories(swept: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = swept / "sweeps" / "tiny"
    one = next(p for p in runs.iterdir() if p.is_dir())
    out = swept / "plain"
    assert main(["report", str(one), "--out", str(out)]) == 0
    assert (out / "runs-curves.png").read_bytes().startswith(PNG_MAGIC)
    assert one.name in (out / "report.md").read_text()
    capsys.readouterr()


def test_report_refuses_what_is_not_a_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    for argv, message in ((["report", "nope"], "'nope' is not a directory"),
                          (["report", "empty"], "'empty' is neither a sweep directory")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def _tree(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes()) for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize(("damage", "file", "message"), [
    (lambda d: (d / "metrics.jsonl").unlink(), "metrics.jsonl", "missing"),
    (lambda d: (d / "metrics.jsonl").write_text('{"step": 0}\n'), "metrics.jsonl", "test_accuracy is missing"),
    (lambda d: (d / "metrics.jsonl").write_text("{not json\n"), "metrics.jsonl", "line 1: not a metrics row"),
    (lambda d: (d / "summary.json").write_text('{"final_test_accuracy": '), "summary.json", "not valid JSON"),
    (lambda d: (d / "summary.json").write_text("[1, 2]"), "summary.json", "not a run summary"),
    (lambda d: (d / "summary.json").write_text("{}"), "summary.json", " is missing (the file is damaged"),
    (lambda d: (d / "summary.json").write_text(json.dumps({**json.loads((d / "summary.json").read_text()),
                                                          "final_test_accuracy": "high"})), "summary.json",
     "final_test_accuracy must be a number, got 'high'"),
], ids=["no-metrics", "metrics-row", "metrics-json", "summary-json", "summary-list", "summary-empty",
        "summary-type"])
@pytest.mark.parametrize("where", ["sweep", "run"])
def test_damaged_inputs_are_named_and_nothing_is_written(tmp_path: Path, swept: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str], damage: Any, file: str,
                                                          message: str, where: str) -> None:
    """Every input is read and checked before the first plot: a damaged file is named, and --out stays unwritten,
    whether it is the last run of a sweep (after plots of the others could have been drawn) or a plain run."""
    import shutil

    monkeypatch.chdir(tmp_path)
    shutil.copytree(swept / "sweeps" / "tiny", tmp_path / "tiny")
    run = sorted(p for p in (tmp_path / "tiny").iterdir() if p.is_dir())[-1]
    damage(run)
    before = _tree(tmp_path)
    target = Path("tiny") if where == "sweep" else run.relative_to(tmp_path)
    assert main(["report", str(target), "--out", "rep"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"{run.relative_to(tmp_path) / file}" in err and message in err, err
    assert _tree(tmp_path) == before


def test_missing_runs_are_not_measured(tmp_path: Path, swept: Path) -> None:
    import shutil

    copy = tmp_path / "tiny"
    shutil.copytree(swept / "sweeps" / "tiny", copy)
    (copy / "strategy.name=rps,network.drop_rate=0.3,seed=1" / "summary.json").unlink()
    result = write_report([copy], tmp_path / "out")
    assert result["missing"] == 1
    same, impossible = result["verdicts"]
    assert same.holds is True and impossible.holds is None and "1 of its runs are missing" in impossible.why


def test_expressions_allow_arithmetic_only() -> None:
    names = {"a": 2.0, "b": 0.5}
    assert evaluate("a * b + 1 - a / 4", names) == 1.5
    assert evaluate("a > b and not b > 1", names) is True
    assert evaluate("1 < a <= 2", names) is True
    assert evaluate("max(a, b, 3) + abs(-b)", names) == 3.5
    assert math.isnan(evaluate("0 / 0", {})) and evaluate("a / 0", names) == math.inf
    assert names_in("abs(a) - b", "x") == {"a", "b"}
    for bad in ("__import__('os')", "a.real", "[a]", "a if b else 1", "'text'", "open('f')"):
        with pytest.raises(ValueError, match="only numbers, names|not a valid expression"):
            evaluate(bad, names)
    with pytest.raises(ValueError, match="'c' is not defined"):
        evaluate("c + 1", names)


def _claim(**changes: Any) -> dict[str, Any]:
    claim = {"id": "c", "title": "t", "paper": "p", "ours": "{a:.1f}", "holds": ["a > 0"],
             "values": {"a": {"where": {"seed": 0}}}}
    claim.update(changes)
    return claim


@pytest.mark.parametrize("changes, message", [
    ({"holds": []}, "holds must be a non-empty list"),
    ({"holds": ["b > 0"]}, "uses 'b', which is not a value"),
    ({"ours": "{b}"}, "ours uses 'b'"),
    ({"values": {"a": {"where": {"sed": 0}}}}, "values.a.where: 'sed' is not a setting"),
    ({"values": {"a": {"metrc": "x"}}}, "values.a.metrc is not a value setting"),
    ({"values": {"a": "b + 1"}}, "'b' is not a run aggregate or an expression before it"),
    ({"values": {"a": {"metric": "final_test_accuracy.real"}}}, "only numbers, names"),
    ({"verdict": "holds"}, "claim[0].verdict is not a claim setting"),
    ({"title": ""}, "claim[0].title must be a non-empty string"),
])
def test_bad_claims_are_refused_naming_the_entry(changes: dict[str, Any], message: str) -> None:
    doc = {"base": {"steps": 5}, "grid": {"seed": [0, 1]}, "claim": [_claim(**changes)]}
    with pytest.raises(ValueError, match="s.toml: ") as info:
        parse_sweep(doc, "s", "s.toml")
    assert message in str(info.value), str(info.value)


def test_reproduction_from_a_real_experiment_file_on_tiny_runs(tmp_path: Path) -> None:
    """experiments/dts_delay.toml as written, but 30 steps and one seed: every claim gets a measured row."""
    sweep = load_sweep(ROOT / "experiments" / "dts_delay.toml", [("steps", 30), ("eval_every", 10), ("seed", 0)])
    assert len(sweep.points) == 8
    assert run_sweeps([sweep], tmp_path / "sweeps", jobs=1, progress=False).ran == 8
    page = tmp_path / "REPRODUCTION.md"
    result = write_report([tmp_path / "sweeps" / "dts_delay"], tmp_path / "docs", page)
    assert [v.holds in (True, False) for v in result["verdicts"]] == [True] * len(sweep.claims)
    rows = [line for line in page.read_text().splitlines() if line.startswith("| **")]
    assert len(rows) == len(sweep.claims) and all("%" in row for row in rows)
    assert (tmp_path / "docs" / "dts_delay-final.png").read_bytes().startswith(PNG_MAGIC)


def test_baseline_values_are_paired_by_seed(swept: Path) -> None:
    from shaky.claims import measure
    from shaky.report import SweepRuns

    runs = SweepRuns(swept / "sweeps" / "tiny")
    claim = {"id": "paired", "title": "t", "paper": "p", "ours": "{d:.4f}", "holds": ["d_n == 2"],
             "values": {"d": {"metric": "final_test_loss", "baseline": {"network.drop_rate": 0.0},
                              "where": {"strategy.name": "lossy-allreduce", "network.drop_rate": 0.3}}}}
    verdict = measure(claim, runs.pairs)
    root = swept / "sweeps" / "tiny"

    def loss(drop: str, seed: int) -> float:
        name = f"strategy.name=lossy-allreduce,network.drop_rate={drop},seed={seed}"
        return json.loads((root / name / "summary.json").read_text())["final_test_loss"]

    diffs = [loss("0.3", s) - loss("0", s) for s in (0, 1)]
    assert verdict.holds is True
    assert verdict.values["d"] == pytest.approx(sum(diffs) / 2)
    assert verdict.values["d_sd"] == pytest.approx(abs(diffs[0] - diffs[1]) / math.sqrt(2))
    with pytest.raises(ValueError, match=r"baseline: network.drop_rate = 0.5 is not a value of the grid"):
        parse_sweep({**_tiny_doc(), "claim": [{**claim, "values": {"d": {"baseline": {"network.drop_rate": 0.5}}}}]},
                    "s", "s.toml")


def _tiny_doc() -> dict[str, Any]:
    import tomllib

    doc = tomllib.loads(TINY)
    doc.pop("claim")
    doc.pop("plot")
    return doc
