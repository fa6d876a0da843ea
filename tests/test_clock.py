"""The simulated clock against figures computed by hand."""

from __future__ import annotations

import pytest
import torch

from shaky.config import NetworkConfig
from shaky.network.clock import Clock
from shaky.network.model import LinkSample, NetworkModel
from shaky.strategies.base import block_exchange_traffic


def _links(w: int, lost_up: tuple[int, int] | None = None) -> LinkSample:
    up = torch.ones(w, w, dtype=torch.bool)
    if lost_up:
        up[lost_up] = False
    return LinkSample(0, up, torch.ones(w, w, dtype=torch.bool))


def _clock(w: int, **net) -> Clock:
    return Clock(NetworkModel(NetworkConfig(**net), w, seed=0), compute_ms=5.0, retransmit_timeout_ms=200.0)


def test_two_workers_two_phases() -> None:
    # 1000 float32 values, 2 blocks of 500: each message is 2000 bytes.
    params = torch.zeros(2, 1000)
    phases = block_exchange_traffic(params, 2, _links(2), reliable=True)
    clock = _clock(2, latency_ms=10.0, bandwidth_mbps=8.0)  # 8 Mbit/s = 1e6 bytes/s
    assert clock.phase_seconds(phases[0]) == pytest.approx(0.010 + 2000 / 1e6)
    assert clock.step_seconds(phases) == pytest.approx(0.005 + 2 * 0.012)
    assert sum(p.bytes_sent for p in phases) == 4 * 2000  # 2 messages per phase, 2 phases


def test_lost_message_costs_a_timeout_only_on_a_reliable_transport() -> None:
    params = torch.zeros(2, 1000)
    clock = _clock(2, latency_ms=10.0, bandwidth_mbps=8.0)
    reliable = block_exchange_traffic(params, 2, _links(2, lost_up=(0, 1)), reliable=True)
    # Phase 1 waits 12 ms, then the 200 ms timeout, then resends the lost message (12 ms).
    assert clock.phase_seconds(reliable[0]) == pytest.approx(0.012 + 0.200 + 0.012)
    assert reliable[0].bytes_sent == 3 * 2000 and reliable[0].dropped == 1
    lossy = block_exchange_traffic(params, 2, _links(2, lost_up=(0, 1)), reliable=False)
    assert clock.phase_seconds(lossy[0]) == pytest.approx(0.012)
    assert lossy[0].bytes_sent == 2 * 2000 and lossy[0].dropped == 1


def test_four_workers_slowest_link_sets_the_pace() -> None:
    latency = [[0.0, 1.0, 1.0, 1.0], [1.0, 0.0, 1.0, 50.0], [1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]]
    params = torch.zeros(4, 10)  # blocks of 3, 3, 2, 2 values
    phases = block_exchange_traffic(params, 4, _links(4), reliable=False)
    clock = _clock(4, latency_ms=tuple(map(tuple, latency)), bandwidth_mbps=0.008)  # 1000 bytes/s
    # Phase 1: link 1 -> 3 carries block 3 (2 values, 8 bytes): 50 ms + 8 ms; link 0 -> 1 carries 12 bytes: 13 ms.
    assert clock.phase_seconds(phases[0]) == pytest.approx(0.058)
    # Phase 2: server 1 sends its 12-byte block to worker 3 over the slow link 1 -> 3: 50 ms + 12 ms.
    assert clock.phase_seconds(phases[1]) == pytest.approx(0.062)
    assert phases[0].messages == 12 and phases[0].bytes_sent == 3 * (12 + 12 + 8 + 8)
