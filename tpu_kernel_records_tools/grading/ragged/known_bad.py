"""Ragged candidates the rubric grades (``tpu-kernel-rubric --ragged``): the reference, a correct variant written
another way, and known-bad ones, each with one bug of the kind serving kernels' trackers report (issue 53) or an
edge of the contract a kernel gets wrong.

Every candidate follows ``ragged_paged_attention(q, k_pages, v_pages, *, kv_lengths, page_indices, cu_q_lens,
num_seqs, scale=None, causal=True, window_size=None, softcap=None, sinks=None, k_scale=None, v_scale=None)``
(``kernel_src.contract``). A known-bad entry's ``doc`` names its bug and ``catches`` the ragged check(s) built to
reject it (``grading.ragged.checks``). The known-bad ones share one compiled program per shape (``_ragged_bugs``:
every bug a *traced* switch, all off the contract), so grading all of them costs one compile per shape.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from ...grading.candidate import Candidate
from ...grading.paged.known_bad import _constant, _kernel
from ...sandbox.cpu_jit import jit_cpu
from kernel_src.contract import RAGGED_FEATURES, check_ragged_inputs, default_scale, dequantize, visible
from kernel_src.reference import reference_ragged_paged_attention, row_owners

RaggedAttention = Callable[..., jax.Array]
STATIC = ("causal", "scale", "window_size", "softcap")  # hashable arguments: static under jit
_HIGHEST = jax.lax.Precision.HIGHEST


def _given(window_size=None, softcap=None, sinks=None, k_scale=None, v_scale=None) -> dict:
    """The feature arguments a call sets, window and cap made hashable."""
    found = {"window_size": None if window_size is None else tuple(window_size),
             "softcap": None if softcap is None else float(softcap), "sinks": sinks, "k_scale": k_scale,
             "v_scale": v_scale}
    return {n: x for n, x in found.items() if x is not None}


def jit_ragged(fn: RaggedAttention, features: tuple[str, ...] | None = None, *, cpu: bool = False) -> RaggedAttention:
    """``fn`` under ``jax.jit`` (``jit_cpu`` when ``cpu``) with static ``causal``, ``scale``, ``window_size`` and
    ``softcap`` (the scales traced), called with the ragged contract's signature; only the feature arguments a
    call sets reach ``fn``. It declares ``features`` (default: what ``fn`` declares)."""
    jitted = (jit_cpu if cpu else jax.jit)(fn, static_argnames=STATIC)

    @functools.wraps(fn)
    def ragged_paged_attention(q, k_pages, v_pages, *, kv_lengths, page_indices, cu_q_lens, num_seqs, scale=None,
                               causal=True, **features):
        return jitted(q, k_pages, v_pages, kv_lengths=kv_lengths, page_indices=page_indices, cu_q_lens=cu_q_lens,
                      num_seqs=num_seqs, causal=bool(causal), scale=None if scale is None else float(scale),
                      **_given(**features))

    ragged_paged_attention.features = tuple(getattr(fn, "features", ()) if features is None else features)
    return ragged_paged_attention


ragged_reference = jit_ragged(reference_ragged_paged_attention, RAGGED_FEATURES, cpu=True)
"""``kernel_src.reference.reference_ragged_paged_attention`` jitted per flags: the ``ragged-reference`` candidate and
the ragged rubric's baseline (one compiled program serves both)."""


# --------------------------------------------------------------------------------------------------
# Known-bad: one program whose bugs are traced switches.

class RaggedSwitches(NamedTuple):
    """Runtime switches of :func:`_ragged_bugs`; all off is the contract."""

    last_page_whole: bool = False      # the last page's slots past the length go into P·V unzeroed (0 * NaN)
    slot_mod_128: bool = False         # a key's slot taken as t % 128 past page size 128
    ignores_num_seqs: bool = False     # every table row is a sequence: garbage offsets claim real rows
    boundary_off_by_one: bool = False  # row r owned where cu[i] < r <= cu[i + 1]
    skips_empty: bool = False          # empty sequences dropped: later rows read the previous index's length/table
    top_left: bool = False             # row j of a sequence at position j instead of kv_len - q_len + j
    causal_decode_only: bool = False   # the causal mask applied to decode rows only
    int16_indices: bool = False        # page_indices kept in int16
    int16_lengths: bool = False        # kv_lengths kept in int16
    identity_table: bool = False       # sequence i's page c is page i * pages_per_sequence + c
    window_page_floor: bool = False    # the window's left edge rounded down to its page's first key
    window_right_clamped: bool = False  # the window's right edge clamped to the row's position
    window_skip_from_last_row: bool = False  # a page skipped for all rows when left of the LAST row's window
    ignores_scale: bool = False        # a given scale ignored: head_dim ** -0.5 always
    softcap_after_mask: bool = False   # the cap applied after masking: masked keys at -softcap, not -inf
    sinks_scaled: bool = False         # the sink multiplied by the softmax scale
    no_descale: bool = False           # a quantized pool's stored numbers used without k_scale, v_scale
    scales_swapped: bool = False       # k_scale applied to values and v_scale to keys
    int8_unsigned: bool = False        # int8 stored values read as uint8


