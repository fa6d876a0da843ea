"""The training loop: replayed traces, bit-identical resume, metrics, and what drops do."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from shaky import native
from shaky.comm.sim import SimComm
from shaky.rundir import load_checkpoint
from shaky.sampler import _mix, _permuted
from shaky.train import (SHARDS_FILE, BatchSampler, InterruptedRun, can_fuse, prepare, read_metrics,
                         train, train_step)

from conftest import everyone, make_config, run, stop_at, unmeasured, without_wall_time


def test_replayed_trace_reproduces_the_run_exactly(tmp_run) -> None:
    first_dir = tmp_run()
    cfg = make_config(network={"drop_rate": 0.3}, strategy={"name": "rps"})
    first, params, rows = run(cfg, first_dir)
    assert first["messages_dropped"] > 0
    # The replay is told drop_rate 0: every loss it sees must come from the trace.
    replay_cfg = make_config(network={"drop_rate": 0.0, "trace": str(first_dir)}, strategy={"name": "rps"})
    second, replay_params, replay_rows = run(replay_cfg, tmp_run())
    assert torch.equal(params, replay_params)
    assert without_wall_time(rows) == without_wall_time(replay_rows)
    assert second["messages_dropped"] == first["messages_dropped"]
    # Without the trace, the same drop-free config ends elsewhere.
    _, free_params, _ = run(make_config(network={"drop_rate": 0.0}, strategy={"name": "rps"}), tmp_run())
    assert not torch.equal(params, free_params)


@pytest.mark.parametrize("strategy,momentum", [("rps", 0.0), ("lossy-allreduce", 0.9), ("allreduce", 0.9),
                                               ({"name": "dts", "delay": 7, "period": 2}, 0.9),
                                               ({"name": "diloco", "period": 3}, 0.9),
                                               ({"name": "diloco", "period": 4, "reliable": True}, "adamw")])
def test_resume_is_bit_identical(strategy: str | dict, momentum: float | str, tmp_run) -> None:
    # DTS with t = 7, d = 2 has averages (and the clock has exchanges) in flight at the checkpoint at step 20.
    cfg = make_config(steps=60, eval_every=10, checkpoint_every=20,
                      strategy=strategy if isinstance(strategy, dict) else {"name": strategy},
                      optim={"name": "adamw", "lr": 0.01} if momentum == "adamw" else {"momentum": momentum},
                      network={"drop_rate": 0.2, "latency_ms": 5.0})
    whole, params, rows = run(cfg, tmp_run())

    crashed = tmp_run()
    with pytest.raises(InterruptedRun):
        train(prepare(cfg), crashed, progress=False, faults=stop_at(35))
    assert read_metrics(crashed)[-1]["step"] == 30          # evaluations after the checkpoint at 20 exist...
    resumed = train(prepare(cfg), crashed, resume=True, progress=False)
    assert [r["step"] for r in read_metrics(crashed)] == [0, 10, 20, 30, 40, 50, 60]  # ...and are not repeated
    assert torch.equal(load_checkpoint(crashed)["params"], params)
    assert without_wall_time(read_metrics(crashed)) == without_wall_time(rows)
    assert unmeasured(resumed) == unmeasured(whole)


def test_a_resumed_run_keeps_its_measured_compute_time(tmp_run, monkeypatch) -> None:
    """With compute time measured (network.compute_ms < 0), a resume uses the run's own measurement, not a new
    one: the simulated time and the summary are those of the run never interrupted."""
    import shaky.setup  # noqa: PLC0415

    cfg = make_config(steps=40, eval_every=10, checkpoint_every=20, network={"compute_ms": -1.0, "drop_rate": 0.1})
    whole, _, rows = run(cfg, tmp_run())
    crashed = tmp_run()
    with pytest.raises(InterruptedRun):
        train(prepare(cfg), crashed, progress=False, faults=stop_at(30))
    # This process would now measure another compute time (a busier machine): the resume must not use it.
    monkeypatch.setattr(shaky.setup, "_COMPUTE_MS", {k: 3 * v for k, v in shaky.setup._COMPUTE_MS.items()})
    assert prepare(cfg).compute_ms == 3 * whole["compute_ms"]
    resumed = train(prepare(cfg), crashed, resume=True, progress=False)
    assert without_wall_time(read_metrics(crashed)) == without_wall_time(rows)
    assert unmeasured(resumed) == unmeasured(whole)


def test_metrics_and_shards_are_recorded(tmp_run) -> None:
    run_dir = tmp_run()
    cfg = make_config(num_workers=4, steps=20, eval_every=10, data={"partition": "dirichlet", "dirichlet_alpha": 0.1},
                      network={"drop_rate": 0.1})
    summary, _, rows = run(cfg, run_dir)
    assert [r["step"] for r in rows] == [0, 10, 20]
    assert rows[0]["train_loss"] is None and rows[-1]["train_loss"] > 0
    assert rows[-1]["bytes_sent"] == summary["bytes_sent"] > 0
    assert summary["messages_sent"] == 20 * 2 * 4 * 3        # steps x phases x W x (W - 1)
    assert 0 < summary["messages_dropped"] < summary["messages_sent"]
    assert summary["sim_time_s"] > 20 * 1e-3                 # at least the compute time (1 ms per step)
    # The three evaluations' seconds, a part of the run's: the step-0 row's wall time is about its evaluation's.
    assert rows[0]["wall_time_s"] <= summary["eval_time_s"] < summary["wall_time_s"] == rows[-1]["wall_time_s"]
    shards = json.loads((run_dir / SHARDS_FILE).read_text())
    indices = [set(s["indices"]) for s in shards]
    assert sum(map(len, indices)) == len(set().union(*indices)) == len(prepare(cfg).data.y_train)
    assert [len(s) for s in indices] == [s["num_samples"] for s in shards]


def test_gradient_averaging_loses_consensus_under_drops_but_rps_does_not(tmp_run) -> None:
    common = dict(num_workers=8, steps=100, network={"drop_rate": 0.1})
    rps, _, _ = run(make_config(strategy={"name": "rps"}, **common), tmp_run())
    lossy, _, _ = run(make_config(strategy={"name": "lossy-allreduce"}, **common), tmp_run())
    assert lossy["consensus_distance"] > 10 * rps["consensus_distance"]


def test_reliable_transport_pays_for_drops_in_time_not_accuracy(tmp_run) -> None:
    common = dict(num_workers=4, steps=30, strategy={"name": "allreduce"})
    clean, clean_params, _ = run(make_config(network={"drop_rate": 0.0}, **common), tmp_run())
    lossy, lossy_params, _ = run(make_config(network={"drop_rate": 0.2}, **common), tmp_run())
    assert torch.equal(clean_params, lossy_params)
    assert lossy["sim_time_s"] > clean["sim_time_s"] + 0.2 * 10   # a 200 ms timeout in most rounds
    assert lossy["bytes_sent"] > clean["bytes_sent"]              # resent messages count again


def test_batch_sampler_walks_each_shard_once_per_epoch() -> None:
    shards = [np.arange(10), np.arange(10, 13), np.arange(20, 41)]
    sampler = BatchSampler(shards, [0, 1, 2], [4, 5, 3], seed=11)
    drawn: list[list[int]] = [[], [], []]
    for step in range(42):
        idx = sampler.indices(step).numpy()
        for k, b in enumerate([4, 5, 3]):
            assert (idx[k, b:] == 0).all()
            drawn[k].extend(idx[k, :b].tolist())
    for k, shard in enumerate(shards):
        n = len(shard)
        epochs = [drawn[k][e * n:(e + 1) * n] for e in range(len(drawn[k]) // n)]
        assert len(epochs) >= 5
        assert all(sorted(e) == shard.tolist() for e in epochs)
        assert len({tuple(e) for e in epochs}) > 1  # a fresh order each epoch


def test_batch_sampler_rows_agree_with_the_full_sampler() -> None:
    """A torch.distributed rank samples its own row only; it must draw what the simulator draws for that row."""
    shards = [np.arange(i * 50, i * 50 + 30 + i) for i in range(4)]
    full = BatchSampler(shards, [0, 1, 2, 3], [8] * 4, seed=3)
    for r in range(4):
        mine = BatchSampler(shards, [r], [8] * 4, seed=3)
        for step in (0, 3, 17):
            assert torch.equal(mine.indices(step)[0], full.indices(step)[r])
    other = BatchSampler(shards, [0, 1, 2, 3], [8] * 4, seed=4)
    assert not torch.equal(other.indices(0), full.indices(0))


def test_batch_sampler_blocks_match_single_steps_in_any_order() -> None:
    """Indices are computed for blocks of steps; any step, asked in any order (a resume jumps back), is what a
    computation of that step alone gives."""
    shards = [np.arange(7), np.arange(100, 190), np.arange(200, 203)]
    sampler = BatchSampler(shards, [0, 1, 2], [5, 32, 2], seed=5)
    order = [*range(130), 70, 3, 200, 64, 63, 0]
    for step in order:
        assert np.array_equal(sampler.indices(step).numpy(), sampler._compute(step, 1)[0]), step


def test_batch_sampler_s_compiled_indices_are_its_numpy_indices() -> None:
    """The C path (where the library was built) computes the numpy path's indices: shards of 1 sample to more
    than a power of two, batches larger and smaller than their shards, rows of a rank, steps far into a run."""
    if native.FASTPATH is None:
        pytest.skip("the compiled library was not built")
    rng = np.random.default_rng(0)
    for _ in range(60):
        w = int(rng.integers(1, 7))
        lengths = [int(rng.choice([1, 2, 3, 7, 8, 9, 31, 64, 65, 1000])) for _ in range(w)]
        starts = np.cumsum([0, *lengths])
        shards = [np.arange(a, b) * 3 + 1 for a, b in zip(starts[:-1], starts[1:])]
        rows = sorted(rng.choice(w, size=int(rng.integers(1, w + 1)), replace=False).tolist())
        sampler = BatchSampler(shards, rows, [int(rng.integers(1, 40)) for _ in range(w)], int(rng.integers(2**32)))
        first, count = int(rng.choice([0, 5, 1000, 10**9])), int(rng.integers(1, 70))
        assert np.array_equal(sampler._compute(first, count), sampler._compute(first, count, compiled=False))


def test_keyed_permutation_is_a_bijection_and_uniform() -> None:
    """The sampler's order of an epoch: a permutation of range(n) for every key, each position landing
    uniformly over keys (chi-square over 20 000 keys, a 1e-5 tail bound)."""
    keys = _mix(np.arange(20_000, dtype=np.uint64) + np.uint64(7))
    for n in (1, 2, 3, 7, 22, 64, 300):
        for k in keys[:10]:
            image = _permuted(np.arange(n), np.full(n, n), np.full(n, k))
            assert sorted(image.tolist()) == list(range(n))
    for n, bound in ((5, 25.0), (22, 60.0), (100, 170.0)):
        first = _permuted(np.full(len(keys), 3), np.full(len(keys), n), keys)
        counts = np.bincount(first, minlength=n)
        expected = len(keys) / n
        assert ((counts - expected) ** 2 / expected).sum() < bound


@pytest.mark.parametrize("model,optim,strategy", [
    ("mlp", {"momentum": 0.9, "weight_decay": 1e-3}, {"name": "rps"}),
    ("mlp", {}, {"name": "local-sgd", "period": 3}),
    ("logreg", {"momentum": 0.5}, {"name": "ri-sgd", "redundancy": 2}),
])
def test_fused_step_equals_the_functional_step_bit_for_bit(model: str, optim: dict, strategy: dict) -> None:
    """train_step's optimizer-in-backward path (taken for linear models under model averaging) gives exactly
    the parameters, momentum and losses of grad_fn + strategy.step, step after step, drops included."""
    cfg = make_config(model={"name": model}, optim={"lr": 0.1, **optim}, strategy=strategy,
                      network={"drop_rate": 0.3})
    setup = prepare(cfg)
    assert can_fuse(setup.grad_fn, setup.strategy)
    comm = SimComm(cfg.num_workers)
    sampler = BatchSampler(setup.shards, list(range(cfg.num_workers)), cfg.worker_batch_sizes(), cfg.seed)
    mask = torch.ones(cfg.num_workers, cfg.batch_size)
    start = setup.flat.flatten(setup.model)[None].repeat(cfg.num_workers, 1)
    runs = {}
    for need_grads in (False, True):
        params, state, losses_seen = start.clone(), setup.strategy.init(start), []
        for step in range(7):
            idx = sampler.indices(step)
            links = everyone(setup.network.sample(step))
            params, state, _, losses, grads = train_step(
                setup.grad_fn, setup.strategy, params, state, setup.data.x_train[idx], setup.data.y_train[idx],
                mask, comm, links, need_grads=need_grads)
            assert (grads is None) is (not need_grads)       # False: the fused path ran
            losses_seen.append(losses)
        runs[need_grads] = (params, state, torch.stack(losses_seen))
    (p_fused, s_fused, l_fused), (p_plain, s_plain, l_plain) = runs[False], runs[True]
    assert torch.equal(p_fused, p_plain)
    assert torch.equal(l_fused, l_plain)
    assert s_fused.opt.count == s_plain.opt.count
    assert (s_fused.opt.momentum is None) is (s_plain.opt.momentum is None)
    if s_fused.opt.momentum is not None:
        assert torch.equal(s_fused.opt.momentum, s_plain.opt.momentum)
    assert not torch.equal(p_fused, start)


def test_the_compute_time_is_measured_once_per_machine(tmp_path, monkeypatch) -> None:
    """Two fresh runs (two processes: this process's memory is cleared in between) are charged the same
    measured compute time, read back from the cache file; a damaged cache file is measured again."""
    import shaky.setup  # noqa: PLC0415

    monkeypatch.setenv("SHAKY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(shaky.setup, "_COMPUTE_MS", {})
    cfg = make_config(steps=10, eval_every=5, network={"compute_ms": -1.0, "drop_rate": 0.1})
    first = train(prepare(cfg), tmp_path / "a", progress=False)
    cache = tmp_path / "cache" / shaky.setup.COMPUTE_CACHE
    saved = json.loads(cache.read_text())
    assert list(saved.values()) == [first["compute_ms"]] and first["compute_ms"] > 0

    monkeypatch.setattr(shaky.setup, "_COMPUTE_MS", {})
    monkeypatch.setattr(shaky.setup, "_measure", lambda setup: pytest.fail("measured again"))
    second = train(prepare(cfg), tmp_path / "b", progress=False)
    assert unmeasured(second) == unmeasured(first)

    cache.write_text("{not json")
    monkeypatch.setattr(shaky.setup, "_COMPUTE_MS", {})
    monkeypatch.setattr(shaky.setup, "_measure", lambda setup: 7.5)
    assert prepare(cfg).compute_ms == 7.5
    assert list(json.loads(cache.read_text()).values()) == [7.5]


def write_text_set(path, samples: int = 160, seed: int = 0):
    """A two-class ``label<TAB>text`` file: each class's sentences draw from their own five words, of varying
    lengths (so the lstm meets padding in every batch)."""
    gen = np.random.default_rng(seed)
    words = [["good", "fine", "great", "nice", "fair"], ["bad", "poor", "awful", "grim", "sad"]]
    lines = []
    for i in range(samples):
        label = i % 2
        lines.append(f"{['pos', 'neg'][label]}\t{' '.join(gen.choice(words[label], gen.integers(2, 9)))}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_an_lstm_learns_a_text_set_and_resumes_bit_identically(tmp_run, tmp_path) -> None:
    """The lstm's batched path end to end (`shaky train --dataset text --model lstm`): it learns a separable set
    over a lossy network, and a run stopped and resumed ends with the uninterrupted run's bits."""
    text = write_text_set(tmp_path / "set.tsv")
    cfg = make_config(steps=20, eval_every=10, checkpoint_every=10, batch_size=8,
                      data={"dataset": "text", "path": str(text), "max_len": 8}, model={"name": "lstm", "hidden": 16},
                      network={"drop_rate": 0.1}, optim={"lr": 0.5})
    summary, params, _ = run(cfg, tmp_run())
    assert summary["final_test_accuracy"] >= 0.9, summary
    crashed = tmp_run()
    with pytest.raises(InterruptedRun):
        train(prepare(cfg), crashed, progress=False, faults=stop_at(15))
    train(prepare(cfg), crashed, resume=True, progress=False)
    assert torch.equal(load_checkpoint(crashed)["params"], params)
