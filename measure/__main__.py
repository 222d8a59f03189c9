"""``python -m measure``: the same as the ``tpu-kernel-records`` console script."""

import sys

from measure.cli import main

sys.exit(main())
