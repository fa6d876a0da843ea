"""``shaky.simulate``: your own model and data, trained over a bad network, from Python.

The same run as ``shaky train`` (the same :func:`shaky.setup.prepare` and :func:`shaky.train.train`, the same
run directory), with the model and the data given as objects instead of named in the config.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from shaky.config import RunConfig, config_from_dict, to_dict
from shaky.errors import BadInput, Stop
from shaky.inject import FaultInjector
from shaky.job import checks
from shaky.job.env import JobEnv
from shaky.rundir import BadCheckpoint, read_summary
from shaky.setup import Setup, prepare
from shaky.train import load_run_config, new_run_dir, train
from shaky.user import dataset_of, function_digest, function_name, is_object, object_digest, object_name

__all__ = ["simulate"]


def simulate(model: nn.Module, train_data: Any, test_data: Any, config: RunConfig | dict[str, Any] | None = None,
             *, loss: Callable[[Tensor, Tensor], Tensor] | None = None, out: str | Path | None = None,
             resume: bool = False, progress: bool = True,
             faults: FaultInjector | None = None) -> dict[str, Any] | None:
    """Trains ``model`` on ``train_data`` with every worker, strategy and network ``config`` says, and evaluates
    it on ``test_data``, writing the usual run directory; returns the run's summary (summary.json).

    Every worker starts from ``model``'s parameters (a copy is trained; ``model`` is left as it is). The model's
    output is the logits: ``[B, num_classes]`` for labels ``y [B]``, or ``[B, T, V]`` for a target per position
    ``y [B, T]`` (next-token prediction: loss and accuracy per token, perplexity reported). The simulator runs
    every worker at once through ``torch.func.vmap`` over the workers' parameter rows: a model it cannot vectorize
    (buffers such as BatchNorm's running statistics, control flow on tensor values, dropout) is refused with a
    ValueError in one line before anything is written.

    Args:
        model: Any ``nn.Module`` mapping a batch of ``x`` to logits.
        train_data: ``(x, y)`` tensors or a torch ``Dataset`` of ``(x, y)`` pairs; y holds class indices.
        test_data: The same, for evaluation.
        config: A :class:`~shaky.config.RunConfig` or its dict (``config_from_dict``); None: the defaults. Its
            ``model.name`` and ``data.dataset`` are replaced by ``object:<module>.<class>`` of what is given
            here, and ``model.sha256`` by :func:`shaky.user.object_digest` of ``model``.
        loss: Each sample's loss, ``loss(logits, y) -> [B]`` (as ``F.cross_entropy(..., reduction="none")``
            gives), for training and the test loss; None: cross-entropy (or the function the config's
            ``model.loss`` names). It runs under ``torch.func.vmap`` (every worker at once): torch operations,
            no control flow on tensor values. Recorded as ``model.loss`` with a digest of its source.
            ``backend = "dist"``: this process is one rank of a torch.distributed job its user started (torchrun;
            RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment), as ``shaky train --backend dist``.
        out: The run directory; None: a fresh ``runs/<class>-<strategy>-w<W>-seed<seed>``. Required on the dist
            backend (every rank names the one rank 0 writes).
        resume: Go on with the run in ``out`` from its checkpoint, with its saved config (``config`` must be
            None); ``model`` must be the one it started from (its digest), the data the same (its digest).
        progress: A progress bar and, at the end on the dist backend, rank 0's summary on stdout.
        faults: Deterministic faults (:mod:`shaky.inject`; tests stop a run with them to resume it).

    Returns:
        The summary (None on a dist rank other than 0, which writes nothing).

    Raises:
        ValueError, TypeError: Bad input, before anything is written; the message names the setting.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch nn.Module, got {type(model).__name__}")
    if loss is not None and not callable(loss):
        raise TypeError(f"loss must be a function loss(logits, y) -> [B], got {type(loss).__name__}")
    cfg, run_dir = _config(model, train_data, config, out, resume, loss)
    data = dataset_of("data.dataset", cfg.data.dataset, train_data, test_data)
    env = JobEnv.from_environ(os.environ)    # a user's process: no command line read it for us (as RPSAverager)
    dist = cfg.backend == "dist"
    try:
        setup = prepare(cfg, model=model, data=data, measure=not dist, loss=loss,
                        local_rank=int(env.local_rank or 0) if dist else None)
        if dist:
            return _dist(env, setup, run_dir, progress)
        checks.claim_run_dir(run_dir, resume=resume)
        setup.machines = {0: checks.read_here(setup, run_dir, resume=resume)}
        return train(setup, run_dir, resume=resume, label=cfg.strategy.name, progress=progress, faults=faults)
    except (BadInput, BadCheckpoint) as exc:
        raise ValueError(str(exc)) from None


