"""A submission's exported programs graded again by the reviewer, on values drawn now.

The submitter's scorecard is not trusted: :func:`regrade` grades the run's stored programs with the
rubric (``measure.submission.grade_programs``: the programs are bytes, deserialized and checked by
``grading.export``; no submitter Python runs) on a seed drawn by the reviewer, at the level the run was
graded at and on the features it declared. The problems' shapes are the run's seed's (``slots_from``),
the shapes its programs were exported for; their values come from the new seed. The timed programs are
checked again at their timed shapes on inputs from new entropy (``grade_timed_shapes``). Programs run on
the platform they were exported for: a TPU run's programs are regraded on a TPU (``review --scheduler``
with TPU workers), anything else is refused in one line.

:func:`regrade_task` is the same on a run's files sent as bytes, so a Dask worker without the
reviewer's disk can run it (``sweeps.sweep.map_on_dask``).
"""

from __future__ import annotations

import json
import secrets
import tempfile
from pathlib import Path
from typing import Any

SEED_BITS = 31


def draw_seed() -> int:
    """A rubric seed no submitter could know: drawn now."""
    return secrets.randbits(SEED_BITS)


def programs_of(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The exported programs a run lists (none for a run of the project's own kernels)."""
    return list((run["correctness"].get("submission") or {}).get("programs", []))


def regrade(run_dir: Path | str, seed: int, entropy: str) -> dict[str, Any]:
    """The scorecard of the run's programs on ``seed`` (rubric) and ``entropy`` (timed shapes), with
    ``seed`` and ``slots_from`` added. Raises ``ProgramRefused`` for a program that cannot run here."""
    import jax

    from ..bench.cases import get_profile
    from ..grading.export import ProgramRefused, load_program, program_path, signature_from_dict
    from ..measure.submission import bench_scopes, case_signature, declared_templates, grade_programs, \
        grade_timed_shapes, templates_for

    run_dir = Path(run_dir)
    corr = json.loads((run_dir / "correctness.json").read_text())
    bench = json.loads((run_dir / "benchmark.json").read_text())
    sub = corr["submission"]
    platform, here = sub["platform"], jax.default_backend()
    if platform != here:
        raise ProgramRefused(f"its programs target {platform} and this machine is {here}: regrade it where they run "
                             "(review --scheduler ADDRESS of workers with that device)")
    name, contract = corr["measured_candidate"], sub.get("contract", "attention")
    features = tuple(sub.get("features", []))
    level = next(c.get("level", "full") for c in corr["scorecards"] if c["candidate"] == name)
    entries = [p for p in sub["programs"] if p["grading"]]
    grading = [signature_from_dict(p["signature"]) for p in entries]
    digests = {sig.key: p["sha256"] for sig, p in zip(grading, entries)}
    card = grade_programs(name, run_dir, digests, grading, seed=seed, level=level, platform=platform,
                          features=features, contract=contract, slots_from=corr["seed"])
    templates = templates_for(get_profile(bench["profile"]), bench_scopes(get_profile(bench["profile"]), contract),
                              corr["seed"], platform)
    templates = declared_templates(templates, features)  # as measure: a feature's case only for a kernel declaring it
    programs = {}
    for case in templates:
        key = case_signature(case).key
        if key not in digests:
            raise ProgramRefused(f"no program is listed for the timed shape of {case.case_id!r}")
        programs[key] = load_program((run_dir / program_path(digests[key])).read_bytes(),
                                     case_signature(case), platform)
    card = grade_timed_shapes(card, templates, programs, digests, entropy=entropy)
    return {**card, "seed": seed, "slots_from": corr["seed"]}


def regrade_task(files: dict[str, bytes], seed: int, entropy: str) -> dict[str, Any]:
    """:func:`regrade` of a run given as its files' bytes (relative path -> bytes): a Dask task."""
    with tempfile.TemporaryDirectory(prefix="tpu-kernel-records-regrade-") as tmp:
        for rel, data in files.items():
            (Path(tmp) / rel).parent.mkdir(parents=True, exist_ok=True)
            (Path(tmp) / rel).write_bytes(data)
        return regrade(tmp, seed, entropy)


def failed_checks(card: dict[str, Any]) -> list[str]:
    return [c["name"] for c in card["checks"] if not c["passed"]]
