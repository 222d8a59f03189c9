"""Paged candidates the rubric grades (``tpu-kernel-rubric --paged``): the reference, a correct variant written
another way, the paged kernels, and known-bad ones, each with one bug real paged kernels have had.

Every candidate follows ``paged_attention(q, k_pages, v_pages, *, kv_lengths, page_indices, scale=None,
causal=True, window_size=None, softcap=None, sinks=None)`` (``kernel_src.contract``). ``PAGED_ENTRIES``
lists them; ``grading.candidates`` turns each into a ``Candidate`` of contract "paged" that ``resolve``
finds by name. A known-bad entry's ``doc`` names its bug and ``catches`` the paged check(s) built to
reject it (``grading.paged.checks``).

The known-bad ones share one compiled program per shape (``_paged_bugs``: every bug a *traced* switch,
all off the contract), so grading all of them costs one compile per shape, not one per bug.
"""

from __future__ import annotations

import functools
import importlib
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from ...grading.candidate import Candidate
from ...sandbox.cpu_jit import jit_cpu
from kernel_src.contract import PAGED_FEATURES, check_paged_inputs, default_scale, visible
from kernel_src.reference import reference_paged_attention

PagedAttention = Callable[..., jax.Array]
STATIC = ("causal", "scale", "window_size", "softcap")  # hashable arguments: static under jit


def _given(window_size=None, softcap=None, sinks=None) -> dict:
    """The feature arguments a call sets, window and cap made hashable."""
    found = {"window_size": None if window_size is None else tuple(window_size),
             "softcap": None if softcap is None else float(softcap), "sinks": sinks}
    return {n: x for n, x in found.items() if x is not None}


def jit_paged(fn: PagedAttention, features: tuple[str, ...] | None = None, *, cpu: bool = False) -> PagedAttention:
    """``fn`` under ``jax.jit`` (``jit_cpu`` when ``cpu``) with static ``causal``, ``scale``, ``window_size``
    and ``softcap``, called with the paged contract's signature; only the feature arguments a call sets
    reach ``fn``. It declares ``features`` (default: what ``fn`` declares)."""
    jitted = (jit_cpu if cpu else jax.jit)(fn, static_argnames=STATIC)

    @functools.wraps(fn)
    def paged_attention(q, k_pages, v_pages, *, kv_lengths, page_indices, scale=None, causal=True, **features):
        return jitted(q, k_pages, v_pages, kv_lengths=kv_lengths, page_indices=page_indices, causal=bool(causal),
                      scale=None if scale is None else float(scale), **_given(**features))

    paged_attention.features = tuple(getattr(fn, "features", ()) if features is None else features)
    return paged_attention


paged_reference = jit_paged(reference_paged_attention, PAGED_FEATURES, cpu=True)
"""``kernel_src.reference.reference_paged_attention`` jitted per flags: the ``paged-reference`` candidate and the
paged rubric's baseline (one compiled program serves both)."""


# --------------------------------------------------------------------------------------------------
# Known-bad: one gather-then-attend program whose bugs are traced switches.

class PagedSwitches(NamedTuple):
    """Runtime switches of :func:`_paged_bugs`; all off is the contract."""

    length_from_pages: bool = False   # length taken as ceil(kv_lengths / page_size) * page_size (mask and position)
    pages_floor: bool = False         # only kv_lengths // page_size whole pages read
    identity_table: bool = False      # sequence b's page c is page b * pages_per_sequence + c
    axes_swapped: bool = False        # pages read as [num_pages, num_kv_heads, page_size, head_dim]
    kv_swapped: bool = False          # V used as keys and K as values
    last_page_whole: bool = False     # the last page's slots past the length go into P·V unzeroed (0 * NaN)
    one_page_more: bool = False       # at an exact multiple, the next table entry's page goes into P·V unzeroed
    int16_indices: bool = False       # page_indices cast to int16 (wraps past 32767)
    int16_lengths: bool = False       # kv_lengths cast to int16 (wraps past 32767)
    top_left: bool = False            # new row i at position i instead of kv_lengths - q_len + i
    table_aligned: bool = False       # new row i at pages_per_sequence * page_size - q_len + i


