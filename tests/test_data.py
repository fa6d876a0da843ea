"""Tests for shaky.data: loaders, splits, partitions."""

from __future__ import annotations

import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from shaky.data import DATASETS, PARTITIONS, Dataset, load_dataset, partition, shard_summary

BUNDLED = {"digits": (64, 10, 1797), "iris": (4, 3, 150), "wine": (13, 3, 178), "breast_cancer": (30, 2, 569)}


@pytest.mark.parametrize("name", [*sorted(BUNDLED), "mnist1d"])
def test_sample_shapes_known_before_loading(name: str) -> None:
    """SAMPLE_SHAPES (which the config reads to match models to data sets) is what loading gives."""
    from shaky.data import SAMPLE_SHAPES

    assert set(SAMPLE_SHAPES) == set(DATASETS)
    assert load_dataset(name, seed=0).input_shape == SAMPLE_SHAPES[name]


@pytest.mark.parametrize("name", sorted(BUNDLED))
def test_bundled_shapes_and_split(name: str) -> None:
    features, classes, total = BUNDLED[name]
    ds = load_dataset(name, seed=0)
    assert isinstance(ds, Dataset) and ds.name == name
    assert ds.input_shape == (features,) and ds.num_classes == classes
    assert ds.classes == tuple(str(i) for i in range(classes))
    assert ds.x_train.dtype == torch.float32 and ds.y_train.dtype == torch.int64
    assert ds.x_train.shape[1:] == (features,) and ds.x_test.shape[1:] == (features,)
    assert len(ds.x_train) + len(ds.x_test) == total
    assert len(ds.x_test) == pytest.approx(0.2 * total, abs=1)
    # Standardized with train statistics; constant columns stay at zero.
    x = ds.x_train.double()
    std = x.std(0, unbiased=False)
    assert x.mean(0).abs().max() < 1e-5
    assert torch.all(((std - 1).abs() < 1e-4) | (std < 1e-6))
    assert (std > 0.5).sum() >= features - 12  # only digits has (border) constant pixels
    same = load_dataset(name, seed=0)
    assert torch.equal(same.x_train, ds.x_train) and torch.equal(same.y_test, ds.y_test)
    other = load_dataset(name, seed=1)
    assert not torch.equal(other.x_train, ds.x_train)


def test_test_fraction_is_respected() -> None:
    ds = load_dataset("iris", seed=3, test_fraction=0.5)
    assert len(ds.x_test) == 75 and len(ds.x_train) == 75


def test_mnist1d_loads_without_touching_global_rng() -> None:
    np.random.seed(1234)
    random.seed(99)
    np_before, py_before = np.random.get_state(), random.getstate()
    ds = load_dataset("mnist1d", seed=0)
    np_after, py_after = np.random.get_state(), random.getstate()
    assert all(np.array_equal(a, b) for a, b in zip(np_before, np_after, strict=True))
    assert py_before == py_after
    assert ds.input_shape == (40,) and ds.num_classes == 10
    assert ds.x_train.shape == (4000, 40) and ds.x_test.shape == (1000, 40)
    assert ds.x_train.dtype == torch.float32
    assert set(ds.y_train.tolist()) == set(range(10))
    again = load_dataset("mnist1d", seed=0)
    assert torch.equal(again.x_train, ds.x_train)
    assert not torch.equal(load_dataset("mnist1d", seed=1).y_train, ds.y_train)


def _write_batch(path: Path, data: np.ndarray, labels: list[int]) -> None:
    with open(path, "wb") as f:
        pickle.dump({b"data": data, b"labels": labels, b"batch_label": b"x"}, f)


