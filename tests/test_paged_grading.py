"""The paged level's checks: every known-bad paged built-in is rejected by its intended check(s) and the
correct ones pass, at the quick level (default run) and the full level on seeds 0-2 (slow).

Trusted built-ins are called in-process here (as ``tests/grading_inprocess.py`` does for the dense checks):
the checks and verdicts are the rubric's (``grading.paged.checks``); the worker path is the CLI test's."""

import jax.numpy as jnp
import numpy as np
import pytest

from tpu_kernel_records_tools.grading.dense import checks as C
from tpu_kernel_records_tools.grading.candidates import PAGED_BUILTIN, resolve
from tpu_kernel_records_tools.grading.paged.known_bad import PagedSwitches, _bug
from tpu_kernel_records_tools.grading.paged.checks import PAGED_CHECKS, PAGED_FEATURE_CHECKS, paged_checks_for
from kernel_src.contract import PAGED_FEATURES
from tests.seeds import full_level_seeds

BAD = sorted(n for n, c in PAGED_BUILTIN.items() if c.kind == "known-bad")
CHECK_NAMES = {c.name for c in (*PAGED_CHECKS, *PAGED_FEATURE_CHECKS.values())}


class PagedRunner:
    """``paged_forward`` like ``grading.runner.Runner``'s, calling the function in this process."""

    def __init__(self, fn):
        self.fn, self.nonfinite, self.returned, self.check = fn, [], 0, ""

    def paged_forward(self, p) -> np.ndarray:
        try:
            out = np.asarray(self.fn(jnp.asarray(p.q), jnp.asarray(p.k_pages), jnp.asarray(p.v_pages), **p.kwargs))
        except Exception as e:
            raise C.CandidateFailure(f"{p.label}: raised {type(e).__name__}: {e}") from None
        if out.shape != p.out_shape:
            raise C.CandidateFailure(f"{p.label}: output shape {out.shape}, expected {p.out_shape}")
        return out


def grade(fn, seed: int, level: str, only=None) -> dict[str, C.Outcome]:
    """Check name -> outcome of the paged checks (``only``: just these) on ``fn``."""
    ctx = C.Context(PagedRunner(fn), seed, level=level)
    found = {}
    for spec in paged_checks_for(getattr(fn, "features", ())):
        if only is None or spec.name in only:
            try:
                found[spec.name] = spec.run(ctx)
            except C.CandidateFailure as e:
                found[spec.name] = C.Outcome(False, str(e))
    return found


def test_roster():
    assert len(BAD) >= 8
    for name in BAD:
        cand = PAGED_BUILTIN[name]
        assert cand.summary and cand.catches and set(cand.catches) <= CHECK_NAMES, name
        assert resolve(name) is cand and cand.contract == "paged"
    kinds = {c.kind for c in PAGED_BUILTIN.values()}
    assert {"reference", "correct-variant", "kernel", "known-bad"} <= kinds
    assert set(PAGED_BUILTIN["paged-reference"].load().features) == set(PAGED_FEATURES)


@pytest.mark.slow  # every paged known-bad with its switch off, graded: about 11 s
def test_every_switch_off_is_the_contract():
    """The known-bads' shared program with no bug on passes what they fail (so each failure is its bug's)."""
    found = grade(_bug(), 0, "quick", only={"paged-accuracy", "paged-garbage", "paged-long"})
    assert all(o.passed for o in found.values()), {n: o.detail for n, o in found.items() if not o.passed}
    assert len(PagedSwitches._fields) >= 10


@pytest.mark.parametrize("name", BAD)
def test_known_bad_is_rejected_by_its_check_at_the_quick_level(name):
    cand = PAGED_BUILTIN[name]
    found = grade(cand.load(), 0, "quick", only=set(cand.catches))
    assert not all(o.passed for o in found.values()), (name, {n: o.detail[:200] for n, o in found.items()})


@pytest.mark.slow
def test_the_online_variant_passes_the_quick_level():
    """(The reference's quick grade is the CLI test's, through the worker.)"""
    found = grade(PAGED_BUILTIN["paged-online-pages"].load(), 3, "quick")
    assert set(found) == {c.name for c in paged_checks_for(PAGED_FEATURES)}
    assert all(o.passed for o in found.values()), {n: o.detail for n, o in found.items() if not o.passed}


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_passes_the_full_level(seed):
    found = grade(PAGED_BUILTIN["paged-reference"].load(), seed, "full")
    assert all(o.passed for o in found.values()), {n: o.detail for n, o in found.items() if not o.passed}


@pytest.mark.slow
def test_online_pages_passes_the_full_level():
    found = grade(PAGED_BUILTIN["paged-online-pages"].load(), 0, "full")
    assert all(o.passed for o in found.values()), {n: o.detail for n, o in found.items() if not o.passed}


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_known_bads_are_rejected_by_their_checks_at_the_full_level(seed):
    missed = {}
    for name in BAD:
        cand = PAGED_BUILTIN[name]
        found = grade(cand.load(), seed, "full", only=set(cand.catches))
        if all(o.passed for o in found.values()):
            missed[name] = {n: o.detail[:200] for n, o in found.items()}
    assert not missed, missed


@pytest.mark.slow
@pytest.mark.parametrize("seed", full_level_seeds())
@pytest.mark.parametrize("name", ["paged-pallas", "paged-triton"])
def test_the_paged_kernels_pass_the_full_level(name, seed):
    """The project's paged kernels (interpreted on CPU) against every paged check, features included."""
    fn = PAGED_BUILTIN[name].load()
    assert set(fn.features) == set(PAGED_FEATURES)
    found = grade(fn, seed, "full")
    assert set(found) == {c.name for c in paged_checks_for(PAGED_FEATURES)}
    assert all(o.passed for o in found.values()), {n: o.detail for n, o in found.items() if not o.passed}
