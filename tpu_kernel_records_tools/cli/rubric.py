"""``tpu-kernel-rubric``: grade attention candidates, list the built-ins, or measure the grader's power.

Every candidate runs in its own worker process (``sandbox.sandbox``): allow-listed environment (no
tokens or credentials), its own empty temporary folder as working directory and home, closed stdin,
a wall-clock limit (``--timeout``) and an address-space limit (``--memory-limit``); the worker and
every process it started are killed before the next candidate is graded. A file or module candidate's
worker runs under bubblewrap (``sandbox.isolation``); where bubblewrap cannot run, grading one is
refused (exit status 2) unless ``--isolation process`` is given. Each scorecard names its isolation.

Exit status: 0 when every named candidate passed every check (``--power``: no correct candidate
rejected and every known-bad one rejected on every seed), 1 when one did not (a candidate that could
not be loaded is a failing scorecard), 2 for a usage error only. ``--json`` is written atomically once
no candidate process is alive, and its sha256 is printed, so a later change is detectable.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Sequence

from ..cli.exits import exit_with
from ..grading import contracts
from ..grading.candidates import CandidateSpecError, builtins, is_builtin, resolve
from ..sandbox import candidate_files, memcg, syscalls
from ..sandbox.isolation import CHOICES, IsolationUnavailable, choose
from ..grading.runner import DEFAULT_TIME_LIMIT_S
from ..sandbox.sandbox import DEFAULT_MEMORY_LIMIT_GB
from kernel_src.contract import canonical_features

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tpu-kernel-rubric",
        description="Grade attention candidates against the contract (kernel_src.contract) with the "
                    "correctness rubric, or sweep seeds to measure how often it rejects correct and "
                    "known-bad candidates.",
        epilog="Examples: tpu-kernel-rubric --candidate reference; tpu-kernel-rubric --candidate "
               "ignores-causal; tpu-kernel-rubric --candidate my_kernel.py:attention --json out.json; "
               "tpu-kernel-rubric --paged --candidate my_paged.py:paged_attention; "
               "tpu-kernel-rubric --power --seeds 200 --markdown power.md")
    p.add_argument("--candidate", action="append", default=[], metavar="NAME_OR_PATH",
                   help="a built-in name (see --list), path/to/file.py:function or package.module:function; "
                        "repeat for several")
    p.add_argument("--candidate-dir", type=Path, metavar="DIR",
                   help="the folder of a kernel that spans several files: bound read-only into the sandbox "
                        "(at /candidate) and put first on the worker's sys.path, so its modules import each "
                        "other; a file candidate must lie inside it. Without it, only the candidate file itself "
                        "(or a module candidate's own package) is visible to the candidate, never its neighbours")
    candidate_files.add_arguments(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the fresh inputs (default 0)")
    p.add_argument("--quick", action="store_true",
                   help="grade at the quick level (small fixed shapes, for fast tests) instead of the full "
                        "problem distribution")
    contracts.add_flags(p)
    p.add_argument("--features", type=_features, metavar="LIST",
                   help="which of each candidate's declared features to grade on top of the base contract: a "
                        "comma-separated list of window, softcap, segments, sinks, or 'none' for the base "
                        "contract alone (default: every feature the candidate declares)")
    p.add_argument("--timeout", "--time-limit", dest="time_limit", type=_positive, default=DEFAULT_TIME_LIMIT_S,
                   metavar="SECONDS",
                   help=f"wall-clock seconds each candidate's worker may take per scorecard, all calls together "
                        f"(loading included, interpreter start not); past it the worker and every process it "
                        f"started are killed and the remaining checks fail (default {DEFAULT_TIME_LIMIT_S:g})")
    p.add_argument("--memory-limit", type=_non_negative, default=DEFAULT_MEMORY_LIMIT_GB, metavar="GB",
                   help=f"memory limit of each candidate's worker in GiB, 0 for none (default "
                        f"{DEFAULT_MEMORY_LIMIT_GB:g}): the limit of a memory cgroup of its own, which counts "
                        f"memfds, tmpfs files and pipes too and OOM-kills the worker alone (needs root or a "
                        f"delegated cgroup); elsewhere, with a warning, an address-space limit (JAX on CPU "
                        f"needs about 2 GiB of it to start). Each scorecard's memory_limit says which")
    p.add_argument("--isolation", choices=CHOICES, default="auto",
                   help="where each candidate's worker runs: bubblewrap (namespaces, read-only file system, no "
                        "network, an unprivileged uid), process (a plain child process: the opt-out, for code you "
                        "trust), or auto (default: bubblewrap for a file or module candidate, refusing where "
                        "bubblewrap cannot run; process for a built-in)")
    p.add_argument("--json", type=Path, metavar="PATH",
                   help='write {"scorecards": [...]} (with --power: {"power": {...}}) atomically')
    p.add_argument("--list", action="store_true", help="list the built-in candidates and exit")
    p.add_argument("--power", action="store_true",
                   help="sweep --seeds seeds over the built-ins, dense and paged, each on its own contract's "
                        "rubric (or the --candidate ones) and report false rejects and power")
    p.add_argument("--seeds", type=int, metavar="N", help="number of seeds for --power")
    p.add_argument("--first-seed", type=int, default=0, metavar="N", help="first seed for --power (default 0)")
    p.add_argument("--kernel-seeds", type=int, metavar="N",
                   help="seeds for kind=kernel candidates in --power (default: --seeds)")
    p.add_argument("--markdown", type=Path, metavar="PATH", help="with --power: write the Markdown report")
    add_sweep_options(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    return p


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("tpu-kernel-records")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _features(text: str) -> tuple[str, ...]:
    """``--features``: 'none' or a comma-separated list of the contract's features."""
    if text.strip().lower() == "none":
        return ()
    try:
        return canonical_features([part.strip() for part in text.split(",") if part.strip()])
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _write_json(path: Path, doc: dict) -> None:
    """Write ``doc`` atomically once no candidate process is alive; print the file's sha256."""
    from ..sandbox.sandbox import close_all

    close_all()
    text = json.dumps(doc, indent=2, allow_nan=False) + "\n"
    write_atomic(path, text)
    print(f"wrote {path} (sha256 {hashlib.sha256(text.encode()).hexdigest()})")


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; the result is an ordinary readable file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def format_scorecard(card) -> str:
    """A readable scorecard: a header line, then one line per check (check, PASS/FAIL, points, detail)."""
    status = "PASSED" if card.passed else "FAILED"
    features = ", ".join(card.features) or "none"
    lines = [f"{card.candidate} [{card.kind}] {status} {card.score:g}/{card.max_score:g} "
             f"(isolation: {card.isolation}; features: {features})"]
    if card.error:
        lines.append(f"  could not be graded: {card.error}")
    width = max((len(c.name) for c in card.checks), default=0)
    for c in card.checks:
        head = f"  {'PASS' if c.passed else 'FAIL'}  {c.name:<{width}}  {c.points:>4g}/{c.max_points:<4g} "
        body = textwrap.wrap(c.detail, 110) or [""]
        lines.append(head + body[0])
        lines += [" " * len(head) + rest for rest in body[1:]]
    return "\n".join(lines)


