"""What makes a grade faster without changing a verdict: XLA:CPU's classic fusion emitters and one LLVM module per
program for the reference's programs and a full-level worker (``grading.candidates.CPU_COMPILE_OPTIONS``: the same
bits, less compile time), a seed's problems built and queued ahead while the worker starts
(``grading.dense.checks.plan_ahead``), no truth or baseline for the problems no check judges, and random values
drawn only where a check changes them. The figures are ``scripts/time_rubric.py``'s, in CHANGELOG.md."""

from __future__ import annotations

import functools
import os
import queue
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpu_kernel_records_tools.grading.dense import checks as C
from tpu_kernel_records_tools.grading.dense import problems as problems_module
from tpu_kernel_records_tools.grading import candidates
from tpu_kernel_records_tools.sandbox import worker
from tpu_kernel_records_tools.grading.candidates import CPU_COMPILE_OPTIONS
from tpu_kernel_records_tools.sandbox.cpu_jit import worker_compile_options
from tpu_kernel_records_tools.grading.dense.known_bad import reference
from tpu_kernel_records_tools.grading.dense.problems import _reference_vjp, normal
from tpu_kernel_records_tools.grading.runner import Runner
from kernel_src.contract import Dims
from tests.grading_inprocess import grade

FLAG = "--xla_cpu_use_fusion_emitters=false"
LEVEL_AND_SPLIT = "--xla_backend_optimization_level=3 --xla_cpu_parallel_codegen_split_count=1"
# JAX's default emitters and XLA's default level, named: the test session's own programs compile under other ones
# (tests/conftest.py)
JAX_DEFAULTS = {"xla_cpu_use_fusion_emitters": True, "xla_backend_optimization_level": 3}


def _same_bits_under_the_options(p, features=None):
    """The reference's output and gradients on problem ``p``: the same bits compiled plainly and under the options."""
    features = {n: jnp.asarray(x) if isinstance(x, np.ndarray) else x for n, x in (features or {}).items()}

    def vjp(q, k, v, ct, lengths, **static):
        out, pull = jax.vjp(lambda q, k, v: reference(q, k, v, kv_lengths=lengths, **static, **features), q, k, v)
        return (out, *pull(ct))

    static = dict(causal=p.causal, scale=p.scale)
    args = (p.q, p.k, p.v, p.ct, p.kv_lengths)
    plain = jax.jit(functools.partial(vjp, **static), compiler_options=JAX_DEFAULTS)(*args)
    for options in (CPU_COMPILE_OPTIONS, worker_compile_options("full")):  # the grader's, a full-level worker's
        fast = jax.jit(functools.partial(vjp, **static), compiler_options=options)(*args)
        for a, b in zip(plain, fast):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), options


@pytest.mark.parametrize("dtype,causal,lengths", [("bfloat16", True, True), ("float32", False, False)])
def test_the_cpu_compile_options_give_the_reference_the_same_bits(dtype, causal, lengths):
    p = normal(np.random.default_rng(3), Dims(3, 40, 200, 8, 2, 80), dtype, causal=causal, lengths=lengths,
               grad=True)
    _same_bits_under_the_options(p)


def test_the_default_run_compiles_its_own_programs_at_level_0_and_the_graders_at_3(request):
    """tests/conftest.py: the default run (slow tests left out) compiles at LLVM's level 0 what names no level; the
    grader's programs name theirs. Seen in the bits of a float32 program that the level rounds differently."""
    if "--xla_cpu_use_fusion_emitters=" in os.environ.get("XLA_FLAGS", "") or \
            "--xla_backend_optimization_level=" in os.environ.get("XLA_FLAGS", ""):
        pytest.skip("XLA_FLAGS choose the session's emitters or level (tests/conftest.py leaves them)")
    p = normal(np.random.default_rng(3), Dims(3, 40, 200, 8, 2, 80), "float32", grad=True)

    def run(options):
        def grads(q, k, v, ct):
            return jax.vjp(lambda q, k, v: reference(q, k, v), q, k, v)[1](ct)
        return b"".join(np.asarray(x).tobytes() for x in jax.jit(grads, compiler_options=options)(p.q, p.k, p.v, p.ct))

    unnamed, level_0, level_3 = (run({"xla_cpu_use_fusion_emitters": False, **extra})
                                 for extra in ({}, {"xla_backend_optimization_level": 0},
                                               {"xla_backend_optimization_level": 3}))
    assert level_0 != level_3 and run(CPU_COMPILE_OPTIONS) == level_3
    assert unnamed == (level_0 if request.config.getoption("markexpr") == "not slow" else level_3)


