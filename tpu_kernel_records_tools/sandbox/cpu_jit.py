"""``jit_cpu``: ``jax.jit`` with XLA:CPU's faster-compiling options where JAX computes on a CPU.

The grader's own programs (the reference's baselines) and the built-in candidates compile through it; a
worker on a CPU gets the same options through ``XLA_FLAGS`` (``sandbox.worker``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

# XLA:CPU's classic fusion emitters instead of its default MLIR ones (about 60% of the compile time), and one LLVM
# module per program instead of XLA's split into parts compiled in parallel (each part repeats work: a third less
# compile CPU again, eight of the reference's gradient programs 4.5 -> 3.0 CPU-s, and a grade keeps both cores of a
# 2-core machine busy without the parts): the same bits on the reference's programs as JAX's defaults
# (tests/test_grader_speed.py compares them), and a grade on a CPU is mostly compiling (every shape a check draws is
# a new program, for the reference's baseline and the candidate alike). Applied to the grader's own programs
# (``jit_cpu``) and, through XLA_FLAGS, to a full-level worker on a CPU (``sandbox.worker``); never on an
# accelerator. The optimization level is named, at XLA's default (3), so the reference's baselines keep the bits the
# tolerance was calibrated on whatever level XLA_FLAGS sets for the rest of the process (the test suite's default
# run compiles its own programs at 0: tests/conftest.py).
CPU_COMPILE_OPTIONS = {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 3,
                       "xla_cpu_parallel_codegen_split_count": 1}
# A worker grading at the full level compiles as the grader does.
FULL_WORKER_OPTIONS = dict(CPU_COMPILE_OPTIONS)
# A worker grading at the quick level compiles at LLVM's optimization level 0 the code XLA:CPU emits: small programs,
# so mostly compile time, which it cuts again (``flash`` interpreted, quick level, every feature: its worker took
# 254 -> 85 CPU-s here). Not for the grader's own programs (the reference's float32 programs then round differently,
# and the baselines the tolerance was calibrated on are the classic emitters' bits), nor at the full level (the
# code runs slower: an interpreted kernel's 70k-key decode takes 4.7 -> 18 CPU-s). XLA's split is kept there: one
# module at level 0 changed a few of flash-style's last bits.
QUICK_WORKER_OPTIONS = {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 0}


def worker_compile_options(level: str) -> dict:
    """The XLA:CPU options a worker on a CPU compiles a candidate under at ``level`` ("quick": small programs,
    mostly compile time; "full": model-sized ones, which an interpreted kernel runs for long)."""
    return dict(QUICK_WORKER_OPTIONS if level == "quick" else FULL_WORKER_OPTIONS)


@functools.cache
def cpu_compile_options() -> dict:
    """``CPU_COMPILE_OPTIONS`` where JAX computes on the CPU, else none (initializes JAX's backend)."""
    return dict(CPU_COMPILE_OPTIONS) if jax.default_backend() == "cpu" else {}


def device_array(x: np.ndarray, dtype=None) -> jax.Array:
    """``jnp.asarray(x, dtype)`` of a NumPy array: the same values (NumPy converts on the host, as
    ``jnp.asarray`` does; float64 straight to bfloat16, never through float32) and shape, without the program
    ``jnp.asarray`` compiles for every new shape (``jit(stage)``, and ``jit(convert_element_type)`` when it
    converts): a grade draws dozens of shapes, and each such compile cost a fifth of a CPU-second here."""
    return jax.device_put(np.asarray(x, dtype=None if dtype is None else jnp.dtype(dtype)))


def jit_cpu(fn, **jit_kwargs):
    """``jax.jit(fn, **jit_kwargs)``, compiled under ``cpu_compile_options()`` where it is called on arrays
    (JAX takes compile options only for a top-level program); on tracers (inside another jit, ``jax.vjp``)
    the plain jitted ``fn``, which becomes part of the caller's program. The options are decided at the
    first call: importing this module does not start JAX's backend."""
    plain = jax.jit(fn, **jit_kwargs)
    top = []

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves((args, kwargs))):
            return plain(*args, **kwargs)
        if not top:
            options = cpu_compile_options()
            top.append(jax.jit(fn, compiler_options=options, **jit_kwargs) if options else plain)
        return top[0](*args, **kwargs)

    return call