def _list() -> int:
    everything = builtins()
    width = max(len(n) for n in everything)
    for name, cand in everything.items():
        print(f"{name:<{width}}  {cand.kind:<15}  {cand.summary}")
    return EXIT_OK


def isolation_allowed(isolation: str, cands, memory_limit_gb: float = DEFAULT_MEMORY_LIMIT_GB) -> bool:
    """Whether ``cands`` may be graded under ``isolation`` here: False after one line on stderr saying why
    and how to install bubblewrap; a stranger's code graded as a plain process gets a warning, and so
    does a stranger's code whose memory no cgroup can hold here (``sandbox.memcg``)."""
    try:
        where = {c.name: choose(isolation, is_builtin(c)) for c in cands}
    except IsolationUnavailable as e:
        print(f"tpu-kernel-rubric: refusing to grade a file or module candidate outside the sandbox: {e}",
              file=sys.stderr)
        return False
    strangers = [c.name for c in cands if where[c.name] == "process" and not is_builtin(c)]
    if strangers:
        print(f"tpu-kernel-rubric: warning: grading {', '.join(strangers)} without bubblewrap (--isolation process): "
              f"its code runs as this user, with this user's files and network", file=sys.stderr)
    if any(not is_builtin(c) for c in cands):
        for warning in (memcg.warning("tpu-kernel-rubric") if memory_limit_gb > 0 else None,
                        syscalls.warning("tpu-kernel-rubric")):
            if warning:
                print(warning, file=sys.stderr)
    return True


def add_sweep_options(p: argparse.ArgumentParser) -> None:
    """Where a sweep's trials run (``sweeps.sweep``) and where they are streamed."""
    p.add_argument("--workers", type=int, metavar="N",
                   help="Dask worker processes of a local cluster (default: one per core); 0 grades serially "
                        "in this process")
    p.add_argument("--scheduler", metavar="ADDRESS",
                   help="run the trials on an existing Dask cluster (tcp://host:8786: `dask scheduler` plus "
                        "`dask worker` processes on machines with this project installed)")
    p.add_argument("--trials", type=Path, metavar="JSONL",
                   help="append each finished trial to this JSON Lines file as it finishes")
    p.add_argument("--resume", action="store_true",
                   help="with --trials: grade only the trials the file does not hold yet")


def run_sweep(args, tasks: list[tuple[str, int]], sweep: str):
    """``sweeps.sweep.run`` with the command's options; None (after one line on stderr) on a usage error."""
    from ..sweeps import sweep as sweeps

    if args.resume and args.trials is None:
        print("tpu-kernel-rubric: --resume needs --trials JSONL", file=sys.stderr)
        return None
    if args.workers is not None and args.workers < 0:
        print("tpu-kernel-rubric: --workers must be >= 0", file=sys.stderr)
        return None
    try:
        return sweeps.run(tasks, level="quick" if args.quick else "full", time_limit_s=args.time_limit,
                          out=args.trials, resume=args.resume, workers=args.workers, scheduler=args.scheduler,
                          progress=not args.quiet, sweep=sweep, isolation=args.isolation)
    except (FileExistsError, ValueError) as e:
        print(f"tpu-kernel-rubric: {e}", file=sys.stderr)
        return None


