"""What the UDP data plane can get out of this machine: measured before shaky/comm/udp/ was written.

    .venv/bin/python benchmarks/udp_probe.py              # everything (a few minutes on 2 cores)
    .venv/bin/python benchmarks/udp_probe.py --only mac    # one part: mac, cpu, wire, exchange
    .venv/bin/python benchmarks/udp_probe.py --only exchange --sizes 1e6 1e7 --repeats 5 --profile

Four parts, each printing numbers measured in this run (the machine is noisy: compare within a run):

mac       microseconds per 1472-byte datagram for each keyed hash in the standard library (HMAC-SHA256
          by ``hmac.digest``, by ``hmac.HMAC.copy``, by hashlib with the pads precomputed; keyed
          BLAKE2b and BLAKE2s), shaky's tag (AES-256-GMAC: compiled, many datagrams a call, and Python's
          path, OpenSSL through ctypes), and the other per-datagram Python costs (struct, memoryview
          copies). ``benchmarks/tag_cost.c`` compares the tags OpenSSL offers in C.
wire      one sender process to one receiver process on 127.0.0.1, 1472-byte datagrams, for a fixed
          volume: (a) plain ``sendto`` / ``recvfrom_into`` into a preallocated buffer; (b) ``sendmsg``
          with ``UDP_SEGMENT`` (GSO, 44 datagrams a call) and a plain receiver (the kernel splits them
          on delivery); (c) GSO and ``UDP_GRO`` on the receiving socket (``recvmsg_into`` gets the
          batch whole, the cmsg says the segment size); (d) plain sends to a GRO receiver. Gbit/s of
          UDP payload that arrived and the fraction lost in the receive buffer. Python has no
          ``recvmmsg``/``sendmmsg``; GSO/GRO are the kernel's batching reachable from Python.
          (e) three senders bursting at one receiver with a small receive buffer, unpaced and
          paced by a token bucket: what pacing buys.
cpu       CPU per datagram in shaky/comm/udp/'s own code paths, without a network: packing a block,
          receiving a GRO batch (numpy checks and copies), receiving one datagram at a time, the tags alone.
exchange  4 processes on 127.0.0.1 (gloo as the control plane): one round of ``UdpExchange.block_average``
          (with GSO/GRO, and without: one datagram per system call) against today's gloo RPS
          (``DistComm.block_average``) and a gloo ``all_reduce``, interleaved,
          each between barriers, for each size (median of ``--repeats``); with ``--profile`` the CPU
          time of rank 0's udp rounds by function.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import math
import multiprocessing as mp
import os
import socket
import statistics
import struct
import sys
import time
import timeit
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SOL_UDP, UDP_SEGMENT, UDP_GRO = 17, 103, 104
DGRAM = 1472
GSO_BATCH = 44          # 44 * 1472 = 64768 bytes: under the 65507-byte limit of one UDP send
END = b"end"


def _us(fn, number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def probe_mac() -> None:
    key = os.urandom(32)
    msg = memoryview(bytearray(os.urandom(DGRAM - 16)))
    n = 50_000
    ipad = hashlib.sha256(bytes(b ^ 0x36 for b in key.ljust(64, b"\0")))
    opad = hashlib.sha256(bytes(b ^ 0x5C for b in key.ljust(64, b"\0")))
    h_obj = hmac.new(key, digestmod="sha256")
    b2b = hashlib.blake2b(key=key, digest_size=16)
    b2s = hashlib.blake2s(key=key, digest_size=16)

    def pads() -> bytes:
        inner = ipad.copy()
        inner.update(msg)
        outer = opad.copy()
        outer.update(inner.digest())
        return outer.digest()

    def blake(state=b2b) -> bytes:
        h = state.copy()
        h.update(msg)
        return h.digest()

    def hmac_copy() -> bytes:
        h = h_obj.copy()
        h.update(msg)
        return h.digest()

    assert pads() == hmac.digest(key, msg, "sha256")
    rows = {
        "hmac.digest(key, msg, 'sha256')": lambda: hmac.digest(key, msg, "sha256"),
        "hmac.new(...).copy() + update + digest": hmac_copy,
        "HMAC-SHA256, hashlib pads precomputed": pads,
        "blake2b(msg, key=key, digest_size=16)": lambda: hashlib.blake2b(msg, key=key, digest_size=16).digest(),
        "blake2b keyed state .copy() + update": blake,
        "blake2s keyed state .copy() + update": lambda: blake(b2s),
        "sha256(msg), no key (the hash alone)": lambda: hashlib.sha256(msg).digest(),
    }
    print(f"mac: microseconds per {DGRAM}-byte datagram (best of 5 x {n})")
    for name, fn in rows.items():
        print(f"  {name:42s} {_us(fn, n):6.2f}")
    from shaky.comm.udp.wire import HEADER, _Mac  # noqa: PLC0415
    from shaky.native import FASTPATH  # noqa: PLC0415

    batch = 64
    rows_buf = bytearray(os.urandom(DGRAM * batch))
    for k in range(batch):
        rows_buf[k * DGRAM:k * DGRAM + HEADER.size] = HEADER.pack(b"SK", 2, 1, 2, 0, 1, 7, 3, 0, k, DGRAM - 52)
    view = memoryview(rows_buf)
    one = bytes(view[:DGRAM - 16])
    if FASTPATH is not None:
        compiled = _Mac(key, compiled=True)
        per = _us(lambda: compiled.tags(view, range(0, DGRAM * batch, DGRAM), DGRAM - 16), n // batch) / batch
        print(f"  {'AES-256-GMAC, compiled, 64 a call (shaky)':42s} {per:6.2f}")
    python_path = _Mac(key)
    print(f"  {'AES-256-GMAC, Python path (EVP via ctypes)':42s} {_us(lambda: python_path.tag(one), n // 10):6.2f}")
    hdr = struct.Struct("<2sBBBBHQQIII")
    buf = bytearray(2048)
    dst = memoryview(bytearray(1 << 20))
    src = memoryview(buf)[36:36 + 1420]
    print(f"  {'struct unpack_from (36-byte header)':42s} {_us(lambda: hdr.unpack_from(buf, 0), n):6.2f}")

    def copy() -> None:
        dst[4096:4096 + 1420] = src
    print(f"  {'memoryview slice copy (1420 bytes)':42s} {_us(copy, n):6.2f}")
    print(f"  {'hmac.compare_digest (16 bytes)':42s} {_us(lambda: hmac.compare_digest(b'x' * 16, b'x' * 16), n):6.2f}")


# ---------------------------------------------------------------------------------------------- wire

def _receiver(port_q, result_q, gro: bool, rcvbuf: int, expect_senders: int) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    try:
        sock.setsockopt(socket.SOL_SOCKET, 33, rcvbuf)  # SO_RCVBUFFORCE: past rmem_max where allowed
    except OSError:
        pass
    if gro:
        sock.setsockopt(SOL_UDP, UDP_GRO, 1)
    sock.bind(("127.0.0.1", 0))
    port_q.put(sock.getsockname()[1])
    buf = bytearray(1 << 17)
    mv = memoryview(buf)
    sock.settimeout(5.0)
    nbytes = ndgrams = calls = 0
    ends = 0
    t_first = t_last = 0.0
    anc = socket.CMSG_SPACE(4)
    while ends < expect_senders:
        try:
            if gro:
                n, ancdata, _flags, _addr = sock.recvmsg_into([mv], anc)
            else:
                n, _addr = sock.recvfrom_into(mv)
                ancdata = ()
        except TimeoutError:
            break
        if n <= 8 and bytes(mv[:3]) == END:
            ends += 1
            continue
        if not calls:
            t_first = time.perf_counter()
        t_last = time.perf_counter()
        calls += 1
        seg = n
        for level, kind, data in ancdata:
            if level == SOL_UDP and kind == UDP_GRO:
                seg = struct.unpack("i", data[:4])[0]
        nbytes += n
        ndgrams += -(-n // seg)
    result_q.put((nbytes, ndgrams, calls, t_last - t_first, sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)))


def _sender(port: int, total: int, gso: bool, rate_gbps: float | None, start_at: float) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
    addr = ("127.0.0.1", port)
    payload = memoryview(bytearray(os.urandom(DGRAM * GSO_BATCH)))
    cmsg = [(SOL_UDP, UDP_SEGMENT, struct.pack("H", DGRAM))]
    while time.time() < start_at:
        time.sleep(0.001)
    sent = 0
    t0 = time.perf_counter()
    while sent < total:
        if gso:
            sock.sendmsg([payload], cmsg, 0, addr)
            sent += GSO_BATCH
        else:
            for i in range(GSO_BATCH):
                sock.sendto(payload[i * DGRAM:(i + 1) * DGRAM], addr)
            sent += GSO_BATCH
        if rate_gbps is not None:   # token bucket with a burst of one batch
            ahead = sent * DGRAM * 8 / (rate_gbps * 1e9) - (time.perf_counter() - t0)
            if ahead > 0:
                time.sleep(ahead)
    time.sleep(0.05)
    for _ in range(20):
        sock.sendto(END, addr)
        time.sleep(0.001)


def _wire(ctx, *, senders: int, gso: bool, gro: bool, total: int, rcvbuf: int = 32 << 20,
          rate_gbps: float | None = None) -> tuple[float, float, float]:
    port_q, result_q = ctx.Queue(), ctx.Queue()
    rx = ctx.Process(target=_receiver, args=(port_q, result_q, gro, rcvbuf, senders))
    rx.start()
    port = port_q.get(timeout=30)
    start_at = time.time() + 0.3
    txs = [ctx.Process(target=_sender, args=(port, total, gso, rate_gbps, start_at)) for _ in range(senders)]
    for p in txs:
        p.start()
    for p in txs:
        p.join(60)
    nbytes, ndgrams, calls, seconds, granted = result_q.get(timeout=60)
    rx.join(10)
    sent = senders * (-(-total // GSO_BATCH) * GSO_BATCH)
    return nbytes * 8 / max(seconds, 1e-9) / 1e9, 1 - ndgrams / sent, ndgrams / max(calls, 1)


def probe_wire(total: int) -> None:
    ctx = mp.get_context("spawn")
    print(f"wire: 1 sender -> 1 receiver process, {total} datagrams of {DGRAM} bytes, 127.0.0.1")
    cases = [("a plain sendto / recvfrom_into", False, False), ("b GSO sendmsg / plain recv", True, False),
             ("c GSO sendmsg / GRO recvmsg_into", True, True), ("d plain sendto / GRO recvmsg_into", False, True)]
    for name, gso, gro in cases:
        gbps, lost, per_call = _wire(ctx, senders=1, gso=gso, gro=gro, total=total)
        print(f"  {name:36s} {gbps:6.2f} Gbit/s  lost {lost:6.1%}  datagrams per recv {per_call:5.1f}")
    small = 1 << 20
    print(f"wire: 3 senders -> 1 receiver with a {small >> 20} MiB receive buffer (GSO+GRO), "
          f"{total // 4} datagrams each")
    for rate in (None, 4.0, 1.0):
        gbps, lost, _ = _wire(ctx, senders=3, gso=True, gro=True, total=total // 4, rcvbuf=small, rate_gbps=rate)
        label = "unpaced" if rate is None else f"paced {rate:.0f} Gbit/s each"
        print(f"  e {label:34s} {gbps:6.2f} Gbit/s  lost {lost:6.1%}")


# ----------------------------------------------------------------------------------------------- cpu

def probe_cpu() -> None:
    """Where a rank's CPU goes per datagram, in the module's own code paths, without a network: packing a block
    (headers, copies, tags), a GRO batch checked and copied (``_fast_batch``), the same datagrams one by one
    (``_on_datagram``, the path of single datagrams and of anything unusual), and the tags alone."""
    import torch  # noqa: PLC0415

    from shaky.comm.udp.exchange import UdpExchange, _Counters, _Round  # noqa: PLC0415
    from shaky.comm.udp.sockets import _batches  # noqa: PLC0415
    from shaky.comm.udp.wire import TAG_BYTES  # noqa: PLC0415

    key = os.urandom(32)
    world = 2
    exs = [UdpExchange(rank=r, num_workers=world, key=key, run_id=1, host="127.0.0.1", ports=range(32000, 32999))
           for r in range(world)]
    for ex in exs:
        ex.connect([e.address for e in exs])
    sender, receiver = exs[1], exs[0]
    size = 2 * 355 * 44 * 50          # rank 0's block: 50 GRO batches of 44 float32 segments
    row = torch.randn(size)
    x = row.numpy()
    res = np.empty_like(x)
    state = _Round(1, 1, x, res, [0, 1], None, 0, world, sender.segment_bytes, recv=receiver._recv_buffers)
    block = x[:state.sizes[0]]
    packed = sender._pack(("probe", 0), 1, 0, state, block)
    n_dgrams = packed.count
    batches = [(a * packed.size, (a + c - 1) * packed.size + packed.length(a + c - 1)) for a, c, _ in _batches(
        packed.count, sender._max_gso)]
    addr = sender.address

    def reset() -> None:
        receiver._cur = _Round(1, 1, x, res, [0, 1], None, 0, world, sender.segment_bytes,
                               recv=receiver._recv_buffers)
        receiver._st = _Counters()

    def cpu(fn, repeat: int = 5) -> float:
        best = math.inf
        for _ in range(repeat):
            reset()
            t0 = time.process_time()
            fn()
            best = min(best, time.process_time() - t0)
        return best / n_dgrams * 1e6

    def pack() -> None:
        sender._pack(("probe", 0), 1, 0, state, block)

    data = [bytes(packed.view[a:b]) for a, b in batches]

    def fast() -> None:
        for d in data:
            assert receiver._fast_batch(memoryview(d), len(d), packed.size, 1)

    def slow() -> None:
        for d in data:
            mv = memoryview(d)
            for o in range(0, len(d), packed.size):
                receiver._on_datagram(mv[o:o + packed.size], addr, 1)

    def tags() -> None:
        sender._mac.tags(packed.view, range(0, (packed.count - 1) * packed.size, packed.size),
                         packed.size - TAG_BYTES)

    print(f"cpu: CPU microseconds per datagram ({n_dgrams} datagrams of {packed.size} bytes, best of 5), "
          f"this process alone")
    for name, fn in (("pack a block (headers, copies, tags)", pack), ("receive: GRO batch of 44, _fast_batch", fast),
                     ("receive: one at a time, _on_datagram", slow), ("tags alone (AES-256-GMAC)", tags)):
        print(f"  {name:40s} {cpu(fn):6.2f}")
    for ex in exs:
        ex.close()


# ------------------------------------------------------------------------------------------ exchange

def _exchange_rank(rank: int, world: int, port: int, key: bytes, sizes: list[int], repeats: int,
                   profile: bool, out_q) -> None:
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    torch.set_num_threads(1)
    from shaky.comm.gloo import DistComm  # noqa: PLC0415
    from shaky.comm.udp import UdpExchange, UdpOptions  # noqa: PLC0415

    # gloo is the control plane here: addresses, barriers between rounds, and the baselines.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    ex = UdpExchange(rank=rank, num_workers=world, key=key, run_id=7, host="127.0.0.1", ports=range(30000, 30999))
    plain = UdpExchange(rank=rank, num_workers=world, key=key, run_id=8, host="127.0.0.1", ports=range(30000, 30999),
                        options=UdpOptions(offload=False))
    for e in (ex, plain):
        addresses: list = [None] * world
        dist.all_gather_object(addresses, e.address)
        e.connect(addresses)
    comm = DistComm()
    # CPU time, not wall time (the profile says where this rank works, not where it waits for the others),
    # summed per function at the granularity of a batch: cProfile's per-call cost would triple the tags'.
    cpu: dict[str, float] = {}
    gate = [False]          # only the GSO/GRO exchange's rounds are counted
    if profile and rank == 0:
        from shaky.comm.udp.exchange import _Round  # noqa: PLC0415
        from shaky.comm.udp.wire import _Mac  # noqa: PLC0415
        for cls, name in ((_Mac, "tags"), (_Mac, "tag"), (_Round, "average"),
                          (UdpExchange, "_pack"), (UdpExchange, "_fast_batch"), (UdpExchange, "_on_datagram"),
                          (UdpExchange, "_send_batch"), (UdpExchange, "_drain"), (UdpExchange, "block_average")):
            setattr(cls, name, _timed(getattr(cls, name), f"{cls.__name__.lstrip('_')}.{name}", cpu, gate))
    rounds = iter(range(1 << 30))
    results = {}
    for size in sizes:
        row = torch.randn(size, generator=torch.Generator().manual_seed(rank))
        every = torch.ones(world, world, dtype=torch.bool)
        reduced = row.clone()
        last: list = [None]

        def udp() -> None:
            gate[0] = True
            last[0] = ex.block_average(row, next(rounds), deadline_s=30.0)
            gate[0] = False

        fns = {"udp RPS": udp,
               "udp RPS, no GSO/GRO": lambda: plain.block_average(row, next(rounds), deadline_s=30.0),
               "gloo RPS (DistComm)": lambda: comm.block_average(row[None], every, every),
               "gloo all_reduce": lambda: dist.all_reduce(reduced)}
        times: dict[str, list[float]] = {k: [] for k in fns}
        for r in range(repeats + 1):          # the first round warms buffers and connections
            for name, fn in fns.items():
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                dist.barrier()
                if r:
                    times[name].append(time.perf_counter() - t0)
        _, up, down, stats = last[0]
        results[size] = ({k: statistics.median(v) for k, v in times.items()}, stats, bool(up.all() and down.all()),
                         {k: v / (repeats + 1) for k, v in cpu.items()})
        cpu.clear()
    out_q.put((rank, results, ex.info()))
    ex.close()
    plain.close()
    dist.destroy_process_group()


def probe_exchange(sizes: list[int], repeats: int, profile: bool, world: int = 4) -> None:
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    key = os.urandom(32)
    q = ctx.Queue()
    procs = [ctx.Process(target=_exchange_rank, args=(r, world, port, key, sizes, repeats, profile, q))
             for r in range(world)]
    for p in procs:
        p.start()
    got = sorted((q.get(timeout=900) for _ in procs), key=lambda g: g[0])
    for p in procs:
        p.join(30)
    print(f"exchange: {world} processes on 127.0.0.1 (one thread each), float32, median of {repeats} rounds, "
          f"each timed between gloo barriers, the four interleaved")
    print(f"  rank 0 socket: {got[0][2]}")
    for size in sizes:
        medians, st, complete, cpu = got[0][1][size]
        base = medians["gloo all_reduce"]
        print(f"  {size:.0e} values ({size * 4 / 1e6:.0f} MB a row):")
        for name, t in medians.items():
            print(f"    {name:22s} {t * 1e3:8.1f} ms  ({t / base:4.2f}x all_reduce)")
        print(f"    udp rank 0: phase 1 {st.phase1_s * 1e3:.1f} ms, averaging {st.average_s * 1e3:.1f} ms, phase 2 "
              f"{st.phase2_s * 1e3:.1f} ms; sent {st.sent}, received {st.received}, rejected {st.rejected}, "
              f"late {st.late}; every segment arrived on every rank: {all(g[1][size][2] for g in got)}")
        if cpu:
            total = cpu.pop("UdpExchange.block_average")
            print(f"    rank 0 CPU per udp round (GSO/GRO): {total * 1e3:.0f} ms, of which (nested: tags and tag inside "
                  "_pack and _fast_batch, _fast_batch inside _drain):")
            print("      " + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1])))


def _timed(fn, name: str, acc: dict[str, float], gate: list[bool]):
    def timed(*args, **kwargs):
        if not gate[0]:
            return fn(*args, **kwargs)
        t0 = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[name] = acc.get(name, 0.0) + time.process_time() - t0
    return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["mac", "wire", "cpu", "exchange"], action="append")
    parser.add_argument("--datagrams", type=int, default=200_000, help="per wire case")
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e6, 1e7])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    parts = args.only or ["mac", "wire", "cpu", "exchange"]
    if "mac" in parts:
        probe_mac()
    if "wire" in parts:
        probe_wire(args.datagrams)
    if "cpu" in parts:
        probe_cpu()
    if "exchange" in parts:
        probe_exchange([int(s) for s in args.sizes], args.repeats, args.profile)


if __name__ == "__main__":
    main()
