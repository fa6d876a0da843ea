"""The run's store in a process of its own: the keeper, which outlives any rank, rank 0 included.

Where no torchrun agent hosts the rendezvous store (ranks started by hand, ``shaky launch``), torch would host it
in rank 0's process: rank 0's death would take with it every key the survivors need (the control rounds, the
heartbeats, the addresses, the record a process started again reads). Rank 0 instead binds MASTER_PORT, starts a
keeper on that socket (forked, or ``python -m shaky.job.keeper``: :func:`start`; in a session of its own, with
nothing of rank 0's open), and joins the store as a client, as every other rank does. The keeper serves the store (torch's TCPStore, the same
server) and nothing else: it averages nothing and holds no key, so it is no rank. The udp transport's control
rounds use the same store (``shaky.membership.quorum.ControlStore``), so any rank may die.

The keeper ends by itself: once the run has ended (the attempt's ``ended`` key) and every heartbeat has stopped,
or once no heartbeat has moved for :func:`quiet_s` (every rank is gone), or when nobody came within the start's
timeout. It lives on rank 0's machine: the death of that machine, not of a process, still ends the run.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

LOOK_S = 0.25
"""How often the keeper looks at the heartbeats and the ended key."""
ENDED_QUIET_S = 1.0
"""After the run ended, the keeper waits this long without any heartbeat moving (every rank has closed its
heartbeat, the last use of the store) before it goes."""

_hosted: tuple[str, int] | None = None
"""(MASTER_ADDR, MASTER_PORT) where this process started the keeper (None: it started none)."""


def _door(port: int) -> str:
    """The keeper's door: a Unix socket in the abstract namespace (Linux: gone with the process, no file) named
    by its port. A rank 0 started again knows by it that the process on MASTER_PORT is its run's keeper (a
    store client would wait forever for an answer from a program that is not a store), and tells a keeper of a
    run that is over to go (:func:`retire`)."""
    return f"\0shaky-keeper-{port}"


def quiet_s(heartbeat_timeout_s: float) -> float:
    """How long the keeper serves with no heartbeat moving before it takes every rank for gone."""
    return max(10.0, 4 * heartbeat_timeout_s)


def hosted() -> tuple[str, int] | None:
    """(MASTER_ADDR, MASTER_PORT) of the keeper this process started, or None."""
    return _hosted


def port_free(port: int) -> bool:
    """Whether this machine's ``port`` can be listened on now."""
    try:
        listen(port).close()
    except OSError:
        return False
    return True


