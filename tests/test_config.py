"""Tests for shaky.config: defaults, TOML round trips, presets, strict keys and types, range checks."""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
from typing import Any

import pytest

from shaky.config import (
    DataConfig,
    NetworkConfig,
    OptimConfig,
    RunConfig,
    config_from_dict,
    load_toml,
    parse_value,
    replace,
    set_dotted,
    to_dict,
    to_toml,
)
from shaky.network.presets import PRESETS


def _from(key: str, value: Any, **extra: Any) -> RunConfig:
    values: dict[str, Any] = dict(extra)
    set_dotted(values, key, value)
    return config_from_dict(values)


def _round_trip(cfg: RunConfig) -> RunConfig:
    return config_from_dict(tomllib.loads(to_toml(cfg)))


# ---------------------------------------------------------------------------
# Defaults and round trips


def test_default_config_is_valid() -> None:
    cfg = RunConfig()
    assert cfg == config_from_dict({})
    assert (cfg.num_workers, cfg.steps, cfg.backend, cfg.dtype) == (8, 600, "sim", "float32")
    assert (cfg.data.dataset, cfg.model.name, cfg.strategy.name) == ("digits", "mlp", "rps")
    assert cfg.network.drop_rate == 0.0 and cfg.network.preset == ""
    assert cfg.optim.decay_steps == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.steps = 5  # type: ignore[misc]


ROUND_TRIP_CASES: dict[str, dict[str, Any]] = {
    "default": {},
    "scalars": {"seed": 7, "num_workers": 3, "steps": 11, "batch_size": 5, "eval_every": 2, "checkpoint_every": 4,
                "dtype": "float64", "data": {"dataset": "iris", "partition": "dirichlet", "dirichlet_alpha": 0.3,
                                             "test_fraction": 0.25, "max_len": 9},
                "model": {"name": "logreg", "hidden": 16},
                "optim": {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4, "warmup_steps": 3,
                          "decay_steps": [5, 8], "decay_factor": 0.5},
                "strategy": {"name": "lossy-allreduce"},
                "network": {"latency_ms": 2.5, "bandwidth_mbps": 100, "burst_enter": 0.01, "burst_exit": 0.2,
                            "burst_drop_rate": 0.9, "retransmit_timeout_ms": 50.0, "compute_ms": 3.0}},
    "drop-matrix": {"num_workers": 3,
                    "network": {"drop_rate": [[0.0, 0.1, 0.2], [0.3, 0.0, 0.5], [0.25, 0.125, 0.0]],
                                "latency_ms": [[0, 1, 2], [1, 0, 1], [2, 1, 0]]}},
    "preset": {"network": {"preset": "lossy"}},
    "preset-and-matrix": {"num_workers": 2, "network": {"preset": "lossy", "drop_rate": [[0.0, 0.4], [0.2, 0.0]]}},
    "text": {"data": {"dataset": "text", "path": "/data/sentences.tsv"}, "model": {"name": "lstm"}},
}


@pytest.mark.parametrize("values", ROUND_TRIP_CASES.values(), ids=ROUND_TRIP_CASES.keys())
def test_toml_round_trip(values: dict[str, Any]) -> None:
    cfg = config_from_dict(values)
    text = to_toml(cfg)
    back = config_from_dict(tomllib.loads(text))
    assert back == cfg
    assert to_toml(back) == text  # stable: a resumed run writes the same file


def test_round_trip_keeps_matrix_values(tmp_path) -> None:
    cfg = config_from_dict(ROUND_TRIP_CASES["drop-matrix"])
    assert cfg.network.drop_rate == ((0.0, 0.1, 0.2), (0.3, 0.0, 0.5), (0.25, 0.125, 0.0))
    assert all(isinstance(v, float) for row in cfg.network.latency_ms for v in row)
    (tmp_path / "c.toml").write_text(to_toml(cfg))
    loaded = load_toml(tmp_path / "c.toml")
    assert loaded["network"]["drop_rate"][1] == [0.3, 0.0, 0.5]
    assert config_from_dict(loaded) == cfg


