"""Calibrate the tolerance policy: how large must ``k`` be for correct candidates never to be rejected?

``tpu-kernel-records calibrate`` measures, for the correct candidates (``reference`` and every built-in of
kind correct-variant, or those named; ``--kernels`` adds the Pallas and Triton flash kernels in interpret
mode on their first ``--kernel-seeds``), the *needed k* on ``seeds`` *calibration* seeds (``0, 1, ...``)
and as many *held-out* seeds (``HELD_OUT_FIRST_SEED, ...``), and :func:`report` turns the trials into the
table of ``grading/tolerance.py``: per candidate the largest needed ``k`` (forward / gradient) over each
set, the false rejects in each, and what the rule "k = RULE_MARGIN x the largest needed value on the
calibration seeds, rounded up" gives against the policy. Measured on CPU (numerics are valid there; no
speed is implied).

**A trial** (:func:`seed_trials`) computes what the needed k depends on and nothing else: every check of the
full level whose outcome holds tolerance verdicts (the candidate's errors against the float64 truth over the
reference's errors; :func:`numeric_checks`: every base check but output-shape-dtype and determinism, and
each declared feature's check), run as the rubric runs them, on the problems the full level draws: the
checks build them (``grading.dense.checks.problems``). **Slot groups.** Seeds come in groups of ``SLOT_GROUP``
(``0-4``, ``5-9``, ..., ``1000-1004``, ...) that share one draw of slots, the shapes, dtypes and flags of
the group's first seed (``grading.dense.checks.Context.slots_from``), each seed drawing its own values; so the
first seed of a group gets exactly its full-level scorecard's problems, every seed gets a full-level draw of
slots with fresh values, and the compiled programs of a group's first seed serve the rest
(``tests/test_calibration.py`` compares the draws problem by problem with the rubric's, and, slow, the
needed k of the reference's trial with its full scorecard's in the worker, at the quick level). The report
says how many slot draws each set covers. The trials of one seed are batched: the seed's problems, truth and
baselines are computed once, before its first candidate, and shared by all. A built-in (our own code) is
called in this process through the worker's own request handler (``sandbox.worker``: the same calls, the
same results as in its worker process), so its jitted functions and their compiled programs live across the
seeds of a group; they are let go when the next group starts, or once the memory mappings they hold pass
:func:`mappings_limit`. A file or module candidate is graded as any scorecard is, in its sandboxed worker
(``grading.rubric``), unchanged: on its seed's own slots.

**Cost**, measured (CPU seconds of this process, the ``cpu_s`` and ``shared_cpu_s`` of each trial record,
which the report sums over one machine's trials; here Intel(R) Xeon(R) Processor @ 2.80GHz, 2 cores, jax
0.10.2, two runs at once under ``nice``, one per core)::

    tpu-kernel-records calibrate --trials shard-1.jsonl --merge calibration/trials.jsonl --markdown shard-1.md
    tpu-kernel-records calibrate --shard 0/2 --kernels --resume --max-minutes 150 --quiet
    tpu-kernel-records calibrate --shard 1/2 --kernels --trials shard-1.jsonl --resume --max-minutes 150 --quiet
    tpu-kernel-records calibrate --merge shard-1.jsonl

gave, over the 1503 trials graded there (the report prices other machines' trials apart), **33.7 CPU-s per
candidate-seed** of a pure-JAX candidate: 5.7 of them the trial's share of its seed's problems, truth and
baselines, and the candidate's own 19.2-34.3 (reference 20.4, rounded-probs 25.1, online-softmax 19.2,
flash-style 33.6, per-head-dkv 33.7, online-softmax-features 34.3, flash-style-features 29.4). A slot group's
first seed compiles: its trials cost 63.0 CPU-s each, the other seeds' 26.4. The goal of <= 3 CPU-s per
candidate-seed is not reached: a compiled trial still runs the full level's problems (a 2,300 x 2,800 prefill,
131k-key caches, 64 heads) on a CPU, and its seed's float64 truth; reaching 3 CPU-s needs smaller problems,
which changes what the rubric grades. Compile options that give the same bits do not help
(``xla_llvm_disable_expensive_passes``), and ``xla_backend_optimization_level=0`` changes flash-style's
results, so neither is used. At 34 CPU-s, 200 + 200 seeds of the 7 correct pure-JAX built-ins are about 26
CPU-hours, about 13 hours of two pieces at once, a core each, which ``--resume`` lets run in pieces of a few
hours. The interpret-mode kernels are priced apart (their own CPU-s per seed at the full level, on AMD EPYC, 2
cores, jax 0.10.2: pallas 15, flash 103, flash-triton 38); ``--kernel-seeds`` keeps them to their first seeds
of each set.

**Memory.** A seed's truths are computed one problem at a time (the float64 truth of a full-level prefill
holds gigabytes), a finished seed's problems are let go, and the compiled programs are let go when a new
slot group starts, or once the process holds :func:`mappings_limit` memory mappings (each compiled XLA:CPU
program holds some; the kernel's default limit is 65,530).

**The sweep** (:func:`run`) goes seed by seed, a slot group of calibration seeds and one of held-out seeds
in turn (so a partial run holds both sets), appends each trial to a JSON Lines file as it finishes
(``sweeps.trials_file``: a killed run loses at most the trial in progress; a cut-off last line is dropped
and reported, and its trial graded again), skips on ``resume`` every trial the file holds (none is graded
twice), and stops cleanly once ``budget_s`` has passed (before the next trial). The file's first line names
the policy (with its allowed roundings), the slot group's size and the problems its trials were drawn from
(:func:`distribution_digest`), so a resume after any of them changed is refused, never mixed. ``shard``
splits the slot groups between runs, one per core, each with its own file, and :func:`merge` joins them; or
``workers`` / ``scheduler`` send each slot group to Dask as one task (:func:`group_trials`, through
``sweeps.sweep.map_on_dask``), the client appending its trials to the one file as they arrive. The
report is regenerated from whatever trials the file holds (``--report-only`` grades nothing), and says how
many seeds and slot draws of each set it covers; a run and a merge write the same report as ``--report-only``
(the file's trials in its order), and say what happened (a budget ran out, a source's cut-off line) on stderr.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..grading.dense import checks as C
from ..sweeps import power
from ..grading.candidates import BUILTIN, Candidate, resolve
from ..grading.dense.feature_checks import FEATURE_CHECKS
from ..grading.dense.problems import Problem
from ..sweeps.in_process_runner import InProcessRunner
from ..grading.runner import Runner
from ..grading.tolerance import POLICY
from ..sweeps.trials_file import TrialsFile
from kernel_src.contract import FEATURES

HELD_OUT_FIRST_SEED = 1000
RULE_MARGIN = 1.25
FORMAT = 3
# Seeds share their slots (shapes, dtypes, flags) in groups of this many: seed s takes the slots of
# ``slots_seed(s)``, the first seed of its group, and its values from itself (``grading.dense.checks.Context.slots_from``).
SLOT_GROUP = 5
# Where the committed calibration lives (relative to the checkout, as ``data`` is for ``verify``). Not under
# data/: every file there is checksummed by data/SHA256SUMS and traces back to a run folder in data/raw/.
CALIBRATION_DIR = Path("calibration")
TRIALS_PATH = CALIBRATION_DIR / "trials.jsonl"
REPORT_PATH = CALIBRATION_DIR / "REPORT.md"
KERNELS = ("pallas", "flash", "flash-triton")  # interpret mode on CPU: minutes per seed, so fewer seeds
KERNEL_SEEDS = 10
# Checks whose outcome holds no tolerance verdict: the needed k does not depend on them.
NO_VERDICTS = ("output-shape-dtype", "determinism")


def numeric_checks(features: Sequence[str] = ()) -> tuple[C.CheckSpec, ...]:
    """The checks a calibration trial runs for a candidate that declares ``features``: those of the full
    grade (``grading.rubric.checks_for``) that judge against the float64 truth."""
    return tuple(s for s in (*C.CHECKS, *(FEATURE_CHECKS[f] for f in features)) if s.name not in NO_VERDICTS)


def correct_candidates() -> list[str]:
    """The built-ins a calibration grades by default: the reference and every correct variant (pure JAX)."""
    return [n for n, c in BUILTIN.items() if c.kind in ("reference", "correct-variant")]


def slots_seed(seed: int) -> int:
    """The seed whose slots ``seed``'s problems take: the first of its group of ``SLOT_GROUP`` (both sets start
    at a multiple of it)."""
    return seed - seed % SLOT_GROUP


def calibration_seeds(seeds: int) -> list[int]:
    """``0..seeds-1`` and ``HELD_OUT_FIRST_SEED..``, a slot group of each in turn, so a partial run holds both
    sets and each group's seeds run one after another (their compiled programs recur)."""
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    out = []
    for first in range(0, seeds, SLOT_GROUP):
        group = range(first, min(seeds, first + SLOT_GROUP))
        out += [*group, *(HELD_OUT_FIRST_SEED + s for s in group)]
    return out


