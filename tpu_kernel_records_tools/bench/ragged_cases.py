"""The ``ragged`` scope's cases: one serving step (``RaggedModel``) per model, page size and cache dtype.

Each case is one ``ragged_paged_attention`` call (``kernel_src.contract``), timed forward only, over the
step's mix (``RaggedModel.mix``: decode rows, prefill chunks, a whole prompt; ``q``'s rows padded to
``TOKEN_MULTIPLE``), its pages permuted in the pool (``RaggedModel.page_table``), the cache in bfloat16 or in
float8_e4m3fn with ``QUANTIZED_SCALES``. Timed: the project's ragged kernel (``ragged-pallas``: Mosaic on a
TPU, interpret mode on a CPU; ``ragged-triton`` on a GPU), the XLA reference (``ragged-xla``, where
``RaggedModel.xla_fits``) and, on a TPU, JAX's ``ragged_paged_attention`` (``jax-ragged``, on its own
K/V-interleaved pool: each implementation gets the pool laid out as it reads it, ``Implementation.paged``).
Every implementation gets the same values. Useful bytes: ``bench.roofline.ragged_work``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..bench.case import Case, LazyFn, Pair, declares, pair_cases, registered, seeded_rng, uses_pallas
from ..bench.profiles import Profile
from ..bench.ragged_profiles import QUANTIZED_SCALES, RaggedModel
from kernel_src import registry
from kernel_src.contract import QUANTIZED_DTYPES, QUANTIZED_KV


def ragged_cases(profile: Profile, scope: str, seed: int, platform: str) -> tuple[list[Case], list[Pair]]:
    """Every case and pair of the ``ragged`` scope: per step, page size and cache dtype, each ragged
    implementation that runs on ``platform`` and declares the cache's features (the XLA reference only where
    ``RaggedModel.xla_fits``), paired as every scope pairs them (``bench.case.pair_cases``)."""
    if not profile.ragged:
        raise ValueError(f"profile {profile.name!r} has no ragged serving steps (scope {scope!r})")
    cases, pairs = [], []
    for model in profile.ragged:
        for page_size, kv_dtype in model.variants():
            features = (QUANTIZED_KV,) if jnp.dtype(kv_dtype) in QUANTIZED_DTYPES else ()
            ids = {}
            for impl in registry.for_scope(scope, platform):
                if (impl.kind == "reference" and not model.xla_fits()) or not declares(impl.name, features):
                    continue
                case = _ragged_case(profile, scope, impl.name, model, page_size, kv_dtype, seed, platform)
                ids[impl.name] = case.case_id
                cases.append(case)
            pairs += pair_cases(scope, model.max_len(), ids)
    return cases, pairs


def step_inputs(model: RaggedModel, page_size: int, kv_dtype: str, q_dtype: Any, rng: np.random.Generator
                ) -> list[np.ndarray]:
    """``[q, k_pages, v_pages, kv_lengths, page_indices, cu_q_lens, num_seqs]`` of a step, host arrays: ``q``
    ``[num_tokens, num_q_heads, head_dim]`` and the pools ``[pool_pages, page_size, num_kv_heads, head_dim]``
    standard normal (a quantized pool's stored values are those over its scale, rounded to its dtype)."""
    q_lens, kv_lens = model.mix()
    table, pool = model.page_table(page_size)
    q = rng.standard_normal((model.num_tokens, model.num_q_heads, model.head_dim), dtype=np.float32)
    shape = (pool, page_size, model.num_kv_heads, model.head_dim)
    k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(2))
    if jnp.dtype(kv_dtype) in QUANTIZED_DTYPES:
        k, v = k / QUANTIZED_SCALES[0], v / QUANTIZED_SCALES[1]
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return [q.astype(q_dtype), k.astype(jnp.dtype(kv_dtype)), v.astype(jnp.dtype(kv_dtype)), kv_lens, table,
            cu_q_lens, np.array([model.num_seqs], np.int32)]


def _interleaved(k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """JAX's one pool ``[pages, page_size, 2 * num_kv_heads, head_dim]``: K at even heads, V at odd."""
    pages, page_size, hk, d = k.shape
    return np.stack([k, v], axis=3).reshape(pages, page_size, 2 * hk, d)


def _ragged_case(profile: Profile, scope: str, impl: str, model: RaggedModel, page_size: int, kv_dtype: str,
                 seed: int, platform: str) -> Case:
    """One step: ``(q, k_pages, v_pages, kv_lengths, page_indices, cu_q_lens, num_seqs) -> out`` (JAX's kernel:
    one interleaved ``kv_pages`` for the two pools)."""
    dtype, cache = jnp.dtype(profile.dtype), jnp.dtype(kv_dtype)
    quantized = cache in QUANTIZED_DTYPES
    if not quantized and cache != dtype:
        raise ValueError(f"{model.name}: an unquantized cache is in q's dtype ({dtype.name}), got {kv_dtype}")
    implementation = registered(impl)
    interleaved = implementation.paged == "kv-interleaved"
    table, pool = model.page_table(page_size)
    d, hk = model.head_dim, model.num_kv_heads
    pools = ((pool, page_size, 2 * hk, d),) if interleaved else ((pool, page_size, hk, d),) * 2
    abstract = (jax.ShapeDtypeStruct((model.num_tokens, model.num_q_heads, d), dtype),
                *(jax.ShapeDtypeStruct(shape, cache) for shape in pools),
                jax.ShapeDtypeStruct((model.num_seqs,), jnp.int32), jax.ShapeDtypeStruct(table.shape, jnp.int32),
                jax.ShapeDtypeStruct((model.num_seqs + 1,), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32))
    options = dict(causal=True, scale=d ** -0.5)
    if quantized:
        options.update(k_scale=QUANTIZED_SCALES[0], v_scale=QUANTIZED_SCALES[1])

    def program():
        kernel = implementation.load()

        def step(q, *pools_and_tables):
            *pools, kv_lengths, page_indices, cu_q_lens, num_seqs = pools_and_tables
            return kernel(q, *pools, kv_lengths=kv_lengths, page_indices=page_indices, cu_q_lens=cu_q_lens,
                          num_seqs=num_seqs, **options)
        return step

    def make_inputs():
        rng = seeded_rng(seed, f"{scope}-{model.name}-p{page_size}-{kv_dtype}", model.max_len())
        q, k, v, *rest = step_inputs(model, page_size, kv_dtype, dtype, rng)
        return [q, _interleaved(k, v), *rest] if interleaved else [q, k, v, *rest]

    flops, nbytes = model.work(cache.itemsize, dtype.itemsize)
    pallas = uses_pallas(impl)
    fn = LazyFn(program)
    return Case(case_id=f"{scope}-{impl}-{model.name}-p{page_size}-{kv_dtype}", scope=scope, implementation=impl,
                seq_len=model.max_len(), shape=dict(batch=model.num_seqs, q_len=model.num_tokens,
                                                     kv_len=model.max_len(), num_q_heads=model.num_q_heads,
                                                     num_kv_heads=hk, head_dim=d),
                dtype=dtype.name, causal=True, padded=True, interpret=platform == "cpu" and pallas, fn=fn,
                abstract_args=abstract, make_inputs=make_inputs,
                tpu_fn=fn if platform == "cpu" and profile.export_tpu and pallas else None,  # as ``bench.cases``
                flops=flops, bytes_moved=nbytes, model=model.name, page_size=page_size, pages=table.shape[1],
                pool_pages=pool, num_seqs=model.num_seqs, q_rows=model.rows, kv_dtype=kv_dtype,
                quantized_kv=quantized)
