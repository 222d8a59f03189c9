"""The candidate contract shared by every kernel and grader.

``attention(q, k, v, *, causal=False, kv_lengths=None, scale=None, window_size=None, softcap=None,
q_segment_ids=None, kv_segment_ids=None, sinks=None) -> out``

* ``q``: ``[batch, q_len, num_q_heads, head_dim]``; ``k``, ``v``:
  ``[batch, kv_len, num_kv_heads, head_dim]`` (the layout of
  ``jax.nn.dot_product_attention``); all three float32 or all three bfloat16.
* Query row ``i`` sits at position ``p = i + (kv_len - q_len)``. ``causal`` is bottom-right aligned:
  query ``i`` sees key ``j`` iff ``j <= p``.
* ``kv_lengths``: int ``[batch]``; key ``j >= kv_lengths[b]`` is padding.
* Grouped-query: query head ``h`` reads kv head ``h // (num_q_heads // num_kv_heads)``.
* ``scale`` defaults to ``head_dim ** -0.5``; a given ``scale`` is used as is, in
  the forward and in the gradients.

The features (``FEATURES``; a kernel supports only those it declares, ``declared_features``):

* ``window_size=(left, right)`` (feature ``"window"``), each an int >= 0 or None (unbounded on that
  side): key ``j`` is visible iff ``p - left <= j <= p + right``, both ends inclusive, as
  FlashAttention's ``window_size``; with ``causal=True`` also ``j <= p``. A model config's
  ``sliding_window=W`` (Mistral, Gemma, gpt-oss: W keys, the query's own included) is
  ``window_size=(W - 1, 0)``. There is no ``-1`` sentinel: an unbounded side is None.
* ``softcap`` (feature ``"softcap"``), a float > 0: the logit is ``s = scale * q.k``, then
  ``s = softcap * tanh(s / softcap)``, then masking, then softmax (the order of FlashAttention,
  FlexAttention and JAX's ragged paged attention).
* ``q_segment_ids`` int32 ``[batch, q_len]`` and ``kv_segment_ids`` int32 ``[batch, kv_len]``
  (feature ``"segments"``), both or neither: key ``j`` is visible to row ``i`` only where the ids are
  equal (equality, not contiguous runs: ids may repeat, A B A).
* ``sinks`` float32 ``[num_q_heads]`` (feature ``"sinks"``), one logit per query head, not multiplied
  by ``scale`` and not capped: ``exp(sinks[h])`` joins each row's softmax denominator (in the same
  max-shifted frame) and contributes no value. A row with no visible key still yields exact zeros.
* Every mask combines with AND, with ``causal`` and with ``kv_lengths``; ``jax.grad`` works with
  respect to ``q``, ``k``, ``v`` and ``sinks``.

A candidate declares the features it supports with a ``features`` attribute on the function (a
tuple of names from ``FEATURES``; ``supports`` sets it). The rubric always grades the base contract
and grades every declared feature on top; a candidate that declares nothing is only ever called with
``causal``, ``kv_lengths`` and ``scale``, exactly as before the features existed.

Rules the rubric (``grading.dense.checks``) judges, each by a named check:

* The output has ``q``'s shape and its dtype equals ``q.dtype`` (output-shape-dtype).
* A query row with no visible key yields exact zeros, and its dQ is exactly zero
  (empty-rows; and each feature's check for the rows its mask empties).
* dK and dV are exactly zero for keys that no query sees: padding, keys in the future of
  every row, outside every row's window or of no row's segment (gradients, and every check that
  takes gradients).
* Padded K/V slots (``j >= kv_lengths[b]``) may hold any *finite* values; they change
  neither the output nor a gradient (padding-leak fills them with large finite values).
  NaN or Inf there is outside the contract: the reference computes ``0 * V`` for them.
* Precision: logits, softmax statistics and accumulation in fp32. Probabilities (and,
  in the backward, P and dS) may be rounded to the input dtype before a matmul, and
  each query head's dK/dV contribution may be rounded to the input dtype before the
  sum over its group; the result is judged against a float64 truth with a bound set by
  the reference's own error (``grading.tolerance``).
* ``jax.grad`` works; the same inputs give the same bits (determinism); different
  inputs get their own answers (no result kept by shape).
* Each declared feature is graded by the check of its name (window, softcap, segments, sinks).

The paged contract (a KV cache kept in fixed-size pages, as serving engines keep it):

``paged_attention(q, k_pages, v_pages, *, kv_lengths, page_indices, scale=None, causal=True,
window_size=None, softcap=None, sinks=None) -> out``

* ``q``: ``[batch, q_len, num_q_heads, head_dim]`` with ``q_len >= 1`` (decoding, speculative rows,
  chunks of prefill); ``k_pages``, ``v_pages``: ``[num_pages, page_size, num_kv_heads, head_dim]`` (the
  pool); ``page_indices``: int32 ``[batch, pages_per_sequence]``; ``kv_lengths``: int32 ``[batch]``. Key
  ``j`` of sequence ``b`` is ``k_pages[page_indices[b, j // page_size], j % page_size]`` for
  ``j < kv_lengths[b]`` (``kv_lengths[b] <= pages_per_sequence * page_size``).
* Query row ``i`` of sequence ``b`` sits at position ``p = kv_lengths[b] - q_len + i`` (the new tokens
  are the last ``q_len`` of the sequence): ``visible`` with ``kv_len = kv_lengths[b]``. ``causal``
  (default True, as in serving) hides keys ``j > p``; ``window_size``, ``softcap`` and ``sinks`` mean
  what they mean for ``attention`` (features ``"window"``, ``"softcap"``, ``"sinks"``, declared the same
  way; segment ids do not apply: ``PAGED_FEATURES``). A row with no visible key (``kv_lengths[b] = 0``,
  or ``p < 0`` under causal) yields exact zeros.
* Slots past ``kv_lengths[b]`` in a sequence's last page, pages no sequence references, and entries of
  ``page_indices`` past a sequence's last page may hold anything, NaN and Inf included: they change
  nothing, not one bit. Pages may be shared between sequences (prefix caching) and appear in any
  order; a permutation of the pool with the table permuted alike changes no bit of the output.
* Grouped-query heads as in ``attention``; all float32 or all bfloat16 (the pool in the input dtype);
  the same precision rules. Forward only: no gradients are graded.

The ragged paged contract (one call over a serving engine's step: decode rows, chunks of prefill and whole
prompts over one paged, possibly quantized cache; names follow JAX's ``ragged_paged_attention``):

``ragged_paged_attention(q, k_pages, v_pages, *, kv_lengths, page_indices, cu_q_lens, num_seqs,
scale=None, causal=True, window_size=None, softcap=None, sinks=None, k_scale=None, v_scale=None) -> out``

- ``q``: ``[num_tokens, num_q_heads, head_dim]``, the new tokens of every sequence one after another
  (float32 or bfloat16); ``out`` has ``q``'s shape and dtype.
- ``k_pages``, ``v_pages``: ``[num_pages, page_size, num_kv_heads, head_dim]``, the pool of
  ``paged_attention``; ``page_indices``: int32 ``[max_seqs, pages_per_sequence]``; ``kv_lengths``: int32
  ``[max_seqs]``; ``cu_q_lens``: int32 ``[max_seqs + 1]``; ``num_seqs``: int32 ``[1]``, with
  ``num_seqs[0] <= max_seqs``.
- Sequence ``i < num_seqs[0]`` owns rows ``cu_q_lens[i] <= r < cu_q_lens[i + 1]``: ``cu_q_lens[0] = 0``,
  non-decreasing up to index ``num_seqs[0]``, and ``cu_q_lens[num_seqs[0]] <= num_tokens``;
  ``q_len_i = cu_q_lens[i+1] - cu_q_lens[i]`` with ``0 <= q_len_i <= kv_lengths[i] <=
  pages_per_sequence * page_size``. Key ``t`` of sequence ``i`` is
  ``k_pages[page_indices[i, t // page_size], t % page_size]`` for ``t < kv_lengths[i]``.
- Row ``cu_q_lens[i] + j`` sits at position ``p = kv_lengths[i] - q_len_i + j`` (the new tokens are the
  sequence's last ``q_len_i``, as in ``paged_attention``); ``causal`` (default True) hides keys ``t > p``;
  ``window_size``, ``softcap`` and ``sinks`` mean exactly what they mean for ``attention`` (features
  ``"window"``, ``"softcap"``, ``"sinks"``, declared the same way). Every graded row sees at least its own
  key. Decode rows (``q_len_i = 1``), chunks of prefill (``1 < q_len_i < kv_lengths[i]``) and whole
  prompts (``q_len_i = kv_lengths[i]``) mix in one call; a sequence may have ``q_len_i = 0``. Grouped-query
  heads as in ``attention``.
- Rows ``r >= cu_q_lens[num_seqs[0]]`` are padding: their inputs may hold anything (NaN and Inf
  included), their output is not graded, and nothing in them may change a bit of a graded row.
  Entries of ``kv_lengths`` and ``page_indices`` at or after index ``num_seqs[0]``, entries of ``cu_q_lens``
  after index ``num_seqs[0]``, and table entries past a sequence's last page hold anything in range
  (``kv_lengths`` in ``[0, pages_per_sequence * page_size]``, ``cu_q_lens`` in ``[0, num_tokens]`` and not
  necessarily sorted, ``page_indices`` in ``[0, num_pages)``). Pool slots that no graded key reads hold
  any value the pool's dtype can (NaN and Inf where it has them). Pages may be shared between
  sequences (prefix caching) and appear in any order: a permutation of the pool with the table permuted
  alike changes no bit of a graded row.
- Quantized cache (feature ``"quantized_kv"``, for ``paged_attention`` too): ``k_pages`` and ``v_pages``
  are both ``float8_e4m3fn`` or both ``int8``, and ``k_scale``, ``v_scale`` are both given (a Python float or a
  0-d float32 array, possibly traced): key ``t``'s value is ``float32(stored) * k_scale`` computed in
  float32 (a value's likewise with ``v_scale``), and may be rounded to ``q``'s dtype before the matmuls,
  as JAX's ``ref_ragged_paged_attention`` does (the tolerance allows that rounding, as it allows the
  others the contract names). The truth dequantizes the same stored numbers in float64, so the kernel
  is charged only for what it does after dequantizing. Without the feature the pool has
  ``q``'s dtype and both scales are None.
- Forward only; fp32 logits, statistics and accumulation; the precision rules of ``attention``.

``RAGGED_FEATURES`` are the features that apply to it; ``check_ragged_inputs`` validates a call's shapes and
dtypes (values may be traced, so they are not checked) and ``dequantize`` is the quantized cache's rule.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Iterable, NamedTuple

import jax
import jax.numpy as jnp

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
FEATURES = ("window", "softcap", "segments", "sinks")  # in this order wherever features are listed
PAGED_FEATURES = ("window", "softcap", "sinks")  # the features that apply to paged_attention
QUANTIZED_KV = "quantized_kv"  # a pool stored in float8_e4m3fn or int8 with k_scale and v_scale (paged contracts only)
FEATURE_NAMES = (*FEATURES, QUANTIZED_KV)  # every feature of any contract, in the order they are listed
RAGGED_FEATURES = ("window", "softcap", "sinks", QUANTIZED_KV)  # the features of ragged_paged_attention
QUANTIZED_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.int8))  # a quantized pool's dtypes
FEATURE_ARGUMENTS = {"window": ("window_size",), "softcap": ("softcap",),
                     "segments": ("q_segment_ids", "kv_segment_ids"), "sinks": ("sinks",)}
Window = tuple[int | None, int | None]


class Dims(NamedTuple):
    batch: int
    q_len: int
    kv_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.num_q_heads // self.num_kv_heads


def check_inputs(q: jax.Array, k: jax.Array, v: jax.Array, kv_lengths: jax.Array | None = None) -> Dims:
    """Validate shapes and dtypes against the contract; return the problem's dimensions.

    Raises ``ValueError`` (``TypeError`` for dtypes) with a message naming the offending argument.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must be 4-D [batch, len, heads, head_dim], got shape {tuple(x.shape)}")
        if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be bfloat16 or float32, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    batch, q_len, hq, d = q.shape
    kb, kv_len, hk, kd = k.shape
    if kb != batch or kd != d:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch and head_dim"
        )
    if hk == 0 or hq % hk:
        raise ValueError(f"num_q_heads ({hq}) must be a multiple of num_kv_heads ({hk})")
    if kv_lengths is not None:
        if tuple(kv_lengths.shape) != (batch,):
            raise ValueError(f"kv_lengths must have shape [batch]=({batch},), got {tuple(kv_lengths.shape)}")
        if not jnp.issubdtype(kv_lengths.dtype, jnp.integer):
            raise TypeError(f"kv_lengths must be an integer array, got {kv_lengths.dtype}")
    return Dims(batch, q_len, kv_len, hq, hk, d)


