"""A drop-in model averager for your own torch.distributed training loop.

In the style of torch's ``PeriodicModelAverager``: keep your model, data
loader, loss and optimizer, and add two lines::

    averager = shaky.RPSAverager(model, network={"drop_rate": 0.1})
    ...
    optimizer.step()
    averager.step()

Every ``period`` steps the model goes through RPS's two-phase block exchange
(Yu et al., ICML 2019) among all ranks, with the delivery masks drawn from the
seed exactly as the simulator draws them, so a dropped message is a block that
is left out of the average, identically on every rank. ``period`` > 1 is local
SGD; steps before ``warmup_steps`` average exactly every step, as
PeriodicModelAverager's warm-up does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from shaky.comm.dist import DistComm
from shaky.config import NetworkConfig, config_from_dict
from shaky.network.model import NetworkModel
from shaky.strategies.base import StepStats, block_exchange_traffic


def _network_config(network: NetworkConfig | dict[str, Any] | str | None) -> NetworkConfig:
    if isinstance(network, NetworkConfig):
        return network
    if network is None:
        return NetworkConfig()
    values = {"preset": network} if isinstance(network, str) else dict(network)
    return config_from_dict({"network": values}).network


class ModelAverager:
    """Averages a module's parameters across torch.distributed ranks over a simulated lossy network."""

    def __init__(self, model: torch.nn.Module, *, network: NetworkConfig | dict[str, Any] | str | None = None,
                 period: int = 1, warmup_steps: int = 0, seed: int = 0) -> None:
        """Args:
            model: The module whose parameters every rank averages (same architecture on every rank).
            network: A NetworkConfig, a dict of its settings (``{"drop_rate": 0.1}``), or a preset name.
            period: Average every this many calls of ``step()`` (1 = RPS, more = local SGD).
            warmup_steps: Calls of ``step()`` that average exactly (no drops) every time.
            seed: Seeds the delivery masks; use the same on every rank.
        """
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"period must be an integer >= 1, got {period!r}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
        self.comm = DistComm()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.network = NetworkModel(_network_config(network), self.comm.num_workers, seed)
        self.period = period
        self.warmup_steps = warmup_steps
        self.steps = 0
        self.rounds = 0
        self.bytes_sent = 0
        self.messages_sent = 0
        self.messages_dropped = 0

    @torch.no_grad()
    def step(self) -> None:
        """Call after ``optimizer.step()``; averages when this step's turn comes."""
        self.steps += 1
        if self.steps > self.warmup_steps and self.steps % self.period:
            return
        vec = parameters_to_vector(self.params)[None]
        if self.steps <= self.warmup_steps:
            averaged = self.comm.mean(vec)
        else:
            links = self.network.sample(self.rounds)
            self.rounds += 1
            averaged = self.comm.block_average(vec, links.up.to(vec.device), links.down.to(vec.device))
            self._count(StepStats(block_exchange_traffic(vec, self.comm.num_workers, links, reliable=False)))
        vector_to_parameters(averaged[0], self.params)

    def _count(self, stats: StepStats) -> None:
        self.bytes_sent += stats.bytes_sent
        self.messages_sent += stats.messages_sent
        self.messages_dropped += stats.messages_dropped


class RPSAverager(ModelAverager):
    """RPS: average every step (``period`` = 1)."""

    def __init__(self, model: torch.nn.Module, *, network: NetworkConfig | dict[str, Any] | str | None = None,
                 warmup_steps: int = 0, seed: int = 0) -> None:
        super().__init__(model, network=network, period=1, warmup_steps=warmup_steps, seed=seed)