def _power(args) -> int:
    from ..sweeps.power import default_candidates, power_markdown, power_tasks, summarize

    if not args.seeds or args.seeds < 1:
        print("tpu-kernel-rubric: --power needs --seeds N (N >= 1)", file=sys.stderr)
        return EXIT_USAGE
    try:
        cands = [resolve(c) for c in args.candidate or default_candidates()]
    except CandidateSpecError as e:
        print(f"tpu-kernel-rubric: {e}", file=sys.stderr)
        return EXIT_USAGE
    if not isolation_allowed(args.isolation, cands):
        return EXIT_USAGE
    done = run_sweep(args, power_tasks(cands, args.seeds, args.first_seed, args.kernel_seeds), "power")
    if done is None:
        return EXIT_USAGE
    power = summarize(cands, done.trials, args.seeds, args.first_seed, "quick" if args.quick else "full")
    report = power_markdown(power)
    print(report, end="")
    for failure in done.failed:
        print(f"tpu-kernel-rubric: not graded: {failure['candidate']} seed {failure['seed']}: {failure['error']}",
              file=sys.stderr)
    if done.failed:
        return EXIT_FAILED
    if args.json:
        _write_json(args.json, {"power": power})
    if args.markdown:
        write_atomic(args.markdown, report)
    if any(e["load_error"] for e in power["candidates"]):
        return EXIT_FAILED
    return EXIT_OK if power["false_rejects"] == 0 and power["missed_bad"] == 0 else EXIT_FAILED


def _grade(args) -> int:
    if getattr(args, "list", False):
        return _list()
    if not args.candidate:
        print("tpu-kernel-rubric: name at least one --candidate (or use --list / --power)", file=sys.stderr)
        return EXIT_USAGE
    try:
        candidate_files.apply_arguments(args)
        cands = [resolve(c, root=args.candidate_dir) for c in args.candidate]
    except (CandidateSpecError, ValueError) as e:
        print(f"tpu-kernel-rubric: {e}", file=sys.stderr)
        return EXIT_USAGE

    from ..grading.rubric import grade_all

    try:
        asked = contracts.flagged(args)
    except ValueError as e:
        print(f"tpu-kernel-rubric: {e}", file=sys.stderr)
        return EXIT_USAGE
    for contract in dict.fromkeys(contracts.of(c, asked) for c in cands):
        if set(args.features or ()) - set(contract.features):
            print(f"tpu-kernel-rubric: --features {','.join(args.features)}: {contract.function}'s features are "
                  f"{', '.join(contract.features)}", file=sys.stderr)
            return EXIT_USAGE
    if not isolation_allowed(args.isolation, cands, args.memory_limit):
        return EXIT_USAGE
    level = "quick" if args.quick else "full"
    cards = grade_all(cands, seed=args.seed, level=level, progress=not args.quiet, time_limit_s=args.time_limit,
                      memory_limit_gb=args.memory_limit, isolation=args.isolation, features=args.features,
                      contract=asked)
    for card in cards:
        print(format_scorecard(card))
        print()
    if args.json:
        _write_json(args.json, {"scorecards": [c.to_dict() for c in cards], "seed": args.seed, "level": level})
    return EXIT_OK if all(c.passed for c in cards) else EXIT_FAILED


def register(subparsers: "argparse._SubParsersAction") -> None:
    """Add ``grade`` and ``power`` to ``tpu-kernel-records`` (the same options as ``tpu-kernel-rubric``)."""
    full = _parser()
    grade_opts = {"--candidate", "--candidate-dir", "--candidate-max-mib", "--candidate-max-files", "--seed", "--quick",
                  *(c.flag for c in contracts.CONTRACTS.values() if c.flag), "--features", "--timeout",
                  "--memory-limit", "--isolation", "--json", "--list", "--quiet"}
    power_opts = {"--candidate", "--quick", "--seeds", "--first-seed", "--kernel-seeds", "--timeout", "--json",
                  "--markdown", "--quiet", "--workers", "--scheduler", "--trials", "--resume", "--isolation"}
    for name, opts, func, help_text in (
            ("grade", grade_opts, _grade, "grade attention candidates with the correctness rubric"),
            ("power", power_opts, _power, "sweep seeds: false rejects and power on known-bad candidates")):
        p = subparsers.add_parser(name, help=help_text, description=full.description, epilog=full.epilog)
        for action in full._actions:
            if action.option_strings and action.option_strings[0] in opts:
                p._add_action(action)
        p.set_defaults(func=func)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``tpu-kernel-rubric`` (``grade``, or ``power`` with ``--power``); the exit status."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2)
        return int(e.code or 0)
    if args.list:
        return _list()
    if args.power:
        return _power(args)
    return _grade(args)


def entry() -> None:
    """The ``tpu-kernel-rubric`` console script: :func:`main`, then ``cli.exits.exit_with`` its status."""
    exit_with(main, None, "tpu-kernel-rubric")


if __name__ == "__main__":
    entry()
