"""A language model as a built-in workload: ``--dataset bytes`` (next-byte prediction on a file) and ``--model gpt``.

The text is :func:`shaky.data.synthetic_text`, the same on every machine (its SHA-256 is checked here).
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
import torch

from shaky.config import config_from_dict
from shaky.data import load_dataset, synthetic_text
from shaky.report import table
from shaky.rundir import read_metrics
from shaky.setup import prepare
from shaky.train import train

TEXT_SHA256 = "22304e6e6883a97a81b63ffbd6b57e7982e5ba0a5a61ba0c98f043eb7e8151f4"
"""synthetic_text(20_000, seed=0): numpy's PCG64 draws, the same everywhere."""


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    body = synthetic_text(20_000)
    assert hashlib.sha256(body.encode()).hexdigest() == TEXT_SHA256
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(body, encoding="ascii")
    return path


def _config(text: Path, **changes: object):
    values = {"num_workers": 4, "steps": 40, "batch_size": 8, "eval_every": 20, "network": {"compute_ms": 1.0},
              "data": {"dataset": "bytes", "path": str(text), "max_len": 16}, "model": {"name": "gpt", "hidden": 32},
              "optim": {"name": "adamw", "lr": 0.003}}
    values.update(changes)
    return config_from_dict(values)


def test_bytes_are_windows_with_the_next_byte_as_target(text: Path) -> None:
    data = load_dataset("bytes", seed=0, path=str(text), max_len=16, test_fraction=0.2)
    raw = torch.tensor(list(text.read_bytes()))
    n = (len(raw) - 1) // 16
    assert len(data.y_train) + len(data.y_test) == n and len(data.y_test) == math.ceil(0.2 * n)
    assert data.x_train.shape[1:] == data.y_train.shape[1:] == (16,) and data.num_classes == data.vocab_size == 256
    assert torch.equal(data.x_train[3], raw[48:64]) and torch.equal(data.y_train[3], raw[49:65])
    assert torch.equal(data.x_test[-1], raw[(n - 1) * 16:n * 16])     # the test split is the file's end
    with pytest.raises(ValueError, match="data.path .* too few"):
        load_dataset("bytes", seed=0, path=str(text), max_len=15_000, test_fraction=0.2)


def test_gpt_learns_the_text_and_reports_its_perplexity(text: Path, tmp_path: Path) -> None:
    summary = train(prepare(_config(text, strategy={"name": "rps"}, network={"compute_ms": 1.0, "drop_rate": 0.1})),
                    tmp_path / "run", progress=False)
    rows = read_metrics(tmp_path / "run")
    for row in rows:
        assert row["test_perplexity"] == pytest.approx(math.exp(row["test_loss"]), rel=1e-12)
    assert rows[0]["test_perplexity"] > 200            # about 256: every byte alike at the start
    assert rows[-1]["test_perplexity"] < 20 and summary["final_test_perplexity"] == rows[-1]["test_perplexity"]
    assert summary["messages_dropped"] > 0 and summary["final_test_accuracy"] > 0.2
    assert "| perplexity |" in table([("gpt", summary)]).splitlines()[0].replace("  ", " ")


def test_what_does_not_fit_a_language_model_is_refused(text: Path) -> None:
    with pytest.raises(ValueError, match="model.name 'lstm' reads token ids but data.dataset 'bytes' holds byte"):
        _config(text, model={"name": "lstm"})
    with pytest.raises(ValueError, match="model.name 'gpt' reads byte sequences .* data.dataset 'digits'"):
        config_from_dict({"model": {"name": "gpt"}})
    with pytest.raises(ValueError, match="data.partition 'dirichlet' cuts by class label"):
        _config(text, data={"dataset": "bytes", "path": str(text), "partition": "dirichlet"})
    with pytest.raises(ValueError, match="data.path must name a local file for dataset bytes"):
        config_from_dict({"data": {"dataset": "bytes"}, "model": {"name": "gpt"}})
