"""The main job: one measurement run (environment + correctness + benchmark) into a run folder.

Beside each TPU case's timings the run keeps the TPU compiler's facts about its program
(``compiled_tpu``, from ``bench.benchmark``: predicted by the compiler, not measured), compiled
for TPU v5e without a chip where this host is not a TPU; null with a reason where libtpu is missing.

``run_measure`` measures, grades, captures the environment, checks that no secret value made it into
any file, and only then writes the folder atomically through ``records.rawio.write_run``: an
interrupted or failed run leaves nothing behind.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Mapping, Sequence

import jax
from tqdm.auto import tqdm

from ..measure import environment
from ..records import rawio
from ..builder.verdicts import features_by_candidate
from ..bench.benchmark import run_benchmark
from ..bench.cases import MASK_SCOPES, MODEL_SCOPES, PAGED_SCOPES, Profile, get_profile
from ..bench.profiles import RAGGED_SCOPES
from ..bench.profiles import default_profile

INTERPRET_WARNING = ("Pallas ran in interpret mode on the CPU: its timings say nothing about kernel "
                     "speed, only that the kernel runs.")
PEAK_MEMORY_NOTE = ("peak_memory_bytes is the backend's high-water mark (memory_stats) of the devices a "
                    "case used since the process started, read after the case: an upper bound, not "
                    "that case's own peak.")
KNOWN_BAD_SKIPPED_NOTE = ("The known-bad built-ins were not graded in this run (profile {profile}, or "
                          "--no-known-bad); the release's grader-power record shows the rubric rejecting "
                          "each of them on every seed.")
QUICK_LEVEL_NOTE = ("The measured kernels were graded at the quick level (profile {profile}), each on the base "
                    "contract and the features its timed rows use: on a CPU the "
                    "kernels are interpreted and this run shows that their path runs; the full level's "
                    "model-sized problems are graded under the tpu-v5e and gpu profiles.")
RUNS_DIR = Path("runs")


class SecretLeakError(RuntimeError):
    """A credential's value was found in a file about to be written; nothing was written."""


def _unique_dir(path: Path) -> Path:
    candidate, n = path, 1
    while candidate.exists():
        candidate, n = path.with_name(f"{path.name}-{n}"), n + 1
    return candidate


def _settings(out: Path | None, profile: str | None, warmups: int | None, samples: int | None
              ) -> tuple[str, Profile, int, int]:
    """The platform, profile and per-case counts of a run; refuses bad counts and an existing ``out``."""
    platform = jax.default_backend()
    prof = get_profile(profile or default_profile(platform))
    warmups = prof.warmups if warmups is None else warmups
    samples = prof.samples if samples is None else samples
    if warmups < 0 or samples < 1:
        raise ValueError(f"need warmups >= 0 and samples >= 1, got {warmups} and {samples}")
    if out is not None and Path(out).exists():
        raise FileExistsError(f"run folder {out} already exists; refusing to overwrite it")
    return platform, prof, warmups, samples


def measured_candidates(profile: Profile, scopes: Sequence[str], platform: str | None = None
                        ) -> tuple[str, list[str]]:
    """The record's headline candidate and every measured kernel's candidate name (each answers for its own
    rows: ``builder.verdicts``): each kernel
    the scopes time on ``platform`` (default: this host's backend) is graded under the name the registry
    gives it (``Implementation.grading_name``), so the graded kernel is the timed one; the paged kernel
    of ``paged-decode`` (``paged-pallas``, ``paged-triton`` on a GPU) on the paged contract, the ragged kernel of
    ``ragged`` (``ragged-pallas``, ``ragged-triton`` on a GPU) on the ragged contract."""
    from kernel_src import registry

    kernels = []
    if {"softmax", "attention"} & set(scopes):
        kernels.append("pallas")
    if ({"flash", *MODEL_SCOPES, *MASK_SCOPES} & set(scopes)
            or ("sharded" in scopes and profile.sharded_kernel == "flash")):
        kernels.append("flash")
    if "sharded" in scopes and profile.sharded_kernel == "pallas" and "pallas" not in kernels:
        kernels.append("pallas")
    for scope in PAGED_SCOPES + RAGGED_SCOPES:
        if scope in scopes:
            kernels += [impl.grading_name for impl in registry.for_scope(scope, platform or jax.default_backend())
                        if impl.kind == "kernel" and impl.grading_name]
    kernels = kernels or ["reference"]
    return kernels[0], kernels


