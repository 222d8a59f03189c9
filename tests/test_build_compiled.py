"""``compiled_tpu``: measure keeps the TPU compiler's facts about each case with a TPU program
(predicted by the compiler, not measured), and the builder takes them only as they follow from the
stored HLO; without libtpu the field is null with a reason, and the run still builds."""

from __future__ import annotations

import dataclasses
import gzip
import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import release_fixtures as testing
from tpu_kernel_records_tools.bench import compiled
from tpu_kernel_records_tools.bench.benchmark import COMPILED_SOURCES, compiled_hlo_path
from tpu_kernel_records_tools.builder.build import BuildError, build
from tpu_kernel_records_tools.builder.verify import verify
from tpu_kernel_records_tools.records import rawio

REASON = compiled.unavailable_reason()
needs_libtpu = pytest.mark.skipif(REASON is not None, reason=str(REASON))


def _stub_grade(kernels, *, seed, progress, known_bad=None, kernel_level="full", kernel_features=None):
    """A passing scorecard: grading is tested elsewhere (it takes minutes on this CPU)."""
    check = {"name": "stub", "passed": True, "points": 1, "max_points": 1, "detail": "not graded here"}
    return [{"candidate": k, "kind": "kernel", "passed": True, "score": 1, "max_score": 1,
             "checks": [check]} for k in kernels]


