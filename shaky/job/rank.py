"""One rank of a dist run (torchrun or ``shaky launch``): its start, its rejoin, its stop.

What happens when rank R dies:

* gloo (and udp without live membership): the next collective fails on every other rank; each names the rank
  whose heartbeat went silent (``rank R stopped answering after step N``) and the last checkpoint, in one line,
  and exits with status 3 (:func:`run_stopped`).
* udp with ``dist.heartbeat_timeout_s`` (live membership, its default): the survivors leave R out once its
  heartbeat has been silent that long and train on; a process started again as R (``shaky launch
  --max-restarts``) finds the run in progress (:func:`joining`) and is taken back at a step's start
  (:func:`rejoin`).
* R = 0 is a rank like the others. The run's store lives in the keeper (:mod:`shaky.job.keeper`), a process of
  its own that rank 0 starts on its machine (under torchrun, the agent's store, and torchrun's agent stops
  every rank when one fails anyway), and the run directory is written by the first live rank of
  :class:`~shaky.train.Writers` (rank 0, then the others that see the directory). A store that goes (the
  keeper's machine died) ends the run (``the run's store ... is gone``, status 3).
* A run that stopped is started again from its last checkpoint by ``shaky launch --max-restarts`` (every rank
  with ``--resume``: :mod:`shaky.job.resume`).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import torch.distributed as dist

from shaky.comm.gloo import DistComm, JoinStore, broadcast_object, gather_object, rendezvous_store
from shaky.comm.staged import StagedComm
from shaky.comm.udp.comm import udp_comm
from shaky.config import MACHINE_SETTINGS, first_difference, machine_settings, to_dict
from shaky.errors import AloneBadInput, BadInput, Stop
from shaky.job.checks import check_same_config, check_taken_back, claim_run_dir, faults, other_inputs
from shaky.job import keeper
from shaky.job.env import JobEnv
from shaky.job.rendezvous import (NoStore, RankTaken, init_group, job_keys, no_group, publish_run, rank_0_joins,
                                  run_in_progress, say_ended, start_keeper)
from shaky.job.stop import checkpoint_note, dist_command, launcher, stopping
from shaky.launch import tell_launcher
from shaky.membership import Agreed, Members, Scheduled
from shaky.membership.heartbeat import Heartbeat
from shaky.membership.quorum import ForgedRecord, LeftBehind, NotTakenBack
from shaky.progress import say
from shaky.resumable import check_params
from shaky.rundir import CHECKPOINT_FILE, load_checkpoint, read_machines
from shaky.setup import inputs_digest, measured_compute_ms
from shaky.train import Writers, schedule_of, train


def joining(env: JobEnv, timeout_s: float) -> JoinStore | None:
    """A process of a torchrun-style job started again for a rank that died: the run in progress at
    MASTER_ADDR:MASTER_PORT (:func:`shaky.job.rendezvous.run_in_progress`; for rank 0, where its run's keeper
    still serves the port: :func:`shaky.job.rendezvous.rank_0_joins`), else None."""
    if env.rank is None or env.master_port is None:
        return None
    try:
        if env.rank == "0":
            return rank_0_joins(env, timeout_s)
        return run_in_progress(env, timeout_s)
    except RankTaken as exc:    # said here: rank 0 does not know of this process
        raise AloneBadInput(str(exc)) from None
    except NoStore as exc:
        tell_launcher(env.run_file, None, None, stopped=True)     # not a rank to start again alone: there is no run
        raise no_group(env, timeout_s, str(exc)) from None


def keep_store(env: JobEnv, cfg: Any) -> None:
    """Rank 0 of a dist run that starts: its keeper started now (:func:`shaky.job.rendezvous.start_keeper`),
    while this process still prepares. A port in use stops it with one line (status 2), as joining the group
    would."""
    try:
        start_keeper(env, cfg.dist_timeout_s, cfg.dist.heartbeat_timeout_s)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    except RuntimeError as exc:     # DistNetworkError: the port is taken
        raise no_group(env, cfg.dist_timeout_s, str(exc)) from None


def rejoin(env: JobEnv, setup: Any, joining: Any, *, quiet: bool) -> int:
    """A process started again for a dead rank of a udp run: the survivors take it back at a step's start and it
    trains on with them; it writes the run directory only once the writer and the ranks before it in
    :class:`~shaky.train.Writers`' order are left out (the survivors hand it both)."""
    cfg, record, rank = setup.cfg, joining.record, joining.rank
    where = f"{env.master_addr}:{env.master_port}"
    if record.get("transport") != "udp":
        raise AloneBadInput(f"rank {rank} cannot rejoin the run in progress at {where}: it uses the "
                            f"{record.get('transport')} transport, on which a failure stops every rank "
                            "(resume it from its checkpoint; --transport udp keeps training through failures)")
    differs = first_difference(json.loads(json.dumps(to_dict(cfg))), record["config"], ignore=MACHINE_SETTINGS)
    if differs is not None:
        name, mine, theirs = differs
        raise AloneBadInput(f"rank {rank} cannot rejoin the run in progress at {where}: its {name} is {mine!r}, the "
                            f"run's is {theirs!r} (start it with the run's command line)")
    differs = other_inputs(cfg, {"settings": machine_settings(cfg), "inputs": inputs_digest(setup)}, record,
                           whose="the run's")
    if differs is not None:
        raise AloneBadInput(f"rank {rank} cannot rejoin the run in progress at {where}: its {differs[1]} than the "
                            f"run's ({differs[2]})")
    run_dir = Path(record["run_dir"])
    setup.compute_ms = float(record["compute_ms"])
    slots = setup.strategy.exchange.schedule.slots
    heartbeat = Heartbeat(rank, joining.num_workers, joining.store)
    try:
        comm = udp_comm(cfg.dist, heartbeat=heartbeat, lanes=slots + 1 if slots else 1,
                        latency_ms=setup.network.latency_ms.tolist(), joining=joining, key_text=env.key,
                        master_addr=env.route_to)
    except ValueError as exc:
        raise AloneBadInput(str(exc)) from None
    agreement = comm.agreement
    tell_launcher(env.run_file, str(run_dir), "udp")
    try:
        if not quiet:
            say(f"shaky: rank {rank}: waiting to be taken back into the run in progress at {where} "
                f"({run_dir})")
        welcome = agreement.await_welcome(cfg.dist_timeout_s, ended_key=job_keys(env).ended)
        check_taken_back(cfg, setup, welcome.get("run", {}), rank)
        if not quiet:
            say(f"shaky: rank {rank}: taken back at step {welcome['counters']['step']}, "
                f"{agreement.join_wait_s:.2f} s after asking")
        store, comm = comm.store, staged(comm, setup)
        writers = Writers(rank, [])
        with stopping(run_dir, dist_command(env), writer=False):
            summary = train(setup, run_dir, comm=comm, writer=False, label=cfg.strategy.name, progress=False,
                            faults=faults(env), welcome=welcome, members=Agreed(agreement, schedule_of(cfg)),
                            writers=writers)
        if writers.mine:
            say_ended(store, job_keys(env).ended)
        comm.barrier()
        if writers.mine:
            if not quiet:
                print(json.dumps(summary, indent=2))
            print(f"run directory: {run_dir}")
    except (LeftBehind, ForgedRecord) as exc:
        say(f"shaky: error: {exc}")
        return 3
    except NotTakenBack as exc:    # the run ended or stopped: there is no run to rejoin
        tell_launcher(env.run_file, str(run_dir), "udp", stopped=True)
        say(f"shaky: error: {exc}")
        return 3
    except RuntimeError as exc:    # taken back, then the run's store went with its rank 0
        here = run_dir if record.get("host") == socket.gethostname() else None
        return run_stopped(env, comm.rank, heartbeat, cfg, exc, run_dir, str(run_dir), here)
    finally:
        comm.close()
        heartbeat.close()
    return 0


