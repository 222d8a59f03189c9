"""Hostile: at import, patches the clock and the statistics a benchmark would use, then computes honestly."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import time

import numpy as np

time.perf_counter = lambda: 0.0
time.monotonic = lambda: 0.0
np.median = lambda *a, **k: 1e-9
try:
    from tpu_kernel_records_tools.bench import stats
    stats.summarize = lambda samples: {"median_ms": 1e-9}
except Exception:
    pass

from pure_jax import attention  # noqa: E402,F401
