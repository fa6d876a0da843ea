"""The command line: ``shaky train``, ``shaky launch``, ``shaky demo``, ``shaky scale``, ``shaky sweep`` and
``shaky report``.

Bad input (a setting that does not exist, a value out of range, a data path
that cannot be read) prints one line naming the setting and the value and exits
with status 2, before any run directory is created.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import sys
import tempfile
import time
import typing
from pathlib import Path
from typing import Any, Iterator, Sequence

# (no torch in shaky.config: process_settings must come before torch loads)
from shaky.config import MACHINE_SETTINGS, MAX_SCALE_PERIOD, first_difference
from shaky.interrupt import exiting
from shaky.launch import EXIT_BAD_INPUT, EXIT_DIVERGED, MAX_RESTARTS_ENV  # no torch (the launcher reads them)
from shaky.progress import say
from shaky.rundir import SUMMARY_FILE  # no torch

BAD_INPUT_GRACE_S = 2.0
"""Under torchrun, how long a rank other than 0 waits before it exits on bad input (rank 0 prints the line)."""
RESUME_ERROR_WAIT_S = 30.0
"""How long rank 0 of a resumed run that stops on bad input waits for the other ranks to read that (their
machines may have no copy of the run directory: rank 0's answer is all they learn)."""


def _ms_or_adaptive(text: str) -> float | str:
    """--deadline-ms: "adaptive" or a number of milliseconds (the config checks that it is positive)."""
    return text if text == "adaptive" else float(text)


_ms_or_adaptive.__name__ = "ms"   # argparse's metavar and its error message name the type by this

# CLI flag -> dotted config key. Every other setting is reachable with --set KEY=VALUE.
_FLAGS: dict[str, tuple[str, type, str]] = {
    "strategy": ("strategy.name", str,
                 "allreduce, lossy-allreduce, rps, local-sgd, ri-sgd, dts or diloco (default rps)"),
    "workers": ("num_workers", int, "number of workers W (default 8)"),
    "drop_rate": ("network.drop_rate", float,
                  "probability that a message is lost, in [0, 1) (default 0, or the preset's)"),
    "preset": ("network.preset", str, "network preset: lan, lossy or geo4 (none by default: lan's values)"),
    "dataset": ("data.dataset", str,
                "digits, iris, wine, breast_cancer, mnist1d, cifar10 or text (default digits)"),
    "data_path": ("data.path", str,
                  "cifar10: a directory in CIFAR-10's python batch format; text: a file of label<TAB>text lines"),
    "partition": ("data.partition", str, "iid, dirichlet or label-skew (default iid)"),
    "model": ("model.name", str,
              "logreg, mlp, cnn, resnet20, resnet32, resnet44, resnet56, resnet110 or lstm (default mlp)"),
    "steps": ("steps", int, "training steps (default 600)"),
    "batch_size": ("batch_size", int, "mini-batch size per worker (default 32)"),
    "lr": ("optim.lr", float, "peak learning rate of every worker's optimizer (default 0.1)"),
    "momentum": ("optim.momentum", float, "sgd's heavy-ball momentum, in [0, 1) (default 0)"),
    "seed": ("seed", int, "seed of every random choice (default 0)"),
    "eval_every": ("eval_every", int, "evaluate every N steps and at the end (default 50)"),
    "checkpoint_every": ("checkpoint_every", int, "write a checkpoint every N steps (default 500; 0 = only the "
                         "final one and the one written when Ctrl-C or SIGTERM stops the run)"),
    "replay_trace": ("network.trace", str, "run directory whose delivery masks are replayed"),
    "device": ("device", str, "cpu (the default), cuda or cuda:N: where the data, the workers' models and the "
               "exchanges live"),
    "backend": ("backend", str,
                "sim (all workers in this process, the default) or dist (one worker per torchrun process)"),
    "transport": ("dist.transport", str, "dist backend's data plane: gloo (the default: TCP, losses drawn) or udp "
                  "(datagrams never resent: the losses are the network's)"),
    "deadline_ms": ("dist.deadline_ms", _ms_or_adaptive, "udp: a phase's deadline in milliseconds, or adaptive "
                    "(the default: from recent rounds' completion times)"),
    "key_file": ("dist.key_file", str, "udp: a file every node holds whose bytes key the datagrams' tags "
                 "(default: $SHAKY_KEY, else a per-run key handed out through the rendezvous store)"),
}


class BadInput(Exception):
    """User input the CLI reports in one line with exit status 2."""


class AloneBadInput(BadInput):
    """Bad input of one process alone (a rank started again for a dead one): it says it itself, whatever its
    rank."""


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line and exit status 2 like every other bad input."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(EXIT_BAD_INPUT, f"shaky: error: {self.prog}: {message} (see {self.prog} --help)\n")


class _Version(argparse.Action):
    """``--version``: shaky's, torch's and Python's versions (:func:`shaky.rundir.versions`, which summary.json
    records too), looked up only when asked (every rank parses the command line)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print shaky's, torch's and Python's versions and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        from shaky.rundir import versions  # noqa: PLC0415 (no torch)

        v = versions()
        print(f"shaky {v['shaky']} (torch {v['torch']}, Python {v['python']})")   # stdout, as argparse's own
        parser.exit(0)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="shaky", description="Distributed training over bad networks.")
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    train = sub.add_parser("train", help="train one run (simulator by default)")
    train.add_argument("--config", metavar="FILE.toml", help="a TOML config; flags override it")
    for name, (key, tp, text) in _FLAGS.items():
        train.add_argument("--" + name.replace("_", "-"), dest=name, type=tp, metavar=tp.__name__.upper(),
                           help=f"{text} ({key})")
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="any setting by its dotted name, e.g. --set network.latency_ms=20 (repeatable)")
    train.add_argument("--out", metavar="DIR", help="run directory (default runs/<dataset>-<model>-<strategy>-...)")
    train.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its checkpoint, with its saved "
                       "config (only a machine's own settings may be given anew: --data-path, --replay-trace, "
                       "--device, --key-file, --set dist.ports=/dist.host=)")
    train.add_argument("--quiet", action="store_true", help="no progress output")

    launch = sub.add_parser(
        "launch", help="start the ranks of a dist run here, and start a rank that dies again",
        usage="shaky launch [options] train [shaky train's arguments]",
        description="Starts this machine's ranks of `shaky train --backend dist ...` as torchrun does (RANK, "
        "WORLD_SIZE, MASTER_ADDR, MASTER_PORT), but a rank that dies leaves the others running and, with "
        "--max-restarts, is started again: on --transport udp the survivors train on and take it back. "
        "With --max-restarts, a run that stops (its rank 0 died, or on gloo any rank) is started again from "
        "its last checkpoint: on every machine, each launcher its own ranks.")
    launch.add_argument("--nproc-per-node", type=int, required=True, metavar="N",
                        help="rank processes to start on this machine")
    launch.add_argument("--max-restarts", type=int, default=0, metavar="N",
                        help="how many times each rank other than 0 may be started again alone (--transport "
                        "udp), and the run's ranks here from its last checkpoint after it stopped (the same on "
                        "every machine; default 0)")
    launch.add_argument("--nnodes", type=int, default=1, metavar="N",
                        help="machines in the run, each running shaky launch (default 1)")
    launch.add_argument("--node-rank", type=int, default=0, metavar="I",
                        help="this machine's place among them, 0 on rank 0's (default 0)")
    launch.add_argument("--master-addr", default="127.0.0.1", metavar="HOST",
                        help="rank 0's machine (default 127.0.0.1)")
    launch.add_argument("--master-port", type=int, default=0, metavar="PORT",
                        help="the rendezvous store's port (default: a free one; required with --nnodes > 1)")
    launch.add_argument("--log-dir", metavar="DIR",
                        help="also append each rank's output (stdout and stderr) to DIR/rank-R.log, each process "
                        "it is started as behind a header line (created if missing)")
    launch.add_argument("train_args", nargs=argparse.REMAINDER, metavar="train ...",
                        help="train, then shaky train's arguments")

    demo = sub.add_parser("demo", help="MLP on digits, 8 workers, 4 runs: allreduce at drop 0 and at drop 0.1, "
                          "rps and lossy-allreduce at drop 0.1")
    demo.add_argument("--out", metavar="DIR", default="runs/demo",
                      help="where runs, table and plot go (default runs/demo)")
    demo.add_argument("--steps", type=int, default=600, help="training steps per run (default 600)")
    demo.add_argument("--quiet", action="store_true", help="no progress output")

    scale = sub.add_parser("scale", help="scalability of allreduce, local-sgd and dts from the simulated clock alone",
                           description="Scalability (throughput of W workers over W times one worker's without "
                           "communication, in simulated time) against latency and against W; no model is "
                           "trained and no message is lost. See docs/clock.md.")
    scale.add_argument("--config", metavar="FILE.toml", help="a TOML file whose [network] table (and num_workers) "
                       "describe the network, e.g. your own latency_ms and bandwidth_mbps matrices")
    scale.add_argument("--preset", default=None, help="network preset: lan, lossy or geo4 (default geo4 "
                       "without --config)")
    scale.add_argument("--set", action="append", default=[], metavar="network.KEY=VALUE",
                       help="any network setting, e.g. --set network.wan_bandwidth_mbps=1000 (repeatable)")
    scale.add_argument("--workers", type=int, default=None, help="W for the latency sweep (default 32, or the "
                       "config's num_workers)")
    scale.add_argument("--worker-counts", type=_int_list, default=None, metavar="W1,W2,...",
                       help="W for the worker sweep (default 4,8,16,32,64)")
    scale.add_argument("--latencies-ms", type=_float_list, default=None, metavar="L1,L2,...",
                       help="one-way latencies between regions for the latency sweep (default 0,50,100,200,...,1000)")
    scale.add_argument("--params", type=float, default=25.6e6, help="values in one message, float32 "
                       "(default 25.6e6, ResNet-50)")
    scale.add_argument("--compute-ms", type=float, default=300.0, help="compute time of one step (default 300)")
    scale.add_argument("--delay", type=int, default=None, help="dts's t (default: the recommended value, see "
                       "docs/clock.md)")
    scale.add_argument("--period", type=int, default=None, help="dts's d and local-sgd's tau (default: as --delay)")
    scale.add_argument("--out", metavar="FILE.png", default="runs/scale.png", help="where the plot goes "
                       "(a Markdown table goes beside it)")

    sweep = sub.add_parser("sweep", help="run a grid of runs from TOML files, in parallel, resumable",
                           description="Runs every combination of a sweep file's [grid] on top of its [base], "
                           f"one process per core; finished runs ({SUMMARY_FILE}) are skipped, so an interrupted "
                           "sweep resumes. Runs go to OUT/<file stem>/<key=value,...>.")
    sweep.add_argument("files", nargs="+", metavar="FILE.toml", help="sweep files (experiments/*.toml)")
    sweep.add_argument("--out", metavar="DIR", default="runs/sweeps", help="where sweeps go (default runs/sweeps)")
    sweep.add_argument("--jobs", type=int, default=None, help="processes at once (default: the cores)")
    sweep.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a base setting; on a grid key, the grid keeps only VALUE (repeatable)")
    sweep.add_argument("--quiet", action="store_true", help="no progress output")

    report = sub.add_parser("report", help="plots, tables and claim checks from sweeps and run directories")
    report.add_argument("dirs", nargs="+", metavar="DIR", help="sweep directories (runs/sweeps/NAME), run "
                        "directories, or directories holding runs")
    report.add_argument("--out", metavar="DIR", default="runs/report", help="where the PNGs and report.md go "
                        "(default runs/report)")
    report.add_argument("--reproduction", metavar="FILE.md", default=None, help="also write the claims page "
                        "(REPRODUCTION.md), linking the plots in --out")
    return parser


def _number_list(kind: type) -> typing.Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        try:
            return [kind(item) for item in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__}s, got {text!r}") from None
    return parse


_int_list, _float_list = _number_list(int), _number_list(float)


def _config_values(args: argparse.Namespace) -> dict[str, Any]:
    from shaky.config import load_toml, parse_value, set_dotted  # noqa: PLC0415

    values: dict[str, Any] = load_toml(args.config) if args.config else {}
    for name, (key, _, _) in _FLAGS.items():
        if getattr(args, name) is not None:
            set_dotted(values, key, getattr(args, name))
    for item in args.set:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise BadInput(f"--set expects KEY=VALUE, got {item!r}")
        set_dotted(values, key.strip(), parse_value(text.strip()))
    return values


def _default_out(cfg: Any) -> Path:
    drop = cfg.network.drop_rate
    drop_text = f"drop{drop:g}" if isinstance(drop, float) else "dropmatrix"
    return Path("runs") / (f"{cfg.data.dataset}-{cfg.model.name}-{cfg.strategy.name}-"
                           f"w{cfg.num_workers}-{drop_text}-seed{cfg.seed}")


def cmd_train(args: argparse.Namespace) -> int:
    from shaky.train import prepare, train  # noqa: PLC0415

    try:
        cfg, run_dir = _train_config(args)
        if _job_rank() in (None, 0):    # rank 0 writes --out
            _check_out(args)
        # dist: rank 0 measures alone (_train_dist); device cuda puts each rank on GPU LOCAL_RANK. Before a rank
        # waits for rank 0's store: bad input found here is said at once, on every machine.
        setup = prepare(cfg, measure=cfg.backend != "dist",
                        local_rank=int(os.environ.get("LOCAL_RANK") or 0) if cfg.backend == "dist" else None)
    except (ValueError, TypeError) as exc:
        raise BadInput(str(exc)) from None
    joining = _joining(cfg.dist_timeout_s) if cfg.backend == "dist" else None
    if joining is None and _job_rank() not in (None, 0) and _machine() == "0":   # as rank 0 beside it says
        _check_out(args)
    if joining is not None:
        return _rejoin_dist(args, setup, joining)
    if cfg.backend == "dist":
        return _train_dist(args, setup, run_dir)
    _claim_run_dir(run_dir, resume=bool(args.resume))
    setup.machines = {0: _read_here(args, setup, run_dir)}
    with _stopping(run_dir, "shaky train"):
        summary = train(setup, run_dir, resume=bool(args.resume), label=cfg.strategy.name,
                        progress=not args.quiet, faults=_faults())
    if not args.quiet:
        print(json.dumps(summary, indent=2))
    print(f"run directory: {run_dir}")
    return 0


def _read_here(args: argparse.Namespace, setup: Any, run_dir: Path) -> dict[str, Any]:
    """A simulator run's machine settings and the digests of what it read (:func:`shaky.setup.inputs_digest`);
    resumed, its data must be what the run's last start read (BadInput)."""
    from shaky.config import machine_settings  # noqa: PLC0415
    from shaky.rundir import read_machines  # noqa: PLC0415
    from shaky.setup import inputs_digest  # noqa: PLC0415

    here = {"settings": machine_settings(setup.cfg), "inputs": inputs_digest(setup)}
    try:
        recorded = read_machines(run_dir).get(0) if args.resume else None
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    _check_as_trained(setup.cfg, here, recorded, f"--resume {run_dir}: its")
    return here


def _check_as_trained(cfg: Any, here: dict[str, Any], recorded: dict[str, Any] | None, who: str) -> None:
    """A resumed run reads the data (and trace) its last start read (``recorded``; None: not known), else
    BadInput, its line starting with ``who``."""
    differs = _other_inputs(cfg, here, recorded, whose="then")
    if differs is not None:
        name, what, sums = differs
        raise BadInput(f"{who} {what} than the run was trained on ({sums} at {_input_path(recorded or {}, name)!r}); "
                       "a resume goes on with the same data")


def _faults() -> Any:
    """The faults that ``SHAKY_INJECT_FAULT`` asks for (tests start processes with it), or None."""
    from shaky.inject import FaultInjector  # noqa: PLC0415

    try:
        return FaultInjector.from_env()
    except ValueError as exc:
        raise BadInput(str(exc)) from None


class Stop(Exception):
    """A command that ends early on purpose or for want of room, with its one line and exit status."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


@contextlib.contextmanager
def _stopping(run_dir: Path, command: str, *, writer: bool = True) -> Iterator[None]:
    """Turns a run that stops early into one line saying what was kept and how to go on (see shaky.interrupt)."""
    from shaky.interrupt import Stopped  # noqa: PLC0415
    from shaky.rundir import WriteError  # noqa: PLC0415

    local = run_dir if writer else None     # a rank > 0 says where rank 0's checkpoint is, not what it sees here
    try:
        yield
    except Stopped as exc:
        raise Stop(f"{exc}; `{command} --resume {run_dir}` continues from there and ends as the uninterrupted "
                   "run would" if writer else "", exc.exit_code) from None
    except KeyboardInterrupt:
        raise Stop(f"interrupted at once; last checkpoint: {_checkpoint_note(run_dir, command, local)}", 130) from None
    except WriteError as exc:
        raise Stop(f"error: {exc}; last checkpoint: {_checkpoint_note(run_dir, command, local)}", 1) from None


def _launcher() -> str:
    """What started this rank: ``shaky launch`` or torchrun."""
    return "shaky launch" if _dist_command().startswith("shaky launch") else "torchrun"


def _dist_command() -> str:
    """How a rank's command line is written in the lines that say how to go on."""
    from shaky.launch import LAUNCHED_BY  # noqa: PLC0415

    return os.environ.get(LAUNCHED_BY) or "torchrun ... -m shaky train"


def _checkpoint_note(run_dir: Path, command: str, local: Path | None = None) -> str:
    """Where the last checkpoint is, and how to resume. ``local``: the run directory as this process may read it
    (default ``run_dir``); None on a machine other than rank 0's, which may have no copy of it, or a stale one."""
    from shaky.rundir import CHECKPOINT_FILE, load_checkpoint  # noqa: PLC0415

    if local is None:
        return f"rank 0's, on its machine; resume with `{command} --resume {run_dir}`"
    path = local / CHECKPOINT_FILE
    if not path.exists():
        return f"none yet (`{command} --resume {run_dir}` starts the run again from step 0)"
    try:
        step = load_checkpoint(local)["counters"]["step"]
    except ValueError as exc:
        return f"none usable ({exc})"
    return f"{path} at step {step}; resume with `{command} --resume {run_dir}`"


def _joining(timeout_s: float) -> Any:
    """A process of a torchrun-style job (RANK > 0) started again for a rank that died: the run in progress
    at MASTER_ADDR:MASTER_PORT (``shaky.comm.dist.run_in_progress``), else None."""
    if "RANK" not in os.environ or os.environ.get("RANK") == "0" or "MASTER_PORT" not in os.environ:
        return None
    from shaky.comm.dist import NoStore, RankTaken, run_in_progress  # noqa: PLC0415
    from shaky.launch import tell_launcher  # noqa: PLC0415

    try:
        return run_in_progress(timeout_s)
    except RankTaken as exc:    # said here: rank 0 does not know of this process
        raise AloneBadInput(str(exc)) from None
    except NoStore as exc:
        tell_launcher(None, None, stopped=True)     # not a rank to start again alone: there is no run
        raise _no_group(timeout_s, str(exc)) from None


def _no_group(timeout_s: float, why: str) -> Stop:
    """The one line of a rank whose process group did not form (status 3), or of a rank 0 that could not host
    the rendezvous store because its port is taken (:func:`_port_taken`, status 2)."""
    taken = _port_taken(why)
    if taken is not None:
        return taken
    return Stop(f"error: rank {os.environ.get('RANK')}: the process group did not form (rank 0's store at "
                f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}; every rank must start within "
                f"dist_timeout_s = {timeout_s:g} s of the others): {' '.join(why.split())[:100]}", 3)