def test_to_dict_is_plain() -> None:
    cfg = config_from_dict({"optim": {"decay_steps": [3]}, "num_workers": 2,
                            "network": {"drop_rate": [[0.0, 0.1], [0.1, 0.0]]}})
    d = to_dict(cfg)
    assert d["optim"]["decay_steps"] == [3]
    assert d["network"]["drop_rate"] == [[0.0, 0.1], [0.1, 0.0]]
    assert isinstance(d["data"], dict) and d["data"]["dataset"] == "digits"


# ---------------------------------------------------------------------------
# Presets


def test_lossy_preset_fills_network() -> None:
    net = config_from_dict({"network": {"preset": "lossy"}}).network
    assert PRESETS["lossy"] == {"drop_rate": 0.1, "latency_ms": 0.5, "bandwidth_mbps": 1000.0}
    assert (net.preset, net.drop_rate, net.latency_ms, net.bandwidth_mbps) == ("lossy", 0.1, 0.5, 1000.0)
    assert net.burst_enter == NetworkConfig().burst_enter  # fields the preset does not name keep defaults


@pytest.mark.parametrize(("field", "value"), [("drop_rate", 0.3), ("latency_ms", 20.0), ("bandwidth_mbps", 5.0)])
def test_field_beside_preset_wins(field: str, value: float) -> None:
    net = config_from_dict({"network": {"preset": "lossy", field: value}}).network
    assert getattr(net, field) == value
    others = {k: v for k, v in PRESETS["lossy"].items() if k != field}
    assert all(getattr(net, k) == v for k, v in others.items())


def test_lan_preset() -> None:
    net = config_from_dict({"network": {"preset": "lan", "drop_rate": 0.05}}).network
    assert (net.drop_rate, net.latency_ms, net.bandwidth_mbps) == (0.05, 0.05, 10000.0)


@pytest.mark.parametrize("preset", ["wan", 5])
def test_unknown_preset(preset: Any) -> None:
    with pytest.raises(ValueError, match=r"network\.preset must be one of lan, lossy, geo4; got " + re.escape(repr(preset))):
        config_from_dict({"network": {"preset": preset}})
    if isinstance(preset, str):  # constructing the section directly checks it too
        with pytest.raises(ValueError, match=r"network\.preset"):
            NetworkConfig(preset=preset)


# ---------------------------------------------------------------------------
# Per-link matrices


@pytest.mark.parametrize("field", ["drop_rate", "latency_ms", "bandwidth_mbps"])
def test_matrix_wrong_size_for_num_workers(field: str) -> None:
    with pytest.raises(ValueError, match=rf"^network\.{field} is a 2x2 matrix but num_workers is 3$"):
        config_from_dict({"num_workers": 3, "network": {field: [[0.5, 0.5], [0.5, 0.5]]}})


def test_matrix_not_square() -> None:
    with pytest.raises(ValueError, match=r"^network\.drop_rate must be a square matrix; row 1 has 3 entries, "
                                         r"expected 2$"):
        config_from_dict({"num_workers": 2, "network": {"drop_rate": [[0.0, 0.1], [0.1, 0.0, 0.2]]}})


@pytest.mark.parametrize(("field", "matrix", "entry", "bad"), [
    ("drop_rate", [[0.0, 1.5], [0.0, 0.0]], "[0][1]", "1.5"),
    ("drop_rate", [[0.0, 0.0], [-0.1, 0.0]], "[1][0]", "-0.1"),
    ("drop_rate", [[0.0, 0.0], [0.0, 1.0]], "[1][1]", "1.0"),
    ("latency_ms", [[0.0, -2.0], [0.0, 0.0]], "[0][1]", "-2.0"),
    ("bandwidth_mbps", [[1.0, 1.0], [0.0, 1.0]], "[1][0]", "0.0"),
    ("drop_rate", [[0.0, float("nan")], [0.0, 0.0]], "[0][1]", "nan"),
])
def test_matrix_entry_out_of_range(field: str, matrix: list[list[float]], entry: str, bad: str) -> None:
    with pytest.raises(ValueError) as exc:
        config_from_dict({"num_workers": 2, "network": {field: matrix}})
    msg = str(exc.value)
    assert msg.startswith(f"network.{field}{entry} must be in "), msg
    assert msg.endswith(f"got {bad}"), msg


