"""``shaky launch``: start the ranks of a dist run on this machine, and start a rank that dies again.

torchrun's agent treats a worker that exits as the failure of the whole group: it stops every other worker on
its machine (or restarts them all). On the udp transport shaky's survivors train on without a dead rank, and
a process started again for it is taken back (README, "Survivors train on"), so a launcher for it must leave
the survivors alone and start only the dead rank again; a run that stops as a whole it starts again as a whole,
as torchrun would. The rank processes are ``shaky train`` processes started as torchrun starts them (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT), so nothing in them knows
which launcher started them. On one
machine the launcher also makes the run's udp key and hands it to its ranks in their environment
(``SHAKY_KEY``, unless set), so that it never travels through the rendezvous store.

Rules, in :func:`restart_decision`: a rank whose process is killed by a signal or exits with a status other
than 0, 2 (bad input: a new process would find the same) or 128 + SIGINT/SIGTERM (stopped on request) is
started again, at most ``max_restarts`` times per rank, rank 0 included (the run's store lives in a keeper
process of its own, ``shaky.job.keeper``, and the run directory's writing moves to the next live rank on its
machine), while the run goes on (rank 0 here has not finished, and the rank did not end because the run
stopped), and only on the udp transport (each rank tells the launcher the transport and the run directory
through a file, :func:`tell_launcher`, and whether it ended because the run stopped: such a rank has no run to
rejoin). A run that stops as a whole (on gloo any rank's failure; on udp a rank that says the run stopped) is
started again as a whole once every rank here has ended (:func:`group_restart_decision`): every rank with
``--resume`` of the run directory, from its last checkpoint, at most ``max_restarts`` times, as torchrun
restarts a group. Over several machines each launcher does so for its own ranks: rank 0's when rank 0 failed
or stopped with the run, another's when its ranks stopped with the run (status 3; on gloo, any failure); only
rank 0 reads the run directory at the start, the others get what they need from it. SIGINT and SIGTERM to the
launcher are passed on to every rank (each stops after the same step with a checkpoint, as under torchrun); the
ranks run in a session of their own, so a terminal's Ctrl-C reaches them once, through the launcher, and they
get SIGTERM if the launcher itself dies.

No torch here: the launcher only starts and watches processes.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shaky.inject import ENV_VAR as FAULT_ENV
from shaky.rundir import CONFIG_FILE, write_json
from shaky.progress import say as say_line

EXIT_BAD_INPUT = 2
EXIT_DIVERGED = 4
"""``shaky train``'s status when training diverged (a result: started again from its checkpoint it would again)."""
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
POLL_S = 0.05
"""How often the launcher looks at its ranks (a restart waits at most this long to start)."""
_PR_SET_PDEATHSIG = 1
NO_RESTARTS_LEFT = "it has no restarts left"
LAUNCHED_BY = "SHAKY_LAUNCHED_BY"
"""Set in each rank's environment: the launcher's command line up to ``train`` (a rank's lines that say how to
resume quote it)."""
MAX_RESTARTS_ENV = "SHAKY_LAUNCH_MAX_RESTARTS"
"""Set in each rank's environment: its launcher's --max-restarts, which every launcher of a run must be given
alike (the ranks compare theirs with rank 0's when the group forms: a launcher that restarts its ranks while
another does not would wait for ranks that never come)."""
RUN_FILE_ENV = "SHAKY_LAUNCH_RUN_FILE"
"""Set in each rank's environment: where the rank writes the run's directory (rank 0's) and transport as JSON
(``tell_launcher``), so that the launcher knows what a restart can do (a file per rank: each writes its own)."""
EXIT_RUN_STOPPED = 3
"""``shaky train``'s status when the run stopped for a failure (a rank died, or this one was left out)."""
ONLY_UDP_TAKES_BACK = "a rank alone is taken back on the udp transport only"
NOT_WRITTEN = "rank 0 ended before it wrote the run directory: there is nothing to resume"
NOT_TOLD = "no rank here learned the run's directory before it ended: there is nothing to resume"
RUN_GOES_ON = "on udp the run goes on without them (none stopped with the run)"
KEY_ENV = "SHAKY_KEY"
"""The udp transport's key in the environment (``shaky.comm.udp.comm.KEY_ENV``; not imported: that loads torch)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchConfig:
    """Where the ranks of a run are started: this machine's share of them, and how to reach rank 0."""

    nproc_per_node: int
    """Rank processes started on this machine."""
    nnodes: int = 1
    """Machines in the run, each with a ``shaky launch`` of its own (WORLD_SIZE = nnodes x nproc_per_node)."""
    node_rank: int = 0
    """This machine's place among them: its ranks are node_rank x nproc_per_node and up."""
    master_addr: str = "127.0.0.1"
    """The address of rank 0's machine, where the rendezvous store listens."""
    master_port: int = 0
    """The rendezvous store's TCP port; 0: a free port of this machine (one machine only)."""
    max_restarts: int = 0
    """How many times each rank (other than 0) may be started again alone after it dies (udp), and how many times
    the run's ranks here may be started again from its last checkpoint after the run stopped (use the same
    number on every machine)."""

    def __post_init__(self) -> None:
        for name in ("nproc_per_node", "nnodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        for name in ("node_rank", "max_restarts", "master_port"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name.replace('_', '-')} must be an integer >= 0, got {value!r}")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node-rank must be below nnodes ({self.nnodes}), got {self.node_rank}")
        if self.master_port > 65535:
            raise ValueError(f"master-port must be at most 65535, got {self.master_port}")
        if self.nnodes > 1 and not self.master_port:
            raise ValueError("master-port must be given with nnodes > 1 (the same on every machine), got 0")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def ranks(self) -> range:
        """The global ranks this machine starts."""
        first = self.node_rank * self.nproc_per_node
        return range(first, first + self.nproc_per_node)