def _port_taken(why: str) -> Stop | None:
    """The one line (status 2) of a rank 0 whose rendezvous store could not listen because its port is in use
    (torch's DistNetworkError names EADDRINUSE): another program or run on the port, or a second launcher given
    --node-rank 0 for the same run. None for any other failure."""
    if "EADDRINUSE" not in why:
        return None
    return Stop(f"error: rank 0 cannot host the rendezvous store: --master-port {os.environ.get('MASTER_PORT')} is "
                "in use on this machine (another run or program on it, or a second launcher given --node-rank 0); "
                "give a free --master-port, and --node-rank 0 to one launcher only", EXIT_BAD_INPUT)


def _rejoin_dist(args: argparse.Namespace, setup: Any, joining: Any) -> int:
    """A process started again for a dead rank of a udp run: the survivors take it back at a step's start and it
    trains on with them; it never writes the run directory (rank 0 does)."""
    from shaky.comm.dist import ForgedRecord, LeftBehind, NotTakenBack, udp_comm  # noqa: PLC0415
    from shaky.config import to_dict  # noqa: PLC0415
    from shaky.launch import tell_launcher  # noqa: PLC0415
    from shaky.train import train  # noqa: PLC0415

    cfg, record, rank = setup.cfg, joining.record, joining.rank
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    if record.get("transport") != "udp":
        raise AloneBadInput(f"rank {rank} cannot rejoin the run in progress at {where}: it uses the "
                       f"{record.get('transport')} transport, on which a failure stops every rank "
                       "(resume it from its checkpoint; --transport udp keeps training through failures)")
    differs = first_difference(json.loads(json.dumps(to_dict(cfg))), record["config"], ignore=MACHINE_SETTINGS)
    if differs is not None:
        name, mine, theirs = differs
        raise AloneBadInput(f"rank {rank} cannot rejoin the run in progress at {where}: its {name} is {mine!r}, the "
                       f"run's is {theirs!r} (start it with the run's command line)")
    from shaky.config import machine_settings  # noqa: PLC0415
    from shaky.setup import inputs_digest  # noqa: PLC0415

    differs = _other_inputs(cfg, {"settings": machine_settings(cfg), "inputs": inputs_digest(setup)}, record,
                            whose="the run's")
    if differs is not None:
        raise AloneBadInput(f"rank {rank} cannot rejoin the run in progress at {where}: its {differs[1]} than the "
                            f"run's ({differs[2]})")
    run_dir = Path(record["run_dir"])
    setup.compute_ms = float(record["compute_ms"])
    slots = setup.strategy.exchange.schedule.slots
    try:
        comm = udp_comm(cfg.dist, heartbeat=True, lanes=slots + 1 if slots else 1,
                        latency_ms=setup.network.latency_ms.tolist(), joining=joining)
    except ValueError as exc:
        raise AloneBadInput(str(exc)) from None
    tell_launcher(str(run_dir), "udp")
    try:
        if not args.quiet:
            say(f"shaky: rank {rank}: waiting to be taken back into the run in progress at {where} "
                f"({run_dir})")
        welcome = comm.await_welcome(cfg.dist_timeout_s)
        _check_taken_back(cfg, setup, welcome.get("run", {}), rank)
        if not args.quiet:
            say(f"shaky: rank {rank}: taken back at step {welcome['counters']['step']}, "
                f"{comm.join_wait_s:.2f} s after asking")
        comm = _staged(comm, setup)
        with _stopping(run_dir, _dist_command(), writer=False):
            train(setup, run_dir, comm=comm, writer=False, label=cfg.strategy.name, progress=False,
                  faults=_faults(), welcome=welcome)
        comm.barrier()
    except (LeftBehind, ForgedRecord) as exc:
        say(f"shaky: error: {exc}")
        return 3
    except NotTakenBack as exc:    # the run ended or stopped: there is no run to rejoin
        tell_launcher(str(run_dir), "udp", stopped=True)
        say(f"shaky: error: {exc}")
        return 3
    except RuntimeError as exc:    # taken back, then the run's store went with its rank 0
        here = run_dir if record.get("host") == socket.gethostname() else None
        return _run_stopped(comm, cfg, exc, run_dir, str(run_dir), here)
    finally:
        comm.close()
    return 0


