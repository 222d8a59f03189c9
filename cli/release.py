"""CLI subcommands of the release: build, verify, publish.

``register(subparsers)`` adds them to ``tpu-kernel-records``; each sets ``func`` (``args -> exit code``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _cmd_build(args: argparse.Namespace) -> int:
    from builder.build import BuildError, build

    try:
        ids = build(args.run_dirs, args.data, args.card, allow_interpret=args.allow_interpret,
                    replace=args.replace, progress=True)
    except BuildError as e:
        print(f"build refused, nothing written: {e}", file=sys.stderr)
        return 1
    print(f"built {', '.join(ids) if ids else 'no new record (regenerated from data/raw)'} into {args.data}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from builder.verify import verify

    problems = verify(args.data, args.card)
    if problems:
        print(f"verify: {len(problems)} problem(s) in {args.data}:", file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    print(f"verify: {args.data} is consistent")
    return 0


def _cmd_publish(args: argparse.Namespace) -> int:
    from builder.publish import PublishError, publish

    root = args.data.absolute().parent
    try:
        publish(root, args.repo_id, args.version, data_dir=args.data, card_path=args.card, dry_run=args.dry_run,
                stage_dir=args.stage, gated=args.gated)
    except PublishError as e:
        print(f"publish refused: {e}", file=sys.stderr)
        return 1
    return 0


def register(subparsers: "argparse._SubParsersAction") -> None:
    """Add the release subcommands to ``tpu-kernel-records``'s parser."""
    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--data", type=Path, default=Path("data"), help="the data folder (default: data)")
        p.add_argument("--card", type=Path, default=None,
                       help="the dataset card (default: dataset_card.md beside the data folder)")

    p = subparsers.add_parser(
        "build", help="accept measurement runs into data/ (all or nothing)",
        description="Check each RUN_DIR (schemas, manifest checksums, acceptance rules) and add it to the data "
                    "folder: data/raw/<record_id>/ and one parquet file per config, then update SHA256SUMS, "
                    "the figure and the card's generated parts. A refusal names the rule, file and field and "
                    "writes nothing. With no RUN_DIR, regenerates every derived file from data/raw.")
    p.add_argument("run_dirs", metavar="RUN_DIR", nargs="*", type=Path, help="run folders written by measure")
    common(p)
    p.add_argument("--allow-interpret", action="store_true",
                   help="accept CPU / interpret-mode runs (flagged interpret=true in every row)")
    p.add_argument("--replace", action="store_true", help="replace records whose id already exists")
    p.set_defaults(func=_cmd_build)

    p = subparsers.add_parser(
        "verify", help="check checksums, schemas, tables and the card",
        description="Check every checksum in SHA256SUMS, every parquet file against its declared schema, that "
                    "every table regenerates identically from data/raw, and that the card's generated parts "
                    "are current. Exits 1 with the list of problems.")
    common(p)
    p.set_defaults(func=_cmd_verify)

    p = subparsers.add_parser(
        "publish", help="push a verified, tagged, gated release to the Hugging Face Hub",
        description="Refuse unless verify passes; stage the release (card as README.md, data/, the loading "
                    "script, kernel_src/, NOTICE, licences); create the dataset repo if needed, gate it, make "
                    "one commit (adds what changed, deletes what the release no longer has) and tag it vX.Y.Z. "
                    "The token comes from `hf auth login` or HF_TOKEN.")
    p.add_argument("--repo-id", required=True, help="OWNER/NAME (a hyphenated name, not tpu_kernel_records)")
    p.add_argument("--version", required=True, help="release version X.Y.Z; tagged vX.Y.Z")
    p.add_argument("--dry-run", action="store_true", help="print the plan; no network")
    p.add_argument("--stage", type=Path, default=None, metavar="DIR", help="only write the staged release to DIR")
    p.add_argument("--gated", choices=("auto", "manual"), default="auto", help="access approval (default: auto)")
    common(p)
    p.set_defaults(func=_cmd_publish)
