"""``python -m tpu_kernel_records_tools``: the same as the ``tpu-kernel-records`` console script."""

import sys

from .cli.main import main

sys.exit(main())