def _owners(cu, num_seqs, t: int, sw: RaggedSwitches):
    """``(owner, graded)`` as the switches compute them (``kernel_src.reference.row_owners`` with none on)."""
    i = jnp.arange(cu.shape[0] - 1)
    r = jnp.arange(t)[:, None]
    valid = (i < num_seqs[0]) | sw.ignores_num_seqs
    inside = jnp.where(sw.boundary_off_by_one, (cu[None, :-1] < r) & (r <= cu[None, 1:]),
                       (cu[None, :-1] <= r) & (r < cu[None, 1:]))
    owner = jnp.max(jnp.where(valid[None, :] & inside, i[None, :], -1), axis=1)
    return jnp.maximum(owner, 0), owner >= 0


def _ragged_bugs(q, k_pages, v_pages, kv_lengths, page_indices, cu_q_lens, num_seqs, sinks, k_scale, v_scale, *,
                 causal, scale, window_size, softcap, sw: RaggedSwitches):
    dims = check_ragged_inputs(q, k_pages, v_pages, kv_lengths, page_indices, cu_q_lens, num_seqs, k_scale, v_scale)
    t, hk, g, d, span = dims.num_tokens, dims.num_kv_heads, dims.group, dims.head_dim, dims.max_length
    n, ps, pps = dims.num_pages, dims.page_size, dims.pages_per_sequence
    scale = jnp.where(sw.ignores_scale, d ** -0.5, default_scale(d, scale))
    cu = cu_q_lens.astype(jnp.int32)
    owner, graded = _owners(cu, num_seqs.astype(jnp.int32), t, sw)
    q_len, start = cu[owner + 1] - cu[owner], cu[owner]
    empties = jnp.cumsum((cu[1:] == cu[:-1]).astype(jnp.int32)) - (cu[1:] == cu[:-1])  # empty sequences before i
    read = jnp.where(sw.skips_empty, owner - empties[owner], owner)
    lengths = kv_lengths.astype(jnp.int32)
    lengths = jnp.where(sw.int16_lengths, lengths.astype(jnp.int16).astype(jnp.int32), lengths)
    table = page_indices.astype(jnp.int32)
    table = jnp.where(sw.int16_indices, table.astype(jnp.int16).astype(jnp.int32), table)
    table = jnp.where(sw.identity_table, (jnp.arange(dims.max_seqs)[:, None] * pps + jnp.arange(pps)) % n, table)
    length, table = lengths[read], table[read]  # [t], [t, pps]
    j = jnp.arange(span)
    position = jnp.where(sw.top_left, 0, length - q_len) + jnp.arange(t) - start
    slot = jnp.where(sw.slot_mod_128 & (ps > 128), j % 128, j % ps)
    flat = table[:, j // ps] * ps + slot  # [t, span]
    if dims.quantized:
        k_pages, v_pages = (jnp.where(sw.int8_unsigned & (x < 0), x.astype(jnp.float32) + 256, x.astype(jnp.float32))
                            for x in (k_pages, v_pages))
        k_s, v_s = jnp.where(sw.scales_swapped, v_scale, k_scale), jnp.where(sw.scales_swapped, k_scale, v_scale)
        k_pages, v_pages = (dequantize(x, jnp.where(sw.no_descale, 1.0, s)).astype(q.dtype)
                            for x, s in ((k_pages, k_s), (v_pages, v_s)))
    k_raw, v_raw = (x.reshape(n * ps, hk, d)[flat] for x in (k_pages, v_pages))  # [t, span, hk, d]
    exists = j[None, :] < length[:, None]
    k, v = (jnp.where(exists[:, :, None, None], x, 0) for x in (k_raw, v_raw))
    logits = jnp.einsum("thgd,tkhd->thgk", q.reshape(t, hk, g, d), k, precision=_HIGHEST,
                        preferred_element_type=jnp.float32) * scale
    p = position[:, None]
    mask = exists & ((j[None, :] <= p) | (not causal) | (sw.causal_decode_only & (q_len[:, None] > 1)))
    if window_size is not None:
        left, right = window_size
        if left is not None:
            edge = p - left
            mask &= j[None, :] >= jnp.where(sw.window_page_floor, edge // ps * ps, edge)
            skipped = j[None, :] // ps * ps + ps - 1 < length[:, None] - 1 - left  # by the sequence's last row
            mask &= ~(skipped & sw.window_skip_from_last_row)
        if right is not None:
            mask &= j[None, :] <= jnp.where(sw.window_right_clamped, p, p + right)
    mask = mask[:, None, None, :]
    if softcap is not None:
        capped = softcap * jnp.tanh(logits / softcap)
        logits = jnp.where(sw.softcap_after_mask, softcap * jnp.tanh(jnp.where(mask, logits, -jnp.inf) / softcap),
                           jnp.where(mask, capped, -jnp.inf))
        mask = mask | sw.softcap_after_mask
    else:
        logits = jnp.where(mask, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(1, hk, g, 1) * jnp.where(sw.sinks_scaled, scale, 1.0)
        m = jnp.maximum(m, sink)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(mask, jnp.exp(logits - m), 0.0)
    denom = jnp.sum(e, axis=-1, keepdims=True) + (0.0 if sinks is None else jnp.exp(sink - m))
    out = jnp.einsum("thgk,tkhd->thgd", e / jnp.where(denom > 0, denom, 1.0), v.astype(jnp.float32),
                     precision=_HIGHEST)
    # What a kernel adds as 0 * V for slots it reads but does not zero: nothing when V is finite, NaN when not.
    tail = (j[None, :] >= length[:, None]) & (j[None, :] < -(-length[:, None] // ps) * ps) & sw.last_page_whole
    leak = jnp.sum(0.0 * jnp.where(tail[:, :, None, None], v_raw, 0).astype(jnp.float32), axis=1)  # [t, hk, d]
    out = out + leak[:, :, None, :]
    return jnp.where(graded[:, None, None], out.reshape(q.shape), 0).astype(q.dtype)


_ragged_bugs_jit = jit_cpu(_ragged_bugs, static_argnames=("causal", "scale", "window_size", "softcap"))


def _bug(**switches) -> RaggedAttention:
    """The ragged contract on :func:`_ragged_bugs` with some switches on (every ragged feature declared)."""
    sw = RaggedSwitches(**switches)

    def ragged_paged_attention(q, k_pages, v_pages, *, kv_lengths, page_indices, cu_q_lens, num_seqs, scale=None,
                               causal=True, window_size=None, softcap=None, sinks=None, k_scale=None, v_scale=None):
        return _ragged_bugs_jit(q, k_pages, v_pages, kv_lengths, page_indices, cu_q_lens, num_seqs, sinks, k_scale,
                                v_scale, causal=bool(causal), scale=None if scale is None else float(scale),
                                window_size=None if window_size is None else tuple(window_size),
                                softcap=None if softcap is None else float(softcap), sw=sw)

    ragged_paged_attention.features = RAGGED_FEATURES
    return ragged_paged_attention


# --------------------------------------------------------------------------------------------------
# A correct variant written the way ragged kernels are: an online softmax over each row's page table.

def _online_rows(q, k_pages, v_pages, *, kv_lengths, page_indices, cu_q_lens, num_seqs, scale=None, causal=True,
                 window_size=None, softcap=None, sinks=None, k_scale=None, v_scale=None, pages_per_step: int = 2):
    """Online softmax over each row's table, ``pages_per_step`` pages per step (a ``lax.scan``): each step gathers
    those pages for every row, dequantizes them in float32 (never rounded to q's dtype), masks its own slots
    (length, causal position, window) with ``where``, caps the logits and rescales an fp32 running max, sum and
    accumulator; a sink starts each row's max and sum. Padding rows are zeros."""
    dims = check_ragged_inputs(q, k_pages, v_pages, kv_lengths, page_indices, cu_q_lens, num_seqs, k_scale, v_scale)
    t, hk, g, d, span = dims.num_tokens, dims.num_kv_heads, dims.group, dims.head_dim, dims.max_length
    ps, pps = dims.page_size, dims.pages_per_sequence
    scale = default_scale(d, scale)
    owner, graded = row_owners(cu_q_lens, num_seqs, t)
    cu = cu_q_lens.astype(jnp.int32)
    length = kv_lengths.astype(jnp.int32)[owner]
    position = length - (cu[owner + 1] - cu[owner]) + jnp.arange(t) - cu[owner]
    steps = -(-pps // pages_per_step)
    table = jnp.pad(page_indices.astype(jnp.int32)[owner], ((0, 0), (0, steps * pages_per_step - pps)))
    qg = q.reshape(t, hk, g, d).astype(jnp.float32)

    def values(pages, scale_):
        return (dequantize(pages, scale_) if dims.quantized else pages.astype(jnp.float32)).reshape(
            t, pages_per_step * ps, hk, d)

    def step(carry, c0):
        m, l, acc = carry  # [t, hk, g, 1], same, [t, hk, g, d]
        pages = jax.lax.dynamic_slice_in_dim(table, c0, pages_per_step, axis=1)  # [t, P]
        j = c0 * ps + jnp.arange(pages_per_step * ps)
        exists = (j[None, :] < length[:, None])[:, :, None, None]
        kc = jnp.where(exists, values(k_pages[pages], k_scale), 0)
        vc = jnp.where(exists, values(v_pages[pages], v_scale), 0)
        s = jnp.einsum("thgd,tkhd->thgk", qg, kc, precision=_HIGHEST) * scale
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        vis = visible(position[:, None], j[None, :], span, span, causal, length[:, None], window_size)
        s = jnp.where(vis[:, None, None], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        alpha = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)
        p = jnp.where(vis[:, None, None], jnp.exp(s - m_safe), 0.0)
        l = alpha * l + jnp.sum(p, axis=-1, keepdims=True)
        acc = alpha * acc + jnp.einsum("thgk,tkhd->thgd", p, vc, precision=_HIGHEST)
        return (m_new, l, acc), None

    if sinks is None:
        init = (jnp.full((t, hk, g, 1), -jnp.inf), jnp.zeros((t, hk, g, 1)), jnp.zeros((t, hk, g, d)))
    else:
        init = (jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, hk, g, 1), (t, hk, g, 1)),
                jnp.ones((t, hk, g, 1)), jnp.zeros((t, hk, g, d)))
    (_, l, acc), _ = jax.lax.scan(step, init, jnp.arange(steps) * pages_per_step)
    out = (acc / jnp.where(l > 0, l, 1.0)).reshape(q.shape)
    return jnp.where(graded[:, None, None], out, 0).astype(q.dtype)


_online_rows.features = RAGGED_FEATURES


# --------------------------------------------------------------------------------------------------
# The roster.

class RaggedEntry(NamedTuple):
    """One ragged candidate: ``grading.candidates.Candidate``'s fields, contract "ragged"."""

    name: str
    kind: str
    doc: str
    loader: Callable[[], RaggedAttention]
    catches: tuple[str, ...] = ()


def _bad(name: str, doc: str, catches: tuple[str, ...], **switches) -> RaggedEntry:
    return RaggedEntry(name, "known-bad", doc, _constant(_bug(**switches)), catches)


RAGGED_ENTRIES: tuple[RaggedEntry, ...] = (
    RaggedEntry("ragged-reference", "reference",
                "kernel_src.reference_ragged_paged_attention: the ragged contract in pure JAX (each row gathers its "
                "sequence's table, masks by length with where; fp32 logits, statistics and accumulation; a "
                "quantized pool dequantized and rounded to q's dtype).", _constant(ragged_reference)),
    RaggedEntry("ragged-online-rows", "correct-variant",
                "Online softmax over each row's page table, 2 pages per step (fp32 running max, sum and "
                "accumulator), masked slots zeroed, a quantized pool dequantized in float32 without rounding; every "
                "ragged feature.", _constant(jit_ragged(_online_rows, RAGGED_FEATURES, cpu=True))),
    RaggedEntry("ragged-pallas", "kernel", "kernel_src.ragged:ragged_paged_attention_tpu: the Pallas TPU ragged "
                "paged attention kernel (interpret mode on a CPU).",
                _kernel("kernel_src.ragged:ragged_paged_attention_tpu", jit_ragged)),
    RaggedEntry("ragged-triton", "kernel", "kernel_src.ragged:ragged_paged_attention_triton: the ragged kernel of "
                "the GPU Triton family (interpret mode on a CPU).",
                _kernel("kernel_src.ragged:ragged_paged_attention_triton", jit_ragged)),
    _bad("ragged-last-page-whole", "Reads each sequence's last page whole and masks only the logits: its slots past "
         "the length enter P·V as 0 * V (FlashAttention's NaN from unused cache slots).",
         ("ragged-garbage", "ragged-accuracy"), last_page_whole=True),
    _bad("ragged-slot-mod-128", "A key's slot in its page taken modulo 128: right up to page size 128, wrong past "
         "it (page sizes past 128 going wrong).", ("ragged-accuracy",), slot_mod_128=True),
    _bad("ragged-ignores-num-seqs", "Takes every table row as a sequence: the offsets past num_seqs, which may be "
         "anything, claim real rows.", ("ragged-garbage",), ignores_num_seqs=True),
    _bad("ragged-boundary-off-by-one", "Row r owned by the sequence with cu_q_lens[i] < r <= cu_q_lens[i + 1]: every "
         "sequence's first row computed as the previous sequence's.", ("ragged-accuracy",), boundary_off_by_one=True),
    _bad("ragged-skips-empty-sequences", "Drops q_len = 0 sequences from its metadata and indexes kv_lengths and "
         "page_indices by the compacted index: every row after an empty sequence reads another sequence's cache.",
         ("ragged-accuracy",), skips_empty=True),
    _bad("ragged-rows-top-left", "A sequence's new rows aligned top-left (row j at position j, not kv_len - q_len + "
         "j): chunked prefill and decode rows see too few keys.", ("ragged-accuracy",), top_left=True),
    _bad("ragged-causal-decode-only", "The causal mask applied to decode rows only: rows of a chunk or a prompt see "
         "their sequence's later keys.", ("ragged-accuracy",), causal_decode_only=True),
    _bad("ragged-int16-page-indices", "Page indices kept in int16: an index past 32767 wraps and reads another page "
         "(an offset overflow at a smaller scale than int32's).", ("ragged-long",), int16_indices=True),
    _bad("ragged-int16-lengths", "Lengths kept in int16: a sequence past 32767 keys wraps negative.", ("ragged-long",),
         int16_lengths=True),
    _bad("ragged-identity-table", "Assumes the identity page table (sequence i's page c is page i * "
         "pages_per_sequence + c): right only on a contiguous pool.", ("ragged-accuracy", "ragged-permutation"),
         identity_table=True),
    _bad("ragged-window-from-page-start", "The sliding window's key loop starts at the first key of the page the "
         "window's left edge falls in (tpu-inference's window starting at the wrong block).", ("ragged-window",),
         window_page_floor=True),
    _bad("ragged-window-right-clamped", "The window's right edge clamped to the row's position: right > 0 without "
         "causal sees no key past the row.", ("ragged-window",), window_right_clamped=True),
    _bad("ragged-window-skip-from-last-row", "Skips a page for every row of a sequence when the page lies left of "
         "the LAST row's window: decided from one row, so a chunk's earlier rows lose keys there.", ("ragged-window",),
         window_skip_from_last_row=True),
    _bad("ragged-ignores-scale", "A given scale ignored: head_dim ** -0.5 always.", ("ragged-accuracy",),
         ignores_scale=True),
    _bad("ragged-softcap-after-mask", "The cap applied after masking: masked keys get logit -softcap instead of "
         "-inf and take probability.", ("ragged-softcap",), softcap_after_mask=True),
    _bad("ragged-sinks-scaled", "The sink logit multiplied by the softmax scale.", ("ragged-sinks",), sinks_scaled=True),
    _bad("ragged-no-descale", "A quantized pool's stored numbers used without k_scale and v_scale (missing fp8 "
         "descales).", ("ragged-quantized_kv",), no_descale=True),
    _bad("ragged-scales-swapped", "k_scale applied to the values and v_scale to the keys.", ("ragged-quantized_kv",),
         scales_swapped=True),
    _bad("ragged-int8-as-uint8", "An int8 pool's stored values read as uint8: negative ones become 256 + x.",
         ("ragged-quantized_kv",), int8_unsigned=True),
)

# Kept apart from the other contracts' built-ins: every consumer of those grades their contracts.
RAGGED_BUILTIN: dict[str, Candidate] = {e.name: Candidate(e.name, e.kind, e.doc, e.loader, e.catches,
                                                          contract="ragged") for e in RAGGED_ENTRIES}