def train_command(command: Sequence[str]) -> list[str]:
    """``shaky train`` arguments for the ranks from what followed ``shaky launch``'s options: they must start
    with ``train``; ``--backend dist`` is added unless given, or unless the run is resumed (its saved config
    says the backend, and the ranks refuse one that is not dist). ValueError names what is wrong."""
    if not command or command[0] != "train":
        raise ValueError(f"the command to launch must be `train ...` (shaky train's arguments), got "
                         f"{' '.join(command) or 'nothing'!r}")
    args = list(command[1:])
    backends = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--backend"]
    backends += [a.split("=", 1)[1] for a in args if a.startswith("--backend=")]
    if any(b != "dist" for b in backends):
        raise ValueError(f"--backend must be dist under shaky launch (one worker per process), got "
                         f"{next(b for b in backends if b != 'dist')!r}")
    resumed = any(a == "--resume" or a.startswith("--resume=") for a in args)
    return args if backends or resumed else [*args, "--backend", "dist"]


def _ended_on_purpose(status: int, stopping: bool) -> str | None:
    """Why a process that ended with ``status`` is not one to start again whatever else holds, or None."""
    if status == 0:
        return "it finished"
    if status == EXIT_BAD_INPUT:
        return "it stopped on bad input (status 2): a new process would too"
    if status == EXIT_DIVERGED:
        return "training diverged: started again from its checkpoint it would again"
    if status in (-signal.SIGINT, -signal.SIGTERM, 128 + signal.SIGINT, 128 + signal.SIGTERM) or stopping:
        return "the run is stopping on request"
    return None


def restart_decision(rank: int, status: int, *, restarts_used: int, max_restarts: int, rank0_running: bool,
                     stopping: bool, transport: str | None, run_stopped: bool = False) -> str | None:
    """Why the rank whose process ended with ``status`` (Popen's: negative for a signal) is not started again
    alone, or None when it is. ``rank0_running``: rank 0 has not ended here (on udp: has not finished or
    stopped with the run; one that died is started again itself); ``transport``: the run's, None while not known
    yet; ``run_stopped``: a rank here said it ended because the run stopped (its store went)."""
    why = _ended_on_purpose(status, stopping)
    if why is not None:
        return why
    if run_stopped:
        return "the run stopped: there is no run to rejoin"
    if not rank0_running and rank != 0:
        return "rank 0 has ended: there is no run to rejoin"
    if transport != "udp":
        return ONLY_UDP_TAKES_BACK
    if restarts_used >= max_restarts:
        return f"{NO_RESTARTS_LEFT} ({restarts_used} of --max-restarts {max_restarts})"
    return None


