"""The network as data: seeded delivery masks, presets and the simulated clock."""

from shaky.geometry import LinkSample
from shaky.network.clock import Clock, ClockState, PhaseTraffic, hiding_period, scalability
from shaky.network.model import NetworkModel, TraceNetwork, link_matrices, pack_masks
from shaky.network.presets import PRESETS, REGIONS, region_of_workers

__all__ = ["PRESETS", "REGIONS", "Clock", "ClockState", "LinkSample", "NetworkModel", "PhaseTraffic", "TraceNetwork",
           "hiding_period", "link_matrices", "pack_masks", "region_of_workers", "scalability"]
