"""The ragged kernels (``kernel_src.ragged``) against a float64 NumPy truth of the ragged contract.

Every batch is built the way a serving engine's step looks: decode rows, chunks of prefill, whole
prompts and empty sequences one after another in ``q``, rows past the last sequence NaN; pages of
each sequence drawn at random from a pool larger than needed, every slot no graded key reads NaN
(or, in an int8 pool, the type's extremes); entries of every per-sequence array at or past
``num_seqs`` garbage (in range), table entries past a sequence's last page pointing at NaN pages.
Outputs must match the truth on the graded rows, carry no NaN there, and not change a bit when the
pool is permuted with the table permuted alike.

Both families run in interpret mode (the Mosaic kernel's DMAs included), small shapes, a few
CPU-seconds a test; the v5e compile and the Triton lowering run without a TPU or GPU. Slow: the
v5e compiles, the ragged rubric with every feature at the full level on seeds 0-2 (the quick level, about
155 CPU-s more, draws the same kinds of mixes and edges at smaller shapes; CI's budget keeps the full level
only), and a few more interpreted calls.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_src.ragged import (RaggedBlockSizes, ragged_paged_attention_tpu,
                               ragged_paged_attention_triton)
from kernel_src.reference import reference_ragged_paged_attention
from tests.seeds import full_level_seeds

KERNELS = {"tpu": ragged_paged_attention_tpu, "triton": ragged_paged_attention_triton}
# Several items per prompt (Mosaic: of up to 3 tiles), several steps (Mosaic) and loop iterations (Triton) per item.
SMALL = RaggedBlockSizes(block_q=4, sub_tiles=3, pages_per_step=2, block_k=16)


@dataclasses.dataclass(frozen=True)
class Case:
    """One ragged step: ``(q_len, kv_len)`` per sequence, in ``q``'s order."""

    seqs: tuple[tuple[int, int], ...]
    max_seqs: int = 0  # rows of the table (0: two more than the sequences)
    pad_tokens: int = 3  # NaN rows of q past the last sequence
    page_size: int = 16
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    dtype: str = "float32"
    pool: str | None = None  # "int8" or "float8_e4m3fn": a quantized pool
    spare_pages: int = 5


SCALES = {"int8": (0.02, 0.03), "float8_e4m3fn": (0.004, 0.01)}


