"""Run configuration: frozen, validated dataclasses read from TOML plus CLI overrides.

Every field has a docstring, units live in names (``latency_ms``), and every
check raises ``ValueError``/``TypeError`` naming the dotted field and the value
(``network.drop_rate must be in [0, 1), got 1.5``). The resolved configuration
is written as TOML into every run directory, and ``--resume`` reads it back.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import tomli_w

Matrix = tuple[tuple[float, ...], ...]
"""A per-link matrix [W, W]: entry [i][j] describes the link from worker i to worker j."""

STRATEGY_OPTIONS: dict[str, tuple[str, ...]] = {
    "allreduce": (),
    "lossy-allreduce": (),
    "rps": (),
    "local-sgd": ("period", "reliable"),
    "ri-sgd": ("period", "redundancy", "grow_batch"),
    "dts": ("period", "delay", "correction"),
    "diloco": ("period", "reliable", "outer_lr", "outer_momentum", "outer_nesterov"),
}
"""Each strategy (the registry in ``shaky.strategies``) and the strategy.* settings it reads beside
``weighted``; setting any other one away from its default is an error that names who reads it."""
STRATEGIES = tuple(STRATEGY_OPTIONS)
OPTIMIZERS = ("sgd", "adamw")
BACKENDS = ("sim", "dist")
TRANSPORTS = ("gloo", "udp")
UDP_PORTS = "29600-29855"
"""The UDP ports a udp rank may bind by default (``dist.ports``)."""
UDP_OVERHEAD_BYTES = 52
"""Header and tag bytes of a udp datagram (``shaky.comm.udp.wire.OVERHEAD_BYTES``; a test checks they agree):
a datagram of ``dist.datagram_bytes`` carries a segment of ``datagram_bytes - 52`` bytes."""
DTYPES = ("float32", "float64")
VALUE_DTYPES = ("float32", "bfloat16", "float16", "int8")
"""strategy.value_dtype's choices beside "" (shaky.comm.quant.FORMATS)."""
DEVICE_PATTERN = re.compile(r"cpu|cuda(:(0|[1-9][0-9]{0,3}))?")
FLOAT32_MAX = 3.4028234663852886e38
MAX_STEPS = 10**9
"""Upper bound on steps: a billion steps is weeks of training even for the smallest model here, so a larger
value is a typo (and counters, schedules and traces are sized for it)."""
MAX_DELAY = 4096
"""Upper bound on strategy.delay: every step of delay keeps one more exchange ([W, D]) in flight in memory."""
MAX_HIDDEN = 8192
"""Upper bound on model.hidden: an mlp holds hidden^2 parameters per worker (8192: 67M, 256 MB each)."""
MAX_LEN = 4096
"""Upper bound on data.max_len: the lstm steps through every token position of every sentence, padding included."""


def models_for(dataset: str) -> tuple[str, ...]:
    """The models that can read ``dataset``'s samples (``RunConfig`` refuses the others before any work).

    Text samples are token ids, which only the lstm embeds; bytes are sequences of next-byte targets, which only
    gpt predicts; every other data set holds features, which logreg, mlp and cnn read in any shape, and a ResNet
    only as images: (C, H, W), or a square number of features (digits is 8 x 8, iris 2 x 2). A data set made by a
    factory is known only once loaded: every model may try it (``shaky.user.check_model`` checks its output).
    """
    from shaky.data import SAMPLE_SHAPES  # noqa: PLC0415 (data imports torch; keep config light)
    from shaky.models import MODELS  # noqa: PLC0415

    if _is_factory(dataset):
        return MODELS
    if dataset == "bytes":
        return ("gpt",)
    shape = SAMPLE_SHAPES.get(dataset)
    if shape is None:  # token ids
        return ("lstm",)
    images = len(shape) == 3 or math.isqrt(math.prod(shape)) ** 2 == math.prod(shape)
    return tuple(m for m in MODELS if m not in ("lstm", "gpt") and (images or not m.startswith("resnet")))


_FACTORY = "or a factory (package.module:factory, path/to/file.py:factory)"
"""How a refusal of an unknown model or data set name ends its list of choices."""


def _is_factory(name: str) -> bool:
    """A model or data set given by a factory (``module:factory``, ``file.py:factory``) or as a Python object."""
    return ":" in name


def short_name(name: str) -> str:
    """A model's or data set's name as a run directory's name shows it: a factory's or an object's last name."""
    return name.rsplit(":", 1)[-1].rsplit(".", 1)[-1] if _is_factory(name) else name


def _resolve_factory(section: Any, setting: str, digest: str = "sha256") -> None:
    """A factory's name checked (its file's path made absolute) and its file's SHA-256 recorded in the section's
    ``digest`` field, which must match the file where it is already set (a resume, a sweep's run): one line where
    the file changed. A built-in name takes no digest."""
    from shaky import user  # noqa: PLC0415 (no torch)

    section_name, attr = setting.split(".")
    name, recorded = getattr(section, attr), getattr(section, digest)
    if not _is_factory(name):
        if recorded:
            what = f"the built-in {name!r}" if name else "the default (cross-entropy)"
            raise ValueError(f"{section_name}.{digest} applies to a factory (module:factory or "
                             f"file.py:factory), not {what} (got {recorded!r})")
        return
    name = user.resolve(setting, name)
    object.__setattr__(section, attr, name)
    if not user.is_object(name):
        object.__setattr__(section, digest, user.check_digest(setting, name, recorded, f"{section_name}.{digest}"))


