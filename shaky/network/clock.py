"""The simulated wall clock: compute time plus the time each exchange takes on the network.

Latency and bandwidth never slow the simulator down; they only move this clock.
A step costs ``compute_ms`` plus, for each phase of its exchanges, the slowest
link's ``latency + bytes / bandwidth`` (all links of a phase transfer at once).
A reliable transport that lost a message in a phase waits the retransmission
timeout and then resends the lost messages; an unreliable one never waits: what
did not arrive in time is treated as lost.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shaky.network.model import NetworkModel


@dataclass(frozen=True, slots=True)
class PhaseTraffic:
    """One phase of an exchange: every message that crossed the network at once."""

    link_bytes: np.ndarray
    """float [W, W]: bytes sent on link i -> j in this phase (0 where nothing is sent)."""
    delivered: torch.Tensor
    """bool [W, W]: whether the message on link i -> j arrived."""
    reliable: bool
    """True if a lost message is detected and resent (TCP-like), False if it is just lost."""

    @property
    def sent(self) -> np.ndarray:
        return self.link_bytes > 0

    @property
    def lost(self) -> np.ndarray:
        return self.sent & ~self.delivered.numpy()

    @property
    def messages(self) -> int:
        return int(self.sent.sum())

    @property
    def dropped(self) -> int:
        return int(self.lost.sum())

    @property
    def bytes_sent(self) -> int:
        """Bytes put on the wire; a lost message counts, and a resent one counts again."""
        total = self.link_bytes.sum()
        if self.reliable:
            total += self.link_bytes[self.lost].sum()
        return int(total)


class Clock:
    """Accumulates simulated seconds from compute time and each step's exchanges."""

    def __init__(self, network: NetworkModel, compute_ms: float, retransmit_timeout_ms: float) -> None:
        self.latency_s = network.latency_ms / 1e3
        self.bytes_per_s = network.bandwidth_mbps * 1e6 / 8
        self.compute_s = compute_ms / 1e3
        self.rto_s = retransmit_timeout_ms / 1e3

    def _transfer_s(self, link_bytes: np.ndarray, mask: np.ndarray) -> float:
        if not mask.any():
            return 0.0
        return float((self.latency_s + link_bytes / self.bytes_per_s)[mask].max())

    def phase_seconds(self, phase: PhaseTraffic) -> float:
        """Seconds until every worker holds what it will get from this phase."""
        seconds = self._transfer_s(phase.link_bytes, phase.sent)
        lost = phase.lost
        if phase.reliable and lost.any():
            seconds += self.rto_s + self._transfer_s(phase.link_bytes, lost)
        return seconds

    def step_seconds(self, phases: tuple[PhaseTraffic, ...]) -> float:
        """One step: compute, then the phases one after another."""
        return self.compute_s + sum(self.phase_seconds(p) for p in phases)