def _check_taken_back(cfg: Any, setup: Any, run: dict[str, Any], rank: int) -> None:
    """A rank taken back checks its config and data against the run's, which came with the survivors' welcome
    (sealed with the run's key): the record it started from came from the rendezvous store, which anyone can
    write (ForgedRecord, status 3: it leaves the run before its model is averaged)."""
    from shaky.comm.dist import ForgedRecord  # noqa: PLC0415
    from shaky.config import machine_settings, to_dict  # noqa: PLC0415
    from shaky.setup import inputs_digest  # noqa: PLC0415

    differs = first_difference(json.loads(json.dumps(to_dict(cfg))), run.get("config"), ignore=MACHINE_SETTINGS)
    if differs is not None:
        name, mine, theirs = differs
        raise ForgedRecord(f"rank {rank} was taken back into a run whose {name} is {theirs!r}, not {mine!r} as the "
                           "run's record in the rendezvous store said: something outside the run wrote it")
    other = _other_inputs(cfg, {"settings": machine_settings(cfg), "inputs": inputs_digest(setup)}, run,
                          whose="the run's")
    if other is not None:
        raise ForgedRecord(f"rank {rank} was taken back into a run that read other data: its {other[1]} ({other[2]}), "
                           "though the run's record in the rendezvous store said otherwise: something outside the "
                           "run wrote it")


