"""JAX's own paged kernels graded by the paged rubric as field kernels (issue 36), through the layout adapters
of ``tests/field_adapters.py`` (pools transposed or K/V-interleaved, query rows folded into the kernel's batch
or token axis, rows with no key zeroed; never the numerics), in TPU interpret mode on the CPU.

* ``jax_paged_attention``: ``pallas.ops.tpu.paged_attention``, a decode kernel (one query row per sequence;
  the adapter gives each of the contract's rows a sequence of its own, causal by its length). Declares
  softcap (``attn_logits_soft_cap``). FINDING: it masks by adding ``mask_value`` to the logits and never
  zeroes K or V where no key is, so NaN or Inf in a last page's slots past the length, or in the pages a
  compute block loads past a sequence's last page (trailing table entries), reach its output: on the
  rubric's NaN-filled pools every check but paged-output fails, and finite. FINDING: it rounds float32 K/V
  pages to bfloat16 (``MultiPageAsyncCopyDescriptor._maybe_dequantize``'s default ``dtype=jnp.bfloat16``),
  so on zero-filled pools (``jax_paged_attention_zeroed_pool``, a diagnostic) the float32 problems still
  fail their bound.
* ``jax_ragged_paged_attention``: ``pallas.ops.tpu.ragged_paged_attention`` (mixed prefill and decode: the
  contract's bottom-right causal is its own, it zeroes K/V past a length and never reads a trailing table
  entry). Declares window (its causal, left-only ``sliding_window``) and softcap. Not gradable here: TPU
  interpret mode (jax 0.6.2 to 0.10.2) handles only indexing transforms of a ref, and the kernel reshapes
  its VMEM K/V buffer; the generic interpreter fails on it too. Its adapter is graded with JAX's own
  ``ref_ragged_paged_attention`` (same signature and layout) in the kernel's place.

Times (a shared 2-core machine at load 7-12; the interpreted kernel compiles a program per shape), quick
level, seed 0, through the worker: ``jax_paged_attention`` 463 s, ``jax_paged_attention_zeroed_pool`` 389 s,
``jax_ragged_paged_reference`` 45 s; the tiny cause tests 4-8 s each. So the tiny cause tests are
slow-marked (the default run keeps the two checks of the adapters' declarations and row logic, about
3 s), and every grade, quick level and full level (seeds 0-2), runs only with
``TPU_KERNEL_RECORDS_FULL_FIELD=1``, like the dense field kernels' (the full level not yet run: its
expectations are the quick level's).
"""

from __future__ import annotations

import inspect
import os
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from tpu_kernel_records_tools.grading.paged.known_bad import paged_reference
from tpu_kernel_records_tools.grading.paged.checks import PAGED_CHECKS, paged_checks_for
from tpu_kernel_records_tools.grading.rubric import grade

from tests import field_adapters

ADAPTERS = Path(__file__).with_name("field_adapters.py")
FULL_FIELD = pytest.mark.skipif(os.environ.get("TPU_KERNEL_RECORDS_FULL_FIELD") != "1",
                                reason="an interpreted Pallas TPU kernel takes many minutes at the full level on "
                                       "2 cores; set TPU_KERNEL_RECORDS_FULL_FIELD=1 to grade it")
FULL_TIME_LIMIT_S = 4 * 3600.0
BASE = [c.name for c in PAGED_CHECKS]
REFUSES_RAGGED = re.compile(r"'(ReshapeTransform|RefReshaper)' object has no attribute 'indices'")


def _grade(adapter: str, level: str, seed: int, features: tuple[str, ...], fails: dict[str, str]):
    """Grade ``adapter`` (paged); exactly the checks in ``fails`` fail, each with its pattern in its detail."""
    card = grade(f"{ADAPTERS}:{adapter}", seed=seed, level=level, contract="paged",
                 **({"time_limit_s": FULL_TIME_LIMIT_S} if level == "full" else {}))
    assert card.error is None, card.error
    assert card.contract == "paged" and card.features == features
    assert [c.name for c in card.checks] == [*(c.name for c in paged_checks_for(features)), "finite"]
    failed = {c.name: c.detail for c in card.checks if not c.passed}
    assert set(failed) == set(fails), failed
    for name, pattern in fails.items():
        assert re.search(pattern, failed[name]), (name, failed[name])
    return card


# --------------------------------------------------------------------------------------------------
# What each adapter declares: exactly the kernel's own arguments.

def test_adapters_declare_exactly_what_the_kernels_take():
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    paged = inspect.signature(paged_attention).parameters
    assert "attn_logits_soft_cap" in paged and not {"sinks", "sliding_window", "sm_scale"} & set(paged)
    assert field_adapters.jax_paged_attention.features == ("softcap",)
    ragged = inspect.signature(ragged_paged_attention).parameters
    assert {"sliding_window", "soft_cap", "sm_scale"} <= set(ragged) and "sinks" not in ragged
    assert field_adapters.jax_ragged_paged_attention.features == ("window", "softcap")
    assert field_adapters.jax_ragged_paged_reference.features == ("window", "softcap")


def test_rows_that_see_a_key():
    """The adapters' zeroing of rows with no key follows the contract's positions (``kv_lengths - q_len + i``)."""
    seen = np.asarray(field_adapters._paged_visible(jnp.asarray([0, 1, 3, 5]), 3, True, None))
    assert seen.tolist() == [[False] * 3, [False, False, True], [True] * 3, [True] * 3]
    assert np.asarray(field_adapters._paged_visible(jnp.asarray([0, 1]), 3, False, None)).tolist() == [
        [False] * 3, [True] * 3]
    window = np.asarray(field_adapters._paged_visible(jnp.asarray([4]), 2, False, (0, 0)))
    assert window.tolist() == [[True, True]]


