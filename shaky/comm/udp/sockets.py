"""The UDP data plane's sockets: binding, buffer sizes, segmentation offload (GSO/GRO), send batches, and the
delay line that emulates latency on one machine."""

from __future__ import annotations

import errno
import heapq
import select
import socket
import threading
import time

from shaky.comm.udp.wire import FINAL_DATAGRAMS

MAX_DATAGRAM_BYTES = 65507
"""The largest UDP payload over IPv4 (and the most one GSO send may carry)."""
MAX_GSO_SEGMENTS = 64

# Linux constants that Python's socket module does not name.
_SOL_UDP = 17
_UDP_SEGMENT = 103
_UDP_GRO = 104
_SO_SNDBUFFORCE = 32
_SO_RCVBUFFORCE = 33
_RECV_BUFFER = 1 << 16
_CMSG_SPACE = socket.CMSG_SPACE(4)
_MSG_TRUNC = int(socket.MSG_TRUNC)      # a plain int: the IntFlag's & costs microseconds per receive

RECV_BATCH = 64
"""Datagrams one ``recvmmsg`` call takes at most (the compiled path)."""


def _resolve(host: object, name: str) -> str:
    if not isinstance(host, str) or not host:
        raise ValueError(f"{name} must be a host name or IPv4 address, got {host!r}")
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(f"{name} {host!r} does not resolve to an IPv4 address ({exc})") from None


def bind_first_free(ip: str, ports: range, kind: socket.SocketKind = socket.SOCK_DGRAM) -> socket.socket:
    """A socket of ``kind`` (UDP, or TCP: SOCK_STREAM) bound on ``ip`` at the first free port of ``ports``.
    Raises OSError naming the range when none is free, or naming ``ip`` when it is not this machine's."""
    proto = "TCP" if kind == socket.SOCK_STREAM else "UDP"
    for port in ports:
        sock = socket.socket(socket.AF_INET, kind)
        if kind == socket.SOCK_STREAM:   # a port whose last connection is in TIME_WAIT is free to listen on
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((ip, port))
            return sock
        except OSError as exc:
            sock.close()
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                continue
            raise OSError(exc.errno, f"cannot bind {proto} on {ip}: {exc.strerror}") from None
    span = f"{ports.start}-{ports[-1]}" if ports.step == 1 else repr(ports)
    raise OSError(errno.EADDRINUSE, f"no free {proto} port on {ip} in ports {span} (all {len(ports)} in use)")


def _set_buffer(sock: socket.socket, opt: int, force: int, nbytes: int) -> int:
    """Asks for ``nbytes`` (past the sysctl cap where this process may) and returns what was granted."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, force, nbytes)
    except OSError:
        sock.setsockopt(socket.SOL_SOCKET, opt, nbytes)
    return sock.getsockopt(socket.SOL_SOCKET, opt) // 2   # Linux reports twice what it accounts as data


def _has_gso(sock: socket.socket) -> bool:
    try:
        sock.getsockopt(_SOL_UDP, _UDP_SEGMENT)
        return True
    except OSError:
        return False


def _batches(count: int, most: int) -> list[tuple[int, int, bool]]:
    """(first, count, one_by_one) batches of at most ``most`` rows; the last ``FINAL_DATAGRAMS`` rows go
    together, one datagram per send (``one_by_one``).

    The final datagrams leave in separate sends so that they are lost independently (a GSO batch can be
    lost whole: on loopback it crosses netfilter and qdiscs as one packet), and back to back so that the
    receiver, once it has one, need not wait long for the others."""
    body = max(0, count - FINAL_DATAGRAMS)
    out = [(a, min(most, body - a), False) for a in range(0, body, most)]
    return out + [(body, count - body, True)] if count > body else out


class DelayLine:
    """Latency emulation: each datagram handed over leaves its socket ``delay_s`` later, from a thread.

    Datagrams with the same delay leave in the order they were handed over, so a sender's stream to one
    receiver stays in order (the early close relies on it). A send that fails is a lost datagram.
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._heap: list[tuple[float, int, bytes, tuple[str, int]]] = []
        self._seq = 0
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="shaky-udp-delay", daemon=True)
        self._thread.start()

    def put(self, data: bytes, addr: tuple[str, int], delay_s: float) -> None:
        with self._cv:
            heapq.heappush(self._heap, (time.monotonic() + delay_s, self._seq, data, addr))
            self._seq += 1
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=1.0)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cv.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                if self._closed:
                    return
                now, due = time.monotonic(), []
                while self._heap and self._heap[0][0] <= now:
                    due.append(heapq.heappop(self._heap))
            for _due, _seq, data, addr in due:
                self._send(data, addr)

    def _send(self, data: bytes, addr: tuple[str, int]) -> None:
        for _ in range(1000):       # a full send buffer drains in microseconds; past that the datagram is lost
            try:
                self._sock.sendto(data, addr)
                return
            except (BlockingIOError, InterruptedError):
                select.select([], [self._sock], [], 0.001)
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:
                    return      # an ICMP error from an earlier datagram, or the socket closed: this one is lost
                time.sleep(0.0001)