def _staged(comm: Any, setup: Any) -> Any:
    """On a GPU rank, the host Comm (gloo or udp) behind pinned-memory staging (shaky.comm.staged)."""
    if setup.device.type == "cpu":
        return comm
    from shaky.comm.staged import StagedComm  # noqa: PLC0415

    return StagedComm(comm, setup.device)


def _train_dist(args: argparse.Namespace, setup: Any, run_dir: Path) -> int:
    """One worker of a torchrun job: rank 0 picks the run directory and writes it; all ranks train."""
    import torch.distributed as dist  # noqa: PLC0415

    from shaky.comm.dist import (DistComm, ForgedRecord, LeftBehind, broadcast_object, init_from_env,  # noqa: PLC0415
                                 udp_comm)
    from shaky.config import to_dict  # noqa: PLC0415
    from shaky.launch import tell_launcher  # noqa: PLC0415
    from shaky.rundir import read_machines  # noqa: PLC0415
    from shaky.setup import inputs_digest  # noqa: PLC0415
    from shaky.train import train  # noqa: PLC0415

    cfg = setup.cfg
    try:
        init_from_env(cfg.dist_timeout_s)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    except RuntimeError as exc:     # DistStoreError, DistNetworkError: a rank that never came, a store that went
        tell_launcher(None, None, stopped=True)     # not a rank to start again alone: there is no run
        raise _no_group(cfg.dist_timeout_s, str(exc)) from None
    try:
        if dist.get_world_size() != cfg.num_workers:
            raise BadInput(f"num_workers is {cfg.num_workers} but {_launcher()} started {dist.get_world_size()} "
                           "processes; they must match (one worker per process)")
        inputs = inputs_digest(setup)
        recorded = read_machines(run_dir).get(0) if args.resume and dist.get_rank() == 0 else None
        setup.machines = _check_same_config(cfg, resumed=bool(args.resume), inputs=inputs, recorded=recorded)
        if cfg.dist.transport == "udp":   # a lane for each exchange a delay keeps in flight, and the next one
            slots = setup.strategy.exchange.schedule.slots
            comm = udp_comm(cfg.dist, heartbeat=True, lanes=slots + 1 if slots else 1,
                            latency_ms=setup.network.latency_ms.tolist())
        else:
            comm = DistComm(heartbeat=True)
        comm = _staged(comm, setup)
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
    # Where this rank may read the run directory for its lines: rank 0's machine only (elsewhere a copy of it
    # under the same name could be stale).
    local = run_dir if writer else Path(resolved) if host == socket.gethostname() else None
    if writer and setup.compute_ms < 0:  # the machine's cached measurement, as the simulator uses
        from shaky.setup import measured_compute_ms  # noqa: PLC0415

        setup.compute_ms = measured_compute_ms(setup)
    setup.compute_ms = float(broadcast_object(setup.compute_ms))
    if writer:
        _claim_run_dir(run_dir, resume=bool(args.resume))
        # What a process started again for a dead rank needs (udp takes it back; gloo says it cannot).
        comm.publish_run({"run_dir": resolved, "compute_ms": setup.compute_ms,
                          "config": to_dict(cfg), "transport": cfg.dist.transport, "host": host,
                          "inputs": inputs, "machines": {str(rank): machine["settings"]
                                                         for rank, machine in setup.machines.items()}})
    tell_launcher(resolved, cfg.dist.transport)   # every rank: a launcher without rank 0 learns it too
    try:
        with _stopping(run_dir, _dist_command(), writer=writer):
            summary = train(setup, run_dir, comm=comm, resume=bool(args.resume), writer=writer,
                            label=cfg.strategy.name, progress=not args.quiet, faults=_faults())
        if writer:
            comm.end_run()
        # Tear down together: a rank that leaves while another still talks to it can abort the other.
        comm.barrier()
    except (LeftBehind, ForgedRecord) as exc:
        if writer:
            _end_run(comm)
        say(f"shaky: error: {exc}; last checkpoint: {_checkpoint_note(run_dir, _dist_command(), local)}")
        return 3
    except (RuntimeError, dist.DistBackendError) as exc:
        if writer:
            _end_run(comm)
        return _run_stopped(comm, cfg, exc, run_dir, resolved, local)
    finally:
        comm.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    if writer:
        if not args.quiet:
            print(json.dumps(summary, indent=2))
        print(f"run directory: {run_dir}")
    return 0


def _run_stopped(comm: Any, cfg: Any, exc: Exception, run_dir: Path, resolved: str, local: Path | None) -> int:
    """A collective or the store failed: the run stopped (a rank died on gloo, or rank 0). Says which rank, in one
    line, and tells the launcher that this rank ended with the run (it is not one to take back alone: the
    launcher starts the run again as a whole). Status 3."""
    from shaky.launch import tell_launcher  # noqa: PLC0415

    found = comm.diagnose_failure(cfg.dist_timeout_s)
    who = (f"rank {found[0]} stopped answering after step {found[1]}" if found else
           "rank 0, which hosts the run's store, is gone")
    tell_launcher(resolved, cfg.dist.transport, stopped=True)
    say(f"shaky: error: {who} (rank {comm.rank} saw: {' '.join(str(exc).split())[:100]}); "
        f"last checkpoint: {_checkpoint_note(run_dir, _dist_command(), local)}")
    return 3


def _end_run(comm: Any) -> None:
    """Rank 0, the run stopped for a failure: said in its store while the store lasts, so that a process started
    for the next attempt that reaches this one first does not take it for a run to join."""
    try:
        comm.end_run()
    except RuntimeError:     # the store no longer answers
        pass


