"""The network as data: seeded delivery masks, presets and the simulated clock."""

from shaky.network.clock import Clock, PhaseTraffic
from shaky.network.model import LinkSample, NetworkModel, TraceNetwork, load_trace, pack_masks

__all__ = ["Clock", "LinkSample", "NetworkModel", "PhaseTraffic", "TraceNetwork", "load_trace", "pack_masks"]
