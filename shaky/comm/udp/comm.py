"""The udp transport's Comm: RPS's block averages as UDP datagrams (:mod:`shaky.comm.udp.exchange`), real loss,
never resent; everything else (each exchange's masks, means, gathers, barriers) on a control plane it is given
(:mod:`shaky.comm.udp.control`: gloo's collectives, or a quorum's rounds with live membership).

Built by every rank together (:func:`udp_comm`): it exchanges addresses, the key's fingerprint and, without a key,
the key itself through the rendezvous store. Each block average is one :class:`UdpExchange` round whose result
follows RPS's rule on what really arrived; every rank's masks are gathered afterwards on the control plane
(:attr:`UdpDistComm.observed`, in the simulator's [W, W, S] layout, for the run's trace), with each rank's
deadline proposal for the next round, so the ranks agree on it (the largest proposal) without another round.
"""

from __future__ import annotations

import hashlib
import os
import socket
import stat
import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from shaky.comm.base import Handle, MeanHandle
from shaky.comm.quant import fine_length, message_kinds, parts
from shaky.comm.gloo import JoinStore, broadcast_object, rendezvous_store
from shaky.comm.udp.control import ControlPlane, GlooControl, QuorumControl
from shaky.comm.udp.exchange import (AdaptiveDeadline, ExchangeStats, QuantState, UdpExchange, UdpOptions,
                                     python_path_warning, run_masks)
from shaky.config import DistConfig
from shaky.geometry import LinkSample, block_sizes
from shaky.membership.heartbeat import Heartbeat
from shaky.progress import say

MAX_LANES = 64
"""The most udp exchanges one run may have in flight at once (sockets and threads per rank)."""

KEY_ENV = "SHAKY_KEY"
"""The environment variable that holds the udp key material when ``dist.key_file`` is not given."""
MIN_KEY_BYTES = 16
"""Key material shorter than this (after stripping white space) is refused."""
DEFAULT_PORTS = DistConfig().port_range()
"""The UDP ports a rank may bind by default (``dist.ports``)."""


class _IntoCaller:
    """The handle of an exchange received into a lane's buffer: ``wait()`` copies the result into the row the
    caller gave up (its ``x``), frees the buffer, and returns ``x``."""

    def __init__(self, handle: Handle, x: torch.Tensor, busy: list[bool], lane: int) -> None:
        self._handle, self._x, self._busy, self._lane = handle, x, busy, lane
        self._done = False

    def wait(self) -> torch.Tensor:
        if not self._done:
            try:
                self._x.copy_(self._handle.wait())
            finally:
                self._busy[self._lane] = False
            self._done = True
        return self._x


def load_key(key_file: str = "", key_text: str | None = None) -> bytes | None:
    """The udp key from ``key_file`` (``dist.key_file``) or else ``key_text`` (``$SHAKY_KEY``, which the caller
    read); None if neither is given.

    The material (a file's bytes or the variable's text, white space stripped at both ends, at least
    16 bytes) is hashed with SHA-256 into the 32-byte HMAC key, so ``head -c 32 /dev/urandom`` and
    ``openssl rand -hex 32`` both make a good one. Raises ValueError naming the file or variable.
    """
    if key_file:
        material = _read_key_file(key_file)
        where = f"dist.key_file {key_file!r}"
    elif key_text is not None:
        material, where = key_text.encode(), f"the environment variable {KEY_ENV}"
    else:
        return None
    material = material.strip()
    if len(material) < MIN_KEY_BYTES:
        raise ValueError(f"{where} holds {'no key' if not material else f'{len(material)} bytes'}; a key needs at "
                         f"least {MIN_KEY_BYTES} (make one with: head -c 32 /dev/urandom > shaky.key)")
    return hashlib.sha256(b"shaky udp key\0" + material).digest()


MAX_KEY_FILE_BYTES = 1 << 16
"""The largest key file read (a key is 16 bytes or more; 64 KiB leaves room for any text form of one)."""


