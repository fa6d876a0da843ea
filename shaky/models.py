"""Models, and the flat-parameter view the vectorized simulator trains them through.

The simulator holds every worker's parameters as one ``[W, D]`` tensor and runs
all forward/backward passes at once with
``torch.func.vmap(torch.func.grad_and_value(loss_fn))``, where ``loss_fn`` turns
one row into parameter views (:meth:`FlatParams.unflatten`) and calls
``torch.func.functional_call``. Every model here is therefore a pure function of
its parameters: no buffers, no dropout, no in-place ops on inputs, and only ops
that have vmap batching rules (which is why the LSTM is written out by hand:
``nn.LSTM`` does not vmap).

Normalisation is GroupNorm, not BatchNorm: BatchNorm's running statistics are
buffers, which neither vmap as pure functions nor average meaningfully across
workers, and batch statistics degrade badly when workers hold non-IID data
(Hsieh et al., 2020, "The Non-IID Data Quagmire of Decentralized Machine
Learning").
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

MODELS: tuple[str, ...] = (
    "logreg",
    "mlp",
    "cnn",
    "resnet20",
    "resnet32",
    "resnet44",
    "resnet56",
    "resnet110",
    "lstm",
    "gpt",
)

DEFAULT_HIDDEN: int = 128
GPT_EMBED: int = 64
"""gpt's default embedding width (``model.hidden`` 0)."""
GPT_LAYERS: int = 2
GPT_HEADS: int = 4
EMBED_DIM: int = 64
# Two groups per GroupNorm layer, as in the GroupNorm ResNets of federated
# CIFAR benchmarks (Reddi et al., 2021, "Adaptive Federated Optimization"); it
# divides every stage width (16/32/64) and keeps 8+ channels per group.
GN_GROUPS: int = 2


def resnet_depth(name: str) -> int:
    """Depth of a CIFAR ResNet model name.

    Args:
        name: A name such as ``"resnet20"``.

    Returns:
        The depth ``6n + 2``.

    Raises:
        ValueError: If ``name`` is not one of the ResNets in :data:`MODELS`.
    """
    if not name.startswith("resnet") or name not in MODELS:
        raise ValueError(f"model.name is not a ResNet in {MODELS}; got {name!r}")
    return int(name.removeprefix("resnet"))


def _square_side(features: int) -> int | None:
    """Side ``s`` with ``s * s == features``, or ``None`` if there is none."""
    side = math.isqrt(features)
    return side if side * side == features else None


