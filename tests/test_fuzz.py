"""Fuzz of the bad-input contract: every command, hundreds of seeded, deterministic bad inputs.

For each case: ``shaky`` exits with status 2, prints exactly one line on stderr (no traceback) and nothing
on stdout, and leaves the file system as it was (the tree under the case's directory, bytes included,
equals the inputs made for it). Cases run in-process (``shaky.cli.main``) with the working directory set to
the case's own tmp_path; damaged run and sweep directories are copies of ONE tiny real run and ONE tiny
sweep, made once for the module. A few cases run as real processes, to see the property end to end (the key
files among them, which only the ranks of a udp run read). Every case runs under a memory limit (RLIMIT_AS: its
process's size plus 2 GiB in-process, 4 GiB a started process): an input that sizes an allocation fails its case
rather than filling the machine.
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
import tomli_w

from shaky.cli import _FLAGS, main

SEED = 20_241_123
Prep = Callable[[Path, "Base", random.Random], None]


@dataclass(frozen=True)
class Base:
    """The real inputs the damaged copies start from (outside every case's directory)."""

    run: Path
    """A finished run: iris, logreg, 2 workers, 20 steps, checkpoints at 10 and 20."""
    sweep: Path
    """A finished sweep directory (two runs of the same setup, seeds 0 and 1)."""


@dataclass(frozen=True)
class Case:
    id: str
    argv: list[str]
    preps: tuple[Prep, ...] = ()


@dataclass
class _Cases:
    items: list[Case] = field(default_factory=list)

    def add(self, id: str, argv: list[str], *preps: Prep) -> None:
        self.items.append(Case(id, argv, preps))


# ---------------------------------------------------------------------------------------------------------------
# Making inputs


def write(name: str, content: str | bytes) -> Prep:
    def prep(tmp: Path, base: Base, rng: random.Random) -> None:
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    return prep


def mkdir(name: str) -> Prep:
    return lambda tmp, base, rng: (tmp / name).mkdir(parents=True, exist_ok=True)


Damage = Callable[[Path, random.Random], None]


def run_copy(damage: Damage | None = None, name: str = "run") -> Prep:
    """A copy of the base run at ``name``, then ``damage(copy, rng)``."""
    def prep(tmp: Path, base: Base, rng: random.Random) -> None:
        shutil.copytree(base.run, tmp / name)
        if damage is not None:
            damage(tmp / name, rng)
    return prep


def sweep_copy(damage: Damage | None = None, name: str = "sw") -> Prep:
    def prep(tmp: Path, base: Base, rng: random.Random) -> None:
        shutil.copytree(base.sweep, tmp / name)
        if damage is not None:
            damage(tmp / name, rng)
    return prep


def first_run(damage: Damage) -> Damage:
    """Applies ``damage`` to the sweep's last run directory (after the first had a chance to be plotted)."""
    return lambda d, rng: damage(sorted(p for p in d.iterdir() if p.is_dir())[-1], rng)


def truncate(name: str, fraction: float) -> Damage:
    def damage(d: Path, rng: random.Random) -> None:
        data = (d / name).read_bytes()
        (d / name).write_bytes(data[:int(len(data) * fraction)])
    return damage


def replace_file(name: str, content: str | bytes | Callable[[bytes], bytes]) -> Damage:
    def damage(d: Path, rng: random.Random) -> None:
        path = d / name
        if callable(content):
            path.write_bytes(content(path.read_bytes()))
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    return damage


def random_bytes(name: str, n: int) -> Damage:
    return lambda d, rng: (d / name).write_bytes(bytes(rng.getrandbits(8) for _ in range(n)))


def flip_bit(name: str, *, in_header: bool) -> Damage:
    """Flips one random bit of checkpoint.pt: in the payload after the header line, or in the digest."""
    def damage(d: Path, rng: random.Random) -> None:
        data = bytearray((d / name).read_bytes())
        newline = data.index(b"\n")
        lo, hi = (newline - 64, newline) if in_header else (newline + 1, len(data))
        pos = rng.randrange(lo, hi)
        data[pos] ^= 1 << rng.randrange(8) if not in_header else 0x01
        (d / name).write_bytes(bytes(data))
    return damage


def signed_checkpoint(blob: Callable[[Path], Any]) -> Damage:
    """A checkpoint with a valid header and checksum around ``blob(run_dir)`` (a foreign or edited content)."""
    def damage(d: Path, rng: random.Random) -> None:
        import hashlib

        import torch

        buf = io.BytesIO()
        torch.save(blob(d), buf)
        payload = buf.getvalue()
        (d / "checkpoint.pt").write_bytes(b"shaky checkpoint 1 sha256=" + hashlib.sha256(payload).hexdigest().encode()
                                          + b"\n" + payload)
    return damage


def edited_checkpoint(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], Any]:
    def blob(d: Path) -> Any:
        from shaky.rundir import load_checkpoint

        ckpt = load_checkpoint(d)
        edit(ckpt)
        return ckpt
    return blob


def edit_toml(name: str, edit: Callable[[dict[str, Any]], None]) -> Damage:
    def damage(d: Path, rng: random.Random) -> None:
        import tomllib

        doc = tomllib.loads((d / name).read_text())
        edit(doc)
        (d / name).write_text(tomli_w.dumps(doc))
    return damage


