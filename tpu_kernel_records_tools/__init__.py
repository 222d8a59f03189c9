"""The tools of tpu-kernel-records: everything that is not shipped kernel source or the loading script.

One package, rooms by job; imports point down only (``cli`` at the top, ``records`` at the bottom):

* ``records``: raw-run I/O, the release schemas (``records.schema``: every name and version, declared
  once) and the secret scanner.
* ``grading``: the correctness rubric (a worker process per candidate, the float64 oracle, the
  tolerance policy, the checks and the grader-power sweep).
* ``bench``: synchronized timing, statistics, benchmark cases and the deviceless TPU v5e plan.
* ``measure``: the measure job (environment capture, one raw run folder).
* ``builder``: accepted runs -> Hub configs under ``data/``, ``verify``, ``publish``.
* ``cli``: the ``tpu-kernel-records`` and ``tpu-kernel-rubric`` commands.
* ``kaggle_runner``: the standalone Kaggle TPU script and its metadata.

The Pallas kernels and the pure-JAX oracle live beside this package in ``kernel_src``; the Hub
loading script is the top-level module ``tpu_kernel_records``.
"""

from .records.schema import VERSION as __version__

__all__ = ["__version__"]
