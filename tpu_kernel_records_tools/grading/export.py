"""A submitted kernel as programs: exported in its sandbox, checked, graded and timed as bytes.

A submitter's Python runs in one place only: a sandboxed worker (``grading.sandbox``, bubblewrap for a
file or module, as the rubric's ``auto``), which loads the candidate and, per call :class:`Signature`,
exports ``jax.jit(lambda q, k, v[, lengths][, segment ids][, sinks]: fn(q, k, v, causal=.., kv_lengths=..,
scale=..[, the features it uses]))`` with
``jax.export`` for the target platform, from ``jax.ShapeDtypeStruct``s only (it never sees a value or
the seed), and answers with ``Exported.serialize(vjp_order=1)``: the forward and its VJP, so the
program supports ``jax.grad``/``jax.vjp``. Its failures, hangs and exits become one-line errors.

The measuring process only deserializes those bytes (:func:`load_program`): a program whose StableHLO
(forward or VJP) calls a ``custom_call`` outside :data:`ALLOWED_CUSTOM_CALLS` (the Pallas lowerings,
Mosaic TPU and Triton/Mosaic GPU, and JAX's own sharding markers), has side effects (every host
callback has), or does not take and return the signature's shapes is refused with one line
(:class:`ProgramRefused`). :class:`ProgramAttention` is the contract on top of stored programs,
dispatching by signature: what the rubric grades and what the benchmark times are those bytes.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np

# custom_call targets a program may use: Pallas' kernel lowerings and JAX's own markers.
ALLOWED_CUSTOM_CALLS = frozenset({
    "tpu_custom_call",                                     # Pallas on TPU (Mosaic)
    "triton_kernel_call", "__gpu$xla.gpu.triton",          # Pallas on GPU (Triton)
    "mosaic_gpu", "mosaic_gpu_v2",                         # Pallas on GPU (Mosaic GPU)
    "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape", "shape_assertion",
})
# A target is printed bare (@name) or, where it is not an identifier, quoted (@"a b", escapes \\ and \XX).
_CUSTOM_CALL = re.compile(r'custom_call\s*@(?:"([^"]*)"|([\w$.\-]+))|call_target_name\s*=\s*"([^"]*)"')
_ESCAPE = re.compile(r'\\(\\|[0-9a-fA-F]{2})')
EXPORT_LIMIT_S = 600.0         # the exporter's whole budget (worker start excluded)
PROGRAM_LIMIT_BYTES = 256 << 20  # all serialized programs of one export together


class ProgramRefused(ValueError):
    """A submitted program (or its export) that cannot be graded or timed; one line says why."""




def _static_feature_kwargs(window, softcap) -> dict[str, Any]:
    """``window_size`` and ``softcap`` as a call passes them, each only when set."""
    kw: dict[str, Any] = {}
    if window is not None:
        kw["window_size"] = window
    if softcap is not None:
        kw["softcap"] = softcap
    return kw

def _unset_features_dropped(d: dict[str, Any], unset: dict[str, Any]) -> dict[str, Any]:
    """``d`` with ``window`` as a list and each feature field that holds its unset value left out (so a call
    without features keys as it did before features existed, and older runs' programs keep their keys)."""
    d["window"] = None if d["window"] is None else list(d["window"])
    return {name: value for name, value in d.items() if name not in unset or value != unset[name]}

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


def signature_from_dict(d: dict[str, Any]) -> Signature | PagedSignature:
    """The signature a dict describes: paged where it says ``contract: "paged"``, else dense."""
    return PagedSignature.from_dict(d) if d.get("contract") == "paged" else Signature.from_dict(d)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --- the worker's side (runs beside the submitter's code, in its sandbox) ---------------------------

def export_programs(fn, signatures: list[dict], platform: str) -> tuple[dict, list]:
    """The worker's ``export`` op: each signature's serialized program as a uint8 array, or the first
    failure as ``{"ok": False, "error": ...}``."""
    import jax
    import jax.export  # noqa: F401 - not an attribute of jax 0.6.2 until imported

    out = []
    sigs = [signature_from_dict(raw) for raw in signatures]
    mismatch = _contract_mismatch(fn, paged=any(isinstance(s, PagedSignature) for s in sigs))
    if mismatch:
        return {"ok": False, "error": mismatch}, []
    for sig in sigs:
        kwargs = {"causal": sig.causal, "scale": sig.scale}
        if isinstance(sig, PagedSignature):
            def call(q, k_pages, v_pages, lengths, table, *extra, sig=sig, kwargs=kwargs):
                return fn(q, k_pages, v_pages, kv_lengths=lengths, page_indices=table, **kwargs,
                          **sig.feature_kwargs(extra))
        else:
            def call(q, k, v, *extra, sig=sig, kwargs=kwargs):
                lengths, extra = (extra[0], extra[1:]) if sig.has_lengths else (None, extra)
                return fn(q, k, v, kv_lengths=lengths, **kwargs, **sig.feature_kwargs(extra))
        try:
            exported = jax.export.export(jax.jit(call), platforms=(platform,))(*sig.abstract_args())
            # the paged contract is forward only (and its integer table has no cotangent)
            data = exported.serialize(vjp_order=0 if isinstance(sig, PagedSignature) else 1)
        except BaseException as e:  # noqa: BLE001 - the candidate's failure, reported in one line
            text = (str(e).strip().splitlines() or [""])[0][:300]
            return {"ok": False, "error": f"exporting {sig.describe()}: {type(e).__name__}: {text}"}, []
        out.append(np.frombuffer(bytes(data), np.uint8))
    return {"ok": True}, out


