"""The block geometry of a flat parameter vector, which the network model and every backend share.

A block exchange cuts a row of D values into W contiguous blocks (``block_sizes``), block j served by one
worker; when the unit of loss is a datagram's segment, ``segment_length``/``segment_counts`` cut each
block into segments. The delivery masks of a round (``LinkSample``) are bool [W, W] (one message per
block) or [W, W, S] (segment k of each block).

Pure functions of sizes: no tensors are moved here, and torch is not imported.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


def block_sizes(dim: int, num_blocks: int) -> list[int]:
    """Splits ``dim`` values into ``num_blocks`` contiguous blocks as equal as possible (larger ones first)."""
    base, extra = divmod(dim, num_blocks)
    return [base + 1] * extra + [base] * (num_blocks - extra)


def segment_length(segment_bytes: int, itemsize: int) -> int:
    """Values per segment when a message is cut into segments of at most ``segment_bytes`` bytes.

    ``max(1, segment_bytes // itemsize)`` (a value is never split); 0 when ``segment_bytes`` is 0, which
    means no cut: a block travels as one message.
    """
    return max(1, segment_bytes // itemsize) if segment_bytes > 0 else 0


def segment_counts(dim: int, num_blocks: int, seg_len: int) -> list[int]:
    """S_j, the segments of each block of ``block_sizes(dim, num_blocks)``: ceil(n_j / seg_len) (1 if seg_len is 0).

    Segment k of block j holds the block's values [k * seg_len, min((k + 1) * seg_len, n_j)). Segment-level
    delivery masks are [W, W, S] with S = max(1, max_j S_j); entries with k >= S_j are padding (True).
    """
    if seg_len <= 0:
        return [1] * num_blocks
    return [-(-n // seg_len) for n in block_sizes(dim, num_blocks)]


def segment_values(sizes: list[int], seg_len: int) -> np.ndarray:
    """float [blocks, S]: the values in segment k of each block of ``sizes`` (0 past a block's last segment)."""
    num_segments = max(1, *[-(-n // seg_len) for n in sizes])
    return np.clip(np.asarray(sizes, dtype=np.float64)[:, None] - np.arange(num_segments) * seg_len, 0, seg_len)


@lru_cache(maxsize=64)
def block_groups(dim: int, num_workers: int) -> tuple[tuple[int, int, int, int], ...]:
    """The blocks of a ``[W, dim]`` exchange as groups of equal size, (first block, last + 1, first column, size):
    blocks come in at most two sizes, larger ones first, so a group is a plain reshape ``[W, blocks, size]`` (no
    gather, no Python loop over the workers). Empty blocks (dim < W) are left out."""
    sizes = block_sizes(dim, num_workers)
    big = sizes.count(sizes[0])
    groups = [(0, big, 0, sizes[0]), (big, num_workers, big * sizes[0], sizes[-1])]
    return tuple(g for g in groups if g[3] > 0 and g[1] > g[0])


@dataclass(frozen=True, slots=True)
class LinkSample:
    """Delivery masks of one round (True = delivered): bool [W, W] each, or [W, W, S] with segments.

    The masks are per block, and each block is a message of its own: when a dead worker's block is served by
    its successor, that successor's link carries two messages, lost each on its own (the paper's model).
    While worker j serves block j (no failure) a block's message and a link are the same thing.

    A real transport builds one from what it observed: ``LinkSample(round, up, down, segment_bytes)``
    with the masks laid out as below (a server's own part True, padding True).
    """

    round: int
    up: torch.Tensor
    """up[i, j]: worker i's message of block j reached the block's server (phase 1); up[i, j, k]: its segment k.
    True where i serves block j (its own part never travels)."""
    down: torch.Tensor
    """down[j, i]: the average of block j reached worker i (phase 2); down[j, i, k]: segment k of it. True where
    i serves block j."""
    segment_bytes: int = 0
    """The segments' size in bytes (``network.segment_bytes``); 0: the masks are [W, W], one message per block."""

    def __post_init__(self) -> None:
        ndim = 2 if self.segment_bytes == 0 else 3
        if self.up.dim() != ndim or self.down.shape != self.up.shape:
            raise ValueError(f"LinkSample with segment_bytes {self.segment_bytes} needs masks of {ndim} dimensions, "
                             f"up and down alike; got up {list(self.up.shape)}, down {list(self.down.shape)}")


def own_parts(servers: Sequence[int] | np.ndarray) -> np.ndarray:
    """bool [W, W]: ``[i, j]`` True where worker i serves block j (``servers[j]``): the entries of
    ``LinkSample.up`` that never travel (transposed: those of ``down``)."""
    srv = np.asarray(servers, dtype=np.int64)
    own = np.zeros((len(srv), len(srv)), dtype=bool)
    own[srv, np.arange(len(srv))] = True
    return own
