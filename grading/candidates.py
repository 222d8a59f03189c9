"""Candidates the rubric grades: the reference, the kernels, correct variants, known-bad ones, any user's.

Every candidate follows the contract ``attention(q, k, v, *, causal=False, kv_lengths=None, scale=None)``
(``kernel_src.contract``). ``BUILTIN`` maps a name to a :class:`Candidate`; :func:`resolve` also accepts
``path/to/file.py:function`` and ``package.module:function``. Loading is lazy: a kernel that does not
import yet, or a file that does not exist, fails in :meth:`Candidate.load` and the rubric turns that into
a scorecard with the load error.

Each known-bad candidate carries one bug that a real kernel or a real grader has had, written down in
its ``doc``, and names in ``catches`` the rubric check(s) built to reject it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kernel_src.reference import reference_attention

Attention = Callable[..., jax.Array]
KINDS = ("reference", "kernel", "correct-variant", "known-bad", "external")


class CandidateSpecError(ValueError):
    """A ``--candidate`` spec that names no built-in and is not ``file.py:function`` / ``module:function``."""


class CandidateLoadError(RuntimeError):
    """A candidate whose code could not be imported or whose function is missing or not callable."""


@dataclass(frozen=True)
class Candidate:
    """A named attention implementation. ``doc``'s first line says what it is (for known-bad: its bug)."""

    name: str
    kind: str
    doc: str
    loader: Callable[[], Attention] = field(repr=False)
    catches: tuple[str, ...] = ()

    def load(self) -> Attention:
        """Import and return the callable; raises :class:`CandidateLoadError` with the reason."""
        try:
            fn = self.loader()
        except CandidateLoadError:
            raise
        except Exception as e:  # an import error in the candidate's own code is the candidate's problem
            raise CandidateLoadError(f"cannot load {self.name!r}: {type(e).__name__}: {e}") from e
        if not callable(fn):
            raise CandidateLoadError(f"{self.name!r} resolved to a {type(fn).__name__}, which is not callable")
        return fn

    @property
    def summary(self) -> str:
        return self.doc.strip().splitlines()[0] if self.doc.strip() else ""


# --------------------------------------------------------------------------------------------------
# One pure-JAX attention whose switches are *traced* values, so the correct variant and every bug built
# on it share one compiled executable per shape and dtype (most of the rubric's cost is XLA compiling).
# Each switch is written so that, when off, it adds no NaN to values or gradients.

class Switches(NamedTuple):
    """Runtime switches of :func:`_attend`; all off is the contract."""

    probs_in_input_dtype: bool = False  # round probabilities to the input dtype before P·V (allowed)
    ignore_causal: bool = False
    ignore_lengths: bool = False
    top_left: bool = False              # causal offset 0 instead of kv_len - q_len
    length_slack: int = 0               # key j valid while j < kv_lengths[b] + slack
    bf16_logits: bool = False           # logits and softmax statistics rounded to bfloat16
    tile_heads: bool = False            # query head h reads kv head h % num_kv_heads
    no_max: bool = False                # exp(s) without subtracting the row max
    nan_empty: bool = False             # 0 / 0 on rows with no visible key
    mean_empty: bool = False            # uniform weights on rows with no visible key
    stop_grad_k: bool = False


