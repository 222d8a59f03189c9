"""Built-in implementations graded the way a user grades a kernel: ``grading.rubric.grade``, candidate in
its own worker process, quick level (small problems).

Division of labour with ``tests/test_rubric.py``, which grades in-process (shared executables, so it
can afford dozens of candidates): there every correct built-in -- the reference, the Pallas kernels
(masked-softmax path and fused flash, forward and gradients, interpret mode) and every correct
variant -- passes, and every known-bad built-in is rejected by its intended check. Here the pure-JAX
built-ins and the project's sharded entry point go through the real rubric end to end (worker process,
transfer of inputs and results, scorecard), as does the flash kernels' GPU (Triton) family in interpret
mode, and a kernel that ignores ``scale=`` is rejected by the scale check.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from tpu_kernel_records_tools.grading.candidates import BUILTIN
from tpu_kernel_records_tools.grading.rubric import grade

ADAPTERS = Path(__file__).with_name("field_adapters.py")
QUICK = {"level": "quick"} if "level" in inspect.signature(grade).parameters else {}
PURE_JAX = ("reference", "online-softmax", "rounded-probs")


def _failures(card) -> list[tuple[str, str]]:
    return [(c.name, c.detail) for c in card.checks if not c.passed]


def test_the_roster_holds_what_the_project_ships():
    correct = {n for n, c in BUILTIN.items() if c.kind in ("reference", "kernel", "correct-variant")}
    assert {"reference", "pallas", "flash", "flash-triton", *PURE_JAX} <= correct
    assert sum(c.kind == "known-bad" for c in BUILTIN.values()) >= 12


# every one slow: tests/test_rubric.py grades the reference through the rubric in the default run
@pytest.mark.slow
@pytest.mark.parametrize("name", PURE_JAX)
def test_pure_jax_builtin_passes_every_check_through_the_rubric(name):
    card = grade(name, seed=0, **QUICK)
    assert card.error is None, card.error
    assert card.passed and card.score == card.max_score, _failures(card)
    assert len(card.checks) >= 14 and all(c.detail for c in card.checks)


@pytest.mark.slow
def test_the_sharded_entry_point_passes_on_two_devices(monkeypatch):
    """``kernel_src.sharded`` around the reference, on two host devices (the rubric's worker sees them)."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    card = grade(f"{ADAPTERS}:sharded_reference", seed=0, **QUICK)
    assert card.error is None, card.error
    assert card.passed, _failures(card)


@pytest.mark.slow  # in-process, test_checks_quick's test_scale rejects the same defect in the default run
def test_a_kernel_that_ignores_an_explicit_scale_fails_the_scale_check():
    card = grade(f"{ADAPTERS}:ignores_scale", seed=0, **QUICK)
    failed = {c.name for c in card.checks if not c.passed}
    assert "scale" in failed, sorted(failed)


@pytest.mark.slow  # both levels: the default run's 5 minutes have no room for another interpreted grade
@pytest.mark.parametrize("level", ["quick", "full"])
def test_the_gpu_flash_family_passes_in_interpret_mode(level):
    """``flash_attention(..., variant="triton")``, the kernels a GPU runs, interpreted on this CPU and graded
    like the TPU family (``flash``): a correct built-in, forward and gradients."""
    card = grade("flash-triton", seed=0, level=level)
    assert card.error is None, card.error
    assert card.passed and card.score == card.max_score, _failures(card)
