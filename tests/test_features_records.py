"""The contract's declared features in the records (issue 34): the scorecard's ``features`` through the
schema, the acceptance rules and the tables into the ``correctness`` column, and the leaderboard's
separate contests. Scorecards are made by hand (nothing is graded here); every run is synthetic."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import release_fixtures as testing
from kernel_src.contract import FEATURE_NAMES
from tpu_kernel_records_tools.builder import leaderboard as board
from tpu_kernel_records_tools.builder.build import BuildError, build
from tpu_kernel_records_tools.builder.rules import accept, run_files
from tpu_kernel_records_tools.builder.tables import record_tables, write_parquet
from tpu_kernel_records_tools.builder.verify import verify
from tpu_kernel_records_tools.records import rawio
from tpu_kernel_records_tools.records.schema import FEATURES as SCHEMAS

REPO = Path(__file__).resolve().parent.parent


def _feature_check(name: str) -> dict:
    return {"name": name, "passed": True, "points": 1.0, "max_points": 1.0, "detail": testing.SYNTHETIC}


def _declare(card: dict, *features: str, checks: bool = True) -> None:
    """``card`` declares ``features`` and (with ``checks``) carries the check of each, passed."""
    card["features"] = list(features)
    if checks:
        card["checks"] += [_feature_check(f) for f in features]
        card["score"] += len(features)
        card["max_score"] += len(features)


def _graded_on_features(docs: dict) -> None:
    reference, pallas, _ = docs["correctness"]["scorecards"]  # the third predates features: no key
    _declare(reference)
    _declare(pallas, "window", "softcap")


def _accepted(run: Path):
    return accept(rawio.read_run(run), allow_interpret=True, read_file=run_files(run))


def test_the_schema_names_exactly_the_contracts_features():
    prop = rawio.load_schema("correctness")["$defs"]["scorecard"]["properties"]["features"]
    assert prop["items"]["enum"] == list(FEATURE_NAMES) and prop["uniqueItems"] is True
    assert rawio.scorecard_features() == FEATURE_NAMES
    assert SCHEMAS["correctness"].field("features").type == pa.list_(pa.field("element", pa.string()))


def test_the_rubrics_scorecard_with_features_is_schema_valid():
    from tpu_kernel_records_tools.grading.rubric import CheckResult, Scorecard

    card = Scorecard("mine", "external", [CheckResult("window", True, 1.0, 1.0, "ok")], features=("window",))
    doc = testing.documents()["correctness"]
    doc["scorecards"].append(card.to_dict())
    rawio.validate("correctness", doc)
    assert doc["scorecards"][-1]["features"] == ["window"]


@pytest.mark.parametrize("features, why", [(["bogus"], "is not one of"), (["window", "window"], "non-unique")])
def test_the_schema_refuses_an_unknown_or_repeated_feature(features, why):
    doc = testing.documents()["correctness"]
    doc["scorecards"][1]["features"] = features
    with pytest.raises(rawio.RunError, match=why) as err:
        rawio.validate("correctness", doc)
    assert err.value.rule == "schema" and err.value.field.startswith("scorecards/1/features")


def test_features_round_trip_into_the_parquet_column(tmp_path):
    run = testing.write(tmp_path / "runs", "synthetic-features", edit=_graded_on_features)
    table = record_tables(_accepted(run))["correctness"]
    write_parquet(table, str(tmp_path / "correctness.parquet"))
    back = pq.read_table(tmp_path / "correctness.parquet")
    assert back.schema.field("features").type == pa.list_(pa.field("element", pa.string()))
    got = {(r["row_kind"], r["candidate"], None if r["features"] is None else tuple(r["features"]))
           for r in back.to_pylist()}
    assert got == {("check", "reference", ()), ("check", "pallas", ("window", "softcap")),
                   ("check", "ignores-causal", None),  # graded before features existed: null
                   ("power", "ignores-causal", None), ("power", "reference", None)}  # grader power: null
    assert {r["check"] for r in back.to_pylist() if r["candidate"] == "pallas"} >= {"window", "softcap"}


def test_the_committed_records_load_unchanged_with_a_null_column():
    for path in sorted((REPO / "data" / "correctness").glob("*.parquet")):
        column = pq.read_table(path).column("features")
        assert column.null_count == len(column), path.name  # every committed run predates features


@pytest.mark.parametrize("edit, field, message", [
    (lambda cards: _declare(cards[1], "sinks", checks=False), "scorecards/1/features", "no check of that name"),
    (lambda cards: cards[1]["checks"].append(_feature_check("segments")) or cards[1].update(
        score=cards[1]["score"] + 1, max_score=cards[1]["max_score"] + 1),
     "scorecards/1/checks/3/name", "does not declare"),
    (lambda cards: _declare(cards[0], "softcap", "window"), "scorecards/0/features", "contract's order"),
])
def test_features_that_disagree_with_the_checks_are_refused(tmp_path, edit, field, message):
    def broken(docs):
        edit(docs["correctness"]["scorecards"])
    run = testing.write(tmp_path / "runs", "synthetic-bad-features", edit=broken)
    with pytest.raises(rawio.RunError, match=message) as err:
        _accepted(run)
    assert (err.value.rule, err.value.field) == ("scorecard", field)


def test_a_card_that_could_not_be_graded_may_lack_its_feature_checks(tmp_path):
    def load_error(docs):
        card = docs["correctness"]["scorecards"][2]  # the known-bad one, not the measured kernel
        card["error"] = "not run: the worker did not start"
        _declare(card, "segments", "sinks", checks=False)
    run = testing.write(tmp_path / "runs", "synthetic-load-error", edit=load_error)
    rows = record_tables(_accepted(run))["correctness"].to_pylist()
    assert {tuple(r["features"]) for r in rows if r["candidate"] == "ignores-causal" and r["row_kind"] == "check"} == {
        ("segments", "sinks")}


def test_an_unknown_feature_is_refused_by_build_and_verify(tmp_path):
    ws = testing.workspace(tmp_path / "ws")
    run = testing.write(ws / "runs", "synthetic-unknown", edit=_graded_on_features)
    doc = rawio.read_run(run)["correctness"]
    doc["scorecards"][1]["features"] = ["window", "softcap", "alibi"]
    testing.rewrite(run, "correctness", doc)  # re-signed: only the schema can object
    with pytest.raises(BuildError) as err:
        build([run], ws / "data", allow_interpret=True)
    assert err.value.rule == "schema" and err.value.field == "scorecards/1/features/2"
    assert "'alibi' is not one of ['window', 'softcap', 'segments', 'sinks', 'quantized_kv']" in str(err.value)
    assert "\n" not in str(err.value) and not (ws / "data").exists()
    # The same run slipped into data/raw by hand: verify names it.
    shutil.copytree(run, ws / "data" / "raw" / "synthetic-unknown")
    problems = verify(ws / "data")
    assert any("[schema]" in p and "scorecards/1/features/2" in p and "'alibi'" in p for p in problems), problems


def _timed(record: str, median: float, interpret: bool = False) -> dict:
    return dict(source="submitted", implementation="submitted", interpret=interpret, device_kind="TPU v5 lite",
                scope="flash", seq_len=1024, num_q_heads=8, num_kv_heads=2, head_dim=128, batch=4,
                dtype="bfloat16", median_ms=median, record_id=record, samples_ms=[median] * 9, pairs=[])


def _verdict(record: str, features: list[str] | None) -> dict:
    return dict(record_id=record, candidate=f"kernel-{record}", candidate_passed=True, source="submitted",
                measured=True, row_kind="check", features=features)


def _tables(rows: list[tuple[str, float, list[str] | None]]) -> str:
    bench = pa.Table.from_pylist([_timed(record, median) for record, median, _ in rows])
    checks = pa.Table.from_pylist([_verdict(record, features) for record, _, features in rows],
                                  schema=pa.schema([*(pa.field(k, pa.string()) for k in ("record_id", "candidate")),
                                                    pa.field("candidate_passed", pa.bool_()),
                                                    pa.field("source", pa.string()),
                                                    pa.field("measured", pa.bool_()),
                                                    pa.field("row_kind", pa.string()),
                                                    pa.field("features", pa.list_(pa.string()))]))
    return board.leaderboard(bench, checks)


def _sections(rendered: str) -> list[tuple[str, list[str]]]:
    """(heading, [record ids in row order]) per table of the rendered leaderboard."""
    out = []
    for block in rendered.strip().split("\n\n"):
        if block.startswith("**"):
            out.append((block, []))
        elif block.startswith("|"):
            out[-1][1].extend(line.split(" | ")[-1].strip(" |`") for line in block.splitlines()[2:])
    return out


def test_the_leaderboard_ranks_each_feature_set_apart():
    rendered = _tables([("sub-fast-window", 0.5, ["window", "softcap"]), ("sub-base", 1.0, []),
                        ("sub-old", 0.8, None), ("sub-sinks", 0.7, ["sinks"]), ("sub-slow-window", 0.9,
                                                                                  ["window", "softcap"])])
    sections = _sections(rendered)
    assert [records for _, records in sections] == [["sub-old", "sub-base"], ["sub-sinks"],
                                                    ["sub-fast-window", "sub-slow-window"]]
    headings = [heading for heading, _ in sections]
    assert "graded on the base contract only" in headings[0]
    assert "base contract plus sinks" in headings[1] and "base contract plus window, softcap" in headings[2]
    window_rows = [line for line in rendered.splitlines() if "sub-fast-window" in line]
    assert len(window_rows) == 1 and "| base + window + softcap |" in window_rows[0]
    assert "| base |" in next(line for line in rendered.splitlines() if "sub-old" in line)


def test_a_base_only_leaderboard_is_one_table():
    sections = _sections(_tables([("sub-b", 2.0, []), ("sub-a", 1.0, [])]))
    assert [records for _, records in sections] == [["sub-a", "sub-b"]]
    assert sections[0][0].startswith("**On the device**")


def test_the_card_describes_the_column():
    card = (REPO / "dataset_card.md").read_text()
    [row] = [line for line in card.splitlines() if line.startswith("| `features` |")]
    assert "`list<string>`" in row and "`[]`: the base contract only" in row
    assert all(f"`{name}`" in row for name in FEATURE_NAMES)
