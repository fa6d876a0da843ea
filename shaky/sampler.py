"""Mini-batches: which samples each worker trains on at each step, a pure function of (seed, worker, step)."""

from __future__ import annotations

import numpy as np
import torch

# Keeps the mini-batch stream apart from the other streams seeded by the run seed.
_BATCH_STREAM = 0x626174


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over a uint64 array (not a scalar: arrays wrap modulo 2**64 silently)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _permuted(pos: np.ndarray, n: np.ndarray, key: np.ndarray) -> np.ndarray:
    """Where a keyed random permutation of ``range(n)`` sends each position (arrays of one shape).

    Four rounds of bijections on the m-bit integers, 2**m the smallest power of two >= n
    (xor with a round key, multiplication by an odd round key modulo 2**m, an xor-shift
    by half the width), applied again to the images that land at n or beyond ("cycle
    walking", under two rounds on average), then a keyed rotation: a bijection of
    ``range(n)`` evaluated at just the positions a step needs, with no permutation
    stored or sorted. Where a position lands is uniform over the keys (chi-square
    checked for n = 2 to 1000), and so are pairs of positions where checked
    (n = 22); the orders of shards of a few samples come from a smaller family,
    which matters little since a batch then spans the whole shard.
    """
    n = n.astype(np.uint64)
    bits = np.ceil(np.log2(np.maximum(n, 2).astype(np.float64))).astype(np.uint64)
    mask = (np.uint64(1) << bits) - np.uint64(1)
    half = (bits + np.uint64(1)) // np.uint64(2)
    round_keys = [_mix(key + np.uint64(r)) for r in (1, 2, 3, 4)]
    x = pos.astype(np.uint64)
    todo = np.ones(x.shape, dtype=bool)
    while todo.any():
        y, m, h = x[todo], mask[todo], half[todo]
        for k in round_keys:
            y = (y ^ k[todo]) & m
            y = (y * (k[todo] | np.uint64(1))) & m
            y = y ^ (y >> h)
        x[todo] = y
        todo[todo] = y >= n[todo]
    # A final keyed rotation of range(n) makes where each position lands uniform over the keys,
    # which the rounds alone do not for small n (they draw from few bijections of few bits).
    return ((x + _mix(key) % n) % n).astype(np.int64)


class BatchSampler:
    """Mini-batch indices per worker: a pure function of (seed, worker, step).

    Worker i walks through its shard in a fresh random order each epoch, the order a
    keyed permutation of (seed, i, epoch) (see ``_permuted``), so a resumed run, the
    simulator and every torch.distributed rank draw the same batches without saving
    any state. A step computes just the positions it needs, for all workers at once:
    a fixed number of array operations on [w, batch] arrays, whatever the number of
    workers or the size of their shards.
    """

    def __init__(self, shards: list[np.ndarray], rows: list[int], batch_sizes: tuple[int, ...] | list[int],
                 seed: int) -> None:
        self.rows = rows
        self.batch_sizes = np.asarray([batch_sizes[r] for r in rows], dtype=np.int64)
        self.width = max(batch_sizes)
        self.seed = seed
        self.lengths = np.asarray([len(shards[r]) for r in rows], dtype=np.int64)
        if (self.lengths == 0).any():
            raise ValueError(f"worker {rows[int(np.argmin(self.lengths))]} has no training samples")
        self._padded = np.zeros((len(rows), int(self.lengths.max())), dtype=np.int64)  # shard k in row k
        for k, r in enumerate(rows):
            self._padded[k, :len(shards[r])] = shards[r]
        run_key = _mix(np.array([seed ^ _BATCH_STREAM], dtype=np.uint64))
        self._worker_keys = _mix(run_key + np.asarray(rows, dtype=np.uint64))
        # Which slots of the padded [w, width] batch are real samples (workers may differ in batch size).
        self.mask = torch.from_numpy((np.arange(self.width)[None, :] < self.batch_sizes[:, None]).astype(np.float32))

    def indices(self, step: int) -> torch.Tensor:
        """int64 [w, width]: each local worker's samples at ``step``, padded (see ``mask``) to the widest batch."""
        slots = np.arange(self.width)[None, :]
        real = slots < self.batch_sizes[:, None]
        epochs, offsets = np.divmod(step * self.batch_sizes[:, None] + slots, self.lengths[:, None])
        keys = _mix(self._worker_keys[:, None] + epochs.astype(np.uint64))
        lengths = np.broadcast_to(self.lengths[:, None], offsets.shape)
        picked = self._padded[np.arange(len(self.rows))[:, None], _permuted(offsets, lengths, keys)]
        return torch.from_numpy(np.where(real, picked, 0))
