"""grading.dense.checks and grading.dense.problems: correct candidates pass, every known-bad one fails the check built
for it (the new ones at the full level, where their bugs live), the problem distribution covers what it
promises, and the tolerance is fair to kernels that round per query head.

Candidates are graded in-process (tests/grading_inprocess.py): the checks and verdicts are the rubric's;
the worker-process isolation has its own tests."""

import jax.numpy as jnp
import numpy as np
import pytest

from tpu_kernel_records_tools.grading.dense import checks as C
from tpu_kernel_records_tools.grading.dense import truth as oracle, problems
from tpu_kernel_records_tools.grading import tolerance
from tpu_kernel_records_tools.grading.candidates import BUILTIN, reference
from kernel_src.contract import FEATURES, Dims
from tpu_kernel_records_tools.records import rawio
from tests.grading_inprocess import InProcessRunner, grade

BAD = sorted(n for n, c in BUILTIN.items() if c.kind == "known-bad")
# Known-bad built-ins whose bug only shows at the sizes of the full level (exact at the quick shapes).
FULL_ONLY = ["head-dim-tile", "query-tile-local-causal", "key-tile-wrap", "input-dtype-accumulator",
             "backward-ignores-scale", "large-kv-top-left", "frozen-running-max", "split-kv-without-maxima",
             "memoizing-large",
             # Bugs at the serving and training shapes (issue 24, tests/test_serving_slots.py).
             "batch-blocks-of-4", "long-cache-bf16-accumulator", "head-blocks-of-16", "prefill-top-left",
             "spec-decode-no-causal", "mha-d64-pairs", "skip-last-full-block"]
CORRECT = sorted(n for n, c in BUILTIN.items() if c.kind in ("reference", "correct-variant"))
# Known-bad built-ins of the contract's features (issue 34): each is graded on the check of the feature it breaks
# in tests/test_feature_builtins.py (quick and full levels); a whole quick grade of each would add a minute here.
FEATURE_BAD = [n for n in BAD if set(BUILTIN[n].catches) <= set(FEATURES)]


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


# --------------------------------------------------------------------------------------------------
# The distribution.

SEEDS = range(12)


@pytest.mark.parametrize("seed", SEEDS)
def test_every_seed_covers_the_promised_shapes(seed):
    shapes = problems.draw_shapes(seed, "full")
    dims = {d.head_dim for d in shapes.values()}
    assert {64, 128, 256} <= dims and dims & set(problems.ODD_HEAD_DIMS)
    groups = {d.group for d in shapes.values()}
    assert {1, 2, 4, 8} <= groups
    assert any(d.num_kv_heads == 1 and d.group > 1 for d in shapes.values())  # MQA
    long = shapes["long"]
    assert long.q_len > 1024 and long.kv_len > 1024 and long.q_len % 128 and long.kv_len % 128
    for slot in ("long", "batch", "ahead", "needle", "readout"):
        d = shapes[slot]
        assert problems.slot_flags(shapes, slot)[1], slot  # causal
        assert (d.kv_len - d.q_len) % 128, (slot, d)  # no multiple of any tile size (128, 256, 512)
    assert shapes["batch"].kv_len > shapes["batch"].q_len > 128 and shapes["batch"].kv_len > 3 * 128
    assert shapes["ahead"].q_len - shapes["ahead"].kv_len > 512  # whole 512-row query tiles see no key
    assert shapes["batch"].batch >= 3 and shapes["decode"].q_len == 1 and shapes["decode"].kv_len > 1024
    accum = shapes["accum"]
    assert accum.kv_len > 2048 and problems.slot_flags(shapes, "accum")[0] == "bfloat16"
    lengths = problems.draw_lengths(np.random.default_rng(seed), shapes["batch"])
    assert 0 in lengths and shapes["batch"].kv_len in lengths and len(set(lengths.tolist())) == 3
    accum_lengths = problems.draw_lengths(np.random.default_rng(seed), accum, minimum=2049)
    assert accum_lengths.min() >= 2049
    flags = {problems.slot_flags(shapes, s)[1:3] + (problems.slot_flags(shapes, s)[3] is None,) for s in shapes}
    assert len(flags) == 8  # every (causal, kv_lengths, default scale) combination


