"""``submit`` and ``review`` (issue 49) against a stand-in Hub on 127.0.0.1 (``tests/hub_standin.py``): the
real huggingface_hub client opens the pull request, lists, downloads and comments. A synthetic tiny-profile
run goes submit -> review --build and becomes rows; damaged runs and pull requests are refused in one line
with data/ and the card byte-identical; each Hub failure has publish's exit status."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import release_fixtures as testing
from hub_standin import REPO_ID, StandInHub, built_workspace, client_env
from release_fixtures import PUBLISHED
from tpu_kernel_records_tools.builder.publish import HUB_STATUS
from tpu_kernel_records_tools.cli import main as commands
from tpu_kernel_records_tools.contribute import review as R
from tpu_kernel_records_tools.contribute.hub import client
from tpu_kernel_records_tools.sandbox import isolation

TOKEN = "hf_" + "StandInSubmitToken" * 2


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return built_workspace(tmp_path_factory.mktemp("contribute"))


@pytest.fixture
def env(monkeypatch):
    return client_env(monkeypatch, TOKEN)


def _run(env, capsys, hub_url: str, *argv: str) -> tuple[int, str, str]:
    env.setenv("HF_ENDPOINT", hub_url)
    code = commands.main(list(argv))
    out, err = capsys.readouterr()
    assert TOKEN not in out + err
    return code, out, err


def _submit(env, capsys, hub, run_dir: Path, *extra: str):
    return _run(env, capsys, hub.url, "submit", str(run_dir), "--repo-id", REPO_ID, "--allow-interpret", *extra)


def _review(env, capsys, hub, ws: Path, *extra: str):
    return _run(env, capsys, hub.url, "review", "--repo-id", REPO_ID, "--allow-interpret", "--data", str(ws / "data"),
                *extra)


def _one_line(err: str) -> str:
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


def _pr_files(run_dir: Path, prefix: str = "submissions") -> dict[str, bytes]:
    return {f"{prefix}/{run_dir.name}/{p.relative_to(run_dir).as_posix()}": p.read_bytes()
            for p in run_dir.rglob("*") if p.is_file()}


def test_a_run_goes_submit_review_build_and_becomes_rows(built, env, capsys, tmp_path):
    ws = Path(shutil.copytree(built, tmp_path / "ws"))
    run_dir = testing.write(tmp_path / "runs", "synthetic-submitted")
    with StandInHub() as hub:
        code, out, err = _submit(env, capsys, hub, run_dir)
        assert code == 0, err
        assert out.strip() == f"opened pull request #1: {hub.url}/datasets/{REPO_ID}/discussions/1"
        assert hub.files("refs/pr/1") == {**hub.files("main"), **_pr_files(run_dir)}  # as written, nothing else
        (pr,) = hub.discussions
        bench = json.loads((run_dir / "benchmark.json").read_text())
        first = bench["pairs"][0]
        assert pr["title"] == "Add run synthetic-submitted: pallas on cpu (tiny profile)"
        assert f"`{first['numerator']}` / `{first['denominator']}`: {first['ratio']:.3g}" in pr["description"]
        assert "interpret mode: yes" in pr["description"]
        assert all(auth == f"Bearer {TOKEN}" for method, _, auth in hub.requests if method == "POST")

        code, out, err = _review(env, capsys, hub, ws, "--pr", "1", "--build", "--comment")
        assert code == 0, err
        assert out.splitlines()[0] == ("#1 synthetic-submitted: accepted (every builder rule passed; no exported "
                                       "program to regrade)")
        assert "accepted" in pr["comments"][0] and "synthetic-submitted" in pr["comments"][0]
    rows = pq.read_table(ws / "data" / "benchmark" / "synthetic-submitted.parquet").to_pylist()
    assert {r["case_id"] for r in rows} == {c["case_id"] for c in bench["cases"]} and all(r["interpret"] for r in rows)
    assert (ws / "data" / "raw" / "synthetic-submitted" / "benchmark.json").read_bytes() == (
        run_dir / "benchmark.json").read_bytes()


def test_dry_run_and_json_say_what_would_be_opened_without_network(env, capsys, tmp_path):
    run_dir = testing.write(tmp_path, "synthetic-dry")
    with StandInHub() as hub:
        code, out, _ = _submit(env, capsys, hub, run_dir, "--dry-run", "--json")
    plan = json.loads(out)
    assert code == 0 and hub.requests == [] and plan["number"] is None
    assert set(plan["files"]) == set(_pr_files(run_dir)) and plan["run_id"] == "synthetic-dry"


def _edit_scorecard_unsigned(run_dir: Path) -> None:
    doc = json.loads((run_dir / "correctness.json").read_text())
    doc["scorecards"][1]["score"] = 3.5
    (run_dir / "correctness.json").write_text(json.dumps(doc))


def _fail_the_kernel_signed(run_dir: Path) -> None:
    doc = json.loads((run_dir / "correctness.json").read_text())
    card = next(c for c in doc["scorecards"] if c["candidate"] == "pallas")
    card["checks"][0].update(passed=False, points=0.0)
    card.update(passed=False, score=card["score"] - 1)
    testing.rewrite(run_dir, "correctness", doc)


def _fail_the_second_kernel(run_dir: Path) -> None:
    """The flash kernel (timed in scope flash, not the measured candidate) failed a check."""
    doc = json.loads((run_dir / "correctness.json").read_text())
    card = next((c for c in doc["scorecards"] if c["candidate"] == "flash"), None)
    if card is None:
        card = json.loads(json.dumps(next(c for c in doc["scorecards"] if c["candidate"] == "pallas")))
        card["candidate"] = "flash"
        doc["scorecards"].insert(-1, card)
    card["checks"][0].update(passed=False, points=0.0)
    card.update(passed=False, score=card["score"] - 1)
    testing.rewrite(run_dir, "correctness", doc)


def _program_differs_from_manifest(run_dir: Path) -> None:
    (run_dir / "programs").mkdir()
    testing.resign(run_dir, "programs/" + "ab" * 32 + ".jaxexport", b"an exported program")
    (run_dir / "programs" / ("ab" * 32 + ".jaxexport")).write_bytes(b"another program")


DAMAGED = {  # damage -> the rule build names
    "scorecard-edited-after-measuring": (_edit_scorecard_unsigned, "[checksum]"),
    "scorecard-failed-resigned": (_fail_the_kernel_signed, "[correctness]"),
    "program-differs-from-manifest": (_program_differs_from_manifest, "[checksum]"),
    "second-kernel-failed": (_fail_the_second_kernel, "'flash' failed check 'causal-mask'"),  # [correctness]
}


def _damaged(tmp_path: Path, damage: str) -> Path:
    scopes = ("softmax", "attention", "flash") if damage == "second-kernel-failed" else testing.SCOPES
    run_dir = testing.write(tmp_path / "runs", f"synthetic-{damage}", scopes=scopes)
    DAMAGED[damage][0](run_dir)
    return run_dir


@pytest.mark.parametrize("damage", DAMAGED)
def test_a_damaged_run_is_refused_by_submit_in_builds_line_and_by_review(damage, built, env, capsys, tmp_path):
    run_dir = _damaged(tmp_path, damage)
    before = testing.tree_hash(built / "data", built / "dataset_card.md")
    ws = Path(shutil.copytree(built, tmp_path / "ws"))  # build writes there if the damage is missed
    code, _, build_err = _run(env, capsys, "http://127.0.0.1:9", "build", str(run_dir), "--allow-interpret",
                              "--data", str(ws / "data"))
    rule = DAMAGED[damage][1]
    assert code == 1 and rule in _one_line(build_err)
    with StandInHub() as hub:
        code, _, err = _submit(env, capsys, hub, run_dir)
        assert code == 1 and hub.requests == []  # refused before anything was uploaded
        assert _one_line(err) == build_err.strip().replace("build refused, nothing written:",
                                                           "submit refused: nothing uploaded:")
        number = hub.open_pr(_pr_files(run_dir), title="a damaged run")  # as a hand-made pull request would
        code, out, err = _review(env, capsys, hub, built, "--pr", str(number), "--build", "--comment")
        assert code == 1 and rule in out and out.startswith(f"#{number} {run_dir.name}: refused: ")
        assert f" submissions/{run_dir.name}/" in out and "/tmp" not in out  # the repository's paths, not ours
        assert "refused" in hub.discussions[0]["comments"][0]
    assert testing.tree_hash(built / "data", built / "dataset_card.md") == before


@pytest.mark.parametrize("extra, deleted, says", [
    ({"data/benchmark/published-tpu-v5e-8.parquet": b"PAR1 not the release PAR1"}, (), "adds data/benchmark/"),
    ({"tpu_kernel_records.py": b"print('hi')\n"}, (), "adds tpu_kernel_records.py outside submissions/<run_id>/"),
    ({}, (".gitattributes",), "modifies or deletes .gitattributes"),
    ({"submissions/x/../../README.md": b"card"}, (), "outside submissions/<run_id>/"),
])
def test_a_pull_request_that_touches_anything_else_is_refused_as_a_whole(extra, deleted, says, built, env, capsys,
                                                                          tmp_path):
    run_dir = testing.write(tmp_path / "runs", "synthetic-scoped")
    before = testing.tree_hash(built / "data", built / "dataset_card.md")
    with StandInHub() as hub:
        number = hub.open_pr({**_pr_files(run_dir), **extra}, deleted)
        code, out, err = _review(env, capsys, hub, built, "--all-open", "--build")
        downloads = [path for method, path, _ in hub.requests if "/resolve/" in path]
    assert code == 1 and downloads == []  # nothing of it was downloaded, let alone built
    line = out.strip()
    assert line.startswith(f"#{number}: refused: it ") and says in line and "refused as a whole" in line
    assert testing.tree_hash(built / "data", built / "dataset_card.md") == before


def test_a_regrade_that_fails_refuses_the_run_and_builds_nothing(built, tmp_path, monkeypatch, env):
    """The submitted scorecard passed; the reviewer's regrade did not: refused, nothing built."""
    run_dir = testing.write(tmp_path / "runs", "synthetic-regraded")
    monkeypatch.setattr(R, "programs_of", lambda run: [{"sha256": "0" * 64}])
    card = {"passed": False, "error": None, "seed": 1234, "slots_from": 0, "score": 2.0, "max_score": 3.0,
            "checks": [{"name": "causal-mask", "passed": False}, {"name": "finite", "passed": True}]}
    with StandInHub() as hub:
        env.setenv("HF_ENDPOINT", hub.url)
        number = hub.open_pr(_pr_files(run_dir))
        review = R.review_pr(client(), REPO_ID, number, tmp_path / "review", allow_interpret=True,
                             regrader=lambda runs: {run_id: card for run_id in runs})
    (verdict,) = review.verdicts
    assert not verdict.accepted and review.accepted == {}
    assert verdict.reason.startswith("[regrade] its programs, regraded on seed 1234, failed causal-mask")
    passing = dict(card, passed=True, score=3.0, checks=[{"name": "causal-mask", "passed": True}])
    assert R._judge(number, "x", passing).accepted and not R._judge(number, "x", "its regrade failed: lost").accepted


