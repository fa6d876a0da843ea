"""shaky.ModelAverager / RPSAverager in a user's own torch.distributed loop (issue 13, item 7).

Two gloo processes on 127.0.0.1 run every scenario once (one start for the whole
file); each rank saves what it saw, and the tests below check it: parameters keep
their dtypes, BatchNorm buffers are averaged (or left alone), network matrices
are checked against the world size, a restarted averager continues bit for bit,
and the averager plugs into torch's PostLocalSGDOptimizer.
"""

from __future__ import annotations

import io
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shaky.comm.sim import SimComm
from shaky.config import NetworkConfig
from shaky.network.model import NetworkModel

from conftest import free_port

WORKERS = 2
DTYPE_SEED, DTYPE_ROUNDS = 3, 3
RESUME = dict(network={"drop_rate": 0.3, "burst_enter": 0.2}, period=2, warmup_steps=3, seed=5)
RESUME_STEPS, RESUME_AT = 12, 7


# ------------------------------------------------------------------------------------------------------------------
# What each rank runs


def _dtypes(rank: int) -> dict[str, Any]:
    import shaky  # noqa: PLC0415

    torch.manual_seed(rank)  # different models on the two ranks
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3).double(), torch.nn.Linear(3, 2))
    before = [p.detach().clone() for p in model.parameters()]
    pointers = [p.data_ptr() for p in model.parameters()]
    averager = shaky.RPSAverager(model, network={"drop_rate": 0.5}, seed=DTYPE_SEED)
    for _ in range(DTYPE_ROUNDS):
        averager.step()
    return {"before": before, "after": [p.detach().clone() for p in model.parameters()],
            "same_storage": [p.data_ptr() for p in model.parameters()] == pointers,
            "messages": (averager.messages_sent, averager.messages_dropped)}


def _bn_model(rank: int) -> torch.nn.Module:
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    model(torch.randn(16, 4, generator=torch.Generator().manual_seed(10 + rank)))  # running stats differ per rank
    return model


def _buffers(rank: int) -> dict[str, Any]:
    import shaky  # noqa: PLC0415

    out: dict[str, Any] = {}
    for average_buffers in (True, False):
        model = _bn_model(rank)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        # The default averages them; the opt-out is named.
        averager = shaky.ModelAverager(model) if average_buffers else shaky.ModelAverager(model, average_buffers=False)
        averager.step()
        out[average_buffers] = {"before": before, "after": {k: v.clone() for k, v in model.state_dict().items()}}
    return out


def _network(rank: int) -> dict[str, Any]:
    import shaky  # noqa: PLC0415

    model = torch.nn.Linear(4, 2)
    averager = shaky.RPSAverager(model, network={"drop_rate": [[0.0, 0.5], [0.5, 0.0]]})
    averager.step()
    out: dict[str, Any] = {"2x2_messages": averager.messages_sent}
    bad = {"3x3_drop_rate": {"drop_rate": [[0.1] * 3] * 3},
           "3x3_latency": NetworkConfig(latency_ms=((0.5,) * 3,) * 3),
           "trace": {"trace": "some/run"}}
    for name, network in bad.items():
        try:
            shaky.RPSAverager(model, network=network)
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    udp_bad = {"udp_only_on_gloo": {"deadline_ms": 50}, "bad_transport": {"transport": "tcp"},
               "bad_deadline": {"transport": "udp", "deadline_ms": -1}, "bad_ports": {"transport": "udp", "ports": "9-1"},
               "drawn_loss_on_udp": {"transport": "udp", "network": {"drop_rate": 0.1}}}
    for name, kwargs in udp_bad.items():   # refused before any socket or collective
        try:
            shaky.RPSAverager(model, **kwargs)
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    return out


def _resume_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(RESUME_STEPS * 8, 6, generator=g), torch.randint(3, (RESUME_STEPS * 8,), generator=g)


def _resume_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _train(rank: int, model: torch.nn.Module, opt: Any, steps: range, after: Any = None) -> None:
    x, y = _resume_data(rank)
    for t in steps:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[8 * t:8 * t + 8]), y[8 * t:8 * t + 8]).backward()
        opt.step()
        if after is not None:
            after()


