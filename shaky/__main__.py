"""``python -m shaky`` is the ``shaky`` command (torchrun can start it with ``-m shaky``)."""

import sys

try:
    from shaky.cli import main
except KeyboardInterrupt:  # Ctrl-C while Python is still starting: one line, as everywhere else
    print("shaky: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
