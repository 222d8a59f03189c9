"""Mutation testing of the code whose mistakes would make a verdict or a number wrong.

For each module below, cosmic-ray (``pip install -e ".[mutation]"``) lists every mutant (one small
edit: an operator, a comparison, a number +-1, a boolean, a keyword, a loop that never runs, ...);
this script draws a seeded random sample of them, runs the module's fast tests against each mutant
in a private copy of the working tree (nothing under the checkout is ever edited), and prints killed /
survived / timed out per module. A mutant is *killed* when its tests fail, *timed out* when they run
past the module's time limit (counted as detected, reported apart), *survived* when they pass.

    python scripts/mutation.py                        # the documented sample (seed 0), about 30 min on 2 cores
    python scripts/mutation.py --modules tolerance --sample 5 --jobs 1     # a quick look
    python scripts/mutation.py --write tests/MUTATION.md                   # the committed report

Mutants inside type annotations are left out before sampling (``from __future__ import annotations``:
never evaluated). A surviving mutant that changes no observable behaviour is listed in ``EQUIVALENT``
below with one line on why; the score counts only the others:
``(killed + timed out) / (sampled - equivalent)``. Not part of ``.ci/run``.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# -n 0: the jobs are the parallelism; -m "": a target names its test files, slow ones included
PYTEST = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-n", "0", "-m", ""]


@dataclass(frozen=True)
class Target:
    """A module to mutate, the tests that judge its mutants, and how many mutants to draw."""

    name: str
    path: str
    tests: tuple[str, ...]
    sample: int


PKG = "tpu_kernel_records_tools"
TARGETS = {t.name: t for t in (
    Target("tolerance", f"{PKG}/grading/tolerance.py", ("tests/test_tolerance_policy.py",), 20),
    Target("truth", f"{PKG}/grading/dense/truth.py", ("tests/test_truth.py", "tests/test_truth_features.py"), 20),
    Target("paged-truth", f"{PKG}/grading/paged/truth.py", ("tests/test_paged_truth.py",), 8),
    Target("paged-checks", f"{PKG}/grading/paged/checks.py", ("tests/test_paged_grading.py",), 8),
    Target("ragged-truth", f"{PKG}/grading/ragged/truth.py", ("tests/test_ragged_truth.py",), 8),
    Target("ragged-checks", f"{PKG}/grading/ragged/checks.py", ("tests/test_ragged_grading.py",), 8),
    Target("features", f"{PKG}/grading/dense/feature_checks.py",
           ("tests/test_features_grading.py", "tests/test_feature_builtins.py"), 12),
    Target("reference", "kernel_src/reference.py", ("tests/test_reference_grade.py",), 12),
    Target("checks", f"{PKG}/grading/dense/checks.py", ("tests/test_peaky_problem.py", "tests/test_check_details.py",
                                                "tests/test_checks_quick.py", "tests/test_grader_speed.py",
                                                "tests/test_stored_output_rounding.py", "tests/test_calibration.py"),
           20),
    Target("calibration", f"{PKG}/sweeps/calibration.py", ("tests/test_calibration.py",), 20),
    Target("rules", f"{PKG}/builder/rules.py",
           ("tests/test_rule_refusals.py", "tests/test_rule_refusals_compiled_tpu.py"), 20),
    Target("submitted", f"{PKG}/builder/submitted.py",
           ("tests/test_submitted.py", "tests/test_stranger_rules.py", "tests/test_submitted_ragged.py"), 8),
    Target("derive", f"{PKG}/builder/derive.py", ("tests/test_rule_refusals.py", "tests/test_verify.py"), 8),
    Target("verify", f"{PKG}/builder/verify.py", ("tests/test_verify.py",), 8),
    Target("stats", f"{PKG}/bench/stats.py", ("tests/test_stats_guarantees.py", "tests/test_stats.py"), 12),
    Target("secrets", f"{PKG}/records/secrets.py", ("tests/test_secrets_guarantees.py", "tests/test_environment.py",
                                                    "tests/test_verify.py"), 12),
)}

# Surviving mutants that change no observable behaviour: (path, original line, mutated line) -> why.
# Lines are compared with surrounding whitespace stripped.
_DENOM = ("the softmax denominator is 0 (no visible key) or >= 1 (the row max contributes exp(0) = 1 and the "
          "other terms are >= 0), so `> 0` and `> 1` pick the same divisor")
_EMPTY = ("e is exactly 0 on every key of a row whose denominator is 0 (no visible key), so any nonzero divisor "
          "there gives the same exact zeros")
ORACLE = "tpu_kernel_records_tools/grading/dense/truth.py"
_NON_DECREASING = "the contract keeps cu_q_lens non-decreasing up to num_seqs, so end < start never reaches the truth"
EQUIVALENT: dict[tuple[str, str, str], str] = {
    (f"{PKG}/grading/dense/checks.py", "group = p.q.shape[2] // p.k.shape[2]", "group = p.q.shape[2] / p.k.shape[2]"):
        "the contract's query heads are a multiple of its kv heads, and np.repeat takes the integral float",
    (f"{PKG}/grading/tolerance.py", "scale_max = float(magnitude.max()) if magnitude.size else 0.0",
     "scale_max = float(magnitude.max()) if magnitude.size else 1.0"):
        "an empty tensor's worst error is 0, and 0 divided by any positive scale is 0",
    (ORACLE, "p = e / np.where(denom > 0, denom, 1.0)", "p = e / np.where(denom > 0, denom, 2.0)"): _EMPTY,
    (ORACLE, "return e / np.where(denom > 0, denom, 1.0)",
     "return e / np.where(denom > 0, denom, 2.0)"): _EMPTY,
    (ORACLE, "p = np.divide(e, np.where(denom > 0, denom, 1.0), out=e)",
     "p = np.divide(e, np.where(denom > 0, denom, 2.0), out=e)"): _EMPTY,
    (ORACLE, "p = np.divide(e, np.where(denom > 0, denom, 1.0), out=e)",
     "p = np.divide(e, np.where(denom > 1, denom, 1.0), out=e)"): _DENOM,
    (f"{PKG}/grading/tolerance.py", "REFERENCE_ERRORS_KEPT = 4096", "REFERENCE_ERRORS_KEPT = 4095"):
        "how many reference errors stay remembered: the size of a cache, on which no verdict depends",
    (f"{PKG}/grading/ragged/truth.py", "if end <= start:", "if end == start:"): _NON_DECREASING,
    (f"{PKG}/grading/ragged/truth.py", "if end <= start:", "if end is start:"):
        "an empty sequence then goes through the dense truth with no rows, which writes nothing and leaves "
        "logit_max as it is (max(x, nan) is x); end < start cannot happen: " + _NON_DECREASING,
    ("kernel_src/reference.py", "return p / jnp.where(denom > 0, denom, 1.0)",
     "return p / jnp.where(denom > 0, denom, 2.0)"): _EMPTY,
    (ORACLE, "p = e / np.where(denom > 0, denom, 1.0)", "p = e / np.where(denom > 1, denom, 1.0)"): _DENOM,
    (ORACLE, "return e / np.where(denom > 0, denom, 1.0)",
     "return e / np.where(denom > 1, denom, 1.0)"): _DENOM,
    ("kernel_src/reference.py", "return p / jnp.where(denom > 0, denom, 1.0)",
     "return p / jnp.where(denom > 1, denom, 1.0)"): _DENOM,
    ("tpu_kernel_records_tools/builder/rules.py", 'if benchmark["source"] == "measured":',
     'if benchmark["source"] <= "measured":'):
        "only 'measured' and 'published-summary' reach this line (the schema's third source, grader-power, "
        "returned earlier, and the consistency rule makes the benchmark's source the environment's), and "
        "'published-summary' > 'measured'",
    ("tpu_kernel_records_tools/builder/derive.py", 'message = str(e).split(": ", 1)[-1]', 'message = str(e).split(": ", 1)[1]'):
        "a RunError's text is always '[rule] where: message', so the split has exactly two parts and [1] is [-1]",
}


@dataclass
class Mutant:
    job_id: str
    operator: str
    occurrence: int
    line: int
    before: str = ""
    after: str = ""
    outcome: str = "pending"  # killed | timed out | survived | skipped
    why_equivalent: str | None = None


@dataclass
class Result:
    target: Target
    total: int = 0
    annotation: int = 0
    baseline_s: float = 0.0
    mutants: list[Mutant] = field(default_factory=list)
    error: str | None = None
    wall_s: float = 0.0

    def count(self, outcome: str) -> int:
        return sum(m.outcome == outcome and not m.why_equivalent for m in self.mutants)

    @property
    def equivalent(self) -> int:
        return sum(bool(m.why_equivalent) for m in self.mutants)

    @property
    def score(self) -> float | None:
        judged = len(self.mutants) - self.equivalent
        return None if not judged else (self.count("killed") + self.count("timed out")) / judged


def tree_files(root: Path) -> list[str]:
    """Tracked and untracked-but-not-ignored files: what the working tree holds now."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, check=True,
                         capture_output=True).stdout.decode()
    return [p for p in out.split("\0") if p and (root / p).is_file()]


