"""Strategies composed from stages: one made up here, DiLoCo from the registry, AdamW, and the fault injector.

The dist half runs two gloo processes on 127.0.0.1 through the same training
loop as the simulator (rank 0 writes each run directory); they must end where
the simulator ends (allclose 1e-5: the two backends sum in different orders).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shaky.config import RunConfig
from shaky.inject import Fault, FaultInjector, InterruptedRun
from shaky.rundir import load_checkpoint
from shaky.strategies import (SGD, AverageModels, AverageUpdates, OuterSGD, delayed, every, lossy_block_average,
                              outer, reliable_mean)
from shaky.train import prepare, read_metrics, train

from conftest import free_port, make_config, run, train_by_hand, without_wall_time

WORKERS = 2


COMPOSED = {
    # Local SGD whose lossy average, launched every 4th step, arrives one step late and then goes through an
    # outer Nesterov step: a strategy no registry entry spells.
    "composed": lambda cfg: AverageModels(
        "made-up", SGD(cfg.optim), outer(OuterSGD(lr=0.7, momentum=0.9), delayed(2, every(4, lossy_block_average())))),
    # DTS's accumulated updates through the exact mean, which gloo runs in the background (an async all-reduce):
    # exchanges are in flight at every checkpoint, and the checkpoint must store their results.
    "composed-in-flight": lambda cfg: AverageUpdates("made-up-2", SGD(cfg.optim), delayed(4, every(2, reliable_mean()))),
}


CASES: dict[str, dict] = {
    "composed": dict(optim={"momentum": 0.9}),
    "composed-in-flight": dict(optim={"momentum": 0.9}, checkpoint_every=5),
    "diloco": dict(strategy={"name": "diloco", "period": 4}, optim={"momentum": 0.9}),
    "diloco-adamw-reliable": dict(strategy={"name": "diloco", "period": 3, "reliable": True},
                                  optim={"name": "adamw", "lr": 0.01, "weight_decay": 0.01}),
}


def _config(case: str) -> RunConfig:
    return make_config(num_workers=WORKERS, steps=16, eval_every=4, network={"drop_rate": 0.25, "compute_ms": 1.0},
                       **CASES[case])


def _setup(case: str):
    setup = prepare(_config(case))
    return dataclasses.replace(setup, strategy=COMPOSED[case](setup.cfg)) if case in COMPOSED else setup


def _worker(rank: int, port: int, out: str) -> None:
    from shaky.comm.gloo import DistComm  # noqa: PLC0415

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORKERS,
                            timeout=timedelta(seconds=60))
    comm = DistComm()
    for case in CASES:
        train(_setup(case), Path(out) / case, comm=comm, writer=rank == 0, progress=False)
        dist.barrier()
    # Every rank is told to stop before step 5; each counts what fired on it.
    faults = FaultInjector((Fault("stop", 5),))
    try:
        train(prepare(_config("diloco")), Path(out) / "stopped", comm=comm, writer=rank == 0, progress=False,
              faults=faults)
    except InterruptedRun:
        pass
    (Path(out) / f"faults-{rank}.json").write_text(json.dumps({"fired_at": faults.fired_at, "checks": faults.checks,
                                                                "fired": list(faults.fired.values())}))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def dist_runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("compose")
    torch.set_num_threads(1)
    mp.start_processes(_worker, args=(free_port(), str(out)), nprocs=WORKERS, start_method="spawn", join=True)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_composed_strategies_run_alike_in_the_simulator_and_on_dist(case: str, dist_runs: Path,
                                                                   tmp_path: Path) -> None:
    sim_dir = tmp_path / "sim"
    train(_setup(case), sim_dir, progress=False)
    sim_rows, dist_rows = read_metrics(sim_dir), read_metrics(dist_runs / case)
    assert [r["step"] for r in dist_rows] == [r["step"] for r in sim_rows] == [0, 4, 8, 12, 16]
    for s, d in zip(sim_rows, dist_rows):
        for key in s:
            if isinstance(s[key], float) and key != "wall_time_s":
                assert d[key] == pytest.approx(s[key], rel=1e-5, abs=1e-5), (case, s["step"], key)
    sim_params = load_checkpoint(sim_dir)["params"]
    dist_params = load_checkpoint(dist_runs / case)["params"]
    torch.testing.assert_close(dist_params, sim_params, atol=1e-5, rtol=1e-5)
    assert sim_rows[-1]["messages_dropped"] > 0 or "reliable" in case or "in-flight" in case


def test_the_composed_strategy_is_not_any_registry_strategy(tmp_path: Path) -> None:
    """The made-up composition changes the numbers: it is not silently replaced by the configured strategy."""
    train(_setup("composed"), tmp_path / "composed", progress=False)
    plain = _config("composed")
    train(prepare(plain), tmp_path / "plain", progress=False)
    a = load_checkpoint(tmp_path / "composed")["params"]
    b = load_checkpoint(tmp_path / "plain")["params"]
    assert not torch.allclose(a, b, atol=1e-3)


def test_an_injected_fault_fires_once_at_its_step_on_every_rank(dist_runs: Path) -> None:
    for rank in range(WORKERS):
        counted = json.loads((dist_runs / f"faults-{rank}.json").read_text())
        assert counted == {"fired_at": [["stop", 5, rank]], "checks": 6, "fired": [1]}


def test_a_fault_for_one_rank_fires_exactly_once_at_its_step(tmp_run) -> None:
    """The simulator is rank 0: rank 0's fault fires once, before step 7, also when the run resumes past it;
    rank 1's never fires."""
    mine, other = Fault("stop", 7, rank=0), Fault("stop", 3, rank=1)
    faults = FaultInjector((mine, other))
    cfg = make_config(steps=20, eval_every=5, checkpoint_every=5)
    run_dir = tmp_run()
    with pytest.raises(InterruptedRun):
        train(prepare(cfg), run_dir, progress=False, faults=faults)
    assert (faults.fired[mine], faults.fired[other], faults.fired_at, faults.checks) == (1, 0, [("stop", 7, 0)], 8)
    train(prepare(cfg), run_dir, resume=True, progress=False, faults=faults)  # from step 5, through 7 again
    assert (faults.fired[mine], faults.fired[other], faults.fired_at) == (1, 0, [("stop", 7, 0)])
    assert faults.checks == 8 + 15
    assert read_metrics(run_dir)[-1]["step"] == 20