class PagedDims(NamedTuple):
    batch: int
    q_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    num_pages: int
    page_size: int
    pages_per_sequence: int

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def max_length(self) -> int:
        """The most keys a sequence's table can hold: ``pages_per_sequence * page_size``."""
        return self.pages_per_sequence * self.page_size


def check_paged_inputs(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, kv_lengths: jax.Array,
                       page_indices: jax.Array) -> PagedDims:
    """Validate shapes and dtypes against the paged contract; return the problem's dimensions.

    Raises ``ValueError`` (``TypeError`` for dtypes) with a one-line message naming the offending argument.
    Values (lengths within the table, indices within the pool) are not checked: they may be traced."""
    for name, x, axes in (("q", q, "[batch, q_len, num_q_heads, head_dim]"),
                          ("k_pages", k_pages, "[num_pages, page_size, num_kv_heads, head_dim]"),
                          ("v_pages", v_pages, "[num_pages, page_size, num_kv_heads, head_dim]")):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"{name} must be 4-D {axes}, got shape {tuple(getattr(x, 'shape', ()))}")
        if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be bfloat16 or float32, got {x.dtype}")
    if not (q.dtype == k_pages.dtype == v_pages.dtype):
        raise TypeError(f"q, k_pages, v_pages must share a dtype, got {q.dtype}, {k_pages.dtype}, {v_pages.dtype}")
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages and v_pages must have the same shape, got {tuple(k_pages.shape)} and "
                         f"{tuple(v_pages.shape)}")
    batch, q_len, hq, d = q.shape
    num_pages, page_size, hk, kd = k_pages.shape
    if q_len < 1:
        raise ValueError(f"q_len must be >= 1, got q of shape {tuple(q.shape)}")
    if kd != d:
        raise ValueError(f"q {tuple(q.shape)} and k_pages {tuple(k_pages.shape)} must agree on head_dim")
    if num_pages < 1 or page_size < 1:
        raise ValueError(f"k_pages must hold at least one page of at least one slot, got {tuple(k_pages.shape)}")
    if hk == 0 or hq % hk:
        raise ValueError(f"num_q_heads ({hq}) must be a multiple of num_kv_heads ({hk})")
    for name, x, shape in (("kv_lengths", kv_lengths, "[batch]"), ("page_indices", page_indices,
                                                                    "[batch, pages_per_sequence]")):
        if x is None:
            raise ValueError(f"{name} is required: int32 {shape}")
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{name} must be an int32 array {shape}, got {x.dtype}")
    if tuple(kv_lengths.shape) != (batch,):
        raise ValueError(f"kv_lengths must have shape [batch]=({batch},), got {tuple(kv_lengths.shape)}")
    if page_indices.ndim != 2 or page_indices.shape[0] != batch or page_indices.shape[1] < 1:
        raise ValueError(f"page_indices must have shape [batch={batch}, pages_per_sequence >= 1], got "
                         f"{tuple(page_indices.shape)}")
    return PagedDims(batch, q_len, hq, hk, d, num_pages, page_size, int(page_indices.shape[1]))


