"""The ``ragged-long`` check's pool past 2^31 elements (the full level only, where memory allows).

A kernel that reads K and V by int32 element offsets into the flattened pool passes every smaller pool and goes
wrong past 2^31 elements. :func:`spread` moves a small call (:data:`SMALL`, drawn as any other) into a pool of
:data:`PAGES` pages of 16 x 1 x 128 (2^31 + 2^17 elements, 4 GiB of bfloat16 per pool), its pages at indices
past 2^20 (element offsets past 2^31); pages 0-63, where those offsets land once wrapped, hold NaN. The pools are
``np.zeros`` (calloc: the pages nobody writes are never resident), the sandbox sends them without their zero
chunks into zeroed aligned buffers that ``jax.device_put`` aliases (``sandbox.worker``), and the truth and the
baseline are those of the small call, whose keys are the same.

A candidate that declares ``quantized_kv`` gets int8 pools (2 GiB each), the others bfloat16 (4 GiB each).
Measured (``/proc/PID/status`` VmHWM, 2 cores, cgroup-limited worker): the reference on the bfloat16 pools and the
int32-offset kernel of ``tests/ragged_int32_offsets.py`` on the int8 ones peak at 0.35 GiB resident in the grader
and 0.34 GiB in the worker (0.19 GiB before the call; 6-10 GiB of address space each), a call of 3 CPU-s in the
worker; a kernel that widens a bfloat16 pool (XLA:CPU's gather does, in that kernel) needs 16 GiB more. So
:func:`unprobed` asks for :func:`need_bytes` (5 GiB int8, 17 GiB bfloat16) and says why where it is not there.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import psutil

from ...grading.ragged.problems import RaggedProblem, draw, garbage
from ...grading.ragged.slots import RaggedSlot

PAGES = (1 << 20) + 64  # pages of 16 x 1 x 128: 2^31 + 2^17 elements
FIRST_PAST = 1 << 20    # the first page whose element offset is past 2^31
LOW_NAN_PAGES = 64      # pages 0..63 hold NaN: where an offset past 2^31 lands once wrapped to 32 bits
BASE_GIB = 1.0          # GiB beside the pools' copies (measured: well under it, see the module docstring)
JAX_ADDRESS_GIB = 4.0   # GiB of address space a CPU worker holds beside its inputs (where RLIMIT_AS bounds it)
SMALL = RaggedSlot("pool2^31", 8, 4, 2, 1, 128, 16, 3, 12, (3, 0, 1), (40, 7, 33), "bfloat16")


def pool_bytes(quantized: bool = False) -> int:
    """Bytes of one big pool (int8 where ``quantized``, else bfloat16)."""
    return PAGES * SMALL.page_size * SMALL.num_kv_heads * SMALL.head_dim * (1 if quantized else 2)


def spread(small: RaggedProblem, rng: np.random.Generator) -> RaggedProblem:
    """``small`` (a call at :data:`SMALL`) with its pool's pages moved to random pages past :data:`FIRST_PAST` of a
    :data:`PAGES`-page pool (the table re-pointed alike, every other page zero, pages below
    :data:`LOW_NAN_PAGES` NaN); judged by ``small``'s truth and baseline."""
    where = FIRST_PAST + rng.choice(PAGES - FIRST_PAST, small.slot.num_pages, replace=False)
    pools = []
    for x in (small.k_pages, small.v_pages):
        big = np.zeros((PAGES, *x.shape[1:]), x.dtype)
        big[:LOW_NAN_PAGES] = garbage("nan", (LOW_NAN_PAGES, *x.shape[1:]), rng, x.dtype)
        big[where] = x
        pools.append(big)
    holds = np.zeros((PAGES, small.slot.page_size), bool)
    holds[where] = small.holds
    slot = dataclasses.replace(small.slot, num_pages=PAGES)
    p = RaggedProblem(f"{small.label} in a pool of {PAGES} pages (2^31 + 2^17 elements, pages past 2^20)", slot,
                      small.q, *pools, small.lengths, where[small.table].astype(np.int32), small.cu, small.num_seqs,
                      holds, causal=small.causal, scale=small.scale, k_scale=small.k_scale, v_scale=small.v_scale)
    p.truth, p.baseline = small.truth, small.baseline  # (cached properties: the same keys, so the same results)
    return p


def big_problem(rng_of, quantized: bool = False) -> RaggedProblem:
    """The probe: a call at :data:`SMALL` spread into the big pool (``rng_of(trial)``: the check's generators);
    ``quantized``: an int8 pool with scales (for a candidate that declares ``quantized_kv``)."""
    small = draw(rng_of(0), SMALL, tag="keys past 2^31 pool elements", quantized="int8" if quantized else None,
                 value_scales=(0.5, 4.0) if quantized else (1.0, 1.0))
    return spread(small, rng_of(1))


def need_bytes(quantized: bool) -> int:
    """Memory the probe may take, grader and worker together: a copy of both pools (an int8 pool, or a bfloat16
    pool widened to float32, as XLA:CPU does to a bfloat16 gather's operand) and :data:`BASE_GIB` GiB."""
    return 2 * pool_bytes(quantized) * (1 if quantized else 2) + int(BASE_GIB * (1 << 30))


def unprobed(runner, quantized: bool, available_bytes: int | None = None) -> str | None:
    """Why the big pool cannot be sent to ``runner``'s worker here (``not probed: ...``), or None when it can:
    the runner must send zeros as holes (``holes``), :func:`need_bytes` must be available (``psutil``) and fit
    the worker's memory limit (where that bounds the address space, beside both pools and JAX's own)."""
    gib = 1 << 30
    if not getattr(runner, "holes", False):
        return f"not probed: its caller would copy {2 * pool_bytes(quantized) / gib:g} GiB of pools"
    need = need_bytes(quantized)
    available = psutil.virtual_memory().available if available_bytes is None else available_bytes
    if available < need:
        return f"not probed: needs {need / gib:.1f} GiB, {available / gib:.1f} available"
    limit_gb = getattr(runner, "memory_limit_gb", 0) or 0
    if getattr(runner, "memory_limit", None) == "address-space":
        need += 2 * pool_bytes(quantized) + int(JAX_ADDRESS_GIB * gib)
    if limit_gb and limit_gb * gib < need:
        return f"not probed: the worker needs {need / gib:.1f} GiB, its memory limit is {limit_gb:g} GiB"
    return None