def _measure(out: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A real tiny softmax benchmark (xla and pallas cases) with a stub scorecard."""
    from tpu_kernel_records_tools.measure import run as run_module

    monkeypatch.setattr(run_module, "grade", _stub_grade)
    return run_module.run_measure(out, profile="tiny", warmups=0, samples=2, scopes=["softmax"],
                                  progress=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        return _measure(tmp_path_factory.mktemp("compiled") / "tiny", mp)


def _cases(run: Path) -> dict[str, dict]:
    return {c["case_id"]: c for c in json.loads((run / "benchmark.json").read_text())["cases"]}


def _edit_case(run: Path, case_id: str, edit) -> None:
    doc = json.loads((run / "benchmark.json").read_text())
    edit(next(c for c in doc["cases"] if c["case_id"] == case_id))
    testing.rewrite(run, "benchmark", doc)


@needs_libtpu
def test_the_pallas_case_carries_its_compiled_v5e_program(tiny):
    cases = _cases(tiny)
    xla, pallas = cases["softmax-xla-s128"], cases["softmax-pallas-s128"]
    assert "compiled_tpu" not in xla, "no TPU lowering on a CPU run: nothing compiled for TPU"
    facts = pallas["compiled_tpu"]
    assert pallas["compiled_tpu_reason"] is None
    assert facts["source"] == COMPILED_SOURCES["deviceless"] and "not measured" in facts["source"]
    assert facts["device_kind"] == "TPU v5 lite" and facts["libtpu"] == compiled.libtpu_version()
    assert len(facts["kernels"]) == 1 and facts["vmem_bytes"] > 0
    # fp32 probabilities [1, 4, 128, 128] out: the memory analysis counts them.
    assert facts["output_bytes"] == 4 * 128 * 128 * 4
    hlo = gzip.decompress((tiny / facts["hlo"]).read_bytes()).decode()
    assert facts["hlo"] == compiled_hlo_path("softmax-pallas-s128") and "tpu_custom_call" in hlo


@needs_libtpu
def test_the_facts_build_into_the_benchmark_table_labelled(tiny, tmp_path):
    ws = testing.workspace(tmp_path / "ws")
    (record,) = build([tiny], ws / "data", allow_interpret=True)
    rows = {r["case_id"]: r for r in pq.read_table(ws / "data" / "benchmark" / f"{record}.parquet").to_pylist()}
    facts = rows["softmax-pallas-s128"]["compiled_tpu"]
    assert facts["hlo"] == f"data/raw/{record}/{compiled_hlo_path('softmax-pallas-s128')}"
    assert (ws / facts["hlo"]).is_file() and "not measured" in facts["source"]
    assert rows["softmax-xla-s128"]["compiled_tpu"] is None
    assert verify(ws / "data") == []


@needs_libtpu
@pytest.mark.parametrize("field, value", [("vmem_bytes", 1), ("outside_bytes", 123456789),
                                          ("outside_ops", ["copy", "transpose"])])
def test_a_hand_edited_hlo_fact_is_refused(tiny, tmp_path, field, value):
    run = Path(shutil.copytree(tiny, tmp_path / "run"))
    _edit_case(run, "softmax-pallas-s128", lambda c: c["compiled_tpu"].__setitem__(field, value))
    ws = testing.workspace(tmp_path / "ws")
    with pytest.raises(BuildError, match=rf"\[derived\].*compiled_tpu/{field}.*from its compiled HLO"):
        build([run], ws / "data", allow_interpret=True)
    assert not (ws / "data" / "raw" / "tiny").exists()


@needs_libtpu
def test_a_swapped_hlo_file_is_refused(tiny, tmp_path):
    run = Path(shutil.copytree(tiny, tmp_path / "run"))
    facts = _cases(run)["softmax-pallas-s128"]["compiled_tpu"]
    testing.resign(run, facts["hlo"], gzip.compress(b"HloModule empty\n\nENTRY %main () -> () {\n}\n", mtime=0))
    with pytest.raises(BuildError, match=r"\[derived\].*compiled_tpu/kernels"):
        build([run], testing.workspace(tmp_path / "ws") / "data", allow_interpret=True)


@needs_libtpu
@pytest.mark.parametrize("edit, message", [
    (lambda c: c.__setitem__("compiled_tpu_reason", "also a reason"), "not both"),
    (lambda c: c.__setitem__("compiled_tpu", None), "not neither"),
    (lambda c: c["compiled_tpu"].__setitem__("source", "measured on a TPU"), "source"),
])
def test_facts_and_reason_exclude_each_other_and_the_label_is_fixed(tiny, tmp_path, edit, message):
    run = Path(shutil.copytree(tiny, tmp_path / "run"))
    _edit_case(run, "softmax-pallas-s128", edit)
    with pytest.raises(BuildError, match=rf"\[compiled-tpu\].*{message}"):
        build([run], testing.workspace(tmp_path / "ws") / "data", allow_interpret=True)


def test_a_case_without_a_tpu_program_may_not_claim_one(tiny, tmp_path):
    run = Path(shutil.copytree(tiny, tmp_path / "run"))
    _edit_case(run, "softmax-xla-s128", lambda c: c.update(compiled_tpu=None, compiled_tpu_reason="x"))
    with pytest.raises(BuildError, match=r"\[compiled-tpu\].*has no TPU program"):
        build([run], testing.workspace(tmp_path / "ws") / "data", allow_interpret=True)


WHY = "libtpu is not installed: `pip install 'libtpu==0.0.42.*'` (test)"


def test_without_libtpu_the_field_is_null_with_a_reason(monkeypatch):
    from tpu_kernel_records_tools.bench import benchmark
    from tpu_kernel_records_tools.bench.cases import get_profile

    monkeypatch.setattr(compiled, "unavailable_reason", lambda: WHY)
    result = benchmark.run_benchmark(get_profile("tiny"), ["softmax"], warmups=0, samples=1,
                                     progress=False)
    by_id = {c["case_id"]: c for c in result.cases}
    assert by_id["softmax-pallas-s128"]["compiled_tpu"] is None
    assert by_id["softmax-pallas-s128"]["compiled_tpu_reason"] == WHY
    assert "compiled_tpu" not in by_id["softmax-xla-s128"]
    assert not [f for f in result.files if f.startswith("compiled/")]
    assert any("No compiled TPU facts" in note and WHY in note for note in result.notes)
    rawio.validate("benchmark", {"format_version": 1, "run_id": "cpu-cpu-test", "source": "measured",
                                 "profile": "tiny", "platform": "cpu", "interpret": True, "warmups": 0,
                                 "samples_per_case": 1, "cases": result.cases, "pairs": result.pairs})


@needs_libtpu
def test_a_compile_error_is_a_reason_not_a_failed_case():
    from tpu_kernel_records_tools.bench import benchmark
    from tpu_kernel_records_tools.bench.cases import build_cases, get_profile

    case = next(c for c in build_cases(get_profile("tiny"), ["softmax"], platform="cpu")[0]
                if c.tpu_fn is not None)

    def no_tpu_lowering(*args):
        raise NotImplementedError("no TPU lowering for this test")
    record, files, _ = benchmark.run_case(dataclasses.replace(case, tpu_fn=no_tpu_lowering), warmups=0,
                                          samples=1, device_kind="cpu", platform="cpu")
    assert record["status"] == "ok" and record["compiled_tpu"] is None
    assert record["compiled_tpu_reason"].startswith("compiling for TPU failed: NotImplementedError")
    assert set(files) == {record["stablehlo"], record["stablehlo_tpu"]} - {None}


@needs_libtpu
def test_a_run_whose_facts_are_null_with_a_reason_builds(tiny, tmp_path):
    run = Path(shutil.copytree(tiny, tmp_path / "run"))
    _edit_case(run, "softmax-pallas-s128", lambda c: c.update(compiled_tpu=None, compiled_tpu_reason=WHY))
    (record,) = build([run], testing.workspace(tmp_path / "ws") / "data", allow_interpret=True)
    rows = pq.read_table(tmp_path / "ws" / "data" / "benchmark" / f"{record}.parquet").to_pylist()
    assert {r["case_id"]: r["compiled_tpu_reason"] for r in rows}["softmax-pallas-s128"] == WHY