def check_paged_features(dims: PagedDims, *, window_size=None, softcap=None, sinks=None) -> Window | None:
    """``check_features`` for the paged contract (no segment ids); returns the window or None."""
    return check_features(Dims(dims.batch, dims.q_len, dims.max_length, dims.num_q_heads, dims.num_kv_heads,
                               dims.head_dim), window_size=window_size, softcap=softcap, sinks=sinks)


class RaggedDims(NamedTuple):
    """The dimensions of one ``ragged_paged_attention`` call; ``kv_dtype`` is the pool's dtype (q's unless quantized)."""

    num_tokens: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    num_pages: int
    page_size: int
    max_seqs: int
    pages_per_sequence: int
    kv_dtype: str

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def max_length(self) -> int:
        """The most keys a sequence's table can hold: ``pages_per_sequence * page_size``."""
        return self.pages_per_sequence * self.page_size

    @property
    def quantized(self) -> bool:
        """Whether the pool is stored quantized (feature ``"quantized_kv"``)."""
        return jnp.dtype(self.kv_dtype) in QUANTIZED_DTYPES


def _int_array(name: str, x: Any, shape: tuple[int, ...], axes: str) -> None:
    if x is None:
        raise ValueError(f"{name} is required: int32 {axes}")
    dtype = getattr(x, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{name} must be an int32 array {axes}, got {getattr(x, 'dtype', type(x).__name__)}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {axes}={shape}, got {tuple(x.shape)}")


def check_kv_scales(q_dtype: Any, k_pages: jax.Array, v_pages: jax.Array, k_scale: Any, v_scale: Any) -> bool:
    """Validate the pool's dtypes and scales (feature ``"quantized_kv"``); True when the pool is quantized.

    Unquantized: both pools in ``q``'s dtype and both scales None. Quantized: both pools ``float8_e4m3fn`` or both
    ``int8`` and both scales given (a Python float or a 0-d float array). ``TypeError``/``ValueError`` otherwise."""
    kd, vd = jnp.dtype(k_pages.dtype), jnp.dtype(v_pages.dtype)
    if kd != vd:
        raise TypeError(f"k_pages and v_pages must share a dtype, got {kd} and {vd}")
    if kd not in QUANTIZED_DTYPES:
        if kd != jnp.dtype(q_dtype):
            raise TypeError(f"the pool must be in q's dtype ({jnp.dtype(q_dtype)}) or quantized (float8_e4m3fn, "
                            f"int8), got {kd}")
        if k_scale is not None or v_scale is not None:
            raise ValueError("k_scale and v_scale apply to a quantized pool (float8_e4m3fn or int8) only")
        return False
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        if x is None:
            raise ValueError(f"a {kd} pool needs both k_scale and v_scale (float32 scalars); {name} is None")
        if getattr(x, "shape", ()) != () or (hasattr(x, "dtype") and not jnp.issubdtype(x.dtype, jnp.floating)):
            raise ValueError(f"{name} must be a Python float or a 0-d float32 array, got {x!r}"[:200])
    return True


def dequantize(pages: jax.Array, scale: Any) -> jax.Array:
    """A quantized pool's values: ``float32(stored) * float32(scale)``, computed in float32 (the contract's rule)."""
    return pages.astype(jnp.float32) * jnp.asarray(scale, jnp.float32)


def check_ragged_inputs(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, kv_lengths: jax.Array,
                        page_indices: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array, k_scale: Any = None,
                        v_scale: Any = None) -> RaggedDims:
    """Validate shapes and dtypes against the ragged paged contract; return the call's dimensions.

    Raises ``ValueError`` (``TypeError`` for dtypes) with a one-line message naming the offending argument.
    Values (lengths, offsets, indices, ``num_seqs``) are not checked: they may be traced."""
    if getattr(q, "ndim", None) != 3:
        raise ValueError(f"q must be 3-D [num_tokens, num_q_heads, head_dim], got shape "
                         f"{tuple(getattr(q, 'shape', ()))}")
    if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
        raise TypeError(f"q must be bfloat16 or float32, got {q.dtype}")
    for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"{name} must be 4-D [num_pages, page_size, num_kv_heads, head_dim], got shape "
                             f"{tuple(getattr(x, 'shape', ()))}")
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages and v_pages must have the same shape, got {tuple(k_pages.shape)} and "
                         f"{tuple(v_pages.shape)}")
    check_kv_scales(q.dtype, k_pages, v_pages, k_scale, v_scale)
    num_tokens, hq, d = q.shape
    num_pages, page_size, hk, kd = k_pages.shape
    if kd != d:
        raise ValueError(f"q {tuple(q.shape)} and k_pages {tuple(k_pages.shape)} must agree on head_dim")
    if num_pages < 1 or page_size < 1:
        raise ValueError(f"k_pages must hold at least one page of at least one slot, got {tuple(k_pages.shape)}")
    if hk == 0 or hq % hk:
        raise ValueError(f"num_q_heads ({hq}) must be a multiple of num_kv_heads ({hk})")
    if getattr(page_indices, "ndim", None) != 2 or page_indices.shape[0] < 1 or page_indices.shape[1] < 1:
        raise ValueError(f"page_indices must be int32 [max_seqs >= 1, pages_per_sequence >= 1], got shape "
                         f"{tuple(getattr(page_indices, 'shape', ()))}")
    max_seqs, pps = (int(x) for x in page_indices.shape)
    _int_array("page_indices", page_indices, (max_seqs, pps), "[max_seqs, pages_per_sequence]")
    _int_array("kv_lengths", kv_lengths, (max_seqs,), "[max_seqs]")
    _int_array("cu_q_lens", cu_q_lens, (max_seqs + 1,), "[max_seqs + 1]")
    _int_array("num_seqs", num_seqs, (1,), "[1]")
    return RaggedDims(num_tokens, hq, hk, d, num_pages, page_size, max_seqs, pps, str(jnp.dtype(k_pages.dtype)))


