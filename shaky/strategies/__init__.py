"""Every strategy is a short composition of stages (docs/architecture.md).

Stages: a local optimizer (``optim``: SGD, AdamW), what is exchanged
(``compose``: gradients, models, or the sum of a period's updates), an exchange
(``exchange``: ``reliable_mean``, ``lossy_block_average``) and its wrappers
(``every(period)``, ``delayed(t)``, ``outer(optimizer)``). The registry below is
the whole list; each entry names its paper and its update rule.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shaky.comm.quant import value_format
from shaky.config import STRATEGY_OPTIONS, RunConfig, StrategyConfig
from shaky.strategies.compose import (AverageGradients, AverageModels, AverageUpdates, ComposedState, Strategy,
                                      UpdatesState)
from shaky.strategies.exchange import (Delayed, DelayedState, Every, Exchange, LossyBlockAverage, Outer,
                                       ReliableMean, StepStats, delayed, every, lossy_block_average, outer,
                                       reliable_mean)
from shaky.strategies.optim import (LOCAL_OPTIMIZERS, SGD, AdamW, AdamWState, LocalOptimizer, OuterSGD, OuterState,
                                    SGDState)
from shaky.schedule import Schedule


def _lossy(c: StrategyConfig) -> LossyBlockAverage:
    return lossy_block_average(value_format(c.value_dtype))


def _exact(c: StrategyConfig) -> ReliableMean:
    return reliable_mean(value_format(c.value_dtype))


def _average(c: StrategyConfig) -> Exchange:
    return _exact(c) if c.reliable else _lossy(c)


Builder = Callable[[StrategyConfig, LocalOptimizer], Strategy]

REGISTRY: dict[str, Builder] = {
    # Synchronous SGD, the baseline of Yu et al. (ICML 2019): x_i <- x_i - lr * mean_k g_k, over a transport
    # that resends what it loses (drops cost time on the clock, never accuracy).
    "allreduce": lambda c, opt: AverageGradients("allreduce", opt, _exact(c)),
    # The same gradient average through RPS's two lossy phases: where a block of the average is lost, worker i
    # keeps its own gradient block. Yu et al. show this is vulnerable to drops, unlike averaging models.
    "lossy-allreduce": lambda c, opt: AverageGradients("lossy-allreduce", opt, _lossy(c)),
    # RPS (Yu et al., "Distributed Learning over Unreliable Networks", ICML 2019, Algorithm 1): a local step
    # v_i = x_i - lr g_i, then server j averages block j over the v_i that arrived; x_i[j] takes that average
    # where it arrived, else keeps v_i[j]. With no drops this is synchronous SGD.
    "rps": lambda c, opt: AverageModels("rps", opt, _lossy(c)),
    # Local SGD: the same model average every tau = period steps (tau = 1 is RPS).
    "local-sgd": lambda c, opt: AverageModels("local-sgd", opt, every(c.period, _average(c))),
    # RI-SGD (Haddadpour et al., "Trading Redundancy for Communication", ICML 2019): local SGD on redundant
    # data, each worker sampling from q of the W chunks (shaky.data.assign_chunks); the update is local SGD's.
    "ri-sgd": lambda c, opt: AverageModels("ri-sgd", opt, every(c.period, _lossy(c))),
    # DTS (Zhu et al., "Distributed Training Across the World", 2019, in the accumulated-update form of Delayed
    # Gradient Averaging, NeurIPS 2021): x_i <- x_i + u_i every step; the U_i summed over a period of d steps
    # are averaged, and at step n + t - 1 x_i <- x_i - U_i(n) + avg_j U_j(n) (without the correction,
    # x_i <- x_i + avg_j U_j(n): plain stale SGD). t = 1 is synchronous SGD; d = tau, t = 1 is local SGD.
    "dts": lambda c, opt: AverageUpdates("dts", opt, delayed(c.delay, every(c.period, _lossy(c))),
                                         correction=c.correction),
    # DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models", 2023):
    # H = period local steps of the inner optimizer, then the pseudo-gradient anchor - avg_j x_j (the model at
    # the last average minus the averaged local models) goes through the outer optimizer, SGD with Nesterov
    # momentum: x_i <- anchor - outer_lr * nesterov(pseudo-gradient).
    "diloco": lambda c, opt: AverageModels(
        "diloco", opt, outer(OuterSGD(c.outer_lr, c.outer_momentum, c.outer_nesterov), every(c.period, _average(c)))),
}


def build_strategy(cfg: RunConfig) -> Strategy:
    """The strategy named by ``cfg.strategy.name`` with the run's local optimizer."""
    opt = LOCAL_OPTIMIZERS[cfg.optim.name](cfg.optim)
    return REGISTRY[cfg.strategy.name](cfg.strategy, opt)


def sample_weights(cfg: RunConfig) -> torch.Tensor | None:
    """Each worker's weight in an average (its batch size) if ``strategy.weighted``, else None (equal weights)."""
    return torch.tensor(cfg.worker_batch_sizes(), dtype=torch.float64) if cfg.strategy.weighted else None


if set(REGISTRY) != set(STRATEGY_OPTIONS):  # pragma: no cover (a programming error: the two lists must agree)
    raise RuntimeError("shaky.config.STRATEGY_OPTIONS and the strategy registry list different strategies")

__all__ = ["LOCAL_OPTIMIZERS", "REGISTRY", "SGD", "AdamW", "AdamWState", "AverageGradients", "AverageModels",
           "AverageUpdates", "ComposedState", "Delayed", "DelayedState", "Every", "Exchange", "LossyBlockAverage",
           "Outer", "OuterSGD", "OuterState", "ReliableMean", "SGDState", "Schedule", "StepStats", "Strategy",
           "UpdatesState", "build_strategy", "delayed", "every", "lossy_block_average", "outer", "reliable_mean",
           "sample_weights"]