def _check_range(name: str, value: float, lo: float, hi: float, *, lo_open: bool = False,
                 hi_open: bool = False) -> None:
    ok_lo = value > lo if lo_open else value >= lo
    ok_hi = value < hi if hi_open else value <= hi
    if not (ok_lo and ok_hi) or math.isnan(value):
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        raise ValueError(f"{name} must be in {interval}, got {value!r}")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _check_scalar_or_matrix(name: str, value: float | Matrix, lo: float, hi: float, *,
                            lo_open: bool = False, hi_open: bool = False) -> None:
    if isinstance(value, tuple):
        n = len(value)
        for i, row in enumerate(value):
            if len(row) != n:
                raise ValueError(f"{name} must be a square matrix; row {i} has {len(row)} "
                                 f"entries, expected {n}")
            for j, v in enumerate(row):
                _check_range(f"{name}[{i}][{j}]", v, lo, hi, lo_open=lo_open, hi_open=hi_open)
    else:
        _check_range(name, value, lo, hi, lo_open=lo_open, hi_open=hi_open)


MAX_SCALE_PERIOD = 1000
"""The largest t or d (given or recommended) that ``shaky scale`` and scale sweeps price: the clock simulates
100 periods per point, so its time grows with them (1000 takes seconds)."""


_UNSET_UNWRITTEN = {"unset_unwritten": True}
"""Field metadata: a setting that :func:`to_dict` leaves out while it holds its default, so that a config that
does not use it reads and writes as configs did before it existed (a run directory, a sweep's finished runs)."""

