"""``python -m shaky`` is the ``shaky`` command (torchrun can start it with ``-m shaky``)."""

import sys

from shaky.cli import main

sys.exit(main())