class LogReg(nn.Module):
    """Multinomial logistic regression on the flattened input."""

    def __init__(self, in_features: int, num_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(in_features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``[B, *input_shape]`` to logits ``[B, num_classes]``."""
        return self.fc(x.flatten(1))


class MLP(nn.Module):
    """Two-hidden-layer ReLU perceptron on the flattened input."""

    def __init__(self, in_features: int, hidden: int, num_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``[B, *input_shape]`` to logits ``[B, num_classes]``."""
        return self.net(x)


class CNN(nn.Module):
    """Small convolutional net, 2-D for images and 1-D for sequences of features.

    conv(32, 3x3) -> ReLU -> maxpool(2) -> conv(64, 3x3) -> ReLU ->
    adaptive average pool to 2x2 (2-D) or 4 (1-D) -> Linear. The adaptive pool
    keeps coarse position information (which global pooling would drop) while
    making the head's size independent of the input resolution.
    """

    def __init__(self, shape: tuple[int, ...], num_classes: int) -> None:
        """Build the net.

        Args:
            shape: ``(C, H, W)`` for Conv2d or ``(C, L)`` for Conv1d; each
                spatial size must be at least 2 so that the max pool fits.
            num_classes: Number of output logits.
        """
        super().__init__()
        self.shape = shape
        two_d = len(shape) == 3
        conv = nn.Conv2d if two_d else nn.Conv1d
        pool = nn.MaxPool2d(2) if two_d else nn.MaxPool1d(2)
        avg = nn.AdaptiveAvgPool2d((2, 2)) if two_d else nn.AdaptiveAvgPool1d(4)
        self.net = nn.Sequential(
            conv(shape[0], 32, 3, padding=1),
            nn.ReLU(),
            pool,
            conv(32, 64, 3, padding=1),
            nn.ReLU(),
            avg,
            nn.Flatten(),
            nn.Linear(64 * 4, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``[B, *input_shape]`` to logits ``[B, num_classes]``."""
        return self.net(x.reshape(x.shape[0], *self.shape))


class BasicBlock(nn.Module):
    """ResNet basic block with GroupNorm and a parameter-free option-A shortcut."""

    def __init__(self, in_ch: int, out_ch: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.gn1 = nn.GroupNorm(GN_GROUPS, out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False)
        self.gn2 = nn.GroupNorm(GN_GROUPS, out_ch)
        self.stride = stride
        self.extra_ch = out_ch - in_ch

    def _shortcut(self, x: torch.Tensor) -> torch.Tensor:
        # Option A (He et al., 2016, Sec. 4.2): subsample and zero-pad channels,
        # so the CIFAR parameter counts match the paper's (0.27M for ResNet-20).
        if self.stride != 1:
            x = x[:, :, :: self.stride, :: self.stride]
        if self.extra_ch:
            half = self.extra_ch // 2
            x = F.pad(x, (0, 0, 0, 0, half, self.extra_ch - half))
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``[B, C, H, W]``."""
        out = F.relu(self.gn1(self.conv1(x)))
        out = self.gn2(self.conv2(out))
        return F.relu(out + self._shortcut(x))


class ResNet(nn.Module):
    """CIFAR ResNet of depth ``6n + 2`` (He et al., 2016) with GroupNorm."""

    def __init__(self, depth: int, shape: tuple[int, int, int], num_classes: int) -> None:
        """Build the net.

        Args:
            depth: ``6n + 2``; three stages of ``n`` blocks at 16/32/64 channels.
            shape: Input ``(C, H, W)``.
            num_classes: Number of output logits.
        """
        super().__init__()
        n = (depth - 2) // 6
        self.shape = shape
        self.conv = nn.Conv2d(shape[0], 16, 3, padding=1, bias=False)
        self.gn = nn.GroupNorm(GN_GROUPS, 16)
        blocks: list[nn.Module] = []
        in_ch = 16
        for stage, out_ch in enumerate((16, 32, 64)):
            for i in range(n):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(BasicBlock(in_ch, out_ch, stride))
                in_ch = out_ch
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``[B, *input_shape]`` to logits ``[B, num_classes]``."""
        out = F.relu(self.gn(self.conv(x.reshape(x.shape[0], *self.shape))))
        out = self.blocks(out)
        return self.fc(out.mean(dim=(2, 3)))


class LSTMClassifier(nn.Module):
    """Embedding -> one-layer LSTM -> Linear, on padded token ids (0 = padding).

    The recurrence is explicit per-timestep math because ``nn.LSTM`` has no vmap
    batching rule. Padding steps carry ``(h, c)`` forward unchanged, so the
    state read at the end is the one after each sequence's last real token,
    whatever the amount or position of padding.
    """

    def __init__(self, vocab_size: int, hidden: int, num_classes: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.embed = nn.Embedding(vocab_size, EMBED_DIM)
        self.ih = nn.Linear(EMBED_DIM, 4 * hidden)
        self.hh = nn.Linear(hidden, 4 * hidden, bias=False)
        self.fc = nn.Linear(hidden, num_classes)
        with torch.no_grad():
            # Forget-gate bias 1 (Jozefowicz et al., 2015) so early gradients
            # are not cut off by a half-closed forget gate.
            self.ih.bias[hidden : 2 * hidden].fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map token ids ``[B, L]`` (int64, 0 = padding) to logits ``[B, num_classes]``.

        Raises:
            ValueError: If ``x`` is not an integer tensor.
        """
        if x.is_floating_point() or x.is_complex():
            raise ValueError(
                f"model.name='lstm' needs integer token ids; got dtype {x.dtype}"
            )
        # Input projections for all steps at once; only h @ W_hh is sequential. The steps are taken apart by
        # one unbind, not L slices: each slice's backward writes a zero-filled [B, L, 4H] (O(L^2) traffic),
        # the unbind's stacks the L gradients once. The same values either way.
        gates_x = self.ih(self.embed(x)).unbind(1)
        real = (x != 0).unsqueeze(-1).unbind(1)
        h = gates_x[0].new_zeros(x.shape[0], self.hidden)
        c = h
        for t in range(x.shape[1]):
            i, f, g, o = (gates_x[t] + self.hh(h)).chunk(4, dim=-1)
            c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h_new = torch.sigmoid(o) * torch.tanh(c_new)
            c = torch.where(real[t], c_new, c)
            h = torch.where(real[t], h_new, h)
        return self.fc(h)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which each position sees itself and the positions before it.

    Written out (scores, mask, softmax) rather than ``F.scaled_dot_product_attention``: under ``vmap`` over the
    workers' parameter rows the fused kernel has no batching rule and runs worker by worker (a warning, and
    slower), while these matmuls batch over the workers.
    """

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, C]`` -> ``[B, T, C]``."""
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(x).split(c, dim=-1))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // self.heads))
        later = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)   # a position's future
        attn = scores.masked_fill(later, float("-inf")).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, t, c))