def _failed_scorecard(candidate: str, error: BaseException) -> dict[str, Any]:
    return {"candidate": candidate, "kind": "kernel", "passed": False, "score": 0, "max_score": 0,
            "error": f"{type(error).__name__}: {error}"[:2000], "checks": []}


def grading_workers(candidates: int, platform: str | None = None) -> int:
    """How many candidates ``grade`` grades at once: one per core on a CPU (each in its own worker process, the
    grader's side mostly waiting on it or in NumPy and XLA, outside the GIL), one on an accelerator (a worker
    holds the chip)."""
    if (platform or jax.default_backend()) != "cpu":
        return 1
    return max(1, min(candidates, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else
                      os.cpu_count() or 1))


def grade(kernels: Sequence[str], *, seed: int, progress: bool,
          known_bad: Sequence[str] | None = None, kernel_level: str = "full",
          kernel_features: Mapping[str, Sequence[str]] | None = None) -> list[dict[str, Any]]:
    """Scorecards of ``kernels`` at ``kernel_level`` (each on ``kernel_features[kernel]``: the features its rows
    use, ``builder.verdicts.features_by_candidate``; default every feature it declares; a paged kernel on the paged
    contract, as ``grading.rubric`` grades every paged built-in) and of the known-bad candidates (default:
    every built-in one, the paged ones where a paged kernel is graded; ``()``: none) at the quick level (the base contract and the
    features their intended checks grade), each candidate in its own worker process (``grading_workers`` of
    them at once); every scorecard says its ``level``. The known-bad ones only show that the rubric still
    rejects them here; the measured kernels' verdict is the one that counts, so it gets the model-sized problems.

    If the rubric itself cannot run, each kernel gets a failed scorecard naming the error, so the
    run is still written and honestly rejected by the builder.
    """
    try:
        from ..grading import candidates, contracts, rubric
        from kernel_src.contract import FEATURES

        if known_bad is None:  # the default contract's, and another contract's where a kernel of it is graded
            every = candidates.builtins()
            graded = {contracts.DEFAULT.name, *(every[name].contract for name in kernels if name in every)}
            known_bad = [name for contract in contracts.CONTRACTS.values() if contract.name in graded
                         for name, c in contract.builtins.items() if c.kind == "known-bad"]
        names = list(dict.fromkeys([*kernels, *known_bad]))
        levels = {name: kernel_level if name in kernels else "quick" for name in names}
        # A known-bad is graded on the base contract and the feature its bug is in (its intended checks),
        # not on every feature it declares: that is what showing the rubric still rejects it needs.
        asked = (lambda name: None) if kernel_features is None else (lambda name: kernel_features.get(name, ()))
        features = {name: asked(name) if name in kernels else
                    [c for c in candidates.resolve(name).catches if c in FEATURES] for name in names}
        with ThreadPoolExecutor(grading_workers(len(names))) as pool, \
                tqdm(total=len(names), desc="rubric", unit="candidate", disable=not progress) as bar:
            def one(name: str) -> dict[str, Any]:
                card = rubric.grade(name, seed=seed, level=levels[name], features=features[name]).to_dict()
                bar.update()
                return card
            return list(pool.map(one, names))
    except Exception as error:  # noqa: BLE001 - recorded in the run, which the builder then rejects
        return [_failed_scorecard(name, error) for name in kernels]


def _power(power_seeds: int, progress: bool) -> dict[str, Any] | None:
    if power_seeds <= 0:
        return None
    from ..sweeps import power

    return power.measure_power(seeds=power_seeds, progress=progress)