# --------------------------------------------------------------------------------------------------
# The findings at their cause, on one tiny problem (a few seconds each: one interpreted program).

def _tiny(dtype, fill: float):
    """Two sequences (20 and 16 keys) in pages of 16, a pool of 4 pages: sequence 0 on pages 0, 1 (slots
    4-15 of page 1 hold no key), sequence 1 on page 2, its trailing table entry page 3 (no key); every slot
    that holds no key is ``fill``."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 1, 2, 16)).astype(np.float32)
    k, v = (rng.standard_normal((4, 16, 1, 16)).astype(np.float32) for _ in range(2))
    holds = np.zeros((4, 16), bool)
    holds[0], holds[1, :4], holds[2] = True, True, True
    k[~holds], v[~holds] = fill, fill
    args = [jnp.asarray(x, dtype) for x in (q, k, v)]
    return args, {"kv_lengths": jnp.asarray([20, 16], jnp.int32), "page_indices": jnp.asarray([[0, 1], [2, 3]],
                                                                                            jnp.int32)}


@pytest.mark.slow
def test_paged_attention_lets_garbage_where_no_key_is_reach_the_output():
    """NaN past sequence 0's length (in its last page) and NaN in the page sequence 1's trailing table entry
    points at (its one compute block loads both table entries) make both rows NaN; zeros there do not."""
    args, kwargs = _tiny(jnp.bfloat16, np.nan)
    out = np.asarray(field_adapters.jax_paged_attention(*args, **kwargs)).astype(np.float32)
    assert np.isnan(out[0]).all() and np.isnan(out[1]).all()
    args, kwargs = _tiny(jnp.bfloat16, 0.0)
    out = np.asarray(field_adapters.jax_paged_attention(*args, **kwargs)).astype(np.float32)
    ref = np.asarray(paged_reference(*args, **kwargs)).astype(np.float32)
    assert np.isfinite(out).all() and np.abs(out - ref).max() < 2e-2


@pytest.mark.slow
def test_paged_attention_rounds_float32_pages_to_bfloat16():
    """On a zero-filled float32 pool its output is the reference's on K/V rounded to bfloat16, not on K/V."""
    args, kwargs = _tiny(jnp.float32, 0.0)
    out = np.asarray(field_adapters.jax_paged_attention(*args, **kwargs))
    exact = np.asarray(paged_reference(*args, **kwargs))
    rounded = np.asarray(paged_reference(args[0], *(x.astype(jnp.bfloat16).astype(jnp.float32) for x in args[1:]),
                                         **kwargs))
    assert np.abs(out - rounded).max() < 1e-5 < 1e-3 < np.abs(out - exact).max()


@pytest.mark.slow
def test_ragged_paged_attention_does_not_run_in_interpret_mode():
    """TPU interpret mode cannot read through the kernel's reshaped VMEM ref. When a JAX release can, this
    fails: grade the kernel then (``_grade("jax_ragged_paged_attention", ...)`` as its reference is)."""
    args, kwargs = _tiny(jnp.float32, 0.0)
    with pytest.raises(Exception, match=REFUSES_RAGGED):
        np.asarray(field_adapters.jax_ragged_paged_attention(*args, **kwargs))


# --------------------------------------------------------------------------------------------------
# The rubric's verdicts (worker process and all).

NAN_LEAK = r"error inf|= nan|non-finite"  # what a NaN that reached the output looks like in a check's detail
PAGED_FAILS = {**{name: NAN_LEAK for name in BASE if name != "paged-output"}, "paged-softcap": NAN_LEAK,
               "finite": "non-finite value"}


@pytest.mark.slow
@FULL_FIELD
def test_jax_paged_attention_fails_by_leaking_garbage():
    _grade("jax_paged_attention", "quick", 0, ("softcap",), PAGED_FAILS)


@pytest.mark.slow
@FULL_FIELD
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_jax_paged_attention_at_the_full_level(seed):
    _grade("jax_paged_attention", "full", seed, ("softcap",), PAGED_FAILS)


ONLY_FLOAT32 = r"(?s)\A(?!.*\bbf16\b).*\bf32\b"  # every problem named is a float32 one
ZEROED_FAILS = {name: ONLY_FLOAT32 for name in ("paged-accuracy", "paged-garbage", "paged-permutation", "paged-dense",
                                                "paged-softcap")}
RAGGED_FAILS = {"paged-window": r"raised ValueError: JAX's ragged_paged_attention's sliding window is causal and "
                                r"left-only"}


@pytest.mark.slow
@FULL_FIELD
def test_jax_paged_attention_on_zeroed_pools_fails_only_in_float32():
    """With the NaN leak out of the way (the diagnostic adapter zeroes every slot that holds no key), only the
    float32 problems fail: its pages rounded to bfloat16. paged-long (bfloat16, 33k keys, page indices past
    2^15) and every bfloat16 problem pass."""
    _grade("jax_paged_attention_zeroed_pool", "quick", 0, ("softcap",), ZEROED_FAILS)


@pytest.mark.slow
@FULL_FIELD
def test_ragged_adapter_with_jax_reference_passes_but_the_two_sided_window():
    """The ragged adapter's layout, with JAX's reference in the kernel's place: every check passes but
    paged-window, whose non-causal two-sided window the kernel's left-only causal window cannot express
    (the adapter refuses it)."""
    _grade("jax_ragged_paged_reference", "quick", 0, ("window", "softcap"), RAGGED_FAILS)


@pytest.mark.slow
@FULL_FIELD
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ragged_adapter_with_jax_reference_at_the_full_level(seed):
    _grade("jax_ragged_paged_reference", "full", seed, ("window", "softcap"), RAGGED_FAILS)
