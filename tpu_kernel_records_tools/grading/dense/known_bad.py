"""The dense contract's built-in candidates: the reference, the kernels, correct variants and known-bad ones.

Every candidate follows the contract ``attention(q, k, v, *, causal=False, kv_lengths=None, scale=None)``
(``kernel_src.contract``), plus the arguments of the features it declares (the feature built-ins declare all
four). ``BUILTIN`` maps a name to a :class:`~tpu_kernel_records_tools.grading.candidate.Candidate`.

Each known-bad candidate carries one bug that a real kernel or a real grader has had, written down in
its ``doc``, and names in ``catches`` the rubric check(s) built to reject it.
The attention code they are made of is ``grading.dense.variant_attention``'s and ``grading.dense.feature_variants``'s.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ...grading.candidate import Attention, Candidate
from ...sandbox.cpu_jit import jit_cpu
from ...grading.dense.feature_variants import _feature_variant
from ...grading.dense.variant_attention import _flash_style, _online_softmax, _split_kv_without_maxima, _variant
from kernel_src.contract import FEATURES, declared_features
from kernel_src.reference import reference_attention
from kernel_src.registry import IMPLEMENTATIONS


STATIC_FEATURES = ("window_size", "softcap")  # hashable feature arguments: static under jit, like scale


def given_features(window_size=None, softcap=None, q_segment_ids=None, kv_segment_ids=None, sinks=None) -> dict:
    """The feature arguments that are set, window and cap made hashable (static under ``jax.jit``)."""
    found = {"window_size": None if window_size is None else tuple(window_size),
             "softcap": None if softcap is None else float(softcap), "q_segment_ids": q_segment_ids,
             "kv_segment_ids": kv_segment_ids, "sinks": sinks}
    return {n: x for n, x in found.items() if x is not None}


def _contract(fn, features: tuple[str, ...] = ()):
    """Give ``fn(q, k, v, kv_lengths, *, causal, scale, **features)`` the contract's signature, jitted per
    flags; it declares ``features`` and is passed only the feature arguments a call sets."""
    jitted = jit_cpu(fn, static_argnames=("causal", "scale", *(STATIC_FEATURES if features else ())))

    @functools.wraps(fn)
    def attention(q, k, v, *, causal=False, kv_lengths=None, scale=None, **features):
        return jitted(q, k, v, kv_lengths, causal=bool(causal), scale=None if scale is None else float(scale),
                      **given_features(**features))

    attention.features = features
    return attention


_online_features_jit = jit_cpu(_online_softmax, static_argnames=("causal", "scale", *STATIC_FEATURES))


def _online_features(first_block_guard: bool) -> Attention:
    """:func:`_online_softmax` with every feature; the guard is traced, so the correct variant and the bug
    without it share their compiled programs."""
    def attention(q, k, v, *, causal=False, kv_lengths=None, scale=None, **features):
        return _online_features_jit(q, k, v, kv_lengths, causal=bool(causal),
                                    scale=None if scale is None else float(scale),
                                    first_block_guard=jnp.asarray(first_block_guard), **given_features(**features))

    attention.features = FEATURES
    return attention


def _reference_fn(q, k, v, kv_lengths, *, causal, scale, window_size=None, softcap=None, q_segment_ids=None,
                  kv_segment_ids=None, sinks=None):
    return reference_attention(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale, window_size=window_size,
                               softcap=softcap, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                               sinks=sinks)


reference = _contract(_reference_fn, FEATURES)
"""``kernel_src.reference_attention`` jitted per (causal, scale, window, cap): the ``reference`` candidate and
the rubric's baseline (one compiled executable serves both); it declares every feature."""


def _reference_with_backward(backward: Callable) -> Attention:
    """``reference`` forward with a custom backward ``backward(pull, g, q, scale) -> (dq, dk, dv)``, where
    ``pull`` is the reference's own VJP. Runs eagerly around the shared ``reference`` executable, so it
    costs no compile of its own."""
    def attention(q, k, v, *, causal=False, kv_lengths=None, scale=None):
        call = functools.partial(reference, causal=causal, kv_lengths=kv_lengths, scale=scale)

        @jax.custom_vjp
        def attn(q, k, v):
            return call(q, k, v)

        def fwd(q, k, v):
            return call(q, k, v), (q, k, v)

        def bwd(residuals, g):
            return backward(jax.vjp(call, *residuals)[1], g, residuals[0], scale)

        attn.defvjp(fwd, bwd)
        return attn(q, k, v)

    return attention


