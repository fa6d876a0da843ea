"""Values on the wire in fewer bytes (strategy.value_dtype, shaky.comm.quant): the rounding, the streams' rule,
the bytes the clock counts, and runs that resume, replay and refuse as every run does."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from shaky.comm import quant
from shaky.comm.quant import FORMATS, GROUP, group_ids, round_trip, segment_index
from shaky.comm.sim import SimComm
from shaky.geometry import LinkSample, block_sizes, segment_length
from shaky.network.faults import Membership
from shaky.strategies.exchange import block_exchange_traffic
from shaky.train import InterruptedRun, prepare, read_metrics, train

from conftest import make_config, run, stop_at, unmeasured, without_wall_time


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
def test_a_float_format_is_the_cast(name: str) -> None:
    d = torch.randn(3, 1000, dtype=torch.float64)
    assert torch.equal(round_trip(d, FORMATS[name], None), d.to(getattr(torch, name)).double())


def test_int8_rounds_each_group_to_half_a_step_of_its_own_scale() -> None:
    torch.manual_seed(0)
    dim, w, seg = 5000, 4, 700
    # groups of very different sizes side by side: each keeps its own precision
    d = torch.randn(2, dim, dtype=torch.float64) * torch.logspace(-6, 0, dim, dtype=torch.float64)
    groups = group_ids(dim, w, seg)
    back = round_trip(d, FORMATS["int8"], groups)
    ids, count = groups
    amax = torch.zeros(2, count, dtype=torch.float64).scatter_reduce_(1, ids.expand(2, -1), d.abs(), "amax")
    step = (amax / 127).float().double()[:, ids]
    assert bool(((back - d).abs() <= step / 2 * (1 + 1e-6)).all())
    q, scale = quant.encode(d, FORMATS["int8"], groups)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and int(q.abs().max()) == 127
    assert torch.equal(quant.decode(q, scale, torch.float64, groups), back)
    zeros = torch.zeros(1, dim)
    assert torch.equal(round_trip(zeros, FORMATS["int8"], groups), zeros)


def test_a_group_never_crosses_a_segment_or_a_block() -> None:
    dim, w, seg = 3001, 3, 600
    ids, count = group_ids(dim, w, seg)
    start = 0
    seen: set[int] = set()
    for n in block_sizes(dim, w):
        for k in range(-(-n // seg)):
            part = ids[start + k * seg:start + min((k + 1) * seg, n)]
            assert not (set(part.tolist()) & seen)              # no group shared with another segment
            assert int(torch.bincount(part).max()) <= GROUP
            seen |= set(part.tolist())
        start += n
    assert len(seen) == count


def _round(comm: SimComm, x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, ref, sync, carry, fmt,
           seg_bytes: int):
    links = LinkSample(0, up, down, seg_bytes)
    return quant.quantized_block_average(comm.server_averages, x, links, Membership.everyone(x.shape[0]),
                                         ref, sync, carry, fmt)


def test_the_streams_hold_under_loss_and_the_rounding_does_not_accumulate() -> None:
    """Random losses for many rounds: every worker in sync on a segment holds exactly its server's value, a
    worker that took a segment holds the stream's value there, and the stream stays within half a step of the
    exact average of what was sent: the error of one round is not carried into the next."""
    gen = torch.Generator().manual_seed(1)
    w, dim, seg_bytes, fmt = 4, 2000, 300, FORMATS["int8"]
    seg = segment_length(seg_bytes, 8)
    comm = SimComm(w)
    s = max(-(-n // seg) for n in block_sizes(dim, w))
    x = torch.randn(w, dim, dtype=torch.float64, generator=gen)
    ref, sync, carry = torch.zeros_like(x), x.new_zeros(w, 1, 1), torch.zeros_like(x)
    blk, sidx = segment_index(dim, w, seg)
    rounded_rounds = 0
    for _ in range(60):
        up = torch.rand(w, w, s, generator=gen) > 0.3
        down = torch.rand(w, w, s, generator=gen) > 0.3
        x = x - 0.01 * torch.randn(w, dim, dtype=torch.float64, generator=gen)   # a local step each
        out, ref, sync, carry, up_q, down_q = _round(comm, x, up, down, ref, sync, carry, fmt, seg_bytes)
        rounded_rounds += int(up_q.any())
        insync = sync == (torch.arange(w) + 1).double()[None, :, None]     # worker j serves block j
        server_value = ref[blk, torch.arange(dim)]       # worker j serves block j
        held = insync[:, blk, sidx]
        assert torch.equal(torch.where(held, ref, 0.0), torch.where(held, server_value[None], 0.0))
        assert torch.equal(torch.where(held, out, 0.0), torch.where(held, server_value[None], 0.0))
        assert torch.equal(torch.where(~held, out, 0.0), torch.where(~held, x, 0.0))   # the rest kept its own
        x = out
    # From the second round on, rounded values travel, but a rounded segment of float64 rows in int8 holds 8
    # parts, sent rounded only by a worker in sync on all 8: at 30% loss a round may have none.
    assert rounded_rounds >= 50, rounded_rounds


def test_a_block_that_moves_starts_its_stream_again_whole() -> None:
    """Worker 3 dies and its block moves to worker 0: nobody holds worker 0's stream of it, so that round every
    segment of it travels whole (and its average is the plain one); from the next round on it is rounded
    again. No loss, so the rest of the row is unaffected."""
    gen = torch.Generator().manual_seed(3)
    w, dim, fmt = 4, 800, FORMATS["int8"]
    comm = SimComm(w)
    every = torch.ones(w, w, dtype=torch.bool)
    links = LinkSample(0, every, every.clone())
    x = torch.randn(w, dim, dtype=torch.float64, generator=gen)
    ref, sync, carry = torch.zeros_like(x), x.new_zeros(w, 1, 1), torch.zeros_like(x)
    for _ in range(3):
        x = x + 0.01 * torch.randn(w, dim, dtype=torch.float64, generator=gen)
        x, ref, sync, carry, up_q, _ = quant.quantized_block_average(
            comm.server_averages, x, links, Membership.everyone(w), ref, sync, carry, fmt)
    assert bool(up_q[~torch.eye(w, dtype=torch.bool)].all())
    live = torch.tensor([True, True, True, False])
    moved = Membership(live, torch.tensor([0, 1, 2, 0]), torch.zeros(w, dtype=torch.bool),
                       torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=torch.float64), False, False)
    last = block_sizes(dim, w)[-1]
    for expect_rounded in (False, True):
        x = x + 0.01 * torch.randn(w, dim, dtype=torch.float64, generator=gen)
        before = x.clone()
        x, ref, sync, carry, up_q, down_q = quant.quantized_block_average(
            comm.server_averages, x, links, moved, ref, sync, carry, fmt)
        assert up_q[1:3, 3].tolist() == [expect_rounded] * 2      # workers 1 and 2 send block 3 to worker 0
        assert down_q[3, 1:3].tolist() == [expect_rounded] * 2    # and get its average back
        if not expect_rounded:   # whole: the block's average is the plain mean of the live workers' values
            mean = before[:3, dim - last:].mean(0)
            assert torch.allclose(x[0, dim - last:], mean, rtol=0, atol=1e-15)
        assert bool(up_q[1:3, 0].all())                 # worker 0's own block streams on


def test_without_loss_int8_rps_stays_next_to_float_rps() -> None:
    """No loss, 200 rounds of drift: the int8 stream stays within a rounding step of the exact average every
    round, and does not drift away from it (the error does not accumulate)."""
    gen = torch.Generator().manual_seed(2)
    w, dim, fmt = 4, 1024, FORMATS["int8"]
    comm = SimComm(w)
    every = torch.ones(w, w, dtype=torch.bool)
    x = torch.randn(w, dim, dtype=torch.float64, generator=gen)
    exact = x.clone()
    ref, sync, carry = torch.zeros_like(x), x.new_zeros(w, 1, 1), torch.zeros_like(x)
    worst = []
    for _ in range(200):
        step = 1e-3 * torch.randn(w, dim, dtype=torch.float64, generator=gen)
        x, exact = x + step, exact + step
        x, ref, sync, carry, _, _ = _round(comm, x, every, every, ref, sync, carry, fmt, 0)
        exact = exact.mean(0, keepdim=True).expand(w, dim).clone()
        worst.append(float((x - exact).abs().max()))
    assert max(worst[1:]) < 1e-4                   # a step of the updates' own scale, not of the weights'
    assert np.mean(worst[150:]) < 2 * np.mean(worst[10:60])


def test_the_clock_counts_the_bytes_that_travel() -> None:
    w, dim, fmt = 4, 10_000, FORMATS["int8"]
    x = torch.zeros(w, dim)
    every = torch.ones(w, w, dtype=torch.bool)
    links = LinkSample(0, every, every.clone())
    rounded = ~torch.eye(w, dtype=torch.bool)
    whole = sum(p.bytes_sent for p in block_exchange_traffic(x, w, links, reliable=False))
    sent = sum(p.bytes_sent for p in block_exchange_traffic(x, w, links, reliable=False, fmt=fmt,
                                                            rounded=(rounded, rounded)))
    per_block = [n + 4 * -(-n // GROUP) for n in block_sizes(dim, w)]
    assert whole == 2 * (w - 1) * dim * 4
    assert sent == 2 * (w - 1) * sum(per_block)
    # a message sent whole counts whole
    half = rounded & (torch.arange(w)[:, None] < 2)
    mixed = sum(p.bytes_sent for p in block_exchange_traffic(x, w, links, reliable=False, fmt=fmt,
                                                             rounded=(half, rounded)))
    assert whole > mixed > sent


@pytest.mark.parametrize("strategy", [{"name": "rps"}, {"name": "diloco", "period": 5},
                                      {"name": "diloco", "period": 5, "reliable": True}, {"name": "allreduce"},
                                      {"name": "dts", "delay": 3, "period": 2}])
def test_int8_trains_like_float_and_sends_under_half_the_bytes(strategy: dict, tmp_run) -> None:
    base = make_config(steps=100, eval_every=50, strategy=strategy, network={"drop_rate": 0.1})
    full, _, _ = run(base, tmp_run())
    small, _, _ = run(make_config(steps=100, eval_every=50, strategy={**strategy, "value_dtype": "int8"},
                                  network={"drop_rate": 0.1}), tmp_run())
    assert abs(small["final_test_accuracy"] - full["final_test_accuracy"]) <= 0.02, (small, full)
    assert small["bytes_sent"] < 0.45 * full["bytes_sent"], (small["bytes_sent"], full["bytes_sent"])


def test_a_quantized_run_resumes_bit_identically_and_replays_its_trace(tmp_run) -> None:
    cfg = make_config(steps=40, eval_every=10, checkpoint_every=20, strategy={"name": "rps", "value_dtype": "int8"},
                      network={"drop_rate": 0.2, "segment_bytes": 300})
    whole_dir = tmp_run()
    whole, params, rows = run(cfg, whole_dir)
    crashed = tmp_run()
    with pytest.raises(InterruptedRun):
        train(prepare(cfg), crashed, progress=False, faults=stop_at(30))
    resumed = train(prepare(cfg), crashed, resume=True, progress=False)
    assert without_wall_time(rows) == without_wall_time(read_metrics(crashed))
    assert unmeasured(resumed) == unmeasured(whole)
    replay = make_config(steps=40, eval_every=10, strategy={"name": "rps", "value_dtype": "int8"},
                         network={"trace": str(whole_dir), "segment_bytes": 300})
    _, replayed, _ = run(replay, tmp_run())
    assert torch.equal(replayed, params)


@pytest.mark.parametrize("setting,says", [
    ("strategy.value_dtype=int4", "strategy.value_dtype"),
    ("strategy.value_dtype=float8", "strategy.value_dtype"),
])
def test_a_bad_value_dtype_is_one_line(setting: str, says: str, tmp_path) -> None:
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "shaky", "train", "--steps", "2", "--out", str(out),
                           "--set", setting], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and says in lines[0], done.stderr
    assert not out.exists()


def test_the_gloo_transport_refuses_a_value_dtype() -> None:
    with pytest.raises(ValueError, match="strategy.value_dtype = 'int8' needs backend sim"):
        make_config(backend="dist", strategy={"name": "rps", "value_dtype": "int8"})


def test_a_rounded_segment_holds_a_group_of_segments_and_travels_as_one_message() -> None:
    """float32 rows in int8 at 1420-byte segments: a whole segment holds 354 values (room for the scale), a
    rounded one the 4 x 354 values of a group and one scale (1420 bytes). In the simulator a group sent rounded is
    one message, whose fate is its first segment's draw (a lost draw elsewhere in the group costs nothing); a
    group sent whole is 4 messages, each taken where it arrived."""
    fmt, w, dim, seg_bytes = FORMATS["int8"], 2, 2 * 5000, 1420
    seg = quant.fine_length(seg_bytes, 4, fmt)
    assert (seg, quant.parts(fmt, 4), int(fmt.bytes_of(4 * seg, 4 * seg))) == (354, 4, 1420)
    s = -(-5000 // seg)                                   # 15 segments a block: groups at 0, 4, 8, 12
    comm, gen = SimComm(w), torch.Generator().manual_seed(4)
    x = torch.randn(w, dim, generator=gen)
    ref, sync, carry = torch.zeros_like(x), x.new_zeros(w, 1, 1), torch.zeros_like(x)
    every = torch.ones(w, w, s, dtype=torch.bool)
    lost = every.clone()
    lost[1, 0, [1, 4]] = False        # worker 1's block 0: a later segment of group 0, the first of group 1
    # round 0 (nobody in sync: all whole, each segment a message of its own): segments 1 and 4 are lost alone
    out, ref, sync, carry, up_q, down_q = _round(comm, x, lost, every, ref, sync, carry, fmt, seg_bytes)
    assert not up_q.any()
    kept = torch.zeros(dim, dtype=torch.bool)
    kept[seg:2 * seg] = kept[4 * seg:5 * seg] = True     # worker 0's average of block 0 left them out
    assert torch.equal(out[0, :5000][kept[:5000]], x[0, :5000][kept[:5000]])
    assert not torch.equal(out[0, :5000][~kept[:5000]], x[0, :5000][~kept[:5000]])
    traffic = block_exchange_traffic(x, w, LinkSample(0, lost, every, seg_bytes), reliable=False, fmt=fmt,
                                     rounded=(up_q, down_q))
    assert traffic[0].messages == 2 * s and traffic[0].dropped == 2
    # round 1 (everyone in sync: every group rounded, one message at its first segment): group 0 arrives
    x = out + 0.01 * torch.randn(w, dim, generator=gen)
    out, ref, sync, carry, up_q, down_q = _round(comm, x, lost, every, ref, sync, carry, fmt, seg_bytes)
    assert bool(up_q[1, 0].all()) and bool(up_q[0, 1].all())
    traffic = block_exchange_traffic(x, w, LinkSample(1, lost, every, seg_bytes), reliable=False, fmt=fmt,
                                     rounded=(up_q, down_q))
    assert traffic[0].messages == 2 * 4 and traffic[0].dropped == 1       # group 1 of worker 1's block 0
    assert traffic[0].bytes_sent == 2 * (3 * 1420 + (5000 - 12 * seg) + 4)
    # worker 0 averaged group 0 with worker 1's values (the rows differ by about 1), and left group 1 (lost as
    # one) out: there its stream is its own values, rounded (a step of 1e-4)
    assert float((out[0, 4 * seg:8 * seg] - x[0, 4 * seg:8 * seg]).abs().max()) < 1e-3
    assert float((out[0, :4 * seg] - x[:, :4 * seg].mean(0)).abs().max()) < 1e-3
