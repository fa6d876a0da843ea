"""``python -m shaky`` is the ``shaky`` command (torchrun can start it with ``-m shaky``); :func:`entry` is also the
console script's."""

from __future__ import annotations

from typing import NoReturn


def entry() -> NoReturn:
    """The ``shaky`` process: a signal while Python loads shaky (torch, scikit-learn: seconds) or after the command
    is done ends it at once with one line (``shaky.interrupt.run_command``); the command itself stops as each of its
    phases says."""
    from shaky.interrupt import run_command

    def main() -> int:
        from shaky.cli import main as cli_main

        return cli_main()

    run_command(main)


if __name__ == "__main__":
    entry()
