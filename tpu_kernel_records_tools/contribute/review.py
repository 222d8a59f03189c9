"""``review``: a maintainer's verdict on the pull requests that propose runs; nothing is merged.

For each pull request: read what it changes against the ``main`` commit it was opened on
(``contribute.hub.pr_changes``); refuse it as a whole, in one line, unless it only adds files under
``submissions/<run_id>/`` (a pull request that also touches ``data/``, the card, the loading script or
code, or modifies or deletes anything, is no submission); download the added files at its head commit
into a fresh folder; then, per run, apply every rule ``build`` applies (``builder.build.check_run``) and
regrade its exported programs on a seed drawn now (``contribute.regrade``; a run of the project's own
kernels has none). Each run gets a :class:`Verdict`. The caller may build the accepted runs into
``data/`` and post the verdicts on the pull request; publishing stays ``publish``'s.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..builder.build import BuildError, check_run
from ..grading.programs import ProgramRefused
from ..measure.timed_checks import draw_entropy

from .hub import SUBMISSIONS, Changes, call, pr_changes
from .regrade import draw_seed, failed_checks, programs_of, regrade, regrade_task

SHOWN_PATHS = 3  # paths named in a scope refusal
MAX_PR_BYTES = 1 << 30  # the most a review downloads of one pull request (a run's programs are at most 256 MiB)


@dataclass
class Verdict:
    """One run's verdict (``run_id`` None: the pull request was refused as a whole)."""

    pr: int
    run_id: str | None
    accepted: bool
    reason: str | None = None  # the refusal, one line
    regrade: dict[str, Any] | None = None  # seed, slots_from, score, max_score, failed checks

    def line(self) -> str:
        where = f"#{self.pr}" + (f" {self.run_id}" if self.run_id else "")
        if not self.accepted:
            return f"{where}: refused: {self.reason}"
        if self.regrade is None:
            return f"{where}: accepted (every builder rule passed; no exported program to regrade)"
        r = self.regrade
        return (f"{where}: accepted (every builder rule passed; its programs regraded on seed {r['seed']}: "
                f"{r['score']:g}/{r['max_score']:g})")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Review:
    """The verdicts of one pull request and the folders of its accepted runs."""

    pr: int
    verdicts: list[Verdict] = field(default_factory=list)
    accepted: dict[str, Path] = field(default_factory=dict)


def _show(paths: list[str]) -> str:
    more = f" and {len(paths) - SHOWN_PATHS} more" if len(paths) > SHOWN_PATHS else ""
    return ", ".join(paths[:SHOWN_PATHS]) + more


def _run_id(path: str) -> str | None:
    parts = path.split("/")
    ok = len(parts) >= 3 and parts[0] == SUBMISSIONS and not {"", ".", ".."} & set(parts)
    return parts[1] if ok else None


def scope(changes: Changes) -> list[str]:
    """The run ids a pull request adds; ``ValueError`` (one line) unless it only adds run folders."""
    touched = [*changes.modified, *changes.deleted]
    if touched:
        raise ValueError(f"it modifies or deletes {_show(touched)}: a submission only adds "
                         f"{SUBMISSIONS}/<run_id>/; refused as a whole")
    outside = [p for p in changes.added if _run_id(p) is None]
    if outside:
        raise ValueError(f"it adds {_show(outside)} outside {SUBMISSIONS}/<run_id>/ (data, the card, the loading "
                         "script and code are the maintainers'); refused as a whole")
    runs = sorted({_run_id(p) for p in changes.added})
    if not runs:
        raise ValueError(f"it adds no run under {SUBMISSIONS}/")
    if changes.added_bytes > MAX_PR_BYTES:
        raise ValueError(f"it adds {changes.added_bytes} bytes, more than the {MAX_PR_BYTES} a review downloads; "
                         "refused as a whole")
    return runs


def download(api: Any, repo_id: str, changes: Changes, folder: Path) -> Path:
    """The pull request's added files at its head commit, under ``folder`` as in the repository."""
    step = f"review could not download pull request #{changes.number}"
    for path in changes.added:
        call(repo_id, step, lambda path=path: api.hf_hub_download(
            repo_id, path, repo_type="dataset", revision=changes.head, local_dir=str(folder)))
    return folder / SUBMISSIONS


Regrader = Callable[[dict[str, Path]], dict[str, "dict[str, Any] | str"]]


