"""Exact equivalences the maths promises, and the semantics of the lossy block exchange."""

from __future__ import annotations

from math import comb

import pytest
import torch

from shaky import native
from shaky.comm.sim import SimComm
from shaky.config import NetworkConfig, OptimConfig, StrategyConfig
from shaky.network.model import NetworkModel
from shaky.strategies import REGISTRY, SGD

from conftest import everyone, make_config, run, train_by_hand


@pytest.mark.parametrize("workers", [1, 4, 8])
def test_rps_at_drop_zero_equals_allreduce(workers: int, tmp_run) -> None:
    """In float64: the model average and the gradient average add the same numbers in another order, which in
    float32 is an ulp a step and can flip a ReLU near zero on another CPU's kernels (AVX-512 against AVX2); in
    float64 the difference stays ~1e-15."""
    base = dict(num_workers=workers, steps=50, dtype="float64", network={"drop_rate": 0.0})
    _, rps, rps_rows = run(make_config(strategy={"name": "rps"}, **base), tmp_run())
    _, sync, sync_rows = run(make_config(strategy={"name": "allreduce"}, **base), tmp_run())
    assert (rps - sync).abs().max().item() <= 1e-12
    assert [r["test_accuracy"] for r in rps_rows] == [r["test_accuracy"] for r in sync_rows]


def test_lossy_allreduce_at_drop_zero_equals_allreduce(tmp_run) -> None:
    base = dict(num_workers=4, steps=30, dtype="float64", network={"drop_rate": 0.0})   # (float64: see above)
    _, lossy, _ = run(make_config(strategy={"name": "lossy-allreduce"}, **base), tmp_run())
    _, sync, _ = run(make_config(strategy={"name": "allreduce"}, **base), tmp_run())
    assert (lossy - sync).abs().max().item() <= 1e-12


@pytest.mark.parametrize("strategy", ["allreduce", "lossy-allreduce", "rps"])
def test_one_worker_equals_plain_sgd(strategy: str, tmp_run) -> None:
    """One worker of any strategy is torch.optim.SGD on an ordinary module, even with drops."""
    optim = {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3, "warmup_steps": 5, "decay_steps": [20],
             "decay_factor": 0.5}
    cfg = make_config(num_workers=1, steps=30, optim=optim, strategy={"name": strategy},
                      network={"drop_rate": 0.5})
    _, params, _ = run(cfg, tmp_run())
    reference = train_by_hand(cfg, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3),
                              lr_at=lambda t: 0.05 * min(1.0, (t + 1) / 5) * (0.5 if t >= 20 else 1.0))
    torch.testing.assert_close(params[0], reference, atol=1e-5, rtol=1e-5)


def test_block_average_by_hand() -> None:
    # 3 workers, 6 values: blocks of 2. Worker i holds the value i+1 everywhere.
    x = torch.tensor([[1.0] * 6, [2.0] * 6, [3.0] * 6])
    up = torch.ones(3, 3, dtype=torch.bool)
    up[2, 0] = False            # server 0 misses worker 2's block: averages (1 + 2) / 2
    down = torch.ones(3, 3, dtype=torch.bool)
    down[1, 0] = False          # worker 0 misses server 1's average: keeps its own block 1
    out = SimComm(3).block_average(x, up, down)
    expected = torch.tensor([[1.5, 1.5, 1.0, 1.0, 2.0, 2.0],
                             [1.5, 1.5, 2.0, 2.0, 2.0, 2.0],
                             [1.5, 1.5, 2.0, 2.0, 2.0, 2.0]])
    torch.testing.assert_close(out, expected)


def test_block_average_uneven_blocks_match_a_loop() -> None:
    w, dim = 5, 23  # blocks 5, 5, 5, 4, 4
    x = torch.randn(w, dim, generator=torch.Generator().manual_seed(0))
    net = NetworkModel(NetworkConfig(drop_rate=0.4), w, seed=1)
    links = net.sample(3)
    out = SimComm(w).block_average(x, links.up, links.down)
    bounds = [0, 5, 10, 15, 19, 23]
    for j in range(w):
        lo, hi = bounds[j], bounds[j + 1]
        senders = links.up[:, j]
        avg = x[senders, lo:hi].mean(0)
        for i in range(w):
            want = avg if links.down[j, i] else x[i, lo:hi]
            torch.testing.assert_close(out[i, lo:hi], want)


