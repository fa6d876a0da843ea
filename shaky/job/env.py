"""The process environment, read once: what torchrun or ``shaky launch`` (and a user) set for a rank.

The command line builds a :class:`JobEnv` when it starts (:meth:`JobEnv.from_environ`) and passes it down; nothing
below it reads the process environment. No torch here (``shaky --version`` and ``shaky launch`` read it too)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from shaky.inject import ENV_VAR as FAULT_ENV
from shaky.launch import KEY_ENV, LAUNCHED_BY, MAX_RESTARTS_ENV, RUN_FILE_ENV  # no torch


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class JobEnv:
    """The variables shaky reads, each as the environment holds it (None: unset), so that "unset" and "set" keep
    their meanings."""

    rank: str | None = None
    """RANK: this process's rank in a torchrun-style job."""
    world_size: str | None = None
    """WORLD_SIZE: the job's ranks."""
    local_rank: str | None = None
    """LOCAL_RANK: its place among this machine's ranks (a GPU rank's device)."""
    master_addr: str | None = None
    """MASTER_ADDR: rank 0's machine, which hosts the rendezvous store."""
    master_port: str | None = None
    """MASTER_PORT: the rendezvous store's port."""
    group_rank: str | None = None
    """GROUP_RANK: this machine's place in the job (torchrun's and shaky launch's)."""
    restart_count: str = "0"
    """TORCHELASTIC_RESTART_COUNT: the times torchrun started its workers again (its store outlives an attempt)."""
    torchelastic_run_id: str | None = None
    """TORCHELASTIC_RUN_ID: set under torchrun (which stops every rank when the first one exits)."""
    key: str | None = None
    """SHAKY_KEY: the udp key material when ``dist.key_file`` is not given."""
    inject_fault: str = ""
    """SHAKY_INJECT_FAULT: faults to inject (:class:`shaky.inject.FaultInjector`; tests start processes with it)."""
    launched_by: str | None = None
    """SHAKY_LAUNCHED_BY: shaky launch's command line up to ``train`` (the lines that say how to resume quote it)."""
    max_restarts: str | None = None
    """SHAKY_LAUNCH_MAX_RESTARTS: this rank's launcher's --max-restarts (None: not started by shaky launch)."""
    run_file: str | None = None
    """SHAKY_LAUNCH_RUN_FILE: where this rank tells its launcher the run's directory (``shaky.launch.tell_launcher``)."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> JobEnv:
        """The variables in ``environ`` (``os.environ``)."""
        return cls(rank=environ.get("RANK"), world_size=environ.get("WORLD_SIZE"),
                   local_rank=environ.get("LOCAL_RANK"), master_addr=environ.get("MASTER_ADDR"),
                   master_port=environ.get("MASTER_PORT"), group_rank=environ.get("GROUP_RANK"),
                   restart_count=environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
                   torchelastic_run_id=environ.get("TORCHELASTIC_RUN_ID"), key=environ.get(KEY_ENV),
                   inject_fault=environ.get(FAULT_ENV, ""), launched_by=environ.get(LAUNCHED_BY),
                   max_restarts=environ.get(MAX_RESTARTS_ENV), run_file=environ.get(RUN_FILE_ENV))

    @property
    def job_rank(self) -> int | None:
        """This process's rank in a job that torchrun or shaky launch started (RANK and MASTER_PORT set), else
        None."""
        if self.master_port is None or self.rank is None:
            return None
        try:
            return int(self.rank)
        except ValueError:
            return None

    @property
    def machine(self) -> str:
        """This machine's place in a job (GROUP_RANK; "0": rank 0's, or no job)."""
        return "0" if self.group_rank is None else self.group_rank

    @property
    def num_ranks(self) -> int:
        """WORLD_SIZE (1 where unset)."""
        return int("1" if self.world_size is None else self.world_size)

    @property
    def is_rank(self) -> bool:
        """Whether this process is one rank of a torch.distributed run (RANK or LOCAL_RANK set)."""
        return self.rank is not None or self.local_rank is not None

    @property
    def route_to(self) -> str:
        """MASTER_ADDR, where the udp transport finds this machine's address towards it (127.0.0.1 where unset)."""
        return "127.0.0.1" if self.master_addr is None else self.master_addr
