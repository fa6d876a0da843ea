"""RPS's rule, written once (shaky/comm/rps.py): its functions against the rule spelled out value by value, and
the compiled implementations (shaky/comm/_fastpath.c) against its functions, bit for bit."""

from __future__ import annotations

import pytest
import torch

from shaky import native
from shaky.comm import rps
from shaky.geometry import block_sizes

NEEDS_BUILD = pytest.mark.skipif(native.FASTPATH is None, reason="the compiled fast path was not built")


def rule(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, seg: int, weights: torch.Tensor | None,
         servers: list[int]) -> torch.Tensor:
    """The rule value by value (float64): server servers[j] averages segment k of block j over the senders
    i with up[i, j, k] (weighted; each block a message of its own); worker r takes it where down[j, r, k], else
    keeps its own."""
    w, d = x.shape
    out, start = x.clone(), 0
    wts = torch.ones(w, dtype=x.dtype) if weights is None else weights.to(x.dtype)
    for j, n in enumerate(block_sizes(d, w)):
        for k in range(-(-n // seg) if seg else 1):
            a, b = start + k * seg if seg else start, start + min((k + 1) * seg, n) if seg else start + n
            arrived = up[:, j, k].to(x.dtype) * wts
            avg = (arrived[:, None] * x[:, a:b]).sum(0) / arrived.sum()
            for r in range(w):
                if down[j, r, k]:
                    out[r, a:b] = avg
        start += n
    return out


def via_rps(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, seg: int, weights: torch.Tensor | None,
            servers: list[int]) -> torch.Tensor:
    """The same through rps's three functions, one block at a time (as a rank serves and receives them)."""
    w, d = x.shape
    out, start = torch.empty_like(x), 0
    for j, n in enumerate(block_sizes(d, w)):
        cols = slice(start, start + n)
        share = rps.shares(up[:, j:j + 1], weights, x.dtype)                  # [1, S, senders]
        avg = rps.server_average(share, x[None, :, cols], seg)               # [1, n]
        rps.keep_own_where_lost(avg, x[:, None, cols], ~down[j, :, None, :], seg, out=out[:, None, cols])
        start += n
    return out


@pytest.mark.parametrize("w, d, seg", [(4, 1000, 16), (5, 37, 0), (3, 7, 2), (6, 600, 7), (4, 40, 100)])
def test_the_three_functions_are_the_rule(w: int, d: int, seg: int) -> None:
    gen = torch.Generator().manual_seed(w * d + seg)
    segments = max(-(-n // seg) for n in block_sizes(d, w)) if seg else 1
    for trial in range(4):
        x = torch.randn(w, d, generator=gen, dtype=torch.float64)
        up = torch.rand(w, w, segments, generator=gen) > 0.3
        down = torch.rand(w, w, segments, generator=gen) > 0.3
        weights = torch.rand(w, generator=gen, dtype=torch.float64) + 0.5 if trial % 2 else None
        servers = torch.randperm(w, generator=gen).tolist() if trial >= 2 else list(range(w))
        up[servers, torch.arange(w)] = True                 # a server's own values always arrive
        want = rule(x, up, down, seg, weights, servers)
        torch.testing.assert_close(via_rps(x, up, down, seg, weights, servers), want, rtol=1e-12, atol=1e-12)


def test_a_lost_segment_is_read_only_as_zero_weight() -> None:
    """A segment that did not arrive weighs 0: its values (0 in a transport's buffer) never move the average."""
    x = torch.randn(1, 3, 10, dtype=torch.float64)
    up = torch.tensor([[True, True], [True, False], [False, True]])          # [senders, segments]
    share = rps.shares(up[:, None, :], None, x.dtype)
    zeroed = x.clone()
    zeroed[0, 2, :5] = 0
    zeroed[0, 1, 5:] = 0
    torch.testing.assert_close(rps.server_average(share, x, 5), rps.server_average(share, zeroed, 5))


@NEEDS_BUILD
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_compiled_shares_and_copies_are_the_rule_s_bits(dtype: torch.dtype) -> None:
    lib = native.FASTPATH
    gen = torch.Generator().manual_seed(3)
    for w, d in ((16, 2613), (5, 37), (7, 3), (4, 40)):
        x = torch.randn(w, d, generator=gen, dtype=dtype)
        up = torch.rand(w, w, generator=gen) > 0.4
        up[torch.arange(w), torch.arange(w)] = True
        down = torch.rand(w, w, generator=gen) > 0.4
        share = x.new_empty(w, 1, w)
        lib.shaky_block_shares(up.data_ptr(), w, share.data_ptr(), x.element_size())
        assert torch.equal(share, rps.shares(up, None, dtype))
        # every block's average, then the copies: C's per row and block, rps's per element
        sizes = block_sizes(d, w)
        avg = torch.cat([rps.server_average(share[j:j + 1], x[None, :, sum(sizes[:j]):sum(sizes[:j + 1])])[0]
                         for j in range(w)])
        byte_sizes = torch.tensor(sizes, dtype=torch.int64) * x.element_size()
        compiled = torch.empty_like(x)
        lib.shaky_take_averages(compiled.data_ptr(), x.data_ptr(), avg.data_ptr(), down.contiguous().data_ptr(),
                                byte_sizes.data_ptr(), w, compiled.stride(0) * compiled.element_size(),
                                x.stride(0) * x.element_size())
        want, start = torch.empty_like(x), 0
        for j, n in enumerate(sizes):
            rps.keep_own_where_lost(avg[None, start:start + n], x[:, None, start:start + n], ~down[j, :, None, None],
                                    out=want[:, None, start:start + n])
            start += n
        assert torch.equal(compiled, want)


def test_a_lossy_average_gives_the_same_bits_whether_its_blocks_come_one_by_one_or_together() -> None:
    """The simulator averages every block in one call, a udp or gloo server only its own: where arrivals differ
    between a block's segments, server_average takes each value's weighted sum sender by sender, so that the
    block's average has the same bits in both (float32, random arrivals, weights with 0 among them, a shorter
    last segment), and equals the formula sum_i w_i a_ik x_i / sum_i w_i a_ik in float64 (1e-12)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        w, b, s, seg = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((2, 7), (2, 5), (2, 30), (1, 9)))
        n = (s - 1) * seg + int(torch.randint(1, seg + 1, (1,), generator=g))
        up = torch.rand(w, b, s, generator=g) >= 0.3
        up[0] = True
        up[1, :, 0] = ~up[1, :, 1]          # every block lossy: its segments' senders differ
        weights = None if torch.rand(1, generator=g) < 0.5 else \
            torch.tensor([0.0, 0.5, 1.0, 2.0])[torch.randint(0, 4, (w,), generator=g)]
        if weights is not None:
            weights[:2] = 1.0               # (sender 1's weight 0 would make its losses no loss)
        x = torch.randn(b, w, n, generator=g)
        share = rps.shares(up, weights, torch.float32)
        together = rps.server_average(share, x, seg)
        one_by_one = torch.cat([rps.server_average(share[j:j + 1], x[j:j + 1], seg) for j in range(b)])
        assert torch.equal(together, one_by_one)
        share64, x64 = rps.shares(up, weights, torch.float64), x.double()
        a = up.permute(1, 0, 2).repeat_interleave(seg, dim=2)[:, :, :n].double()      # [B, senders, n]
        wt = torch.ones(w, dtype=torch.float64) if weights is None else weights.double()
        num, den = (a * wt[:, None] * x64).sum(1), (a * wt[:, None]).sum(1)
        torch.testing.assert_close(rps.server_average(share64, x64, seg), num / den, rtol=1e-12, atol=1e-12)


def test_keeping_its_own_values_in_place_equals_choosing_between_the_two() -> None:
    """A transport's phase 2 (the averages received in place, ``avg`` None: only the lost segments are copied
    back, one by one when few, in batches when many) gives the bits of the simulator's (``avg`` given: a choice
    between the average and its own values everywhere), for a few and for many lost segments, a shorter last
    segment, several workers and blocks."""
    g = torch.Generator().manual_seed(0)
    for p in (0.05, 0.3, 0.9):
        for _ in range(20):
            w, b, seg = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((1, 4), (1, 4), (1, 50)))
            n = int(torch.randint(seg + 1, 40 * seg, (1,), generator=g))
            s = -(-n // seg)
            own, avg = torch.randn(w, b, n, generator=g), torch.randn(b, n, generator=g)
            lost = torch.rand(w, b, s, generator=g) < p
            want = rps.keep_own_where_lost(avg, own, lost, seg, out=torch.empty(w, b, n))
            got = avg[None].expand(w, b, n).clone()
            assert rps.keep_own_where_lost(None, own, lost, seg, out=got) is got
            assert torch.equal(got, want)
