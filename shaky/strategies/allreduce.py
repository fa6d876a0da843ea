"""Gradient averaging, the baselines of Yu et al. (ICML 2019).

``allreduce``: synchronous SGD over a reliable transport, x_i <- x_i - lr * mean_k g_k.
A lost message is resent, so drops cost time (see the clock), never accuracy.

``lossy-allreduce``: the same gradient average sent through RPS's two lossy
phases: g_i <- block-wise average of the gradients that arrived, where worker i
keeps its own gradient block if the average was lost. The paper shows that this
is vulnerable to drops, unlike averaging models.
"""

from __future__ import annotations

import torch

from shaky.comm.base import Comm
from shaky.network.model import LinkSample
from shaky.strategies.base import SGDState, SGDStrategy, StepStats


class AllReduce(SGDStrategy):
    name = "allreduce"
    reliable = True
    """Whether the gradient average travels over a transport that resends what it loses."""

    def step(self, params: torch.Tensor, grads: torch.Tensor, state: SGDState, comm: Comm,
             links: LinkSample) -> tuple[torch.Tensor, SGDState, StepStats]:
        average = self.reliable_mean if self.reliable else self.lossy_average
        averaged, stats = average(grads, comm, links)
        params, state = self.sgd.update(params, averaged, state)
        return params, state, stats


class LossyAllReduce(AllReduce):
    name = "lossy-allreduce"
    reliable = False
