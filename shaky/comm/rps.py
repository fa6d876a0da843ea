"""RPS's rule (Yu et al., ICML 2019), written once: every backend's block average is these three functions.

A row of D values is cut into W blocks (``shaky.geometry.block_sizes``); block j is served by one worker, and
with a segment length ``seg`` > 0 each block is cut further into segments of ``seg`` values, the unit of loss
(``segment_counts``; ``seg`` 0: a block is one message).

- Phase 1, at a server (:func:`shares`, :func:`server_average`): the average of a block, segment by segment,
  over the senders whose segment arrived, each weighted by its worker's weight::

      avg[k] = sum_i w_i a_ik x_i[k] / sum_i w_i a_ik        (a_ik: sender i's segment k of this block arrived)

  Each block is a message of its own: a server of two blocks (a dead worker's successor) averages each over
  the senders whose segment of that block arrived (the masks are per block, ``LinkSample``'s). Its own
  segment always arrives (:func:`own_parts_delivered`). A segment that arrived from nobody of nonzero weight is 0/0 (NaN): the
  caller never uses it (only a server out of the round gets one).
- Phase 2, at a worker (:func:`keep_own_where_lost`): it takes the server's average of each segment where it
  arrived, and keeps its own values where it was lost. Unbiased and never worse than not averaging.

The simulator calls them over every block at once (a leading batch of blocks), gloo and udp over the blocks a
rank serves and receives. ``shaky/comm/_fastpath.c`` implements :func:`shares` (``shaky_block_shares``) and
:func:`keep_own_where_lost` (``shaky_take_averages``) for the simulator's CPU path without segments; the tests
check that they give these functions' bits.
"""

from __future__ import annotations

import numpy as np
import torch

from shaky.geometry import own_parts


