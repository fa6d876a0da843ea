"""Model averaging: RPS, local SGD and RI-SGD are one update with a period.

RPS (Yu et al., "Distributed Learning over Unreliable Networks", ICML 2019,
Algorithm 1): every worker takes a local SGD step, v_i = x_i - lr * g_i; then
the model (not the gradient) goes through the two lossy phases: server j
averages block j over the v_i that arrived, and worker i sets x_i[j] to that
average if it arrived, else keeps v_i[j]. With no drops this is synchronous SGD.

Local SGD averages the same way, but only every tau = ``period`` steps; tau = 1
is RPS. RI-SGD (Haddadpour et al., "Trading Redundancy for Communication",
ICML 2019) is local SGD on redundant data: each worker samples from q of the W
data chunks (see ``shaky.data.assign_chunks``); the update itself is this one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shaky.comm.base import Comm
from shaky.network.model import LinkSample
from shaky.strategies.base import SGDState, SGDStrategy, StepStats


class LocalSGD(SGDStrategy):
    name = "local-sgd"

    @property
    def period(self) -> int:
        return self.cfg.period

    def step(self, params: torch.Tensor, grads: torch.Tensor, state: SGDState, comm: Comm,
             links: LinkSample) -> tuple[torch.Tensor, SGDState, StepStats]:
        # The new local models go into the gradient buffer (the step owns it), and are averaged in place:
        # no full-size tensor is allocated in the step (see Strategy).
        local, state = self.sgd.update(params, grads, state, overwrite_grads=True)
        return self.after_local_update(local, state, comm, links)

    def local_update(self, params: torch.Tensor,
                     state: SGDState) -> tuple[Callable[[slice, torch.Tensor], None], SGDState]:
        """This step's local SGD update, to be applied in place to ``params`` column slice by column slice
        while the backward pass runs (``shaky.train.train_step``); then :meth:`after_local_update`."""
        return self.sgd.in_place(params, state)

    def after_local_update(self, local: torch.Tensor, state: SGDState, comm: Comm,
                           links: LinkSample) -> tuple[torch.Tensor, SGDState, StepStats]:
        """The rest of the step once every worker holds its new local model ``local`` (the caller's to give up):
        the lossy average on every period-th step."""
        if state.count % self.period:
            return local, state, StepStats()
        averaged, stats = self.lossy_average(local, comm, links, overwrite=True)
        return averaged, state, stats


class RPS(LocalSGD):
    name = "rps"


class RISGD(LocalSGD):
    name = "ri-sgd"
