"""Segments as the unit of loss (network.segment_bytes): masks, the averaging rule, the clock and the trace.

A block's message is cut into segments of max(1, segment_bytes // itemsize) values; each segment of each link
is lost on its own. segment_bytes 0 is the block-level model, bit for bit; a segment as large as the largest
block is the block-level rule again.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from shaky.comm.sim import SimComm
from shaky.config import NetworkConfig, RunConfig, config_from_dict
from shaky.geometry import LinkSample, block_sizes, segment_counts, segment_length
from shaky.network.clock import Clock, PhaseTraffic
from shaky.network.faults import Membership, Round
from shaky.network.model import MaskLog, NetworkModel, TraceNetwork, pack_masks
from shaky.rundir import load_checkpoint, load_trace, save_trace
from shaky.setup import Setup
from shaky.strategies.exchange import block_exchange_traffic, lossy_block_average, ring_allreduce_traffic
from shaky.train import prepare, read_metrics, train

from conftest import make_config, unmeasured, without_wall_time


def _segmented(cfg: RunConfig) -> Setup:
    """``prepare(cfg)`` whose network model knows the message (D values of the run's dtype), as segments need."""
    setup = prepare(cfg)
    network = NetworkModel(cfg.network, cfg.num_workers, cfg.seed, dim=setup.flat.dim, itemsize=setup.dtype.itemsize)
    return dataclasses.replace(setup, network=network)


def _train(setup: Setup, run_dir: Path) -> tuple[dict, torch.Tensor, list[dict]]:
    summary = train(setup, run_dir, progress=False)
    return summary, load_checkpoint(run_dir)["params"], read_metrics(run_dir)


def _reference(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, weights: list[float] | None,
               servers: list[int] | None, segment_bytes: int) -> torch.Tensor:
    """The segment rule in plain Python: the server of block j (servers[j]) averages segment k over the senders i
    with up[i, j, k] (weighted; its own always counts), and worker i takes it where down[j, i, k] (or i is the
    server), else keeps its own segment."""
    w, d = x.shape
    sizes = block_sizes(d, w)
    seg = segment_length(segment_bytes, x.element_size())
    out = x.clone()
    for j in range(w):
        s = j if servers is None else servers[j]
        first = sum(sizes[:j])
        for k in range(-(-sizes[j] // seg)):
            lo, hi = first + k * seg, first + min((k + 1) * seg, sizes[j])
            senders = [i for i in range(w) if up[i, j, k] or i == s]
            weight = [1.0 if weights is None else weights[i] for i in senders]
            avg = sum(wt * x[i, lo:hi] for wt, i in zip(weight, senders)) / sum(weight)
            for i in range(w):
                if down[j, i, k] or i == s:
                    out[i, lo:hi] = avg
    return out


# ---------------------------------------------------------------------------
# segment_bytes 0: today's model, bit for bit


def test_zero_segment_bytes_draws_the_block_masks_of_the_seed() -> None:
    """The block-level stream is untouched: u = rng(seed, stream, round) of shape [2, W, W], kept where u >= drop."""
    drop = np.array([[0, .1, .5, .2], [.3, 0, .1, .1], [.9, .2, 0, .4], [.1, .6, .1, 0]])
    net = NetworkModel(NetworkConfig(drop_rate=tuple(map(tuple, drop.tolist())), segment_bytes=0), 4, seed=11,
                       dim=1000)
    for r in (0, 1, 57):
        links = net.sample(r)
        u = np.random.default_rng([11, 0x6E6574, r]).random((2, 4, 4))
        want = (u >= drop) | np.eye(4, dtype=bool)
        assert links.segment_bytes == 0 and links.up.shape == (4, 4)
        assert np.array_equal(links.up.numpy(), want[0]) and np.array_equal(links.down.numpy(), want[1])


def test_zero_segment_bytes_trains_exactly_as_the_default_config(tmp_run) -> None:
    base = make_config(steps=20, eval_every=10, strategy={"name": "rps"}, network={"drop_rate": 0.2})
    explicit = make_config(steps=20, eval_every=10, strategy={"name": "rps"},
                           network={"drop_rate": 0.2, "segment_bytes": 0})
    first = _train(prepare(base), tmp_run())
    second = _train(_segmented(explicit), tmp_run())  # a network model told the message's size changes nothing
    assert torch.equal(first[1], second[1])
    assert without_wall_time(first[2]) == without_wall_time(second[2])
    assert unmeasured(first[0]) == unmeasured(second[0])


# ---------------------------------------------------------------------------
# A segment as large as the largest block: the block-level rule


@pytest.mark.parametrize("strategy", ["rps", "allreduce"])
def test_a_whole_block_segment_is_the_block_rule(strategy: str, tmp_run) -> None:
    net = {"drop_rate": 0.2, "latency_ms": 2.0}
    cfg = make_config(steps=20, eval_every=10, strategy={"name": strategy}, network=net)
    block_bytes = block_sizes(prepare(cfg).flat.dim, cfg.num_workers)[0] * 4
    whole = make_config(steps=20, eval_every=10, strategy={"name": strategy},
                        network={**net, "segment_bytes": block_bytes})
    setup = _segmented(whole)
    links, block_links = setup.network.sample(3), prepare(cfg).network.sample(3)
    assert links.up.shape == (4, 4, 1) and torch.equal(links.up[..., 0], block_links.up)
    assert torch.equal(links.down[..., 0], block_links.down)

    blocks, params, rows = _train(prepare(cfg), tmp_run())
    segments, seg_params, seg_rows = _train(setup, tmp_run())
    assert torch.equal(params, seg_params)
    assert without_wall_time(rows) == without_wall_time(seg_rows)
    for key in ("messages_sent", "messages_dropped", "bytes_sent", "sim_time_s"):
        assert segments[key] == blocks[key], key


def test_one_segment_per_block_averages_as_the_block_rule() -> None:
    w, d = 5, 103
    x = torch.randn(w, d, generator=torch.Generator().manual_seed(0))
    weights, servers = torch.tensor([1.0, 2.0, 0.0, 1.0, 3.0]), torch.tensor([0, 1, 3, 3, 4])
    block = NetworkModel(NetworkConfig(drop_rate=0.4), w, seed=1).sample(7, servers)
    seg = NetworkModel(NetworkConfig(drop_rate=0.4, segment_bytes=4 * 21), w, seed=1, dim=d).sample(7, servers)
    want = SimComm(w).block_average(x, block.up, block.down, weights=weights, servers=servers)
    got = SimComm(w).block_average(x, seg.up, seg.down, weights=weights, servers=servers, segment_bytes=4 * 21)
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------
# The rule, against plain Python


def test_a_hand_made_example() -> None:
    # 2 workers, 6 float64 values, blocks of 3; 16-byte segments hold 2 values: block j = [seg 0: 2 values, seg 1: 1].
    x = torch.tensor([[0.0, 1, 2, 3, 4, 5], [10.0, 11, 12, 13, 14, 15]], dtype=torch.float64)
    up = torch.ones(2, 2, 2, dtype=torch.bool)
    down = torch.ones(2, 2, 2, dtype=torch.bool)
    up[1, 0, 0] = False    # worker 1's segment 0 of block 0 never reached server 0
    down[0, 1, 1] = False  # server 0's average of segment 1 never reached worker 1
    out = SimComm(2).block_average(x, up, down, segment_bytes=16)
    assert out.tolist() == [[0, 1, 7, 8, 9, 10], [0, 1, 12, 8, 9, 10]]
    weighted = SimComm(2).block_average(x, up, down, weights=torch.tensor([3.0, 1.0], dtype=torch.float64),
                                        segment_bytes=16)
    assert weighted.tolist() == [[0, 1, 4.5, 5.5, 6.5, 7.5], [0, 1, 12, 5.5, 6.5, 7.5]]


def test_a_successor_averages_each_of_its_blocks_over_its_own_arrivals() -> None:
    """Worker 0 is dead and worker 1 serves blocks 0 and 1: each block is a message of its own, so worker 2's
    segment 0 of block 1, which arrived, counts in block 1's average although its segment 0 of block 0 was lost
    (one mask for both blocks on the link, or the AND of theirs, left it out), and block 1's average of segment 1
    reaches worker 2 although block 0's was lost."""
    # 3 workers, 6 float64 values, blocks of 2; 8-byte segments hold 1 value: block j = columns 2j, 2j + 1.
    x = torch.tensor([[0.0, 0, 0, 0, 0, 0], [2.0, 4, 6, 8, 10, 12], [4.0, 8, 12, 16, 20, 24]], dtype=torch.float64)
    weights, servers = torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64), torch.tensor([1, 1, 2])
    up = torch.ones(3, 3, 2, dtype=torch.bool)
    down = torch.ones(3, 3, 2, dtype=torch.bool)
    up[2, 0, 0] = False      # worker 2's segment 0 of block 0 never reached server 1 (its block 1's did)
    down[0, 2, 1] = False    # block 0's average of segment 1 never reached worker 2 (block 1's did)
    out = SimComm(3).block_average(x, up, down, weights=weights, servers=servers, segment_bytes=8)
    # block 0: segment 0 from worker 1 alone, segment 1 from both; block 1 and block 2 from both
    assert out[1].tolist() == [2, 6, 9, 12, 15, 18]
    assert out[2].tolist() == [2, 8, 9, 12, 15, 18]    # block 0's segment 1: its own


@pytest.mark.parametrize("w,d,segment_bytes,dtype", [(4, 37, 8, torch.float32), (5, 103, 12, torch.float64),
                                                     (3, 7, 4, torch.float32), (6, 4, 8, torch.float32),
                                                     (4, 41, 1, torch.float32)])
def test_segment_rule_matches_plain_python(w: int, d: int, segment_bytes: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(w * d)
    x = torch.randn(w, d, generator=g, dtype=dtype)
    num_segments = max(1, *segment_counts(d, w, segment_length(segment_bytes, x.element_size())))
    eye = torch.eye(w, dtype=torch.bool)[..., None]
    up = (torch.rand(w, w, num_segments, generator=g) > 0.4) | eye
    down = (torch.rand(w, w, num_segments, generator=g) > 0.4) | eye
    weights = torch.rand(w, generator=g, dtype=dtype) + 0.5
    servers = torch.tensor([1] + list(range(1, w)))  # worker 0 is down: worker 1 serves its block too
    for wts, srv, overwrite in itertools.product([None, weights], [None, servers], [False, True]):
        want = _reference(x, up, down, None if wts is None else wts.tolist(),
                          None if srv is None else srv.tolist(), segment_bytes)
        given = x.clone()
        got = SimComm(w).block_average(given, up, down, weights=wts, servers=srv, overwrite=overwrite,
                                       segment_bytes=segment_bytes)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        if overwrite:
            assert got.data_ptr() == given.data_ptr()
        else:
            assert torch.equal(given, x)


def test_the_exchange_stage_passes_segment_masks_on() -> None:
    w, d = 4, 50
    x = torch.randn(w, d, generator=torch.Generator().manual_seed(3))
    links = NetworkModel(NetworkConfig(drop_rate=0.3, segment_bytes=16), w, seed=2, dim=d).sample(0)
    rnd = Round(0, links, Membership.everyone(w))
    out, _, stats = lossy_block_average()(x, SimComm(w), rnd, ())
    assert torch.equal(out, SimComm(w).block_average(x, links.up, links.down, segment_bytes=16))
    counts = segment_counts(d, w, 4)
    assert stats.messages_sent == 2 * (w - 1) * sum(counts)   # every segment of every block, both phases
    assert stats.messages_dropped == int((~links.up).sum() + (~links.down).sum()) > 0  # padding never drops
    assert stats.bytes_sent == 2 * (w - 1) * d * 4            # the payload, however it is cut


# ---------------------------------------------------------------------------
# Training with segments: deterministic, replayed from its trace


@pytest.mark.parametrize("strategy", [{"name": "rps"}, {"name": "dts", "delay": 3, "period": 2}])
def test_a_segmented_run_is_deterministic_and_replays_from_its_trace(strategy: dict, tmp_run) -> None:
    cfg = make_config(steps=30, eval_every=10, strategy=strategy, network={"drop_rate": 0.1, "segment_bytes": 64})
    first_dir = tmp_run()
    first, params, rows = _train(_segmented(cfg), first_dir)
    again, again_params, again_rows = _train(_segmented(cfg), tmp_run())
    assert torch.equal(params, again_params) and without_wall_time(rows) == without_wall_time(again_rows)
    assert first["messages_dropped"] == again["messages_dropped"] > 0
    # Segments are the messages: 16 float32 values each, every one lost at about the drop rate.
    dim = prepare(cfg).flat.dim
    exchanges = first["comm_rounds"]
    assert first["messages_sent"] == exchanges * 2 * (cfg.num_workers - 1) * sum(segment_counts(dim, 4, 16))
    assert first["bytes_sent"] == exchanges * 2 * (cfg.num_workers - 1) * dim * 4
    assert 0.08 < first["messages_dropped"] / first["messages_sent"] < 0.12

    with np.load(first_dir / "trace.npz") as z:
        assert int(z["segment_bytes"]) == 64 and int(z["num_segments"]) == max(segment_counts(dim, 4, 16))
    up, down, _ = load_trace(str(first_dir), cfg.num_workers, cfg.steps, segment_bytes=64)
    # The replay is told drop_rate 0: every loss it sees comes from the trace.
    replay_cfg = make_config(steps=30, eval_every=10, strategy=strategy,
                             network={"drop_rate": 0.0, "segment_bytes": 64})
    replay = dataclasses.replace(prepare(replay_cfg),
                                 network=TraceNetwork(replay_cfg.network, cfg.num_workers, cfg.seed, up, down))
    replayed, replay_params, replay_rows = _train(replay, tmp_run())
    assert torch.equal(params, replay_params)
    assert without_wall_time(rows) == without_wall_time(replay_rows)
    assert replayed["messages_dropped"] == first["messages_dropped"]
    assert replayed["sim_time_s"] == first["sim_time_s"]


# ---------------------------------------------------------------------------
# Drawing the masks


def test_segments_are_lost_at_the_drop_rate_one_link_at_a_time() -> None:
    w, d = 4, 4000
    drop = np.array([[0, .05, .1, .2], [.3, 0, .05, .05], [.1, .2, 0, .4], [.05, .1, .15, 0]])
    cfg = NetworkConfig(drop_rate=tuple(map(tuple, drop.tolist())), segment_bytes=40)
    net = NetworkModel(cfg, w, seed=5, dim=d)
    samples = [net.sample(r) for r in range(60)]
    assert samples[0].up.shape == (w, w, 100) and samples[0].segment_bytes == 40   # 1000 values, 10 a segment
    lost_up = torch.stack([~s.up for s in samples]).double().mean(dim=(0, 3)).numpy()
    lost_down = torch.stack([~s.down for s in samples]).double().mean(dim=(0, 3)).numpy()
    np.testing.assert_allclose(lost_up, drop, atol=0.02)
    np.testing.assert_allclose(lost_down, drop, atol=0.02)
    # Pure in (seed, round), in any order.
    assert torch.equal(NetworkModel(cfg, w, seed=5, dim=d).sample(42).down, samples[42].down)
    assert not torch.equal(NetworkModel(cfg, w, seed=6, dim=d).sample(42).down, samples[42].down)


def test_padding_and_diagonal_are_delivered() -> None:
    w, d = 3, 10                      # blocks 4, 3, 3 values; 8-byte segments hold 2: 2, 2 and 2 segments
    net = NetworkModel(NetworkConfig(drop_rate=0.9, segment_bytes=8), w, seed=0, dim=d)
    assert net.sample(0).up.shape == (3, 3, 2)
    w, d = 3, 8                       # blocks 3, 3, 2 values: 2, 2 and 1 segments
    net = NetworkModel(NetworkConfig(drop_rate=0.9, segment_bytes=8), w, seed=0, dim=d)
    for r in range(20):
        links = net.sample(r)
        assert links.up[:, 2, 1].all() and links.down[2, :, 1].all()    # block 2 has no segment 1
        assert links.up[range(3), range(3)].all() and links.down[range(3), range(3)].all()
        assert not links.up[:, :2, 1].all()                             # the others' segment 1 is drawn


def test_a_bad_link_loses_all_its_segments_of_the_slot() -> None:
    net = NetworkModel(NetworkConfig(burst_enter=0.3, burst_exit=0.5, burst_drop_rate=1.0, segment_bytes=4),
                       4, seed=1, dim=400)
    off = ~torch.eye(4, dtype=torch.bool)
    bad = 0
    for r in range(50):
        links = net.sample(r)
        for mask in (links.up, links.down):
            lost = (~mask).sum(-1)[off]
            assert ((lost == 0) | (lost == 100)).all()   # the link's state holds for every segment it sends
            bad += int((lost == 100).sum())
    assert bad > 0


# ---------------------------------------------------------------------------
# The clock and the counters


def test_the_clock_resends_only_a_lost_segment_and_only_when_reliable() -> None:
    w = 3
    clock = Clock(NetworkModel(NetworkConfig(latency_ms=1.0, bandwidth_mbps=8.0), w, seed=0), 5.0, 200.0)
    link_bytes = np.zeros((w, w, 2))
    link_bytes[0, 1] = [20.0, 20.0]
    link_bytes[1, 2] = [20.0, 10.0]
    delivered = torch.ones(w, w, 2, dtype=torch.bool)
    everything = clock.phase_seconds(PhaseTraffic(link_bytes, delivered, True))
    assert everything == pytest.approx(0.001 + 40 / 1e6)  # a link's segments back to back, 1e6 bytes/s
    delivered[1, 2, 1] = False
    lost = PhaseTraffic(link_bytes, delivered.clone(), True)
    assert clock.phase_seconds(lost) == pytest.approx(everything + (0.200 + 0.002) + (0.001 + 10 / 1e6))
    assert lost.messages == 4 and lost.dropped == 1 and lost.bytes_sent == 70 + 10
    unreliable = PhaseTraffic(link_bytes, delivered, False)
    assert clock.phase_seconds(unreliable) == everything and unreliable.bytes_sent == 70


def test_segment_traffic_with_a_dead_server() -> None:
    w, d = 4, 40                       # blocks of 10 float32 values; 16-byte segments: 4, 4 and 2 values
    x = torch.zeros(w, d)
    live = torch.tensor([True, False, True, True])
    members = Membership(live, torch.tensor([0, 2, 2, 3]), torch.zeros(w, dtype=torch.bool),
                         live.to(torch.float64), False, False)
    links = NetworkModel(NetworkConfig(segment_bytes=16), w, seed=0, dim=d).sample(0, members.servers)
    up, down = block_exchange_traffic(x, w, links, members, reliable=False)
    assert up.link_bytes.shape == (w, w, 3)
    # Blocks 1 and 2, both served by worker 2, are messages of their own on the link 0 -> 2 (and 2 -> 0).
    assert up.link_bytes[0, 1].tolist() == up.link_bytes[0, 2].tolist() == [16.0, 16.0, 8.0]
    assert up.route[0][0, 1] == 0 and up.route[1][0, 1] == 2 and down.route[0][1, 0] == 2 and down.route[1][1, 0] == 0
    assert up.link_bytes[1].sum() == 0 and down.link_bytes[:, 1].sum() == 0   # the dead worker sends nothing
    assert up.messages == down.messages == 3 * (3 + 2 + 3)     # segments of the blocks workers 0, 2, 3 send
    # Each live worker sends every block it does not serve (40 bytes each) and gets its average back.
    assert up.bytes_sent == down.bytes_sent == sum(40 for i in (0, 2, 3) for j in range(4) if [0, 2, 2, 3][j] != i)


@pytest.mark.parametrize("segment_bytes", [0, 16])
def test_the_clock_times_a_successor_s_two_messages_on_its_link(segment_bytes: int) -> None:
    """Messages routed to a successor's link take the time of their bytes on that link (per-link latencies and
    bandwidths): the same as one message of both blocks' bytes there, and a resent one is timed on its link."""
    w, d = 4, 40
    latency = tuple(tuple(1.0 + i + 10 * j for j in range(w)) for i in range(w))
    bandwidth = tuple(tuple(8.0 * (1 + (i * j) % 3) for j in range(w)) for i in range(w))
    network = NetworkModel(NetworkConfig(latency_ms=latency, bandwidth_mbps=bandwidth, segment_bytes=segment_bytes),
                           w, seed=0, dim=d)
    clock = Clock(network, 5.0, 200.0)
    live = torch.tensor([True, False, True, True])
    members = Membership(live, torch.tensor([0, 2, 2, 3]), torch.zeros(w, dtype=torch.bool),
                         live.to(torch.float64), False, False)
    links = network.sample(0, members.servers)
    for phase, down in zip(block_exchange_traffic(torch.zeros(w, d), w, links, members, reliable=True), (0, 1)):
        snd, rcv = phase.route
        per_link = np.zeros_like(phase.link_bytes)
        np.add.at(per_link, (snd, rcv), phase.link_bytes)
        assert clock.phase_seconds(phase) == pytest.approx(clock.phase_seconds(PhaseTraffic(per_link, torch.ones(
            per_link.shape, dtype=torch.bool), True)), rel=1e-12)
        # one lost message of block 1 (served by worker 2) from worker 0, or to it: resent on the link 0 <-> 2
        delivered = torch.ones(phase.delivered.shape, dtype=torch.bool)
        delivered[(1, 0) if down else (0, 1)] = False
        lost = dataclasses.replace(phase, delivered=delivered)
        resent_bytes = np.where(delivered.numpy(), 0.0, phase.link_bytes).sum()
        assert lost.dropped == (3 if segment_bytes else 1) and lost.bytes_sent == phase.bytes_sent + resent_bytes
        timeout = 0.200 + 2 * latency[0][2] / 1e3 if not down else 0.200 + 2 * latency[2][0] / 1e3
        more = clock.phase_seconds(lost) - clock.phase_seconds(phase)
        assert more == pytest.approx(timeout + clock._transfer_s(phase.link_bytes, ~delivered.numpy() & phase.sent,
                                                                 route=phase.route), rel=1e-12)
        assert clock._transfer_s(phase.link_bytes, ~delivered.numpy() & phase.sent, route=phase.route) == \
            pytest.approx(resent_bytes / (bandwidth[0][2] if not down else bandwidth[2][0]) / 1e6 * 8
                          + (latency[0][2] if not down else latency[2][0]) / 1e3, rel=1e-12)


def test_ring_traffic_with_segments() -> None:
    w, d = 4, 40
    x = torch.zeros(w, d)
    links = NetworkModel(NetworkConfig(drop_rate=0.5, segment_bytes=16), w, seed=4, dim=d).sample(0)
    hops = ring_allreduce_traffic(x, w, links)
    assert len(hops) == 6 and all(h.link_bytes.shape == (w, w, 3) for h in hops)
    block = ring_allreduce_traffic(x, w, LinkSample(0, torch.ones(w, w, dtype=torch.bool),
                                                    torch.ones(w, w, dtype=torch.bool)))
    assert sum(h.link_bytes.sum() for h in hops) == sum(h.link_bytes.sum() for h in block)
    assert sum(h.messages for h in hops) == 6 * w * 3 and sum(h.dropped for h in hops) > 0


# ---------------------------------------------------------------------------
# The trace


def test_segment_masks_round_trip_through_the_trace(tmp_path: Path) -> None:
    w, d = 5, 333
    net = NetworkModel(NetworkConfig(drop_rate=0.3, segment_bytes=24), w, seed=9, dim=d)
    samples = [net.sample(r) for r in range(11)]
    num_segments = samples[0].up.shape[2]
    log = MaskLog(w, capacity=2)
    for s in samples:
        log.append(s)
    packed = log.packed()
    assert packed["up"].shape == (11, num_segments * 4) and int(packed["num_segments"]) == num_segments
    assert all(np.array_equal(packed[k], pack_masks(samples)[k]) for k in ("up", "down"))
    save_trace(tmp_path, packed, w)
    up, down, _ = load_trace(str(tmp_path), w, 11, segment_bytes=24)
    replay = TraceNetwork(NetworkConfig(segment_bytes=24), w, 0, up, down)
    for s in samples:
        r = replay.sample(s.round)
        assert r.segment_bytes == 24 and torch.equal(r.up, s.up) and torch.equal(r.down, s.down)
    with pytest.raises(ValueError, match="recorded with network.segment_bytes = 24, but network.segment_bytes is 0"):
        load_trace(str(tmp_path), w, 11, segment_bytes=0)
    with pytest.raises(ValueError, match=f"holds {num_segments} segments per block; set network.segment_bytes"):
        TraceNetwork(NetworkConfig(), w, 0, up, down)
    with pytest.raises(ValueError, match="changed their segments"):
        log.append(NetworkModel(NetworkConfig(), w, seed=9).sample(0))


def test_an_old_trace_reads_as_one_segment(tmp_path: Path) -> None:
    w = 3
    samples = [NetworkModel(NetworkConfig(drop_rate=0.5), w, seed=1).sample(r) for r in range(4)]
    packed = pack_masks(samples)
    np.savez_compressed(tmp_path / "trace.npz", up=packed["up"], down=packed["down"], num_workers=np.int64(w))
    up, down, _ = load_trace(str(tmp_path), w, 4, segment_bytes=0)
    replay = TraceNetwork(NetworkConfig(), w, 0, up, down)
    assert replay.num_segments == 1
    for s in samples:
        r = replay.sample(s.round)
        assert r.up.shape == (w, w) and torch.equal(r.up, s.up) and torch.equal(r.down, s.down)


# ---------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("value", [-1, 1.5, True, "64"])
def test_bad_segment_bytes(value: object) -> None:
    with pytest.raises(ValueError, match=rf"^network.segment_bytes must be an integer >= 0 .*got {value!r}$"):
        NetworkConfig(segment_bytes=value)  # type: ignore[arg-type]


def test_bad_segment_bytes_in_a_config_file() -> None:
    with pytest.raises(TypeError, match="network.segment_bytes must be an integer, got 1.5"):
        config_from_dict({"network": {"segment_bytes": 1.5}})
    with pytest.raises(ValueError, match="network.segment_bytes must be an integer >= 0"):
        config_from_dict({"network": {"segment_bytes": -8}})
    assert config_from_dict({"network": {"segment_bytes": 1400}}).network.segment_bytes == 1400


def test_segment_masks_that_do_not_fit() -> None:
    with pytest.raises(ValueError, match="network.segment_bytes = 64 .* needs the message's size"):
        NetworkModel(NetworkConfig(segment_bytes=64), 4, seed=0).sample(0)
    links = NetworkModel(NetworkConfig(segment_bytes=64), 4, seed=0, dim=1000).sample(0)
    with pytest.raises(ValueError, match=r"segment masks must be \[4, 4, 4\]"):
        SimComm(4).block_average(torch.zeros(4, 1000), links.up, links.down, segment_bytes=256)
    with pytest.raises(ValueError, match="needs masks of 3 dimensions"):
        LinkSample(0, torch.ones(4, 4, dtype=torch.bool), torch.ones(4, 4, dtype=torch.bool), 64)
    with pytest.raises(ValueError, match="needs masks of 2 dimensions"):
        LinkSample(0, links.up, links.down)
