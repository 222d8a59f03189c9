"""HBM bytes a Pallas TPU kernel's pipeline moves, counted from its grid and BlockSpecs.

XLA sees a Mosaic kernel as a black box: its cost analysis counts only what the kernel's
``pl.CostEstimate`` declares (every operand once, at best). What the kernel moves is decided by
the Pallas TPU pipeline, whose rule this module replays:

* the grid runs in row-major order (last axis fastest);
* an input block is copied HBM -> VMEM at a step whose block index differs from the previous
  step's (the first step always copies); an unchanged index issues no DMA, so a block that never
  changes index is copied once, a block revisited after a different one is copied again, and a
  skipped step whose index map repeats the last block costs nothing;
* an output block is written VMEM -> HBM once per run of equal consecutive indices (when its
  index changes, and at the end);
* a scalar-prefetch operand is copied to SMEM once.

Index maps are evaluated at every grid point with the kernel's scalar-prefetch operands (the
project's kv lengths, splash's mask tables), so the walk needs their values: they are folded
from constants, or given for the program's arguments (``known``). Only the kernels a TPU
compile keeps are counted: a ``cond`` whose branch is known (``lax.platform_dependent``'s
``platform_index`` takes the TPU branch, or a constant) is followed into that branch alone.
Blocks in ``memory_space=ANY`` (manual DMA) are reported, not counted; a small input that is a
constant of the program (``SMALL_CONSTANT``) is counted once. A kernel inside a loop body is
counted once. This is a model of the pipeline, not a measurement.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Sequence

import numpy as np

import jax
import jax.numpy as jnp

_MAX_FOLD_ELEMENTS = 1 << 24  # constant-folded intermediates larger than this stay unknown
# A kernel input whose value is a constant of the program and at most this big (splash's
# q_sequence iota, int32 [seq, 128]) is placed in VMEM by XLA (memory space S(1) in the compiled
# HLO): it is counted once, not once per block copy. The v5e compile keeps it there up to 32k
# keys (16 MiB: the iota is S(1) at the forward kernel and assembled in VMEM, ConcatBitcast S(1),
# for splash's dQ kernel).
SMALL_CONSTANT = 16 << 20


# --- the rule --------------------------------------------------------------------------------

def grid_points(grid: Sequence[int]) -> np.ndarray:
    """``[steps, len(grid)]`` int32 grid indices in the order the pipeline runs them (row-major,
    last axis fastest)."""
    if not grid:
        return np.zeros((1, 0), np.int32)
    mesh = np.meshgrid(*[np.arange(n, dtype=np.int32) for n in grid], indexing="ij")
    return np.stack([m.reshape(-1) for m in mesh], axis=1)


def block_copies(indices: np.ndarray) -> int:
    """Copies of one block: 1 for the first step plus one per step whose ``[steps, ndim]`` block
    index differs from the previous step's (for an output: the write-backs, one per run)."""
    indices = np.asarray(indices)
    if indices.shape[0] == 0:
        return 0
    if indices.ndim == 1:
        indices = indices[:, None]
    return 1 + int(np.any(indices[1:] != indices[:-1], axis=1).sum())


def copies_of(grid: Sequence[int], index_map: Callable[..., Sequence[int]],
              *prefetch: Any) -> int:
    """``block_copies`` of a Python ``index_map(*grid_indices, *prefetch)`` over ``grid``, for
    hand-counted examples: the same rule as ``kernel_traffic`` without tracing a kernel."""
    indices = [tuple(int(i) for i in index_map(*point, *prefetch)) for point in grid_points(grid)]
    return block_copies(np.array(indices, np.int64).reshape(len(indices), -1))


# --- finding the kernels a TPU compile keeps --------------------------------------------------

def _closed(jaxpr):
    from jax._src import core as jax_core
    return jaxpr if isinstance(jaxpr, jax_core.ClosedJaxpr) else jax_core.ClosedJaxpr(jaxpr, ())


def _tpu_branch(platforms) -> int:
    """The branch a TPU lowering takes: the first platform group naming "tpu", else the default."""
    default = None
    for i, names in enumerate(platforms):
        if names is None:
            default = i
        elif "tpu" in [str(p).lower() for p in names]:
            return i
    if default is None:
        raise ValueError(f"no TPU branch among {platforms}")
    return default


