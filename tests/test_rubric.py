"""grading.rubric: correct candidates pass, every known-bad one fails the check built for it, and no
candidate misbehaviour escapes as a traceback."""

import time

import jax.numpy as jnp
import numpy as np
import pytest

from grading import oracle, tolerance
from records import rawio
from grading.candidates import BUILTIN, Candidate, reference
from grading.rubric import Scorecard, grade

BAD = sorted(n for n, c in BUILTIN.items() if c.kind == "known-bad")


def _validate(cards):
    doc = {"format_version": 1, "run_id": "rubric-test", "source": "measured", "seed": 0,
           "measured_candidate": cards[0].candidate, "scorecards": [c.to_dict() for c in cards], "power": None}
    rawio.validate("correctness", doc)


def test_oracle_agrees_with_the_jax_reference():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((2, 5, 4, 8), (2, 7, 2, 8), (2, 7, 2, 8)))
    lengths = np.array([7, 3])
    truth = oracle.attention(q, k, v, causal=True, kv_lengths=lengths)
    got = np.asarray(reference(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), causal=True,
                               kv_lengths=jnp.asarray(lengths)))
    assert np.max(np.abs(got - truth.out)) < 1e-5


def test_tolerance_never_passes_nan_and_scales_with_the_baseline():
    truth = np.ones((4, 4))
    base = truth + 1e-3
    assert tolerance.judge("x", truth + 1.5e-3, truth, base, "bfloat16", gradient=False).ok
    assert not tolerance.judge("x", truth + 1e-2, truth, base, "bfloat16", gradient=False).ok
    nan = truth.copy()
    nan[1, 2] = np.nan
    verdict = tolerance.judge("x", nan, truth, base, "float32", gradient=False)
    assert not verdict.ok and verdict.candidate.index == (1, 2)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_passes_every_check(seed):
    card = grade("reference", seed=seed)
    assert card.passed, card.failed
    assert card.score == card.max_score == 100
    assert len(card.checks) == 14
    _validate([card])


@pytest.mark.parametrize("name", ["pallas", "rounded-probs"])
def test_correct_candidates_pass(name):
    card = grade(name, seed=0)
    assert card.error is None, card.error
    assert card.passed, [(c.name, c.detail) for c in card.checks if not c.passed]


@pytest.mark.parametrize("name", BAD)
def test_known_bad_candidate_fails_its_intended_check(name):
    card = grade(name, seed=0)
    assert not card.passed and card.score < card.max_score
    failed = {c.name: c for c in card.checks if not c.passed}
    assert set(BUILTIN[name].catches) & set(failed), (name, sorted(failed))
    for check in failed.values():
        assert check.points == 0 and check.detail


def test_empty_row_checks_name_the_rule():
    nan = {c.name: c for c in grade("nan-empty-rows").checks}["empty-rows"]
    mean = {c.name: c for c in grade("mean-v-empty-rows").checks}["empty-rows"]
    assert "NaN" in nan.detail and "exact zeros" in nan.detail
    assert "mean of V" in mean.detail and "exact zeros" in mean.detail


def test_leak_and_readout_details_point_at_the_offence():
    cards = {n: {c.name: c for c in grade(n).checks} for n in ("ignores-causal", "causal-top-left",
                                                                "off-by-one-padding")}
    assert "future" in cards["ignores-causal"]["causal-leak"].detail
    assert "(b=" in cards["ignores-causal"]["causal-leak"].detail
    assert "top-left" in cards["causal-top-left"]["mask-readout"].detail
    assert "padding" in cards["off-by-one-padding"]["mask-readout"].detail
    gqa = {c.name: c for c in grade("wrong-gqa").checks}["gqa-mapping"]
    assert "read kv head" in gqa.detail


def _external(fn, name="misbehaving"):
    return Candidate(name, "external", "test candidate", lambda: fn)


def _raises(q, k, v, **kw):
    raise RuntimeError("kernel exploded")


def _hangs(q, k, v, **kw):
    time.sleep(3600)


def _wrong_shape(q, k, v, **kw):
    return jnp.zeros(q.shape[:-1] + (q.shape[-1] + 1,), q.dtype)


def _not_an_array(q, k, v, **kw):
    return [1, 2, 3]


def _nan(q, k, v, **kw):
    return reference(q, k, v, **kw) * jnp.nan


def test_a_raising_candidate_gets_a_scorecard():
    card = grade(_external(_raises))
    assert card.error is None and not card.passed and card.score == 0
    assert all("RuntimeError: kernel exploded" in c.detail or c.name == "finite" for c in card.checks)
    _validate([card])


def test_a_hanging_candidate_is_abandoned_after_its_time_limit():
    start = time.monotonic()
    card = grade(_external(_hangs), time_limit_s=1.0)
    assert time.monotonic() - start < 30
    assert not card.passed and card.score == 0
    assert "time limit" in card.checks[0].detail
    assert all("time limit" in c.detail or "out of time" in c.detail for c in card.checks)


@pytest.mark.parametrize("fn, words", [(_wrong_shape, "shape"), (_not_an_array, "not an array")])
def test_wrong_outputs_get_a_scorecard(fn, words):
    card = grade(_external(fn))
    shape_check = card.checks[0]
    assert shape_check.name == "output-shape-dtype" and not shape_check.passed
    assert words in shape_check.detail
    assert card.score == 0 and all(not c.passed for c in card.checks)


def test_a_nan_candidate_fails_finite_and_accuracy():
    card = grade(_external(_nan))
    checks = {c.name: c for c in card.checks}
    assert not checks["finite"].passed and "nan" in checks["finite"].detail.lower()
    assert not checks["forward-accuracy"].passed and checks["forward-accuracy"].error is None
    _validate([card])


def test_a_candidate_that_cannot_load_gets_a_scorecard_with_the_error(tmp_path):
    card = grade(f"{tmp_path / 'absent.py'}:attention")
    assert isinstance(card, Scorecard) and card.error and "does not exist" in card.error
    assert not card.passed and card.score == 0 and len(card.checks) == 14
    assert card.to_dict()["error"] == card.error
    _validate([card])
