"""``python -m contrail``: the ``contrail`` command (see `contrail.cli`)."""

import sys

from contrail.cli import main

sys.exit(main())