def check_ragged_features(dims: RaggedDims, *, window_size=None, softcap=None, sinks=None) -> Window | None:
    """``check_features`` for the ragged contract (no segment ids); returns the window or None."""
    return check_features(Dims(1, dims.num_tokens, dims.max_length, dims.num_q_heads, dims.num_kv_heads,
                               dims.head_dim), window_size=window_size, softcap=softcap, sinks=sinks)


def default_scale(head_dim: int, scale: float | None) -> float:
    """The softmax scale: ``head_dim ** -0.5`` unless given."""
    return head_dim ** -0.5 if scale is None else float(scale)


def canonical_features(names: Iterable[str]) -> tuple[str, ...]:
    """``names`` in ``FEATURE_NAMES`` order, each once; ``ValueError`` for a name that is not a feature."""
    if isinstance(names, str):
        names = (names,)
    names = list(names)
    unknown = [n for n in names if not isinstance(n, str) or n not in FEATURE_NAMES]
    if unknown:
        raise ValueError(f"unknown feature {str(unknown[0])[:40]!r}: the features are {', '.join(FEATURE_NAMES)}")
    return tuple(f for f in FEATURE_NAMES if f in names)


def declared_features(fn: Any) -> tuple[str, ...]:
    """The features ``fn`` declares (its ``features`` attribute), canonical; () when it has none.

    Raises ``ValueError`` when the attribute is not a tuple, list or set of feature names."""
    names = getattr(fn, "features", ())
    if names is None:
        return ()
    if not isinstance(names, (tuple, list, set, frozenset)):
        raise ValueError(f"a candidate's features must be a tuple of names from {FEATURES}, got a "
                         f"{type(names).__name__}")
    return canonical_features(names)


