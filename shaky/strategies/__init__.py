"""One algorithm per module, each an (init, step) pair over [w, D] tensors."""

import torch

from shaky.config import RunConfig
from shaky.strategies.allreduce import AllReduce, LossyAllReduce
from shaky.strategies.base import SGD, SGDState, StepStats, Strategy
from shaky.strategies.dts import DTS, DTSState
from shaky.strategies.local_sgd import RISGD, RPS, LocalSGD

_STRATEGIES = {s.name: s for s in (AllReduce, LossyAllReduce, RPS, LocalSGD, RISGD, DTS)}


def build_strategy(cfg: RunConfig) -> Strategy:
    """The strategy named by ``cfg.strategy.name`` with the run's optimizer and averaging weights."""
    weights = (torch.tensor(cfg.worker_batch_sizes(), dtype=torch.float64) if cfg.strategy.weighted else None)
    return _STRATEGIES[cfg.strategy.name](SGD(cfg.optim), cfg.strategy, weights)


__all__ = ["DTS", "DTSState", "RISGD", "RPS", "SGD", "AllReduce", "LocalSGD", "LossyAllReduce", "SGDState",
           "StepStats", "Strategy", "build_strategy"]
