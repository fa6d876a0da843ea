"""shaky: distributed training over bad networks.

The public API: build a config, prepare and train a run in the simulator, run a
sweep and report on it, or average your own model across torch.distributed ranks
with ``RPSAverager``.
"""

import os

# OpenMP threads that spin while they wait turn any other load on a small machine (a second
# run, a sweep's other process, torchrun's other ranks) into a 20-30x slowdown; sleeping
# waiters cost next to nothing when the machine is idle. It must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from shaky.averager import ModelAverager, RPSAverager  # noqa: E402
from shaky.comm.sim import SimComm  # noqa: E402
from shaky.config import NetworkConfig, RunConfig, config_from_dict, load_toml  # noqa: E402
from shaky.network.model import LinkSample, NetworkModel  # noqa: E402
from shaky.network.clock import Clock  # noqa: E402
from shaky.scale import scalability  # noqa: E402
from shaky.strategies import Strategy, build_strategy  # noqa: E402
from shaky.sweep import load_sweep, run_sweeps  # noqa: E402
from shaky.train import prepare, read_metrics, train  # noqa: E402
from shaky.report import write_report  # noqa: E402

__all__ = [
    "Clock", "LinkSample", "ModelAverager", "NetworkConfig", "NetworkModel", "RPSAverager", "RunConfig", "SimComm",
    "Strategy", "build_strategy", "config_from_dict", "load_sweep", "load_toml", "prepare", "read_metrics",
    "run_sweeps", "scalability", "train", "write_report",
]