def calibration_tasks(seeds: int, candidates: Sequence[str], kernel_seeds: int | None = None,
                      kernels: Sequence[str] = KERNELS, shard: tuple[int, int] = (0, 1)) -> list[tuple[str, int]]:
    """Every ``(candidate, seed)``, seed-major; the ``kernels`` among ``candidates`` only on the first
    ``kernel_seeds`` of each set (default: all). ``shard`` ``(k, n)``: only the seeds of the slot
    groups ``g = s % HELD_OUT_FIRST_SEED // SLOT_GROUP`` with ``g % n == k`` (both sets; ``n`` runs, one per
    core, share the groups between them and each keeps its own trials file, joined by :func:`merge`)."""
    k, n = shard
    if not 0 <= k < n:
        raise ValueError(f"shard must be K/N with 0 <= K < N, got {k}/{n}")
    few = seeds if kernel_seeds is None else min(seeds, kernel_seeds)
    return [(name, seed) for seed in calibration_seeds(seeds) if seed % HELD_OUT_FIRST_SEED // SLOT_GROUP % n == k
            for name in candidates if name not in kernels or seed % HELD_OUT_FIRST_SEED < few]


@functools.lru_cache(maxsize=1)
def machine() -> str:
    """What graded a trial, for its CPU seconds: the processor's model name, its cores and JAX's version."""
    import jax

    model = platform.processor() or "unknown processor"
    try:
        with open("/proc/cpuinfo") as info:
            model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, jax {jax.__version__}"


