"""DTS: equivalences with allreduce and local SGD, the delayed update by hand, drops, the clock, bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shaky.cli import main
from shaky.comm.sim import SimComm
from shaky.config import OptimConfig, StrategyConfig
from shaky.geometry import LinkSample
from shaky.strategies import SGD, REGISTRY

from conftest import everyone, make_config, run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------
# Equivalences the maths promises


def test_delay_1_period_1_equals_allreduce(tmp_run) -> None:
    """In float64: the two paths add the same numbers in another order (the update's sum, then its mean, against
    the gradients' mean), so in float32 a ReLU near zero flips on some CPUs' kernels (MKL's AVX-512 ones summed
    1.3e-4 apart after 50 steps) and the runs part; in float64 the order costs ~1e-16 a step."""
    base = dict(num_workers=4, steps=50, dtype="float64", network={"drop_rate": 0.0})
    _, dts, dts_rows = run(make_config(strategy={"name": "dts"}, **base), tmp_run())
    _, sync, sync_rows = run(make_config(strategy={"name": "allreduce"}, **base), tmp_run())
    assert (dts - sync).abs().max().item() <= 1e-12
    assert [r["test_accuracy"] for r in dts_rows] == [r["test_accuracy"] for r in sync_rows]


def test_delay_1_equals_allreduce_with_momentum_and_weight_decay(tmp_run) -> None:
    """Each worker keeps its own momentum; the average of the buffers follows allreduce's buffer exactly."""
    base = dict(num_workers=4, steps=30, dtype="float64", optim={"momentum": 0.9, "weight_decay": 1e-3})
    _, dts, _ = run(make_config(strategy={"name": "dts"}, **base), tmp_run())
    _, sync, _ = run(make_config(strategy={"name": "allreduce"}, **base), tmp_run())
    assert (dts - sync).abs().max().item() <= 1e-12


@pytest.mark.parametrize("period", [3, 5])
def test_delay_1_with_period_d_equals_local_sgd_with_tau_d(period: int, tmp_run) -> None:
    base = dict(num_workers=4, steps=40, dtype="float64", network={"drop_rate": 0.0})   # (float64: see above)
    _, dts, dts_rows = run(make_config(strategy={"name": "dts", "period": period}, **base), tmp_run())
    _, local, local_rows = run(make_config(strategy={"name": "local-sgd", "period": period}, **base), tmp_run())
    assert (dts - local).abs().max().item() <= 1e-12
    assert [r["comm_rounds"] for r in dts_rows] == [r["comm_rounds"] for r in local_rows]


# ---------------------------------------------------------------------------
# The update rule against a direct transcription of the formulas


def _drive(t: int, d: int, correction: bool, steps: int = 12, w: int = 3, dim: int = 6,
           links: LinkSample | None = None) -> tuple[list[torch.Tensor], torch.Tensor, list]:
    """Runs DTS on fixed gradients (they ignore the model); returns the params after each step."""
    gen = torch.Generator().manual_seed(0)
    grads = torch.randn(steps, w, dim, generator=gen, dtype=torch.float64)
    strategy = REGISTRY["dts"](StrategyConfig(name="dts", delay=t, period=d, correction=correction),
                               SGD(OptimConfig(lr=0.1)))
    everything = torch.ones(w, w, dtype=torch.bool)
    links = links or LinkSample(0, everything, everything)
    params = torch.randn(w, dim, generator=gen, dtype=torch.float64)
    history, stats = [params], []
    state = strategy.init(params)
    for n in range(steps):
        params, state, s = strategy.step(params, grads[n], state, SimComm(w), everyone(links, n))
        history.append(params)
        stats.append(s)
    return history, grads, stats


@pytest.mark.parametrize("t", [1, 2, 4])
def test_delayed_update_follows_the_paper(t: int) -> None:
    """w(n) = w(n-1) - lr (g(n-1) - g(n-t) + gbar(n-t)); without the correction w(n) = w(n-1) - lr gbar(n-t)."""
    for correction in (True, False):
        history, g, _ = _drive(t, 1, correction)
        gbar = g.mean(dim=1, keepdim=True).expand_as(g)
        w = history[0]
        for n in range(1, len(history)):
            old = n - t  # the step whose average arrives now (none before step t)
            if correction:
                w = w - 0.1 * (g[n - 1] - (g[old] - gbar[old] if old >= 0 else 0))
            elif old >= 0:
                w = w - 0.1 * gbar[old]
            torch.testing.assert_close(history[n], w, rtol=0, atol=1e-12)


@pytest.mark.parametrize("t,d", [(1, 3), (3, 2), (5, 2), (4, 4), (2, 5)])
def test_period_and_delay_compose(t: int, d: int) -> None:
    """Every step a worker adds its update; t - 1 steps after a period ends it swaps the period's sum
    of its own updates for the average sum (or, without the correction, adds only the average)."""
    steps = 14
    for correction in (True, False):
        history, g, stats = _drive(t, d, correction, steps=steps)
        u = -0.1 * g
        w = history[0]
        for n in range(steps):
            if correction:
                w = w + u[n]
            launch_end = n - (t - 1)  # the last step of the period whose average is applied now
            if launch_end >= 0 and (launch_end + 1) % d == 0:
                period = u[launch_end - d + 1:launch_end + 1].sum(dim=0)
                avg = period.mean(dim=0, keepdim=True)
                w = w + (avg - period if correction else avg)
            torch.testing.assert_close(history[n + 1], w, rtol=0, atol=1e-12)
        launched = [n for n, s in enumerate(stats) if s.phases]
        assert launched == [n for n in range(steps) if (n + 1) % d == 0]
        assert all(stats[n].delay == t for n in launched)


def test_a_lost_block_keeps_the_workers_own_update() -> None:
    """The averages go through the lossy block exchange: a worker that misses a block keeps its own."""
    w = 3  # blocks of 2 values (6 in all), served by workers 0, 1, 2
    up = torch.ones(w, w, dtype=torch.bool)
    up[2, 0] = False     # server 0 averages block 0 over workers 0 and 1 only
    down = torch.ones(w, w, dtype=torch.bool)
    down[1, 0] = False   # worker 0 misses server 1's average of block 1
    history, g, stats = _drive(1, 1, True, steps=1, links=LinkSample(0, up, down))
    u = -0.1 * g[0]
    expected = history[0] + u.mean(dim=0, keepdim=True)
    expected[:, 0:2] = history[0][:, 0:2] + u[:2, 0:2].mean(dim=0)
    expected[0, 2:4] = history[0][0, 2:4] + u[0, 2:4]
    torch.testing.assert_close(history[1], expected, rtol=0, atol=1e-12)
    assert stats[0].messages_dropped == 2 and not stats[0].phases[0].reliable


# ---------------------------------------------------------------------------
# Training: traffic, the clock's overlap, resume


def test_delay_hides_latency_on_the_clock(tmp_run) -> None:
    # 1 ms of compute against 5 ms links: a synchronous step costs 1 ms + an exchange C (two phases, ~10 ms).
    # With t = d = 4 an exchange has 3 ms of compute to arrive in, then the workers wait for it; t = d = 12
    # hides it completely.
    common = dict(num_workers=4, steps=24, network={"latency_ms": 5.0, "compute_ms": 1.0})
    sync, _, _ = run(make_config(strategy={"name": "dts"}, **common), tmp_run())
    late, _, _ = run(make_config(strategy={"name": "dts", "delay": 4, "period": 4}, **common), tmp_run())
    hidden, _, _ = run(make_config(strategy={"name": "dts", "delay": 12, "period": 12}, **common), tmp_run())
    assert sync["comm_rounds"] == 24 and late["comm_rounds"] == 6 and hidden["comm_rounds"] == 2
    exchange = sync["sim_time_s"] / 24 - 0.001
    assert exchange == pytest.approx(0.010, rel=0.02) and sync["scalability"] < 0.1
    # The first average arrives 4 ms + C in, each next one 1 ms + C later (it is launched one step
    # after the wait); the last of the 6 is still in flight when step 23 ends, 1 ms after the 5th.
    assert late["sim_time_s"] == pytest.approx(0.004 + exchange + 4 * (0.001 + exchange) + 0.001, rel=1e-9)
    assert hidden["scalability"] == pytest.approx(1.0)
    assert sync["bytes_sent"] == 4 * late["bytes_sent"]


@pytest.mark.parametrize("rejoin", [13, -1])
def test_a_rejoining_worker_takes_the_average_state(rejoin: int, tmp_run) -> None:
    """t = 1, d = 5 at drop 0: right after each average every live worker holds the same model, also the one
    that came back with the others' average model in the middle of a period (it swaps their average update)."""
    cfg = make_config(num_workers=4, steps=20, eval_every=5, strategy={"name": "dts", "period": 5}, dtype="float64",
                      failures=[{"worker": 1, "step": 7, "rejoin": rejoin}])
    summary, params, rows = run(cfg, tmp_run())
    assert [r["live_workers"] for r in rows] == [4, 4, 3, 3 if rejoin == -1 else 4, 3 if rejoin == -1 else 4]
    live = params if rejoin != -1 else params[[0, 2, 3]]
    assert (live - live.mean(dim=0)).abs().max().item() <= 1e-12
    assert rows[-1]["consensus_distance"] <= 1e-10


# ---------------------------------------------------------------------------
# Bad input: one line naming the field, exit status 2, nothing written


def _bad(argv: list[str], capsys: pytest.CaptureFixture[str], root: Path) -> str:
    before = sorted(root.rglob("*"))
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's own errors exit from inside parse_args
        rc = exc.code
    assert rc == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert sorted(root.rglob("*")) == before
    return err.strip()


@pytest.mark.parametrize("argv,expected", [
    (["--set", "strategy.delay=0"], "strategy.delay must be >= 1, got 0"),
    (["--set", "strategy.period=0"], "strategy.period must be >= 1, got 0"),
    (["--workers", "2", "--set", "network.latency_ms=[[0, 1, 1], [1, 0, 1], [1, 1, 0]]"],
     "network.latency_ms is a 3x3 matrix but num_workers is 2"),
    (["--workers", "2", "--set", "network.latency_ms=[[0, 1], [1, 0, 2]]"],
     "network.latency_ms must be a square matrix; row 1 has 3 entries, expected 2"),
    (["--workers", "2", "--set", "network.latency_ms=[[0, -5], [1, 0]]"],
     "network.latency_ms[0][1] must be in [0, inf), got -5.0"),
    (["--preset", "geo4", "--set", 'network.regions=["oregon", "paris"]'],
     "network.regions[1] must be one of oregon, ohio, london, tokyo; got 'paris'"),
    (["--preset", "geo4", "--set", "network.latency_ms=[[0, 1], [1, 0]]", "--workers", "2"],
     "network.latency_ms must be one number (the link inside a region) when network.regions is set"),
])
def test_bad_input_names_the_field(argv: list[str], expected: str, tmp_path: Path, monkeypatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert expected in _bad(["train", "--strategy", "dts", *argv], capsys, tmp_path)


@pytest.mark.parametrize("argv,expected", [
    (["--delay", "0"], "--delay must be >= 1, got 0"),
    (["--worker-counts", "4,0"], "--worker-counts must be in [1, 256], got 0"),
    (["--config", "missing.toml"], "config file 'missing.toml' cannot be read"),
    (["--latencies-ms", "0,-5"], "--latencies-ms must be a number >= 0, got -5.0"),
    (["--compute-ms", "0"], "--compute-ms must be a positive number, got 0.0"),
    (["--set", 'network.regions=["mars"]'], "network.regions[0] must be one of oregon, ohio, london, tokyo"),
    (["--set", "optim.lr=0.1"], "--set takes network settings only"),
    (["--worker-counts", "4,x"], "argument --worker-counts: expected comma-separated ints, got '4,x'"),
])
def test_scale_bad_input(argv: list[str], expected: str, tmp_path: Path, monkeypatch,
                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert expected in _bad(["scale", *argv], capsys, tmp_path)


def test_scale_prints_a_table_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plots" / "scale.png"
    assert main(["scale", "--workers", "8", "--worker-counts", "4,8", "--latencies-ms", "0,500",
                 "--params", "1e6", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| one-way latency between regions (ms) | allreduce" in text and "| 500 " in text
    assert "recommended t = d =" in text
    assert out.read_bytes().startswith(PNG_MAGIC) and out.with_suffix(".md").exists()


def test_scale_prices_your_own_matrices_from_a_toml_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    net = tmp_path / "mynet.toml"
    net.write_text("num_workers = 3\n[network]\nlatency_ms = [[0, 40, 80], [40, 0, 60], [80, 60, 0]]\n"
                   "bandwidth_mbps = [[10000, 200, 100], [200, 10000, 200], [100, 200, 10000]]\n")
    assert main(["scale", "--config", str(net), "--latencies-ms", "0", "--params", "1e6",
                 "--out", str(tmp_path / "s.png")]) == 0
    text = capsys.readouterr().out
    assert "one site" in text and "| 3 " in text  # the worker sweep holds the file's W only


def test_geo4_training_charges_the_wan(tmp_run) -> None:
    common = dict(num_workers=8, steps=8, eval_every=8, network={"preset": "geo4", "compute_ms": 300.0})
    sync, _, _ = run(make_config(strategy={"name": "allreduce"}, **common), tmp_run())
    dts, _, _ = run(make_config(strategy={"name": "dts", "delay": 4, "period": 4}, **common), tmp_run())
    # A 26k-value MLP: 104 KB per exchange; the ring's 14 hops each wait for the London -> Tokyo link (108 ms).
    assert sync["sim_time_s"] > 8 * (0.3 + 14 * 0.1079) and sync["scalability"] < 0.2
    assert dts["scalability"] == pytest.approx(1.0)