def group_restart_decision(statuses: dict[int, int], *, restarts_used: int, max_restarts: int, stopping: bool,
                           run_dir: str | None, transport: str | None) -> str | None:
    """Why the ranks of this machine, which have all ended (``statuses``: each one's last status, by rank), are
    not started again from the run's last checkpoint (``--resume``), or None when they are. Where rank 0 runs
    here, its status decides (it stops the run); elsewhere the run stopped when these ranks did for a failure,
    on udp only when one of them stopped with the run (status 3: a rank lost alone leaves the others training).
    ``run_dir``: the run's directory once known (on rank 0's machine, once rank 0 has written its config.toml),
    else None; ``transport``: the run's, None where no rank here told it."""
    for status in [statuses[0]] if 0 in statuses else [statuses[r] for r in sorted(statuses)]:
        why = _ended_on_purpose(status, stopping)
        if why is not None:
            return why
    if transport == "udp" and EXIT_RUN_STOPPED not in statuses.values():
        return RUN_GOES_ON
    if restarts_used >= max_restarts:
        return f"{NO_RESTARTS_LEFT} ({restarts_used} of --max-restarts {max_restarts})"
    if run_dir is None:
        return NOT_WRITTEN if 0 in statuses else NOT_TOLD
    return None


def resume_args(args: Sequence[str], run_dir: str) -> list[str]:
    """The ranks' arguments that go on with the run in ``run_dir`` from its last checkpoint: ``--resume`` (the
    saved config says the rest; each rank's machine settings are in the run's machines.json), and ``--quiet``
    if it was given (argparse takes an abbreviation of it too)."""
    return ["--resume", run_dir, *(["--quiet"] if any(len(a) > 2 and "--quiet".startswith(a) for a in args) else [])]


def tell_launcher(path: str | None, run_dir: str | None, transport: str | None, *, stopped: bool = False) -> None:
    """A rank under ``shaky launch``: the run's directory (rank 0's) and transport (None: not known, the process
    group never formed), to the file the launcher named for it (``path``: its :data:`RUN_FILE_ENV`, which the rank
    read; None: not under shaky launch, nothing to tell); ``stopped``: the rank is ending because the run stopped
    (rank 0 went, or on gloo any rank) or never started, not because it was left out: it is not one to start
    again alone."""
    if path:
        write_json(Path(path), {"run_dir": run_dir, "transport": transport, "stopped": stopped})


def describe(status: int) -> str:
    """``killed by SIGKILL`` or ``exited with status 3``."""
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exited with status {status}"


def exit_status(statuses: dict[int, int]) -> int:
    """The launcher's status from its ranks' last ones (by rank), a death by signal N counted as 128 + N, as a
    shell does: 0 if a rank here finished (the run finished: a rank lost on the way, rank 0 included, is
    membership, said in a line and in summary.json), else rank 0's where it ran here, else the lowest rank's."""
    def shell(status: int) -> int:
        return 128 - status if status < 0 else status

    if any(status == 0 for status in statuses.values()):
        return 0
    return shell(statuses[0 if 0 in statuses else min(statuses)])


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the launcher dies (Linux), so that no rank outlives it; and the
    stop signals, which the launcher blocks while it starts a rank, unblocked."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        pass


LOG_JOIN_S = 5.0
"""How long the launcher waits, once a rank's process has ended, for the rest of its output to be passed on."""