def _calls(eqn) -> list[tuple[Any, bool]]:
    """``(closed jaxpr, inputs aligned with eqn.invars)`` of a call-like equation's bodies."""
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        body = eqn.params.get(key)
        if body is not None and (hasattr(body, "eqns") or hasattr(body, "jaxpr")):
            closed = _closed(body)
            return [(closed, len(closed.jaxpr.invars) == len(eqn.invars))]
    from jax._src import core as jax_core
    found = []
    for value in eqn.params.values():
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, (jax_core.ClosedJaxpr, jax_core.Jaxpr)):
                found.append((_closed(item), False))
    return found


def _fold(eqn, values) -> list[Any] | None:
    """The equation evaluated on CPU when every input is known and its outputs are small."""
    if sum(math.prod(getattr(v.aval, "shape", ())) for v in eqn.outvars) > _MAX_FOLD_ELEMENTS:
        return None
    try:
        bound = eqn.primitive.get_bind_params(eqn.params)
        subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
        with jax.default_device(jax.devices("cpu")[0]):
            out = eqn.primitive.bind(*subfuns, *values, **params)
    except Exception:  # noqa: BLE001 - not evaluable here: the outputs stay unknown
        return None
    return list(out) if eqn.primitive.multiple_results else [out]


def _walk(closed, inputs: Sequence[Any], found: list) -> list[Any]:
    """Append ``(pallas_call equation, its input values or None)`` in program order; return the
    values of ``closed``'s outputs that are known."""
    from jax._src import core as jax_core
    env: dict[Any, Any] = dict(zip(closed.jaxpr.constvars, closed.consts))
    env.update((var, val) for var, val in zip(closed.jaxpr.invars, inputs) if val is not None)

    def read(atom):
        return atom.val if isinstance(atom, jax_core.Literal) else env.get(atom)

    for eqn in closed.jaxpr.eqns:
        values = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name == "pallas_call":
            found.append((eqn, values))
            continue
        if name == "platform_index":
            env[eqn.outvars[0]] = np.int32(_tpu_branch(eqn.params["platforms"]))
            continue
        if name == "cond" and values and values[0] is not None:
            branches = eqn.params["branches"]
            taken = branches[int(np.clip(np.asarray(values[0]), 0, len(branches) - 1))]
            outs = _walk(taken, values[1:], found)
        else:
            outs = [None] * len(eqn.outvars)
            for body, aligned in _calls(eqn):
                result = _walk(body, values if aligned else [None] * len(body.jaxpr.invars), found)
                if aligned and len(result) == len(eqn.outvars):
                    outs = result
            if all(v is not None for v in values) and any(o is None for o in outs):
                outs = _fold(eqn, values) or outs
        env.update((var, o) for var, o in zip(eqn.outvars, outs) if o is not None)
    return [read(v) for v in closed.jaxpr.outvars]


def pallas_calls(fn: Callable[..., Any], args: Sequence[Any],
                 known: dict[int, Any] | None = None) -> list[tuple[Any, list[Any]]]:
    """``(pallas_call equation, input values)`` of every kernel a TPU compile of ``fn(*args)``
    keeps; ``known`` gives values to some arguments (by position), e.g. kv lengths."""
    closed = jax.make_jaxpr(fn)(*args)
    inputs = [None] * len(closed.jaxpr.invars)
    for position, value in (known or {}).items():
        inputs[position] = np.asarray(value)
    found: list = []
    _walk(closed, inputs, found)
    return found


# --- one kernel ------------------------------------------------------------------------------

def _array(mapping):
    """The whole array of a block mapping (``array_aval``; ``array_shape_dtype`` in jax < 0.7)."""
    return getattr(mapping, "array_aval", None) or mapping.array_shape_dtype


def _block_bytes(mapping) -> int:
    from jax._src.pallas import core as pallas_core
    size = getattr(pallas_core, "get_block_size", None) or pallas_core._get_block_dim_size
    rows = math.prod(size(d) for d in mapping.block_shape)
    return rows * np.dtype(_array(mapping).dtype).itemsize