def _attend(q, k, v, lengths, causal, scale, sw: Switches):
    lq, hq = q.shape[1], q.shape[2]
    lk, hk = k.shape[1], k.shape[2]
    heads = jnp.arange(hq)
    kv_head = jnp.where(sw.tile_heads, heads % hk, heads // (hq // hk))
    k, v = jnp.take(k, kv_head, axis=2), jnp.take(v, kv_head, axis=2)
    k = jnp.where(sw.stop_grad_k, jax.lax.stop_gradient(k), k)

    def low(x):
        return jnp.where(sw.bf16_logits, x.astype(jnp.bfloat16).astype(jnp.float32), x)

    s = low(jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=jax.lax.Precision.HIGHEST,
                       preferred_element_type=jnp.float32) * scale)
    i, j = jnp.arange(lq)[:, None], jnp.arange(lk)[None, :]
    offset = jnp.where(sw.top_left, 0, lk - lq)
    vis = (j <= i + offset) | sw.ignore_causal | ~causal
    vis = vis[None, None] & ((j < lengths[:, None] + sw.length_slack) | sw.ignore_lengths)[:, None, None, :]
    s = jnp.where(vis, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jax.lax.stop_gradient(low(jnp.where(jnp.isfinite(m) & ~sw.no_max, m, 0.0)))
    empty = ~jnp.any(vis, axis=-1, keepdims=True)
    e = low(jnp.where(vis, jnp.exp(s - m), jnp.where(sw.mean_empty & empty, 1.0, 0.0)))
    denom = low(jnp.sum(e, axis=-1, keepdims=True))
    p = e / jnp.where(sw.nan_empty | (denom > 0), denom, 1.0)
    p = jnp.where(sw.probs_in_input_dtype, p.astype(q.dtype).astype(jnp.float32), p)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return out.astype(q.dtype)


_attend_jit = jax.jit(_attend)


def _variant(default_scale: Callable[[int], float] = lambda d: d ** -0.5, **switches) -> Attention:
    """The contract on top of :func:`_attend` with some switches on (flags become traced values)."""
    sw = Switches(**switches)

    def attention(q, k, v, *, causal=False, kv_lengths=None, scale=None):
        batch, kv_len = k.shape[0], k.shape[1]
        lengths = jnp.full((batch,), kv_len, jnp.int32) if kv_lengths is None else jnp.asarray(kv_lengths, jnp.int32)
        scale = default_scale(q.shape[-1]) if scale is None else scale
        return _attend_jit(q, k, v, lengths, jnp.asarray(bool(causal)), jnp.asarray(scale, jnp.float32), sw)

    return attention


def _online_softmax(q, k, v, kv_lengths, *, causal, scale, chunk=16):
    """Flash-style: running max, sum and fp32 accumulator over key chunks of ``chunk`` (a ``lax.scan``)."""
    b, lq, hq, d = q.shape
    lk, hk = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    pad = -lk % chunk
    k = jnp.pad(jnp.repeat(k, hq // hk, axis=2), ((0, 0), (0, pad), (0, 0), (0, 0)))
    v = jnp.pad(jnp.repeat(v, hq // hk, axis=2), ((0, 0), (0, pad), (0, 0), (0, 0)))
    lengths = jnp.full((b,), lk) if kv_lengths is None else kv_lengths
    i = jnp.arange(lq)[:, None]

    def step(carry, start):
        m, l, acc = carry
        kc = jax.lax.dynamic_slice_in_dim(k, start, chunk, axis=1)
        vc = jax.lax.dynamic_slice_in_dim(v, start, chunk, axis=1)
        j = start + jnp.arange(chunk)[None, :]
        vis = (j < lk) & ((j <= i + (lk - lq)) | (not causal))
        vis = vis[None, None] & (j[None, None] < lengths[:, None, None, None])
        s = jnp.einsum("bqhd,bkhd->bhqk", q, kc, precision=jax.lax.Precision.HIGHEST,
                       preferred_element_type=jnp.float32) * scale
        s = jnp.where(vis, s, -jnp.inf)
        # The result does not depend on the running max, so no gradient flows through it.
        m_new = jax.lax.stop_gradient(jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True)))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        alpha = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)
        p = jnp.where(vis, jnp.exp(s - m_safe), 0.0)
        l = alpha * l + jnp.sum(p, axis=-1, keepdims=True)
        acc = alpha * acc + jnp.einsum("bhqk,bkhd->bhqd", p, vc.astype(jnp.float32),
                                       precision=jax.lax.Precision.HIGHEST)
        return (m_new, l, acc), None

    init = (jnp.full((b, hq, lq, 1), -jnp.inf, jnp.float32), jnp.zeros((b, hq, lq, 1), jnp.float32),
            jnp.zeros((b, hq, lq, d), jnp.float32))
    (_, l, acc), _ = jax.lax.scan(step, init, jnp.arange(0, lk + pad, chunk))
    out = acc / jnp.where(l > 0, l, 1.0)
    return jnp.transpose(out, (0, 2, 1, 3)).astype(q.dtype)


def _contract(fn):
    """Give ``fn(q, k, v, kv_lengths, *, causal, scale)`` the contract's signature, jitted per flags."""
    jitted = jax.jit(fn, static_argnames=("causal", "scale"))

    @functools.wraps(fn)
    def attention(q, k, v, *, causal=False, kv_lengths=None, scale=None):
        return jitted(q, k, v, kv_lengths, causal=bool(causal), scale=None if scale is None else float(scale))

    return attention


def _reference_fn(q, k, v, kv_lengths, *, causal, scale):
    return reference_attention(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale)


reference = _contract(_reference_fn)
"""``kernel_src.reference_attention`` jitted per (causal, scale): the ``reference`` candidate and the
rubric's baseline (one compiled executable serves both)."""


def _ones_cotangent() -> Attention:
    """Runs eagerly around the shared ``reference`` executable, so it costs no compile of its own."""
    def attention(q, k, v, *, causal=False, kv_lengths=None, scale=None):
        call = functools.partial(reference, causal=causal, kv_lengths=kv_lengths, scale=scale)

        @jax.custom_vjp
        def attn(q, k, v):
            return call(q, k, v)

        def fwd(q, k, v):
            return call(q, k, v), (q, k, v)

        def bwd(residuals, g):
            g = jnp.broadcast_to(jnp.mean(g.astype(jnp.float32), axis=-1, keepdims=True), g.shape)
            return jax.vjp(call, *residuals)[1](g.astype(residuals[0].dtype))

        attn.defvjp(fwd, bwd)
        return attn(q, k, v)

    return attention


def _memoizing() -> Attention:
    cache: dict = {}

    def attention(q, k, v, *, causal=False, kv_lengths=None, scale=None):
        key = (q.shape, k.shape, str(q.dtype), bool(causal), kv_lengths is None, scale)
        if key in cache:
            return cache[key]
        out = reference(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale)
        if not isinstance(out, jax.core.Tracer):
            cache[key] = out
        return out

    return attention


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


def _kernel(module: str, *names: str) -> Callable[[], Attention]:
    """Lazy loader for ``module``'s first attribute in ``names`` (or ``module`` itself if it is a function).

    The kernel is graded under ``jax.jit`` (static ``causal``/``scale``), as it runs in a model; without
    it an interpret-mode ``pallas_call`` is traced and compiled again on every call.
    """
    @functools.cache  # one jitted wrapper per process, so later grades reuse its executables
    def load() -> Attention:
        fn = _find()
        jitted = jax.jit(fn, static_argnames=("causal", "scale"))

        @functools.wraps(fn)
        def attention(q, k, v, *, causal=False, kv_lengths=None, scale=None):
            return jitted(q, k, v, causal=bool(causal), kv_lengths=kv_lengths,
                          scale=None if scale is None else float(scale))

        return attention

    def _find() -> Attention:
        package, _, leaf = module.rpartition(".")
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            mod = getattr(importlib.import_module(package), leaf, None)
            if mod is None:
                raise CandidateLoadError(f"{module} is not importable yet ({e})") from e
        if callable(mod) and not isinstance(mod, type(sys)):
            return mod
        for name in names:
            if callable(getattr(mod, name, None)):
                return getattr(mod, name)
        raise CandidateLoadError(f"{module} has none of {names}")
    return load


def _constant(fn):
    return lambda: fn


def _bad(name: str, doc: str, catches: tuple[str, ...], loader) -> Candidate:
    return Candidate(name, "known-bad", doc, loader, catches)


BUILTIN: dict[str, Candidate] = {c.name: c for c in [
    Candidate("reference", "reference",
              "kernel_src.reference_attention: the contract-precision pure-JAX oracle (fp32 logits, "
              "statistics and accumulation; output in the input dtype).", _constant(reference)),
    Candidate("pallas", "kernel",
              "kernel_src.pallas_attention: Pallas masked softmax inside XLA matmuls (interpret mode on CPU).",
              _kernel("kernel_src.pallas_attention", "pallas_attention", "attention")),
    Candidate("flash", "kernel",
              "kernel_src.flash_attention.flash_attention: fused Pallas flash kernel (interpret mode on CPU).",
              _kernel("kernel_src.flash_attention", "flash_attention", "attention")),
    Candidate("rounded-probs", "correct-variant",
              "Probabilities rounded to the input dtype before P·V (the contract allows it), fp32 accumulation.",
              _constant(_variant(probs_in_input_dtype=True))),
    Candidate("online-softmax", "correct-variant",
              "Online softmax over 16-key chunks (running max, sum and fp32 accumulator), like a flash kernel.",
              _constant(_contract(_online_softmax))),
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
         ("scale",), _constant(_variant(default_scale=lambda d: 1.0 / d))),
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
    _bad("wrong-dtype", "Returns float32 for bfloat16 inputs (accurate, but breaks the output dtype rule).",
         ("output-shape-dtype",), _constant(_wrong_dtype)),
]}


def _load_external(spec: str, target: str, function: str) -> Callable[[], Attention]:
    def load() -> Attention:
        if target.endswith(".py") or "/" in target or "\\" in target:
            path = Path(target).expanduser().resolve()
            if not path.is_file():
                raise CandidateLoadError(f"candidate file {target} does not exist")
            module_name = "rubric_candidate_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
            module_spec = importlib.util.spec_from_file_location(module_name, path)
            if module_spec is None or module_spec.loader is None:
                raise CandidateLoadError(f"cannot import {target} as Python source")
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_name] = module
            try:
                module_spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(module_name, None)
                raise
        else:
            module = importlib.import_module(target)
        if not hasattr(module, function):
            raise CandidateLoadError(f"{target} has no attribute {function!r}")
        return getattr(module, function)
    return load


def resolve(spec: str | Candidate) -> Candidate:
    """A built-in name, ``path/to/file.py:function`` or ``package.module:function`` as a Candidate.

    Raises :class:`CandidateSpecError` for a spec of neither form (the file or module itself is only
    imported by :meth:`Candidate.load`).
    """
    if isinstance(spec, Candidate):
        return spec
    spec = str(spec).strip()
    if spec in BUILTIN:
        return BUILTIN[spec]
    if ":" not in spec:
        raise CandidateSpecError(
            f"unknown candidate {spec!r}: use a built-in ({', '.join(BUILTIN)}), "
            f"path/to/file.py:function or package.module:function")
    target, _, function = spec.rpartition(":")
    if not target or not function.isidentifier():
        raise CandidateSpecError(f"bad candidate spec {spec!r}: expected path/to/file.py:function "
                                 f"or package.module:function")
    if not (target.endswith(".py") or "/" in target or "\\" in target) and \
            not all(part.isidentifier() for part in target.split(".")):
        raise CandidateSpecError(f"bad candidate spec {spec!r}: {target!r} is neither a .py file nor a module path")
    return Candidate(spec, "external", f"External candidate {spec}.", _load_external(spec, target, function))