def supports(*features: str) -> Callable[[Callable], Callable]:
    """Decorator: declare the features a kernel supports (``@supports("window", "softcap")``)."""
    names = canonical_features(features)

    def mark(fn: Callable) -> Callable:
        fn.features = names
        return fn
    return mark


def check_window(window_size: Any) -> Window | None:
    """``window_size`` as ``(left, right)`` of ints >= 0 or None; ``ValueError`` otherwise."""
    if window_size is None:
        return None
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}") from None
    pair = []
    for side, x in (("left", left), ("right", right)):
        if x is not None:
            try:
                if isinstance(x, bool):
                    raise TypeError
                x = operator.index(x)  # ints and integer scalars; not floats, not bools
            except TypeError:
                raise ValueError(f"window_size's {side} must be an int >= 0 or None, got {x!r}") from None
            if x < 0:
                raise ValueError(f"window_size's {side} must be an int >= 0 or None (no -1 sentinel), got {x!r}")
        pair.append(x)
    return pair[0], pair[1]


def check_features(dims: Dims, *, window_size=None, softcap=None, q_segment_ids=None, kv_segment_ids=None,
                   sinks=None) -> Window | None:
    """Validate the feature arguments against ``dims``; returns the window as a pair of ints or None.

    Raises ``ValueError`` (``TypeError`` for dtypes) naming the offending argument."""
    window = check_window(window_size)
    if softcap is not None and not (float(softcap) > 0 and float(softcap) < float("inf")):
        raise ValueError(f"softcap must be a finite float > 0 or None, got {softcap!r}")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids go together: give both or neither")
    for name, ids, length in (("q_segment_ids", q_segment_ids, dims.q_len),
                              ("kv_segment_ids", kv_segment_ids, dims.kv_len)):
        if ids is None:
            continue
        if tuple(ids.shape) != (dims.batch, length):
            raise ValueError(f"{name} must have shape [batch, len]=({dims.batch}, {length}), got {tuple(ids.shape)}")
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"{name} must be an integer array, got {ids.dtype}")
    if sinks is not None:
        if tuple(sinks.shape) != (dims.num_q_heads,):
            raise ValueError(f"sinks must have shape [num_q_heads]=({dims.num_q_heads},), got {tuple(sinks.shape)}")
        if not jnp.issubdtype(sinks.dtype, jnp.floating):
            raise TypeError(f"sinks must be a float array, got {sinks.dtype}")
    return window