def edit_json(name: str, edit: Callable[[Any], Any]) -> Damage:
    def damage(d: Path, rng: random.Random) -> None:
        (d / name).write_text(json.dumps(edit(json.loads((d / name).read_text()))))
    return damage


def remove(name: str) -> Damage:
    def damage(d: Path, rng: random.Random) -> None:
        p = d / name
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    return damage


def as_directory(name: str) -> Damage:
    def damage(d: Path, rng: random.Random) -> None:
        (d / name).unlink()
        (d / name).mkdir()
    return damage


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        *parents, leaf = key.split(".")
        node = doc
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return edit


# ---------------------------------------------------------------------------------------------------------------
# The cases


TEXT_OK = "".join(f"{'pos' if i % 2 else 'neg'}\tsome words here {i}\n" for i in range(40))
IRIS2 = ["--dataset", "iris", "--model", "logreg", "--workers", "2"]
# Values argparse or the config refuse for each CLI flag of `shaky train` (every one of them bad for that flag).
_BAD_INT = ["abc", "1.5", "nan", "inf", "1e3", ""]
FLAG_VALUES: dict[str, list[str]] = {
    "workers": ["0", "-1", "99999999999999999999", "500"] + _BAD_INT,
    "steps": ["0", "-5", "1000000000000000", "10000000001"] + _BAD_INT,
    "batch_size": ["0", "-1", "5000", "2.5", "x"],
    "seed": ["-1", "4294967296", "1e9", "s"],
    "eval_every": ["0", "-1", "e"],
    "checkpoint_every": ["-1", "x", "0.5"],
    "drop_rate": ["-0.1", "1", "1.5", "nan", "inf", "-inf", "x", "1e400"],
    "lr": ["0", "-0.1", "nan", "inf", "1e300", "1e400", "x"],
    "momentum": ["-0.5", "1", "nan", "inf", "m"],
    "strategy": ["bogus", "", "RPS", "rps "],
    "preset": ["bogus", "LAN"],
    "dataset": ["bogus", "", "mnist", "Digits"],
    "partition": ["bogus", ""],
    "model": ["bogus", "", "resnet21", "lstm"],
    "backend": ["bogus", "", "dist"],
    "data_path": ["x.tsv", "nope"],
    "replay_trace": ["nope", "emptydir"],
    "value_dtype": ["int4", "INT8", "float8", " int8", "bfloat 16"],
    "transport": ["bogus", "", "UDP", "udp"],
    "deadline_ms": ["0", "-1", "nan", "inf", "x", "1e400", "fast"],
    "key_file": ["nope", "key"],
    "device": ["gpu", "", "CUDA", "cuda:", "cuda:-1", "cuda:9999", "cpu "],
}

# --set keys and values that are bad for them (TOML values, as typed after KEY=).
_WRONG_NUMBER = ['"abc"', "true", "[1, 2]", "{x = 1}"]
SET_VALUES: dict[str, list[str]] = {
    "seed": ["-1", "4294967296", "1.5"],
    "num_workers": ["0", "-3", "1000000000000000000000000000000"],
    "steps": ["0", "-1", "10000000000", "1e3"],
    "batch_size": ["0", "1000000"],
    "eval_every": ["0"],
    "checkpoint_every": ["-1"],
    "dist_timeout_s": ["0", "inf", "nan", "1e308", "604801"],
    "target_accuracy": ["1.5", "-0.1", "nan"],
    "dtype": ['"float16"', "64"],
    "backend": ['"gloo"'],
    "data.max_len": ["0", "1000000"],
    "data.dirichlet_alpha": ["0", "-1", "inf", "nan"],
    "data.test_fraction": ["0", "1", "-0.5", "0.9999"],
    "data.dataset": ['"bogus"', "7"],
    "data.partition": ['"sorted"'],
    "data.path": ["5", '"notes.txt"'],
    "model.name": ['"vgg"', '"lstm"'],
    "model.hidden": ["-1", "1000000000"],
    "optim.name": ['"adam"'],
    "optim.lr": ["0", "-1", "inf", "nan", "1e300"],
    "optim.momentum": ["1", "-0.1", "nan"],
    "optim.weight_decay": ["-1", "inf"],
    "optim.decay_factor": ["0", "2"],
    "optim.decay_steps": ["[0]", "[5, 3]", "3", '["a"]'],
    "optim.warmup_steps": ["-1"],
    "optim.beta1": ["0.5"],
    "optim.eps": ["0", "1e-12"],
    "strategy.name": ['"gossip"'],
    "strategy.period": ["0", "7"],
    "strategy.redundancy": ["0", "99"],
    "strategy.delay": ["0", "10000000"],
    "strategy.correction": ['"yes"', "1", "false"],
    "strategy.weighted": ['"no"', "0"],
    "strategy.outer_lr": ["0", "2.0"],
    "network.preset": ['"wan"', "3"],
    "network.drop_rate": ["-0.1", "1.0", "nan", "inf", "[[0.1]]", "[[0.1, 0.2], [0.3]]", '[["a"]]'],
    "network.latency_ms": ["-1", "inf", "nan"],
    "network.bandwidth_mbps": ["0", "-1", "inf"],
    "network.burst_enter": ["1.5", "nan"],
    "network.burst_exit": ["0", "2"],
    "network.burst_drop_rate": ["-1"],
    "network.retransmit_timeout_ms": ["-1", "inf"],
    "network.compute_ms": ["inf", "nan"],
    "network.wan_bandwidth_mbps": ["5.0", "0"],
    "network.regions": ['["mars"]', '["oregon", "oregon"]', '"oregon"'],
    "network.trace": ["5", '"nope"'],
    "batch_sizes": ["[1]", "[0, 0, 0, 0, 0, 0, 0, 0]", "5"],
    "dist.transport": ['"tcp"', "1"],
    "dist.deadline_ms": ["0", "-5", '"auto"', "true"],
    "dist.ports": ['"0-10"', '"70000"', '"100-50"', '"a-b"', "29600"],
    "dist.datagram_bytes": ["10", "70000"],
    "dist.send_rate_mbps": ["-1", "inf"],
    "dist.host": ['"127.0.0.1"'],
    "failures": ["[{worker = 9, step = 1}]", "[{worker = 0}]", "[{worker = 0, step = 1, bogus = 2}]", "[1]",
                 "[{worker = 0, step = 5, rejoin = 2}]", "[{worker = 0, step = 100000}]"],
}
_NUMERIC = [k for k in SET_VALUES if k.split(".")[-1] in (
    "seed", "num_workers", "steps", "batch_size", "dist_timeout_s", "max_len", "test_fraction", "hidden", "lr",
    "momentum", "period", "delay", "latency_ms", "bandwidth_mbps", "compute_ms", "burst_exit")]


