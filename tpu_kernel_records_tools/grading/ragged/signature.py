"""How export describes a call of the ragged paged contract (``kernel_src.contract.ragged_paged_attention``), and the
contract on top of its stored programs (``grading.programs``)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import numpy as np

from ...grading.programs import ProgramRefused, Programs, _static_feature_kwargs, _unset_features_dropped

_SCALES = ("k_scale", "v_scale")


@dataclass(frozen=True)
class RaggedSignature:
    """One call of the ragged contract as a program sees it: the shapes of q, of the pool (``k_pages`` and
    ``v_pages`` alike, in ``pool_dtype``) and of the page table, q's dtype and the static arguments; the
    per-sequence arrays (kv_lengths ``[max_seqs]``, page_indices, cu_q_lens ``[max_seqs + 1]``, num_seqs ``[1]``)
    and a quantized pool's scales (0-d float32) are always arguments. Forward only."""

    q: tuple[int, ...]
    pool: tuple[int, ...]
    table: tuple[int, ...]
    dtype: str
    causal: bool
    scale: float | None
    window: tuple | None = None
    softcap: float | None = None
    sinks: bool = False
    pool_dtype: str | None = None  # None: q's dtype; else a quantized pool's ("float8_e4m3fn", "int8"), with scales

    contract = "ragged"

    vjp_order: ClassVar[int] = 0  # forward only

    def bind(self, fn):
        """``fn`` as the program exports it: positional ``abstract_args``, this call's static arguments bound."""
        def call(q, k_pages, v_pages, lengths, table, cu_q_lens, num_seqs, *extra):
            return fn(q, k_pages, v_pages, kv_lengths=lengths, page_indices=table, cu_q_lens=cu_q_lens,
                      num_seqs=num_seqs, causal=self.causal, scale=self.scale, **self.feature_kwargs(extra))
        return call

    @staticmethod
    def mismatch(params) -> str | None:
        """Why a function with these parameters is no ragged kernel (it takes no ``cu_q_lens``), or None."""
        if "cu_q_lens" not in params:
            return ("--ragged: the candidate takes no cu_q_lens, so it is not a ragged kernel "
                    "(ragged_paged_attention(q, k_pages, v_pages, *, kv_lengths, page_indices, cu_q_lens, num_seqs, "
                    "...))")
        return None

    @classmethod
    def of_call(cls, q, k_pages, v_pages, *, kv_lengths, page_indices, cu_q_lens, num_seqs, causal=True, scale=None,
                window_size=None, softcap=None, sinks=None, k_scale=None, v_scale=None) -> "RaggedSignature":
        pools = {str(np.dtype(x.dtype)) for x in (k_pages, v_pages)}
        if len(pools) != 1 or tuple(k_pages.shape) != tuple(v_pages.shape) or (k_scale is None) != (v_scale is None):
            raise ProgramRefused(f"k_pages and v_pages have dtypes {sorted(pools)} and shapes {tuple(k_pages.shape)}, "
                                 f"{tuple(v_pages.shape)}; k_scale and v_scale go together")
        dtype, pool = str(np.dtype(q.dtype)), pools.pop()
        return cls(tuple(map(int, q.shape)), tuple(map(int, k_pages.shape)), tuple(map(int, page_indices.shape)),
                   dtype, bool(causal), None if scale is None else float(scale),
                   None if window_size is None else tuple(None if x is None else int(x) for x in window_size),
                   None if softcap is None else float(softcap), sinks is not None,
                   None if k_scale is None and pool == dtype else pool)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RaggedSignature":
        window = d.get("window")
        return cls(tuple(d["q"]), tuple(d["pool"]), tuple(d["table"]), str(d["dtype"]), bool(d["causal"]),
                   None if d["scale"] is None else float(d["scale"]),
                   None if window is None else tuple(None if x is None else int(x) for x in window),
                   None if d.get("softcap") is None else float(d["softcap"]), bool(d.get("sinks", False)),
                   d.get("pool_dtype"))

    def to_dict(self) -> dict[str, Any]:
        """``contract: "ragged"`` and the base fields; a feature's field only when the call uses it."""
        d = {"contract": self.contract, **asdict(self), "q": list(self.q), "pool": list(self.pool),
             "table": list(self.table)}
        return _unset_features_dropped(d, {"window": None, "softcap": None, "sinks": False, "pool_dtype": None})

    @property
    def key(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def abstract_args(self) -> tuple:
        """``q, k_pages, v_pages, kv_lengths, page_indices, cu_q_lens, num_seqs[, sinks][, k_scale, v_scale]`` as
        shape-dtype structs."""
        import jax
        import jax.numpy as jnp

        dtype, max_seqs = jnp.dtype(self.dtype), self.table[0]
        pool = jnp.dtype(self.pool_dtype or self.dtype)
        args = (jax.ShapeDtypeStruct(self.q, dtype), jax.ShapeDtypeStruct(self.pool, pool),
                jax.ShapeDtypeStruct(self.pool, pool), jax.ShapeDtypeStruct((max_seqs,), jnp.int32),
                jax.ShapeDtypeStruct(self.table, jnp.int32), jax.ShapeDtypeStruct((max_seqs + 1,), jnp.int32),
                jax.ShapeDtypeStruct((1,), jnp.int32))
        args += (jax.ShapeDtypeStruct((self.q[1],), jnp.float32),) if self.sinks else ()
        return args + ((jax.ShapeDtypeStruct((), jnp.float32),) * 2 if self.pool_dtype else ())

    def feature_kwargs(self, extra: tuple) -> dict[str, Any]:
        """The feature keyword arguments of a call, ``extra`` being the arrays after ``num_seqs``."""
        kw = _static_feature_kwargs(self.window, self.softcap)
        extra = list(extra)
        if self.sinks:
            kw["sinks"] = extra.pop(0)
        if self.pool_dtype:
            kw.update(zip(_SCALES, extra))
        return kw

    def describe(self) -> str:
        more = "".join(f" {n}={x}" for n, x in (("window_size", self.window), ("softcap", self.softcap),
                                                 ("pool", self.pool_dtype)) if x is not None)
        return (f"ragged q{list(self.q)} pool{list(self.pool)} table{list(self.table)} {self.dtype} "
                f"causal={self.causal} scale={self.scale}{more}" + " sinks" * self.sinks)


class ProgramRaggedAttention(Programs):
    """The ragged contract on top of stored programs: each call dispatched by its :class:`RaggedSignature`."""

    def __call__(self, q, k_pages, v_pages, *, kv_lengths, page_indices, cu_q_lens, num_seqs, scale=None, causal=True,
                 window_size=None, softcap=None, sinks=None, k_scale=None, v_scale=None):
        import jax.numpy as jnp

        sig = RaggedSignature.of_call(q, k_pages, v_pages, kv_lengths=kv_lengths, page_indices=page_indices,
                                      cu_q_lens=cu_q_lens, num_seqs=num_seqs, causal=causal, scale=scale,
                                      window_size=window_size, softcap=softcap, sinks=sinks, k_scale=k_scale,
                                      v_scale=v_scale)
        args = [q, k_pages, v_pages, *(jnp.asarray(x, jnp.int32) for x in (kv_lengths, page_indices, cu_q_lens,
                                                                           num_seqs))]
        args += [jnp.asarray(sinks, jnp.float32)] if sig.sinks else []
        args += [jnp.asarray(x, jnp.float32) for x in (k_scale, v_scale)] if sig.pool_dtype else []
        return self.program(sig).call(*args)
