"""Every command the user documentation shows (README.md, docs/, the dataset card) is run or checked, so
a renamed module, subcommand or flag fails this suite instead of a user; and the documents keep what
the guides promise: a command per path on README's first screen, every column and every acceptance
rule explained, no commit hash or load average. The load snippets run in ``tests/test_loading.py``."""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.metadata
import importlib.util
import io
import re
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from doc_blocks import PYTHON, REPO, Block, SCRIPTS, SHELL, blocks, inline_commands, shell_commands, user_documents
from tpu_kernel_records_tools.builder import fields
from tpu_kernel_records_tools.cli import main as records_cli
from tpu_kernel_records_tools.cli import rubric as rubric_cli
from tpu_kernel_records_tools.sandbox import isolation
from tpu_kernel_records_tools.records.columns import COLUMNS
from tpu_kernel_records_tools.records.schema import CONFIG_NAMES, FEATURES

EXTRAS = set(importlib.metadata.metadata("tpu-kernel-records").get_all("Provides-Extra") or ())
WRAPPERS = {"sudo", "nohup", "nice"}
OTHER_COMMANDS = {"python", "pytest", "kaggle", "sudo", "apt-get", "dnf", "sysctl", "dask", "hf"}
OWN_MODULES = ("tpu_kernel_records", "kernel_src")  # a from-import of these must name something that exists
EXAMPLE = "examples/simple_attention.py:attention"
RAGGED_EXAMPLE = "examples/ragged_kernel.py:ragged_paged_attention"
CHEAP = {"--help", "-h", "--version", "--list"}


def _parse(script: str, args: list[str]) -> str | None:
    """None when the project's own parser accepts ``args`` (running --help, --version or --list), else why not."""
    parser = records_cli.build_parser() if script == SCRIPTS[0] else rubric_cli._parser()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            parser.parse_args(args)
        except SystemExit as e:
            return None if e.code == 0 and out.getvalue() else (err.getvalue().strip() or f"exit {e.code}")
        if "--list" in args:
            return None if rubric_cli.main(args) == 0 and out.getvalue() else "--list failed"
    return None


def _imports(code: str) -> list[str]:
    """Problems with the modules and names ``code`` imports (nothing is imported from outside the project)."""
    problems = []
    for node in ast.walk(ast.parse(code)):
        names = [(a.name, None) for a in node.names] if isinstance(node, ast.Import) else (
            [(node.module, a.name) for a in node.names] if isinstance(node, ast.ImportFrom) else [])
        for module, name in names:
            if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
                problems.append(f"no module {module}")
            elif name and module.startswith(OWN_MODULES) and not hasattr(importlib.import_module(module), name):
                problems.append(f"{module} has no {name}")
    return problems


def _path_problems(args: list[str]) -> list[str]:
    """Repository paths an argument names (``examples/x.py:fn`` included) that do not exist."""
    tops = {p.name for p in REPO.iterdir()}
    paths = [a.split(":")[0] for a in args if "/" in a and a.split("/")[0] in tops and "://" not in a]
    return [f"no such path {p}" for p in paths if not (REPO / p).exists()]


def _python(args: list[str]) -> list[str]:
    if args[:2] == ["-m", "pip"]:
        wanted = [e for a in args if a.startswith(".[") for e in a[2:-1].split(",")]
        return [f"no extra {e!r} in pyproject.toml" for e in wanted if e not in EXTRAS]
    if args[:1] == ["-m"]:
        return [] if importlib.util.find_spec(args[1]) else [f"no module {args[1]}"]
    if args[:1] == ["-c"]:
        return _imports(args[1])
    script = REPO / args[0]
    if not script.is_file():
        return [f"no script {args[0]}"]
    source = script.read_text()
    return [f"{args[0]} has no option {a}" for a in args[1:] if a.startswith("--") and f'"{a}"' not in source]