def _sweep_doc(**changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "description": "fuzz base",
        "base": {"num_workers": 2, "steps": 4, "eval_every": 2, "batch_size": 8, "data": {"dataset": "iris"},
                 "model": {"name": "logreg"}, "network": {"compute_ms": 1.0}},
        "grid": {"seed": [0, 1]}}
    for key, value in changes.items():
        *parents, leaf = key.split("__")
        node = doc
        for part in parents:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return doc


def _cases() -> list[Case]:
    c = _Cases()

    # --- no or unknown command, unknown flags
    c.add("argv-empty", [])
    c.add("argv-command", ["bogus"])
    c.add("train-unknown-flag", ["train", "--bogus"])
    c.add("train-flag-without-value", ["train", "--steps"])
    c.add("train-positional", ["train", "extra"])

    # --- every `shaky train` flag with values bad for it
    for name, values in FLAG_VALUES.items():
        flag = "--" + name.replace("_", "-")
        for k, value in enumerate(values):
            preps: list[Prep] = []
            if name == "data_path":
                preps.append(write("x.tsv", TEXT_OK))
            if name == "replay_trace":
                preps.append(mkdir("emptydir"))
            c.add(f"train-flag-{name}-{k}", ["train", flag, value], *preps)
    c.add("train-data-path-cifar-missing", ["train", "--dataset", "cifar10", "--data-path", "nope"])
    c.add("train-data-path-cifar-file", ["train", "--dataset", "cifar10", "--data-path", "f"], write("f", "x"))
    c.add("train-data-path-cifar-empty", ["train", "--dataset", "cifar10", "--data-path", "d"], mkdir("d"))
    c.add("train-data-path-cifar-garbage", ["train", "--dataset", "cifar10", "--data-path", "d"],
          write("d/data_batch_1", b"\x80\x04garbage"), write("d/test_batch", b"nope"))
    text = ["train", "--dataset", "text", "--model", "lstm", "--data-path"]
    c.add("train-text-missing", [*text, "nope"])
    c.add("train-text-directory", [*text, "d"], mkdir("d"))
    c.add("train-text-binary", [*text, "t"], write("t", b"\xff\xfe\x00\x01" * 50))
    c.add("train-text-empty", [*text, "t"], write("t", ""))
    c.add("train-text-no-tab", [*text, "t"], write("t", "just words\nmore words\n"))
    c.add("train-text-one-line", [*text, "t"], write("t", "pos\tgood\n"))
    c.add("train-text-model-mlp", ["train", "--dataset", "text", "--data-path", "t"], write("t", TEXT_OK))
    c.add("train-text-model-cnn", ["train", "--dataset", "text", "--model", "cnn", "--data-path", "t"],
          write("t", TEXT_OK))
    c.add("train-wine-resnet", ["train", "--dataset", "wine", "--model", "resnet20"])
    c.add("train-text-max-len", [*text, "t", "--set", "data.max_len=100000"], write("t", TEXT_OK))

    # --- --replay-trace: a trace that does not fit, or is damaged
    c.add("trace-workers", ["train", "--replay-trace", "run"], run_copy())
    c.add("trace-rounds", ["train", *IRIS2, "--replay-trace", "run"], run_copy())
    c.add("trace-file-missing", ["train", *IRIS2, "--steps", "5", "--replay-trace", "run"], run_copy(remove("trace.npz")))
    for k, fraction in enumerate((0.0, 0.3, 0.9)):
        c.add(f"trace-truncated-{k}", ["train", *IRIS2, "--steps", "5", "--replay-trace", "run"],
              run_copy(truncate("trace.npz", fraction)))
    c.add("trace-random", ["train", *IRIS2, "--steps", "5", "--replay-trace", "run"],
          run_copy(random_bytes("trace.npz", 600)))
    c.add("trace-directory", ["train", *IRIS2, "--steps", "5", "--replay-trace", "run"],
          run_copy(as_directory("trace.npz")))

    def npz(**arrays: Any) -> Damage:
        def damage(d: Path, rng: random.Random) -> None:
            import numpy as np

            with open(d / "trace.npz", "wb") as f:
                np.savez(f, **{k: np.asarray(v) for k, v in arrays.items()})
        return damage

    import numpy as np
    u8 = np.zeros((30, 1), np.uint8)
    for k, arrays in enumerate([
        {"up": u8, "down": u8},                                          # no num_workers
        {"up": u8, "down": u8, "num_workers": "x"},
        {"up": u8, "down": u8, "num_workers": [2, 2]},
        {"up": u8, "down": np.zeros((30, 7), np.uint8), "num_workers": 2},
        {"up": np.zeros(30, np.float32), "down": u8, "num_workers": 2},
        {"up": u8, "down": np.zeros((3, 1), np.uint8), "num_workers": 2},
        {"up": np.zeros((30, 1), np.int64), "down": np.zeros((30, 1), np.int64), "num_workers": 2},
    ]):
        c.add(f"trace-layout-{k}", ["train", *IRIS2, "--steps", "5", "--replay-trace", "run"], run_copy(npz(**arrays)))

    # --- --config files
    c.add("config-missing", ["train", "--config", "nope.toml"])
    c.add("config-directory", ["train", "--config", "d"], mkdir("d"))
    c.add("config-not-utf8", ["train", "--config", "c.toml"], write("c.toml", b"\xff\xfesteps = 3\n"))
    for k, text in enumerate(["steps = = 3\n", "[network\n", "steps = 3\nsteps = 4\n", "x = [1, 2\n", "= 5\n",
                              "[a]\nb = 1\n[a]\nc = 2\n", 'steps = "unterminated\n', "steps = 3 4\n",
                              "\x00\x01\x02", "network = { drop_rate = 0.1\n"]):
        c.add(f"config-malformed-{k}", ["train", "--config", "c.toml"], write("c.toml", text))
    for k, text in enumerate(["stepz = 5\n", "[network]\ndrop_rat = 0.1\n", "[optim]\nlearning_rate = 0.1\n",
                              "[nonsense]\nx = 1\n", 'steps = "many"\n', "num_workers = 2.5\n", "network = 3\n",
                              "[optim]\nlr = true\n", "[[failures]]\nworker = 0\n", "[data]\ndataset = 5\n",
                              "[strategy]\nname = \"rps\"\nperiod = 4\n"]):
        c.add(f"config-bad-{k}", ["train", "--config", "c.toml"], write("c.toml", text))

    # --- --set: syntax, unknown keys, and a bad value for every setting
    for k, item in enumerate(["foo", "=3", "", "steps.x=1", "network=3", "nope=1", "network.nope=1",
                              "optim.lr.x=1", "data.=1", ".steps=1", "network..drop_rate=0.1"]):
        c.add(f"set-syntax-{k}", ["train", "--set", item])
    for key, values in SET_VALUES.items():
        for k, value in enumerate(values):
            c.add(f"set-{key}-{k}", ["train", "--set", f"{key}={value}"])
    for key in _NUMERIC:
        for k, value in enumerate(_WRONG_NUMBER):
            c.add(f"set-type-{key}-{k}", ["train", "--set", f"{key}={value}"])

    # --- --out
    c.add("out-below-file", ["train", "--steps", "2", "--out", "f/run"], write("f", "x"))
    c.add("out-not-empty", ["train", "--steps", "2", "--out", "d"], write("d/notes.txt", "keep"))
    c.add("out-unwritable", ["train", *IRIS2, "--steps", "2", "--out", "/proc/shaky-fuzz/run"])

    # --- --resume: extra flags, and damaged run directories
    c.add("resume-missing", ["train", "--resume", "nope"])
    c.add("resume-file", ["train", "--resume", "f"], write("f", "x"))
    c.add("resume-empty-dir", ["train", "--resume", "d"], mkdir("d"))
    for k, extra in enumerate([["--steps", "30"], ["--out", "x"], ["--set", "steps=30"], ["--config", "run/config.toml"]]):
        c.add(f"resume-extra-{k}", ["train", "--resume", "run", *extra], run_copy())
    resume = ["train", "--resume", "run", "--quiet"]
    damaged: list[tuple[str, Damage]] = [
        ("ckpt-truncated-half", truncate("checkpoint.pt", 0.5)),
        ("ckpt-truncated-header", truncate("checkpoint.pt", 0.02)),
        ("ckpt-empty", truncate("checkpoint.pt", 0.0)),
        ("ckpt-random", random_bytes("checkpoint.pt", 2000)),
        ("ckpt-bitflip-payload", flip_bit("checkpoint.pt", in_header=False)),
        ("ckpt-bitflip-digest", flip_bit("checkpoint.pt", in_header=True)),
        ("ckpt-foreign-torch", lambda d, rng: __import__("torch").save({"a": 1}, d / "checkpoint.pt")),
        ("ckpt-foreign-text", replace_file("checkpoint.pt", "shaky checkpoint 1 sha256=abc\nhello")),
        ("ckpt-signed-list", signed_checkpoint(lambda d: [1, 2, 3])),
        ("ckpt-signed-no-config", signed_checkpoint(edited_checkpoint(lambda c: c.pop("config")))),
        ("ckpt-signed-other-config", signed_checkpoint(edited_checkpoint(_set("config.num_workers", 4)))),
        ("ckpt-signed-garbage-pickle", signed_checkpoint(lambda d: {"params": 1, "state": 2, "counters": 3,
                                                                     "config": 4})),
        ("ckpt-directory", as_directory("checkpoint.pt")),
        ("config-edited-steps", edit_toml("config.toml", _set("steps", 30))),
        ("config-edited-drop", edit_toml("config.toml", _set("network.drop_rate", 0.1))),
        ("config-unknown-key", edit_toml("config.toml", _set("network.bogus", 1))),
        ("config-bad-value", edit_toml("config.toml", _set("network.drop_rate", 2.0))),
        ("config-malformed", replace_file("config.toml", "steps = = 1\n")),
        ("config-emptied", replace_file("config.toml", "")),
        ("config-not-utf8", replace_file("config.toml", b"\xff\xfe\x00")),
        ("config-removed", remove("config.toml")),
        ("config-directory", as_directory("config.toml")),
        ("metrics-garbage-line", replace_file("metrics.jsonl", lambda b: b"garbage\n" + b)),
        ("metrics-emptied", replace_file("metrics.jsonl", "")),
        ("metrics-torn-final-row", truncate("metrics.jsonl", 0.9)),
        ("metrics-truncated-half", truncate("metrics.jsonl", 0.5)),
        ("metrics-directory", as_directory("metrics.jsonl")),
    ]
    for name, damage in damaged:
        c.add(f"resume-{name}", resume, run_copy(damage))
    # Whole checkpoints (their checksums hold) that are not this run's, and inputs that switch half way.
    import torch

    foreign: list[tuple[str, Damage]] = [
        ("ckpt-step-huge", signed_checkpoint(edited_checkpoint(_set("counters.step", 10**12)))),
        ("ckpt-step-negative", signed_checkpoint(edited_checkpoint(_set("counters.step", -3)))),
        ("ckpt-step-text", signed_checkpoint(edited_checkpoint(_set("counters.step", "ten")))),
        ("ckpt-params-shape", signed_checkpoint(edited_checkpoint(lambda c: c.update(params=c["params"][:, :-1])))),
        ("ckpt-params-rows", signed_checkpoint(edited_checkpoint(lambda c: c.update(params=c["params"][:1])))),
        ("ckpt-params-dtype", signed_checkpoint(edited_checkpoint(lambda c: c.update(params=c["params"].double() if c["params"].dtype == torch.float32 else c["params"].float())))),
        ("ckpt-params-list", signed_checkpoint(edited_checkpoint(_set("params", [1.0, 2.0])))),
        ("ckpt-params-huge-view", signed_checkpoint(edited_checkpoint(
            lambda c: c.update(params=torch.zeros(1).expand(2, 10**9))))),
        ("metrics-middle-row-lost", replace_file("metrics.jsonl", lambda b: b"".join(
            line for k, line in enumerate(b.splitlines(keepends=True)) if k != 1))),
        ("machines-other-data", edit_json("machines.json", lambda m: {
            **m, "0": {**m["0"], "inputs": {**m["0"]["inputs"], "data": "0" * 64}}})),
        ("machines-garbage", replace_file("machines.json", "{not json")),
    ]
    for name, damage in foreign:
        c.add(f"resume-{name}", resume, run_copy(damage))
    c.add("resume-replay-trace-switched-on", [*resume, "--replay-trace", "t.npz"],
          run_copy(lambda d, rng: shutil.copy(d / "trace.npz", d.parent / "t.npz")))

    # --- shaky sweep
    def sweep_file(doc: dict[str, Any] | str, name: str = "s.toml") -> Prep:
        return write(name, doc if isinstance(doc, str) else tomli_w.dumps(doc))

    c.add("sweep-no-file", ["sweep"])
    c.add("sweep-missing", ["sweep", "nope.toml"])
    c.add("sweep-directory", ["sweep", "d"], mkdir("d"))
    c.add("sweep-not-utf8", ["sweep", "s.toml"], write("s.toml", b"\xff\xfe["))
    for k, text in enumerate(["[grid\n", "grid = \n", "[grid]\nseed = [0, 1\n", "[base]\nsteps = 1\n[base]\n"]):
        c.add(f"sweep-malformed-{k}", ["sweep", "s.toml"], sweep_file(text))
    sweep_docs: list[dict[str, Any]] = [
        _sweep_doc(bogus=1), _sweep_doc(kind="bogus"), _sweep_doc(description=5), _sweep_doc(base=3),
        _sweep_doc(grid=None), _sweep_doc(grid=5), _sweep_doc(grid={}), _sweep_doc(grid={"bogus": [1]}),
        _sweep_doc(grid={"seed": 3}), _sweep_doc(grid={"seed": []}), _sweep_doc(grid={"steps": [0, 2]}),
        _sweep_doc(grid={"network.drop_rate": [0.0, 2.0]}), _sweep_doc(grid={"model.name": ["lstm"]}),
        _sweep_doc(grid={"seed": [0, 0]}), _sweep_doc(table=5), _sweep_doc(table=[1]),
        _sweep_doc(labels={"bogus": {"0": "x"}}), _sweep_doc(labels=3),
        _sweep_doc(claim=[{"id": "x"}]), _sweep_doc(claim=5),
        _sweep_doc(claim=[{"id": "c", "title": "t", "paper": "p", "ours": "{a}", "holds": ["a > 0"],
                           "values": {"a": {"where": {"seed": 7}}}}]),
        _sweep_doc(claim=[{"id": "c", "title": "t", "paper": "p", "ours": "{a}", "holds": ["__import__('os')"],
                           "values": {"a": {"where": {"seed": 0}}}}]),
        _sweep_doc(plot=[{"kind": "bogus"}]), _sweep_doc(plot=[{"kind": "final", "x": "bogus"}]),
        _sweep_doc(base__steps=-1), _sweep_doc(base__bogus=1), _sweep_doc(base__network__drop_rate=1.5),
        _sweep_doc(base__batch_size=5000), _sweep_doc(base__data__dataset="text"),
        _sweep_doc(base__network__trace="nope"), _sweep_doc(base__data__path="x.tsv"),
        _sweep_doc(base__optim__lr=float("nan")), _sweep_doc(kind="scale", grid={"scale.num_params": [0]}),
    ]
    for k, doc in enumerate(sweep_docs):
        c.add(f"sweep-doc-{k}", ["sweep", "s.toml", "--quiet"], sweep_file(doc))
    ok = sweep_file(_sweep_doc())
    for k, extra in enumerate([["--jobs", "0"], ["--jobs", "-1"], ["--jobs", "x"], ["--set", "steps=0"],
                               ["--set", "nope=1"], ["--set", "x"], ["--set", "seed=-1"], ["--out", "f/sweeps"],
                               ["--set", "batch_size=5000"], ["--set", "model.name=lstm"]]):
        c.add(f"sweep-flags-{k}", ["sweep", "s.toml", "--quiet", *extra], ok, write("f", "x"))
    c.add("sweep-same-name", ["sweep", "a/s.toml", "b/s.toml", "--quiet"], sweep_file(_sweep_doc(), "a/s.toml"),
          sweep_file(_sweep_doc(), "b/s.toml"))
    # A sweep continues only what is its own: a finished run's summary of its config, a checkpoint and metrics
    # that are the run's (the resume check of `shaky train --resume`).
    def other_seeds(name: str) -> Damage:
        return lambda d, rng: shutil.copy(d / "seed=1" / name, d / "seed=0" / name)

    def unfinished(damage: Damage) -> Damage:
        def both(d: Path, rng: random.Random) -> None:
            (d / "seed=0" / "summary.json").unlink()
            damage(d / "seed=0", rng)
        return both

    sweep_damage: list[tuple[str, Damage]] = [
        ("finished-other-summary", other_seeds("summary.json")),
        ("finished-summary-digest", lambda d, rng: edit_json("summary.json", lambda m: {
            **m, "config_sha256": "0" * 64})(d / "seed=0", rng)),
        ("finished-old-summary-other-seed", lambda d, rng: edit_json("summary.json", lambda m: {
            **{k: v for k, v in m.items() if k != "config_sha256"}, "seed": 1})(d / "seed=0", rng)),
        ("finished-summary-garbage", lambda d, rng: (d / "seed=0" / "summary.json").write_text("[1, 2")),
        ("resume-other-seed-ckpt", unfinished(lambda d, rng: shutil.copy(d.parent / "seed=1" / "checkpoint.pt",
                                                                          d / "checkpoint.pt"))),
        ("resume-metrics-middle-row-lost", unfinished(replace_file("metrics.jsonl", lambda b: b"".join(
            line for k, line in enumerate(b.splitlines(keepends=True)) if k != 1)))),
        ("resume-ckpt-bitflip", unfinished(flip_bit("checkpoint.pt", in_header=False))),
        ("resume-ckpt-step-huge", unfinished(signed_checkpoint(edited_checkpoint(_set("counters.step", 10**12))))),
        ("resume-ckpt-params-shape", unfinished(signed_checkpoint(edited_checkpoint(
            lambda c: c.update(params=c["params"][:, :-1]))))),
        ("resume-other-data", unfinished(edit_json("machines.json", lambda m: {
            **m, "0": {**m["0"], "inputs": {**m["0"]["inputs"], "data": "0" * 64}}}))),
    ]
    for name, damage in sweep_damage:
        c.add(f"sweep-{name}", ["sweep", "s.toml", "--quiet", "--out", "sweeps"], sweep_file(_sweep_doc(), "s.toml"),
              lambda tmp, base, rng, damage=damage: (shutil.copytree(base.sweep, tmp / "sweeps" / "s"),
                                                     damage(tmp / "sweeps" / "s", rng)))

    # --- shaky report
    c.add("report-no-dir", ["report"])
    c.add("report-missing", ["report", "nope"])
    c.add("report-file", ["report", "f"], write("f", "x"))
    c.add("report-empty-dir", ["report", "d"], mkdir("d"))
    c.add("report-unrelated-dir", ["report", "d"], write("d/notes.txt", "x"), mkdir("d/sub"))
    run_damage: list[tuple[str, Damage]] = [
        ("metrics-missing", remove("metrics.jsonl")),
        ("metrics-garbage", replace_file("metrics.jsonl", "garbage\n")),
        ("metrics-row-list", replace_file("metrics.jsonl", "[1, 2]\n")),
        ("metrics-row-keys", replace_file("metrics.jsonl", '{"step": 0}\n')),
        ("metrics-row-type", edit_lines("test_accuracy", "high")),
        ("metrics-directory", as_directory("metrics.jsonl")),
        ("metrics-not-utf8", replace_file("metrics.jsonl", b"\xff\xfe\n")),
        ("summary-truncated", truncate("summary.json", 0.5)),
        ("summary-list", replace_file("summary.json", "[1, 2]")),
        ("summary-empty-object", replace_file("summary.json", "{}")),
        ("summary-type", edit_json("summary.json", lambda s: {**s, "final_test_accuracy": "high"})),
        ("summary-bool", edit_json("summary.json", lambda s: {**s, "bytes_sent": True})),
        ("summary-missing-key", edit_json("summary.json", lambda s: {k: v for k, v in s.items() if k != "sim_time_s"})),
        ("summary-not-utf8", replace_file("summary.json", b"\xff\xfe{}")),
        ("summary-random", random_bytes("summary.json", 300)),
    ]
    for name, damage in run_damage:
        c.add(f"report-run-{name}", ["report", "run", "--out", "rep"], run_copy(damage))
        c.add(f"report-sweep-{name}", ["report", "sw", "--out", "rep"], sweep_copy(first_run(damage)))
    c.add("report-two-runs-one-bad", ["report", "run", "bad", "--out", "rep"], run_copy(),
          run_copy(remove("metrics.jsonl"), name="bad"))
    for k, text in enumerate(["[grid\n", "bogus = 1\n", "", "grid = 5\n"]):
        c.add(f"report-sweep-file-{k}", ["report", "sw", "--out", "rep"], sweep_copy(replace_file("sweep.toml", text)))
    c.add("report-out-below-file", ["report", "run", "--out", "f/rep"], run_copy(), write("f", "x"))
    c.add("report-out-unwritable", ["report", "run", "--out", "/proc/shaky-fuzz/rep"], run_copy())
    c.add("report-reproduction-dir", ["report", "sw", "--out", "rep", "--reproduction", "d"], sweep_copy(), mkdir("d"))
    c.add("report-reproduction-below-file", ["report", "sw", "--out", "rep", "--reproduction", "f/R.md"],
          sweep_copy(), write("f", "x"))
    c.add("report-reproduction-plain-run", ["report", "run", "--out", "rep", "--reproduction", "R.md"], run_copy())
    c.add("report-reproduction-unwritable", ["report", "sw", "--out", "rep", "--reproduction", "/proc/x/R.md"],
          sweep_copy())

    # --- shaky scale
    scale_flags: dict[str, list[str]] = {
        "--workers": ["0", "-1", "1000", "abc", "2.5"],
        "--worker-counts": ["0", "4,x", "", "4,,8", "-4", "100000"],
        "--latencies-ms": ["-1", "nan", "inf", "x", "0,,1"],
        "--params": ["0", "-1", "nan", "inf", "1e30", "x"],
        "--compute-ms": ["0", "-1", "nan", "inf", "1e-9", "x"],
        "--delay": ["0", "-1", "1000000", "1.5"],
        "--period": ["0", "-2", "1000000"],
        "--preset": ["bogus", "GEO4"],
        "--set": ["network.latency_ms=-1", "optim.lr=0.1", "x", "network.bogus=1", "network.regions=[\"mars\"]",
                  "network.bandwidth_mbps=0", "network.wan_bandwidth_mbps=nan"],
        "--out": ["s.txt", "plots", "d", "f/s.png", "/proc/shaky-fuzz/s.png", "f/x/s.png"],
        "--config": ["nope.toml", "d", "bad.toml", "workers.toml", "net.toml", "utf.toml"],
    }
    scale_inputs = [mkdir("d"), write("f", "x"), write("bad.toml", "[network\n"),
                    write("workers.toml", 'num_workers = "x"\n'), write("net.toml", "[network]\nlatency_ms = -3\n"),
                    write("utf.toml", b"\xff\xfe")]
    for flag, values in scale_flags.items():
        for k, value in enumerate(values):
            c.add(f"scale{flag}-{k}", ["scale", "--latencies-ms", "0", "--worker-counts", "4", flag, value]
                  if flag not in ("--latencies-ms", "--worker-counts") else ["scale", flag, value], *scale_inputs)
    c.add("scale-md-is-dir", ["scale", "--latencies-ms", "0", "--worker-counts", "4", "--out", "p.png"], mkdir("p.md"))

    # --- shaky demo
    for k, extra in enumerate([["--steps", "0"], ["--steps", "-1"], ["--steps", "x"], ["--steps", "10000000000"],
                               ["--out", "f"], ["--out", "f/demo"], ["--out", "/proc/shaky-fuzz/demo"]]):
        c.add(f"demo-{k}", ["demo", "--quiet", *extra], write("f", "x"))
    return c.items


