"""CLI subcommands of the release: build, verify, publish.

``register(subparsers)`` adds them to ``tpu-kernel-records``; each sets ``func`` (``args -> exit code``).
Exit statuses: 0 ok; 1 refused or failed (a build refusal, a verify problem, a publish refusal);
2 usage; publish's Hub failures 3-9 (``builder.publish.HUB_STATUS``). Errors are one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..builder.publish import HUB_STATUS

PUBLISH_STATUS = ", ".join(f"{status} {kind}" for kind, status in HUB_STATUS.items())


def _grader_power_run(power_json: Path, out: Path) -> Path:
    """Wrap a ``tpu-kernel-rubric --power --json`` summary with this machine's environment (see
    ``builder.grader_power``): run it where the sweep ran."""
    import jax

    from ..builder.grader_power import SOURCE, write_power_run
    from ..measure import environment

    created = environment.utc_now()
    run_id = f"{SOURCE}-{created:%Y%m%dt%H%M%Sz}"
    env = environment.capture(run_id=run_id, created=created, profile=SOURCE, devices_used=1,
                              interpret=jax.default_backend() == "cpu")
    return write_power_run(power_json, out, env)


def _cmd_build(args: argparse.Namespace) -> int:
    import tempfile

    from ..builder.build import BuildError, build
    from ..records.rawio import RunError

    with tempfile.TemporaryDirectory(prefix="tpu-kernel-records-power-") as tmp:
        run_dirs = list(args.run_dirs)
        try:
            if args.grader_power is not None:
                run_dirs.append(_grader_power_run(args.grader_power, Path(tmp)))
            ids = build(run_dirs, args.data, args.card, allow_interpret=args.allow_interpret,
                        replace=args.replace, progress=not args.quiet, plan_path=args.plan)
        except (BuildError, RunError, ValueError) as e:
            print(f"build refused, nothing written: {e}", file=sys.stderr)
            return 1
    if not args.quiet:
        print(f"built {', '.join(ids) if ids else 'no new record (regenerated from data/raw)'} into {args.data}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from ..builder.verify import verify

    problems = verify(args.data, args.card)
    if args.json:
        print(json.dumps({"data": str(args.data), "ok": not problems, "problems": problems}, indent=2))
    elif problems:
        print(f"verify: {len(problems)} problem(s) in {args.data}:", file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
    elif not args.quiet:
        print(f"verify: {args.data} is consistent")
    return 1 if problems else 0


def refused_or_failed(command: str, error: "PublishError", as_json: bool) -> int:
    """Report a ``PublishError`` (a ``HubError`` has a ``kind``): one line on stderr, with ``as_json`` also
    ``{ok, status, kind, error}`` on stdout; returns its exit status."""
    kind = getattr(error, "kind", None)
    if as_json:
        print(json.dumps({"ok": False, "status": error.status, "kind": kind or "refused", "error": str(error)}))
    print(f"{command} {'failed' if kind else 'refused'}: {error}", file=sys.stderr)
    return error.status


def _cmd_publish(args: argparse.Namespace) -> int:
    from ..builder.publish import PublishError, publish

    root = args.data.absolute().parent
    quiet = args.quiet or args.json
    try:
        plan = publish(root, args.repo_id, args.version, data_dir=args.data, card_path=args.card,
                       dry_run=args.dry_run, stage_dir=args.stage, gated=args.gated, private=args.private,
                       out=(lambda line: None) if quiet else print)
    except PublishError as e:
        return refused_or_failed("publish", e, args.json)
    if args.json:
        print(json.dumps({"ok": True, "dry_run": args.dry_run, **plan.to_dict()}, indent=2))
    return 0


def register(subparsers: "argparse._SubParsersAction") -> None:
    """Add the release subcommands to ``tpu-kernel-records``'s parser."""
    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--data", type=Path, default=Path("data"), help="the data folder (default: data)")
        p.add_argument("--card", type=Path, default=None,
                       help="the dataset card (default: dataset_card.md beside the data folder)")
        p.add_argument("--quiet", action="store_true", help="no progress bars or chatter; errors still go to stderr")

    p = subparsers.add_parser(
        "build", help="accept measurement runs into data/ (all or nothing)",
        description="Check each RUN_DIR (schemas, manifest checksums, acceptance rules: every derived number "
                    "recomputed from the samples and shapes, every case of its profile present, the environment "
                    "allow-list, no secret-shaped value) and add it to the data folder: data/raw/<record_id>/ "
                    "and one parquet file per config, then update SHA256SUMS, the figure and the card's generated "
                    "parts. A refusal names the rule, file and field and writes nothing. With no RUN_DIR, "
                    "regenerates every derived file from data/raw. Exit: 0 built, 1 refused, 2 usage.")
    p.add_argument("run_dirs", metavar="RUN_DIR", nargs="*", type=Path, help="run folders written by measure")
    common(p)
    p.add_argument("--allow-interpret", action="store_true",
                   help="accept CPU / interpret-mode runs (flagged interpret=true in every row)")
    p.add_argument("--replace", action="store_true", help="replace records whose id already exists")
    p.add_argument("--grader-power", type=Path, metavar="POWER_JSON", default=None,
                   help="also add a grader-power record: a `tpu-kernel-rubric --power --json` summary, wrapped "
                        "with this machine's environment (run it where the sweep ran; labelled CPU-measured)")
    p.add_argument("--plan", type=Path, metavar="PLAN_JSON", default=None,
                   help="keep a `tpu-kernel-records plan --json` file as data/plan/tpu-v5e.json: the card's "
                        "flash / XLA table, predicted by the compiler, not measured (builder.plan)")
    p.set_defaults(func=_cmd_build)

    p = subparsers.add_parser(
        "verify", help="check checksums, schemas, tables, the card and scan for secrets",
        description="Check every checksum in SHA256SUMS, every parquet file against its declared schema, that "
                    "every table regenerates identically from data/raw, that the card's generated parts are "
                    "current, and scan every file for secret-shaped values (tokens, keys). "
                    "Exit: 0 consistent, 1 problems (listed), 2 usage.")
    common(p)
    p.add_argument("--json", action="store_true", help="print {data, ok, problems} as JSON on stdout")
    p.set_defaults(func=_cmd_verify)

    p = subparsers.add_parser(
        "publish", help="push a verified, tagged, gated release to the Hugging Face Hub",
        description="Refuse unless verify passes; stage the release (card as README.md naming this repo and "
                    "tag in its examples, data/, the loading script, kernel_src/, NOTICE, licences); create the "
                    "dataset repo if needed, gate it, make one commit (unchanged files skipped, files no longer "
                    "in the release deleted) and tag it vX.Y.Z. The token comes from `hf auth login` or "
                    "HF_TOKEN; HF_ENDPOINT is honoured. Exit: 0 published, 1 refused, 2 usage, Hub failures: "
                    f"{PUBLISH_STATUS}.")
    p.add_argument("--repo-id", required=True, help="OWNER/NAME (a hyphenated name, not tpu_kernel_records)")
    p.add_argument("--version", default=None,
                   help="must equal the release version set in records/schema.py (the default); tagged vX.Y.Z")
    p.add_argument("--dry-run", action="store_true", help="print the plan; no network")
    p.add_argument("--json", action="store_true", help="print the plan (or the error) as JSON on stdout")
    p.add_argument("--stage", type=Path, default=None, metavar="DIR", help="only write the staged release to DIR")
    p.add_argument("--gated", choices=("auto", "manual"), default="auto", help="access approval (default: auto)")
    p.add_argument("--private", action="store_true",
                   help="create the repo private (a first release into a scratch repo); gating is still set")
    common(p)
    p.set_defaults(func=_cmd_publish)