def test_server_average_is_unbiased_over_drop_draws() -> None:
    """Server j divides by the senders that arrived (never by W) and weighs every other sender alike.

    Its own block always arrives, so E[avg_j] = a v_j + (1 - a) mean_{i != j} v_i with
    a = E[1 / (1 + K)], K ~ Binomial(W - 1, 1 - p): the average over the senders that
    arrived is unbiased for the blocks it averages.
    """
    w, p, rounds = 5, 0.3, 20000
    v = torch.tensor([[1.0], [3.0], [-2.0], [7.0], [0.5]]).expand(w, w).contiguous()  # value v_i in every block
    net = NetworkModel(NetworkConfig(drop_rate=p), w, seed=4)
    comm = SimComm(w)
    total = torch.zeros(w, dtype=torch.float64)
    everyone = torch.ones(w, w, dtype=torch.bool)
    for r in range(rounds):
        up = net.sample(r).up
        out = comm.block_average(v, up, everyone)  # every worker gets the server averages
        total += out[0].double()                    # out[0, j] = avg_j
        assert torch.equal(comm.block_average(torch.full((w, w), 2.5), up, everyone), torch.full((w, w), 2.5))
    a = sum(comb(w - 1, k) * (1 - p) ** k * p ** (w - 1 - k) / (1 + k) for k in range(w))
    vals = v[:, 0].double()
    expected = torch.stack([a * vals[j] + (1 - a) * (vals.sum() - vals[j]) / (w - 1) for j in range(w)])
    # Standard error per server is about 0.02 here.
    torch.testing.assert_close(total / rounds, expected, atol=0.06, rtol=0)


def _tensors(tree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, tuple):
        return [t for item in tree for t in _tensors(item)]
    return []


@pytest.mark.parametrize("name,extra", [("rps", {}), ("local-sgd", {"period": 2}), ("ri-sgd", {}),
                                        ("allreduce", {}), ("lossy-allreduce", {}), ("dts", {"delay": 2}),
                                        ("diloco", {"period": 2}), ("local-sgd", {"period": 2, "reliable": True})])
def test_step_leaves_params_and_state_alone_and_may_only_reuse_grads(name: str, extra: dict) -> None:
    """Strategy's contract: step never writes params or state; the result equals a step on a private
    copy of the gradients, whatever the step did to the gradient buffer it was given."""
    w, dim = 4, 23                                      # 23 values in 4 blocks: uneven block sizes
    gen = torch.Generator().manual_seed(1)
    strategy = REGISTRY[name](StrategyConfig(name=name, **extra), SGD(OptimConfig(lr=0.1, momentum=0.9)))
    network = NetworkModel(NetworkConfig(drop_rate=0.3), w, seed=3)
    params = torch.randn(w, dim, generator=gen, dtype=torch.float64)
    state = strategy.init(params)
    for step in range(4):
        links = everyone(network.sample(step))
        grads = torch.randn(w, dim, generator=gen, dtype=torch.float64)
        params_before, state_before = params.clone(), [t.clone() for t in _tensors(state)]
        new, new_state, _ = strategy.step(params, grads.clone(), state, SimComm(w), links)
        assert torch.equal(params, params_before)
        assert all(torch.equal(a, b) for a, b in zip(_tensors(state), state_before))
        # The same step on a column-major copy of the gradients (which no step can write its result into)
        # gives the same numbers: writing into the gradient buffer changes nothing but where the result lives.
        column_major = grads.t().contiguous().t()
        again, again_state, _ = strategy.step(params_before, column_major, state, SimComm(w), links)
        assert torch.equal(new, again)
        assert all(torch.equal(a, b) for a, b in zip(_tensors(new_state), _tensors(again_state)))
        assert torch.equal(column_major, grads)
        params, state = new, new_state


