"""The main job end to end on the CPU (tiny profile): a schema-valid run folder, every sample kept,
StableHLO evidence, no secret anywhere, failed cases recorded, and atomic output."""

from __future__ import annotations

import dataclasses
import gzip
import json
import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest

from tpu_kernel_records_tools.records import rawio
from tpu_kernel_records_tools.measure import run as run_module
from tpu_kernel_records_tools.bench.benchmark import BenchmarkResult, run_case
from tpu_kernel_records_tools.bench.cases import SCOPES, build_cases, get_profile
from tpu_kernel_records_tools.cli.main import main

CANARY = "canary-0d1e2f3a-must-never-be-written"
SECRET_NAMES = ("HF_TOKEN", "KAGGLE_KEY", "TPU_SECRET_TOKEN")
HAS_RUBRIC = importlib.util.find_spec("tpu_kernel_records_tools.grading.rubric") is not None
REAL_GRADE = run_module.grade


def _stub_scorecards(kernels, *, seed, progress, known_bad=None, kernel_level="full", kernel_features=None):
    check = {"name": "stub", "passed": True, "points": 1, "max_points": 1, "detail": "measure.rubric missing"}
    return [{"candidate": k, "kind": "kernel", "passed": True, "score": 1, "max_score": 1, "checks": [check]}
            for k in kernels]


# The measured candidate of the tiny run: a correct pure-JAX built-in that declares no feature, so its
# quick card is the base contract's (the reference's adds every feature's checks, twice the cost).
MEASURED = "online-softmax"


