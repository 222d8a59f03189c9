"""JAX's ``ragged_paged_attention`` given the ragged paged contract (``kernel_src.contract``, the last section), for
the ragged rubric (``tpu-kernel-rubric --ragged``; ``tests/test_ragged_field_kernels.py``). Not collected by pytest.

Layout only, as in ``tests/field_adapters.py``: K and V interleaved into the one pool JAX's kernel reads, the
contract's window and scale as its ``sliding_window`` and ``sm_scale``, the non-causal case folded into its causal
one; logits, masking, dequantizing and softmax are the kernel's own. Self-contained: the rubric's worker imports a
candidate's file by path and sees the project's packages, not ``tests/``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernel_src.contract import check_ragged_features, check_ragged_inputs, default_scale, supports

LANES = 128  # the TPU kernel's head_dim is whole 128-lane tiles (padded with zeros: exact)
QUERIES_PER_BLOCK = 32  # the kernel's num_queries_per_block (the token axis padded to a multiple)
PAGES_PER_BLOCK = 8  # the kernel's num_kv_pages_per_block, at most pages_per_sequence


def sliding_window(window, causal: bool) -> int | None:
    """The contract's ``window_size=(left, right)`` as JAX's ``sliding_window``: ``left + 1``.

    JAX's row at position ``p`` hides key ``t`` when ``p - sliding_window >= t``, so it sees ``t >= p - left``;
    its window is causal and left-only, so ``right`` hides nothing only under causal (any right >= 0 does not).
    ``ValueError`` for a window with ``causal=False``, which it cannot express."""
    if window is None or window[0] is None:
        return None
    if not causal:
        raise ValueError("JAX's ragged_paged_attention's sliding window is causal and left-only: a window with "
                         "causal=False is outside it")
    return int(window[0]) + 1


def static_scale(name: str, x) -> float | None:
    """A quantized pool's scale as the Python float JAX's kernel requires (``static_validate_inputs`` asserts
    ``isinstance(k_scale, float)``); ``ValueError`` for a traced scale, which it cannot take."""
    if x is None:
        return None
    try:
        return float(x)
    except jax.errors.ConcretizationTypeError:
        raise ValueError(f"JAX's ragged_paged_attention takes {name} as a Python float, not a traced array") from None


@functools.partial(jax.jit, static_argnames=("causal", "lanes", "queries"))
def layout(q, k_pages, v_pages, kv_lengths, page_indices, cu_q_lens, num_seqs, *, causal: bool, lanes: int,
           queries: int):
    """The kernel's arguments: ``(tokens, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)``.

    ``kv_pages``: ``[num_pages, page_size, 2 * num_kv_heads, lanes]``, K at even heads, V at odd; ``tokens``
    padded to a multiple of ``queries`` rows and ``lanes`` columns with zeros. Causal: the ragged layout as given.
    Not causal (JAX's kernel is always causal): every graded row ``r`` becomes a sequence of one token with its
    own sequence's length and table, so its position is its sequence's last key and it sees every key."""
    num_tokens, _, d = q.shape
    num_pages, page_size, hk, _ = k_pages.shape
    kv = jnp.stack([k_pages, v_pages], axis=3).reshape(num_pages, page_size, 2 * hk, d)
    kv = jnp.pad(kv, ((0, 0), (0, 0), (0, 0), (0, lanes - d)))
    tokens = jnp.pad(q, ((0, -num_tokens % queries), (0, 0), (0, lanes - d)))
    if causal:
        return tokens, kv, kv_lengths, page_indices, cu_q_lens, num_seqs
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    starts = jnp.arange(1, cu_q_lens.shape[0], dtype=jnp.int32)
    seq = jnp.sum((starts[None, :] <= num_seqs[0]) & (cu_q_lens[1:][None, :] <= rows[:, None]), axis=1,
                  dtype=jnp.int32)
    seq = jnp.minimum(seq, page_indices.shape[0] - 1)  # padding rows: not graded, and past the new num_seqs
    return (tokens, kv, kv_lengths[seq], page_indices[seq], jnp.arange(num_tokens + 1, dtype=jnp.int32),
            cu_q_lens[num_seqs[0]][None])


def _call(kernel, q, k_pages, v_pages, kv_lengths, page_indices, cu_q_lens, num_seqs, scale, causal, window_size,
          softcap, sinks, k_scale, v_scale, *, lanes: int, queries: int, **blocks):
    """``kernel`` (``ragged_paged_attention``'s signature) on the contract's call; the rows it returns (all of
    ``q``'s, or only the graded ones, JAX's reference) come back in ``q``'s shape, zeros past them."""
    dims = check_ragged_inputs(q, k_pages, v_pages, kv_lengths, page_indices, cu_q_lens, num_seqs, k_scale, v_scale)
    window = check_ragged_features(dims, window_size=window_size, softcap=softcap, sinks=sinks)
    if sinks is not None:
        raise ValueError("JAX's ragged_paged_attention has no sinks (not a declared feature)")
    causal = bool(causal)
    scales = {"k_scale": static_scale("k_scale", k_scale), "v_scale": static_scale("v_scale", v_scale)}
    args = layout(q, k_pages, v_pages, *(jnp.asarray(x, jnp.int32) for x in (kv_lengths, page_indices, cu_q_lens,
                                                                               num_seqs)),
                  causal=causal, lanes=lanes, queries=queries)
    if int(args[-1][0]) == 0:
        return jnp.zeros_like(q)  # no graded row (JAX's reference concatenates an empty list)
    out = kernel(*args, sm_scale=default_scale(dims.head_dim, scale), sliding_window=sliding_window(window, causal),
                 soft_cap=None if softcap is None else float(softcap), **scales, **blocks)
    out = out[:dims.num_tokens, :, :dims.head_dim]
    return jnp.pad(out, ((0, dims.num_tokens - out.shape[0]), (0, 0), (0, 0))).astype(q.dtype)


@supports("window", "softcap", "quantized_kv")
def jax_ragged_kernel(q, k_pages, v_pages, *, kv_lengths, page_indices, cu_q_lens, num_seqs, scale=None,
                      causal=True, window_size=None, softcap=None, sinks=None, k_scale=None, v_scale=None):
    """``pallas.ops.tpu.ragged_paged_attention`` (``(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
    sm_scale, sliding_window, soft_cap, k_scale, v_scale, num_kv_pages_per_block, num_queries_per_block)``) in
    TPU interpret mode, on the contract's call through ``layout``.

    Declared: ``window`` (causal only: ``sliding_window = left + 1``), ``softcap`` (its ``soft_cap``) and
    ``quantized_kv`` (its ``k_scale`` / ``v_scale``: Python floats only, a traced scale is refused). Not declared:
    ``sinks`` (it has none). ``scale`` is its ``sm_scale``.

    It does not run on a CPU: TPU interpret mode (jax 0.6.2 to 0.10.2) reads a ref only through indexing
    transforms and the kernel reshapes its VMEM K/V buffer (``'ReshapeTransform' object has no attribute
    'indices'``). ``jax_ragged_reference`` is graded in its place."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention
    import jax.experimental.pallas.tpu as pltpu

    if not hasattr(pltpu, "force_tpu_interpret_mode"):
        raise RuntimeError(f"jax {jax.__version__} has no pltpu.force_tpu_interpret_mode (TPU interpret mode)")
    pages_per_block = min(PAGES_PER_BLOCK, int(page_indices.shape[1]))
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        return _call(ragged_paged_attention, q, k_pages, v_pages, kv_lengths, page_indices, cu_q_lens, num_seqs,
                     scale, causal, window_size, softcap, sinks, k_scale, v_scale,
                     lanes=-(-q.shape[-1] // LANES) * LANES, queries=QUERIES_PER_BLOCK,
                     num_kv_pages_per_block=pages_per_block, num_queries_per_block=QUERIES_PER_BLOCK)


@supports("window", "softcap", "quantized_kv")
def jax_ragged_reference(q, k_pages, v_pages, *, kv_lengths, page_indices, cu_q_lens, num_seqs, scale=None,
                         causal=True, window_size=None, softcap=None, sinks=None, k_scale=None, v_scale=None):
    """JAX's ``ref_ragged_paged_attention`` (beside the kernel: the same signature, layout and features) in the
    kernel's place, through the same ``layout``, graded because the kernel cannot run here.

    It runs eagerly (a Python loop over ``num_seqs[0]``), masks by adding ``mask_value`` to the logits of keys it
    sliced to the sequence's length, dequantizes as the contract allows (``float32(stored) * scale`` rounded to
    q's dtype), rounds probabilities to the value dtype before the P.V matmul, and returns only the graded rows
    (the adapter pads the rest with zeros; with no graded row it returns zeros without calling it)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import ref_ragged_paged_attention

    return _call(ref_ragged_paged_attention, q, k_pages, v_pages, kv_lengths, page_indices, cu_q_lens, num_seqs,
                 scale, causal, window_size, softcap, sinks, k_scale, v_scale, lanes=q.shape[-1], queries=1)