def _ones_cotangent() -> Attention:
    """Replaces the cotangent by its mean over head_dim before the reference's backward."""
    def backward(pull, g, q, scale):
        g = jnp.broadcast_to(jnp.mean(g.astype(jnp.float32), axis=-1, keepdims=True), g.shape)
        return pull(g.astype(q.dtype))
    return _reference_with_backward(backward)


def _backward_ignores_scale() -> Attention:
    """dQ and dK carry head_dim**-0.5 instead of the given scale (exact when scale=None)."""
    def backward(pull, g, q, scale):
        wrong = 1.0 if scale is None else q.shape[-1] ** -0.5 / scale
        dq, dk, dv = pull(g)
        return (dq * wrong).astype(dq.dtype), (dk * wrong).astype(dk.dtype), dv
    return _reference_with_backward(backward)


def _memoizing(min_kv_len: int = 0) -> Attention:
    """Returns the first output it computed for the same shapes and flags (only where kv_len >= min_kv_len)."""
    cache: dict = {}

    def attention(q, k, v, *, causal=False, kv_lengths=None, scale=None):
        key = (q.shape, k.shape, str(q.dtype), bool(causal), kv_lengths is None, scale)
        remembers = k.shape[1] >= min_kv_len
        if remembers and key in cache:
            return cache[key]
        out = reference(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale)
        if remembers and not isinstance(out, jax.core.Tracer):
            cache[key] = out
        return out

    return attention


# Bugs that only the serving and training slots of the full level show (``grading.dense.slots``): each runs the
# shared ``reference`` executable on changed inputs, branching on static shapes as size-dispatched
# kernels do, and is exact at every shape of the earlier distribution (batch <= 3, <= 16 query heads,
# kv_len <= about 2350 and never a multiple of 512, q_len 1 or 32..1400).

def _lengths(k, kv_lengths) -> jax.Array:
    return jnp.full((k.shape[0],), k.shape[1], jnp.int32) if kv_lengths is None else jnp.asarray(kv_lengths, jnp.int32)