def test_explicit_scale_differs_from_the_default_at_every_head_dim():
    """A kernel that ignores scale= is caught only where the explicit scale is not head_dim**-0.5."""
    dims = {d.head_dim for seed in range(50) for d in problems.draw_shapes(seed, "full").values()}
    dims |= {d.head_dim for d in problems.draw_shapes(0, "quick").values()}
    for d in dims:
        assert abs(problems.EXPLICIT_SCALE / d ** -0.5 - 1) > 0.15, d  # 20% at head_dim 16, more elsewhere


def test_quick_level_is_the_four_toy_shapes():
    assert set(problems.draw_shapes(3, "quick").values()) == set(problems.QUICK.values())
    with pytest.raises(ValueError, match="level"):
        problems.draw_shapes(0, "medium")


class _Recorder(InProcessRunner):
    """Records every call's key (shape, dtype, flags) and whether it was a fresh draw."""

    def __init__(self, fn):
        super().__init__(fn)
        self.calls = []

    def forward(self, p, **kw):
        self.calls.append((p.key, p.derived, p.label))
        return super().forward(p, **kw)

    def vjp(self, p):
        self.calls.append((p.key, p.derived, p.label))
        return super().vjp(p)


@pytest.fixture(scope="module")
def full_reference():
    """The reference graded at the full level on seed 0 on the base contract (its features' checks are
    test_feature_builtins'), with every call recorded (computes and caches the seed's truth and baselines
    for the other full-level tests of this module)."""
    runner = _Recorder(BUILTIN["reference"].load())
    return grade("reference", seed=0, level="full", runner=runner, features=()), runner.calls


@pytest.mark.slow
def test_reference_passes_every_check_at_the_full_level(full_reference):
    card, _ = full_reference
    assert card.passed, [(c.name, c.detail) for c in card.checks if not c.passed]
    assert len(card.checks) == 14 and card.score == card.max_score == 100
    _validate([card])


@pytest.mark.slow
def test_every_shape_is_called_twice_with_different_values(full_reference):
    """A kernel that memoizes by shape and flags meets every key at least twice with fresh values."""
    _, calls = full_reference
    fresh = {}
    for key, derived, label in calls:
        if not derived:
            fresh.setdefault(key, []).append(label)
    assert len(fresh) >= 12
    assert all(len(labels) >= 2 for labels in fresh.values()), {k: v for k, v in fresh.items() if len(v) < 2}
    assert max(key[1][1] for key in fresh) > 2048  # kv_len


@pytest.mark.slow
@pytest.mark.parametrize("name", FULL_ONLY)
def test_new_known_bad_is_caught_at_the_full_level_by_its_check(name, full_reference):
    only = BUILTIN[name].catches
    card = grade(name, seed=0, level="full", only=only)
    failed = {c.name: c for c in card.checks if not c.passed}
    assert failed, (name, [(c.name, c.detail) for c in card.checks])
    for check in failed.values():  # the detail names the problem: slot, dims, dtype and flags
        assert any(f"{slot}(" in check.detail for slot in problems.draw_shapes(0, "full")), check.detail


@pytest.mark.parametrize("name", [pytest.param("head-dim-tile", marks=pytest.mark.slow),
                                  pytest.param("query-tile-local-causal", marks=pytest.mark.slow),
                                  pytest.param("key-tile-wrap", marks=pytest.mark.slow),
                                  pytest.param("large-kv-top-left", marks=pytest.mark.slow),
                                  pytest.param("split-kv-without-maxima", marks=pytest.mark.slow)])
def test_new_known_bad_is_exact_at_the_quick_shapes(name):
    """Their bugs are invisible at the old toy shapes: that is why the full level exists."""
    assert grade(name, seed=0, level="quick").passed


# --------------------------------------------------------------------------------------------------
# The quick level: every built-in.

