"""Seeds of the slow full-level grades: seed 0 in every slow run (CI's included), seeds 1 and 2 only
with ``TPU_KERNEL_RECORDS_ALL_SEEDS=1`` (an interpreted kernel's full-level card takes one to two minutes
on 2 cores, and CI's 90 minutes hold the slow run under two versions of JAX; docs/DEVELOPING.md)."""

import os

import pytest

ALL_SEEDS = os.environ.get("TPU_KERNEL_RECORDS_ALL_SEEDS") == "1"
_LATER = pytest.mark.skipif(not ALL_SEEDS, reason="seeds 1 and 2 of an interpreted kernel's full-level grade: "
                                                  "set TPU_KERNEL_RECORDS_ALL_SEEDS=1")


def full_level_seeds() -> list:
    """``[0, 1, 2]`` as pytest parameters, 1 and 2 skipped unless ``TPU_KERNEL_RECORDS_ALL_SEEDS=1``."""
    return [0, *(pytest.param(s, marks=_LATER) for s in (1, 2))]
