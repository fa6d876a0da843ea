"""A seeded model of an unreliable network: which messages of a round arrive.

Every round has two message slots, the two phases of a block exchange:
``up[i, j]`` says whether worker i's message to server j arrived (phase 1) and
``down[j, i]`` whether server j's message to worker i arrived (phase 2). A
worker's message to itself never travels, so the diagonals are always True.

With ``network.segment_bytes`` > 0 the unit of loss is a segment (a datagram's
payload) instead of a whole block: the masks are bool [W, W, S], ``up[i, j, k]``
for segment k of block j (``shaky.geometry.segment_counts`` gives the layout;
entries past a block's last segment are padding, True). Every segment of a link
is dropped on its own with the link's drop probability; with bursts, the link's
state in a slot (good or bad) holds for all the segments it sends in that slot.
Segment draws come from the same (seed, round) stream with a trailing segment
axis, so a segment as large as the largest block draws exactly the block-level
masks, and ``segment_bytes`` 0 leaves the block-level stream untouched.

``sample(round)`` is a pure function of (seed, round): every rank of a
torch.distributed run and the simulator draw the same masks, so runs replay bit
for bit. With Gilbert-Elliott bursts each link is a two-state Markov chain over
message slots; the chain is replayed from slot 0 whenever a caller asks for an
earlier round than the last one, so purity holds there too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from shaky.geometry import LinkSample, own_parts, segment_counts, segment_length
from shaky.native import SeededUniform
from shaky.network.presets import region_of_workers, region_rtt_ms

if TYPE_CHECKING:
    from shaky.config import Matrix, NetworkConfig

# Keeps the network's random stream apart from every other stream seeded by the run seed.
_NETWORK_STREAM = 0x6E6574


def as_matrix(value: float | Matrix, num_workers: int) -> np.ndarray:
    """A scalar or [W][W] setting as a float64 [W, W] array."""
    if isinstance(value, tuple):
        return np.asarray(value, dtype=np.float64)
    return np.full((num_workers, num_workers), float(value))


def link_matrices(cfg: NetworkConfig, num_workers: int) -> tuple[np.ndarray, np.ndarray]:
    """One-way latency (ms) and bandwidth (Mbit/s) of every link, [W, W] each.

    Without regions, the settings as given. With ``cfg.regions``, workers are spread
    over the regions in contiguous blocks; inside a region the scalar ``latency_ms``
    and ``bandwidth_mbps`` apply (the LAN), between regions half the measured round
    trip and ``wan_bandwidth_mbps`` (see shaky.network.presets).
    """
    latency = as_matrix(cfg.latency_ms, num_workers)
    bandwidth = as_matrix(cfg.bandwidth_mbps, num_workers)
    if cfg.regions:
        region = region_of_workers(len(cfg.regions), num_workers)
        for i in range(num_workers):
            for j in range(num_workers):
                if region[i] != region[j]:
                    latency[i, j] = region_rtt_ms(cfg.regions[region[i]], cfg.regions[region[j]]) / 2
                    bandwidth[i, j] = cfg.wan_bandwidth_mbps
    return latency, bandwidth


class NetworkModel:
    """Per-link drop probabilities (optionally bursty), latency and bandwidth for W workers."""

    def __init__(self, cfg: NetworkConfig, num_workers: int, seed: int, *, dim: int | None = None,
                 itemsize: int = 4, seg_len: int | None = None) -> None:
        """``dim`` and ``itemsize``: the values in one message (a row of the exchanged [W, D] tensor) and their
        bytes; needed only with ``cfg.segment_bytes`` > 0, to cut each block into segments. ``seg_len``: the
        values a segment holds where not ``segment_length(cfg.segment_bytes, itemsize)`` (a run that rounds its
        values leaves room for int8's scale: ``shaky.comm.quant.fine_length``)."""
        self.num_workers = num_workers
        self.seed = seed
        # _uniform(shape, *keys): default_rng([seed, _NETWORK_STREAM, *keys]).random(shape), in C where built.
        self._uniform = SeededUniform(seed, _NETWORK_STREAM)
        self.segment_bytes = cfg.segment_bytes
        self.dim, self.itemsize = dim, itemsize
        # Padding of the segment masks: [block j, segment k] is True where k is past block j's last segment.
        self._padding: np.ndarray | None = None
        if cfg.segment_bytes and dim is not None:
            seg = segment_length(cfg.segment_bytes, itemsize) if seg_len is None else seg_len
            counts = segment_counts(dim, num_workers, seg)
            self._padding = np.arange(max(1, *counts))[None, :] >= np.asarray(counts)[:, None]
        self.drop = as_matrix(cfg.drop_rate, num_workers)
        self.latency_ms, self.bandwidth_mbps = link_matrices(cfg, num_workers)
        self.burst_enter = cfg.burst_enter
        self.burst_exit = cfg.burst_exit
        self.burst_drop = cfg.burst_drop_rate
        self._eye = np.eye(num_workers, dtype=bool)
        # Bursty chains: the bad-state matrix after the last sampled round.
        self._chain_round = -1
        self._chain_bad = np.zeros((2, num_workers, num_workers), dtype=bool)

    def _advance_chain(self, round_: int) -> np.ndarray:
        """Bad-state masks [2, W, W] for the two slots of ``round_`` (slot 0 then slot 1)."""
        if round_ <= self._chain_round:
            self._chain_round, self._chain_bad[:] = -1, False
        while self._chain_round < round_:
            r = self._chain_round + 1
            u = self._uniform((2,) + self.drop.shape, r, 1)
            bad = self._chain_bad[1].copy()  # the state left by the previous round's last slot
            for slot in range(2):
                bad = np.where(bad, u[slot] >= self.burst_exit, u[slot] < self.burst_enter)
                self._chain_bad[slot] = bad
            self._chain_round = r
        return self._chain_bad

    def sample(self, round_: int, servers: torch.Tensor | None = None) -> LinkSample:
        """The delivery masks of ``round_``; a pure function of (seed, round_, servers).

        ``servers``: int [W], the worker serving each block (``Membership.servers``; None: worker j serves block
        j). The masks are per block (``LinkSample``): the message of block j from worker i gets a draw of its
        own, at the drop rate (and burst state) of the link it travels on, i -> servers[j] (phase 1) and
        servers[j] -> i (phase 2). A successor's two blocks are two messages, lost independently; with the
        default servers the draws are the same as without ``servers``.
        """
        if self.segment_bytes:
            return self._sample_segments(round_, servers)
        u = self._uniform((2,) + self.drop.shape, round_)
        drop, own = self._per_message(round_, servers)
        delivered = (u >= drop) | own
        # down is indexed [block (its server), worker], the sender first, like up.
        return LinkSample(round_, torch.from_numpy(delivered[0]), torch.from_numpy(delivered[1]))

    def _per_message(self, round_: int, servers: torch.Tensor | None) -> tuple[np.ndarray, np.ndarray]:
        """(drop probability, never travels) of each message of the round's two slots: [2, W, W] (or [W, W] for
        both) and [2, W, W] (or [W, W]), up's [sender, block] and down's [block, worker]."""
        drop = self.drop   # [W, W], for both slots
        bad = self._advance_chain(round_) if self.burst_enter > 0.0 else None
        if servers is None:
            own = self._eye
        else:   # block j travels on its server's links
            srv = np.asarray(servers, dtype=np.int64)
            drop = np.stack([drop[:, srv], drop[srv, :]])
            bad = None if bad is None else np.stack([bad[0][:, srv], bad[1][srv, :]])
            own_up = own_parts(srv)
            own = np.stack([own_up, own_up.T])
        if bad is not None:
            drop = np.where(bad, self.burst_drop, drop)
        return drop, own

    def _sample_segments(self, round_: int, servers: torch.Tensor | None) -> LinkSample:
        """Segment-level masks [W, W, S]: every segment of a link dropped on its own at the link's rate."""
        if self._padding is None:
            raise ValueError(f"network.segment_bytes = {self.segment_bytes} cuts each block into segments, so the "
                             "network model needs the message's size: NetworkModel(..., dim=D, itemsize=...)")
        num_segments = self._padding.shape[1]
        u = self._uniform((2,) + self.drop.shape + (num_segments,), round_)
        # A link's state in a slot holds for every segment it sends then.
        drop, own = self._per_message(round_, servers)
        delivered = (u >= drop[..., None]) | own[..., None]
        # Padding past block j's last segment: up is [sender, server j, k], down is [server j, worker, k].
        delivered[0] |= self._padding[None, :, :]
        delivered[1] |= self._padding[:, None, :]
        return LinkSample(round_, torch.from_numpy(delivered[0]), torch.from_numpy(delivered[1]),
                          self.segment_bytes)


class MaskLog:
    """The delivery masks of every round so far, packed into bits in one preallocated buffer.

    A run keeps every round's masks for its trace. Keeping each round's LinkSample
    alive instead left small long-lived allocations between the large tensors that
    every step frees, so the allocator could not reuse those blocks: the heap grew by
    megabytes a step (1.4 GB after 300 steps at W = 16, and an out-of-memory kill at
    W = 64) and every step page-faulted on fresh memory.

    A round is one row: for each segment k in turn, the bits of the [W, W] plane
    ``mask[:, :, k]`` (``np.packbits``, padded to a whole byte), so a row holds S
    planes of ceil(W*W/8) bytes (S = 1: one message per block, the plane alone).
    The first appended round sets S; every later round must have the same.
    """

    def __init__(self, num_workers: int, capacity: int = 1024) -> None:
        self.num_workers = num_workers
        self.num_segments = 1
        self.segment_bytes = 0
        self._plane = (num_workers * num_workers + 7) // 8
        # Preallocated for the planned rounds (up to 65536; beyond, append doubles it).
        self._capacity = min(max(capacity, 1), 1 << 16)
        self._up = np.zeros((self._capacity, self._plane), dtype=np.uint8)
        self._down = np.zeros_like(self._up)
        self.rounds = 0

    def _set_segments(self, num_segments: int, segment_bytes: int) -> None:
        if self.rounds:
            raise ValueError(f"the delivery masks changed their segments from {self.num_segments} "
                             f"(segment_bytes {self.segment_bytes}) to {num_segments} (segment_bytes "
                             f"{segment_bytes}) in the middle of a run")
        self.num_segments, self.segment_bytes = num_segments, segment_bytes
        width = num_segments * self._plane
        # Untouched pages of np.zeros cost no memory, but keep the reservation itself moderate (64 MiB).
        rows = max(1, min(self._capacity, (64 << 20) // width)) if num_segments > 1 else self._capacity
        self._up = np.zeros((rows, width), dtype=np.uint8)
        self._down = np.zeros_like(self._up)

    def append(self, links: LinkSample) -> None:
        num_segments = 1 if links.up.dim() == 2 else links.up.shape[2]
        if (num_segments, links.segment_bytes) != (self.num_segments, self.segment_bytes):
            self._set_segments(num_segments, links.segment_bytes)
        if self.rounds == len(self._up):  # past the planned capacity: double it (rare, one large block)
            self._up = np.concatenate([self._up, np.zeros_like(self._up)])
            self._down = np.concatenate([self._down, np.zeros_like(self._down)])
        self._up[self.rounds] = _pack(links.up)
        self._down[self.rounds] = _pack(links.down)
        self.rounds += 1

    def put(self, round_: int, links: LinkSample) -> None:
        """Replaces the masks of an appended round (a real transport's observed masks, known when its exchange
        completed, in place of the drawn ones appended at the round)."""
        if not 0 <= round_ < self.rounds:
            raise IndexError(f"round {round_} has not been appended (rounds: {self.rounds})")
        num_segments = 1 if links.up.dim() == 2 else links.up.shape[2]
        if (num_segments, links.segment_bytes) != (self.num_segments, self.segment_bytes):
            raise ValueError(f"round {round_}'s masks have {num_segments} segments of {links.segment_bytes} bytes; "
                             f"the log holds {self.num_segments} of {self.segment_bytes}")
        self._up[round_] = _pack(links.up)
        self._down[round_] = _pack(links.down)

    def restore(self, packed: dict[str, np.ndarray]) -> None:
        """Takes the rounds of ``packed`` (another log's :meth:`packed`, e.g. a peer's, handed to a rank that
        rejoins) in place of this empty log's."""
        if self.rounds:
            raise ValueError(f"restore needs an empty log; this one holds {self.rounds} rounds")
        rounds = len(packed["up"])
        if rounds:
            self._set_segments(int(packed["num_segments"]), int(packed["segment_bytes"]))
            if len(self._up) < rounds:
                self._up = np.zeros((rounds, self._up.shape[1]), dtype=np.uint8)
                self._down = np.zeros_like(self._up)
            self._up[:rounds], self._down[:rounds] = packed["up"], packed["down"]
        self.rounds = rounds

    def packed(self) -> dict[str, np.ndarray]:
        """Arrays [rounds, S * ceil(W*W/8)] of uint8 and the segments' count and size: the layout of ``trace.npz``
        (its masks per block, ``LinkSample``'s)."""
        return {"up": self._up[:self.rounds], "down": self._down[:self.rounds],
                "num_segments": np.int64(self.num_segments), "segment_bytes": np.int64(self.segment_bytes),
                "by_block": np.int64(1)}


def _pack(mask: torch.Tensor) -> np.ndarray:
    """One round's mask, [W, W] or [W, W, S], as S packed planes of ceil(W*W/8) bytes each."""
    if mask.dim() == 2:
        return np.packbits(mask.numpy().reshape(-1))
    w, _, num_segments = mask.shape
    return np.packbits(mask.numpy().transpose(2, 0, 1).reshape(num_segments, w * w), axis=1).reshape(-1)


def pack_masks(samples: list[LinkSample]) -> dict[str, np.ndarray]:
    """Packs the masks of consecutive rounds into bits: arrays [R, S * ceil(W*W/8)] of uint8 (see MaskLog)."""
    if not samples:
        return {"up": np.zeros((0, 0), np.uint8), "down": np.zeros((0, 0), np.uint8)}
    log = MaskLog(samples[0].up.shape[0], len(samples))
    for s in samples:
        log.append(s)
    return log.packed()


class TraceNetwork(NetworkModel):
    """Replays the delivery masks recorded by an earlier run instead of sampling them.

    ``up`` and ``down`` are the packed rows of ``trace.npz`` ([R, S * ceil(W*W/8)], see MaskLog); S is read
    from their width. Segment masks (S > 1, or any S when ``cfg.segment_bytes`` > 0) replay as [W, W, S]
    with ``cfg.segment_bytes``, which must be the recorded run's (``load_trace`` checks it when asked).

    ``by_block``: the masks are per block (``LinkSample``; every trace written since blocks became messages of
    their own). A trace written before (False) holds per-link masks: the replay gives block j its server's
    link, ``up[:, servers]`` and ``down[servers, :]``, as that run's exchanges read them, so it replays exactly.
    """

    def __init__(self, cfg: NetworkConfig, num_workers: int, seed: int, up: np.ndarray, down: np.ndarray,
                 by_block: bool = True) -> None:
        super().__init__(cfg, num_workers, seed)
        plane = (num_workers * num_workers + 7) // 8
        width = up.shape[1] if up.ndim == 2 else -1
        if width < 0 or (len(up) and (width == 0 or width % plane)) or down.shape != up.shape:
            raise ValueError(f"network.trace: the masks are {list(up.shape)} and {list(down.shape)}, not rows of "
                             f"packed [{num_workers}, {num_workers}] planes ({plane} bytes each)")
        self.num_segments = max(1, width // plane)
        if self.num_segments > 1 and not cfg.segment_bytes:
            raise ValueError(f"network.trace holds {self.num_segments} segments per block; set "
                             "network.segment_bytes to the recorded run's value to replay it")
        self._up, self._down = up, down
        self.by_block = by_block

    @property
    def num_rounds(self) -> int:
        return int(self._up.shape[0])

    @property
    def packed(self) -> tuple[np.ndarray, np.ndarray]:
        """The packed up and down rows it replays, as read."""
        return self._up, self._down

    def sample(self, round_: int, servers: torch.Tensor | None = None) -> LinkSample:
        if round_ >= self.num_rounds:
            raise IndexError(f"the replayed trace holds {self.num_rounds} rounds; round {round_} was asked for")
        # A server's own part never travels: it is True whatever the file says (a rank that died before its
        # peers agreed on it recorded nothing, and an average over no sender is 0 / 0).
        moved = servers is not None
        if moved and not self.by_block:
            srv = torch.as_tensor(servers)
            up, down = self._unpack(self._up[round_], self._eye), self._unpack(self._down[round_], self._eye)
            up, down = up[:, srv], down[srv, :]
        else:
            own = own_parts(np.asarray(servers)) if moved else self._eye
            up, down = self._unpack(self._up[round_], own), self._unpack(self._down[round_], own.T)
        return LinkSample(round_, up, down, self.segment_bytes if self.segment_bytes else 0)

    def _unpack(self, row: np.ndarray, own: np.ndarray) -> torch.Tensor:
        """One round's row of S packed planes as a bool [W, W] mask (or [W, W, S] with segments), ``own`` True."""
        w, s = self.num_workers, self.num_segments
        if not self.segment_bytes:
            return torch.from_numpy(np.unpackbits(row, count=w * w).astype(bool).reshape(w, w) | own)
        planes = np.unpackbits(row.reshape(s, -1), axis=1, count=w * w).astype(bool).reshape(s, w, w) | own
        return torch.from_numpy(np.ascontiguousarray(planes.transpose(1, 2, 0)))