@pytest.mark.parametrize("command", ["submit", "review"])
@pytest.mark.parametrize("status, error_code, kind", [
    (500, None, "server"), (404, "RepoNotFound", "not-found"), (403, "GatedRepo", "gated"), (401, None, "unauthorized"),
])
def test_each_hub_failure_is_one_line_with_publishs_status(command, status, error_code, kind, built, env, capsys,
                                                           tmp_path):
    run_dir = testing.write(tmp_path / "runs", "synthetic-hub-failure")
    before = testing.tree_hash(built / "data", built / "dataset_card.md")
    with StandInHub(status, error_code) as hub:
        if command == "submit":
            code, out, err = _submit(env, capsys, hub, run_dir)
        else:
            code, out, err = _review(env, capsys, hub, built, "--all-open", "--build")
    assert code == HUB_STATUS[kind] and _one_line(err).startswith(f"{command} failed: {command} could not ")
    assert len(hub.requests) == 1  # the first call's failure ends it (no retry storm, nothing uploaded)
    assert testing.tree_hash(built / "data", built / "dataset_card.md") == before


def test_a_missing_repository_and_a_missing_token_are_one_line(env, capsys, tmp_path):
    run_dir = testing.write(tmp_path / "runs", "synthetic-no-token")
    with StandInHub(repo_exists=False) as hub:
        code, _, err = _submit(env, capsys, hub, run_dir)
        assert code == HUB_STATUS["not-found"] and "check --repo-id" in _one_line(err)
        hub.requests.clear()
        env.delenv("HF_TOKEN")
        env.setattr("huggingface_hub.constants.HF_TOKEN_PATH", str(tmp_path / "no-token"))
        code, _, err = _submit(env, capsys, hub, run_dir)
        assert hub.requests == []  # refused before any network access
    assert code == HUB_STATUS["unauthorized"] and "hf auth login" in _one_line(err)