def _resume(rank: int, out: Path) -> dict[str, Any]:
    import shaky  # noqa: PLC0415

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
        model = _resume_model()
        averager = shaky.ModelAverager(model, outer_optimizer=shaky.OuterSGD(lr=0.7, momentum=0.9), **RESUME)
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), averager

    def counters(a: Any) -> tuple[int, ...]:
        return a.steps, a.rounds, a.bytes_sent, a.messages_sent, a.messages_dropped

    model, opt, averager = build()  # the uninterrupted run
    _train(rank, model, opt, range(RESUME_STEPS), averager.step)
    results: dict[str, Any] = {"uninterrupted": model.state_dict(), "uninterrupted_counters": counters(averager)}

    model, opt, averager = build()  # stopped after RESUME_AT steps, restarted from its checkpoint
    _train(rank, model, opt, range(RESUME_AT), averager.step)
    path = out / f"checkpoint{rank}.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "averager": averager.state_dict()}, path)
    for restore in (True, False):  # without the averager's state: the control, which must end elsewhere
        model, opt, averager = build()
        checkpoint = torch.load(path)  # weights_only: plain values and tensors
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["opt"])
        if restore:
            averager.load_state_dict(checkpoint["averager"])
        _train(rank, model, opt, range(RESUME_AT, RESUME_STEPS), averager.step)
        results["restarted" if restore else "fresh_averager"] = model.state_dict()
        if restore:
            results["restarted_counters"] = counters(averager)
    try:
        shaky.ModelAverager(_resume_model(), outer_optimizer=shaky.OuterSGD(), **{**RESUME, "seed": 6}) \
            .load_state_dict(checkpoint["averager"])
        results["other_seed"] = None
    except ValueError as exc:
        results["other_seed"] = str(exc)
    return results


def _post_local_sgd(rank: int) -> dict[str, Any]:
    import shaky  # noqa: PLC0415
    from torch.distributed.optim import PostLocalSGDOptimizer  # noqa: PLC0415

    network = {"drop_rate": 0.3}
    out: dict[str, Any] = {}
    model = _resume_model()  # ours inside torch's PostLocalSGDOptimizer
    averager = shaky.ModelAverager(model, network=network, period=2, seed=1)
    opt = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), averager.torch_averager())
    _train(rank, model, opt, range(6))
    out["post_local_sgd"] = [p.detach().clone() for p in model.parameters()]
    out["messages"] = averager.messages_sent
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    again = shaky.ModelAverager(model, network=network, period=2, seed=1)
    PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), again.torch_averager()) \
        .load_state_dict(torch.load(buf))
    out["restored_steps"] = (again.steps, again.rounds)

    model = _resume_model()  # the same with averager.step() in a plain loop
    averager = shaky.ModelAverager(model, network=network, period=2, seed=1)
    _train(rank, model, torch.optim.SGD(model.parameters(), lr=0.1), range(6), averager.step)
    out["plain"] = [p.detach().clone() for p in model.parameters()]

    model = _resume_model()  # no drops: after an averaging step the ranks agree
    averager = shaky.ModelAverager(model, period=2)
    _train(rank, model, PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                              averager.torch_averager()), range(4))
    out["no_drops"] = [p.detach().clone() for p in model.parameters()]

    opt = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), averager)  # the averager itself
    _train(rank, model, opt, range(2))
    try:
        torch.save(opt.state_dict(), io.BytesIO())
        out["direct_save"] = None
    except TypeError as exc:
        out["direct_save"] = str(exc)
    return out


def _worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORKERS,
                            timeout=timedelta(seconds=30))
    scenarios = {"dtypes": lambda: _dtypes(rank), "buffers": lambda: _buffers(rank), "network": lambda: _network(rank),
                 "resume": lambda: _resume(rank, Path(out)), "post_local_sgd": lambda: _post_local_sgd(rank)}
    results: dict[str, Any] = {}
    for name, scenario in scenarios.items():
        try:  # one scenario's failure is its test's, not every test's
            results[name] = scenario()
        except Exception as exc:  # noqa: BLE001
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("averager")
    context = mp.start_processes(_worker, args=(free_port(), str(out)), nprocs=WORKERS, start_method="spawn",
                                 join=False)
    deadline = time.monotonic() + 120
    while not context.join(timeout=1):  # raises if a rank failed
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the averager's 2-process run did not finish within 120 s")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORKERS)]


def _runs(ranks: list[dict[str, Any]], scenario: str) -> list[Any]:
    """Each rank's results of one scenario (the test fails with the rank's error if it raised)."""
    for rank, results in enumerate(ranks):
        if "error" in results[scenario]:
            pytest.fail(f"rank {rank}: {results[scenario]['error']}")
    return [results[scenario] for results in ranks]


# ------------------------------------------------------------------------------------------------------------------
# The checks