def ask_to_be_taken_back(env: JobEnv, setup: Any, left_behind: LeftBehind, *, quiet: bool) -> int:
    """A rank the others left out while it stood still (SIGSTOP, a stalled machine, a long pause) and that woke
    up: its sockets, heartbeat and process group are closed, and it asks to be taken back as a process started
    again for it would (:func:`rejoin`), in this process: the survivors take it back at a step's start, and it
    trains on from their state. Status 3 with one line if the run has ended meanwhile."""
    rank = int(env.rank or 0)
    try:
        joining = run_in_progress(env, setup.cfg.dist_timeout_s, again=True)
    except (NoStore, RankTaken):
        joining = None
    if joining is None:     # the run ended (or its store went with rank 0)
        say(f"shaky: error: {left_behind}, and the run ended before it could be taken back")
        return 3
    say(f"shaky: rank {rank}: {left_behind}; it asks to be taken back")
    return rejoin(env, setup, joining, quiet=quiet)


def staged(comm: Any, setup: Any) -> Any:
    """On a GPU rank, the host Comm (gloo or udp) behind pinned-memory staging (shaky.comm.staged)."""
    if setup.device.type == "cpu":
        return comm
    return StagedComm(comm, setup.device)


def train_dist(env: JobEnv, setup: Any, run_dir: Path, *, resume: bool, quiet: bool) -> int:
    """One worker of a torchrun job: rank 0 picks the run directory and writes it; all ranks train."""
    cfg = setup.cfg
    try:
        init_group(env, cfg.dist_timeout_s, cfg.dist.heartbeat_timeout_s)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    except RuntimeError as exc:     # DistStoreError, DistNetworkError: a rank that never came, a store that went
        tell_launcher(env.run_file, None, None, stopped=True)     # not a rank to start again alone: there is no run
        raise no_group(env, cfg.dist_timeout_s, str(exc)) from None
    try:
        if dist.get_world_size() != cfg.num_workers:
            raise BadInput(f"num_workers is {cfg.num_workers} but {launcher(env)} started {dist.get_world_size()} "
                           "processes; they must match (one worker per process)")
        inputs = inputs_digest(setup)
        recorded = read_machines(run_dir).get(0) if resume and dist.get_rank() == 0 else None
        refused = resume_refused(setup, run_dir) if resume and dist.get_rank() == 0 else None
        setup.machines = check_same_config(cfg, resumed=resume, inputs=inputs, recorded=recorded,
                                           restarts=env.max_restarts, refused=refused)
        # The heartbeat tells a rank that died from one that hangs: on udp it beats in the quorum's store, whose
        # rounds leave out a rank silent for dist.heartbeat_timeout_s (live membership); on gloo in the
        # rendezvous store, where the survivors of a failure read it to name the rank that stopped.
        heartbeat = Heartbeat(dist.get_rank(), dist.get_world_size(), rendezvous_store())
        if cfg.dist.transport == "udp":   # a lane for each exchange a delay keeps in flight, and the next one
            slots = setup.strategy.exchange.schedule.slots
            comm = udp_comm(cfg.dist, heartbeat=heartbeat, lanes=slots + 1 if slots else 1,
                            latency_ms=setup.network.latency_ms.tolist(), key_text=env.key, master_addr=env.route_to)
            members: Members = Agreed(comm.agreement, schedule_of(cfg))
        else:
            comm = DistComm()
            members = Scheduled(schedule_of(cfg), heartbeat.start().mark)
        comm = staged(comm, setup)
    except ValueError as exc:    # udp: a key file, a port or the keys (on every rank alike)
        dist.destroy_process_group()
        raise BadInput(str(exc)) from None
    except BadInput:
        dist.destroy_process_group()   # leaving with the group alive can abort the process at exit
        raise
    except ForgedRecord as exc:
        dist.destroy_process_group()
        raise Stop(f"error: {exc}", 3) from None
    # Every rank must agree on what rank 0 decided or measured.
    shown, resolved, host = broadcast_object((str(run_dir), str(run_dir.resolve()), socket.gethostname()))
    run_dir, writer = Path(shown), comm.rank == 0
    # With live membership the run directory outlives rank 0: the first live rank that sees it writes it.
    seen = gather_object(_place(resolved))
    writers = Writers(comm.rank, [r for r, place in enumerate(seen) if place == seen[0]]) \
        if isinstance(members, Agreed) else None
    # Where this rank may read the run directory for its lines: rank 0's machine only (elsewhere a copy of it
    # under the same name could be stale).
    local = run_dir if writer else Path(resolved) if host == socket.gethostname() else None
    if writer and setup.compute_ms < 0:  # the machine's cached measurement, as the simulator uses
        setup.compute_ms = measured_compute_ms(setup)
    setup.compute_ms = float(broadcast_object(setup.compute_ms))
    keys = job_keys(env)
    if writer:
        claim_run_dir(run_dir, resume=resume)
        # What a process started again for a dead rank needs (udp takes it back; gloo says it cannot).
        publish_run(comm.store, {"run_dir": resolved, "compute_ms": setup.compute_ms,
                                 "config": to_dict(cfg), "transport": cfg.dist.transport, "host": host,
                                 "udp_prefix": getattr(comm, "prefix", None),
                                 "inputs": inputs, "machines": {str(rank): machine["settings"]
                                                                for rank, machine in setup.machines.items()}},
                    key=keys.run)
    tell_launcher(env.run_file, resolved, cfg.dist.transport)   # every rank: a launcher without rank 0 learns it too
    try:
        with stopping(run_dir, dist_command(env), writer=writer):
            summary = train(setup, run_dir, comm=comm, resume=resume, writer=writer,
                            label=cfg.strategy.name, progress=not quiet, faults=faults(env), members=members,
                            writers=writers)
        writer = writers.mine if writers is not None else writer
        if writer:
            say_ended(comm.store, keys.ended)
        # Tear down together: a rank that leaves while another still talks to it can abort the other.
        comm.barrier()
    except Stop as exc:     # a signal: every rank stopped after the same step, and rank 0 wrote the checkpoint
        if str(exc):    # said before the teardown: torchrun ends every rank once the first one has exited
            say(f"shaky: {exc}")
        raise Stop("", exc.code) from None
    except LeftBehind as exc:
        if writer and keeper.hosted() is None:  # rank 0 hosts the control store: the others cannot go on without it
            end_run(comm, keys.ended)
            say(f"shaky: error: {exc}; last checkpoint: {checkpoint_note(run_dir, dist_command(env), local)}")
            return 3
        left_behind = exc
    except ForgedRecord as exc:
        if writer:
            end_run(comm, keys.ended)
        say(f"shaky: error: {exc}; last checkpoint: {checkpoint_note(run_dir, dist_command(env), local)}")
        return 3
    except (RuntimeError, dist.DistBackendError) as exc:
        if writer:
            end_run(comm, keys.ended)
        return run_stopped(env, comm.rank, heartbeat, cfg, exc, run_dir, resolved, local)
    else:
        left_behind = None
    finally:
        comm.close()
        heartbeat.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    if left_behind is not None:
        return ask_to_be_taken_back(env, setup, left_behind, quiet=quiet)
    if writer:
        if not quiet:
            print(json.dumps(summary, indent=2))
        print(f"run directory: {run_dir}")
    return 0


