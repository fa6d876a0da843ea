"""``python -m shaky`` is the ``shaky`` command (torchrun can start it with ``-m shaky``)."""

import sys

from shaky.interrupt import exiting

with exiting():  # a signal while Python loads shaky ends the process at once, with one line
    from shaky.cli import main

sys.exit(main())