def run_measure(out: Path | None = None, *, profile: str | None = None, warmups: int | None = None,
                samples: int | None = None, scopes: Sequence[str] | None = None, seed: int = 0,
                power_seeds: int = 0, known_bad: bool | None = None, progress: bool = True) -> Path:
    """Measure the kernels on this machine and write one run folder; return its path.

    Args:
      out: the run folder to create (must not exist); default ``runs/<run_id>/``.
      profile: ``cpu``, ``tiny``, ``tpu-v5e`` or ``gpu``; default from the platform.
      warmups, samples: per case; the profile's defaults (5 and 20; cpu 2 and 10) when ``None``.
      scopes: subset of ``bench.cases.SCOPES`` (``softmax``, ``attention``, ``flash``, ``sharded``,
        the masks models run, ``masks-fwd``, ``masks-fwd-bwd``, the paged decode step ``paged-decode``,
        the ragged serving step ``ragged``, and on a TPU or GPU the model-sized ``model-fwd``, ``model-fwd-bwd``); the profile's defaults
        when ``None``.
      seed: inputs, bootstrap resampling and the rubric.
      power_seeds: seeds for the rubric's grader-power summary; 0 records ``power: null``.
      known_bad: also grade every known-bad built-in (quick level); the profile's
        ``grade_known_bad`` when ``None``. Skipping them is said in the run's notes.
      progress: tqdm bars while running and the summary table after.

    Raises:
      FileExistsError: ``out`` exists (checked before measuring, and again at the write).
      ValueError: unknown profile or scope, or negative counts.
      SecretLeakError: a credential's value appeared in a file; nothing is written.
    """
    platform, prof, warmups, samples = _settings(out, profile, warmups, samples)
    scopes = list(dict.fromkeys(scopes or prof.scopes))
    created = environment.utc_now()
    run_id = environment.run_id_for(platform, jax.devices()[0].device_kind, created)

    # every case timed first; the deviceless TPU compiles it leaves run beside the rubric, after the last sample
    bench = run_benchmark(prof, scopes, warmups=warmups, samples=samples, seed=seed, progress=progress,
                          defer_tpu=True)
    measured, kernels = measured_candidates(prof, scopes)
    known_bad = prof.grade_known_bad if known_bad is None else known_bad
    # a quick grade (a CPU profile's) covers the base contract and the features each kernel's rows use; the
    # full level every feature the kernel declares
    used = features_by_candidate(bench.cases, {"measured_candidate": measured})
    with ThreadPoolExecutor(1) as compiler:
        compiling = compiler.submit(bench.finish)
        scorecards = grade(kernels, seed=seed, progress=progress, known_bad=None if known_bad else (),
                           kernel_level=prof.kernel_level,
                           kernel_features=None if prof.kernel_level == "full" else used)
        compiling.result()
    notes = ([INTERPRET_WARNING] if bench.interpret else []) + bench.notes
    if prof.kernel_level != "full":
        notes.append(QUICK_LEVEL_NOTE.format(profile=prof.name))
    if not known_bad:
        notes.append(KNOWN_BAD_SKIPPED_NOTE.format(profile=prof.name))
    if any(c["peak_memory_bytes"] is not None for c in bench.cases):
        notes.append(PEAK_MEMORY_NOTE)
    documents = {
        "environment": environment.capture(run_id=run_id, created=created, profile=prof.name,
                                           devices_used=bench.devices_used, interpret=bench.interpret,
                                           notes=notes),
        "correctness": {"format_version": 1, "run_id": run_id, "source": "measured", "seed": seed,
                        "measured_candidate": measured, "scorecards": scorecards,
                        "power": _power(power_seeds, progress)},
        "benchmark": {"format_version": 1, "run_id": run_id, "source": "measured", "profile": prof.name,
                      "platform": platform, "interpret": bench.interpret, "warmups": warmups,
                      "samples_per_case": samples, "cases": bench.cases, "pairs": bench.pairs},
    }
    _refuse_secrets(documents, bench.files)
    out_dir = Path(out) if out is not None else _unique_dir(RUNS_DIR / run_id)
    rawio.write_run(out_dir, documents, bench.files)
    if progress:
        print(summary(documents["benchmark"], documents["correctness"]), file=sys.stderr)
    return out_dir