def test_parameters_keep_their_dtypes_and_storage(ranks) -> None:
    """A float64 layer among float32 ones: every parameter keeps its dtype and storage, and each dtype group is
    exactly the simulator's block average with the round's masks (the same masks for both groups)."""
    runs = _runs(ranks, "dtypes")
    assert [p.dtype for p in runs[0]["after"]] == [torch.float32] * 2 + [torch.float64] * 2 + [torch.float32] * 2
    assert all(run["same_storage"] for run in runs)
    groups = [[0, 1, 4, 5], [2, 3]]  # float32, then float64 (order of first appearance)
    network = NetworkModel(NetworkConfig(drop_rate=0.5), WORKERS, DTYPE_SEED)
    dropped = 0
    expected = [torch.stack([torch.cat([run["before"][i].reshape(-1) for i in g]) for run in runs]) for g in groups]
    for r in range(DTYPE_ROUNDS):
        links = network.sample(r)
        dropped += int((~links.up).sum() + (~links.down).sum())
        expected = [SimComm(WORKERS).block_average(x, links.up, links.down) for x in expected]
    assert dropped > 0  # the masks lost something: the check can tell a lossy average from the mean
    for rank, run in enumerate(runs):
        for g, x in zip(groups, expected):
            torch.testing.assert_close(torch.cat([run["after"][i].reshape(-1) for i in g]), x[rank])
        # One message per link and phase carries both groups' blocks: counted once, lost once.
        assert run["messages"] == (DTYPE_ROUNDS * 2 * WORKERS * (WORKERS - 1), dropped)


def test_batchnorm_buffers_are_averaged_unless_opted_out(ranks) -> None:
    runs = _runs(ranks, "buffers")
    on, off = [r[True] for r in runs], [r[False] for r in runs]
    for key in ("1.running_mean", "1.running_var"):
        assert not torch.equal(on[0]["before"][key], on[1]["before"][key])
        mean = (on[0]["before"][key] + on[1]["before"][key]) / 2
        for run in on:
            torch.testing.assert_close(run["after"][key], mean)
        for run in off:  # average_buffers=False: every buffer untouched
            assert torch.equal(run["after"][key], run["before"][key])
    for run in on + off:  # integer counters are left alone, and stay integers
        assert run["after"]["1.num_batches_tracked"].dtype == torch.int64
        assert run["after"]["1.num_batches_tracked"].item() == 1
    for runs in (on, off):  # the parameters are averaged either way
        assert not torch.equal(runs[0]["before"]["0.weight"], runs[1]["before"]["0.weight"])
        torch.testing.assert_close(runs[0]["after"]["0.weight"], runs[1]["after"]["0.weight"])


def test_network_matrices_are_checked_against_the_world_size(ranks) -> None:
    for run in _runs(ranks, "network"):
        assert run["2x2_messages"] == 2 * WORKERS * (WORKERS - 1)  # accepted, and it exchanged
        assert run["3x3_drop_rate"] == ("network.drop_rate is a 3x3 matrix but the world size is 2; "
                                        "give one number or a 2x2 matrix")
        assert run["3x3_latency"].startswith("network.latency_ms is a 3x3 matrix but the world size is 2")
        assert run["trace"].startswith("network.trace is not supported by the averager")
        assert all("\n" not in run[k] for k in ("3x3_drop_rate", "3x3_latency", "trace"))
        assert run["udp_only_on_gloo"].startswith("dist.deadline_ms = 50 applies only with dist.transport")
        assert run["bad_transport"].startswith("dist.transport must be one of")
        assert run["bad_deadline"].startswith("dist.deadline_ms must be a positive number")
        assert run["bad_ports"].startswith("dist.ports must be FIRST-LAST")
        assert run["drawn_loss_on_udp"].startswith("network drop_rate/burst_enter (0.1/0.0) are drawn losses")


def test_state_dict_round_trip_continues_bit_for_bit(ranks) -> None:
    """Stopped after 7 of 12 steps (inside the drop pattern, with bursts, DiLoCo's outer momentum and BatchNorm),
    saved with torch.save and restored into a fresh averager: the same model, bit for bit, as without the stop."""
    for run in _runs(ranks, "resume"):
        assert run["restarted"].keys() == run["uninterrupted"].keys()
        for key, value in run["uninterrupted"].items():
            assert torch.equal(run["restarted"][key], value), key
        assert run["restarted_counters"] == run["uninterrupted_counters"]
        steps, rounds, _, sent, dropped = run["uninterrupted_counters"]
        assert (steps, rounds, sent) == (12, 5, 5 * 2 * WORKERS * (WORKERS - 1)) and dropped > 0
        # Without the averager's state the continuation differs: the check can tell.
        assert not torch.equal(run["fresh_averager"]["0.weight"], run["uninterrupted"]["0.weight"])
        assert run["other_seed"] == "state_dict was saved with seed = 5, but this averager has seed = 6"


def test_post_local_sgd_optimizer_with_our_averager(ranks) -> None:
    runs = _runs(ranks, "post_local_sgd")
    for run in runs:
        assert run["messages"] == 3 * 2 * WORKERS * (WORKERS - 1)  # 6 steps, period 2: three lossy rounds
        for ours, plain in zip(run["post_local_sgd"], run["plain"]):
            assert torch.equal(ours, plain)  # the same as averager.step() after optimizer.step()
        assert run["restored_steps"] == (6, 3)  # its state_dict's step counter is the averager's
        assert run["direct_save"].startswith("a shaky averager cannot be pickled")
    for a, b in zip(runs[0]["no_drops"], runs[1]["no_drops"]):
        torch.testing.assert_close(a, b)
