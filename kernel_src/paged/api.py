"""``paged_attention_tpu`` and ``paged_attention_triton``: the public entries, one per family.

Both take the paged contract's arguments (``kernel_src.contract``), check them there, lay the
query heads out as ``plan.to_rows`` tiles, run the family's kernel (interpret mode on CPU, the
compiled kernel on its own platform, refused on the other) and lay the rows back out.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from kernel_src import backend
from kernel_src.contract import (PAGED_FEATURES, Window, check_paged_features, check_paged_inputs,
                                 default_scale, supports)
from kernel_src.flash.plan import next_power_of_two, vmem_limits
from kernel_src.paged import gpu, tpu
from kernel_src.paged.plan import (PagedBlockSizes, PagedPlan, clip_lengths, from_rows,
                                   tile_rows, to_rows)


@functools.partial(jax.jit, static_argnames=("plan", "family", "block_sizes", "vmem_limit"))
def _paged(q, k_pages, v_pages, kv_lengths, page_indices, sinks, *, plan: PagedPlan,
           family: str, block_sizes: PagedBlockSizes, vmem_limit: int):
    q_rows = to_rows(q, plan.num_kv_heads, plan.rows_pad)
    lengths = clip_lengths(kv_lengths, plan)
    table = page_indices.astype(jnp.int32)
    sinks = None if sinks is None else sinks.astype(jnp.float32)
    if family == "mosaic":
        pages = block_sizes.pages(plan.page_size, plan.pages_per_sequence)
        if not plan.interpret:
            pages = tpu.fit_pages(pages, plan.page_size, plan.num_kv_heads, plan.head_dim,
                                  q.dtype.itemsize, plan.layout)
        out = tpu.forward(q_rows, k_pages, v_pages, lengths, table, sinks, plan, pages,
                          vmem_limit)
    else:
        block_k = min(block_sizes.block_k, max(16, next_power_of_two(plan.max_len)))
        out = gpu.forward(q_rows, k_pages, v_pages, lengths, table, sinks, plan, block_k)
    return from_rows(out, plan.q_len, plan.group)


def _paged_attention(family: str, q, k_pages, v_pages, kv_lengths, page_indices, scale, causal,
                     window_size, softcap, sinks, block_sizes, interpret, layout=None):
    dims = check_paged_inputs(q, k_pages, v_pages, kv_lengths, page_indices)
    if layout is not None and layout not in tpu.LAYOUTS:
        raise ValueError(f"layout must be one of {tpu.LAYOUTS}, got {layout!r}")
    if (layout == "rows" and dims.num_kv_heads % 2 and dims.num_kv_heads > 1
            and q.dtype.itemsize < 4):
        raise ValueError("layout 'rows' needs 1 or an even number of kv heads in 16 bits, got "
                         f"{dims.num_kv_heads}")
    window = check_paged_features(dims, window_size=window_size, softcap=softcap, sinks=sinks)
    window = None if window == (None, None) else window
    softcap = None if softcap is None else float(softcap)
    home = {"mosaic": "tpu", "triton": "gpu"}[family]

    def build(target: str, interpret: Any):
        compiled = target != "cpu"
        if compiled and target != home:
            raise backend.Unsupported(f"the {family} paged kernel has no {target} lowering")
        chosen = layout or ("heads" if not compiled or family != "mosaic" else
                            tpu.mosaic_layout(dims.num_kv_heads, q.dtype.itemsize))
        plan = PagedPlan(dims.q_len, dims.num_q_heads, dims.num_kv_heads, dims.head_dim,
                         dims.page_size, dims.pages_per_sequence, dims.num_pages, bool(causal),
                         default_scale(dims.head_dim, scale), interpret, window=window,
                         softcap=softcap, sinks=sinks is not None,
                         rows_pad=tile_rows(dims.group * dims.q_len, family), layout=chosen)
        blocks = block_sizes or PagedBlockSizes.for_platform(target)
        return functools.partial(_paged, plan=plan, family=family, block_sizes=blocks,
                                 vmem_limit=vmem_limits()[0])

    return backend.per_platform(build, interpret, jax.ShapeDtypeStruct(q.shape, q.dtype),
                                q, k_pages, v_pages, kv_lengths, page_indices, sinks)


@supports(*PAGED_FEATURES)
def paged_attention_tpu(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, *,
                        kv_lengths: jax.Array, page_indices: jax.Array,
                        scale: float | None = None, causal: bool = True,
                        window_size: Window | None = None, softcap: float | None = None,
                        sinks: jax.Array | None = None,
                        block_sizes: PagedBlockSizes | None = None,
                        interpret: Any = None, layout: str | None = None) -> jax.Array:
    """Paged grouped-query attention (the paged contract), forward only: the Mosaic kernel.

    Args:
      q: ``[batch, q_len, num_q_heads, head_dim]``, bf16 or fp32; ``q_len >= 1`` new rows,
        the last ``q_len`` of each sequence: row ``i`` of sequence ``b`` sits at position
        ``kv_lengths[b] - q_len + i``.
      k_pages, v_pages: ``[num_pages, page_size, num_kv_heads, head_dim]``, q's dtype; query
        head ``h`` reads kv head ``h // (num_q_heads // num_kv_heads)``.
      kv_lengths: int ``[batch]``: key ``j < kv_lengths[b]`` of sequence ``b`` is
        ``k_pages[page_indices[b, j // page_size], j % page_size]`` (values are clipped to
        ``[0, pages_per_sequence * page_size]``).
      page_indices: int ``[batch, pages_per_sequence]``; entries past a sequence's last page
        are never used (any value), and neither are slots past its length nor other pages
        (any value, NaN and Inf included).
      scale: logit scale, ``head_dim ** -0.5`` by default.
      causal: bottom-right causal (default): row ``i`` sees keys ``j <= position``.
      window_size: ``(left, right)``, ints >= 0 or None: keys ``position - left <= j <=
        position + right`` only; pages before the first row's window are not read.
      softcap: float > 0: logits become ``softcap * tanh(scale * q.k / softcap)`` before
        masking.
      sinks: fp32 ``[num_q_heads]``: one unscaled, uncapped logit per query head in each row's
        softmax denominator, with no value.
      block_sizes: pages per step (``PagedBlockSizes``); ``PagedBlockSizes.for_platform``'s of
        each target by default (compiled, shrunk until the K/V buffers fit
        ``tpu.BUFFER_BYTES`` of VMEM).
      interpret: ``None``: interpret mode on CPU, Mosaic on TPU, refused on GPU; ``True`` or
        ``pltpu.InterpretParams(...)`` (``backend.tpu_interpret_params()``: races, NaN-filled
        VMEM, out-of-bounds reads raise): interpret mode everywhere; ``False``: compiled only.
      layout: how the kernel's K/V buffers hold the kv heads (``tpu.LAYOUTS``): ``"heads"``
        (the pool as it is) or ``"rows"`` (the pool viewed as ``[num_pages, page_size *
        num_kv_heads, head_dim]``, a head read as strided rows: jax < 0.7, whose Mosaic cannot
        take one head out of a block). ``None``: "heads" in interpret mode, compiled the one the
        installed Mosaic takes (``tpu.mosaic_layout``); when given, interpret mode runs it too
        (how the tests check on a CPU the layout compiled under older jax). Same results.

    Returns:
      ``[batch, q_len, num_q_heads, head_dim]`` in q's dtype; a row with no visible key is
      exact zeros.
    """
    return _paged_attention("mosaic", q, k_pages, v_pages, kv_lengths, page_indices, scale,
                            causal, window_size, softcap, sinks, block_sizes, interpret, layout)


@supports(*PAGED_FEATURES)
def paged_attention_triton(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, *,
                           kv_lengths: jax.Array, page_indices: jax.Array,
                           scale: float | None = None, causal: bool = True,
                           window_size: Window | None = None, softcap: float | None = None,
                           sinks: jax.Array | None = None,
                           block_sizes: PagedBlockSizes | None = None,
                           interpret: Any = None) -> jax.Array:
    """Paged grouped-query attention (the paged contract), forward only: the Triton kernel.

    Arguments, shapes and result as ``paged_attention_tpu``, except: ``block_sizes.block_k``
    keys are gathered per loop iteration (``block_sizes.pages_per_step`` and ``keys_per_step``
    are unused); ``interpret=None`` runs interpret mode on CPU, Triton on GPU (CUDA, ROCm) and
    is refused on TPU, ``interpret=True`` interprets everywhere.
    """
    return _paged_attention("triton", q, k_pages, v_pages, kv_lengths, page_indices, scale,
                            causal, window_size, softcap, sinks, block_sizes, interpret)
