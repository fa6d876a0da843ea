"""One algorithm per module, each an (init, step) pair over [w, D] tensors."""

from shaky.config import RunConfig
from shaky.strategies.allreduce import AllReduce, LossyAllReduce
from shaky.strategies.base import SGD, SGDState, StepStats, Strategy
from shaky.strategies.rps import RPS

_STRATEGIES = {s.name: s for s in (AllReduce, LossyAllReduce, RPS)}


def build_strategy(cfg: RunConfig) -> Strategy:
    """The strategy named by ``cfg.strategy.name`` with the run's optimizer."""
    return _STRATEGIES[cfg.strategy.name](SGD(cfg.optim))


__all__ = ["RPS", "SGD", "AllReduce", "LossyAllReduce", "SGDState", "StepStats", "Strategy", "build_strategy"]
