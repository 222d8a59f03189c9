"""The flash kernels' contract features (issue 35): sliding windows, the soft-cap, segment ids and
sinks, in both families (Mosaic and Triton, interpret mode on this CPU), forward and backward, and
the block skipping that windows and segment ids allow.

Accuracy is judged as the rubric judges it (``grading.dense.truth``'s float64 truth, the tolerance
policy's bounds, exact zeros on rows that see no key and on keys no row sees; dsinks too), through
the grader's own ``_gradient_verdicts``.

The default run compiles one forward + VJP per family with every feature at once (a two-sided
window, a cap, segment ids, a sink per query head, kv_lengths) and runs it three times: on data
where every feature matters (a query id that no key has, sinks of both signs); with all ids equal
and sinks of -1e30 (the window and cap alone, judged against their truth without the other two);
and with NaN planted where only skipped blocks would read it (keys outside every row's window;
keys and queries in blocks whose segment ids cannot match): a computed-but-masked tile multiplies
``0 * NaN`` into its accumulators, so finite results prove the blocks were not computed. The
block ranges are checked against the contract's mask tile by tile, and the kernels' own grids and
index maps at a 4,096-key window over 32,768 keys read about an eighth of the key blocks.

The slow run takes each feature alone (causal, bfloat16 and grouped heads among them), the Mosaic
kernels in TPU interpret mode (NaN-filled memory, race detection), and grades ``flash`` and
``flash-triton`` with the rubric's feature checks at the full level on seed 0 (seeds 1 and 2 with
``TPU_KERNEL_RECORDS_ALL_SEEDS=1``: ``tests/seeds.py``).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_src.backend import tpu_interpret_races_found
from kernel_src.contract import FEATURES, declared_features, visible
from kernel_src.flash import FlashBlockSizes, flash_attention, plan as flash_plan, tpu as flash_tpu
from kernel_src.flash import block_skipping
from tpu_kernel_records_tools.grading.dense import checks as C
from tpu_kernel_records_tools.grading.dense.feature_checks import _empty_row_violations
from tpu_kernel_records_tools.grading.dense.problems import Problem
from tests.seeds import full_level_seeds

VARIANTS = ("mosaic", "triton")
BLOCKS = FlashBlockSizes(*(16,) * 6)  # a power of two, as Triton takes; any multiple of 8 for Mosaic

# The default run's problem: 2/1 heads, head_dim 16; 40 queries (3 blocks, the last padded) at
# positions 32..71 against 72 keys (5 blocks); not causal, window (10, 5): row i sees keys
# i + 22 .. i + 37, so keys 0..21 (block 0 whole) are outside every window. Batch 1's 50 keys
# leave rows 28.. without a visible key.
BATCH, Q_LEN, KV_LEN, Q_HEADS, KV_HEADS, HEAD_DIM = 2, 40, 72, 2, 1, 16
WINDOW, SOFTCAP = (10, 5), 4.0
LENGTHS = np.asarray([72, 50], np.int32)
# Segment ids: query block 0 (rows 0..15) holds id 5, the rest id 1 (rows 20, 21: id 0, which no key
# has); key blocks 0, 1 and 3 (keys 0..31, 48..63) id 5, the others id 1. So of its window's key
# blocks 1..3 query block 0 needs 1 and 3 only (block 0, outside every window, only its ids would
# let in), and key blocks 1 and 3 are needed by query block 0 only.
Q_IDS = np.asarray([5] * 16 + [1] * 4 + [0] * 2 + [1] * 18, np.int32)
KV_IDS = np.asarray([5] * 32 + [1] * 16 + [5] * 16 + [1] * 8, np.int32)


def _arrays(seed: int = 0, dtype=np.float32, batch=BATCH, q_len=Q_LEN, kv_len=KV_LEN,
            q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM):
    """NumPy float32 ``(q, k, v, ct)``."""
    rng = np.random.default_rng(seed)
    shapes = [(batch, q_len, q_heads, head_dim), (batch, kv_len, kv_heads, head_dim),
              (batch, kv_len, kv_heads, head_dim), (batch, q_len, q_heads, head_dim)]
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def _program(variant: str, *, causal: bool, window, softcap, segments: bool, sinks: bool,
             interpret=True):
    """One jitted ``(out, dq, dk, dv, dsinks)`` of ``flash_attention`` with the features set
    (window and cap static; ids and sinks arrays, so one program serves every value)."""

    @jax.jit
    def run(q, k, v, ct, lengths, q_ids, kv_ids, sink):
        arrays = {}
        if segments:
            arrays.update(q_segment_ids=q_ids, kv_segment_ids=kv_ids)

        def attend(q, k, v, sink):
            extra = {"sinks": sink} if sinks else {}
            return flash_attention(q, k, v, causal=causal, kv_lengths=lengths, window_size=window,
                                   softcap=softcap, **arrays, **extra, block_sizes=BLOCKS,
                                   interpret=interpret, variant=variant)

        out, pull = jax.vjp(attend, q, k, v, sink)
        return (out, *pull(ct.astype(out.dtype)))
    return run


def _problem(label, dtype, q, k, v, ct, *, causal, lengths, window=None, softcap=None,
             q_ids=None, kv_ids=None, sinks=None) -> Problem:
    batch = q.shape[0]
    q_seg = None if q_ids is None else np.broadcast_to(q_ids, (batch, q.shape[1]))
    kv_seg = None if kv_ids is None else np.broadcast_to(kv_ids, (batch, k.shape[1]))
    return Problem(label, dtype, q, k, v, ct=ct, causal=causal, kv_lengths=lengths, window=window,
                   softcap=softcap, q_segments=q_seg, kv_segments=kv_seg, sinks=sinks)


class _Given:
    """A runner whose VJP is a result already computed (the grader's verdicts, nothing else)."""

    def __init__(self, result):
        self.result = result

    def vjp(self, p):
        return self.result


def _assert_judged_accurate(p: Problem, results) -> None:
    """The rubric's verdicts on out, dQ, dK, dV (and dsinks with sinks), its exact zeros (dK, dV of
    keys no row sees; out and dQ of rows that see no key), all as the feature checks judge them."""
    results = tuple(np.asarray(x) for x in results)
    verdicts, violations, _ = C._gradient_verdicts(C.Context(_Given(results), 0), p)
    violations += _empty_row_violations(p, results[0], results[1])
    failed = [v.describe() for v in verdicts if not v.ok]
    assert not failed and not violations, (failed, violations)
    if p.sinks is not None and p.dtype == "float32":
        assert any(v.label.endswith("dsinks") for v in verdicts)


def _run(program, q, k, v, ct, lengths, q_ids, kv_ids, sinks):
    def ids(x, length):
        return jnp.asarray(np.broadcast_to(x, (q.shape[0], length)).astype(np.int32))
    return jax.block_until_ready(program(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(ct), jnp.asarray(lengths),
        ids(q_ids, q.shape[1]), ids(kv_ids, k.shape[1]), jnp.asarray(sinks, jnp.float32)))


@pytest.mark.parametrize("variant", ["triton", *(pytest.param(v, marks=pytest.mark.slow)
                                                  for v in ("mosaic", "mosaic-no-table"))])
def test_every_feature_at_once_in_one_program(variant, monkeypatch):
    """Every feature matters; then the window and cap alone; then NaN where only skipped blocks
    would read it (keys outside every window; blocks whose ids cannot match). "mosaic-no-table":
    the Mosaic walk where a block table would not fit SMEM (id-disjoint blocks not computed)."""
    if variant == "mosaic-no-table":
        monkeypatch.setattr(flash_tpu, "TABLE_BYTES", 0)
        jax.clear_caches()  # the jitted entry's programs with tables
        variant = "mosaic"
    program = _program(variant, causal=False, window=WINDOW, softcap=SOFTCAP, segments=True,
                       sinks=True)
    q, k, v, ct = _arrays()
    q *= 3  # logits past the cap of 4
    sinks = np.asarray([1.5, -2.0], np.float32)  # they differ within the kv group
    flags = dict(causal=False, lengths=LENGTHS, window=WINDOW, softcap=SOFTCAP)

    results = _run(program, q, k, v, ct, LENGTHS, Q_IDS, KV_IDS, sinks)
    p = _problem("every feature", "float32", q, k, v, ct, q_ids=Q_IDS, kv_ids=KV_IDS, sinks=sinks,
                 **flags)
    empty = ~p.truth.visible.any(axis=2)
    assert empty[:, 20:22].all() and empty[1, 28:].all() and not empty[0, :10].any()
    _assert_judged_accurate(p, results)

    results = _run(program, q, k, v, ct, LENGTHS, np.full(Q_LEN, 3), np.full(KV_LEN, 3),
                   np.full(2, -1e30, np.float32))
    _assert_judged_accurate(_problem("window and cap alone", "float32", q, k, v, ct, **flags),
                            results[:4] + (None,))
    assert not np.any(np.asarray(results[4]))  # sinks of -1e30 take no probability

    bad_q, bad_k, bad_v, bad_ct = (x.copy() for x in (q, k, v, ct))
    bad_k[:, :16] = bad_v[:, :16] = np.nan  # key block 0: outside every row's window
    bad_k[:, 32:48] = bad_v[:, 32:48] = np.nan  # key block 2, id 1: hidden from query block 0
    bad_q[:, 16:] = bad_ct[:, 16:] = np.nan  # ids 1 and 0: hidden from key blocks 1 and 3
    out, dq, dk, dv, _ = (np.asarray(x) for x in _run(program, bad_q, bad_k, bad_v, bad_ct,
                                                      LENGTHS, Q_IDS, KV_IDS, sinks))
    truth, rows, keys = p.truth, np.s_[:, :16], np.r_[16:32, 48:64]
    for name, got, want in (("out", out[rows], truth.out[rows]), ("dq", dq[rows], truth.dq[rows]),
                            ("dk", dk[:, keys], truth.dk[:, keys]),
                            ("dv", dv[:, keys], truth.dv[:, keys])):
        assert np.isfinite(got).all(), f"{variant} {name}: a skipped block was computed"
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5, err_msg=name)
    assert np.isnan(out[0, 16:20]).all(), "the planted NaN must reach rows that see it"
    assert np.isnan(dk[0, 32:48]).all() and np.isnan(dk[0, 64:]).all()