def _check_same_config(cfg: Any, *, resumed: bool, inputs: dict[str, str] | None = None,
                       recorded: dict[str, Any] | None = None) -> dict[int, Any]:
    """Every rank runs rank 0's config (but :data:`~shaky.config.MACHINE_SETTINGS`): each compares its own with
    rank 0's, sent over the process group, and all learn of any difference (a collective), so that every rank
    stops alike. In a new run each machine reads its own command line (BadInput, status 2); in a resumed run the
    ranks > 0 took theirs from the rendezvous store, which takes writes from whoever reaches it (ForgedRecord).

    ``inputs``: the digests of what this rank read from its own paths (:func:`shaky.setup.inputs_digest`), which
    must be rank 0's too: two machines whose data.path holds other data would train apart, silently (BadInput).
    ``recorded`` (rank 0 of a resumed run): what rank 0 read at the run's last start (``machines.json``); its
    data must be the same now (BadInput). Returns every rank's machine settings and digests, by rank (rank 0
    records them in the run directory)."""
    from shaky.comm.dist import ForgedRecord, broadcast_object, gather_object  # noqa: PLC0415
    from shaky.config import machine_settings, to_dict  # noqa: PLC0415

    mine = json.loads(json.dumps(to_dict(cfg)))
    machine = {"settings": machine_settings(cfg), "inputs": inputs or {}}
    rank0_config, recorded = broadcast_object((mine, recorded))
    restarts = os.environ.get(MAX_RESTARTS_ENV)     # under shaky launch: its --max-restarts
    found = gather_object((first_difference(mine, rank0_config, ignore=MACHINE_SETTINGS), machine, restarts))
    rank, theirs = next(((r, n) for r, (_, _, n) in enumerate(found) if n != found[0][2]), (None, None))
    if rank is not None:
        raise BadInput(f"rank {rank}'s shaky launch has --max-restarts {theirs or '(none: not shaky launch)'}, rank "
                       f"0's {found[0][2] or '(none: not shaky launch)'}: give every machine's launcher the same")
    found = [(d, m) for d, m, _ in found]       # (its config's first difference, its machine) by rank
    rank, differs = next(((r, d) for r, (d, _) in enumerate(found) if d is not None), (None, None))
    if differs is not None:
        name, got, theirs = differs
        if resumed:
            raise ForgedRecord(f"rank {rank}: the resumed run's config in the rendezvous store is not rank 0's (its "
                               f"{name} is {got!r}, rank 0's {theirs!r}): something outside the run wrote it")
        raise BadInput(f"rank {rank}'s {name} is {got!r}, rank 0's is {theirs!r}: every machine must run the same "
                       f"command line (only {', '.join(MACHINE_SETTINGS)} may differ)")
    rank0 = found[0][1]
    _check_as_trained(cfg, rank0, recorded, "--resume: rank 0's")
    for rank, (_, theirs) in enumerate(found):
        differs = _other_inputs(cfg, theirs, rank0, whose="rank 0's")
        if differs is None:
            continue
        name, what, sums = differs
        if name == "data" and not theirs["settings"]["data.path"] and not rank0["settings"]["data.path"]:
            raise BadInput(f"rank {rank} loads other {cfg.data.dataset} data than rank 0 ({sums}: another version of "
                           "the library that ships it?); every machine must train on the same data")
        raise BadInput(f"rank {rank}'s {what} than rank 0's {_input_path(rank0, name)!r} ({sums}); every machine "
                       f"must read the same {'data' if name == 'data' else 'trace'}")
    return {rank: theirs for rank, (_, theirs) in enumerate(found)}


_INPUT_SETTING = {"data": "data.path", "network.trace": "network.trace"}
"""The setting that names the file behind each of :func:`shaky.setup.inputs_digest`'s digests."""


def _input_path(machine: dict[str, Any], name: str) -> str:
    return str(machine["settings"].get(_INPUT_SETTING[name], ""))


def _other_inputs(cfg: Any, machine: dict[str, Any], reference: dict[str, Any] | None, *,
                  whose: str) -> tuple[str, str, str] | None:
    """The first of ``machine``'s inputs (the data, a trace) that is not what ``reference`` read (each
    ``{"settings", "inputs"}``; ``reference``'s settings are not needed): its name, "data.path '...' holds
    other text data" and "sha256 ..., <whose> ..."; None where they agree (or ``reference`` has no digest)."""
    for name, digest in machine["inputs"].items():
        theirs = (reference or {}).get("inputs", {}).get(name)
        if theirs is not None and digest != theirs:
            what = f"{cfg.data.dataset} data" if name == "data" else "masks"
            return (name, f"{_INPUT_SETTING[name]} {_input_path(machine, name)!r} holds other {what}",
                    f"sha256 {digest[:12]}, {whose} {theirs[:12]}")
    return None


def _train_config(args: argparse.Namespace) -> tuple[Any, Path]:
    from shaky.config import config_from_dict  # noqa: PLC0415
    from shaky.train import load_run_config, new_run_dir  # noqa: PLC0415

    if args.resume:
        given = [n for n in (*_FLAGS, "config", "out") if getattr(args, n) is not None and n not in _MACHINE_FLAGS]
        if given:
            raise BadInput(f"--resume continues with the run's saved config; drop --{given[0].replace('_', '-')} "
                           f"(only a machine's own settings may be given: {', '.join(_RESUME_FLAGS)})")
        own = _machine_overrides(args)
        rank, run_dir = _job_rank(), Path(args.resume)
        if rank and (_launcher() == "shaky launch" or not _simulator_run(run_dir)):
            return _resumed_from_rank_0(own)
        if rank == 0:
            return _hand_out_resume(run_dir, own), run_dir
        try:
            cfg = _with_own(load_run_config(run_dir), own)
        except ValueError as exc:
            raise BadInput(str(exc)) from None
    else:
        cfg = config_from_dict(_absolute_paths(_config_values(args)))
        run_dir = Path(args.out) if args.out else new_run_dir(_default_out(cfg))
    return cfg, run_dir


_MACHINE_FLAGS = {name: key for name, (key, _, _) in _FLAGS.items() if key in MACHINE_SETTINGS}
"""The flags of a machine's own settings: they may be given with --resume (the data moved, another device)."""
_RESUME_FLAGS = [f"--{name.replace('_', '-')}" for name in _MACHINE_FLAGS] + [
    f"--set {key}=" for key in MACHINE_SETTINGS if key not in _MACHINE_FLAGS.values()]


def _machine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The machine settings that a resumed run's command line gives (--data-path, --set dist.host=..., ...)."""
    from shaky.config import parse_value  # noqa: PLC0415

    own = {key: getattr(args, name) for name, key in _MACHINE_FLAGS.items() if getattr(args, name) is not None}
    for item in args.set:
        key, sep, text = item.partition("=")
        if not sep or key.strip() not in MACHINE_SETTINGS:
            raise BadInput(f"--resume continues with the run's saved config; drop --set {item} (only a machine's own "
                           f"settings may be given: {', '.join(_RESUME_FLAGS)})")
        own[key.strip()] = parse_value(text.strip())
    for key in ("data.path", "network.trace"):      # absolute, as a new run's (_absolute_paths)
        if isinstance(own.get(key), str) and own[key]:
            own[key] = str(Path(own[key]).resolve())
    return own


def _with_own(cfg: Any, own: dict[str, Any]) -> Any:
    """``cfg`` with this machine's settings ``own`` (ValueError where the result is not a valid config)."""
    from shaky.config import with_settings  # noqa: PLC0415

    return with_settings(cfg, own) if own else cfg


def _job_rank() -> int | None:
    """This process's rank in a job that torchrun or shaky launch started (RANK and MASTER_PORT set), else None."""
    if "MASTER_PORT" not in os.environ:
        return None
    try:
        return int(os.environ["RANK"])
    except (KeyError, ValueError):
        return None