@pytest.fixture
def cifar_dir(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    for i, n in ((1, 3), (2, 2)):
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        _write_batch(tmp_path / f"data_batch_{i}", data, [i, 9, 0][:n])
    _write_batch(tmp_path / "test_batch", rng.integers(0, 256, (4, 3072), dtype=np.uint8), [5, 6, 7, 8])
    return tmp_path


def test_cifar10_loads_python_format(cifar_dir: Path) -> None:
    ds = load_dataset("cifar10", seed=0, path=str(cifar_dir))
    assert ds.input_shape == (3, 32, 32) and ds.num_classes == 10
    assert ds.x_train.shape == (5, 3, 32, 32) and ds.x_test.shape == (4, 3, 32, 32)
    assert ds.y_train.tolist() == [1, 9, 0, 2, 9] and ds.y_test.tolist() == [5, 6, 7, 8]
    assert ds.y_train.dtype == torch.int64 and ds.x_train.dtype == torch.float32
    # Values: channel-major layout, scaled to [0, 1], normalized with train stats per channel.
    raw = []
    for i in (1, 2):
        with open(cifar_dir / f"data_batch_{i}", "rb") as f:
            raw.append(pickle.load(f, encoding="bytes")[b"data"])
    imgs = np.concatenate(raw).reshape(-1, 3, 32, 32) / 255.0
    mean, std = imgs.mean(axis=(0, 2, 3), keepdims=True), imgs.std(axis=(0, 2, 3), keepdims=True)
    np.testing.assert_allclose(ds.x_train.numpy(), (imgs - mean) / std, rtol=1e-4, atol=1e-5)
    per_channel = ds.x_train.double().mean(dim=(0, 2, 3))
    assert torch.allclose(per_channel, torch.zeros(3, dtype=torch.float64), atol=1e-5)


def test_cifar10_errors(cifar_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="data.path must point to a CIFAR-10 directory.*got ''"):
        load_dataset("cifar10", seed=0)
    with pytest.raises(ValueError, match="data.path.*not a directory"):
        load_dataset("cifar10", seed=0, path=str(tmp_path / "nope"))
    (cifar_dir / "data_batch_2").write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="data.path.*data_batch_2"):
        load_dataset("cifar10", seed=0, path=str(cifar_dir))
    (cifar_dir / "test_batch").unlink()
    with pytest.raises(ValueError, match="data.path.*missing test_batch"):
        load_dataset("cifar10", seed=0, path=str(cifar_dir))


TEXT = """atis_flight\tShow me flights from Boston to Denver
atis_flight\tflights from denver to boston

atis_airfare\twhat is the fare from boston to denver
atis_flight\tI want a flight to Denver
atis_airfare\thow much is a ticket to boston
atis_airfare\tcheapest fare boston denver please show me the price of the ticket today
atis_ground_service\t
atis_flight\tflights boston
"""


def test_text_loader(tmp_path: Path) -> None:
    f = tmp_path / "atis.tsv"
    f.write_text(TEXT, encoding="utf-8")
    ds = load_dataset("text", seed=0, path=str(f), test_fraction=0.25, max_len=8)
    assert ds.classes == ("atis_airfare", "atis_flight", "atis_ground_service")
    assert ds.num_classes == 3 and ds.input_shape == (8,)
    assert ds.x_train.dtype == torch.int64 and ds.x_train.shape == (6, 8) and ds.x_test.shape == (2, 8)
    # Vocabulary is built on train only: every train id is known, ids fit in vocab_size.
    assert int(ds.x_train.max()) < ds.vocab_size and int(ds.x_test.max()) < ds.vocab_size
    assert 2 < ds.vocab_size <= 2 + 30
    train_rows = ds.x_train.tolist()
    rows = train_rows + ds.x_test.tolist()
    labels = ds.y_train.tolist() + ds.y_test.tolist()
    assert [r for r, y in zip(rows, labels, strict=True) if y == 2] == [[1] + [0] * 7]  # empty sentence
    for row in train_rows:
        n = sum(1 for t in row if t != 0)
        assert all(t != 0 for t in row[:n]) and all(t == 0 for t in row[n:])  # right padding
        if row != [1] + [0] * 7:
            assert 1 not in row  # train tokens are never unknown
    # Same seed, same split; the most frequent train tokens get the smallest ids.
    again = load_dataset("text", seed=0, path=str(f), test_fraction=0.25, max_len=8)
    assert torch.equal(again.x_train, ds.x_train) and again.vocab_size == ds.vocab_size
    short = load_dataset("text", seed=0, path=str(f), test_fraction=0.25, max_len=2)
    assert short.x_train.shape == (6, 2) and torch.equal(short.x_train, ds.x_train[:, :2])


