"""A submitted kernel as programs: exported in its sandbox, checked, graded and timed as bytes.

A submitter's Python runs in one place only: a sandboxed worker (``grading.sandbox``, bubblewrap for a
file or module, as the rubric's ``auto``), which loads the candidate and, per call :class:`Signature`,
exports ``jax.jit(lambda q, k, v[, lengths]: fn(q, k, v, causal=.., kv_lengths=.., scale=..))`` with
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

    @classmethod
    def of_call(cls, q, k, v, *, causal=False, kv_lengths=None, scale=None) -> "Signature":
        dtypes = {str(np.dtype(x.dtype)) for x in (q, k, v)}
        if len(dtypes) != 1:
            raise ProgramRefused(f"q, k and v have different dtypes {sorted(dtypes)}")
        return cls(tuple(map(int, q.shape)), tuple(map(int, k.shape)), tuple(map(int, v.shape)), dtypes.pop(),
                   bool(causal), kv_lengths is not None, None if scale is None else float(scale))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Signature":
        return cls(tuple(d["q"]), tuple(d["k"]), tuple(d["v"]), str(d["dtype"]), bool(d["causal"]),
                   bool(d["has_lengths"]), None if d["scale"] is None else float(d["scale"]))

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "q": list(self.q), "k": list(self.k), "v": list(self.v)}

    @property
    def key(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def abstract_args(self) -> tuple:
        import jax
        import jax.numpy as jnp

        dtype = jnp.dtype(self.dtype)
        args = tuple(jax.ShapeDtypeStruct(s, dtype) for s in (self.q, self.k, self.v))
        return args + ((jax.ShapeDtypeStruct((self.q[0],), jnp.int32),) if self.has_lengths else ())

    def describe(self) -> str:
        return (f"q{list(self.q)} k{list(self.k)} {self.dtype} causal={self.causal} "
                f"kv_lengths={'yes' if self.has_lengths else 'no'} scale={self.scale}")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --- the worker's side (runs beside the submitter's code, in its sandbox) ---------------------------

def export_programs(fn, signatures: list[dict], platform: str) -> tuple[dict, list]:
    """The worker's ``export`` op: each signature's serialized program as a uint8 array, or the first
    failure as ``{"ok": False, "error": ...}``."""
    import jax
    import jax.export  # noqa: F401 - not an attribute of jax 0.6.2 until imported

    out = []
    for raw in signatures:
        sig = Signature.from_dict(raw)
        kwargs = {"causal": sig.causal, "scale": sig.scale}
        if sig.has_lengths:
            def call(q, k, v, lengths, kwargs=kwargs):
                return fn(q, k, v, kv_lengths=lengths, **kwargs)
        else:
            def call(q, k, v, kwargs=kwargs):
                return fn(q, k, v, kv_lengths=None, **kwargs)
        try:
            exported = jax.export.export(jax.jit(call), platforms=(platform,))(*sig.abstract_args())
            data = exported.serialize(vjp_order=1)
        except BaseException as e:  # noqa: BLE001 - the candidate's failure, reported in one line
            text = (str(e).strip().splitlines() or [""])[0][:300]
            return {"ok": False, "error": f"exporting {sig.describe()}: {type(e).__name__}: {text}"}, []
        out.append(np.frombuffer(bytes(data), np.uint8))
    return {"ok": True}, out


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

    def __init__(self, folder: str, table: dict[str, str], platform: str):
        self.folder, self.table, self.platform = str(folder), dict(table), platform
        self._loaded: dict[str, Any] = {}
        self.used: set[str] = set()

    def __getstate__(self):
        return {"folder": self.folder, "table": self.table, "platform": self.platform}

    def __setstate__(self, state):
        self.__init__(state["folder"], state["table"], state["platform"])

    def program(self, sig: Signature):
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

    def __call__(self, q, k, v, *, causal=False, kv_lengths=None, scale=None):
        import jax.numpy as jnp

        sig = Signature.of_call(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale)
        exported = self.program(sig)
        args = (q, k, v) + ((jnp.asarray(kv_lengths, jnp.int32),) if sig.has_lengths else ())
        return exported.call(*args)


def program_path(digest: str) -> str:
    """Where a program lives in a run folder (and in the folder ``ProgramAttention`` reads)."""
    return f"programs/{digest}.jaxexport"
