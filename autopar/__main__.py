"""``python -m autopar``: the ``autopar`` command."""

import sys

from autopar.frontend.cli import main

sys.exit(main())