def _index_map_indices(mapping, points: np.ndarray, prefetch: Sequence[np.ndarray]) -> np.ndarray:
    """``[steps, ndim]`` block indices of ``mapping`` at every grid point."""
    from jax._src import core as jax_core
    from jax._src.state.discharge import discharge_state
    closed = mapping.index_map_jaxpr
    try:  # jax >= 0.7 takes a closed jaxpr; older ones (jaxpr, consts) and return a pair
        discharged = discharge_state(closed)
        jaxpr, consts = discharged.jaxpr, discharged.consts
    except (TypeError, AttributeError):
        jaxpr, consts = discharge_state(closed.jaxpr, closed.consts)
    outs = len(closed.jaxpr.outvars)

    def one(*grid_index):
        result = jax_core.eval_jaxpr(jaxpr, consts, *grid_index, *prefetch)
        return [jnp.asarray(r, jnp.int32) for r in result[:outs]]

    if outs == 0:
        return np.zeros((points.shape[0], 0), np.int32)
    with jax.default_device(jax.devices("cpu")[0]):
        columns = jax.jit(jax.vmap(one))(*[jnp.asarray(points[:, a]) for a in range(points.shape[1])])
    return np.stack([np.asarray(c) for c in columns], axis=1)


def kernel_record(eqn, values: Sequence[Any]) -> dict[str, Any]:
    """One kernel's modelled traffic: ``name, grid, steps, inputs, outputs`` (each block:
    ``array, block, copies, bytes``), ``read_bytes``, ``write_bytes``, ``bytes``; ``error`` when
    its scalar-prefetch operands are not known (then no bytes)."""
    mapping = eqn.params["grid_mapping"]
    grid = tuple(int(g) for g in mapping.grid)
    dynamic = sum(1 for g in mapping.grid if not isinstance(g, int))
    prefetch = values[dynamic:dynamic + mapping.num_index_operands]
    name = getattr(eqn.params.get("name_and_src_info"), "name", None) or "pallas_call"
    record: dict[str, Any] = dict(name=str(name), grid=list(grid), steps=math.prod(grid),
                                  inputs=[], outputs=[])
    if any(v is None for v in prefetch):
        record.update(error="a scalar-prefetch operand is not known", read_bytes=None,
                      write_bytes=None, bytes=None)
        return record
    prefetch = [np.asarray(v) for v in prefetch]
    for value in prefetch:  # copied to SMEM once, before the first step
        record["inputs"].append(dict(array=f"{value.dtype}{list(value.shape)}", array_bytes=int(value.nbytes),
                                     copies=1, bytes=int(value.nbytes), note="scalar prefetch"))
    points = grid_points(grid)
    for k, bm in enumerate(mapping.block_mappings):
        space = str(getattr(bm.transformed_block_aval, "memory_space", None) or "")
        array = _array(bm)
        array_bytes = math.prod(array.shape) * np.dtype(array.dtype).itemsize
        entry = dict(array=f"{array.dtype}{list(array.shape)}",
                     array_bytes=int(array_bytes))
        value = values[dynamic + mapping.num_index_operands + k] if k < mapping.num_inputs else None
        if "any" in space.lower():
            entry.update(copies=None, bytes=0, note="memory_space ANY: manual DMA, not modelled")
        elif value is not None and array_bytes <= SMALL_CONSTANT:
            entry.update(copies=1, bytes=int(array_bytes),
                         note="a small constant of the program: XLA keeps it in VMEM, read once")
        else:
            copies = block_copies(_index_map_indices(bm, points, prefetch))
            entry.update(copies=copies, bytes=copies * _block_bytes(bm))
        (record["inputs"] if k < mapping.num_inputs else record["outputs"]).append(entry)
    record["read_bytes"] = sum(e["bytes"] for e in record["inputs"])
    record["write_bytes"] = sum(e["bytes"] for e in record["outputs"])
    record["bytes"] = record["read_bytes"] + record["write_bytes"]
    return record


def kernel_traffic(fn: Callable[..., Any], args: Sequence[Any],
                   known: dict[int, Any] | None = None) -> list[dict[str, Any]]:
    """``kernel_record`` of every kernel a TPU compile of ``fn(*args)`` keeps, in program order."""
    return [kernel_record(eqn, values) for eqn, values in pallas_calls(fn, args, known)]


def total_bytes(records: Iterable[dict[str, Any]]) -> int | None:
    """Modelled bytes of all ``records``; ``None`` if any could not be modelled."""
    records = list(records)
    if any(r.get("bytes") is None for r in records):
        return None
    return sum(r["bytes"] for r in records)
