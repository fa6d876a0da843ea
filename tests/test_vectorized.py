"""Tests for shaky.vectorized: the fast batched paths equal the generic vmap path."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.func import vmap

from shaky.models import MODELS, FlatParams, build_model
from shaky.vectorized import (BatchedGradFn, _fold, fast_path, generic_functions, make_functions,
                              worker_logits)

NUM_CLASSES = 10
VOCAB = 50

# (name, input_shape): every model in MODELS, and each input layout the cnn handles.
CASES: list[tuple[str, tuple[int, ...]]] = [
    ("logreg", (64,)),
    ("logreg", (3, 4, 4)),
    ("mlp", (64,)),
    ("cnn", (64,)),  # digits: reshaped to 1x8x8, Conv2d
    ("cnn", (40,)),  # mnist1d: reshaped to 1x40, Conv1d
    ("cnn", (3, 8, 8)),  # native (C, H, W)
    ("resnet20", (64,)),  # digits-shaped, reshaped to 1x8x8
    ("resnet20", (3, 8, 8)),
    ("resnet32", (3, 8, 8)),
    ("resnet44", (1, 4, 4)),
    ("resnet56", (1, 4, 4)),
    ("resnet110", (1, 4, 4)),
    ("lstm", (12,)),
]
EXPECTED_PATH = {"logreg": "linear", "mlp": "linear", "cnn": "grouped", "lstm": "recurrent"}


def test_cases_cover_every_model() -> None:
    # gpt, a next-token model, has its own test below (test_gpt_grads_are_each_worker_s_own).
    assert {name for name, _ in CASES} | {"gpt"} == set(MODELS)


def test_gpt_grads_are_each_worker_s_own() -> None:
    """gpt runs on the generic vmap path: each worker's loss and gradient are its own model's on its own batch (the
    mean next-token cross-entropy over its real samples' positions), as plain autograd computes them one worker
    at a time; padding samples weigh nothing."""
    model = build_model("gpt", input_shape=(6,), num_classes=VOCAB, vocab_size=VOCAB, hidden=16, seed=0).double()
    flat = FlatParams(model)
    gen = torch.Generator().manual_seed(1)
    params = flat.flatten(model) + 0.05 * torch.randn(3, flat.dim, generator=gen, dtype=torch.float64)
    x = torch.randint(0, VOCAB, (3, 5, 6), generator=gen)
    y = torch.randint(0, VOCAB, (3, 5, 6), generator=gen)
    mask = (torch.arange(5) < torch.tensor([[5], [4], [2]])).double()
    assert fast_path(model) is None
    grads, losses = make_functions(model, flat)[0](params, x, y, mask)
    assert grads.shape == (3, flat.dim) and losses.shape == (3,)
    for w in range(3):
        flat.load(model, params[w])
        model.zero_grad()
        n = int(mask[w].sum())
        loss = F.cross_entropy(model(x[w, :n]).reshape(-1, VOCAB), y[w, :n].reshape(-1))
        loss.backward()
        torch.testing.assert_close(losses[w], loss.detach(), rtol=1e-12, atol=1e-12)
        want = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        torch.testing.assert_close(grads[w], want, rtol=1e-10, atol=1e-12)


def _setup(name: str, shape: tuple[int, ...], workers: int, batch: int, dtype: torch.dtype = torch.float32,
           seed: int = 0):
    model = build_model(name, input_shape=shape, num_classes=NUM_CLASSES, vocab_size=VOCAB, hidden=16,
                        seed=seed).to(dtype)
    flat = FlatParams(model)
    gen = torch.Generator().manual_seed(seed + 1)
    # Different parameters per worker, so that mixing two workers up would show.
    params = flat.flatten(model) + 0.1 * torch.randn(workers, flat.dim, generator=gen, dtype=dtype)
    if name == "lstm":
        ids = torch.randint(1, VOCAB, (workers, batch, *shape), generator=gen)
        lengths = torch.randint(1, shape[0] + 1, (workers, batch, 1), generator=gen)
        x = torch.where(torch.arange(shape[0]) < lengths, ids, 0)
    else:
        x = torch.randn(workers, batch, *shape, generator=gen, dtype=dtype)
    y = torch.randint(0, NUM_CLASSES, (workers, batch), generator=gen)
    # Heterogeneous batch sizes: worker i has batch - i real samples, the rest is padding.
    sizes = torch.tensor([max(1, batch - i) for i in range(workers)])
    mask = (torch.arange(batch) < sizes[:, None]).to(dtype)
    return model, flat, params, x, y, mask


@pytest.mark.parametrize(("name", "shape"), CASES)
def test_fast_grads_match_generic(name: str, shape: tuple[int, ...]) -> None:
    model, flat, params, x, y, mask = _setup(name, shape, workers=3, batch=5)
    want_grads, want_losses = generic_functions(model, flat)[0](params, x, y, mask)
    grads, losses = make_functions(model, flat)[0](params, x, y, mask)
    assert grads.shape == (3, flat.dim) and losses.shape == (3,)
    assert not grads.requires_grad and not losses.requires_grad
    torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-6)
    # float32 rounding differs between the convolution algorithms: 1e-5 of the largest gradient entry
    # (ResNet-110's deepest layers reach a few 1e-6 absolute).
    torch.testing.assert_close(grads, want_grads, rtol=1e-5, atol=1e-5 * float(want_grads.abs().max()))
    assert fast_path(model) == EXPECTED_PATH.get(name, "grouped")


@pytest.mark.parametrize(("name", "shape"), [("mlp", (64,)), ("cnn", (40,)), ("resnet20", (3, 8, 8)), ("lstm", (12,))])
def test_float64_and_one_worker(name: str, shape: tuple[int, ...]) -> None:
    model, flat, params, x, y, mask = _setup(name, shape, workers=2, batch=4, dtype=torch.float64)
    want = generic_functions(model, flat)[0](params, x, y, mask)
    got = make_functions(model, flat)[0](params, x, y, mask)
    assert got[0].dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # One worker, as train.py's compute-time measurement calls it.
    want1 = generic_functions(model, flat)[0](params[:1], x[:1], y[:1], mask[:1])
    got1 = make_functions(model, flat)[0](params[:1], x[:1], y[:1], mask[:1])
    torch.testing.assert_close(got1, want1, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("name", "shape"), [("mlp", (64,)), ("cnn", (64,)), ("resnet20", (64,))])
def test_padding_is_ignored(name: str, shape: tuple[int, ...]) -> None:
    """Whatever sits in the padding slots changes nothing."""
    model, flat, params, x, y, mask = _setup(name, shape, workers=3, batch=5)
    grad_fn = make_functions(model, flat)[0]
    grads, losses = grad_fn(params, x, y, mask)
    pad = mask == 0
    x2 = torch.where(pad.reshape(*pad.shape, *[1] * len(shape)), torch.randn_like(x) * 5, x)
    y2 = torch.where(pad, (y + 3) % NUM_CLASSES, y)
    grads2, losses2 = grad_fn(params, x2, y2, mask)
    torch.testing.assert_close(losses2, losses)
    torch.testing.assert_close(grads2, grads)


@pytest.mark.parametrize(("name", "shape"), CASES)
def test_forward_fn_matches_model(name: str, shape: tuple[int, ...]) -> None:
    model, flat, params, x, _, _ = _setup(name, shape, workers=3, batch=4)
    forward_fn = make_functions(model, flat)[1]
    xs = x[0]
    torch.testing.assert_close(forward_fn(flat.flatten(model), xs), model(xs))
    per_worker = vmap(forward_fn, in_dims=(0, None))(params, xs)
    assert per_worker.shape == (3, 4, NUM_CLASSES)
    for w in range(3):
        flat.load(model, params[w])
        torch.testing.assert_close(per_worker[w], model(xs), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("name", "shape"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_worker_logits_equal_each_worker_s_model_on_the_shared_samples(name: str, shape: tuple[int, ...],
                                                                      dtype: torch.dtype) -> None:
    model, flat, params, x, _, _ = _setup(name, shape, workers=3, batch=5, dtype=dtype)
    grad_fn, forward_fn = make_functions(model, flat)
    logits = worker_logits(grad_fn, forward_fn)
    assert isinstance(grad_fn, BatchedGradFn) == (fast_path(model) is not None)
    xs = x[1]
    out = logits(params, xs)
    assert out.shape == (3, 5, NUM_CLASSES) and out.dtype == dtype
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-12}
    for w in range(3):
        flat.load(model, params[w])
        torch.testing.assert_close(out[w], model(xs), **tol)


def test_inputs_are_not_modified() -> None:
    model, flat, params, x, y, mask = _setup("mlp", (64,), workers=2, batch=4)
    copies = [t.clone() for t in (params, x, y, mask)]
    make_functions(model, flat)[0](params, x, y, mask)
    for t, c in zip((params, x, y, mask), copies):
        assert torch.equal(t, c)


def test_unknown_module_falls_back_to_generic() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    flat = FlatParams(model)
    params = flat.flatten(model)[None].repeat(2, 1)
    x, y, mask = torch.randn(2, 5, 6), torch.randint(0, 3, (2, 5)), torch.ones(2, 5)
    assert fast_path(model) is None
    torch.testing.assert_close(make_functions(model, flat)[0](params, x, y, mask),
                               generic_functions(model, flat)[0](params, x, y, mask))


def test_tune_allocator_in_a_fresh_process() -> None:
    # Process-wide malloc settings: exercised in a child, not in the test process.
    code = ("import torch; from shaky.vectorized import tune_allocator; ok = tune_allocator(); "
            "x = torch.ones(4096, 4096); del x; assert torch.ones(2048, 2048).sum() == 2048 ** 2; print(ok)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() in ("True", "False")


@pytest.mark.parametrize("channels", [1, 3])
def test_fold_lays_images_out_channels_last_with_each_workers_channels_together(channels: int) -> None:
    """The grouped path's input is channels-last (oneDNN's fast layout; with one channel per worker a plain
    reshape left it worker-major and the whole CNN ran in NCHW) and holds worker w's channels at w*C..w*C+C-1."""
    w, b, h, width = 4, 3, 5, 6
    x = torch.randn(w, b, channels, h, width)
    folded = _fold(x, (channels, h, width), channels_last=True)
    assert folded.shape == (b, w * channels, h, width)
    assert folded.is_contiguous(memory_format=torch.channels_last)
    for worker in range(w):
        assert torch.equal(folded[:, worker * channels:(worker + 1) * channels], x[worker])


