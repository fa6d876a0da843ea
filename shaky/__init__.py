"""shaky: distributed training over bad networks.

The public API: build a config, prepare and train a run in the simulator, or
average your own model across torch.distributed ranks with ``RPSAverager``.
"""

from shaky.averager import ModelAverager, RPSAverager
from shaky.comm.sim import SimComm
from shaky.config import NetworkConfig, RunConfig, config_from_dict, load_toml
from shaky.network.model import LinkSample, NetworkModel
from shaky.network.clock import Clock
from shaky.scale import scalability
from shaky.strategies import Strategy, build_strategy
from shaky.train import prepare, read_metrics, train

__all__ = [
    "Clock", "LinkSample", "ModelAverager", "NetworkConfig", "NetworkModel", "RPSAverager", "RunConfig", "SimComm",
    "Strategy", "build_strategy", "config_from_dict", "load_toml", "prepare", "read_metrics", "scalability",
    "train",
]
