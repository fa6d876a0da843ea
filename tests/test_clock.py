"""The simulated clock against figures computed by hand (docs/clock.md has the formulas)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from shaky.config import NetworkConfig, config_from_dict
from shaky.geometry import LinkSample
from shaky.network.clock import Clock, ClockState, PhaseTraffic, hiding_period, scalability
from shaky.network.model import NetworkModel
from shaky.network.presets import REGION_RTT_MS, region_of_workers
from shaky.scale import Workload, exchange_seconds, recommended_period, strategy_scalability
from shaky.strategies.exchange import block_exchange_traffic, ring_allreduce_traffic


def _links(w: int, lost_up: tuple[int, int] | None = None) -> LinkSample:
    up = torch.ones(w, w, dtype=torch.bool)
    if lost_up:
        up[lost_up] = False
    return LinkSample(0, up, torch.ones(w, w, dtype=torch.bool))


def _clock(w: int, compute_ms: float = 5.0, **net) -> Clock:
    return Clock(NetworkModel(NetworkConfig(**net), w, seed=0), compute_ms=compute_ms, retransmit_timeout_ms=200.0)


def _matrix(w: int, off: float, **entries: float) -> tuple[tuple[float, ...], ...]:
    """A [w, w] matrix with ``off`` off the diagonal, 0 on it, and entries named like ``e1_3=50``."""
    m = np.full((w, w), off) - np.eye(w) * off
    for name, value in entries.items():
        i, j = map(int, name[1:].split("_"))
        m[i, j] = value
    return tuple(map(tuple, m.tolist()))


# ---------------------------------------------------------------------------
# One phase, one exchange


def test_two_workers_two_phases() -> None:
    # 1000 float32 values, 2 blocks of 500: each message is 2000 bytes.
    params = torch.zeros(2, 1000)
    phases = block_exchange_traffic(params, 2, _links(2), reliable=True)
    clock = _clock(2, latency_ms=10.0, bandwidth_mbps=8.0)  # 8 Mbit/s = 1e6 bytes/s
    assert clock.phase_seconds(phases[0]) == pytest.approx(0.010 + 2000 / 1e6)
    assert clock.exchange_seconds(phases) == pytest.approx(2 * 0.012)
    assert clock.advance(phases) == pytest.approx(0.005 + 2 * 0.012)  # a synchronous step: compute, then both phases
    assert sum(p.bytes_sent for p in phases) == 4 * 2000  # 2 messages per phase, 2 phases


def test_lost_message_costs_a_timeout_only_on_a_reliable_transport() -> None:
    params = torch.zeros(2, 1000)
    clock = _clock(2, latency_ms=10.0, bandwidth_mbps=8.0)
    reliable = block_exchange_traffic(params, 2, _links(2, lost_up=(0, 1)), reliable=True)
    # Phase 1 takes 12 ms; the lost message is resent after the timeout, 200 ms plus a
    # round trip (20 ms), and takes 12 ms again.
    assert clock.phase_seconds(reliable[0]) == pytest.approx(0.012 + (0.200 + 0.020) + 0.012)
    assert reliable[0].bytes_sent == 3 * 2000 and reliable[0].dropped == 1
    lossy = block_exchange_traffic(params, 2, _links(2, lost_up=(0, 1)), reliable=False)
    assert clock.phase_seconds(lossy[0]) == pytest.approx(0.012)
    assert lossy[0].bytes_sent == 2 * 2000 and lossy[0].dropped == 1


def test_four_workers_the_busiest_port_and_the_slowest_link_set_the_pace() -> None:
    params = torch.zeros(4, 10)  # blocks of 3, 3, 2, 2 values: 12, 12, 8, 8 bytes
    phases = block_exchange_traffic(params, 4, _links(4), reliable=False)
    # 1 ms on every link but 1 -> 3 (50 ms); 1000 bytes/s, so a byte takes 1 ms.
    clock = _clock(4, latency_ms=_matrix(4, 1.0, e1_3=50.0), bandwidth_mbps=0.008)
    # Phase 1: worker 1 sends blocks 0, 2, 3 one after another (12 + 8 + 8 bytes = 28 ms), the
    # last over the 50 ms link: 78 ms. (Server 3 receives 3 x 8 bytes, 24 ms, + 50 ms = 74 ms.)
    assert clock.phase_seconds(phases[0]) == pytest.approx(0.078)
    # Phase 2: server 1 sends its 12-byte block to 3 workers (36 ms), one over the slow link: 86 ms.
    assert clock.phase_seconds(phases[1]) == pytest.approx(0.086)
    assert phases[0].messages == 12 and phases[0].bytes_sent == 3 * (12 + 12 + 8 + 8)


def test_ring_allreduce_takes_2w_minus_2_hops_over_the_slowest_link() -> None:
    # 4 workers, 8 values: chunks of 2 float32 = 8 bytes; 1 ms everywhere but 2 -> 3 (20 ms); 1000 bytes/s.
    clock = _clock(4, latency_ms=_matrix(4, 1.0, e2_3=20.0), bandwidth_mbps=0.008)
    hops = ring_allreduce_traffic(torch.zeros(4, 8), 4, _links(4))
    assert len(hops) == 2 * (4 - 1)
    assert all(h.messages == 4 and h.sent[[0, 1, 2, 3], [1, 2, 3, 0]].all() for h in hops)
    # Every hop waits for link 2 -> 3: 20 ms + 8 bytes. In all: 2(W-1) latencies + 2(W-1)/W of 32 bytes.
    assert clock.exchange_seconds(hops) == pytest.approx(6 * 0.028)
    assert clock.exchange_seconds(hops) == pytest.approx(2 * 3 * 0.020 + 2 * 3 / 4 * 32 / 1000)
    # Same messages and bytes as the block exchange: 2 W (W - 1) messages, 2 (W - 1) D values.
    assert sum(h.messages for h in hops) == 24 and sum(h.bytes_sent for h in hops) == 2 * 3 * 8 * 4


def test_ring_with_uneven_chunks() -> None:
    # 10 values: chunks of 12, 12, 8, 8 bytes. Reduce-scatter hop s: worker 2 sends chunk 2 - s over
    # the slow link; all-gather hop s: chunk 3 - s. Hops: 20 + (8, 12, 12), then 20 + (8, 8, 12) ms.
    clock = _clock(4, latency_ms=_matrix(4, 1.0, e2_3=20.0), bandwidth_mbps=0.008)
    hops = ring_allreduce_traffic(torch.zeros(4, 10), 4, _links(4))
    assert [clock.phase_seconds(h) for h in hops] == pytest.approx([0.028, 0.032, 0.032, 0.028, 0.028, 0.032])


def test_a_lost_ring_message_stalls_its_hop() -> None:
    clock = _clock(4, latency_ms=_matrix(4, 1.0, e2_3=20.0), bandwidth_mbps=0.008)
    # Worker 0's draw towards worker 2 is its message of reduce-scatter hop 1 (the 2nd worker after it).
    hops = ring_allreduce_traffic(torch.zeros(4, 8), 4, _links(4, lost_up=(0, 2)))
    assert [h.dropped for h in hops] == [0, 1, 0, 0, 0, 0] and hops[1].lost[0, 1]
    # Hop 1 waits the timeout (200 ms + a 2 ms round trip on link 0 -> 1) and resends 8 bytes over 1 ms.
    assert clock.phase_seconds(hops[1]) == pytest.approx(0.028 + 0.202 + 0.009)
    assert sum(h.bytes_sent for h in hops) == 6 * 32 + 8


# ---------------------------------------------------------------------------
# Overlap: delayed exchanges, a shared network, state


def test_synchronous_steps_add_compute_and_exchange() -> None:
    clock = _clock(2, compute_ms=100.0)
    assert [clock.tick(0.25) for _ in range(3)] == pytest.approx([0.35, 0.70, 1.05])


def test_overlapped_exchange_that_arrives_late() -> None:
    clock = _clock(2, compute_ms=100.0)
    # Launched when step 0's compute ends (0.1 s), it arrives at 0.35 s; it is needed at the end of
    # step 2 (delay 3), whose compute ends at 0.3 s: the workers wait 50 ms.
    times = [clock.tick(0.25, delay=3), clock.tick(None), clock.tick(None), clock.tick(None)]
    assert times == pytest.approx([0.1, 0.2, 0.35, 0.45])


def test_overlapped_exchange_that_arrives_in_time_costs_nothing() -> None:
    clock = _clock(2, compute_ms=100.0)
    times = [clock.tick(0.15, delay=3), clock.tick(None), clock.tick(None)]
    assert times == pytest.approx([0.1, 0.2, 0.3])
    assert clock.state == ClockState(3, pytest.approx(0.3), pytest.approx(0.25), ())


def test_exchanges_share_the_network_one_at_a_time() -> None:
    clock = _clock(2, compute_ms=100.0)
    # Step 0 launches at 0.1 (arrives 0.35); step 1 launches at 0.2 but the network is busy until
    # 0.35, so it arrives at 0.6. Step 2 waits for the first (0.35), step 3 for the second (0.6).
    times = [clock.tick(0.25, delay=3), clock.tick(0.25, delay=3), clock.tick(None), clock.tick(None)]
    assert times == pytest.approx([0.1, 0.2, 0.35, 0.6])


def test_exchanges_in_flight_overlap_their_latencies() -> None:
    clock = _clock(2, compute_ms=100.0)
    # The same two exchanges, each 200 ms of latency and 50 ms of bytes (busy): the ports are free again at
    # 0.15 s, so the second leaves at 0.2 s (its launch) and arrives at 0.45 s instead of 0.6 s.
    times, waits = [], []
    for exchange in (0.25, 0.25, None, None):
        times.append(clock.tick(exchange, delay=3, busy_s=0.05))
        waits.append(clock.last_wait_s)
    assert times == pytest.approx([0.1, 0.2, 0.35, 0.45])
    assert waits == pytest.approx([0.0, 0.0, 0.05, 0.0])     # step 2's compute ended at 0.3 s


def test_advance_takes_the_busy_part_from_the_phases() -> None:
    params = torch.zeros(2, 1000)
    phases = block_exchange_traffic(params, 2, _links(2), reliable=False)
    clock = _clock(2, compute_ms=1.0, latency_ms=10.0, bandwidth_mbps=8.0)   # 2 ms of bytes, 10 ms latency a phase
    assert clock.busy_seconds(phases) == pytest.approx(2 * 0.002)
    # DTS-like: an exchange every step, due 8 steps later; 24 ms each, but only 4 ms of it holds the ports,
    # so the network keeps up with one exchange per 4 ms and the steps never wait past the first ones.
    for _ in range(100):
        end = clock.advance(phases, delay=8)
    assert end == pytest.approx(100 * 0.004 + 0.001, rel=0.05)
    lost = block_exchange_traffic(params, 2, _links(2, lost_up=(0, 1)), reliable=True)
    assert clock.busy_seconds(lost) == pytest.approx(3 * 0.002)   # the resent message occupies the port again


def test_an_exchanges_own_compute_is_never_hidden() -> None:
    """exchange_compute_ms lengthens the step that launches an exchange, whatever the delay; steps that launch
    nothing keep the plain compute."""
    clock = Clock(NetworkModel(NetworkConfig(), 2, seed=0), compute_ms=100.0, retransmit_timeout_ms=200.0,
                  exchange_compute_ms=20.0)
    times = [clock.tick(0.05, delay=8), clock.tick(None), clock.tick(0.05, delay=8)]
    assert times == pytest.approx([0.12, 0.22, 0.34])


def test_a_control_round_follows_each_exchange_with_latency_only() -> None:
    """A transport with a control round (udp: every rank's record straight to every other, by mail) makes each
    exchange arrive that much later: the slowest link's one-way latency, as every record crosses one link once.
    The round holds no port, so the next exchange is not held back by it."""
    from shaky.network.clock import mail_round_seconds  # noqa: PLC0415

    latency = _matrix(3, 10.0, e2_0=30.0, e0_1=20.0)        # rank 2 -> 0 takes 30 ms, 0 -> 1 takes 20 ms
    assert mail_round_seconds(latency) == pytest.approx(0.030)
    assert mail_round_seconds(25.0) == pytest.approx(0.025) and mail_round_seconds(_matrix(1, 0.0)) == 0.0
    params = torch.zeros(3, 1500)
    phases = block_exchange_traffic(params, 3, _links(3), reliable=False)
    plain = _clock(3, compute_ms=1.0, latency_ms=latency, bandwidth_mbps=8.0)
    rounds = Clock(NetworkModel(NetworkConfig(latency_ms=latency, bandwidth_mbps=8.0), 3, seed=0), compute_ms=1.0,
                   retransmit_timeout_ms=200.0, control_round_s=mail_round_seconds(latency))
    assert rounds.control_round_s == pytest.approx(0.030) and plain.control_round_s == 0.0
    exchange = plain.exchange_seconds(phases)
    assert plain.advance(phases) == pytest.approx(0.001 + exchange)
    assert rounds.advance(phases) == pytest.approx(0.001 + exchange + 0.030)
    # Delayed by 4, an exchange launched every step: each one's round runs while the next three steps compute
    # and their exchanges travel, so four steps take one step's compute, one exchange and its round.
    for clock in (plain, rounds):
        clock.state = ClockState()
        ends = [clock.advance(phases, delay=4) for _ in range(40)]
        assert ends[3::4] == pytest.approx([k * (0.001 + exchange + clock.control_round_s) for k in range(1, 11)])
    assert rounds.advance(()) > 0   # a step without an exchange waits for no round


def test_clock_state_survives_pickling_mid_flight() -> None:
    a, b = _clock(2, compute_ms=100.0), _clock(2, compute_ms=100.0)
    for clock in (a, b):
        clock.tick(0.25, delay=4)
        clock.tick(0.25, delay=4)
    b2 = _clock(2, compute_ms=100.0)
    b2.state = pickle.loads(pickle.dumps(b.state))
    assert len(b2.state.pending) == 2
    assert [a.tick(None) for _ in range(4)] == [b2.tick(None) for _ in range(4)]


# ---------------------------------------------------------------------------
# Scalability


def test_scalability_by_hand() -> None:
    clock = _clock(2, compute_ms=100.0)
    assert scalability(clock, None) == pytest.approx(1.0)                            # no communication
    assert scalability(clock, 0.25) == pytest.approx(0.1 / 0.35)                     # synchronous every step
    assert scalability(clock, 0.25, period=4, steps=400) == pytest.approx(0.4 / 0.65)  # every 4th step
    # Period 4, delay 4: launched at the end of a period, needed 3 steps of compute (0.3 s) later,
    # and the network is free again before the next launch: nobody ever waits.
    assert scalability(clock, 0.25, period=4, delay=4) == pytest.approx(1.0)
    assert hiding_period(0.25, 100.0) == 4 and hiding_period(0.3, 100.0) == 4 and hiding_period(0.0, 100.0) == 1
    # Period 2, delay 4: the network needs 0.25 s per 0.2 s of compute, so it sets the pace.
    assert scalability(clock, 0.25, period=2, delay=4) == pytest.approx(0.2 / 0.25, rel=1e-2)


# ---------------------------------------------------------------------------
# Regions and the geo4 preset


def test_geo4_spreads_workers_over_regions_in_blocks() -> None:
    assert region_of_workers(4, 8) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert region_of_workers(4, 10) == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
    cfg = config_from_dict({"num_workers": 8, "network": {"preset": "geo4", "wan_bandwidth_mbps": 50.0}})
    net = NetworkModel(cfg.network, 8, seed=0)
    oregon, ohio, london, tokyo = 0, 2, 4, 6
    assert net.latency_ms[oregon, ohio] == pytest.approx(68.087 / 2)       # half the measured round trip
    assert net.latency_ms[london, tokyo] == net.latency_ms[tokyo, london] == pytest.approx(215.736 / 2)
    assert net.latency_ms[oregon, oregon + 1] == 0.05 and net.bandwidth_mbps[tokyo, tokyo + 1] == 10000.0  # LAN
    assert net.bandwidth_mbps[ohio, london] == 50.0                         # the WAN, as configured
    assert len(REGION_RTT_MS) == 6


def test_geo4_resnet50_scalability() -> None:
    """The issue's setting: 8 workers in each of 4 regions, 100 Mbit/s WAN, 25.6M float32, 300 ms compute."""
    cfg = config_from_dict({"num_workers": 32, "network": {"preset": "geo4"}})
    work = Workload(25_600_000, 300.0)
    allreduce = strategy_scalability("allreduce", cfg, work, period=1, delay=1)
    t = recommended_period(cfg, work)
    assert t == 43 and exchange_seconds("dts", cfg, work) == pytest.approx(12.54, abs=0.01)
    dts = strategy_scalability("dts", cfg, work, period=t, delay=t)
    assert allreduce <= 0.05 and dts >= 0.7
    assert allreduce == pytest.approx(0.3 / (0.3 + exchange_seconds("allreduce", cfg, work)), rel=1e-3)


def test_a_phase_s_figures_are_kept_only_for_arrays_that_cannot_change() -> None:
    """The clock and the counters keep what a read-only traffic array decides (the cached arrays a run reuses
    every step); a writable array is read afresh each time, so writing into it changes the figures."""
    w = 3
    clock = _clock(w, bandwidth_mbps=8.0, latency_ms=10.0)
    link_bytes = np.full((w, w), 1000.0) - np.eye(w) * 1000.0
    delivered = torch.ones(w, w, dtype=torch.bool)
    writable = PhaseTraffic(link_bytes, delivered, False)
    before = (clock.phase_seconds(writable), writable.messages, writable.bytes_sent)
    link_bytes[0, 1] = 0.0
    link_bytes[1, 0] = 4000.0
    after = (clock.phase_seconds(writable), writable.messages, writable.bytes_sent)
    assert after[1:] == (before[1] - 1, before[2] + 3000 - 1000)
    # sender 1 now sends 5,000 bytes at 1 MB/s, plus 10 ms: 15 ms (it was 12 ms)
    assert after[0] == pytest.approx(0.015) and before[0] == pytest.approx(0.012)

    frozen = link_bytes.copy()
    frozen.flags.writeable = False
    phase = PhaseTraffic(frozen, delivered, False)
    assert (clock.phase_seconds(phase), phase.messages, phase.bytes_sent) == after
    assert clock.phase_seconds(phase) == clock._sent_s(frozen)[0]
    assert id(frozen) in clock._sent_s._memo
    view = frozen[:, :]                        # read-only but not owning its data: never kept
    assert clock.phase_seconds(PhaseTraffic(view, delivered, False)) == after[0]
    assert id(view) not in clock._sent_s._memo