def _cpu_s(children: bool = False) -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# --------------------------------------------------------------------------------------------------
# A trial: one candidate's numeric checks on one seed, the seed's problems shared by its candidates.

def seed_problems(seed: int, level: str = "full", features: Sequence[str] = FEATURES,
                  prepare: bool = True, slots_from: int | None = None) -> list[Problem]:
    """Every fresh problem the numeric checks (of a candidate declaring ``features``) draw on ``seed``, as
    the full grade draws them (the checks' own builders, through ``grading.dense.checks.problems``), in check
    order; with ``prepare`` their truth and baselines computed, one problem at a time (not on the background
    threads: three float64 truths of full-level prefills at once took two runs past 23 GB)."""
    planning = C._Planning(None, seed, level=level, ahead=False, slots_from=slots_from)
    found: list[Problem] = []

    def walk(x) -> None:
        if isinstance(x, Problem):
            if not x.derived:
                found.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y)

    for spec in numeric_checks(features):
        try:
            spec.run(planning)
        except Exception:  # noqa: BLE001  _Planned at the first call; anything else the graded run reports
            pass
        walk(C._CACHE.get(C.cache_key(planning, spec.name), []))
    for p in found if prepare else ():
        p.prepare()
    return found


def _trial(runner: Runner, cand: Candidate, seed: int, level: str,
           slots_from: int | None = None) -> "Scorecard":  # noqa: F821
    from ..grading.rubric import CheckResult, Scorecard, _finite, run_check

    runner.new_scorecard()
    error = None if runner.alive else runner.start()
    if error is not None:
        return Scorecard(cand.name, cand.kind, [CheckResult("load", False, 0.0, 0.0, error)], error=error,
                         seed=seed, level=level, isolation=runner.isolation)
    ctx = C.Context(runner, seed, level=level, slots_from=slots_from)
    results, verdicts = [], {}
    for spec in numeric_checks(runner.features):
        result, verdicts[spec.name] = run_check(spec, ctx)
        results.append(result)
    results.append(_finite(runner))
    return Scorecard(cand.name, cand.kind, results, seed=seed, level=level, verdicts=verdicts,
                     features=runner.features, isolation=runner.isolation)


