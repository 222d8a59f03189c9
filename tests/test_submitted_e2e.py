"""A submitted kernel end to end (slow: each measure exports in bubblewrap and grades): measure -> build ->
verify -> load, and the builder's refusals of wrong, tampered and hostile submissions."""
import json
import shutil
from pathlib import Path

import pytest

from tpu_kernel_records_tools.bench.submitted import checked_samples
from tpu_kernel_records_tools.builder import rules
from tpu_kernel_records_tools.sandbox import isolation
from tpu_kernel_records_tools.grading.export import ProgramRefused
from tpu_kernel_records_tools.measure.run import run_submitted
from tpu_kernel_records_tools.measure.submission import TIMED_SHAPES_CHECK
from tpu_kernel_records_tools.records import rawio

pytestmark = [pytest.mark.slow, pytest.mark.skipif(isolation.unavailable_reason() is not None,
                                                   reason="bubblewrap cannot run here")]
HERE = Path(__file__).parent / "submitted"


def measure(tmp: Path, file: str, name: str, function: str = "attention") -> Path:
    return run_submitted(f"{HERE / file}:{function}", name, tmp / name, profile="tiny", level="quick",
                         progress=False, candidate_dir=HERE)  # the submissions import their honest pure_jax.py


def accept(run_dir: Path):
    return rules.accept(rawio.read_run(run_dir), allow_interpret=True, read_file=rules.run_files(run_dir))


@pytest.fixture(scope="module")
def honest(honest_submission):
    return honest_submission  # conftest's: measured once for this module and tests/test_contribute.py


def _programs(run_dir: Path) -> dict:
    doc = json.loads((run_dir / "correctness.json").read_text())
    return {p["sha256"]: p for p in doc["submission"]["programs"]}


def _rewrite(run_dir: Path, dest: Path, edit) -> Path:
    shutil.copytree(run_dir, dest)
    edit(dest)
    manifest = json.loads((dest / "manifest.json").read_text())
    for rel in manifest["files"]:
        manifest["files"][rel] = rawio.sha256_file(dest / rel)
    (dest / "manifest.json").write_bytes(rawio.dumps(manifest))
    return dest


def test_a_correct_submission_becomes_a_record_and_a_leaderboard_row(honest, tmp_path):
    from tpu_kernel_records_tools.builder.build import build
    from tpu_kernel_records_tools.builder.verify import verify
    import pyarrow.parquet as pq

    acc = accept(honest)
    card = acc.run["correctness"]["scorecards"][0]
    assert card["passed"] and card["programs"] and acc.run["correctness"]["submission"]["isolation"] == "bubblewrap"
    data, card_path = tmp_path / "data", tmp_path / "card.md"
    shutil.copy(Path(__file__).parents[1] / "dataset_card.md", card_path)
    build([honest], data_dir=data, card_path=card_path, allow_interpret=True)
    assert not verify(data_dir=data, card_path=card_path)
    rows = [r for r in pq.read_table(data / "benchmark").to_pylist() if r["implementation"] == "submitted"]
    assert len(rows) == 1 and rows[0]["source"] == "submitted" and rows[0]["interpret"]
    text = card_path.read_text()
    assert "`pure-jax`" in text and "not kernel speed" in text and rows[0]["record_id"] in text
    _loads_from_a_staged_release(tmp_path, data, card_path, acc)


def _loads_from_a_staged_release(tmp_path, data, card_path, acc):
    """load_dataset of the staged release returns the submission's row, program hashes and file hash."""
    import datasets
    from tpu_kernel_records_tools.builder.publish import stage

    staged = stage(Path(__file__).parents[1], tmp_path / "staged", data_dir=data, card_path=card_path)
    load = lambda config: datasets.load_dataset(str(staged), config, split="train",  # noqa: E731
                                                cache_dir=str(tmp_path / "cache"))
    submission = acc.run["correctness"]["submission"]
    timed = [r for r in load("benchmark") if r["implementation"] == "submitted"]
    assert len(timed) == 1 and timed[0]["program_sha256"] in {p["sha256"] for p in submission["programs"]}
    assert timed[0]["output_checks"] and all(c["passed"] for c in timed[0]["output_checks"])
    graded = {tuple(r["programs"]) for r in load("correctness") if r["candidate"] == "pure-jax"}
    assert graded == {tuple(acc.run["correctness"]["scorecards"][0]["programs"])}
    assert timed[0]["program_sha256"] in next(iter(graded))
    (env,) = load("environment")
    assert env["source"] == "submitted" and env["submission_file_sha256"] == submission["file_sha256"]
    assert len(env["submission_file_sha256"]) == 64 and env["submission_spec"] == "pure_jax.py:attention"


def test_a_tampered_program_file_is_refused(honest, tmp_path):
    def flip(d):
        path = d / next(iter(_programs(d).values()))["path"]
        data = path.read_bytes()
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(rawio.RunError, match=r"\[program-file\]"):
        accept(_rewrite(honest, tmp_path / "run", flip))


def test_a_timed_program_that_was_not_graded_is_refused(honest, tmp_path):
    def swap(d):
        bench = json.loads((d / "benchmark.json").read_text())
        case = next(c for c in bench["cases"] if c["implementation"] == "submitted")
        case["program_sha256"] = "0" * 64
        (d / "benchmark.json").write_bytes(rawio.dumps(bench))
    with pytest.raises(rawio.RunError, match=r"\[timed-not-graded\]"):
        accept(_rewrite(honest, tmp_path / "run", swap))


