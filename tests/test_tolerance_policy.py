"""The tolerance policy (``grading.tolerance``) tested by what it decides, not by its values.

Synthetic candidates whose error sits just under and just over the bound, for the output (forward
``k``) and the gradients (gradient ``k``), with the norm-wise error and the worst-element error binding
separately, and at the floor (an exact baseline). The calibrated constants are pinned here by those
decisions: an edit of ``K_FORWARD``, ``K_GRADIENT`` or ``FLOOR_EPS`` that the measurement in
``grading.tolerance``'s docstring did not produce makes a test below fail. A recalibration updates
``CALIBRATED`` together with that docstring table (the command that measured it is named there).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tpu_kernel_records_tools.grading import tolerance
from tpu_kernel_records_tools.grading.tolerance import Error, Policy, Verdict, error, judge, needed_floor, needed_k

# The decisions the calibration made (grading/tolerance.py docstring): an error up to k times the
# reference's, plus a floor of FLOOR_ULPS float32 ulps, passes.
CALIBRATED = {"forward": 5.0, "gradient": 6.0, "floor_ulps": 4.0}
ULP = 2.0 ** -23
N = 64  # elements of the synthetic tensors
JUST = 1e-3  # relative distance from the bound of the "just under" and "just over" candidates


def _tensors(seed: int = 0):
    truth = np.random.default_rng(seed).standard_normal(N)
    return truth, np.ones(N)  # magnitude 1 everywhere: errors are plain differences


def _spike(size: float) -> np.ndarray:
    e = np.zeros(N)
    e[17] = size
    return e


def _spread(size: float) -> np.ndarray:
    return np.full(N, size) * np.where(np.arange(N) % 2, 1.0, -1.0)


def _k(gradient: bool) -> float:
    return CALIBRATED["gradient" if gradient else "forward"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("gradient", [False, True], ids=["output", "gradient"])
def test_norm_error_just_under_the_bound_passes_and_just_over_fails(gradient, dtype):
    """Baseline: one spike (small norm-wise error, large worst element). Candidate: the same error on
    every element, so only its norm-wise error can reach its bound."""
    truth, mag = _tensors()
    spike = 1e-3
    baseline = truth + _spike(spike)
    bound = _k(gradient) * spike / math.sqrt(N) + CALIBRATED["floor_ulps"] * ULP
    for factor, ok in ((1 - JUST, True), (1 + JUST, False)):
        v = judge("t", truth + _spread(factor * bound), truth, baseline, dtype, gradient=gradient, magnitude=mag)
        assert v.ok is ok, (factor, v.describe())
        assert v.candidate.worst < 0.5 * v.tol_worst  # the worst element is far from its own bound
        assert math.isclose(v.tol_norm, bound, rel_tol=1e-12)
        assert v.binding[0] == "norm-wise"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("gradient", [False, True], ids=["output", "gradient"])
def test_worst_element_just_under_the_bound_passes_and_just_over_fails(gradient, dtype):
    """Baseline: the same error everywhere. Candidate: one spike, so only its worst element can fail."""
    truth, mag = _tensors(1)
    level = 2e-4
    baseline = truth + _spread(level)
    bound = _k(gradient) * level + CALIBRATED["floor_ulps"] * ULP
    for factor, ok in ((1 - JUST, True), (1 + JUST, False)):
        v = judge("t", truth + _spike(factor * bound), truth, baseline, dtype, gradient=gradient, magnitude=mag)
        assert v.ok is ok, (factor, v.describe())
        assert v.candidate.norm < 0.5 * v.tol_norm
        assert math.isclose(v.tol_worst, bound, rel_tol=1e-12)
        assert v.binding[0] == "worst-element" and v.candidate.index == (17,)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("gradient", [False, True], ids=["output", "gradient"])
def test_the_floor_is_one_float32_ulp_whatever_the_dtype(gradient, dtype):
    """An exact baseline leaves only the floor: FLOOR_ULPS float32 ulps, for bfloat16 inputs too."""
    truth, mag = _tensors(2)
    floor = CALIBRATED["floor_ulps"] * ULP
    for make in (_spread, _spike):
        for factor, ok in ((1 - JUST, True), (1 + JUST, False)):
            v = judge("t", truth + make(factor * floor), truth, truth.copy(), dtype, gradient=gradient,
                      magnitude=mag)
            assert v.ok is ok, (make.__name__, factor, v.describe())
            assert v.tol_norm == v.tol_worst == pytest.approx(floor, rel=1e-12)
    assert tolerance.POLICY.floor(dtype) == pytest.approx(floor, rel=1e-12)


def test_forward_and_gradient_bounds_differ_as_calibrated():
    """The same error relative to the same baseline: judged by the gradient ``k`` only when asked."""
    truth, mag = _tensors(3)
    level = 1e-3
    baseline = truth + _spread(level)
    between = 0.5 * (CALIBRATED["forward"] + CALIBRATED["gradient"]) * level
    out = judge("o", truth + _spread(between), truth, baseline, "float32", gradient=False, magnitude=mag)
    grad = judge("g", truth + _spread(between), truth, baseline, "float32", gradient=True, magnitude=mag)
    assert not out.ok and grad.ok and not out.gradient and grad.gradient


def test_verdict_needs_both_errors_in_bounds():
    base = Error(1e-6, 1e-5, (0,))
    for norm, worst, ok in ((0.5, 0.5, True), (1.5, 0.5, False), (0.5, 1.5, False), (1.5, 1.5, False),
                            (1.0, 1.0, True)):
        v = Verdict("v", Error(norm, worst, (3,)), base, 1.0, 1.0)
        assert v.ok is ok, (norm, worst)
        assert v.ratio == pytest.approx(max(norm, worst))
        scaled = Verdict("v", Error(norm * 0.25, worst * 4.0, (3,)), base, 0.25, 4.0)
        assert scaled.ok is ok and scaled.ratio == pytest.approx(max(norm, worst))
    tie = Verdict("v", Error(0.5, 2.0, (3,)), base, 1.0, 4.0)
    assert tie.binding[0] == "norm-wise" and " at " not in tie.describe()
    # Through judge: a candidate over on one error only fails.
    truth, mag = _tensors(4)
    baseline = truth + _spread(1e-4)
    k = CALIBRATED["forward"]
    only_worst = truth + _spike(2 * k * 1e-4)
    assert not judge("w", only_worst, truth, baseline, "float32", gradient=False, magnitude=mag).ok
    spike_base = truth + _spike(1e-3)
    only_norm = truth + _spread(2 * k * 1e-3 / math.sqrt(N))
    assert not judge("n", only_norm, truth, spike_base, "float32", gradient=False, magnitude=mag).ok


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_value_never_passes(bad):
    truth, mag = _tensors(5)
    cand = truth.copy()
    cand[9] = bad
    v = judge("x", cand, truth, truth + _spread(1.0), "float32", gradient=False, magnitude=mag,
              policy=Policy(k_forward=1e30))
    assert not v.ok and v.candidate.index == (9,) and math.isinf(v.ratio)
    assert math.isinf(v.candidate.worst) and math.isinf(v.candidate.norm)
    assert math.isinf(needed_k(v)) and math.isinf(needed_floor(v))
    nan_error = Verdict("n", Error(math.nan, math.nan, ()), Error(0, 0, ()), 1.0, 1.0)
    assert not nan_error.ok and math.isinf(nan_error.ratio) and math.isinf(needed_floor(nan_error))


def test_error_is_normwise_and_worst_element_relative_to_the_magnitude():
    truth = np.array([[1.0, -2.0], [0.0, 4.0]])
    mag = np.array([[2.0, 2.0], [1.0, 4.0]])
    cand = truth + np.array([[0.1, 0.0], [-0.3, 0.2]])
    e = error(cand, truth, mag)
    assert e.norm == pytest.approx(math.sqrt(0.01 + 0.09 + 0.04) / math.sqrt(4 + 4 + 1 + 16), rel=1e-12)
    assert e.worst == pytest.approx(0.3 / 4.0, rel=1e-12) and e.index == (1, 0)
    plain = error(cand, truth)  # default magnitude |truth|
    assert plain.norm == pytest.approx(math.sqrt(0.14) / math.sqrt(1 + 4 + 16), rel=1e-12)
    assert plain.worst == pytest.approx(0.3 / 4.0, rel=1e-12)
    assert error(truth.astype(np.float32), truth) == Error(0.0, 0.0, (0, 0))
    zero = error(np.zeros(3), np.zeros(3))
    assert zero.norm == 0.0 and zero.worst == 0.0
    assert error(np.zeros((0, 4)), np.zeros((0, 4))) == Error(0.0, 0.0, ())  # an empty slice: no error
    tiny = error(np.array([1e-150]), np.zeros(1))
    assert tiny.norm > 1 and tiny.worst > 1  # nothing to be relative to: any difference is large


def test_error_leaves_its_inputs_alone_and_given_scales_are_the_magnitudes():
    rng = np.random.default_rng(3)
    truth, mag = rng.normal(size=(6, 5)), rng.uniform(1, 2, size=(6, 5))
    cand = truth + rng.normal(scale=1e-3, size=(6, 5))
    kept = cand.copy()
    e = error(cand, truth, mag)
    assert np.array_equal(cand, kept)  # the differences go into a copy, never into the candidate's array
    assert e == error(cand, truth, mag, (float(np.linalg.norm(mag)), float(mag.max())))
    diff = np.abs(cand - truth)
    assert e.norm == pytest.approx(np.sqrt(np.sum(diff ** 2)) / np.linalg.norm(mag), rel=1e-12)
    assert e.worst == diff.max() / mag.max() and e.index == np.unravel_index(np.argmax(diff), diff.shape)


def test_the_bound_scales_with_the_baseline():
    truth, mag = _tensors(6)
    small = judge("s", truth, truth, truth + _spread(1e-6), "float32", gradient=False, magnitude=mag)
    large = judge("l", truth, truth, truth + _spread(1e-3), "float32", gradient=False, magnitude=mag)
    floor = CALIBRATED["floor_ulps"] * ULP
    assert small.tol_norm == pytest.approx(CALIBRATED["forward"] * 1e-6 + floor, rel=1e-12)
    assert large.tol_norm == pytest.approx(CALIBRATED["forward"] * 1e-3 + floor, rel=1e-12)
    assert small.baseline.norm == pytest.approx(1e-6, rel=1e-12)


def test_needed_k_and_floor_are_the_smallest_that_pass():
    truth, mag = _tensors(7)
    level = 1e-4
    baseline = truth + _spread(level)
    for gradient in (False, True):
        v = judge("t", truth + _spread(9 * level), truth, baseline, "float32", gradient=gradient, magnitude=mag)
        k = needed_k(v)
        assert k == pytest.approx((9 * level - CALIBRATED["floor_ulps"] * ULP) / level, rel=1e-9)
        for factor, ok in ((1 + JUST, True), (1 - JUST, False)):
            policy = Policy(k_forward=k * factor, k_gradient=k * factor)
            assert judge("t", truth + _spread(9 * level), truth, baseline, "float32", gradient=gradient,
                         magnitude=mag, policy=policy).ok is ok
        ulps = needed_floor(v)
        assert ulps == pytest.approx((9 - _k(gradient)) * level / ULP, rel=1e-9)
        for factor, ok in ((1 + JUST, True), (1 - JUST, False)):
            policy = Policy(floor_eps=ulps * factor)
            assert judge("t", truth + _spread(9 * level), truth, baseline, "float32", gradient=gradient,
                         magnitude=mag, policy=policy).ok is ok
    # Worst-element binding: a spike over a spread baseline.
    spike = judge("t", truth + _spike(20 * level), truth, baseline, "float32", gradient=False, magnitude=mag)
    assert needed_floor(spike) == pytest.approx((20 - CALIBRATED["forward"]) * level / ULP, rel=1e-9)
    assert needed_k(spike) == pytest.approx((20 * level - CALIBRATED["floor_ulps"] * ULP) / level, rel=1e-9)
    within = judge("t", truth + _spread(0.5 * ULP), truth, truth.copy(), "float32", gradient=False, magnitude=mag)
    assert needed_k(within) == 0.0 and needed_floor(within) == pytest.approx(0.5, rel=1e-9)
    exact_base = judge("t", truth + _spread(2 * CALIBRATED["floor_ulps"] * ULP), truth, truth.copy(), "float32",
                       gradient=False, magnitude=mag)
    assert math.isinf(needed_k(exact_base))  # no k helps when the reference is exact


def test_the_policy_and_its_verdicts_cannot_be_edited_in_place():
    import dataclasses

    verdict = judge("t", np.zeros(2), np.zeros(2), np.zeros(2), "float32", gradient=False)
    for obj, name in ((tolerance.POLICY, "k_forward"), (verdict, "tol_norm"), (verdict.candidate, "worst")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, 60.0)


def test_eps_are_the_machine_epsilons():
    import jax.numpy as jnp

    assert tolerance.EPS == {"float32": float(np.finfo(np.float32).eps), "bfloat16": float(jnp.finfo(jnp.bfloat16).eps)}


def test_the_policy_reports_what_it_applies():
    d = tolerance.POLICY.to_dict()
    assert d["k"] == {"forward": CALIBRATED["forward"], "gradient": CALIBRATED["gradient"]}
    assert d["floor"]["float32_eps_multiple"] == CALIBRATED["floor_ulps"]
    assert d["floor"]["value"] == pytest.approx(CALIBRATED["floor_ulps"] * ULP, rel=1e-12)
    assert tolerance.POLICY.k(True) == CALIBRATED["gradient"] and tolerance.POLICY.k(False) == CALIBRATED["forward"]
    assert d["allowed_roundings"] == {"reference": "bound", "dk-dv-per-query-head": "bound",
                                      "dq-dk-with-di-from-stored-output": "answer"}


def test_describe_names_the_binding_error_its_bound_and_the_outcome():
    truth, mag = _tensors(8)
    baseline = truth + _spread(1e-4)
    bad = judge("dq of P", truth + _spike(1.0), truth, baseline, "float32", gradient=True, magnitude=mag)
    text = bad.describe()
    assert text.startswith("dq of P: worst-element error 1 > tol") and "at (17,)" in text
    assert f"(reference {1e-4:.3g})" in text
    good = judge("out", truth, truth, baseline, "float32", gradient=False, magnitude=mag)
    assert " <= tol " in good.describe() and good.binding[0] in ("norm-wise", "worst-element")
    metric, err, tol, base = bad.binding
    assert (metric, err, tol, base) == ("worst-element", bad.candidate.worst, bad.tol_worst, bad.baseline.worst)


def test_an_alternative_rounding_raises_each_bound_to_the_larger_baseline_error():
    """dK/dV may round each query head's contribution before the group sum: the bound is then set,
    metric by metric, by the larger of the reference's error and that rounding's error."""
    truth, mag = _tensors(9)
    level = 1e-4
    baseline = truth + _spread(level)  # norm = worst = level
    alternative = truth + _spike(3 * level)  # norm 3 level / 8, worst 3 level
    k, floor = CALIBRATED["gradient"], CALIBRATED["floor_ulps"] * ULP
    v = judge("dk", truth, truth, baseline, "float32", gradient=True, magnitude=mag, alternatives=(alternative,))
    assert v.tol_norm == pytest.approx(k * level + floor, rel=1e-12)
    assert v.tol_worst == pytest.approx(k * 3 * level + floor, rel=1e-12)
    swapped = judge("dk", truth, truth, alternative, "float32", gradient=True, magnitude=mag, alternatives=(baseline,))
    assert (swapped.tol_norm, swapped.tol_worst) == pytest.approx((v.tol_norm, v.tol_worst), rel=1e-12)
    for factor, ok in ((1 - JUST, True), (1 + JUST, False)):
        cand = truth + _spike(factor * v.tol_worst)
        assert judge("dk", cand, truth, baseline, "float32", gradient=True, magnitude=mag,
                     alternatives=(None, alternative)).ok is ok
    assert not judge("dk", truth + _spike(2 * k * level), truth, baseline, "float32", gradient=True,
                     magnitude=mag).ok  # without the alternative the same spike fails


def test_an_allowed_answer_is_compared_against_not_added_to_the_bound():
    """dQ/dK may take rowsum(dO * O) from the stored output: a candidate near that answer passes by the
    reference's bound, while an error of the same size in another direction still fails; the bound
    itself is the reference's."""
    truth, mag = _tensors(10)
    level = 1e-4
    baseline = truth + _spread(level)
    answer = truth + _spread(40 * level)[::-1] * np.linspace(0.5, 1.5, N)  # 40x the reference's error
    k, floor = CALIBRATED["gradient"], CALIBRATED["floor_ulps"] * ULP
    near = answer + _spread(2 * level)
    v = judge("dq", near, truth, baseline, "float32", gradient=True, magnitude=mag,
              answers={"di from the stored output": answer})
    assert v.ok and v.against == "di from the stored output" and "against the answer with di" in v.describe()
    assert (v.tol_norm, v.tol_worst) == pytest.approx((k * level + floor, k * level + floor), rel=1e-12)
    assert v.candidate.norm == pytest.approx(2 * level, rel=1e-9)
    assert not judge("dq", near, truth, baseline, "float32", gradient=True, magnitude=mag).ok  # without it
    other = truth + (answer - truth)[::-1]  # the same size of error, another direction
    w = judge("dq", other, truth, baseline, "float32", gradient=True, magnitude=mag,
              answers={"di from the stored output": answer})
    assert not w.ok
    exact = judge("dq", truth, truth, baseline, "float32", gradient=True, magnitude=mag,
                  answers={"di from the stored output": answer, "unused": None})
    assert exact.ok and exact.against == "" and exact.candidate.norm == 0.0  # the truth is always an answer
    nan = judge("dq", np.full(N, np.nan), truth, baseline, "float32", gradient=True, magnitude=mag,
                answers={"di from the stored output": answer})
    assert not nan.ok


