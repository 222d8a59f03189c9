"""The serving and training slots of the full level (issue 24): drawn on every seed with the promised
shapes, dtypes, flags and kv_lengths (cheap, default run), and each known-bad built-in whose bug only
they show is caught by its intended check while the reference passes (slow: full-level grades)."""

import numpy as np
import pytest

from tpu_kernel_records_tools.grading.dense import checks as C
from tpu_kernel_records_tools.grading.dense import truth as oracle, slots
from tpu_kernel_records_tools.grading.candidates import BUILTIN
from tests.grading_inprocess import InProcessRunner, grade

SEEDS = range(20)
SERVING_BAD = ["batch-blocks-of-4", "long-cache-bf16-accumulator", "head-blocks-of-16", "prefill-top-left",
               "spec-decode-no-causal", "mha-d64-pairs", "skip-last-full-block"]


def _lengths(seed, slot):
    ctx = C.Context(InProcessRunner(None), seed)
    return ctx.problem(np.random.default_rng(seed), slot).lengths, ctx.shapes[slot]


@pytest.mark.parametrize("seed", SEEDS)
def test_serving_slots_are_drawn_on_every_seed(seed):
    s = slots.draw_shapes(seed, "full")
    flags = {n: slots.slot_flags(s, n) for n in s}
    # A serving batch of 8 with 8 distinct lengths, 0 and full among them, far apart.
    for slot in ("serve8", "spec"):
        lengths, d = _lengths(seed, slot)
        assert d.batch == 8 and len(set(lengths.tolist())) == 8 and {0, d.kv_len} <= set(lengths.tolist())
        assert np.diff(np.sort(lengths)).min() >= d.kv_len // 24, lengths
        assert flags[slot][1] and flags[slot][2]  # causal, kv_lengths
    assert s["serve8"].q_len == 1
    # Speculative decoding: 2-8 draft rows, causal, full and partial lengths.
    assert 2 <= s["spec"].q_len <= 8
    # A long bfloat16 KV cache: 8192-16384 keys, q_len <= 16, causal and padded (full and partial rows).
    long = s["longcache"]
    assert 8192 <= long.kv_len <= 16384 and long.q_len <= 16 and flags["longcache"][:3] == ("bfloat16", True, True)
    lengths, _ = _lengths(seed, "longcache")
    assert long.kv_len in lengths and lengths.min() > 4096 and lengths.min() < long.kv_len
    # 24, 40 and 64 query heads over 8 kv heads, and MHA with as many; MHA at head_dim 64 and 128.
    for h in (24, 40, 64):
        assert (s[f"heads{h}"].num_q_heads, s[f"heads{h}"].num_kv_heads) == (h, 8)
        assert s[f"mha{h}"].num_q_heads == s[f"mha{h}"].num_kv_heads == h
    mha = {d.head_dim for d in s.values() if d.num_q_heads == d.num_kv_heads >= 2}
    assert {64, 128} <= mha
    # Chunked prefill: q_len 2048 + r against kv_len q_len + r, causal.
    pre = s["prefill"]
    assert pre.q_len > 2048 and pre.kv_len > pre.q_len and flags["prefill"][1]
    assert pre.kv_len % 128 and (pre.kv_len - pre.q_len) % 128
    # Exact multiples of every tile, beside the ragged ones.
    exact = {(s[n].q_len, s[n].kv_len) for n in ("exact512", "exact2048", "exact4096")}
    assert {q for q, _ in exact} | {k for _, k in exact} == {512, 2048, 4096}
    assert all(q % 512 == 0 and k % 512 == 0 for q, k in exact)
    for slot in slots.SERVING_SLOTS:
        assert slot in slots.SLOT_FLAGS
        if not slot.startswith("exact"):
            assert s[slot].kv_len % 128, slot


def test_the_quick_level_has_no_serving_slot():
    assert not set(slots.SERVING_SLOTS) & set(slots.draw_shapes(0, "quick"))


def test_the_old_slots_are_drawn_as_before():
    """The serving slots come from a generator of their own: the earlier slots (and their calibration) stay."""
    s = slots.draw_shapes(0, "full")
    assert s["long"] == slots.Dims(1, 1143, 1166, 2, 1, 64) and s["gqa"] == slots.Dims(1, 54, 344, 16, 2, 64)


@pytest.mark.parametrize("causal, lengths", [(True, None), (True, [0, 7]), (False, [3, 5]), (True, [9, 9])])
def test_truth_skips_rows_and_keys_as_the_dense_computation(causal, lengths):
    """The oracle leaves out rows ahead of every key and keys past every length; the results are the dense
    ones (to float64 rounding: a shorter key axis may sum in another order)."""
    rng = np.random.default_rng(0)
    q, ct = rng.standard_normal((2, 30, 4, 8)), rng.standard_normal((2, 30, 4, 8))
    k, v = rng.standard_normal((2, 12, 2, 8)), rng.standard_normal((2, 12, 2, 8))
    got = oracle.attention(q, k, v, ct, causal=causal, kv_lengths=lengths, per_head=True)
    vis = oracle.visible_keys(2, 30, 12, causal, None if lengths is None else np.asarray(lengths))
    dense = oracle._attention(q, k, v, ct, vis, 8 ** -0.5, np.float64, True, True)
    for name in ("out", "dq", "dk", "dv", "probs"):
        assert np.allclose(getattr(got, name), getattr(dense, name), rtol=1e-13, atol=1e-15), name
    assert got.logit_max == pytest.approx(dense.logit_max, rel=1e-14)
    for a, b in zip(got.per_head_dkv, dense.per_head_dkv):
        assert np.allclose(a, b, rtol=1e-13, atol=1e-15)


def test_values_along_keys_leave_a_correct_kernel_exact():
    """The long-cache precision probe: fp32 accumulation returns V's value exactly; bf16 running sums drift."""
    ctx = C.Context(InProcessRunner(BUILTIN["online-softmax"].load()), 0)
    p = C._values_along_keys(ctx.problem(ctx.rng("forward-accuracy", 20), "longcache"))
    assert C._judge_out(p, ctx.runner.forward(p)).ok
    bad = C.Context(InProcessRunner(BUILTIN["long-cache-bf16-accumulator"].load()), 0)
    assert not C._judge_out(p, bad.runner.forward(p)).ok


@pytest.mark.slow
@pytest.mark.parametrize("name", SERVING_BAD)
def test_serving_known_bad_is_caught_by_its_check(name):
    card = grade(name, seed=0, level="full", only=BUILTIN[name].catches)
    failed = [c.name for c in card.checks if not c.passed]
    assert set(failed) & set(BUILTIN[name].catches), [(c.name, c.detail) for c in card.checks]


@pytest.mark.slow
def test_reference_passes_the_serving_slots():
    card = grade("reference", seed=1, level="full", only=("forward-accuracy", "gradients", "causal-leak",
                                                          "padding-leak", "empty-rows", "gqa-mapping"))
    assert all(c.passed for c in card.checks), [(c.name, c.detail) for c in card.checks if not c.passed]


@pytest.mark.parametrize("name", SERVING_BAD)
def test_serving_known_bad_is_exact_at_the_quick_shapes(name):
    """Their bugs live only at the serving and training shapes: the checks that catch them at the full level
    pass at the quick level's shapes."""
    if name == "spec-decode-no-causal":
        pytest.skip("the quick shape C has q_len 8, a speculative length")
    card = grade(name, seed=0, level="quick", only=BUILTIN[name].catches)
    assert {c.name for c in card.checks} == set(BUILTIN[name].catches) and card.passed
