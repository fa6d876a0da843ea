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
PeriodicModelAverager's warm-up does. With ``outer_optimizer`` (for example
``shaky.OuterSGD(lr=0.7, momentum=0.9)``) the averaged model goes through
DiLoCo's outer step: ``ModelAverager(model, period=H, outer_optimizer=...)`` is
DiLoCo around your own inner optimizer.

Nothing here changes process-wide settings (threads, OpenMP, malloc): those are
the command line's; ``docs/performance.md`` says which ones pay off and how to
set them in your own process.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from shaky.comm.dist import DistComm
from shaky.config import NetworkConfig, config_from_dict
from shaky.network.faults import Membership, Round
from shaky.network.model import NetworkModel
from shaky.schedule import Schedule
from shaky.strategies.exchange import StepStats, lossy_block_average
from shaky.strategies.optim import OuterSGD, OuterState


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
                 period: int = 1, warmup_steps: int = 0, seed: int = 0,
                 outer_optimizer: OuterSGD | None = None) -> None:
        """Args:
            model: The module whose parameters every rank averages (same architecture on every rank).
            network: A NetworkConfig, a dict of its settings (``{"drop_rate": 0.1}``), or a preset name.
            period: Average every this many calls of ``step()`` (1 = RPS, more = local SGD).
            warmup_steps: Calls of ``step()`` that average exactly (no drops) every time.
            seed: Seeds the delivery masks; use the same on every rank.
            outer_optimizer: DiLoCo's outer step on the averaged model (``shaky.OuterSGD``); None: the average
                itself.
        """
        self.schedule = Schedule(period=period, warmup_steps=warmup_steps)
        if outer_optimizer is not None and not isinstance(outer_optimizer, OuterSGD):
            raise TypeError(f"outer_optimizer must be a shaky.OuterSGD, got {type(outer_optimizer).__name__}")
        self.comm = DistComm()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.network = NetworkModel(_network_config(network), self.comm.num_workers, seed)
        self.exchange = lossy_block_average()
        self.members = Membership.everyone(self.comm.num_workers)
        self.outer = outer_optimizer
        # The anchor of the first outer step: the model as it is now, before any local step (construct the
        # averager before training, as torch's averagers are).
        self.outer_state: OuterState | None = None if outer_optimizer is None else \
            outer_optimizer.init(parameters_to_vector(self.params).detach()[None])
        self.steps = 0
        self.rounds = 0
        self.bytes_sent = 0
        self.messages_sent = 0
        self.messages_dropped = 0

    @torch.no_grad()
    def step(self) -> None:
        """Call after ``optimizer.step()``; averages when this step's turn comes."""
        step = self.steps
        self.steps += 1
        if not self.schedule.launches(step):
            return
        vec = parameters_to_vector(self.params)[None]
        if self.schedule.in_warmup(step):
            averaged = self.comm.mean(vec)
            if self.outer is not None:  # warm-up averages exactly; the outer step starts after it
                self.outer_state = self.outer.init(averaged)
        else:
            links = self.network.sample(self.rounds)
            averaged, _, stats = self.exchange(vec, self.comm, Round(self.rounds, links, self.members), ())
            self.rounds += 1
            self._count(stats)
            if self.outer is not None and self.outer_state is not None:  # (not None together: for the type checker)
                averaged, self.outer_state = self.outer.update(averaged, self.outer_state)
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
