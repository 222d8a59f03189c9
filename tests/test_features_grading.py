"""Declared features (issue 34): the contract's validation, the declaration's path from a candidate's
function through its sandboxed worker to the scorecard, and the probes the features' slots promise
(``grading.dense.slots.draw_feature_slots``'s table), for seeds 0-2 at the full level."""

from __future__ import annotations

import functools
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpu_kernel_records_tools.grading.dense import checks as C
from tpu_kernel_records_tools.grading.dense import truth as oracle
from tpu_kernel_records_tools.grading.dense.feature_checks import FEATURE_CHECKS, feature_problem
from tpu_kernel_records_tools.grading.rubric import checks_for
from tpu_kernel_records_tools.grading.runner import Runner
from tpu_kernel_records_tools.grading.dense.feature_variants import _blocks_skipped
from tpu_kernel_records_tools.grading.dense.slots import BLOCK_SIZES, draw_feature_slots
from kernel_src import contract
from kernel_src.reference import reference_attention

SEEDS = (0, 1, 2)


# -- the contract ---------------------------------------------------------------------------------

def test_features_are_declared_once_and_named_alike_everywhere():
    assert contract.FEATURES == ("window", "softcap", "segments", "sinks")
    assert tuple(FEATURE_CHECKS) == contract.FEATURES
    assert [c.name for c in checks_for(())] == [c.name for c in C.CHECKS]
    assert [c.name for c in checks_for(("window", "sinks"))][-2:] == ["window", "sinks"]
    assert contract.declared_features(reference_attention) == contract.FEATURES


@pytest.mark.parametrize("given, error", [
    ((-1, 0), "no -1 sentinel"), ((0, -1), "no -1 sentinel"), ((1.5, 0), "int >= 0 or None"),
    ((True, 0), "int >= 0 or None"), (5, "a pair"), ((1, 2, 3), "a pair")])
def test_window_size_is_a_pair_of_non_negative_ints_or_none(given, error):
    with pytest.raises(ValueError, match=error):
        contract.check_window(given)


def test_windows_that_are_allowed():
    assert contract.check_window(None) is None
    assert contract.check_window((None, 0)) == (None, 0)
    assert contract.check_window((np.int32(4095), 0)) == (4095, 0)


def test_declarations_are_validated_and_put_in_canonical_order():
    @contract.supports("sinks", "window")
    def kernel(q, k, v, **_):
        return q
    assert kernel.features == ("window", "sinks")
    with pytest.raises(ValueError, match="unknown feature 'alibi'"):
        contract.supports("alibi")
    kernel.features = "window"  # a string, not a tuple of names
    with pytest.raises(ValueError, match="a tuple of names"):
        contract.declared_features(kernel)
    kernel.features = None
    assert contract.declared_features(kernel) == ()


def _qkv(b=2, lq=3, lk=5, hq=4, hk=2, d=8):
    rng = np.random.default_rng(0)
    return tuple(jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((b, lq, hq, d), (b, lk, hk, d), (b, lk, hk, d)))


@pytest.mark.parametrize("kwargs, error", [
    ({"q_segment_ids": jnp.zeros((2, 3), jnp.int32)}, "both or neither"),
    ({"q_segment_ids": jnp.zeros((2, 3), jnp.int32), "kv_segment_ids": jnp.zeros((2, 4), jnp.int32)},
     r"kv_segment_ids must have shape \[batch, len\]=\(2, 5\)"),
    ({"q_segment_ids": jnp.zeros((2, 3)), "kv_segment_ids": jnp.zeros((2, 5), jnp.int32)}, "integer"),
    ({"sinks": jnp.zeros(2)}, r"sinks must have shape \[num_q_heads\]=\(4,\)"),
    ({"sinks": jnp.zeros(4, jnp.int32)}, "float"),
    ({"softcap": 0.0}, "softcap must be a finite float > 0"),
    ({"softcap": float("inf")}, "softcap must be a finite float > 0"),
    ({"window_size": (-1, -1)}, "no -1 sentinel"),
])
def test_the_reference_refuses_malformed_feature_arguments_with_one_line(kwargs, error):
    q, k, v = _qkv()
    with pytest.raises((ValueError, TypeError), match=error):
        reference_attention(q, k, v, **kwargs)


# -- the declaration's path through the sandbox -----------------------------------------------------

