"""A submitted paged kernel (``measure --candidate FILE.py:fn --name NAME --paged``): graded on the paged
rubric in its sandbox, the same programs timed at the cpu profile's paged-decode cases, checked by the
builder and shown in the paged leaderboard table; a wrong one refused, a kernel of the other contract
refused with one line."""
import shutil
from pathlib import Path

import pytest

from tpu_kernel_records_tools.builder import rules
from tpu_kernel_records_tools.sandbox import isolation
from tpu_kernel_records_tools.grading.export import ProgramRefused
from tpu_kernel_records_tools.measure.run import run_submitted
from tpu_kernel_records_tools.records import rawio

HERE = Path(__file__).parent / "submitted"
needs_bwrap = pytest.mark.skipif(isolation.unavailable_reason() is not None, reason="bubblewrap cannot run here")


def measure(tmp: Path, file: str, name: str, function: str = "paged_attention", paged: bool = True) -> Path:
    return run_submitted(f"{HERE / file}:{function}", name, tmp / name, profile="cpu", level="quick", warmups=0,
                         samples=3, progress=False, candidate_dir=HERE, contract="paged" if paged else "attention")


def accept(run_dir: Path):
    return rules.accept(rawio.read_run(run_dir), allow_interpret=True, read_file=rules.run_files(run_dir))


@pytest.mark.slow
@needs_bwrap
def test_a_correct_paged_submission_becomes_a_paged_leaderboard_row(tmp_path):
    from tpu_kernel_records_tools.builder.build import build
    import pyarrow.parquet as pq

    run_dir = measure(tmp_path, "paged_gather.py", "paged-gather")
    acc = accept(run_dir)
    card = acc.run["correctness"]["scorecards"][0]
    assert card["passed"] and card["contract"] == "paged" and card["features"] == ["window"]
    assert acc.run["correctness"]["submission"]["contract"] == "paged"
    timed = [c for c in acc.run["benchmark"]["cases"] if c["implementation"] == "submitted"]
    assert {c["scope"] for c in timed} == {"paged-decode"} and len(timed) == 3
    assert all(c["output_checks"] and all(x["passed"] for x in c["output_checks"]) for c in timed)
    data, card_path = tmp_path / "data", tmp_path / "card.md"
    shutil.copy(Path(__file__).parents[1] / "dataset_card.md", card_path)
    build([run_dir], data_dir=data, card_path=card_path, allow_interpret=True)
    rows = [r for r in pq.read_table(data / "benchmark").to_pylist() if r["implementation"] == "submitted"]
    assert len(rows) == 3 and {r["page_size"] for r in rows} == {16, 128}
    text = card_path.read_text()
    assert "`paged-gather`" in text and "paged: base + window" in text and "the paged contract" in text


@pytest.mark.slow
@needs_bwrap
def test_a_paged_kernel_leaking_its_last_page_is_refused(tmp_path):
    run_dir = measure(tmp_path, "paged_last_page.py", "paged-last-page")
    card = rawio.read_run(run_dir)["correctness"]["scorecards"][0]
    assert not card["passed"] and not next(c for c in card["checks"] if c["name"] == "paged-garbage")["passed"]
    with pytest.raises(rawio.RunError, match=r"\[correctness\]") as refused:
        accept(run_dir)
    assert "\n" not in str(refused.value)


@needs_bwrap
@pytest.mark.parametrize("file, function, paged, says", [
    ("pure_jax.py", "attention", True, "takes no page_indices"),
    pytest.param("paged_gather.py", "paged_attention", False, "measured with --paged",  # after the dense
                 marks=pytest.mark.slow)])  # rubric's signatures are recorded: about 55 s
def test_a_kernel_of_the_other_contract_is_refused_in_one_line(tmp_path, file, function, paged, says):
    with pytest.raises(ProgramRefused, match=says) as refused:
        measure(tmp_path, file, "other-contract", function, paged)
    assert "\n" not in str(refused.value)
