"""Named networks and the geographic regions they can spread workers over.

A preset fills network settings; fields the user sets beside it win. With
``regions`` set, workers are spread over the regions in contiguous blocks (see
``region_of_workers``): two workers in one region talk over the region's LAN
(``latency_ms``, ``bandwidth_mbps``), two in different regions over the WAN
(half the round trip below as one-way latency, ``wan_bandwidth_mbps``).
"""

from __future__ import annotations

from typing import Any

from shaky.geometry import block_sizes

REGION_RTT_MS: dict[frozenset[str], float] = {
    # Average ping round trip between EC2 instances over VPC peering, in ms, from
    # R. Imaoka, "Using ping to test AWS VPC network latency across different regions",
    # 2019-06-10 (github.com/richardimaoka/blog-en, posts/network-latency-analysis-with-ping-aws-cross-region.md;
    # measurement code github.com/richardimaoka/aws-ping). Oregon = us-west-2, Ohio = us-east-2,
    # London = eu-west-2, Tokyo = ap-northeast-1.
    frozenset(("oregon", "ohio")): 68.087,
    frozenset(("oregon", "london")): 137.377,
    frozenset(("oregon", "tokyo")): 99.467,
    frozenset(("ohio", "london")): 86.559,
    frozenset(("ohio", "tokyo")): 158.274,
    frozenset(("london", "tokyo")): 215.736,
}
REGIONS: tuple[str, ...] = ("oregon", "ohio", "london", "tokyo")
"""Regions with a measured round trip to every other one."""

_LAN: dict[str, Any] = {"drop_rate": 0.0, "latency_ms": 0.05, "bandwidth_mbps": 10000.0}

PRESETS: dict[str, dict[str, Any]] = {
    # One data-centre rack: nothing is lost, 50 us one way, 10 Gbit/s.
    "lan": dict(_LAN),
    # The RPS paper's setting: a shared network where 10% of messages are lost,
    # 0.5 ms one way, 1 Gbit/s.
    "lossy": {"drop_rate": 0.1, "latency_ms": 0.5, "bandwidth_mbps": 1000.0},
    # The DTS paper's four sites (Zhu et al., "Distributed Training Across the World"):
    # a lan rack in each region, 100 Mbit/s between regions, measured round trips above.
    "geo4": {**_LAN, "regions": list(REGIONS), "wan_bandwidth_mbps": 100.0},
}


def region_of_workers(num_regions: int, num_workers: int) -> list[int]:
    """The region index of each worker: contiguous blocks as equal as possible, larger blocks first.

    32 workers over 4 regions: workers 0-7 in the first region, 8-15 in the second, ...;
    10 workers: 3, 3, 2, 2. Adjacent workers share a region, so a ring all-reduce in
    worker order crosses each region boundary once.
    """
    return [r for r, n in enumerate(block_sizes(num_workers, num_regions)) for _ in range(n)]


def region_rtt_ms(a: str, b: str) -> float:
    """The measured round trip between two different regions, in ms."""
    return REGION_RTT_MS[frozenset((a, b))]
