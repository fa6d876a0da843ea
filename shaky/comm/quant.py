"""Values on the wire in fewer bytes (``strategy.value_dtype``), written once for every backend that sends them.

What travels is never a model rounded to the wire's type: rounding a model every round would lose every update
smaller than half a step of the grid. What travels is the difference between a worker's values and a
**reference both ends hold exactly**, rounded; the receiver adds it back to its copy of the reference. The
result becomes the next reference, so a rounding error lives one round and never accumulates:

- an exact mean (:func:`quantized_mean`): the reference is the exchange's last result, which every live worker
  holds bit for bit (a reliable mean gives every rank the same row). The first round, and a round in which some
  live worker holds no reference (it rejoined), sends the values themselves at the model's precision.
- RPS's block average (:func:`quantized_block_average`): every block is a *stream*. Its server's reference is the
  value it last handed out, ``b``; the server sends ``q_t = Q(a_t - b)`` and ``b + deq(q_t)`` becomes everyone's
  model and reference (the server's too). A worker that holds ``b`` of its block's present server (it is *in
  sync* on that segment; it took the server's last value, and the block has not moved to another server since)
  sends ``Q(x_i - b)``; one that does not (a lost phase-2 segment, a rejoin, the first round, a block moved)
  sends its values at the model's precision, and its server then sends it the new ``b`` whole, also at the
  model's precision, which puts it back in sync. A server that holds no stream of a segment (the block just
  moved to it, or it rejoined) cannot read a rounded segment, which is then lost to it, and it sends the new
  value whole to everyone. A segment of ``q_t`` that reaches a worker not in sync is of no use to it: it is a
  loss like any other (it keeps its own values). Nothing else is ever agreed: whether a sender is in sync is
  known from the type of what it sent; whether a receiver whose phase-1 segment was lost is in sync is not
  known, so it is sent ``q_t``. Each rank decides from what it holds, what it received and the agreed
  membership, which a transport gives it too.

Formats: ``float32``, ``bfloat16`` and ``float16`` round to the nearest value of the type; ``int8`` rounds
``d / scale`` to the nearest integer in [-127, 127] (ties to even), with one float32 ``scale = max|d| / 127`` for
each segment of rounded values, carried in the segment after them (a lost segment costs only itself; without
segments, one for each :data:`GROUP` values).

**Segments.** A segment of whole values, a *part*, holds what a datagram's ``segment_bytes`` hold at the rows'
itemsize (less int8's scale: :func:`fine_length`); a segment of rounded values holds a *group* of ``P`` parts
(:func:`parts`: the rows' itemsize over the format's, 4 for int8 from float32, 2 for bfloat16), so that it is
the same datagram with ``P`` times the values: ``segment_bytes`` a datagram carry 4x (2x) the values of a
float32 one. The delivery masks are per part (the network model's and a transport's, as for any run). A part
sent whole is a message of its own; a group sent rounded is one message, whose fate is the mask's entry at the
group's first part (:func:`delivered`): every draw of the masks is used by one message at most. Sync is kept
per part; what travels is decided per group: a worker sends a group rounded only where it is in sync on every
part of it (:func:`in_groups`), and a server sends a receiver a group whole where any part of it came whole
from that receiver (:func:`any_in_groups`).

Everything here is elementwise (or an exact maximum) in the model's dtype, so the same values give the same
bits on every backend and every CPU.

The simulator runs this over every row at once; the udp transport runs the same rule for one rank's row
(``shaky.comm.udp.exchange.QuantState``): nothing in it needs a rank to know more than it does there. A
server learns whether a sender is in sync from the type of the segment that arrived (a datagram of rounded
values has a dtype byte of its own, ``shaky.comm.udp.wire.ROUNDED_CODES``), a receiver knows its own sync,
and every rank adds to its part of the masks' round which segments it held, so that every rank counts the
same bytes. gloo's exchange sends the model's values and refuses ``strategy.value_dtype``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from shaky.comm.rps import own_parts_delivered
from shaky.geometry import block_sizes, segment_length

GROUP = 256
"""Values that share one int8 scale where a block is one message (no segments): groups of this many, from the
block's start. With segments, a rounded segment's values share one scale."""


@dataclass(frozen=True, slots=True)
class ValueFormat:
    """How a value travels: ``name`` (a torch dtype's name), ``itemsize`` bytes each, and ``scale_bytes`` per
    group of values that share a scale (int8's float32 scale; 0 for a float type)."""

    name: str
    itemsize: int
    scale_bytes: int = 0

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.name)

    def bytes_of(self, values: int | np.ndarray, group: int = GROUP) -> int | np.ndarray:
        """Bytes on the wire of a message (or each message) of ``values`` values: theirs and their scales' (one
        for each ``group`` values: a rounded segment's whole length, or :data:`GROUP` without segments)."""
        if not self.scale_bytes:
            return values * self.itemsize
        return values * self.itemsize + self.scale_bytes * -(-np.asarray(values) // group)


FORMATS = {"float32": ValueFormat("float32", 4), "bfloat16": ValueFormat("bfloat16", 2),
           "float16": ValueFormat("float16", 2), "int8": ValueFormat("int8", 1, 4)}
"""The formats ``strategy.value_dtype`` names ("": the model's own dtype, nothing rounded)."""


def value_format(name: str) -> ValueFormat | None:
    """The format ``strategy.value_dtype`` names, or None for "" (values travel as the model holds them)."""
    return FORMATS[name] if name else None


def parts(fmt: ValueFormat, itemsize: int) -> int:
    """P: the segments of whole values (of ``itemsize`` bytes each) that one segment of rounded values holds."""
    return max(1, itemsize // fmt.itemsize)


def fine_length(segment_bytes: int, itemsize: int, fmt: ValueFormat | None) -> int:
    """Values in a segment of whole values (``itemsize`` bytes each) of a run that sends ``fmt``: what
    ``segment_bytes`` hold, less int8's scale, so that :func:`parts` of them rounded, with their scale, fit the same
    bytes (``shaky.geometry.segment_length``; 0 without segments). ``fmt`` None: the run sends its values."""
    if fmt is None or segment_bytes <= 0:
        return segment_length(segment_bytes, itemsize)
    return segment_length(segment_bytes - fmt.scale_bytes, max(itemsize, fmt.itemsize))


def rounded_length(seg: int, fmt: ValueFormat, itemsize: int) -> int:
    """Values in a segment of rounded values: :func:`parts` segments of ``seg`` (0 without segments)."""
    return seg * parts(fmt, itemsize)


def scale_group(seg: int, fmt: ValueFormat, itemsize: int) -> int:
    """Values that share one int8 scale: a rounded segment's, or :data:`GROUP` without segments."""
    return rounded_length(seg, fmt, itemsize) if seg > 0 else GROUP


@lru_cache(maxsize=32)
def group_ids(dim: int, num_blocks: int, seg_len: int, group: int = GROUP) -> tuple[torch.Tensor, int]:
    """int64 [dim]: the int8 scale group of each value of a row cut into ``num_blocks`` blocks and each block into
    segments of ``seg_len`` values (0: a block is one segment), groups of ``group`` counted from each
    segment's start; and the number of groups."""
    ids, start, base = np.empty(dim, np.int64), 0, 0
    for n in block_sizes(dim, num_blocks):
        length = seg_len if seg_len > 0 else max(n, 1)
        for first in range(0, n, length):
            size = min(length, n - first)
            ids[start + first:start + first + size] = base + np.arange(size) // group
            base += -(-size // group)
        start += n
    return torch.from_numpy(ids), base


def scale_groups(dim: int, num_blocks: int, seg: int, fmt: ValueFormat, itemsize: int
                 ) -> tuple[torch.Tensor, int] | None:
    """:func:`group_ids` of a row whose segments of whole values hold ``seg`` values, sent in ``fmt``: one group
    a rounded segment (None for a float format, which has no scale)."""
    if not fmt.scale_bytes:
        return None
    group = scale_group(seg, fmt, itemsize)
    return group_ids(dim, num_blocks, rounded_length(seg, fmt, itemsize), group)


def _by_group(mask: torch.Tensor, p: int, fill: bool = True) -> torch.Tensor:
    """``mask`` [..., S] as [..., ceil(S / p), p]: its parts by rounded segment (padding past S: ``fill``)."""
    pad = -mask.shape[-1] % p
    if pad:
        mask = torch.cat([mask, mask.new_full((*mask.shape[:-1], pad), fill)], dim=-1)
    return mask.reshape(*mask.shape[:-1], -1, p)


def _spread(g: torch.Tensor, like: torch.Tensor, p: int) -> torch.Tensor:
    """[..., G, 1], one entry a group of ``p`` parts, back over the parts of ``like`` [..., S]."""
    return g.expand(*g.shape[:-1], p).reshape(*like.shape[:-1], -1)[..., :like.shape[-1]]


def in_groups(mask: torch.Tensor, p: int) -> torch.Tensor:
    """[..., S]: True at each part whose whole group of ``p`` parts is True (a group goes rounded only so)."""
    return mask if p == 1 else _spread(_by_group(mask, p).all(-1, keepdim=True), mask, p)


def any_in_groups(mask: torch.Tensor, p: int) -> torch.Tensor:
    """[..., S]: True at each part of a group with any part True (padding past S is False)."""
    return mask if p == 1 else _spread(_by_group(mask, p, fill=False).any(-1, keepdim=True), mask, p)


def delivered(mask: torch.Tensor, rounded: torch.Tensor, p: int) -> torch.Tensor:
    """What arrived, per part [..., S]: of a part sent whole, its own message (``mask``'s entry); of a group sent
    rounded (``rounded``, the same for every part of a group), its one message, whose fate is ``mask``'s entry
    at the group's first part."""
    if p == 1:
        return mask
    first = _spread(_by_group(mask, p)[..., :1], mask, p)
    return torch.where(rounded, first, mask)


def rounded_values(values: np.ndarray, p: int) -> np.ndarray:
    """float [.., S]: the values each rounded message holds, at its group's first part (0 at the others: they are
    no message), from ``values`` [.., S], those of each segment of whole values."""
    if p == 1:
        return values
    s = values.shape[-1]
    pad = np.zeros((*values.shape[:-1], -s % p))
    g = np.concatenate([values, pad], axis=-1).reshape(*values.shape[:-1], -1, p)
    out = np.zeros_like(g)
    out[..., 0] = g.sum(-1)
    return out.reshape(*values.shape[:-1], -1)[..., :s]


@lru_cache(maxsize=32)
def segment_index(dim: int, num_blocks: int, seg_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 [dim] each: the block and the segment within it of every value of a row (segment 0 when
    ``seg_len`` is 0): the index that spreads a [.., W, S] mask over the row's values."""
    blocks, segs, start = np.empty(dim, np.int64), np.empty(dim, np.int64), 0
    for j, n in enumerate(block_sizes(dim, num_blocks)):
        blocks[start:start + n] = j
        segs[start:start + n] = np.arange(n) // seg_len if seg_len > 0 else 0
        start += n
    return torch.from_numpy(blocks), torch.from_numpy(segs)


@lru_cache(maxsize=32)
def spread_index(dim: int, num_blocks: int, seg_len: int, num_segments: int) -> torch.Tensor:
    """int64 [dim]: each value's place in a [.., W, S] mask flattened to [.., W * S] (:func:`segment_index`)."""
    blocks, segs = segment_index(dim, num_blocks, seg_len)
    return blocks * num_segments + segs


def _take(t: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``t[..., ids]``: each row's entries at ``ids`` (numpy's take on the CPU, three times torch's index_select
    along the last dimension there)."""
    if t.device.type == "cpu":
        return torch.from_numpy(np.take(t.numpy(), ids.numpy(), axis=-1))
    return t.index_select(-1, ids.to(t.device))


def round_trip(d: torch.Tensor, fmt: ValueFormat, groups: tuple[torch.Tensor, int] | None) -> torch.Tensor:
    """``deq(Q(d))``: what a receiver recovers of ``d`` [..., dim] sent in ``fmt``, in ``d``'s dtype
    (:func:`decode` of :func:`encode`). ``groups``: :func:`group_ids` of the row's layout (int8 only). An int8
    group of zeros has scale 0 and comes back as zeros."""
    return decode(*encode(d, fmt, groups), d.dtype, groups)


def encode(d: torch.Tensor, fmt: ValueFormat, groups: tuple[torch.Tensor, int] | None
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``Q(d)`` as it travels: the values in ``fmt`` and, for int8, the float32 scale of each group (a
    transport's payload). The scale travels as float32: both ends use it rounded to float32."""
    if fmt.scale_bytes == 0:
        return d.to(fmt.dtype), None
    ids, count = groups
    ids = ids.to(d.device)
    flat = d.reshape(-1, d.shape[-1])
    amax = flat.new_zeros(flat.shape[0], count).scatter_reduce_(1, ids.expand_as(flat), flat.abs(), "amax")
    scale32 = (amax / 127).to(torch.float32)
    per_value = _take(scale32.to(d.dtype), ids)
    safe = torch.where(per_value > 0, per_value, torch.ones_like(per_value))
    q = torch.round(flat / safe).clamp_(-127, 127).to(torch.int8)
    return q.reshape(d.shape), scale32.reshape(*d.shape[:-1], count)


def decode(q: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype,
           groups: tuple[torch.Tensor, int] | None) -> torch.Tensor:
    """The values :func:`encode` sent, in ``dtype``."""
    if scale is None:
        return q.to(dtype)
    ids = groups[0].to(q.device)
    flat = q.reshape(-1, q.shape[-1]).to(dtype)
    return (flat * _take(scale.reshape(flat.shape[0], -1).to(dtype), ids)).reshape(q.shape)


def quantized_mean(comm, x: torch.Tensor, members, ref: torch.Tensor, held: torch.Tensor, carry: torch.Tensor,
                   fmt: ValueFormat, segment_bytes: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """The exact (weighted) mean of ``x`` [w, D] with its values sent in ``fmt``, against the last result.

    ``ref`` [w, D]: the exchange's last result; ``held`` [w, 1]: 1 where a worker holds it; ``carry`` [w, D]:
    what each worker's rounding left out last time (error feedback: it is sent with the next difference). Where
    every live worker holds the reference, each sends ``Q(x_i - ref + carry_i)`` and the result is
    ``ref + mean_i deq(...)``; otherwise (the first round, a worker back from the dead) the values are sent as
    they are and the result is the plain mean. A simulated ring counts each worker's rounding once (a real one
    that sums partial results in ``fmt`` rounds again at each hop). Returns (result [w, D], new ref, new held,
    new carry, whether the values were rounded).
    """
    rows = comm.rows
    live = (members.live & ~members.rejoined)[rows].to(x.dtype)[:, None]
    # Every live worker holds the reference: the live-weighted mean of ``held`` is exactly 1 (a sum of ones).
    everyone = bool((comm.mean(held * live + (1 - live), members.live.to(x.dtype)) == 1).all())
    if everyone:
        seg = fine_length(segment_bytes, x.element_size(), fmt)
        groups = scale_groups(x.shape[1], comm.num_workers, seg, fmt, x.element_size())
        d = x - ref + carry
        sent = round_trip(d, fmt, groups)
        result, carry = ref + comm.mean(sent, members.weights), d - sent
    else:
        result, carry = comm.mean(x, members.weights), torch.zeros_like(carry)
    result = result.contiguous() if result.stride(0) == 0 else result
    taken = members.live[rows].to(torch.bool)[:, None]
    return result, torch.where(taken, result, ref), taken.to(x.dtype), carry, everyone


def message_kinds(insync: torch.Tensor, up: torch.Tensor, servers: torch.Tensor, p: int = 1
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What each message of a round carries, from who held which stream before it (``insync`` bool [W, W, S],
    worker, block, part) and what arrived in phase 1 (``up`` [W, W, S]; ``p``: :func:`parts`): the block parts
    that never travel (``own`` [W, W, 1]), the phase-1 parts sent rounded (``rounded_up`` [sender, block, S]: the
    sender held the stream on every part of the group), the parts whose server holds its stream on the whole
    group (``server_sync`` [block, S]), the phase-2 parts sent whole (``whole`` [receiver, block, S]: the server
    holds no stream, or a part of the receiver's group came whole, so it does not hold the whole group; q_t
    otherwise, of use only to a receiver in sync on that part), and what arrived in phase 1 (``up`` [W, W, S], :func:`delivered`). The
    simulator and every rank of udp compute them alike."""
    w = insync.shape[0]
    blocks = torch.arange(w, device=insync.device)
    own = torch.zeros(w, w, 1, dtype=torch.bool, device=insync.device)
    own[servers, blocks] = True
    insync = in_groups(insync, p)                  # a rounded segment is sent only for a group wholly in sync
    rounded_up = insync & ~own
    up = delivered(up, rounded_up, p)
    server_sync = insync[servers, blocks]
    whole = ~server_sync[None] | any_in_groups(up & ~rounded_up, p)
    return own, rounded_up, server_sync, whole, up


def quantized_block_average(server_averages, x: torch.Tensor, links, members, ref: torch.Tensor,
                            sync: torch.Tensor, carry: torch.Tensor, fmt: ValueFormat
                            ) -> tuple[torch.Tensor, ...]:
    """RPS's block average (:mod:`shaky.comm.rps`) with the values sent in ``fmt`` against each segment's stream
    (the module docstring), over every worker's row at once (the simulator: ``x`` is [W, D]).

    ``server_averages(sent, up, weights, servers, seg)``: phase 1, each value's server average [D] of what
    arrived (the comm's). ``ref`` [W, D], ``sync`` [W, W, S] (1 + the server whose stream value of that segment
    the worker holds, 0 for none; any other shape before the first round: nobody in sync), ``carry`` [W, D]:
    :class:`shaky.strategies.exchange.BlockStreams`. Error feedback: what a worker's
    rounding left out of a value it sent, as a sender in phase 1 or as the value's server in phase 2, is added
    to what it sends of that value next time (where it sends it whole, nothing is left out). Returns the new
    rows, ref, sync and carry, and which messages carried rounded values, up's and down's (bool, the masks'
    shape; the others carried the rows' own precision).
    """
    w, dim = x.shape
    seg = fine_length(links.segment_bytes, x.element_size(), fmt)
    p = parts(fmt, x.element_size()) if seg else 1
    srv = torch.arange(w) if members.all_live else members.servers.to(torch.int64)
    up, down = own_parts_delivered(links.up, links.down, srv)
    segmented = up.dim() == 3
    up3, down3 = (up, down) if segmented else (up[..., None], down[..., None])
    device = x.device   # (the masks and the membership are drawn on the host)
    up3, down3, srv = (t.to(device) for t in (up3, down3, srv))
    live, present = members.live.to(device), (members.live & ~members.rejoined).to(device)
    num_segments = up3.shape[2]
    stream_of = (srv + 1).to(x.dtype)[None, :, None]              # whose stream a sync entry names
    insync = (sync == stream_of) & present[:, None, None] if tuple(sync.shape) == (w, w, num_segments) else \
        torch.zeros(w, w, num_segments, dtype=torch.bool, device=device)
    own, rounded_up, server_sync, whole, up3 = message_kinds(insync, up3, srv, p)
    # A server that does not hold the stream cannot read a rounded segment: to it, that segment is lost.
    used_up = up3 & (~rounded_up | server_sync[None])
    blk = segment_index(dim, w, seg)[0].to(device)
    spread = spread_index(dim, w, seg, num_segments)

    def per_value(mask: torch.Tensor) -> torch.Tensor:       # [W, S] -> [D], [w, W, S] -> [w, D]
        return _take(mask.reshape(*mask.shape[:-2], -1), spread)

    groups = scale_groups(dim, w, seg, fmt, x.element_size())
    rounded_pos = per_value(rounded_up)
    d = x - ref + carry
    d_sent = round_trip(d, fmt, groups)
    sent = torch.where(rounded_pos, ref + d_sent, x)
    avg = server_averages(sent, used_up if segmented else used_up[..., 0], members.weights, srv, seg)   # [D]
    # each value's server's reference and carry: the server's row of them, read at that value
    at_server = srv[blk] * dim + torch.arange(dim, device=device)
    b = ref.reshape(-1).take(at_server)
    streaming = per_value(server_sync)
    target = avg + carry.reshape(-1).take(at_server)
    step = round_trip((target - b)[None], fmt, groups)[0]
    stream = torch.where(streaming, b + step, avg)
    carry = torch.where(rounded_pos, d - d_sent, torch.zeros_like(d))
    carry.view(-1).index_copy_(0, at_server, torch.where(streaming, target - b - step, torch.zeros_like(b)))
    down_used = delivered(down3.transpose(0, 1), ~whole, p)      # [receiver, block, S]
    take = (down_used & (whole | insync) & live[:, None, None]) | own
    take_pos = per_value(take)
    out = torch.where(take_pos, stream[None], x)
    new_ref = torch.where(take_pos, stream[None], ref)
    new_sync = torch.where(take, stream_of, torch.zeros_like(stream_of))
    rounded_down = (~whole & ~own).transpose(0, 1)
    if not segmented:
        rounded_up, rounded_down = rounded_up[..., 0], rounded_down[..., 0]
    return out, new_ref, new_sync, carry, rounded_up.cpu(), rounded_down.cpu()