def copy_tree(dest: Path) -> Path:
    for rel in tree_files(REPO):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, target)
    return dest


def annotation_spans(source: str) -> list[tuple[int, int, int, int]]:
    """``(line, col, end_line, end_col)`` of every annotation (arguments, returns, annotated assignments)."""
    spans = []
    for node in ast.walk(ast.parse(source)):
        anns = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            anns.append(node.returns)
            a = node.args
            anns += [x.annotation for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if x]
        elif isinstance(node, ast.AnnAssign):
            anns.append(node.annotation)
        spans += [(n.lineno, n.col_offset, n.end_lineno, n.end_col_offset) for n in anns if n is not None]
    return spans


def _inside(pos: tuple[int, int], spans) -> bool:
    line, col = pos
    return any((l0, c0) <= (line, col) < (l1, c1) for l0, c0, l1, c1 in spans)


def _env(copy: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update(PYTHONPATH=str(copy), JAX_PLATFORMS=env.get("JAX_PLATFORMS", "cpu"), PYTHONDONTWRITEBYTECODE="1")
    return env


def _cosmic(copy: Path, *args: str) -> None:
    exe = Path(sys.executable).with_name("cosmic-ray")
    command = [str(exe)] if exe.exists() else [sys.executable, "-c", "from cosmic_ray.cli import main; main()"]
    subprocess.run([*command, *args], cwd=copy, env=_env(copy), check=True, capture_output=True)


def run_target(target: Target, seed: int, sample: int, workdir: Path, timeout_factor: float, log) -> Result:
    result = Result(target)
    start = time.monotonic()
    copy = copy_tree(workdir / target.name)
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

    test_command = [*PYTEST, *target.tests]
    t0 = time.monotonic()
    clean = subprocess.run(test_command, cwd=copy, env=_env(copy), capture_output=True, text=True)
    result.baseline_s = time.monotonic() - t0
    if clean.returncode != 0:
        tail = (clean.stdout + clean.stderr).strip().splitlines()[-3:]
        result.error = f"the tests fail without any mutant: {' / '.join(tail)}"
        log(f"{target.name}: not run, {result.error}")
        return result
    timeout = max(60.0, timeout_factor * result.baseline_s)
    config = copy / "mutation.toml"
    config.write_text(
        "[cosmic-ray]\n"
        f'module-path = "{target.path}"\n'
        f"timeout = {timeout:.0f}\n"
        "excluded-modules = []\n"
        f"test-command = {json.dumps(shlex.join(test_command))}\n\n"
        '[cosmic-ray.distributor]\nname = "local"\n')
    db_path = copy / "mutation.sqlite"
    _cosmic(copy, "init", str(config), str(db_path))

    source = (copy / target.path).read_text()
    spans = annotation_spans(source)
    lines = source.splitlines()
    with use_db(str(db_path), WorkDB.Mode.open) as db:
        items = sorted(db.work_items, key=lambda w: (w.mutations[0].start_pos, w.mutations[0].end_pos,
                                                    w.mutations[0].operator_name, w.mutations[0].occurrence))
        result.total = len(items)
        eligible = []
        for item in items:
            m = item.mutations[0]
            if _inside(m.start_pos, spans):
                result.annotation += 1
                db.set_result(item.job_id, WorkResult(output="annotation", worker_outcome=WorkerOutcome.SKIPPED))
            else:
                eligible.append(item)
        chosen = random.Random(f"{seed}:{target.path}").sample(eligible, min(sample, len(eligible)))
        chosen_ids = {w.job_id for w in chosen}
        for item in eligible:
            if item.job_id not in chosen_ids:
                db.set_result(item.job_id, WorkResult(output="not sampled", worker_outcome=WorkerOutcome.SKIPPED))
        for item in chosen:
            m = item.mutations[0]
            result.mutants.append(Mutant(item.job_id, m.operator_name.replace("core/", ""), m.occurrence,
                                         m.start_pos[0], lines[m.start_pos[0] - 1].strip()))
    log(f"{target.name}: {result.total} mutants, {result.annotation} in annotations, {len(chosen)} drawn; "
        f"clean run {result.baseline_s:.0f} s, limit {timeout:.0f} s per mutant")
    _cosmic(copy, "exec", str(config), str(db_path))

    with use_db(str(db_path), WorkDB.Mode.open) as db:
        outcomes = {item.job_id: res for item, res in db.completed_work_items}
    for m in result.mutants:
        res = outcomes.get(m.job_id)
        if res is None or res.worker_outcome == WorkerOutcome.SKIPPED:
            m.outcome = "not run"
            continue
        m.after = _mutated_line(res.diff or "", m.before)
        if res.test_outcome == TestOutcome.SURVIVED:
            m.outcome = "survived"
            m.why_equivalent = EQUIVALENT.get((target.path, m.before, m.after))
        elif (res.output or "").strip() == "timeout":
            m.outcome = "timed out"
        else:
            m.outcome = "killed"
    result.wall_s = time.monotonic() - start
    log(f"{target.name}: killed {result.count('killed')}, timed out {result.count('timed out')}, "
        f"survived {result.count('survived')}, equivalent {result.equivalent} ({result.wall_s:.0f} s)")
    for line in survivors([result]):
        log(f"  {line}")
    return result


def _mutated_line(diff: str, before: str) -> str:
    added = [line[1:].strip() for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]
    return added[0] if added else ""


def table(results: list[Result]) -> list[str]:
    rows = ["| module | file | mutants | drawn | killed | timed out | survived | equivalent | score |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    tot = {"drawn": 0, "killed": 0, "timed out": 0, "survived": 0, "equivalent": 0}
    for r in results:
        if r.error:
            rows.append(f"| {r.target.name} | `{r.target.path}` | {r.total} | - | - | - | - | - | not run: {r.error} |")
            continue
        score = "-" if r.score is None else f"{100 * r.score:.0f}%"
        rows.append(f"| {r.target.name} | `{r.target.path}` | {r.total - r.annotation} | {len(r.mutants)} | "
                    f"{r.count('killed')} | {r.count('timed out')} | {r.count('survived')} | {r.equivalent} | {score} |")
        tot["drawn"] += len(r.mutants)
        for key in ("killed", "timed out", "survived"):
            tot[key] += r.count(key)
        tot["equivalent"] += r.equivalent
    judged = tot["drawn"] - tot["equivalent"]
    overall = f"{100 * (tot['killed'] + tot['timed out']) / judged:.0f}%" if judged else "-"
    rows.append(f"| **all** | | | {tot['drawn']} | {tot['killed']} | {tot['timed out']} | {tot['survived']} | "
                f"{tot['equivalent']} | **{overall}** |")
    return rows


def survivors(results: list[Result]) -> list[str]:
    out = []
    for r in results:
        for m in r.mutants:
            if m.outcome != "survived":
                continue
            status = f"equivalent: {m.why_equivalent}" if m.why_equivalent else "**not killed**"
            out.append(f"- `{r.target.path}:{m.line}` {m.operator} #{m.occurrence}: `{m.before}` -> "
                       f"`{m.after}` — {status}")
    return out


def report(results: list[Result], args, wall_s: float) -> str:
    command = "python scripts/mutation.py " + " ".join(sys.argv[1:])
    lines = ["# Mutation testing report", "",
             f"Written by `{command.strip()}` (cosmic-ray, seed {args.seed}); wall time {wall_s / 60:.1f} min with "
             f"{args.jobs} parallel sessions on this machine (`nproc` = {os.cpu_count()}). "
             "Score = (killed + timed out) / (drawn - equivalent).", "",
             *table(results), "", "Tests run against each module's mutants:", ""]
    lines += [f"- {r.target.name}: `{' '.join(r.target.tests)}` (clean run {r.baseline_s:.0f} s)" for r in results]
    lines += ["", "## Surviving mutants", ""]
    lines += survivors(results) or ["None."]
    return "\n".join(lines) + "\n"


def recheck(path: str, before: str, after: str) -> str:
    """Run the tests of the module at ``path`` against one given mutant (the first line whose stripped
    text is ``before`` replaced by ``after``), in a private copy; returns "killed" or "survived"."""
    target = next(t for t in TARGETS.values() if t.path == path)
    with tempfile.TemporaryDirectory(prefix="tpu-kernel-records-recheck-") as tmp:
        copy = copy_tree(Path(tmp))
        lines = (copy / path).read_text().splitlines(keepends=True)
        index = next(i for i, line in enumerate(lines) if line.strip() == before)
        indent = lines[index][:len(lines[index]) - len(lines[index].lstrip())]
        lines[index] = indent + after + "\n"
        (copy / path).write_text("".join(lines))
        done = subprocess.run([*PYTEST, *target.tests], cwd=copy, env=_env(copy), capture_output=True, text=True)
    return "survived" if done.returncode == 0 else "killed"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modules", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}")
    parser.add_argument("--sample", type=int, help="mutants drawn per module (default: each module's own)")
    parser.add_argument("--jobs", type=int, default=2, help="modules mutated at the same time (each in its own copy)")
    parser.add_argument("--timeout-factor", type=float, default=4.0, help="per-mutant limit = factor x clean run")
    parser.add_argument("--write", type=Path, help="write the Markdown report here (e.g. tests/MUTATION.md)")
    parser.add_argument("--recheck", nargs=3, metavar=("PATH", "LINE", "MUTATED"),
                        help="run PATH's tests against one mutant: LINE (stripped) replaced by MUTATED")
    args = parser.parse_args(argv)
    if args.recheck:
        print(recheck(*args.recheck))
        return 0
    names = [n.strip() for n in args.modules.split(",") if n.strip()]
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        parser.error(f"unknown module(s) {unknown}; choose from {', '.join(TARGETS)}")
    try:
        import cosmic_ray  # noqa: F401
    except ImportError:
        print('mutation: cosmic-ray is not installed; pip install -e ".[mutation]"', file=sys.stderr)
        return 2
    start = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="tpu-kernel-records-mutation-"))
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = [pool.submit(run_target, TARGETS[n], args.seed, args.sample or TARGETS[n].sample, workdir,
                                   args.timeout_factor, lambda s: print(s, flush=True)) for n in names]
            results = [f.result() for f in futures]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    wall = time.monotonic() - start
    print("\n".join(table(results)))
    print("\n".join(survivors(results)))
    if args.write:
        text = report(results, args, wall)
        tmp = args.write.with_suffix(args.write.suffix + ".partial")
        tmp.write_text(text)
        os.replace(tmp, args.write)
        print(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
