"""Shared fixtures: random attention inputs, strict TPU interpret-mode settings, and the accuracy
check every kernel test uses (the rubric's float64 oracle and tolerance policy, nothing else)."""

from __future__ import annotations

import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpu_kernel_records_tools.grading import tolerance
from tpu_kernel_records_tools.grading.dense.problems import Problem
from kernel_src.backend import reset_tpu_interpret_state, tpu_interpret_params


def _attention_inputs(batch, q_len, kv_len, q_heads, kv_heads, head_dim, dtype=jnp.float32, seed=0):
    """Random ``(q, k, v, do)`` in the contract layout; ``do`` is an fp32 output cotangent."""
    kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (batch, q_len, q_heads, head_dim), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (batch, kv_len, kv_heads, head_dim), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (batch, kv_len, kv_heads, head_dim), jnp.float32).astype(dtype)
    do = jax.random.normal(kd, q.shape, jnp.float32)
    return q, k, v, do


# One JAX compilation cache per test session, empty at its start: the xdist workers, and the grader CLIs
# that tests start, share the programs they compile (most of the default run is compiling the same small
# programs). It lives in a fresh temporary folder that the session removes. Never a graded candidate's: its
# worker's environment is an allow-list (sandbox.sandbox) that leaves these variables out.
SESSION_CACHE = "KERNEL_RECORDS_TEST_JAX_CACHE"  # not TPU_: the worker allow-list passes those


def pytest_configure(config):
    path = os.environ.get(SESSION_CACHE)
    if path is None:  # the controller, or a run without xdist: its workers inherit the folder
        path = tempfile.mkdtemp(prefix="jax-test-cache-")
        os.environ[SESSION_CACHE] = config._jax_test_cache = path
    settings = {"jax_compilation_cache_dir": path, "jax_persistent_cache_min_compile_time_secs": 0,
                "jax_persistent_cache_min_entry_size_bytes": 0}
    # JAX keys a cached program by XLA_FLAGS as they are when it compiles, not as the backend started: the
    # processes tests start, which compile under the user's flags, get a folder of their own
    started = os.path.join(path, "started-processes")
    os.makedirs(started, exist_ok=True)
    for name, value in settings.items():
        jax.config.update(name, value)
        # for the processes tests start (they read it at import)
        os.environ[name.upper()] = started if name == "jax_compilation_cache_dir" else str(value)
    _start_backend(default_run=config.getoption("markexpr") == "not slow")


# The tests' own programs (kernels against the oracle, exported programs, in-process candidates) compile under
# XLA:CPU's classic fusion emitters, as the grader's programs already do (``sandbox.cpu_jit``): about 45% less
# compile time, and the default run is mostly compiling. The default run (slow tests left out) also compiles them
# at LLVM's optimization level 0, as a quick-level worker compiles a candidate: its programs are small, and this
# halves its compile time (the whole default run: about 590 -> 510 CPU-s here). The slow tests keep level 3: they
# run interpreted kernels' long grids, which run several times slower at level 0. The grader's own programs (the
# reference's baselines) name their options, level included (``CPU_COMPILE_OPTIONS``), so they keep the bits the
# tolerance was calibrated on. XLA reads XLA_FLAGS once, when JAX's backend starts, so the flags are set for that
# moment only: the processes tests start (grader CLIs, workers, ``measure``) get the environment as the user has
# it. Tests that compare options name theirs in compiler_options.
CLASSIC_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
DEFAULT_RUN_LEVEL = "--xla_backend_optimization_level=0"


def _start_backend(default_run: bool) -> None:
    given = os.environ.get("XLA_FLAGS")
    if given is not None and "--xla_cpu_use_fusion_emitters=" in given:
        return  # the user's choice stands
    flags = [given or "", CLASSIC_EMITTERS]
    if default_run and "--xla_backend_optimization_level=" not in (given or ""):
        flags.append(DEFAULT_RUN_LEVEL)
    os.environ["XLA_FLAGS"] = " ".join(flags).strip()
    try:
        jax.devices()
    finally:
        if given is None:
            del os.environ["XLA_FLAGS"]
        else:
            os.environ["XLA_FLAGS"] = given


def pytest_unconfigure(config):
    owned = getattr(config, "_jax_test_cache", None)
    if owned is not None:
        shutil.rmtree(owned, ignore_errors=True)


@pytest.fixture(autouse=True)
def _return_compile_memory(request):
    """After each slow test: drop JAX's caches and give freed heap back to the system. A deviceless
    v5e compile can peak at several GB, and without this a worker keeps that high-water mark for
    the rest of the run (one reached 11.5 GB), so two workers could exhaust a 24 GB machine."""
    yield
    if request.node.get_closest_marker("slow") is None:
        return
    import ctypes
    import gc

    jax.clear_caches()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