class GPTBlock(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x)), the MLP 4x wide with GELU."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, C]`` -> ``[B, T, C]``."""
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A small decoder-only transformer in nanoGPT's spirit, for next-token prediction.

    Token and learned position embeddings, ``layers`` pre-norm blocks, a final LayerNorm and a linear head to
    the vocabulary (not tied to the token embedding: one parameter, one place in the flat row). No dropout and
    no buffers, so every worker's model is a pure function of its parameters. Initialised as nanoGPT: normal
    weights of std 0.02 (the residual projections 0.02 / sqrt(2 * layers)), zero biases.
    """

    def __init__(self, vocab_size: int, context: int, width: int = GPT_EMBED, layers: int = GPT_LAYERS,
                 heads: int = GPT_HEADS) -> None:
        super().__init__()
        self.context = context
        self.tokens = nn.Embedding(vocab_size, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(GPTBlock(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() > 1:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("attn.proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map token ids ``[B, T]`` (T at most the context) to next-token logits ``[B, T, vocab_size]``.

        Raises:
            ValueError: If ``x`` is not an integer tensor.
        """
        if x.is_floating_point() or x.is_complex():
            raise ValueError(f"model.name='gpt' needs integer token ids; got dtype {x.dtype}")
        h = self.tokens(x) + self.positions(torch.arange(x.shape[-1], device=x.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))


def _make(
    name: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    vocab_size: int,
    hidden: int,
) -> nn.Module:
    """Construct (not seed) the named model, or raise on a misfit input."""
    misfit = f"model.name={name!r} does not fit input_shape={input_shape}"
    features = math.prod(input_shape)
    if name == "logreg":
        return LogReg(features, num_classes)
    if name == "mlp":
        return MLP(features, hidden or DEFAULT_HIDDEN, num_classes)
    if name == "lstm":
        if len(input_shape) != 1:
            raise ValueError(f"{misfit}: needs token ids of shape (L,)")
        if vocab_size < 2:
            raise ValueError(f"model.name='lstm' needs vocab_size >= 2; got {vocab_size}")
        return LSTMClassifier(vocab_size, hidden or DEFAULT_HIDDEN, num_classes)
    if name == "gpt":
        if len(input_shape) != 1:
            raise ValueError(f"{misfit}: needs byte or token ids of shape (T,)")
        if vocab_size < 2 or num_classes > vocab_size:
            raise ValueError(f"model.name='gpt' predicts the next of vocab_size tokens; got vocab_size "
                             f"{vocab_size} for {num_classes} classes")
        width = hidden or GPT_EMBED
        if width % GPT_HEADS:
            raise ValueError(f"model.hidden {width} must be a multiple of gpt's {GPT_HEADS} heads")
        return GPT(vocab_size, input_shape[0], width)
    side = _square_side(features) if len(input_shape) == 1 else None
    if name == "cnn":
        if len(input_shape) == 3:
            shape = input_shape
        elif side is not None:
            shape = (1, side, side)
        elif len(input_shape) == 1:
            shape = (1, features)
        else:
            raise ValueError(f"{misfit}: needs (C, H, W) or flat (F,) features")
        if min(shape[1:]) < 2:
            raise ValueError(f"{misfit}: spatial sizes must be >= 2")
        return CNN(shape, num_classes)
    if len(input_shape) == 3:
        shape3 = input_shape
    elif side is not None:
        shape3 = (1, side, side)
    else:
        raise ValueError(f"{misfit}: needs (C, H, W) or flat (F,) with F a perfect square")
    return ResNet(resnet_depth(name), shape3, num_classes)


