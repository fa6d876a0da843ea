"""Data sets and their partition across workers.

Every data set here is available offline: the small sets scikit-learn bundles are read from its files,
MNIST-1D is generated locally, and CIFAR-10, the text set and the bytes set are read from a
user-supplied path (:func:`synthetic_text` writes a text that is the same on every machine). A data set may
also come from the user's own factory (``shaky.user``, called by ``shaky.setup.prepare``). All randomness (splits, shards) flows from a ``seed``.
"""

from __future__ import annotations

import csv
import gzip
import importlib.util
import math
import os
import pickle
import random
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

DATASETS: tuple[str, ...] = ("digits", "iris", "wine", "breast_cancer", "mnist1d", "cifar10", "text", "bytes")
READS_PATH: tuple[str, ...] = ("cifar10", "text", "bytes")
"""The data sets read from ``data.path``."""
PARTITIONS: tuple[str, ...] = ("iid", "dirichlet", "label-skew")
SAMPLE_SHAPES: dict[str, tuple[int, ...] | None] = {
    "digits": (64,), "iris": (4,), "wine": (13,), "breast_cancer": (30,), "mnist1d": (40,), "cifar10": (3, 32, 32),
    "text": None, "bytes": None,
}
"""Each data set's ``input_shape`` as ``load_dataset`` returns it, known before loading (the config checks
which models fit); None for text and bytes, whose samples are ``max_len`` token ids."""
BYTE_VOCAB = 256
"""The bytes data set's tokens: every byte value."""

PAD_ID = 0
UNK_ID = 1

_SKLEARN_FILES: dict[str, str] = {
    "digits": "digits.csv.gz",
    "iris": "iris.csv",
    "wine": "wine_data.csv",
    "breast_cancer": "breast_cancer.csv",
}
"""The small sets scikit-learn bundles: their files in its package, read without importing it (see _bundled)."""
_CIFAR_HINT = "a CIFAR-10 directory (data_batch_1..5, test_batch)"
# Generating MNIST-1D takes a couple of seconds; one process does it once.
_MNIST1D_CACHE: dict[str, tuple[np.ndarray, np.ndarray]] = {}


@dataclass(frozen=True, slots=True)
class Dataset:
    """A train/test split ready for training.

    Attributes:
        name: Data set name, one of ``DATASETS``.
        x_train: Float32 features ``[N, *input_shape]``; for text, int64 token
            ids ``[N, max_len]`` with 0 as padding; for bytes, int64 bytes ``[N, max_len]``.
        y_train: Int64 labels ``[N]``; for next-token prediction (bytes), a target
            per position ``[N, max_len]`` (the next byte).
        x_test: Test features, same layout as ``x_train``.
        y_test: Int64 test labels.
        input_shape: Per-sample shape, e.g. ``(64,)`` or ``(3, 32, 32)``.
        num_classes: Number of classes.
        vocab_size: Text only: number of token ids, including padding and unknown.
        classes: Class names (text labels, otherwise ``str(i)``).
    """

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    input_shape: tuple[int, ...]
    num_classes: int
    vocab_size: int = 0
    classes: tuple[str, ...] = ()