def visible(q_pos: jax.Array, k_pos: jax.Array, q_len: int, kv_len: int, causal: bool,
            kv_length: jax.Array | None, window: Window | None = None, q_segment: jax.Array | None = None,
            kv_segment: jax.Array | None = None) -> jax.Array:
    """Boolean visibility of key positions ``k_pos`` to query rows ``q_pos`` (broadcasting).

    ``window``: ``(left, right)`` around the row's position ``q_pos + kv_len - q_len``; ``q_segment`` /
    ``kv_segment``: segment ids broadcasting like ``q_pos`` / ``k_pos``. Works on iotas inside a kernel as
    well as on whole index grids outside one.
    """
    position = q_pos + (kv_len - q_len)
    ok = k_pos < kv_len
    if causal:
        ok = ok & (k_pos <= position)
    if kv_length is not None:
        ok = ok & (k_pos < kv_length)
    if window is not None:
        left, right = window
        if left is not None:
            ok = ok & (k_pos >= position - left)
        if right is not None:
            ok = ok & (k_pos <= position + right)
    if q_segment is not None:
        ok = ok & (q_segment == kv_segment)
    return ok


def visibility_mask(q_len: int, kv_len: int, causal: bool, kv_lengths: jax.Array | None,
                    window: Window | None = None, q_segment_ids: jax.Array | None = None,
                    kv_segment_ids: jax.Array | None = None) -> jax.Array:
    """``[batch or 1, q_len, kv_len]`` boolean mask of the keys each query may see."""
    q_pos = jnp.arange(q_len)[:, None]
    k_pos = jnp.arange(kv_len)[None, :]
    if kv_lengths is None and q_segment_ids is None:
        return visible(q_pos, k_pos, q_len, kv_len, causal, None, window)[None]
    lengths = None if kv_lengths is None else kv_lengths[:, None, None]
    q_seg = None if q_segment_ids is None else q_segment_ids[:, :, None]
    kv_seg = None if kv_segment_ids is None else kv_segment_ids[:, None, :]
    return visible(q_pos[None], k_pos[None], q_len, kv_len, causal, lengths, window, q_seg, kv_seg)
