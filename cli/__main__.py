"""``python -m cli``: the same as the ``tpu-kernel-records`` console script."""

import sys

from cli.main import main

sys.exit(main())