def test_the_cpu_compile_options_give_the_reference_the_same_bits_with_every_feature():
    rng = np.random.default_rng(6)
    p = normal(rng, Dims(2, 24, 96, 4, 2, 64), "bfloat16", causal=True, lengths=True, grad=True)
    segments = np.sort(rng.integers(0, 3, (2, 96)), axis=1).astype(np.int32)
    _same_bits_under_the_options(p, dict(window_size=(17, 3), softcap=20.0, sinks=rng.normal(size=4).astype(np.float32),
                                         q_segment_ids=segments[:, -24:], kv_segment_ids=segments))


def test_a_worker_gets_the_faster_compile_at_the_quick_level_only():
    assert CPU_COMPILE_OPTIONS == {"xla_cpu_use_fusion_emitters": False,  # the grader's own programs'
                                   "xla_backend_optimization_level": 3, "xla_cpu_parallel_codegen_split_count": 1}
    assert worker_compile_options("quick") == {"xla_cpu_use_fusion_emitters": False,  # XLA's split kept
                                               "xla_backend_optimization_level": 0}
    assert worker_compile_options("full") == CPU_COMPILE_OPTIONS


def test_the_grader_compiles_under_the_options_on_a_cpu_and_still_composes():
    assert candidates.cpu_compile_options() == (CPU_COMPILE_OPTIONS if jax.default_backend() == "cpu" else {})
    p = normal(np.random.default_rng(4), Dims(2, 24, 72, 4, 2, 32), "float32", causal=True, grad=True)
    top = reference(p.q, p.k, p.v, causal=True)
    inside_jit = jax.jit(functools.partial(reference, causal=True))(p.q, p.k, p.v)  # a nested program
    out, pull = jax.vjp(lambda q, k, v: reference(q, k, v, causal=True), p.q, p.k, p.v)
    grads = _reference_vjp(p.q, p.k, p.v, p.ct, None, causal=True, scale=None)
    assert np.array_equal(top, inside_jit) and np.array_equal(top, out) and np.array_equal(top, grads[0])
    assert all(np.array_equal(a, b) for a, b in zip(pull(p.ct), grads[1:]))