def _documented(command: str) -> list[list[str]]:
    from doc_blocks import SHELL, blocks, shell_commands

    return [argv for block in blocks(SHELL) for argv in shell_commands(block)
            if argv[:2] == ["tpu-kernel-records", command]]


def test_the_documented_submit_and_review_commands_run_as_written(built, env, capsys, tmp_path):
    """Every submit and review command the guides show, against the stand-in: the repository id, the run
    folder and the pull request's number put in (and --allow-interpret: the run is a synthetic CPU one)."""
    submits, reviews = _documented("submit"), _documented("review")
    assert len(submits) >= 3 and len(reviews) >= 3 and any("--build" in argv for argv in reviews)
    ws = Path(shutil.copytree(built, tmp_path / "ws"))
    run_dir = testing.write(tmp_path / "runs", "synthetic-documented")

    def filled(argv: list[str], number: int | None) -> list[str]:
        out = [REPO_ID if previous == "--repo-id" else str(number) if previous == "--pr" else arg
               for previous, arg in zip([None, *argv], argv)][1:]
        return [*out[:1], str(run_dir), *out[2:]] if out[0] == "submit" else [*out, "--data", str(ws / "data")]

    with StandInHub() as hub:
        env.setenv("HF_ENDPOINT", hub.url)
        for argv in submits:
            assert commands.main([*filled(argv, None), "--allow-interpret"]) == 0, capsys.readouterr().err
        for argv in sorted(reviews, key=lambda argv: "--build" in argv):  # built, the run is then a duplicate
            assert commands.main([*filled(argv, len(hub.discussions)), "--allow-interpret"]) == 0, capsys.readouterr()
        assert hub.discussions[-1]["comments"]  # the documented --comment posted its verdict
    assert (ws / "data" / "raw" / "synthetic-documented").is_dir()


