"""The UDP data plane (shaky/comm/udp/) on 127.0.0.1: 2-4 ranks as threads (one process: the socket calls
release the GIL), one test with 4 processes (forked from a fork server).

Loss and lateness are injected deterministically by the test-only ``fault`` hook (a datagram dropped or held
back until the sender's call ends, by phase, block, segment and destination), never by sleeps; attacks are
datagrams queued in a rank's socket before its round starts, or sent from the hook while a round runs.
Every result is compared with the rule computed here in numpy from the masks the ranks observed, and the
observed masks with the drops that were injected.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import hmac
import math
import multiprocessing as mp
import os
import socket
import struct
import threading
from contextlib import ExitStack, contextmanager

import numpy as np
import pytest
import torch

import shaky.comm.udp.exchange as exchange_module
from shaky.comm.udp import (FASTPATH, FINAL_DATAGRAMS, HEADER, OVERHEAD_BYTES, TAG_BYTES, AdaptiveDeadline,
                            UdpExchange, UdpOptions, run_masks)
from shaky.comm.udp.wire import _Mac
from shaky.geometry import block_sizes

KEY = bytes(range(32))
RUN = 7
PORTS = range(42000, 43000)
# 64-byte segments (16 float32 or 8 float64 a datagram). A phase whose very last datagram from a sender is
# lost closes after a grace; no test here loses one except where it says so, and with threads descheduled
# at will a short grace could close a phase before a sender's final datagrams are all out.
SMALL = UdpOptions(datagram_bytes=OVERHEAD_BYTES + 64, final_grace_s=5.0)
ROUND_TIMEOUT_S = 30.0
NOT_BUILT = "the compiled fast path (shaky/comm/_fastpath.c) was not built by this install"
# The receive paths a test runs on: the compiled one (tags in C, recvmmsg, a batch placed with numpy) and
# Python's (datagram by datagram); both must apply the same rules.
NEEDS_BUILD = pytest.mark.skipif(FASTPATH is None, reason=NOT_BUILT)
PATHS = [pytest.param(True, id="compiled", marks=NEEDS_BUILD), pytest.param(False, id="python")]


@contextmanager
def group(num_workers: int, options: UdpOptions = SMALL, key: bytes = KEY, compiled: bool | None = None,
          latency_s=None):
    """``latency_s``: None, or rank -> the one-way latencies of that rank's links (emulated)."""
    if compiled is not None:
        options = dataclasses.replace(options, compiled=compiled)
    with ExitStack() as stack:
        exs = [stack.enter_context(UdpExchange(rank=r, num_workers=num_workers, key=key, run_id=RUN,
                                               host="127.0.0.1", ports=PORTS, options=options,
                                               latency_s=None if latency_s is None else latency_s(r)))
               for r in range(num_workers)]
        for ex in exs:
            ex.connect([e.address for e in exs])
            assert ex.info()["compiled"] == (options.compiled and exchange_module.FASTPATH is not None)
        yield exs


