"""RPS, the Robust Parameter Server of Yu et al., "Distributed Learning over
Unreliable Networks", ICML 2019, Algorithm 1.

Each worker takes a local SGD step on its model, v_i = x_i - lr * g_i; then the
model (not the gradient) goes through the two lossy phases: server j averages
block j over the v_i that arrived, and worker i sets x_i[j] to that average if
it arrived, else keeps v_i[j]. With no drops this is synchronous SGD exactly.
"""

from __future__ import annotations

import torch

from shaky.comm.base import Comm
from shaky.network.model import LinkSample
from shaky.strategies.base import SGDState, SGDStrategy, StepStats, block_exchange_traffic


class RPS(SGDStrategy):
    name = "rps"

    def step(self, params: torch.Tensor, grads: torch.Tensor, state: SGDState, comm: Comm,
             links: LinkSample) -> tuple[torch.Tensor, SGDState, StepStats]:
        local, state = self.sgd.update(params, grads, state)
        averaged = comm.block_average(local, links.up, links.down)
        return averaged, state, StepStats(block_exchange_traffic(local, comm.num_workers, links, reliable=False))
