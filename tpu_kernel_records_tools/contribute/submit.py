"""``submit``: a measured run proposed to the dataset as one pull request, after the builder's rules.

The run folder is checked first with every rule ``build`` applies (``builder.build.check_run``): what
``build`` would refuse is refused here, in the same line, before anything is uploaded. Then one
``create_commit(..., create_pr=True)`` adds the manifest and every file it lists, byte for byte, under
``submissions/<run_id>/``; the title and description are generated from the run (kernel, device,
profile, features, its headline ratios). Nothing is merged: a maintainer reviews the pull request with
``review`` (``contribute.review``) and releases with ``publish``.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..builder.build import check_run
from ..builder.publish import check_repo_id
from ..builder.rules import Accepted
from ..records import rawio

from .hub import SUBMISSIONS, call, client, require_token

HEADLINE_PAIRS = 8  # ratios listed in the description (the rest are in the run)


@dataclass
class Submission:
    """A pull request ``submit`` opens (or, dry, would open)."""

    repo_id: str
    run_id: str
    title: str
    description: str
    files: dict[str, str]  # path in the repository -> sha256
    url: str | None = None
    number: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_files(run_dir: Path, accepted: Accepted) -> list[str]:
    """The manifest and every file it lists: exactly what ``build`` copies into ``data/raw``."""
    return [rawio.MANIFEST, *accepted.run["manifest"]["files"]]


def kernel_of(run: dict[str, Any]) -> str:
    return run["correctness"]["measured_candidate"]


def features_of(run: dict[str, Any]) -> list[str]:
    """The features the measured kernel was graded on (a submission's declared ones)."""
    corr = run["correctness"]
    if corr.get("submission"):
        return list(corr["submission"].get("features", []))
    card = next((c for c in corr["scorecards"] if c["candidate"] == kernel_of(run)), {})
    return list(card.get("features", []))


def describe(accepted: Accepted) -> tuple[str, str]:
    """The pull request's title and description, from the run's own documents."""
    run = accepted.run
    env, bench = run["environment"], run["benchmark"]
    device = f"{env['device_count']} x {env['device_kind']}"
    title = f"Add run {accepted.record_id}: {kernel_of(run)} on {env['device_kind']} ({bench['profile']} profile)"
    timed = {c["case_id"] for c in bench["cases"] if c["implementation"] in ("submitted", "pallas")}
    pairs = [p for p in bench["pairs"] if p["numerator"] in timed] or bench["pairs"]
    lines = [f"A `{env['source']}` run proposed with `tpu-kernel-records submit`.", "",
             f"- kernel: `{kernel_of(run)}`", f"- device: {device} ({env['platform']})",
             f"- profile: `{bench['profile']}`, {len(bench['cases'])} cases, {bench['samples_per_case']} samples each",
             f"- features: {', '.join(features_of(run)) or 'none (the base contract)'}",
             f"- interpret mode: {'yes: not kernel speed' if accepted.interpret else 'no'}", "",
             "Headline ratios (median over median, 95% bootstrap interval):", ""]
    for p in pairs[:HEADLINE_PAIRS]:
        ci = f" [{p['ci_low']:.3g}, {p['ci_high']:.3g}]" if p.get("ci_low") is not None else ""
        lines.append(f"- `{p['numerator']}` / `{p['denominator']}`: {p['ratio']:.3g}{ci}")
    if len(pairs) > HEADLINE_PAIRS:
        lines.append(f"- and {len(pairs) - HEADLINE_PAIRS} more in `benchmark.json`")
    lines += ["", f"Files: `{SUBMISSIONS}/{accepted.record_id}/` as the run wrote them. A maintainer regrades "
                  "and builds it with `tpu-kernel-records review`."]
    return title, "\n".join(lines)


def plan(run_dir: Path | str, repo_id: str, *, allow_interpret: bool = False) -> tuple[Submission, Accepted]:
    """Check the run (``BuildError`` as ``build`` raises it) and plan its pull request; no network."""
    check_repo_id(repo_id)
    run_dir = Path(run_dir)
    accepted = check_run(run_dir, allow_interpret=allow_interpret)
    title, description = describe(accepted)
    files = {f"{SUBMISSIONS}/{accepted.record_id}/{rel}": hashlib.sha256((run_dir / rel).read_bytes()).hexdigest()
             for rel in run_files(run_dir, accepted)}
    return Submission(repo_id, accepted.record_id, title, description, files), accepted


def submit(run_dir: Path | str, repo_id: str, *, allow_interpret: bool = False, dry_run: bool = False,
           api: Any = None) -> Submission:
    """Check ``run_dir`` and open one pull request adding it to ``repo_id`` (a dataset); see the module doc.

    Raises ``BuildError`` (refused, nothing uploaded), ``PublishError`` (a malformed repo id) or
    ``HubError`` (the Hub's failure, one line with its exit status)."""
    from huggingface_hub import CommitOperationAdd

    submission, accepted = plan(run_dir, repo_id, allow_interpret=allow_interpret)
    if dry_run:
        return submission
    step = "submit could not open the pull request"
    require_token(step)
    api = api or client()
    call(repo_id, step, lambda: api.repo_info(repo_id, repo_type="dataset"))
    operations = [CommitOperationAdd(path_in_repo=f"{SUBMISSIONS}/{accepted.record_id}/{rel}",
                                     path_or_fileobj=str(Path(run_dir) / rel))
                  for rel in run_files(Path(run_dir), accepted)]
    info = call(repo_id, step, lambda: api.create_commit(
        repo_id, operations, commit_message=submission.title, commit_description=submission.description,
        repo_type="dataset", create_pr=True))
    submission.url = info.pr_url
    submission.number = info.pr_num
    return submission
