"""Everything a run needs, built and checked before anything is written, and how a run is evaluated.

``prepare`` does everything that can fail on user input (data, shards, model,
network, strategy) and raises ValueError naming the setting; ``evaluate`` and
``gradient_diversity`` are the metrics a run reports.
"""

from __future__ import annotations

import copy
import dataclasses
import fcntl
import math
import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from shaky.comm.base import Comm
from shaky.comm.quant import fine_length, value_format
from shaky.config import RunConfig
from shaky.data import Dataset, assign_chunks, load_dataset, partition
from shaky.models import FlatParams, build_model
from shaky.network.model import NetworkModel, TraceNetwork
from shaky.progress import say
from shaky.rundir import Trace, load_trace
from shaky.strategies import Strategy, build_strategy
from shaky.user import check_model, load_data, load_loss
from shaky.vectorized import make_functions, worker_logits


@dataclass
class Setup:
    """Everything a run needs, built and checked before anything is written."""

    cfg: RunConfig
    data: Dataset
    shards: list[np.ndarray]
    model: torch.nn.Module
    flat: FlatParams
    network: NetworkModel
    strategy: Strategy[Any]
    compute_ms: float
    dtype: torch.dtype
    device: torch.device
    grad_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    forward_fn: Callable[..., torch.Tensor] = field(repr=False)
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = field(default=None, repr=False)
    """Each sample's loss (``model.loss``); None: cross-entropy."""
    digests: dict[str, str] | None = field(default=None, repr=False)
    """:func:`inputs_digest`, once computed."""
    machines: dict[int, Any] = field(default_factory=dict, repr=False)
    """What each rank read on its own machine (settings, digests), by rank, for the run directory
    (``shaky.rundir.MACHINES_FILE``); the CLI fills it in."""