def run_round(exs, rows, rnd, **kwargs):
    """Every rank's ``block_average`` in its own thread; kwargs apply to all ranks, or are callables of the rank."""
    results: list = [None] * len(exs)
    errors: list = []

    def go(r: int) -> None:
        try:
            kw = {k: (v(r) if callable(v) else v) for k, v in kwargs.items()}
            kw.setdefault("deadline_s", 10.0)
            results[r] = exs[r].block_average(rows[r], rnd, **kw)
        except BaseException as exc:  # noqa: BLE001 (re-raised in the test's thread)
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(r,), daemon=True) for r in range(len(exs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(ROUND_TIMEOUT_S)
        assert not t.is_alive(), "a round did not finish"
    if errors:
        raise errors[0]
    return results


def seg_len(ex: UdpExchange, dtype: torch.dtype, fmt=None) -> int:
    """Values in a datagram of whole values (of a run that sends ``fmt``: less int8's scale)."""
    from shaky.comm.quant import fine_length  # noqa: PLC0415
    return fine_length(ex.segment_bytes, torch.empty((), dtype=dtype).element_size(), fmt)


def masks(results, servers=None):
    """The run's per-block [W, W, S] masks from each rank's observed ones (``run_masks``): up[i, j, k] (sender,
    block) and down[j, r, k] (block, worker)."""
    servers = list(range(len(results))) if servers is None else list(servers)
    up, down = run_masks([res[1] for res in results], [res[2] for res in results], servers)
    return up.numpy(), down.numpy()


def reference(rows: np.ndarray, up: np.ndarray, down: np.ndarray, seg: int, weights=None, servers=None) -> np.ndarray:
    """RPS's rule per segment, in numpy: server servers[j] averages segment k of block j over the senders i
    with up[i, j, k] (weighted; each block a message of its own); worker r takes it where down[j, r, k], else
    keeps its own."""
    W, D = rows.shape
    w = np.ones(W, rows.dtype) if weights is None else np.asarray(weights, rows.dtype)
    out = rows.copy()
    start = 0
    for j, n in enumerate(block_sizes(D, W)):
        for k in range(math.ceil(n / seg)):
            a, b = start + k * seg, start + min((k + 1) * seg, n)
            share = up[:, j, k].astype(rows.dtype) * w
            avg = (share / share.sum()) @ rows[:, a:b]
            for r in range(W):
                if down[j, r, k]:
                    out[r, a:b] = avg
        start += n
    return out


def expected_masks(W: int, D: int, seg: int, dropped, servers=None) -> tuple[np.ndarray, np.ndarray]:
    """The masks a run must observe when sender i's hook drops ``dropped(i, phase, block, k, dest)``: per block,
    segment k of block j arrived if it did (padding True)."""
    servers = list(range(W)) if servers is None else list(servers)
    nseg = [math.ceil(n / seg) for n in block_sizes(D, W)]
    S = max(1, *nseg)
    up = np.ones((W, W, S), bool)
    down = np.ones((W, W, S), bool)
    for j in range(W):
        s = servers[j]
        for k in range(nseg[j]):
            for i in range(W):
                if i != s:
                    up[i, j, k] = not dropped(i, 1, j, k, s)      # sender i's segment of block j to server s
                    down[j, i, k] = not dropped(s, 2, j, k, i)    # server s's average of block j to worker i
    return up, down


def random_rows(W: int, D: int, dtype=torch.float32, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(D, generator=g, dtype=torch.float64).to(dtype) for _ in range(W)]


def assert_matches(results, rows, seg, *, weights=None, servers=None):
    up, down = masks(results, servers)
    want = reference(torch.stack(rows).numpy(), up, down, seg, weights, servers)
    got = torch.stack([res[0] for res in results]).numpy()
    tol = 1e-12 if got.dtype == np.float64 else 1e-6
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    return up, down


# ------------------------------------------------------------------------------------------ zero loss

@pytest.mark.parametrize("compiled, offload", [pytest.param(True, True, id="compiled", marks=NEEDS_BUILD),
                                                pytest.param(False, True, id="python-gso-gro"),
                                                pytest.param(False, False, id="python-one-datagram-a-call")])
@pytest.mark.parametrize("W", [2, 3, 4])
def test_zero_loss_is_the_exact_mean(W: int, compiled: bool, offload: bool) -> None:
    D = 1000
    rows = random_rows(W, D)
    options = UdpOptions(datagram_bytes=SMALL.datagram_bytes, final_grace_s=5.0, offload=offload, compiled=compiled)
    one_by_one: dict[int, int] = {}         # datagrams each rank handled one at a time
    original = UdpExchange._on_datagram

    def counted(self, d, addr, peer):
        one_by_one[self.rank] = one_by_one.get(self.rank, 0) + 1
        return original(self, d, addr, peer)

    with group(W, options) as exs, pytest.MonkeyPatch.context() as mp_:
        mp_.setattr(UdpExchange, "_on_datagram", counted)
        results = run_round(exs, rows, 0)
        seg = seg_len(exs[0], torch.float32)
    copies = 1      # without loss before, each stream's last datagram goes with one copy (final_copies is 2)
    if compiled:    # the batch path placed all but each stream's short last segment and its repeats
        assert all(one_by_one.get(r, 0) <= 2 * (1 + copies) * (W - 1) for r in range(W)), one_by_one
    mean = torch.stack(rows).mean(0)
    nseg = [math.ceil(n / seg) for n in block_sizes(D, W)]
    for r, (new, up_obs, down_obs, stats) in enumerate(results):
        torch.testing.assert_close(new, mean, rtol=1e-6, atol=1e-7)
        assert up_obs.shape == (W, 1, max(nseg)) and down_obs.shape == (W, max(nseg))
        assert up_obs.all() and down_obs.all()
        assert stats.received == sum(stats.expected) and stats.rejected == stats.late == 0
        assert stats.closed_by == ("complete", "complete")
        assert stats.sent == sum(nseg) - nseg[r] + (W - 1) * nseg[r]
        assert stats.repeated == 2 * (W - 1) * copies     # copies of the last datagram per stream, both phases
    assert_matches(results, rows, seg)


def test_zero_loss_weighted_equals_the_rule_and_repeats() -> None:
    W, D = 4, 777
    weights = torch.tensor([1.0, 2.0, 0.5, 4.0])
    with group(W) as exs:
        seg = seg_len(exs[0], torch.float32)
        for rnd in (0, 1, 5):      # rounds need only increase
            rows = random_rows(W, D, seed=rnd)
            results = run_round(exs, rows, rnd, weights=weights)
            up, down = assert_matches(results, rows, seg, weights=weights.numpy())
            assert up.all() and down.all()
            want = (weights[:, None] * torch.stack(rows)).sum(0) / weights.sum()
            for res in results:
                torch.testing.assert_close(res[0], want, rtol=1e-5, atol=1e-6)


def test_one_rank_and_fewer_values_than_ranks() -> None:
    with group(1) as exs:
        row = torch.arange(5.0)
        new, up, down, stats = exs[0].block_average(row, 0, deadline_s=1.0)
        assert torch.equal(new, row) and up.all() and down.all() and stats.sent == 0
    with group(4) as exs:
        rows = random_rows(4, 3)                # block 3 is empty: nothing sent for it, nothing awaited
        results = run_round(exs, rows, 0)
        for res in results:
            torch.testing.assert_close(res[0], torch.stack(rows).mean(0))
            assert res[3].closed_by == ("complete", "complete")


# ----------------------------------------------------------------------------------------------- loss

def _drop_rule(seed: int, nseg: list[int], rate: float = 0.3):
    """Drops about ``rate`` of the segments, never a block's last FINAL_DATAGRAMS (so phases close early)."""
    def dropped(sender: int, phase: int, block: int, k: int, dest: int) -> bool:
        if k >= nseg[block] - FINAL_DATAGRAMS:
            return False
        h = hash((seed, sender, phase, block, k, dest)) % 1000
        return h < rate * 1000
    return dropped


def _install(exs, dropped, what: str = "drop") -> None:
    for i, ex in enumerate(exs):
        ex.fault = (lambda i: lambda phase, block, k, dest: what if dropped(i, phase, block, k, dest) else None)(i)


@pytest.mark.parametrize("compiled", PATHS)
def test_injected_loss_gives_the_rule_with_the_observed_masks(compiled: bool) -> None:
    W, D = 4, 1000
    rows = random_rows(W, D, seed=3)
    weights = torch.tensor([1.0, 3.0, 2.0, 1.0])
    with group(W, compiled=compiled) as exs:
        seg = seg_len(exs[0], torch.float32)
        nseg = [math.ceil(n / seg) for n in block_sizes(D, W)]
        dropped = _drop_rule(1, nseg)
        _install(exs, dropped)
        results = run_round(exs, rows, 0, weights=weights)
    up, down = assert_matches(results, rows, seg, weights=weights.numpy())
    want_up, want_down = expected_masks(W, D, seg, dropped)
    np.testing.assert_array_equal(up, want_up)
    np.testing.assert_array_equal(down, want_down)
    assert not up.all() and not down.all()
    for r, res in enumerate(results):
        stats = res[3]
        assert stats.closed_by == ("complete" if up[:, r].all() else "final",
                                   "complete" if down[:, r].all() else "final")
        assert stats.late == stats.rejected == 0
        assert stats.received + (~up[:, r]).sum() + (~down[:, r]).sum() == sum(stats.expected)
    assert sum(res[3].dropped_by_hook for res in results) == (~want_up).sum() + (~want_down).sum()


@pytest.mark.parametrize("compiled", PATHS)
def test_float64_unequal_blocks_remapped_servers_and_loss(compiled: bool) -> None:
    W, D = 4, 4 * 256 + 1                  # blocks of 257, 256, 256, 256 values: 33, 32, 32, 32 segments of 8
    servers = [1, 1, 3, 2]                 # rank 1 serves two blocks, rank 0 none
    weights = [2.0, 1.0, 1.0, 3.0]
    rows = random_rows(W, D, dtype=torch.float64, seed=5)
    with group(W, compiled=compiled) as exs:
        seg = seg_len(exs[0], torch.float64)
        nseg = [math.ceil(n / seg) for n in block_sizes(D, W)]
        assert seg == 8 and nseg == [33, 32, 32, 32]
        dropped = _drop_rule(2, nseg, rate=0.2)
        _install(exs, dropped)
        results = run_round(exs, rows, 0, weights=torch.tensor(weights), servers=torch.tensor(servers))
    assert all(res[0].dtype == torch.float64 for res in results)
    up, down = assert_matches(results, rows, seg, weights=weights, servers=servers)
    want_up, want_down = expected_masks(W, D, seg, dropped, servers)
    np.testing.assert_array_equal(up, want_up)
    np.testing.assert_array_equal(down, want_down)
    assert up.shape == (W, W, 33) and up[:, [1, 2, 3], 32].all()     # padding: only block 0 has a segment 32
    assert results[0][1].shape == (W, 0, 33) and results[1][1].shape == (W, 2, 33)   # the blocks each serves


@pytest.mark.parametrize("compiled", PATHS)
def test_a_successor_averages_each_of_its_blocks_over_its_own_arrivals(compiled: bool) -> None:
    """Rank 1 serves blocks 0 and 1 (a dead rank's successor): each block is a message of its own. Rank 2's
    segment 0 of block 1, which arrived, counts in block 1's average although its segment 0 of block 0 was lost,
    and block 1's average of segment 1 reaches rank 2 although block 0's was lost (the AND of the two blocks'
    masks threw both away); the masks say so per block, and the simulator computes the same from them."""
    from shaky.comm.sim import SimComm  # noqa: PLC0415

    W, D = 3, 120                          # blocks of 40 float64 values: 5 segments of 8
    servers = [1, 1, 2]
    rows = random_rows(W, D, dtype=torch.float64, seed=8)

    def dropped(sender: int, phase: int, block: int, k: int, dest: int) -> bool:
        return (sender, phase, block, k) == (2, 1, 0, 0) or (sender, phase, block, k, dest) == (1, 2, 0, 1, 2)

    with group(W, compiled=compiled) as exs:
        seg = seg_len(exs[0], torch.float64)
        assert seg == 8
        _install(exs, dropped)
        results = run_round(exs, rows, 0, servers=torch.tensor(servers))
    x = torch.stack(rows)
    up, down = assert_matches(results, rows, seg, servers=servers)
    want_up, want_down = expected_masks(W, D, seg, dropped, servers)
    np.testing.assert_array_equal(up, want_up)
    np.testing.assert_array_equal(down, want_down)
    assert not up[2, 0, 0] and up[2, 1, 0] and not down[0, 2, 1] and down[1, 2, 1]
    # rank 1 (the server): block 0's segment 0 without rank 2's, block 1's segment 0 with it
    torch.testing.assert_close(results[1][0][:8], x[:2, :8].mean(0), rtol=0, atol=1e-12)
    torch.testing.assert_close(results[1][0][40:48], x[:, 40:48].mean(0), rtol=0, atol=1e-12)
    # rank 2: its own values of block 0's segment 1, block 1's average of segment 1
    torch.testing.assert_close(results[2][0][8:16], x[2, 8:16], rtol=0, atol=0)
    torch.testing.assert_close(results[2][0][48:56], x[:, 48:56].mean(0), rtol=0, atol=1e-12)
    sim = SimComm(W).block_average(x, torch.from_numpy(up), torch.from_numpy(down), servers=torch.tensor(servers),
                                   segment_bytes=exs[0].segment_bytes)
    torch.testing.assert_close(torch.stack([res[0] for res in results]), sim, rtol=0, atol=1e-12)


def test_matches_the_simulator_segment_average() -> None:
    """The simulator, given the masks a udp round observed, computes the same rows (the shared layout)."""
    from shaky.comm.sim import SimComm  # noqa: PLC0415

    W, D = 4, 1000
    servers = torch.tensor([0, 2, 2, 1])
    weights = torch.tensor([1.0, 2.0, 3.0, 4.0])
    rows = random_rows(W, D, seed=9)
    with group(W) as exs:
        seg = seg_len(exs[0], torch.float32)
        nseg = [math.ceil(n / seg) for n in block_sizes(D, W)]
        _install(exs, _drop_rule(4, nseg))
        results = run_round(exs, rows, 0, weights=weights, servers=servers)
        segment_bytes = exs[0].segment_bytes
    up, down = (torch.from_numpy(m) for m in masks(results, servers.tolist()))
    sim = SimComm(W).block_average(torch.stack(rows), up, down, weights=weights, servers=servers,
                                   segment_bytes=segment_bytes)
    torch.testing.assert_close(torch.stack([res[0] for res in results]), sim, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["int8", "bfloat16", "float16", "float32"])
@pytest.mark.parametrize("compiled", PATHS)
def test_rounded_values_give_the_simulators_streams(name: str, compiled: bool) -> None:
    """strategy.value_dtype on udp: rounds of rounded differences under injected loss (float64 rows), and the
    simulator's rule (shaky.comm.quant) given the masks they observed computes the same rows, references,
    streams and carries; the transport counts the bytes it sent, fewer once the streams run."""
    from shaky.comm import quant  # noqa: PLC0415
    from shaky.comm.sim import SimComm  # noqa: PLC0415
    from shaky.comm.udp.exchange import QuantState  # noqa: PLC0415
    from shaky.geometry import LinkSample  # noqa: PLC0415
    from shaky.network.faults import Membership  # noqa: PLC0415

    W, D = 4, 1000
    fmt = quant.FORMATS[name]
    g = torch.Generator().manual_seed(11)
    x = torch.randn(W, D, dtype=torch.float64, generator=g)
    options = UdpOptions(datagram_bytes=OVERHEAD_BYTES + 256, final_grace_s=5.0)     # 32 float64 a segment
    with group(W, options=options, compiled=compiled) as exs:
        seg = seg_len(exs[0], torch.float64, fmt)
        nseg = [math.ceil(n / seg) for n in block_sizes(D, W)]
        states = [QuantState(fmt, np.zeros(D), np.zeros(D), np.zeros((W, max(nseg)))) for _ in range(W)]
        ref, sync, carry = torch.zeros_like(x), x.new_zeros(W, 1, 1), torch.zeros_like(x)
        sent, rounded = [], []
        for rnd in range(4):
            x = x + 0.01 * torch.randn(W, D, dtype=torch.float64, generator=g)
            _install(exs, _drop_rule(20 + rnd, nseg, rate=0.2))
            results = run_round(exs, [x[r].clone() for r in range(W)], rnd, quant=lambda r: states[r])
            up, down = (torch.from_numpy(m) for m in masks(results))
            assert not bool(up.all()) and not bool(down.all())
            links = LinkSample(rnd, up, down, exs[0].segment_bytes)
            x, ref, sync, carry, up_q, _ = quant.quantized_block_average(
                SimComm(W).server_averages, x, links, Membership.everyone(W), ref, sync, carry, fmt)
            torch.testing.assert_close(torch.stack([res[0] for res in results]), x, rtol=0, atol=1e-12)
            torch.testing.assert_close(torch.from_numpy(np.stack([s.ref for s in states])), ref, rtol=0, atol=1e-12)
            torch.testing.assert_close(torch.from_numpy(np.stack([s.carry for s in states])), carry, rtol=0,
                                       atol=1e-12)
            np.testing.assert_array_equal(np.stack([s.sync for s in states]), sync.numpy())
            sent.append(sum(res[3].bytes_sent for res in results))
            rounded.append(int(up_q.sum()))
    assert rounded[0] == 0 and all(n > 0 for n in rounded[1:])
    assert sent[-1] < sent[0]


@pytest.mark.parametrize("name, fewer", [("int8", 3.97), ("bfloat16", 1.99)])
def test_the_transport_counts_the_bytes_rounded_values_save(name: str, fewer: float) -> None:
    """Loss 0, float32 rows, 1472-byte datagrams: a round of a run that sends float32 (355 values a datagram), then
    a quantized run's first round (whole values: 354 a datagram for int8, to leave room for its scale) and its
    second (rounded differences: a datagram holds 4 (2) segments' values, and int8's one scale). Each round's
    bytes, counted by the transport, are what the datagrams hold (52 bytes of header and tag each; every stream's
    last datagram twice: no round lost anything); the rounded round sends 4x (2x) fewer bytes than float32, less
    only the blocks' shorter last datagrams (3.99x and 2.00x for a large model)."""
    from shaky.comm import quant  # noqa: PLC0415
    from shaky.comm.udp.exchange import QuantState  # noqa: PLC0415

    W, D = 4, 200_000
    fmt = quant.FORMATS[name]
    rows = random_rows(W, D, seed=12)
    with group(W, options=UdpOptions(final_grace_s=5.0)) as exs:
        plain_seg, seg = seg_len(exs[0], torch.float32), seg_len(exs[0], torch.float32, fmt)
        p = quant.parts(fmt, 4)
        states = [QuantState(fmt, np.zeros(D, np.float32), np.zeros(D, np.float32),
                             np.zeros((W, math.ceil(D / W / seg)), np.float32)) for _ in range(W)]
        plain = sum(res[3].bytes_sent for res in run_round(exs, rows, 0))
        sent = [sum(res[3].bytes_sent for res in run_round(exs, rows, rnd, quant=lambda r: states[r]))
                for rnd in (1, 2)]

    def round_bytes(length: int, payload) -> int:
        total = 0
        for n in block_sizes(D, W):
            lengths = [min(length, n - a) for a in range(0, n, length)]
            total += sum(OVERHEAD_BYTES + payload(m) for m in lengths) + OVERHEAD_BYTES + payload(lengths[-1])
        return 2 * (W - 1) * total

    assert plain == round_bytes(plain_seg, lambda m: 4 * m)
    assert sent[0] == round_bytes(seg, lambda m: 4 * m)
    assert sent[1] == round_bytes(p * seg, lambda m: int(fmt.bytes_of(m, p * seg)))
    assert plain / sent[1] > fewer, plain / sent[1]


def test_each_bad_rounded_datagram_is_rejected() -> None:
    """The rules for a datagram of rounded values (strategy.value_dtype): used in a quantized round when it sits
    at a group's first segment and its length is that group's in its format (4 segments of 354 float32 values in
    int8 and one scale: 1420 bytes; the block's last group is shorter); malformed with another length, another
    format's dtype byte, at a segment inside a group, or in a round that sends whole values; a bad tag is a bad
    tag. None of them is used."""
    from shaky.comm import quant  # noqa: PLC0415
    from shaky.comm.udp.exchange import _Round  # noqa: PLC0415
    from shaky.comm.udp.wire import HEADER, MAGIC, ROUNDED_CODES, VERSION  # noqa: PLC0415

    W, D, rnd = 2, 4000, 5                 # blocks of 2000 values: segments of 354, groups at 0 and 4
    fmt = quant.FORMATS["int8"]
    with group(W, options=UdpOptions(datagram_bytes=1472)) as exs:
        ex = exs[0]
        assert seg_len(ex, torch.float32, fmt) == 354

        def fresh(quantized: bool) -> _Round:
            x = np.zeros(D, np.float32)
            state = _Round(rnd, RUN, x, np.zeros(D, np.float32), [0, 1], None, 0, W, ex.segment_bytes,
                           recv=ex._recv_buffers, fmt=fmt if quantized else None)
            ex._cur, ex._st = state, exchange_module._Counters()
            return state

        first, last = 4 * 354 + 4, 2000 - 4 * 354 + 4
        cases = [("used", True, ROUNDED_CODES["int8"], 0, first, False),
                 ("used", True, ROUNDED_CODES["int8"], 4, last, False),
                 ("malformed", True, ROUNDED_CODES["int8"], 0, first + 4, False),
                 ("malformed", True, ROUNDED_CODES["int8"], 4, first, False),
                 ("malformed", True, ROUNDED_CODES["int8"], 1, first, False),
                 ("malformed", True, ROUNDED_CODES["bfloat16"], 0, 2 * 4 * 354, False),
                 ("malformed", False, ROUNDED_CODES["int8"], 0, first, False),
                 ("bad_tag", True, ROUNDED_CODES["int8"], 0, first, True)]
        for outcome, quantized, code, k, length, forged in cases:
            state = fresh(quantized)
            head = HEADER.pack(MAGIC, VERSION, 1, code, 0, 1, RUN, rnd, 0, k, length)
            body = head + bytes(length)
            tag = exs[1]._mac.tag(memoryview(body))
            if forged:
                tag = bytes(b ^ 1 for b in tag)
            ex._on_datagram(memoryview(body + tag), exs[1].address, None)
            used = bool(state.got1[0][1].any())
            assert used == (outcome == "used"), (outcome, code, k, length)
            if outcome == "used":          # the whole group arrived, and came rounded
                n = min(4, state.nseg[0] - k)
                assert state.got1[0][1].sum() == n and state.rounded1[0][1, k:k + n].all()
                assert ex._st.rejected == 0
            else:
                assert ex._st.rejected_by == {outcome: 1}, (outcome, ex._st.rejected_by)
        ex._cur = None


# ---------------------------------------------------------------------------------------- late, deadline

def test_held_datagrams_are_late_and_not_used() -> None:
    W, D = 4, 1000
    rows = random_rows(W, D, seed=4)
    held = {(1, 0, 2), (1, 0, 5), (2, 0, 7)}      # (sender, block, segment) of phase 1, to rank 0
    with group(W) as exs:
        seg = seg_len(exs[0], torch.float32)
        for i in (1, 2):
            exs[i].fault = (lambda i: lambda phase, block, k, dest:
                            "hold" if phase == 1 and (i, block, k) in held else None)(i)
        first = run_round(exs, rows, 0)
        for ex in exs:
            ex.fault = None
        second = run_round(exs, rows, 1)
    up, _ = assert_matches(first, rows, seg)
    assert sorted(zip(*np.nonzero(~up))) == [(1, 0, 2), (1, 0, 5), (2, 0, 7)]
    assert first[0][3].closed_by[0] == "final"
    # Released after rank 0's phase 1 closed: late in round 0 (phase 2 still open) or as round 0's in round 1.
    assert first[0][3].late + second[0][3].late == len(held)
    assert all(res[3].rejected == 0 for res in first + second)
    up2, down2 = assert_matches(second, rows, seg)
    assert up2.all() and down2.all()


def test_a_lost_last_datagram_closes_after_the_grace() -> None:
    """Rank 2's very last average to rank 1 is lost: rank 1 has rank 2's other final datagrams, waits the
    grace (not the deadline) for it, and closes."""
    W, D = 4, 1000
    rows = random_rows(W, D, seed=7)
    with group(W, UdpOptions(datagram_bytes=SMALL.datagram_bytes, final_grace_s=0.05)) as exs:
        seg = seg_len(exs[0], torch.float32)
        last = math.ceil(block_sizes(D, W)[2] / seg) - 1
        exs[2].fault = lambda phase, block, k, dest: "drop" if (phase, block, k, dest) == (2, 2, last, 1) else None
        results = run_round(exs, rows, 0, deadline_s=20.0)
    _, down = assert_matches(results, rows, seg)
    assert sorted(zip(*np.nonzero(~down))) == [(2, 1, last)]
    assert results[1][3].closed_by == ("complete", "final")
    assert results[1][3].grace_s >= 0.05     # the whole grace, counted (others may wait briefly for a sender)


def test_the_repeat_stands_in_for_a_lost_last_datagram() -> None:
    """Rank 2's very last average to rank 1 is lost but its repeat arrives: rank 1 uses it and closes the phase
    as complete, without waiting the grace (here longer than the round is allowed to take)."""
    W, D = 4, 1000
    rows = random_rows(W, D, seed=7)
    with group(W, UdpOptions(datagram_bytes=SMALL.datagram_bytes, final_grace_s=60.0)) as exs:
        seg = seg_len(exs[0], torch.float32)
        last = math.ceil(block_sizes(D, W)[2] / seg) - 1
        calls = []

        def first_copy_lost(phase: int, block: int, k: int, dest: int) -> str | None:
            if (phase, block, k, dest) != (2, 2, last, 1):
                return None
            calls.append(k)
            return "drop" if len(calls) == 1 else None      # the original, not the repeat

        exs[2].fault = first_copy_lost
        results = run_round(exs, rows, 0, deadline_s=60.0)
    assert calls == [last, last]
    _, down = assert_matches(results, rows, seg)
    assert down.all()
    st = results[1][3]
    assert st.closed_by == ("complete", "complete") and st.received == sum(st.expected) and st.rejected == 0
    assert results[2][3].dropped_by_hook == 1


def test_a_round_that_lost_datagrams_makes_the_next_send_every_copy_of_the_last() -> None:
    """Rank 0 loses one datagram of rank 1's (more than 1% of what it expects): in the next round it sends each of
    its streams' very last datagram with ``final_copies`` copies; the others, which lost nothing, with one."""
    W, D = 3, 1000
    rows = random_rows(W, D, seed=8)
    options = UdpOptions(datagram_bytes=SMALL.datagram_bytes, final_grace_s=5.0, final_copies=2)
    with group(W, options) as exs:
        exs[1].fault = lambda phase, block, k, dest: "drop" if (phase, k, dest) == (1, 0, 0) else None
        lossy = run_round(exs, rows, 0)
        exs[1].fault = None
        after = run_round(exs, rows, 1)
    assert lossy[0][3].received == sum(lossy[0][3].expected) - 1
    assert [res[3].repeated for res in lossy] == [2 * (W - 1)] * W
    assert [res[3].repeated for res in after] == [2 * (W - 1) * 2, 2 * (W - 1), 2 * (W - 1)]
    assert all(res[1].all() and res[2].all() for res in after)


def test_a_phase_closes_at_its_deadline() -> None:
    """Sender 1's whole block to rank 0 is held (its final datagrams too): rank 0's phase 1 ends at its
    deadline, without sender 1; the others wait longer, so they get rank 0's average."""
    W, D = 4, 1000
    rows = random_rows(W, D, seed=6)
    with group(W) as exs:
        seg = seg_len(exs[0], torch.float32)
        exs[1].fault = lambda phase, block, k, dest: "hold" if phase == 1 and dest == 0 else None
        first = run_round(exs, rows, 0, deadline_s=lambda r: 0.3 if r == 0 else 10.0)
        exs[1].fault = None
        second = run_round(exs, rows, 1)
    up, down = assert_matches(first, rows, seg)
    assert not up[1, 0].any() and up[[0, 2, 3], 0].all() and up[:, 1:].all() and down.all()
    stats = first[0][3]
    assert stats.closed_by[0] == "deadline" and stats.phase1_s >= 0.3
    assert first[0][3].late + second[0][3].late == math.ceil(D / W / seg)


def test_a_faster_peers_next_round_is_kept_for_it() -> None:
    """Rank 0 waits out its phase-2 deadline in round 0 (rank 1's final averages to it are dropped) while the
    others already send round 1: what rank 0 reads of round 1 meanwhile is used when its round 1 starts."""
    W, D = 4, 1000
    rows = [random_rows(W, D, seed=20 + r) for r in range(2)]
    results: dict[tuple[int, int], tuple] = {}
    errors: list = []
    with group(W) as exs:
        seg = seg_len(exs[0], torch.float32)
        last = math.ceil(block_sizes(D, W)[1] / seg) - FINAL_DATAGRAMS
        exs[1].fault = lambda phase, block, k, dest: "drop" if (phase, dest) == (2, 0) and k >= last else None

        def rank(r: int) -> None:
            try:
                for rnd in range(2):
                    deadline = 1.0 if (r, rnd) == (0, 0) else 10.0
                    results[r, rnd] = exs[r].block_average(rows[rnd][r], rnd, deadline_s=deadline)
                    exs[r].fault = None
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(W)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(2 * ROUND_TIMEOUT_S)
            assert not t.is_alive()
    assert not errors, errors
    first = [results[r, 0] for r in range(W)]
    _, down = assert_matches(first, rows[0], seg)
    assert not down[1, 0, last:].any() and first[0][3].closed_by[1] == "deadline"
    second = [results[r, 1] for r in range(W)]
    up, down = assert_matches(second, rows[1], seg)
    assert up.all() and down.all()
    assert second[0][3].received == sum(second[0][3].expected) and second[0][3].rejected == 0


def test_paced_sending_gives_the_same_result() -> None:
    W, D = 3, 600
    rows = random_rows(W, D, seed=8)
    with group(W, UdpOptions(datagram_bytes=SMALL.datagram_bytes, final_grace_s=5.0, send_rate_mbps=20.0)) as exs:
        results = run_round(exs, rows, 0)
    for res in results:
        torch.testing.assert_close(res[0], torch.stack(rows).mean(0))
        assert res[3].closed_by == ("complete", "complete")


# ---------------------------------------------------------------------------------------------- attacks

def gmac_reference(key: bytes, data: bytes) -> bytes:
    """The documented tag of a datagram's header and payload (``data``), from OpenSSL's EVP AES-256-GCM called
    here through ctypes: the sender's round key from the key, run, sender and round the header names, the nonce
    from its phase, flags, block and segment, and ``data`` as the associated data of an empty plaintext."""
    sender, run, rnd = struct.unpack_from("<HQQ", data, 6)
    round_key = hmac.digest(key, b"shaky udp gmac\0" + struct.pack("<QHQ", run, sender, rnd), "sha256")
    iv = bytes((data[3], data[5])) + data[24:32] + bytes(2)
    lib = ctypes.CDLL(ctypes.util.find_library("crypto"))
    lib.EVP_CIPHER_CTX_new.restype = lib.EVP_aes_256_gcm.restype = ctypes.c_void_p
    ctx, n, tag = lib.EVP_CIPHER_CTX_new(), ctypes.c_int(), ctypes.create_string_buffer(16)
    try:
        assert lib.EVP_EncryptInit_ex(ctypes.c_void_p(ctx), ctypes.c_void_p(lib.EVP_aes_256_gcm()), None, round_key,
                                      iv) == 1
        assert lib.EVP_EncryptUpdate(ctypes.c_void_p(ctx), None, ctypes.byref(n), data, len(data)) == 1
        assert lib.EVP_EncryptFinal_ex(ctypes.c_void_p(ctx), ctypes.create_string_buffer(16), ctypes.byref(n)) == 1
        assert lib.EVP_CIPHER_CTX_ctrl(ctypes.c_void_p(ctx), 0x10, 16, tag) == 1      # EVP_CTRL_GCM_GET_TAG
    finally:
        lib.EVP_CIPHER_CTX_free(ctypes.c_void_p(ctx))
    return tag.raw


def craft(key: bytes, *, phase: int, sender: int, rnd: int, block: int, k: int, payload: bytes, final: bool = False,
          run: int = RUN, dtype_code: int = 2, tag: bytes | None = None) -> bytes:
    """A datagram built from the documented format alone (struct + OpenSSL's AES-256-GCM), as an attacker with the
    key would."""
    head = HEADER.pack(b"SK", 2, phase, dtype_code, int(final), sender, run, rnd, block, k, len(payload))
    body = head + payload
    return body + (gmac_reference(key, body) if tag is None else tag)


def segment_payload(row: torch.Tensor, W: int, block: int, k: int, seg: int) -> bytes:
    start = sum(block_sizes(row.numel(), W)[:block])
    n = block_sizes(row.numel(), W)[block]
    return row[start + k * seg:start + min((k + 1) * seg, n)].numpy().tobytes()


@pytest.mark.parametrize("compiled", PATHS)
def test_attacks_change_nothing_and_are_rejected(compiled: bool) -> None:
    W, D = 4, 1000
    rounds = [random_rows(W, D, seed=10 + r) for r in range(3)]
    with group(W, compiled=compiled) as exs:      # the same three rounds without an attacker
        baseline = [run_round(exs, rounds[r], r) for r in range(3)]

    with group(W, compiled=compiled) as exs, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stranger:
        stranger.bind(("127.0.0.1", 0))
        seg = seg_len(exs[0], torch.float32)
        attacked = [run_round(exs, rounds[r], r) for r in range(2)]
        rng = np.random.default_rng(0)
        # Queued in every rank's socket before round 2 starts, so each is handled (and counted) in round 2.
        for target in range(W):
            s = (target + 1) % W                  # a real peer's socket: datagrams from a known address
            peer = exs[s].sock
            genuine = craft(KEY, phase=1, sender=s, rnd=1, block=target, k=0,
                            payload=segment_payload(rounds[1][s], W, target, 0, seg))
            bad = [
                genuine[:OVERHEAD_BYTES - 1],                                    # truncated below a header
                genuine[:-5],                                                    # truncated: wrong length
                genuine[:-TAG_BYTES] + bytes(TAG_BYTES),                         # forged tag
                craft(os.urandom(32), phase=1, sender=s, rnd=2, block=target, k=1, payload=bytes(64)),  # wrong key
                craft(KEY, phase=3, sender=s, rnd=2, block=target, k=1, payload=bytes(64)),  # unknown phase
                craft(KEY, phase=1, sender=s, rnd=2, block=target, k=999, payload=bytes(64)),  # segment out of range
                craft(KEY, phase=1, sender=s, rnd=2, block=target, k=0, payload=bytes(8)),   # wrong payload length
                craft(KEY, phase=1, sender=s, rnd=2, block=(target + 1) % W, k=0, payload=bytes(64)),  # not its block
                craft(KEY, phase=1, sender=(s + 1) % W, rnd=2, block=target, k=0, payload=bytes(64)),  # other's name
                craft(KEY, phase=1, sender=s, rnd=2, block=target, k=0, payload=bytes(64), run=RUN + 1),  # other run
                genuine,                                                         # replay: last round, received
                craft(KEY, phase=1, sender=s, rnd=0, block=target, k=0,          # replay: two rounds ago
                      payload=segment_payload(rounds[0][s], W, target, 0, seg)),
            ]
            for data in bad:
                peer.sendto(data, exs[target].address)
            for _ in range(5):
                stranger.sendto(rng.bytes(int(rng.integers(1, 1500))), exs[target].address)
            stranger.sendto(genuine, exs[target].address)                        # a real datagram, wrong address
        # During round 2: each time rank 1 sends block 0's segment 3 to rank 0, an exact copy goes too.
        dup = craft(KEY, phase=1, sender=1, rnd=2, block=0, k=3, payload=segment_payload(rounds[2][1], W, 0, 3, seg))
        exs[1].fault = lambda phase, block, k, dest: (exs[1].sock.sendto(dup, exs[0].address) and None) \
            if (phase, block, k, dest) == (1, 0, 3, 0) else None
        attacked.append(run_round(exs, rounds[2], 2))

    for r in range(3):
        for base, hit in zip(baseline[r], attacked[r]):
            assert torch.equal(base[0], hit[0]), f"round {r}: the attacker changed a result"
            assert torch.equal(base[1], hit[1]) and torch.equal(base[2], hit[2])
    stats = [res[3] for res in attacked[2]]
    for st in stats:
        assert st.rejected >= 18 and st.late == 0
        assert {"malformed", "unknown_sender", "wrong_run", "bad_tag", "past_round", "duplicate"} <= set(st.rejected_by)
        assert st.received == sum(st.expected)
    assert stats[0].rejected_by["duplicate"] == 2       # the replay of round 1, and rank 1's copy (or original)


@pytest.mark.parametrize("compiled", PATHS)
def test_each_bad_datagram_in_a_coalesced_batch_is_rejected(compiled: bool) -> None:
    """Every kind of bad datagram, sent while a round runs in one GSO send from a real peer's socket (so that the
    kernel hands them to the receiver as one coalesced batch where it has UDP_GRO, between genuine ones), and a
    stranger's batch: each is rejected for its reason, counted once, and the results are those of the same
    rounds without them."""
    W, D = 4, 1000
    rounds = [random_rows(W, D, seed=20 + r) for r in range(3)]
    with group(W, compiled=compiled) as exs:
        baseline = [run_round(exs, rounds[r], r) for r in range(3)]

    with group(W, compiled=compiled) as exs, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stranger:
        stranger.bind(("127.0.0.1", 0))
        seg = seg_len(exs[0], torch.float32)
        attacked = [run_round(exs, rounds[r], r) for r in range(2)]

        def payload(rnd: int, k: int) -> bytes:
            return segment_payload(rounds[rnd][1], W, 0, k, seg)

        real = craft(KEY, phase=1, sender=1, rnd=2, block=0, k=5, payload=payload(2, 5))
        one_key = craft(KEY, phase=1, sender=1, rnd=2, block=0, k=0, payload=bytes(64))[:36]   # a version-1 header
        body = HEADER.pack(b"SK", 2, 1, 2, 3, 1, RUN, 2, 0, 9, 64) + bytes(64)   # final and repeat on segment 9
        repeat_mid_stream = body + gmac_reference(KEY, body)
        bad = {
            "bad_tag": [real[:-TAG_BYTES] + bytes(TAG_BYTES),                                  # forged tag
                        craft(os.urandom(32), phase=1, sender=1, rnd=2, block=0, k=6, payload=payload(2, 6))],
            "wrong_run": [craft(KEY, phase=1, sender=1, rnd=2, block=0, k=7, payload=payload(2, 7), run=RUN + 1)],
            "malformed": [
                b"SK\x01" + one_key[3:] + bytes(64) + bytes(TAG_BYTES),                      # wire version 1
                craft(KEY, phase=3, sender=1, rnd=2, block=0, k=8, payload=bytes(64)),      # unknown phase
                craft(KEY, phase=1, sender=1, rnd=2, block=0, k=999, payload=bytes(64)),    # segment out of range
                craft(KEY, phase=1, sender=1, rnd=2, block=2, k=0, payload=bytes(64)),      # a block rank 0 does not serve
                craft(KEY, phase=1, sender=1, rnd=2, block=0, k=9, payload=bytes(64), dtype_code=3),  # other dtype
                repeat_mid_stream,                                                         # authentic, flagged wrong
            ],
            "unknown_sender": [craft(KEY, phase=1, sender=2, rnd=2, block=0, k=10, payload=payload(2, 10))],
            "past_round": [craft(KEY, phase=1, sender=1, rnd=0, block=0, k=0, payload=payload(0, 0))],
            "duplicate": [craft(KEY, phase=1, sender=1, rnd=1, block=0, k=0, payload=payload(1, 0)),  # replayed
                          craft(KEY, phase=1, sender=1, rnd=2, block=0, k=3, payload=payload(2, 3))],  # a copy
        }
        batch = [d for kind in bad.values() for d in kind]
        assert {len(d) for d in batch} == {len(real)}
        cut = real[:-5]                                  # the batch's shorter last datagram: a wrong length
        bad["malformed"].append(cut)
        noise = [os.urandom(len(real)) for _ in range(5)]

        def attack() -> None:
            gso = [(socket.IPPROTO_UDP, 103, struct.pack("H", len(real)))]                  # UDP_SEGMENT
            exs[1].sock.sendmsg([b"".join(batch) + cut], gso, 0, exs[0].address)
            stranger.sendmsg([b"".join(noise)], gso, 0, exs[0].address)

        exs[1].fault = lambda phase, block, k, dest: attack() if (phase, block, k, dest) == (1, 0, 1, 0) else None
        attacked.append(run_round(exs, rounds[2], 2))

    for r in range(3):
        for base, hit in zip(baseline[r], attacked[r]):
            assert torch.equal(base[0], hit[0]), f"round {r}: the attacker changed a result"
            assert torch.equal(base[1], hit[1]) and torch.equal(base[2], hit[2])
    st = attacked[2][0][3]
    want = {kind: len(datagrams) for kind, datagrams in bad.items()}
    want["unknown_sender"] += len(noise)
    assert st.rejected_by == want and st.rejected == sum(want.values())
    assert st.received == sum(st.expected) and st.late == 0
    for other in attacked[2][1:]:
        assert other[3].rejected == 0


# ---------------------------------------------------------------------------------------------- set-up

def test_no_free_port_names_the_range() -> None:
    with ExitStack() as stack:
        for base in range(45000, 46000, 3):     # three consecutive ports, all bound here
            socks = []
            try:
                for port in range(base, base + 3):
                    socks.append(stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_DGRAM)))
                    socks[-1].bind(("127.0.0.1", port))
                break
            except OSError:
                continue
        with pytest.raises(OSError, match=f"no free UDP port on 127.0.0.1 in ports {base}-{base + 2} "
                                          r"\(all 3 in use\)"):
            UdpExchange(rank=0, num_workers=2, key=KEY, run_id=1, host="127.0.0.1", ports=range(base, base + 3))


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="key must be 32 bytes, got 5 bytes"):
        UdpExchange(rank=0, num_workers=2, key=b"short", run_id=1, host="127.0.0.1", ports=PORTS)
    with pytest.raises(ValueError, match="rank must be in"):
        UdpExchange(rank=2, num_workers=2, key=KEY, run_id=1, host="127.0.0.1", ports=PORTS)
    with pytest.raises(ValueError, match="ports must be"):
        UdpExchange(rank=0, num_workers=2, key=KEY, run_id=1, host="127.0.0.1", ports=range(70000, 70001))
    with pytest.raises(ValueError, match="host '::1' does not resolve to an IPv4 address"):
        UdpExchange(rank=0, num_workers=2, key=KEY, run_id=1, host="::1", ports=PORTS)
    with pytest.raises(ValueError, match="datagram_bytes must be in"):
        UdpOptions(datagram_bytes=40)
    with pytest.raises(ValueError, match="send_rate_mbps"):
        UdpOptions(send_rate_mbps=0)
    with group(2) as exs:
        ex = exs[0]
        row = torch.zeros(10)
        with pytest.raises(ValueError, match="deadline_s must be a positive number"):
            ex.block_average(row, 0, deadline_s=0)
        with pytest.raises(ValueError, match=r"servers must be 2 ranks in \[0, 2\)"):
            ex.block_average(row, 0, deadline_s=1, servers=[0, 2])
        with pytest.raises(ValueError, match="weights must be 2 finite numbers"):
            ex.block_average(row, 0, deadline_s=1, weights=[1.0, -1.0])
        with pytest.raises(TypeError, match="row must be float16, float32 or float64"):
            ex.block_average(torch.zeros(10, dtype=torch.int32), 0, deadline_s=1)
        with pytest.raises(ValueError, match="row must be 1-D"):
            ex.block_average(torch.zeros(2, 5), 0, deadline_s=1)
        with pytest.raises(ValueError, match="out must not overlap row"):
            ex.block_average(row, 0, deadline_s=1, out=row)
        with pytest.raises(ValueError, match="peers must have one"):
            ex.connect([ex.address])
        ex.block_average(row, 3, deadline_s=0.05)    # rank 1 never answers: both phases end at the deadline
        with pytest.raises(ValueError, match="round must increase from call to call: got 3 after 3"):
            ex.block_average(row, 3, deadline_s=1)
    with UdpExchange(rank=0, num_workers=2, key=KEY, run_id=1, host="127.0.0.1", ports=PORTS) as lone:
        with pytest.raises(RuntimeError, match="connect"):
            lone.block_average(torch.zeros(4), 0, deadline_s=1)


