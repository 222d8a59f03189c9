"""How export describes a call of the dense contract (``kernel_src.contract.attention``), and the contract
on top of its stored programs (``grading.programs``)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import numpy as np

from ...grading.programs import ProgramRefused, Programs, _static_feature_kwargs, _unset_features_dropped


@dataclass(frozen=True)
class Signature:
    """One call of the contract as a program sees it: shapes, dtypes and the static arguments."""

    q: tuple[int, ...]
    k: tuple[int, ...]
    v: tuple[int, ...]
    dtype: str
    causal: bool
    has_lengths: bool
    scale: float | None
    window: tuple | None = None      # the features (kernel_src.contract): static window_size and softcap,
    softcap: float | None = None     # and whether segment ids and sinks are arguments
    segments: bool = False
    sinks: bool = False

    vjp_order: ClassVar[int] = 1  # the forward and its VJP, so the program supports jax.grad / jax.vjp

    def bind(self, fn):
        """``fn`` as the program exports it: positional ``abstract_args``, this call's static arguments bound."""
        def call(q, k, v, *extra):
            lengths, extra = (extra[0], extra[1:]) if self.has_lengths else (None, extra)
            return fn(q, k, v, kv_lengths=lengths, causal=self.causal, scale=self.scale, **self.feature_kwargs(extra))
        return call

    @staticmethod
    def mismatch(params) -> str | None:
        """Why a function with these parameters is no dense kernel (it takes ``page_indices``), or None."""
        if "page_indices" in params:
            return ("the candidate takes page_indices: a paged kernel (kernel_src.contract.paged_attention) is "
                    "measured with --paged")
        return None

    @classmethod
    def of_call(cls, q, k, v, *, causal=False, kv_lengths=None, scale=None, window_size=None, softcap=None,
                q_segment_ids=None, kv_segment_ids=None, sinks=None) -> "Signature":
        dtypes = {str(np.dtype(x.dtype)) for x in (q, k, v)}
        if len(dtypes) != 1:
            raise ProgramRefused(f"q, k and v have different dtypes {sorted(dtypes)}")
        return cls(tuple(map(int, q.shape)), tuple(map(int, k.shape)), tuple(map(int, v.shape)), dtypes.pop(),
                   bool(causal), kv_lengths is not None, None if scale is None else float(scale),
                   None if window_size is None else tuple(None if x is None else int(x) for x in window_size),
                   None if softcap is None else float(softcap), q_segment_ids is not None, sinks is not None)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Signature":
        window = d.get("window")
        return cls(tuple(d["q"]), tuple(d["k"]), tuple(d["v"]), str(d["dtype"]), bool(d["causal"]),
                   bool(d["has_lengths"]), None if d["scale"] is None else float(d["scale"]),
                   None if window is None else tuple(None if x is None else int(x) for x in window),
                   None if d.get("softcap") is None else float(d["softcap"]), bool(d.get("segments", False)),
                   bool(d.get("sinks", False)))

    def to_dict(self) -> dict[str, Any]:
        """The base fields always; a feature's field only when the call uses it (so a base call's key is
        what it was before features existed, and older runs' programs keep their keys)."""
        d = {**asdict(self), "q": list(self.q), "k": list(self.k), "v": list(self.v)}
        return _unset_features_dropped(d, {"window": None, "softcap": None, "segments": False, "sinks": False})

    @property
    def key(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def abstract_args(self) -> tuple:
        """``q, k, v[, kv_lengths][, q_segment_ids, kv_segment_ids][, sinks]`` as shape-dtype structs."""
        import jax
        import jax.numpy as jnp

        dtype = jnp.dtype(self.dtype)
        args = tuple(jax.ShapeDtypeStruct(s, dtype) for s in (self.q, self.k, self.v))
        args += (jax.ShapeDtypeStruct((self.q[0],), jnp.int32),) if self.has_lengths else ()
        if self.segments:
            args += (jax.ShapeDtypeStruct(self.q[:2], jnp.int32), jax.ShapeDtypeStruct(self.k[:2], jnp.int32))
        return args + ((jax.ShapeDtypeStruct((self.q[2],), jnp.float32),) if self.sinks else ())

    def feature_kwargs(self, extra: tuple) -> dict[str, Any]:
        """The feature keyword arguments of a call, ``extra`` being the arrays after q, k, v[, kv_lengths]."""
        kw = _static_feature_kwargs(self.window, self.softcap)
        extra = list(extra)
        if self.segments:
            kw["q_segment_ids"], kw["kv_segment_ids"] = extra.pop(0), extra.pop(0)
        if self.sinks:
            kw["sinks"] = extra.pop(0)
        return kw

    def describe(self) -> str:
        more = "".join(f" {n}={x}" for n, x in (("window_size", self.window), ("softcap", self.softcap))
                       if x is not None)
        more += " segment ids" * self.segments + " sinks" * self.sinks
        return (f"q{list(self.q)} k{list(self.k)} {self.dtype} causal={self.causal} "
                f"kv_lengths={'yes' if self.has_lengths else 'no'} scale={self.scale}{more}")


class ProgramAttention(Programs):
    """The dense contract on top of stored programs: each call dispatched by its :class:`Signature`."""

    def __call__(self, q, k, v, *, causal=False, kv_lengths=None, scale=None, window_size=None, softcap=None,
                 q_segment_ids=None, kv_segment_ids=None, sinks=None):
        import jax.numpy as jnp

        sig = Signature.of_call(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale, window_size=window_size,
                                softcap=softcap, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                                sinks=sinks)
        exported = self.program(sig)
        args = (q, k, v) + ((jnp.asarray(kv_lengths, jnp.int32),) if sig.has_lengths else ())
        if sig.segments:
            args += (jnp.asarray(q_segment_ids, jnp.int32), jnp.asarray(kv_segment_ids, jnp.int32))
        if sig.sinks:
            args += (jnp.asarray(sinks, jnp.float32),)
        return exported.call(*args)