@pytest.mark.skipif(native.FASTPATH is None, reason="the compiled library (shaky/comm/_fastpath.c) was not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_block_average_s_compiled_parts_give_the_torch_path_s_bits(monkeypatch: pytest.MonkeyPatch,
                                                                   dtype: torch.dtype) -> None:
    """Where the install built shaky/comm/_fastpath.c, the block average's arrival shares (without weights) and
    its copies run in C; a run's numbers must not depend on whether it was built: both paths give the same bits,
    in place or not, with uneven blocks, weights, moved servers, a strided input and fewer values than workers."""
    gen = torch.Generator().manual_seed(4)
    for w, dim, drop in ((16, 26122, 0.1), (5, 37, 0.5), (7, 3, 0.3), (4, 40, 0.9), (3, 0, 0.5)):
        network = NetworkModel(NetworkConfig(drop_rate=drop), w, seed=w)
        for step in range(3):
            links = network.sample(step)
            x = torch.randn(w, dim + 3, generator=gen, dtype=dtype)
            weights = torch.rand(w, generator=gen, dtype=torch.float64) + 0.5 if step == 1 else None
            servers = torch.randperm(w, generator=gen) if step == 2 else None
            for source, overwrite in ((x[:, :dim].contiguous(), False), (x[:, :dim].contiguous(), True),
                                      (x[:, 2:dim + 2], False)):
                args = (links.up, links.down)
                kwargs = {"weights": weights, "servers": servers, "overwrite": overwrite}
                compiled = SimComm(w).block_average(source.clone() if overwrite else source, *args, **kwargs)
                with monkeypatch.context() as m:
                    m.setattr(native, "FASTPATH", None)
                    reference = SimComm(w).block_average(source.clone() if overwrite else source, *args, **kwargs)
                assert torch.equal(compiled, reference), (w, dim, drop, step, overwrite)


def test_block_average_s_gpu_path_gives_the_cpu_path_s_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU's last step of the block average (one elementwise choice per group of blocks, no nonzero) run on
    the CPU: the bits of the CPU's paths, in place or not, with uneven blocks, weights, moved servers and a
    strided input."""
    import shaky.comm.sim as sim  # noqa: PLC0415

    gen = torch.Generator().manual_seed(9)
    for w, dim, drop in ((16, 2613, 0.1), (5, 37, 0.5), (7, 3, 0.3), (4, 40, 0.9)):
        network = NetworkModel(NetworkConfig(drop_rate=drop), w, seed=w)
        for step in range(3):
            links = network.sample(step)
            x = torch.randn(w, dim + 3, generator=gen)
            kwargs = {"weights": torch.rand(w, generator=gen, dtype=torch.float64) + 0.5 if step == 1 else None,
                      "servers": torch.randperm(w, generator=gen) if step == 2 else None}
            for source, overwrite in ((x[:, :dim].contiguous(), False), (x[:, :dim].contiguous(), True),
                                      (x[:, 2:dim + 2], False)):
                cpu = SimComm(w).block_average(source.clone() if overwrite else source, links.up, links.down,
                                               overwrite=overwrite, **kwargs)
                with monkeypatch.context() as m:
                    m.setattr(sim, "WHERE_ON_CPU", True)
                    where = SimComm(w).block_average(source.clone() if overwrite else source, links.up, links.down,
                                                     overwrite=overwrite, **kwargs)
                assert torch.equal(where, cpu), (w, dim, drop, step, overwrite)


def test_block_average_in_place_matches_a_fresh_result() -> None:
    w, dim = 5, 37
    gen = torch.Generator().manual_seed(2)
    network = NetworkModel(NetworkConfig(drop_rate=0.4), w, seed=5)
    for step in range(6):
        links = network.sample(step)
        x = torch.randn(w, dim, generator=gen)
        weights = torch.rand(w, generator=gen, dtype=torch.float64) + 0.5
        servers = torch.randperm(w, generator=gen) if step % 2 else None
        fresh = SimComm(w).block_average(x, links.up, links.down, weights=weights, servers=servers)
        buffer = x.clone()
        result = SimComm(w).block_average(buffer, links.up, links.down, weights=weights, servers=servers,
                                          overwrite=True)
        assert result.data_ptr() == buffer.data_ptr()      # written in place
        assert torch.equal(result, fresh)
