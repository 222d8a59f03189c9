"""The cases benchmark profiles (``bench.profiles``) expand to.

A profile names the shapes (batch, 4 query heads on 2 KV heads, head dim, bf16, causal, padded) and
sequence lengths; a scope names what is measured. Which implementations a scope measures is
declared once, in ``kernel_src.registry`` (``Implementation.scopes``); every implementation is
paired with the scope's reference (``xla``), and every kernel with every vendor kernel:

* ``softmax``: the masked-softmax step alone (``Implementation.load_softmax()``): ``pallas`` vs
  ``xla``, on ``[batch, q_heads, seq, seq]`` logits.
* ``attention``: whole grouped-query attention, ``pallas`` vs ``xla``.
* ``flash``: the fused ``flash`` kernel vs ``xla``; on a GPU also cuDNN's fused attention
  (``cudnn``). cuDNN aligns causal masks top-left and handles rows with no visible key
  differently; the cases use ``q_len == kv_len`` and key lengths ``>= seq/2``, where top-left
  equals the contract's bottom-right alignment and no row is empty, so all three compute the
  same function.
* ``sharded``: ``sharded_attention`` of the profile's kernel, the same global problem on 1 device
  and on all devices (scaling efficiency ``t1 / (n * tn)`` goes into the pair).
* ``model-fwd`` and ``model-fwd-bwd``: what the ``flash`` scope measures, at the sizes models run
  (``ModelShapes``: batch 8, 32 query / 8 kv heads and 16 / 16, head_dim 128, seq 2048 to 16384,
  causal, no padding), the forward alone and the forward with its VJP as one program
  ``(q, k, v, d_out) -> (dq, dk, dv)``. Achieved TFLOP/s count the useful FLOPs only
  (``bench.roofline``: causal counts about half, the backward 2.5 times the forward). The XLA
  reference joins only where its fp32 logits fit (``ModelShapes.xla_max_logit_bytes``). Only in
  the ``tpu-v5e`` and ``gpu`` profiles, and refused on a CPU (interpret mode would take hours).
* ``masks-fwd`` and ``masks-fwd-bwd``: the masks models run (``MaskedModel``: a sliding window, a
  soft-cap, packed documents' segment ids, attention sinks), each at its model's heads and
  sequence lengths (``MODEL_MASKS``, in the ``tpu-v5e`` and ``gpu`` profiles: Mistral-7B,
  Gemma 2 9B, gpt-oss-20b, packed training) or at tiny sizes with the same features
  (``TINY_MASKS``, the ``cpu`` and ``tiny`` profiles: interpret mode there). Causal, unpadded;
  the forward alone, and the forward with its VJP (``dsinks`` too, where there are sinks). Every
  implementation of the ``flash`` scope that declares the case's features is timed (the
  ``flash`` kernel; the XLA reference where its fp32 logits fit, ``ModelShapes.xla_fits``; cuDNN
  declares none). Useful FLOPs count the visible pairs only (``bench.roofline.visible_pairs``:
  a 4,096-key window over 32k keys about an eighth of the causal pairs).

* ``paged-decode``: one decode step (``q_len`` 1) over a paged KV cache, the paged contract
  (``kernel_src.contract.paged_attention``; ``PagedModel``: a model's heads, page sizes 16 and 128,
  contexts and batches, ``MODEL_PAGED`` in the ``tpu-v5e`` and ``gpu`` profiles: Llama-3-8B at 1k-32k
  keys, batch 64-8, and Mistral-7B with its 4,096-key window; ``TINY_PAGED`` at interpret-mode
  sizes in ``cpu``, its windowed one in ``tiny``). Sequences of distinct, ragged lengths (``PagedModel.lengths``)
  whose pages lie permuted in a pool of ``batch * pages`` pages (``PagedModel.page_table``). Timed:
  the project's paged kernel (``paged-pallas``: Mosaic on a TPU, interpret mode on a CPU;
  ``paged-triton`` on a GPU), the XLA gather-then-attend reference (``paged-xla``) and, on a TPU
  without a window, JAX's ``paged_attention`` (``jax-paged``, on its own heads-first pools: each
  implementation gets the pool laid out as it reads it, ``Implementation.paged``). Useful bytes are
  the K/V actually read (``bench.roofline.paged_work``: each key a new row sees, once, plus q and
  the output).
* ``ragged``: one serving step (decode rows, prefill chunks, a whole prompt) in one call of the ragged
  contract over a bfloat16 or float8_e4m3fn cache (``RaggedModel``; its cases are ``bench.ragged_cases``').

Every case of a scope and sequence length gets the same inputs (drawn from ``seed``); segment ids
are not drawn from ``seed`` but follow from the case (``MaskedModel.segment_ids``), so its FLOPs do.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..bench import roofline
from ..bench.case import Case, LazyFn, Pair, declares, pair_cases, registered, seeded_rng, uses_pallas
from ..bench.profiles import (MASK_SCOPES, MODEL_SCOPES, MODEL_SHAPES, PAGED_SCOPES, RAGGED_SCOPES, SCOPES, MaskedModel,
                              PagedModel, Profile)
from ..bench.ragged_cases import ragged_cases
# Re-exported: many callers import these from bench.cases.
from ..bench.profiles import PROFILES, get_profile  # noqa: F401
from kernel_src import registry
from kernel_src.registry import IMPLEMENTATIONS, Implementation


def kv_lengths_for(batch: int, seq: int) -> np.ndarray:
    """Key lengths alternating 3/4 and all of ``seq`` over the batch: padding, but no empty row."""
    return np.array([seq - (seq // 4) * ((b + 1) % 2) for b in range(batch)], dtype=np.int32)


# --- implementations (declared once, in kernel_src.registry) ------------------------------------

def _softmax_fn(impl: Implementation, causal: bool):
    softmax = impl.load_softmax()
    return lambda logits, lengths: softmax(logits, causal=causal, kv_lengths=lengths)


def _attention_fn(kernel: Callable[..., Any], causal: bool, scale: float):
    return lambda q, k, v, lengths: kernel(q, k, v, causal=causal, kv_lengths=lengths, scale=scale)


def _sharded_fn(kernel: Callable[..., Any], devices: int, causal: bool, scale: float):
    sharded = IMPLEMENTATIONS["sharded"].load()

    def fn(q, k, v, lengths):
        from kernel_src.sharded import attention_mesh

        mesh = attention_mesh(q.shape[0], k.shape[2], jax.devices()[:devices])
        return sharded(kernel, q, k, v, mesh=mesh, causal=causal, kv_lengths=lengths, scale=scale)
    return fn


# --- expansion ---------------------------------------------------------------------------------

def _implementations(scope: str, platform: str, profile: Profile) -> list[str]:
    if scope == "sharded":
        kernel = profile.sharded_kernel
        n = jax.device_count()
        return [f"{kernel}@1"] + ([f"{kernel}@{n}"] if n > 1 else [])
    if scope not in SCOPES:
        raise ValueError(f"unknown scope {scope!r}; choose from {SCOPES}")
    if scope in MODEL_SCOPES or scope in MASK_SCOPES:  # the flash scope's implementations
        scope = "flash"
    return [impl.name for impl in registry.for_scope(scope, platform)]


def build_cases(profile: Profile, scopes: Sequence[str], *, seed: int = 0,
                platform: str | None = None) -> tuple[list[Case], list[Pair]]:
    """Expand ``profile`` over ``scopes`` into cases (in run order) and the pairs to compare."""
    platform = platform or jax.default_backend()
    unknown = [s for s in scopes if s not in SCOPES]
    if unknown:
        raise ValueError(f"unknown scope(s) {unknown}; choose from {SCOPES}")
    dtype = jnp.dtype(profile.dtype)
    cases, pairs = [], []
    for scope in scopes:
        if scope in MODEL_SCOPES or scope in MASK_SCOPES or scope in PAGED_SCOPES or scope in RAGGED_SCOPES:
            expand = (_model_cases if scope in MODEL_SCOPES else _mask_cases if scope in MASK_SCOPES
                      else _paged_cases if scope in PAGED_SCOPES else ragged_cases)
            model_cases, model_pairs = expand(profile, scope, seed, platform)
            cases, pairs = cases + model_cases, pairs + model_pairs
            continue
        for seq in profile.seq_lens_for(scope):
            batch = profile.batch_for(scope, seq)
            ids = {}
            for impl in _implementations(scope, platform, profile):
                case = _case(profile, scope, impl, seq, batch, dtype, seed, platform)
                ids[impl] = case.case_id
                cases.append(case)
            pairs += pair_cases(scope, seq, ids)
    return cases, pairs


def _case(profile: Profile, scope: str, impl: str, seq: int, batch: int, dtype: Any, seed: int,
          platform: str) -> Case:
    hq, hk, d = profile.num_q_heads, profile.num_kv_heads, profile.head_dim
    lengths = kv_lengths_for(batch, seq) if profile.padded else None
    interpret = platform == "cpu" and uses_pallas(impl)
    shape = dict(batch=batch, q_len=seq, kv_len=seq, num_q_heads=hq, num_kv_heads=hk, head_dim=d)
    lengths_spec = (jax.ShapeDtypeStruct((batch,), jnp.int32),) if lengths is not None else ()
    base, _, devices = impl.partition("@")
    implementation = registered(base)

    if scope == "softmax":
        abstract = (jax.ShapeDtypeStruct((batch, hq, seq, seq), dtype),) + lengths_spec
        flops, nbytes = roofline.softmax_work(batch, hq, seq, seq, dtype.itemsize, lengths is not None)

        def make_inputs():
            logits = seeded_rng(seed, scope, seq).standard_normal((batch, hq, seq, seq), dtype=np.float32)
            return [(3.0 * logits).astype(dtype)] + ([lengths] if lengths is not None else [])

        fn = _with_optional_lengths(LazyFn(lambda: _softmax_fn(implementation, profile.causal)),
                                    lengths)
        case_id = f"{scope}-{impl}-s{seq}"
    else:
        scale = d ** -0.5
        abstract = (jax.ShapeDtypeStruct((batch, seq, hq, d), dtype),
                    jax.ShapeDtypeStruct((batch, seq, hk, d), dtype),
                    jax.ShapeDtypeStruct((batch, seq, hk, d), dtype)) + lengths_spec
        flops, nbytes = roofline.attention_work(batch, seq, seq, hq, hk, d, dtype.itemsize,
                                                profile.causal, lengths)

        def make_inputs():
            rng = seeded_rng(seed, scope, seq)
            qkv = [rng.standard_normal(a.shape, dtype=np.float32).astype(dtype) for a in abstract[:3]]
            return qkv + ([lengths] if lengths is not None else [])

        def contract_fn():
            kernel = implementation.load()
            if scope == "sharded":
                return _sharded_fn(kernel, int(devices), profile.causal, scale)
            return _attention_fn(kernel, profile.causal, scale)

        fn = _with_optional_lengths(LazyFn(contract_fn), lengths)
        case_id = f"{scope}-{base}-d{devices}-s{seq}" if scope == "sharded" else f"{scope}-{impl}-s{seq}"

    # The kernels choose their lowering when lowered, so the very program timed here, exported
    # for TPU, is what a TPU would be given (Mosaic, TPU tiles).
    export = platform == "cpu" and profile.export_tpu and uses_pallas(impl)
    return Case(case_id=case_id, scope=scope, implementation=impl, seq_len=seq, shape=shape,
                dtype=dtype.name, causal=profile.causal, padded=lengths is not None,
                interpret=interpret, fn=fn, abstract_args=abstract, make_inputs=make_inputs,
                flops=flops, bytes_moved=nbytes, tpu_fn=fn if export else None,
                mesh_devices=int(devices) if devices else None)


def _model_cases(profile: Profile, scope: str, seed: int, platform: str
                 ) -> tuple[list[Case], list[Pair]]:
    """Every case and pair of a ``model-*`` scope: per heads pair and sequence, each of the flash
    scope's implementations (the XLA reference only where ``ModelShapes.xla_fits``)."""
    model = profile.model
    if model is None:
        raise ValueError(f"profile {profile.name!r} has no model-sized cases (scope {scope!r}); "
                         f"use tpu-v5e or gpu")
    if platform == "cpu":
        raise ValueError(f"scope {scope!r} runs model-sized problems: it needs a TPU or a GPU "
                         f"(Pallas in interpret mode on a CPU would take hours)")
    cases, pairs = [], []
    for hq, hk in model.heads:
        for seq in model.seq_lens:
            ids = {}
            for impl in _implementations(scope, platform, profile):
                if IMPLEMENTATIONS[impl].kind == "reference" and not model.xla_fits(scope, hq, seq):
                    continue
                case = _model_case(profile, scope, impl, seq, hq, hk, seed)
                ids[impl] = case.case_id
                cases.append(case)
            pairs += pair_cases(scope, seq, ids)
    return cases, pairs


