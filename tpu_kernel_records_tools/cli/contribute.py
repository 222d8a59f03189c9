"""CLI subcommands of contributions: ``submit`` (a run as a Hub pull request) and ``review`` (a
maintainer's verdict on those pull requests). Exit statuses as ``publish``: 0 ok; 1 refused; 2 usage;
Hub failures 3-9 (``builder.publish.HUB_STATUS``). Errors are one line on stderr; the token never shows."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from ..builder.publish import PublishError
from .release import PUBLISH_STATUS, refused_or_failed


def _cmd_submit(args: argparse.Namespace) -> int:
    from ..builder.build import BuildError
    from ..contribute.submit import submit

    try:
        sub = submit(args.run_dir, args.repo_id, allow_interpret=args.allow_interpret, dry_run=args.dry_run)
    except BuildError as e:
        return refused_or_failed("submit", PublishError(f"nothing uploaded: {e}"), args.json)
    except PublishError as e:
        return refused_or_failed("submit", e, args.json)
    if args.json:
        print(json.dumps({"ok": True, "dry_run": args.dry_run, **sub.to_dict()}, indent=2))
    elif args.dry_run:
        print(f"dry run: no network access; the pull request would be:\n{sub.title}\n\n{sub.description}\n")
        print("\n".join(f"  + {path}  {digest[:12]}" for path, digest in sorted(sub.files.items())))
    else:
        print(f"opened pull request #{sub.number}: {sub.url}")
    return 0


def _cmd_review(args: argparse.Namespace) -> int:
    from ..builder.build import BuildError, build
    from ..builder.derive import record_ids
    from ..contribute import review as R
    from ..contribute.hub import client, open_pull_requests
    from ..builder.publish import check_repo_id

    regrader = (R.regrade_on_dask(args.workers, args.scheduler) if args.workers or args.scheduler
                else R.regrade_here)
    try:
        check_repo_id(args.repo_id)
        api = client()
        numbers = [args.pr] if args.pr is not None else open_pull_requests(api, args.repo_id)
        with tempfile.TemporaryDirectory(prefix="tpu-kernel-records-review-") as tmp:
            reviews = []
            for number in numbers:
                reviews.append(R.review_pr(api, args.repo_id, number, Path(tmp) / f"pr-{number}",
                                           allow_interpret=args.allow_interpret, regrader=regrader,
                                           existing=frozenset(record_ids(args.data.absolute()))))
                for verdict in reviews[-1].verdicts if not args.json else ():
                    print(verdict.line())
                if args.comment:
                    R.comment(api, args.repo_id, reviews[-1])
            accepted = [d for r in reviews for d in r.accepted.values()]
            if args.build and accepted:
                build(accepted, args.data, args.card, allow_interpret=args.allow_interpret, progress=False)
    except PublishError as e:
        return refused_or_failed("review", e, args.json)
    except BuildError as e:
        print(f"build refused, nothing written: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(R.as_json(reviews))
    elif not numbers:
        print(f"review: {args.repo_id} has no open pull request")
    elif args.build and accepted:
        print(f"built {len(accepted)} accepted run(s) into {args.data}")
    return 0 if all(v.accepted for r in reviews for v in r.verdicts) else 1


def register(subparsers: "argparse._SubParsersAction") -> None:
    """Add ``submit`` and ``review`` to ``tpu-kernel-records``'s parser."""
    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--repo-id", required=True, help="the dataset repository, OWNER/NAME")
        p.add_argument("--allow-interpret", action="store_true",
                       help="accept a CPU / interpret-mode run, as build's flag (its rows say interpret=true)")
        p.add_argument("--json", action="store_true", help="print the result (or the error) as JSON on stdout")

    p = subparsers.add_parser(
        "submit", help="propose a measured run to the dataset as one Hub pull request",
        description="Check RUN_DIR with every rule build applies (refused in build's line, nothing uploaded), "
                    "then open one pull request on the dataset repository adding it under "
                    "submissions/<run_id>/ as written (manifest, documents, programs/*.jaxexport), titled and "
                    "described from the run; prints its URL and number. The token comes from `hf auth login` "
                    "or HF_TOKEN (never printed); HF_ENDPOINT is honoured. Exit: 0 opened, 1 refused, 2 usage, "
                    f"Hub failures: {PUBLISH_STATUS}.")
    p.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="a run folder written by measure")
    common(p)
    p.add_argument("--dry-run", action="store_true", help="check and print the pull request; no network")
    p.set_defaults(func=_cmd_submit)

    p = subparsers.add_parser(
        "review", help="maintainers: check, regrade and (optionally) build the runs proposed as pull requests",
        description="Download a pull request's files at refs/pr/N into a fresh folder, refuse it as a whole "
                    "unless it only adds submissions/<run_id>/, apply every build rule to each run, regrade each "
                    "submission's exported programs on a seed drawn now (the submitted scorecard is not "
                    "trusted) and print each run's verdict. Nothing is merged. Exit: 0 every run accepted, "
                    f"1 a refusal, 2 usage, Hub failures: {PUBLISH_STATUS}.")
    common(p)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--pr", type=int, metavar="N", help="the pull request's number")
    which.add_argument("--all-open", action="store_true", help="every open pull request")
    p.add_argument("--build", action="store_true", help="build the accepted runs into --data (as build does)")
    p.add_argument("--comment", action="store_true", help="post the verdicts on each pull request")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--workers", type=int, metavar="N", help="regrade on a local Dask cluster of N workers")
    where.add_argument("--scheduler", metavar="ADDRESS",
                       help="regrade on the Dask cluster at ADDRESS (tcp://host:8786)")
    p.add_argument("--data", type=Path, default=Path("data"), help="the data folder --build writes (default: data)")
    p.add_argument("--card", type=Path, default=None,
                   help="the dataset card (default: dataset_card.md beside the data folder)")
    p.set_defaults(func=_cmd_review)