@pytest.fixture(scope="session")
def honest_submission(tmp_path_factory):
    """One tiny-profile run of the honest submitted kernel ``tests/submitted/pure_jax.py`` (measured once per
    session: exported in bubblewrap, graded at the quick level, timed); its folder. For slow tests only."""
    from pathlib import Path

    from tpu_kernel_records_tools.measure.run import run_submitted

    here = Path(__file__).parent / "submitted"
    return run_submitted(f"{here / 'pure_jax.py'}:attention", "pure-jax", tmp_path_factory.mktemp("submitted") / "pure-jax",
                         profile="tiny", level="quick", progress=False, candidate_dir=here)


@pytest.fixture
def attention_inputs():
    """Factory ``(batch, q_len, kv_len, q_heads, kv_heads, head_dim, dtype=fp32, seed=0) -> (q, k, v, do)``."""
    return _attention_inputs


@pytest.fixture
def tpu_interpret():
    """``pltpu.InterpretParams`` with race detection and NaN-filled memory; skips where JAX lacks it."""
    params = tpu_interpret_params()
    if params is None:
        pytest.skip(f"jax {jax.__version__} has no pltpu.InterpretParams (TPU interpret mode)")
    yield params
    reset_tpu_interpret_state()


def forward_and_grads(attention, q, k, v, do, **kwargs):
    """``(out, dq, dk, dv)`` of one jitted forward + VJP of ``attention(q, k, v, **kwargs)``.

    ``do`` is cast to the output dtype first, so the cotangent is the one the oracle is given.
    """
    @jax.jit
    def run(q, k, v, do):
        out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, **kwargs), q, k, v)
        return (out, *vjp(do.astype(out.dtype)))

    return jax.block_until_ready(run(q, k, v, do))


def assert_accurate(results, q, k, v, do, *, causal=False, kv_lengths=None, scale=None,
                    index=None, only=("out", "dq", "dk", "dv")) -> Problem:
    """Judge a kernel's ``(out, dq, dk, dv)`` exactly as the rubric does; return the problem.

    The inputs become a ``grading.dense.problems.Problem`` (cotangent ``do`` rounded to the input dtype):
    its float64 ``truth`` (``grading.dense.truth``), the reference's ``baseline`` on the same inputs, the
    floor's ``logit_max``, for bf16 groups the ``grouped_baseline`` of dK/dV, and the answer of dQ/dK
    with ``di`` from the stored output (``Truth.stored_out_grads``); each tensor must
    pass ``grading.tolerance.judge`` under them. Rows that see no key must be exact zeros in the
    output and dQ, keys no query sees exact zeros in dK and dV. ``index``: an optional
    ``[batch, ...]`` slice to judge only part of each tensor named in ``only``.
    """
    dtype = jnp.dtype(q.dtype).name
    problem = Problem("kernel", dtype, q, k, v, ct=do, causal=causal, scale=scale,
                      kv_lengths=None if kv_lengths is None else np.asarray(kv_lengths))
    truth = problem.truth
    grouped = problem.grouped_baseline or (None, None)
    stored = truth.stored_out_grads or (None, None)
    part = (lambda x: x) if index is None else (lambda x: None if x is None else np.asarray(x)[index])
    for label, got, want, base, alternative, answer in zip(
            ("out", "dq", "dk", "dv"), results, (truth.out, truth.dq, truth.dk, truth.dv),
            problem.baseline, (None, None, *grouped), (None, *stored, None)):
        if label not in only:
            continue
        assert got.dtype == q.dtype, f"{label} must be in the input dtype, got {got.dtype}"
        verdict = tolerance.judge(label, part(got), part(want), part(base), dtype,
                                  gradient=label != "out", magnitude=part(truth.magnitude[label]),
                                  alternatives=(part(alternative),), answers={tolerance.STORED_OUTPUT: part(answer)},
                                  logit_scale=problem.logit_max)
        assert verdict.ok, verdict.describe()
    if index is None:
        empty_rows = ~truth.visible.any(axis=2)  # [batch, q_len]
        unseen_keys = ~truth.visible.any(axis=1)  # [batch, kv_len]
        for label, got, empty in zip(("out", "dq", "dk", "dv"), results,
                                     (empty_rows, empty_rows, unseen_keys, unseen_keys)):
            if label in only:
                assert not np.any(np.asarray(got)[empty]), f"{label} must be exactly zero there"
    return problem


@pytest.fixture(name="forward_and_grads")
def _forward_and_grads_fixture():
    """``forward_and_grads(attention, q, k, v, do, **kwargs) -> (out, dq, dk, dv)``."""
    return forward_and_grads


@pytest.fixture(name="assert_accurate")
def _assert_accurate_fixture():
    """``assert_accurate(results, q, k, v, do, *, causal, kv_lengths, scale, index, only) -> Problem``."""
    return assert_accurate
