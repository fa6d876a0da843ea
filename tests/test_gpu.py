"""The equivalence tests on a CUDA device (``device = "cuda"``), skipped where there is none.

The tests the maths promises (rps at drop 0 equals allreduce, one worker equals
torch's SGD), a bit-identical resume, a replayed trace, a run that gives the same
numbers twice, a GPU run against the CPU run of the same config, and torchrun
ranks on the GPU (gloo's and udp's exchanges staged through pinned host memory).
``make test-gpu`` runs only these.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import conftest
import test_strategies
import test_train
from conftest import assert_same_run, make_config, run
from shaky.rundir import load_checkpoint
from shaky.train import prepare, read_metrics

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(autouse=True)
def on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every config the tests make runs on the GPU."""
    monkeypatch.setattr(conftest, "DEVICE", "cuda")


@pytest.mark.parametrize("workers", [1, 4, 8])
def test_rps_at_drop_zero_equals_allreduce_on_cuda(workers: int, tmp_run) -> None:
    test_strategies.test_rps_at_drop_zero_equals_allreduce(workers, tmp_run)


def test_lossy_allreduce_at_drop_zero_equals_allreduce_on_cuda(tmp_run) -> None:
    test_strategies.test_lossy_allreduce_at_drop_zero_equals_allreduce(tmp_run)


@pytest.mark.parametrize("strategy", ["allreduce", "lossy-allreduce", "rps"])
def test_one_worker_equals_plain_sgd_on_cuda(strategy: str, tmp_run) -> None:
    test_strategies.test_one_worker_equals_plain_sgd(strategy, tmp_run)


@pytest.mark.parametrize("strategy,momentum", [("rps", 0.0), ("lossy-allreduce", 0.9), ("allreduce", 0.9),
                                               ({"name": "dts", "delay": 7, "period": 2}, 0.9),
                                               ({"name": "diloco", "period": 3}, 0.9),
                                               ({"name": "diloco", "period": 4, "reliable": True}, "adamw")])
def test_resume_is_bit_identical_on_cuda(strategy: str | dict, momentum: float | str, tmp_run) -> None:
    test_train.test_resume_is_bit_identical(strategy, momentum, tmp_run)


def test_replayed_trace_reproduces_the_run_exactly_on_cuda(tmp_run) -> None:
    test_train.test_replayed_trace_reproduces_the_run_exactly(tmp_run)


@pytest.mark.parametrize("overrides", [
    dict(strategy={"name": "rps"}, failures=[{"worker": 1, "step": 5, "rejoin": 15}]),
    dict(model={"name": "cnn"}, strategy={"name": "dts", "delay": 3, "period": 2}),
    dict(model={"name": "resnet20"}, num_workers=2, batch_size=8, steps=6, eval_every=3,
         strategy={"name": "rps"}),
    dict(model={"name": "lstm", "hidden": 16}, data={"dataset": "text", "max_len": 8}, batch_size=8),
], ids=["rps-failure-rejoin", "cnn-dts", "resnet20", "lstm"])
def test_the_same_config_gives_the_same_numbers_twice_on_cuda(overrides: dict, tmp_run, tmp_path: Path) -> None:
    if "data" in overrides:  # the text set, written here
        overrides = {**overrides, "data": {**overrides["data"],
                                           "path": str(test_train.write_text_set(tmp_path / "set.tsv"))}}
    cfg = make_config(**{"steps": 30, "eval_every": 10, "network": {"drop_rate": 0.2}, **overrides})
    first, again = tmp_run(), tmp_run()
    run(cfg, first)
    run(cfg, again)
    assert_same_run(again, first)
    assert torch.equal(load_checkpoint(again)["params"], load_checkpoint(first)["params"])


def test_a_cuda_run_keeps_its_tensors_on_the_gpu_and_its_checkpoint_on_the_host(tmp_run) -> None:
    cfg = make_config(steps=10, eval_every=5)
    setup = prepare(cfg)
    assert setup.device.type == "cuda" and setup.data.x_train.is_cuda and setup.data.y_test.is_cuda
    assert all(p.is_cuda for p in setup.model.parameters())
    out = tmp_run()
    run(cfg, out)
    assert load_checkpoint(out)["params"].device.type == "cpu"