def test_matrix_rows_must_be_lists() -> None:
    with pytest.raises(TypeError, match=r"^network\.drop_rate must be a number or a list of lists of numbers, "
                                        r"got \[0\.1, 0\.2\]$"):
        config_from_dict({"network": {"drop_rate": [0.1, 0.2]}})


def test_matrix_entry_wrong_type_names_the_entry() -> None:
    with pytest.raises(TypeError, match=r"network\.drop_rate\[0\]\[1\] must be a number, got 'x'"):
        config_from_dict({"num_workers": 2, "network": {"drop_rate": [[0.0, "x"], [0.0, 0.0]]}})


# ---------------------------------------------------------------------------
# Strict keys and types


@pytest.mark.parametrize(("values", "name", "where"), [
    ({"stepz": 5}, "stepz", "the top level"),
    ({"network": {"drop_rat": 0.1}}, "network.drop_rat", "network"),
    ({"optim": {"learning_rate": 0.1}}, "optim.learning_rate", "optim"),
    ({"data": {"dataset": "iris", "shuffle": True}}, "data.shuffle", "data"),
])
def test_unknown_keys(values: dict[str, Any], name: str, where: str) -> None:
    with pytest.raises(ValueError) as exc:
        config_from_dict(values)
    msg = str(exc.value)
    assert msg.startswith(f"{name} is not a setting (known in {where}: "), msg
    known = "steps" if where == "the top level" else name.split(".")[0]
    assert known in msg


@pytest.mark.parametrize(("key", "value", "message"), [
    ("steps", True, "steps must be an integer, got True"),
    ("num_workers", False, "num_workers must be an integer, got False"),
    ("model.hidden", True, "model.hidden must be an integer, got True"),
    ("optim.lr", True, "optim.lr must be a number, got True"),
    ("steps", 5.0, "steps must be an integer, got 5.0"),
    ("steps", "5", "steps must be an integer, got '5'"),
    ("strategy.name", 3, "strategy.name must be a string, got 3"),
    ("optim.decay_steps", 5, "optim.decay_steps must be a list, got 5"),
    ("optim.decay_steps", [5, True], "optim.decay_steps[1] must be an integer, got True"),
    ("network", 3, "network must be a table of settings, got 3"),
])
def test_wrong_types(key: str, value: Any, message: str) -> None:
    with pytest.raises(TypeError) as exc:
        _from(key, value)
    assert str(exc.value) == message


def test_int_accepted_for_float() -> None:
    cfg = config_from_dict({"optim": {"lr": 1, "momentum": 0}, "network": {"latency_ms": 3, "drop_rate": 0}})
    assert cfg.optim.lr == 1.0 and type(cfg.optim.lr) is float
    assert type(cfg.optim.momentum) is float
    assert cfg.network.latency_ms == 3.0 and type(cfg.network.latency_ms) is float
    assert type(cfg.network.drop_rate) is float


def test_float_field_given_int_round_trips() -> None:
    cfg = config_from_dict({"network": {"bandwidth_mbps": 100}})
    assert "bandwidth_mbps = 100.0" in to_toml(cfg)
    assert _round_trip(cfg) == cfg


# ---------------------------------------------------------------------------
# parse_value and set_dotted


@pytest.mark.parametrize(("text", "expected"), [
    ("0.1", 0.1),
    ("3", 3),
    ("[1, 2]", [1, 2]),
    ("[[0, 0.5], [0.5, 0]]", [[0, 0.5], [0.5, 0]]),
    ("rps", "rps"),
    ('"rps"', "rps"),
    ("true", True),
    ("1e3", 1000.0),
    ("", ""),
    ("/some/path", "/some/path"),
    ("lossy-allreduce", "lossy-allreduce"),
])
def test_parse_value(text: str, expected: Any) -> None:
    value = parse_value(text)
    assert value == expected
    assert type(value) is type(expected)


def test_parse_value_nan() -> None:
    assert math.isnan(parse_value("nan"))


def test_set_dotted_creates_nested_tables() -> None:
    values: dict[str, Any] = {"network": {"drop_rate": 0.1}}
    set_dotted(values, "a.b.c", 1)
    set_dotted(values, "network.latency_ms", 5.0)
    set_dotted(values, "steps", 3)
    set_dotted(values, "network.drop_rate", 0.2)
    assert values == {"network": {"drop_rate": 0.2, "latency_ms": 5.0}, "a": {"b": {"c": 1}}, "steps": 3}


