"""Local SGD and RI-SGD: equivalences, cyclic redundancy, failures, heterogeneous batches, metrics."""

from __future__ import annotations

from itertools import combinations
from pathlib import Path

import numpy as np
import pytest
import torch

from shaky.cli import main
from shaky.comm.sim import SimComm
from shaky.config import FailureConfig
from shaky.data import assign_chunks, coverage, partition
from shaky.network.faults import FailureSchedule
from shaky.rundir import load_checkpoint
from shaky.setup import gradient_diversity
from shaky.strategies.state import map_rows
from shaky.train import BatchSampler, InterruptedRun, prepare, train

from conftest import make_config, run, stop_at


def test_ri_sgd_with_q1_equals_local_sgd(tmp_run) -> None:
    common = dict(num_workers=4, steps=40, network={"drop_rate": 0.1}, data={"partition": "label-skew"})
    _, ri, ri_rows = run(make_config(strategy={"name": "ri-sgd", "period": 5, "redundancy": 1}, **common), tmp_run())
    _, local, local_rows = run(make_config(strategy={"name": "local-sgd", "period": 5}, **common), tmp_run())
    assert torch.equal(ri, local)
    assert [r["test_accuracy"] for r in ri_rows] == [r["test_accuracy"] for r in local_rows]


def test_local_sgd_with_tau1_equals_rps(tmp_run) -> None:
    common = dict(num_workers=4, steps=40, network={"drop_rate": 0.2})
    _, local, _ = run(make_config(strategy={"name": "local-sgd", "period": 1}, **common), tmp_run())
    _, rps, _ = run(make_config(strategy={"name": "rps"}, **common), tmp_run())
    assert torch.equal(local, rps)


def test_local_sgd_averages_only_every_tau_steps(tmp_run) -> None:
    summary, params, rows = run(make_config(num_workers=4, steps=30, eval_every=5,
                                            strategy={"name": "local-sgd", "period": 10}), tmp_run())
    assert summary["comm_rounds"] == 3 and [r["comm_rounds"] for r in rows] == [0, 0, 1, 1, 2, 2, 3]
    assert summary["messages_sent"] == 3 * 2 * 4 * 3
    # Right after an averaging round at drop 0 the workers agree; between rounds they drift apart.
    assert rows[-1]["consensus_distance"] < 1e-10 and rows[-2]["consensus_distance"] > 1e-6


@pytest.mark.parametrize("p,q", [(8, 1), (8, 3), (5, 5), (7, 2)])
def test_cyclic_assignment_puts_every_chunk_on_exactly_q_workers(p: int, q: int) -> None:
    labels = np.arange(100) % 10
    chunks = partition(labels, p, kind="label-skew", seed=0)
    shards = assign_chunks(chunks, q)
    for c, chunk in enumerate(chunks):
        holders = [i for i, shard in enumerate(shards) if np.isin(chunk, shard).all()]
        assert len(holders) == q
        assert holders == sorted((c - k) % p for k in range(q))  # worker i holds chunks i .. i+q-1
    assert all(len(s) == sum(len(chunks[(i + k) % p]) for k in range(q)) for i, s in enumerate(shards))


@pytest.mark.parametrize("q", [1, 2, 3])
def test_coverage_after_failures_matches_the_combinatorics(q: int) -> None:
    p, n = 8, 80                                     # equal chunks of 10 samples
    shards = assign_chunks(partition(np.arange(n) % 10, p, kind="iid", seed=1), q)
    for f in range(p):
        for failed in combinations(range(p), f):
            live = np.ones(p, dtype=bool)
            live[list(failed)] = False
            # Chunk c is lost iff all of its q holders c, c-1, ..., c-q+1 failed.
            lost = sum(all((c - k) % p in failed for k in range(q)) for c in range(p))
            assert coverage(shards, live, n) == pytest.approx(1 - lost / p)


def test_two_failures_keep_coverage_with_redundancy_but_not_without(tmp_run) -> None:
    failures = [{"worker": 0, "step": 10}, {"worker": 1, "step": 10}]
    for q, expected in ((3, 1.0), (1, 0.75)):
        cfg = make_config(num_workers=8, steps=20, eval_every=10, failures=failures, data={"partition": "iid"},
                          strategy={"name": "ri-sgd", "period": 5, "redundancy": q})
        summary, _, rows = run(cfg, tmp_run())
        assert [r["live_workers"] for r in rows] == [8, 8, 6]
        assert rows[1]["coverage"] == 1.0 and summary["coverage"] == pytest.approx(expected, abs=0.01)


