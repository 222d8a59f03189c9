"""The facts the documents state are the code's and the data's: enumerated values against the release's rows,
the numbers a kernel author relies on (tolerance, limits, shapes, the export's allow-list) against the
constants that enforce them, documented timings against the latest measurement, documented import paths
against what imports, and no release version typed where it should be read. Each check has a twin that
shows it failing on a wrong document."""

from __future__ import annotations

import contextlib
import glob
import importlib
import io
import json
import math
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from doc_blocks import REPO, user_documents
from tpu_kernel_records_tools.bench.profiles import PROFILES, SCOPES
from tpu_kernel_records_tools.builder import card
from tpu_kernel_records_tools.grading import export, tolerance
from tpu_kernel_records_tools.grading.dense.slots import HEAD_DIMS, ODD_HEAD_DIMS
from tpu_kernel_records_tools.grading.paged.slots import ODD_PAGE_SIZES, PAGE_SIZES
from tpu_kernel_records_tools.grading.runner import DEFAULT_TIME_LIMIT_S
from tpu_kernel_records_tools.kaggle_runner import run_kaggle
from tpu_kernel_records_tools.records.columns import COLUMNS, NEVER
from tpu_kernel_records_tools.records.schema import CONFIG_NAMES, VERSION
from tpu_kernel_records_tools.sandbox.sandbox import DEFAULT_MEMORY_LIMIT_GB

SUBMITTING = REPO / "docs" / "SUBMITTING.md"
# Columns whose description lists every value they may hold, each in backticks.
ENUMERATED = {"benchmark": ("source", "platform", "profile", "scope", "implementation", "status", "dtype",
                            "device_kind"),
              "correctness": ("source", "row_kind", "kind", "expected", "contract", "isolation", "memory_limit"),
              "environment": ("source", "platform", "profile", "device_kind")}


def _tables() -> dict[str, list[dict]]:
    return {name: pq.ParquetDataset(sorted(glob.glob(str(REPO / "data" / name / "*.parquet")))).read().to_pylist()
            for name in CONFIG_NAMES}


def undocumented_values(tables: dict[str, list[dict]], columns=COLUMNS) -> list[str]:
    """``config.column: value`` for every value the data holds that the column's description does not name."""
    problems = []
    for name, enumerated in ENUMERATED.items():
        for column in enumerated:
            meaning = columns[name][column][1]
            values = {str(row[column]).split("@")[0] for row in tables[name] if row[column] is not None}
            problems += [f"{name}.{column}: {v}" for v in sorted(values) if f"`{v}`" not in meaning]
    return problems


def nulls_where_never(tables: dict[str, list[dict]], columns=COLUMNS) -> list[str]:
    """``config.column`` for every column documented as never null that holds a null."""
    return [f"{name}.{column}" for name in CONFIG_NAMES for column, (_, _, null) in columns[name].items()
            if null.startswith(NEVER) and any(row[column] is None for row in tables[name])]


def test_every_value_in_the_data_is_one_its_column_documents():
    tables = _tables()
    assert undocumented_values(tables) == [] and nulls_where_never(tables) == []
    wrong = {name: {c: (u, m.replace("`grader-power`", "grader-power"), n) for c, (u, m, n) in cols.items()}
             for name, cols in COLUMNS.items()}
    wrong["environment"]["measured_candidate"] = ("—", "the candidate", NEVER)
    tables["environment"].append({**tables["environment"][0], "measured_candidate": None})
    assert "environment.profile: grader-power" in undocumented_values(tables, wrong)
    assert "environment.measured_candidate" in nulls_where_never(tables, wrong)


def test_every_scope_and_profile_the_code_runs_is_documented():
    assert [s for s in SCOPES if f"`{s}`" not in COLUMNS["benchmark"]["scope"][1]] == []
    assert [p for p in PROFILES if f"`{p}`" not in COLUMNS["benchmark"]["profile"][1]] == []


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:end if end > 0 else len(text)]


def test_submitting_states_the_numbers_the_code_enforces():
    guide = SUBMITTING.read_text()
    numbers = _section(guide, "## The tolerance, in numbers")
    assert f"`k = {tolerance.K_FORWARD:g}` for the output" in numbers
    assert f"`k = {tolerance.K_GRADIENT:g}` for dQ, dK and dV" in numbers
    assert f"floor = {tolerance.FLOOR_EPS:g} * eps(float32) * max(1, L)" in numbers
    assert f"`eps(float32) = 2**{round(math.log2(tolerance.EPS['float32']))}`" in numbers
    named = {r for r in tolerance.ALLOWED_ROUNDINGS if r != "reference"}
    assert named == {r for r in re.findall(r"`([a-z-]+)`", numbers) if r in tolerance.ALLOWED_ROUNDINGS}
    requirements = _section(guide, "## Kernel requirements")
    assert f"`--timeout` (default {DEFAULT_TIME_LIMIT_S:g} s)" in requirements
    assert f"`--memory-limit` (default {DEFAULT_MEMORY_LIMIT_GB:g} GiB)" in requirements
    assert f"budget of {export.EXPORT_LIMIT_S:g} s" in requirements
    assert f"exceed {export.PROGRAM_LIMIT_BYTES >> 20} MiB" in requirements
    allowed = re.search(r"outside the allow-list:(.*?);", requirements, re.S).group(1)
    assert set(re.findall(r"`([^`]+)`", allowed)) == set(export.ALLOWED_CUSTOM_CALLS)
    assert f"head_dim {', '.join(map(str, HEAD_DIMS))} and one of\n  {', '.join(map(str, ODD_HEAD_DIMS))}" \
        in requirements
    assert f"page sizes {', '.join(map(str, PAGE_SIZES))} and {', '.join(map(str, ODD_PAGE_SIZES))}" \
        in requirements.replace("\n  ", " ")


