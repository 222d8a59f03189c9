"""A submitted kernel as programs: exported in its sandbox, checked, graded and timed as bytes.

A submitter's Python runs in one place only: a sandboxed worker (``sandbox.sandbox``, bubblewrap for a
file or module, as the rubric's ``auto``), which loads the candidate and, per call signature (its
contract's type: ``grading.dense.signature.Signature``, ``grading.paged.signature.PagedSignature``),
exports ``jax.jit`` of the candidate bound to that call's static arguments (:func:`export_signatures`)
with ``jax.export`` for the target platform, from ``jax.ShapeDtypeStruct``s only (it never sees a value or
the seed), and answers with ``Exported.serialize(vjp_order=...)``: the dense contract's forward and its
VJP, so the program supports ``jax.grad``/``jax.vjp``; the paged contract's forward. Its failures, hangs
and exits become one-line errors.

The measuring process only deserializes those bytes (:func:`load_program`): a program whose StableHLO
(forward or VJP) calls a ``custom_call`` outside :data:`ALLOWED_CUSTOM_CALLS` (the Pallas lowerings,
Mosaic TPU and Triton/Mosaic GPU, and JAX's own sharding markers), has side effects (every host
callback has), or does not take and return the signature's shapes is refused with one line
(:class:`ProgramRefused`). :class:`Programs` is a contract on top of stored programs, dispatching by
signature: what the rubric grades and what the benchmark times are those bytes.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

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

def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --- the worker's side (runs beside the submitter's code, in its sandbox) ---------------------------

def export_signatures(fn, sigs: list, platform: str) -> tuple[dict, list]:
    """The worker's ``export`` op on signatures of one contract (each a contract's signature type:
    ``bind``, ``abstract_args``, ``vjp_order``, ``mismatch``): each one's serialized program as a uint8 array,
    or the first failure as ``{"ok": False, "error": ...}``."""
    import jax
    import jax.export  # noqa: F401 - not an attribute of jax 0.6.2 until imported

    out = []
    mismatch = _contract_mismatch(fn, {type(s) for s in sigs})
    if mismatch:
        return {"ok": False, "error": mismatch}, []
    for sig in sigs:
        try:
            exported = jax.export.export(jax.jit(sig.bind(fn)), platforms=(platform,))(*sig.abstract_args())
            data = exported.serialize(vjp_order=sig.vjp_order)
        except BaseException as e:  # noqa: BLE001 - the candidate's failure, reported in one line
            text = (str(e).strip().splitlines() or [""])[0][:300]
            return {"ok": False, "error": f"exporting {sig.describe()}: {type(e).__name__}: {text}"}, []
        out.append(np.frombuffer(bytes(data), np.uint8))
    return {"ok": True}, out


def _contract_mismatch(fn, signature_types) -> str | None:
    """Why ``fn`` cannot follow the contract of ``signature_types``, read from its parameters (each type's
    ``mismatch``), as one line; None when it may (or cannot be told)."""
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return next(filter(None, (t.mismatch(params) for t in signature_types)), None)


# --- the measuring process's side (the sandboxed export itself: grading.exporter) -----------------

def _one_line(text: str, limit: int = 400) -> str:
    text = "".join(ch if ch.isprintable() else " " for ch in text).strip()
    return text[:limit]


def custom_calls(mlir_text: str) -> set[str]:
    """Every ``custom_call`` target named in a StableHLO module's text."""
    return {_ESCAPE.sub(lambda m: "\\" if m[1] == "\\" else chr(int(m[1], 16)), a or b or c)
            for a, b, c in _CUSTOM_CALL.findall(mlir_text)}


def load_program(data: bytes, sig, platform: str):
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


class Programs:
    """A contract on top of stored programs: picklable (a folder and the hash per signature), it reads
    and checks each program on first use; a contract's subclass (``ProgramAttention``,
    ``ProgramPagedAttention``) is called as its kernel and dispatches each call by its signature. A call
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

    def program(self, sig):
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

def program_path(digest: str) -> str:
    """Where a program lives in a run folder (and in the folder :class:`Programs` reads)."""
    return f"programs/{digest}.jaxexport"
