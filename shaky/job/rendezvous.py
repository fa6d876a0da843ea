"""The job's rendezvous: the keys shaky keeps in the rendezvous store (MASTER_ADDR:MASTER_PORT's), the process
group's start, a process started again for a dead rank finding the run in progress, and a resumed run's config,
which rank 0 hands out before the group forms.

Every value of the environment comes from the :class:`~shaky.job.env.JobEnv` passed in."""

from __future__ import annotations

import errno
import importlib
import json
import os
import socket
import time
from datetime import timedelta
from typing import Any, NamedTuple

import torch.distributed as dist

from shaky.comm.gloo import JoinStore
from shaky.errors import Stop
from shaky.job import keeper
from shaky.job.env import JobEnv
from shaky.launch import EXIT_BAD_INPUT
from shaky.membership.quorum import KEEPER_ADDRESS_KEY


class Keys(NamedTuple):
    """shaky's keys in the rendezvous store, for one attempt (TORCHELASTIC_RESTART_COUNT: torchrun's count of the
    times it started its workers again; its agent's store outlives an attempt, so the keys name the attempt, while
    ``shaky launch`` starts a new store with every rank 0)."""

    run: str
    """The run record (:func:`publish_run`): its presence means a run is in progress."""
    ended: str
    """Set when the run has finished, or stopped for a failure."""
    claim_prefix: str
    """Where each rank > 0 claims its rank before the process group forms (:func:`_claim_rank`)."""
    resume: str
    """A resumed run's config and directory, or the bad input that stops it, which rank 0 reads from the run
    directory and sets before the process group forms (:func:`hand_out_resume`): the other ranks' machines need
    no copy of the directory."""
    resume_read: str
    """How many ranks have read :attr:`resume` (a counter)."""


def keys(attempt: str) -> Keys:
    """The keys of ``attempt`` (:attr:`JobEnv.restart_count`)."""
    return Keys(run=f"shaky/run/{attempt}", ended=f"shaky/ended/{attempt}", claim_prefix=f"shaky/rank/{attempt}/",
                resume=f"shaky/resume/{attempt}", resume_read=f"shaky/resume-read/{attempt}")


def job_keys(env: JobEnv) -> Keys:
    """This process's attempt's keys."""
    return keys(env.restart_count)


def publish_run(store: Any, record: dict[str, Any], *, key: str) -> None:
    """Rank 0: what a process started again for a dead rank needs to know of the run (its directory, its config,
    the measured compute time), at ``key`` (:attr:`Keys.run`) in the rendezvous store (:func:`run_in_progress`)."""
    store.set(key, json.dumps(record))


def say_ended(store: Any, key: str) -> None:
    """Rank 0, the run finished or stopped: a process still waiting to be taken back learns that it will not be
    (``key``: :attr:`Keys.ended`)."""
    store.set(key, "1")


def init_group(env: JobEnv, timeout_s: float, heartbeat_timeout_s: float) -> None:
    """Joins the process group that torchrun describes in the environment.

    Training runs on the CPU, so the group is gloo; collectives that wait longer
    than ``timeout_s`` fail instead of hanging. Rank 0 joins through the keeper's store
    (:func:`rank_0_store`) where no torchrun agent hosts it.
    """
    if dist.is_initialized():
        return
    given = {"RANK": env.rank, "WORLD_SIZE": env.world_size, "MASTER_ADDR": env.master_addr,
             "MASTER_PORT": env.master_port}
    missing = [k for k, v in given.items() if v is None]
    if missing:
        raise ValueError(f"backend dist must be started by torchrun (the environment lacks {', '.join(missing)}); "
                         "e.g. torchrun --nproc-per-node 4 -m shaky train --backend dist ...")
    store = rank_0_store(env, timeout_s, heartbeat_timeout_s)
    if store is None:
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))   # env:// (torch reads the same)
    else:
        # Under the prefix torch's env:// rendezvous gives the other ranks' stores.
        dist.init_process_group("gloo", store=dist.PrefixStore("default_pg", store), rank=0,
                                world_size=env.num_ranks, timeout=timedelta(seconds=timeout_s))