def _model_case(profile: Profile, scope: str, impl: str, seq: int, hq: int, hk: int,
                seed: int) -> Case:
    """One model-sized case: causal, unpadded; ``model-fwd-bwd`` also takes the output's
    cotangent and returns ``(dq, dk, dv)``."""
    model, dtype, backward = profile.model, jnp.dtype(profile.dtype), scope == "model-fwd-bwd"
    batch, d = model.batch, model.head_dim
    q_spec = jax.ShapeDtypeStruct((batch, seq, hq, d), dtype)
    kv_spec = jax.ShapeDtypeStruct((batch, seq, hk, d), dtype)
    abstract = (q_spec, kv_spec, kv_spec) + ((q_spec,) if backward else ())
    flops, nbytes = roofline.attention_work(batch, seq, seq, hq, hk, d, dtype.itemsize, True, None,
                                            backward=backward)
    implementation, scale = registered(impl), d ** -0.5

    def program():
        kernel = implementation.load()

        def forward(q, k, v):
            return kernel(q, k, v, causal=True, scale=scale)
        if not backward:
            return forward

        def forward_backward(q, k, v, d_out):
            _, pullback = jax.vjp(forward, q, k, v)
            return pullback(d_out)
        return forward_backward

    def make_inputs():
        rng = seeded_rng(seed, f"{scope}-h{hq}x{hk}", seq)
        return [rng.standard_normal(a.shape, dtype=np.float32).astype(dtype) for a in abstract]

    return Case(case_id=f"{scope}-{impl}-h{hq}x{hk}-s{seq}", scope=scope, implementation=impl,
                seq_len=seq, shape=dict(batch=batch, q_len=seq, kv_len=seq, num_q_heads=hq,
                                        num_kv_heads=hk, head_dim=d),
                dtype=dtype.name, causal=True, padded=False, interpret=False,
                fn=LazyFn(program), abstract_args=abstract, make_inputs=make_inputs,
                flops=flops, bytes_moved=nbytes)