def _hand_out_resume(run_dir: Path, own: dict[str, Any]) -> Any:
    """Rank 0 of a resumed run reads its config from the run directory and hands it, with the directory, to the
    other ranks through the rendezvous store before the process group forms: their machines need no copy of the
    directory (the checkpoint follows over the group, ``shaky.train``). Bad input goes to them too, so that every
    rank stops at once with status 2 (rank 0 says why). ``own``: rank 0's machine settings given anew; each
    other rank gets its own as the run's last start recorded them (``machines.json``), and may give its own
    anew too (:func:`_resumed_from_rank_0`)."""
    from shaky.comm.dist import hand_out_resume  # noqa: PLC0415
    from shaky.config import to_dict  # noqa: PLC0415
    from shaky.rundir import read_machines  # noqa: PLC0415
    from shaky.train import load_run_config  # noqa: PLC0415

    try:
        try:
            cfg = _with_own(load_run_config(run_dir), own)
            machines = {str(rank): machine["settings"] for rank, machine in read_machines(run_dir).items() if rank}
        except (ValueError, TypeError) as exc:
            raise BadInput(str(exc)) from None
        if cfg.backend != "dist" and _launcher() == "shaky launch":
            raise BadInput(f"--resume {run_dir}: a run on backend {cfg.backend!r}, and shaky launch runs backend "
                           f"'dist' (resume it with `shaky train --resume {run_dir}`)")
    except BadInput as exc:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            say(f"shaky: error: {exc}")
            hand_out_resume({"error": str(exc)}, RESUME_ERROR_WAIT_S)
            raise Stop("", EXIT_BAD_INPUT) from None
        raise
    if cfg.backend != "dist":   # a simulator run resumed where RANK is set (started by torchrun, a cluster's job)
        return cfg
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        try:
            hand_out_resume({"config": to_dict(cfg), "run_dir": str(run_dir.resolve()), "machines": machines},
                            cfg.dist_timeout_s)
        except RuntimeError as exc:     # DistNetworkError: the port is taken, the address is not this machine's
            raise _port_taken(str(exc)) or Stop(
                f"error: rank 0 cannot open the rendezvous store at {os.environ.get('MASTER_ADDR')}:"
                f"{os.environ.get('MASTER_PORT')}: {' '.join(str(exc).split())[:100]}", 3) from None
    return cfg


def _machine() -> str:
    """This machine's place in a job (torchrun's and shaky launch's GROUP_RANK; "0": rank 0's, or no job)."""
    return os.environ.get("GROUP_RANK", "0")


