"""The rubric's problems: inputs and flags of one candidate call, with the float64 truth and the
reference's result computed on demand (``Problem``), and the shapes they are drawn at.

Every problem is built from a NumPy generator, so ``(seed, check, trial)`` fixes its values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from grading import oracle
from grading.candidates import reference
from kernel_src.contract import Dims

SHAPES = {
    "A": Dims(batch=2, q_len=16, kv_len=40, num_q_heads=6, num_kv_heads=3, head_dim=64),
    "B": Dims(batch=1, q_len=24, kv_len=24, num_q_heads=3, num_kv_heads=1, head_dim=32),
    "C": Dims(batch=2, q_len=8, kv_len=136, num_q_heads=2, num_kv_heads=2, head_dim=48),
    "D": Dims(batch=2, q_len=20, kv_len=12, num_q_heads=4, num_kv_heads=2, head_dim=16),
}
SHORT = {"float32": "f32", "bfloat16": "bf16"}
EXPLICIT_SCALE = 0.3  # fixed (not drawn) so an explicit scale costs one compiled executable, not one per seed


class Problem:
    """One call's inputs and flags. ``ct`` (a random cotangent) is set when gradients are checked."""

    def __init__(self, label: str, dtype: str, q, k, v, *, causal: bool = False, kv_lengths=None,
                 scale: float | None = None, ct=None):
        self.label, self.dtype, self.causal, self.scale = label, dtype, causal, scale
        self.q, self.k, self.v = (jnp.asarray(x, dtype) for x in (q, k, v))
        self.ct = None if ct is None else jnp.asarray(ct, dtype)
        self.lengths = None if kv_lengths is None else np.asarray(kv_lengths, np.int32)
        self.kv_lengths = None if kv_lengths is None else jnp.asarray(self.lengths)

    @property
    def kwargs(self) -> dict:
        return {"causal": self.causal, "kv_lengths": self.kv_lengths, "scale": self.scale}

    @property
    def offset(self) -> int:
        return self.k.shape[1] - self.q.shape[1]

    def replace(self, label: str, **arrays) -> "Problem":
        """The same flags with some of q/k/v/ct replaced (NumPy float32 values); always fresh arrays."""
        a = {n: arrays.get(n, None if getattr(self, n) is None else self.host(n)) for n in ("q", "k", "v", "ct")}
        return Problem(label, self.dtype, a["q"], a["k"], a["v"], ct=a["ct"], causal=self.causal,
                       kv_lengths=self.lengths, scale=self.scale)

    def host(self, name: str) -> np.ndarray:
        return np.asarray(getattr(self, name)).astype(np.float32)

    @functools.cached_property
    def truth(self) -> oracle.Truth:
        return oracle.attention(self.q, self.k, self.v, self.ct, causal=self.causal,
                                kv_lengths=self.lengths, scale=self.scale)

    @functools.cached_property
    def baseline(self) -> tuple[np.ndarray, ...]:
        """The reference's ``(out,)`` or ``(out, dq, dk, dv)`` when ``ct`` is set."""
        # Called exactly as the rubric calls a candidate, so grading ``reference`` reuses these executables.
        if self.ct is None:
            return (np.asarray(reference(self.q, self.k, self.v, **self.kwargs)),)
        out, pull = jax.vjp(lambda q, k, v: reference(q, k, v, **self.kwargs), self.q, self.k, self.v)
        return tuple(np.asarray(x) for x in (out, *pull(self.ct)))


def _lengths(rng: np.random.Generator, dims: Dims, zero_batch: int | None = None) -> np.ndarray:
    """Random kv_lengths in [1, kv_len - 1]; past 128 the first one crosses the 128-lane boundary."""
    lengths = rng.integers(1, dims.kv_len, size=dims.batch)
    if dims.kv_len > 129:
        lengths[0] = rng.integers(129, dims.kv_len)
        lengths[1:] = rng.integers(1, 128, size=dims.batch - 1)
    if zero_batch is not None:
        lengths[zero_batch] = 0
    return lengths


def normal(rng: np.random.Generator, shape: str, dtype: str, *, causal: bool = False, lengths: bool | str = False,
           scale: float | None = None, grad: bool = False, zero_batch: int | None = None, tag: str = "") -> Problem:
    """N(0, 1) q, k, v (and cotangent when ``grad``) of ``SHAPES[shape]``.

    ``lengths``: False (kv_lengths=None), True (random kv_lengths) or "full" (kv_lengths = kv_len).
    """
    d = SHAPES[shape]
    q = rng.standard_normal((d.batch, d.q_len, d.num_q_heads, d.head_dim), np.float32)
    k = rng.standard_normal((d.batch, d.kv_len, d.num_kv_heads, d.head_dim), np.float32)
    v = rng.standard_normal(k.shape, np.float32)
    ct = rng.standard_normal(q.shape, np.float32) if grad else None
    kv_lengths = None if not lengths else np.full(d.batch, d.kv_len) if lengths == "full" else \
        _lengths(rng, d, zero_batch)
    flags = [name for name, on in (("causal", causal), ("kv_lengths", lengths)) if on]
    flags += [f"scale={scale:g}"] if scale is not None else []
    label = f"{shape}{tuple(d)} {SHORT[dtype]} {'+'.join(flags) or 'unmasked'}{' ' + tag if tag else ''}"
    return Problem(label, dtype, q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale, ct=ct)


