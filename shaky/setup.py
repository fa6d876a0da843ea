"""Everything a run needs, built and checked before anything is written, and how a run is evaluated.

``prepare`` does everything that can fail on user input (data, shards, model,
network, strategy) and raises ValueError naming the setting; ``evaluate`` and
``gradient_diversity`` are the metrics a run reports.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import vmap

from shaky.comm.base import Comm
from shaky.config import RunConfig
from shaky.data import Dataset, assign_chunks, load_dataset, partition
from shaky.models import FlatParams, build_model
from shaky.network.model import NetworkModel, TraceNetwork, load_trace
from shaky.strategies import Strategy, build_strategy
from shaky.vectorized import make_functions


@dataclass
class Setup:
    """Everything a run needs, built and checked before anything is written."""

    cfg: RunConfig
    data: Dataset
    shards: list[np.ndarray]
    model: torch.nn.Module
    flat: FlatParams
    network: NetworkModel
    strategy: Strategy[Any]
    compute_ms: float
    dtype: torch.dtype
    grad_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    forward_fn: Callable[..., torch.Tensor] = field(repr=False)


# Measured compute times, per (dataset, model, batch size, dtype), shared by the runs of one process
# so that runs compared side by side (the demo, a sweep) are charged the same compute time.
_COMPUTE_MS: dict[tuple[Any, ...], float] = {}


def _measure_compute_ms(setup: Setup, params: torch.Tensor) -> float:
    """Fastest of a few timed forward+backward passes of one worker at its batch size, on this machine.

    The minimum, not the mean, because everything else running on the machine only ever adds time.
    """
    cfg = setup.cfg
    key = (cfg.data.dataset, cfg.data.path, cfg.model.name, cfg.model.hidden, cfg.batch_size, cfg.dtype)
    if key not in _COMPUTE_MS:
        n = min(cfg.batch_size, len(setup.data.y_train))
        x, y = setup.data.x_train[None, :n], setup.data.y_train[None, :n]
        mask = torch.ones(1, n, dtype=x.dtype if x.is_floating_point() else setup.dtype)
        times = []
        for i in range(10):
            t0 = time.perf_counter()
            setup.grad_fn(params[:1], x, y, mask)
            if i >= 3:  # the first calls pay for allocation and dispatch warm-up
                times.append(time.perf_counter() - t0)
        _COMPUTE_MS[key] = float(min(times) * 1e3)
    return _COMPUTE_MS[key]


def prepare(cfg: RunConfig) -> Setup:
    """Loads data, cuts shards, builds the model, network and strategy; raises ValueError on bad input."""
    dtype = getattr(torch, cfg.dtype)
    data = load_dataset(cfg.data.dataset, seed=cfg.seed, path=cfg.data.path,
                        test_fraction=cfg.data.test_fraction, max_len=cfg.data.max_len)
    if data.x_train.is_floating_point():
        data = dataclasses.replace(data, x_train=data.x_train.to(dtype), x_test=data.x_test.to(dtype))
    chunks = partition(data.y_train.numpy(), cfg.num_workers, kind=cfg.data.partition, seed=cfg.seed,
                       alpha=cfg.data.dirichlet_alpha)
    shards = assign_chunks(chunks, cfg.strategy.redundancy)
    model = build_model(cfg.model.name, input_shape=data.input_shape, num_classes=data.num_classes,
                        vocab_size=data.vocab_size, hidden=cfg.model.hidden, seed=cfg.seed).to(dtype)
    flat = FlatParams(model)
    if cfg.network.trace:
        up, down = load_trace(cfg.network.trace, cfg.num_workers, cfg.steps)
        network: NetworkModel = TraceNetwork(cfg.network, cfg.num_workers, cfg.seed, up, down)
    else:
        network = NetworkModel(cfg.network, cfg.num_workers, cfg.seed)
    grad_fn, forward_fn = make_functions(model, flat)
    setup = Setup(cfg, data, shards, model, flat, network, build_strategy(cfg), cfg.network.compute_ms,
                  dtype, grad_fn, forward_fn)
    if setup.compute_ms < 0:
        setup.compute_ms = _measure_compute_ms(setup, flat.flatten(model)[None])
    return setup


def gradient_diversity(grads: torch.Tensor, comm: Comm, weights: torch.Tensor | None) -> float:
    """sum_i ||g_i||^2 / ||sum_i g_i||^2 over the live workers (Yin et al. 2018): 1/n for equal gradients."""
    n = comm.num_workers if weights is None else float(weights.sum())
    mean_sq = comm.mean(grads.pow(2).sum(dim=1, keepdim=True), weights)[0, 0]
    mean_grad = comm.mean(grads, weights)[0]
    return float(mean_sq / (n * mean_grad.pow(2).sum()))


def evaluate(setup: Setup, params: torch.Tensor, comm: Comm, weights: torch.Tensor | None = None,
             chunk: int = 2048) -> dict[str, float]:
    """Test metrics of the averaged model and of each worker, and the consensus distance (over live workers)."""
    mean = comm.mean(params, weights)[:1]
    consensus = comm.mean((params - mean).pow(2).sum(dim=1, keepdim=True), weights)[0, 0]
    x, y = setup.data.x_test, setup.data.y_test
    avg_correct = avg_loss = 0.0
    worker_correct = torch.zeros(params.shape[0], dtype=torch.float64)
    per_worker = vmap(setup.forward_fn, in_dims=(0, None))
    with torch.no_grad():
        for s in range(0, len(y), chunk):
            xs, ys = x[s:s + chunk], y[s:s + chunk]
            out = setup.forward_fn(mean[0], xs)
            avg_loss += float(F.cross_entropy(out, ys, reduction="sum"))
            avg_correct += float((out.argmax(-1) == ys).sum())
            worker_correct += (per_worker(params, xs).argmax(-1) == ys).sum(dim=1).double()
    worker_acc = comm.mean((worker_correct / len(y))[:, None], weights)[0, 0]
    return {"test_accuracy": avg_correct / len(y), "test_loss": avg_loss / len(y),
            "worker_test_accuracy": float(worker_acc), "consensus_distance": float(consensus)}