def edit_lines(key: str, value: Any) -> Damage:
    """Sets ``key`` in every metrics.jsonl row."""
    def damage(d: Path, rng: random.Random) -> None:
        rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        (d / "metrics.jsonl").write_text("".join(json.dumps({**r, key: value}) + "\n" for r in rows))
    return damage


CASES = _cases()


# ---------------------------------------------------------------------------------------------------------------
# Running them


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Base:
    """One tiny real run and one tiny sweep, made in-process once for every case."""
    root = tmp_path_factory.mktemp("fuzz-base")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        mp.setenv("SHAKY_CACHE_DIR", str(root / "cache"))
        assert main(["train", "--steps", "20", "--workers", "2", "--dataset", "iris", "--model", "logreg",
                     "--checkpoint-every", "10", "--quiet", "--out", "run", "--set", "network.compute_ms=1"]) == 0
        (root / "tiny.toml").write_text(tomli_w.dumps(_sweep_doc()))
        assert main(["sweep", "tiny.toml", "--jobs", "1", "--quiet", "--out", "sweeps"]) == 0
    return Base(root / "run", root / "sweeps" / "tiny")


def _tree(root: Path) -> dict[str, bytes | str | None]:
    """Every path under ``root`` with its bytes (None: a directory; a FIFO, which reading would block on, by kind)."""
    return {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes() if p.is_file() else "not a file")
            for p in sorted(root.rglob("*"))}


