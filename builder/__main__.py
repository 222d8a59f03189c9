"""``python -m builder build|verify|publish``: see ``builder.commands``."""

import sys

from .commands import main

sys.exit(main())