def _refuse_secrets(documents: dict[str, Any], files: dict[str, bytes]) -> None:
    everything = {f"{name}.json": rawio.dumps(doc) for name, doc in documents.items()} | dict(files)
    leaks = environment.find_secrets(everything)
    if leaks:
        raise SecretLeakError(f"a credential's value appears in {leaks}; nothing was written")


def summary(benchmark: dict[str, Any], correctness: dict[str, Any]) -> str:
    """A plain-text table of the run: cases by scope and sequence, medians, ratios, checks passed."""
    by_id = {c["case_id"]: c for c in benchmark["cases"]}

    def ms(case: dict[str, Any]) -> str:
        if case["status"] != "ok":
            return "FAILED"
        return f"{case['median_ms']:.4f} ms" + (" (interp)" if case["interpret"] else "")

    lines = [f"{'scope':<10}{'seq':>6}  {'numerator':<24}{'median':>22}  {'baseline':<24}{'median':>22}"
             f"  {'ratio [95% CI]':<24}"]
    for pair in benchmark["pairs"]:
        num, den = by_id[pair["numerator"]], by_id[pair["denominator"]]
        ratio = ("n/a" if pair["ratio"] is None
                 else f"{pair['ratio']:.2f}x [{pair['ci_low']:.2f}, {pair['ci_high']:.2f}]")
        if pair.get("scaling_efficiency") is not None:
            ratio += f" eff {pair['scaling_efficiency']:.2f}"
        lines.append(f"{pair['scope']:<10}{pair['seq_len']:>6}  {num['implementation']:<24}{ms(num):>22}  "
                     f"{den['implementation']:<24}{ms(den):>22}  {ratio:<24}")
    paired = {p[k] for p in benchmark["pairs"] for k in ("numerator", "denominator")}
    for case in benchmark["cases"]:
        if case["case_id"] not in paired:
            lines.append(f"{case['scope']:<10}{case['seq_len']:>6}  {case['implementation']:<24}{ms(case):>22}")
    failed = [c for c in benchmark["cases"] if c["status"] != "ok"]
    lines.append(f"cases: {len(benchmark['cases']) - len(failed)} ok, {len(failed)} failed"
                 + "".join(f"\n  {c['case_id']}: {c['error']}" for c in failed))
    for card in correctness["scorecards"]:
        checks = card["checks"]
        passed = sum(c["passed"] for c in checks)
        verdict = "PASSED" if card["passed"] else "failed"
        expect = " (known-bad: expected to fail)" if card["kind"] == "known-bad" else ""
        lines.append(f"rubric {card['candidate']:<24} {passed}/{len(checks)} checks, {verdict}{expect}"
                     + (f" - {card['error']}" if card.get("error") else ""))
    if benchmark["interpret"]:
        lines.append("WARNING: " + INTERPRET_WARNING)
    return "\n".join(lines)