def check(argv: list[str], markers: set[str] = frozenset({"slow"})) -> list[str]:
    """Why a documented command would not run as written (empty: it would, as far as can be told
    without running it); a --help, --version or --list of the project's commands is run. ``markers``:
    pytest's registered markers."""
    while argv and argv[0] in WRAPPERS:  # sudo, nohup, nice [-n N]: the command they run is what counts
        argv = argv[3:] if argv[0] == "nice" and argv[1:2] == ["-n"] else argv[1:]
    command, args = argv[0], argv[1:]
    problems = _path_problems(args)
    if command in SCRIPTS:
        reason = _parse(command, args)
        problems += [reason] if reason else []
    elif command == "python":
        problems += _python(args)
    elif command == "pytest":
        problems += [f"no marker {m}" for i, m in enumerate(args[1:], 1)
                     if args[i - 1] == "-m" and m.strip("'\"") and m.strip("'\"") not in markers]
    elif command not in OTHER_COMMANDS:
        problems.append(f"unknown command {command!r}")
    return problems


def _documented() -> list[tuple[str, list[str]]]:
    found = [(b.where(), argv) for b in blocks(SHELL) for argv in shell_commands(b)]
    return found + inline_commands()


def test_the_console_scripts_are_installed():
    installed = {ep.name for ep in importlib.metadata.entry_points(group="console_scripts")}
    assert set(SCRIPTS) <= installed


def test_every_documented_command_would_run_as_written(pytestconfig):
    markers = {m.split(":")[0] for m in pytestconfig.getini("markers")}
    documented = _documented()
    assert len(documented) > 40  # the collector found the documents' commands
    problems = [f"{where}: {' '.join(argv)}: {p}" for where, argv in documented for p in check(argv, markers)]
    assert problems == []


def test_the_checker_catches_a_renamed_flag_module_path_and_command():
    assert check(["tpu-kernel-records", "build", "--allow-interpet"])
    assert check(["tpu-kernel-records", "bild"])
    assert check(["tpu-kernel-rubric", "--candidate", "examples/missing.py:attention"])
    assert check(["python", "-c", "from tpu_kernel_records_tools.records.rawio import read_runs"])
    assert check(["python", "-c", "from measure.rawio import read_run"])
    assert check(["python", "-m", "pip", "install", "-e", ".[devel]"])
    assert check(["python", "scripts/mutation.py", "--sampel", "5"])
    assert check(["pytest", "-m", "slowly"])
    assert check(["tpu-kernel-record", "--help"])
    assert not check(["tpu-kernel-records", "measure", "--help"])


def test_a_background_command_is_checked_as_the_command_it_runs():
    """nohup, nice -n N and redirections wrap the command; a typo inside them is still caught."""
    def argv(line):
        return shell_commands(Block(REPO / "README.md", 1, "bash", line))

    assert argv("nohup nice -n 19 tpu-kernel-records calibrate --resume > log 2>&1 &") == [
        ["nohup", "nice", "-n", "19", "tpu-kernel-records", "calibrate", "--resume"]]
    assert not check(argv("nohup nice -n 19 tpu-kernel-records calibrate --resume > log 2>&1 &")[0])
    assert check(argv("nohup nice -n 19 tpu-kernel-records calibrate --resme > log 2>&1 &")[0])
    assert check(argv("nice -n 19 tpu-kernel-record --help")[0])


def test_every_python_block_compiles_and_imports_what_exists():
    found = blocks(PYTHON)
    assert found
    problems = [f"{b.where()}: {p}" for b in found for p in _imports(b.text)]
    assert problems == []


def test_readme_offers_a_command_per_path_on_its_first_screen():
    first = (REPO / "README.md").read_text().splitlines()[:40]
    rows = [line for line in first if line.startswith("| ") and "`" in line and "---" not in line]
    paths = ("load the data", "add a record", "grade or submit", "release a version", "develop")
    assert [p for p in paths if not any(line.startswith(f"| {p}") for line in rows)] == []


def test_readme_says_which_kinds_of_record_the_data_does_not_hold_yet():
    present = {r for p in (REPO / "data" / "environment").glob("*.parquet")
               for r in pq.read_table(p, columns=["source"]).column("source").to_pylist()}
    [line] = [line for line in (REPO / "README.md").read_text().splitlines() if "Not yet in the data" in line]
    sources = {"measured", "submitted", "published-summary", "grader-power"}  # the raw schemas' enum
    assert set(re.findall(r"`([a-z-]+)`", line)) & sources == sources - present