def start_keeper(env: JobEnv, timeout_s: float, heartbeat_timeout_s: float) -> bool:
    """Rank 0, where no torchrun agent hosts the rendezvous store: the keeper started on MASTER_PORT
    (:mod:`shaky.job.keeper`; once a process, as early as the rank knows its config, so that the keeper's start
    overlaps the rank's own preparing), a keeper of a run that is over told to go first. Whether this process
    has one (False: not rank 0, or under torchrun's agent store). A port in use raises DistNetworkError naming
    EADDRINUSE (:func:`port_taken` says it in one line)."""
    rank, world, host, port = _job_address(env)
    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    if rank != 0 or rendezvous._torchelastic_use_agent_store():
        return False
    if keeper.hosted() is None:
        old = keeper.found(host, port)
        if old is not None and keeper.over(old, world):     # the keeper of a run that is over: it goes
            keeper.retire(port, timeout_s)
        try:
            keeper.start(host, port, world=world, ended_key=job_keys(env).ended, timeout_s=timeout_s,
                         heartbeat_timeout_s=heartbeat_timeout_s)
        except OSError as exc:
            raise dist.DistNetworkError(f"the keeper cannot listen on port {port}: {exc} "
                                        f"({'EADDRINUSE' if exc.errno == errno.EADDRINUSE else exc.errno})") from None
    return True


def rank_0_store(env: JobEnv, timeout_s: float, heartbeat_timeout_s: float) -> dist.Store | None:
    """Rank 0, where no torchrun agent hosts the rendezvous store: starts the keeper on MASTER_PORT
    (:mod:`shaky.job.keeper`; once a process) and returns a client of its store, as every other rank has. None
    for any other rank, or under torchrun's agent store. A port in use raises DistNetworkError naming EADDRINUSE
    (:func:`port_taken` says it in one line)."""
    if not start_keeper(env, timeout_s, heartbeat_timeout_s):
        return None
    _, world, host, port = _job_address(env)
    store = dist.TCPStore(host, port, world, is_master=False, timeout=timedelta(seconds=timeout_s))
    store.set(KEEPER_ADDRESS_KEY, f"{host} {port}")     # the control rounds go there too (ControlStore)
    return store


class NoStore(RuntimeError):
    """No rendezvous store answered at MASTER_ADDR:MASTER_PORT in time: the process group cannot form."""


def _knock(host: str, port: int, deadline: float) -> str | None:
    """Waits until something listens at ``host:port`` (None), or says what was last seen there at ``deadline``.
    A plain socket, before torch's store client: that one retries a refused connect well past the timeout it is
    given, logging a stack trace at each try."""
    while True:
        left = deadline - time.monotonic()
        try:
            socket.create_connection((host, port), timeout=max(min(left, 2.0), 0.01)).close()
            return None
        except OSError as exc:
            if deadline - time.monotonic() <= 0:
                return f"{host}:{port}: {exc.strerror or exc}"
            time.sleep(min(0.5, max(deadline - time.monotonic(), 0)))


def run_in_progress(env: JobEnv, timeout_s: float, *, again: bool = False) -> JoinStore | None:
    """For a process of rank > 0 before it joins the process group: the rendezvous store and the run record when
    a run is already in progress at MASTER_ADDR:MASTER_PORT (this process was started again for a rank that died),
    else None (the run starts: rank 0 publishes its record only after every rank has joined). Waits up to
    ``timeout_s`` for the store to come up, as joining the group would. ``again``: rank 0 too (a process started
    again for it finds its run's keeper serving MASTER_PORT, :func:`rank_0_joins`; a rank 0 the others left out
    asks to be taken back)."""
    rank, world = int("0" if env.rank is None else env.rank), env.num_ranks
    host, port, k = env.master_addr, env.master_port, job_keys(env)
    if (rank == 0 and not again) or not host or not port:
        return None
    deadline = time.monotonic() + timeout_s
    why = _knock(host, int(port), deadline)
    if why is not None:
        raise NoStore(f"no store answered at {host}:{port} within {timeout_s:g} s ({why})")
    try:
        raw = dist.TCPStore(host, int(port), is_master=False,
                            timeout=timedelta(seconds=max(deadline - time.monotonic(), 1.0)))
    except (RuntimeError, ValueError):   # the store went again: joining the group will say so
        return None
    if not raw.check([k.run]) or raw.check([k.ended]):
        if rank != 0:
            _claim_rank(env, raw, rank)
        return None
    record = json.loads(raw.get(k.run).decode())
    if record.get("transport") != "udp" and rank != 0:    # gloo takes no rank back: a second process as this rank
        _claim_rank(env, raw, rank)
    return JoinStore(raw, rank, world, record)