@pytest.mark.parametrize("reliable", [False, True])
def test_diloco_with_outer_lr_1_and_no_momentum_is_local_sgd_bit_for_bit(reliable: bool, tmp_run) -> None:
    base = dict(steps=40, eval_every=10, optim={"momentum": 0.9}, network={"drop_rate": 0.2, "compute_ms": 1.0})
    _, local, local_rows = run(make_config(strategy={"name": "local-sgd", "period": 4, "reliable": reliable},
                                           **base), tmp_run())
    _, diloco, diloco_rows = run(make_config(strategy={"name": "diloco", "period": 4, "reliable": reliable,
                                                       "outer_lr": 1.0, "outer_momentum": 0.0}, **base), tmp_run())
    assert torch.equal(diloco, local)
    assert without_wall_time(diloco_rows) == without_wall_time(local_rows)


def test_a_rejoining_worker_takes_the_live_workers_outer_anchor(tmp_run) -> None:
    """Worker 1 dies at step 4 and rejoins at step 12; outer steps end steps 3, 7, 11. With the exact mean, every
    live worker's anchor is the same after an outer step, and the rejoining worker must take it (with the average
    model), not keep the anchor of step 3: its next pseudo-gradient would span 8 steps of other workers' work."""
    cfg = make_config(steps=14, eval_every=7, failures=[{"worker": 1, "step": 4, "rejoin": 12}],
                      strategy={"name": "diloco", "period": 4, "reliable": True}, network={"drop_rate": 0.0})
    run_dir = tmp_run()
    run(cfg, run_dir)
    anchor = load_checkpoint(run_dir)["state"].exchange.outer.anchor
    torch.testing.assert_close(anchor[1], anchor[0], atol=1e-6, rtol=0)
    assert torch.equal(anchor[0], anchor[2]) and torch.equal(anchor[0], anchor[3])


