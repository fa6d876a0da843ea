"""shaky: distributed training over bad networks.

The public API: train your own model on your own data with ``simulate``; build a
config, prepare and train a run in the simulator, run a sweep and report on it,
compose a strategy from stages, or average your own model across
torch.distributed ranks with ``RPSAverager`` / ``ModelAverager`` (DiLoCo with
``outer_optimizer=OuterSGD(...)``).

Importing shaky changes nothing in the process (no environment variable, thread
count or allocator setting; the command line makes those), and loads torch only
when a name that needs it is first used.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ModelAverager": "shaky.averager", "RPSAverager": "shaky.averager", "init_process_group": "shaky.averager",
    "SimComm": "shaky.comm.sim",
    "NetworkConfig": "shaky.config", "RunConfig": "shaky.config", "config_from_dict": "shaky.config",
    "load_toml": "shaky.config",
    "FaultInjector": "shaky.inject",
    "LinkSample": "shaky.geometry", "NetworkModel": "shaky.network.model",
    "Membership": "shaky.network.faults",
    "Clock": "shaky.network.clock",
    "Schedule": "shaky.schedule",
    "scalability": "shaky.scale",
    "OuterSGD": "shaky.strategies", "Strategy": "shaky.strategies", "build_strategy": "shaky.strategies",
    "AverageGradients": "shaky.strategies", "AverageModels": "shaky.strategies", "AverageUpdates": "shaky.strategies",
    "delayed": "shaky.strategies", "every": "shaky.strategies", "outer": "shaky.strategies",
    "lossy_block_average": "shaky.strategies", "reliable_mean": "shaky.strategies",
    "load_sweep": "shaky.sweep", "run_sweeps": "shaky.sweep",
    "prepare": "shaky.setup", "read_metrics": "shaky.rundir", "train": "shaky.train", "simulate": "shaky.api",
    "write_report": "shaky.report",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name == "__version__":   # the installed package's, as `shaky --version` prints it
        return importlib.import_module("shaky.rundir").versions()["shaky"]
    if name not in _EXPORTS:
        raise AttributeError(f"module 'shaky' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