def _config(model: nn.Module, train_data: Any, config: RunConfig | dict[str, Any] | None, out: str | Path | None,
            resume: bool, loss: Callable[[Tensor, Tensor], Tensor] | None) -> tuple[RunConfig, Path]:
    """The run's config, naming the objects given, and its directory."""
    digest = object_digest(model)
    loss_name, loss_digest = (function_name(loss), function_digest(loss)) if loss is not None else ("", "")
    if resume:
        if out is None or config is not None:
            raise ValueError("resume=True goes on with the run in out (give out) with its saved config "
                             "(leave config None)")
        cfg = load_run_config(out)
        if cfg.model.name != object_name(model) or cfg.model.sha256 != digest:
            raise ValueError(f"resume: {out} was trained from a {cfg.model.name} with sha256 "
                             f"{cfg.model.sha256[:16]}..., and this is a {object_name(model)} with sha256 "
                             f"{digest[:16]}...: give the model it started from (same class, same parameters)")
        if loss is not None and (cfg.model.loss, cfg.model.loss_sha256) != (loss_name, loss_digest):
            was = (f"the loss {cfg.model.loss} with sha256 {cfg.model.loss_sha256[:16]}..." if cfg.model.loss
                   else "cross-entropy")
            raise ValueError(f"resume: {out} was trained with {was}, and this is {loss_name} with sha256 "
                             f"{loss_digest[:16]}...: give the loss it started with")
        if loss is None and is_object(cfg.model.loss):
            raise ValueError(f"resume: {out} was trained with the loss {cfg.model.loss} given to shaky.simulate: "
                             "give it again (loss=...)")
        if cfg.backend == "dist":
            raise ValueError(f"resume: {out} is a dist run; resume it from shaky.simulate on the simulator only "
                             "for now (its ranks' config hand-out is shaky train's)")
        return cfg, Path(out)
    if config is None:
        config = RunConfig()
    if isinstance(config, dict):
        config = config_from_dict(config)
    if not isinstance(config, RunConfig):
        raise TypeError(f"config must be a RunConfig, a dict of settings or None, got {type(config).__name__}")
    values = to_dict(config)
    values["model"] = {**values["model"], "name": object_name(model), "sha256": digest}
    if loss is not None:
        values["model"].update(loss=loss_name, loss_sha256=loss_digest)
    data_name = "object:tensors" if isinstance(train_data, (tuple, list)) else object_name(train_data)
    values["data"] = {**values["data"], "dataset": data_name, "path": "", "sha256": ""}
    cfg = config_from_dict(values)
    if out is None:
        if cfg.backend == "dist":
            raise ValueError("out must name the run directory on backend dist (every rank passes the same)")
        out = new_run_dir(Path("runs") / f"{type(model).__name__}-{cfg.strategy.name}-w{cfg.num_workers}-"
                                         f"seed{cfg.seed}")
    run_dir = Path(out)
    if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        raise ValueError(f"out {str(run_dir)!r} already exists and is not empty; pick another directory or "
                         "resume it (resume=True)")
    return cfg, run_dir


def _dist(env: JobEnv, setup: Setup, run_dir: Path, progress: bool) -> dict[str, Any] | None:
    """This process's rank of a dist run, as ``shaky train --backend dist`` runs it (shaky.job.rank)."""
    from shaky.job import rank  # noqa: PLC0415 (torch.distributed, sockets: only where it is used)

    if not env.is_rank:
        raise ValueError("backend dist: this process is not a rank of a torch.distributed job (no RANK in its "
                         "environment); start it with torchrun, or use backend sim")
    try:
        status = rank.train_dist(env, setup, run_dir, resume=False, quiet=not progress)
    except Stop as exc:
        raise RuntimeError(f"shaky: {exc}") from None
    if status != 0:
        raise RuntimeError(f"shaky: the dist run in {run_dir} stopped (status {status}; its line above says why)")
    return read_summary(run_dir) if env.job_rank in (None, 0) else None