def _place(path: str) -> tuple[str, int, int, str]:
    """Where ``path`` (absolute) is, as this process sees it: the machine, and the device and inode of its
    nearest existing directory with the rest of the path. Two ranks with the same place see the same run
    directory (on another machine, or behind another mount, a path of the same name is another directory)."""
    here, rest = Path(path), []
    while not here.exists() and here != here.parent:
        here, rest = here.parent, [here.name, *rest]
    try:
        st = os.stat(here)
    except OSError:
        return socket.gethostname(), -1, -1, path
    return socket.gethostname(), st.st_dev, st.st_ino, "/".join(rest)


def resume_refused(setup: Any, run_dir: Path) -> str | None:
    """Rank 0 of a resumed run: why its checkpoint's parameters cannot be this run's (the rest of the resume check
    ran before: ``shaky.rundir.load_run_config``; the data's digests are compared in ``check_same_config``)."""
    try:
        if (run_dir / CHECKPOINT_FILE).is_file():
            check_params(run_dir, load_checkpoint(run_dir).get("params"), setup)
    except ValueError as exc:
        return str(exc)
    return None


def run_stopped(env: JobEnv, rank: int, heartbeat: Heartbeat, cfg: Any, exc: Exception, run_dir: Path,
                resolved: str, local: Path | None) -> int:
    """A collective or the store failed: the run stopped (a rank died on gloo, or the run's store went). Says
    which rank, in one line (the one whose ``heartbeat`` stopped, :meth:`Heartbeat.diagnose`), and tells the
    launcher that this rank ended with the run (it is not one to take back alone: the launcher starts the run
    again as a whole). Status 3."""
    found = heartbeat.diagnose(cfg.dist_timeout_s)
    paused = heartbeat.paused_s()
    if found is None and paused > cfg.dist.heartbeat_timeout_s:
        # This process stood still (SIGSTOP, a stall) past the timeout, and woke to find the store gone: the run
        # most likely ended meanwhile, which it cannot tell from rank 0's death with the store gone.
        who = (f"rank {rank} stood still for {paused:.1f} s (SIGSTOP, a stalled machine), and meanwhile the run "
               "ended or its store went")
    else:
        who = (f"rank {found[0]} stopped answering after step {found[1]}" if found else
               f"the run's store at {env.master_addr}:{env.master_port} (on rank 0's machine) is gone")
    tell_launcher(env.run_file, resolved, cfg.dist.transport, stopped=True)
    say(f"shaky: error: {who} (rank {rank} saw: {' '.join(str(exc).split())[:100]}); "
        f"last checkpoint: {checkpoint_note(run_dir, dist_command(env), local)}")
    return 3


def end_run(comm: Any, key: str) -> None:
    """Rank 0, the run stopped for a failure: said in its store while the store lasts, so that a process started
    for the next attempt that reaches this one first does not take it for a run to join (``key``: the attempt's
    :attr:`~shaky.job.rendezvous.Keys.ended`)."""
    try:
        say_ended(comm.store, key)
    except RuntimeError:     # the store no longer answers
        pass