@pytest.mark.slow  # measures a submitted kernel (conftest's honest_submission) and regrades it twice
@pytest.mark.skipif(isolation.unavailable_reason() is not None, reason="bubblewrap cannot run here")
def test_a_submitted_kernel_is_regraded_on_a_new_seed_and_becomes_a_leaderboard_row(honest_submission, built, env,
                                                                                     capsys, tmp_path):
    ws = Path(shutil.copytree(built, tmp_path / "ws"))
    seed = json.loads((honest_submission / "correctness.json").read_text())["seed"]
    with StandInHub() as hub:
        assert _submit(env, capsys, hub, honest_submission)[0] == 0
        code, out, err = _review(env, capsys, hub, ws, "--pr", "1", "--build", "--json")
        assert code == 0, err
        (verdict,) = json.loads(out)["verdicts"]
        regraded = verdict["regrade"]
        assert verdict["accepted"] and regraded["slots_from"] == seed and regraded["seed"] != seed
        assert regraded["score"] == regraded["max_score"] > 0 and regraded["failed"] == []
        # the same as a Dask task (against data/ without the run: built, it is refused as a duplicate)
        code, out, err = _review(env, capsys, hub, built, "--pr", "1", "--workers", "1")
        run_id = verdict["run_id"]
        assert code == 0 and out.startswith(f"#1 {run_id}: accepted") and "regraded on seed" in out, err
    rows = pq.read_table(ws / "data" / "benchmark").to_pylist()
    assert [r["implementation"] for r in rows if r["record_id"] == run_id].count("submitted") == 1


def test_a_run_already_in_the_data_is_refused_before_any_build(built, env, capsys):
    published = built / "data" / "raw" / PUBLISHED
    before = testing.tree_hash(built / "data", built / "dataset_card.md")
    with StandInHub() as hub:
        number = hub.open_pr(_pr_files(published))
        code, out, err = _review(env, capsys, hub, built, "--pr", str(number), "--build")
    assert code == 1 and out.strip().startswith(f"#{number} {PUBLISHED}: refused: [duplicate-record] ")
    assert testing.tree_hash(built / "data", built / "dataset_card.md") == before


def test_a_pull_request_too_large_to_review_is_refused_before_downloading(built, env, capsys, tmp_path, monkeypatch):
    run_dir = testing.write(tmp_path / "runs", "synthetic-large")
    files = _pr_files(run_dir)
    monkeypatch.setattr(R, "MAX_PR_BYTES", sum(map(len, files.values())) - 1)
    with StandInHub() as hub:
        number = hub.open_pr(files)
        code, out, _ = _review(env, capsys, hub, built, "--pr", str(number))
        assert [path for _, path, _ in hub.requests if "/resolve/" in path] == []
    assert code == 1 and "bytes" in out and "refused as a whole" in out


