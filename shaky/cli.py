"""The command line: ``shaky train``, ``shaky launch``, ``shaky demo``, ``shaky scale``, ``shaky sweep`` and
``shaky report``.

Bad input (a setting that does not exist, a value out of range, a data path
that cannot be read) prints one line naming the setting and the value and exits
with status 2, before any run directory is created.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import typing
from pathlib import Path
from typing import Any, Sequence

# (no torch in shaky.config: process_settings must come before torch loads)
from shaky.config import MACHINE_SETTINGS, MAX_SCALE_PERIOD, short_name
from shaky.errors import AloneBadInput, BadInput, Stop
from shaky.interrupt import Stopped, exiting, raising
from shaky.job.env import JobEnv
from shaky.launch import EXIT_BAD_INPUT, EXIT_DIVERGED  # no torch (the launcher reads them)
from shaky.outputs import check_writable, no_file_below
from shaky.progress import say
from shaky.rundir import SUMMARY_FILE  # no torch

BAD_INPUT_GRACE_S = 2.0
"""Under torchrun, how long a rank other than 0 waits before it exits on bad input (rank 0 prints the line)."""


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
    "dataset": ("data.dataset", str, "digits, iris, wine, breast_cancer, mnist1d, cifar10, text or bytes (or a "
                "factory: package.module:factory or path/to/file.py:factory; default digits)"),
    "data_path": ("data.path", str, "cifar10: a directory in CIFAR-10's python batch format; text: a file of "
                  "label<TAB>text lines; bytes: any file, its bytes predicted one by one"),
    "partition": ("data.partition", str, "iid, dirichlet or label-skew (default iid)"),
    "model": ("model.name", str, "logreg, mlp, cnn, resnet20, resnet32, resnet44, resnet56, resnet110, lstm or gpt "
              "(or a factory, called with input_shape and num_classes: module:factory or file.py:factory; "
              "default mlp)"),
    "steps": ("steps", int, "training steps (default 600)"),
    "batch_size": ("batch_size", int, "mini-batch size per worker (default 32)"),
    "lr": ("optim.lr", float, "peak learning rate of every worker's optimizer (default 0.1)"),
    "momentum": ("optim.momentum", float, "sgd's heavy-ball momentum, in [0, 1) (default 0)"),
    "seed": ("seed", int, "seed of every random choice (default 0)"),
    "eval_every": ("eval_every", int, "evaluate every N steps and at the end (default 50)"),
    "checkpoint_every": ("checkpoint_every", int, "write a checkpoint every N steps (default 500; 0 = only the "
                         "final one and the one written when Ctrl-C or SIGTERM stops the run)"),
    "value_dtype": ("strategy.value_dtype", str, "how exchanged values travel: float32, bfloat16, float16 or int8, "
                    "as rounded differences from a value both ends hold (default: as the model holds them; the "
                    "simulator and --transport udp)"),
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
    return Path("runs") / (f"{short_name(cfg.data.dataset)}-{short_name(cfg.model.name)}-{cfg.strategy.name}-"
                           f"w{cfg.num_workers}-{drop_text}-seed{cfg.seed}")


def cmd_train(args: argparse.Namespace, env: JobEnv) -> int:
    # The job's modules load torch: imported here, as every command's modules are in its cmd_ function, so that
    # shaky --version, shaky launch and bad input on the command line stay quick (and torch loads after
    # process_settings).
    from shaky.job import local, rank  # noqa: PLC0415
    from shaky.train import prepare  # noqa: PLC0415

    try:
        cfg, run_dir = _train_config(args, env)
        # A process started again for rank 0 of a udp run in progress (its keeper still serves MASTER_PORT) joins it.
        joining = rank.joining(env, cfg.dist_timeout_s) if cfg.backend == "dist" and env.job_rank == 0 else None
        if env.job_rank in (None, 0) and joining is None:    # rank 0 writes --out
            _check_out(args)
        if cfg.backend == "dist" and env.job_rank == 0 and joining is None:
            rank.keep_store(env, cfg)    # the run's store, in a process of its own: started while this one prepares
        # dist: rank 0 measures alone (rank.train_dist); device cuda puts each rank on GPU LOCAL_RANK. Before a rank
        # waits for rank 0's store: bad input found here is said at once, on every machine.
        setup = prepare(cfg, measure=cfg.backend != "dist",
                        local_rank=int(env.local_rank or 0) if cfg.backend == "dist" else None)
    except (ValueError, TypeError) as exc:
        raise BadInput(str(exc)) from None
    if cfg.backend == "dist" and env.job_rank != 0:
        joining = rank.joining(env, cfg.dist_timeout_s)
    if joining is None and env.job_rank not in (None, 0) and env.machine == "0":   # as rank 0 beside it says
        _check_out(args)
    if joining is not None:
        return rank.rejoin(env, setup, joining, quiet=args.quiet)
    if cfg.backend == "dist":
        return rank.train_dist(env, setup, run_dir, resume=bool(args.resume), quiet=args.quiet)
    summary = local.train_here(env, setup, run_dir, resume=bool(args.resume), quiet=args.quiet)
    if not args.quiet:
        print(json.dumps(summary, indent=2))
    print(f"run directory: {run_dir}")
    return 0


def _train_config(args: argparse.Namespace, env: JobEnv) -> tuple[Any, Path]:
    from shaky.config import config_from_dict  # noqa: PLC0415
    from shaky.job import resume  # noqa: PLC0415
    from shaky.job.stop import launcher  # noqa: PLC0415
    from shaky.train import load_run_config, new_run_dir  # noqa: PLC0415

    if args.resume:
        given = [n for n in (*_FLAGS, "config", "out") if getattr(args, n) is not None and n not in _MACHINE_FLAGS]
        if given:
            raise BadInput(f"--resume continues with the run's saved config; drop --{given[0].replace('_', '-')} "
                           f"(only a machine's own settings may be given: {', '.join(_RESUME_FLAGS)})")
        own = _machine_overrides(args)
        rank, run_dir = env.job_rank, Path(args.resume)
        if rank and (launcher(env) == "shaky launch" or not resume.simulator_run(run_dir)):
            return resume.config_from_rank_0(env, own)
        if rank == 0:
            return resume.hand_out_config(env, run_dir, own), run_dir
        try:
            cfg = resume.with_own(load_run_config(run_dir), own)
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
    from shaky.config import parse_value  # noqa: PLC0415 (no torch)

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
    check_writable("--out", out, directory=True)
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


def cmd_scale(args: argparse.Namespace) -> int:
    from shaky import scale  # noqa: PLC0415

    values, workers, counts, latencies, out = scale.command_inputs(args)
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


def cmd_sweep(args: argparse.Namespace) -> int:
    from shaky.sweep import check_setups, execute_tuned, load_sweep, parse_overrides, plan, run_sweeps  # noqa: PLC0415

    if args.jobs is not None and args.jobs < 1:
        raise BadInput(f"--jobs must be >= 1, got {args.jobs}")
    out = Path(args.out)
    no_file_below("--out", out)
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
    no_file_below("--out", out)
    reproduction = Path(args.reproduction) if args.reproduction else None
    if reproduction is not None:
        no_file_below("--reproduction", reproduction.parent)
        if reproduction.is_dir():
            raise BadInput(f"--reproduction {str(reproduction)!r} is a directory; name a .md file")
        check_writable("--reproduction", reproduction, directory=False)
    check_writable("--out", out, directory=True)
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

    * OpenMP's idle threads spin while the run has its CPUs to itself and sleep while another program wants
      them (:mod:`shaky.waiting`), unless the environment sets a policy (``OMP_WAIT_POLICY``,
      ``GOMP_SPINCOUNT``). Spinning is 1.1-2.7x faster a quiet step than sleeping (an MLP on digits at
      W = 16 and 64), but when another program keeps one core busy the spinning threads wait for a thread
      that lost its core: 100x slower a step on two cores of an idle host, 3-16x on this VM, where sleeping
      stays within 1.3x of its quiet speed. Thread counts are never changed behind the user's back: they
      change a conv net's numbers (reductions split per thread), and the wait does not.
    * glibc malloc keeps freed memory: every step allocates and frees the same large tensors, and
      returning them to the OS costs a page fault per 4 KiB per step.
    * ``shared_cores`` (a torch.distributed rank): also ``TORCH_CPP_LOG_LEVEL=ERROR`` unless set.
      torch.distributed's C++ warns, with a stack trace, about every store request that times out or finds
      its peer gone; a run that loses a rank says what happened in one line of its own (and live membership
      waits on the store on purpose).
    """
    from shaky import waiting  # noqa: PLC0415 (no torch)

    waiting.prepare()
    if shared_cores:
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from shaky.vectorized import tune_allocator  # noqa: PLC0415

    tune_allocator()
    waiting.start()     # torch has loaded: its libgomp holds the marker