def _mask_cases(profile: Profile, scope: str, seed: int, platform: str) -> tuple[list[Case], list[Pair]]:
    """Every case and pair of a ``masks-*`` scope: per masked model, sequence and document count,
    each implementation of the flash scope that declares the mask's features (the XLA reference
    only where ``ModelShapes.xla_fits`` at the case's batch)."""
    if not profile.masks:
        raise ValueError(f"profile {profile.name!r} has no masked models (scope {scope!r})")
    cases, pairs = [], []
    for masked in profile.masks:
        for seq, documents in masked.variants():
            batch, ids = masked.batch_for(seq), {}
            fits = dataclasses.replace(MODEL_SHAPES, batch=batch).xla_fits(
                "model-fwd-bwd" if scope == "masks-fwd-bwd" else "model-fwd", masked.num_q_heads, seq)
            for impl in _implementations(scope, platform, profile):
                if not declares(impl, masked.features):
                    continue
                if IMPLEMENTATIONS[impl].kind == "reference" and not fits:
                    continue
                case = _mask_case(profile, scope, impl, masked, seq, documents, seed, platform)
                ids[impl] = case.case_id
                cases.append(case)
            pairs += pair_cases(scope, seq, ids)
    return cases, pairs


def _mask_case(profile: Profile, scope: str, impl: str, masked: MaskedModel, seq: int,
               documents: int | None, seed: int, platform: str) -> Case:
    """One masked case: ``(q, k, v[, d_out][, q_ids, kv_ids][, sinks])`` into the forward, or
    ``masks-fwd-bwd``'s ``(dq, dk, dv[, dsinks])``."""
    dtype, backward = jnp.dtype(profile.dtype), scope == "masks-fwd-bwd"
    batch, hq, hk, d = masked.batch_for(seq), masked.num_q_heads, masked.num_kv_heads, masked.head_dim
    q_spec = jax.ShapeDtypeStruct((batch, seq, hq, d), dtype)
    kv_spec = jax.ShapeDtypeStruct((batch, seq, hk, d), dtype)
    ids = None if documents is None else masked.segment_ids(seq, documents)
    extra = ((jax.ShapeDtypeStruct((batch, seq), jnp.int32),) * 2 if ids is not None else ()) + (
        (jax.ShapeDtypeStruct((hq,), jnp.float32),) if masked.sinks else ())
    abstract = (q_spec, kv_spec, kv_spec) + ((q_spec,) if backward else ()) + extra
    flops, nbytes = roofline.attention_work(batch, seq, seq, hq, hk, d, dtype.itemsize, True, None,
                                            backward=backward, window=masked.window, q_segment_ids=ids,
                                            kv_segment_ids=ids, sinks=masked.sinks)
    implementation = registered(impl)
    scale = d ** -0.5 if masked.scale is None else masked.scale
    options = dict(causal=True, scale=scale)
    if masked.window is not None:
        options["window_size"] = masked.window
    if masked.softcap is not None:
        options["softcap"] = masked.softcap

    def program():
        kernel = implementation.load()

        def forward(q, k, v, *rest):
            rest = list(rest)
            features = dict(options)
            if ids is not None:
                features["q_segment_ids"], features["kv_segment_ids"] = rest.pop(0), rest.pop(0)
            if masked.sinks:
                features["sinks"] = rest.pop(0)
            return kernel(q, k, v, **features)
        if not backward:
            return forward

        def forward_backward(q, k, v, d_out, *rest):
            if masked.sinks:  # the sinks are learned: their gradient too
                *segments, sinks = rest
                _, pullback = jax.vjp(lambda q, k, v, s: forward(q, k, v, *segments, s), q, k, v, sinks)
            else:
                _, pullback = jax.vjp(lambda q, k, v: forward(q, k, v, *rest), q, k, v)
            return pullback(d_out)
        return forward_backward

    def make_inputs():
        rng = seeded_rng(seed, f"{scope}-{masked.name}-d{documents}", seq)
        arrays = [rng.standard_normal(a.shape, dtype=np.float32).astype(dtype)
                  for a in abstract[:4 if backward else 3]]
        if ids is not None:
            arrays += [ids, ids]
        if masked.sinks:
            arrays.append(rng.standard_normal((hq,), dtype=np.float32))
        return arrays

    interpret = platform == "cpu" and uses_pallas(impl)
    export = platform == "cpu" and profile.export_tpu and uses_pallas(impl)  # as in ``_case``
    docs = "" if documents is None else f"-d{documents}"
    fn = LazyFn(program)
    return Case(case_id=f"{scope}-{impl}-{masked.name}{docs}-s{seq}", scope=scope, implementation=impl,
                seq_len=seq, shape=dict(batch=batch, q_len=seq, kv_len=seq, num_q_heads=hq, num_kv_heads=hk,
                                        head_dim=d),
                dtype=dtype.name, causal=True, padded=False, interpret=interpret,
                fn=fn, abstract_args=abstract, make_inputs=make_inputs, tpu_fn=fn if export else None,
                flops=flops, bytes_moved=nbytes, model=masked.name, window=masked.window,
                softcap=masked.softcap, segments=documents, sinks=True if masked.sinks else None)