def test_the_worker_adds_the_options_to_xla_flags_once(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    worker._add_xla_flags(CPU_COMPILE_OPTIONS)
    worker._add_xla_flags(CPU_COMPILE_OPTIONS)
    assert os.environ["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=2 {FLAG} {LEVEL_AND_SPLIT}"
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_fusion_emitters=true")  # the user's choice stands
    worker._add_xla_flags(CPU_COMPILE_OPTIONS)
    assert os.environ["XLA_FLAGS"] == f"--xla_cpu_use_fusion_emitters=true {LEVEL_AND_SPLIT}"
    monkeypatch.delenv("XLA_FLAGS")
    worker._add_xla_flags(CPU_COMPILE_OPTIONS)
    assert os.environ["XLA_FLAGS"] == f"{FLAG} {LEVEL_AND_SPLIT}"


CANDIDATE = '''
import os
from kernel_src.reference import reference_attention

def attention(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    if "{flag}" not in os.environ.get("XLA_FLAGS", ""):
        raise RuntimeError("compiled without the grader's CPU options: " + os.environ.get("XLA_FLAGS", ""))
    if ("--xla_backend_optimization_level=0" in os.environ["XLA_FLAGS"]) != {quick}:
        raise RuntimeError("the optimization level is not the one of the level: " + os.environ["XLA_FLAGS"])
    return reference_attention(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale)
'''


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the options are for a CPU only")
@pytest.mark.parametrize("level", ["quick", "full"])
def test_a_cpu_grade_starts_its_worker_with_the_options_of_its_level(tmp_path, level):
    path = tmp_path / "flags.py"
    path.write_text(CANDIDATE.format(flag=FLAG, quick=level == "quick"))
    runner = Runner(f"{path}:attention", isolation="process", time_limit_s=120, level=level)
    try:
        assert runner.start() is None, runner.down
        p = normal(np.random.default_rng(5), Dims(1, 8, 16, 2, 1, 16), "float32")
        assert runner.forward(p).shape == p.q.shape
    finally:
        runner.close()


def test_the_problems_no_check_judges_get_no_truth_or_baseline(monkeypatch):
    seed, unjudged = 9002, ("output-shape-dtype", "determinism")  # no other test grades the seed
    planning = C._Planning(None, seed, level="quick", ahead=False)  # nothing computed on the background threads
    for spec in C.CHECKS:
        if spec.name in (*unjudged, "fresh-inputs"):
            with pytest.raises(C._Planned):  # its problems are built
                spec.run(planning)
    skipped = [p for name in unjudged for p in C._CACHE[(seed, "quick", name)]]
    judged = C._CACHE[(seed, "quick", "fresh-inputs")]
    for p in skipped:
        p.prepare()
    assert len(skipped) == 5 and not any({"truth", "baseline", "grouped_baseline"} & set(vars(p)) for p in skipped)
    assert judged and all(p.judged for p in judged)
    jobs = queue.Queue()  # what compute_ahead queues, with no thread to take it
    monkeypatch.setattr(problems_module, "_JOBS", jobs)
    monkeypatch.setattr(problems_module, "_THREADS", [None] * problems_module.AHEAD_THREADS)
    problems_module.compute_ahead([skipped, judged])
    assert jobs.qsize() == 2 * len(judged)  # a truth and a baseline of each judged problem, nothing else


def test_gqa_mappings_bfloat16_constant_values_get_no_truth_or_baseline():
    """With V constant a bfloat16 output is judged on the kv head it names alone (``checks._mapping_only``), so
    its problem is not judged; a float32 one is judged on accuracy too."""
    seed = 9003  # no other test grades the seed
    planning = C._Planning(None, seed, level="full", ahead=False)
    with pytest.raises(C._Planned):
        next(spec for spec in C.CHECKS if spec.name == "gqa-mapping").run(planning)
    ps = C._CACHE[(seed, "full", "gqa-mapping")]
    const = [p for p in ps if p.label.endswith("V = kv head + 1")]
    assert {p.dtype for p in const} == {"float32", "bfloat16"}
    assert all(p.judged == (p.dtype == "float32") for p in const)
    assert all(p.judged for p in ps if p not in const)


@pytest.mark.slow  # a whole quick scorecard planned ahead: about 18 s
def test_plan_ahead_builds_every_checks_problems_which_the_grade_then_uses():
    seed = 9001  # no other test grades it: its problems are built here
    assert not [k for k in C._CACHE if k[:2] == (seed, "quick")]
    C.plan_ahead(seed, "quick").join(timeout=120)
    planned = {k[2]: v for k, v in C._CACHE.items() if k[:2] == (seed, "quick")}
    assert set(planned) == {spec.name for spec in C.CHECKS}
    assert all(planned.values())
    used = []
    original = C.problems

    def recording(ctx, check, build, **judged):
        used.append(original(ctx, check, build, **judged))
        return used[-1]

    try:
        C.problems = recording
        card = grade("reference", seed=seed, level="quick", features=())  # the base checks' problems
    finally:
        C.problems = original
    assert card.passed, card.failed
    assert len(used) == len(C.CHECKS) and all(any(u is v for v in planned.values()) for u in used)


def test_perturbing_hidden_keys_draws_their_values_only():
    """``_perturb_keys`` draws K and V anew at the hidden keys alone (a long cache's hidden keys are a fraction of
    it), and leaves every other value as it was."""
    p = normal(np.random.default_rng(7), Dims(2, 3, 40, 2, 1, 8), "float32", lengths=np.array([30, 12]))
    hidden = np.arange(40)[None] >= p.lengths[:, None]  # [batch, kv_len]
    drawn = []

    class Counting:  # a Generator whose draws are counted
        def standard_normal(self, size, dtype):
            drawn.append(int(np.prod(size)))
            return np.random.default_rng(1).standard_normal(size, dtype)

    changed = C._perturb_keys(p, Counting(), hidden, "padding changed")
    assert drawn == [int(hidden.sum()) * 8] * 2  # K's values and V's signs at the hidden keys (1 kv head of 8)
    for name in ("k", "v"):
        assert np.array_equal(changed.host(name)[~hidden], p.host(name)[~hidden])
        assert not np.any(changed.host(name)[hidden] == p.host(name)[hidden])
    assert np.all(np.abs(changed.host("v")[hidden] - p.host("v")[hidden]) == 1e4)


@pytest.mark.slow  # a quick-level grade, then its parts one after another: about 40 CPU-s
def test_grade_parts_measures_every_part_of_a_grade():
    """``scripts/grade_parts.py``: each part's CPU-seconds, and their sum with the least wall time on two cores."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "grade_parts.py"
    done = subprocess.run([sys.executable, str(script), "--level", "quick", "--features", "none"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    parts = dict(re.findall(r"^  (.+?) +([\d.]+) CPU-s", done.stdout, re.M))
    named = ["grader start", "problems drawn", "float64 truths", "reference's baselines", "worker start",
             "candidate's calls"]
    assert list(parts) == [*named, "in all"] and all(float(parts[n]) > 0 for n in named)
    assert abs(sum(float(parts[n]) for n in named) - float(parts["in all"])) < 0.04  # each printed to 0.01
    least = float(re.search(r"at least ([\d.]+) s on 2 cores", done.stdout)[1])
    assert abs(least - float(parts["in all"]) / 2) < 0.1
    assert re.search(r"level=quick features=none seed=0: (\d+) problems judged, (\d+) calls", done.stdout)