CANDIDATE = '''
from kernel_src.reference import reference_attention

def attention(q, k, v, *, causal=False, kv_lengths=None, scale=None, sinks=None):
    return reference_attention(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale, sinks=sinks)

attention.features = {features}
'''


def _runner(tmp_path, features: str) -> Runner:
    path = tmp_path / "kernel.py"
    path.write_text(textwrap.dedent(CANDIDATE.format(features=features)))
    return Runner(f"{path}:attention", time_limit_s=120, isolation="process")


def test_a_declared_feature_reaches_the_worker_and_its_arguments_reach_the_candidate(tmp_path):
    runner = _runner(tmp_path, '("sinks",)')
    try:
        assert runner.start() is None
        assert runner.features == ("sinks",)
        ctx = C.Context(runner, 0, level="quick")
        p = feature_problem(ctx, np.random.default_rng(0), "sinks/random")
        out, dq, dk, dv, dsinks = runner.vjp(p)
        assert dsinks.shape == p.sinks.shape and np.any(dsinks != 0)
        assert np.allclose(dsinks, p.truth.dsinks, rtol=1e-4, atol=1e-5)
        assert np.allclose(out, p.truth.out, rtol=1e-4, atol=1e-5)
        plain = C.normal(np.random.default_rng(1), "A", "float32", causal=True)
        runner.forward(plain)  # a base problem: no feature argument is passed (the signature has no window)
    finally:
        runner.close()


@pytest.mark.parametrize("features, error", [('("alibi",)', "unknown feature 'alibi'"),
                                             ('"sinks"', "a tuple of names")])
def test_a_malformed_declaration_is_a_load_error(tmp_path, features, error):
    runner = _runner(tmp_path, features)
    try:
        down = runner.start()
        assert down is not None and error in down and "declared features" in down
    finally:
        runner.close()


# -- the probes the slots promise ------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _problems(seed: int) -> dict:
    ctx = C.Context(None, seed, level="full")
    return {name: feature_problem(ctx, np.random.default_rng([seed, n]), name)
            for n, name in enumerate(draw_feature_slots(seed, "full"))}


def _visible(p) -> np.ndarray:
    """Bool ``[batch, q_len, kv_len]`` of ``p``'s mask (the truth's, without computing the truth)."""
    b, lq = p.q.shape[:2]
    return oracle.visible_keys(b, lq, p.k.shape[1], p.causal, p.lengths, p.window, p.q_segments, p.kv_segments)


def _logits(p) -> np.ndarray:
    """Uncapped ``scale * q.k``, ``[b, hq, q, k]``."""
    group = p.group
    k = np.repeat(p.host("k"), group, axis=2)
    scale = p.q.shape[-1] ** -0.5 if p.scale is None else p.scale
    return np.einsum("bqhd,bkhd->bhqk", p.host("q").astype(np.float64), k.astype(np.float64)) * scale


@pytest.mark.parametrize("seed", SEEDS)
def test_the_window_slots_probe_what_the_issue_lists(seed):
    ps = _problems(seed)
    train, wide = ps["window/train"], ps["window/wide"]
    assert (train.window, wide.window) == ((127, 0), (128, 0)) and train.q.shape == wide.q.shape
    assert train.k.shape[1] > 3 * 128 and train.causal and train.ct is not None
    chunk, decode = ps["window/chunk"], ps["window/decode"]
    assert chunk.window == (1023, 0) and chunk.k.shape[1] > 3 * 1024 and 1 < chunk.q.shape[1] < 1023
    assert decode.window == (4095, 0) and decode.q.shape[1] == 1 and decode.k.shape[1] > 3 * 4096
    seen = _visible(decode).any(axis=2)[:, 0]
    assert seen.any() and not seen.all() and decode.lengths is not None  # rows with and without keys
    assert ps["window/short"].k.shape[1] < ps["window/short"].window[0] + 1
    assert ps["window/all"].window[0] >= ps["window/all"].k.shape[1] - 1 and ps["window/all"].causal
    assert ps["window/self"].window == (0, 0) and not ps["window/self"].causal
    odd = ps["window/odd"]
    assert all(side % 128 for side in odd.window) and not odd.causal
    hidden = ~_visible(odd).any(axis=1)[0]
    assert hidden[:128].all()  # a whole leading key block of every tile size up to 128 is masked for every row
    ahead = ps["window/ahead"]
    assert ahead.q.shape[1] > ahead.k.shape[1] and (~_visible(ahead).any(axis=2)).any()
    readout = ps["window/readout"]
    assert readout.k.shape[1] <= readout.q.shape[-1] and readout.lengths is not None and readout.window[0] > 0