def test_the_kaggle_install_is_the_runners_fallback():
    fallback = run_kaggle.ATTEMPTS[-1].pip_args
    guide = SUBMITTING.read_text()
    assert f'python -m pip install "{fallback[0]}" -f {run_kaggle.LIBTPU_RELEASES}' in guide


def _time_grade() -> dict:
    return json.loads((REPO / "scripts" / "time_grade.json").read_text())["levels"]


def _report_costs() -> tuple[float, float, float]:
    report = (REPO / "calibration" / "REPORT.md").read_text()
    m = re.search(r"([\d.]+) per trial of a pure-JAX candidate \(([\d.]+) on a slot group's first seed, which "
                  r"compiles; ([\d.]+) on the other seeds\)", report)
    return float(m[1]), float(m[2]), float(m[3])


def _documented_timings() -> list[tuple[str, float, float]]:
    """(claim, documented, latest measured) for each timing the documents state."""
    readme, guide = (REPO / "README.md").read_text(), SUBMITTING.read_text()
    developing = (REPO / "docs" / "DEVELOPING.md").read_text()
    measured = _time_grade()
    quick_readme = re.search(r"--quick +# about ([\d.]+) CPU-seconds", readme)
    quick = re.search(r"`--quick` grades on four small fixed shapes \(about ([\d.]+) CPU-seconds", guide)
    full = re.search(r"the full level draws problems at the sizes models run \(about ([\d.]+)\s+CPU-seconds", guide)
    walls = re.search(r"Wall time grows with how busy the machine is: about ([\d.]+) min and ([\d.]+) min", guide)
    cost = re.search(r"Cost: about ([\d.]+) CPU-seconds per candidate and seed at the full level\s+\(the first "
                     r"seed of a group compiles: ([\d.]+); the others ([\d.]+)\)", developing)
    per_trial, first, other = _report_costs()
    return [("README quick grade", float(quick_readme[1]), measured["quick"]["cpu_s"]),
            ("SUBMITTING quick grade", float(quick[1]), measured["quick"]["cpu_s"]),
            ("SUBMITTING full grade", float(full[1]), measured["full"]["cpu_s"]),
            ("SUBMITTING quick grade's wall time", 60 * float(walls[1]), measured["quick"]["wall_s"]),
            ("SUBMITTING full grade's wall time", 60 * float(walls[2]), measured["full"]["wall_s"]),
            ("DEVELOPING calibration trial", float(cost[1]), per_trial),
            ("DEVELOPING calibration first seed", float(cost[2]), first),
            ("DEVELOPING calibration other seeds", float(cost[3]), other)]


def off_by_more_than_twice(claims: list[tuple[str, float, float]]) -> list[str]:
    return [f"{what}: documented {doc:g}, measured {got:g}" for what, doc, got in claims
            if not got / 2 <= doc <= 2 * got]


def test_documented_timings_are_within_twice_the_latest_measurement():
    claims = _documented_timings()
    assert off_by_more_than_twice(claims) == []
    assert all(code == 0 for code in (v["exit_code"] for v in _time_grade().values()))
    assert off_by_more_than_twice([("quick", 5, 11.4)]) and off_by_more_than_twice([("quick", 23, 11.4)])
    assert not off_by_more_than_twice([("quick", 11, 11.4)])


_DOTTED = re.compile(r"`((?:kernel_src|tpu_kernel_records_tools|tpu_kernel_records)(?:[.:][A-Za-z_]\w*)+)`")
_BARE = re.compile(r"\b((?:kernel_src|tpu_kernel_records_tools)(?:\.[A-Za-z_]\w*)+)")
_FILE = re.compile(r"`((?:kernel_src|tpu_kernel_records_tools|scripts|tests|examples|docs|calibration|data)/"
                   r"[\w./-]*\.(?:py|md|json|jsonl))`")


def unresolved(dotted: str) -> str | None:
    """None when ``a.b.c`` (or ``a.b:c``) is a module or an attribute reached from one, else why not."""
    parts = dotted.replace(":", ".").split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(target, name):
                return f"{'.'.join(parts[:cut])} has no {'.'.join(parts[cut:])}"
            target = getattr(target, name)
        return None
    return f"no module {parts[0]}"


