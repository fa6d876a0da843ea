"""Named networks. A preset fills network settings; fields the user sets beside it win."""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # One data-centre rack: nothing is lost, 50 us one way, 10 Gbit/s.
    "lan": {"drop_rate": 0.0, "latency_ms": 0.05, "bandwidth_mbps": 10000.0},
    # The RPS paper's setting: a shared network where 10% of messages are lost,
    # 0.5 ms one way, 1 Gbit/s.
    "lossy": {"drop_rate": 0.1, "latency_ms": 0.5, "bandwidth_mbps": 1000.0},
}