def test_text_unknown_tokens_and_vocab_order(tmp_path: Path) -> None:
    f = tmp_path / "t.tsv"
    # Every sentence ends in a token of its own, so each test sentence holds
    # exactly one token the train vocabulary has never seen.
    lines = [f"a\tcommon common zz{i}" for i in range(5)] + [f"b\tcommon rare{i}" for i in range(5)]
    f.write_text("\n".join(lines) + "\n", encoding="utf-8")
    ds = load_dataset("text", seed=2, path=str(f), test_fraction=0.2, max_len=4)
    assert ds.x_train[:, 0].tolist() == [2] * len(ds.x_train)  # "common" is the most frequent token
    assert ds.x_test[:, 1:].eq(1).any(dim=1).all()  # every test sentence ends in an unseen token
    assert ds.vocab_size == 2 + 1 + 8
    # Ties in count are broken alphabetically: every rare* id is below every zz* id.
    rare = [r[1] for r, y in zip(ds.x_train.tolist(), ds.y_train.tolist(), strict=True) if y == 1]
    zz = [r[2] for r, y in zip(ds.x_train.tolist(), ds.y_train.tolist(), strict=True) if y == 0]
    assert rare and zz and max(rare) < min(zz)


def test_text_errors(tmp_path: Path) -> None:
    f = tmp_path / "bad.tsv"
    f.write_text("atis_flight\tflights to boston\n\natis_airfare no tab here\n", encoding="utf-8")
    with pytest.raises(ValueError, match="data.path.*line 3"):
        load_dataset("text", seed=0, path=str(f))
    with pytest.raises(ValueError, match="data.path"):
        load_dataset("text", seed=0)
    with pytest.raises(ValueError, match="data.path"):
        load_dataset("text", seed=0, path=str(tmp_path / "missing.tsv"))
    f.write_text("atis_flight\tone line only\n", encoding="utf-8")
    with pytest.raises(ValueError, match="data.path.*at least 2"):
        load_dataset("text", seed=0, path=str(f))


def test_load_dataset_argument_errors() -> None:
    assert DATASETS == ("digits", "iris", "wine", "breast_cancer", "mnist1d", "cifar10", "text", "bytes")
    with pytest.raises(ValueError, match=r"data.dataset must be one of digits, iris.*got 'foo'"):
        load_dataset("foo", seed=0)
    for bad in (0.0, 1.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="data.test_fraction"):
            load_dataset("iris", seed=0, test_fraction=bad)
    with pytest.raises(ValueError, match="data.test_fraction"):
        load_dataset("iris", seed=0, test_fraction=0.01)  # fewer test samples than classes
    with pytest.raises(ValueError, match="data.max_len"):
        load_dataset("iris", seed=0, max_len=0)
    with pytest.raises(ValueError, match="seed"):
        load_dataset("iris", seed=-1)


def _check_cover(shards: list[np.ndarray], n: int) -> None:
    assert all(s.dtype == np.int64 and np.all(np.diff(s) > 0) for s in shards)
    assert np.array_equal(np.sort(np.concatenate(shards)), np.arange(n))


def test_iid_partition() -> None:
    labels = np.repeat(np.arange(10), 101)
    shards = partition(labels, 7, seed=0)
    _check_cover(shards, len(labels))
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1
    assert all(np.array_equal(a, b) for a, b in zip(shards, partition(labels, 7, seed=0), strict=True))
    assert not np.array_equal(shards[0], partition(labels, 7, seed=1)[0])
    # iid shards see every class.
    assert all(len(np.unique(labels[s])) == 10 for s in shards)


def test_dirichlet_partition_is_skewed_and_covering() -> None:
    labels = np.repeat(np.arange(10), 100)
    shards = partition(labels, 20, kind="dirichlet", seed=0, alpha=0.1)
    _check_cover(shards, len(labels))
    assert all(len(s) >= 1 for s in shards)
    summary = shard_summary(shards, labels, 10)
    # Label skew: in most workers the top two classes hold at least 80% of the data.
    dominated = sum(sum(sorted(w["class_counts"])[-2:]) >= 0.8 * w["num_samples"] for w in summary)
    assert dominated >= 15
    again = partition(labels, 20, kind="dirichlet", seed=0, alpha=0.1)
    assert all(np.array_equal(a, b) for a, b in zip(shards, again, strict=True))


def test_dirichlet_fills_empty_workers() -> None:
    labels = np.zeros(12, dtype=np.int64)  # one class: most workers get nothing from the draw
    shards = partition(labels, 12, kind="dirichlet", seed=3, alpha=0.01)
    _check_cover(shards, 12)
    assert [len(s) for s in shards] == [1] * 12


