"""The grader compiles only the programs it computes with (issue 50): ``jnp.asarray`` of a NumPy array compiles a
program per new shape under jax 0.10 (``jit(stage)``, ``jit(convert_element_type)``) and slicing a JAX array one
more (``jit(dynamic_slice)``); a full-level grade drew ~60 of them in the grader and one per call in the worker.
``sandbox.cpu_jit.device_array`` gives the same arrays without them. And what the grader no longer computes
twice: the reference's error on a problem, judged once for all the candidates graded on it."""

from __future__ import annotations

import contextlib
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpu_kernel_records_tools.grading.dense.problems import normal
from tpu_kernel_records_tools.grading.serve import AttentionServer
from tpu_kernel_records_tools.sandbox.cpu_jit import device_array
from kernel_src.contract import Dims


@contextlib.contextmanager
def compiled():
    """The names of the programs XLA compiles inside the block (``jit(name)``), in order."""
    names: list[str] = []

    class Seen(logging.Handler):
        def emit(self, record):
            text = record.getMessage()
            if text.startswith("Finished XLA compilation of "):
                names.append(text.split()[4])

    seen, logger = Seen(), logging.getLogger("jax")
    level = logger.level
    logger.addHandler(seen)
    logger.setLevel(logging.DEBUG)
    try:
        with jax.log_compiles(True):
            yield names
    finally:
        logger.removeHandler(seen)
        logger.setLevel(level)


def _bits(x) -> bytes:
    x = np.asarray(x)
    return x.view(f"u{x.itemsize}").tobytes()


@pytest.mark.parametrize("source", [np.float32, np.float64])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_device_array_gives_jnp_asarrays_bits_and_compiles_nothing(source, dtype):
    rng = np.random.default_rng(0)
    ties = (np.arange(1 << 12, dtype=np.uint32) << 15).view(np.float32).astype(np.float64)  # between two bfloat16s
    above = ties * (1 + 2.0 ** -30)  # in float64 just past the tie, in float32 on it: rounded once, straight to bfloat16
    x = np.concatenate([rng.standard_normal(4093) * 30, ties, above]).astype(source).reshape(15, 819)
    want = jnp.asarray(x, dtype)
    with compiled() as names:
        got = device_array(x, dtype)
    assert names == []
    assert isinstance(got, jax.Array) and got.dtype == want.dtype and got.shape == want.shape
    assert _bits(got) == _bits(want)


def test_a_problem_compiles_only_the_references_program():
    rng = np.random.default_rng(1)
    with compiled() as names:  # a shape no other test draws
        p = normal(rng, Dims(3, 11, 173, 6, 2, 40), "bfloat16", causal=True, lengths=True, grad=True)
        p = p.replace(p.label, q_segments=np.zeros((3, 11), np.int32), kv_segments=np.zeros((3, 173), np.int32),
                      sinks=rng.standard_normal(6).astype(np.float32))
        p.prepare()
        p.kwargs  # noqa: B018
    assert names == ["jit(_reference_vjp)"]
    assert p.truth.stored_out_grads is not None and p.grouped_baseline[0].dtype == jnp.bfloat16


def test_the_worker_compiles_only_the_candidates_programs():
    server = AttentionServer()
    assert server.load({"op": "load", "spec": "reference"})["ok"]
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal(s, np.float32).astype(jnp.bfloat16) for s in ((2, 13, 4, 24), (2, 151, 2, 24),
                                                                                 (2, 151, 2, 24)))
    header = {"op": "forward", "causal": True, "scale": None, "has_lengths": True}
    with compiled() as names:
        reply, (out,) = server.call(header, [q, k, v, np.array([151, 77], np.int32)])
    assert reply == {"ok": True, "inputs_modified": []} and out.shape == q.shape
    assert names == ["jit(_reference_fn)"]


def test_the_worker_catches_a_write_into_its_inputs_by_their_bytes():
    import ctypes

    server = AttentionServer()

    def zero_v(q, k, v, **_):
        v.block_until_ready()
        ctypes.memset(v.unsafe_buffer_pointer(), 0x55, 1)  # the lowest byte of v's first value (1.0: 0x00)
        return jnp.zeros(q.shape, q.dtype)

    server.fn = zero_v
    q = np.ones((1, 2, 1, 8), np.float32)
    reply, _ = server.call({"op": "forward", "causal": False, "scale": None}, [q, q.copy(), q.copy()])
    assert reply["inputs_modified"] == ["v"]


def test_the_references_error_is_computed_once_per_problem_and_never_served_stale(monkeypatch):
    from tpu_kernel_records_tools.grading import tolerance

    rng = np.random.default_rng(3)
    truth, base, alt = (rng.standard_normal((4, 64)) for _ in range(3))
    magnitude = np.abs(truth) + 1
    calls = []
    real = tolerance.error
    monkeypatch.setattr(tolerance, "error", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    first = [tolerance.judge("x", truth + 1e-3 * n, truth, base, "float32", gradient=True, magnitude=magnitude,
                             alternatives=(None, alt)) for n in range(3)]
    assert [c is base or c is alt for c in calls] == [True, True, False, False, False]  # once, then candidates only
    assert len({(v.baseline, v.tol_norm, v.tol_worst) for v in first}) == 1
    fresh = base * 2  # a new baseline is judged anew (a stale bound would pass the candidate at 1e-3)
    again = tolerance.judge("x", truth + 1e-3, truth, fresh, "float32", gradient=True, magnitude=magnitude,
                            alternatives=(alt,))
    plain = tolerance.error(fresh, truth, magnitude)
    assert again.baseline.norm == max(plain.norm, tolerance.error(alt, truth, magnitude).norm)


def test_the_truths_float64_copy_of_bfloat16_keeps_every_value():
    from tpu_kernel_records_tools.grading.dense.truth import as_f64

    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(jnp.bfloat16)  # each bfloat16 bit pattern
    finite = every[np.isfinite(every.astype(np.float32))]
    got, want = as_f64(finite.reshape(2, -1)), finite.astype(np.float32).astype(np.float64).reshape(2, -1)
    assert got.dtype == np.float64 and got.tobytes() == want.tobytes()


def test_the_remembered_errors_stay_bounded_with_judges_on_threads(monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from tpu_kernel_records_tools.grading import tolerance

    monkeypatch.setattr(tolerance, "REFERENCE_ERRORS_KEPT", 4)
    rng = np.random.default_rng(4)
    kept = [rng.standard_normal((2, 8)) for _ in range(40)]  # alive throughout: never pruned as dead

    def judged(n):
        truth = kept[n]
        v = tolerance.judge("x", truth, truth, truth + 1e-6, "float32", gradient=False, magnitude=np.abs(truth) + 1)
        return v.ok and v.baseline.norm > 0

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(judged, range(40)))
    assert len(tolerance._REFERENCE_ERRORS) <= 4