def build_model(
    name: str,
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    vocab_size: int = 0,
    hidden: int = 0,
    seed: int,
) -> nn.Module:
    """Build a model with parameters initialised deterministically from ``seed``.

    Args:
        name: One of :data:`MODELS`, or a factory (``package.module:factory``, ``path/to/file.py:factory``,
            see :mod:`shaky.user`), called as ``factory(input_shape, num_classes)`` under ``seed``.
        input_shape: Shape of one example (no batch dimension), e.g. ``(64,)``,
            ``(3, 32, 32)``, or ``(L,)`` token ids for ``"lstm"``.
        num_classes: Number of output logits.
        vocab_size: Vocabulary size for ``"lstm"`` (token 0 is padding) and ``"gpt"``.
        hidden: Hidden width of ``"mlp"`` and ``"lstm"``, embedding width of ``"gpt"``; 0 means 128 (gpt: 64).
        seed: Initialisation seed; the global RNG state is left untouched.

    Returns:
        The model, a pure function of its parameters (no buffers; a factory's is checked by
        ``shaky.user.check_model`` once the data is known).

    Raises:
        ValueError: On an unknown name, bad sizes, or an input the model cannot take.
    """
    if ":" in name:
        from shaky import user  # noqa: PLC0415

        return user.build_model(name, tuple(int(s) for s in input_shape), num_classes, seed)
    if name not in MODELS:
        raise ValueError(f"model.name must be one of {MODELS}; got {name!r}")
    input_shape = tuple(int(s) for s in input_shape)
    if not input_shape or min(input_shape) < 1:
        raise ValueError(f"model.name={name!r} needs a non-empty input_shape; got {input_shape}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1; got {num_classes}")
    if hidden < 0:
        raise ValueError(f"hidden must be >= 0 (0 = default); got {hidden}")
    # Module constructors draw from the global RNG; fork it so seeding here
    # neither depends on nor disturbs the caller's random state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _make(name, input_shape, num_classes, vocab_size, hidden)


class FlatParams:
    """Layout of a module's parameters as one flat vector, in ``named_parameters()`` order.

    Attributes:
        names: Parameter names.
        shapes: Parameter shapes.
        numels: Parameter sizes.
        offsets: Start of each parameter in the flat vector.
        dim: Total number of parameters ``D``.
    """

    def __init__(self, module: nn.Module) -> None:
        params = list(module.named_parameters())
        self.names: list[str] = [n for n, _ in params]
        self.shapes: list[torch.Size] = [p.shape for _, p in params]
        self.numels: list[int] = [p.numel() for _, p in params]
        self.offsets: list[int] = [0]
        for numel in self.numels[:-1]:
            self.offsets.append(self.offsets[-1] + numel)
        self.dim: int = sum(self.numels)

    def flatten(self, module: nn.Module) -> torch.Tensor:
        """Return a detached ``[D]`` copy of ``module``'s current parameters.

        Raises:
            ValueError: If ``module``'s parameter layout differs from this one.
        """
        shapes = [p.shape for p in module.parameters()]
        if shapes != self.shapes:
            raise ValueError("module's parameter shapes differ from this FlatParams layout")
        return torch.cat([p.detach().reshape(-1) for p in module.parameters()])

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Split a ``[D]`` row into named parameter views.

        Only ``split`` and ``view`` are used, so this works inside vmap and keeps
        the autograd link to ``flat`` (gradients come back as one ``[D]`` vector).
        """
        pieces = flat.split(self.numels)
        return {n: p.view(s) for n, p, s in zip(self.names, pieces, self.shapes)}

    def load(self, module: nn.Module, flat: torch.Tensor) -> None:
        """Copy a ``[D]`` row into ``module``'s parameters in place."""
        with torch.no_grad():
            for p, v in zip(module.parameters(), self.unflatten(flat).values()):
                p.copy_(v)