def _shares_cores(args: argparse.Namespace, env: JobEnv) -> bool:
    """Whether this process is one rank of a torch.distributed run (torchrun, or RANK set by hand)."""
    return getattr(args, "backend", None) == "dist" or env.is_rank


def main(argv: Sequence[str] | None = None) -> int:
    env = JobEnv.from_environ(os.environ)   # the one read of the process environment: passed down from here
    try:
        args = _parser().parse_args(argv)
        if args.command == "launch":    # starts and watches processes: no torch, no process settings here
            return cmd_launch(args)
        with exiting():  # seconds of loading torch and scikit-learn, before anything is written
            process_settings(shared_cores=_shares_cores(args, env))
            import shaky.data  # noqa: F401, PLC0415 (scikit-learn, scipy)
        with raising():     # SIGINT: KeyboardInterrupt, SIGTERM: Stopped, where the command is (its cleanup runs)
            if args.command == "train":
                return cmd_train(args, env)
            return {"demo": cmd_demo, "scale": cmd_scale, "sweep": cmd_sweep, "report": cmd_report}[args.command](args)
    except BadInput as exc:
        # Every user-input check runs before a run directory exists; errors
        # raised later are bugs and keep their traceback. Under torchrun every rank finds the same bad
        # input: rank 0 says it, once.
        # On another machine than rank 0's, its first rank says it too: rank 0's line is not seen there.
        if (env.rank is None or env.rank == "0") or isinstance(exc, AloneBadInput) or (
                env.local_rank == "0" and env.machine != "0"):
            say(f"shaky: error: {exc}")
        elif env.torchelastic_run_id is not None:
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
    except KeyboardInterrupt:  # a run that was under way says more (see shaky.job.stop.stopping)
        say("shaky: interrupted")
        return 130
    except Stopped as exc:
        say(f"shaky: {exc}")
        return exc.exit_code
    except OSError as exc:  # no space left, a read-only directory: where, in one line
        where = f"{exc.filename}: " if exc.filename else ""
        say(f"shaky: error: {where}{exc.strerror or exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
