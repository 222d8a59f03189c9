"""The paged kernels (``kernel_src.paged``) against a float64 gather-then-attend truth.

Every problem is built the way a serving engine's cache looks after a while: the pages of each
sequence are drawn at random from a pool larger than needed (so they are permuted and
non-contiguous), some sequences share their first page (prefix caching), every slot no sequence
holds is NaN, the slots past a length in a last page are NaN, +Inf and -Inf, and the table entries
past a sequence's last page point at NaN pages, at page 0 and outside the pool (-1, the pool's
size, 2**31 - 1). Outputs must match the truth, carry no NaN, be exact zeros on rows with no
visible key, and not change a bit when the pool is permuted with the table permuted alike, nor
when the Mosaic kernel reads its pages in the layout compiled under jax < 0.7 ("rows": a kv head
as strided rows) instead of the in-place one ("heads").

Both families run in interpret mode (the Mosaic kernel's DMAs included). The default run keeps
one small call per family (about 5 s on a busy 2-core machine; the slow ones about 100 s); the sweeps over page sizes, dtypes,
groups, features, long tables and 131k keys, the strict TPU interpreter (races, NaN-filled
VMEM), the Triton lowering and the v5e compile are slow.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_src import backend
from kernel_src.contract import PAGED_FEATURES
from kernel_src.paged import PagedBlockSizes, paged_attention_tpu, paged_attention_triton

KERNELS = {"tpu": paged_attention_tpu, "triton": paged_attention_triton}
# Several steps (Mosaic) and loop iterations (Triton) even in small problems.
SMALL_STEPS = PagedBlockSizes(pages_per_step=2, block_k=32)
GARBAGE_ENTRIES = ("nan page", 0, -1, "pool size", 2 ** 31 - 1)


@dataclasses.dataclass(frozen=True)
class Case:
    """One paged problem: the sequences' lengths share one pool and one table."""

    lengths: tuple[int, ...]
    page_size: int = 16
    q_len: int = 4
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    dtype: str = "float32"
    spare_pages: int = 7  # pool pages beyond those the table needs, NaN-filled
    extra_entries: int = 2  # table entries past the longest sequence's last page
    first_page: int = 0  # the lowest page index the sequences use (the pool has pages below)


