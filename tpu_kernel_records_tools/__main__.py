"""``python -m tpu_kernel_records_tools``: the same as the ``tpu-kernel-records`` console script."""

from .cli.main import entry

entry()
