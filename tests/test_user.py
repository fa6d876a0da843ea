"""Your own model and data in the simulator: ``shaky.simulate``, and factories named on the command line.

The model and the data set are defined here, in the test file (a network shaky has never seen: two layers with
a skip connection and LayerNorm; Gaussian blobs). The command-line tests load this very file (a copy of it) as
the factories' file, so the model is the same one either way.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import shaky
from shaky.inject import Fault, FaultInjector, InterruptedRun
from shaky.rundir import load_checkpoint, read_metrics

from conftest import unmeasured

NUM_FEATURES = 8
NUM_CLASSES = 3


class SkipNet(nn.Module):
    """Two layers with a skip connection around the second, and LayerNorm before it."""

    def __init__(self, features: int, classes: int, width: int = 24) -> None:
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.norm = nn.LayerNorm(width)
        self.hidden = nn.Linear(width, width)
        self.out = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x.flatten(1)))
        h = h + torch.tanh(self.hidden(self.norm(h)))
        return self.out(h)


def skip_net(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The model factory: ``factory(input_shape, num_classes)``."""
    return SkipNet(math.prod(input_shape), num_classes)


def blobs() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The data factory: three Gaussian blobs in 8 dimensions, 480 samples to train on and 120 to test."""
    gen = torch.Generator().manual_seed(7)
    centres = 2.0 * torch.randn(NUM_CLASSES, NUM_FEATURES, generator=gen)
    y = torch.randint(0, NUM_CLASSES, (600,), generator=gen)
    x = centres[y] + 1.5 * torch.randn(600, NUM_FEATURES, generator=gen)
    return (x[:480], y[:480]), (x[480:], y[480:])


class WithBatchNorm(nn.Module):
    def __init__(self, features: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(features, classes)
        self.bn = nn.BatchNorm1d(classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x.flatten(1)))


def bn_net(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return WithBatchNorm(math.prod(input_shape), num_classes)


class Branches(nn.Module):
    """Control flow on a tensor's value, which vmap cannot batch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(NUM_FEATURES, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(x)
        return out if out.sum() > 0 else -out


def cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy written out by hand: the default loss, as a user's own (``model.loss``)."""
    return torch.logsumexp(logits, dim=-1) - logits.gather(-1, y[:, None])[:, 0]