def test_failed_worker_is_frozen_and_rejoins_with_the_average(tmp_run) -> None:
    """Worker 2 misses steps 4..7 and rejoins at step 8; checkpoints after 4, 8 and 9 steps show it.

    allreduce keeps live rows identical but never pulls a stale row back by itself: only the
    rejoin sync can make worker 2 equal to the others again.
    """
    snapshots = {}
    for stop in (4, 8, 9):
        cfg = make_config(num_workers=4, steps=12, eval_every=4, checkpoint_every=stop, strategy={"name": "allreduce"},
                          failures=[{"worker": 2, "step": 4, "rejoin": 8}], network={"drop_rate": 0.0})
        d = tmp_run()
        with pytest.raises(InterruptedRun):
            train(prepare(cfg), d, progress=False, faults=stop_at(stop))
        snapshots[stop] = load_checkpoint(d)["params"]
    before, during, after = snapshots[4], snapshots[8], snapshots[9]
    assert torch.equal(before[2], during[2])                     # frozen while dead
    assert not torch.equal(before[0], during[0])                 # the others train on
    assert (during[[0, 1, 3]] - during[0]).abs().max() < 1e-6    # and agree among themselves (drop 0)
    assert (during[2] - during[0]).abs().max() > 1e-3            # the dead worker fell behind
    # At step 8 worker 2 starts from the live average and takes the same averaged step.
    assert (after[2] - after[0]).abs().max() < 1e-6


@pytest.mark.parametrize("restart", [False, True])
def test_a_restarted_worker_also_takes_the_average_of_its_momentum(restart: bool, tmp_run) -> None:
    """Worker 2 misses steps 4..7 and rejoins at step 8. Cut off (restart false) it keeps its own momentum, which
    no longer matches the others'; restarted as a new process (its memory lost) it takes the live workers'
    average of its momentum as well as of its model, so one step later it equals them in both (cut off, its own
momentum moves it away from them again)."""
    cfg = make_config(num_workers=4, steps=12, eval_every=4, checkpoint_every=9, strategy={"name": "allreduce"},
                      optim={"momentum": 0.9}, network={"drop_rate": 0.0},
                      failures=[{"worker": 2, "step": 4, "rejoin": 8, "restart": restart}])
    d = tmp_run()
    with pytest.raises(InterruptedRun):
        train(prepare(cfg), d, progress=False, faults=stop_at(9))
    ckpt = load_checkpoint(d)
    momenta: list[torch.Tensor] = []
    map_rows(ckpt["state"], lambda t: momenta.append(t) or t)
    assert momenta
    for gap in (float((ckpt["params"][2] - ckpt["params"][0]).abs().max()),
                max(float((m[2] - m[0]).abs().max()) for m in momenta)):
        assert (gap < 1e-6) if restart else (gap > 1e-4), gap


def test_an_observed_rejoin_is_a_restart_the_schedule_hands_on() -> None:
    """A real transport's survivors take a rank back: the schedule records it as a restart, its failures replay
    it, and another schedule adopts them."""
    schedule = FailureSchedule((), 4, 100)
    live = torch.tensor([True, True, False, True])
    schedule.observe(26, live)
    schedule.observe(40, torch.ones(4, dtype=torch.bool))
    assert schedule.failures == [{"worker": 2, "step": 26, "rejoin": 40, "restart": True}]
    members = schedule.membership(40)
    assert members.rejoined.tolist() == [False, False, True, False] and members.any_restarted
    assert members.restarted.tolist() == members.rejoined.tolist()
    other = FailureSchedule((), 4, 100)
    other.adopt(schedule.failures)
    assert other.live(30).tolist() == live.tolist() and other.membership(40).any_restarted
    replayed = FailureSchedule(tuple(FailureConfig(**f) for f in schedule.failures), 4, 100)
    assert replayed.failures == schedule.failures and not replayed.membership(41).any_rejoined