def _simulator_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a readable config of a simulator run (resumed by a process that RANK names, e.g.
    a cluster's job step, it runs as any simulator run does). Nothing else is read here: a dist run's rank > 0
    takes its config from rank 0."""
    from shaky.config import config_from_dict, load_toml  # noqa: PLC0415
    from shaky.rundir import CONFIG_FILE  # noqa: PLC0415

    try:
        return config_from_dict(load_toml(str(run_dir / CONFIG_FILE))).backend != "dist"
    except (OSError, ValueError, TypeError):
        return False


def _resumed_from_rank_0(own: dict[str, Any]) -> tuple[Any, Path]:
    """A rank > 0 of a resumed run: the config and directory rank 0 handed out (:func:`_hand_out_resume`), with
    this rank's machine settings as the run's last start recorded them, and then ``own``, given anew."""
    from shaky.comm.dist import NoResume, resumed_run  # noqa: PLC0415
    from shaky.config import DIST_TIMEOUT_S, config_from_dict  # noqa: PLC0415

    try:    # the run's own dist_timeout_s is in the answer: wait as long as a new run's ranks wait by default
        answer = resumed_run(DIST_TIMEOUT_S)
    except NoResume as exc:
        raise Stop(f"error: {exc}", 3) from None
    if "error" in answer:
        raise BadInput(answer["error"])     # rank 0 says it
    recorded = answer.get("machines", {}).get(os.environ.get("RANK", ""), {})
    try:    # (what the store holds is checked against rank 0's own config once the group forms)
        return _with_own(config_from_dict(answer["config"]), {**recorded, **own}), Path(answer["run_dir"])
    except (ValueError, TypeError) as exc:
        raise BadInput(str(exc)) from None


def _check_out(args: argparse.Namespace) -> None:
    """``--out`` names a directory a new run can be written to (a rank taken back writes none: not checked)."""
    if args.resume or not args.out:
        return
    run_dir = Path(args.out)
    if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        raise BadInput(f"--out {str(run_dir)!r} already exists and is not empty; "
                       "pick another directory or --resume it")
    blocker = next((p for p in run_dir.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise BadInput(f"--out {str(run_dir)!r} cannot be created: {str(blocker)!r} is a file")


def _absolute_paths(values: dict[str, Any]) -> dict[str, Any]:
    """data.path and network.trace as absolute paths, so that config.toml still finds them when the run is
    resumed from another directory."""
    for table, key in (("data", "path"), ("network", "trace")):
        sub = values.get(table)
        if isinstance(sub, dict) and isinstance(sub.get(key), str) and sub[key]:
            values[table] = {**sub, key: str(Path(sub[key]).resolve())}
    return values


def _claim_run_dir(run_dir: Path, *, resume: bool) -> None:
    """This process becomes the run directory's one writer (two at once would interleave their files)."""
    from shaky.rundir import claim_dir  # noqa: PLC0415

    try:
        claim_dir(run_dir, fresh=not resume)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    except OSError as exc:
        flag = "--resume" if resume else "--out"
        raise BadInput(f"{flag} {str(run_dir)!r} cannot be used: {exc.strerror or exc}"
                       + (f" ({exc.filename})" if exc.filename and str(exc.filename) != str(run_dir) else "")) from None


# The fourth run shows the system side of the paper: a reliable transport keeps
# allreduce's accuracy at drop 0.1 but pays a retransmission timeout in most rounds.
DEMO_RUNS = (("allreduce, drop 0", "allreduce", 0.0), ("rps, drop 0.1", "rps", 0.1),
             ("lossy-allreduce, drop 0.1", "lossy-allreduce", 0.1), ("allreduce, drop 0.1", "allreduce", 0.1))


def cmd_demo(args: argparse.Namespace) -> int:
    from shaky.config import config_from_dict  # noqa: PLC0415
    from shaky.report import plot_accuracy, table  # noqa: PLC0415
    from shaky.train import new_run_dir, prepare, train  # noqa: PLC0415

    if args.steps < 1:
        raise BadInput(f"--steps must be >= 1, got {args.steps}")
    given = Path(args.out)
    if given.exists() and not given.is_dir():
        raise BadInput(f"--out {args.out!r} is a file; name a directory (an existing one gets a fresh sibling, "
                       f"{given.name}-1)")
    out = new_run_dir(given)
    _check_writable("--out", out, directory=True)
    base = {"num_workers": 8, "steps": args.steps, "data": {"dataset": "digits"}, "model": {"name": "mlp"},
            "optim": {"lr": 0.1}, "eval_every": max(1, args.steps // 20), "network": {"preset": "lossy"}}
    try:  # every run's config is checked before the first one starts
        cfgs = [config_from_dict({**base, "strategy": {"name": strategy},
                                  "network": {**base["network"], "drop_rate": drop}})
                for _, strategy, drop in DEMO_RUNS]
    except (ValueError, TypeError) as exc:
        raise BadInput(f"--steps {args.steps}: {exc}") from None
    summaries, runs = [], []
    for (name, strategy, drop), cfg in zip(DEMO_RUNS, cfgs):
        run_dir = out / f"{strategy}-drop{drop:g}"
        summaries.append((name, train(prepare(cfg), run_dir, label=name, progress=not args.quiet)))
        runs.append((name, run_dir))
    text = table(summaries)
    (out / "table.md").write_text(text + "\n")
    png = plot_accuracy(runs, out / "accuracy.png",
                        title="MLP on digits, 8 workers, 1 Gbit/s, 0.5 ms links (lossy preset)")
    print(text)
    print(f"\nplot: {png}\nruns: {out}")
    return 0


MAX_SCALE_WORKERS = 256
MAX_SCALE_PARAMS = 1e12
"""A trillion float32 values (4 TB) per message: beyond any model, and what the traffic model can size."""


def _scale_network(args: argparse.Namespace) -> tuple[dict[str, Any], int | None]:
    """The network settings for ``shaky scale`` (file, then preset, then --set) and the file's num_workers."""
    from shaky.config import load_toml, parse_value, set_dotted  # noqa: PLC0415

    values: dict[str, Any] = {}
    file_workers = None
    if args.config:
        loaded = load_toml(args.config)
        values = {"network": loaded.get("network", {})}
        file_workers = loaded.get("num_workers")
        if file_workers is not None and (isinstance(file_workers, bool) or not isinstance(file_workers, int)):
            raise BadInput(f"num_workers must be an integer, got {file_workers!r} (in {args.config})")
    if args.preset is not None or not args.config:
        set_dotted(values, "network.preset", args.preset if args.preset is not None else "geo4")
    for item in args.set:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise BadInput(f"--set expects KEY=VALUE, got {item!r}")
        if not key.startswith("network."):
            raise BadInput(f"scale: --set takes network settings only (network.KEY=VALUE), got {key!r}")
        set_dotted(values, key, parse_value(text.strip()))
    return values, file_workers


def _scale_inputs(args: argparse.Namespace) -> tuple[dict[str, Any], int, list[int], list[float], Path]:
    """Checks ``shaky scale``'s flags: network values, W, the worker counts, the latencies, the plot path."""
    try:
        values, file_workers = _scale_network(args)
    except (ValueError, TypeError) as exc:
        raise BadInput(str(exc)) from None
    workers = args.workers if args.workers is not None else (file_workers if file_workers is not None else 32)
    counts = args.worker_counts or ([workers] if file_workers is not None else [4, 8, 16, 32, 64])
    latencies = args.latencies_ms if args.latencies_ms is not None else [0, 50, 100] + list(range(200, 1001, 100))
    # The clock holds a W x W matrix for each of a ring's 2(W-1) hops: 256 workers already take 270 MB.
    in_range = f"in [1, {MAX_SCALE_WORKERS}]"
    checks = [("--workers", workers, 1 <= workers <= MAX_SCALE_WORKERS, in_range),
              ("--params", args.params, 1 <= args.params <= MAX_SCALE_PARAMS, f"in [1, {MAX_SCALE_PARAMS:g}]"),
              ("--compute-ms", args.compute_ms, 0 < args.compute_ms < float("inf"), "a positive number"),
              ("--delay", args.delay, args.delay is None or args.delay >= 1, ">= 1"),
              ("--period", args.period, args.period is None or args.period >= 1, ">= 1"),
              ("--delay", args.delay, args.delay is None or args.delay <= MAX_SCALE_PERIOD,
               f"at most {MAX_SCALE_PERIOD}"),
              ("--period", args.period, args.period is None or args.period <= MAX_SCALE_PERIOD,
               f"at most {MAX_SCALE_PERIOD}")]
    checks += [("--worker-counts", w, 1 <= w <= MAX_SCALE_WORKERS, in_range) for w in counts]
    checks += [("--latencies-ms", v, 0 <= v < float("inf"), "a number >= 0") for v in latencies]
    for flag, value, ok, expected in checks:
        if not ok:
            raise BadInput(f"{flag} must be {expected}, got {value!r}")
    out = Path(args.out)
    blocker = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if out.is_dir() or blocker is not None:
        raise BadInput(f"--out {str(out)!r} cannot be written: {str(blocker or out)!r} is "
                       f"{'a file' if blocker else 'a directory'}")
    # The plot's format follows the name; a table goes beside it as .md, so the name must say .png.
    if out.suffix.lower() != ".png":
        raise BadInput(f"--out must name a .png file (the Markdown table goes beside it, as "
                       f"{out.with_suffix('.md').name}), got {str(out)!r}")
    _check_writable("--out", out, directory=False)
    if out.with_suffix(".md").is_dir():
        raise BadInput(f"--out {str(out)!r}: its table would go to {str(out.with_suffix('.md'))!r}, a directory")
    _check_writable("--out", out.with_suffix(".md"), directory=False)
    return values, workers, counts, latencies, out


def cmd_scale(args: argparse.Namespace) -> int:
    from shaky import scale  # noqa: PLC0415

    values, workers, counts, latencies, out = _scale_inputs(args)
    work = scale.Workload(int(args.params), args.compute_ms)
    try:
        base = scale.network_config(values, workers)
        for w in counts:
            scale.network_config(values, w)
    except (ValueError, TypeError) as exc:
        raise BadInput(str(exc)) from None
    recommended = scale.recommended_period(base, work)
    delay = args.delay if args.delay is not None else recommended
    period = args.period if args.period is not None else delay
    if max(delay, period) > MAX_SCALE_PERIOD:  # only the recommended value can be here: the flags were checked
        raise BadInput(f"the recommended t = d = {recommended} (one exchange over --compute-ms "
                       f"{args.compute_ms:g}) is above {MAX_SCALE_PERIOD}; give --delay and --period, or a larger "
                       "--compute-ms")
    sweeps = [scale.sweep_latency(values, workers, latencies, work, period=period, delay=delay),
              scale.sweep_workers(values, counts, work, period=period, delay=delay)]
    net = base.network
    where = (f"{len(net.regions)} regions, {net.wan_bandwidth_mbps:g} Mbit/s between them" if net.regions
             else "one site")
    title = (f"{work.num_params / 1e6:g}M float32 per message ({work.num_params * 4 / 1e6:g} MB), "
             f"{work.compute_ms:g} ms compute per step, {where}")
    worker_axis = "latencies between regions as measured" if net.regions else "latencies as configured"
    print(f"scalability (clock alone, nothing lost): {title}")
    print(f"one dts exchange at W = {workers}: {scale.exchange_seconds('dts', base, work):.3f} s, "
          f"one allreduce: {scale.exchange_seconds('allreduce', base, work):.3f} s; "
          f"recommended t = d = {recommended}; using t = {delay}, d = tau = {period}\n")
    texts = [f"latency sweep, W = {workers}:\n{scale.table(sweeps[0], period, delay)}",
             f"worker sweep, {worker_axis}:\n{scale.table(sweeps[1], period, delay)}"]
    print("\n\n".join(texts))
    png = scale.plot(sweeps, out, period=period, delay=delay, title=title,
                     subtitles=[f"W = {workers}", worker_axis])
    out.with_suffix(".md").write_text(f"{title}\n\n" + "\n\n".join(texts) + "\n")
    print(f"\nplot: {png}")
    return 0


def _no_file_below(flag: str, path: Path) -> None:
    blocker = next((p for p in [path, *path.parents] if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise BadInput(f"{flag} {str(path)!r} cannot be created: {str(blocker)!r} is a file")


def _check_writable(flag: str, path: Path, *, directory: bool) -> None:
    """BadInput unless files can be written at ``path`` (a directory, or a file that may replace one there).

    Permission bits do not tell (root ignores them; a read-only mount or /proc does not), so this tries:
    it creates what is missing of the directory and a probe file in it, then removes all of it again,
    leaving the file system as it was.
    """
    _no_file_below(flag, path if directory else path.parent)
    if not directory and path.is_dir():
        raise BadInput(f"{flag} {str(path)!r} is a directory; name a file")
    folder = path if directory else path.parent
    created: list[Path] = []
    try:
        for p in reversed([folder, *folder.parents]):
            if not p.exists():
                p.mkdir()
                created.append(p)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".shaky-probe-")
        os.close(fd)
        os.unlink(probe)
        if not directory and path.exists() and not os.access(path, os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as exc:
        raise BadInput(f"{flag} {str(path)!r} cannot be written: {exc.strerror or exc}") from None
    finally:
        for p in reversed(created):
            p.rmdir()


def cmd_sweep(args: argparse.Namespace) -> int:
    from shaky.sweep import check_setups, execute_tuned, load_sweep, parse_overrides, plan, run_sweeps  # noqa: PLC0415

    if args.jobs is not None and args.jobs < 1:
        raise BadInput(f"--jobs must be >= 1, got {args.jobs}")
    out = Path(args.out)
    _no_file_below("--out", out)
    try:
        overrides = parse_overrides(args.set)
        sweeps = [load_sweep(f, overrides) for f in args.files]
        names = [s.name for s in sweeps]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"two sweep files are named {name!r}; their runs would share {str(out / name)!r}")
        tasks, _ = plan(sweeps, out)  # refuses directories of other configs before anything is written
        check_setups(tasks)
    except (ValueError, TypeError) as exc:
        raise BadInput(str(exc)) from None
    from shaky.rundir import claim_dir  # noqa: PLC0415

    try:  # one sweep at a time per directory: a second would clear and rewrite runs the first is training
        for sweep in sweeps:
            claim_dir(out / sweep.name, fresh=not (out / sweep.name).exists(), what="sweep directory")
    except (ValueError, OSError) as exc:
        raise BadInput(str(exc)) from None
    from shaky.interrupt import Stopped, raising  # noqa: PLC0415

    resume = "the runs under way wrote checkpoints; run the same command again to resume (finished runs are kept)"
    try:
        with raising():
            outcome = run_sweeps(sweeps, out, jobs=args.jobs, progress=not args.quiet, runner=execute_tuned)
    except KeyboardInterrupt:
        raise Stop(f"interrupted; {resume}", 130) from None
    except Stopped as exc:
        raise Stop(f"sweep stopped by {signal.Signals(exc.signum).name}; {resume}", exc.exit_code) from None
    for name, error in outcome.failed:
        say(f"shaky: run failed: {name}: {error}")
    print(f"sweep: {outcome.ran} runs done, {outcome.skipped} already finished, {len(outcome.failed)} failed, "
          f"in {outcome.wall_s:.0f} s; runs in {out}")
    return 1 if outcome.failed else 0


def cmd_report(args: argparse.Namespace) -> int:
    from shaky.report import find_runs, write_report  # noqa: PLC0415
    from shaky.sweep import SWEEP_FILE  # noqa: PLC0415

    dirs = [Path(d) for d in args.dirs]
    for d in dirs:
        if not d.is_dir():
            raise BadInput(f"report: {str(d)!r} is not a directory")
        if not (d / SWEEP_FILE).is_file() and not find_runs(d):
            raise BadInput(f"report: {str(d)!r} is neither a sweep directory ({SWEEP_FILE}) nor holds finished "
                           f"runs ({SUMMARY_FILE})")
    out = Path(args.out)
    _no_file_below("--out", out)
    reproduction = Path(args.reproduction) if args.reproduction else None
    if reproduction is not None:
        _no_file_below("--reproduction", reproduction.parent)
        if reproduction.is_dir():
            raise BadInput(f"--reproduction {str(reproduction)!r} is a directory; name a .md file")
        _check_writable("--reproduction", reproduction, directory=False)
    _check_writable("--out", out, directory=True)
    try:
        result = write_report(dirs, out, reproduction)
    except (ValueError, TypeError) as exc:
        raise BadInput(str(exc)) from None
    for v in result["verdicts"]:
        verdict = "holds" if v.holds else ("not measured" if v.holds is None else "does not hold")
        print(f"{v.id}: {verdict}: {' '.join(v.ours.split())}" + (f" ({v.why})" if v.why else ""))
    if result["missing"]:
        say(f"shaky: warning: {result['missing']} runs of these sweeps are not finished; run shaky sweep again")
    print(f"report: {result['report']} ({len(result['plots'])} plots in {out})")
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    from shaky.launch import Launcher, LaunchConfig, train_command  # noqa: PLC0415

    try:
        cfg = LaunchConfig(nproc_per_node=args.nproc_per_node, nnodes=args.nnodes, node_rank=args.node_rank,
                           master_addr=args.master_addr, master_port=args.master_port,
                           max_restarts=args.max_restarts)
        train_args = train_command(args.train_args)
        launcher = Launcher(cfg, train_args, log_dir=args.log_dir)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    return launcher.run()


def process_settings(*, shared_cores: bool = False) -> None:
    """The process-wide settings of a shaky command (docs/performance.md has the measurements behind them).

    Only the command line makes them: ``import shaky`` and the classes a user constructs in their own
    process leave the process as it is. They must come before torch loads (OpenMP reads its
    environment then), which is why nothing above this call imports torch.

    * ``shared_cores`` (a torch.distributed rank: other ranks of the run may share this machine's cores):
      ``OMP_WAIT_POLICY=PASSIVE`` unless set, since OpenMP threads that spin while they wait take the cores
      from the other processes' working threads (a 2-3x slowdown measured with two runs on two cores).
      Otherwise OpenMP's own default (spin briefly, then sleep): for a run that has the machine to itself
      it is 1.2-1.4x faster a step than PASSIVE (an MLP on digits at W = 16 and 64), where waking a
      sleeping thread costs tens of microseconds per parallel region. ``shaky sweep`` runs one
      single-threaded process per core, where the policy does not matter.
    * glibc malloc keeps freed memory: every step allocates and frees the same large tensors, and
      returning them to the OS costs a page fault per 4 KiB per step.
    * ``shared_cores`` also: ``TORCH_CPP_LOG_LEVEL=ERROR`` unless set. torch.distributed's C++ warns, with a
      stack trace, about every store request that times out or finds its peer gone; a run that loses a rank
      says what happened in one line of its own (and live membership waits on the store on purpose).
    """
    if shared_cores:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from shaky.vectorized import tune_allocator  # noqa: PLC0415

    tune_allocator()


def _shares_cores(args: argparse.Namespace) -> bool:
    """Whether this process is one rank of a torch.distributed run (torchrun, or RANK set by hand)."""
    return getattr(args, "backend", None) == "dist" or any(k in os.environ for k in ("RANK", "LOCAL_RANK"))


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        if args.command == "launch":    # starts and watches processes: no torch, no process settings here
            return cmd_launch(args)
        with exiting():  # seconds of loading torch and scikit-learn, before anything is written
            process_settings(shared_cores=_shares_cores(args))
            import shaky.data  # noqa: F401, PLC0415 (scikit-learn, scipy)
        return {"train": cmd_train, "demo": cmd_demo, "scale": cmd_scale, "sweep": cmd_sweep,
                "report": cmd_report}[args.command](args)
    except BadInput as exc:
        # Every user-input check runs before a run directory exists; errors
        # raised later are bugs and keep their traceback. Under torchrun every rank finds the same bad
        # input: rank 0 says it, once.
        # On another machine than rank 0's, its first rank says it too: rank 0's line is not seen there.
        if os.environ.get("RANK", "0") == "0" or isinstance(exc, AloneBadInput) or (
                os.environ.get("LOCAL_RANK") == "0" and _machine() != "0"):
            say(f"shaky: error: {exc}")
        elif "TORCHELASTIC_RUN_ID" in os.environ:
            # torchrun stops every rank when the first one exits: leave rank 0 the time to say it.
            time.sleep(BAD_INPUT_GRACE_S)
        return EXIT_BAD_INPUT
    except Stop as exc:
        if str(exc):
            say(f"shaky: {exc}")
        return exc.code
    except FloatingPointError as exc:     # diverged: a result (summary.json says so), not a crash
        say(f"shaky: error: {exc}")
        return EXIT_DIVERGED
    except KeyboardInterrupt:  # a run that was under way says more (see _stopping)
        say("shaky: interrupted")
        return 130
    except OSError as exc:  # no space left, a read-only directory: where, in one line
        where = f"{exc.filename}: " if exc.filename else ""
        say(f"shaky: error: {where}{exc.strerror or exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