def smoothed(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Label smoothing 0.2: another loss, for the loss factory on the command line."""
    return torch.nn.functional.cross_entropy(logits, y, reduction="none", label_smoothing=0.2)


def mean_only(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A loss reduced to its mean: it cannot weigh the samples of a worker's batch."""
    return torch.nn.functional.cross_entropy(logits, y)


CONFIG: dict[str, Any] = {"num_workers": 4, "steps": 40, "batch_size": 8, "eval_every": 20,
                          "network": {"compute_ms": 1.0}}


def config(**changes: Any) -> dict[str, Any]:
    values = json.loads(json.dumps(CONFIG))
    for key, value in changes.items():
        values[key] = {**values.get(key, {}), **value} if isinstance(value, dict) else value
    return values


def model(seed: int = 0) -> nn.Module:
    """The model as the factory makes it for a run of seed ``seed`` (the run seeds torch's generator)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return skip_net((NUM_FEATURES,), NUM_CLASSES)


def no_wall_time(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [unmeasured(r) for r in rows]


def test_own_model_trains_with_rps_at_drop_0_1_and_with_allreduce(tmp_path: Path) -> None:
    """Through the Python entry point, with the training split as a torch Dataset: rps loses messages and still
    learns, allreduce learns; the model given is left as it was."""
    (x, y), test = blobs()
    given = model()
    before = [p.detach().clone() for p in given.parameters()]
    rps = shaky.simulate(given, TensorDataset(x, y), test, config(strategy={"name": "rps"},
                                                                    network={"drop_rate": 0.1}),
                         out=tmp_path / "rps", progress=False)
    allreduce = shaky.simulate(given, TensorDataset(x, y), test, config(strategy={"name": "allreduce"}),
                               out=tmp_path / "allreduce", progress=False)
    assert rps["messages_dropped"] > 0 and allreduce["messages_dropped"] == 0
    for summary in (rps, allreduce):
        assert summary["final_test_accuracy"] > 0.8, summary      # chance: 1/3
        assert summary["model"] == "object:test_user.SkipNet" and summary["dataset"] == (
            "object:torch.utils.data.dataset.TensorDataset")
    assert all(torch.equal(a, b) for a, b in zip(before, given.parameters()))
    rows = read_metrics(tmp_path / "rps")
    assert [r["step"] for r in rows] == [0, 20, 40] and rows[-1]["test_loss"] < rows[0]["test_loss"]


def test_rps_at_drop_0_is_allreduce(tmp_path: Path) -> None:
    """The exact equivalence the maths promises, for a model shaky has never seen (float64)."""
    train, test = blobs()
    for name in ("rps", "allreduce"):
        shaky.simulate(model(), train, test, config(strategy={"name": name}, dtype="float64"),
                       out=tmp_path / name, progress=False)
    got, want = (load_checkpoint(tmp_path / n)["params"] for n in ("rps", "allreduce"))
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(read_metrics(tmp_path / "rps"), read_metrics(tmp_path / "allreduce")):
        assert math.isclose(a["test_loss"], b["test_loss"], rel_tol=1e-12)


def test_a_resume_is_bit_identical_and_needs_the_same_model(tmp_path: Path) -> None:
    train, test = blobs()
    cfg = config(network={"drop_rate": 0.2}, checkpoint_every=10)
    whole = shaky.simulate(model(), train, test, cfg, out=tmp_path / "whole", progress=False)
    with pytest.raises(InterruptedRun):
        shaky.simulate(model(), train, test, cfg, out=tmp_path / "crashed", progress=False,
                       faults=FaultInjector((Fault("stop", 25),)))
    with pytest.raises(ValueError, match=r"sha256.*give the model it started from"):
        shaky.simulate(model(seed=1), train, test, out=tmp_path / "crashed", resume=True, progress=False)
    resumed = shaky.simulate(model(), train, test, out=tmp_path / "crashed", resume=True, progress=False)
    assert unmeasured(resumed) == unmeasured(whole)
    assert no_wall_time(read_metrics(tmp_path / "crashed")) == no_wall_time(read_metrics(tmp_path / "whole"))
    assert torch.equal(load_checkpoint(tmp_path / "crashed")["params"], load_checkpoint(tmp_path / "whole")["params"])


def test_a_loss_of_your_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                            capsys: pytest.CaptureFixture[str]) -> None:
    """``loss=``: cross-entropy written by hand trains what the default trains (float64, 1e-12, on the generic
    path); another loss trains other numbers; config.toml records it; a resume needs the same loss; a loss that
    returns its mean is refused in one line before anything is written; ``--set model.loss=file.py:function``
    on the command line trains what the same function trains from Python."""
    train, test = blobs()
    cfg = config(dtype="float64", network={"drop_rate": 0.1}, checkpoint_every=10)
    default = shaky.simulate(model(), train, test, cfg, out=tmp_path / "default", progress=False)
    mine = shaky.simulate(model(), train, test, cfg, loss=cross_entropy, out=tmp_path / "mine", progress=False)
    torch.testing.assert_close(load_checkpoint(tmp_path / "mine")["params"],
                               load_checkpoint(tmp_path / "default")["params"], rtol=1e-12, atol=1e-12)
    assert math.isclose(mine["final_test_loss"], default["final_test_loss"], rel_tol=1e-12)
    saved = (tmp_path / "mine" / "config.toml").read_text()
    assert 'loss = "object:test_user.cross_entropy"' in saved and "loss_sha256" in saved
    assert "loss" not in (tmp_path / "default" / "config.toml").read_text()
    other = shaky.simulate(model(), train, test, cfg, loss=smoothed, out=tmp_path / "smoothed", progress=False)
    assert other["final_test_accuracy"] > 0.8 and not math.isclose(other["final_test_loss"], mine["final_test_loss"],
                                                                   rel_tol=1e-3)
    with pytest.raises(InterruptedRun):
        shaky.simulate(model(), train, test, cfg, loss=smoothed, out=tmp_path / "cut", progress=False,
                       faults=FaultInjector((Fault("stop", 25),)))
    for wrong, why in ((cross_entropy, "was trained with the loss object:test_user.smoothed"),
                       (None, "give it again")):
        with pytest.raises(ValueError, match=why):
            shaky.simulate(model(), train, test, loss=wrong, out=tmp_path / "cut", resume=True, progress=False)
    resumed = shaky.simulate(model(), train, test, loss=smoothed, out=tmp_path / "cut", resume=True, progress=False)
    assert resumed["final_test_loss"] == other["final_test_loss"]
    with pytest.raises(ValueError, match=r"returns \[\] for 2 samples; it must return each sample's loss") as exc:
        shaky.simulate(model(), train, test, cfg, loss=mean_only, out=tmp_path / "bad", progress=False)
    assert "\n" not in str(exc.value) and not (tmp_path / "bad").exists()

    from shaky.cli import main  # noqa: PLC0415

    monkeypatch.chdir(tmp_path)
    shutil.copy(__file__, tmp_path / "mine.py")
    args = ["train", "--model", "mine.py:skip_net", "--dataset", "mine.py:blobs", "--workers", "4", "--steps", "40",
            "--batch-size", "8", "--eval-every", "20", "--set", "network.compute_ms=1.0", "--set", "dtype=float64",
            "--set", "network.drop_rate=0.1", "--quiet"]
    assert main([*args, "--set", "model.loss=mine.py:smoothed", "--out", "cli"]) == 0
    py = shaky.simulate(model(), train, test, config(dtype="float64", network={"drop_rate": 0.1}), loss=smoothed,
                        out=tmp_path / "py", progress=False)
    assert read_metrics(tmp_path / "cli")[-1]["test_loss"] == py["final_test_loss"]
    capsys.readouterr()
    assert main([*args, "--set", "model.loss=mine.py:mean_only", "--out", "cli-bad"]) == 2
    assert "must return each sample's loss" in _one_error_line(capsys)
    assert not (tmp_path / "cli-bad").exists()


def test_a_factory_file_imports_a_module_beside_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``file.py:factory`` where the file imports a module of its own directory, as its author runs it."""
    from shaky.cli import main  # noqa: PLC0415

    (tmp_path / "nets").mkdir()
    shutil.copy(__file__, tmp_path / "nets" / "shaky_test_user_sibling.py")
    (tmp_path / "nets" / "factories.py").write_text("from shaky_test_user_sibling import blobs, skip_net\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert main(["train", "--model", "nets/factories.py:skip_net", "--dataset", "nets/factories.py:blobs",
                 "--workers", "2", "--steps", "4", "--batch-size", "8", "--eval-every", "4", "--set",
                 "network.compute_ms=1.0", "--quiet", "--out", "run"]) == 0
    assert (tmp_path / "run" / "summary.json").is_file()


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shaky: error: ") and "Traceback" not in err, err
    return lines[0]


