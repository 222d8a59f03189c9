"""The ragged rubric's checks: every known-bad ragged built-in is rejected by its intended check(s) at the quick
level (default run); their shared program with every switch off passes every check at the quick level, and the
correct ones pass and the known-bads are rejected at the full level on seeds 0-2 (slow run).

Trusted built-ins are called in-process here (as ``tests/test_paged_grading.py`` does): the checks and verdicts are
the rubric's (``grading.ragged.checks``); the worker path is the CLI test's (``tests/test_ragged_cli.py``)."""

import jax.numpy as jnp
import numpy as np
import pytest

from tpu_kernel_records_tools.grading.dense import checks as C
from tpu_kernel_records_tools.grading.ragged.checks import RAGGED_CHECKS, RAGGED_FEATURE_CHECKS, ragged_checks_for
from tpu_kernel_records_tools.grading.ragged.known_bad import RAGGED_BUILTIN, RaggedSwitches, _bug
from tpu_kernel_records_tools.grading.candidates import resolve
from kernel_src.contract import RAGGED_FEATURES

BAD = sorted(n for n, c in RAGGED_BUILTIN.items() if c.kind == "known-bad")
CHECK_NAMES = {c.name for c in (*RAGGED_CHECKS, *RAGGED_FEATURE_CHECKS.values())}


class RaggedRunner:
    """``ragged_forward`` like ``grading.runner.Runner``'s, calling the function in this process."""

    def __init__(self, fn):
        self.fn, self.nonfinite, self.returned, self.check = fn, [], 0, ""
        self.features = tuple(getattr(fn, "features", ()))

    def ragged_forward(self, p) -> np.ndarray:
        q, k_pages, v_pages, *rest = ((n, jnp.asarray(x)) for n, x in p.arrays.items())
        try:
            out = np.asarray(self.fn(q[1], k_pages[1], v_pages[1], **dict(rest), **p.static))
        except Exception as e:
            raise C.CandidateFailure(f"{p.label}: raised {type(e).__name__}: {e}") from None
        if out.shape != p.out_shape:
            raise C.CandidateFailure(f"{p.label}: output shape {out.shape}, expected {p.out_shape}")
        return out


def grade(fn, seed: int, level: str, only=None) -> dict[str, C.Outcome]:
    """Check name -> outcome of the ragged checks (``only``: just these) on ``fn``."""
    ctx = C.Context(RaggedRunner(fn), seed, level=level)
    found = {}
    for spec in ragged_checks_for(getattr(fn, "features", ())):
        if only is None or spec.name in only:
            try:
                found[spec.name] = spec.run(ctx)
            except C.CandidateFailure as e:
                found[spec.name] = C.Outcome(False, str(e))
    return found


def test_roster():
    assert len(BAD) >= 12
    for name in BAD:
        cand = RAGGED_BUILTIN[name]
        assert cand.summary and cand.catches and set(cand.catches) <= CHECK_NAMES, name
        assert resolve(name) is cand and cand.contract == "ragged"
    assert {c.kind for c in RAGGED_BUILTIN.values()} >= {"reference", "correct-variant", "known-bad"}
    assert RAGGED_BUILTIN["ragged-reference"].load().features == RAGGED_FEATURES
    assert len(RaggedSwitches._fields) == len(BAD)  # one switch per known-bad


@pytest.fixture(scope="module")
def switches_off():
    """The known-bads' shared program with no bug on, graded on every check at the quick level."""
    return grade(_bug(), 0, "quick")


@pytest.mark.slow  # about 25 CPU-s: the program compiles for every check's problems (the known-bads' for their own)
def test_every_switch_off_is_the_contract(switches_off):
    """(So each known-bad's failure is its bug's.)"""
    assert set(switches_off) == CHECK_NAMES
    assert all(o.passed for o in switches_off.values()), {n: o.detail for n, o in switches_off.items() if not o.passed}


@pytest.mark.parametrize("name", BAD)
def test_known_bad_is_rejected_by_its_check_at_the_quick_level(name):
    cand = RAGGED_BUILTIN[name]
    found = grade(cand.load(), 0, "quick", only=set(cand.catches))
    assert set(found) == set(cand.catches)
    assert not all(o.passed for o in found.values()), (name, {n: o.detail[:200] for n, o in found.items()})


@pytest.mark.slow  # about 120 CPU-s a seed: one test per seed, so the seed's problems and truths are drawn once
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_correct_ones_pass_and_known_bads_are_rejected_by_their_checks_at_the_full_level(seed):
    for name in ["ragged-reference", "ragged-online-rows"]:
        found = grade(RAGGED_BUILTIN[name].load(), seed, "full")
        assert set(found) == CHECK_NAMES
        assert all(o.passed for o in found.values()), (name, {n: o.detail for n, o in found.items() if not o.passed})
    missed = {}
    for name in BAD:
        cand = RAGGED_BUILTIN[name]
        found = grade(cand.load(), seed, "full", only=set(cand.catches))
        if all(o.passed for o in found.values()):
            missed[name] = {n: o.detail[:200] for n, o in found.items()}
    assert not missed, missed
