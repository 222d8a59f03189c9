"""Each check of ``grading.dense.checks`` alone, at the quick level, in-process: its verdict and its detail on
the reference (passes, with the numbers it promises) and on a known-bad candidate built for it (fails,
with the detail naming the broken rule and the problem). Fast (seconds per check), so that it can judge
the mutants of ``grading/dense/checks.py`` (``scripts/mutation.py``, module ``checks``).

Known-bad candidates are the roster's (``grading.candidates.BUILTIN``) or small defects built here on
the reference: one wrong gradient entry where the contract demands an exact zero, one hidden visible
key, a wrong output shape, an ignored ``scale=``.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpu_kernel_records_tools.grading.dense import checks as C
from tpu_kernel_records_tools.grading.candidates import BUILTIN, jit_contract, reference
from kernel_src.contract import visibility_mask
from tests.grading_inprocess import InProcessRunner

SPECS = {spec.name: spec for spec in C.CHECKS}
REFERENCE = BUILTIN["reference"].load()  # jitted: the plain function would compile op by op


def run(check: str, fn, seed: int = 0) -> C.Outcome:
    """``check``'s outcome for ``fn`` (a callable or a built-in name) at the quick level, as the rubric
    computes it (a candidate's exception becomes a failed outcome)."""
    fn = BUILTIN[fn].load() if isinstance(fn, str) else fn
    runner = InProcessRunner(fn)
    runner.check = check
    ctx = C.Context(runner, seed, level="quick")
    try:
        return SPECS[check].run(ctx)
    except C.CandidateFailure as e:
        return C.Outcome(False, str(e))


def problems_of(check: str, seed: int = 0) -> list:
    """The (cached) problems ``check`` built for ``seed`` at the quick level (after a ``run``)."""
    return C._CACHE[(seed, "quick", check)]


def _with_gradient_defect(defect):
    """The reference (jitted), whose backward then goes through ``defect(dq, dk, dv, visible) -> (dq, dk,
    dv)`` (``visible``: bool ``[batch or 1, q_len, kv_len]``)."""
    @functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
    def g(q, k, v, lengths, causal, scale):
        return reference(q, k, v, causal=causal, kv_lengths=lengths, scale=scale)

    def fwd(q, k, v, lengths, causal, scale):
        return g(q, k, v, lengths, causal, scale), (q, k, v, lengths)

    def bwd(causal, scale, saved, ct):
        q, k, v, lengths = saved
        dq, dk, dv = jax.vjp(lambda q, k, v: reference(q, k, v, causal=causal, kv_lengths=lengths, scale=scale),
                             q, k, v)[1](ct)
        return (*defect(dq, dk, dv, visibility_mask(q.shape[1], k.shape[1], causal, lengths)), None)

    g.defvjp(fwd, bwd)

    @jit_contract
    def attention(q, k, v, *, causal=False, kv_lengths=None, scale=None):
        return g(q, k, v, kv_lengths, causal, scale)
    return attention


def _dk_on_unseen_keys(dq, dk, dv, visible):
    unseen = ~jnp.any(visible, axis=1)[:, :, None, None]  # [batch, kv_len, 1, 1]
    return dq, jnp.where(unseen, jnp.asarray(1e-3, dk.dtype), dk), dv


def _dq_on_empty_rows(dq, dk, dv, visible):
    empty = ~jnp.any(visible, axis=2)[:, :, None, None]  # [batch, q_len, 1, 1]
    return jnp.where(empty, jnp.asarray(1e-3, dq.dtype), dq), dk, dv


@jit_contract
def _hides_last_valid_key(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    """Key ``kv_lengths[b] - 1`` treated as padding (off by one the other way): a visible key gets zero."""
    lengths = None if kv_lengths is None else jnp.maximum(jnp.asarray(kv_lengths) - 1, 0)
    return reference(q, k, v, causal=causal, kv_lengths=lengths, scale=scale)


@jit_contract
def _drops_last_head(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    return reference(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale)[:, :, :-1]


@jit_contract
def _adds_a_head(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    out = reference(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale)
    return jnp.concatenate([out, out[:, :, :1]], axis=2)


@jit_contract
def _ignores_scale(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    return reference(q, k, v, causal=causal, kv_lengths=kv_lengths)


def _numbers(detail: str) -> list[float]:
    return [float(x) for x in re.findall(r"(?<![\w.])-?\d+(?:\.\d+)?(?:e[-+]?\d+)?", detail)]


# --------------------------------------------------------------------------------------------------
# Cheap first (the mutation run stops at the first failure).

def test_each_check_is_worth_its_published_points_and_they_add_up_to_100():
    assert sum(spec.points for spec in C.CHECKS) + C.FINITE.points == 100
    assert {spec.name: spec.points for spec in C.CHECKS} == {
        "output-shape-dtype": 5, "forward-accuracy": 12, "gradients": 12, "causal-leak": 8, "padding-leak": 8,
        "empty-rows": 8, "mask-readout": 8, "gqa-mapping": 8, "large-logits": 6, "peaky-attention": 5, "scale": 5,
        "determinism": 5, "fresh-inputs": 6}
class _BuildOnly(InProcessRunner):
    """Stops a check at its first call: the problems are built (and cached), nothing is computed."""

    def forward(self, p, **kw):
        raise C.CandidateFailure("built")

    vjp = forward


def test_causal_leak_always_protects_a_row_from_future_keys():
    """Over many seeds, every causal-leak problem changes only keys in the future of at least one row
    (a cut at or before the first row's last visible key would protect nothing)."""
    saved = dict(C._CACHE)
    try:
        for seed in range(100, 164):
            ctx = C.Context(_BuildOnly(reference), seed, level="quick")
            try:
                SPECS["causal-leak"].run(ctx)
            except C.CandidateFailure:
                pass
            for p, changed, rows, cut in C._CACHE[(seed, "quick", "causal-leak")]:
                assert rows.any(), (seed, p.label, cut)
                i_last = int(np.flatnonzero(rows[0])[-1])
                assert cut > i_last + p.offset and cut >= 1, (seed, p.label, cut)
                assert not np.array_equal(changed.host("k"), p.host("k"))
    finally:
        C._CACHE.clear()
        C._CACHE.update(saved)


# --------------------------------------------------------------------------------------------------
# The reference passes each check, with the detail each promises.

PASS_DETAIL = {
    "output-shape-dtype": "3 calls returned q's shape in q's dtype (float32 and bfloat16)",
    "forward-accuracy": "4 random problems within the forward bound; closest to its bound: ",
    "gradients": "dQ, dK, dV under random cotangents on 4 problems",
    "causal-leak": "future keys/values changed (K longer and shorter than Q); rows that cannot see them stayed put",
    "padding-leak": "keys/values past kv_lengths changed to large finite values; the output stayed put",
    "empty-rows": "rows with no visible key",
    "mask-readout": "with V one-hot the output is the probability matrix",
    "gqa-mapping": "query heads on ",
    "large-logits": "logits near +-500, and needle keys 50-150 above the rest",
    "peaky-attention": "low-entropy rows",
    "scale": "scale=0.3 at head_dim [16, 32, 48, 64]",
    "determinism": "same inputs twice gave the same bits",
    "fresh-inputs": "three fresh draws on one shape and flags: each output answers its own inputs",
}


def test_every_check_has_a_test_here():
    assert set(PASS_DETAIL) == set(SPECS)


@pytest.mark.slow  # the reference's pass of every check is in the default run through the CLI (test_rubric_cli)
@pytest.mark.parametrize("check", list(PASS_DETAIL))
def test_the_reference_passes(check):
    outcome = run(check, REFERENCE)
    assert outcome.passed, outcome.detail
    assert PASS_DETAIL[check] in outcome.detail, outcome.detail
    for v in outcome.verdicts:  # every verdict that it passed on is within its bounds
        assert v.ok and v.candidate.norm <= v.tol_norm and v.candidate.worst <= v.tol_worst, v.describe()
    if outcome.verdicts:
        worst = max(outcome.verdicts, key=lambda v: v.ratio)
        _, err, tol, base = worst.binding
        assert outcome.error == pytest.approx(err) and outcome.tolerance == pytest.approx(tol)
        assert outcome.baseline_error == pytest.approx(base) and 0 <= outcome.error <= outcome.tolerance
    if check in ("forward-accuracy", "gradients", "large-logits", "peaky-attention", "scale"):
        assert " <= tol " in outcome.detail  # the closest verdict is described


def test_verdict_counts_follow_the_problems():
    assert len(run("forward-accuracy", REFERENCE).verdicts) == 4
    assert len(run("gradients", REFERENCE).verdicts) == 12  # dq, dk, dv on 4 problems
    assert len(run("causal-leak", REFERENCE).verdicts) == 4  # accuracy and change on 2 problems
    assert len(run("padding-leak", REFERENCE).verdicts) == 4
    assert len(run("empty-rows", REFERENCE).verdicts) == 8  # out, dq, dk, dv on 2 problems
    assert len(run("mask-readout", REFERENCE).verdicts) == 2
    assert len(run("gqa-mapping", REFERENCE).verdicts) == 3
    assert len(run("large-logits", REFERENCE).verdicts) == 3 + 4
    assert len(run("peaky-attention", REFERENCE).verdicts) == 2
    assert len(run("scale", REFERENCE).verdicts) == 4 + 4 * 4
    assert len(run("fresh-inputs", REFERENCE).verdicts) == 3


def test_empty_rows_counts_the_rows_it_checked():
    outcome = run("empty-rows", REFERENCE)
    rows = sum(int((~p.truth.visible.any(axis=2)).sum()) for p in problems_of("empty-rows"))
    assert rows > 0 and outcome.detail.startswith(f"{rows} rows with no visible key")


def test_gqa_mapping_names_its_heads():
    outcome = run("gqa-mapping", REFERENCE)
    const = problems_of("gqa-mapping")[0]
    assert outcome.detail.startswith(f"{const.q.shape[2]} query heads on {const.k.shape[2]} kv heads")
    assert np.all(const.host("v")[:, :, 1] == 2) and const.k.shape[2] > 1


# --------------------------------------------------------------------------------------------------
# Each check fails the known-bad candidate built for it, and says why.

def _failed(check, fn, *needles):
    outcome = run(check, fn)
    assert not outcome.passed, outcome.detail
    for needle in needles:
        assert needle in outcome.detail, (needle, outcome.detail)
    return outcome


def test_output_shape_dtype():
    _failed("output-shape-dtype", "wrong-dtype", "dtype float32, expected shape",
            "dtype bfloat16 (contract: the output has q's shape and dtype)")
    bad = _failed("output-shape-dtype", _drops_last_head, "returned shape (", "(contract: the output has q's shape")
    assert bad.detail.count("expected shape") == 3  # all three calls, joined
    _failed("output-shape-dtype", _adds_a_head, "returned shape (", "(contract: the output has q's shape")


def test_forward_accuracy():
    bad = _failed("forward-accuracy", "zeros", " > tol ")
    assert bad.error > bad.tolerance > 0 and bad.baseline_error is not None
    assert "; and " in bad.detail or bad.detail.count(" > tol ") == 3  # at most three described


def test_forward_accuracy_lists_at_most_three_and_counts_the_rest():
    bad = run("forward-accuracy", "unrelated-output")
    failed = [v for v in bad.verdicts if not v.ok]
    assert len(failed) == 4 and bad.detail.count(" > tol ") == 3 and bad.detail.endswith("; and 1 more")


def test_gradients():
    _failed("gradients", "stop-gradient-k", " dk: ", " > tol ")
    _failed("gradients", _with_gradient_defect(_dk_on_unseen_keys), "= 0.001 but no query may see key",
                  "(contract: dK, dV exactly zero for keys no query sees)")


def test_gradients_exact_zero_rule_alone():
    """dK off by 1e-3 on padding keys only: within the tolerance, so only the exact rule can fail it."""
    bad = run("gradients", _with_gradient_defect(_dk_on_unseen_keys))
    assert not bad.passed and "dk[b=" in bad.detail
    b, j = (int(x) for x in re.search(r"dk\[b=(\d+), j=(\d+)", bad.detail).groups())
    p = next(p for p in problems_of("gradients") if p.label in bad.detail.split(": dk[")[0])
    assert not p.truth.visible[b, :, j].any()


def test_causal_leak():
    bad = _failed("causal-leak", "ignores-causal", "in the future of rows i <", "rows that cannot see them moved by",
                  "(b=")
    assert "bottom-right causal" in bad.detail


def test_padding_leak():
    _failed("padding-leak", "missing-mask", "keys at or past kv_lengths=", "changed to large finite values",
            "rows that cannot see them moved by")
    _failed("padding-leak", "off-by-one-padding", "padding changed")


def test_empty_rows():
    _failed("empty-rows", "nan-empty-rows", "NaN", "the contract says exact zeros")
    _failed("empty-rows", "mean-v-empty-rows", "the mean of V over all keys", "exact zeros")
    _failed("empty-rows", _with_gradient_defect(_dq_on_empty_rows), "on a row with no visible key",
            "(contract: dQ exactly zero for rows that see no key)")


def test_mask_readout():
    _failed("mask-readout", "causal-top-left", "gave zero probability to visible key",
            "(causal mask aligned top-left?)")
    bad = _failed("mask-readout", "ignores-causal", "in its future (bottom-right causal allows j <=")
    assert "gave probability" in bad.detail
    _failed("mask-readout", "off-by-one-padding", "which is padding (kv_lengths[")
    _failed("mask-readout", _hides_last_valid_key, "gave zero probability to visible key")


def test_mask_readout_leak_points_at_an_invisible_key():
    bad = run("mask-readout", "ignores-causal")
    b, i, h, j = (int(x) for x in re.search(r"query \(b=(\d+), i=(\d+), h=(\d+)\) gave probability \S+ to key (\d+)",
                                            bad.detail).groups())
    p = problems_of("mask-readout")[0]
    assert not p.truth.visible[b, i, j] and j > i + p.offset


def test_gqa_mapping():
    bad = _failed("gqa-mapping", "wrong-gqa", "read kv head", "expected kv head", "'s output matches kv head")
    h, read, want = (int(x) for x in re.search(r"q head (\d+) read kv head (\d+) .*expected kv head (\d+)",
                                               bad.detail).groups())
    const = problems_of("gqa-mapping")[0]
    group, heads = const.q.shape[2] // const.k.shape[2], const.k.shape[2]
    assert want == h // group and read == h % heads != want


def test_large_logits():
    _failed("large-logits", "no-max-subtraction", "logits ~ +-500")
    _failed("large-logits", "low-precision", " > tol ")


def test_peaky_attention():
    _failed("peaky-attention", "no-max-subtraction", "peaky, integer V")


def test_scale():
    bad = _failed("scale", _ignores_scale, "scale=0.3", " > tol ")
    assert bad.error > bad.tolerance


def test_determinism():
    _failed("determinism", "nondeterministic", "differs between two calls on the same inputs at (")


def test_fresh_inputs():
    _failed("fresh-inputs", "memoizing", "returned the same bits as draw 1 although the inputs differ")
    _failed("fresh-inputs", "unrelated-output", " > tol ")


def test_a_result_kept_by_shape_fails_the_check_where_it_happens():
    bad = run("forward-accuracy", "memoizing")  # every slot twice in one grade: caught where it repeats
    assert bad.passed or "a result kept by shape" in bad.detail
    outcome = run("mask-readout", "memoizing")
    assert not outcome.passed and "a result kept by shape" in outcome.detail


# --------------------------------------------------------------------------------------------------
# Problem construction.

def test_perturbed_keys_are_large_finite_and_only_where_hidden():
    ctx = C.Context(InProcessRunner(reference), 0, level="quick")
    p = ctx.problem(np.random.default_rng(0), "accum")
    hidden = np.arange(p.k.shape[1])[None, :] >= p.lengths[:, None]
    changed = C._perturb_keys(p, np.random.default_rng(1), hidden, "padding changed")
    k, v = changed.host("k"), changed.host("v")
    assert changed.derived and hidden.any() and np.all(np.isfinite(v)) and np.abs(v[hidden]).min() > 1e3
    assert np.abs(k[hidden]).max() > 20
    assert np.array_equal(v[~hidden], p.host("v")[~hidden]) and np.array_equal(k[~hidden], p.host("k")[~hidden])


def test_shifted_logits_and_needles_are_as_large_as_promised():
    run("large-logits", REFERENCE)
    shifted, needles = problems_of("large-logits")[:2]
    for p, low, high in ((shifted, 300, 800), (needles, 50, 200)):
        q, k = p.host("q").astype(np.float64), p.host("k").astype(np.float64)
        scale = q.shape[-1] ** -0.5 if p.scale is None else p.scale
        group = q.shape[2] // k.shape[2]
        s = np.einsum("bihd,bjhd->bhij", q, np.repeat(k, group, axis=2)) * scale
        s = np.where(p.truth.visible[:, None], s, np.nan)
        if p is shifted:
            assert low < np.nanmax(np.abs(s)) < high
        else:  # the best key (a needle) beats every key past the three needles by 50 or more
            top = -np.sort(-np.nan_to_num(s, nan=-np.inf), axis=-1)[..., :4]
            gap = top[..., 0] - top[..., 3]
            assert gap[np.isfinite(gap)].size and np.all(gap[np.isfinite(gap)] > 40)


def test_one_hot_values_read_out_the_probabilities():
    run("mask-readout", REFERENCE)
    p = problems_of("mask-readout")[0]
    out = np.asarray(reference(p.q, p.k, p.v, **p.kwargs)).astype(np.float64)
    lk = p.k.shape[1]
    probs = np.transpose(out[..., :lk], (0, 2, 1, 3))
    assert np.allclose(probs, p.truth.probs, atol=1e-5)


def test_peaky_rows_have_one_dominant_key():
    run("peaky-attention", REFERENCE)
    for p in problems_of("peaky-attention"):
        probs = p.truth.probs
        top = np.max(probs, axis=-1)
        rows = p.truth.visible.any(axis=-1)[:, None]
        assert np.median(top[np.broadcast_to(rows, top.shape)]) > 0.9
        assert np.array_equal(p.host("v"), np.rint(p.host("v")))