def _quick_real_grade(kernels, *, seed, progress, known_bad=None, kernel_level="full", kernel_features=None):
    """The real rubric on cheap candidates: grading Pallas in interpret mode takes minutes on this
    CPU, too long for a unit test. The candidate choice itself is tested on its own below."""
    return REAL_GRADE([MEASURED], seed=seed, progress=progress, known_bad=["zeros"], kernel_level="quick")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny measure run with planted credentials in the environment; returns its folder."""
    out = tmp_path_factory.mktemp("runs") / "tiny"
    with pytest.MonkeyPatch.context() as mp:
        for name in SECRET_NAMES:
            mp.setenv(name, CANARY)
        mp.setenv("TPU_RECORDS_TEST_MARKER", "allowed-marker")
        mp.setattr(run_module, "grade", _quick_real_grade if HAS_RUBRIC else _stub_scorecards)
        mp.setattr(run_module, "measured_candidates", lambda profile, scopes: (MEASURED, [MEASURED]))
        path = run_module.run_measure(out, profile="tiny", scopes=["softmax", "attention"], samples=3,
                                      warmups=1, progress=False)
    return path


@pytest.fixture(scope="module")
def run(tiny_run):
    return rawio.read_run(tiny_run)


def test_run_folder_is_complete_and_schema_valid(tiny_run, run):
    assert tiny_run.name == "tiny" and not list(tiny_run.parent.glob(".*partial"))
    bench, env = run["benchmark"], run["environment"]
    assert env["profile"] == bench["profile"] == "tiny" and env["platform"] == bench["platform"] == "cpu"
    assert [c["case_id"] for c in bench["cases"]] == [
        "softmax-xla-s128", "softmax-pallas-s128", "attention-xla-s128", "attention-pallas-s128"]
    assert bench["warmups"] == 1 and bench["samples_per_case"] == 3


def test_every_case_is_timed_and_summarized(run):
    for case in run["benchmark"]["cases"]:
        assert case["status"] == "ok", case["error"]
        samples = case["samples_ms"]
        assert len(samples) == 3 and all(s > 0 for s in samples)
        assert case["median_ms"] == pytest.approx(float(np.median(samples)))
        assert case["min_ms"] <= case["q1_ms"] <= case["median_ms"] <= case["q3_ms"] <= case["max_ms"]
        assert case["lower_ms"] > 0 and case["compile_ms"] > 0 and case["transfer_ms"] > 0
        assert case["shape"] == {"batch": 1, "q_len": 128, "kv_len": 128, "num_q_heads": 4,
                                 "num_kv_heads": 2, "head_dim": 64}
        assert case["dtype"] == "bfloat16" and case["causal"] and case["padded"]
        assert case["interpret"] == (case["implementation"] == "pallas")
        assert case["flops"] > 0 and case["tflops"] > 0 and case["peak_flops_fraction"] is None


def test_pairs_are_pallas_over_xla_with_a_ci(run):
    pairs = run["benchmark"]["pairs"]
    assert [(p["scope"], p["numerator"], p["denominator"]) for p in pairs] == [
        ("softmax", "softmax-pallas-s128", "softmax-xla-s128"),
        ("attention", "attention-pallas-s128", "attention-xla-s128")]
    by_id = {c["case_id"]: c for c in run["benchmark"]["cases"]}
    for p in pairs:
        assert p["ratio"] == pytest.approx(by_id[p["numerator"]]["median_ms"] / by_id[p["denominator"]]["median_ms"])
        assert p["ci_low"] <= p["ratio"] <= p["ci_high"]


def test_stablehlo_evidence_is_deterministic_gzip(tiny_run, run):
    for case in run["benchmark"]["cases"]:
        data = (tiny_run / case["stablehlo"]).read_bytes()
        assert data[4:8] == b"\0\0\0\0"  # gzip mtime field
        assert "func.func public @main" in gzip.decompress(data).decode()
        if case["implementation"] == "pallas":
            tpu = gzip.decompress((tiny_run / case["stablehlo_tpu"]).read_bytes()).decode()
            assert "tpu_custom_call" in tpu
        else:
            assert case["stablehlo_tpu"] is None


def test_environment_and_interpret_flags(run):
    env = run["environment"]
    assert env["interpret"] and run["benchmark"]["interpret"]
    assert "say nothing about kernel speed" in env["notes"]
    assert env["devices_used"] == 1 and env["device_count"] >= 1
    assert env["bootstrap"][0]["outcome"] == "used"
    assert env["env_vars"]["TPU_RECORDS_TEST_MARKER"] == "allowed-marker"
    assert not set(SECRET_NAMES) & set(env["env_vars"])


def test_no_secret_anywhere_in_the_run_folder(tiny_run):
    files = [p for p in tiny_run.rglob("*") if p.is_file()]
    assert len(files) >= 4 + 6
    for path in files:
        data = path.read_bytes()
        texts = [data, gzip.decompress(data)] if path.suffix == ".gz" else [data]
        for text in texts:
            assert CANARY.encode() not in text, path


def test_correctness_comes_from_the_same_run(run):
    corr = run["correctness"]
    assert corr["measured_candidate"] == MEASURED and corr["power"] is None and corr["seed"] == 0
    cards = {c["candidate"]: c for c in corr["scorecards"]}
    assert cards[MEASURED]["passed"], cards[MEASURED]
    if HAS_RUBRIC:
        assert cards["zeros"]["kind"] == "known-bad" and not cards["zeros"]["passed"]
        assert len(cards[MEASURED]["checks"]) >= 5


def test_the_measured_kernels_decide_the_candidates():
    cpu, tpu = get_profile("cpu"), get_profile("tpu-v5e")
    assert run_module.measured_candidates(cpu, ["softmax", "attention"]) == ("pallas", ["pallas"])
    assert run_module.measured_candidates(tpu, list(SCOPES), "tpu") == ("pallas", ["pallas", "flash", "paged-pallas",
                                                                             "ragged-pallas"])
    assert run_module.measured_candidates(tpu, ["ragged"], "gpu") == ("ragged-triton", ["ragged-triton"])
    assert run_module.measured_candidates(cpu, ["ragged"], "cpu") == ("ragged-pallas", ["ragged-pallas"])
    assert run_module.measured_candidates(tpu, ["paged-decode"], "gpu") == ("paged-triton", ["paged-triton"])
    assert run_module.measured_candidates(cpu, ["paged-decode"], "cpu") == ("paged-pallas", ["paged-pallas"])
    assert run_module.measured_candidates(tpu, ["flash"]) == ("flash", ["flash"])
    assert run_module.measured_candidates(tpu, ["sharded"]) == ("flash", ["flash"])
    assert run_module.measured_candidates(tpu, ["model-fwd-bwd"]) == ("flash", ["flash"])


def test_grading_never_raises_when_the_rubric_cannot_run(monkeypatch):
    from tpu_kernel_records_tools import grading
    monkeypatch.setattr(grading, "rubric", None, raising=False)
    monkeypatch.setitem(__import__("sys").modules, "tpu_kernel_records_tools.grading.rubric", None)
    (card,) = run_module.grade(["pallas"], seed=0, progress=False)
    assert card["candidate"] == "pallas" and not card["passed"] and "Error" in card["error"]


def test_summary_names_cases_ratios_checks_and_the_caveat(run):
    text = run_module.summary(run["benchmark"], run["correctness"])
    assert "softmax" in text and "attention" in text and "(interp)" in text
    assert f"rubric {MEASURED}" in text and "say nothing about kernel speed" in text


# --- failures --------------------------------------------------------------------------------------

def _tiny_case(index=0):
    cases, _ = build_cases(get_profile("tiny"), ["softmax"], platform="cpu")
    return cases[index]


def test_a_raising_case_is_recorded_as_failed():
    def boom(*args):
        raise RuntimeError("kernel exploded")

    record, files, _ = run_case(dataclasses.replace(_tiny_case(), fn=boom), warmups=0, samples=2,
                                device_kind="cpu")
    rawio.validate("benchmark", {**_bench_doc([record]), "pairs": []})
    assert record["status"] == "failed" and "kernel exploded" in record["error"]
    assert record["samples_ms"] == [] and record["median_ms"] is None and files == {}


def test_a_non_finite_output_is_recorded_as_failed():
    record, files, _ = run_case(dataclasses.replace(_tiny_case(), fn=lambda x, n: x * np.nan),
                                warmups=0, samples=2, device_kind="cpu")
    assert record["status"] == "failed" and "non-finite" in record["error"]
    assert record["stablehlo"] in files


def _bench_doc(cases):
    return {"format_version": 1, "run_id": "cpu-cpu-test", "source": "measured", "profile": "tiny",
            "platform": "cpu", "interpret": False, "warmups": 0, "samples_per_case": 2, "cases": cases}


@pytest.fixture
def replay(run, monkeypatch):
    """Make run_measure replay the tiny run's results instead of measuring again (fast)."""
    bench = run["benchmark"]
    result = BenchmarkResult(cases=[dict(c) for c in bench["cases"]], pairs=list(bench["pairs"]))
    monkeypatch.setattr(run_module, "run_benchmark", lambda *a, **k: result)
    monkeypatch.setattr(run_module, "grade", lambda *a, **k: run["correctness"]["scorecards"])
    return result