def test_socket_buffers_and_offload_are_reported() -> None:
    with group(2, UdpOptions(buffer_bytes=1 << 20)) as exs:
        info = exs[0].info()
    assert info["rcvbuf_bytes"] >= 1 << 16 and info["sndbuf_bytes"] >= 1 << 16
    assert info["segment_bytes"] == 1472 - OVERHEAD_BYTES and info["float32_per_datagram"] == 355
    assert isinstance(info["gso"], bool) and isinstance(info["gro"], bool)


def test_tag_is_aes_256_gmac_of_the_documented_round_key_and_nonce() -> None:
    heads = [HEADER.pack(b"SK", 2, phase, 2, flags, sender, run, rnd, block, k, 1420)
             for phase, flags, sender, run, rnd, block, k in ((1, 0, 3, RUN, 5, 2, 9), (2, 1, 0, 2**64 - 1, 2**40, 7, 0),
                                                            (2, 3, 65535, 0, 0, 2**32 - 1, 2**32 - 1))]
    for head in heads:
        data = head + os.urandom(1420)
        assert _Mac(KEY).tag(data) == gmac_reference(KEY, data)
    buf = memoryview(bytearray(b"".join(h + os.urandom(64) for h in heads)))
    assert _Mac(KEY).tags(buf, range(0, 300, 100), 84) == b"".join(
        gmac_reference(KEY, bytes(buf[o:o + 84])) for o in range(0, 300, 100))
    assert _Mac(KEY).tag(heads[0][:35]) == bytes(16)          # shorter than a header: a tag that never verifies
    assert HEADER.size == 36 and struct.calcsize("<2sBBBBHQQIII") == 36


