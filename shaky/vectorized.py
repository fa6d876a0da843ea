"""All workers' forward and backward passes as one batched computation, as fast as the hardware allows.

The simulator holds W workers' parameters as one ``[W, D]`` tensor. The generic
way to get every worker's gradient is ``vmap(grad_and_value(loss))`` over its
rows (:func:`generic_functions`); it works for every model but pays for vmap's
per-op batching rules and for a ``torch.cat`` of the per-parameter gradients.
:func:`make_functions` returns functions with the same semantics that run the
W workers as one big computation instead, so a round costs about what one model
at batch ``W * B`` costs (the limit on one machine, see ``docs/performance.md``):

* ``logreg`` and ``mlp`` (a chain of Linear layers with ReLUs): batched
  matmuls (``baddbmm``/``bmm``) on ``[W, B, F]`` activations and ``[W, out, in]``
  views of the parameter rows, with the backward pass written out by hand and
  the gradients gathered into one ``[W, D]`` tensor by a single ``cat``.
* ``cnn`` and the ResNets: the worker axis is folded into the channels
  (activations ``[B, W * C, ...]``) and every convolution runs once with
  ``groups = W`` (grouped convolution keeps the workers apart); GroupNorm runs
  with ``W * num_groups`` groups, which are exactly each worker's own groups; the
  linear head is a batched matmul. Autograd runs once over this one graph, with
  the ``[W, D]`` parameter tensor as its only leaf.
* ``lstm``: the recurrence over ``[W, B, H]`` states, one ``bmm`` per gate
  product for all workers, the input projection of every step at once and laid
  out time-major; the backward through time written out by hand, each weight's
  gradient one ``bmm`` over all steps.
* anything else (``gpt``, a user's own model, any model whose layout is not
  recognised) uses the generic vmap path, so every model keeps working.

The numbers agree with the generic path to float rounding
(``tests/test_vectorized.py``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import warnings
import weakref
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from shaky.models import CNN, MLP, BasicBlock, FlatParams, LogReg, LSTMClassifier, ResNet

GradFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""``grad_fn(params [W, D], x [W, B, ...], y [W, B], mask [W, B]) -> (grads [W, D], losses [W])``.

Worker i's loss is the mean cross-entropy over its real samples (``mask`` 1;
padding slots, ``mask`` 0, weigh nothing): ``sum_b ce[i, b] * mask[i, b] / sum_b mask[i, b]``. With targets
``y [W, B, T]`` (next-token prediction) a sample's ``ce`` is the mean over its T positions (:func:`sample_losses`).
"""
ForwardFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``forward_fn(row [D], x [N, ...]) -> logits [N, C]`` (``[N, T, V]`` for next-token prediction); vmappable over
``row``."""
InPlaceUpdate = Callable[[slice, torch.Tensor], None]
"""``update(columns, grad [W, n])``: apply an optimizer step to ``params[:, columns]`` in place."""
FusedFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, InPlaceUpdate], torch.Tensor]
"""``fused(params [W, D], x, y, mask, update) -> losses [W]``: the backward pass calls ``update`` per parameter."""

__all__ = ["BatchedGradFn", "ForwardFn", "FusedFn", "FusedGradFn", "GradFn", "InPlaceUpdate", "fast_path",
           "generic_functions", "make_functions", "sample_losses", "tune_allocator", "worker_logits"]


def sample_losses(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each sample's cross-entropy ``[B]``: of logits ``[B, C]`` against labels ``[B]``, or, for next-token
    prediction, the mean over positions of logits ``[B, T, V]`` against targets ``[B, T]`` (so a worker's loss is
    the mean over its tokens). A classifier's numbers are ``F.cross_entropy``'s, untouched."""
    if y.dim() <= 1:
        return F.cross_entropy(logits, y, reduction="none")
    per_token = F.cross_entropy(logits.flatten(0, -2), y.reshape(-1), reduction="none")
    return per_token.view(y.shape).flatten(1).mean(dim=1)