def shares(up: torch.Tensor, weights: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Each arrival's weight in its server's average: ``w_i a_i / sum_i w_i a_i``.

    ``up``: bool [senders, blocks] (or [senders, blocks, S] per segment), what arrived of each block at its
    server; ``weights``: [senders] or None (equal). Returns [blocks, S, senders] in ``dtype`` (S = 1 for
    [senders, blocks]), contiguous: a block's row of weights is what multiplies its received values
    (:func:`server_average`).
    """
    arrived = up.to(dtype)
    if weights is not None:
        arrived = arrived * weights.to(dtype).reshape(-1, *([1] * (up.dim() - 1)))
    share = arrived / arrived.sum(0)
    return share.T.unsqueeze(1).contiguous() if up.dim() == 2 else share.permute(1, 2, 0).contiguous()


def own_parts_delivered(up: torch.Tensor, down: torch.Tensor, servers: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The masks (per block, ``shaky.geometry.LinkSample``'s) with each server's own part of the blocks it serves
    delivered, ``up[servers[j], j]`` and ``down[j, servers[j]]``: it never travels. The network model's masks
    have them; masks made by hand may not, and a block whose server's own values were left out would be
    averaged without them (or over no sender at all)."""
    own = torch.from_numpy(own_parts(servers.tolist())).to(up.device)
    if up.dim() == 3:
        own = own[..., None]
    return up | own, down | own.transpose(0, 1)


def _pieces(n: int, seg: int) -> list[tuple[int, int, int]]:
    """A block of ``n`` values in segments of ``seg``: (first segment, segments, values each) for its whole
    segments and for a shorter last one, so that each piece is one view ``[..., segments, values]``."""
    if seg <= 0 or n <= seg:
        return [(0, 1, n)] if n else []
    whole, rest = divmod(n, seg)
    return [(0, whole, seg)] + ([(whole, 1, rest)] if rest else [])


def server_average(share: torch.Tensor, blocks: torch.Tensor, seg: int = 0, *,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Phase 1: each served block's average over the senders whose segments arrived.

    ``share``: [B, S, senders], :func:`shares` of the B blocks (S = 1 without segments); ``blocks``: [B, senders,
    n], every sender's values of each block (a view of any strides; a segment that did not arrive must hold
    finite values, 0 as a rule: it is multiplied by 0); ``seg``: values per segment (0: none).
    Returns [B, n] (written into ``out`` where given). Where every segment of every block came from the same
    senders (no loss, as a rule), one batched matrix product over whole blocks; otherwise each value is its
    senders' weighted sum, taken sender by sender in order (a multiply, then one multiply-add per sender): a
    lossy block's average has the same bits whether a call holds it alone (a udp or gloo server) or with other
    blocks (the simulator), and it costs one pass over the values per sender (a matrix product per pattern of
    arrivals cost 9x more for a small block at 10% loss, and 3-9x more for large ones).
    """
    b, w, n = blocks.shape
    # (a fresh bmm, then copied: bmm's out= at an offset summed 1 ulp apart here and there)
    if seg <= 0 or n <= seg or share.shape[1] == 1 or torch.equal(share, share[:, :1].expand_as(share)):
        # One segment a block, or every segment from the same senders (no loss, as a rule): one batched
        # product over whole blocks (each value the same sum over the senders as segment by segment).
        whole = torch.bmm(share[:, :1], blocks).view(b, n)
        return whole if out is None else out.copy_(whole)
    avg = blocks.new_empty(b, n) if out is None else out
    by_sender = share.permute(2, 0, 1)                                               # [senders, B, S]
    for k0, count, length in _pieces(n, seg):
        start = k0 * seg
        stop = start + count * length
        src = blocks[:, :, start:stop].unflatten(2, (count, length))                 # [B, senders, segs, len]
        weight = by_sender[:, :, k0:k0 + count, None]                                # [senders, B, segs, 1]
        dst = avg[:, start:stop].unflatten(1, (count, length))                       # [B, segs, len]
        torch.mul(src[:, 0], weight[0], out=dst)
        for i in range(1, w):
            dst.addcmul_(src[:, i], weight[i])
    return avg


_FEW_LOST = 32
"""Lost segments that :func:`keep_own_where_lost` copies back one by one (more: in a few batched copies)."""


def keep_own_where_lost(avg: torch.Tensor | None, own: torch.Tensor, lost: torch.Tensor, seg: int = 0, *,
                        out: torch.Tensor) -> torch.Tensor:
    """Phase 2: every worker takes each block's average where it arrived, and keeps its own where it was lost.

    ``avg``: [B, n] the servers' averages, or None where ``out`` holds them already (a transport receives them
    in place: then only the lost segments are copied); ``own``: [w, B, n] each local worker's own values;
    ``lost``: bool [w, B, S] (S = 1 without segments), the average of that segment did not come back; ``out``:
    [w, B, n], which may be ``own`` itself (each element is read before it is written). Copies only.
    """
    if seg <= 0 or own.shape[2] <= seg:     # one segment a block
        if avg is not None:
            return torch.where(lost[:, :, :1], own, avg[None], out=out)
        if bool(lost.any()):
            where = lost[:, :, 0].nonzero(as_tuple=True)
            out[where] = own[where]
        return out
    if avg is None:     # a transport's: the averages are in ``out``, and the lost segments are few as a rule
        cpu = own.device.type == "cpu" and not own.requires_grad
        gone = list(zip(*np.nonzero(lost.numpy()))) if cpu else lost.nonzero().tolist()
        if len(gone) <= _FEW_LOST:      # a copy each (80 -> 10 us for two of a 6,530-value block, on a CPU)
            n = own.shape[2]
            src, dst = (own.numpy(), out.numpy()) if cpu else (own, out)
            for i, b, k in gone:
                dst[i, b, k * seg:min((k + 1) * seg, n)] = src[i, b, k * seg:min((k + 1) * seg, n)]
            return out
    for k0, count, length in _pieces(own.shape[2], seg):
        start = k0 * seg
        stop = start + count * length
        mine, dst = (t[:, :, start:stop].unflatten(2, (count, length)) for t in (own, out))
        gone = lost[:, :, k0:k0 + count]
        if avg is not None:
            torch.where(gone[..., None], mine, avg[None, :, start:stop].unflatten(2, (count, length)), out=dst)
        elif bool(gone.any()):
            where = gone.nonzero(as_tuple=True)
            dst[where] = mine[where]
    return out