def test_a_run_without_the_compiled_path_is_told(monkeypatch) -> None:
    monkeypatch.setattr(exchange_module, "FASTPATH", None)     # where UdpExchange and the warning look it up
    line = exchange_module.python_path_warning(UdpOptions())
    assert line is not None and "_fastpath.c" in line and "libssl-dev" in line
    assert exchange_module.python_path_warning(UdpOptions(compiled=False)) is None  # asked for Python: nothing to say
    with group(2) as exs:                                                           # and the exchange runs in Python
        assert not any(ex.info()["compiled"] for ex in exs)
        results = run_round(exs, random_rows(2, 100), 0)
    assert all(res[3].received == sum(res[3].expected) for res in results)


@NEEDS_BUILD
def test_the_compiled_path_is_silent() -> None:
    assert exchange_module.python_path_warning(UdpOptions()) is None


@NEEDS_BUILD
def test_compiled_tags_are_the_documented_gmac() -> None:
    mac = _Mac(KEY, compiled=True)
    rows = np.frombuffer(b"".join(HEADER.pack(b"SK", 2, 1 + i % 2, 2, i % 2, i, RUN, 40 + i // 2, i, 3 * i, 64)
                                  + os.urandom(64) for i in range(5)), np.uint8).copy().reshape(5, 100)
    buf = rows.reshape(-1)
    want = [gmac_reference(KEY, buf[o:o + 84].tobytes()) for o in range(0, 500, 100)]
    assert mac.tags(memoryview(buf), range(0, 500, 100), 84) == b"".join(want)
    lengths = np.array([0, 35, 36, 63, 100], np.uint32)
    got = mac.tags_of(rows, lengths)
    assert [bytes(t) for t in got] == [bytes(16) if n < 36 else gmac_reference(KEY, rows[i, :n].tobytes())
                                       for i, n in enumerate(lengths.tolist())]
    for _ in range(200):      # more (sender, round) keys than the 64 slots it caches: every tag still right
        head = HEADER.pack(b"SK", 2, 1, 2, 0, int(np.random.randint(65536)), RUN, int(np.random.randint(1 << 62)), 0,
                           0, 8)
        data = head + os.urandom(8)
        assert mac.tag(data) == gmac_reference(KEY, data)


def test_adaptive_deadline() -> None:
    d = AdaptiveDeadline(initial_s=1.0, window=10, percentile=90, margin=2.0, floor_s=0.01, cap_s=4.0)
    assert d.propose() == 1.0
    for t in [0.1] * 9 + [0.2]:
        d.observe(t, complete=True)
    assert d.propose() == pytest.approx(2.0 * np.percentile([0.1] * 9 + [0.2], 90))
    for _ in range(5):                      # half the window hit the deadline: too short, it grows
        d.observe(0.3, complete=False)
    first = d.propose()
    assert first == pytest.approx(2 * 0.22)
    assert d.propose() == pytest.approx(4 * 0.22)
    for _ in range(10):
        d.propose()
    assert d.propose() == 4.0               # the cap
    for _ in range(10):
        d.observe(0.001, complete=True)
    assert d.propose() == 0.01              # the floor
    with pytest.raises(ValueError, match="floor_s must be <= cap_s"):
        AdaptiveDeadline(floor_s=2.0, cap_s=1.0)
    with pytest.raises(ValueError, match="percentile must be in"):
        AdaptiveDeadline(percentile=0)


# ------------------------------------------------------------------------------------------ processes

def _process_rank(rank: int, W: int, ports: list[int], D: int, bound, queue) -> None:
    torch.set_num_threads(1)
    ex = UdpExchange(rank=rank, num_workers=W, key=KEY, run_id=RUN, host="127.0.0.1",
                     ports=range(ports[rank], ports[rank] + 1), options=UdpOptions(final_grace_s=5.0))
    ex.connect([("127.0.0.1", p) for p in ports])
    bound.wait(60)      # a datagram to a port not bound yet is lost (the control plane's barrier, in a real run)
    rows = random_rows(W, D, seed=1)
    out = []
    for rnd in range(2):
        new, up, down, stats = ex.block_average(rows[rank], rnd, deadline_s=20.0)
        out.append((new.numpy(), bool(up.all() and down.all()), stats.received == sum(stats.expected)))
    queue.put((rank, out))
    ex.close()


def test_four_processes() -> None:
    W, D = 4, 100_000
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(W)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    # A fork server that has imported torch once forks the ranks: four spawned interpreters would each
    # import torch (seconds apiece on two cores), and forking this process (threads, state) is unsafe.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "numpy", "shaky.comm.udp"])
    queue, bound = ctx.Queue(), ctx.Barrier(W)
    procs = [ctx.Process(target=_process_rank, args=(r, W, ports, D, bound, queue), daemon=True) for r in range(W)]
    for p in procs:
        p.start()
    try:
        got = dict(queue.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    mean = torch.stack(random_rows(W, D, seed=1)).mean(0).numpy()
    for r in range(W):
        for new, all_arrived, complete in got[r]:
            assert all_arrived and complete
            np.testing.assert_allclose(new, mean, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------------------ real loss

REAL_LOSS_SCRIPT = r"""
import json, subprocess, sys
sys.path.insert(0, sys.argv[1])
from test_udp import group, masks, random_rows, reference, run_round, seg_len, UdpOptions, OVERHEAD_BYTES
import numpy as np, torch
# This runs inside a private network namespace: only its own loopback exists.
subprocess.run(["ip", "link", "set", "lo", "up", "mtu", "1500"], check=True)
subprocess.run(["iptables", "-A", "INPUT", "-i", "lo", "-p", "udp", "-m", "statistic", "--mode", "random",
                "--probability", sys.argv[2], "-j", "DROP"], check=True)
opts = UdpOptions(datagram_bytes=OVERHEAD_BYTES + 256, offload=False, final_grace_s=0.2)
W, D = 4, 20000
lost = total = 0
with group(W, opts) as exs:
    seg = seg_len(exs[0], torch.float32)
    for rnd in range(3):
        rows = random_rows(W, D, seed=rnd)
        results = run_round(exs, rows, rnd, deadline_s=5.0)
        up, down = masks(results)
        want = reference(torch.stack(rows).numpy(), up, down, seg)
        got = torch.stack([res[0] for res in results]).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        off = ~np.eye(W, dtype=bool)
        lost += int((~up[off]).sum() + (~down[off]).sum())
        total += int(up[off].size + down[off].size)
print(json.dumps({"lost": lost, "total": total}))
"""


def _real_loss_unavailable() -> str:
    import os  # noqa: PLC0415
    import shutil  # noqa: PLC0415
    import subprocess  # noqa: PLC0415

    if os.geteuid() != 0:
        return "real-loss tests need root (a network namespace and an iptables rule)"
    for tool in ("unshare", "ip", "iptables"):
        if shutil.which(tool) is None:
            return f"real-loss tests need {tool} (apt-get install iptables iproute2 util-linux)"
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True)
    return "" if probe.returncode == 0 else "real-loss tests need unshare --net (a network namespace)"


def test_real_packet_loss_gives_the_rule_with_what_arrived(tmp_path) -> None:
    """Inside a private network namespace an iptables rule drops 10% of the UDP packets on its loopback:
    every round's result is RPS's rule applied to the masks of what really arrived, and some did not."""
    import json  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    why = _real_loss_unavailable()
    if why:
        pytest.skip(why)
    script = tmp_path / "real_loss.py"
    script.write_text(REAL_LOSS_SCRIPT)
    done = subprocess.run(["unshare", "--net", sys.executable, str(script), str(Path(__file__).parent), "0.1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert 0.03 < found["lost"] / found["total"] < 0.4, found


def test_emulated_latency_holds_datagrams_for_their_link() -> None:
    """Rank 2's links out are 6 s long (the delay line), the others' instant: with a 2 s deadline nothing
    rank 2 sent can be in time (its segments at the servers and its average everywhere are lost, and the rule
    holds on those masks), while the links between the other two deliver; with the latency under the deadline
    it all arrives. Bad latencies are refused, naming the entry."""
    W, D = 3, 200
    rows = [torch.arange(D, dtype=torch.float32) * (r + 1) for r in range(W)]

    with group(W, latency_s=lambda r: [6.0 if r == 2 else 0.0] * W) as exs:
        results = run_round(exs, rows, 0, deadline_s=2.0)
    up, down = masks(results)
    seg = seg_len(exs[0], torch.float32)
    nseg = [math.ceil(n / seg) for n in block_sizes(D, W)]
    assert not up[2, 0, :nseg[0]].any() and not up[2, 1, :nseg[1]].any(), "rank 2's segments came in time"
    assert not down[2, 0, :nseg[2]].any() and not down[2, 1, :nseg[2]].any(), "rank 2's average came in time"
    # Between the other two everything arrives. (Rank 2's own phase 2 is not checked: its phase 1, fed by
    # instant links, completes at once, so its phase 2 ends when the servers' phase 1 deadline sends them on.)
    assert up[0, 1].all() and up[1, 0].all() and down[0, 1].all() and down[1, 0].all(), "an instant link lost"
    expected = reference(np.stack([r.numpy() for r in rows]), up, down, seg)
    np.testing.assert_allclose(np.stack([res[0].numpy() for res in results]), expected, rtol=1e-6)

    with group(W, latency_s=lambda r: [0.05 if r == 2 else 0.0] * W) as exs:
        results = run_round(exs, rows, 0, deadline_s=10.0)
    assert all(res[3].closed_by == ("complete", "complete") for res in results)
    mean = sum(rows) / W
    for res in results:
        torch.testing.assert_close(res[0], mean)

    for bad, why in (([0.1] * 2, "one one-way latency per rank"), ([0.0, -1.0, 0.0], r"latency_s\[1\]"),
                     ([0.0, float("nan"), 0.0], r"latency_s\[1\]")):
        with pytest.raises(ValueError, match=why):
            UdpExchange(rank=0, num_workers=W, key=KEY, run_id=RUN, host="127.0.0.1", ports=PORTS, latency_s=bad)


def test_a_rank_of_weight_0_is_out_of_the_round() -> None:
    """A dead rank (weight 0, its block served by the next rank) takes no part: the three others neither wait
    for it nor send it anything, every phase completes, what each sent is what the others counted as expected
    and received, and the result is RPS's rule over the live ranks."""
    W, D = 4, 1000
    rows = [torch.arange(D, dtype=torch.float32) * (r + 1) for r in range(W)]
    weights, servers = torch.tensor([1.0, 1.0, 0.0, 1.0]), [0, 1, 3, 3]
    with group(W) as exs:
        results: dict = {}

        def go(r: int) -> None:
            results[r] = exs[r].block_average(rows[r], 0, deadline_s=10.0, weights=weights, servers=servers)

        threads = [threading.Thread(target=go, args=(r,), daemon=True) for r in (0, 1, 3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(ROUND_TIMEOUT_S)
    stats = [results[r][3] for r in (0, 1, 3)]
    assert all(st.closed_by == ("complete", "complete") for st in stats)
    assert sum(st.sent for st in stats) == sum(sum(st.expected) for st in stats) == sum(st.received for st in stats)
    mean = (rows[0] + rows[1] + rows[3]) / 3
    for r in (0, 1, 3):
        torch.testing.assert_close(results[r][0], mean)