def _features_of(cands: Sequence[Candidate]) -> tuple[str, ...]:
    """Every feature some of ``cands`` declares (a stranger's candidate: all, it is not loaded here)."""
    from kernel_src.contract import declared_features

    found = set()
    for cand in cands:
        try:
            found |= set(declared_features(cand.load())) if BUILTIN.get(cand.name) is cand else set(FEATURES)
        except Exception:  # noqa: BLE001  a load error is the trial's to report
            pass
    return tuple(f for f in FEATURES if f in found)


@dataclass
class Runners:
    """The in-process runners of built-ins, kept across seeds (their compiled programs with them)."""

    time_limit_s: float | None = None
    isolation: str = "auto"
    _kept: dict = field(default_factory=dict)

    def clear(self) -> None:
        """Let every kept runner go (its compiled programs with it, once JAX's caches are cleared)."""
        self._kept.clear()

    def of(self, cand: Candidate) -> InProcessRunner:
        if cand.name not in self._kept:
            self._kept[cand.name] = InProcessRunner(cand)
        return self._kept[cand.name]


def seed_trials(seed: int, names: Sequence[str], *, level: str = "full", slots_from: int | None = None,
                runners: Runners | None = None, on_trial: Callable[[dict], None] | None = None,
                stop: Callable[[], bool] = lambda: False) -> list[dict]:
    """The trial record of each candidate of ``names`` on ``seed`` (``power.trial_record`` plus ``cpu_s``, the
    candidate's CPU seconds, ``shared_cpu_s``, its share of the seed's problems, truth and baselines, and
    ``trial``: "numeric" in-process, "scorecard" for a stranger's candidate graded in its sandbox;
    ``machine``, what graded it (:func:`machine`); ``slots_from``, the seed its slots were drawn from:
    ``slots_from``, or ``seed`` itself when None and for a scorecard, which draws as every grade does). Each
    is passed to ``on_trial`` as it finishes; ``stop()`` is asked before each candidate."""
    from ..grading.rubric import grade_seeds

    runners = runners or Runners()
    cands = [resolve(n) for n in names]
    start = _cpu_s()
    seed_problems(seed, level, _features_of(cands), slots_from=slots_from)
    shared = (_cpu_s() - start) / max(1, len(cands))
    records = []
    for cand in cands:
        if stop():
            break
        cpu, children, wall = _cpu_s(), _cpu_s(children=True), time.perf_counter()
        if BUILTIN.get(cand.name) is cand:
            card, kind = _trial(runners.of(cand), cand, seed, level, slots_from), "numeric"
        else:
            limit = {} if runners.time_limit_s is None else {"time_limit_s": runners.time_limit_s}
            (card,) = grade_seeds(cand, [seed], level=level, isolation=runners.isolation, **limit)
            kind = "scorecard"
        record = power.trial_record(cand, seed, card, time.perf_counter() - wall)
        record.update(trial=kind, cpu_s=round(_cpu_s() - cpu + _cpu_s(children=True) - children, 2),
                      shared_cpu_s=round(shared, 2), machine=machine(),
                      slots_from=seed if kind == "scorecard" or slots_from is None else slots_from)
        records.append(record)
        if on_trial is not None:
            on_trial(record)
        release_compiled(runners)
    _forget(seed, level)
    return records


# --------------------------------------------------------------------------------------------------
# The sweep.

# Each compiled XLA:CPU program holds memory mappings of its own, and a full-level seed compiles hundreds
# (the seven pure-JAX candidates: about 40,000; with the three kernels in interpret mode, more); past the
# kernel's limit (vm.max_map_count, 65,530 by default) the next compile fails ("LLVM compilation error:
# Cannot allocate memory", then a crash). The seeds of a slot group reuse the programs of its first seed, so
# the count stops growing there, and the sweep lets every program go when a new group starts; past
# ``mappings_limit()`` it also lets them go after the trial that crossed it (the group's later seeds then
# compile again: raise vm.max_map_count to keep a whole group's programs, docs/DEVELOPING.md).
MAPPINGS_MARGIN = 20_000  # room for the trial that crosses the limit (a kernel in interpret mode adds thousands)