def test_set_dotted_into_a_value() -> None:
    values: dict[str, Any] = {"steps": 3}
    with pytest.raises(ValueError, match=r"^steps\.x: steps is a value, not a table$"):
        set_dotted(values, "steps.x", 1)
    assert values == {"steps": 3}


def test_dotted_keys_build_a_config() -> None:
    values: dict[str, Any] = {}
    for key, text in [("network.drop_rate", "0.1"), ("strategy.name", "allreduce"),
                      ("optim.decay_steps", "[10, 20]"), ("num_workers", "4")]:
        set_dotted(values, key, parse_value(text))
    cfg = config_from_dict(values)
    assert (cfg.network.drop_rate, cfg.strategy.name, cfg.optim.decay_steps, cfg.num_workers) == (
        0.1, "allreduce", (10, 20), 4)


# ---------------------------------------------------------------------------
# replace


def test_replace_dotted_and_sections() -> None:
    cfg = RunConfig()
    new = replace(cfg, steps=10, network__drop_rate=0.2, optim=OptimConfig(lr=0.5))
    assert (new.steps, new.network.drop_rate, new.optim.lr) == (10, 0.2, 0.5)
    assert new.data == cfg.data and cfg.steps == 600  # the original is untouched
    with pytest.raises(ValueError, match=r"network\.drop_rate must be in \[0, 1\), got 2\.0"):
        replace(cfg, network__drop_rate=2.0)
    with pytest.raises(ValueError, match=r"network\.drop_ratee is not a setting"):
        replace(cfg, network__drop_ratee=0.1)


# ---------------------------------------------------------------------------
# Range checks, each naming the dotted field and the value

