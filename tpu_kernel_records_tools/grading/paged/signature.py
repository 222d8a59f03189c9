"""How export describes a call of the paged contract (``kernel_src.contract.paged_attention``), and the
contract on top of its stored programs (``grading.programs``)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import numpy as np

from ...grading.programs import ProgramRefused, Programs, _static_feature_kwargs, _unset_features_dropped


@dataclass(frozen=True)
class PagedSignature:
    """One call of the paged contract (``kernel_src.contract.paged_attention``) as a program sees it: the
    shapes of q, of the pool (``k_pages`` and ``v_pages`` alike) and of the page table, the dtype and the
    static arguments; ``kv_lengths`` and ``page_indices`` are always arguments. Forward only."""

    q: tuple[int, ...]
    pool: tuple[int, ...]
    table: tuple[int, ...]
    dtype: str
    causal: bool
    scale: float | None
    window: tuple | None = None
    softcap: float | None = None
    sinks: bool = False

    contract = "paged"

    vjp_order: ClassVar[int] = 0  # the paged contract is forward only (and its integer table has no cotangent)

    def bind(self, fn):
        """``fn`` as the program exports it: positional ``abstract_args``, this call's static arguments bound."""
        def call(q, k_pages, v_pages, lengths, table, *extra):
            return fn(q, k_pages, v_pages, kv_lengths=lengths, page_indices=table, causal=self.causal,
                      scale=self.scale, **self.feature_kwargs(extra))
        return call

    @staticmethod
    def mismatch(params) -> str | None:
        """Why a function with these parameters is no paged kernel (it takes no ``page_indices``), or None."""
        if "page_indices" not in params:
            return ("--paged: the candidate takes no page_indices, so it is not a paged kernel "
                    "(paged_attention(q, k_pages, v_pages, *, kv_lengths, page_indices, ...)); measure a dense "
                    "kernel without --paged")
        return None

    @classmethod
    def of_call(cls, q, k_pages, v_pages, *, kv_lengths, page_indices, causal=True, scale=None, window_size=None,
                softcap=None, sinks=None) -> "PagedSignature":
        dtypes = {str(np.dtype(x.dtype)) for x in (q, k_pages, v_pages)}
        if len(dtypes) != 1 or tuple(k_pages.shape) != tuple(v_pages.shape):
            raise ProgramRefused(f"q, k_pages and v_pages have dtypes {sorted(dtypes)} and pools "
                                 f"{tuple(k_pages.shape)}, {tuple(v_pages.shape)}")
        return cls(tuple(map(int, q.shape)), tuple(map(int, k_pages.shape)), tuple(map(int, page_indices.shape)),
                   dtypes.pop(), bool(causal), None if scale is None else float(scale),
                   None if window_size is None else tuple(None if x is None else int(x) for x in window_size),
                   None if softcap is None else float(softcap), sinks is not None)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PagedSignature":
        window = d.get("window")
        return cls(tuple(d["q"]), tuple(d["pool"]), tuple(d["table"]), str(d["dtype"]), bool(d["causal"]),
                   None if d["scale"] is None else float(d["scale"]),
                   None if window is None else tuple(None if x is None else int(x) for x in window),
                   None if d.get("softcap") is None else float(d["softcap"]), bool(d.get("sinks", False)))

    def to_dict(self) -> dict[str, Any]:
        """``contract: "paged"`` and the base fields; a feature's field only when the call uses it."""
        d = {"contract": self.contract, **asdict(self), "q": list(self.q), "pool": list(self.pool),
             "table": list(self.table)}
        return _unset_features_dropped(d, {"window": None, "softcap": None, "sinks": False})

    @property
    def key(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def abstract_args(self) -> tuple:
        """``q, k_pages, v_pages, kv_lengths, page_indices[, sinks]`` as shape-dtype structs."""
        import jax
        import jax.numpy as jnp

        dtype = jnp.dtype(self.dtype)
        args = (jax.ShapeDtypeStruct(self.q, dtype), jax.ShapeDtypeStruct(self.pool, dtype),
                jax.ShapeDtypeStruct(self.pool, dtype), jax.ShapeDtypeStruct((self.q[0],), jnp.int32),
                jax.ShapeDtypeStruct(self.table, jnp.int32))
        return args + ((jax.ShapeDtypeStruct((self.q[2],), jnp.float32),) if self.sinks else ())

    def feature_kwargs(self, extra: tuple) -> dict[str, Any]:
        """The feature keyword arguments of a call, ``extra`` being the arrays after the page table."""
        kw = _static_feature_kwargs(self.window, self.softcap)
        if self.sinks:
            kw["sinks"] = extra[0]
        return kw

    def describe(self) -> str:
        more = "".join(f" {n}={x}" for n, x in (("window_size", self.window), ("softcap", self.softcap))
                       if x is not None)
        return (f"paged q{list(self.q)} pool{list(self.pool)} table{list(self.table)} {self.dtype} "
                f"causal={self.causal} scale={self.scale}{more}" + " sinks" * self.sinks)


class ProgramPagedAttention(Programs):
    """The paged contract on top of stored programs: each call dispatched by its :class:`PagedSignature`."""

    def __call__(self, q, k_pages, v_pages, *, kv_lengths, page_indices, scale=None, causal=True, window_size=None,
                 softcap=None, sinks=None):
        import jax.numpy as jnp

        sig = PagedSignature.of_call(q, k_pages, v_pages, kv_lengths=kv_lengths, page_indices=page_indices,
                                     causal=causal, scale=scale, window_size=window_size, softcap=softcap, sinks=sinks)
        args = (q, k_pages, v_pages, jnp.asarray(kv_lengths, jnp.int32), jnp.asarray(page_indices, jnp.int32))
        return self.program(sig).call(*args, *((jnp.asarray(sinks, jnp.float32),) if sig.sinks else ()))
