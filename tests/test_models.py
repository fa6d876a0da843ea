"""Tests for shaky.models: shapes, seeding, FlatParams and the vmap training path."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad_and_value, vmap

from shaky.models import MODELS, FlatParams, build_model, resnet_depth

NUM_CLASSES = 10
VOCAB = 50

# (name, input_shape): one suitable small input per model family.
CASES: list[tuple[str, tuple[int, ...]]] = [
    ("logreg", (64,)),
    ("mlp", (64,)),
    ("cnn", (64,)),  # digits: reshaped to 1x8x8, Conv2d
    ("cnn", (40,)),  # mnist1d: reshaped to 1x40, Conv1d
    ("cnn", (3, 8, 8)),  # native (C, H, W)
    ("resnet20", (64,)),  # digits-shaped, reshaped to 1x8x8
    ("lstm", (12,)),
]


def _build(name: str, shape: tuple[int, ...], seed: int = 0) -> torch.nn.Module:
    return build_model(
        name, input_shape=shape, num_classes=NUM_CLASSES, vocab_size=VOCAB, hidden=16, seed=seed
    )


def _inputs(name: str, shape: tuple[int, ...], batch: int, gen: torch.Generator) -> torch.Tensor:
    """A batch for ``name``; token ids get varying lengths with trailing padding."""
    if name != "lstm":
        return torch.randn(batch, *shape, generator=gen)
    ids = torch.randint(1, VOCAB, (batch, *shape), generator=gen)
    lengths = torch.randint(1, shape[0] + 1, (batch,), generator=gen)
    return torch.where(torch.arange(shape[0]) < lengths[:, None], ids, 0)


@pytest.mark.parametrize(("name", "shape"), CASES)
def test_output_shape_and_no_buffers(name: str, shape: tuple[int, ...]) -> None:
    model = _build(name, shape)
    gen = torch.Generator().manual_seed(1)
    assert model(_inputs(name, shape, 5, gen)).shape == (5, NUM_CLASSES)
    assert not list(model.buffers())


def test_resnet_cifar_shape() -> None:
    model = build_model("resnet20", input_shape=(3, 32, 32), num_classes=10, seed=0)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_resnet_depths() -> None:
    counts = []
    for name in ("resnet20", "resnet32", "resnet44", "resnet56", "resnet110"):
        model = build_model(name, input_shape=(3, 32, 32), num_classes=10, seed=0)
        counts.append(FlatParams(model).dim)
    assert counts == sorted(counts) and len(set(counts)) == len(counts)
    # Option-A shortcuts keep ResNet-20 at the paper's ~0.27M parameters.
    assert 0.26e6 < counts[0] < 0.28e6
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert resnet_depth("resnet110") == 110


@pytest.mark.parametrize(("name", "shape"), CASES)
def test_seeding(name: str, shape: tuple[int, ...]) -> None:
    rng_before = torch.random.get_rng_state()
    a, b, c = _build(name, shape, 3), _build(name, shape, 3), _build(name, shape, 4)
    assert torch.equal(torch.random.get_rng_state(), rng_before)
    flat = FlatParams(a)
    assert torch.equal(flat.flatten(a), flat.flatten(b))
    assert not torch.equal(flat.flatten(a), flat.flatten(c))


@pytest.mark.parametrize(("name", "shape"), CASES)
def test_flat_round_trip(name: str, shape: tuple[int, ...]) -> None:
    model = _build(name, shape)
    flat = FlatParams(model)
    row = flat.flatten(model)
    assert row.shape == (flat.dim,) and flat.dim == sum(p.numel() for p in model.parameters())
    x = _inputs(name, shape, 4, torch.Generator().manual_seed(2))
    torch.testing.assert_close(functional_call(model, flat.unflatten(row), (x,)), model(x))
    other = _build(name, shape, seed=9)
    flat.load(other, row)
    torch.testing.assert_close(flat.flatten(other), row)


@pytest.mark.parametrize(("name", "shape"), CASES)
def test_vmap_matches_loop(name: str, shape: tuple[int, ...]) -> None:
    workers, batch = 3, 4
    model = _build(name, shape)
    flat = FlatParams(model)
    gen = torch.Generator().manual_seed(5)
    rows = flat.flatten(model) + 0.1 * torch.randn(workers, flat.dim, generator=gen)
    xs = torch.stack([_inputs(name, shape, batch, gen) for _ in range(workers)])
    ys = torch.randint(0, NUM_CLASSES, (workers, batch), generator=gen)

    def loss_fn(row: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(model, flat.unflatten(row), (x,)), y)

    grads, losses = vmap(grad_and_value(loss_fn))(rows, xs, ys)
    assert grads.shape == (workers, flat.dim) and losses.shape == (workers,)
    for w in range(workers):
        local = copy.deepcopy(model)
        flat.load(local, rows[w])
        loss = F.cross_entropy(local(xs[w]), ys[w])
        loss.backward()
        grad = torch.cat([p.grad.reshape(-1) for p in local.parameters()])
        torch.testing.assert_close(losses[w], loss.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grads[w], grad, rtol=1e-5, atol=1e-5)


def test_lstm_ignores_padding() -> None:
    model = _build("lstm", (8,))
    ids = torch.tensor([[5, 9, 3, 0, 0, 0, 0, 0], [7, 1, 2, 4, 6, 8, 11, 13]])
    longer = torch.cat([ids, torch.zeros(2, 5, dtype=ids.dtype)], dim=1)
    torch.testing.assert_close(model(ids), model(longer))
    # The padded sequence must also equal the unpadded one run on its own.
    torch.testing.assert_close(model(ids[:1, :3]), model(ids[:1]))


def test_lstm_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        build_model("lstm", input_shape=(8,), num_classes=2, vocab_size=1, seed=0)
    with pytest.raises(ValueError, match="model.name"):
        build_model("lstm", input_shape=(1, 8, 8), num_classes=2, vocab_size=10, seed=0)
    model = build_model("lstm", input_shape=(8,), num_classes=2, vocab_size=10, seed=0)
    with pytest.raises(ValueError, match="model.name"):
        model(torch.randn(2, 8))


def test_misfit_inputs() -> None:
    with pytest.raises(ValueError, match=r"model\.name='cnn'.*\(4, 8\)"):
        build_model("cnn", input_shape=(4, 8), num_classes=2, seed=0)
    with pytest.raises(ValueError, match=r"model\.name='resnet20'.*\(40,\)"):
        build_model("resnet20", input_shape=(40,), num_classes=2, seed=0)


def test_unknown_name() -> None:
    with pytest.raises(ValueError, match="model.name must be one of"):
        build_model("vgg", input_shape=(64,), num_classes=10, seed=0)
    assert "resnet110" in MODELS


def test_gpt_is_causal_seeded_and_has_no_buffers() -> None:
    """gpt's logits at a position depend on that position and the ones before it only; the same seed builds the
    same model; no buffers (a pure function of its parameters, as the simulator needs); default sizes."""
    model = build_model("gpt", input_shape=(8,), num_classes=VOCAB, vocab_size=VOCAB, seed=0)
    assert not list(model.buffers())
    assert model.tokens.weight.shape == (VOCAB, 64) and len(model.blocks) == 2 and model.blocks[0].attn.heads == 4
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    later = ids.clone()
    later[:, 5:] = (later[:, 5:] + 1) % VOCAB
    out, out_later = model(ids), model(later)
    assert out.shape == (2, 8, VOCAB)
    torch.testing.assert_close(out[:, :5], out_later[:, :5])
    assert not torch.allclose(out[:, 5:], out_later[:, 5:])
    again = build_model("gpt", input_shape=(8,), num_classes=VOCAB, vocab_size=VOCAB, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    with pytest.raises(ValueError, match="model.name='gpt'"):
        model(torch.randn(2, 8))
    with pytest.raises(ValueError, match="model.hidden 30"):
        build_model("gpt", input_shape=(8,), num_classes=VOCAB, vocab_size=VOCAB, hidden=30, seed=0)
