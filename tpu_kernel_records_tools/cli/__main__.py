"""``python -m tpu_kernel_records_tools.cli``: the same as the ``tpu-kernel-records`` console script."""

from .main import entry

entry()
