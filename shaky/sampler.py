"""Mini-batches: which samples each worker trains on at each step, a pure function of (seed, worker, step)."""

from __future__ import annotations

import numpy as np
import torch

from shaky import native

# Keeps the mini-batch stream apart from the other streams seeded by the run seed.
_BATCH_STREAM = 0x626174
_BLOCK_STEPS, _BLOCK_VALUES = 64, 1 << 20


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over a uint64 array (not a scalar: arrays wrap modulo 2**64 silently)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _permuted(pos: np.ndarray, n: np.ndarray, key: np.ndarray) -> np.ndarray:
    """Where a keyed random permutation of ``range(n)`` sends each position (arrays that broadcast together).

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
    n = np.asarray(n).astype(np.uint64)
    round_keys, multipliers, rotation = _key_schedule(np.asarray(key, dtype=np.uint64))
    return _walk(np.asarray(pos), n, round_keys, multipliers, rotation % n)


def _key_schedule(key: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """A permutation's four round keys, their odd multipliers and its rotation (before ``% n``)."""
    round_keys = [_mix(key + np.uint64(r)) for r in (1, 2, 3, 4)]
    return round_keys, [k | np.uint64(1) for k in round_keys], _mix(key)


def _walk(pos: np.ndarray, n: np.ndarray, round_keys: list[np.ndarray], multipliers: list[np.ndarray],
          rotation: np.ndarray) -> np.ndarray:
    """``_permuted`` from its key schedule (``rotation`` already ``% n``); every argument broadcasts to one
    shape. The first pass runs on whole arrays; only the images that land at n or beyond, a fraction, are
    gathered and walked on."""
    bits = np.ceil(np.log2(np.maximum(n, 2).astype(np.float64))).astype(np.uint64)
    mask = (np.uint64(1) << bits) - np.uint64(1)
    half = (bits + np.uint64(1)) // np.uint64(2)

    def rounds(y: np.ndarray, m: np.ndarray, h: np.ndarray, ks: list[np.ndarray],
               ms: list[np.ndarray]) -> np.ndarray:
        for k, mult in zip(ks, ms):
            y = (y ^ k) & m
            y = (y * mult) & m
            y = y ^ (y >> h)
        return y

    shape = np.broadcast_shapes(pos.shape, n.shape, rotation.shape, *(k.shape for k in round_keys))
    x = np.array(np.broadcast_to(rounds(pos.astype(np.uint64), mask, half, round_keys, multipliers), shape))
    where = np.nonzero(x >= n)
    if len(where[0]):
        # The walk runs on flat positions, with what each needs stacked into one [11, k] array, so that
        # dropping the finished ones is one indexing operation per array, not one per parameter.
        todo = np.ravel_multi_index(where, shape)
        params = np.stack([np.broadcast_to(a, shape)[where] for a in (n, mask, half, *round_keys, *multipliers)])
        flat = x.reshape(-1)
        y = flat[todo]
        while len(y):
            y = rounds(y, params[1], params[2], list(params[3:7]), list(params[7:11]))
            done = y < params[0]
            flat[todo[done]] = y[done]
            left = ~done
            todo, y, params = todo[left], y[left], params[:, left]
    # A final keyed rotation of range(n) makes where each position lands uniform over the keys,
    # which the rounds alone do not for small n (they draw from few bijections of few bits).
    return ((x + rotation) % n).astype(np.int64)


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
        # Steps computed per block: up to 64, about a million indices at most.
        self._block_steps = max(1, min(_BLOCK_STEPS, _BLOCK_VALUES // (len(rows) * self.width)))
        self._block_start, self._block = 0, np.zeros((0, len(rows), self.width), dtype=np.int64)

    def indices(self, step: int) -> torch.Tensor:
        """int64 [w, width]: each local worker's samples at ``step``, padded (see ``mask``) to the widest batch.

        Computed for a block of steps at once and served from it: the arrays are small, so one call over
        many steps costs little more than one over a single step (at W = 16, 0.4 ms a step alone)."""
        k = step - self._block_start
        if not 0 <= k < len(self._block):
            self._block_start, self._block = step, self._compute(step, self._block_steps)
            k = 0
        return torch.from_numpy(self._block[k])

    def _compute(self, first: int, count: int, *, compiled: bool = True) -> np.ndarray:
        """int64 [count, w, width]: the indices of steps ``first`` to ``first + count - 1``; in C where the
        library was built (``shaky_batch_indices``, the same numbers; ``compiled=False``: numpy's)."""
        lib = native.FASTPATH
        if compiled and lib is not None:
            out = np.empty((count, len(self.rows), self.width), dtype=np.int64)
            lib.shaky_batch_indices(out.ctypes.data, first, count, len(self.rows), self.width,
                                    self.batch_sizes.ctypes.data, self.lengths.ctypes.data,
                                    self._worker_keys.ctypes.data, self._padded.ctypes.data, self._padded.shape[1])
            return out
        steps = np.arange(first, first + count, dtype=np.int64)[:, None, None]
        slots = np.arange(self.width)[None, None, :]
        real = slots < self.batch_sizes[None, :, None]
        lengths = self.lengths[None, :, None]
        epochs, offsets = np.divmod(steps * self.batch_sizes[None, :, None] + slots, lengths)
        # Keys depend on (worker, epoch) only: the key schedule is made for the few epochs of the block, per
        # worker, and looked up, instead of once per sample.
        first_epoch, last_epoch = epochs.min(axis=(0, 2)), epochs.max(axis=(0, 2))
        spanned = int((last_epoch - first_epoch).max()) + 1
        epoch_table = (first_epoch[:, None] + np.arange(spanned)[None, :]).astype(np.uint64)
        keys = _mix(self._worker_keys[:, None] + epoch_table)              # [w, epochs]
        round_keys, multipliers, rotation = _key_schedule(keys)
        rotation = rotation % self.lengths[:, None].astype(np.uint64)
        where = np.arange(len(self.rows))[None, :, None] * spanned + (epochs - first_epoch[None, :, None])

        def look_up(table: np.ndarray) -> np.ndarray:
            return np.take(table, where)
        permuted = _walk(offsets, lengths.astype(np.uint64), [look_up(k) for k in round_keys],
                         [look_up(k) for k in multipliers], look_up(rotation))
        picked = self._padded[np.arange(len(self.rows))[None, :, None], permuted]
        return np.where(real, picked, 0)