HEARTBEAT_TIMEOUT_S = 3.0
"""``dist.heartbeat_timeout_s``'s default (and the averagers')."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    dataset: str = "digits"
    """digits, iris, wine, breast_cancer, mnist1d, cifar10 (needs path), text (needs path), bytes (needs path), or
    a factory: ``package.module:factory`` or ``path/to/file.py:factory`` (see ``shaky.user``)."""
    path: str = ""
    """CIFAR-10 python-batch directory, a ``label<TAB>text`` file for ``text``, or any file for ``bytes``."""
    partition: str = "iid"
    """How training samples are cut into one chunk per worker: iid, dirichlet, or label-skew (sorted by label)."""
    dirichlet_alpha: float = 0.5
    """Concentration of the Dirichlet label skew; smaller is more skewed."""
    test_fraction: float = 0.2
    """Fraction held out for testing (ignored by cifar10, which ships a test split)."""
    max_len: int = 32
    """Tokens per sentence for the text data set (truncated or padded); bytes: the context, bytes per sample."""
    sha256: str = field(default="", metadata=_UNSET_UNWRITTEN)
    """A factory's file's SHA-256, recorded when the run is configured (a resume or sweep refuses a changed file)."""

    def __post_init__(self) -> None:
        from shaky.data import DATASETS, PARTITIONS, READS_PATH  # noqa: PLC0415 (data imports torch)

        if not _is_factory(self.dataset):
            _check_choice("data.dataset", self.dataset, (*DATASETS, _FACTORY))
        _resolve_factory(self, "data.dataset")
        _check_choice("data.partition", self.partition, PARTITIONS)
        _check_range("data.dirichlet_alpha", self.dirichlet_alpha, 0.0, math.inf, lo_open=True, hi_open=True)
        _check_range("data.test_fraction", self.test_fraction, 0.0, 1.0, lo_open=True, hi_open=True)
        if self.max_len < 1:
            raise ValueError(f"data.max_len must be >= 1, got {self.max_len}")
        if self.max_len > MAX_LEN:
            raise ValueError(f"data.max_len must be at most {MAX_LEN}, got {self.max_len}")
        if self.dataset in READS_PATH and not self.path:
            raise ValueError(f"data.path must name a local {'directory' if self.dataset == 'cifar10' else 'file'} "
                             f"for dataset {self.dataset}; got ''")
        if self.path and self.dataset not in READS_PATH:
            raise ValueError(f"data.path applies only to the {', '.join(READS_PATH[:-1])} and {READS_PATH[-1]} data "
                             f"sets; dataset {self.dataset} reads no file (got path {self.path!r})")
        if self.dataset == "bytes" and self.partition != "iid":
            raise ValueError(f"data.partition {self.partition!r} cuts by class label; dataset bytes has a next-byte "
                             "target at every position (use iid)")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    name: str = "mlp"
    """logreg, mlp, cnn, resnet20 ... resnet110 (depth 6n+2), lstm, gpt, or a factory:
    ``package.module:factory`` or ``path/to/file.py:factory``, called as ``factory(input_shape, num_classes)``."""
    hidden: int = 0
    """Hidden width of mlp and lstm, gpt's embedding width; 0 picks the model's default (128; gpt 64)."""
    sha256: str = field(default="", metadata=_UNSET_UNWRITTEN)
    """A factory's file's SHA-256, recorded when the run is configured (a resume or sweep refuses a changed file);
    a model given to ``shaky.simulate`` as an object: the digest of its class's source and parameters."""
    loss: str = field(default="", metadata=_UNSET_UNWRITTEN)
    """Each sample's training and test loss: empty for cross-entropy of the logits against the targets (per token
    for next-token targets, where perplexity is reported too), or a function ``loss(logits, y) -> [B]`` (each
    sample's loss, as ``F.cross_entropy(..., reduction="none")`` gives) named as ``package.module:function`` or
    ``path/to/file.py:function``, or given to ``shaky.simulate(loss=...)``. Such a loss runs on the generic vmap
    path (every worker's loss at once), so it must be written in torch operations vmap can batch."""
    loss_sha256: str = field(default="", metadata=_UNSET_UNWRITTEN)
    """``loss``'s file's SHA-256 (a function given to ``shaky.simulate``: of its source), as ``sha256``."""

    def __post_init__(self) -> None:
        from shaky.models import MODELS  # noqa: PLC0415

        if not _is_factory(self.name):
            _check_choice("model.name", self.name, (*MODELS, _FACTORY))
        _resolve_factory(self, "model.name")
        if self.loss and not _is_factory(self.loss):
            raise ValueError(f"model.loss must be empty (cross-entropy) or a function (package.module:function, "
                             f"path/to/file.py:function); got {self.loss!r}")
        _resolve_factory(self, "model.loss", "loss_sha256")
        if self.hidden < 0:
            raise ValueError(f"model.hidden must be >= 0, got {self.hidden}")
        if self.hidden > MAX_HIDDEN:
            raise ValueError(f"model.hidden must be at most {MAX_HIDDEN}, got {self.hidden}")


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimConfig:
    name: str = "sgd"
    """Every worker's local (inner) optimizer: sgd (torch.optim.SGD's rule) or adamw (torch.optim.AdamW's)."""
    lr: float = 0.1
    """Peak learning rate of the local optimizer."""
    momentum: float = 0.0
    """sgd: heavy-ball momentum, kept per worker (0 in the RPS paper)."""
    weight_decay: float = 0.0
    """sgd: L2 penalty added to each gradient (0 in the RPS paper); adamw: decoupled weight decay."""
    beta1: float = 0.9
    """adamw: decay of the first-moment average."""
    beta2: float = 0.999
    """adamw: decay of the second-moment average."""
    eps: float = 1e-8
    """adamw: added to the root of the second moment."""
    warmup_steps: int = 0
    """Steps of linear learning-rate warm-up from lr/warmup_steps to lr."""
    decay_steps: tuple[int, ...] = ()
    """Steps at which the learning rate is multiplied by decay_factor."""
    decay_factor: float = 0.1
    """Multiplier applied at each of decay_steps."""

    def __post_init__(self) -> None:
        _check_choice("optim.name", self.name, OPTIMIZERS)
        _check_range("optim.lr", self.lr, 0.0, math.inf, lo_open=True, hi_open=True)
        _check_range("optim.momentum", self.momentum, 0.0, 1.0, hi_open=True)
        _check_range("optim.beta1", self.beta1, 0.0, 1.0, hi_open=True)
        _check_range("optim.beta2", self.beta2, 0.0, 1.0, hi_open=True)
        _check_range("optim.eps", self.eps, 0.0, math.inf, lo_open=True, hi_open=True)
        if self.name == "adamw" and self.momentum:
            raise ValueError(f"optim.momentum applies to sgd; adamw has beta1 and beta2 (got momentum = "
                             f"{self.momentum!r})")
        if self.name == "sgd" and (self.beta1, self.beta2, self.eps) != (0.9, 0.999, 1e-8):
            raise ValueError("optim.beta1, optim.beta2 and optim.eps apply to adamw, not sgd")
        _check_range("optim.weight_decay", self.weight_decay, 0.0, math.inf, hi_open=True)
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if any(s < 1 for s in self.decay_steps) or list(self.decay_steps) != sorted(self.decay_steps):
            raise ValueError(f"optim.decay_steps must be increasing positive steps, got {list(self.decay_steps)}")
        _check_range("optim.decay_factor", self.decay_factor, 0.0, 1.0, lo_open=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class StrategyConfig:
    name: str = "rps"
    """allreduce, lossy-allreduce, rps, local-sgd, ri-sgd, dts or diloco."""
    period: int = 1
    """Average every this many steps (local SGD's tau, DTS's temporal sparsity d, DiLoCo's H); 1 = every step."""
    redundancy: int = 1
    """RI-SGD's q: each worker holds q of the W data chunks, chosen cyclically; 1 = no redundancy."""
    grow_batch: bool = False
    """RI-SGD: grow each worker's batch with q (as the authors' code does) instead of keeping compute equal."""
    delay: int = 1
    """DTS's t: the average launched at step n is applied at step n + t - 1; 1 = synchronous."""
    correction: bool = True
    """DTS: correct the stale average with the worker's own fresh gradient (off = plain stale SGD)."""
    weighted: bool = False
    """Weigh each worker's share of an average by its batch size (for heterogeneous batch_sizes)."""
    reliable: bool = False
    """local-sgd, diloco: average over a reliable transport (the exact mean of a ring all-reduce, resending what
    is lost) instead of RPS's lossy block exchange."""
    outer_lr: float = 0.7
    """diloco: learning rate of the outer SGD step on the pseudo-gradient (0.7 in the DiLoCo paper)."""
    outer_momentum: float = 0.9
    """diloco: momentum of the outer step (0.9 in the DiLoCo paper; 0 = plain outer SGD)."""
    outer_nesterov: bool = True
    """diloco: Nesterov momentum in the outer step (as the DiLoCo paper), else heavy-ball."""
    value_dtype: str = field(default="", metadata=_UNSET_UNWRITTEN)
    """How exchanged values travel: "" (as the model holds them), float32, bfloat16, float16 or int8 (a float32
    scale a group of 256 values), each as the difference from a reference both ends hold (shaky.comm.quant);
    the simulator and dist.transport udp (gloo refuses it)."""

    def __post_init__(self) -> None:
        _check_choice("strategy.name", self.name, STRATEGIES)
        for name in ("period", "redundancy", "delay"):
            if getattr(self, name) < 1:
                raise ValueError(f"strategy.{name} must be >= 1, got {getattr(self, name)}")
        if self.delay > MAX_DELAY:
            raise ValueError(f"strategy.delay must be at most {MAX_DELAY}, got {self.delay}")
        if self.value_dtype:
            _check_choice("strategy.value_dtype", self.value_dtype, VALUE_DTYPES)
        _check_range("strategy.outer_lr", self.outer_lr, 0.0, math.inf, lo_open=True, hi_open=True)
        _check_range("strategy.outer_momentum", self.outer_momentum, 0.0, 1.0, hi_open=True)
        # One rule for every strategy: a setting away from its default must be one the strategy reads.
        for f in dataclasses.fields(self):
            if f.name in ("name", "weighted", "value_dtype") or f.name in STRATEGY_OPTIONS[self.name]:
                continue
            if getattr(self, f.name) != f.default:
                users = [n for n, options in STRATEGY_OPTIONS.items() if f.name in options]
                raise ValueError(f"strategy.{f.name} applies to {', '.join(users)}; not {self.name} "
                                 f"(got {f.name} = {getattr(self, f.name)!r})")


@dataclass(frozen=True, kw_only=True, slots=True)
class NetworkConfig:
    preset: str = ""
    """A named network (lan, lossy, geo4); fields set beside it override the preset's values."""
    drop_rate: float | Matrix = 0.0
    """Probability that one message is lost: one number for every link, or a [W][W] matrix."""
    latency_ms: float | Matrix = 0.05
    """One-way latency of a link, in milliseconds."""
    bandwidth_mbps: float | Matrix = 10000.0
    """Bandwidth of a link, in megabits per second."""
    regions: tuple[str, ...] = ()
    """Regions the workers are spread over in contiguous blocks (oregon, ohio, london, tokyo); empty = one site.
    With regions, latency_ms and bandwidth_mbps are one number each, the LAN inside a region."""
    wan_bandwidth_mbps: float = 100.0
    """Bandwidth of a link between two regions, in megabits per second (with regions only)."""
    burst_enter: float = 0.0
    """Gilbert-Elliott bursty loss: chance per message slot that a good link turns bad (0 = no bursts)."""
    burst_exit: float = 0.5
    """Chance per message slot that a bad link recovers; the mean burst lasts 1/burst_exit slots."""
    burst_drop_rate: float = 1.0
    """Drop probability while a link is in the bad state."""
    segment_bytes: int = 0
    """The unit of loss: a block's message is cut into segments (datagram payloads) of at most this many bytes,
    each lost on its own; 0 = one message per block (a loss loses the whole block)."""
    retransmit_timeout_ms: float = 200.0
    """What a reliable transport waits before resending a lost message (Linux's minimum RTO)."""
    compute_ms: float = -1.0
    """Simulated compute time of one worker's step; negative means measure it on this machine."""
    exchange_compute_ms: float = 0.0
    """Simulated compute time an exchange takes from the step that launches it (a software data plane packing,
    tagging and receiving datagrams on the workers' own cores): it never overlaps, whatever the delay."""
    trace: str = ""
    """A run directory whose recorded delivery masks are replayed instead of sampled."""

    def __post_init__(self) -> None:
        from shaky.network.presets import PRESETS  # noqa: PLC0415

        if self.preset:
            _check_choice("network.preset", self.preset, tuple(PRESETS))
        _check_scalar_or_matrix("network.drop_rate", self.drop_rate, 0.0, 1.0, hi_open=True)
        _check_scalar_or_matrix("network.latency_ms", self.latency_ms, 0.0, math.inf, hi_open=True)
        _check_scalar_or_matrix("network.bandwidth_mbps", self.bandwidth_mbps, 0.0, math.inf,
                                lo_open=True, hi_open=True)
        self._check_regions()
        _check_range("network.burst_enter", self.burst_enter, 0.0, 1.0)
        _check_range("network.burst_exit", self.burst_exit, 0.0, 1.0, lo_open=True)
        _check_range("network.burst_drop_rate", self.burst_drop_rate, 0.0, 1.0)
        if isinstance(self.segment_bytes, bool) or not isinstance(self.segment_bytes, int) or self.segment_bytes < 0:
            raise ValueError(f"network.segment_bytes must be an integer >= 0 (0: one message per block), "
                             f"got {self.segment_bytes!r}")
        _check_range("network.retransmit_timeout_ms", self.retransmit_timeout_ms, 0.0, math.inf,
                     hi_open=True)
        if math.isnan(self.compute_ms) or math.isinf(self.compute_ms):
            raise ValueError(f"network.compute_ms must be a finite number, got {self.compute_ms!r}")
        _check_range("network.exchange_compute_ms", self.exchange_compute_ms, 0.0, math.inf, hi_open=True)

    def _check_regions(self) -> None:
        from shaky.network.presets import REGIONS  # noqa: PLC0415

        _check_range("network.wan_bandwidth_mbps", self.wan_bandwidth_mbps, 0.0, math.inf, lo_open=True,
                     hi_open=True)
        for k, region in enumerate(self.regions):
            _check_choice(f"network.regions[{k}]", region, REGIONS)
            if region in self.regions[:k]:
                raise ValueError(f"network.regions lists {region!r} twice")
        if self.regions:
            for name in ("latency_ms", "bandwidth_mbps"):
                if isinstance(getattr(self, name), tuple):
                    raise ValueError(f"network.{name} must be one number (the link inside a region) when "
                                     f"network.regions is set; got a matrix")
        elif self.wan_bandwidth_mbps != 100.0:
            raise ValueError(f"network.wan_bandwidth_mbps applies only with network.regions "
                             f"(got {self.wan_bandwidth_mbps!r} and no regions)")


DIST_TIMEOUT_S = 60.0
"""dist_timeout_s's default: how long a collective (and joining the process group) waits before it fails."""
MAX_DIST_TIMEOUT_S = 7 * 24 * 3600.0
"""dist_timeout_s's largest value, a week: every rank turns it into a timedelta and a store's milliseconds, which
overflow far above it (1e308 raised OverflowError in one rank while the others waited)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DistConfig:
    """The dist backend's data plane: how the exchanges' blocks travel between the torchrun processes."""

    transport: str = "gloo"
    """gloo: every block over gloo's TCP, losses drawn by the network model as in the simulator; udp: RPS's
    block averages as authenticated UDP datagrams, never resent, and the losses are what really arrived."""
    deadline_ms: float | str = "adaptive"
    """udp: each phase of an exchange closes when everything arrived or at this deadline; "adaptive": from the
    completion times of recent rounds, agreed across ranks (the first rounds wait up to 1 s)."""
    key_file: str = ""
    """udp: a file every node has, whose bytes (at least 16) key the datagrams' tags; empty: the environment
    variable SHAKY_KEY, else rank 0 makes a key for this run and hands it out through the rendezvous store."""
    ports: str = UDP_PORTS
    """udp: the UDP ports a rank may bind, "FIRST-LAST" (or one port); each rank binds the first free one. With
    live membership rank 0 also listens on the first free TCP port of the range (the control plane's store), and
    every rank binds the next free UDP port for its control rounds' datagrams."""
    host: str = ""
    """udp: this rank's IPv4 address as the others reach it (empty: the address this machine uses to reach
    MASTER_ADDR); datagrams are accepted only from the other ranks' addresses."""
    datagram_bytes: int = 1472
    """udp: UDP payload bytes of a full datagram (1472 fits a 1500-byte MTU); every rank the same."""
    send_rate_mbps: float = 0.0
    """udp: pace each rank's sending to this rate (0: unpaced)."""
    heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S
    """udp: a rank whose heartbeat (a thread beating every 0.25 s in the control plane's store) stops for this long is
    declared dead, and the survivors train on without it (its blocks move to the next live rank)."""
    emulate_latency: bool = False
    """udp, for tests and benchmarks on one machine: hold every datagram for the network model's one-way latency
    of its link (network.latency_ms, or a preset's regions) before it leaves, an application-level delay line;
    and each request of a control round (live membership) for the latency between the rank and rank 0, which
    hosts their store, before it goes and after its answer. Emulation: gloo's collectives are not delayed."""

    def __post_init__(self) -> None:
        _check_choice("dist.transport", self.transport, TRANSPORTS)
        if isinstance(self.deadline_ms, str):
            if self.deadline_ms != "adaptive":
                raise ValueError(f"dist.deadline_ms must be a positive number of milliseconds or \"adaptive\", "
                                 f"got {self.deadline_ms!r}")
        elif isinstance(self.deadline_ms, bool) or not isinstance(self.deadline_ms, (int, float)) or \
                not 0 < self.deadline_ms <= 3.6e6:  # NaN fails too
            raise ValueError(f"dist.deadline_ms must be a positive number of milliseconds (at most an hour) or "
                             f"\"adaptive\", got {self.deadline_ms!r}")
        if self.transport != "udp":
            defaults = DistConfig.__dataclass_fields__
            changed = [name for name in ("deadline_ms", "key_file", "ports", "host", "datagram_bytes",
                                         "send_rate_mbps", "emulate_latency", "heartbeat_timeout_s")
                       if getattr(self, name) != defaults[name].default]
            if changed:
                raise ValueError(f"dist.{changed[0]} = {getattr(self, changed[0])!r} applies only with "
                                 f"dist.transport = \"udp\" (got {self.transport!r})")
        self.port_range()
        if not UDP_OVERHEAD_BYTES + 8 <= self.datagram_bytes <= 65507:
            raise ValueError(f"dist.datagram_bytes must be in [{UDP_OVERHEAD_BYTES + 8}, 65507], "
                             f"got {self.datagram_bytes}")
        _check_range("dist.send_rate_mbps", self.send_rate_mbps, 0.0, 1e9, hi_open=True)
        _check_range("dist.heartbeat_timeout_s", self.heartbeat_timeout_s, 0.0, 3600.0, lo_open=True)
        if not isinstance(self.emulate_latency, bool):
            raise TypeError(f"dist.emulate_latency must be true or false, got {self.emulate_latency!r}")

    def port_range(self) -> range:
        """``ports`` as a range of port numbers."""
        first, sep, last = self.ports.partition("-")
        try:
            lo, hi = int(first), int(last) if sep else int(first)
        except ValueError:
            lo = hi = -1
        if not 1 <= lo <= hi <= 65535:
            raise ValueError(f"dist.ports must be FIRST-LAST (or one port) within 1-65535, got {self.ports!r}")
        return range(lo, hi + 1)

    @property
    def segment_bytes(self) -> int:
        """The segment each udp datagram carries: the unit of loss (``network.segment_bytes`` of a udp run)."""
        return self.datagram_bytes - UDP_OVERHEAD_BYTES


@dataclass(frozen=True, kw_only=True, slots=True)
class FailureConfig:
    worker: int
    """The worker that fails."""
    step: int
    """The first step it misses: from here on it neither computes nor sends."""
    rejoin: int = -1
    """The step at which it comes back with the live workers' average model; -1 = never."""
    restart: bool = False
    """It comes back as a new process (its memory lost): it also takes the live workers' average of the rest of
    its strategy state (momentum, moments), not only of the model. What a udp run's restarted rank does; false:
    it comes back with its own state, as a worker cut off by the network would."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    seed: int = 0
    """Seeds everything: data split, shards, initial model, mini-batches and the network."""
    num_workers: int = 8
    """Number of workers W (and, for RPS, of block servers)."""
    steps: int = 600
    """Training steps (rounds) per worker."""
    batch_size: int = 32
    """Mini-batch size per worker per step."""
    batch_sizes: tuple[int, ...] = ()
    """Heterogeneous mini-batch sizes, one per worker; empty = batch_size for every worker."""
    target_accuracy: float = 0.0
    """Test accuracy whose first crossing is reported as rounds_to_target (0 = off)."""
    failures: tuple[FailureConfig, ...] = ()
    """Worker failures: [[failures]] tables with worker, step and an optional rejoin step."""
    eval_every: int = 50
    """Evaluate (and write a metrics.jsonl line) every this many steps, and at the end."""
    checkpoint_every: int = 500
    """Write a resumable checkpoint every this many steps (0 = only the final one and the one written when
    SIGINT or SIGTERM stops the run; a SIGKILL then loses everything since the start)."""
    backend: str = "sim"
    """sim: all workers in this process; dist: one worker per process, started by torchrun (gloo)."""
    dist_timeout_s: float = DIST_TIMEOUT_S
    """dist backend: a collective that waits longer than this fails (a dead or hung rank); at most a week."""
    dtype: str = "float32"
    """Parameter precision: float32 or float64."""
    device: str = "cpu"
    """Where the tensors live: cpu, cuda or cuda:N. The data set moves there once; every worker's parameters and
    state, the exchanges and the evaluation run there. On the dist backend, cuda puts each rank on GPU
    LOCAL_RANK (mod the GPUs it sees)."""
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    dist: DistConfig = field(default_factory=DistConfig)

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        for name in ("steps", "batch_size", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.steps > MAX_STEPS:
            raise ValueError(f"steps must be at most {MAX_STEPS} (a billion), got {self.steps}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")
        _check_choice("backend", self.backend, BACKENDS)
        self._check_transport()
        _check_range("dist_timeout_s", self.dist_timeout_s, 0.0, MAX_DIST_TIMEOUT_S, lo_open=True)
        if self.batch_sizes and len(self.batch_sizes) != self.num_workers:
            raise ValueError(f"batch_sizes has {len(self.batch_sizes)} entries but num_workers is {self.num_workers}")
        if any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch_sizes must all be >= 1, got {list(self.batch_sizes)}")
        _check_range("target_accuracy", self.target_accuracy, 0.0, 1.0)
        self._check_failures()
        if self.strategy.redundancy > self.num_workers:
            raise ValueError(f"strategy.redundancy (q = {self.strategy.redundancy}) must be at most "
                             f"num_workers (p = {self.num_workers}): there are only p data chunks")
        _check_choice("dtype", self.dtype, DTYPES)
        if not isinstance(self.device, str) or not DEVICE_PATTERN.fullmatch(self.device):
            raise ValueError(f"device must be cpu, cuda or cuda:N (N a GPU's index); got {self.device!r}")
        if self.dtype == "float32":  # torch refuses a scalar factor that overflows the tensors' dtype
            for name, value in (("optim.lr", self.optim.lr), ("optim.weight_decay", self.optim.weight_decay),
                                ("optim.eps", self.optim.eps), ("strategy.outer_lr", self.strategy.outer_lr)):
                if value > FLOAT32_MAX:
                    raise ValueError(f"{name} must be at most {FLOAT32_MAX:.7g} (the largest float32; "
                                     f"dtype is float32), got {value!r}")
        fitting = models_for(self.data.dataset)
        if self.model.name not in fitting and not _is_factory(self.model.name):
            from shaky.data import SAMPLE_SHAPES  # noqa: PLC0415

            shape = SAMPLE_SHAPES[self.data.dataset]
            holds = ("byte sequences with next-byte targets" if self.data.dataset == "bytes" else "token ids"
                     if shape is None else f"{math.prod(shape)} features" if len(shape) == 1 else "images")
            reads = ("token ids" if self.model.name == "lstm" else "byte sequences (next-token prediction)"
                     if self.model.name == "gpt" else "images (or a square number of features)"
                     if self.model.name.startswith("resnet") else "features")
            raise ValueError(f"model.name {self.model.name!r} reads {reads} but data.dataset "
                             f"{self.data.dataset!r} holds {holds}; models for {self.data.dataset}: "
                             f"{', '.join(fitting)}")
        for name in ("drop_rate", "latency_ms", "bandwidth_mbps"):
            value = getattr(self.network, name)
            if isinstance(value, tuple) and len(value) != self.num_workers:
                raise ValueError(f"network.{name} is a {len(value)}x{len(value)} matrix but "
                                 f"num_workers is {self.num_workers}")


    def _check_transport(self) -> None:
        udp = self.dist.transport == "udp"
        if self.backend == "dist" and self.strategy.value_dtype and not udp:
            raise ValueError(f"strategy.value_dtype = {self.strategy.value_dtype!r} needs backend sim or "
                             "dist.transport udp: gloo's exchange sends values as the model holds them")
        if udp and self.backend != "dist":
            raise ValueError("dist.transport = \"udp\" needs backend dist (torchrun, one worker per process): the "
                             "simulator draws its losses from the network model")
        if self.backend == "dist" and not udp and self.network.segment_bytes:
            raise ValueError(f"network.segment_bytes = {self.network.segment_bytes} needs backend sim or "
                             "dist.transport udp: the gloo exchange loses whole blocks (set network.segment_bytes = 0)")
        if not udp:
            return
        net = self.network
        if net.segment_bytes not in (0, self.dist.segment_bytes):
            raise ValueError(f"network.segment_bytes = {net.segment_bytes} on the udp transport must be 0 or "
                             f"{self.dist.segment_bytes}, the segment of a {self.dist.datagram_bytes}-byte datagram "
                             "(dist.datagram_bytes - 52)")
        drawn = [(name, value) for name, value in (("drop_rate", net.drop_rate), ("burst_enter", net.burst_enter),
                                                    ("trace", net.trace)) if value]
        if drawn:
            name, value = drawn[0]
            raise ValueError(f"network.{name} = {value!r} is the simulator's drawn loss; on dist.transport udp the "
                             f"losses are what really arrives (leave network.{name} unset)")
        # The recorded masks are segment-level with the datagrams' segment: the config says so, and a replay of
        # this run's trace in the simulator reads it from there.
        object.__setattr__(self, "network", dataclasses.replace(net, segment_bytes=self.dist.segment_bytes))

    def worker_batch_sizes(self) -> tuple[int, ...]:
        """Each worker's mini-batch size: batch_sizes if given, else batch_size (times q with grow_batch)."""
        if self.batch_sizes:
            return self.batch_sizes
        grow = self.strategy.redundancy if self.strategy.grow_batch else 1
        return (self.batch_size * grow,) * self.num_workers

    def _check_failures(self) -> None:
        down: dict[int, list[tuple[int, int]]] = {}
        for k, f in enumerate(self.failures):
            name = f"failures[{k}]"
            if not 0 <= f.worker < self.num_workers:
                raise ValueError(f"{name}.worker must name a worker in [0, {self.num_workers}), got {f.worker}")
            if not 0 <= f.step < self.steps:
                raise ValueError(f"{name}.step must be in [0, steps = {self.steps}), got {f.step}")
            if f.rejoin != -1 and f.rejoin <= f.step:
                raise ValueError(f"{name}.rejoin ({f.rejoin}) must come after its failure step ({f.step}), "
                                 "or be -1 for never")
            if f.restart and f.rejoin == -1:
                raise ValueError(f"{name}.restart is true but the worker never rejoins (rejoin = -1)")
            end = f.rejoin if f.rejoin != -1 else self.steps
            for start, stop in down.get(f.worker, []):
                if f.step < stop and start < end:
                    raise ValueError(f"{name} overlaps another failure of worker {f.worker}")
            down.setdefault(f.worker, []).append((f.step, end))
        for step in sorted({f.step for f in self.failures}):
            if all(any(a <= step < b for a, b in down.get(w, [])) for w in range(self.num_workers)):
                raise ValueError(f"failures leave no live worker at step {step}")


# ---------------------------------------------------------------------------
# Building a RunConfig from nested dicts (TOML) with strict keys and types.

def _is_matrix_type(tp: Any) -> bool:
    return tp == Matrix or (typing.get_origin(tp) in (Union, types.UnionType) and Matrix in typing.get_args(tp))


def _convert(name: str, value: Any, tp: Any) -> Any:
    """Checks ``value`` against the annotation ``tp`` and converts lists to tuples."""
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise TypeError(f"{name} must be a table of settings, got {value!r}")
        return _build(tp, value, prefix=f"{name}.")
    if _is_matrix_type(tp):
        if isinstance(value, list):
            if not all(isinstance(r, list) for r in value):
                raise TypeError(f"{name} must be a number or a list of lists of numbers, got {value!r}")
            return tuple(tuple(_convert(f"{name}[{i}][{j}]", v, float) for j, v in enumerate(row))
                         for i, row in enumerate(value))
        return _convert(name, value, float)
    if tp == (float | str):
        return value if isinstance(value, str) else _convert(name, value, float)
    if tp is bool:
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a string, got {value!r}")
        return value
    if typing.get_origin(tp) is tuple:
        (item_tp, _ellipsis) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{name} must be a list, got {value!r}")
        return tuple(_convert(f"{name}[{i}]", v, item_tp) for i, v in enumerate(value))
    raise TypeError(f"{name}: unsupported setting type {tp!r}")  # a programming error, not user input


def _build(cls: type, values: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"{prefix}{unknown[0]} is not a setting (known in {prefix.rstrip('.') or 'the top level'}: "
                         f"{', '.join(sorted(names))})")
    if cls is NetworkConfig and values.get("preset"):
        from shaky.network.presets import PRESETS  # noqa: PLC0415

        preset = values["preset"]
        if not isinstance(preset, str) or preset not in PRESETS:
            raise ValueError(f"network.preset must be one of {', '.join(PRESETS)}; got {preset!r}")
        values = {**PRESETS[preset], **values}
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in values
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{prefix}{missing[0]} is required")
    kwargs = {k: _convert(f"{prefix}{k}", v, hints[k]) for k, v in values.items()}
    return cls(**kwargs)


def config_from_dict(values: dict[str, Any]) -> RunConfig:
    """Builds and validates a RunConfig from nested dicts; unknown keys and wrong types are errors."""
    return _build(RunConfig, values)


def load_toml(path: str | Path) -> dict[str, Any]:
    """Reads a TOML file into nested dicts, with errors that name the file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"config file {str(p)!r} cannot be read: {exc.strerror or exc}") from None
    except UnicodeError as exc:
        raise ValueError(f"config file {str(p)!r} is not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {str(p)!r} is not valid TOML: {exc}") from None


def set_dotted(values: dict[str, Any], key: str, value: Any) -> None:
    """Sets ``a.b.c = value`` inside nested dicts, creating tables on the way."""
    *parents, leaf = key.split(".")
    if not all((*parents, leaf)):
        raise ValueError(f"{key!r} is not a setting name (a dotted name such as network.drop_rate has no empty "
                         "parts)")
    node = values
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"{key}: {part} is a value, not a table")
        node = child
    node[leaf] = value


def parse_value(text: str) -> Any:
    """Parses a ``--set`` value as a TOML value (``0.1``, ``[1, 2]``, ``"x"``), else as a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as nested plain dicts/lists (tuples become lists), ready for TOML or JSON. A setting marked
    :data:`_UNSET_UNWRITTEN` is left out while it holds its default."""
    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)
                    if not (f.metadata.get("unset_unwritten") and getattr(v, f.name) == f.default)}
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        return v
    return plain(cfg)


def to_toml(cfg: RunConfig) -> str:
    """The resolved config as TOML text; reading it back gives an equal config."""
    return tomli_w.dumps(to_dict(cfg))


def replace(cfg: RunConfig, **changes: Any) -> RunConfig:
    """``dataclasses.replace`` that also accepts dotted keys (``network__drop_rate``) for nested sections."""
    values = to_dict(cfg)
    for key, value in changes.items():
        set_dotted(values, key.replace("__", "."), to_dict(value) if dataclasses.is_dataclass(value) else value)
    return config_from_dict(values)


MACHINE_SETTINGS = ("data.path", "network.trace", "dist.key_file", "dist.ports", "dist.host", "device")
"""Settings of a machine's own, not of the run: local paths, addresses and the device. They may differ between
the machines of one run, and between a run and its resume (data moved, another GPU); what the paths hold may not
(``shaky.setup.inputs_digest`` is compared instead)."""


def first_difference(mine: Any, theirs: Any, *, ignore: tuple[str, ...] = (),
                     name: str = "") -> tuple[str, Any, Any] | None:
    """The first setting (dotted name, in sorted order) whose value differs between two configs' dicts, with
    both values, or None; settings named in ``ignore`` are not compared."""
    if name in ignore:
        return None
    if isinstance(mine, dict) and isinstance(theirs, dict):
        for key in sorted({*mine, *theirs}):
            found = first_difference(mine.get(key), theirs.get(key), ignore=ignore,
                                     name=f"{name}.{key}" if name else key)
            if found is not None:
                return found
        return None
    return None if mine == theirs else (name, mine, theirs)


def machine_settings(cfg: RunConfig) -> dict[str, Any]:
    """``cfg``'s :data:`MACHINE_SETTINGS`, by dotted name."""
    out = {}
    for name in MACHINE_SETTINGS:
        value: Any = cfg
        for part in name.split("."):
            value = getattr(value, part)
        out[name] = value
    return out


def with_settings(cfg: RunConfig, settings: dict[str, Any]) -> RunConfig:
    """``cfg`` with the dotted ``settings`` set (checked as any config is: ValueError)."""
    values = to_dict(cfg)
    for name, value in settings.items():
        set_dotted(values, name, value)
    return config_from_dict(values)