def test_a_failed_write_leaves_no_folder(tmp_path, replay, monkeypatch):
    def broken_rename(src, dst):
        raise OSError("disk full (injected)")

    monkeypatch.setattr(rawio.os, "rename", broken_rename)
    with pytest.raises(OSError, match="injected"):
        run_module.run_measure(tmp_path / "new", profile="tiny", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_an_existing_run_folder_is_never_touched(tmp_path, replay):
    existing = tmp_path / "old"
    existing.mkdir()
    (existing / "benchmark.json").write_text("precious")
    with pytest.raises(FileExistsError):
        run_module.run_measure(existing, profile="tiny", progress=False)
    assert main(["measure", "--out", str(existing), "--profile", "tiny", "--quiet"]) == 2
    assert [p.name for p in existing.iterdir()] == ["benchmark.json"]
    assert (existing / "benchmark.json").read_text() == "precious"


def test_a_leaked_secret_refuses_the_whole_run(tmp_path, replay, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", CANARY)
    replay.cases[0] = {**replay.cases[0], "status": "failed", "error": f"bad token {CANARY}"}
    with pytest.raises(run_module.SecretLeakError):
        run_module.run_measure(tmp_path / "leak", profile="tiny", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_default_folder_is_runs_run_id(tmp_path, replay, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = run_module.run_measure(profile="tiny", progress=False)
    second = run_module.run_measure(profile="tiny", progress=False)
    assert first.parent == Path("runs") and first.name.startswith("cpu-cpu-") and second != first
    for folder in (first, second):
        assert rawio.read_run(folder)["manifest"]["run_id"].startswith(first.name[:len("cpu-cpu-2025")])


def test_cli_rejects_bad_counts_and_scopes(capsys):
    for argv in (["measure", "--samples", "0"], ["measure", "--scopes", "nope"], ["measure", "--warmups", "-1"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2


SHARDED_SCRIPT = r"""
import dataclasses, json
from tpu_kernel_records_tools.records import rawio
from tpu_kernel_records_tools.bench.benchmark import pair_record, run_case
from tpu_kernel_records_tools.bench.cases import build_cases, get_profile
profile = dataclasses.replace(get_profile("tiny"), batch=2)
cases, pairs = build_cases(profile, ["flash", "sharded"])
records = [run_case(c, warmups=1, samples=2, device_kind="cpu")[0] for c in cases]
by_id = {r["case_id"]: r for r in records}
doc = {"format_version": 1, "run_id": "cpu-cpu-sharded", "source": "measured", "profile": "tiny",
       "platform": "cpu", "interpret": True, "warmups": 1, "samples_per_case": 2, "cases": records,
       "pairs": [pair_record(p, by_id, 0) for p in pairs]}
rawio.validate("benchmark", doc)
print(json.dumps(doc))
"""


@pytest.mark.slow  # a measure run in a child process with two host devices: 24 s on a loaded machine
def test_flash_and_sharded_scopes_on_two_host_devices():
    """The flash and sharded scopes on 2 forced host devices (a fresh process: XLA_FLAGS must be
    set before JAX starts)."""
    import subprocess
    import sys

    env = {**__import__("os").environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    done = subprocess.run([sys.executable, "-c", SHARDED_SCRIPT], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout.strip().splitlines()[-1])
    cases = {c["case_id"]: c for c in doc["cases"]}
    assert sorted(cases) == ["flash-flash-s128", "flash-xla-s128", "sharded-flash-d1-s128", "sharded-flash-d2-s128"]
    assert all(c["status"] == "ok" for c in cases.values()), [c["error"] for c in cases.values()]
    assert cases["sharded-flash-d2-s128"]["devices_used"] == 2 and cases["sharded-flash-d1-s128"]["devices_used"] == 1
    assert cases["sharded-flash-d2-s128"]["implementation"] == "flash@2"
    assert cases["flash-flash-s128"]["interpret"] and cases["flash-flash-s128"]["stablehlo_tpu"]
    scaling = next(p for p in doc["pairs"] if p["scope"] == "sharded")
    assert scaling["devices"] == 2 and scaling["numerator"] == "sharded-flash-d2-s128"
    assert scaling["scaling_efficiency"] == pytest.approx(
        cases["sharded-flash-d1-s128"]["median_ms"] / (2 * cases["sharded-flash-d2-s128"]["median_ms"]))


def test_power_seeds_fill_the_optional_power_summary(tmp_path, replay, monkeypatch):
    from tpu_kernel_records_tools.sweeps import power

    calls = []
    summary = {"seeds": 3, "shapes": [], "policy": {"k": {"forward": 5.0, "gradient": 6.0}, "floor": {"value": 1e-7}},
               "candidates": [{"candidate": "zeros", "kind": "known-bad", "trials": 3, "rejected": 3,
                               "rejected_by": {"forward-accuracy": 3}}]}
    monkeypatch.setattr(power, "measure_power", lambda *, seeds, progress: calls.append(seeds) or summary)
    folder = run_module.run_measure(tmp_path / "p", profile="tiny", power_seeds=3, progress=False)
    assert calls == [3] and rawio.read_run(folder)["correctness"]["power"] == summary


def test_a_cpu_grades_one_candidate_per_core_at_once_in_order_and_an_accelerator_one(monkeypatch):
    import threading

    from tpu_kernel_records_tools.grading import rubric

    assert run_module.grading_workers(5, "tpu") == run_module.grading_workers(5, "gpu") == 1
    assert run_module.grading_workers(1, "cpu") == 1
    cores = len(os.sched_getaffinity(0))
    assert run_module.grading_workers(5, "cpu") == min(5, cores)
    if run_module.grading_workers(2) < 2:
        pytest.skip("one core: the grades run one at a time")
    together = threading.Barrier(2, timeout=60)  # broken (an error) unless two grades run at once

    def fake_grade(name, *, seed, level, features=None):
        together.wait()
        return rubric.Scorecard(name, "kernel", [], seed=seed, level=level)

    monkeypatch.setattr(rubric, "grade", fake_grade)
    cards = run_module.grade(["pallas", "flash"], seed=0, progress=False, known_bad=["zeros", "ignores-causal"])
    assert [c["candidate"] for c in cards] == ["pallas", "flash", "zeros", "ignores-causal"]
    assert not together.broken


def test_measured_kernels_are_graded_at_the_full_level_and_known_bad_at_quick(monkeypatch):
    from tpu_kernel_records_tools.grading import rubric

    asked = {}

    def fake_grade(name, *, seed, level, features=None):
        asked[name] = level
        return rubric.Scorecard(name, "kernel", [], seed=seed, level=level)

    monkeypatch.setattr(rubric, "grade", fake_grade)
    cards = run_module.grade(["pallas"], seed=3, progress=False, known_bad=["zeros", "ignores-causal"])
    assert asked == {"pallas": "full", "zeros": "quick", "ignores-causal": "quick"}
    assert [c["level"] for c in cards] == ["full", "quick", "quick"]


@pytest.mark.parametrize("profile, flag, expect_known_bad", [
    ("tiny", None, ()), ("tiny", True, None), ("cpu", None, ()), ("gpu", None, None), ("gpu", False, ())])
def test_known_bad_grading_follows_the_profile_unless_told_and_a_skip_is_noted(
        tmp_path, run, monkeypatch, profile, flag, expect_known_bad):
    bench = run["benchmark"]
    monkeypatch.setattr(run_module, "run_benchmark", lambda *a, **k: BenchmarkResult(
        cases=[dict(c) for c in bench["cases"]], pairs=list(bench["pairs"])))
    asked = []
    monkeypatch.setattr(run_module, "grade", lambda kernels, **kw: asked.append((kw["known_bad"], kw["kernel_level"]))
                        or run["correctness"]["scorecards"])
    folder = run_module.run_measure(tmp_path / "k", profile=profile, known_bad=flag, scopes=["softmax"],
                                    progress=False)
    notes = rawio.read_run(folder)["environment"]["notes"] or ""
    level = "full" if profile == "gpu" else "quick"  # a CPU run shows the path; an accelerator's grades it all
    assert asked == [(expect_known_bad, level)]
    assert ("known-bad built-ins were not graded" in notes) == (expect_known_bad == ())
    assert ("measured kernels were graded at the quick level" in notes) == (level == "quick")


def test_a_deferred_tpu_compile_gives_the_case_what_the_inline_one_gives():
    from tpu_kernel_records_tools.bench import compiled

    if compiled.unavailable_reason() is not None:
        pytest.skip(compiled.unavailable_reason())
    case = next(c for c in build_cases(get_profile("tiny"), ["softmax"], platform="cpu")[0] if c.tpu_fn is not None)
    inline, inline_files, _ = run_case(case, warmups=0, samples=1, device_kind="cpu", platform="cpu")
    jobs = []
    deferred, files, _ = run_case(case, warmups=0, samples=1, device_kind="cpu", platform="cpu", deferred=jobs)
    assert len(jobs) == 1 and deferred["compiled_tpu"] is None and deferred["compiled_tpu_reason"] is None
    assert list(deferred) == list(inline)  # the same keys in the same order
    assert inline["compiled_tpu"]["hlo"] not in files
    result = BenchmarkResult(cases=[deferred], pairs=[], files=files, pending=jobs)
    result.finish()
    assert not result.pending and deferred["compiled_tpu"] == inline["compiled_tpu"]
    assert result.files[inline["compiled_tpu"]["hlo"]] == inline_files[inline["compiled_tpu"]["hlo"]]


def test_measure_times_every_case_before_the_deferred_tpu_compiles_and_records_them(tmp_path, run, monkeypatch):
    cases = [dict(c) for c in run["benchmark"]["cases"]]
    target = next(c for c in cases if "compiled_tpu" in c)
    asked = {}

    def benchmark(*args, **kwargs):
        asked.update(kwargs)
        return BenchmarkResult(cases=cases, pairs=list(run["benchmark"]["pairs"]), pending=[
            lambda files: target.update(compiled_tpu=None, compiled_tpu_reason="compiled after the last sample")])

    monkeypatch.setattr(run_module, "run_benchmark", benchmark)
    monkeypatch.setattr(run_module, "grade", lambda kernels, **kw: run["correctness"]["scorecards"])
    folder = run_module.run_measure(tmp_path / "d", profile="tiny", scopes=["softmax"], progress=False)
    assert asked["defer_tpu"] is True
    written = {c["case_id"]: c for c in rawio.read_run(folder)["benchmark"]["cases"]}
    assert written[target["case_id"]]["compiled_tpu_reason"] == "compiled after the last sample"


@pytest.mark.parametrize("profile", ["tiny", "cpu", "gpu"])
def test_a_quick_grade_covers_the_features_each_kernels_rows_use_and_the_full_one_all(
        tmp_path, run, monkeypatch, profile):
    cases = [dict(c) for c in run["benchmark"]["cases"]]
    flash = {**cases[-1], "case_id": "masks-fwd-flash", "implementation": "flash", "window": [63, 0], "sinks": True}
    monkeypatch.setattr(run_module, "run_benchmark", lambda *a, **k: BenchmarkResult(
        cases=[*cases, flash], pairs=list(run["benchmark"]["pairs"])))
    asked = []
    monkeypatch.setattr(run_module, "grade", lambda kernels, **kw: asked.append((kernels, kw["kernel_features"]))
                        or run["correctness"]["scorecards"])
    folder = run_module.run_measure(tmp_path / "f", profile=profile, scopes=["softmax", "masks-fwd"], progress=False)
    notes = rawio.read_run(folder)["environment"]["notes"] or ""
    assert ("each on the base contract and the features its timed rows use" in notes) == (profile != "gpu")
    (kernels, features), = asked
    assert kernels == ["pallas", "flash"]
    if profile == "gpu":
        assert features is None  # every feature each kernel declares, at the full level
    else:
        assert {k: features[k] for k in kernels} == {"pallas": [], "flash": ["window", "sinks"]}


def test_the_runbook_states_the_recorded_cost_of_the_cpu_run(capsys):
    """docs/RUNBOOK.md's cost of a CPU run is the one ``scripts/time_measure.py --record`` measured, not typed, and
    ``measure --help`` says what a CPU run does and where its cost is."""
    repo = Path(__file__).resolve().parent.parent
    record = json.loads((repo / "scripts" / "time_measure.json").read_text())
    assert record["command"] == ["tpu-kernel-records", "measure"] and not any(record["exit_codes"])
    runbook = " ".join((repo / "docs" / "RUNBOOK.md").read_text().split())
    assert (f"{record['median_cpu_s']:.0f} CPU-seconds (user and system time of the process and its grading "
            f"workers) and {record['median_wall_s']:.0f} s of wall time, on {record['machine']},") in runbook
    with pytest.raises(SystemExit):
        main(["measure", "--help"])
    helped = " ".join(capsys.readouterr().out.split())
    assert "grades the measured kernels at the quick level" in helped and "docs/RUNBOOK.md" in helped