def _paged_cases(profile: Profile, scope: str, seed: int, platform: str) -> tuple[list[Case], list[Pair]]:
    """Every case and pair of the ``paged-decode`` scope: per paged model, context and page size, each
    paged implementation that runs on ``platform`` and declares the model's features (JAX's
    ``paged_attention`` declares none)."""
    if not profile.paged:
        raise ValueError(f"profile {profile.name!r} has no paged decode cases (scope {scope!r})")
    cases, pairs = [], []
    for paged in profile.paged:
        for context, page_size in paged.variants():
            ids = {}
            for impl in _implementations(scope, platform, profile):
                if not declares(impl, paged.features):
                    continue
                case = _paged_case(profile, scope, impl, paged, context, page_size, seed, platform)
                ids[impl] = case.case_id
                cases.append(case)
            pairs += pair_cases(scope, context, ids)
    return cases, pairs


def _paged_case(profile: Profile, scope: str, impl: str, paged: PagedModel, context: int, page_size: int,
                seed: int, platform: str) -> Case:
    """One decode step: ``(q, k_pages, v_pages, kv_lengths, page_indices) -> out``, the pools laid out as
    the implementation reads them (``Implementation.paged``), the same values for each."""
    dtype = jnp.dtype(profile.dtype)
    batch, hq, hk, d = paged.batch_for(context), paged.num_q_heads, paged.num_kv_heads, paged.head_dim
    lengths = paged.lengths(context)
    table, pool = paged.page_table(context, page_size)
    implementation = registered(impl)
    heads_first = implementation.paged == "heads-first"
    pool_shape = (hk, pool, page_size, d) if heads_first else (pool, page_size, hk, d)
    abstract = (jax.ShapeDtypeStruct((batch, 1, hq, d), dtype), jax.ShapeDtypeStruct(pool_shape, dtype),
                jax.ShapeDtypeStruct(pool_shape, dtype), jax.ShapeDtypeStruct((batch,), jnp.int32),
                jax.ShapeDtypeStruct(table.shape, jnp.int32))
    flops, nbytes = paged.work(context, dtype.itemsize)
    options = dict(causal=True, scale=d ** -0.5)
    if paged.window is not None:
        options["window_size"] = paged.window

    def program():
        kernel = implementation.load()
        return lambda q, k, v, lengths, table: kernel(q, k, v, kv_lengths=lengths, page_indices=table, **options)

    def make_inputs():
        rng = seeded_rng(seed, f"{scope}-{paged.name}-p{page_size}", context)
        q = rng.standard_normal((batch, 1, hq, d), dtype=np.float32).astype(dtype)
        k, v = (rng.standard_normal((pool, page_size, hk, d), dtype=np.float32).astype(dtype) for _ in range(2))
        if heads_first:
            k, v = (np.ascontiguousarray(x.transpose(2, 0, 1, 3)) for x in (k, v))
        return [q, k, v, lengths, table]

    interpret = platform == "cpu" and uses_pallas(impl)
    export = platform == "cpu" and profile.export_tpu and uses_pallas(impl)  # as in ``_case``
    fn = LazyFn(program)
    return Case(case_id=f"{scope}-{impl}-{paged.name}-p{page_size}-s{context}", scope=scope, implementation=impl,
                seq_len=context, shape=dict(batch=batch, q_len=1, kv_len=context, num_q_heads=hq, num_kv_heads=hk,
                                            head_dim=d),
                dtype=dtype.name, causal=True, padded=True, interpret=interpret, fn=fn, abstract_args=abstract,
                make_inputs=make_inputs, tpu_fn=fn if export else None, flops=flops, bytes_moved=nbytes,
                model=paged.name, window=paged.window, page_size=page_size, pages=context // page_size,
                pool_pages=pool)


def _with_optional_lengths(fn: Callable[..., Any], lengths: np.ndarray | None) -> Callable[..., Any]:
    """``fn`` taking the key lengths as its last argument, or ``None`` for them when unpadded."""
    if lengths is not None:
        return fn
    return lambda *args: fn(*args, None)