def make_problem(case: Case, seed: int = 0):
    """``(q, k_pages, v_pages, args)``: NumPy arrays (q in its dtype, the pools in theirs) and
    the keyword arguments ``kv_lengths``, ``page_indices``, ``cu_q_lens``, ``num_seqs`` (and the
    scales of a quantized pool)."""
    rng = np.random.default_rng(seed)
    ps, hk, d, n = case.page_size, case.num_kv_heads, case.head_dim, len(case.seqs)
    max_seqs = case.max_seqs or n + 2
    pages = [-(-kv // ps) for _, kv in case.seqs]
    per_seq = max(max(pages), 1) + 2
    num_pages = sum(pages) + case.spare_pages
    ids = rng.permutation(num_pages)
    pool_dtype = np.dtype(jnp.dtype(case.pool or case.dtype))
    junk = 127 if case.pool == "int8" else np.nan  # what no graded key reads
    k = np.full((num_pages, ps, hk, d), junk, np.float32)
    v = np.full((num_pages, ps, hk, d), junk, np.float32)
    table = rng.integers(0, num_pages, (max_seqs, per_seq))
    taken = 0
    for i, ((_, kv), count) in enumerate(zip(case.seqs, pages)):
        table[i, :count] = ids[taken:taken + count]
        taken += count
        if case.spare_pages:  # past the last page: junk pages
            table[i, count:] = rng.choice(ids[sum(pages):], per_seq - count)
        for t in range(0, kv, ps):
            filled = min(ps, kv - t)
            k[table[i, t // ps], :filled] = _stored(rng, (filled, hk, d), case.pool)
            v[table[i, t // ps], :filled] = _stored(rng, (filled, hk, d), case.pool)
    q_lens = [ql for ql, _ in case.seqs]
    tokens = sum(q_lens) + case.pad_tokens
    q = rng.standard_normal((tokens, case.num_q_heads, d)).astype(np.float32)
    q[sum(q_lens):] = np.nan
    cu = np.concatenate([[0], np.cumsum(q_lens), rng.integers(0, tokens + 1, max_seqs - n)])
    lengths = np.concatenate([[kv for _, kv in case.seqs],
                              rng.integers(0, per_seq * ps + 1, max_seqs - n)])
    args = dict(kv_lengths=lengths.astype(np.int32), page_indices=table.astype(np.int32),
                cu_q_lens=cu.astype(np.int32), num_seqs=np.array([n], np.int32))
    if case.pool:
        args["k_scale"], args["v_scale"] = SCALES[case.pool]
    return q.astype(jnp.dtype(case.dtype)), k.astype(pool_dtype), v.astype(pool_dtype), args


def _stored(rng, shape, pool):
    if pool == "int8":
        return rng.integers(-127, 128, shape)
    if pool == "float8_e4m3fn":  # near the type's range (448) with the scale far from 1
        return np.clip(rng.standard_normal(shape) * 150.0, -448, 448)
    return rng.standard_normal(shape)


def truth(q, k_pages, v_pages, *, kv_lengths, page_indices, cu_q_lens, num_seqs, scale=None,
          causal=True, window_size=None, softcap=None, sinks=None, k_scale=None, v_scale=None):
    """The ragged contract in float64 NumPy, sequence by sequence: ``(out, graded)``, ``graded``
    bool ``[num_tokens]`` (rows of some sequence)."""
    q = np.asarray(q, np.float64)
    k_pages = np.asarray(k_pages.astype(np.float32), np.float64) * (k_scale or 1.0)
    v_pages = np.asarray(v_pages.astype(np.float32), np.float64) * (v_scale or 1.0)
    hq, d = q.shape[1:]
    ps, hk = k_pages.shape[1:3]
    scale = d ** -0.5 if scale is None else scale
    out, graded = np.zeros_like(q), np.zeros(q.shape[0], bool)
    for i in range(int(num_seqs[0])):
        lo, hi, n = int(cu_q_lens[i]), int(cu_q_lens[i + 1]), int(kv_lengths[i])
        t = np.arange(n)
        k = np.repeat(k_pages[page_indices[i, t // ps], t % ps], hq // hk, axis=1)  # [n, hq, d]
        v = np.repeat(v_pages[page_indices[i, t // ps], t % ps], hq // hk, axis=1)
        s = np.einsum("qhd,khd->hqk", q[lo:hi], k) * scale
        if softcap is not None:
            s = softcap * np.tanh(s / softcap)
        position = n - (hi - lo) + np.arange(hi - lo)[:, None]
        ok = np.ones((hi - lo, n), bool)
        if causal:
            ok &= t <= position
        left, right = window_size or (None, None)
        ok &= True if left is None else t >= position - left
        ok &= True if right is None else t <= position + right
        s = np.where(ok, s, -np.inf)
        m = s.max(axis=-1, keepdims=True, initial=-np.inf)
        sink = None if sinks is None else np.asarray(sinks, np.float64)[:, None, None]
        m = m if sink is None else np.maximum(m, sink)
        m = np.where(np.isfinite(m), m, 0.0)
        p = np.where(ok, np.exp(s - m), 0.0)
        total = p.sum(axis=-1, keepdims=True) + (0.0 if sink is None else np.exp(sink - m))
        out[lo:hi] = (np.einsum("hqk,khd->hqd", p, v) / np.where(total > 0, total, 1)).transpose(1, 0, 2)
        graded[lo:hi] = True
    return out, graded


def attend(family: str, problem, block_sizes=SMALL, **options):
    q, k, v, args = problem
    arrays = {name: jnp.asarray(x) if isinstance(x, np.ndarray) else x for name, x in args.items()}
    got = KERNELS[family](jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), **arrays,
                          block_sizes=block_sizes, **options)
    assert got.shape == q.shape and got.dtype == q.dtype
    return np.asarray(got.astype(jnp.float32))


def assert_matches(got, problem, **options):
    """Close to the float64 truth on the graded rows, with no NaN there."""
    q, k, v, args = problem
    want, graded = truth(q, k, v, **args, **options)
    assert not np.isnan(got[graded]).any()
    tolerance = 2e-5 if q.dtype == np.float32 else 3e-2
    np.testing.assert_allclose(got[graded], want[graded], atol=tolerance, rtol=tolerance)


def permuted(problem, seed: int = 1):
    """The same problem with the pool's pages permuted and the table's entries alike."""
    q, k, v, args = problem
    order = np.random.default_rng(seed).permutation(k.shape[0])  # new page of old page p
    new_k, new_v = np.empty_like(k), np.empty_like(v)
    new_k[order], new_v[order] = k, v
    return q, new_k, new_v, dict(args, page_indices=order[args["page_indices"]].astype(np.int32))


# decode rows, a chunk of prefill, empty sequences between others, whole prompts, a prompt
# cut into several items with a partial last one
MIXED = ((1, 40), (0, 9), (6, 33), (1, 1), (0, 0), (13, 13), (3, 50), (9, 9))


# The interpreted Mosaic kernel costs about 5 CPU-s a call: the default run calls it on the mixed step only, the
# Triton kernel (about 2 CPU-s) on every case; the Mosaic cases run with the slow tests
SLOW_TPU = [pytest.param("tpu", marks=pytest.mark.slow), "triton"]


@pytest.mark.parametrize("family", KERNELS)
def test_mixed_step_matches_truth_and_ignores_pool_order(family):
    problem = make_problem(Case(MIXED, page_size=12))  # no power of two
    got = attend(family, problem)
    assert_matches(got, problem)
    np.testing.assert_array_equal(attend(family, permuted(problem)), got)
    q, k, v, args = problem
    _, graded = truth(q, k, v, **args)
    np.testing.assert_array_equal(got[~graded], 0.0)  # padding rows: zeros
    reference = np.asarray(reference_ragged_paged_attention(q, k, v, **args))
    np.testing.assert_allclose(got[graded], reference[graded], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("family", SLOW_TPU)
def test_window_softcap_sinks_in_bf16_with_gqa(family):
    """Window edges inside a page, a group of 4, each feature at once; default block sizes."""
    problem = make_problem(Case(((1, 30), (7, 21), (0, 5), (11, 11)), page_size=8, num_q_heads=8,
                                dtype="bfloat16"), seed=3)
    options = dict(window_size=(5, 0), softcap=5.0,
                   sinks=np.linspace(-1.0, 2.0, 8).astype(np.float32))
    got = attend(family, problem, block_sizes=None, **options)
    assert_matches(got, problem, **options)


@pytest.mark.parametrize("family", SLOW_TPU)
def test_not_causal_with_a_right_window(family):
    """Rows see keys after their position (up to ``right``); the left edge many pages back."""
    problem = make_problem(Case(((2, 60), (5, 17), (1, 3)), page_size=4), seed=4)
    options = dict(causal=False, window_size=(22, 3), scale=0.3)
    assert_matches(attend(family, problem, **options), problem, **options)


@pytest.mark.parametrize("family,pool,dtype", [
    ("triton", "int8", "bfloat16"), ("triton", "float8_e4m3fn", "float32"),
    pytest.param("tpu", "int8", "bfloat16", marks=pytest.mark.slow),
    pytest.param("tpu", "float8_e4m3fn", "float32", marks=pytest.mark.slow)])
def test_quantized_pools(family, pool, dtype):
    """Dequantized in the kernel: ``float32(stored) * scale``; unused int8 slots at 127, fp8
    ones NaN; scales far from 1 and fp8 values near the type's range."""
    problem = make_problem(Case(((1, 19), (6, 6), (0, 4), (4, 35)), pool=pool, dtype=dtype),
                           seed=5)
    assert_matches(attend(family, problem), problem)


@pytest.mark.parametrize("family", SLOW_TPU)
def test_pages_outside_every_window_are_never_read(family):
    """Window skipping: the table entries of pages no row's window reaches point outside the
    pool (Mosaic: a DMA of one raises under the strict TPU interpreter, whose buffer slots no
    copy wrote are NaN too) or at a NaN page (Triton: a gathered V row of NaN poisons P·V even
    where P is 0)."""
    from kernel_src import backend

    q, k, v, args = problem = make_problem(Case(((1, 70), (3, 41), (0, 8), (2, 2)), page_size=8),
                                           seed=6)
    table = args["page_indices"].copy()
    nan_page = int(np.flatnonzero(np.isnan(v).all(axis=(1, 2, 3)))[0])
    table[0, :7] = 2 ** 31 - 1 if family == "tpu" else nan_page  # keys 0-55; the row sees 59-69
    table[1, :3] = k.shape[0] if family == "tpu" else nan_page  # keys 0-23; the rows see 28-40
    options = dict(window_size=(10, 0))
    interpret = backend.tpu_interpret_params() if family == "tpu" else True
    if interpret is None:
        pytest.skip("this JAX has no pltpu.InterpretParams")
    try:
        got = attend(family, (q, k, v, dict(args, page_indices=table)), interpret=interpret,
                     **options)
        races = backend.tpu_interpret_races_found() if family == "tpu" else None
    finally:
        backend.reset_tpu_interpret_state()
    assert_matches(got, problem, **options)
    assert races is not True


def test_features_are_declared():
    for fn in KERNELS.values():
        assert fn.features == ("window", "softcap", "sinks", "quantized_kv")


@pytest.mark.parametrize("change,message", [
    (dict(q=np.zeros((6, 4, 32), np.float16)), "q must be bfloat16 or float32"),
    (dict(q=np.zeros((6, 32), np.float32)), "q must be 3-D"),
    (dict(k_pages=np.zeros((7, 16, 2, 32), np.int8)), "k_pages and v_pages must share a dtype"),
    (dict(k_scale=0.5, v_scale=0.5), "k_scale and v_scale apply to a quantized pool"),
    (dict(cu_q_lens=np.zeros(3, np.int32)), "cu_q_lens"),
    (dict(num_seqs=np.zeros(2, np.int32)), "num_seqs"),
    (dict(window_size=(-1, 0)), "no -1 sentinel"),
    (dict(sinks=np.zeros(3, np.float32)), "sinks must have shape [num_q_heads]=(4,)"),
])
def test_bad_arguments_are_refused_in_one_line(change, message):
    q, k, v, args = make_problem(Case(((2, 5), (1, 3))))
    call = dict(q=q, k_pages=k, v_pages=v, **args) | change
    with pytest.raises((ValueError, TypeError)) as error:
        ragged_paged_attention_tpu(**call)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("field,value", [("block_q", 0), ("block_q", True), ("sub_tiles", 0), ("block_k", 24)])
def test_block_sizes_are_checked(field, value):
    with pytest.raises(ValueError, match=field):
        RaggedBlockSizes(**{field: value})


@pytest.mark.parametrize("pool", ["bfloat16", "int8", "float8_e4m3fn"])
def test_triton_lowers_for_cuda(pool):
    """``jax.export`` for cuda runs the Pallas -> Triton lowering (no GPU compiler here), every
    feature, each pool dtype."""
    from jax import export

    struct = jax.ShapeDtypeStruct
    scales = dict(k_scale=0.5, v_scale=2.0) if pool != "bfloat16" else {}
    pool = struct((300, 24, 2, 128), jnp.dtype(pool))
    args = (struct((40, 8, 128), jnp.bfloat16), pool, pool, struct((6,), jnp.int32),
            struct((6, 50), jnp.int32), struct((7,), jnp.int32), struct((1,), jnp.int32),
            struct((8,), jnp.float32))

    def fn(q, k, v, lengths, table, cu, n, sinks):
        return ragged_paged_attention_triton(
            q, k, v, kv_lengths=lengths, page_indices=table, cu_q_lens=cu, num_seqs=n,
            window_size=(100, 0), softcap=30.0, sinks=sinks, **scales)
    triton = "__gpu$xla.gpu.triton"
    module = export.export(jax.jit(fn), platforms=["cuda"],
                           disabled_checks=[export.DisabledSafetyCheck.custom_call(triton)])(
        *args).mlir_module()
    assert module.count(f"@{triton}") == 1


# --- slow: compiled for a TPU v5e without one ----------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("shape", [
    # tokens, max_seqs, hq, hk, head_dim, page_size, keys per sequence, dtype, pool, features
    (256, 16, 32, 8, 128, 16, 4096, "bfloat16", None, {}),
    (256, 16, 32, 8, 128, 16, 4096, "bfloat16", "int8", {}),
    (64, 8, 8, 1, 128, 128, 2048, "float32", "float8_e4m3fn",
     dict(window_size=(100, 0), softcap=30.0, sinks=True)),
], ids=["llama3-8b-step", "llama3-8b-int8", "fp8-group8-features"])
def test_mosaic_compiles_for_v5e(shape):
    """Compiled deviceless (about 15 CPU-s each on a loaded 2-core machine); the kernel declares at
    least K and V of every table entry once, in the pool's bytes."""
    from kernel_src.flash.plan import HEADS_IN_PLACE
    from tpu_kernel_records_tools.bench import compiled

    reason = compiled.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    if not HEADS_IN_PLACE:
        pytest.skip("the ragged Mosaic kernel takes one kv head out of a block: jax >= 0.7")
    tokens, seqs, hq, hk, d, ps, keys, dtype, pool, options = shape
    options = dict(options)
    per_seq = -(-keys // ps)
    num_pages = seqs * per_seq + 3
    pool_dtype = jnp.dtype(pool or dtype)
    args = [compiled.struct((tokens, hq, d), jnp.dtype(dtype)),
            compiled.struct((num_pages, ps, hk, d), pool_dtype),
            compiled.struct((num_pages, ps, hk, d), pool_dtype),
            *(compiled.struct(s, jnp.int32) for s in ((seqs,), (seqs, per_seq), (seqs + 1,), (1,)))]
    if options.pop("sinks", False):
        args.append(compiled.struct((hq,), jnp.float32))
    scales = dict(k_scale=0.5, v_scale=0.25) if pool else {}

    def fn(q, k, v, lengths, table, cu, n, *sinks):
        return ragged_paged_attention_tpu(q, k, v, kv_lengths=lengths, page_indices=table,
                                          cu_q_lens=cu, num_seqs=n,
                                          sinks=sinks[0] if sinks else None, **scales, **options)
    facts = compiled.analyse(compiled.compile_program(fn, args))
    (kernel,) = facts["kernels"]
    assert kernel["vmem_bytes"] is not None
    assert kernel["declared_bytes"] >= 2 * seqs * per_seq * ps * hk * d * pool_dtype.itemsize


def test_registered():
    from kernel_src.registry import IMPLEMENTATIONS

    assert IMPLEMENTATIONS["ragged-pallas"].load() is ragged_paged_attention_tpu
    assert IMPLEMENTATIONS["ragged-triton"].load() is ragged_paged_attention_triton


@pytest.mark.parametrize("causal,window,want", [
    (True, None, [(0, 40), (0, 4), (0, 8), (0, 12), (0, 13), (0, 0)]),
    (True, (5, 0), [(34, 40), (0, 4), (0, 8), (3, 12), (7, 13), (0, 0)]),
    (False, (None, 2), [(0, 40), (0, 6), (0, 10), (0, 13), (0, 13), (0, 0)]),
    (False, None, [(0, 40), (0, 13), (0, 13), (0, 13), (0, 13), (0, 0)]),
])
def test_each_item_reads_only_the_keys_its_rows_see(causal, window, want):
    """The work list of a decode row and a 13-row prompt in items of 4 rows, and each item's
    keys (``key_range``: causal, window and length skipping); items past the last read none."""
    from kernel_src.ragged.plan import RaggedPlan, item_tokens, key_range, schedule

    plan = RaggedPlan(num_tokens=16, max_seqs=3, num_q_heads=2, num_kv_heads=1, head_dim=8,
                      page_size=4, pages_per_sequence=10, num_pages=20, causal=causal, scale=1.0,
                      interpret=True, block_q=4, rows_pad=8, window=window)
    items = schedule(jnp.array([0, 1, 14, 9]), jnp.array([40, 13, 7]), jnp.array([2]), plan)
    assert plan.items == 7
    np.testing.assert_array_equal(items.seq[:5], [0, 1, 1, 1, 1])
    np.testing.assert_array_equal(items.j0[:5], [0, 0, 4, 8, 12])
    np.testing.assert_array_equal(items.first[:5], [0, 1, 5, 9, 13])
    np.testing.assert_array_equal(items.rows, [1, 4, 4, 4, 1, 0, 0])
    tokens, real = item_tokens(items, plan)
    np.testing.assert_array_equal(tokens[4], [13, 14, 15, 15])  # clipped past the end
    np.testing.assert_array_equal(real[4], [True, False, False, False])
    start, end = key_range(items.length, items.q_len, items.j0, plan)
    got = [(int(a), int(max(b, 0))) for a, b in zip(start, end)][:6]
    assert got == want


def test_tpu_work_items_hold_the_steps_tokens_per_sequence_slot():
    """``num_tokens / max_seqs`` rounded up to a power of two in [16, 64] on TPU, items of 512 rows; 16 elsewhere,
    items of 4 tiles on CPU (interpreted), of one on GPU."""
    steps = ((2096, 67), (416, 34), (8192, 16), (48, 4), (1, 1), (130, 4))
    assert [RaggedBlockSizes.for_step("tpu", t, s).block_q for t, s in steps] == [32, 16, 64, 16, 16, 64]
    assert [RaggedBlockSizes.for_step("tpu", t, s).sub_tiles for t, s in steps] == [16, 32, 8, 32, 32, 8]
    assert RaggedBlockSizes.for_step("tpu", 2096, 67).keys_per_step == 512
    cpu = RaggedBlockSizes.for_platform("cpu")
    assert RaggedBlockSizes.for_step("cpu", 8192, 16) == dataclasses.replace(cpu, sub_tiles=4)
    assert RaggedBlockSizes.for_step("gpu", 8192, 16).block_q == 16


def _equations(jaxpr):
    """The equations of ``jaxpr`` and of the jaxprs in their parameters (a kernel's body not entered)."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name == "pallas_call":
            continue
        for value in eqn.params.values():
            for inner in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


def test_mosaic_copies_q_and_the_output_rows_itself():
    """The Mosaic kernel takes ``q [num_tokens, hq, d]`` as it is and makes the output: no op around it makes an
    array as large as q (tiles of each item's rows gathered in XLA, or the output rows gathered back, would).
    Items of 16 rows over 13 rows of q: no row copy is larger than q."""
    q, k, v, args = problem = make_problem(Case(((1, 20), (9, 9))))
    blocks = dataclasses.replace(SMALL, sub_tiles=4)
    assert_matches(attend("tpu", problem, block_sizes=blocks), problem)
    jaxpr = jax.make_jaxpr(lambda q, k, v: ragged_paged_attention_tpu(q, k, v, **args, block_sizes=blocks))(q, k, v)
    equations = list(_equations(jaxpr.jaxpr))
    kernels = [e for e in equations if e.primitive.name == "pallas_call"]  # a branch per platform
    assert kernels and all([o.aval.shape for o in kernel.outvars] == [q.shape] for kernel in kernels)
    around = [e.primitive.name for e in equations  # the platforms' branches and refusals move nothing
              if e.primitive.name not in ("pallas_call", "cond", "jit", "pjit", "custom_vjp_call")
              and not e.primitive.name.startswith("kernel_src_")
              and any(np.prod(o.aval.shape) >= q.size for o in e.outvars)]
    assert around == []


def test_an_items_state_is_fitted_to_vmem():
    """Compiled, sub-tiles halve until an item's rows and statistics fit the budget beside the page buffers."""
    from kernel_src.ragged.plan import RaggedPlan
    from kernel_src.ragged.tpu import fit_sub_tiles, state_bytes

    plan = RaggedPlan(num_tokens=4096, max_seqs=8, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                      pages_per_sequence=64, num_pages=512, causal=True, scale=1.0, interpret=False, block_q=32,
                      rows_pad=128, sub_tiles=64)
    one = state_bytes(dataclasses.replace(plan, sub_tiles=1), 2)
    assert one == 32 * 32 * 128 * 2 + 8 * 128 * 128 * 2 + 8 * 128 * (2 * 128 + 128) * 4
    budget = 40 * 2 ** 20
    fitted = fit_sub_tiles(plan, budget, 2)
    assert fitted == 16 and state_bytes(dataclasses.replace(plan, sub_tiles=fitted), 2) <= budget
    assert state_bytes(dataclasses.replace(plan, sub_tiles=2 * fitted), 2) > budget
    assert fit_sub_tiles(plan, 1, 2) == 1


def test_the_tiles_are_gathered_and_come_back_by_one_gather_each():
    """A decode row, a 5-row prompt and a 4-row chunk in items of 3 rows, 3 query heads per kv head
    and NaN padding rows: each item's tile holds its rows as ``paged.plan.to_rows`` lays them out
    (zeros where no row of a sequence is), and the way back returns q's rows, zeros past them."""
    from kernel_src.paged.plan import to_rows
    from kernel_src.ragged.plan import RaggedPlan, gather_tiles, item_tokens, scatter_tiles, schedule

    plan = RaggedPlan(num_tokens=12, max_seqs=4, num_q_heads=6, num_kv_heads=2, head_dim=4, page_size=2,
                      pages_per_sequence=4, num_pages=16, causal=True, scale=1.0, interpret=True, block_q=3,
                      rows_pad=16)
    items = schedule(jnp.array([0, 1, 6, 10, 10]), jnp.array([3, 5, 8, 0]), jnp.array([3]), plan)
    q = jnp.arange(12 * 6 * 4, dtype=jnp.float32).reshape(12, 6, 4).at[10:].set(jnp.nan)
    tokens, real = item_tokens(items, plan)
    rows = jnp.where(real[:, :, None, None], q[tokens], 0.0)
    tiles = gather_tiles(q, items, plan)
    np.testing.assert_array_equal(tiles, to_rows(rows, 2, 16))
    assert not jnp.isnan(tiles).any() and int(real.sum()) == 10
    np.testing.assert_array_equal(scatter_tiles(tiles, items, plan), q.at[10:].set(0.0))


# --- slow: the ragged rubric (grading.ragged), graded in this process as test_ragged_grading does ---


def _rubric(family: str, seed: int, level: str):
    from kernel_src.contract import RAGGED_FEATURES
    from tests.test_ragged_grading import grade
    from tpu_kernel_records_tools.grading.ragged.checks import ragged_checks_for

    found = grade(KERNELS[family], seed, level)
    assert set(found) == {c.name for c in ragged_checks_for(RAGGED_FEATURES)}
    assert all(o.passed for o in found.values()), {n: o.detail for n, o in found.items() if not o.passed}


@pytest.mark.slow  # about 125 CPU-s (Mosaic) and 90 CPU-s (Triton) a seed
@pytest.mark.parametrize("seed", full_level_seeds())
@pytest.mark.parametrize("family", KERNELS)
def test_the_full_rubric_with_every_feature(family, seed):
    _rubric(family, seed, "full")