@pytest.mark.parametrize("logit_scale, factor", [(0.25, 1.0), (1.0, 1.0), (40.0, 40.0), (math.inf, 1.0),
                                                 (math.nan, 1.0)])
def test_the_floor_grows_with_the_largest_logit(logit_scale, factor):
    """float32 logits carry an absolute error of about |logit| eps: the floor is max(1, |logit|) ulps."""
    truth, mag = _tensors(10)
    floor = CALIBRATED["floor_ulps"] * ULP * factor
    for just, ok in ((1 - JUST, True), (1 + JUST, False)):
        v = judge("t", truth + _spike(just * floor), truth, truth.copy(), "float32", gradient=False,
                  magnitude=mag, logit_scale=logit_scale)
        assert v.ok is ok and v.tol_worst == pytest.approx(floor, rel=1e-12)
    over = judge("t", truth + _spike(3 * floor), truth, truth.copy(), "float32", gradient=False, magnitude=mag,
                 logit_scale=logit_scale)
    assert needed_floor(over) == pytest.approx(3 * CALIBRATED["floor_ulps"], rel=1e-9)
    base = truth + _spread(1e-5)
    v = judge("t", truth + _spread(1e-4), truth, base, "float32", gradient=False, magnitude=mag,
              logit_scale=logit_scale)
    assert needed_k(v) == pytest.approx((1e-4 - floor) / 1e-5, rel=1e-9)