def rank_0_joins(env: JobEnv, timeout_s: float) -> JoinStore | None:
    """Rank 0 at its start, where its run's keeper may still serve MASTER_PORT (:mod:`shaky.job.keeper`): the
    run in progress that a process started again for rank 0 joins (udp, not ended), else None. A keeper whose
    run is over (ended, stopped, a gloo run) is told to go, and the port is waited for, so that this rank 0
    starts a run of its own on it (a port held by anything else is said by :func:`port_taken`)."""
    if env.master_port is None or env.rank != "0" or keeper.hosted() is not None:
        return None
    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    if rendezvous._torchelastic_use_agent_store():
        return None
    host, port = env.master_addr or "127.0.0.1", int(env.master_port)
    raw = keeper.found(host, port)
    if raw is None:     # (held by something else: port_taken says so when rank 0 binds the port)
        return None
    if keeper.over(raw, env.num_ranks):
        keeper.retire(port, timeout_s)
        return None
    return run_in_progress(env, timeout_s, again=True)


class RankTaken(ValueError):
    """Another process already holds this rank in the group that is forming (two launchers given one
    --node-rank, or different --nproc-per-node): bad input of this process alone."""


def _claim_rank(env: JobEnv, store: dist.Store, rank: int) -> None:
    """A rank > 0 about to join a new process group claims its rank in the rendezvous store, in the name of its
    machine and launcher (the same launcher starting it again is the same claimant); RankTaken where another
    holds it. Without this the two would both join as that rank, and the group fail or hang."""
    machine = "?" if env.group_rank is None else env.group_rank
    mine = f"host {socket.gethostname()}, launcher pid {os.getppid()}, machine {machine}"
    holder = store.compare_set(f"{job_keys(env).claim_prefix}{rank}", "", mine).decode()
    if holder != mine:
        raise RankTaken(f"rank {rank} is held by another process ({holder}; this one: {mine}): give each machine "
                        "its own --node-rank and every machine the same --nproc-per-node")


_early_stores: list[dist.Store] = []
"""Rank 0's own handle on the rendezvous store, opened before the process group (a client of the keeper's store,
or of torchrun's agent's), kept for the process's life."""


def _required(value: str | None, name: str) -> str:
    if value is None:
        raise KeyError(name)
    return value


def _job_address(env: JobEnv) -> tuple[int, int, str, int]:
    """RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT of a torchrun-style job."""
    try:
        return (int(_required(env.rank, "RANK")), env.num_ranks, _required(env.master_addr, "MASTER_ADDR"),
                int(_required(env.master_port, "MASTER_PORT")))
    except (KeyError, ValueError) as exc:
        raise ValueError(f"backend dist must be started by torchrun or shaky launch (RANK, WORLD_SIZE, "
                         f"MASTER_ADDR and MASTER_PORT: {exc})") from None