def _knock(port: int, message: bytes = b"") -> bool:
    """Whether a keeper of ``port`` answers at its door on this machine (:func:`_door`), handing it
    ``message``."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as door:
            door.settimeout(2.0)
            door.connect(_door(port))
            door.sendall(message)
    except OSError:     # no keeper (or no abstract namespace: not Linux)
        return False
    return True


def found(host: str, port: int) -> object | None:
    """A client of the keeper serving ``port`` on this machine, or None: the port is free, or held by something
    else."""
    import torch.distributed as dist  # noqa: PLC0415

    if port_free(port) or not _knock(port):
        return None
    try:
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=5.0))
    except (RuntimeError, ValueError):      # it went meanwhile
        return None


def over(store: object, world: int) -> bool:
    """Whether the run of the keeper behind ``store`` is over: no rank's heartbeat moves for
    ``shaky.membership.heartbeat.BLIND_S`` (four beats)."""
    from shaky.membership.heartbeat import BLIND_S  # noqa: PLC0415

    beats = [f"shaky/beat/{r}" for r in range(world)]
    before = [int(store.add(k, 0)) for k in beats]      # type: ignore[attr-defined]
    time.sleep(BLIND_S)
    return before == [int(store.add(k, 0)) for k in beats]      # type: ignore[attr-defined]


def retire(port: int, timeout_s: float) -> None:
    """Tells the keeper of ``port`` to go, and waits at most ``timeout_s`` for the port to be free."""
    _knock(port, b"go")
    deadline = time.monotonic() + timeout_s
    while not port_free(port) and time.monotonic() < deadline:
        time.sleep(0.05)


def listen(port: int) -> socket.socket:
    """A TCP socket listening on ``port`` of every address of this machine (as torch's own store listens);
    OSError (EADDRINUSE) when the port is taken."""
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=1024)
    return socket.create_server(("", port), backlog=1024)


def start(host: str, port: int, *, world: int, ended_key: str, timeout_s: float, heartbeat_timeout_s: float) -> None:
    """Rank 0: binds ``port`` and starts the keeper on it (OSError where the port is taken: nothing started).
    ``ended_key``: set in the store when the run has ended (``shaky.job.rendezvous.Keys.ended``). Returns at
    once; a client that connects meanwhile waits in the socket's backlog.

    A process with one thread (rank 0 before it trains) forks the keeper, which then serves at once: a new
    Python would first spend seconds importing torch (3.7 s here), every rank waiting for it. The fork forks
    again and its child is the keeper (reparented, never rank 0's zombie), in a session of its own, with only
    the listening socket and /dev/null open. A process with more threads (a user's loop) starts
    ``python -m shaky.job.keeper`` instead: forking it would copy locks other threads hold."""
    global _hosted
    listener = listen(port)
    args = [str(listener.fileno()), str(port), str(world), ended_key, repr(float(timeout_s)),
            repr(quiet_s(heartbeat_timeout_s))]
    try:
        if threading.active_count() == 1 and hasattr(os, "fork"):
            _fork(listener.fileno(), args)
        else:
            subprocess.Popen([sys.executable, "-m", "shaky.job.keeper", *args], pass_fds=(listener.fileno(),),
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    finally:
        listener.close()    # the keeper holds it now
    _hosted = (host, port)


def _fork(fd: int, args: list[str]) -> None:
    """The keeper as this process's grandchild (see :func:`start`)."""
    child = os.fork()
    if child:
        os.waitpid(child, 0)    # the middle process ends at once
        return
    try:
        os.setsid()
        if os.fork():
            os._exit(0)
        null = os.open(os.devnull, os.O_RDWR)
        for std in (0, 1, 2):
            os.dup2(null, std)
        os.closerange(3, fd)
        os.closerange(fd + 1, _max_fd())
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        _name_process()
        main(args)
    finally:
        os._exit(0)


def _name_process() -> None:
    """``shaky-keeper`` in ps and top (Linux's PR_SET_NAME; a forked keeper otherwise shows rank 0's command)."""
    try:
        import ctypes  # noqa: PLC0415

        ctypes.CDLL(None, use_errno=True).prctl(15, b"shaky-keeper", 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _max_fd() -> int:
    try:
        return int(os.sysconf("SC_OPEN_MAX"))
    except (OSError, ValueError):
        return 65536


def serve(fd: int, port: int, world: int, ended: str, timeout_s: float, quiet: float) -> None:
    """The keeper's life (see the module): serves the store on the listening socket ``fd`` until the run is
    over."""
    import torch.distributed as dist  # noqa: PLC0415 (the keeper's own process)

    from shaky.membership.quorum import shorten_store_retransmits  # noqa: PLC0415

    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, master_listen_fd=fd,
                           timeout=timedelta(seconds=timeout_s))
    door: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        door.bind(_door(port))
        door.listen(16)
        door.settimeout(LOOK_S)
    except OSError:     # no abstract namespace (not Linux): a rank 0 started again cannot find this keeper
        door.close()
        door = None
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=max(timeout_s, 10.0)))
    shorten_store_retransmits(port)     # the listener (the connections it accepts inherit it), and its own client
    beats = [f"shaky/beat/{r}" for r in range(world)]
    started = moved = time.monotonic()
    last: list[int] | None = None
    ended_at: float | None = None
    while True:
        if _answer(door):
            break       # a rank 0 that starts a new run on the port
        now = time.monotonic()
        try:
            seen = [int(client.add(k, 0)) for k in beats]
            if ended_at is None and client.check([ended]):
                ended_at = now
        except RuntimeError:
            return
        if seen != last:
            last, moved = seen, now
        if ended_at is not None and now - max(moved, ended_at) >= ENDED_QUIET_S:
            break       # the run ended and every rank has closed its heartbeat
        if any(seen) and now - moved >= quiet:
            break       # every rank is gone
        if not any(seen) and now - started >= timeout_s + quiet:
            break       # nobody came
    del client, server


def _answer(door: socket.socket | None) -> bool:
    """Waits at most :data:`LOOK_S` at the door (None: it could not open); whether whoever came asked the
    keeper to go."""
    if door is None:
        time.sleep(LOOK_S)
        return False
    try:
        conn, _ = door.accept()
    except OSError:     # (the wait ran out)
        return False
    with conn:
        conn.settimeout(1.0)
        try:
            return conn.recv(8) == b"go"
        except OSError:
            return False


def main(argv: list[str] | None = None) -> None:
    """``python -m shaky.job.keeper FD PORT WORLD ENDED_KEY TIMEOUT_S QUIET_S`` (:func:`start` passes them)."""
    parser = argparse.ArgumentParser(prog="python -m shaky.job.keeper")
    parser.add_argument("fd", type=int)
    parser.add_argument("port", type=int)
    parser.add_argument("world", type=int)
    parser.add_argument("ended")
    parser.add_argument("timeout", type=float)
    parser.add_argument("quiet", type=float)
    a = parser.parse_args(argv)
    serve(a.fd, a.port, a.world, a.ended, a.timeout, a.quiet)


if __name__ == "__main__":
    main()