def mappings_limit() -> int:
    """How many memory mappings the compiled programs may hold before they are let go: the kernel's limit
    (``/proc/sys/vm/max_map_count``; 65,530 where it cannot be read) less ``MAPPINGS_MARGIN``, at least half
    of it."""
    try:
        kernel = int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        kernel = 65_530
    return max(kernel - MAPPINGS_MARGIN, kernel // 2)


def memory_mappings() -> int | None:
    """How many memory mappings this process has (Linux), or None where that cannot be read."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return None


def release_compiled(runners: "Runners", limit: int | None = None, *, now: bool = False) -> bool:
    """Past ``limit`` mappings (default :func:`mappings_limit`; or ``now``: a new slot group starts, whose
    shapes none of them serves), drop the built-ins' runners and JAX's caches of compiled programs; True if so."""
    import gc

    import jax

    count = memory_mappings()
    limit = mappings_limit() if limit is None else limit
    if not now and (count is None or count <= limit):
        return False
    runners.clear()
    jax.clear_caches()
    gc.collect()
    return True

# Slots added after the committed calibration (calibration/trials.jsonl) was drawn: their problems are graded
# by the policy, but no trial of the committed sweep measured what they need. Calibrating them (a sweep of
# today's full level) empties this tuple.
UNCALIBRATED_SLOTS = ("segments/chunk", "segments/decode")


def slot_of(label: str) -> str:
    """The slot a problem's label names (``"segments/chunk(2, 8, ...)"`` -> ``"segments/chunk"``)."""
    return label.split("(", 1)[0]


def distribution_digest(level: str = "full", *, leave_out: tuple[str, ...] = ()) -> str:
    """SHA-256 of what the trials of ``level`` are drawn from: every problem the numeric checks of a candidate
    declaring every feature draw on seed 0 (check order; labels, dtypes, flags and the bytes of every input),
    less the slots in ``leave_out``. A change to a check's problems (a new slot, another size range or value
    law) changes it, so trials drawn before the change are never mixed with trials drawn after it (:func:`run`
    refuses the file)."""
    digest = hashlib.sha256()
    for p in seed_problems(0, level, FEATURES, prepare=False):
        if slot_of(p.label) in leave_out:
            continue
        flags = [p.label, p.dtype, p.causal, p.scale, p.window, p.softcap]
        digest.update(json.dumps(flags).encode())
        for x in (p.q, p.k, p.v, p.ct, p.lengths, p.q_segments, p.kv_segments, p.sinks):
            if x is not None:
                x = np.ascontiguousarray(np.asarray(x))
                digest.update(f"{x.dtype}{x.shape}".encode())
                digest.update(x.reshape(-1).view(np.uint8))
    _forget(0, level)
    return digest.hexdigest()


def _forget(seed: int, level: str) -> None:
    """Drop the problems (inputs, truth, baselines) of ``seed`` kept by ``grading.dense.checks``: a sweep never
    comes back to a seed, and a full-level seed holds gigabytes."""
    for key in [k for k in C._CACHE if k[:2] == (seed, level)]:
        del C._CACHE[key]


def header(level: str, digest: str | None = None) -> dict:
    """The first line of a calibration's trials file: what its trials mean (a resume must match it), with
    the ``distribution_digest`` of the problems they were drawn from when ``digest`` is given."""
    sweep = {"format": FORMAT, "kind": "calibration", "level": level, "slot_group": SLOT_GROUP,
             "policy": POLICY.to_dict()}
    return {"sweep": sweep if digest is None else {**sweep, "problems": digest}}


@dataclass
class Sweep:
    """The trials a file holds after a run (task order, then any others it held), what is left, and notes."""

    trials: list[dict] = field(default_factory=list)
    graded: int = 0           # trials graded by this run
    remaining: int = 0        # tasks neither in the file nor graded (the budget ran out)
    notes: list[str] = field(default_factory=list)


def read_trials(path: Path, level: str = "full") -> tuple[list[dict], list[str]]:
    """The trial records of a calibration file and notes on it (a cut-off last line, dropped)."""
    from ..sweeps import trials_file

    found = trials_file.read(path)
    sweep = dict(found.header.get("sweep") or {}) if isinstance(found.header, dict) else {}
    sweep.pop("problems", None)  # what they were drawn from is checked by a run that adds to them
    if {"sweep": sweep} != header(level):
        raise ValueError(f"{path} holds another sweep (its first line is not {header(level)})")
    notes = [] if found.cut_off is None else [_cut_off_note(path, found.cut_off)]
    return [line["trial"] for line in found.lines if "trial" in line], notes


def merge(out: Path, sources: Sequence[Path]) -> tuple[int, list[str]]:
    """Append to ``out`` every trial of ``sources`` (other runs' trials files, e.g. other shards) that it does
    not hold yet; every file must have ``out``'s first line (the same level, policy and drawn problems), and
    ``out`` is created with theirs if it does not exist. Returns the trials added and notes (cut-off lines)."""
    from ..sweeps import trials_file

    found = [(path, trials_file.read(path)) for path in sources]
    first = trials_file.read(out).header if Path(out).exists() else (found[0][1].header if found else None)
    if first is None:
        return 0, []
    if not isinstance(first.get("sweep"), dict) or first["sweep"].get("kind") != "calibration":
        raise ValueError(f"{out} is not a calibration's trials file")
    for path, contents in found:
        if contents.header != first:
            raise ValueError(f"{path} holds another sweep (its first line must be {json.dumps(first)}); not merged")
    log, held = TrialsFile.open(out, first, resume=True)
    have = {(t["trial"]["candidate"], t["trial"]["seed"]) for t in (held.lines if held else []) if "trial" in t}
    added, notes = 0, [] if held is None or held.cut_off is None else [_cut_off_note(out, held.cut_off)]
    for path, contents in found:
        notes += [] if contents.cut_off is None else [_cut_off_note(path, contents.cut_off)]
        for line in contents.lines:
            key = (line["trial"]["candidate"], line["trial"]["seed"]) if "trial" in line else None
            if key is not None and key not in have:
                log.write(line)
                have.add(key)
                added += 1
    return added, notes


def _cut_off_note(path: Path, cut: str) -> str:
    return (f"{path}: its last line was cut off ({len(cut)} characters, a run killed while writing it) and is "
            f"dropped; that trial is graded again on --resume")


def compute_on_cpu() -> None:
    """Calibrate on the CPU, with the compile options a grading worker on a CPU uses (``sandbox.worker``), as
    long as JAX's backend has not started in this process (it has not when the command or a Dask worker starts)."""
    import jax
    from jax._src import xla_bridge

    from ..grading.candidates import CPU_COMPILE_OPTIONS
    from ..sandbox.worker import _add_xla_flags

    if xla_bridge.backends_are_initialized():
        return
    jax.config.update("jax_platforms", "cpu")
    os.environ["JAX_PLATFORMS"] = "cpu"  # and so for the sandboxed workers of a stranger's candidate
    _add_xla_flags(CPU_COMPILE_OPTIONS)


def group_trials(tasks: Sequence[tuple[str, int]], level: str, time_limit_s: float | None = None,
                 isolation: str = "auto") -> list[dict]:
    """The trial records of ``tasks`` (the ``(candidate, seed)``s of one slot group), seed by seed as :func:`run`
    grades them, where a Dask worker runs them: each seed's problems once, its candidates' trials after, the
    group's compiled programs let go at the end."""
    compute_on_cpu()
    runners = Runners(time_limit_s=time_limit_s, isolation=isolation)
    records: list[dict] = []
    try:
        for seed in dict.fromkeys(s for _, s in tasks):
            seed_trials(seed, [n for n, s in tasks if s == seed], level=level, slots_from=slots_seed(seed),
                        runners=runners, on_trial=records.append)
    finally:
        release_compiled(runners, now=True)
    return records


def run(tasks: Sequence[tuple[str, int]], *, level: str = "full", out: Path | None = None, resume: bool = False,
        budget_s: float | None = None, progress: bool = True, time_limit_s: float | None = None,
        isolation: str = "auto", clock: Callable[[], float] = time.monotonic, workers: int = 0,
        scheduler: str | None = None, task: Callable[..., list[dict]] = group_trials) -> Sweep:
    """Grade every ``(candidate, seed)`` of ``tasks`` that ``out`` does not hold yet (see the module doc):
    serially in this process, seed by seed, stopping before the next trial once ``budget_s`` has passed; or,
    with ``workers`` (a ``LocalCluster`` of that many) or ``scheduler`` (an existing cluster's address), one
    Dask task per slot group (``task``, default :func:`group_trials`), each trial appended to ``out`` by this
    process as its group's results arrive; a group that fails twice is named in ``Sweep.notes`` and its trials
    stay to grade (``Sweep.remaining``)."""
    from tqdm.auto import tqdm

    on_dask = bool(workers or scheduler)
    if on_dask and budget_s is not None:
        raise ValueError("--max-minutes runs serially; on Dask stop the run at any time and go on with --resume")
    log, found = TrialsFile.open(out, header(level, None if out is None else distribution_digest(level)), resume)
    result = Sweep()
    done: dict[tuple[str, int], dict] = {}
    if found is not None:
        for line in found.lines:
            if "trial" in line:
                done[(line["trial"]["candidate"], line["trial"]["seed"])] = line["trial"]
        if found.cut_off is not None:
            result.notes.append(_cut_off_note(out, found.cut_off))
    todo = [t for t in tasks if t not in done]
    deadline = None if budget_s is None else clock() + budget_s
    bar = tqdm(total=len(tasks), initial=len(tasks) - len(todo), desc="calibration", unit="trial",
               disable=not progress)

    def keep(record: dict) -> None:
        done[(record["candidate"], record["seed"])] = record
        log.write({"trial": record})
        result.graded += 1
        bar.update(1)
        bar.set_postfix_str(f"seed {record['seed']} {record['candidate']} {record['cpu_s']:.0f}+"
                            f"{record['shared_cpu_s']:.0f} CPU-s")

    if on_dask:
        _on_dask(todo, keep, result.notes, task, (level, time_limit_s, isolation), workers, scheduler)
    else:
        _serial(todo, keep, lambda: deadline is not None and clock() >= deadline, level,
                Runners(time_limit_s=time_limit_s, isolation=isolation))
    bar.close()
    result.remaining = sum(t not in done for t in tasks)
    wanted = set(tasks)
    result.trials = [done[t] for t in tasks if t in done] + [r for t, r in done.items() if t not in wanted]
    return result


def _serial(todo, keep, out_of_time, level, runners) -> None:
    group = None
    for seed in dict.fromkeys(s for _, s in todo):
        if out_of_time():
            break
        if group is not None and slots_seed(seed) != group:
            release_compiled(runners, now=True)
        group = slots_seed(seed)
        seed_trials(seed, [n for n, s in todo if s == seed], level=level, slots_from=group, runners=runners,
                    on_trial=keep, stop=out_of_time)


def _on_dask(todo, keep, notes, task, how, workers, scheduler) -> None:
    from ..sweeps.sweep import map_on_dask

    groups: dict[int, list[tuple[str, int]]] = {}
    for name, seed in todo:
        groups.setdefault(slots_seed(seed), []).append((name, seed))

    def lost(unit, error: str) -> None:
        seeds = sorted({seed for _, seed in unit[0]})
        notes.append(f"slot group of seeds {seeds[0]}-{seeds[-1]} ({len(unit[0])} trials) failed twice ({error}); "
                     f"`--resume` grades it again")

    def arrived(unit, records: list[dict]) -> None:
        for record in records:
            keep(record)

    # No Dask memory limit per worker: a full-level seed's float64 truths hold gigabytes for a moment.
    map_on_dask(task, [(tuple(g), *how) for g in groups.values()], workers=workers, scheduler=scheduler,
                on_result=arrived, on_failure=lost, memory_limit=0)