def _rubric_list() -> str:
    from tpu_kernel_records_tools.cli import rubric

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert rubric.main(["--list"]) == 0
    return out.getvalue()


def test_documented_import_paths_import_and_named_files_exist():
    texts = {p.relative_to(REPO).as_posix(): p.read_text() for p in user_documents()}
    texts["tpu_kernel_records.py"] = (REPO / "tpu_kernel_records.py").read_text()
    problems = [f"tpu-kernel-rubric --list: {why}" for name in sorted(set(_BARE.findall(_rubric_list())))
                if (why := unresolved(name))]
    for where, text in texts.items():
        dotted = {name for name in _DOTTED.findall(text) if not name.endswith((".py", ".md", ".json"))}  # files
        problems += [f"{where}: {why}" for name in sorted(dotted) if (why := unresolved(name))]
        problems += [f"{where}: no file {f}" for f in sorted(set(_FILE.findall(text))) if not (REPO / f).exists()]
    assert problems == []
    assert unresolved("kernel_src.reference_attention") is None
    assert unresolved("kernel_src.reference:reference_paged_attention") is None
    assert unresolved("kernel_src.reference_paged_atention") and unresolved("kernel_src.no_such_module.x")


_TAG = re.compile(r"(?<![\w.])v\d+\.\d+\.\d+\b")


def typed_versions(text: str) -> list[str]:
    """Release versions typed into ``text``: a ``vX.Y.Z`` tag or the release version itself in quotes."""
    return _TAG.findall(text) + re.findall(rf'"{re.escape(VERSION)}"', text)


def test_no_release_version_is_typed_where_it_is_read():
    texts = {p.relative_to(REPO).as_posix(): p.read_text() for p in user_documents()}
    texts["dataset_card.md"] = card.replace(texts["dataset_card.md"], {"usage": ""})  # generated from the TAG
    loader = (REPO / "tpu_kernel_records.py").read_text()
    texts["tpu_kernel_records.py"] = re.sub(r'(?m)^VERSION_STRING = "[^"]*".*$', "", loader)  # kept by a test
    found = {where: typed_versions(text) for where, text in texts.items() if typed_versions(text)}
    assert found == {}
    assert typed_versions(f'revision="v{VERSION}"') and typed_versions(f'VERSION = "{VERSION}"')
    assert not typed_versions("one tag `vX.Y.Z`; JAX 0.6.2")


def test_the_grade_subcommand_takes_the_rubrics_folder_bounds():
    """``tpu-kernel-records grade`` shares the rubric's options; a candidate's folder bounds among them."""
    from tpu_kernel_records_tools.cli import main as records_cli
    from tpu_kernel_records_tools.sandbox import candidate_files

    args = records_cli.build_parser().parse_args(
        ["grade", "--candidate", "examples/simple_attention.py:attention", "--candidate-max-files", "7"])
    candidate_files.apply_arguments(args)
    assert args.candidate_max_files == 7
    candidate_files.apply_arguments(records_cli.build_parser().parse_args(["grade", "--candidate", "reference"]))


@pytest.mark.parametrize("path", [SUBMITTING], ids=lambda p: p.name)
def test_submitting_has_the_sections_a_kernel_author_needs(path: Path):
    headings = set(re.findall(r"(?m)^#{2,3} (.+)$", path.read_text()))
    assert {"The dense contract", "The paged contract", "Kernel requirements", "The export refusals",
            "The tolerance, in numbers", "The licence of a submission"} <= headings


def about_minutes(seconds: float) -> str:
    """``seconds`` to the nearest half minute, as the README writes it ("5", "4½")."""
    halves = round(seconds / 30)
    return f"{halves // 2}{'½' if halves % 2 else ''}"


def test_the_default_runs_documented_time_is_the_recorded_one():
    """README's and DEVELOPING's time of the default run (``pytest``) is the one ``scripts/time_tests.py --record``
    measured, not typed, and within the 5 minutes DEVELOPING sets."""
    record = json.loads((REPO / "scripts" / "time_tests.json").read_text())
    assert record["command"] == ["pytest"] and not any(record["exit_codes"])
    wall, cpu = record["median_wall_s"], record["median_cpu_s"]
    developing = " ".join((REPO / "docs" / "DEVELOPING.md").read_text().split())
    assert (f"`python scripts/time_tests.py --record scripts/time_tests.json`, from a fresh clone on an otherwise "
            f"idle machine, measured {wall:.0f} s of wall time and {cpu:.0f} CPU-seconds on {record['machine']}."
            ) in developing
    assert "It must stay within 5 minutes on 2 CPU cores" in developing and wall <= 300
    readme = " ".join((REPO / "README.md").read_text().split())
    assert f"default run (slow tests left out): about {about_minutes(wall)} minutes on 2 CPU cores." in readme
    assert [about_minutes(s) for s in (287, 270, 331)] == ["5", "4½", "5½"]