def _batch_blocks(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    """Walks the batch in blocks of 4 and reads kv_lengths by the index inside the block."""
    if q.shape[0] > 4 and kv_lengths is not None:
        kv_lengths = jnp.asarray(kv_lengths)[jnp.arange(q.shape[0]) % 4]
    return reference(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale)


def _long_cache_bf16(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    """Past 4096 keys: online softmax over 512-key blocks, running output and sum kept in bfloat16."""
    if k.shape[1] <= 4096:
        return reference(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale)
    return _online_bf16(q, k, v, _lengths(k, kv_lengths), causal=bool(causal), scale=scale)


@functools.partial(jax.jit, static_argnames=("causal", "scale"))
def _online_bf16(q, k, v, lengths, *, causal, scale):
    return _online_softmax(q, k, v, lengths, causal=causal, scale=scale, chunk=512, bug="bf16-accumulator")


def _head_blocks(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    """Query heads in blocks of 16; the remainder block (24 and 40 heads: heads 16.. and 32..) is read from
    head 0 (its output is that of the block's first heads)."""
    out = reference(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale)
    hq = q.shape[2]
    rest = hq % 16
    if hq > 16 and rest:
        out = jnp.concatenate([out[:, :, :hq - rest], out[:, :, :rest]], axis=2)
    return out


def _prefill_top_left(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    """The prefill path (q_len >= 2048) aligns the causal mask top-left (j <= i)."""
    if q.shape[1] >= 2048 and causal and k.shape[1] != q.shape[1]:
        return _variant(top_left=True)(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale)
    return reference(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale)


def _spec_no_causal(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    """The path for 2..8 query rows (speculative decoding) drops the causal mask."""
    if 2 <= q.shape[1] <= 8:
        causal = False
    return reference(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale)


def _mha_pairs(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    """Plain multi-head attention at head_dim 64 packs two heads into 128 lanes and unpacks them swapped:
    query head h reads kv head h ^ 1."""
    heads = k.shape[2]
    if q.shape[2] == heads >= 2 and q.shape[3] == 64:
        swap = np.arange(heads) ^ 1
        swap[swap >= heads] = heads - 1
        k, v = k[:, :, swap], v[:, :, swap]
    return reference(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale)


def _skip_last_block(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    """When kv_len is an exact multiple of 512, the last 512-key block is never visited (an off-by-one in
    the block count ``(kv_len - 1) // 512``)."""
    if k.shape[1] % 512 == 0:
        kv_lengths = jnp.minimum(_lengths(k, kv_lengths), k.shape[1] - 512)
    return reference(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale)


def _zeros(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    return jnp.zeros_like(q)


def _unrelated(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    seed = int.from_bytes(hashlib.sha256(repr((q.shape, k.shape)).encode()).digest()[:4], "little")
    fake = np.random.default_rng(seed).standard_normal(q.shape).astype(np.float32) / np.sqrt(k.shape[1])
    return jnp.asarray(fake, q.dtype)


def _nondeterministic(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    out = reference(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale)
    jitter = 1 + np.random.default_rng().uniform(-1, 1, out.shape).astype(np.float32) * 2.0 ** -23
    return (out.astype(jnp.float32) * jitter).astype(out.dtype)


def _wrong_dtype(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    return reference(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale).astype(jnp.float32)


def _kernel(find: Callable[[], Attention]) -> Callable[[], Attention]:
    """Lazy loader of the kernel ``find()`` returns (e.g. ``kernel_src.registry.Implementation.load``).

    The kernel is graded under ``jax.jit`` (static ``causal``/``scale``), as it runs in a model; without
    it an interpret-mode ``pallas_call`` is traced and compiled again on every call.
    """
    @functools.cache  # one jitted wrapper per process, so later grades reuse its executables
    def load() -> Attention:
        return jit_contract(find())

    return load


def jit_contract(fn: Attention) -> Attention:
    """``fn`` under ``jax.jit`` with static ``causal``, ``scale``, ``window_size`` and ``softcap``, called with the
    contract's signature (only the feature arguments a call sets reach ``fn``); keeps ``fn``'s features."""
    static = ("causal", "scale", *(STATIC_FEATURES if declared_features(fn) else ()))
    jitted = jax.jit(fn, static_argnames=static)

    @functools.wraps(fn)
    def attention(q, k, v, *, causal=False, kv_lengths=None, scale=None, **features):
        return jitted(q, k, v, causal=bool(causal), kv_lengths=kv_lengths,
                      scale=None if scale is None else float(scale), **given_features(**features))

    return attention


def _constant(fn):
    return lambda: fn


def _bad(name: str, doc: str, catches: tuple[str, ...], loader) -> Candidate:
    return Candidate(name, "known-bad", doc, loader, catches)


BUILTIN: dict[str, Candidate] = {c.name: c for c in [
    Candidate("reference", "reference",
              "kernel_src.reference_attention: the contract-precision pure-JAX oracle (fp32 logits, "
              "statistics and accumulation; output in the input dtype).", _constant(reference)),
    *(Candidate(impl.grading_name, "kernel", f"{impl.target}: {impl.description}", _kernel(impl.load))
      for impl in IMPLEMENTATIONS.values() if impl.kind == "kernel" and impl.grading_name and impl.contract),
    Candidate("rounded-probs", "correct-variant",
              "Probabilities rounded to the input dtype before P·V (the contract allows it), fp32 accumulation.",
              _constant(_variant(probs_in_input_dtype=True))),
    Candidate("online-softmax", "correct-variant",
              "Online softmax over 16-key chunks (running max, sum and fp32 accumulator), like a flash kernel.",
              _constant(_contract(_online_softmax))),
    Candidate("flash-style", "correct-variant",
              "Rounds where FlashAttention-2/3 do: 128x128 tiles both ways, exp2 on log2(e)-scaled logits, "
              "P in the input dtype before P·V; backward with P and dS in the input dtype, fp32 accumulation.",
              _constant(_contract(_flash_style))),
    Candidate("per-head-dkv", "correct-variant",
              "flash-style whose backward rounds each query head's dK/dV contribution to the input dtype "
              "before summing over the group (FlashAttention-2 on repeated K/V heads).",
              _constant(_contract(functools.partial(_flash_style, per_head_dkv=True)))),
    Candidate("online-softmax-features", "correct-variant",
              "online-softmax with every feature: each 16-key chunk's own window and segment mask, the cap on the "
              "chunk's logits, running max and sum that start from the row's sink (m = sink, l = 1).",
              _constant(_online_features(first_block_guard=True))),
    Candidate("flash-style-features", "correct-variant",
              "flash-style in 16x32 tiles with every feature: per-tile window and segment masks, the cap before "
              "the mask (its slope on dS), the sink as each row's first max and sum, dsinks = -sum(P_sink * di).",
              _constant(_contract(functools.partial(_flash_style, block_q=16, block_k=32), FEATURES))),
    _bad("ignores-causal", "Ignores causal=True: every query sees future keys.",
         ("causal-leak", "mask-readout"), _constant(_variant(ignore_causal=True))),
    _bad("missing-mask", "Ignores kv_lengths: padding keys take part in the softmax.",
         ("padding-leak", "mask-readout"), _constant(_variant(ignore_lengths=True))),
    _bad("low-precision", "Logits and softmax statistics in bfloat16 instead of fp32.",
         ("large-logits", "forward-accuracy"), _constant(_variant(bf16_logits=True))),
    _bad("wrong-gqa", "Grouped-query head h reads kv head h % num_kv_heads (tile instead of repeat).",
         ("gqa-mapping",), _constant(_variant(tile_heads=True))),
    _bad("causal-top-left", "Causal mask aligned top-left (j <= i) instead of bottom-right "
         "(j <= i + kv_len - q_len): wrong whenever q_len != kv_len (cached decoding).",
         ("mask-readout",), _constant(_variant(top_left=True))),
    _bad("off-by-one-padding", "Key j is treated as valid while j <= kv_lengths[b] (one padding key leaks).",
         ("padding-leak", "mask-readout"), _constant(_variant(length_slack=1))),
    _bad("nan-empty-rows", "A row with no visible key gives NaN (softmax of all -inf), as JAX's GPU "
         "reference does; the contract says exact zeros.", ("empty-rows",),
         _constant(_variant(nan_empty=True))),
    _bad("mean-v-empty-rows", "A row with no visible key gives the mean of V (finite -1e30 mask value, "
         "uniform weights), as JAX's Pallas flash kernel does; the contract says exact zeros.",
         ("empty-rows",), _constant(_variant(mean_empty=True))),
    _bad("no-max-subtraction", "Softmax without subtracting the row max: exp overflows to inf on large "
         "logits (NaN output).", ("large-logits", "peaky-attention"), _constant(_variant(no_max=True))),
    _bad("wrong-default-scale", "scale=None defaults to 1/head_dim instead of head_dim**-0.5.",
         ("forward-accuracy", "scale"), _constant(_variant(default_scale=lambda d: 1.0 / d))),
    _bad("stop-gradient-k", "K enters the logits through stop_gradient: dK is zero, forward is exact.",
         ("gradients",), _constant(_variant(stop_grad_k=True))),
    _bad("ones-cotangent", "Custom backward that replaces the cotangent by its mean over head_dim: exact "
         "for loss=sum(out) (all-ones cotangent), wrong for any other.", ("gradients",),
         _ones_cotangent),
    _bad("memoizing", "Returns the first output it computed for the same shapes and flags, whatever "
         "the values (passes graders that use one input per shape).", ("fresh-inputs",), _memoizing),
    _bad("zeros", "Returns zeros of the right shape and dtype (passes loose allclose on some problems).",
         ("forward-accuracy",), _constant(_zeros)),
    _bad("unrelated-output", "Returns a fixed pseudo-random tensor of the right shape, scale and dtype, "
         "unrelated to q, k, v.", ("fresh-inputs", "forward-accuracy"), _constant(_unrelated)),
    _bad("nondeterministic", "Correct to about one fp32 ulp but different bits on every call "
         "(like unordered atomic accumulation).", ("determinism",), _constant(_nondeterministic)),
    # Bugs the old four toy shapes (head_dim <= 64, q_len <= 24, kv_len <= 136) could not see.
    _bad("head-dim-tile", "Logits from the first 128 entries of head_dim only (a kernel tiled for head_dim "
         "<= 128): exact at head_dim 64 and 128, wrong at 256.", ("forward-accuracy", "mask-readout"),
         _constant(_variant(head_dim_tile=True))),
    _bad("query-tile-local-causal", "Causal mask built from the row index inside its 128-row query tile "
         "(the tile's start never added): exact while q_len <= 128.", ("forward-accuracy", "causal-leak"),
         _constant(_variant(query_tile_local=True))),
    _bad("key-tile-wrap", "Key j >= 256 reads K/V row j % 256 (the key tile index wraps after the second "
         "128-key tile, like a double-buffer slot used as block index): exact while kv_len <= 256.",
         ("forward-accuracy",), _constant(_variant(key_tile_wrap=True))),
    _bad("input-dtype-accumulator", "Online softmax over 32-key blocks (a Triton-sized tile) whose output "
         "accumulator and running sum are kept in the input dtype between blocks: bfloat16 roundings pile up "
         "once kv_len reaches thousands.", ("forward-accuracy", "padding-leak", "gradients"),
         _constant(_contract(functools.partial(_online_softmax, chunk=32, bug="input-dtype-accumulator")))),
    _bad("backward-ignores-scale", "Forward exact; the backward multiplies dQ and dK by head_dim**-0.5 "
         "instead of the given scale (exact whenever scale=None).", ("gradients", "scale"),
         _backward_ignores_scale),
    _bad("large-kv-top-left", "A size-dispatched path: for kv_len >= 1024 the causal mask is aligned "
         "top-left (j <= i); the small-kv path is right.", ("forward-accuracy", "gradients"),
         _constant(_variant(large_kv_top_left=True))),
    _bad("frozen-running-max", "Online softmax over 128-key chunks whose running max is set by the first "
         "chunk and never raised: exp overflows once a later key's logit exceeds it by 89.",
         ("large-logits",), _constant(_contract(functools.partial(_online_softmax, chunk=128,
                                                                 bug="frozen-max")))),
    _bad("split-kv-without-maxima", "Split-KV decoding (q_len <= 16, 512-key splits) that combines the "
         "splits' results with their sums but without their maxima: exact while kv_len <= 512.",
         ("large-logits",), _constant(_contract(_split_kv_without_maxima))),
    _bad("memoizing-large", "Caches outputs by shape and flags once kv_len >= 1024 (like an autotuning "
         "cache that also keeps results): right on the first call of each large shape only.",
         ("forward-accuracy", "large-logits", "gradients"), functools.partial(_memoizing, 1024)),
    _bad("wrong-dtype", "Returns float32 for bfloat16 inputs (accurate, but breaks the output dtype rule).",
         ("output-shape-dtype",), _constant(_wrong_dtype)),
    # Bugs at the shapes serving and training run every day, which the distribution before issue 24 never drew.
    _bad("batch-blocks-of-4", "Walks the batch in blocks of 4 and reads kv_lengths by the index inside the "
         "block: right for batch <= 4; a serving batch of 8 gets other sequences' lengths.",
         ("padding-leak", "forward-accuracy", "empty-rows"), _constant(_batch_blocks)),
    _bad("long-cache-bf16-accumulator", "Caches longer than 4096 keys take an online-softmax path over "
         "512-key blocks whose running output and sum are kept in bfloat16.", ("forward-accuracy",),
         _constant(_long_cache_bf16)),
    _bad("head-blocks-of-16", "Query heads in blocks of 16, the remainder block read from head 0: right for "
         "<= 16 heads and multiples of 16, wrong at 24 and 40 (Llama-3.2-3B, Qwen2.5-14B).", ("gqa-mapping",),
         _constant(_head_blocks)),
    _bad("prefill-top-left", "The prefill path (q_len >= 2048) aligns the causal mask top-left: wrong for "
         "chunked prefill against a longer cache.", ("forward-accuracy",), _constant(_prefill_top_left)),
    _bad("spec-decode-no-causal", "The path for 2-8 query rows (speculative decoding) drops the causal mask: "
         "draft tokens see the ones after them.", ("causal-leak",), _constant(_spec_no_causal)),
    _bad("mha-d64-pairs", "Plain multi-head attention at head_dim 64 packs heads in pairs and unpacks them "
         "swapped (query head h reads kv head h ^ 1).", ("gqa-mapping", "gradients", "forward-accuracy"),
         _constant(_mha_pairs)),
    _bad("skip-last-full-block", "When kv_len is an exact multiple of 512 the last 512-key block is skipped "
         "(static KV caches and training sequences of 512, 2048, 4096).", ("forward-accuracy", "gradients"),
         _constant(_skip_last_block)),
    # Bugs in the features (issue 34) that real kernels have had; every one declares all four features.
    _bad("window-one-key-wide", "Sliding window one key too wide: window_size's left read as the window's W keys "
         "(sees p - left - 1 .. p), the off-by-one between a model's sliding_window=W and (W - 1, 0).",
         ("window",), _constant(_feature_variant(window_slack=1))),
    _bad("window-one-key-narrow", "Sliding window one key too narrow: sees p - left + 1 .. p (the left end taken "
         "as exclusive).", ("window",), _constant(_feature_variant(window_slack=-1))),
    _bad("window-top-left", "Window placed around row i instead of its position i + kv_len - q_len (aligned "
         "top-left): right in training (q_len = kv_len), wrong for chunked prefill and decoding.", ("window",),
         _constant(_feature_variant(window_top_left=True))),
    _bad("window-short-fast-path", "A short-sequence fast path that drops the window when q_len <= left, testing "
         "the query length instead of the key span: a decoding row sees its whole cache.", ("window",),
         _constant(_feature_variant(window_short_path=True))),
    _bad("softcap-no-cap-value", "Soft-cap computed as s * tanh(s): the cap value is never used.", ("softcap",),
         _constant(_feature_variant(cap_mode=1))),
    _bad("softcap-tanh-of-product", "Soft-cap computed as tanh(s * softcap): the cap multiplied into the tanh's "
         "argument instead of dividing it and multiplying the result.", ("softcap",),
         _constant(_feature_variant(cap_mode=2))),
    _bad("softcap-before-scale", "Cap applied before the scale: softcap * tanh(q.k / softcap) * scale (the "
         "contract caps scale * q.k).", ("softcap",), _constant(_feature_variant(cap_mode=3))),
    _bad("softcap-after-mask", "Cap applied after the mask: masked logits (-1e30) become -softcap, so padding, "
         "future keys and rows with no visible key take weight again.", ("softcap",),
         _constant(_feature_variant(cap_mode=4))),
    _bad("segments-q-ids-only", "Segment ids from one side only: key j's id read from q_segment_ids (clamped at "
         "q_len - 1), kv_segment_ids ignored; right in packed training, where both are the same ids.",
         ("segments",), _constant(_feature_variant(segments_q_only=True))),
    _bad("segments-contiguous-runs", "Segment ids taken as contiguous documents: a row sees only the run of equal "
         "kv ids around its position, so two runs of one id (A B A) do not see each other.", ("segments",),
         _constant(_feature_variant(segments_runs=True))),
    _bad("segments-block-skip-first-key", "Skips each 128-key block whose first key's segment id no query row has, "
         "deciding for the whole block from one key: a query document that starts inside the block after a document "
         "only the keys hold (chunked prefill or decoding over a packed cache) loses its keys there.", ("segments",),
         _constant(_feature_variant(segments_block_skip=128))),
    _bad("segments-block-skip-last-key", "Skips each 128-key block whose last key's segment id no query row has: "
         "the block holding a sequence's last keys is dropped when the padding after kv_lengths carries an id of "
         "its own.", ("segments",), _constant(_feature_variant(segments_block_skip=-128))),
    _bad("sinks-scaled", "Sink multiplied by the softmax scale like a logit (the contract's sink is unscaled).",
         ("sinks",), _constant(_feature_variant(sinks_scaled=True))),
    _bad("sinks-per-kv-head", "Query head h reads sinks[h // group], one sink per kv head (the first "
         "num_kv_heads entries), instead of its own sinks[h].", ("sinks",),
         _constant(_feature_variant(sinks_per_kv_head=True))),
    _bad("sinks-unshifted", "Sink added outside the max-shifted frame: exp(sink) joins a denominator of "
         "exp(s - max) (exact only when the row max is 0).", ("sinks",),
         _constant(_feature_variant(sinks_unshifted=True))),
    _bad("sinks-frozen", "The sinks enter through stop_gradient (a learned sink that never learns): the "
         "forward is exact, dsinks is zero.", ("sinks",), _constant(_feature_variant(sinks_frozen=True))),
    _bad("nan-first-block", "Online softmax over 16-key chunks that guards only rows with no visible key at "
         "all: a row whose first chunk its window or segment hides whole gets exp(-inf - -inf) = NaN.",
         ("window", "segments"),
         _constant(_online_features(first_block_guard=False))),
]}