class RankLogs:
    """``shaky launch --log-dir DIR``: each rank's output, stdout and stderr alike, appended to ``DIR/rank-R.log``
    as well as passed on to the launcher's own (a tee, as ``torchrun --log-dir --tee 3``), each process the
    rank is started as behind a header line. The files are opened before any rank starts (a folder that cannot
    hold them is bad input, ValueError); a file that can no longer be written (a full disk) is said once, and
    that rank's output then goes on to the terminal only: a log never stops a run."""

    def __init__(self, folder: str | Path, ranks: Sequence[int], say: Callable[[str], None]) -> None:
        folder = Path(folder)
        self.say = say
        self.files: dict[int, Any] = {}
        self.lock = threading.Lock()
        self.pumps: dict[int, list[threading.Thread]] = {}
        made = []
        try:
            folder.mkdir(parents=True, exist_ok=True)
            for rank in ranks:
                path = folder / f"rank-{rank}.log"
                if not path.exists():
                    made.append(path)
                self.files[rank] = open(path, "ab", buffering=0)  # noqa: SIM115
        except OSError as exc:
            self.close()
            for path in made:   # nothing left behind by a launcher that started nothing
                path.unlink(missing_ok=True)
            raise ValueError(f"log-dir {str(folder)!r} cannot hold the ranks' logs: {exc.strerror or exc}"
                             + (f" ({exc.filename})" if exc.filename else "")) from None

    def follow(self, rank: int, proc: subprocess.Popen[bytes], header: str) -> None:
        """Passes on ``proc``'s output (started with stdout and stderr piped) from now on, after ``header``."""
        self._to_file(rank, f"{header}\n".encode())
        self.pumps[rank] = [threading.Thread(target=self._pump, args=(rank, stream, fd), daemon=True)
                            for stream, fd in ((proc.stdout, 1), (proc.stderr, 2))]
        for thread in self.pumps[rank]:
            thread.start()

    def drain(self, rank: int) -> None:
        """The rank's process has ended: waits (at most :data:`LOG_JOIN_S`) for the rest of its output."""
        for thread in self.pumps.pop(rank, []):
            thread.join(LOG_JOIN_S)

    def close(self) -> None:
        for rank in list(self.pumps):
            self.drain(rank)
        for f in self.files.values():
            f.close()

    def _pump(self, rank: int, stream: Any, fd: int) -> None:
        try:
            while chunk := stream.read1(65536):
                try:
                    os.write(fd, chunk)     # one write per chunk: a rank's whole lines stay whole on the terminal
                except OSError:
                    pass                    # the launcher's own output is closed: the log still gets it
                self._to_file(rank, chunk)
        except (OSError, ValueError):
            pass
        finally:
            stream.close()

    def _to_file(self, rank: int, data: bytes) -> None:
        with self.lock:
            f = self.files.get(rank)
            if f is None:
                return
            try:
                f.write(data)
            except OSError as exc:
                del self.files[rank]
                f.close()
                self.say(f"cannot write {f.name}: {exc.strerror or exc}; rank {rank}'s output goes on to this "
                         "terminal only")


