"""A seeded model of an unreliable network: which messages of a round arrive.

Every round has two message slots, the two phases of a block exchange:
``up[i, j]`` says whether worker i's message to server j arrived (phase 1) and
``down[j, i]`` whether server j's message to worker i arrived (phase 2). A
worker's message to itself never travels, so the diagonals are always True.

``sample(round)`` is a pure function of (seed, round): every rank of a
torch.distributed run and the simulator draw the same masks, so runs replay bit
for bit. With Gilbert-Elliott bursts each link is a two-state Markov chain over
message slots; the chain is replayed from slot 0 whenever a caller asks for an
earlier round than the last one, so purity holds there too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shaky.config import Matrix, NetworkConfig
from shaky.network.presets import region_of_workers, region_rtt_ms

# Keeps the network's random stream apart from every other stream seeded by the run seed.
_NETWORK_STREAM = 0x6E6574


@dataclass(frozen=True, slots=True)
class LinkSample:
    """Delivery masks of one round (bool [W, W] each; True = delivered)."""

    round: int
    up: torch.Tensor
    """up[i, j]: worker i's message to server j arrived (phase 1)."""
    down: torch.Tensor
    """down[j, i]: server j's message to worker i arrived (phase 2)."""


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

    def __init__(self, cfg: NetworkConfig, num_workers: int, seed: int) -> None:
        self.num_workers = num_workers
        self.seed = seed
        self.drop = as_matrix(cfg.drop_rate, num_workers)
        self.latency_ms, self.bandwidth_mbps = link_matrices(cfg, num_workers)
        self.burst_enter = cfg.burst_enter
        self.burst_exit = cfg.burst_exit
        self.burst_drop = cfg.burst_drop_rate
        self._eye = np.eye(num_workers, dtype=bool)
        # Bursty chains: the bad-state matrix after the last sampled round.
        self._chain_round = -1
        self._chain_bad = np.zeros((2, num_workers, num_workers), dtype=bool)

    def _rng(self, round_: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, _NETWORK_STREAM, round_])

    def _advance_chain(self, round_: int) -> np.ndarray:
        """Bad-state masks [2, W, W] for the two slots of ``round_`` (slot 0 then slot 1)."""
        if round_ <= self._chain_round:
            self._chain_round, self._chain_bad[:] = -1, False
        while self._chain_round < round_:
            r = self._chain_round + 1
            u = np.random.default_rng([self.seed, _NETWORK_STREAM, r, 1]).random((2,) + self.drop.shape)
            bad = self._chain_bad[1].copy()  # the state left by the previous round's last slot
            for slot in range(2):
                bad = np.where(bad, u[slot] >= self.burst_exit, u[slot] < self.burst_enter)
                self._chain_bad[slot] = bad
            self._chain_round = r
        return self._chain_bad

    def sample(self, round_: int) -> LinkSample:
        """The delivery masks of ``round_``; a pure function of (seed, round_)."""
        u = self._rng(round_).random((2,) + self.drop.shape)
        drop = np.broadcast_to(self.drop, u.shape)
        if self.burst_enter > 0.0:
            drop = np.where(self._advance_chain(round_), self.burst_drop, drop)
        delivered = (u >= drop) | self._eye
        # down is indexed [server, worker], the sender first, like up.
        return LinkSample(round_, torch.from_numpy(delivered[0]), torch.from_numpy(delivered[1]))


class MaskLog:
    """The delivery masks of every round so far, packed into bits in one preallocated buffer.

    A run keeps every round's masks for its trace. Keeping each round's LinkSample
    alive instead left small long-lived allocations between the large tensors that
    every step frees, so the allocator could not reuse those blocks: the heap grew by
    megabytes a step (1.4 GB after 300 steps at W = 16, and an out-of-memory kill at
    W = 64) and every step page-faulted on fresh memory.
    """

    def __init__(self, num_workers: int, capacity: int = 1024) -> None:
        self.num_workers = num_workers
        width = (num_workers * num_workers + 7) // 8
        # Preallocated for the planned rounds (up to 65536; beyond, append doubles it).
        self._up = np.zeros((min(max(capacity, 1), 1 << 16), width), dtype=np.uint8)
        self._down = np.zeros_like(self._up)
        self.rounds = 0

    def append(self, links: LinkSample) -> None:
        if self.rounds == len(self._up):  # past the planned capacity: double it (rare, one large block)
            self._up = np.concatenate([self._up, np.zeros_like(self._up)])
            self._down = np.concatenate([self._down, np.zeros_like(self._down)])
        self._up[self.rounds] = np.packbits(links.up.numpy().reshape(-1))
        self._down[self.rounds] = np.packbits(links.down.numpy().reshape(-1))
        self.rounds += 1

    def packed(self) -> dict[str, np.ndarray]:
        """Arrays [rounds, ceil(W*W/8)] of uint8, the layout of ``trace.npz``."""
        return {"up": self._up[:self.rounds], "down": self._down[:self.rounds]}


def pack_masks(samples: list[LinkSample]) -> dict[str, np.ndarray]:
    """Packs the masks of consecutive rounds into bits: arrays [R, ceil(W*W/8)] of uint8."""
    if not samples:
        return {"up": np.zeros((0, 0), np.uint8), "down": np.zeros((0, 0), np.uint8)}
    log = MaskLog(samples[0].up.shape[0], len(samples))
    for s in samples:
        log.append(s)
    return log.packed()


class TraceNetwork(NetworkModel):
    """Replays the delivery masks recorded by an earlier run instead of sampling them."""

    def __init__(self, cfg: NetworkConfig, num_workers: int, seed: int, up: np.ndarray, down: np.ndarray) -> None:
        super().__init__(cfg, num_workers, seed)
        self._up, self._down = up, down

    @property
    def num_rounds(self) -> int:
        return int(self._up.shape[0])

    def sample(self, round_: int) -> LinkSample:
        if round_ >= self.num_rounds:
            raise IndexError(f"the replayed trace holds {self.num_rounds} rounds; round {round_} was asked for")
        w = self.num_workers
        unpack = lambda a: torch.from_numpy(np.unpackbits(a[round_], count=w * w).astype(bool).reshape(w, w))  # noqa: E731
        return LinkSample(round_, unpack(self._up), unpack(self._down))


TRACE_FILE = "trace.npz"


def save_trace(run_dir: Path, packed: dict[str, np.ndarray], num_workers: int) -> None:
    """Writes the packed masks atomically into ``run_dir/trace.npz`` (see ``shaky.rundir.atomic_write``)."""
    from shaky.rundir import atomic_write  # noqa: PLC0415 (rundir imports nothing of the network)

    atomic_write(Path(run_dir) / TRACE_FILE, lambda f: np.savez_compressed(
        f, up=packed["up"], down=packed["down"], num_workers=np.int64(num_workers)), "wb")


def load_trace(path: str, num_workers: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Reads a trace from a run directory (or a trace.npz file), checking it fits this run."""
    p = Path(path)
    f = p / TRACE_FILE if p.is_dir() else p
    try:
        with np.load(f) as z:
            up, down, w = z["up"], z["down"], int(z["num_workers"])
    except (OSError, KeyError, ValueError) as exc:
        raise ValueError(f"network.trace: cannot read a trace from {path!r} ({exc})") from None
    if w != num_workers:
        raise ValueError(f"network.trace {path!r} was recorded with {w} workers, but num_workers is {num_workers}")
    if up.shape[0] < steps:
        raise ValueError(f"network.trace {path!r} holds {up.shape[0]} rounds, fewer than steps = {steps}")
    return up, down