def _read_key_file(key_file: str) -> bytes:
    """The bytes of ``key_file``, a regular file of at most :data:`MAX_KEY_FILE_BYTES`: a device (/dev/zero) would
    be read until memory runs out and a FIFO would block until something writes it, so neither is opened.
    Raises ValueError naming the file."""
    try:
        info = os.stat(key_file)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"dist.key_file {key_file!r} is not a regular file (a key is read from a file of at "
                             f"most {MAX_KEY_FILE_BYTES} bytes: head -c 32 /dev/urandom > shaky.key)")
        with open(key_file, "rb") as f:
            material = f.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"dist.key_file {key_file!r} cannot be read: {exc.strerror or exc}") from None
    if len(material) > MAX_KEY_FILE_BYTES:
        raise ValueError(f"dist.key_file {key_file!r} holds more than {MAX_KEY_FILE_BYTES} bytes: not a key file "
                         "(make one with: head -c 32 /dev/urandom > shaky.key)")
    return material


def agreed_key(key_file: str = "", key_text: str | None = None) -> bytes | None:
    """:func:`load_key` on every rank (a collective): a key file one rank cannot read stops every rank with the
    same ValueError, which names that rank, instead of leaving the others waiting for it."""
    key, error = None, ""
    try:
        key = load_key(key_file, key_text)
    except ValueError as exc:
        error = str(exc)
    errors = [""] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    found = [(r, e) for r, e in enumerate(errors) if e]
    if found:
        raise ValueError(f"rank {found[0][0]}: {found[0][1]}")
    return key