@pytest.mark.slow  # seed 0's grade, 100/100 and schema-valid, is in the default run through the CLI (test_rubric_cli)
@pytest.mark.parametrize("seed", [0, 1])
def test_reference_passes_every_check_at_the_quick_level(seed):
    card = grade("reference", seed=seed)
    assert card.passed, card.failed
    assert card.features == FEATURES  # the reference declares every feature: 8 points each past the base 100
    assert card.score == card.max_score == 100 + 8 * len(FEATURES)
    _validate([card])


# the slow run: every correct variant's whole quick card (the default run grades the reference's, above and
# in test_feature_builtins; the Pallas kernel's quick grade is test_build's real tiny run; flash-style's custom
# backward, test_floor_fairness)
@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in CORRECT if n != "reference"] + ["pallas", "flash"])
def test_correct_candidates_pass(name):
    card = grade(name, seed=0)
    assert card.passed, [(c.name, c.detail) for c in card.checks if not c.passed]


# Two whose grades cost the most (a custom backward, a jitter per call) run in the slow run only.
SLOW_BAD = {"ones-cotangent", "nondeterministic"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_BAD else n
                                  for n in BAD if n not in FULL_ONLY and n not in FEATURE_BAD])
def test_known_bad_candidate_fails_its_intended_check(name):
    """Graded on its intended checks alone (the whole card of every known-bad is the power sweep's)."""
    card = grade(name, seed=0, only=BUILTIN[name].catches)
    assert {c.name for c in card.checks} == set(BUILTIN[name].catches)
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


def test_contract_rules_are_named_when_broken():
    card = {c.name: c for c in grade("wrong-dtype", only=["output-shape-dtype"]).checks}
    assert "contract: the output has q's shape and dtype" in card["output-shape-dtype"].detail
    memo = {c.name: c for c in grade("memoizing", only=BUILTIN["memoizing"].catches).checks}
    assert any("a result kept by shape" in c.detail for c in memo.values() if not c.passed)


def test_padding_is_filled_with_large_finite_values():
    """The contract: padded K/V slots may hold any finite values; the check uses large ones."""
    ctx = C.Context(InProcessRunner(reference), 0, level="quick")
    p = ctx.problem(np.random.default_rng(0), "accum")
    hidden = np.arange(p.k.shape[1])[None, :] >= p.lengths[:, None]
    changed = C._perturb_keys(p, np.random.default_rng(1), hidden, "padding changed")
    v = changed.host("v")[hidden]
    assert changed.derived and hidden.any() and np.all(np.isfinite(v)) and np.abs(v).min() > 1e3
    assert np.array_equal(changed.host("v")[~hidden], p.host("v")[~hidden])


# --------------------------------------------------------------------------------------------------
# Fairness: per-query-head rounding of dK/dV at large groups.

@pytest.mark.parametrize("num_q_heads", [8, 32])
def test_per_head_rounded_dkv_passes_at_large_groups(num_q_heads):
    """FlashAttention-2-style backwards round each query head's dK/dV to bfloat16 before the group sum;
    the bound allows that rounding (``Problem.grouped_baseline``), and no trial is rejected."""
    runner = InProcessRunner(BUILTIN["per-head-dkv"].load())
    without = []
    for seed in range(3):
        p = problems.normal(np.random.default_rng(seed), Dims(1, 64, 200, num_q_heads, 1, 64), "bfloat16",
                            causal=seed % 2 == 0, grad=True)
        verdicts, violations, _ = C._gradient_verdicts(C.Context(runner, seed, "quick"), p)
        assert not violations and all(v.ok for v in verdicts), [v.describe() for v in verdicts if not v.ok]
        t = p.truth
        for i, name in ((2, "dk"), (3, "dv")):
            plain = tolerance.judge(name, runner.vjp(p)[i], getattr(t, name), p.baseline[i], "bfloat16",
                                    gradient=True, magnitude=t.magnitude[name])
            without.append(tolerance.needed_k(plain))
    # Without the grouped baseline the same results need a larger k than with it (the rounding is real).
    assert max(without) > 1.2
