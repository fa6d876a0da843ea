"""The command line: ``shaky train`` and ``shaky demo``.

Bad input (a setting that does not exist, a value out of range, a data path
that cannot be read) prints one line naming the setting and the value and exits
with status 2, before any run directory is created.
"""

from __future__ import annotations

import argparse
import json
import sys
import typing
from pathlib import Path
from typing import Any, Sequence

EXIT_BAD_INPUT = 2

# CLI flag -> dotted config key. Every other setting is reachable with --set KEY=VALUE.
_FLAGS: dict[str, tuple[str, type, str]] = {
    "strategy": ("strategy.name", str, "allreduce, lossy-allreduce or rps"),
    "workers": ("num_workers", int, "number of workers W"),
    "drop_rate": ("network.drop_rate", float, "probability that a message is lost, in [0, 1)"),
    "preset": ("network.preset", str, "network preset: lan or lossy"),
    "dataset": ("data.dataset", str, "digits, iris, wine, breast_cancer, mnist1d, cifar10, text"),
    "data_path": ("data.path", str, "CIFAR-10 directory or label<TAB>text file"),
    "partition": ("data.partition", str, "iid or dirichlet"),
    "model": ("model.name", str, "logreg, mlp, cnn, resnet20..resnet110, lstm"),
    "steps": ("steps", int, "training steps"),
    "batch_size": ("batch_size", int, "mini-batch size per worker"),
    "lr": ("optim.lr", float, "learning rate"),
    "momentum": ("optim.momentum", float, "momentum"),
    "seed": ("seed", int, "seed of every random choice"),
    "eval_every": ("eval_every", int, "evaluate every N steps"),
    "checkpoint_every": ("checkpoint_every", int, "write a checkpoint every N steps"),
    "replay_trace": ("network.trace", str, "run directory whose delivery masks are replayed"),
}


class BadInput(Exception):
    """User input the CLI reports in one line with exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line and exit status 2 like every other bad input."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(EXIT_BAD_INPUT, f"shaky: error: {self.prog}: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="shaky", description="Distributed training over bad networks.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    train = sub.add_parser("train", help="train one run (simulator by default)")
    train.add_argument("--config", metavar="FILE.toml", help="a TOML config; flags override it")
    for name, (key, tp, text) in _FLAGS.items():
        train.add_argument("--" + name.replace("_", "-"), dest=name, type=tp, metavar=tp.__name__.upper(),
                           help=f"{text} ({key})")
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="any setting by its dotted name, e.g. --set network.latency_ms=20 (repeatable)")
    train.add_argument("--out", metavar="DIR", help="run directory (default runs/<dataset>-<model>-<strategy>-...)")
    train.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its checkpoint")
    train.add_argument("--quiet", action="store_true", help="no progress output")

    demo = sub.add_parser("demo", help="MLP on digits, 8 workers: allreduce, rps and lossy-allreduce at drop 0.1")
    demo.add_argument("--out", metavar="DIR", default="runs/demo", help="where runs, table and plot go")
    demo.add_argument("--steps", type=int, default=600, help="training steps per run")
    demo.add_argument("--quiet", action="store_true", help="no progress output")
    return parser


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
        setup = prepare(cfg)
    except (ValueError, TypeError) as exc:
        raise BadInput(str(exc)) from None
    summary = train(setup, run_dir, resume=bool(args.resume), label=cfg.strategy.name, progress=not args.quiet)
    if not args.quiet:
        print(json.dumps(summary, indent=2))
    print(f"run directory: {run_dir}")
    return 0


def _train_config(args: argparse.Namespace) -> tuple[Any, Path]:
    from shaky.config import config_from_dict  # noqa: PLC0415
    from shaky.train import load_run_config, new_run_dir  # noqa: PLC0415

    if args.resume:
        given = [n for n in (*_FLAGS, "config", "out") if getattr(args, n) is not None] + (["set"] if args.set else [])
        if given:
            raise BadInput(f"--resume continues with the run's saved config; drop --{given[0].replace('_', '-')}")
        run_dir = Path(args.resume)
        cfg = load_run_config(run_dir)
    else:
        cfg = config_from_dict(_config_values(args))
        if args.out:
            run_dir = Path(args.out)
            if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
                raise BadInput(f"--out {str(run_dir)!r} already exists and is not empty; "
                               "pick another directory or --resume it")
            blocker = next((p for p in run_dir.parents if p.exists() and not p.is_dir()), None)
            if blocker is not None:
                raise BadInput(f"--out {str(run_dir)!r} cannot be created: {str(blocker)!r} is a file")
        else:
            run_dir = new_run_dir(_default_out(cfg))
    return cfg, run_dir


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
    out = new_run_dir(args.out)
    base = {"num_workers": 8, "steps": args.steps, "data": {"dataset": "digits"}, "model": {"name": "mlp"},
            "optim": {"lr": 0.1}, "eval_every": max(1, args.steps // 20), "network": {"preset": "lossy"}}
    summaries, runs = [], []
    for name, strategy, drop in DEMO_RUNS:
        cfg = config_from_dict({**base, "strategy": {"name": strategy},
                                "network": {**base["network"], "drop_rate": drop}})
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


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return {"train": cmd_train, "demo": cmd_demo}[args.command](args)
    except BadInput as exc:
        # Every user-input check runs before a run directory exists; errors
        # raised later are bugs and keep their traceback.
        print(f"shaky: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except FloatingPointError as exc:
        print(f"shaky: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("shaky: interrupted; resume with --resume from the last checkpoint", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