def regrade_here(runs: dict[str, Path]) -> dict[str, dict[str, Any] | str]:
    """Each run's regraded scorecard, in this process (the rubric starts its own worker), or why not."""
    out: dict[str, dict[str, Any] | str] = {}
    for run_id, run_dir in runs.items():
        try:
            out[run_id] = regrade(run_dir, draw_seed(), draw_entropy())
        except ProgramRefused as e:
            out[run_id] = f"[regrade] its programs cannot be regraded: {e}"
        except Exception as e:  # noqa: BLE001 - a hostile run's surprise is its refusal, not the review's end
            out[run_id] = f"[regrade] its regrade failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
    return out


def regrade_on_dask(workers: int | None, scheduler: str | None) -> Regrader:
    """A ``Regrader`` that sends each run's files to Dask (``sweeps.sweep.map_on_dask``), one task a run."""
    def run(runs: dict[str, Path]) -> dict[str, dict[str, Any] | str]:
        from ..sweeps.sweep import map_on_dask

        units = {run_id: ({p.relative_to(d).as_posix(): p.read_bytes() for p in d.rglob("*") if p.is_file()},
                          draw_seed(), draw_entropy()) for run_id, d in runs.items()}
        named = {id(unit): run_id for run_id, unit in units.items()}
        out: dict[str, dict[str, Any] | str] = {}
        map_on_dask(regrade_task, list(units.values()), workers=workers, scheduler=scheduler,
                    on_result=lambda unit, card: out.__setitem__(named[id(unit)], card),
                    on_failure=lambda unit, why: out.__setitem__(named[id(unit)],
                                                                  f"[regrade] its regrade failed: {why}"))
        return out
    return run


def _judge(pr: int, run_id: str, card: dict[str, Any] | str) -> Verdict:
    if isinstance(card, str):
        return Verdict(pr, run_id, False, card)
    summary = {"seed": card["seed"], "slots_from": card["slots_from"], "score": card["score"],
               "max_score": card["max_score"], "failed": failed_checks(card)}
    if card["passed"]:
        return Verdict(pr, run_id, True, regrade=summary)
    why = card.get("error") or "failed " + ", ".join(summary["failed"])
    return Verdict(pr, run_id, False, f"[regrade] its programs, regraded on seed {card['seed']}, {why} "
                                      "(the submitted scorecard is not trusted)", summary)


def review_pr(api: Any, repo_id: str, number: int, folder: Path, *, allow_interpret: bool = False,
              regrader: Regrader = regrade_here, existing: frozenset[str] = frozenset()) -> Review:
    """Review pull request ``number`` into the fresh ``folder``: its verdicts and accepted runs. A run whose
    id is ``existing`` (the data's records) is refused as ``build`` would refuse it."""
    review = Review(number)
    changes = pr_changes(api, repo_id, number)
    try:
        run_ids = scope(changes)
    except ValueError as e:
        review.verdicts.append(Verdict(number, None, False, str(e)))
        return review
    root = download(api, repo_id, changes, folder)
    checked, to_regrade = {}, {}
    for run_id in run_ids:
        try:
            checked[run_id] = check_run(root / run_id, allow_interpret=allow_interpret)
        except BuildError as e:  # its paths as in the repository, not this machine's folder
            review.verdicts.append(Verdict(number, run_id, False, str(e).replace(f"{folder}/", "")))
            continue
        if run_id in existing:
            review.verdicts.append(Verdict(number, run_id, False, str(BuildError(
                "duplicate-record", f"{SUBMISSIONS}/{run_id}/manifest.json", "run_id",
                f"record {run_id!r} already exists in the data; a run is added once"))))
            del checked[run_id]
            continue
        if programs_of(checked[run_id].run):
            to_regrade[run_id] = root / run_id
    cards = regrader(to_regrade) if to_regrade else {}
    for run_id in checked:
        verdict = _judge(number, run_id, cards[run_id]) if run_id in cards else Verdict(number, run_id, True)
        review.verdicts.append(verdict)
        if verdict.accepted:
            review.accepted[run_id] = root / run_id
    return review


def comment(api: Any, repo_id: str, review: Review) -> None:
    """Post the verdicts on the pull request (one comment)."""
    text = "\n".join(["**tpu-kernel-records review**", "", *(f"- {v.line()}" for v in review.verdicts), "",
                      "Nothing is merged by the review; accepted runs are released with the next version."])
    call(repo_id, f"review could not comment on pull request #{review.pr}",
         lambda: api.comment_discussion(repo_id, review.pr, text, repo_type="dataset"))


def as_json(reviews: list[Review]) -> str:
    return json.dumps({"ok": all(v.accepted for r in reviews for v in r.verdicts),
                       "verdicts": [v.to_dict() for r in reviews for v in r.verdicts]}, indent=2)