def _outer_every(cfg: RunConfig, period: int) -> Callable[[list[torch.nn.Parameter]], Callable[[int], None]]:
    """``after_step`` for train_by_hand: every ``period`` steps, torch.optim.SGD(nesterov=True) stepped on the
    pseudo-gradient (the model at the last outer step minus the model now), from that anchor."""
    s = cfg.strategy

    def make(params: list[torch.nn.Parameter]) -> Callable[[int], None]:
        outer_opt = torch.optim.SGD(params, lr=s.outer_lr, momentum=s.outer_momentum, nesterov=s.outer_nesterov)
        anchor = [p.detach().clone() for p in params]

        def after(t: int) -> None:
            if (t + 1) % period:
                return
            with torch.no_grad():
                for p, a in zip(params, anchor):
                    p.grad = a - p
                    p.copy_(a)
            outer_opt.step()
            anchor[:] = [p.detach().clone() for p in params]

        return after

    return make


def test_one_worker_diloco_is_torch_sgd_with_nesterov_on_the_pseudo_gradient(tmp_run) -> None:
    cfg = make_config(num_workers=1, steps=30, strategy={"name": "diloco", "period": 5},
                      optim={"lr": 0.05, "momentum": 0.9}, network={"drop_rate": 0.5, "compute_ms": 1.0})
    assert (cfg.strategy.outer_lr, cfg.strategy.outer_momentum, cfg.strategy.outer_nesterov) == (0.7, 0.9, True)
    _, params, _ = run(cfg, tmp_run())

    def sgd(p: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(p, lr=0.05, momentum=0.9)

    reference = train_by_hand(cfg, sgd, after_step=_outer_every(cfg, 5))
    torch.testing.assert_close(params[0], reference, atol=1e-5, rtol=1e-5)
    # Without the outer step the same run ends elsewhere: the test can tell the two apart.
    assert not torch.allclose(params[0], train_by_hand(cfg, sgd), atol=1e-3)


@pytest.mark.parametrize("strategy", ["rps", "allreduce"])
def test_one_worker_adamw_equals_torch_adamw(strategy: str, tmp_run) -> None:
    optim = {"name": "adamw", "lr": 0.01, "weight_decay": 0.05, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6,
             "warmup_steps": 5, "decay_steps": [20], "decay_factor": 0.5}
    cfg = make_config(num_workers=1, steps=30, optim=optim, strategy={"name": strategy},
                      network={"drop_rate": 0.5, "compute_ms": 1.0})
    _, params, _ = run(cfg, tmp_run())
    reference = train_by_hand(cfg, lambda p: torch.optim.AdamW(p, lr=0.01, betas=(0.8, 0.99), eps=1e-6,
                                                                weight_decay=0.05),
                              lr_at=lambda t: 0.01 * min(1.0, (t + 1) / 5) * (0.5 if t >= 20 else 1.0))
    torch.testing.assert_close(params[0], reference, atol=1e-5, rtol=1e-5)


AVERAGER_OUTER = """
import torch, torch.distributed as dist, shaky
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d", rank=0, world_size=1)
def make():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
x, y = torch.randn(60, 4, generator=torch.Generator().manual_seed(1)), torch.arange(60) %% 2
model = make()
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
averager = shaky.ModelAverager(model, period=3, outer_optimizer=shaky.OuterSGD(lr=0.7, momentum=0.9))
ref = make()
ref_params = list(ref.parameters())
ref_opt = torch.optim.SGD(ref_params, lr=0.1, momentum=0.9)
outer = torch.optim.SGD(ref_params, lr=0.7, momentum=0.9, nesterov=True)
anchor = [p.detach().clone() for p in ref_params]
for t in range(12):
    for m, o in ((model, opt), (ref, ref_opt)):
        o.zero_grad()
        torch.nn.functional.cross_entropy(m(x[5 * t:5 * t + 5]), y[5 * t:5 * t + 5]).backward()
        o.step()
    averager.step()
    if (t + 1) %% 3 == 0:
        with torch.no_grad():
            for p, a in zip(ref_params, anchor):
                p.grad = a - p
                p.copy_(a)
        outer.step()
        anchor = [p.detach().clone() for p in ref_params]
diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref_params))
plain = max((a - b).abs().max().item() for a, b in zip(model.parameters(), make().parameters()))
print(diff, plain)
dist.destroy_process_group()
"""


def test_model_averager_outer_step_is_torch_sgd_with_nesterov_on_the_pseudo_gradient() -> None:
    """One rank: ModelAverager(period=3, outer_optimizer=OuterSGD()) around a user's torch.optim.SGD equals torch's
    SGD(nesterov=True) stepped every 3 steps on (the model 3 steps ago) - (the model now), from the first step on."""
    proc = subprocess.run([sys.executable, "-c", AVERAGER_OUTER % free_port()], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    diff, moved = map(float, proc.stdout.split())
    assert diff < 1e-6 and moved > 1e-2, (diff, moved)


ENV_CHECK = """
import os, sys
calls = []
sys.setprofile(lambda frame, event, arg: calls.append(frame.f_code.co_qualname)
               if event == "call" and frame.f_code.co_name == "tune_allocator" else None)
before = dict(os.environ)
import shaky
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d", rank=0, world_size=1)
model = torch.nn.Linear(4, 2)
averager = shaky.RPSAverager(model, network={"drop_rate": 0.1})
averager.step()
outer = shaky.ModelAverager(model, period=2, outer_optimizer=shaky.OuterSGD())
outer.step(); outer.step()
dist.destroy_process_group()
sys.setprofile(None)
changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
import shaky.waiting
print("changed:", changed, "tune_allocator calls:", calls, "wait watched at:", shaky.waiting.state.where)
"""


def test_import_and_averagers_leave_the_process_settings_alone() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "MALLOC_"))}
    proc = subprocess.run([sys.executable, "-c", ENV_CHECK % free_port()], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "changed: [] tune_allocator calls: [] wait watched at: None"


@pytest.mark.parametrize("shared_cores,given,adapted,log_level", [
    (False, None, "True", "None"), (True, None, "True", "ERROR"), (False, "ACTIVE", "False", "None")])
def test_the_command_line_does_tune_the_process(shared_cores: bool, given: str | None, adapted: str,
                                                log_level: str) -> None:
    """The counterpart: the CLI entry point makes the process-wide settings (so the check above can fail).
    Every shaky command adapts OpenMP's wait to the machine (shaky/waiting.py: spin while the cores are its
    own, sleep while another program wants them), unless the environment sets a policy; a torch.distributed
    rank also quiets c10d's log."""
    code = ("import sys; calls = []; "
            "sys.setprofile(lambda f, e, a: calls.append(1) if e == 'call' and f.f_code.co_name == 'tune_allocator' "
            "else None); from shaky.cli import process_settings; from shaky import waiting; import os; "
            f"process_settings(shared_cores={shared_cores}); print(os.environ.get('OMP_WAIT_POLICY'), "
            "waiting.state.where is not None, os.environ.get('TORCH_CPP_LOG_LEVEL'), len(calls))")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "MALLOC_", "TORCH_CPP_LOG"))}
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [str(given), adapted, log_level, "1"]