def test_the_same_model_by_file_path_on_the_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """``--model file.py:factory --dataset file.py:factory`` trains what shaky.simulate trains, number for number;
    config.toml records the file's path and SHA-256, and once the file is edited ``--resume`` refuses in one line
    (status 2) and changes nothing."""
    from shaky.cli import main  # noqa: PLC0415

    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "mine.py"
    shutil.copy(__file__, mine)
    run = tmp_path / "cli"
    args = ["train", "--model", f"{mine}:skip_net", "--dataset", "mine.py:blobs", "--workers", "4", "--steps", "40",
            "--batch-size", "8", "--eval-every", "20", "--set", "network.compute_ms=1.0", "--quiet"]
    assert main([*args, "--out", str(run)]) == 0
    saved = (run / "config.toml").read_text()
    digest = hashlib.sha256(mine.read_bytes()).hexdigest()
    assert f'name = "{mine}:skip_net"' in saved and f'dataset = "{mine}:blobs"' in saved
    assert saved.count(f'sha256 = "{digest}"') == 2
    train, test = blobs()
    shaky.simulate(model(), train, test, config(), out=tmp_path / "py", progress=False)
    assert no_wall_time(read_metrics(run)) == no_wall_time(read_metrics(tmp_path / "py"))
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--quiet"]) == 0    # unchanged: the finished run's summary
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    with mine.open("a") as f:
        f.write("\n# edited\n")
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--quiet"]) == 2
    line = _one_error_line(capsys)
    # (the data factory's file is the model's: data.sha256 is found first)
    assert ".sha256 is" in line and str(mine) in line and "file changed" in line, line
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


def test_a_model_the_simulator_cannot_vectorize_is_refused_before_anything_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from shaky.cli import main  # noqa: PLC0415

    train, test = blobs()
    for bad, why in ((WithBatchNorm(NUM_FEATURES, NUM_CLASSES), r"buffers \(bn.running_mean.*GroupNorm or LayerNorm"),
                     (Branches(), r"cannot be vectorized .* by torch.func.vmap")):
        with pytest.raises(ValueError, match=why) as exc:
            shaky.simulate(bad, train, test, config(), out=tmp_path / "bad", progress=False)
        assert "\n" not in str(exc.value)
        assert not (tmp_path / "bad").exists()
    monkeypatch.chdir(tmp_path)
    shutil.copy(__file__, tmp_path / "mine.py")
    capsys.readouterr()
    assert main(["train", "--model", "mine.py:bn_net", "--dataset", "mine.py:blobs", "--steps", "5", "--quiet"]) == 2
    assert "BatchNorm" in _one_error_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.py"]


DIST_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
import shaky
from test_user import blobs, config, model
train, test = blobs()
shaky.simulate(model(), train, test, config(num_workers=2, backend="dist", network={{"drop_rate": 0.2}}),
               out={out!r}, progress=False)
"""


def test_simulate_on_the_dist_backend_equals_the_simulator(tmp_path: Path) -> None:
    """shaky.simulate in two gloo ranks that torchrun started trains what it trains in the simulator."""
    script = tmp_path / "ranks.py"
    out = tmp_path / "dist"
    script.write_text(DIST_SCRIPT.format(tests=str(Path(__file__).parent), out=str(out)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    train, test = blobs()
    shaky.simulate(model(), train, test, config(num_workers=2, network={"drop_rate": 0.2}), out=tmp_path / "sim",
                   progress=False)
    sim_rows, dist_rows = read_metrics(tmp_path / "sim"), read_metrics(out)
    assert len(sim_rows) == len(dist_rows) == 3 and sim_rows[-1]["messages_dropped"] > 0
    for s, d in zip(sim_rows, dist_rows):
        for key, value in s.items():
            if key != "wall_time_s" and isinstance(value, float):
                assert math.isclose(value, d[key], rel_tol=1e-5, abs_tol=1e-5), (s["step"], key, value, d[key])
            elif key != "wall_time_s":
                assert value == d[key], (s["step"], key)
    torch.testing.assert_close(load_checkpoint(out)["params"], load_checkpoint(tmp_path / "sim")["params"],
                               rtol=1e-5, atol=1e-5)