@pytest.mark.parametrize("seed", SEEDS)
def test_the_softcap_slots_put_logits_far_past_the_cap(seed):
    ps = _problems(seed)
    for name, cap in (("softcap/cap5", 5.0), ("softcap/cap50", 50.0), ("softcap/d256", 50.0)):
        p = ps[name]
        assert p.softcap == cap
        assert np.max(np.abs(_logits(p))) > 2 * cap, name
    assert ps["softcap/cap50"].scale == pytest.approx(144 ** -0.5) and ps["softcap/cap50"].dtype == "bfloat16"
    assert ps["softcap/cap5"].lengths is not None and ps["softcap/cap5"].causal  # cap with masking
    assert ps["softcap/huge"].softcap >= 1e30


@pytest.mark.parametrize("seed", SEEDS)
def test_the_segment_slots_probe_what_the_issue_lists(seed):
    ps = _problems(seed)
    packed = ps["segments/packed"]
    for ids in packed.kv_segments:
        sizes = np.bincount(ids)
        assert 4 <= len(sizes) <= 16 and sizes.min() == 1  # one single-key document
        starts = np.flatnonzero(np.diff(ids)) + 1
        assert any(s % 128 for s in starts)
    repeat = ps["segments/repeat"]
    runs = [int(x) for x, n in zip(repeat.kv_segments[0], np.r_[1, np.diff(repeat.kv_segments[0])]) if n]
    assert len(runs) > len(set(runs))  # an id that comes back (A B A)
    cross = ps["segments/cross"]
    assert cross.q.shape[1] != cross.k.shape[1]
    assert not np.isin(cross.q_segments, cross.kv_segments).all()  # a query id that no key has
    assert (~_visible(cross).any(axis=2)).any()
    equal = ps["segments/equal"]
    assert len(np.unique(equal.q_segments)) == 1 and np.array_equal(np.unique(equal.q_segments),
                                                                    np.unique(equal.kv_segments))


def _packed_cache_problems(level: str, seed: int) -> tuple:
    if level == "full":
        return _problems(seed)["segments/chunk"], _problems(seed)["segments/decode"]
    ctx = C.Context(None, seed, level=level)
    return tuple(feature_problem(ctx, np.random.default_rng([seed, n]), f"segments/{name}")
                 for n, name in enumerate(("chunk", "decode")))


@pytest.mark.parametrize("level, seed", [("quick", 0), *(("full", s) for s in SEEDS)])
def test_the_packed_cache_slots_catch_a_block_skip_decided_from_one_key(level, seed):
    """Issue 51: chunked prefill and decoding over a packed cache, the documents before the queries' only among
    the keys, a document starting 1-3 keys past every block size that fits; whichever block size (16-512) and
    whichever key decides (first or last), skipping the blocks whose deciding key's id no query has hides a key
    that some row sees, in one of the two slots."""
    chunk, decode = _packed_cache_problems(level, seed)
    lk, lq = chunk.k.shape[1], chunk.q.shape[1]
    assert lq < lk and chunk.causal and chunk.ct is not None and chunk.lengths is None
    for q_ids, kv_ids in zip(chunk.q_segments, chunk.kv_segments):
        assert np.array_equal(q_ids, kv_ids[lk - lq:]) and not np.isin(kv_ids[:lk - lq], q_ids).all()
        starts = np.flatnonzero(np.diff(kv_ids)) + 1
        for size in BLOCK_SIZES:
            assert size + 3 >= lk - lq or ((starts > size) & (starts <= size + 3)).any(), (size, starts)
    assert decode.q.shape[1] < decode.k.shape[1] and decode.lengths is not None
    for q_ids, kv_ids, n in zip(decode.q_segments, decode.kv_segments, decode.lengths):
        assert (q_ids == kv_ids[n - 1]).all() and not np.isin(kv_ids[n:], kv_ids[:n]).any() and n < len(kv_ids)
        assert any(0 < n - size * 2 ** k < 8 for size in BLOCK_SIZES for k in range(2)), n
    for size in BLOCK_SIZES:
        for block in (size, -size):
            assert _skip_hides_a_visible_key(chunk, block) or _skip_hides_a_visible_key(decode, block), block
    assert _skip_hides_a_visible_key(chunk, 128)  # the hidden kernel's bug shows in chunked prefill, without padding


