"""The network model: pure, seeded delivery masks; per-link rates; bursts; traces."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shaky import native
from shaky.config import NetworkConfig
from shaky.network.model import _NETWORK_STREAM, MaskLog, NetworkModel, TraceNetwork, pack_masks
from shaky.rundir import load_trace, save_trace


def test_sample_is_a_pure_function_of_seed_and_round() -> None:
    a = NetworkModel(NetworkConfig(drop_rate=0.3), 6, seed=7)
    b = NetworkModel(NetworkConfig(drop_rate=0.3), 6, seed=7)
    forward = [a.sample(r) for r in range(20)]
    backward = [b.sample(r) for r in reversed(range(20))][::-1]
    for x, y in zip(forward, backward):
        assert torch.equal(x.up, y.up) and torch.equal(x.down, y.down)
    other = NetworkModel(NetworkConfig(drop_rate=0.3), 6, seed=8)
    assert not all(torch.equal(a.sample(r).up, other.sample(r).up) for r in range(20))


@pytest.mark.parametrize("compiled", [True, False])
def test_seeded_uniform_draws_numpy_s_numbers(compiled: bool) -> None:
    if compiled and not native.UNIFORM_MATCHES_NUMPY:
        pytest.skip("the compiled library was not built (or its draws differ from numpy's, and it stands aside)")
    # (70 ints: more entropy than the C path takes, which then leaves it to numpy)
    for ints in [(0, _NETWORK_STREAM), (7,), (2**32 - 1, 2**32, 2**40 + 5), (2**70 + 1, 3), tuple(range(70))]:
        draw = native.SeededUniform(*ints)
        draw.compiled = compiled
        for keys in [(0,), (1,), (999,), (2**32 - 1,), (2**32 + 3, 1), (2**63,), ()]:
            for shape in [(2, 5, 5), (2, 3, 3, 4), (1,), (0,)]:
                ref = np.random.default_rng([*ints, *keys]).random(shape)
                assert np.array_equal(draw(shape, *keys), ref), (ints, keys, shape)


def test_the_masks_are_numpy_s_draws_from_seed_stream_and_round() -> None:
    net = NetworkModel(NetworkConfig(drop_rate=0.3), 5, seed=11)
    for r in (0, 1, 57):
        u = np.random.default_rng([11, _NETWORK_STREAM, r]).random((2, 5, 5))
        expected = (u >= 0.3) | np.eye(5, dtype=bool)
        s = net.sample(r)
        assert np.array_equal(s.up.numpy(), expected[0]) and np.array_equal(s.down.numpy(), expected[1])


def test_self_messages_always_arrive_and_drop_rate_is_respected() -> None:
    w, p = 8, 0.2
    net = NetworkModel(NetworkConfig(drop_rate=p), w, seed=0)
    masks = torch.stack([torch.stack([s.up, s.down]) for s in map(net.sample, range(2000))])
    assert masks[..., torch.arange(w), torch.arange(w)].all()
    off = ~torch.eye(w, dtype=torch.bool)
    rate = 1 - masks[..., off].float().mean().item()
    # 2000 rounds x 2 phases x 56 links: the standard error is about 0.0014.
    assert abs(rate - p) < 0.01


def test_per_link_matrix() -> None:
    drop = tuple(tuple(0.0 if j != 1 else 0.5 for j in range(3)) for i in range(3))
    net = NetworkModel(NetworkConfig(drop_rate=drop), 3, seed=1)
    ups = torch.stack([net.sample(r).up for r in range(3000)]).float().mean(0)
    assert ups[0, 0] == 1 and ups[0, 2] == 1 and ups[2, 0] == 1      # links with rate 0
    assert abs(ups[0, 1].item() - 0.5) < 0.04 and ups[1, 1] == 1      # column 1 at rate 0.5, self kept


@pytest.mark.parametrize("segment_bytes", [0, 8])
def test_a_successor_s_two_blocks_are_lost_independently(segment_bytes: int) -> None:
    """Worker 1 is dead and worker 2 serves blocks 1 and 2: each block is a message of its own, drawn on its own
    at the link's rate (a segment that arrived for one block is not lost with the other's: the loss a block sees
    is p, not the 2p of two blocks' masks and-ed), in both phases; the server's own parts always arrive, and the
    draws are those of (seed, round, servers)."""
    w, p, rounds = 4, 0.2, 3000
    net = NetworkModel(NetworkConfig(drop_rate=p, segment_bytes=segment_bytes), w, seed=11, dim=4 * w)
    servers = torch.tensor([0, 2, 2, 3])
    samples = [net.sample(r, servers) for r in range(rounds)]
    up = torch.stack([s.up if s.up.dim() == 3 else s.up[..., None] for s in samples]).float()      # [R, i, j, k]
    down = torch.stack([s.down if s.down.dim() == 3 else s.down[..., None] for s in samples]).float()
    assert up[:, 2, 1].min() == 1 and up[:, 2, 2].min() == 1 and down[:, 1, 2].min() == 1   # the server's own
    for sender in (0, 3):    # its messages of blocks 1 and 2, both to server 2
        a, b = 1 - up[:, sender, 1], 1 - up[:, sender, 2]
        c, d = 1 - down[:, 1, sender], 1 - down[:, 2, sender]
        # 3000 rounds (x segments): the standard error of a rate near 0.2 is under 0.008, of one near 0.04 0.004
        for lost_one, lost_other in ((a, b), (c, d)):
            assert abs(lost_one.mean().item() - p) < 0.03 and abs(lost_other.mean().item() - p) < 0.03
            assert abs((lost_one * lost_other).mean().item() - p * p) < 0.015     # independent, not the same draw
            assert abs(torch.maximum(lost_one, lost_other).mean().item() - (2 * p - p * p)) < 0.03
    again = NetworkModel(NetworkConfig(drop_rate=p, segment_bytes=segment_bytes), w, seed=11, dim=4 * w)
    assert torch.equal(again.sample(77, servers).up, samples[77].up)


def test_default_servers_draw_the_masks_without_servers() -> None:
    """servers = (0, 1, ..., W-1) is the default: the same draws, bit for bit, with bursts and segments too."""
    for cfg in (NetworkConfig(drop_rate=0.3), NetworkConfig(drop_rate=0.3, segment_bytes=8),
                NetworkConfig(drop_rate=0.1, burst_enter=0.1, burst_exit=0.3, burst_drop_rate=0.9)):
        a, b = NetworkModel(cfg, 5, seed=2, dim=40), NetworkModel(cfg, 5, seed=2, dim=40)
        for r in range(20):
            x, y = a.sample(r), b.sample(r, torch.arange(5))
            assert torch.equal(x.up, y.up) and torch.equal(x.down, y.down)


def test_a_trace_replays_its_per_block_masks_and_an_older_one_its_per_link_masks(tmp_path) -> None:
    """A trace written now is per block (``by_block``): with a dead worker's block moved it replays as recorded
    (the server's own parts True). One written before (no ``by_block``) holds per-link masks and replays with
    each block on its server's link, as its run read them: ``up[:, servers]``, ``down[servers, :]``."""
    w, servers = 4, torch.tensor([0, 2, 2, 3])
    net = NetworkModel(NetworkConfig(drop_rate=0.4), w, seed=5)
    samples = [net.sample(r, servers if r % 2 else None) for r in range(6)]
    save_trace(tmp_path, pack_masks(samples), w)
    trace = load_trace(str(tmp_path), w, 6)
    assert trace.by_block
    replay = TraceNetwork(NetworkConfig(), w, 5, *trace)
    for r, s in enumerate(samples):
        got = replay.sample(r, servers if r % 2 else None)
        assert torch.equal(got.up, s.up) and torch.equal(got.down, s.down)
    old = tmp_path / "old.npz"
    links = [net.sample(r) for r in range(6)]           # per link, as traces were written before
    packed = pack_masks(links)
    np.savez_compressed(old, up=packed["up"], down=packed["down"], num_workers=np.int64(w))
    trace = load_trace(str(old), w, 6)
    assert not trace.by_block
    replay = TraceNetwork(NetworkConfig(), w, 5, *trace)
    for r, s in enumerate(links):
        got = replay.sample(r, servers)
        assert torch.equal(got.up, s.up[:, servers]) and torch.equal(got.down, s.down[servers, :])
        plain = replay.sample(r)
        assert torch.equal(plain.up, s.up) and torch.equal(plain.down, s.down)


def test_gilbert_elliott_bursts_are_correlated_and_pure() -> None:
    cfg = NetworkConfig(drop_rate=0.0, burst_enter=0.05, burst_exit=0.2, burst_drop_rate=1.0)
    net = NetworkModel(cfg, 4, seed=3)
    lost = np.array([not net.sample(r).up[0, 1].item() for r in range(4000)])
    # Stationary share of bad slots: enter / (enter + exit) = 0.2.
    assert 0.12 < lost.mean() < 0.28
    # Bursty: a loss follows a loss far more often than the marginal rate.
    after_loss = lost[1:][lost[:-1]].mean()
    assert after_loss > 2 * lost.mean()
    again = NetworkModel(cfg, 4, seed=3)
    assert torch.equal(again.sample(1234).up, net.sample(1234).up)  # out of order, same masks


def test_mask_log_grows_past_its_capacity_and_replays(tmp_path) -> None:
    """A run's MaskLog holds every round in bits; past its planned capacity it grows and loses nothing."""
    net = NetworkModel(NetworkConfig(drop_rate=0.4), 5, seed=7)
    samples = [net.sample(r) for r in range(11)]
    log = MaskLog(5, capacity=2)
    for s in samples:
        log.append(s)
    packed = log.packed()
    assert log.rounds == 11 and packed["up"].shape == (11, 4)  # 25 bits -> 4 bytes a round
    save_trace(tmp_path, packed, 5)
    up, down, _ = load_trace(str(tmp_path), 5, 11)
    replay = TraceNetwork(NetworkConfig(), 5, 99, up, down)
    for s in samples:
        r = replay.sample(s.round)
        assert torch.equal(r.up, s.up) and torch.equal(r.down, s.down)


def test_mask_log_put_replaces_one_round_only(tmp_path) -> None:
    """An exchange that completes steps after its launch puts its observed masks at the launch round; the
    other rounds keep theirs, and a round not yet appended or masks of another layout are refused."""
    net, other = NetworkModel(NetworkConfig(drop_rate=0.4), 5, seed=7), NetworkModel(NetworkConfig(), 5, seed=1)
    log = MaskLog(5)
    for r in range(4):
        log.append(net.sample(r))
    before = log.packed()["up"].copy()
    log.put(1, other.sample(1))
    after = log.packed()
    assert np.array_equal(after["up"][[0, 2, 3]], before[[0, 2, 3]])
    save_trace(tmp_path, after, 5)
    replay = TraceNetwork(NetworkConfig(), 5, 99, *load_trace(str(tmp_path), 5, 4))
    assert replay.sample(1).up.all() and torch.equal(replay.sample(2).up, net.sample(2).up)
    with pytest.raises(IndexError, match="round 4"):
        log.put(4, net.sample(4))
    segmented = NetworkModel(NetworkConfig(segment_bytes=8), 5, seed=1, dim=100).sample(0)
    with pytest.raises(ValueError, match="segments"):
        log.put(0, segmented)


@pytest.mark.parametrize("segment_bytes", [0, 8])
def test_mask_log_restore_takes_a_peers_rounds_and_goes_on(segment_bytes: int) -> None:
    """A rank taken back restores the survivors' log (one round per step so far, of their segment layout) and
    appends its own rounds after it, as if it had logged them all; a log that holds rounds refuses."""
    net = NetworkModel(NetworkConfig(drop_rate=0.4, segment_bytes=segment_bytes), 5, seed=7, dim=100)
    samples = [net.sample(r) for r in range(6)]
    peer, mine = MaskLog(5, capacity=2), MaskLog(5, capacity=2)
    for s in samples[:4]:
        peer.append(s)
    mine.restore(peer.packed())
    for s in samples[4:]:
        mine.append(s)
        peer.append(s)
    assert mine.rounds == 6
    assert all(np.array_equal(mine.packed()[k], peer.packed()[k]) for k in ("up", "down", "num_segments"))
    with pytest.raises(ValueError, match="empty log"):
        mine.restore(peer.packed())


def test_trace_round_trip(tmp_path) -> None:
    net = NetworkModel(NetworkConfig(drop_rate=0.4), 5, seed=2)
    samples = [net.sample(r) for r in range(30)]
    save_trace(tmp_path, pack_masks(samples), 5)
    up, down, _ = load_trace(str(tmp_path), 5, 30)
    replay = TraceNetwork(NetworkConfig(), 5, 99, up, down)
    for s in samples:
        r = replay.sample(s.round)
        assert torch.equal(r.up, s.up) and torch.equal(r.down, s.down)
    with pytest.raises(ValueError, match="network.trace .* 30 rounds, fewer than steps = 31"):
        load_trace(str(tmp_path), 5, 31)
    with pytest.raises(ValueError, match="recorded with 5 workers, but num_workers is 4"):
        load_trace(str(tmp_path), 4, 10)
    with pytest.raises(ValueError, match="network.trace: cannot read"):
        load_trace(str(tmp_path / "missing"), 5, 10)