def generic_functions(model: nn.Module, flat: FlatParams,
                      per_sample: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = sample_losses
                      ) -> tuple[GradFn, ForwardFn]:
    """The reference path: ``vmap(grad_and_value(loss))`` over the parameter rows, for any model; ``per_sample``
    gives each sample's loss ``[B]`` from the logits and the targets (:func:`sample_losses`, or a user's)."""

    def logits(row: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return functional_call(model, flat.unflatten(row), (x,))

    def loss(row: torch.Tensor, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # The mean over the worker's real samples; padding slots (mask 0) weigh nothing.
        return (per_sample(logits(row, x), y) * mask).sum() / mask.sum()

    return vmap(grad_and_value(loss)), logits


def make_functions(model: nn.Module, flat: FlatParams, *, compile: bool = False,
                   loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
                   ) -> tuple[GradFn, ForwardFn]:
    """The fastest ``(grad_fn, forward_fn)`` pair for ``model``, with the semantics of :func:`generic_functions`.

    Args:
        model: A model from :func:`shaky.models.build_model` (any module whose
            parameters ``flat`` describes falls back to the generic path).
        flat: The layout of ``model``'s parameters in a ``[D]`` row.
        compile: Wrap ``grad_fn`` in ``torch.compile``. Off by default: on
            the benchmark machine compiling took 13 to 90 s; it never paid back
            for the MLP and CNN, and for ResNet-20 it paid back after about 300
            steps but its gradients differ from eager by up to 7e-4 (see
            ``docs/performance.md``).
        loss: Each sample's loss from the logits and the targets (``model.loss``); None: cross-entropy. The
            specialised paths compute cross-entropy's gradient by hand, so a loss of the user's takes the
            generic path.

    Returns:
        ``grad_fn`` (see :data:`GradFn`) and ``forward_fn`` (see :data:`ForwardFn`;
        the generic functional call, so ``vmap(forward_fn, in_dims=(0, None))`` works).
    """
    if loss is not None:
        generic_grad, forward_fn = generic_functions(model, flat, loss)
        return (torch.compile(generic_grad, dynamic=False) if compile else generic_grad), forward_fn
    generic_grad, forward_fn = generic_functions(model, flat)
    fast = _build_fast(model, flat)
    if fast is None:
        grad_fn: GradFn = generic_grad
    else:
        grad_fn = fast
    if compile:
        grad_fn = torch.compile(grad_fn, dynamic=False)
    return grad_fn, forward_fn


class BatchedGradFn:
    """A specialised gradient function (the linear, grouped-convolution and recurrent paths) that also computes every
    worker's logits on one shared batch in one batched pass: the evaluation's per-worker test accuracy (see
    :func:`worker_logits`; against ``vmap`` over :data:`ForwardFn` 1.2x faster for the MLP, 2x for the CNN)."""

    def __call__(self, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                 mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def worker_logits(self, params: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``params [W, D]``, ``x [N, ...]`` (the same samples for every worker) -> logits ``[W, N, C]``."""
        raise NotImplementedError


def worker_logits(grad_fn: Callable[..., Any], forward_fn: ForwardFn) -> Callable[[torch.Tensor, torch.Tensor],
                                                                                  torch.Tensor]:
    """``fn(params [W, D], x [N, ...]) -> [W, N, C]``: every worker's logits on the same samples, by the
    specialised path where ``grad_fn`` is one (:class:`BatchedGradFn`), else ``vmap`` over ``forward_fn``. The
    two agree to rounding (the order of a matrix product's sums), not bit for bit."""
    if isinstance(grad_fn, BatchedGradFn):
        return grad_fn.worker_logits
    return vmap(forward_fn, in_dims=(0, None))


class FusedGradFn(BatchedGradFn):
    """A gradient function that can also run with the optimizer in its backward pass (the linear path).

    For a model whose ``[W, D]`` state is large against its compute (the MLP at
    W = 64: 6.7 MB a tensor), assembling the gradients into ``[W, D]`` and then
    reading them again for the update is a large part of a round. ``update_in_place``
    hands each parameter's gradient to the optimizer as soon as it is computed,
    while it is still in cache, and the update goes straight into the parameters
    (``shaky.train.train_step`` chooses it by this type).
    """

    def update_in_place(self, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor,
                        update: InPlaceUpdate) -> torch.Tensor:
        raise NotImplementedError


class _GraphedGradFn(BatchedGradFn):
    """A gradient function whose rounds are hundreds of small kernels (the conv nets, the lstm): on a GPU, where
    launching them from Python bounds the round, :meth:`_eager` is replayed from CUDA graphs (:class:`_GraphCache`;
    ``CUDA_GRAPHS``); elsewhere it runs as it is."""

    _graphs: _GraphCache | None = None

    def __call__(self, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                 mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if params.is_cuda and CUDA_GRAPHS:
            if self._graphs is None:
                self._graphs = _GraphCache(self._eager)
            return self._graphs(params, x, y, mask)
        return self._eager(params, x, y, mask)

    def _eager(self, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
               mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


def fast_path(model: nn.Module) -> str | None:
    """Which specialised path :func:`make_functions` uses for ``model``: ``"linear"``, ``"grouped"``,
    ``"recurrent"`` or None."""
    if _linear_chain(model) is not None:
        return "linear"
    if _is_basic_resnet(model) or _conv_layers(model) is not None:
        return "grouped"
    if isinstance(model, LSTMClassifier):
        return "recurrent"
    return None


# --------------------------------------------------------------------------------------------------------------
# Shared pieces


def _param_index(model: nn.Module, flat: FlatParams) -> dict[int, int]:
    """id(parameter) -> its index in ``flat``'s layout."""
    index = {id(p): i for i, (_, p) in enumerate(model.named_parameters())}
    if len(index) != len(flat.names):
        raise ValueError("model's parameters do not match the FlatParams layout")
    return index


def _row_views(params: torch.Tensor, flat: FlatParams) -> list[torch.Tensor]:
    """``[W, *shape]`` views of every parameter in a ``[W, D]`` tensor (one ``split`` node under autograd)."""
    w = params.shape[0]
    return [p.view(w, *s) for p, s in zip(params.split(flat.numels, dim=1), flat.shapes)]


def _sample_weights(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each real sample's weight in its worker's mean, ``mask / mask.sum(dim=1)`` ([W, B], ``dtype``)."""
    mask = mask.to(dtype)
    return mask / mask.sum(dim=1, keepdim=True)


class _SampleWeights:
    """:func:`_sample_weights`, remembered for the last mask: a training loop passes the same mask every step
    (its values unchanged: the key holds the tensor's version counter, which every in-place write moves)."""

    def __init__(self) -> None:
        self._key: tuple[object, ...] | None = None
        self._value = torch.empty(0)

    def __call__(self, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        key = (mask.data_ptr(), mask._version, tuple(mask.shape), tuple(mask.stride()), mask.dtype, dtype)
        if key != self._key:
            self._value, self._key = _sample_weights(mask, dtype), key
        return self._value


def _loss_and_dlogits(logits: torch.Tensor, y: torch.Tensor, mask: torch.Tensor,
                      scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-worker masked mean cross-entropy of ``logits [W, B, C]`` and its gradient w.r.t. the logits.

    Spelled out (max, exp, sum) rather than ``log_softmax``: for the few classes
    of these models torch's softmax kernels vectorise across a row of only C
    values, and took twice as long as this whole function (0.12 ms of a 1 ms
    round for the MLP at W = 16, see ``docs/performance.md``). ``scale``: the
    mask's sample weights (:func:`_sample_weights`), if the caller has them.
    """
    index = y.unsqueeze(-1)
    z = logits - logits.amax(dim=-1, keepdim=True)
    e = z.exp()
    total = e.sum(dim=-1, keepdim=True)
    nll = (total.log() - z.gather(-1, index)).squeeze(-1)              # [W, B]
    if scale is None:
        scale = _sample_weights(mask, logits.dtype)                     # each real sample's weight in its mean
    losses = (nll * scale).sum(dim=1)
    # d loss_i / d logits[i, b] = (softmax - onehot) * mask[i, b] / count_i
    dlogits = e.div_(total).scatter_add_(-1, index, e.new_full(index.shape, -1.0))
    return losses, dlogits.mul_(scale.unsqueeze(-1))


def _batched_linear(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``h [W, B, in] @ weight[W, out, in]^T + bias [W, out]`` for every worker at once."""
    if bias is None:
        return torch.bmm(h, weight.transpose(1, 2))
    return torch.baddbmm(bias.unsqueeze(1), h, weight.transpose(1, 2))


# --------------------------------------------------------------------------------------------------------------
# logreg / mlp: a chain of Linear layers with ReLUs, forward and backward by hand


@dataclass(frozen=True)
class _Linear:
    weight: int
    """Index of the weight in the flat layout."""
    bias: int | None
    relu: bool
    """Whether a ReLU follows."""


def _linear_chain(model: nn.Module) -> list[nn.Module] | None:
    """The modules of a Flatten/Linear/ReLU chain that ends in a Linear, or None for another model."""
    if isinstance(model, LogReg):
        return [model.fc]
    if isinstance(model, MLP):
        mods = list(model.net)
    else:
        return None
    if mods and isinstance(mods[0], nn.Flatten) and mods[0].start_dim == 1 and mods[0].end_dim == -1:
        mods = mods[1:]
    if not mods or not isinstance(mods[-1], nn.Linear):
        return None
    for prev, mod in zip([None, *mods], mods):
        if not isinstance(mod, nn.Linear | nn.ReLU):
            return None
        if isinstance(mod, nn.ReLU) and not isinstance(prev, nn.Linear):
            return None
    return mods


class _LinearChainGrad(FusedGradFn):
    """grad_fn for a chain of Linear (+ ReLU) layers: batched matmuls, manual backward, no autograd."""

    def __init__(self, model: nn.Module, flat: FlatParams, mods: Sequence[nn.Module]) -> None:
        index = _param_index(model, flat)
        layers: list[_Linear] = []
        for mod in mods:
            if isinstance(mod, nn.ReLU):
                last = layers[-1]
                layers[-1] = _Linear(last.weight, last.bias, True)
            else:
                if not isinstance(mod, nn.Linear):  # _linear_chain only lets Linear and ReLU through
                    raise TypeError(f"fast MLP path: unexpected layer {type(mod).__name__}")
                bias = None if mod.bias is None else index[id(mod.bias)]
                layers.append(_Linear(index[id(mod.weight)], bias, False))
        self.layers = layers
        self.flat = flat
        self._weights = _SampleWeights()
        self._views_key: tuple[object, ...] | None = None
        self._views: list[torch.Tensor] = []
        self._weight_grads: dict[int, torch.Tensor] = {}

    def _weight_grad_out(self, i: int, like: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """Layer ``i``'s weight-gradient buffer ``[W, rows, cols]``, the same storage every step: the gemm writes
        into memory that is still in the cache, not a fresh 4 MB block (about 0.07 ms a step for the MLP at W = 64; the
        bits are bmm's either way). A gradient handed to a sink is read or consumed before the next call."""
        buf = self._weight_grads.get(i)
        shape = (like.shape[0], rows, cols)
        if buf is None or buf.shape != shape or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._weight_grads[i] = like.new_empty(shape)
        return buf

    def _row_views(self, params: torch.Tensor) -> list[torch.Tensor]:
        """:func:`_row_views` of ``params.detach()``, kept while the training loop passes the same storage every
        step (the fused path updates it in place); 40 us a step at W = 16. The kept views hold that storage, so
        no other tensor can be allocated at its address while they are kept."""
        key = (params.data_ptr(), tuple(params.shape), tuple(params.stride()), params.dtype)
        if key != self._views_key:
            self._views, self._views_key = _row_views(params.detach(), self.flat), key
        return self._views

    def __call__(self, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                 mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = params.shape[0]
        pieces: list[torch.Tensor | None] = [None] * len(self.flat.names)

        def keep(index: int, piece: torch.Tensor) -> None:
            pieces[index] = piece

        losses = self._backward(params, x, y, mask, keep)
        # One cat writes every gradient into its slice of the [W, D] result.
        grads = torch.cat([params.new_zeros(w, n) if g is None else g
                           for g, n in zip(pieces, self.flat.numels)], dim=1)
        return grads, losses

    def update_in_place(self, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor,
                        update: InPlaceUpdate) -> torch.Tensor:
        """The backward pass with the optimizer in it: ``update(columns, grad)`` is called once per parameter,
        as soon as its gradient ``[W, n]`` is known and no longer needed by the backward pass, and changes
        ``params[:, columns]`` in place. No ``[W, D]`` gradient is ever assembled. Returns the losses [W].
        """
        offsets = [0]
        for n in self.flat.numels:
            offsets.append(offsets[-1] + n)
        done = [False] * len(self.flat.names)

        def apply(index: int, piece: torch.Tensor) -> None:
            done[index] = True
            update(slice(offsets[index], offsets[index + 1]), piece)

        losses = self._backward(params, x, y, mask, apply)
        for index, finished in enumerate(done):  # parameters outside the chain get a zero gradient
            if not finished:
                apply(index, params.new_zeros(params.shape[0], self.flat.numels[index]))
        return losses

    def worker_logits(self, params: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            p = _row_views(params.detach(), self.flat)
            w = params.shape[0]
            h = x.reshape(x.shape[0], -1).to(params.dtype)
            first, *rest = self.layers
            # The samples are shared, so the first layer of every worker is one matrix product with the W
            # weights side by side ([N, in] @ [in, W * out]), not W small ones.
            weight = p[first.weight].reshape(-1, h.shape[1]).T
            h = h @ weight if first.bias is None else torch.addmm(p[first.bias].reshape(-1), h, weight)
            h = h.view(h.shape[0], w, -1).transpose(0, 1)                   # [W, N, out]
            if first.relu:
                h.relu_()
            for layer in rest:
                h = _batched_linear(h, p[layer.weight], None if layer.bias is None else p[layer.bias])
                if layer.relu:
                    h.relu_()
            return h

    def _backward(self, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor,
                  sink: Callable[[int, torch.Tensor], None]) -> torch.Tensor:
        """Forward and backward; hands each parameter's gradient ``[W, n]`` to ``sink(index, gradient)`` once
        the backward pass has no further use for that parameter's values."""
        with torch.no_grad():
            p = self._row_views(params)
            params = params.detach()
            h = x.reshape(x.shape[0], x.shape[1], -1).to(params.dtype)
            acts = [h]
            for layer in self.layers:
                h = _batched_linear(h, p[layer.weight], None if layer.bias is None else p[layer.bias])
                if layer.relu:
                    h.relu_()
                acts.append(h)
            losses, dz = _loss_and_dlogits(h, y, mask, self._weights(mask, h.dtype))
            w = params.shape[0]
            for i in range(len(self.layers) - 1, -1, -1):
                layer = self.layers[i]
                if i < len(self.layers) - 1 and layer.relu:
                    # ReLU's backward in one pass, without a boolean mask tensor.
                    dz = torch.ops.aten.threshold_backward(dz, acts[i + 1], 0)
                # Into a contiguous buffer of its own, not straight into a [W, D] view: CPU bmm takes its batched
                # gemm path only for a contiguous result and falls back to one gemm per worker otherwise.
                out = self._weight_grad_out(i, dz, dz.shape[2], acts[i].shape[2])
                weight_grad = torch.bmm(dz.transpose(1, 2), acts[i], out=out).reshape(w, -1)
                bias_grad = None if layer.bias is None else dz.sum(dim=1)
                if i:
                    dz = torch.bmm(dz, p[layer.weight])      # the last use of this layer's parameters
                sink(layer.weight, weight_grad)
                if layer.bias is not None and bias_grad is not None:
                    sink(layer.bias, bias_grad)
            return losses


# --------------------------------------------------------------------------------------------------------------
# cnn / ResNets: the worker axis folded into the channels, grouped convolutions, autograd over one graph


def _conv_layers(model: nn.Module) -> list[nn.Module] | None:
    """The layers of a :class:`CNN` if every one of them has a grouped counterpart here, else None."""
    if not isinstance(model, CNN):
        return None
    mods = list(model.net)
    supported = (nn.Conv1d, nn.Conv2d, nn.ReLU, nn.MaxPool1d, nn.MaxPool2d, nn.AdaptiveAvgPool1d,
                 nn.AdaptiveAvgPool2d, nn.Flatten, nn.Linear)
    flat_seen = False
    for mod in mods:
        if not isinstance(mod, supported):
            return None
        if isinstance(mod, nn.Conv1d | nn.Conv2d) and (mod.padding_mode != "zeros" or flat_seen
                                                        or isinstance(mod.padding, str)):
            return None
        if isinstance(mod, nn.Flatten):
            if mod.start_dim != 1 or mod.end_dim != -1:
                return None
            flat_seen = True
        if isinstance(mod, nn.Linear) and not flat_seen:
            return None
    return mods if flat_seen and isinstance(mods[-1], nn.Linear) else None


def _fold(x: torch.Tensor, shape: tuple[int, ...], channels_last: bool) -> torch.Tensor:
    """``x [W, B, ...]`` as ``[B, W * C, *spatial]`` with worker w's channels at ``w * C ... (w + 1) * C - 1``.

    With ``channels_last`` (2-D only) the result is laid out ``[B, H, W', W * C]`` in memory, which oneDNN's
    grouped convolutions and the pooling kernels run fastest on.
    """
    w, b = x.shape[:2]
    x = x.reshape(w, b, *shape)
    if channels_last and len(shape) == 3:
        c, height, width = shape
        # With one channel per worker the reshape merges W and C without copying, which leaves the result
        # laid out worker-major, not channels-last; the conv after it then ran in NCHW, and so did everything
        # downstream (max-pool 7x slower). Ask for the layout explicitly (free when the reshape copied).
        folded = x.permute(1, 3, 4, 0, 2).reshape(b, height, width, w * c).permute(0, 3, 1, 2)
        return folded.contiguous(memory_format=torch.channels_last)
    return x.transpose(0, 1).reshape(b, w * shape[0], *shape[1:])


def _unfold_features(h: torch.Tensor, w: int) -> torch.Tensor:
    """Folded ``[B, W * C, *spatial]`` as per-worker flattened features ``[W, B, C * prod(spatial)]``."""
    return h.reshape(h.shape[0], w, -1).transpose(0, 1)


def _grouped_weight(view: torch.Tensor) -> torch.Tensor:
    """A ``[W, out, in, *k]`` stack of conv weights as one grouped weight ``[W * out, in, *k]``."""
    return view.reshape(view.shape[0] * view.shape[1], *view.shape[2:])


def _grouped_conv(h: torch.Tensor, conv: nn.Conv1d | nn.Conv2d, weight: torch.Tensor,
                  bias: torch.Tensor | None, w: int) -> torch.Tensor:
    fn = F.conv2d if isinstance(conv, nn.Conv2d) else F.conv1d
    return fn(h, _grouped_weight(weight), None if bias is None else bias.reshape(-1), conv.stride, conv.padding,
              conv.dilation, conv.groups * w)


def _grouped_norm(h: torch.Tensor, gn: nn.GroupNorm, weight: torch.Tensor | None,
                  bias: torch.Tensor | None, w: int) -> torch.Tensor:
    # Worker w's channels are contiguous and its groups split them the same way, so W * G groups over the
    # folded channels are exactly the W workers' own groups.
    return F.group_norm(h, gn.num_groups * w, None if weight is None else weight.reshape(-1),
                        None if bias is None else bias.reshape(-1), gn.eps)


def _adaptive_avg_pool(h: torch.Tensor, size: Any) -> torch.Tensor:
    """``F.adaptive_avg_pool{1,2}d(h, size)``; on a GPU, where every window has the same size, as the plain
    average pool it then is: CUDA's adaptive pool has no deterministic backward (atomic adds), the plain one's
    is deterministic. (The CPU keeps the adaptive pool, and so its numbers.)"""
    two_d = h.dim() == 4
    out = (size,) * (h.dim() - 2) if isinstance(size, int) else tuple(size)
    if h.device.type != "cpu" and None not in out and all(n % o == 0 for n, o in zip(h.shape[2:], out)):
        kernel = tuple(n // o for n, o in zip(h.shape[2:], out))
        return F.avg_pool2d(h, kernel) if two_d else F.avg_pool1d(h, kernel)
    return F.adaptive_avg_pool2d(h, size) if two_d else F.adaptive_avg_pool1d(h, size)


def _pool_before_relu(mods: list[nn.Module]) -> list[nn.Module]:
    """``mods`` with every ReLU -> MaxPool pair swapped to MaxPool -> ReLU.

    max is monotone, so ``relu(maxpool(h)) == maxpool(relu(h))``, and the gradient
    is the same too (it flows to the window's maximum where that is positive);
    the ReLU then runs on the pooled, smaller tensor.
    """
    out = list(mods)
    for i in range(len(out) - 1):
        if isinstance(out[i], nn.ReLU) and isinstance(out[i + 1], nn.MaxPool1d | nn.MaxPool2d):
            out[i], out[i + 1] = out[i + 1], out[i]
    return out


def _pad_channels(h: torch.Tensor, w: int, extra: int) -> torch.Tensor:
    """Option-A shortcut on folded ``[B, W * C, H, W']``: zero-pad each worker's C channels by ``extra``."""
    half = extra // 2
    b, c, height, width = h.shape
    # Channels last in memory: pad the innermost (channel) axis per worker, keep the layout.
    nhwc = h.permute(0, 2, 3, 1).reshape(b, height, width, w, c // w)
    return F.pad(nhwc, (half, extra - half)).reshape(b, height, width, -1).permute(0, 3, 1, 2)


class _GroupedGrad(_GraphedGradFn):
    """grad_fn for convolutional nets: one folded forward graph, autograd with ``[W, D]`` as the only leaf."""

    def __init__(self, model: nn.Module, flat: FlatParams, channels_last: bool | None = None) -> None:
        self.model = model
        self.flat = flat
        self.index = _param_index(model, flat)
        # Channels-last is the layout oneDNN's grouped convolutions are fast in: on the benchmark machine (2
        # cores, AVX-512) every grouped 3x3 convolution of the CNN and ResNet-20 ran faster in it, and the
        # first ResNet convolution (3 channels per group) 11x faster with 2 threads. GroupNorm is slower in it
        # (about 1.6x at 32x32), which costs less than the convolutions gain.
        # On a GPU (the H100 of docs/performance.md) cuDNN's grouped convolutions of the CNN ran faster in NCHW.
        on_cpu = next(model.parameters()).device.type == "cpu"
        self.channels_last = on_cpu if channels_last is None else channels_last
        if isinstance(model, ResNet):
            self.logits = self._resnet_logits
        else:
            mods = _conv_layers(model)
            if mods is None:  # fast_path() chose this branch only for a recognised conv net
                raise TypeError(f"fast conv path: {type(model).__name__} is not a recognised conv net")
            self.mods = _pool_before_relu(mods)
            self.logits = self._cnn_logits

    def _p(self, p: list[torch.Tensor], param: torch.Tensor | None) -> torch.Tensor | None:
        return None if param is None else p[self.index[id(param)]]

    def _cnn_logits(self, p: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        w = x.shape[0]
        h = _fold(x, self.model.shape, self.channels_last)
        folded = True
        for mod in self.mods:
            if isinstance(mod, nn.Conv1d | nn.Conv2d):
                h = _grouped_conv(h, mod, self._p(p, mod.weight), self._p(p, mod.bias), w)
            elif isinstance(mod, nn.ReLU):
                # In place: none of the layers before a ReLU here keeps its output for the backward pass.
                h = h.relu_()
            elif isinstance(mod, nn.MaxPool2d):
                h = F.max_pool2d(h, mod.kernel_size, mod.stride, mod.padding, mod.dilation, mod.ceil_mode)
            elif isinstance(mod, nn.MaxPool1d):
                h = F.max_pool1d(h, mod.kernel_size, mod.stride, mod.padding, mod.dilation, mod.ceil_mode)
            elif isinstance(mod, nn.AdaptiveAvgPool2d | nn.AdaptiveAvgPool1d):
                h = _adaptive_avg_pool(h, mod.output_size)
            elif isinstance(mod, nn.Flatten):
                h = _unfold_features(h, w) if folded else h
                folded = False
            else:
                h = _batched_linear(h, self._p(p, mod.weight), self._p(p, mod.bias))
        return h

    def _resnet_logits(self, p: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        m = self.model
        w = x.shape[0]
        h = _fold(x, m.shape, self.channels_last)
        h = _grouped_conv(h, m.conv, self._p(p, m.conv.weight), None, w)
        h = _grouped_norm(h, m.gn, self._p(p, m.gn.weight), self._p(p, m.gn.bias), w).relu_()
        for block in m.blocks:
            if not isinstance(block, BasicBlock):
                raise TypeError(f"fast ResNet path: unexpected block {type(block).__name__}")
            out = _grouped_conv(h, block.conv1, self._p(p, block.conv1.weight), None, w)
            out = _grouped_norm(out, block.gn1, self._p(p, block.gn1.weight), self._p(p, block.gn1.bias), w)
            out = _grouped_conv(out.relu_(), block.conv2, self._p(p, block.conv2.weight), None, w)
            out = _grouped_norm(out, block.gn2, self._p(p, block.gn2.weight), self._p(p, block.gn2.bias), w)
            shortcut = h
            if block.stride != 1:
                shortcut = shortcut[:, :, :: block.stride, :: block.stride]
            if block.extra_ch:
                shortcut = _pad_channels(shortcut, w, block.extra_ch)
            h = out.add_(shortcut).relu_()
        feats = h.mean(dim=(2, 3)).reshape(h.shape[0], w, -1).transpose(0, 1)
        return _batched_linear(feats, self._p(p, m.fc.weight), self._p(p, m.fc.bias))

    def _eager(self, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
               mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.enable_grad():
            leaf = params.detach().requires_grad_()
            logits = self.logits(_row_views(leaf, self.flat), x.to(params.dtype))
            with torch.no_grad():
                losses, dlogits = _loss_and_dlogits(logits.detach(), y, mask)
            (grads,) = torch.autograd.grad(logits, leaf, dlogits)
        return grads, losses

    def worker_logits(self, params: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            w = params.shape[0]
            return self.logits(_row_views(params.detach(), self.flat), x.to(params.dtype).expand(w, *x.shape))


CUDA_GRAPHS = True
"""Whether the conv nets' and the lstm's gradients on a GPU replay a CUDA graph (:class:`_GraphCache`); False:
eager."""


_CAPTURE_STREAMS: MutableMapping[tuple[int, int], object] = weakref.WeakValueDictionary()
"""The capture stream of every live :class:`_GraphCache`, by (device index, stream handle)."""

POOL_DRAWS = 32
"""How many streams :func:`_own_stream` draws before it gives up: PyTorch's pool hands out 32 streams of a
priority per device, round and round."""


def _own_stream(owner: object, draw: Callable[[], Any], held: MutableMapping[tuple[int, int], object],
                tries: int = POOL_DRAWS) -> Any | None:
    """A stream from ``draw`` that no other live owner in ``held`` has, now ``owner``'s; None when every one
    drawn is taken.

    ``torch.cuda.Stream()`` does not make a new stream: it takes the next of a pool of 32, so two graph caches
    would share one once more than 32 had drawn one. A graph that is destroyed clears the cuBLAS workspaces of
    the stream it was captured on (pytorch/pytorch#193402), which a live graph captured on the same stream still
    writes to: its replay would write into freed memory. ``held`` forgets an owner when it is freed.
    """
    for _ in range(tries):
        stream = draw()
        key = (stream.device_index, stream.cuda_stream)
        if held.get(key) is None:
            held[key] = owner
            return stream
    return None


class _GraphCache:
    """A gradient function on a GPU as CUDA graphs: one launch for the whole forward and backward.

    A conv net's or the lstm's round is bound by the host on a GPU: hundreds of small kernels, each launched
    from Python (docs/performance.md). For each shape of the inputs, the third call (the first two run eagerly,
    which creates cuDNN's and cuBLAS's handles and workspaces) warms the function up on the cache's own stream
    and captures it there; every later call copies its inputs into the graph's own, replays it and returns
    copies of its outputs. The same kernels in the same order as the eager calls, so the same bits. At most
    ``MAX_GRAPHS`` shapes are captured (each keeps its activations' memory; none is freed before the cache, so
    none clears the workspace of another on the cache's stream); others run eagerly, and so does every shape
    when no stream of PyTorch's pool is free of other live caches (:func:`_own_stream`; a warning says so).
    """

    MAX_GRAPHS = 2

    def __init__(self, fn: GradFn) -> None:
        self.fn = fn
        self._stream: torch.cuda.Stream | None = None
        self._eager_only = False
        self.calls: dict[tuple[Any, ...], int] = {}
        self.graphs: dict[tuple[Any, ...], tuple[torch.cuda.CUDAGraph, list[torch.Tensor],
                                                 tuple[torch.Tensor, torch.Tensor]]] = {}

    def __call__(self, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                 mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = (params, x, y, mask)
        key = tuple((t.shape, t.dtype, t.device, t.stride()) for t in inputs)
        found = self.graphs.get(key)
        if found is None:
            seen = self.calls[key] = self.calls.get(key, 0) + 1
            if seen < 3 or len(self.graphs) >= self.MAX_GRAPHS or self._eager_only:
                return self.fn(*inputs)
            captured = self._capture(inputs)
            if captured is None:
                return self.fn(*inputs)
            found = self.graphs[key] = captured
        graph, static, out = found
        for mine, given in zip(static, inputs):
            mine.copy_(given)
        graph.replay()
        return out[0].clone(), out[1].clone()

    def _capture(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor],
                                                                  tuple[torch.Tensor, torch.Tensor]] | None:
        device = inputs[0].device
        # Dead graphs (a finished run's, held by a reference cycle) are freed now, not by the cycle collector in
        # the middle of this capture: a graph that is destroyed clears the cuBLAS workspaces of its capture
        # stream (CUBLAS_STATUS_EXECUTION_FAILED in the gpu tests when every cache captured on PyTorch's one
        # default capture stream). This cache's own stream, which no other live cache has, is warmed up and
        # captured on.
        gc.collect()
        if self._stream is None:
            self._stream = _own_stream(self, lambda: torch.cuda.Stream(device), _CAPTURE_STREAMS)
            if self._stream is None:
                self._eager_only = True
                warnings.warn(f"every stream of PyTorch's pool on {device} is held by another live graph cache: "
                              "these gradients run without CUDA graphs (the same numbers, more slowly)",
                              RuntimeWarning, stacklevel=3)
                return None
        static = [t.detach().clone() for t in inputs]
        side = self._stream
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):   # warm-up on the capture stream before capture, as PyTorch asks
                self.fn(*static)
        graph = torch.cuda.CUDAGraph()
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
                out = self.fn(*static)
        finally:
            if collecting:
                gc.enable()
        torch.cuda.current_stream(device).wait_stream(side)
        return graph, static, out


# --------------------------------------------------------------------------------------------------------------
# lstm: every worker's recurrence as batched matmuls over [W, B, ...], the backward through time by hand


class _RecurrentGrad(_GraphedGradFn):
    """grad_fn for :class:`shaky.models.LSTMClassifier`: the model's forward over ``[W, B, ...]`` for every
    worker at once, and its backward through time written out by hand.

    Each step's gate product is one ``bmm`` for all workers. Autograd (or vmap) would also add every step's
    ``[W, 4H, H]`` recurrent-weight gradient into the sum as it goes, L writes of W times a model's matrix;
    here the backward keeps each step's gate gradients (``[W, L, B, 4H]``) and forms the weight gradients
    after the loop, one ``bmm`` each over all L * B rows, as the input weights' already are. The same
    operations per worker as the model's ``forward`` (the gates in the order i, f, g, o; padding steps carry
    ``(h, c)`` forward), so the same numbers to float rounding (``tests/test_vectorized.py``).
    """

    def __init__(self, model: LSTMClassifier, flat: FlatParams) -> None:
        self.model = model
        self.flat = flat
        index = _param_index(model, flat)
        self._at = {name: index[id(param)] for name, param in (
            ("embed", model.embed.weight), ("ih_w", model.ih.weight), ("ih_b", model.ih.bias),
            ("hh_w", model.hh.weight), ("fc_w", model.fc.weight), ("fc_b", model.fc.bias))}

    def _forward(self, p: list[torch.Tensor], x: torch.Tensor, keep: bool) -> tuple[torch.Tensor, dict[str, Any]]:
        """``x [W, B, L]`` token ids -> (logits ``[W, B, C]``, what the backward pass needs if ``keep``)."""
        at, hidden = self._at, self.model.hidden
        w, b, length = x.shape
        steps = x.transpose(1, 2)                                                # [W, L, B], time-major
        rows = torch.arange(w, device=x.device).view(w, 1, 1)
        emb = p[at["embed"]][rows, steps].reshape(w, length * b, -1)             # [W, L * B, E]
        gates_x = torch.baddbmm(p[at["ih_b"]].unsqueeze(1), emb, p[at["ih_w"]].transpose(1, 2))
        gates_x = gates_x.view(w, length, b, 4 * hidden)
        real = (steps != 0).unsqueeze(-1)                                        # [W, L, B, 1]
        hh = p[at["hh_w"]].transpose(1, 2)                                       # [W, H, 4H]
        # Kept for the backward pass: each step's gate activations (sigmoid i, sigmoid f, tanh g, sigmoid o),
        # tanh of the new cell, and the (h, c) it started from.
        acts = gates_x.new_empty(w, length, b, 4 * hidden) if keep else None
        tanh_c = gates_x.new_empty(w, length, b, hidden) if keep else None
        h_in = gates_x.new_empty(w, length, b, hidden) if keep else None
        c_in = gates_x.new_empty(w, length, b, hidden) if keep else None
        h = gates_x.new_zeros(w, b, hidden)
        c = h
        two, three = 2 * hidden, 3 * hidden
        for t in range(length):
            pre = torch.baddbmm(gates_x[:, t], h, hh)
            a = acts[:, t] if acts is not None else torch.empty_like(pre)
            torch.sigmoid(pre[..., :two], out=a[..., :two])
            torch.tanh(pre[..., two:three], out=a[..., two:three])
            torch.sigmoid(pre[..., three:], out=a[..., three:])
            c_new = a[..., hidden:two] * c + a[..., :hidden] * a[..., two:three]
            tc = torch.tanh(c_new)
            h_new = a[..., three:] * tc
            if keep:
                tanh_c[:, t] = tc
                h_in[:, t] = h
                c_in[:, t] = c
            c = torch.where(real[:, t], c_new, c)
            h = torch.where(real[:, t], h_new, h)
        logits = _batched_linear(h, p[at["fc_w"]], p[at["fc_b"]])
        saved = {"steps": steps, "emb": emb, "real": real, "acts": acts, "tanh_c": tanh_c, "h_in": h_in,
                 "c_in": c_in, "h": h}
        return logits, saved

    def _eager(self, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
               mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            at, hidden = self._at, self.model.hidden
            p = _row_views(params.detach(), self.flat)
            logits, s = self._forward(p, x, keep=True)
            losses, dlogits = _loss_and_dlogits(logits, y, mask)
            w, length, b, _ = s["acts"].shape
            grads: list[torch.Tensor] = list(p)    # every entry replaced below
            grads[at["fc_w"]] = torch.bmm(dlogits.transpose(1, 2), s["h"])
            grads[at["fc_b"]] = dlogits.sum(dim=1)
            dh = torch.bmm(dlogits, p[at["fc_w"]])                              # [W, B, H]
            dc = torch.zeros_like(dh)
            dgates = torch.empty_like(s["acts"])                                 # [W, L, B, 4H]
            hh = p[at["hh_w"]]                                                   # [W, 4H, H]
            two, three = 2 * hidden, 3 * hidden
            for t in range(length - 1, -1, -1):
                real, a, tc = s["real"][:, t], s["acts"][:, t], s["tanh_c"][:, t]
                # h = where(real, h_new, h_in), and the same for c: the gradient goes to one of the two.
                dh_new = torch.where(real, dh, 0.0)
                dc_new = torch.where(real, dc, 0.0)
                si, sf, tg, so = a[..., :hidden], a[..., hidden:two], a[..., two:three], a[..., three:]
                dc_new = dc_new + dh_new * so * (1 - tc * tc)
                g = dgates[:, t]
                torch.mul(dc_new * tg, si * (1 - si), out=g[..., :hidden])
                torch.mul(dc_new * s["c_in"][:, t], sf * (1 - sf), out=g[..., hidden:two])
                torch.mul(dc_new * si, 1 - tg * tg, out=g[..., two:three])
                torch.mul(dh_new * tc, so * (1 - so), out=g[..., three:])
                dc = torch.where(real, 0.0, dc) + dc_new * sf
                dh = torch.baddbmm(torch.where(real, 0.0, dh), g, hh)
            flat_g = dgates.view(w, length * b, 4 * hidden)
            grads[at["hh_w"]] = torch.bmm(flat_g.transpose(1, 2), s["h_in"].view(w, length * b, hidden))
            grads[at["ih_w"]] = torch.bmm(flat_g.transpose(1, 2), s["emb"])
            grads[at["ih_b"]] = flat_g.sum(dim=1)
            demb = torch.bmm(flat_g, p[at["ih_w"]])                              # [W, L * B, E]
            vocab = p[at["embed"]].shape[1]
            token = (s["steps"].reshape(w, -1) + vocab * torch.arange(w, device=x.device).unsqueeze(1)).reshape(-1)
            grads[at["embed"]] = torch.zeros_like(p[at["embed"]]).view(w * vocab, -1).index_add_(
                0, token, demb.reshape(w * length * b, -1)).view(w, vocab, -1)
            return torch.cat([g.reshape(w, -1) for g in grads], dim=1), losses

    EVAL_BYTES = 256 << 20
    """At most this many bytes of input projections (``[W, n, L, 4H]``) at a time in :meth:`worker_logits`:
    the evaluation hands it 2,048 test sentences at once, which at W = 64, L = 32 and H = 128 would be 8 GB."""

    def worker_logits(self, params: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            w, length = params.shape[0], x.shape[1]
            p = _row_views(params.detach(), self.flat)
            per_sample = w * length * 4 * self.model.hidden * params.element_size()
            pieces = x.split(max(1, self.EVAL_BYTES // per_sample))
            return torch.cat([self._forward(p, xs.expand(w, *xs.shape), keep=False)[0] for xs in pieces], dim=1)


def _is_basic_resnet(model: nn.Module) -> bool:
    return isinstance(model, ResNet) and all(isinstance(b, BasicBlock) for b in model.blocks)


def _build_fast(model: nn.Module, flat: FlatParams) -> GradFn | None:
    mods = _linear_chain(model)
    if mods is not None:
        return _LinearChainGrad(model, flat, mods)
    if _is_basic_resnet(model) or _conv_layers(model) is not None:
        return _GroupedGrad(model, flat)
    if isinstance(model, LSTMClassifier):
        return _RecurrentGrad(model, flat)
    return None


# --------------------------------------------------------------------------------------------------------------
# Process settings


def tune_allocator(*, keep_large_blocks: bool = True) -> bool:
    """Keep freed memory in the process instead of returning it to the OS every step (glibc only).

    glibc serves large blocks with mmap and unmaps them on free, and trims the
    heap once a few MB are free, so a loop that allocates and frees the same big
    tensors every step (the ``[W, D]`` parameters and gradients, the activations of
    ``W * B`` samples) page-faults on fresh memory every step. On the benchmark
    machine that was 400k page faults and half the time of a CNN round at W = 64
    (see ``docs/performance.md``). Process-wide; call it once at start-up.

    Args:
        keep_large_blocks: Serve every block from the heap and never trim it
            (fastest; the heap keeps its peak size, and fragmentation can raise the
            peak resident memory, about 1.6x for ResNet-20 at W = 64). False only
            raises the mmap threshold to glibc's maximum, 32 MiB, and the trim
            threshold to 512 MiB: blocks up to 32 MiB are reused, larger ones are
            still mapped and unmapped.

    Returns:
        True if the settings were applied (False where the C library is not glibc).
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold, m_mmap_max = -1, -3, -4
    if keep_large_blocks:
        ok = mallopt(m_mmap_max, 0) == 1
        ok &= mallopt(m_trim_threshold, 2**31 - 1) == 1
    else:
        ok = mallopt(m_mmap_threshold, 32 << 20) == 1
        ok &= mallopt(m_trim_threshold, 512 << 20) == 1
    return bool(ok)
