"""Runs a command inside the private network namespace this process was started in (``unshare --net``).

    unshare --net python tests/netns.py [--loss P] [--proto udp] [--also CMD_JSON] -- COMMAND...

Brings the namespace's loopback up with a 1500-byte MTU and GSO segments of one datagram (``gso_max_segs 1``:
the kernel cuts a UDP_SEGMENT batch into datagrams before the device, so the rule below drops datagrams one by
one, as on a real link, instead of a whole batch), drops a fraction P of the incoming ``--proto`` packets with
an iptables ``statistic`` rule, starts each ``--also`` command (a JSON list of arguments) in the background,
runs COMMAND, stops the background commands with SIGTERM and exits with COMMAND's status. Nothing here can
reach any address but the namespace's own loopback.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--loss", type=float, default=0.0)
    parser.add_argument("--proto", default="udp")
    parser.add_argument("--also", action="append", default=[])
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    subprocess.run(["ip", "link", "set", "dev", "lo", "up", "mtu", "1500"], check=True)
    subprocess.run(["ip", "link", "set", "dev", "lo", "gso_max_segs", "1"], check=True)
    if args.loss > 0:
        subprocess.run(["iptables", "-A", "INPUT", "-i", "lo", "-p", args.proto, "-m", "statistic", "--mode",
                        "random", "--probability", str(args.loss), "-j", "DROP"], check=True)
    background = [subprocess.Popen(json.loads(cmd)) for cmd in args.also]
    try:
        return subprocess.run(command).returncode
    finally:
        for proc in background:
            proc.terminate()
        for proc in background:
            proc.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