def test_dead_server_block_is_served_by_its_successor() -> None:
    schedule = FailureSchedule((FailureConfig(worker=1, step=0), FailureConfig(worker=2, step=0)), 4, 10)
    members = schedule.membership(0)
    assert members.servers.tolist() == [0, 3, 3, 3]
    x = torch.tensor([[1.0] * 4, [10.0] * 4, [20.0] * 4, [3.0] * 4])
    up = torch.ones(4, 4, dtype=torch.bool)
    up[0, 3] = False                                              # worker 0's block 3 (to server 3) lost
    out = SimComm(4).block_average(x, up, torch.ones(4, 4, dtype=torch.bool), weights=members.weights,
                                   servers=members.servers)
    # Block 0 (server 0): workers 0 and 3 alive and arrived: 2.0. Blocks 1-3 (server 3) are messages of their
    # own: worker 0's blocks 1 and 2 arrived (2.0), its block 3 did not (only 3 itself: 3.0).
    assert out[0].tolist() == [2.0, 2.0, 2.0, 3.0] and out[3].tolist() == [2.0, 2.0, 2.0, 3.0]


def test_allreduce_with_weighted_heterogeneous_batches_is_sgd_on_the_union(tmp_run) -> None:
    """Weighted by samples, two workers with batches of 8 and 24 take the step of one worker on all 32."""
    cfg = make_config(num_workers=2, steps=15, batch_sizes=[8, 24], strategy={"name": "allreduce", "weighted": True})
    _, params, _ = run(cfg, tmp_run())
    setup = prepare(cfg)
    sampler = BatchSampler(setup.shards, [0, 1], [8, 24], cfg.seed)
    x = setup.flat.flatten(setup.model)
    for t in range(cfg.steps):
        idx = sampler.indices(t)
        union = torch.cat([idx[0, :8], idx[1, :24]])
        g, _ = setup.grad_fn(x[None], setup.data.x_train[union][None], setup.data.y_train[union][None],
                             torch.ones(1, 32))
        x = x - cfg.optim.lr * g[0]
    torch.testing.assert_close(params[0], x, atol=1e-5, rtol=1e-5)
    # Unweighted, the small batch counts as much as the large one: a different model.
    _, unweighted, _ = run(make_config(num_workers=2, steps=15, batch_sizes=[8, 24]), tmp_run())
    assert not torch.allclose(unweighted[0], x, atol=1e-4)


def test_gradient_diversity() -> None:
    comm = SimComm(4)
    same = torch.ones(4, 6)
    assert gradient_diversity(same, comm, None) == pytest.approx(0.25)       # n ||g||^2 / ||n g||^2 = 1/n
    orthogonal = torch.eye(4, 6)
    assert gradient_diversity(orthogonal, comm, None) == pytest.approx(1.0)
    # A dead worker's gradient does not count.
    live = torch.tensor([1.0, 1.0, 0.0, 0.0])
    assert gradient_diversity(torch.cat([same[:2], orthogonal[2:]]), comm, live) == pytest.approx(0.5)


def test_rounds_to_target_are_reported(tmp_run) -> None:
    summary, _, rows = run(make_config(num_workers=4, steps=40, eval_every=5, target_accuracy=0.5,
                                       strategy={"name": "local-sgd", "period": 5}), tmp_run())
    first = next(r for r in rows if r["test_accuracy"] >= 0.5)
    assert summary["rounds_to_target"] == first["comm_rounds"] > 0
    assert rows[-1]["gradient_diversity"] > 0 and rows[0]["gradient_diversity"] is None


@pytest.mark.parametrize("args,expected", [
    (["--strategy", "ri-sgd", "--set", "strategy.redundancy=9"], "strategy.redundancy (q = 9) must be at most num_workers (p = 8)"),
    (["--strategy", "ri-sgd", "--set", "strategy.redundancy=0"], "strategy.redundancy must be >= 1, got 0"),
    (["--strategy", "local-sgd", "--set", "strategy.period=0"], "strategy.period must be >= 1, got 0"),
    (["--set", "failures=[{worker = 8, step = 3}]"], "failures[0].worker must name a worker in [0, 8), got 8"),
    (["--set", "failures=[{worker = 1, step = 30, rejoin = 20}]"], "failures[0].rejoin (20) must come after its failure step (30)"),
    (["--set", "failures=[{worker = 1}]"], "failures[0].step is required"),
    (["--set", "failures=[{worker = 1, step = 3, restart = true}]"], "failures[0].restart is true but the worker never rejoins"),
    (["--set", "failures=[{worker = 1, step = 3, rejoin = 5, restart = 1}]"], "failures[0].restart"),
    (["--set", "batch_sizes=[4, 4]"], "batch_sizes has 2 entries but num_workers is 8"),
])
def test_bad_input_exits_2_naming_the_field(args: list[str], expected: str, tmp_path: Path, monkeypatch,
                                            capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--quiet", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err
    assert not (tmp_path / "runs").exists()