def load_dataset(
    name: str, *, seed: int, path: str = "", test_fraction: float = 0.2, max_len: int = 32
) -> Dataset:
    """Loads a data set and splits it into train and test by ``seed``.

    Args:
        name: One of ``DATASETS``.
        seed: Seed of the train/test split (ignored by cifar10's fixed split).
        path: CIFAR-10 directory or text file; unused by the other sets.
        test_fraction: Fraction of samples held out for testing, in (0, 1);
            ignored by cifar10, which ships its own test split.
        max_len: Text: token ids per sentence after truncation/padding; bytes: the context, bytes per sample.

    Returns:
        The loaded ``Dataset``.

    Raises:
        ValueError: If any argument is invalid or the data cannot be read.
        TypeError: If an argument has the wrong type.
    """
    if name not in DATASETS:
        raise ValueError(f"data.dataset must be one of {', '.join(DATASETS)}; got {name!r}")
    _check_seed(seed)
    if isinstance(test_fraction, bool) or not isinstance(test_fraction, (int, float)):
        raise TypeError(f"data.test_fraction must be a number; got {test_fraction!r}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"data.test_fraction must be in (0, 1); got {test_fraction!r}")
    if isinstance(max_len, bool) or not isinstance(max_len, int):
        raise TypeError(f"data.max_len must be an integer; got {max_len!r}")
    if max_len < 1:
        raise ValueError(f"data.max_len must be >= 1; got {max_len}")
    if name in _SKLEARN_FILES:
        x, y = _bundled(name)
        return _dense(name, *_split(x, y, test_fraction, seed, stratify=True))
    if name == "mnist1d":
        x, y = _mnist1d()
        return _dense(name, *_split(x, y, test_fraction, seed, stratify=True), standardize=False)
    if name == "cifar10":
        return _load_cifar10(path)
    if name == "bytes":
        return _load_bytes(path, test_fraction, max_len)
    return _load_text(path, seed, test_fraction, max_len)


def partition(
    labels: np.ndarray, num_workers: int, *, kind: str = "iid", seed: int, alpha: float = 0.5
) -> list[np.ndarray]:
    """Splits the training indices among workers.

    Args:
        labels: Integer training labels ``[N]``.
        num_workers: Number of shards, between 1 and ``N``.
        kind: ``"iid"`` (uniform random), ``"dirichlet"`` (label proportions drawn
            from Dirichlet(alpha)) or ``"label-skew"`` (samples sorted by label, ties
            in random order, cut into equal contiguous chunks: each chunk holds one
            or two classes when there are about as many chunks as classes).
        seed: Seed of every random choice.
        alpha: Dirichlet concentration; smaller means more skew.

    Returns:
        One sorted int64 index array per worker; the arrays are disjoint, cover
        ``range(N)`` and none is empty.

    Raises:
        ValueError: If an argument is out of range.
        TypeError: If ``num_workers`` is not an integer.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be one-dimensional; got shape {labels.shape}")
    if isinstance(num_workers, bool) or not isinstance(num_workers, (int, np.integer)):
        raise TypeError(f"num_workers must be an integer; got {num_workers!r}")
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1; got {num_workers}")
    n = len(labels)
    if num_workers > n:
        raise ValueError(
            f"num_workers ({num_workers}) is larger than the number of training samples ({n}) "
            "of the data set; every worker needs at least one sample"
        )
    if kind not in PARTITIONS:
        raise ValueError(f"data.partition must be one of {', '.join(PARTITIONS)}; got {kind!r}")
    # Validated even for iid so that a bad config fails whichever partition it picks.
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (
        math.isfinite(alpha) and alpha > 0
    ):
        raise ValueError(f"data.dirichlet_alpha must be a finite number > 0; got {alpha!r}")
    _check_seed(seed)
    rng = np.random.default_rng(seed)
    if kind == "iid":
        shards = np.array_split(rng.permutation(n), num_workers)
    elif kind == "label-skew":
        order = rng.permutation(n)
        shards = np.array_split(order[np.argsort(labels[order], kind="stable")], num_workers)
    else:
        parts: list[list[np.ndarray]] = [[] for _ in range(num_workers)]
        for c in np.unique(labels):
            idx = rng.permutation(np.flatnonzero(labels == c))
            props = rng.dirichlet(np.full(num_workers, float(alpha)))
            cuts = (np.cumsum(props)[:-1] * len(idx)).astype(np.int64)
            for w, piece in enumerate(np.split(idx, cuts)):
                parts[w].append(piece)
        shards = [np.concatenate(p) for p in parts]
        # A worker with no data cannot take a step; since num_workers <= N the
        # largest shard always has a sample to spare.
        for w in range(num_workers):
            if len(shards[w]) == 0:
                big = int(np.argmax([len(s) for s in shards]))
                shards[w], shards[big] = shards[big][-1:], shards[big][:-1]
    return [np.sort(s).astype(np.int64) for s in shards]


def assign_chunks(chunks: list[np.ndarray], redundancy: int) -> list[np.ndarray]:
    """RI-SGD's cyclic redundancy: worker i holds chunks i, i+1, ..., i+q-1 (mod p), as in the authors' code.

    Every chunk then lives on exactly q workers, so up to q - 1 failed workers lose no data.
    """
    p = len(chunks)
    if not 1 <= redundancy <= p:
        raise ValueError(f"strategy.redundancy must be in [1, {p}] (the number of chunks), got {redundancy}")
    return [np.sort(np.concatenate([chunks[(i + k) % p] for k in range(redundancy)])) for i in range(p)]


def coverage(shards: list[np.ndarray], live: np.ndarray, num_samples: int) -> float:
    """Fraction of the training samples held by at least one live worker."""
    held = np.zeros(num_samples, dtype=bool)
    for shard, alive in zip(shards, live):
        if alive:
            held[shard] = True
    return float(held.mean())


def shard_summary(shards: list[np.ndarray], labels: np.ndarray, num_classes: int) -> list[dict]:
    """Describes each worker's shard in plain Python types, for a run directory.

    Args:
        shards: Index arrays as returned by ``partition``.
        labels: Training labels the indices refer to.
        num_classes: Length of each ``class_counts`` list.

    Returns:
        Per worker ``{"worker": i, "num_samples": n, "class_counts": [...]}`` (next-token targets: the
        count of every target position's class).
    """
    labels = np.asarray(labels)
    out = []
    for i, shard in enumerate(shards):
        counts = np.bincount(labels[shard].reshape(-1), minlength=num_classes)   # bytes: every position's target
        out.append({"worker": i, "num_samples": int(len(shard)), "class_counts": [int(c) for c in counts]})
    return out


def _check_seed(seed: int) -> None:
    # numpy rejects negative seeds, with a less helpful message.
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an integer; got {seed!r}")
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32); got {seed}")


def _bundled(name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(x float64 [N, F], y int [N])`` of a set scikit-learn bundles, read from its package's data files as
    ``sklearn.datasets.load_*(return_X_y=True)`` reads them (the same arrays; ``tests/test_data.py`` checks),
    without importing scikit-learn: that import is 1.2 s of the start of every process that trains."""
    spec = importlib.util.find_spec("sklearn")     # finds the package without running it
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"data.dataset {name!r} is read from scikit-learn's bundled copy; scikit-learn is not "
                         f"installed (pip install -e .)")
    path = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / _SKLEARN_FILES[name]
    if name == "digits":   # one row a sample: 64 pixels, then the digit
        with gzip.open(path, "rt", encoding="utf-8") as f:
            data = np.loadtxt(f, delimiter=",")
        return data[:, :-1], data[:, -1].astype(int, copy=False)
    with open(path, encoding="utf-8") as f:   # a header (samples, features, class names), then the rows
        rows = csv.reader(f)
        head = next(rows)
        x = np.empty((int(head[0]), int(head[1])))
        y = np.empty((int(head[0]),), dtype=int)
        for i, row in enumerate(rows):
            x[i] = np.asarray(row[:-1], dtype=np.float64)
            y[i] = np.asarray(row[-1], dtype=int)
    return x, y


def _split(
    x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int, *, stratify: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Seeded train/test split; returns ``x_train, y_train, x_test, y_test``.

    scikit-learn's ``train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=y or None)``,
    written out (the same indices from the same draws of ``RandomState(seed)``; ``tests/test_data.py`` checks
    it against scikit-learn), so that no run imports scikit-learn.
    """
    n = len(y)
    n_test = math.ceil(test_fraction * n)
    n_train = n - n_test

    def refuse(reason: str) -> ValueError:
        return ValueError(f"data.test_fraction {test_fraction!r} cannot split {n} samples: {reason}")

    if n_train <= 0:
        raise refuse(f"the train set would be empty ({n_test} test samples)")
    rng = np.random.RandomState(seed)
    if not stratify:
        order = rng.permutation(n)
        test, train = order[:n_test], order[n_test:]
    else:
        classes, y_index, counts = np.unique(y, return_inverse=True, return_counts=True)
        if counts.min() < 2:
            raise refuse(f"classes {classes[counts < 2].tolist()} have 1 sample; a stratified split needs 2")
        if n_train < len(classes) or n_test < len(classes):
            raise refuse(f"{n_train} train and {n_test} test samples cannot each hold all {len(classes)} classes")
        members = np.split(np.argsort(y_index, kind="stable"), np.cumsum(counts)[:-1])
        n_i = _approximate_mode(counts, n_train, rng)
        t_i = _approximate_mode(counts - n_i, n_test, rng)
        train_parts, test_parts = [], []
        for i in range(len(classes)):
            mine = members[i][rng.permutation(counts[i])]
            train_parts.append(mine[:n_i[i]])
            test_parts.append(mine[n_i[i]:n_i[i] + t_i[i]])
        train = rng.permutation(np.concatenate(train_parts))
        test = rng.permutation(np.concatenate(test_parts))
    return x[train], y[train], x[test], y[test]


def _approximate_mode(counts: np.ndarray, draws: int, rng: np.random.RandomState) -> np.ndarray:
    """How many of ``draws`` samples each class gives: its share, rounded down, and the rest one each to the
    classes with the largest remainders (ties broken by ``rng``), as scikit-learn's stratified split does."""
    continuous = counts / counts.sum() * draws
    floored = np.floor(continuous)
    need = int(draws - floored.sum())
    if need > 0:
        remainder = continuous - floored
        for value in np.sort(np.unique(remainder))[::-1]:
            (inds,) = np.where(remainder == value)
            now = min(len(inds), need)
            floored[rng.choice(inds, size=now, replace=False)] += 1
            need -= now
            if need == 0:
                break
    return floored.astype(int)


def _standardize(train: np.ndarray, test: np.ndarray, axis: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Scales both splits with the train statistics so no test information leaks."""
    mean = train.mean(axis=axis, keepdims=True)
    std = train.std(axis=axis, keepdims=True)
    std[std == 0] = 1.0  # constant features (e.g. digits' border pixels) stay at zero
    return (train - mean) / std, (test - mean) / std


def _dense(
    name: str,
    x_tr: np.ndarray,
    y_tr: np.ndarray,
    x_te: np.ndarray,
    y_te: np.ndarray,
    standardize: bool = True,
) -> Dataset:
    """Builds a ``Dataset`` of flat float features."""
    x_tr, x_te = x_tr.astype(np.float64), x_te.astype(np.float64)
    if standardize:
        x_tr, x_te = _standardize(x_tr, x_te, axis=(0,))
    num_classes = int(max(y_tr.max(), y_te.max())) + 1
    return Dataset(
        name=name,
        x_train=torch.from_numpy(x_tr.astype(np.float32)),
        y_train=torch.from_numpy(y_tr.astype(np.int64)),
        x_test=torch.from_numpy(x_te.astype(np.float32)),
        y_test=torch.from_numpy(y_te.astype(np.int64)),
        input_shape=tuple(x_tr.shape[1:]),
        num_classes=num_classes,
        classes=tuple(str(i) for i in range(num_classes)),
    )


def _mnist1d() -> tuple[np.ndarray, np.ndarray]:
    """Generates the canonical MNIST-1D (train and test merged), once per process."""
    if "data" not in _MNIST1D_CACHE:
        if "matplotlib.pyplot" not in sys.modules:
            import matplotlib

            # mnist1d imports pyplot; a headless run must not need a display.
            matplotlib.use("Agg")
        from mnist1d.data import get_dataset_args, make_dataset

        # make_dataset reseeds numpy's and Python's global generators (to its
        # canonical seed 42); put them back so callers see no side effect.
        np_state, py_state = np.random.get_state(), random.getstate()
        try:
            raw = make_dataset(get_dataset_args())
        finally:
            np.random.set_state(np_state)
            random.setstate(py_state)
        x = np.concatenate([raw["x"], raw["x_test"]])
        y = np.concatenate([raw["y"], raw["y_test"]]).astype(np.int64)
        _MNIST1D_CACHE["data"] = (x, y)
    return _MNIST1D_CACHE["data"]


def _read_cifar_batch(path: str, fname: str) -> tuple[np.ndarray, np.ndarray]:
    """Reads one CIFAR-10 python batch as ``uint8 [n, 3072]`` and ``int64 [n]``."""
    try:
        with open(os.path.join(path, fname), "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        data = np.asarray(batch[b"data"])
        labels = np.asarray(batch[b"labels"], dtype=np.int64)
    except Exception as err:  # unreadable, truncated or not a CIFAR pickle
        raise ValueError(
            f"data.path {path!r}: cannot read {fname} as a CIFAR-10 batch ({type(err).__name__}: {err})"
        ) from err
    if data.ndim != 2 or data.shape[1] != 3072 or labels.shape != (len(data),):
        raise ValueError(
            f"data.path {path!r}: {fname} has data of shape {data.shape} and {labels.size} labels; "
            "expected [n, 3072] and n labels"
        )
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise ValueError(f"data.path {path!r}: {fname} has labels outside 0..9")
    return data, labels


def _load_cifar10(path: str) -> Dataset:
    """Loads CIFAR-10 from its python-format directory, normalized per channel."""
    if not path:
        raise ValueError(f"data.path must point to {_CIFAR_HINT} for dataset cifar10; got {path!r}")
    if not os.path.isdir(path):
        raise ValueError(f"data.path must point to {_CIFAR_HINT}; {path!r} is not a directory")
    names = [f"data_batch_{i}" for i in range(1, 6)]
    train_files = [f for f in names if os.path.isfile(os.path.join(path, f))]
    missing = [] if train_files else ["all of data_batch_1..5"]
    if not os.path.isfile(os.path.join(path, "test_batch")):
        missing.append("test_batch")
    if missing:
        raise ValueError(f"data.path {path!r} is not {_CIFAR_HINT}: missing {', '.join(missing)}")
    batches = [_read_cifar_batch(path, f) for f in train_files]
    x_te, y_te = _read_cifar_batch(path, "test_batch")
    x_tr = np.concatenate([b[0] for b in batches])
    y_tr = np.concatenate([b[1] for b in batches])
    if len(x_tr) == 0 or len(x_te) == 0:
        raise ValueError(f"data.path {path!r}: CIFAR-10 train or test batches are empty")

    def to_images(d: np.ndarray) -> np.ndarray:
        return d.reshape(-1, 3, 32, 32).astype(np.float32) / 255.0

    x_tr, x_te = _standardize(to_images(x_tr), to_images(x_te), axis=(0, 2, 3))
    return Dataset(
        name="cifar10",
        x_train=torch.from_numpy(np.ascontiguousarray(x_tr, dtype=np.float32)),
        y_train=torch.from_numpy(y_tr),
        x_test=torch.from_numpy(np.ascontiguousarray(x_te, dtype=np.float32)),
        y_test=torch.from_numpy(y_te),
        input_shape=(3, 32, 32),
        num_classes=10,
        classes=tuple(str(i) for i in range(10)),
    )


def _load_text(path: str, seed: int, test_fraction: float, max_len: int) -> Dataset:
    """Loads a ``label<TAB>text`` file as padded token ids with a train vocabulary."""
    if not path:
        raise ValueError(f"data.path must point to a 'label<TAB>text' file for dataset text; got {path!r}")
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeError) as err:
        raise ValueError(f"data.path {path!r} cannot be read as UTF-8 text: {err}") from err
    texts: list[list[str]] = []
    names: list[str] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        label, sep, text = line.partition("\t")
        if not sep or not label.strip():
            raise ValueError(
                f"data.path {path!r} line {lineno}: expected 'label<TAB>text'; got {line[:80]!r}"
            )
        names.append(label.strip())
        texts.append(text.lower().split())
    if len(texts) < 2:
        raise ValueError(f"data.path {path!r} has {len(texts)} samples; need at least 2")
    classes = tuple(sorted(set(names)))
    class_id = {c: i for i, c in enumerate(classes)}
    y = np.array([class_id[n] for n in names], dtype=np.int64)
    # Stratify only where the split can: every class needs a sample on each side.
    n_test = math.ceil(test_fraction * len(y))
    counts = np.bincount(y)
    stratify = counts.min() >= 2 and min(n_test, len(y) - n_test) >= len(classes)
    idx_tr, y_tr, idx_te, y_te = _split(np.arange(len(y)), y, test_fraction, seed, stratify=stratify)
    freq = Counter(tok for i in idx_tr for tok in texts[i])
    vocab = {tok: i + 2 for i, (tok, _) in enumerate(sorted(freq.items(), key=lambda kv: (-kv[1], kv[0])))}

    def encode(indices: np.ndarray) -> torch.Tensor:
        out = np.full((len(indices), max_len), PAD_ID, dtype=np.int64)
        for row, i in enumerate(indices):
            ids = [vocab.get(tok, UNK_ID) for tok in texts[i]] or [UNK_ID]
            out[row, : min(len(ids), max_len)] = ids[:max_len]
        return torch.from_numpy(out)

    return Dataset(
        name="text",
        x_train=encode(idx_tr),
        y_train=torch.from_numpy(y_tr),
        x_test=encode(idx_te),
        y_test=torch.from_numpy(y_te),
        input_shape=(max_len,),
        num_classes=len(classes),
        vocab_size=len(vocab) + 2,
        classes=classes,
    )


def _load_bytes(path: str, test_fraction: float, max_len: int) -> Dataset:
    """A file's bytes as next-byte prediction: sample i is the window of ``max_len`` bytes at ``i * max_len``, its
    targets the same window one byte on. The test split is the file's last windows (``test_fraction`` of them),
    as nanoGPT holds out the end of its text: neighbouring windows share their context, so a split at random
    would test on text the training saw the rest of."""
    if not path:
        raise ValueError(f"data.path must point to a file for dataset bytes; got {path!r}")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as err:
        raise ValueError(f"data.path {path!r} cannot be read: {err.strerror or err}") from err
    n = (len(raw) - 1) // max_len if raw else 0
    n_test = math.ceil(test_fraction * n)
    if n - n_test < 1 or n_test < 1:
        raise ValueError(f"data.path {path!r} holds {len(raw)} bytes: {n} windows of data.max_len {max_len} + 1 "
                         f"bytes, too few to hold out data.test_fraction {test_fraction!r} and train on the rest")
    data = np.frombuffer(raw, dtype=np.uint8).astype(np.int64)
    x = torch.from_numpy(data[: n * max_len].reshape(n, max_len).copy())
    y = torch.from_numpy(data[1: n * max_len + 1].reshape(n, max_len).copy())
    cut = n - n_test
    return Dataset(name="bytes", x_train=x[:cut].clone(), y_train=y[:cut].clone(), x_test=x[cut:].clone(),
                   y_test=y[cut:].clone(), input_shape=(max_len,), num_classes=BYTE_VOCAB, vocab_size=BYTE_VOCAB,
                   classes=tuple(str(i) for i in range(BYTE_VOCAB)))


_WORDS = {
    "name": ("the ship", "a fox", "the old sailor", "my neighbour", "the river", "a small robot", "the queen",
             "our teacher", "the wind", "a tired dog", "the baker", "every child"),
    "verb": ("finds", "carries", "watches", "paints", "follows", "remembers", "builds", "hides", "sells", "calls"),
    "thing": ("a red lantern", "the quiet harbour", "seven apples", "the broken clock", "a letter", "the map",
              "a blue kettle", "the garden gate", "two candles", "the last train"),
    "when": ("at dawn", "before the storm", "every morning", "in the evening", "after supper", "on sunday",
             "while it rains", "at midnight"),
    "link": ("and then", "but", "so", "because", "while"),
}


def synthetic_text(num_bytes: int, seed: int = 0) -> str:
    """English-like ASCII text from a small grammar, ``num_bytes`` long: a corpus for the bytes data set that is the
    same on every machine without a download (numpy's PCG64 integers; its SHA-256 is checked by the tests).

    Sentences are "<name> <verb> <thing> <when>", sometimes joined by a link word, in paragraphs, so that a
    byte-level model has spelling, words and a little syntax to learn.
    """
    if num_bytes < 0:
        raise ValueError(f"num_bytes must be >= 0, got {num_bytes}")
    rng = np.random.default_rng(seed)
    out: list[str] = []
    size = 0

    def pick(kind: str) -> str:
        words = _WORDS[kind]
        return words[int(rng.integers(0, len(words)))]

    while size < num_bytes:
        sentence = f"{pick('name')} {pick('verb')} {pick('thing')} {pick('when')}"
        if int(rng.integers(0, 3)) == 0:
            sentence += f", {pick('link')} {pick('name')} {pick('verb')} {pick('thing')}"
        sentence = sentence[0].upper() + sentence[1:] + (".\n\n" if int(rng.integers(0, 5)) == 0 else ". ")
        out.append(sentence)
        size += len(sentence)
    return "".join(out)[:num_bytes]