class Launcher:
    """Starts this machine's ranks of ``shaky train args`` and watches them until every one has ended."""

    def __init__(self, cfg: LaunchConfig, args: Sequence[str], *, env: dict[str, str] | None = None,
                 say: Callable[[str], None] | None = None, log_dir: str | Path | None = None) -> None:
        self.cfg = cfg
        self.args = list(args)
        self.command = " ".join(["shaky launch", f"--nproc-per-node {cfg.nproc_per_node}",
                                 *([f"--nnodes {cfg.nnodes} --node-rank N"] if cfg.nnodes > 1 else []),
                                 *([f"--max-restarts {cfg.max_restarts}"] if cfg.max_restarts else []), "train ..."])
        self.port = cfg.master_port or free_port(cfg.master_addr)
        self.env = {k: v for k, v in (os.environ if env is None else env).items()
                    if k != RUN_FILE_ENV}   # this launcher's to set
        if cfg.nnodes == 1 and KEY_ENV not in self.env:
            # Every rank is a child of this process: the udp key can reach them in their environment instead of
            # through the rendezvous store, which is not encrypted (a key file given to train still wins).
            self.env[KEY_ENV] = secrets.token_hex(32)
        self.fault = self.env.pop(FAULT_ENV, None)
        """An injected fault (tests) is an event of the run: the first process of each rank gets it, a process
        started again does not (it would meet the same step again after a resume)."""
        self.say = say or (lambda line: say_line(f"shaky launch: {line}"))
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.restarts: dict[int, int] = {rank: 0 for rank in cfg.ranks}
        """How many times each rank was started again alone."""
        self.group_restarts = 0
        """How many times every rank was started again from the run's last checkpoint."""
        self.statuses: dict[int, int] = {}
        """The exit status of each rank's last process, once it has ended for good."""
        self.stopping: int | None = None
        """The signal passed on to the ranks, once one came."""
        self.run_files: str | None = None
        """The folder of the files where the ranks write the run's directory and transport (``run-RANK.json``)."""
        self.told: dict[str, Any] = {}
        """What the ranks here last told of the run (a rank's file goes when its next process starts)."""
        self.logs = RankLogs(log_dir, cfg.ranks, self.say) if log_dir else None
        """Each rank's output in a file of its own as well (``--log-dir``), or None."""
        self.starts: dict[int, int] = {rank: 0 for rank in cfg.ranks}
        """How many processes each rank has been started as."""

    def _env(self, rank: int) -> dict[str, str]:
        env = {**self.env, "RANK": str(rank), "WORLD_SIZE": str(self.cfg.world_size),
               "LOCAL_RANK": str(rank - self.cfg.ranks.start), "LOCAL_WORLD_SIZE": str(self.cfg.nproc_per_node),
               "GROUP_RANK": str(self.cfg.node_rank), "MASTER_ADDR": self.cfg.master_addr,
               "MASTER_PORT": str(self.port), LAUNCHED_BY: self.command,
               MAX_RESTARTS_ENV: str(self.cfg.max_restarts)}
        if self.run_files is not None:
            env[RUN_FILE_ENV] = self._run_file(rank)
        if self.fault and not self.restarts[rank] and not self.group_restarts:
            env[FAULT_ENV] = self.fault
        if self.cfg.nproc_per_node > 1:
            # As torchrun: processes that share the cores take one OpenMP thread each unless told otherwise.
            env.setdefault("OMP_NUM_THREADS", "1")
        if self.logs is not None:
            env["PYTHONUNBUFFERED"] = "1"   # through a pipe: each line as it is written, not a block later
        return env

    def _start(self, rank: int) -> None:
        # A stop signal that comes while the rank starts is held until it is in self.procs (then _pass_on sends
        # it); one that came before is sent here: either way the rank gets it once.
        self._run_info()      # what the last process told is kept; its file goes, a new process writes its own
        if self.run_files is not None and os.path.exists(self._run_file(rank)):
            os.unlink(self._run_file(rank))
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            piped = {} if self.logs is None else {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
            proc = subprocess.Popen([sys.executable, "-m", "shaky", "train", *self.args], env=self._env(rank),
                                    start_new_session=True, preexec_fn=_die_with_parent, **piped)
            self.procs[rank] = proc
            self.starts[rank] += 1
            if self.logs is not None:
                self.logs.follow(rank, proc, f"shaky launch: rank {rank}, process {self.starts[rank]}, pid {proc.pid}, "
                                             f"started {time.strftime('%Y-%m-%d %H:%M:%S %Z')}: shaky train "
                                             f"{' '.join(self.args)}")
            if self.stopping is not None:
                proc.send_signal(self.stopping)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def _pass_on(self, signum: int, _frame: object) -> None:
        self.stopping = signum
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signum)

    def _run_info(self, ranks: Sequence[int] | None = None) -> dict[str, Any]:
        """What the first of ``ranks`` that wrote of the run wrote (its directory and transport, and whether it
        ended because the run stopped); default: the first of the ranks here that knew the directory, or what
        they wrote in an earlier attempt; empty before one has."""
        for rank in self.cfg.ranks if ranks is None else ranks:
            try:
                with open(self._run_file(rank), encoding="utf-8") as f:
                    told = dict(json.load(f))
            except (OSError, ValueError):
                continue
            if ranks is not None:
                return told
            if told.get("run_dir"):
                self.told = told
                return told
        return self.told if ranks is None else {}

    def _run_file(self, rank: int) -> str:
        return os.path.join(self.run_files or "", f"run-{rank}.json")

    def run(self) -> int:
        """Starts the ranks and watches them until each has ended for good, starting them all again from the
        run's last checkpoint where :func:`group_restart_decision` says so; returns :func:`exit_status`."""
        old = {s: signal.signal(s, self._pass_on) for s in STOP_SIGNALS}
        with tempfile.TemporaryDirectory(prefix="shaky-launch-") as scratch:
            self.run_files = scratch
            try:
                for rank in self.cfg.ranks:
                    self._start(rank)
                while True:
                    while len(self.statuses) < len(self.cfg.ranks):
                        time.sleep(POLL_S)
                        self._watch()
                    if not self._restart_group():
                        break
            finally:
                for s, handler in old.items():
                    signal.signal(s, handler)
                for proc in self.procs.values():     # an exception here (never expected) leaves no rank behind
                    if proc.poll() is None:
                        proc.terminate()
                if self.logs is not None:
                    self.logs.close()
        return exit_status(self.statuses)

    def _restart_group(self) -> bool:
        """Every rank here has ended: starts them all again from the run's last checkpoint if the run failed
        and restarts are left (see :func:`group_restart_decision`); whether it did."""
        info = self._run_info()
        run_dir, transport = info.get("run_dir"), info.get("transport")
        if run_dir is not None and 0 in self.cfg.ranks and not os.path.isfile(os.path.join(run_dir, CONFIG_FILE)):
            run_dir = None     # named, but rank 0 ended before it wrote the directory
        why = group_restart_decision(self.statuses, restarts_used=self.group_restarts,
                                     max_restarts=self.cfg.max_restarts, stopping=self.stopping is not None,
                                     run_dir=run_dir, transport=transport)
        failed = self._culprit(transport)
        if why is not None:
            if failed and (why.startswith(NO_RESTARTS_LEFT) or why in (NOT_WRITTEN, NOT_TOLD)):
                self.say(f"{failed}; not started again: {why}")
            return False
        self.group_restarts += 1
        self.say(f"{failed}; starting {'every rank' if self.cfg.nnodes == 1 else 'the ranks here'} "
                 f"again from its last checkpoint: train --resume {run_dir} ({self.group_restarts} of "
                 f"{self.cfg.max_restarts})")
        self.args = resume_args(self.args, str(run_dir))
        self.statuses.clear()
        for rank in self.cfg.ranks:
            self._start(rank)
        return True

    def _culprit(self, transport: str | None) -> str:
        """What stopped the run, as the ranks here saw it: on udp rank 0's end (here, or elsewhere: a rank here
        that stopped with the run says it; a rank lost before was left out), else the lowest rank here that failed
        on its own, else the lowest that stopped with the run (status 3: the cause was elsewhere)."""
        if transport == "udp" and 0 in self.statuses:
            return f"rank 0 {describe(self.statuses[0])} and the run stopped"
        stopped = [r for r in sorted(self.statuses) if self.statuses[r] == EXIT_RUN_STOPPED]
        if transport == "udp" and stopped:   # rank 0, elsewhere, went (a rank lost here before was left out)
            return f"the run stopped (rank {stopped[0]} {describe(EXIT_RUN_STOPPED)})"
        failed = [r for r in sorted(self.statuses) if _ended_on_purpose(self.statuses[r], False) is None]
        own = [r for r in failed if self.statuses[r] != EXIT_RUN_STOPPED]
        if own:
            return f"rank {own[0]} {describe(self.statuses[own[0]])} and the run stopped"
        return f"the run stopped (rank {failed[0]} {describe(self.statuses[failed[0]])})" if failed else ""

    def _watch(self) -> None:
        for rank, proc in list(self.procs.items()):
            status = proc.poll()
            if status is None or rank in self.statuses:
                continue
            if self.logs is not None:
                self.logs.drain(rank)   # its last lines before the launcher's line about it
            rank0 = self.procs.get(0)   # (on another machine: a process started again finds out itself)
            transport = self._run_info().get("transport")
            ended = None if rank0 is None else rank0.poll()     # on udp a dead rank 0 is started again itself
            why = restart_decision(rank, status, restarts_used=self.restarts[rank],
                                   max_restarts=self.cfg.max_restarts,
                                   rank0_running=ended is None or (transport == "udp" and ended not in (
                                       0, EXIT_BAD_INPUT, EXIT_RUN_STOPPED)),
                                   stopping=self.stopping is not None, transport=transport,
                                   run_stopped=any(self._run_info([r]).get("stopped") for r in self.procs))
            if why is None:
                self.restarts[rank] += 1
                self.say(f"rank {rank} {describe(status)}; starting it again ({self.restarts[rank]} of "
                         f"{self.cfg.max_restarts}): the others train on and take it back")
                self._start(rank)
                continue
            self.statuses[rank] = status
            # Said where a restart alone could have been expected; a rank that stopped with a line of its own (bad
            # input, a run stopped on request or without its rank 0) has said why, and a run that stops for it
            # is started again as a whole or says why not (_restart_group).
            if why.startswith(NO_RESTARTS_LEFT):
                self.say(f"rank {rank} {describe(status)}; not started again: {why}")
