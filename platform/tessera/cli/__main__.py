"""``python -m tessera.cli``: the ``tessera`` command, for subprocesses that must use this interpreter."""

import sys

from tessera.cli import main

sys.exit(main())