_jitted_blocks_skipped = jax.jit(_blocks_skipped)


def _skip_hides_a_visible_key(p, block: int) -> bool:
    """Whether skipping ``block``-key blocks from one key (``feature_variants._blocks_skipped``) hides a key a row
    sees."""
    skipped = _jitted_blocks_skipped(p.q_segments, p.kv_segments, np.int32(block))  # one program, not one an op
    return bool((_visible(p) & np.asarray(skipped)[:, None, :]).any())


@pytest.mark.parametrize("seed", SEEDS)
def test_the_sink_slots_probe_what_the_issue_lists(seed):
    ps = _problems(seed)
    random = ps["sinks/random"]
    groups = random.sinks.reshape(random.k.shape[2], -1)
    assert all(len(np.unique(g)) == len(g) for g in groups) and random.ct is not None and random.dtype == "float32"
    high = ps["sinks/high"]
    top = np.abs(_logits(high)).max(axis=(0, 2, 3))
    assert np.all(high.sinks > top + 30)
    assert (~_visible(high).any(axis=2)).any()  # a fully masked row with a sink
    low = ps["sinks/low"]
    assert np.all(low.sinks < -np.abs(_logits(low)).max() - 30)
    assert np.all(ps["sinks/off"].sinks <= -1e30)


def test_measure_grades_a_known_bad_on_the_feature_its_bug_is_in(monkeypatch):
    """A measured kernel is graded on every feature it declares; a known-bad on its intended checks' features."""
    from tpu_kernel_records_tools.grading import rubric
    from tpu_kernel_records_tools.measure import run as run_module

    asked = {}

    class Card:
        def __init__(self, name):
            self.name = name

        def to_dict(self):
            return {"candidate": self.name}

    def fake_grade(name, *, seed, level, features):
        asked[name] = (level, features)
        return Card(name)

    monkeypatch.setattr(rubric, "grade", fake_grade)
    cards = run_module.grade(["reference"], seed=0, progress=False, known_bad=["sinks-scaled", "nan-first-block", "zeros"],
                             kernel_level="full")
    assert [c["candidate"] for c in cards] == ["reference", "sinks-scaled", "nan-first-block", "zeros"]
    assert asked == {"reference": ("full", None), "sinks-scaled": ("quick", ["sinks"]),
                     "nan-first-block": ("quick", ["window", "segments"]), "zeros": ("quick", [])}


@pytest.mark.parametrize("level", ["quick", "full"])
def test_the_window_leak_probes_change_keys_that_no_row_sees(level):
    """The window check's leak probes (window/chunk, window/odd) hide real keys from every row, and change them."""
    from tpu_kernel_records_tools.grading.dense.feature_checks import _hidden_from_all
    from tpu_kernel_records_tools.grading.dense.checks import _perturb_keys

    ctx = C.Context(None, 0, level=level)
    for name in ("window/chunk", "window/odd"):
        rng = np.random.default_rng(1)
        p = feature_problem(ctx, rng, name, grad=False)
        hidden = _hidden_from_all(p)
        assert hidden.sum() >= 2, name
        assert not (hidden[:, :, None] & _visible(p).transpose(0, 2, 1)).any()  # no row sees them
        changed = _perturb_keys(p, rng, hidden, "changed")
        moved = np.any(changed.host("v") != p.host("v"), axis=(2, 3))
        assert np.array_equal(moved, hidden), name


@pytest.mark.parametrize("level", ["quick", "full"])
def test_the_softcap_leak_probe_changes_padding_only(level):
    from tpu_kernel_records_tools.grading.dense.feature_checks import padding_under_cap

    kind, p, changed, rows, _ = padding_under_cap(C.Context(None, 0, level=level), np.random.default_rng(2))
    assert kind == "leak" and p.softcap == 5.0 and rows.all()
    padding = np.arange(p.k.shape[1])[None, :] >= p.lengths[:, None]
    moved = np.any(changed.host("k") != p.host("k"), axis=(2, 3))
    assert padding.any() and np.array_equal(moved, padding)
