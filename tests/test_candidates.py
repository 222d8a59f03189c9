"""grading.candidates: the built-in roster, spec resolution and loading of external candidates."""

import sys

import pytest

from kernel_src.contract import declared_features
from tpu_kernel_records_tools.grading.dense import checks
from tpu_kernel_records_tools.grading.dense.feature_checks import FEATURE_CHECKS
from tpu_kernel_records_tools.grading.candidates import (BUILTIN, KINDS, Candidate, CandidateLoadError,
                                                         CandidateSpecError, resolve)

CHECK_NAMES = {spec.name for spec in checks.CHECKS} | {checks.FINITE.name} | set(FEATURE_CHECKS)


def test_roster_has_the_required_candidates():
    kinds = {}
    for cand in BUILTIN.values():
        kinds.setdefault(cand.kind, []).append(cand.name)
    assert {"reference", "pallas", "flash"} <= set(BUILTIN)
    assert {"rounded-probs", "online-softmax", "flash-style", "per-head-dkv"} <= set(kinds["correct-variant"])
    assert len(kinds["known-bad"]) >= 21
    assert {"ignores-causal", "missing-mask", "low-precision", "wrong-gqa"} <= set(kinds["known-bad"])
    # Bugs of real kernels at real sizes (issue 9): each names the check(s) that catch it.
    assert {"head-dim-tile", "query-tile-local-causal", "key-tile-wrap", "input-dtype-accumulator",
            "backward-ignores-scale", "large-kv-top-left", "frozen-running-max", "split-kv-without-maxima",
            "memoizing-large"} <= set(kinds["known-bad"])


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_every_builtin_is_documented(name):
    cand = BUILTIN[name]
    assert cand.name == name and cand.kind in KINDS and cand.summary
    if cand.kind == "known-bad":
        assert cand.catches and set(cand.catches) <= CHECK_NAMES, cand.catches
        # a feature's check runs only on a candidate that declares the feature
        assert set(cand.catches) & set(FEATURE_CHECKS) <= set(declared_features(cand.load())), cand.catches


def test_resolve_builtin_and_passthrough():
    assert resolve("reference") is BUILTIN["reference"]
    assert resolve(BUILTIN["zeros"]) is BUILTIN["zeros"]


@pytest.mark.parametrize("spec", ["no-such-candidate", "", "file.py", "file.py:", ":fn", "a b:fn",
                                  "pkg.mod:not-an-identifier", "pkg..mod:fn"])
def test_bad_specs_raise_a_clear_error(spec):
    with pytest.raises(CandidateSpecError, match="candidate"):
        resolve(spec)


EXTERNAL = """
from tpu_kernel_records_tools.grading.candidates import reference

def attention(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    return reference(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale)

not_callable = 3
"""


def test_external_file_and_module_candidates_load(tmp_path, monkeypatch):
    path = tmp_path / "my_kernel.py"
    path.write_text(EXTERNAL)
    by_file = resolve(f"{path}:attention")
    assert by_file.kind == "external" and by_file.name == f"{path}:attention"
    assert callable(by_file.load())

    pkg = tmp_path / "rubric_ext_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "kern.py").write_text(EXTERNAL)
    monkeypatch.syspath_prepend(str(tmp_path))
    by_module = resolve("rubric_ext_pkg.kern:attention")
    assert by_module.kind == "external"
    assert by_module.load().__module__ == "rubric_ext_pkg.kern"
    sys.modules.pop("rubric_ext_pkg.kern", None)


@pytest.mark.parametrize("body, spec_tail, message", [
    (None, "attention", "does not exist"),
    (EXTERNAL, "missing", "no attribute"),
    (EXTERNAL, "not_callable", "not callable"),
    ("def attention(:\n", "attention", "SyntaxError"),
    ("import no_such_module_for_rubric\n", "attention", "ModuleNotFoundError"),
])
def test_external_load_errors_are_named(tmp_path, body, spec_tail, message):
    path = tmp_path / "broken.py"
    if body is not None:
        path.write_text(body)
    cand = resolve(f"{path}:{spec_tail}")
    with pytest.raises(CandidateLoadError, match=message):
        cand.load()


def test_missing_module_is_a_load_error():
    with pytest.raises(CandidateLoadError, match="No module named"):
        resolve("no_such_pkg_for_rubric.mod:attention").load()


def test_kernel_loader_reports_a_missing_kernel():
    from tpu_kernel_records_tools.grading.dense.known_bad import _kernel
    from kernel_src.registry import Implementation

    ghost = Implementation("ghost", "kernel_src.no_such_kernel:f", "kernel", "absent", scopes=(), pallas=True)
    cand = Candidate("ghost", "kernel", "A kernel that does not exist.", _kernel(ghost.load))
    with pytest.raises(CandidateLoadError, match="no_such_kernel"):
        cand.load()


def test_kernel_builtins_come_from_the_registry():
    from kernel_src.registry import IMPLEMENTATIONS

    kernels = {n for n, c in BUILTIN.items() if c.kind == "kernel"}
    assert kernels == {i.grading_name for i in IMPLEMENTATIONS.values()
                       if i.kind == "kernel" and i.grading_name and i.contract}
    for name in kernels:
        assert BUILTIN[name].summary.startswith(
            next(i.target for i in IMPLEMENTATIONS.values() if i.grading_name == name))