def _params() -> list[Any]:
    return [pytest.param(case, id=case.id) for case in CASES]


@pytest.mark.parametrize("case", _params())
def test_bad_input_is_one_line_and_writes_nothing(case: Case, base: Base, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    cwd = tmp_path / "case"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("SHAKY_CACHE_DIR", str(tmp_path / "cache"))  # outside the tree compared below
    rng = random.Random(f"{SEED}-{case.id}")
    for prep in case.preps:
        prep(cwd, base, rng)
    before = _tree(cwd)
    import resource

    limits = _limit_memory()
    try:
        rc = main(case.argv)
    except SystemExit as exc:  # argparse
        rc = exc.code
    finally:
        resource.setrlimit(resource.RLIMIT_AS, limits)
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "Traceback" not in out, err
    assert rc == 2, (rc, err[-2000:])
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("shaky: error: "), err
    assert out == "", out
    assert _tree(cwd) == before, "bad input changed the file system"


def test_enough_cases() -> None:
    assert len(CASES) >= 300
    assert len({c.id for c in CASES}) == len(CASES)
    flags = {name for name in _FLAGS}
    assert flags <= set(FLAG_VALUES), flags - set(FLAG_VALUES)  # every train flag is fuzzed
    commands = {c.argv[0] for c in CASES if c.argv}
    assert {"train", "sweep", "report", "scale", "demo"} <= commands


# A few as real processes: exit status, stderr and the file system as a user sees them.
SUBPROCESS_CASES = {
    "train-text-mlp": (["train", "--dataset", "text", "--data-path", "t.tsv", "--model", "mlp"],
                       [write("t.tsv", TEXT_OK)]),
    "report-no-metrics": (["report", "run", "--out", "rep"], [run_copy(remove("metrics.jsonl"))]),
    "scale-out-txt": (["scale", "--out", "s.txt"], []),
    "resume-bitflip": (["train", "--resume", "run", "--quiet"], [run_copy(flip_bit("checkpoint.pt", in_header=False))]),
    # Key files are read by the ranks of a udp run: two of them, started by shaky launch.
    **{f"launch-key-{name}": (["launch", "--nproc", "2", "train", "--backend", "dist", "--transport", "udp",
                               "--key-file", key, *IRIS2, "--steps", "2", "--quiet", "--out", "run"], preps)
       for name, key, preps in [("device", "/dev/zero", []), ("fifo", "fifo", [lambda tmp, base, rng: os.mkfifo(tmp / "fifo")]),
                                ("large", "big.key", [write("big.key", b"k" * 70_000)]),
                                ("directory", "keys", [mkdir("keys")])]},
}

MEMORY_LIMIT = 2 << 30
"""Bytes of address space a case may add (RLIMIT_AS): bad input that sizes an allocation (a step of 10**12, a
key file on /dev/zero) fails the case instead of taking the machine's memory."""


def _limit_memory(extra: int = MEMORY_LIMIT) -> tuple[int, int]:
    """Lowers this process's soft RLIMIT_AS to its size now plus ``extra``; returns the limits to restore."""
    import resource

    old = resource.getrlimit(resource.RLIMIT_AS)
    size = int(next(line.split()[1] for line in Path("/proc/self/status").read_text().splitlines()
                    if line.startswith("VmSize:"))) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (size + extra, old[1]))
    return old