RANGE_CASES: list[tuple[str, Any, str]] = [
    ("num_workers", 0, "num_workers must be >= 1, got 0"),
    ("steps", 0, "steps must be >= 1, got 0"),
    ("steps", -5, "steps must be >= 1, got -5"),
    ("batch_size", 0, "batch_size must be >= 1, got 0"),
    ("eval_every", 0, "eval_every must be >= 1, got 0"),
    ("checkpoint_every", -1, "checkpoint_every must be >= 0, got -1"),
    ("backend", "mpi", "backend must be one of sim, dist; got 'mpi'"),
    ("dtype", "float16", "dtype must be one of float32, float64; got 'float16'"),
    ("optim.lr", 0.0, "optim.lr must be in (0, inf), got 0.0"),
    ("optim.lr", -0.1, "optim.lr must be in (0, inf), got -0.1"),
    ("optim.lr", math.inf, "optim.lr must be in (0, inf), got inf"),
    ("optim.momentum", 1.0, "optim.momentum must be in [0, 1), got 1.0"),
    ("optim.momentum", -0.5, "optim.momentum must be in [0, 1), got -0.5"),
    ("optim.weight_decay", -1.0, "optim.weight_decay must be in [0, inf), got -1.0"),
    ("optim.warmup_steps", -1, "optim.warmup_steps must be >= 0, got -1"),
    ("optim.decay_steps", [30, 10], "optim.decay_steps must be increasing positive steps, got [30, 10]"),
    ("optim.decay_steps", [0, 10], "optim.decay_steps must be increasing positive steps, got [0, 10]"),
    ("optim.decay_factor", 0.0, "optim.decay_factor must be in (0, 1], got 0.0"),
    ("optim.decay_factor", 1.5, "optim.decay_factor must be in (0, 1], got 1.5"),
    ("network.drop_rate", 1.0, "network.drop_rate must be in [0, 1), got 1.0"),
    ("network.drop_rate", math.nan, "network.drop_rate must be in [0, 1), got nan"),
    ("network.latency_ms", -1.0, "network.latency_ms must be in [0, inf), got -1.0"),
    ("network.latency_ms", math.inf, "network.latency_ms must be in [0, inf), got inf"),
    ("network.bandwidth_mbps", 0.0, "network.bandwidth_mbps must be in (0, inf), got 0.0"),
    ("network.burst_enter", 1.5, "network.burst_enter must be in [0, 1], got 1.5"),
    ("network.burst_enter", -0.1, "network.burst_enter must be in [0, 1], got -0.1"),
    ("network.burst_exit", 0.0, "network.burst_exit must be in (0, 1], got 0.0"),
    ("network.burst_exit", 1.01, "network.burst_exit must be in (0, 1], got 1.01"),
    ("network.burst_drop_rate", 2.0, "network.burst_drop_rate must be in [0, 1], got 2.0"),
    ("network.retransmit_timeout_ms", -1.0, "network.retransmit_timeout_ms must be in [0, inf), got -1.0"),
    ("network.compute_ms", math.inf, "network.compute_ms must be a finite number, got inf"),
    ("network.compute_ms", math.nan, "network.compute_ms must be a finite number, got nan"),
    ("network.exchange_compute_ms", -1.0, "network.exchange_compute_ms must be in [0, inf), got -1.0"),
    ("network.exchange_compute_ms", math.inf, "network.exchange_compute_ms must be in [0, inf), got inf"),
    ("dist.heartbeat_timeout_s", 5.0, "dist.heartbeat_timeout_s = 5.0 applies only with dist.transport = \"udp\" "
                                      "(got 'gloo')"),
    ("dist.emulate_latency", True, "dist.emulate_latency = True applies only with dist.transport = \"udp\" "
                                   "(got 'gloo')"),
    ("data.dataset", "mnist", "data.dataset must be one of digits, iris, wine, breast_cancer, mnist1d, cifar10, "
                              "text, bytes, or a factory (package.module:factory, path/to/file.py:factory); "
                              "got 'mnist'"),
    ("data.partition", "random", "data.partition must be one of iid, dirichlet, label-skew; got 'random'"),
    ("data.dirichlet_alpha", 0.0, "data.dirichlet_alpha must be in (0, inf), got 0.0"),
    ("data.test_fraction", 0.0, "data.test_fraction must be in (0, 1), got 0.0"),
    ("data.test_fraction", 1.0, "data.test_fraction must be in (0, 1), got 1.0"),
    ("data.max_len", 0, "data.max_len must be >= 1, got 0"),
    ("data.dataset", "cifar10", "data.path must name a local directory for dataset cifar10; got ''"),
    ("data.dataset", "text", "data.path must name a local file for dataset text; got ''"),
    ("model.name", "vgg", "model.name must be one of logreg, mlp, cnn, resnet20, resnet32, resnet44, resnet56, "
                          "resnet110, lstm, gpt, or a factory (package.module:factory, path/to/file.py:factory); "
                          "got 'vgg'"),
    ("model.hidden", -1, "model.hidden must be >= 0, got -1"),
    ("strategy.name", "gossip", "strategy.name must be one of allreduce, lossy-allreduce, rps, local-sgd, ri-sgd, dts, diloco; got 'gossip'"),
    # Absurdly large values: refused before anything is sized by them.
    ("steps", 10**15, "steps must be at most 1000000000 (a billion), got 1000000000000000"),
    ("model.hidden", 10**8, "model.hidden must be at most 8192, got 100000000"),
    ("data.max_len", 10**6, "data.max_len must be at most 4096, got 1000000"),
    ("optim.lr", 1e300, "optim.lr must be at most 3.402823e+38 (the largest float32; dtype is float32), got 1e+300"),
    ("data.path", "notes.txt", "data.path applies only to the cifar10, text and bytes data sets; dataset digits reads no "
                               "file (got path 'notes.txt')"),
]


@pytest.mark.parametrize(("key", "bad", "message"), RANGE_CASES, ids=[f"{k}={v!r}" for k, v, _ in RANGE_CASES])
def test_range_checks(key: str, bad: Any, message: str) -> None:
    with pytest.raises(ValueError) as exc:
        _from(key, bad)
    assert str(exc.value) == message


