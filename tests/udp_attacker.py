"""An attacker on the path of a udp run (tests only; run as root inside a private network namespace).

    python tests/udp_attacker.py FIRST_PORT LAST_PORT SECONDS COUNTS_JSON

It captures the run's datagrams with a raw socket (every UDP packet on the namespace's loopback) and, until
it has run SECONDS or gets SIGTERM, sends at every port of the range:
- random bytes, from its own socket;
- captured datagrams truncated, with a flipped tag bit, and from its own address (a stranger's copy);
- captured datagrams replayed verbatim from their real sender's address (spoofed with a raw IP socket),
  to the rank they were meant for, once right away and once a few rounds later.
Each kind is counted and the counts written to COUNTS_JSON at the end.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import socket
import struct
import sys
import time

HEADER_BYTES = 36


def udp_packet(src: tuple[str, int], dst: tuple[str, int], payload: bytes) -> bytes:
    """An IPv4 packet carrying ``payload`` from ``src`` to ``dst`` (UDP checksum 0: none, which IPv4 allows)."""
    udp = struct.pack("!HHHH", src[1], dst[1], 8 + len(payload), 0) + payload
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), random.getrandbits(16), 0, 64, socket.IPPROTO_UDP,
                     0, socket.inet_aton(src[0]), socket.inet_aton(dst[0]))
    return ip + udp    # the kernel fills in the IP checksum


def main() -> int:
    first, last, seconds, out = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    ports = range(first, last + 1)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    sniff = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP)
    spoof = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    mine = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    mine.bind(("127.0.0.1", 0))
    rng = random.Random(0)
    counts = {"random": 0, "truncated": 0, "forged_tag": 0, "wrong_address": 0, "replayed": 0}
    captured: list[tuple[tuple[str, int], tuple[str, int], bytes]] = []
    later: list[tuple[float, bytes, tuple[str, int]]] = []
    end = time.monotonic() + seconds
    next_burst = 0.0
    while not stop and time.monotonic() < end:
        ready, _, _ = select.select([sniff], [], [], 0.002)
        if ready:
            packet = sniff.recv(65535)
            ihl = (packet[0] & 0x0F) * 4
            sport, dport = struct.unpack("!HH", packet[ihl:ihl + 4])
            src, dst = socket.inet_ntoa(packet[12:16]), socket.inet_ntoa(packet[16:20])
            data = packet[ihl + 8:]
            # The run's datagrams: between ports of the range, starting with the magic; not our own copies.
            if sport in ports and dport in ports and data[:2] == b"SK" and len(data) > HEADER_BYTES + 16:
                if len(captured) < 200 and rng.random() < 0.05:
                    captured.append(((src, sport), (dst, dport), data))
                    later.append((time.monotonic() + 0.5, data, (src, sport)))
                    spoof.sendto(udp_packet((src, sport), (dst, dport), data), (dst, 0))
                    counts["replayed"] += 1
        now = time.monotonic()
        for due, data, src in [item for item in later if item[0] <= now]:
            later.remove((due, data, src))
            for port in ports:
                spoof.sendto(udp_packet(src, ("127.0.0.1", port), data), ("127.0.0.1", 0))
                counts["replayed"] += 1
        if now >= next_burst:          # a few hundred datagrams a second: not enough to crowd the buffers
            next_burst = now + 0.02
            for port in ports:
                target = ("127.0.0.1", port)
                mine.sendto(rng.randbytes(rng.randrange(1, 1500)), target)
                counts["random"] += 1
                if captured:
                    src, _, data = rng.choice(captured)
                    cut = data[:rng.randrange(1, len(data))]
                    spoof.sendto(udp_packet(src, target, cut), ("127.0.0.1", 0))
                    counts["truncated"] += 1
                    flipped = data[:-1] + bytes([data[-1] ^ 1])
                    spoof.sendto(udp_packet(src, target, flipped), ("127.0.0.1", 0))
                    counts["forged_tag"] += 1
                    mine.sendto(data, target)
                    counts["wrong_address"] += 1
    with open(out + ".tmp", "w") as f:
        json.dump(counts, f)
    os.replace(out + ".tmp", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