def test_block_ranges_are_exactly_the_tiles_holding_a_visible_pair():
    """``key_block_range`` / ``query_block_range`` hold a block iff some (real row, key) pair of the
    tile is visible under the contract's mask (windows one- and two-sided, (0, 0), causal, rows
    ahead of every key, kv_lengths, a length of 0); ``whole_tile`` iff every pair is and no row is
    padding; the static walks are the widest ranges."""
    cases = [(40, 72, False, (10, 5)), (40, 72, True, (10, None)), (72, 40, True, (7, None)),
             (33, 33, False, (0, 0)), (50, 30, False, (None, 3)), (24, 64, True, None),
             (64, 64, True, (16, 0)), (17, 90, False, (40, 40))]
    for (q_len, kv_len, causal, window), (bq, bk), length in itertools.product(
            cases, [(8, 16), (16, 8), (8, 8)], ["full", "part", 0]):
        length = {"full": kv_len, "part": kv_len * 2 // 3}.get(length, length)
        plan = flash_plan.Plan(q_len, kv_len, 2, 1, causal, 1.0, BLOCKS, "mosaic", True,
                               window=window)
        mask = visible(np.arange(q_len)[:, None], np.arange(kv_len)[None, :], q_len, kv_len, causal,
                       length, window)  # the contract's predicate, on NumPy grids
        nq, nk = -(-q_len // bq), -(-kv_len // bk)
        tiles = np.zeros((nq * bq, nk * bk), bool)  # padding rows and keys: not visible
        tiles[:q_len, :kv_len] = mask
        tiles = tiles.reshape(nq, bq, nk, bk)
        needed, whole = tiles.any(axis=(1, 3)), tiles.all(axis=(1, 3))
        got = block_skipping.whole_tile(np.arange(nq)[:, None], np.arange(nk)[None, :], bq, bk, length, plan)
        np.testing.assert_array_equal(np.broadcast_to(got, whole.shape), whole)
        lo, hi = (np.asarray(x) for x in block_skipping.key_block_range(np.arange(nq), length, bq, bk, plan))
        ki = np.arange(nk)
        np.testing.assert_array_equal((ki >= lo[:, None]) & (ki < hi[:, None]), needed,
                                      err_msg=str((q_len, kv_len, causal, window, bq, bk, length)))
        lo, hi = (np.asarray(x) for x in block_skipping.query_block_range(ki, length, bq, bk, plan))
        qi = np.arange(nq)
        np.testing.assert_array_equal((qi >= lo[:, None]) & (qi < hi[:, None]), needed.T,
                                      err_msg=str((q_len, kv_len, causal, window, bq, bk, length)))
        if length == kv_len:
            assert block_skipping.max_key_steps(bq, bk, nq, nk, plan) == max(1, needed.sum(1).max())
            assert block_skipping.max_query_steps(bq, bk, nq, nk, plan) == max(1, needed.sum(0).max())


def test_segment_tables_keep_every_block_a_row_may_see_and_pass_over_the_others():
    """``needed_blocks`` with segment ids keeps every tile holding a visible pair (ids equal,
    window, lengths) and drops a tile whose blocks' id ranges do not overlap; ``block_table``
    lists each outer block's needed blocks in order, then repeats its last."""
    plan = flash_plan.Plan(Q_LEN, KV_LEN, 2, 1, False, 1.0, BLOCKS, "mosaic", True, window=WINDOW,
                           segments=True)
    q_ids, kv_ids = (np.broadcast_to(x, (2, x.size)) for x in (Q_IDS, KV_IDS))
    pad = lambda x, n: np.pad(x, ((0, 0), (0, n - x.shape[1])))  # noqa: E731
    q_pad, kv_pad = pad(q_ids, 48), pad(kv_ids, 80)
    mask = visible(np.arange(Q_LEN)[None, :, None], np.arange(KV_LEN)[None, None, :], Q_LEN, KV_LEN,
                   False, LENGTHS[:, None, None], WINDOW, q_ids[:, :, None], kv_ids[:, None, :])
    for by_key in (False, True):
        needed = np.asarray(block_skipping.needed_blocks(LENGTHS, q_pad, kv_pad, 16, 16, plan,
                                                         by_key))
        exact = np.zeros((2, 3, 5), bool)
        for b, qi, ki in itertools.product(range(2), range(3), range(5)):
            exact[b, qi, ki] = mask[b, qi * 16:(qi + 1) * 16, ki * 16:(ki + 1) * 16].any()
        exact = exact.transpose(0, 2, 1) if by_key else exact
        assert not (exact & ~needed).any()  # every block a row may see is kept
        np.testing.assert_array_equal(needed, exact)  # these ids' ranges are exact
    needed = block_skipping.needed_blocks(LENGTHS, q_pad, kv_pad, 16, 16, plan)
    assert needed[0].astype(int).tolist() == [[0, 1, 0, 1, 0], [0, 0, 1, 0, 1], [0, 0, 0, 0, 1]]
    assert needed[1].astype(int).tolist() == [[0, 1, 0, 1, 0], [0, 0, 1, 0, 0], [0, 0, 0, 0, 0]]
    table, count = block_skipping.block_table(needed, 3)
    assert count.tolist() == [[2, 2, 1], [2, 1, 0]]
    assert table[0].tolist() == [[1, 3, 3], [2, 4, 4], [4, 4, 4]]
    assert table[1].tolist() == [[1, 3, 3], [2, 2, 2], [0, 0, 0]]

    # whole tiles (no mask, no where) with ids: exactly those whose two blocks hold one id, and
    # every pair visible otherwise (causal, packed documents of 24, 9 and 7 positions, blocks of 8)
    plan = flash_plan.Plan(40, 40, 2, 1, True, 1.0, BLOCKS, "mosaic", True, segments=True)
    ids = np.repeat(np.arange(3, dtype=np.int32), [24, 9, 7])[None]
    walk = flash_tpu.Walk(plan, 8, 8, 5, 5, by_key=False)
    pre = walk.arrays(np.asarray([40], np.int32), (ids, ids))
    got = walk.whole(0, np.arange(5)[:, None], np.arange(5)[None, :], pre)
    mask = visible(np.arange(40)[:, None], np.arange(40)[None, :], 40, 40, True, 40, None,
                   ids[0][:, None], ids[0][None, :])
    whole = mask.reshape(5, 8, 5, 8).all(axis=(1, 3))
    np.testing.assert_array_equal(got, whole)
    assert whole.sum() == 3  # tiles (1, 0), (2, 0), (2, 1): document 0's, below the diagonal


def _fetches(index_map, grid, pre) -> int:
    """Blocks an input's pipeline fetches over ``grid``: one each time its block index changes
    between consecutive steps (every index map evaluated at once on the grid's index arrays)."""
    steps = np.stack(np.meshgrid(*(np.arange(n) for n in grid), indexing="ij"), -1).reshape(-1, len(grid))
    blocks = np.stack([np.broadcast_to(np.asarray(x), len(steps))
                       for x in index_map(*steps.T, *pre)], -1)
    return 1 + int(np.any(blocks[1:] != blocks[:-1], axis=1).sum())


def _pallas_grids(jaxpr) -> list[tuple[int, ...]]:
    """The grids of the ``pallas_call``s in ``jaxpr`` and the jaxprs its equations hold, in order."""
    grids = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            grids.append(tuple(eqn.params["grid_mapping"].grid))
            continue
        for value in eqn.params.values():
            for item in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(item, "jaxpr", item)
                if hasattr(inner, "eqns"):
                    grids += _pallas_grids(inner)
    return grids


def test_a_4096_key_window_over_32768_keys_reads_about_an_eighth_of_the_key_blocks():
    """Mistral's sliding window (4096: ``window_size=(4095, 0)``, causal) over 32,768 queries and
    keys, at the tiles a TPU v5e compile takes (``tpu_tiles``, which keep blocks at most a window
    over ``WINDOW_TILES``): the forward's, dQ's and dK/dV's grids walk about an eighth of the key
    (query) blocks, read from the call's own jaxpr, and their index maps fetch as many K/V (Q/dO)
    blocks; the Triton kernels' loops, bounded by the same ranges, read as few."""
    seq, window = 32768, (4095, 0)
    blocks, heads = flash_plan.tpu_tiles(seq, seq, 8, 8, 128, 2, span=4096)
    assert max(getattr(blocks, f) for f in blocks.__dataclass_fields__) <= 512
    plan = flash_plan.Plan(seq, seq, 8, 8, True, 1.0, blocks, "mosaic", True, window=window)
    q = jax.ShapeDtypeStruct((1, seq, 8, 128), jnp.bfloat16)

    def forward_and_vjp(q, k, v):
        out, pull = jax.vjp(lambda q, k, v: flash_attention(
            q, k, v, causal=True, window_size=window, block_sizes=blocks, interpret=True), q, k, v)
        return pull(out)
    grids = _pallas_grids(jax.make_jaxpr(forward_and_vjp)(q, q, q).jaxpr)
    pre = (np.asarray([seq], np.int32),)
    fractions = {}
    for phase, grid, (bq, bk) in zip(("fwd", "dq", "dkv"), grids, [
            (blocks.block_q, blocks.block_k), (blocks.block_q_dq, blocks.block_k_dq),
            (blocks.block_q_dkv, blocks.block_k_dkv)]):
        nq, nk = seq // bq, seq // bk
        by_key = phase == "dkv"
        walk = flash_tpu.Walk(plan, bq, bk, nq, nk, by_key=by_key)
        assert grid == (1, 1, nk if by_key else nq, walk.steps), (phase, grid)
        q_map, kv_map = (flash_tpu.key_side_maps if by_key else flash_tpu.query_side_maps)(walk)
        read = _fetches(q_map if by_key else kv_map, grid, pre)
        fractions[phase] = (read / (nq * nk), walk.steps / (nq if by_key else nk))
    for phase, (read, steps) in fractions.items():
        assert 0.11 <= read <= steps <= 0.15, (phase, fractions)
    gpu = flash_plan.FlashBlockSizes.for_platform("gpu")
    triton = flash_plan.Plan(seq, seq, 8, 8, True, 1.0, gpu, "triton", True, window=window)
    for bq, bk, by_key in ((gpu.block_q, gpu.block_k, False), (gpu.block_q_dq, gpu.block_k_dq, False),
                           (gpu.block_q_dkv, gpu.block_k_dkv, True)):
        nq, nk = seq // bq, seq // bk
        find = block_skipping.query_block_range if by_key else block_skipping.key_block_range
        lo, hi = find(np.arange(nk if by_key else nq), seq, bq, bk, triton)
        assert 0.11 <= int(np.asarray(block_skipping.range_steps(lo, hi)).sum()) / (nq * nk) <= 0.15


def test_the_flash_entries_declare_every_feature():
    from kernel_src import registry

    assert declared_features(flash_attention) == FEATURES
    for name in ("flash", "flash-triton"):
        assert declared_features(registry.IMPLEMENTATIONS[name].load()) == FEATURES, name


# --------------------------------------------------------------------------------------------
# Slow: each feature alone, and the rubric's full-level grades.

ALONE = {  # feature -> (causal, window, softcap, segments, sinks, dtype, q scale, kv_lengths)
    "window-causal": (True, (12, None), None, False, False, "float32", 1.0, [72, 30]),
    "window-(0,0)": (False, (0, 0), None, False, False, "float32", 1.0, None),
    "softcap": (True, None, 5.0, False, False, "float32", 6.0, [72, 0]),
    "softcap-bf16": (True, None, 50.0, False, False, "bfloat16", 30.0, None),
    "segments-causal": (True, None, None, True, False, "float32", 1.0, [72, 60]),
    "sinks-causal": (True, None, None, False, True, "float32", 1.0, [72, 0]),
    "sinks-bf16": (False, None, None, False, True, "bfloat16", 1.0, [40, 60]),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", ALONE)
def test_each_feature_alone(variant, name):
    causal, window, softcap, segments, sinks, dtype, boost, lengths = ALONE[name]
    q, k, v, ct = _arrays(seed=1, q_heads=4, kv_heads=2)
    q *= boost
    rng = np.random.default_rng(2)
    q_ids = np.sort(rng.integers(0, 4, Q_LEN)).astype(np.int32)
    kv_ids = np.sort(rng.integers(0, 4, KV_LEN)).astype(np.int32)
    kv_ids[KV_LEN - Q_LEN:] = q_ids  # packed documents: the queries are the last keys
    sink = rng.standard_normal(4).astype(np.float32) * 2
    lengths = np.asarray(lengths or [KV_LEN] * BATCH, np.int32)
    program = _program(variant, causal=causal, window=window, softcap=softcap, segments=segments,
                       sinks=sinks)
    cast = (lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
            ) if dtype == "bfloat16" else (lambda x: x)
    q, k, v, ct = map(cast, (q, k, v, ct))
    args = [jnp.asarray(x, dtype) for x in (q, k, v, ct)]
    results = _run(program, *args, lengths, q_ids, kv_ids, sink)
    p = _problem(name, dtype, q, k, v, ct, causal=causal, lengths=lengths, window=window,
                 softcap=softcap, q_ids=q_ids if segments else None,
                 kv_ids=kv_ids if segments else None, sinks=sink if sinks else None)
    assert all(np.asarray(x).dtype == jnp.dtype(dtype) for x in results[:4])
    _assert_judged_accurate(p, results if sinks else results[:4] + (None,))


@pytest.mark.slow
def test_mosaic_features_in_tpu_interpret_mode(tpu_interpret):
    """NaN-filled scratch and outputs (a skipped init or store shows) and race detection, with
    every feature at once."""
    program = _program("mosaic", causal=False, window=WINDOW, softcap=SOFTCAP, segments=True,
                       sinks=True, interpret=tpu_interpret)
    q, k, v, ct = _arrays()
    sinks = np.asarray([1.5, -2.0], np.float32)
    results = _run(program, q, k, v, ct, LENGTHS, Q_IDS, KV_IDS, sinks)
    p = _problem("tpu interpret", "float32", q, k, v, ct, causal=False, lengths=LENGTHS,
                 window=WINDOW, softcap=SOFTCAP, q_ids=Q_IDS, kv_ids=KV_IDS, sinks=sinks)
    _assert_judged_accurate(p, results)
    assert tpu_interpret_races_found() is not True


@pytest.mark.slow
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("name", ["flash", "flash-triton"])
@pytest.mark.parametrize("seed", full_level_seeds())
def test_the_rubric_grades_every_feature_of_the_flash_kernels_at_the_full_level(name, seed, feature):
    """The rubric's check of each feature (``grading.dense.feature_checks``), in-process, at the full
    level: it passes with full points. One check per test: a whole card of the Mosaic family
    interpreted took 75-600 s on a loaded 2-core machine, against the 600 s limit per test."""
    from tests.grading_inprocess import grade

    card = grade(name, seed=seed, level="full", only=[feature])
    assert card.features == FEATURES
    assert [c.name for c in card.checks] == [feature]
    assert card.passed and card.score == card.max_score, [(c.name, c.detail) for c in card.checks
                                                          if not c.passed]