def test_a_pull_request_that_does_not_exist_is_one_line(built, env, capsys):
    with StandInHub() as hub:
        code, _, err = _review(env, capsys, hub, built, "--pr", "3")
    assert code == HUB_STATUS["not-found"] and "has no pull request #3" in _one_line(err)


def _swap_in_wrong_programs(run_dir: Path, dest: Path) -> Path:
    """The honest run with every program replaced by the same call exported from ``tests/submitted/wrong.py``
    (ignores kv_lengths), the hashes updated everywhere and the manifest re-signed: its scorecard still says
    passed, and every builder rule still holds (they cannot run a program); only a regrade can tell."""
    import sys

    from tpu_kernel_records_tools.grading.export import export_programs, program_path, sha256

    sys.path.insert(0, str(Path(__file__).parent / "submitted"))
    import wrong

    run_dir = Path(shutil.copytree(run_dir, dest / run_dir.name))
    corr = json.loads((run_dir / "correctness.json").read_text())
    entries = corr["submission"]["programs"]
    reply, arrays = export_programs(wrong.attention, [p["signature"] for p in entries], "cpu")
    assert reply["ok"], reply
    renamed = {}
    for entry, array in zip(entries, arrays):
        (run_dir / entry["path"]).unlink()
        data = array.tobytes()
        renamed[entry["sha256"]] = sha256(data)
        entry.update(sha256=sha256(data), path=program_path(sha256(data)))
        (run_dir / entry["path"]).write_bytes(data)
    for card in corr["scorecards"]:
        card["programs"] = sorted(renamed.get(d, d) for d in card.get("programs", []))
    bench = json.loads((run_dir / "benchmark.json").read_text())
    for case in bench["cases"]:
        if case.get("program_sha256") in renamed:
            case["program_sha256"] = renamed[case["program_sha256"]]
    moved = {program_path(old): program_path(new) for old, new in renamed.items()}
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest["files"] = {moved.get(rel, rel): digest for rel, digest in manifest["files"].items()}
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    testing.rewrite(run_dir, "correctness", corr)
    testing.rewrite(run_dir, "benchmark", bench)
    for rel in manifest["files"]:
        if rel.startswith("programs/"):
            testing.resign(run_dir, rel, (run_dir / rel).read_bytes())
    return run_dir


@pytest.mark.slow  # exports a wrong kernel's programs in process and regrades them
@pytest.mark.skipif(isolation.unavailable_reason() is not None, reason="bubblewrap cannot run here")
def test_a_passing_scorecard_over_wrong_programs_is_refused_by_the_regrade(honest_submission, built, env, capsys,
                                                                           tmp_path):
    from tpu_kernel_records_tools.builder.build import check_run

    run_dir = _swap_in_wrong_programs(honest_submission, tmp_path)
    check_run(run_dir, allow_interpret=True)  # the builder's rules cannot tell
    before = testing.tree_hash(built / "data", built / "dataset_card.md")
    with StandInHub() as hub:
        assert _submit(env, capsys, hub, run_dir)[0] == 0
        code, out, err = _review(env, capsys, hub, built, "--pr", "1", "--build")
    run_id = json.loads((run_dir / "environment.json").read_text())["run_id"]
    assert code == 1 and out.startswith(f"#1 {run_id}: refused: [regrade] its programs, regraded on seed ")
    assert "timed-shapes" in out and "(the submitted scorecard is not trusted)" in out
    assert testing.tree_hash(built / "data", built / "dataset_card.md") == before


def test_programs_for_another_platform_or_a_broken_run_are_one_line_refusals_not_a_crash(tmp_path):
    """A TPU run's programs cannot run on this CPU: refused, said where to regrade it; anything else a
    hostile run makes the regrade raise is its refusal too (review goes on with the next run)."""
    tpu, broken = tmp_path / "tpu", tmp_path / "broken"
    for folder, submission in ((tpu, {"platform": "tpu", "programs": []}), (broken, {"platform": "cpu"})):
        folder.mkdir()
        (folder / "correctness.json").write_text(json.dumps({"submission": submission}))
        (folder / "benchmark.json").write_text("{}")
    out = R.regrade_here({"tpu": tpu, "broken": broken})
    assert out["tpu"] == ("[regrade] its programs cannot be regraded: its programs target tpu and this machine is "
                          "cpu: regrade it where they run (review --scheduler ADDRESS of workers with that device)")
    assert out["broken"].startswith("[regrade] its regrade failed: KeyError: ")