def run_submitted(spec: str, name: str, out: Path | None = None, *, profile: str | None = None,
                  warmups: int | None = None, samples: int | None = None, seed: int = 0, level: str = "full",
                  isolation: str = "auto", progress: bool = True, candidate_dir: Path | None = None,
                  contract: str = "attention", case_budget_s: float | None = None) -> Path:
    """``measure --candidate SPEC --name NAME`` (``measure.submission``): export the submitted kernel in a
    sandbox, grade the programs at ``level`` and time them beside XLA and the flash kernel at the
    profile's flash and model shapes (the project's kernels timed beside it graded at ``level`` too, each
    answering for its rows); write one run with source ``submitted``, programs kept. The timed
    shapes' inputs, checked calls and rows follow from entropy drawn after the export (recorded as
    ``submission.check_entropy``); ``seed`` is the rubric's. ``candidate_dir``: the folder of a kernel
    that spans several files (``grading.candidates.resolve``'s ``root``), bound into the exporter's sandbox.
    ``contract="paged"`` (``--paged``): a paged kernel, graded on the paged rubric and timed at the profile's
    ``paged-decode`` cases beside the paged implementations.
    ``case_budget_s``: seconds the submitted program may take at one timed case, announced to the
    supervising process (``measure.supervise``) that kills the measuring past it.

    Raises ``ProgramRefused`` (one line) for an export that fails or a program that is refused, and
    ``ValueError`` / ``FileExistsError`` as ``run_measure``."""
    import tempfile

    from ..measure import submission, timed_checks

    submission.check_name(name)
    platform, prof, warmups, samples = _settings(out, profile, warmups, samples)
    created = environment.utc_now()
    device_kind = jax.devices()[0].device_kind
    run_id = f"{environment.run_id_for(platform, device_kind, created)}-{name}"[:128]
    with tempfile.TemporaryDirectory(prefix="submission-") as folder:
        entry, templates, programs, digests, grading = submission.prepare(
            spec, profile=prof, seed=seed, level=level, platform=platform, isolation=isolation, folder=Path(folder),
            candidate_dir=candidate_dir, contract=contract)
        card = submission.grade_programs(name, Path(folder), digests, grading, seed=seed, level=level,
                                         platform=platform, features=tuple(entry.get("features", ())),
                                         contract=contract)
        entropy = timed_checks.draw_entropy()  # after the export: no program can know it
        card = submission.grade_timed_shapes(card, templates, programs, digests, entropy=entropy)
        files = {e["path"]: (Path(folder) / e["path"]).read_bytes() for e in entry["programs"]}
    bench = submission.run_benchmark_with(prof, warmups=warmups, samples=samples, seed=seed, progress=progress,
                                          contract=contract)
    submission.time_submission(bench, templates, programs, digests, warmups=warmups, samples=samples, seed=seed,
                               entropy=entropy, device_kind=device_kind, progress=progress,
                               case_budget_s=case_budget_s)
    # the project's kernels timed beside it answer for their rows too (builder.verdicts), graded on the
    # features those rows use
    _, kernels = measured_candidates(prof, submission.bench_scopes(prof, contract), platform)
    baselines = grade([k for k in kernels if k != "reference"], seed=seed, progress=progress, known_bad=(),
                      kernel_level=level,
                      kernel_features=features_by_candidate(bench.cases, {"measured_candidate": name}))
    notes = ([INTERPRET_WARNING] if bench.interpret else []) + bench.notes + [
        submission.SUBMITTED_NOTE.format(name=name)]
    env = environment.capture(run_id=run_id, created=created, profile=prof.name, devices_used=bench.devices_used,
                              interpret=bench.interpret, notes=notes)
    documents = {
        "environment": {**env, "source": "submitted"},
        "correctness": {"format_version": 1, "run_id": run_id, "source": "submitted", "seed": seed,
                        "measured_candidate": name, "scorecards": [card, *baselines], "power": None,
                        "submission": {"name": name, **entry, "check_entropy": entropy}},
        "benchmark": {"format_version": 1, "run_id": run_id, "source": "submitted", "profile": prof.name,
                      "platform": platform, "interpret": bench.interpret, "warmups": warmups,
                      "samples_per_case": samples, "cases": bench.cases, "pairs": bench.pairs},
    }
    files.update(bench.files)
    _refuse_secrets(documents, files)
    out_dir = Path(out) if out is not None else _unique_dir(RUNS_DIR / run_id)
    rawio.write_run(out_dir, documents, files)
    if progress:
        print(summary(documents["benchmark"], documents["correctness"]), file=sys.stderr)
    return out_dir