def test_partition_errors() -> None:
    labels = np.arange(5) % 2
    assert PARTITIONS == ("iid", "dirichlet", "label-skew")
    with pytest.raises(ValueError, match=r"num_workers \(6\).*\(5\)"):
        partition(labels, 6, seed=0)
    with pytest.raises(ValueError, match="num_workers"):
        partition(labels, 0, seed=0)
    with pytest.raises(ValueError, match="data.partition.*'shards'"):
        partition(labels, 2, kind="shards", seed=0)
    for alpha in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="data.dirichlet_alpha"):
            partition(labels, 2, kind="dirichlet", seed=0, alpha=alpha)


def test_shard_summary_plain_types() -> None:
    labels = np.array([0, 1, 1, 2, 2, 2])
    summary = shard_summary([np.array([0, 3]), np.array([1, 2, 4, 5])], labels, 4)
    assert summary == [
        {"worker": 0, "num_samples": 2, "class_counts": [1, 0, 1, 0]},
        {"worker": 1, "num_samples": 4, "class_counts": [0, 2, 2, 0]},
    ]
    assert all(type(c) is int for w in summary for c in w["class_counts"])


@pytest.mark.parametrize("name", sorted(BUNDLED))
def test_bundled_sets_are_what_scikit_learn_loads(name: str) -> None:
    """shaky reads scikit-learn's bundled files itself (importing scikit-learn costs every process 1.2 s): the
    same arrays as ``sklearn.datasets.load_*(return_X_y=True)``, dtypes included."""
    from sklearn import datasets  # noqa: PLC0415

    from shaky.data import _bundled  # noqa: PLC0415

    want_x, want_y = getattr(datasets, f"load_{name}")(return_X_y=True)
    x, y = _bundled(name)
    assert x.dtype == want_x.dtype and y.dtype == want_y.dtype
    np.testing.assert_array_equal(x, want_x)
    np.testing.assert_array_equal(y, want_y)


def test_the_split_is_scikit_learn_s_train_test_split() -> None:
    """The written-out split takes the indices scikit-learn's ``train_test_split`` takes, stratified or not, for
    many seeds and fractions and for class counts with ties (which its stratified split breaks at random), and
    refuses what it refuses."""
    from sklearn.model_selection import train_test_split  # noqa: PLC0415

    from shaky.data import _bundled, _split  # noqa: PLC0415

    digits_y = _bundled("digits")[1]
    labels = {"digits": digits_y, "iris": _bundled("iris")[1], "ties": np.repeat(np.arange(7), [2, 3, 3, 5, 5, 9, 2]),
              "two": np.array([0, 1] * 20 + [1] * 3), "skewed": np.sort(digits_y[:301] % 3)}
    checked = refused = 0
    for name, y in labels.items():
        x = np.arange(len(y)) * 10
        for fraction in (0.01, 0.1, 0.2, 0.25, 1 / 3, 0.5, 0.77, 0.95):
            for seed in (0, 1, 7, 123, 2**32 - 1):
                for stratify in (True, False):
                    try:
                        want = train_test_split(x, y, test_size=fraction, random_state=seed,
                                                stratify=y if stratify else None)
                    except ValueError:
                        with pytest.raises(ValueError, match=r"^data\.test_fraction .* cannot split"):
                            _split(x, y, fraction, seed, stratify=stratify)
                        refused += 1
                        continue
                    x_tr, y_tr, x_te, y_te = _split(x, y, fraction, seed, stratify=stratify)
                    for got, expected in zip((x_tr, x_te, y_tr, y_te), want, strict=True):
                        np.testing.assert_array_equal(got, expected)
                    checked += 1
    assert checked > 300 and refused > 0, (checked, refused)


def test_training_does_not_import_scikit_learn(tmp_path: Path) -> None:
    """A run on a bundled set, in a fresh process, never imports scikit-learn (its import was a third of the
    start of every process that trains)."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    code = ("import sys; from shaky.cli import main; "
            f"rc = main(['train', '--steps', '2', '--quiet', '--out', {str(tmp_path / 'run')!r}]); "
            "print(rc, sorted(m for m in sys.modules if m.split('.')[0] in ('sklearn', 'scipy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split("\n")[-2] == "0 []", out.stdout[-2000:] + out.stderr[-2000:]
