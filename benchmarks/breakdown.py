"""Where a `shaky train` step's time goes: the loop's parts, in milliseconds a step, from one instrumented run.

    .venv/bin/python benchmarks/breakdown.py --workers 16 --drop-rate 0.1 --steps 3000
    .venv/bin/python benchmarks/breakdown.py --workers 64 --batch-size 16 --drop-rate 0.1 --steps 1500

The arguments are `shaky train`'s (`--out` defaults to a temporary directory, `--quiet` is added). The
run is the command's own, in this process, with the command's process settings; each part below is
timed around its call with `time.perf_counter` (about a microsecond a call on top), and the loop's own
time is `shaky.train._loop`'s. Parts:

* ``step``: ``train_step`` (gradients, the local update and the exchange), of which ``block average``
  (the simulator's lossy block average, ``SimComm.block_average``) and ``bmm and baddbmm`` (every
  ``torch.bmm`` and ``torch.baddbmm`` called from Python during the step: for the MLP, all of its matrix
  products, the block average's included; a conv net's run inside autograd and are not counted);
* ``evaluation``: the metrics row every ``eval_every`` steps (the test set through the average model and
  through every worker's, the gradient diversity, the metrics file);
* ``masks``: drawing the round's delivery masks (``NetworkModel.sample``); ``mask log``: keeping them for
  the trace, and counting the lost messages (``_Masks.record``);
* ``sampler``: the step's mini-batch indices (``BatchSampler.indices``);
* ``loss mean``: taking in the means of the training loss that arrived, and the stop check
  (``_LossMeans.take``; the simulator's mean itself is taken in the step, once the losses are known);
* ``clock``: the simulated clock (``Clock.advance``);
* ``rest``: the loop less all of the above (gathering the batch, the membership, the counters, progress).

Compare with `benchmarks/sim.py`'s (a) and (c) (the step alone, and the limit) and `benchmarks/loop.py`
(the uninstrumented loop against (c)).
"""

from __future__ import annotations

import collections
import functools
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent

# (label, module, attribute path): what is timed. "block average" runs inside "step", and "loop" holds them all.
PARTS = [("step", "shaky.train", "train_step"), ("block average", "shaky.comm.sim", "SimComm.block_average"),
         ("bmm and baddbmm", "torch", "bmm"), ("bmm and baddbmm", "torch", "baddbmm"),
         ("evaluation", "shaky.train", "_Metrics.log"), ("masks", "shaky.network.model", "NetworkModel.sample"),
         ("mask log", "shaky.train", "_Masks.record"), ("sampler", "shaky.sampler", "BatchSampler.indices"),
         ("loss mean", "shaky.train", "_LossMeans.take"), ("clock", "shaky.network.clock", "Clock.advance"),
         ("loop", "shaky.train", "_loop")]
INSIDE = {"block average": "step", "bmm and baddbmm": "step"}


def _instrument(totals: collections.Counter[str]) -> None:
    """Wrap every part's function in a timer. A part counts only while the loop runs: `train` also evaluates
    the model before its loop (step 0's metrics row), and that time belongs to no step."""
    import importlib  # noqa: PLC0415

    in_loop = [False]
    depth: collections.Counter[str] = collections.Counter()   # how many calls of each part are running now

    for label, module, path in PARTS:
        owner: Any = importlib.import_module(module)
        *outer, name = path.split(".")
        for part in outer:
            owner = getattr(owner, part)
        fn: Callable[..., Any] = getattr(owner, name)

        def timed(*args: Any, _fn: Callable[..., Any] = fn, _label: str = label, **kwargs: Any) -> Any:
            if _label == "loop":
                in_loop[0] = True
            elif not in_loop[0] or (_label in INSIDE and not depth[INSIDE[_label]]):
                return _fn(*args, **kwargs)
            depth[_label] += 1
            start = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                totals[_label] += time.perf_counter() - start
                depth[_label] -= 1
                if _label == "loop":
                    in_loop[0] = False

        setattr(owner, name, functools.wraps(fn)(timed))


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    sys.path.insert(0, str(ROOT))
    from shaky import cli  # noqa: PLC0415 (cli.process_settings must come before torch loads)

    cli.process_settings()
    totals: collections.Counter[str] = collections.Counter()
    _instrument(totals)
    with tempfile.TemporaryDirectory(prefix="shaky-breakdown-") as tmp:
        if "--out" not in args:
            args += ["--out", str(Path(tmp) / "run")]
        out = Path(args[args.index("--out") + 1])
        rc = cli.main(["train", *args, "--quiet"])
        if rc:
            return rc
        summary = json.loads((out / "summary.json").read_text())
    steps = summary["steps"]
    loop = totals.pop("loop")
    print(f"shaky benchmarks/breakdown.py: shaky train {' '.join(args)}")
    print(f"{steps} steps, {1e3 * summary['wall_time_s'] / steps:.3f} ms a step by summary.json "
          f"(this run, instrumented)\n")
    print(f"{'part':<16} {'ms/step':>8} {'share':>6}")
    for label in dict.fromkeys(label for label, _, _ in PARTS[:-1]):
        ms = 1e3 * totals[label] / steps
        name = f"  {label}" if label in INSIDE else label
        print(f"{name:<16} {ms:>8.3f} {totals[label] / loop:>6.0%}")
    rest = loop - sum(v for k, v in totals.items() if k not in INSIDE)
    print(f"{'rest':<16} {1e3 * rest / steps:>8.3f} {rest / loop:>6.0%}")
    print(f"{'loop':<16} {1e3 * loop / steps:>8.3f} {1:>6.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
