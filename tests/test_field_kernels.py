"""The field's own attention kernels graded as correct candidates: a false reject of a kernel the field
relies on is a grader bug.

Through small adapters (``tests/field_adapters.py``: layout, masks as the kernel's own mask or segment
ids, head repetition, the contract's zeros for rows without keys; never the numerics): XLA's
``jax.nn.dot_product_attention`` (``implementation="xla"``, native grouped heads), and the Pallas TPU
flash attention and splash attention of ``jax.experimental.pallas.ops.tpu`` in TPU interpret mode on
the CPU. Graded by the rubric at its quick level.

The two Pallas TPU kernels run the TPU interpreter (a Python loop over every grid step and DMA), which
makes a rubric grade take many minutes on a 2-core machine, too long for ``.ci/run``: they are graded
when ``TPU_KERNEL_RECORDS_SLOW_TESTS=1`` is set, and skipped otherwise with that reason.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import jax
import pytest

from grading.rubric import grade

ADAPTERS = Path(__file__).with_name("field_adapters.py")
QUICK = {"level": "quick"} if "level" in inspect.signature(grade).parameters else {}
SLOW = pytest.mark.skipif(os.environ.get("TPU_KERNEL_RECORDS_SLOW_TESTS") != "1",
                          reason="a Pallas TPU kernel in TPU interpret mode takes many minutes to grade on 2 cores; "
                                 "set TPU_KERNEL_RECORDS_SLOW_TESTS=1 to grade it")


def _tpu_interpret_available() -> bool:
    import jax.experimental.pallas.tpu as pltpu

    return hasattr(pltpu, "set_tpu_interpret_mode")


def _grade(adapter: str):
    card = grade(f"{ADAPTERS}:{adapter}", seed=0, **QUICK)
    assert card.error is None, card.error
    assert card.passed, [(c.name, c.detail) for c in card.checks if not c.passed]
    return card


def test_jax_dot_product_attention_xla_is_accepted():
    _grade("xla_dot_product_attention")


@SLOW
@pytest.mark.skipif(not _tpu_interpret_available(),
                    reason=f"jax {jax.__version__} has no pltpu.set_tpu_interpret_mode, and "
                           "pallas.ops.tpu.flash_attention takes no interpret= argument")
def test_pallas_tpu_flash_attention_is_accepted():
    _grade("pallas_tpu_flash")


@SLOW
def test_pallas_tpu_splash_attention_is_accepted():
    _grade("pallas_tpu_splash")
