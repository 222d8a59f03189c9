"""``python -m tpu_kernel_records_tools.cli``: the same as the ``tpu-kernel-records`` console script."""

import sys

from .main import main

sys.exit(main())
