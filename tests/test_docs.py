"""The README, ``shaky ... --help`` and the code say the same thing (issue 13: the docs must not drift).

Every name is read from the code (the config dataclasses, the strategy registry, the network presets,
the data sets, partitions and models, the argparse parsers, the demo's runs, the experiment grids)
and looked for in README.md and in the help text. A setting, flag, strategy or preset added without
its documentation fails here, and so does a list of valid values in the docs that the code no longer
accepts (or no longer lists everything the code accepts).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import tomllib
import typing
from pathlib import Path

import pytest

from shaky.cli import _FLAGS, DEMO_RUNS, _parser
from shaky.config import BACKENDS, DTYPES, OPTIMIZERS, RunConfig, config_from_dict, parse_value
from shaky.data import DATASETS, PARTITIONS
from shaky.models import MODELS
from shaky.network.presets import PRESETS
from shaky.strategies import REGISTRY
from shaky.sweep import ScaleConfig, load_sweep, parse_sweep

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
TOML_BLOCKS = re.findall(r"^```toml\n(.*?)^```", README, flags=re.MULTILINE | re.DOTALL)
CONFIG_BLOCK = next(b for b in TOML_BLOCKS if "[strategy]" in b and "[grid]" not in b)
"""The README's example config file (the one with every table)."""

CHOICES: dict[str, tuple[str, ...]] = {
    "data.dataset": DATASETS, "data.partition": PARTITIONS, "model.name": MODELS, "optim.name": OPTIMIZERS,
    "strategy.name": tuple(REGISTRY), "network.preset": tuple(PRESETS), "backend": BACKENDS, "dtype": DTYPES,
}
"""Every setting with a closed set of valid values, and the code's own list of them."""


def _settings(cls: type, prefix: str = "") -> list[str]:
    """The dotted name of every field of a config dataclass, nested tables and [[arrays]] walked."""
    names = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if typing.get_origin(tp) is tuple and dataclasses.is_dataclass(typing.get_args(tp)[0]):
            tp = typing.get_args(tp)[0]  # failures: tuple[FailureConfig, ...]
        if dataclasses.is_dataclass(tp):
            names += _settings(tp, f"{prefix}{f.name}.")
        else:
            names.append(f"{prefix}{f.name}")
    return names


SETTINGS = _settings(RunConfig) + _settings(ScaleConfig, "scale.")


def _toml_keys(block: str) -> dict[str, str]:
    """Dotted key -> its line, for every ``key = ...`` in a TOML block, commented-out ones included."""
    keys, table = {}, ""
    for line in block.splitlines():
        header = re.fullmatch(r"\s*\[\[?([\w.]+)\]\]?\s*(#.*)?", line)
        if header:
            table = header.group(1) + "."
            continue
        for key in re.findall(r"(?:^|[#,]\s*)(\w+)\s*=", line):
            keys.setdefault(table + key, line)
    return keys


def _readme_names() -> set[str]:
    """Every setting name the README mentions: dotted names, `backticked` names and TOML keys."""
    names = set(re.findall(r"\b[a-z_]+(?:\.[a-z_0-9]+)+\b", README))
    names |= set(re.findall(r"`([a-z_][a-z_0-9.]*)(?: = [^`]*)?`", README))
    for block in TOML_BLOCKS:
        names |= set(_toml_keys(block))
    return names


def _listed(text: str) -> set[str]:
    """The values a list such as ``iid, dirichlet or label-skew`` names (``x (why)`` counts as x)."""
    text = re.sub(r"\([^)]*\)", "", text)
    return {w for w in re.split(r"[,\s]+", text) if w and w not in ("or", "and")}


def _help_list(text: str) -> set[str]:
    """The values a flag's help lists, after its ``label:`` if it has one (``network preset: lan, ...``)."""
    return _listed(re.sub(r"\([^)]*\)", "", text).rpartition(":")[2])