def _paged_bugs(q, k_pages, v_pages, kv_lengths, page_indices, *, causal, scale, sw: PagedSwitches):
    dims = check_paged_inputs(q, k_pages, v_pages, kv_lengths, page_indices)
    b, lq, hk, g, d = dims.batch, dims.q_len, dims.num_kv_heads, dims.group, dims.head_dim
    n, ps, pps, span = dims.num_pages, dims.page_size, dims.pages_per_sequence, dims.max_length
    scale = default_scale(d, scale)
    lengths = kv_lengths.astype(jnp.int32)
    lengths = jnp.where(sw.int16_lengths, lengths.astype(jnp.int16).astype(jnp.int32), lengths)
    table = page_indices.astype(jnp.int32)
    table = jnp.where(sw.int16_indices, table.astype(jnp.int16).astype(jnp.int32), table)
    table = jnp.where(sw.identity_table, (jnp.arange(b)[:, None] * pps + jnp.arange(pps)[None, :]) % n, table)
    k_pool, v_pool = (jnp.where(sw.kv_swapped, v_pages, k_pages), jnp.where(sw.kv_swapped, k_pages, v_pages))
    k_pool, v_pool = (jnp.where(sw.axes_swapped, x.reshape(n, hk, ps, d).transpose(0, 2, 1, 3), x)
                      for x in (k_pool, v_pool))
    k, v = k_pool[table].reshape(b, span, hk, d), v_pool[table].reshape(b, span, hk, d)
    j = jnp.arange(span)
    whole = -(-lengths // ps) * ps  # every slot of the pages that hold a key
    seen = jnp.where(sw.length_from_pages, whole, jnp.where(sw.pages_floor, lengths // ps * ps, lengths))
    used = j[None, :] < seen[:, None]  # [b, span]: the keys the kernel believes exist
    length = jnp.where(sw.length_from_pages, whole, lengths)
    row = jnp.arange(lq)[None, :, None]
    position = jnp.where(sw.top_left, row,
                         jnp.where(sw.table_aligned, row + span - lq, row + length[:, None, None] - lq))
    mask = used[:, None, :] & ((j[None, None, :] <= position) | (not causal))  # [b, q_len, span]
    kz = jnp.where(used[:, :, None, None], k, 0)
    vz = jnp.where(used[:, :, None, None], v, 0)
    qg = q.reshape(b, lq, hk, g, d)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, kz, precision=jax.lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    e = jnp.where(mask[:, None, None], jnp.exp(s - m), 0.0)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p, vz.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    # What a kernel adds as 0 * V for slots it reads but does not zero: nothing when V is finite, NaN when not.
    tail = (j[None, :] >= lengths[:, None]) & (j[None, :] < whole[:, None]) & sw.last_page_whole
    extra_page = jnp.take_along_axis(table, jnp.minimum(lengths // ps, pps - 1)[:, None], axis=1)[:, 0]
    more = (lengths % ps == 0) & (lengths // ps < pps) & sw.one_page_more
    leak = jnp.sum(0.0 * jnp.where(tail[:, :, None, None], v, 0).astype(jnp.float32), axis=1)  # [b, hk, d]
    leak = leak + jnp.where(more[:, None, None], 0.0 * jnp.sum(v_pool[extra_page].astype(jnp.float32), axis=1), 0.0)
    out = out + leak[:, None, :, None, :]
    return out.reshape(q.shape).astype(q.dtype)


_paged_bugs_jit = jit_cpu(_paged_bugs, static_argnames=("causal", "scale"))


def _bug(**switches) -> PagedAttention:
    """The paged contract on :func:`_paged_bugs` with some switches on (no feature declared)."""
    sw = PagedSwitches(**switches)

    def paged_attention(q, k_pages, v_pages, *, kv_lengths, page_indices, scale=None, causal=True):
        return _paged_bugs_jit(q, k_pages, v_pages, kv_lengths, page_indices, causal=bool(causal),
                               scale=None if scale is None else float(scale), sw=sw)

    paged_attention.features = ()
    return paged_attention


# --------------------------------------------------------------------------------------------------
# A correct variant written the way paged decode kernels are: an online softmax over the page table.

def _online_pages(q, k_pages, v_pages, *, kv_lengths, page_indices, causal=True, scale=None, window_size=None,
                  softcap=None, sinks=None, pages_per_step: int = 4, pool_order: bool = False,
                  window_skip_from_last_row: bool = False):
    """Online softmax over the table, ``pages_per_step`` pages per step (a ``lax.scan``): each step gathers
    those pages of every sequence, masks its own slots (length, causal position, window) with ``where``,
    caps the logits, and rescales an fp32 running max, sum and accumulator; a sink starts each row's max
    and sum (``m = sink``, ``l = 1``). Slots it masks are zeroed in V before P·V, so garbage never reaches
    the sum. ``pool_order`` (known-bad): each sequence's pages are visited in the order of their physical
    index in the pool instead of table order: the same sums in another order. ``window_skip_from_last_row``
    (known-bad): a page is skipped for every row when its last key lies left of the last row's window."""
    dims = check_paged_inputs(q, k_pages, v_pages, kv_lengths, page_indices)
    b, lq, hq, hk, d = dims.batch, dims.q_len, dims.num_q_heads, dims.num_kv_heads, dims.head_dim
    ps, pps = dims.page_size, dims.pages_per_sequence
    g = hq // hk
    scale = default_scale(d, scale)
    lengths = kv_lengths.astype(jnp.int32)
    table = page_indices.astype(jnp.int32)
    columns = jnp.broadcast_to(jnp.arange(pps)[None, :], (b, pps))
    if pool_order:  # used pages sorted by their index in the pool; the rest after them
        used = columns < -(-lengths[:, None] // ps)
        columns = jnp.argsort(jnp.where(used, table, jnp.iinfo(jnp.int32).max), axis=1).astype(jnp.int32)
    steps = -(-pps // pages_per_step)
    pad = steps * pages_per_step - pps
    columns = jnp.pad(columns, ((0, 0), (0, pad)), constant_values=pps)  # column pps: past every length
    table = jnp.pad(table, ((0, 0), (0, 1)))
    qg = q.reshape(b, lq, hk, g, d).astype(jnp.float32)
    row = jnp.arange(lq)[None, :, None, None]  # [1, q, 1, 1] against slots [b, 1, P, ps]
    left, right = (None, None) if window_size is None else window_size

    def step(carry, c0):
        m, l, acc = carry  # [b, hk, g, q, 1], same, [b, hk, g, q, d]
        cols = jax.lax.dynamic_slice_in_dim(columns, c0, pages_per_step, axis=1)  # [b, P]
        pages = jnp.take_along_axis(table, cols, axis=1)
        j = (cols[:, :, None] * ps + jnp.arange(ps)[None, None, :])[:, None]  # [b, 1, P, ps]
        vis = visible(row, j, lq, lengths[:, None, None, None], causal, None, window_size)  # [b, q, P, ps]
        vis = jnp.broadcast_to(vis, (b, lq, pages_per_step, ps)).reshape(b, lq, pages_per_step * ps)
        if window_skip_from_last_row and left is not None:
            skipped = cols * ps + ps - 1 < (lengths - 1 - left)[:, None]  # [b, P]
            vis = vis & ~jnp.repeat(skipped, ps, axis=1)[:, None, :]
        exists = (j < lengths[:, None, None, None]).reshape(b, pages_per_step * ps)[:, :, None, None]
        kc = jnp.where(exists, k_pages[pages].reshape(b, pages_per_step * ps, hk, d), 0).astype(jnp.float32)
        vc = jnp.where(exists, v_pages[pages].reshape(b, pages_per_step * ps, hk, d), 0).astype(jnp.float32)
        s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, kc, precision=jax.lax.Precision.HIGHEST) * scale
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        s = jnp.where(vis[:, None, None], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        alpha = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)
        p = jnp.where(vis[:, None, None], jnp.exp(s - m_safe), 0.0)
        l = alpha * l + jnp.sum(p, axis=-1, keepdims=True)
        acc = alpha * acc + jnp.einsum("bhgqk,bkhd->bhgqd", p, vc, precision=jax.lax.Precision.HIGHEST)
        return (m_new, l, acc), None

    if sinks is None:
        init = (jnp.full((b, hk, g, lq, 1), -jnp.inf), jnp.zeros((b, hk, g, lq, 1)), jnp.zeros((b, hk, g, lq, d)))
    else:
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, hk, g, 1, 1), (b, hk, g, lq, 1))
        init = (sink, jnp.ones((b, hk, g, lq, 1)), jnp.zeros((b, hk, g, lq, d)))
    (_, l, acc), _ = jax.lax.scan(step, init, jnp.arange(0, steps * pages_per_step, pages_per_step))
    out = acc / jnp.where(l > 0, l, 1.0)
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(q.shape).astype(q.dtype)


# --------------------------------------------------------------------------------------------------
# The roster.

class PagedEntry(NamedTuple):
    """One paged candidate: ``grading.candidates.Candidate``'s fields, contract "paged"."""

    name: str
    kind: str
    doc: str
    loader: Callable[[], PagedAttention]
    catches: tuple[str, ...] = ()


def _constant(fn):
    return lambda: fn


def _kernel(target: str, jit: Callable[[Callable], Callable] | None = None) -> Callable[[], PagedAttention]:
    """Lazy loader of ``module:attribute`` (a kernel), jitted per flags as it runs in a model (``jit``: the
    contract's wrapper, :func:`jit_paged` by default); an import error becomes the scorecard's load error
    (``grading.candidates.Candidate.load``)."""
    @functools.cache
    def load() -> PagedAttention:
        module, _, attribute = target.partition(":")
        return (jit or jit_paged)(getattr(importlib.import_module(module), attribute))
    return load


def _bad(name: str, doc: str, catches: tuple[str, ...], **switches) -> PagedEntry:
    return PagedEntry(name, "known-bad", doc, _constant(_bug(**switches)), catches)


PAGED_ENTRIES: tuple[PagedEntry, ...] = (
    PagedEntry("paged-reference", "reference",
               "kernel_src.reference_paged_attention: the paged contract in pure JAX (gather each table, mask by "
               "length with where, fp32 logits, statistics and accumulation).", _constant(paged_reference)),
    PagedEntry("paged-online-pages", "correct-variant",
               "Online softmax over the page table, 4 pages per step (fp32 running max, sum and accumulator), "
               "masked slots zeroed in V; every paged feature.",
               _constant(jit_paged(_online_pages, PAGED_FEATURES, cpu=True))),
    PagedEntry("paged-pallas", "kernel", "kernel_src.paged:paged_attention_tpu: the Pallas TPU paged decode kernel.",
               _kernel("kernel_src.paged:paged_attention_tpu")),
    PagedEntry("paged-triton", "kernel", "kernel_src.paged:paged_attention_triton: the paged kernel of the GPU "
               "Triton family (interpret mode on a CPU).", _kernel("kernel_src.paged:paged_attention_triton")),
    _bad("paged-length-from-pages", "Masks by page count instead of length: a sequence's length taken as its pages "
         "times page_size, so the unused slots of its last page are keys and its rows sit past their position.",
         ("paged-accuracy", "paged-garbage"), length_from_pages=True),
    _bad("paged-pages-rounded-down", "The page count rounded down (kv_lengths // page_size): the keys of a "
         "sequence's partial last page are never read.", ("paged-accuracy",), pages_floor=True),
    _bad("paged-identity-table", "Assumes the identity page table (sequence b's page c is page b * "
         "pages_per_sequence + c): right only on a contiguous pool.", ("paged-accuracy", "paged-permutation"),
         identity_table=True),
    _bad("paged-page-head-swapped", "Page and head axes swapped: the pool read as [num_pages, num_kv_heads, "
         "page_size, head_dim]; right with one kv head.", ("paged-accuracy",), axes_swapped=True),
    _bad("paged-kv-swapped", "K and V swapped: v_pages used as keys and k_pages as values.", ("paged-accuracy",),
         kv_swapped=True),
    _bad("paged-last-page-whole", "Reads the last page whole and masks only the logits: its slots past the length "
         "enter P·V as 0 * V, harmless on a zero-filled pool, NaN on a real one.", ("paged-garbage", "paged-accuracy"),
         last_page_whole=True),
    _bad("paged-one-page-too-many", "Reads one page too many when a length is an exact multiple of page_size: the "
         "next table entry's page enters P·V as 0 * V (NaN when that entry points at a NaN page).",
         ("paged-garbage", "paged-accuracy"), one_page_more=True),
    _bad("paged-int16-page-indices", "Page indices kept in int16: an index past 32767 wraps and reads another "
         "page.", ("paged-long",), int16_indices=True),
    _bad("paged-int16-lengths", "Lengths kept in int16: a sequence past 32767 keys wraps negative and sees "
         "nothing.", ("paged-long",), int16_lengths=True),
    _bad("paged-rows-top-left", "New rows aligned top-left: row i at position i instead of kv_lengths - q_len + i "
         "(a decoding row sees only the first key).", ("paged-accuracy", "paged-dense"), top_left=True),
    _bad("paged-rows-at-table-end", "New rows aligned to the table's end (pages_per_sequence * page_size - q_len "
         "+ i), the dense contract's alignment on the gathered cache: speculative rows see each other's future.",
         ("paged-accuracy", "paged-dense"), table_aligned=True),
    PagedEntry("paged-pool-order", "known-bad", "Online softmax over each sequence's pages in the order of their "
               "index in the pool instead of table order: the same keys summed in another order, so a permuted "
               "pool changes bits.", _constant(jit_paged(functools.partial(_online_pages, pool_order=True), (),
                                                         cpu=True)), ("paged-permutation",)),
    PagedEntry("paged-window-skip-from-last-row", "known-bad", "Online softmax over the page table that skips a page "
               "for every row when the page's last key is left of the LAST row's window: decided from one row, so "
               "speculative rows whose windows start in an earlier page lose keys there.",
               _constant(jit_paged(functools.partial(_online_pages, window_skip_from_last_row=True), PAGED_FEATURES,
                                   cpu=True)), ("paged-window",)),
)

# Kept apart from the dense BUILTIN: every consumer of BUILTIN grades the attention contract.
PAGED_BUILTIN: dict[str, Candidate] = {e.name: Candidate(e.name, e.kind, e.doc, e.loader, e.catches, contract="paged")
                                       for e in PAGED_ENTRIES}