def test_the_linear_path_s_kept_views_and_sample_weights_follow_new_tensors_and_in_place_writes() -> None:
    """The fused MLP path keeps its parameter views and the mask's sample weights between calls (a training
    loop passes the same tensors every step): a new parameter tensor, a parameter tensor written in place and a
    mask changed in place must each give what the generic path gives for them."""
    model, flat, params, x, y, mask = _setup("mlp", (64,), workers=3, batch=5)
    fast, _ = make_functions(model, flat)
    generic, _ = generic_functions(model, flat)

    def check(p: torch.Tensor, m: torch.Tensor) -> None:
        g_fast, l_fast = fast(p, x, y, m)
        g_ref, l_ref = generic(p, x, y, m)
        torch.testing.assert_close(g_fast, g_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(l_fast, l_ref, rtol=1e-5, atol=1e-6)

    check(params, mask)
    other = params.flip(0).contiguous()        # another storage
    check(other, mask)
    params.mul_(0.5)                           # the first storage again, written in place
    check(params, mask)
    mask[0, 1:] = 0.0                          # the same mask object, changed in place
    check(params, mask)
    check(params, mask.clone())


def test_lstm_worker_logits_in_pieces_are_the_logits_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lstm's per-worker evaluation runs its samples in pieces of at most EVAL_BYTES of input projections
    (a chunk of 2,048 test sentences at W = 64 would need 8 GB at once): pieces of one sample give the
    logits of one pass over them all."""
    model, flat, params, x, _, _ = _setup("lstm", (12,), workers=3, batch=5)
    grad_fn, forward_fn = make_functions(model, flat)
    logits = worker_logits(grad_fn, forward_fn)
    whole = logits(params, x[0])
    monkeypatch.setattr(type(grad_fn), "EVAL_BYTES", 1)
    torch.testing.assert_close(logits(params, x[0]), whole, rtol=1e-6, atol=1e-6)


def test_no_two_live_graph_caches_capture_on_one_stream_of_a_wrapping_pool() -> None:
    """PyTorch's stream pool hands out the same few streams round and round: a graph cache gets one that no other
    live cache holds, a freed cache's stream can be had again, and with every one held there is none (eager)."""
    import gc  # noqa: PLC0415
    import weakref  # noqa: PLC0415
    from types import SimpleNamespace  # noqa: PLC0415

    from shaky.vectorized import _own_stream  # noqa: PLC0415

    pool = [SimpleNamespace(device_index=0, cuda_stream=handle) for handle in (11, 22, 33)]
    drawn = iter(pool * 10)
    held: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    class Owner:
        pass

    a, b, c = Owner(), Owner(), Owner()
    assert [_own_stream(o, lambda: next(drawn), held, tries=3).cuda_stream for o in (a, b)] == [11, 22]
    d = Owner()
    assert _own_stream(d, lambda: next(drawn), held, tries=3).cuda_stream == 33   # the pool wraps after this
    assert _own_stream(c, lambda: next(drawn), held, tries=3) is None             # 11, 22, 33: all held
    del b
    gc.collect()
    assert _own_stream(c, lambda: next(drawn), held, tries=3).cuda_stream == 22   # b's, free again
    assert sorted(held) == [(0, 11), (0, 22), (0, 33)] and held[(0, 22)] is c