def test_a_wrong_submission_is_refused_by_the_builder(tmp_path):
    run_dir = measure(tmp_path, "wrong.py", "ignores-lengths")
    with pytest.raises(rawio.RunError, match=r"\[correctness\]"):
        accept(run_dir)


def test_hostile_submissions_cannot_change_what_is_recorded(honest, tmp_path):
    def median(run_dir):
        bench = json.loads((run_dir / "benchmark.json").read_text())
        return next(c for c in bench["cases"] if c["implementation"] == "submitted")["median_ms"]

    for file in ("timer_patch.py", "replay_identity.py"):  # their trick never reaches the timing process
        run_dir = measure(tmp_path, file, file.removesuffix(".py").replace("_", "-"))
        accept(run_dir)  # graded and timed as an honest program: the patched clock reported 0 ms
        assert median(run_dir) > 0.1 * median(honest)
    run_dir = measure(tmp_path, "batched_first.py", "batched-first")  # later calls return zeros
    with pytest.raises(rawio.RunError, match=r"\[correctness\]"):
        accept(run_dir)
    for file in ("replay_fingerprint.py", "deferred.py"):  # need values, or return no array: no program
        with pytest.raises(ProgramRefused):
            measure(tmp_path, file, file.removesuffix(".py").replace("_", "-"))


@pytest.mark.parametrize("file", ["rows_window.py", "zero_dkv.py"])
def test_a_submission_honest_only_at_the_graders_shapes_is_refused(file, tmp_path):
    """Right only in the rows a public seed used to check, or with zero dK/dV, at the timed shape alone: the
    rubric passes it, the timed-shapes check (rows and key rows from the run's entropy) does not."""
    run_dir = measure(tmp_path, file, file.removesuffix(".py").replace("_", "-"))
    card = json.loads((run_dir / "correctness.json").read_text())["scorecards"][0]
    failed = [c["name"] for c in card["checks"] if not c["passed"]]
    assert failed == [TIMED_SHAPES_CHECK], failed
    caught = "output of 64 rows" if file == "rows_window.py" else "dk of 64 key rows"
    assert any(caught in part and " > tol" in part for part in card["checks"][-1]["detail"].split("; "))
    with pytest.raises(rawio.RunError, match=r"\[correctness\]"):
        accept(run_dir)


def test_the_check_entropy_is_recorded_and_decides_the_checked_calls(honest, tmp_path):
    entropy = json.loads((honest / "correctness.json").read_text())["submission"]["check_entropy"]
    bench = json.loads((honest / "benchmark.json").read_text())
    case = next(c for c in bench["cases"] if c["implementation"] == "submitted")
    assert [c["sample"] for c in case["output_checks"]] == checked_samples(len(case["samples_ms"]), entropy,
                                                                           case["case_id"])
    other = next(f"{n:032x}" for n in range(1000) if checked_samples(len(case["samples_ms"]), f"{n:032x}",
                                                                     case["case_id"]) != checked_samples(
        len(case["samples_ms"]), entropy, case["case_id"]))

    def set_entropy(value):
        def edit(d):
            doc = json.loads((d / "correctness.json").read_text())
            if value is None:
                del doc["submission"]["check_entropy"]
            else:
                doc["submission"]["check_entropy"] = value
            (d / "correctness.json").write_bytes(rawio.dumps(doc))
        return edit
    with pytest.raises(rawio.RunError, match=r"\[output-check\]"):
        accept(_rewrite(honest, tmp_path / "other", set_entropy(other)))
    with pytest.raises(rawio.RunError, match="check_entropy"):
        accept(_rewrite(honest, tmp_path / "none", set_entropy(None)))


def test_a_pallas_submission_in_interpret_mode_becomes_a_record(tmp_path):
    accept(measure(tmp_path, "pallas_interpret.py", "pallas-interpret"))


def test_a_submission_that_declares_features_is_graded_and_recorded_with_them(tmp_path):
    """Issue 34: the declared features are graded by their checks, recorded on the scorecard and in the
    correctness config, and the leaderboard ranks the row among kernels graded on the same features."""
    from tpu_kernel_records_tools.builder.build import build
    import pyarrow.parquet as pq

    run_dir = measure(tmp_path, "windowed.py", "windowed")
    acc = accept(run_dir)
    card = acc.run["correctness"]["scorecards"][0]
    assert card["passed"] and card["features"] == ["window", "softcap"]
    assert {"window", "softcap"} <= {c["name"] for c in card["checks"] if c["passed"]}
    assert not {"segments", "sinks"} & {c["name"] for c in card["checks"]}
    data, card_path = tmp_path / "data", tmp_path / "card.md"
    shutil.copy(Path(__file__).parents[1] / "dataset_card.md", card_path)
    build([run_dir], data_dir=data, card_path=card_path, allow_interpret=True)
    rows = [r for r in pq.read_table(data / "correctness").to_pylist() if r["candidate"] == "windowed"]
    assert rows and all(r["features"] == ["window", "softcap"] for r in rows)
    assert "base + window + softcap" in card_path.read_text()