def _readme_list(setting: str) -> set[str]:
    """The values the README's example config lists in the comment beside ``setting``, up to a ``:`` or ``;``."""
    line = _toml_keys(CONFIG_BLOCK).get(setting)
    assert line is not None and "#" in line, f"README's example config has no commented line for {setting}"
    return _listed(re.split(r"[:;]", line.rpartition("#")[2])[0])


def _default(setting: str, cfg: object | None = None) -> object:
    """The value of a dotted setting in ``cfg``; by default the code's default."""
    node: object = cfg or (ScaleConfig() if setting.startswith("scale.") else RunConfig())
    for part in setting.removeprefix("scale.").split("."):
        node = getattr(node, part)
    return node


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _help_text(command: str, capsys: pytest.CaptureFixture[str]) -> str:
    """What ``shaky COMMAND --help`` prints."""
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args([command, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def _flag_in(flag: str, text: str) -> bool:
    return re.search(re.escape(flag) + r"(?![\w-])", text) is not None


@pytest.fixture(autouse=True)
def _wide_help(monkeypatch: pytest.MonkeyPatch) -> None:
    # argparse wraps help at the terminal's width and breaks words at hyphens ("lossy-\nallreduce").
    monkeypatch.setenv("COLUMNS", "1000")


def test_every_setting_is_in_the_readme() -> None:
    names = _readme_names()
    missing = [s for s in SETTINGS if s not in names]
    assert not missing, f"settings the README never mentions: {missing}"


def test_the_readme_example_config_is_the_defaults() -> None:
    """The example config file shows every default (commented-out lines show other values), so a changed
    default, a renamed setting or a stale value in it fails here."""
    example = config_from_dict(tomllib.loads(CONFIG_BLOCK))
    differ = [(s, _default(s, example), _default(s)) for s in SETTINGS
              if not s.startswith(("scale.", "failures.")) and _default(s, example) != _default(s)]
    assert not differ, f"README's example config (setting, README, code's default): {differ}"


def test_the_readme_examples_are_valid() -> None:
    """Every TOML block in the README loads: a sweep file as a sweep, anything else as a run config."""
    assert len(TOML_BLOCKS) >= 3
    for block in TOML_BLOCKS:
        doc = tomllib.loads(block)
        if "grid" in doc:
            assert parse_sweep(doc, "readme", "README.md").points
        else:
            config_from_dict(doc)


def test_every_command_is_in_the_readme() -> None:
    missing = [c for c in _subcommands() if f"shaky {c}" not in README]
    assert not missing, f"commands the README never shows: {missing}"


def test_every_flag_has_help_in_its_command_help(capsys: pytest.CaptureFixture[str]) -> None:
    top_help = _parser().format_help()
    for command, parser in _subcommands().items():
        text = _help_text(command, capsys)
        assert re.search(rf"^\s+{command}\s+\S", top_help, flags=re.MULTILINE), f"{command} has no help line"
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            name = action.option_strings[0] if action.option_strings else action.metavar or action.dest
            assert action.help and action.help.strip() and action.help != argparse.SUPPRESS, \
                f"shaky {command} {name} has no help text"
            assert all(_flag_in(o, text) for o in action.option_strings), f"{name} missing from {command} --help"
            assert " ".join(action.help.split()) in " ".join(text.split()), f"{name}'s help is not in --help"


def test_every_train_flag_is_in_the_readme_list() -> None:
    """The README's "Flags: ..." paragraph (Training) names every flag of ``shaky train``."""
    listed = README.split("\nFlags: ", 1)[1].split("\n\n", 1)[0]
    flags = [o for a in _subcommands()["train"]._actions for o in a.option_strings if o.startswith("--")]
    missing = [f for f in flags if f != "--help" and not _flag_in(f, listed)]
    assert not missing, f"shaky train flags missing from the README's list of flags: {missing}"


def test_each_train_flag_names_a_real_setting(capsys: pytest.CaptureFixture[str]) -> None:
    text = " ".join(_help_text("train", capsys).split())
    for name, (key, _, _) in _FLAGS.items():
        assert key in SETTINGS, f"--{name} sets {key}, which is not a setting"
        assert f"({key})" in text, f"--{name}'s help does not name its setting {key}"


def test_every_strategy_and_preset_is_documented() -> None:
    strategies = README.split("\n## Strategies\n", 1)[1].split("\n## ", 1)[0]
    for name in REGISTRY:
        assert re.search(rf"^- `{re.escape(name)}`", strategies, flags=re.MULTILINE), \
            f"strategy {name} has no entry in the README's Strategies section"
    network = README.split("\n## The network and the clock\n", 1)[1].split("\n## ", 1)[0]
    for name in PRESETS:
        assert f"`{name}`" in network, f"preset {name} is not described in the README's network section"


def test_defaults_named_in_help_are_the_real_defaults() -> None:
    """A flag's help that says ``default X`` is right: the config's default for a train flag, else argparse's."""
    checked = 0
    for command, parser in _subcommands().items():
        for action in parser._actions:
            said = re.search(r"\bdefault ([^\s;,)]+)", action.help or "")
            if said is None:
                continue
            flag = action.dest if command == "train" else None
            actual = _default(_FLAGS[flag][0]) if flag in _FLAGS else action.default
            if actual is None:  # worked out when the command runs (scale --workers)
                continue
            assert parse_value(said.group(1)) == actual, f"shaky {command} {action.option_strings}: " \
                f"help says default {said.group(1)}, the code's is {actual!r}"
            checked += 1
    assert checked >= 10


@pytest.mark.parametrize("flag", ["strategy", "preset", "dataset", "partition", "model", "backend"])
def test_train_help_lists_exactly_the_valid_values(flag: str) -> None:
    key, _, text = _FLAGS[flag]
    assert _help_list(text) == set(CHOICES[key]), f"--{flag}'s help: {text!r}; the code accepts {CHOICES[key]}"


def test_scale_preset_help_lists_the_presets() -> None:
    action = next(a for a in _subcommands()["scale"]._actions if "--preset" in a.option_strings)
    assert _help_list(action.help) == set(PRESETS), action.help


@pytest.mark.parametrize("setting", sorted(CHOICES))
def test_readme_config_lists_exactly_the_valid_values(setting: str) -> None:
    listed = _readme_list(setting)
    assert listed == set(CHOICES[setting]), f"README's example config lists {sorted(listed)} for {setting}; " \
        f"the code accepts {CHOICES[setting]}"


def test_demo_help_and_readme_name_every_demo_run() -> None:
    action = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    help_text = next(a.help for a in action._choices_actions if a.dest == "demo")
    demo = README.split("`make demo`", 1)[1].split("\n\n", 1)[0]
    assert f"{len(DEMO_RUNS)} runs" in help_text, help_text
    for _, strategy, drop in DEMO_RUNS:
        for where, text in (("shaky demo's help", help_text), ("README's make demo paragraph", demo)):
            text = " ".join(text.split())
            assert re.search(rf"(?<![\w-]){re.escape(strategy)}(?![\w-])", text), f"{where} omits {strategy}"
            assert re.search(rf"drop {re.escape(f'{drop:g}')}(?![\d.])", text), f"{where} omits drop {drop:g}"


def test_readme_run_counts_match_the_grids() -> None:
    """Every "N runs" the README gives for experiments/ is what shaky sweep would run."""
    counts = {p.stem: len(load_sweep(p).points) for p in sorted((ROOT / "experiments").glob("*.toml"))}
    claims = re.findall(r"experiments/([\w*]+)\.toml`?\s+[#(]\s*(\d+) runs", " ".join(README.split()))
    assert any(name == "*" for name, _ in claims), "README no longer counts the runs of experiments/*.toml"
    for name, n in claims:
        expected = sum(counts.values()) if name == "*" else counts[name]
        assert int(n) == expected, f"README: experiments/{name}.toml has {n} runs; its grid has {expected}"