def cache_dir() -> Path:
    """Where shaky keeps what it measured on this machine: ``SHAKY_CACHE_DIR``, else ``$XDG_CACHE_HOME/shaky``,
    else ``~/.cache/shaky``."""
    if os.environ.get("SHAKY_CACHE_DIR"):
        return Path(os.environ["SHAKY_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "shaky"


COMPUTE_CACHE = "compute_ms.json"
_COMPUTE_MS: dict[str, float] = {}
"""This process's measurements, for when the cache file cannot be written."""


def measured_compute_ms(setup: Setup) -> float:
    """One worker's compute time per step on this machine, measured once and then read back.

    The simulated clock charges it for every step, so runs that should be identical must be charged the
    same: the first measurement (per data set, model, batch size, dtype, torch version and CPU) is kept in
    ``cache_dir()/compute_ms.json`` (under a lock, so a sweep's processes measure it once between them),
    and every later run, sweep or torch.distributed rank on the machine reads it. ``network.compute_ms``
    overrides it; delete the file to measure again.
    """
    cfg = setup.cfg
    key = json.dumps([cfg.data.dataset, str(Path(cfg.data.path).resolve()) if cfg.data.path else "",
                      cfg.model.name, cfg.model.hidden, cfg.batch_size, cfg.dtype, torch.__version__, _cpu_name()]
                     + [digest for digest in (cfg.data.sha256, cfg.model.sha256) if digest]   # an edited factory
                     + ([torch.cuda.get_device_name(setup.device)] if setup.device.type == "cuda" else []))
    if key in _COMPUTE_MS:
        return _COMPUTE_MS[key]
    path = cache_dir() / COMPUTE_CACHE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(COMPUTE_CACHE + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                known = json.loads(path.read_text())
                known = known if isinstance(known, dict) else {}
            except (OSError, ValueError):
                known = {}  # none yet, or damaged: measured again
            value = known.get(key)
            if not isinstance(value, float) or not value > 0:
                known[key] = value = _measure(setup)
                from shaky.rundir import write_json  # noqa: PLC0415

                write_json(path, known)
    except OSError as exc:  # a read-only home: measured per process, and said once
        value = _measure(setup)
        say(f"shaky: warning: cannot keep the measured compute time in {path} ({exc.strerror or exc}); "
            "runs in other processes measure their own (set network.compute_ms to fix it)")
    _COMPUTE_MS[key] = value
    return value


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _measure(setup: Setup) -> float:
    """Fastest of a few timed forward+backward passes of one worker at its batch size, on one thread.

    The minimum, not the mean, because everything else running on the machine only ever adds time; one
    thread, because a simulated worker stands for one device, as a sweep's process or a torchrun rank is.
    On a GPU: one worker's pass on the run's GPU, waited for.
    """
    cfg = setup.cfg
    params = setup.flat.flatten(setup.model)[None]
    n = min(cfg.batch_size, len(setup.data.y_train))
    x, y = setup.data.x_train[None, :n], setup.data.y_train[None, :n]
    mask = torch.ones(1, n, dtype=x.dtype if x.is_floating_point() else setup.dtype, device=x.device)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cuda = setup.device.type == "cuda"
    try:
        times = []
        for i in range(10):
            if cuda:
                torch.cuda.synchronize(setup.device)
            t0 = time.perf_counter()
            setup.grad_fn(params, x, y, mask)
            if cuda:
                torch.cuda.synchronize(setup.device)
            if i >= 3:  # the first calls pay for allocation and dispatch warm-up
                times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return float(min(times) * 1e3)


def _load_trace(cfg: RunConfig) -> Trace:
    """The masks of ``network.trace``, checked to be what a run of ``cfg``'s workers wrote: a file that is
    cut short, damaged or of another layout is a ValueError naming it, not a crash in the middle of the run."""
    path = cfg.network.trace
    try:
        trace = load_trace(path, cfg.num_workers, cfg.steps, segment_bytes=cfg.network.segment_bytes)
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever a damaged zip or array raises, the file is unusable
        raise ValueError(f"network.trace: cannot read a trace from {path!r} ({type(exc).__name__}: "
                         f"{' '.join(str(exc).split())[:120]})") from None
    plane = (cfg.num_workers * cfg.num_workers + 7) // 8  # one packed [W, W] plane per segment of a block
    for name, a in (("up", trace.up), ("down", trace.down)):
        if a.dtype != np.uint8 or a.ndim != 2 or not a.shape[1] or a.shape[1] % plane or a.shape != trace.up.shape:
            raise ValueError(f"network.trace {path!r}: {name} is {a.dtype} {list(a.shape)}, not the packed masks "
                             f"of {cfg.num_workers} workers (uint8 [rounds, S x {plane}], up and down alike); "
                             "the file is damaged or not a shaky trace")
    return trace


def _check_batches_fit(cfg: RunConfig, shards: list[np.ndarray]) -> None:
    """A worker's mini-batch must not be larger than its shard: the batch would hold the same samples twice."""
    sizes = cfg.worker_batch_sizes()
    worst = max(range(len(shards)), key=lambda w: sizes[w] - len(shards[w]))
    if sizes[worst] <= len(shards[worst]):
        return
    smallest = min(len(s) for s in shards)
    if cfg.batch_sizes:
        raise ValueError(f"batch_sizes[{worst}] = {sizes[worst]} is larger than worker {worst}'s shard "
                         f"({len(shards[worst])} samples): its batches would repeat samples")
    grown = f" x strategy.redundancy {cfg.strategy.redundancy} (grow_batch)" if cfg.strategy.grow_batch else ""
    raise ValueError(f"batch_size {cfg.batch_size}{grown} is larger than the smallest shard ({smallest} samples, "
                     f"{cfg.num_workers} workers on {cfg.data.dataset}): batches would repeat samples; "
                     f"use batch_size <= {smallest // (cfg.strategy.redundancy if grown else 1)} or fewer workers")


def resolve_device(name: str, local_rank: int | None = None) -> torch.device:
    """The torch device of the ``device`` setting (cpu, cuda or cuda:N), or a ValueError naming it where this
    machine has no such device. ``local_rank`` (a torchrun rank's LOCAL_RANK): plain cuda is GPU
    ``local_rank`` mod the GPUs this process sees, so that the ranks of one machine spread over its GPUs."""
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, no GPU visible"
        raise ValueError(f"device {name!r}: CUDA is not available here (torch {torch.__version__}, {build}); "
                         "use device cpu")
    count = torch.cuda.device_count()
    if ":" in name:
        index = int(name.split(":", 1)[1])
    else:
        index = (local_rank or 0) % count
    if index >= count:
        raise ValueError(f"device {name!r}: this machine has {count} CUDA device{'s' * (count != 1)} "
                         f"(cuda:0 to cuda:{count - 1})")
    return torch.device("cuda", index)


def deterministic_cuda() -> None:
    """Settings that make a GPU run give the same numbers every time (process-wide; called before the run
    touches the GPU): PyTorch's deterministic algorithms (warning, not failing, for an operation that has
    none), cuDNN without its timing-based choice of algorithms, and the cuBLAS workspace size that makes its
    reductions deterministic. Memory PyTorch allocates uninitialised is not filled: shaky writes all it
    allocates, and filling would cost a kernel per allocation."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    torch.backends.cudnn.benchmark = False


def dataset_on(data: Dataset, device: torch.device) -> Dataset:
    """The data set's tensors moved to ``device`` once (the run then indexes its batches there)."""
    if device.type == "cpu":
        return data
    return dataclasses.replace(data, x_train=data.x_train.to(device), y_train=data.y_train.to(device),
                               x_test=data.x_test.to(device), y_test=data.y_test.to(device))


def prepare(cfg: RunConfig, *, measure: bool = True, local_rank: int | None = None,
            model: torch.nn.Module | None = None, data: Dataset | None = None,
            loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> Setup:
    """Loads data, cuts shards, builds the model, network and strategy; raises ValueError on bad input.

    Without ``measure`` a compute time that is not set stays -1 for the caller to fill in (the dist
    backend: rank 0 reads or measures it, and every rank takes rank 0's). ``local_rank``: see
    :func:`resolve_device`. ``model`` and ``data``: a model and a data set given as objects
    (:func:`shaky.simulate`; ``cfg`` names them ``object:...``): a copy of the model is trained, from its own
    parameters, and the data's splits are the user's. A model that is not one of shaky's own (a factory's, an
    object) is checked by :func:`shaky.user.check_model`: the simulator must be able to vectorize it. ``loss``:
    each sample's loss given as an object (``shaky.simulate``); None: the one ``model.loss`` names, if any."""
    dtype = getattr(torch, cfg.dtype)
    device = resolve_device(cfg.device, local_rank)
    if device.type == "cuda":
        deterministic_cuda()
        torch.cuda.set_device(device)
    data = read_data(cfg, data)
    sequences = data.y_train.dim() > 1     # a target per position: next-token prediction
    if sequences and cfg.data.partition != "iid":
        raise ValueError(f"data.partition {cfg.data.partition!r} cuts by class label; data.dataset "
                         f"{cfg.data.dataset!r} has a target per position (use iid)")
    # iid draws only a permutation of the samples: a next-token set's shards need no labels.
    labels = data.y_train.numpy() if not sequences else np.zeros(len(data.y_train), dtype=np.int64)
    chunks = partition(labels, cfg.num_workers, kind=cfg.data.partition, seed=cfg.seed,
                       alpha=cfg.data.dirichlet_alpha)
    shards = assign_chunks(chunks, cfg.strategy.redundancy)
    _check_batches_fit(cfg, shards)
    data = dataset_on(data, device)
    if model is None:
        model = build_model(cfg.model.name, input_shape=data.input_shape, num_classes=data.num_classes,
                            vocab_size=data.vocab_size, hidden=cfg.model.hidden, seed=cfg.seed)
    else:   # the user's object stays as it was: the run trains a copy
        model = copy.deepcopy(model)
    model = model.to(device, dtype)
    flat = FlatParams(model)
    if cfg.network.trace:
        network: NetworkModel = TraceNetwork(cfg.network, cfg.num_workers, cfg.seed, *_load_trace(cfg))
    else:  # the message size sets how many segments a block has (network.segment_bytes)
        seg = fine_length(cfg.network.segment_bytes, dtype.itemsize, value_format(cfg.strategy.value_dtype))
        network = NetworkModel(cfg.network, cfg.num_workers, cfg.seed, dim=flat.dim, itemsize=dtype.itemsize,
                               seg_len=seg)
    if loss is None and cfg.model.loss:
        loss = load_loss(cfg.model.loss)
    grad_fn, forward_fn = make_functions(model, flat, loss=loss)
    if ":" in cfg.model.name or loss is not None:     # the user's code: can the simulator vectorize it?
        check_model(cfg.model.name, model, data, grad_fn, forward_fn, flat, loss, cfg.model.loss)
    setup = Setup(cfg, data, shards, model, flat, network, build_strategy(cfg), cfg.network.compute_ms,
                  dtype, device, grad_fn, forward_fn, loss=loss)
    if setup.compute_ms < 0 and measure:
        setup.compute_ms = measured_compute_ms(setup)
    return setup


def read_data(cfg: RunConfig, data: Dataset | None = None) -> Dataset:
    """The run's data set as it trains on it: ``data`` (an object given to :func:`shaky.simulate`), a factory's
    (shaky.user, called under the seed) or a built-in set (split by the seed), features in the run's dtype."""
    if data is None and ":" in cfg.data.dataset:
        data = load_data(cfg.data.dataset, cfg.seed)
    if data is None:
        data = load_dataset(cfg.data.dataset, seed=cfg.seed, path=cfg.data.path,
                            test_fraction=cfg.data.test_fraction, max_len=cfg.data.max_len)
    if data.x_train.is_floating_point():
        dtype = getattr(torch, cfg.dtype)
        data = dataclasses.replace(data, x_train=data.x_train.to(dtype), x_test=data.x_test.to(dtype))
    return data


def _digest(*arrays: torch.Tensor | np.ndarray, meta: object) -> str:
    h = hashlib.sha256(json.dumps(meta).encode())
    for a in arrays:
        t = torch.as_tensor(a).detach().cpu().contiguous()
        h.update(f"{t.dtype}{list(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def data_digest(d: Dataset) -> str:
    """SHA-256 of a data set as a run trains on it (train and test, and what describes them): the ``data`` entry
    of :func:`inputs_digest`."""
    return _digest(d.x_train, d.y_train, d.x_test, d.y_test,
                   meta=[d.name, list(d.input_shape), d.num_classes, d.vocab_size, list(d.classes)])


def inputs_digest(setup: Setup) -> dict[str, str]:
    """SHA-256 of what this machine read for the run from its own files and libraries, by setting: ``data`` (the
    data set after loading and splitting, train and test: another copy of a CIFAR-10 directory or text file, or
    another scikit-learn's or mnist1d's set, differs) and, where one is replayed, ``network.trace`` (its masks).
    The dist backend compares every rank's with rank 0's, since these paths may differ between machines.
    Computed once per setup."""
    if setup.digests is not None:
        return dict(setup.digests)

    out = {"data": data_digest(setup.data)}
    if isinstance(setup.network, TraceNetwork):
        out["network.trace"] = _digest(*setup.network.packed, meta="trace")
    setup.digests = out
    return dict(out)


def gradient_diversity(grads: torch.Tensor, comm: Comm, weights: torch.Tensor | None) -> float:
    """sum_i ||g_i||^2 / ||sum_i g_i||^2 over the live workers (Yin et al. 2018): 1/n for equal gradients."""
    return start_gradient_diversity(grads, comm, weights)()


def start_gradient_diversity(grads: torch.Tensor, comm: Comm,
                             weights: torch.Tensor | None) -> Callable[[], float]:
    """:func:`gradient_diversity`, started: its two means are deferred (with live membership they ride in the
    next control round, an evaluation's, instead of a round each); the function returned waits for them."""
    n = comm.num_workers if weights is None else float(weights.sum())
    mean_sq = comm.start_mean(grads.pow(2).sum(dim=1, keepdim=True), weights, deferred=True)
    mean_grad = comm.start_mean(grads, weights, deferred=True)
    return lambda: float(mean_sq.wait()[0, 0] / (n * mean_grad.wait()[0].pow(2).sum()))


def evaluate(setup: Setup, params: torch.Tensor, comm: Comm, weights: torch.Tensor | None = None,
             chunk: int = 2048) -> dict[str, float]:
    """Test metrics of the averaged model and of each worker, and the consensus distance (over live workers).
    Two rounds of means: the model's with the workers' accuracies (and any other deferred mean, a gradient
    diversity's), then the consensus distance, which needs the first.

    With a target per position (next-token prediction) accuracy and loss are per token, ``chunk`` counts tokens,
    and ``test_perplexity`` (exp of the test loss) is reported too. A loss of the user's (``model.loss``) is its
    mean over the test samples, and no perplexity (it need not be a log-likelihood)."""
    x, y = setup.data.x_test, setup.data.y_test
    targets = y.numel()                          # len(y) for a classifier
    chunk = max(1, chunk // max(1, targets // len(y)))
    worker_correct = torch.zeros(params.shape[0], dtype=torch.float64, device=params.device)
    per_worker = worker_logits(setup.grad_fn, setup.forward_fn)
    with torch.no_grad():
        for s in range(0, len(y), chunk):
            hits = per_worker(params, x[s:s + chunk]).argmax(-1) == y[s:s + chunk]
            worker_correct += hits.flatten(1).sum(dim=1).double()
    started = comm.start_mean(params, weights, deferred=True)
    worker_acc = comm.start_mean((worker_correct / targets)[:, None], weights, deferred=True)
    mean = started.wait()[:1]
    consensus = comm.mean((params - mean).pow(2).sum(dim=1, keepdim=True), weights)[0, 0]
    avg_correct = avg_loss = 0.0
    with torch.no_grad():
        for s in range(0, len(y), chunk):
            xs, ys = x[s:s + chunk], y[s:s + chunk]
            out = setup.forward_fn(mean[0], xs)
            if setup.loss is None:
                avg_loss += float(F.cross_entropy(out.flatten(0, -2), ys.reshape(-1), reduction="sum"))
            else:
                avg_loss += float(setup.loss(out, ys).sum())
            avg_correct += float((out.argmax(-1) == ys).sum())
    row = {"test_accuracy": avg_correct / targets,
           "test_loss": avg_loss / (targets if setup.loss is None else len(y)),
           "worker_test_accuracy": float(worker_acc.wait()[0, 0]), "consensus_distance": float(consensus)}
    if y.dim() > 1 and setup.loss is None:
        loss = row["test_loss"]     # exp overflows a float past 709; NaN stays NaN
        row["test_perplexity"] = math.exp(loss) if loss < 700 else math.inf if loss > 0 else loss
    return row