@pytest.mark.parametrize("path", user_documents(), ids=lambda p: p.name)
def test_user_documents_carry_no_commit_hash_or_load_average(path):
    text = path.read_text()
    hashes = [h for h in re.findall(r"(?<![0-9A-Za-z.,-])[0-9a-f]{7,40}(?![0-9A-Za-z.,-])", text)
              if re.search(r"[0-9]", h)]  # 8302239 or e8ff143; not 4.76837158203125e-07, 1,816 or a sha256
    assert hashes == [] and "load average" not in text.lower()


def test_submitting_explains_every_acceptance_rule():
    source = "".join(p.read_text() for folder in ("builder", "records")
                     for p in (REPO / "tpu_kernel_records_tools" / folder).glob("*.py"))
    rules = set(re.findall(r'(?:RunError|BuildError|_fail)\(\s*"([a-z0-9-]+)"', source))
    assert len(rules) > 30
    guide = (REPO / "docs" / "SUBMITTING.md").read_text()
    assert sorted(r for r in rules if f"`{r}`" not in guide) == []


def test_a_column_without_a_description_fails_the_card(monkeypatch):
    assert fields.undescribed() == []
    empty = {name: pa.Table.from_pylist([], schema=FEATURES[name]) for name in CONFIG_NAMES}
    assert "`output_checks`" in fields.section(empty)
    monkeypatch.delitem(COLUMNS["benchmark"], "output_checks")
    with pytest.raises(ValueError, match=r"benchmark\.output_checks: no description"):
        fields.section(empty)


def _grade_example(tmp_path, monkeypatch, capsys, *extra: str, example: str = EXAMPLE) -> tuple[int, str]:
    """The documented grade of the example kernel, its argv as written, in a fresh folder holding examples/
    (in this process: the console script is ``rubric.main``, checked above)."""
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    status = rubric_cli.main(["--candidate", example, *extra])
    return status, capsys.readouterr().out


@pytest.mark.skipif(isolation.unavailable_reason() is not None, reason="bubblewrap cannot run here")
def test_the_example_kernel_passes_the_quick_grade_as_documented(tmp_path, monkeypatch, capsys):
    assert any(EXAMPLE in argv and "--quick" in argv for _, argv in _documented())
    status, out = _grade_example(tmp_path, monkeypatch, capsys, "--quick", "--quiet")
    assert status == 0 and "PASSED 100/100" in out and "isolation: bubblewrap" in out, out[-3000:]


@pytest.mark.slow
@pytest.mark.skipif(isolation.unavailable_reason() is not None, reason="bubblewrap cannot run here")
def test_the_example_kernel_passes_the_full_rubric(tmp_path, monkeypatch, capsys):
    assert any(argv[-2:] == ["--candidate", EXAMPLE] for _, argv in _documented())
    status, out = _grade_example(tmp_path, monkeypatch, capsys, "--quiet")
    assert status == 0 and "PASSED 100/100" in out and "isolation: bubblewrap" in out, out[-3000:]


@pytest.mark.slow
@pytest.mark.skipif(isolation.unavailable_reason() is not None, reason="bubblewrap cannot run here")
def test_the_ragged_example_passes_the_quick_grade_as_documented(tmp_path, monkeypatch, capsys):
    documented = ["tpu-kernel-rubric", "--ragged", "--candidate", RAGGED_EXAMPLE, "--quick"]
    assert documented in [argv for _, argv in _documented()]
    status, out = _grade_example(tmp_path, monkeypatch, capsys, "--ragged", "--quick", "--quiet",
                                 example=RAGGED_EXAMPLE)
    assert status == 0 and re.search(r"PASSED (\d+)/\1 \(isolation: bubblewrap; features: window, softcap, sinks, "
                                     r"quantized_kv\)", out), out[-3000:]