def local_address(master: str = "127.0.0.1") -> str:
    """The IPv4 address this machine uses to reach ``master`` (MASTER_ADDR; 127.0.0.1 when that is this
    machine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((master, 9))   # a UDP connect sends nothing: it only picks the route
        except OSError as exc:
            raise ValueError(f"cannot find this machine's address towards MASTER_ADDR {master!r} ({exc}); "
                             "set dist.host") from None
        return str(probe.getsockname()[0])


class UdpDistComm:
    """A Comm whose block averages travel as UDP datagrams: real loss, never resent (see the module).

    ``control`` builds its control plane (``control(comm, wiring)``: :class:`GlooControl` by default, or a
    :class:`QuorumControl` with live membership, which :func:`udp_comm` makes). It is data only: who is in is the
    control plane's :attr:`agreement` (``shaky.membership.Agreed`` asks it), and the masks it observed are
    :meth:`take_observed`'s (``shaky.comm.base.Observed``).
    """

    _instances = 0   # per process: every rank builds its comms in the same order, so the store keys agree

    def __init__(self, *, deadline_ms: float | None = None, key: bytes | None = None, ports: range | None = None,
                 host: str | None = None, options: UdpOptions | None = None, announce: bool = True, lanes: int = 1,
                 latency_s: list[float] | None = None, joining: JoinStore | None = None,
                 master_addr: str = "127.0.0.1",
                 control: Callable[[UdpDistComm, Wiring], ControlPlane] | None = None) -> None:
        """``deadline_ms``: a fixed phase deadline (None: adaptive; the first round, with no history, gets
        :func:`first_deadline_s` of its row). ``key``: 32 bytes
        (``load_key``); None: rank 0 makes one for this run and hands it out through the store, and every
        rank says so on stderr (``announce``). ``ports``: the range a rank binds the first free port of.
        ``host``: this rank's address as the others reach it (None: ``local_address(master_addr)``, the one
        this machine reaches ``master_addr``, MASTER_ADDR, from).
        ``lanes``: exchanges that may be in flight at once (a delayed exchange's slots): each lane is a
        socket of its own, driven by a thread of its own, so that the exchanges launched at consecutive
        steps overlap each other as well as the compute (their latencies pipeline). ``latency_s``: the
        one-way latency to emulate towards each rank (``UdpExchange``'s delay line, and with a quorum the
        control rounds' requests to rank 0's store; None: none). ``joining``: this process was started again
        for a dead rank of a run in progress (needs a control plane that takes ranks back): it asks the
        survivors to take it back, and the control plane's ``await_welcome`` waits until they do.

        Raises ValueError (the same on every rank, naming the rank) when a rank cannot bind a port, or the
        ranks' keys differ."""
        if deadline_ms is not None and not 0 < deadline_ms < float("inf"):
            raise ValueError(f"deadline_ms must be a positive number of milliseconds, got {deadline_ms!r}")
        if isinstance(lanes, bool) or not isinstance(lanes, int) or not 1 <= lanes <= MAX_LANES:
            raise ValueError(f"lanes must be an integer in [1, {MAX_LANES}], got {lanes!r}")
        if joining is not None:
            self.rank, self.num_workers, self.store = joining.rank, joining.num_workers, joining.store
        elif not dist.is_initialized():
            raise RuntimeError("UdpDistComm needs torch.distributed to be initialised (start with torchrun)")
        else:
            self.rank, self.num_workers = dist.get_rank(), dist.get_world_size()
            self.store = rendezvous_store()
        """The rendezvous store (where the ranks' addresses are)."""
        self.rows = torch.tensor([self.rank])
        self.wait_s = 0.0
        """Seconds spent blocked waiting for exchanges."""
        if joining is None:
            UdpDistComm._instances += 1
        # A process that joins a run in progress takes the run's keys (a rank that was left out and asks to be
        # taken back has built comms of its own before: its count is not the run's).
        prefix = self.prefix = f"shaky/udp/{UdpDistComm._instances}" if joining is None else \
            str(joining.record.get("udp_prefix", "shaky/udp/1"))
        """This comm's keys in the rendezvous store."""
        store, me, w = self.store, self.rank, self.num_workers
        if me == 0 and joining is None:
            store.set(f"{prefix}/run", os.urandom(8).hex())
            if key is None:
                store.set(f"{prefix}/key", os.urandom(32).hex())
        run_id = int(store.get(f"{prefix}/run").decode(), 16)
        if key is None:
            key = bytes.fromhex(store.get(f"{prefix}/key").decode())
            if announce:
                say(f"shaky: rank {me}: the udp key was handed out through the rendezvous store, which is not "
                    f"encrypted; give every node dist.key_file or {KEY_ENV} to keep it off the network")
        fingerprint = hashlib.sha256(b"shaky key fingerprint\0" + key).hexdigest()[:16]
        exchanges: list[UdpExchange] = []
        address = ""
        try:
            address = host or local_address(master_addr)
            for _ in range(lanes):
                exchanges.append(UdpExchange(rank=me, num_workers=w, key=key, run_id=run_id, host=address,
                                             ports=ports or DEFAULT_PORTS, options=options, latency_s=latency_s))
            where = " ".join(f"{ex.address[0]} {ex.address[1]}" for ex in exchanges)
            store.set(f"{prefix}/addr/{me}", f"ok {fingerprint} {where}")
        except (OSError, ValueError) as exc:
            store.set(f"{prefix}/addr/{me}", f"error {exc}")
        self.exchanges: list[UdpExchange] = exchanges
        """This rank's ends of the data plane, one per lane."""
        try:
            self._connect(fingerprint)       # a socket this rank could not open is an error entry of its own
            self.control: ControlPlane = (control or gloo_control)(
                self, Wiring(key, run_id, address, ports or DEFAULT_PORTS, lanes, latency_s, joining is not None))
            """The control plane: each exchange's masks, the means, gathers and barriers."""
        except ValueError:
            for ex in exchanges:
                ex.close()
            raise
        self.exchange: UdpExchange = exchanges[0]
        """The first lane's exchange (every lane has the same options)."""
        self._threads = [ThreadPoolExecutor(1, thread_name_prefix=f"shaky-udp-lane{k}") for k in range(lanes)]
        self._completed: list[tuple[int, LinkSample]] = []
        self._step = 0
        self.segment_bytes = self.exchange.segment_bytes
        """The bytes of a datagram's segment: the unit of loss (``network.segment_bytes`` of the masks)."""
        self._fixed_s = None if deadline_ms is None else deadline_ms / 1000
        self._adaptive = AdaptiveDeadline()
        self._adaptive_lock = threading.Lock()     # the control threads observe exchanges that end at once
        self._deadline_s = self._fixed_s or self._adaptive.propose()
        self._round = 0
        self._scratch: list[torch.Tensor | None] = [None] * lanes
        """Each lane's result buffer for exchanges whose caller gave its row up (``overwrite``): kept, so that its
        pages are not faulted in again every round."""
        self._scratch_busy = [False] * lanes
        """Whether a lane's buffer holds a result not yet copied to its caller (another exchange on the lane
        then gets a fresh tensor)."""
        self._observed: LinkSample | None = None
        self._quant_row: torch.Tensor | None = None
        """uint8 [W, S]: while a quantized exchange runs, which of its segments this rank held the stream of
        before it (its masks' record carries it, so that every rank knows what went rounded)."""
        self._insync: torch.Tensor | None = None
        """bool [W, W, S]: every rank's ``_quant_row`` of the last quantized exchange."""
        self.last_stats: ExchangeStats | None = None
        """The counters of the last exchange (this rank's)."""
        self._totals = {"sent": 0, "received": 0, "expected": 0, "late": 0, "rejected": 0, "closed_by_deadline": 0,
                        "repeated": 0, "grace_s": 0.0}
        self.control.start(joining is not None, fingerprint)

    def _connect(self, fingerprint: str) -> None:
        """Every lane learns every rank's address from the store (at the start, and whenever ranks are taken
        back: theirs changed). Raises ValueError naming a rank that could not open its socket, or when the
        ranks' keys differ."""
        entries = [self.store.get(f"{self.prefix}/addr/{r}").decode().split(" ", 1) for r in range(self.num_workers)]
        errors = [(r, rest) for r, (status, rest) in enumerate(entries) if status != "ok"]
        if errors:
            r, why = errors[0]
            raise ValueError(f"rank {r} cannot open its udp socket: {why} (see dist.ports and dist.host)")
        fields = [rest.split(" ") for _, rest in entries]
        if len({f[0] for f in fields}) > 1 or fields[self.rank][0] != fingerprint:
            raise ValueError("the ranks hold different udp keys (dist.key_file or SHAKY_KEY differs between "
                             "nodes): every datagram would be rejected")
        for lane, ex in enumerate(self.exchanges):
            ex.connect([(f[1 + 2 * lane], int(f[2 + 2 * lane])) for f in fields])
        self._fingerprint = fingerprint

    def reconnect(self) -> None:
        """Every rank's address, learnt again (ranks were taken back: theirs changed)."""
        self._connect(self._fingerprint)

    def handover_state(self) -> dict[str, Any]:
        """What a rank taken back needs of this comm to go on alike: the next exchange's number and deadline."""
        return {"round": self._round, "deadline_s": self._deadline_s}

    def take_over(self, state: dict[str, Any], step: int) -> None:
        """A rank taken back: the survivors' :meth:`handover_state`, at ``step``."""
        self._round, self._deadline_s = state["round"], state["deadline_s"]
        self._adaptive = AdaptiveDeadline(initial_s=state["deadline_s"])
        self._step = step

    @property
    def agreement(self) -> Any:
        """What the survivors agree on (``shaky.membership.Agreement``), or None where a dead rank stops the
        run: the control plane's."""
        return self.control.agreement

    def control_round_seconds(self, latency_ms: Any) -> float:
        """Seconds of the control round every exchange waits for after its datagrams (``Observed``)."""
        return self.control.round_seconds(latency_ms)

    @property
    def deadline_s(self) -> float:
        """The deadline of the next exchange's phases, in seconds (the same on every rank)."""
        return self._deadline_s

    @property
    def observed(self) -> LinkSample | None:
        """The masks that arrived in the last exchange, every rank's ([W, W, S]); None before the first."""
        return self._observed

    def info(self) -> dict[str, object]:
        """This rank's first socket: address, granted buffers, GSO/GRO (``UdpExchange.info``), and the lanes."""
        return {**self.exchange.info(), "lanes": len(self.exchanges)}

    def close(self) -> None:
        """Stops the control plane, the lanes and the sockets (before the process group is destroyed)."""
        self.control.close(self._close_data)

    def _close_data(self) -> None:
        for pool in self._threads:
            pool.shutdown(wait=True, cancel_futures=True)
        for ex in self.exchanges:
            ex.close()

    def on_step(self, step: int) -> None:
        """A step starts: the masks of the exchanges launched from now on are this step's (``Observed``)."""
        self._step = step

    def take_observed(self) -> list[tuple[int, LinkSample]]:
        """The masks of the exchanges completed since the last call (what really arrived), each with the step
        it was launched at: an exchange that runs in the background completes steps later."""
        done, self._completed = self._completed, []
        return done

    def start_block_average(self, x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *,
                            weights: torch.Tensor | None = None, servers: torch.Tensor | None = None,
                            overwrite: bool = False, segment_bytes: int = 0) -> Handle:
        """:meth:`block_average`, launched in the background: the exchange runs in its lane's thread while the
        caller computes, and ``wait()`` blocks only for what has not arrived yet (then gathers the masks on the
        control plane: every rank waits for its handles in the same order, as a schedule makes them). Unless
        the caller gives ``x`` up (``overwrite``), the lane reads a copy of it; if it does, the result is
        written into ``x`` at ``wait()`` (:meth:`block_average`)."""
        return self._launch(x, weights, servers, segment_bytes, copy=not overwrite, into=overwrite)

    def block_average(self, x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *,
                      weights: torch.Tensor | None = None, servers: torch.Tensor | None = None,
                      overwrite: bool = False, segment_bytes: int = 0) -> torch.Tensor:
        """RPS's exchange over UDP. ``up`` and ``down`` (the drawn masks) are not used: the loss is the
        network's, and :attr:`observed` holds what arrived. ``segment_bytes`` must be :attr:`segment_bytes`
        (the run's ``network.segment_bytes``), so that the caller's masks and counters have its layout.

        With ``overwrite`` the result is received into a buffer this comm keeps for the lane (``x`` supplies
        the segments whose average was lost until the exchange is complete) and then copied into ``x``, which
        is returned: a fresh tensor of a large model's size costs a page fault per 4 KiB every round, about a
        third of a round's processor time at 1e7 float32 on the benchmark machine."""
        return self._launch(x, weights, servers, segment_bytes, copy=False, into=overwrite).wait()

    def quantized_block_average(self, x: torch.Tensor, links: LinkSample, members: Any, ref: torch.Tensor,
                                sync: torch.Tensor, carry: torch.Tensor, fmt: Any) -> tuple[torch.Tensor, ...]:
        """RPS's exchange with the values as rounded differences (``strategy.value_dtype``): the rule of
        :func:`shaky.comm.quant.quantized_block_average` for this rank's row, ``ref``, ``sync`` and ``carry`` ([1,
        D], [1, W, S], [1, D]: :class:`shaky.strategies.exchange.BlockStreams`' rows), waited for (no background:
        the next round's streams start from this one's). Returns the new row, ref, sync and carry, and which
        messages of the run carried rounded values, up's and down's [W, W, S] (every rank's part of the masks'
        round says what it held, so that every rank counts the same bytes)."""
        w, me = self.num_workers, self.rank
        srv = None if members.all_live else members.servers.to(torch.int64)
        srv_list = srv.tolist() if srv is not None else list(range(w))
        num_segments = links.up.shape[2]
        held = sync[0].numpy().astype(np.float64) if tuple(sync.shape) == (1, w, num_segments) else \
            np.zeros((w, num_segments))
        q = QuantState(fmt, ref[0].numpy().copy(), carry[0].numpy().copy(), held,
                       present=not bool(members.rejoined[me]))
        stream_of = np.asarray(srv_list, np.float64)[:, None] + 1
        self._quant_row = torch.from_numpy(((q.sync == stream_of) & q.present).astype(np.uint8))
        try:
            new = self._launch(x, members.weights, srv, links.segment_bytes, copy=True, quant=q).wait()
        finally:
            self._quant_row = None
        p = parts(fmt, x.element_size()) if fine_length(links.segment_bytes, x.element_size(), fmt) else 1
        own, rounded_up, _, whole, _ = message_kinds(self._insync, self._observed.up, torch.tensor(srv_list), p)
        rounded_down = (~whole & ~own).transpose(0, 1)
        dtype = x.dtype
        return (new, torch.from_numpy(q.ref).to(dtype)[None], torch.from_numpy(q.sync).to(dtype)[None],
                torch.from_numpy(q.carry).to(dtype)[None], rounded_up, rounded_down)

    def _launch(self, x: torch.Tensor, weights: torch.Tensor | None, servers: torch.Tensor | None,
                segment_bytes: int, *, copy: bool, into: bool = False, quant: QuantState | None = None) -> Handle:
        if segment_bytes != self.segment_bytes:
            raise ValueError(f"the udp transport's unit of loss is a {self.segment_bytes}-byte segment; "
                             f"block_average was called with segment_bytes={segment_bytes} "
                             f"(set network.segment_bytes = {self.segment_bytes})")
        deadline = self._deadline_s
        if self._fixed_s is None and self._round == 0:
            deadline = max(deadline, first_deadline_s(x[0].numel() * x.element_size()))
        # A background exchange reads its row while the caller goes on, so it gets a copy of its own.
        row = x[0].clone() if copy else x[0].contiguous()
        k = self._round % len(self.exchanges)
        out = None
        if into and not self._scratch_busy[k] and x.dim() == 2 and x.shape[0] == 1:
            out = self._scratch[k]
            if out is None or out.numel() != row.numel() or out.dtype != row.dtype:
                out = self._scratch[k] = torch.empty_like(row)
            self._scratch_busy[k] = True
        future = self._threads[k].submit(self.exchanges[k].block_average, row, self._round, deadline_s=deadline,
                                         weights=weights, servers=servers, out=out, quant=quant)
        self._round += 1
        handle = self.control.exchanged(future, k, self._step, row, servers)
        return handle if out is None else _IntoCaller(handle, x, self._scratch_busy, k)

    def _propose(self, stats: ExchangeStats) -> float:
        """This rank's proposal of the next exchange's deadline, having seen ``stats``."""
        if self._fixed_s is not None:
            return self._fixed_s
        with self._adaptive_lock:
            self._adaptive.observe_stats(stats)
            return self._adaptive.propose()

    def mask_record(self, result: tuple[torch.Tensor, torch.Tensor, torch.Tensor, ExchangeStats],
                    servers: torch.Tensor | None) -> torch.Tensor:
        """This rank's part of an exchange's masks round: what reached it (``up_obs`` [W, B, S], padded with True
        to the most blocks a rank serves, so that every rank's record is of one size; ``down_obs`` [W, S]), and
        its deadline proposal for the next exchange (uint8)."""
        _, up_obs, down_obs, stats = result
        w, served, nseg = up_obs.shape
        most = _most_served(servers, self.num_workers)
        if served < most:
            up_obs = torch.cat([up_obs, torch.ones(w, most - served, nseg, dtype=torch.bool)], dim=1)
        held = [] if self._quant_row is None else [self._quant_row.reshape(-1)]
        return torch.cat([up_obs.reshape(-1).to(torch.uint8), down_obs.reshape(-1).to(torch.uint8), *held,
                          torch.frombuffer(bytearray(struct.pack("<d", self._propose(stats))), dtype=torch.uint8)])

    def finish(self, result: tuple[torch.Tensor, torch.Tensor, torch.Tensor, ExchangeStats],
               parts: list[torch.Tensor], gone: tuple[int, ...], step: int, row: torch.Tensor,
               servers: torch.Tensor | None) -> torch.Tensor:
        """Counts an exchange, and makes every rank's masks (``parts``, :meth:`mask_record`) the run's; ``gone``:
        the ranks that left no record (dead), whose blocks every rank keeps its own values of."""
        new, _, _, stats = result
        self.last_stats = stats
        t = self._totals
        t["sent"] += stats.sent
        t["received"] += stats.received
        t["expected"] += sum(stats.expected)
        t["late"] += stats.late
        t["rejected"] += stats.rejected
        t["closed_by_deadline"] += sum(c == "deadline" for c in stats.closed_by)
        t["repeated"] += stats.repeated
        t["grace_s"] += stats.grace_s
        self._observed = self._masks_from(parts, servers, step, gone)
        self._completed.append((step, self._observed))
        if gone:
            w = self.num_workers
            srv = servers.tolist() if servers is not None else list(range(w))
            sizes = block_sizes(row.numel(), w)
            for j in range(w):
                if srv[j] in gone:
                    start = sum(sizes[:j])
                    new[start:start + sizes[j]] = row[start:start + sizes[j]]
        return new[None]

    def _masks_from(self, parts: list[torch.Tensor], servers: torch.Tensor | None, step: int,
                    gone: tuple[int, ...]) -> LinkSample:
        """Every rank's observed masks (:meth:`mask_record`) as the run's per-block [W, W, S] masks
        (:func:`~shaky.comm.udp.exchange.run_masks`), and the agreed deadline of the next round (the largest
        proposal). ``gone``: the ranks that left no record (dead): nothing reached them, and what they served
        counts as lost."""
        w = self.num_workers
        srv = servers.tolist() if servers is not None else list(range(w))
        most = _most_served(servers, w)
        every = torch.stack(parts)                                  # [rank, W c S + W S (+ W S) + 8]
        extra = 1 if self._quant_row is not None else 0             # a quantized exchange: what each rank held
        nseg = (every.shape[1] - 8) // (w * (most + 1 + extra))
        n_up, n = w * most * nseg, w * (most + 1) * nseg
        ups = every[:, :n_up].view(w, w, most, nseg).bool()
        downs = every[:, n_up:n].view(w, w, nseg).bool()
        if extra:
            self._insync = every[:, n:n + w * nseg].view(w, w, nseg).bool()
            n += w * nseg
        self._deadline_s = max(struct.unpack("<d", bytes(p[n:].tolist()))[0] for p in parts if p[n:].any())
        up, down = run_masks(list(ups), list(downs), srv, gone)
        return LinkSample(step, up, down, self.segment_bytes)

    # ------------------------------------------------------------------ on the control plane

    def mean(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        return self.control.mean(x, weights)

    def start_mean(self, x: torch.Tensor, weights: torch.Tensor | None = None, *,
                   deferred: bool = False) -> MeanHandle:
        """:meth:`mean`, started (``deferred``: a quorum carries it in its next round, at no round's cost)."""
        return self.control.start_mean(x, weights, deferred=deferred)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """All workers' rows (with a quorum a dead rank's row is the mean of the live ones: what it would take
        when it rejoins)."""
        return self.control.gather(x)

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (pickled, over gloo: every rank is there when a run resumes)."""
        return broadcast_object(value)

    def barrier(self) -> None:
        """Every live rank got here."""
        self.control.barrier()

    def transport_stats(self, before: dict[str, Any] | None = None) -> dict[str, Any]:
        """The run's datagram counters summed over the ranks (a collective), plus ``before`` (the same table
        from the run's checkpoint, when it was resumed), the observed loss rate 1 - received / expected, and
        what the control plane adds (with a quorum, the membership changes)."""
        names = list(self._totals)
        total = torch.stack(self.control.all_gather(torch.tensor([float(self._totals[k]) for k in names],
                                                                 dtype=torch.float64), fill=0)).sum(dim=0)
        t = dict(zip(names, (v if k.endswith("_s") else int(v) for k, v in zip(names, total.tolist())), strict=True))
        out: dict[str, Any] = {
            "datagrams_sent": t["sent"], "datagrams_received": t["received"], "datagrams_expected": t["expected"],
            "late": t["late"], "rejected": t["rejected"], "phases_closed_by_deadline": t["closed_by_deadline"],
            "datagrams_repeated": t["repeated"], "grace_wait_s": round(t["grace_s"], 6)}
        for key, value in (before or {}).items():
            if key in out:
                out[key] += value if key.endswith("_s") else int(value)
        expected = out["datagrams_expected"]
        out["observed_loss"] = 1 - out["datagrams_received"] / expected if expected else 0.0
        return {**out, **self.control.stats(before)}


def _most_served(servers: torch.Tensor | None, num_workers: int) -> int:
    """The most blocks one rank serves (1 with the default servers; 2 for a dead rank's successor): the columns
    of every rank's ``up_obs`` in its masks record."""
    if servers is None:
        return 1
    return int(torch.bincount(servers.to(torch.int64), minlength=num_workers).max())


class Wiring(NamedTuple):
    """What a control plane is built with, besides its comm (:class:`UdpDistComm`'s ``control``)."""

    key: bytes
    """The run's udp key (the quorum seals its records with it)."""
    run_id: int
    host: str
    """This rank's address (rank 0's is where the quorum's store listens)."""
    ports: range
    lanes: int
    latency_s: list[float] | None
    joining: bool


def gloo_control(comm: UdpDistComm, wiring: Wiring) -> ControlPlane:
    """The control plane on gloo's collectives: a dead rank stops every rank."""
    if wiring.joining:
        raise ValueError("a rank started again can join only with live membership (dist.heartbeat_timeout_s)")
    return GlooControl(comm)


def quorum_control(heartbeat: Heartbeat, timeout_s: float) -> Callable[[UdpDistComm, Wiring], ControlPlane]:
    """The control plane of live membership: ``heartbeat`` (this rank's, not started) beats in the quorum's store,
    and a rank silent for ``timeout_s`` is left out."""
    def build(comm: UdpDistComm, wiring: Wiring) -> ControlPlane:
        return QuorumControl(comm, heartbeat, timeout_s, key=wiring.key, run_id=wiring.run_id, host=wiring.host,
                             ports=wiring.ports, lanes=wiring.lanes, latency_s=wiring.latency_s,
                             joining=wiring.joining)
    return build


FIRST_DEADLINE_S = 1.0
FIRST_DEADLINE_S_PER_MB = 0.1


def first_deadline_s(row_bytes: int) -> float:
    """The adaptive deadline's first round, which has no earlier rounds to learn from: 1 s plus 0.1 s per MB
    of the row (a 1e7-value float32 row: 5 s), so that a large model's first phases are not closed while
    most of their datagrams are still on the way. A phase that completes does not wait for it."""
    return FIRST_DEADLINE_S + FIRST_DEADLINE_S_PER_MB * row_bytes / 1e6


def udp_comm(settings: DistConfig, *, heartbeat: Heartbeat | None = None, lanes: int = 1,
             latency_ms: Sequence[Sequence[float]] | None = None, joining: JoinStore | None = None,
             key_text: str | None = None, master_addr: str = "127.0.0.1") -> UdpDistComm:
    """The udp transport's comm for the ``[dist]`` settings, built by every rank together (a collective):
    ``shaky train --transport udp`` and ``RPSAverager(transport="udp")`` both start it here. A key file that
    one rank cannot read, a rank with no free port or keys that differ raise the same ValueError on every rank.

    ``heartbeat``: this rank's (:class:`~shaky.membership.heartbeat.Heartbeat`, not started): live membership,
    a :class:`QuorumControl` whose rounds leave out a rank silent for ``settings.heartbeat_timeout_s``; None: the
    control plane is gloo's, and a dead rank stops every rank. ``lanes``: exchanges in flight at once
    (:class:`UdpDistComm`; more than :data:`MAX_LANES` are capped, the rest queue). ``latency_ms``: the network
    model's [W, W] one-way latencies, emulated where ``settings.emulate_latency`` (required then). ``joining``: a
    process started again for a dead rank (``shaky.job.rendezvous.run_in_progress``), built alone (it reads the
    others' addresses and asks to be taken back). ``key_text``: ``$SHAKY_KEY`` (:func:`load_key`);
    ``master_addr``: MASTER_ADDR (:func:`local_address`), both as the caller read them from the environment."""
    options = UdpOptions(datagram_bytes=settings.datagram_bytes, send_rate_mbps=settings.send_rate_mbps or None)
    latency_s = None
    if settings.emulate_latency:
        if latency_ms is None:
            raise ValueError("dist.emulate_latency needs the network's latencies (network.latency_ms)")
        latency_s = [float(v) / 1e3 for v in latency_ms[dist.get_rank() if joining is None else joining.rank]]
    comm = UdpDistComm(deadline_ms=None if settings.deadline_ms == "adaptive" else float(settings.deadline_ms),
                       key=(agreed_key(settings.key_file, key_text) if joining is None
                            else load_key(settings.key_file, key_text)),
                       ports=settings.port_range(), host=settings.host or None, options=options,
                       lanes=min(max(1, lanes), MAX_LANES), latency_s=latency_s, joining=joining,
                       master_addr=master_addr,
                       control=None if heartbeat is None else quorum_control(heartbeat, settings.heartbeat_timeout_s))
    warning = python_path_warning(options)
    if warning and comm.rank == 0:
        say(f"shaky: warning: {warning}")
    return comm