def _contract_mismatch(fn, *, paged: bool) -> str | None:
    """Why ``fn`` cannot follow the contract asked for, read from its parameters (a paged kernel takes
    ``page_indices``, a dense one does not), as one line; None when it may (or cannot be told)."""
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    takes_pages = "page_indices" in params
    if paged and not takes_pages:
        return ("--paged: the candidate takes no page_indices, so it is not a paged kernel "
                "(paged_attention(q, k_pages, v_pages, *, kv_lengths, page_indices, ...)); measure a dense "
                "kernel without --paged")
    if not paged and takes_pages:
        return ("the candidate takes page_indices: a paged kernel (kernel_src.contract.paged_attention) is "
                "measured with --paged")
    return None


# --- the measuring process's side (the sandboxed export itself: grading.exporter) -----------------

def _one_line(text: str, limit: int = 400) -> str:
    text = "".join(ch if ch.isprintable() else " " for ch in text).strip()
    return text[:limit]


def custom_calls(mlir_text: str) -> set[str]:
    """Every ``custom_call`` target named in a StableHLO module's text."""
    return {_ESCAPE.sub(lambda m: "\\" if m[1] == "\\" else chr(int(m[1], 16)), a or b or c)
            for a, b, c in _CUSTOM_CALL.findall(mlir_text)}


def load_program(data: bytes, sig: Signature, platform: str):
    """Deserialize one program and check it (see module doc); returns the ``jax.export.Exported``."""
    import jax
    import jax.export  # noqa: F401 - not an attribute of jax 0.6.2 until imported

    try:
        exported = jax.export.deserialize(bytearray(data))
    except Exception as e:  # noqa: BLE001 - untrusted bytes
        raise ProgramRefused(f"program for {sig.describe()} does not deserialize ({type(e).__name__})") from None
    if tuple(exported.platforms) != (platform,):
        raise ProgramRefused(f"program for {sig.describe()} targets {list(exported.platforms)}, not [{platform!r}]")
    if exported.nr_devices != 1:
        raise ProgramRefused(f"program for {sig.describe()} runs on {exported.nr_devices} devices, not 1")
    wanted = [(tuple(a.shape), str(a.dtype)) for a in sig.abstract_args()]
    got = [(tuple(a.shape), str(a.dtype)) for a in exported.in_avals]
    out = [(tuple(a.shape), str(a.dtype)) for a in exported.out_avals]
    if got != wanted or out != [(sig.q, sig.dtype)]:
        raise ProgramRefused(f"program for {sig.describe()} takes {got} and returns {out}, not the signature's")
    parts = [("forward", exported)]
    if exported.has_vjp():
        parts.append(("VJP", exported.vjp()))
    for what, part in parts:
        if part.ordered_effects or part.unordered_effects:
            raise ProgramRefused(f"program for {sig.describe()}: its {what} has side effects "
                                 f"({[str(e) for e in (*part.ordered_effects, *part.unordered_effects)][:3]}), "
                                 f"as host callbacks do")
        bad = sorted(custom_calls(part.mlir_module()) - ALLOWED_CUSTOM_CALLS)
        if bad:
            raise ProgramRefused(f"program for {sig.describe()}: its {what} calls custom_call {bad[:3]}, which "
                                 f"is neither a Pallas kernel nor JAX's own (host callbacks are refused)")
    return exported


class ProgramAttention:
    """The contract on top of stored programs: picklable (a folder and the hash per signature), it reads
    and checks each program on first use and dispatches each call by its :class:`Signature`. A call
    with no program is an error: it fails the rubric's check that made it."""

    def __init__(self, folder: str, table: dict[str, str], platform: str, features: tuple[str, ...] = ()):
        self.folder, self.table, self.platform = str(folder), dict(table), platform
        self.features = tuple(features)  # what the submission declared (the rubric grades these too)
        self._loaded: dict[str, Any] = {}
        self.used: set[str] = set()

    def __getstate__(self):
        return {"folder": self.folder, "table": self.table, "platform": self.platform, "features": self.features}

    def __setstate__(self, state):
        self.__init__(state["folder"], state["table"], state["platform"], state.get("features", ()))

    def program(self, sig: "Signature | PagedSignature"):
        digest = self.table.get(sig.key)
        if digest is None:
            raise ProgramRefused(f"no exported program for the call {sig.describe()}")
        if digest not in self._loaded:
            data = (Path(self.folder) / program_path(digest)).read_bytes()
            if sha256(data) != digest:
                raise ProgramRefused(f"program {digest[:12]} changed on disk")
            self._loaded[digest] = load_program(data, sig, self.platform)
        self.used.add(digest)
        return self._loaded[digest]

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


class ProgramPagedAttention(ProgramAttention):
    """:class:`ProgramAttention` for the paged contract: each call dispatched by its :class:`PagedSignature`."""

    def __call__(self, q, k_pages, v_pages, *, kv_lengths, page_indices, scale=None, causal=True, window_size=None,
                 softcap=None, sinks=None):
        import jax.numpy as jnp

        sig = PagedSignature.of_call(q, k_pages, v_pages, kv_lengths=kv_lengths, page_indices=page_indices,
                                     causal=causal, scale=scale, window_size=window_size, softcap=softcap, sinks=sinks)
        args = (q, k_pages, v_pages, jnp.asarray(kv_lengths, jnp.int32), jnp.asarray(page_indices, jnp.int32))
        return self.program(sig).call(*args, *((jnp.asarray(sinks, jnp.float32),) if sig.sinks else ()))


def program_path(digest: str) -> str:
    """Where a program lives in a run folder (and in the folder ``ProgramAttention`` reads)."""
    return f"programs/{digest}.jaxexport"