@pytest.mark.parametrize("model,shape", [("cnn", (784,)), ("cnn", (40,)), ("resnet20", (3, 32, 32)), ("lstm", (12,))])
def test_gradients_replayed_from_a_cuda_graph_are_the_eager_bits(model: str, shape: tuple[int, ...],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The conv nets' and the lstm's gradient functions capture a CUDA graph at the third call of a shape and
    replay it after: every call, with new parameters, data and masks each time, gives the eager path's bits."""
    import shaky.vectorized as vectorized  # noqa: PLC0415
    from shaky.models import FlatParams, build_model  # noqa: PLC0415

    net = build_model(model, input_shape=shape, num_classes=10, vocab_size=30, seed=0).cuda()
    flat = FlatParams(net)
    graphed, _ = vectorized.make_functions(net, flat)
    eager, _ = vectorized.make_functions(net, flat)
    gen = torch.Generator(device="cuda").manual_seed(1)
    w, b = 4, 8
    for call in range(6):
        params = flat.flatten(net)[None].repeat(w, 1) + 0.01 * torch.randn(w, flat.dim, generator=gen, device="cuda")
        if model == "lstm":   # token ids, right-padded: 1 to 12 real
            ids = torch.randint(1, 30, (w, b, *shape), generator=gen, device="cuda")
            lengths = torch.randint(1, shape[0] + 1, (w, b, 1), generator=gen, device="cuda")
            x = torch.where(torch.arange(shape[0], device="cuda") < lengths, ids, 0)
        else:
            x = torch.randn(w, b, *shape, generator=gen, device="cuda")
        y = torch.randint(0, 10, (w, b), generator=gen, device="cuda")
        mask = (torch.rand(w, b, generator=gen, device="cuda") < 0.8).float()
        mask[:, 0] = 1.0
        got = graphed(params, x, y, mask)
        with monkeypatch.context() as m:
            m.setattr(vectorized, "CUDA_GRAPHS", False)
            want = eager(params, x, y, mask)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), call
    assert len(graphed._graphs.graphs) == 1


@pytest.mark.parametrize("model", ["mlp", "cnn", "lstm"])
def test_a_cuda_run_ends_where_the_cpu_run_does(model: str, tmp_run, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The same config on both devices: the same batches, masks and initial model, so the same training up to
    the order of the sums (cuDNN's and cuBLAS's kernels sum in another order than the CPU's)."""
    extra: dict = {"model": {"name": model}}
    if model == "lstm":
        text = test_train.write_text_set(tmp_path / "set.tsv")
        extra = {"model": {"name": "lstm", "hidden": 16}, "batch_size": 8,
                 "data": {"dataset": "text", "path": str(text), "max_len": 8}}
    cfg = make_config(steps=30, eval_every=10, network={"drop_rate": 0.1}, **extra)
    gpu, gpu_params, gpu_rows = run(cfg, tmp_run())
    monkeypatch.setattr(conftest, "DEVICE", "cpu")
    cpu, cpu_params, cpu_rows = run(make_config(steps=30, eval_every=10, network={"drop_rate": 0.1}, **extra),
                                    tmp_run())
    torch.testing.assert_close(gpu_params, cpu_params, atol=2e-3, rtol=2e-3)
    assert gpu["messages_dropped"] == cpu["messages_dropped"] and gpu["sim_time_s"] == cpu["sim_time_s"]
    for g, c in zip(gpu_rows, cpu_rows):
        assert math.isclose(g["train_loss"] or 0.0, c["train_loss"] or 0.0, rel_tol=1e-3, abs_tol=1e-4)


@pytest.mark.parametrize("transport", ["gloo", "udp"])
def test_torchrun_ranks_on_cuda_finish_and_gloo_s_end_where_the_simulator_does(transport: str, tmp_path: Path) -> None:
    """Two torchrun ranks on the GPU (the exchanges staged through pinned host memory) against the simulator on
    the GPU: gloo's run ends where the simulator's does; udp's (its losses are what arrives) finishes."""
    out = tmp_path / "torchrun"
    args = ["--backend", "dist", "--workers", "2", "--steps", "30", "--eval-every", "10", "--device", "cuda",
            "--quiet", "--out", str(out), "--transport", transport]
    args += ["--drop-rate", "0.1"] if transport == "gloo" else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "shaky", "train", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 30 and not summary["diverged"]
    if transport == "udp":
        return
    cfg = make_config(num_workers=2, steps=30, eval_every=10, batch_size=32, network={"drop_rate": 0.1})
    sim, _, _ = run(cfg, tmp_path / "sim")
    dist_final = read_metrics(out)[-1]
    assert math.isclose(dist_final["test_accuracy"], sim["final_test_accuracy"], abs_tol=1e-9)
