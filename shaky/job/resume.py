"""A resumed dist run's config: rank 0 reads it from the run directory and hands it out through the rendezvous
store before the process group forms, so that the other ranks' machines need no copy of the directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shaky.config import DIST_TIMEOUT_S, HEARTBEAT_TIMEOUT_S, config_from_dict, load_toml, to_dict, with_settings
from shaky.errors import BadInput, Stop
from shaky.job.env import JobEnv
from shaky.job.rendezvous import NoResume, hand_out_resume, port_taken, resumed_run
from shaky.job.stop import launcher
from shaky.launch import EXIT_BAD_INPUT
from shaky.progress import say
from shaky.rundir import CONFIG_FILE, read_machines
from shaky.train import load_run_config

RESUME_ERROR_WAIT_S = 30.0
"""How long rank 0 of a resumed run that stops on bad input waits for the other ranks to read that (their
machines may have no copy of the run directory: rank 0's answer is all they learn)."""


def with_own(cfg: Any, own: dict[str, Any]) -> Any:
    """``cfg`` with this machine's settings ``own`` (ValueError where the result is not a valid config)."""
    return with_settings(cfg, own) if own else cfg


def hand_out_config(env: JobEnv, run_dir: Path, own: dict[str, Any]) -> Any:
    """Rank 0 of a resumed run reads its config from the run directory and hands it, with the directory, to the
    other ranks through the rendezvous store before the process group forms: their machines need no copy of the
    directory (the checkpoint follows over the group, ``shaky.train``). Bad input goes to them too, so that every
    rank stops at once with status 2 (rank 0 says why). ``own``: rank 0's machine settings given anew; each
    other rank gets its own as the run's last start recorded them (``machines.json``), and may give its own
    anew too (:func:`config_from_rank_0`)."""
    try:
        try:
            cfg = with_own(load_run_config(run_dir), own)
            machines = {str(rank): machine["settings"] for rank, machine in read_machines(run_dir).items() if rank}
        except (ValueError, TypeError) as exc:
            raise BadInput(str(exc)) from None
        if cfg.backend != "dist" and launcher(env) == "shaky launch":
            raise BadInput(f"--resume {run_dir}: a run on backend {cfg.backend!r}, and shaky launch runs backend "
                           f"'dist' (resume it with `shaky train --resume {run_dir}`)")
    except BadInput as exc:
        if env.num_ranks > 1:
            say(f"shaky: error: {exc}")
            hand_out_resume(env, {"error": str(exc)}, RESUME_ERROR_WAIT_S, HEARTBEAT_TIMEOUT_S)
            raise Stop("", EXIT_BAD_INPUT) from None
        raise
    if cfg.backend != "dist":   # a simulator run resumed where RANK is set (started by torchrun, a cluster's job)
        return cfg
    if env.num_ranks > 1:
        try:
            hand_out_resume(env, {"config": to_dict(cfg), "run_dir": str(run_dir.resolve()), "machines": machines},
                            cfg.dist_timeout_s, cfg.dist.heartbeat_timeout_s)
        except RuntimeError as exc:     # DistNetworkError: the port is taken, the address is not this machine's
            raise port_taken(env, str(exc)) or Stop(
                f"error: rank 0 cannot open the rendezvous store at {env.master_addr}:"
                f"{env.master_port}: {' '.join(str(exc).split())[:100]}", 3) from None
    return cfg


def simulator_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a readable config of a simulator run (resumed by a process that RANK names, e.g.
    a cluster's job step, it runs as any simulator run does). Nothing else is read here: a dist run's rank > 0
    takes its config from rank 0."""
    try:
        return config_from_dict(load_toml(str(run_dir / CONFIG_FILE))).backend != "dist"
    except (OSError, ValueError, TypeError):
        return False


def config_from_rank_0(env: JobEnv, own: dict[str, Any]) -> tuple[Any, Path]:
    """A rank > 0 of a resumed run: the config and directory rank 0 handed out (:func:`hand_out_config`), with
    this rank's machine settings as the run's last start recorded them, and then ``own``, given anew."""
    try:    # the run's own dist_timeout_s is in the answer: wait as long as a new run's ranks wait by default
        answer = resumed_run(env, DIST_TIMEOUT_S)
    except NoResume as exc:
        raise Stop(f"error: {exc}", 3) from None
    if "error" in answer:
        raise BadInput(answer["error"])     # rank 0 says it
    recorded = answer.get("machines", {}).get("" if env.rank is None else env.rank, {})
    try:    # (what the store holds is checked against rank 0's own config once the group forms)
        return with_own(config_from_dict(answer["config"]), {**recorded, **own}), Path(answer["run_dir"])
    except (ValueError, TypeError) as exc:
        raise BadInput(str(exc)) from None
