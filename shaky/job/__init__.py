"""A rank's life: the process environment read once (:mod:`~shaky.job.env`), the rendezvous
(:mod:`~shaky.job.rendezvous`), a dist rank's start, rejoin and stop (:mod:`~shaky.job.rank`), the checks that every
rank runs the same config on the same data (:mod:`~shaky.job.checks`), a resumed run's config handed out by rank 0
(:mod:`~shaky.job.resume`) and the lines of a run that stops (:mod:`~shaky.job.stop`).

Nothing is imported here: :mod:`shaky.job.env` loads no torch (the command line reads it for every command), the
rest does."""