def _limit_child_memory() -> None:
    """``preexec_fn``: a started process may use 4 GiB of address space (torch's libraries take about 1)."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, resource.getrlimit(resource.RLIMIT_AS)[1]))


@pytest.mark.kill  # slow, multi-process: make test-kill (.ci/run runs it)
def test_end_to_end_in_processes(base: Base, tmp_path: Path) -> None:
    """The same contract in real processes (started together: each pays for importing torch)."""
    env = {**os.environ, "SHAKY_CACHE_DIR": str(tmp_path / "cache")}
    procs = {}
    for name, (argv, preps) in SUBPROCESS_CASES.items():
        cwd = tmp_path / name
        cwd.mkdir()
        for prep in preps:
            prep(cwd, base, random.Random(f"{SEED}-{name}"))
        procs[name] = (cwd, _tree(cwd), subprocess.Popen([sys.executable, "-m", "shaky", *argv], cwd=cwd, env=env,
                                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                                        preexec_fn=_limit_child_memory))
    for name, (cwd, before, proc) in procs.items():
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 2, (name, proc.returncode, err)
        assert "Traceback" not in err, (name, err)
        assert len(err.splitlines()) == 1 and err.startswith("shaky: error: "), (name, err)
        assert out == "", (name, out)
        assert _tree(cwd) == before, name


def test_cases_are_deterministic() -> None:
    """The same seed builds the same damage: two runs of a case see the same bytes."""
    a, b = random.Random(f"{SEED}-x"), random.Random(f"{SEED}-x")
    assert [a.getrandbits(8) for _ in range(32)] == [b.getrandbits(8) for _ in range(32)]
    assert [c.id for c in _cases()] == [c.id for c in CASES]