@pytest.mark.parametrize(("dataset", "model", "message"), [
    ("text", "mlp", "model.name 'mlp' reads features but data.dataset 'text' holds token ids; models for text: lstm"),
    ("text", "resnet20", "model.name 'resnet20' reads images (or a square number of features) but data.dataset "
                         "'text' holds token ids; models for text: lstm"),
    ("digits", "lstm", "model.name 'lstm' reads token ids but data.dataset 'digits' holds 64 features; models for "
                       "digits: logreg, mlp, cnn, resnet20, resnet32, resnet44, resnet56, resnet110"),
    ("wine", "resnet20", "model.name 'resnet20' reads images (or a square number of features) but data.dataset "
                         "'wine' holds 13 features; models for wine: logreg, mlp, cnn"),
    ("cifar10", "lstm", "model.name 'lstm' reads token ids but data.dataset 'cifar10' holds images; models for "
                        "cifar10: logreg, mlp, cnn, resnet20, resnet32, resnet44, resnet56, resnet110"),
])
def test_model_must_fit_the_data(dataset: str, model: str, message: str) -> None:
    """Which models read which data sets is checked in the config, before any data is loaded or file written."""
    path = "" if dataset not in ("text", "cifar10") else "/nowhere"
    with pytest.raises(ValueError) as exc:
        config_from_dict({"data": {"dataset": dataset, "path": path}, "model": {"name": model}})
    assert str(exc.value) == message


def test_every_dataset_has_a_model_and_strategy_delay_is_bounded() -> None:
    from shaky.config import models_for
    from shaky.data import DATASETS

    assert models_for("text") == ("lstm",)
    assert all(models_for(d) for d in DATASETS)
    with pytest.raises(ValueError, match=r"^strategy\.delay must be at most 4096, got 5000$"):
        config_from_dict({"strategy": {"name": "dts", "delay": 5000}})
    assert config_from_dict({"steps": 10**9}).steps == 10**9  # the bound itself is accepted
    assert config_from_dict({"optim": {"lr": 1e300}, "dtype": "float64"}).optim.lr == 1e300


def test_range_cases_cover_every_check() -> None:
    required = {"num_workers", "steps", "batch_size", "eval_every", "checkpoint_every", "backend", "dtype",
                "optim.lr", "optim.momentum", "optim.decay_steps", "network.latency_ms", "network.bandwidth_mbps",
                "network.burst_enter", "network.burst_exit", "data.partition", "data.test_fraction", "model.name",
                "strategy.name"}
    assert required <= {key for key, _, _ in RANGE_CASES}


def test_boundaries_are_accepted() -> None:
    cfg = config_from_dict({
        "num_workers": 1, "steps": 1, "batch_size": 1, "eval_every": 1, "checkpoint_every": 0, "backend": "sim",
        "optim": {"momentum": 0.0, "decay_factor": 1.0, "decay_steps": [1, 2]},
        "network": {"drop_rate": 0.0, "latency_ms": 0.0, "burst_enter": 1.0, "burst_exit": 1.0,
                    "burst_drop_rate": 0.0, "retransmit_timeout_ms": 0.0, "compute_ms": -1.0},
        "data": {"test_fraction": 0.999, "max_len": 1}, "model": {"hidden": 0},
    })
    assert cfg.network.burst_enter == 1.0 and cfg.optim.decay_factor == 1.0 and cfg.backend == "sim"
    assert config_from_dict({"network": {"drop_rate": 0.999999}}).network.drop_rate == 0.999999


def test_sections_check_on_direct_construction() -> None:
    with pytest.raises(ValueError, match=r"^data\.test_fraction must be in \(0, 1\), got 1\.5$"):
        DataConfig(test_fraction=1.5)
    with pytest.raises(ValueError, match=r"^network\.drop_rate\[1\]\[0\] must be in \[0, 1\), got 1\.0$"):
        NetworkConfig(drop_rate=((0.0, 0.0), (1.0, 0.0)))
    with pytest.raises(ValueError, match=r"^num_workers must be >= 1, got 0$"):
        RunConfig(num_workers=0)


@pytest.mark.parametrize("value", [1e308, 7 * 24 * 3600.0 + 1, float("inf"), 0.0])
def test_dist_timeout_s_is_bounded(value: float) -> None:
    """Every rank turns dist_timeout_s into a timedelta and a store's milliseconds: 1e308 raised OverflowError in
    one rank while the others waited. A value past a week is refused where the config is read, on every rank."""
    with pytest.raises(ValueError, match=r"^dist_timeout_s must be in \(0, 604800\], got "):
        config_from_dict({"dist_timeout_s": value})
    assert config_from_dict({"dist_timeout_s": 7 * 24 * 3600.0}).dist_timeout_s == 604800.0