def make_problem(case: Case, seed: int = 0):
    """``(q, k_pages, v_pages, kv_lengths, page_indices)`` as NumPy arrays of the case's dtype
    (see the module docstring for what the pool holds)."""
    rng = np.random.default_rng(seed)
    ps, hk, d = case.page_size, case.num_kv_heads, case.head_dim
    pages = [-(-n // ps) for n in case.lengths]
    per_seq = max(max(pages), 1) + case.extra_entries
    used = sum(pages)
    num_pages = case.first_page + used + case.spare_pages
    pool_ids = case.first_page + rng.permutation(num_pages - case.first_page)
    k = np.full((num_pages, ps, hk, d), np.nan, np.float32)
    v = np.full((num_pages, ps, hk, d), np.nan, np.float32)
    table = np.zeros((len(case.lengths), per_seq), np.int64)
    nan_pages = pool_ids[used:]  # never written
    taken = 0
    for b, (n, count) in enumerate(zip(case.lengths, pages)):
        table[b, :count] = pool_ids[taken:taken + count]
        taken += count
        if b and count and pages[b - 1] and min(n, case.lengths[b - 1]) >= ps:
            table[b, 0] = table[b - 1, 0]  # a shared full first page (prefix caching)
        for i in range(count):
            filled = min(ps, n - i * ps)
            page = table[b, i]
            if i == 0 and b and table[b, 0] == table[b - 1, 0]:
                continue  # the shared page is already written, full
            k[page, :filled] = rng.standard_normal((filled, hk, d))
            v[page, :filled] = rng.standard_normal((filled, hk, d))
            tail = ps - filled  # the last page's slots past the length: NaN, +Inf, -Inf
            k[page, filled:] = np.resize([np.nan, np.inf, -np.inf], tail)[:, None, None]
            v[page, filled:] = np.resize([np.inf, np.nan, -np.inf], tail)[:, None, None]
        for e in range(count, per_seq):
            pick = GARBAGE_ENTRIES[(b + e) % len(GARBAGE_ENTRIES)]
            table[b, e] = {"nan page": nan_pages[e % len(nan_pages)] if len(nan_pages) else 0,
                           "pool size": num_pages}.get(pick, pick)
    q = rng.standard_normal((len(case.lengths), case.q_len, case.num_q_heads, d))
    dtype = jnp.dtype(case.dtype)
    return (q.astype(np.float32).astype(dtype), k.astype(dtype), v.astype(dtype),
            np.asarray(case.lengths, np.int32), table.astype(np.int32))


def truth(q, k_pages, v_pages, kv_lengths, page_indices, *, scale=None, causal=True,
          window_size=None, softcap=None, sinks=None):
    """The paged contract in float64 NumPy: gather each sequence's keys, attend densely.
    Returns ``(out [batch, q_len, hq, d], seen)``: ``seen`` bool ``[batch, q_len, hq]``, whether
    the row sees a key."""
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    batch, q_len, hq, d = q.shape
    ps, hk = k_pages.shape[1], k_pages.shape[2]
    scale = d ** -0.5 if scale is None else scale
    out = np.zeros_like(q)
    seen = np.zeros(q.shape[:3], bool)
    for b in range(batch):
        n = int(kv_lengths[b])
        j = np.arange(n)
        k = np.repeat(k_pages[page_indices[b, j // ps], j % ps], hq // hk, axis=1)  # [n, hq, d]
        v = np.repeat(v_pages[page_indices[b, j // ps], j % ps], hq // hk, axis=1)
        s = np.einsum("qhd,khd->hqk", q[b], k) * scale
        if softcap is not None:
            s = softcap * np.tanh(s / softcap)
        position = n - q_len + np.arange(q_len)[:, None]
        ok = np.ones((q_len, n), bool)
        if causal:
            ok &= j[None, :] <= position
        if window_size is not None:
            left, right = window_size
            ok &= True if left is None else j[None, :] >= position - left
            ok &= True if right is None else j[None, :] <= position + right
        s = np.where(ok, s, -np.inf)
        m = s.max(axis=-1, keepdims=True, initial=-np.inf)
        if sinks is not None:
            m = np.maximum(m, np.asarray(sinks, np.float64)[:, None, None])
        m = np.where(np.isfinite(m), m, 0.0)
        p = np.where(ok, np.exp(s - m), 0.0)
        denominator = p.sum(axis=-1, keepdims=True)
        if sinks is not None:
            denominator = denominator + np.exp(np.asarray(sinks, np.float64)[:, None, None] - m)
        o = np.einsum("hqk,khd->hqd", p, v) / np.where(denominator > 0, denominator, 1.0)
        out[b] = o.transpose(1, 0, 2)
        seen[b] = ok.any(axis=-1)[:, None]
    return out, seen


def attend(family: str, problem, block_sizes=SMALL_STEPS, **options):
    q, k, v, lengths, table = (jnp.asarray(x) for x in problem)
    fn = KERNELS[family]
    return np.asarray(fn(q, k, v, kv_lengths=lengths, page_indices=table,
                         block_sizes=block_sizes, **options).astype(jnp.float32))


def assert_matches(got, problem, **options):
    """Close to the float64 truth, no NaN, exact zeros on rows that see no key."""
    q = problem[0]
    want, seen = truth(*problem, **options)
    assert got.shape == q.shape
    assert not np.isnan(got).any()
    tolerance = 2e-5 if q.dtype == np.float32 else 3e-2
    np.testing.assert_allclose(got, want, atol=tolerance, rtol=tolerance)
    assert (got[~seen] == 0).all()


def permuted(problem, seed: int = 1):
    """The same problem with the pool's pages permuted and the table's entries alike (entries
    outside the pool stay as they are)."""
    q, k, v, lengths, table = problem
    order = np.random.default_rng(seed).permutation(k.shape[0])  # new page of old page p
    new_k, new_v = np.empty_like(k), np.empty_like(v)
    new_k[order], new_v[order] = k, v
    inside = (table >= 0) & (table < k.shape[0])
    return q, new_k, new_v, lengths, np.where(inside, order[np.clip(table, 0, k.shape[0] - 1)], table)


# --- the default run: one call per family (and its permutation, no recompile) -----------------

BASE = Case(lengths=(0, 1, 15, 16, 17, 48, 70), q_len=4)


@pytest.mark.parametrize("family", KERNELS)
def test_lengths_pool_and_table_garbage(family):
    """Lengths 0, 1, page_size - 1, page_size, page_size + 1, multiples; q_len 4 with rows
    ahead of short sequences (zero rows); group 2; several steps; a permuted pool with the
    table permuted alike gives the same bits (Mosaic: read in the other layout, "rows", as
    compiled under jax < 0.7: a kv head as strided rows, head_dim 32 padded to 128 lanes)."""
    problem = make_problem(BASE)
    got = attend(family, problem)
    assert_matches(got, problem)
    other = dict(layout="rows") if family == "tpu" else {}
    assert np.array_equal(attend(family, permuted(problem), **other), got)


def test_features_are_declared():
    for fn in KERNELS.values():
        assert fn.features == PAGED_FEATURES == ("window", "softcap", "sinks")


def test_bad_arguments_are_refused():
    q, k, v, lengths, table = (jnp.asarray(x) for x in make_problem(Case(lengths=(3,))))
    for fn in KERNELS.values():
        with pytest.raises(ValueError, match="page_indices"):
            fn(q, k, v, kv_lengths=lengths, page_indices=table[0])
        with pytest.raises(ValueError, match="multiple"):
            fn(q[:, :, :3], k, v, kv_lengths=lengths, page_indices=table)
        with pytest.raises(TypeError, match="dtype"):
            fn(q.astype(jnp.bfloat16), k, v, kv_lengths=lengths, page_indices=table)
        with pytest.raises(ValueError, match="window_size"):
            fn(q, k, v, kv_lengths=lengths, page_indices=table, window_size=(-1, 0))
    with pytest.raises(ValueError, match="layout"):
        paged_attention_tpu(q, k, v, kv_lengths=lengths, page_indices=table, layout="flat")
    q3, k3 = (jnp.zeros(x.shape[:2] + (3, x.shape[3]), jnp.bfloat16) for x in (q, k))
    with pytest.raises(ValueError, match="even number of kv heads"):
        paged_attention_tpu(q3, k3, k3, kv_lengths=lengths, page_indices=table, layout="rows")


# --- slow: the sweeps ---------------------------------------------------------------------------

SWEEP = {
    "page24-bf16-group8-q1": Case(lengths=(0, 1, 23, 24, 25, 72, 100), page_size=24, q_len=1,
                                  num_q_heads=8, num_kv_heads=1, dtype="bfloat16"),
    "page128-f32-group1-q4": Case(lengths=(0, 3, 127, 128, 129, 256), page_size=128, q_len=4,
                                  num_q_heads=2, num_kv_heads=2, head_dim=64),
    "page16-bf16-group2-q4": Case(lengths=(2, 33, 64, 0), q_len=4, dtype="bfloat16"),
    "page16-f32-group8-q3-d40": Case(lengths=(5, 50), q_len=3, num_q_heads=16, num_kv_heads=2,
                                     head_dim=40),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", SWEEP)
@pytest.mark.parametrize("family", KERNELS)
def test_sweep(family, name):
    problem = make_problem(SWEEP[name], seed=3)
    got = attend(family, problem)
    assert_matches(got, problem)
    assert np.array_equal(attend(family, permuted(problem)), got)


OPTIONS = {
    "noncausal": dict(causal=False),  # only the lengths hide keys
    "window": dict(window_size=(20, 0)),
    "window-noncausal": dict(window_size=(5, 3), causal=False),
    "softcap": dict(softcap=3.0, scale=0.5),
    "sinks": dict(sinks=np.array([0.5, -1.0, 4.0, -np.inf], np.float32)),
    "all": dict(window_size=(30, None), softcap=5.0,
                sinks=np.array([2.0, 0.0, -3.0, 1.0], np.float32)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", SWEEP)
def test_rows_layout_sweep(name):
    """The Mosaic kernel's layout "rows" (compiled under jax < 0.7: a kv head read as strided
    rows of ``[page_size * kv heads, d]`` pages) gives exactly the bits of the in-place layout
    "heads" over the sweep: pages of 24 and 128, one kv head, head_dim 64 and 40 (padded to 128
    lanes), fp32 (strided rows) and bf16 (through 32-bit words)."""
    problem = make_problem(SWEEP[name], seed=3)
    got = attend("tpu", problem, layout="rows")
    assert_matches(got, problem)
    assert np.array_equal(got, attend("tpu", problem, layout="heads"))


@pytest.mark.slow
@pytest.mark.parametrize("name", OPTIONS)
@pytest.mark.parametrize("family", KERNELS)
def test_options(family, name):
    """Each declared feature (pages before the window are not read; bf16 for the window) and
    ``causal=False``."""
    options = OPTIONS[name]
    case = Case(lengths=(0, 1, 16, 45, 100), q_len=4,
                dtype="bfloat16" if name == "window" else "float32")
    problem = make_problem(case, seed=5)
    kernel_options = {key: jnp.asarray(x) if isinstance(x, np.ndarray) else x
                      for key, x in options.items()}
    got = attend(family, problem, **kernel_options)
    assert_matches(got, problem, **options)


@pytest.mark.slow
@pytest.mark.parametrize("family", KERNELS)
def test_long_tables_and_high_page_indices(family):
    """More than 128 pages per sequence, every page index past 2**15, the default blocks."""
    case = Case(lengths=(16 * 130 + 5, 16 * 140, 16 * 129), q_len=2, num_q_heads=2,
                num_kv_heads=1, head_dim=16, first_page=2 ** 15 + 3, spare_pages=20)
    problem = make_problem(case, seed=7)
    assert problem[4][:, :129].min() > 2 ** 15
    got = attend(family, problem, block_sizes=None)
    assert_matches(got, problem)


@pytest.mark.slow
@pytest.mark.parametrize("family", KERNELS)
def test_131072_keys(family):
    """One sequence of 131,072 keys (and one of 131,071) in pages of 128, bf16, default blocks:
    positions and lengths past every 16-bit range."""
    case = Case(lengths=(131072, 131071), page_size=128, q_len=2, num_q_heads=2,
                num_kv_heads=1, head_dim=16, dtype="bfloat16", extra_entries=0)
    problem = make_problem(case, seed=9)
    got = attend(family, problem, block_sizes=None)
    assert_matches(got, problem)


@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, dict(window_size=(20, 0)),
                                     dict(window_size=(20, 0), layout="rows")],
                         ids=["base", "window", "window-rows"])
def test_mosaic_under_the_strict_interpreter(options):
    """Races detected, VMEM NaN-filled before use and out-of-bounds reads raising: a slot read
    before its copy lands, a buffer slot no copy of this step wrote (past the last page, before
    the window's first page) leaking into the output, or a copy of a page past a sequence's
    last one (every such table entry points outside the pool here) shows up."""
    options = dict(options)
    layout = options.pop("layout", None)
    params = backend.tpu_interpret_params()
    if params is None:
        pytest.skip("this JAX has no pltpu.InterpretParams")
    # the first sequence's window starts past its first step's first page: those VMEM slots
    # are still uninitialized (NaN) when it computes
    q, k, v, lengths, table = make_problem(Case(lengths=(70, 0, 17, 33, 64), q_len=2), seed=11)
    for b, n in enumerate(lengths):
        table[b, -(-n // 16):] = [k.shape[0], 2 ** 31 - 1, k.shape[0] + 9][b % 3]
    problem = (q, k, v, lengths, table)
    try:
        got = attend("tpu", problem, interpret=params, layout=layout, **options)
        races = backend.tpu_interpret_races_found()
    finally:
        backend.reset_tpu_interpret_state()
    assert_matches(got, problem, **options)
    assert races is not True


def test_triton_lowers_for_cuda():
    """``jax.export`` for cuda runs the Pallas -> Triton lowering (no GPU compiler here)."""
    from jax import export

    q = jax.ShapeDtypeStruct((4, 2, 8, 128), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((300, 24, 2, 128), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((4, 50), jnp.int32)
    lengths = jax.ShapeDtypeStruct((4,), jnp.int32)
    sinks = jax.ShapeDtypeStruct((8,), jnp.float32)

    def fn(q, k, v, lengths, table, sinks):
        return paged_attention_triton(q, k, v, kv_lengths=lengths, page_indices=table,
                                      window_size=(100, 0), softcap=30.0, sinks=sinks)
    triton = "__gpu$xla.gpu.triton"
    module = export.export(jax.jit(fn), platforms=["cuda"],
                           disabled_checks=[export.DisabledSafetyCheck.custom_call(triton)])(
        q, pool, pool, lengths, table, sinks).mlir_module()
    assert module.count(f"@{triton}") == 1


# --- slow: compiled for a TPU v5e without one ----------------------------------------------------


def _v5e_reason():
    from tpu_kernel_records_tools.bench import compiled
    return compiled.unavailable_reason()


@pytest.mark.slow
@pytest.mark.parametrize("shape", [
    # batch, q_len, hq, hk, head_dim, page_size, keys per sequence, dtype, features
    (8, 1, 32, 8, 128, 16, 4096, "bfloat16", {}),
    (2, 4, 8, 1, 128, 128, 1024, "float32", dict(window_size=(100, 0), softcap=30.0, sinks=True)),
    (2, 1, 4, 4, 64, 24, 1000, "bfloat16", {}),
], ids=["llama3-8b-decode", "group8-q4-features", "page24-d64"])
def test_mosaic_compiles_for_v5e(shape):
    """Compiled deviceless in the layout the installed jax takes ("heads" from jax 0.7, "rows"
    before: the Kaggle image's 0.6.2); with head_dim a multiple of 128 nothing copies the pools
    around the kernel (the "rows" view is free)."""
    reason = _v5e_reason()
    if reason is not None:
        pytest.skip(reason)
    from tpu_kernel_records_tools.bench import compiled

    batch, q_len, hq, hk, d, ps, keys, dtype, options = shape
    options = dict(options)
    per_seq = -(-keys // ps)
    num_pages = batch * per_seq + 3
    args = [(batch, q_len, hq, d), (num_pages, ps, hk, d), (num_pages, ps, hk, d)]
    args = [compiled.struct(s, jnp.dtype(dtype)) for s in args]
    args += [compiled.struct((batch,), jnp.int32), compiled.struct((batch, per_seq), jnp.int32)]
    if options.pop("sinks", False):
        args.append(compiled.struct((hq,), jnp.float32))

    def fn(q, k, v, lengths, table, *sinks):
        return paged_attention_tpu(q, k, v, kv_lengths=lengths, page_indices=table,
                                   sinks=sinks[0] if sinks else None, **options)
    facts = compiled.analyse(compiled.compile_program(fn, args))
    (kernel,) = facts["kernels"]
    assert kernel["vmem_bytes"] is not None
    least = 2 * batch * per_seq * ps * hk * d * jnp.dtype(dtype).itemsize  # K and V once
    assert kernel["declared_bytes"] >= least
    if d % 128 == 0:  # no copy of the pools around the kernel (layout "rows": a free view)
        assert facts["outside_bytes"] < least / 4