def hand_out_resume(env: JobEnv, answer: dict[str, Any], timeout_s: float, heartbeat_timeout_s: float) -> None:
    """Rank 0 of a resumed run, before it joins the process group: sets ``answer`` (``{"config", "run_dir"}``,
    or ``{"error"}``) in the rendezvous store, which it opens as joining the group would (its keeper's, unless
    torchrun's agent hosts it). With an error it then waits, at most ``timeout_s``, until every other rank has
    read it, so that every rank stops with the same line at about the same time."""
    _, world, host, port = _job_address(env)
    k = job_keys(env)
    # The keeper's store (rank_0_store), or torchrun's agent's, without waiting for the other ranks to join (they
    # join the group later, and the group's handle waits for them).
    store = rank_0_store(env, timeout_s, heartbeat_timeout_s) or dist.TCPStore(
        host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    _early_stores.append(store)
    store.set(k.resume, json.dumps(answer))
    if "error" in answer:
        deadline = time.monotonic() + timeout_s
        while store.add(k.resume_read, 0) < world - 1 and time.monotonic() < deadline:
            time.sleep(0.05)


class NoResume(RuntimeError):
    """A rank > 0 of a resumed run got nothing from rank 0 (no store, or rank 0 went before it answered)."""


def resumed_run(env: JobEnv, timeout_s: float) -> dict[str, Any]:
    """Rank > 0 of a resumed run, before it joins the process group: rank 0's answer (:func:`hand_out_resume`),
    or, where a udp run is in progress (this process was started again for a rank of it), its record's config
    and directory (:func:`run_in_progress` then takes it back). A store whose run has ended, or a gloo run's
    (which takes no rank back), belongs to the attempt before: it is waited out, as a store that goes away is,
    until the next one answers. Waits at most ``timeout_s`` in all."""
    rank, _, host, port = _job_address(env)
    k = job_keys(env)
    deadline = time.monotonic() + timeout_s
    seen = "no store"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise NoResume(f"rank {rank} got no answer from rank 0 at {host}:{port} within {timeout_s:g} s: a "
                           "resumed run's config and checkpoint come from rank 0, which reads the run directory "
                           f"(is it running? {seen})")
        knocked = _knock(host, port, deadline)
        if knocked is not None:
            seen = knocked
            continue
        try:
            store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=min(left, 10.0)))
            while time.monotonic() < deadline:
                if store.check([k.ended]):
                    seen = "the store there is the ended run's"
                elif store.check([k.resume]):
                    answer = json.loads(store.get(k.resume).decode())
                    store.add(k.resume_read, 1)
                    break
                elif store.check([k.run]):
                    record = json.loads(store.get(k.run).decode())
                    if record.get("transport") == "udp":
                        answer = {"config": record["config"], "run_dir": record["run_dir"],
                                  "machines": record.get("machines", {})}
                        break
                    seen = "the store there is a gloo run's, which takes no rank back"
                time.sleep(0.05)
            else:
                continue
        except (RuntimeError, ValueError) as exc:   # DistStoreError (a timeout), DistNetworkError: RuntimeErrors
            seen = " ".join(str(exc).split())[:80]
            time.sleep(0.2)
            continue
        if not isinstance(answer, dict) or not ({"error"} <= answer.keys() or {"config", "run_dir"} <= answer.keys()):
            raise NoResume(f"rank {rank}: {k.resume} in the store at {host}:{port} is not shaky's answer")
        return answer


def no_group(env: JobEnv, timeout_s: float, why: str) -> Stop:
    """The one line of a rank whose process group did not form (status 3), or of a rank 0 that could not host
    the rendezvous store because its port is taken (:func:`port_taken`, status 2)."""
    taken = port_taken(env, why)
    if taken is not None:
        return taken
    return Stop(f"error: rank {env.rank}: the process group did not form (rank 0's store at "
                f"{env.master_addr}:{env.master_port}; every rank must start within "
                f"dist_timeout_s = {timeout_s:g} s of the others): {' '.join(why.split())[:100]}", 3)


def port_taken(env: JobEnv, why: str) -> Stop | None:
    """The one line (status 2) of a rank 0 whose rendezvous store could not listen because its port is in use
    (torch's DistNetworkError names EADDRINUSE): another program or run on the port, or a second launcher given
    --node-rank 0 for the same run. None for any other failure."""
    if "EADDRINUSE" not in why:
        return None
    return Stop(f"error: rank 0 cannot host the rendezvous store: --master-port {env.master_port} is "
                "in use on this machine (another run or program on it, or a second launcher given --node-rank 0); "
                "give a free --master-port, and --node-rank 0 to one launcher only", EXIT_BAD_INPUT)
