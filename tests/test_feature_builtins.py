"""The built-ins of the contract's features (issue 34): every known-bad feature kernel fails the check of the
feature it breaks, and the correct ones -- the reference and two variants written like flash kernels (per-chunk
and per-tile masks, the sink as the rows' first running max and sum) -- pass all four feature checks.

The default run grades at the quick level on seed 0, each known-bad only on its intended check (``only=``); the
slow run does the same at the full level on seeds 0, 1 and 2. Every known-bad built on
``feature_variants._attend_features`` shares its compiled programs with the others and with the same function with its
switches off, which must pass: removing a bug from its switch turns its candidate correct (nan-first-block without
its bug is online-softmax-features, the same compiled programs with the guard on). Candidates are graded
in-process (tests/grading_inprocess.py): the checks and verdicts are the rubric's.
"""

from __future__ import annotations

import pytest

from kernel_src.contract import FEATURES, declared_features
from tests.grading_inprocess import grade
from tpu_kernel_records_tools.grading.candidates import BUILTIN, Candidate
from tpu_kernel_records_tools.grading.dense.feature_variants import FeatureSwitches, _feature_variant

# Each known-bad feature built-in and what its failing check's detail must say (the probe that caught it).
BADS = {
    "window-one-key-wide": ("no query may see key",),
    "window-one-key-narrow": ("gave zero probability to visible key",),
    "window-top-left": ("window/decode",),
    "window-short-fast-path": ("window/decode",),
    "softcap-no-cap-value": ("softcap/huge",),
    "softcap-tanh-of-product": ("softcap/huge",),
    "softcap-before-scale": ("softcap/cap5",),
    "softcap-after-mask": ("on a row that sees no key",),
    "segments-q-ids-only": ("segments/cross",),
    "segments-contiguous-runs": ("gave zero probability to visible key",),
    "segments-block-skip-first-key": ("segments/chunk(",),  # issue 51: chunked prefill over a packed cache
    "segments-block-skip-last-key": ("segments/decode(",),  # the padding after kv_lengths has an id of its own
    "sinks-scaled": ("random sinks",),
    "sinks-per-kv-head": ("random sinks",),
    "sinks-unshifted": ("random sinks",),
    "sinks-frozen": ("dsinks",),
    "nan-first-block": (" nan", "segments/packed("),  # NaN, or the packed rows it poisons (their documents start late)
}
CORRECT = ["online-softmax-features", "flash-style-features"]
CASES = [(name, check) for name in BADS for check in BUILTIN[name].catches]
# The default run holds one known-bad per feature check (of those sharing ``_attend_features``'s programs),
# their switches off and the reference; each of the online-softmax pair
# (nan-first-block and online-softmax-features share programs) and flash-style-features compiles programs of its
# own for every probe (5-10 s each), so their quick grades run with the slow tests.
OWN_PROGRAMS = {"nan-first-block", *CORRECT}
SWITCHES_OFF = Candidate("features-switches-off", "correct-variant",
                         "feature_variants._attend_features with every switch off: the known-bads' code without a bug.",
                         lambda: _feature_variant())


def _failures(card) -> list[tuple[str, str]]:
    return [(c.name, c.detail) for c in card.checks if not c.passed]


def _assert_caught(name: str, check: str, level: str, seed: int) -> None:
    card = grade(name, seed=seed, level=level, only=[check])
    assert [c.name for c in card.checks] == [check]
    result = card.checks[0]
    assert not result.passed and result.points == 0, (name, check, level, seed, result.detail)
    assert f"{check}/" in result.detail, result.detail  # names the probe: slot, dims, dtype and flags
    assert any(word in result.detail for word in BADS[name]), (BADS[name], result.detail)


def _assert_passes_every_feature(candidate, level: str, seed: int) -> None:
    card = grade(candidate, seed=seed, level=level, only=list(FEATURES))
    assert [c.name for c in card.checks] == list(FEATURES)
    assert card.passed and card.score == card.max_score, _failures(card)


def test_the_feature_roster():
    """Every known-bad feature built-in declares all four features (so every feature check runs on it), says its
    bug and names feature checks only; the correct variants declare them all too."""
    feature_bads = {n for n, c in BUILTIN.items() if c.kind == "known-bad" and set(c.catches) <= set(FEATURES)}
    assert feature_bads == set(BADS)
    for name in [*BADS, *CORRECT]:
        cand = BUILTIN[name]
        assert declared_features(cand.load()) == FEATURES, name
        assert cand.summary and cand.kind == ("known-bad" if name in BADS else "correct-variant")
    # the switch-built ones (all but nan-first-block): exactly one switch on each, one bug per candidate
    for name in BADS:
        cells = BUILTIN[name].load().__closure__ or ()
        switches = [c.cell_contents for c in cells if isinstance(c.cell_contents, FeatureSwitches)]
        assert len(switches) == (name != "nan-first-block"), name
        if switches:
            assert sum(x != off for x, off in zip(switches[0], FeatureSwitches())) == 1, (name, switches[0])


def _default_cases() -> set[tuple[str, str]]:
    """The first switch-built known-bad of each feature check: the default run's share (the file took 54 s
    of a 7-minute default run); the others, and those with programs of their own, run with the slow tests."""
    first = {}
    for n, c in CASES:
        if n not in OWN_PROGRAMS:
            first.setdefault(c, (n, c))
    return set(first.values())


@pytest.mark.parametrize("name, check", [(n, c) if (n, c) in _default_cases() else pytest.param(n, c, marks=pytest.mark.slow)
                                         for n, c in CASES])
def test_known_bad_fails_its_feature_check_at_the_quick_level(name, check):
    _assert_caught(name, check, "quick", 0)


def test_the_known_bads_without_their_switch_pass_at_the_quick_level():
    """The same compiled programs as the switch-built known-bads, every switch off."""
    _assert_passes_every_feature(SWITCHES_OFF, "quick", 0)


@pytest.mark.parametrize("name", ["reference", *(pytest.param(n, marks=pytest.mark.slow) for n in CORRECT)])
def test_correct_candidate_passes_every_feature_check_at_the_quick_level(name):
    _assert_passes_every_feature(name, "quick", 0)


@pytest.mark.slow  # about 80-120 s a seed on 2 cores: one test per seed, so each seed's truths and programs are shared
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_known_bads_fail_and_correct_ones_pass_at_the_full_level(seed):
    wrong = []
    for name, run in [*((n, lambda n=n: _assert_passes_every_feature(n, "full", seed))
                        for n in ["reference", *CORRECT]),
                      ("switches off", lambda: _assert_passes_every_feature(SWITCHES_OFF, "full", seed)),
                      *((f"{n} ({c})", lambda n=n, c=c: _assert_caught(n, c, "full", seed)) for n, c in CASES)]:
        try:
            run()
        except AssertionError as e:
            wrong.append(f"{name}: {str(e)[:500]}")
    assert not wrong, wrong
