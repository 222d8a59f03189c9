"""``measure --candidate SPEC --name NAME``: a submitted kernel graded and timed as the same programs.

1. The call signatures: the benchmark's (the profile's ``flash`` scope and model scopes, forward; the
   ``model-fwd-bwd`` cases time the same program's VJP) and the grader's, found by grading the trusted
   reference in this process with a recorder (a correct kernel's control flow; a call the submission's
   grade meets without a program fails that check).
2. ``grading.export``: the submission is imported only in a sandboxed worker, which exports a program
   per signature; here each is deserialized and checked (custom calls, effects, shapes) or refused; the sandboxed export itself is ``grading.exporter``.
3. The rubric grades :class:`grading.export.ProgramAttention` over those bytes at ``level``; the
   benchmark times the same bytes (``bench.submitted``) beside XLA and the project's flash kernel at the
   same shapes. Every program is kept as ``programs/<sha256>.jaxexport`` in the run, which the builder
   checks (``builder.submitted``).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import re
import tempfile
import zlib
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ..bench import roofline, stats
from ..bench.benchmark import BenchmarkResult, run_benchmark
from ..bench.cases import MODEL_SCOPES, Case, Profile
from ..bench.submitted import roofline_floor_ms, time_program
from ..grading.export import ProgramAttention, ProgramRefused, Signature, load_program, program_path
from ..grading.exporter import export_candidate

NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{1,63}$")
SUBMITTED = "submitted"  # the implementation name of a submitted kernel's cases
SUBMITTED_NOTE = ("A submitted kernel ({name}): its Python ran only in a sandboxed exporter; the programs "
                  "it exported were graded and timed here, and are kept under programs/.")


def check_name(name: str) -> str:
    if not NAME.match(name or ""):
        raise ValueError(f"--name {name!r}: use 2-64 characters of a-z, 0-9, '.', '_', '-', starting with a "
                         f"letter or digit")
    return name


def bench_scopes(profile: Profile) -> list[str]:
    """The scopes a submission is timed at: ``flash`` and the profile's model scopes."""
    return ["flash"] + [s for s in profile.scopes if s in MODEL_SCOPES]


# --- 1. signatures --------------------------------------------------------------------------------

class _Recorder:
    """A runner for the rubric's checks that calls the reference in this process and notes each call."""

    def __init__(self):
        from ..grading.candidates import jit_contract
        from kernel_src.reference import reference_attention

        self.fn = jit_contract(reference_attention)
        self.signatures: list[Signature] = []
        self.nonfinite, self.returned, self.timed_out, self.check = [], 0, False, ""

    def _note(self, p) -> None:
        self.signatures.append(Signature.of_call(p.q, p.k, p.v, **p.kwargs))

    def forward(self, p, *, check_shape: bool = True) -> np.ndarray:
        self._note(p)
        self.returned += 1
        return np.asarray(self.fn(p.q, p.k, p.v, **p.kwargs))

    def vjp(self, p):
        self._note(p)
        out, pull = jax.vjp(lambda q, k, v: self.fn(q, k, v, **p.kwargs), p.q, p.k, p.v)
        self.returned += 4
        return tuple(np.asarray(x) for x in (out, *pull(p.ct.astype(out.dtype))))


def grading_signatures(seed: int, level: str) -> list[Signature]:
    """Every call signature the rubric makes at ``seed`` and ``level`` on a correct kernel."""
    from ..grading import checks as C

    recorder = _Recorder()
    ctx = C.Context(recorder, seed, level=level)
    for spec in C.CHECKS:
        recorder.check = spec.name
        try:
            spec.run(ctx)
        except Exception:  # noqa: BLE001 - a check's verdict does not matter here, only its calls
            pass
    return list(dict.fromkeys(recorder.signatures))


def case_signature(case: Case) -> Signature:
    q, k, v = case.abstract_args[:3]
    return Signature(tuple(q.shape), tuple(k.shape), tuple(v.shape), str(np.dtype(q.dtype)), case.causal,
                     case.padded, case.shape["head_dim"] ** -0.5)


def submitted_case_id(case: Case) -> str:
    return case.case_id.replace(f"-{case.implementation}", f"-{SUBMITTED}", 1)


# --- 2. file identity -----------------------------------------------------------------------------

def source_file(spec: str) -> Path | None:
    """The file a ``file.py:fn`` or ``module:fn`` spec names, found without importing anything."""
    target = spec.rpartition(":")[0]
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target).expanduser().resolve()
        return path if path.is_file() else None
    found, search = None, None
    for part in target.split("."):
        found = importlib.machinery.PathFinder.find_spec(part, search)
        if found is None:
            return None
        search = found.submodule_search_locations
    origin = getattr(found, "origin", None)
    return Path(origin) if origin and Path(origin).is_file() else None


# --- 3. output checks -----------------------------------------------------------------------------

def check_output(sig: Signature, host: list[np.ndarray], out: Any, *, backward: bool, seed: int,
                 lengths: np.ndarray | None = None, rows: int = 64) -> tuple[bool, str]:
    """Judge a timed call's output (the forward's, or dQ of a forward + backward) on ``rows`` query rows
    of one batch element (picked from ``seed``) against the float64 oracle, with the rubric's tolerance
    policy (bound by the contract-precision reference's error on the same rows)."""
    from kernel_src.reference import reference_attention
    from ..grading import oracle, tolerance

    q, k, v = host[:3]
    if sig.has_lengths and lengths is None:
        lengths = host[-1]
    ct = host[3] if backward else None
    rng = np.random.default_rng([seed, 7])
    b = int(rng.integers(q.shape[0]))
    n = min(rows, q.shape[1])
    r0 = int(rng.integers(q.shape[1] - n + 1))
    keys = k.shape[1]
    if sig.causal:  # keys past the last row's visible ones drop out, keeping the bottom-right offset
        keys = max(1, min(keys, r0 + n + keys - q.shape[1]))
    sub = dict(q=q[b:b + 1, r0:r0 + n], k=k[b:b + 1, :keys], v=v[b:b + 1, :keys])
    sub_lengths = None if lengths is None else np.minimum(lengths[b:b + 1], keys).astype(np.int32)
    kwargs = dict(causal=sig.causal, kv_lengths=sub_lengths, scale=sig.scale)
    got = np.asarray(jax.device_get(out[0] if backward else out))[b:b + 1, r0:r0 + n]
    if backward:
        sub_ct = ct[b:b + 1, r0:r0 + n]
        truth = oracle.attention(sub["q"], sub["k"], sub["v"], sub_ct, **kwargs)
        _, pull = jax.vjp(lambda q_: reference_attention(q_, sub["k"], sub["v"], **kwargs), sub["q"])
        baseline = np.asarray(pull(sub_ct)[0])
        expected, magnitude, what = truth.dq, truth.magnitude.get("dq"), "dq"
    else:
        truth = oracle.attention(sub["q"], sub["k"], sub["v"], **kwargs)
        baseline = np.asarray(reference_attention(sub["q"], sub["k"], sub["v"], **kwargs))
        expected, magnitude, what = truth.out, truth.magnitude.get("out"), "output"
    verdict = tolerance.judge(f"{what} rows {r0}-{r0 + n - 1} of batch {b}", got, expected, baseline, sig.dtype,
                              gradient=backward, magnitude=magnitude, logit_scale=truth.logit_max)
    return verdict.ok, verdict.describe()


# --- 4. the run -----------------------------------------------------------------------------------

def _fresh_inputs(case: Case, seed: int):
    """Sample ``i``'s host inputs: fresh q, k, v (and cotangent) values; the profile's key lengths."""
    host = case.make_inputs()
    ints = {j: host[j] for j, a in enumerate(case.abstract_args) if np.dtype(a.dtype).kind == "i"}

    def make(i: int) -> list[np.ndarray]:
        rng = np.random.default_rng(np.random.SeedSequence([seed, zlib.crc32(case.case_id.encode()), i + 2 ** 20]))
        return [ints[j] if j in ints else rng.standard_normal(a.shape, dtype=np.float32).astype(a.dtype)
                for j, a in enumerate(case.abstract_args)]
    return make


def time_submission(bench: BenchmarkResult, templates: list[Case], programs: dict[str, Any], digests: dict[str, str],
                    *, warmups: int, samples: int, seed: int, device_kind: str, progress: bool) -> None:
    """Add one timed case per template (the submitted program at its shape) and its pairs to ``bench``."""
    from tqdm.auto import tqdm

    by_group: dict[tuple, list[str]] = {}
    for case in bench.cases:
        by_group.setdefault((case["scope"], case["seq_len"], case["shape"]["num_q_heads"]), []).append(case["case_id"])
    for case in tqdm(templates, desc="submitted", unit="case", disable=not progress):
        backward = case.scope == "model-fwd-bwd"
        sig = case_signature(case)
        exported = programs[sig.key]
        if backward:
            def fn(q, k, v, d_out, exported=exported):
                return jax.vjp(exported.call, q, k, v)[1](d_out)
        elif sig.has_lengths:
            fn = exported.call
        else:
            def fn(q, k, v, exported=exported):
                return exported.call(q, k, v)
        case_id = submitted_case_id(case)
        record = {k: v for k, v in _template_record(case).items()}
        record.update(case_id=case_id, implementation=SUBMITTED, program_sha256=digests[sig.key],
                      interpret=jax.default_backend() == "cpu",  # no kernel speed on a CPU
                      roofline_floor_ms=roofline_floor_ms(case.flops, case.bytes_moved, device_kind))
        try:
            timing = time_program(fn, case.abstract_args, _fresh_inputs(case, seed), warmups=warmups, samples=samples,
                                  check=lambda i, host, out: check_output(sig, host, out, backward=backward,
                                                                          seed=seed + i),
                                  seed=seed, key=case_id)
            record.update(samples_ms=timing.samples_ms, lower_ms=timing.lower_ms, compile_ms=timing.compile_ms,
                          transfer_ms=timing.transfer_ms, output_checks=timing.output_checks)
            record.update(stats.summarize(timing.samples_ms))
            record.update(roofline.rates(case.flops, case.bytes_moved, record["median_ms"], device_kind, 1))
        except Exception as error:  # noqa: BLE001 - recorded, and the builder refuses the run
            record.update(status="failed", error=f"{type(error).__name__}: {error}"[:2000], output_checks=[])
        bench.cases.append(record)
        for other in by_group.get((case.scope, case.seq_len, case.shape["num_q_heads"]), []):
            ratio, low, high = (stats.ratio_of_medians(record["samples_ms"], _by_id(bench, other)["samples_ms"],
                                                       seed=seed, key=f"{case_id}/{other}")
                                if record["status"] == "ok" and _by_id(bench, other)["status"] == "ok"
                                else (None, None, None))
            bench.pairs.append({"scope": case.scope, "seq_len": case.seq_len, "numerator": case_id,
                                "denominator": other, "ratio": ratio, "ci_low": low, "ci_high": high})


def _by_id(bench: BenchmarkResult, case_id: str) -> dict[str, Any]:
    return next(c for c in bench.cases if c["case_id"] == case_id)


def _template_record(case: Case) -> dict[str, Any]:
    return {"case_id": case.case_id, "scope": case.scope, "implementation": case.implementation,
            "seq_len": case.seq_len, "shape": dict(case.shape), "dtype": case.dtype, "causal": case.causal,
            "padded": case.padded, "devices_used": 1, "status": "ok", "error": None, "interpret": False,
            "transfer_ms": None, "lower_ms": None, "compile_ms": None, "samples_ms": [],
            **stats.summarize([]), "peak_memory_bytes": None, "flops": case.flops, "bytes_moved": case.bytes_moved,
            **roofline.rates(None, None, None, "", 1), "stablehlo": None, "stablehlo_tpu": None}


def templates_for(profile: Profile, scopes: list[str], seed: int, platform: str) -> list[Case]:
    """One case per shape of ``scopes`` (the first implementation's), the shape a submission is timed at."""
    from ..bench.cases import build_cases

    cases, _ = build_cases(profile, scopes, seed=seed, platform=platform)
    seen, out = set(), []
    for case in cases:
        key = (case.scope, case.seq_len, case.shape["num_q_heads"], case.shape["num_kv_heads"])
        if key not in seen:
            seen.add(key)
            out.append(case)
    return out


def prepare(spec: str, *, profile: Profile, seed: int, level: str, platform: str, isolation: str,
            folder: Path) -> tuple[dict[str, Any], list[Case], dict[str, Any], dict[str, str], list[Signature]]:
    """Signatures, export and checks: ``(submission entry, templates, programs by key, sha256 by key,
    grading signatures)``; the programs' bytes are written under ``folder``. Raises ``ProgramRefused``."""
    from ..grading import isolation as isolations
    from ..grading.candidates import resolve

    templates = templates_for(profile, bench_scopes(profile), seed, platform)
    grading = grading_signatures(seed, level)
    bench_sigs = {case_signature(c).key: c for c in templates}
    wanted = list(dict.fromkeys([*grading, *(case_signature(c) for c in templates)]))
    try:
        where = isolations.choose(isolation, resolve(spec))
    except isolations.IsolationUnavailable as e:
        raise ProgramRefused(str(e)) from None
    raw = export_candidate(spec, wanted, platform=platform, isolation=where)
    programs, digests, entries = {}, {}, {}
    grading_keys = {s.key for s in grading}
    for sig in wanted:
        data = raw[sig.key]
        programs[sig.key] = load_program(data, sig, platform)
        digest = digests[sig.key] = hashlib.sha256(data).hexdigest()
        path = folder / program_path(digest)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        entry = entries.setdefault(digest, {"sha256": digest, "path": program_path(digest),
                                            "signature": sig.to_dict(), "grading": False, "cases": []})
        entry["grading"] |= sig.key in grading_keys or sig.key in bench_sigs  # rubric, or timed-shapes
        if sig.key in bench_sigs:
            entry["cases"].append(submitted_case_id(bench_sigs[sig.key]))
    file = source_file(spec)
    target, _, function = spec.rpartition(":")
    shown = f"{Path(target).name}:{function}" if file is not None and target.endswith(".py") else spec
    submission = {"spec": shown, "file_sha256": hashlib.sha256(file.read_bytes()).hexdigest() if file else None,
                  "platform": platform, "isolation": where, "programs": list(entries.values())}
    return submission, templates, programs, digests, grading


def grade_programs(name: str, folder: Path, digests: dict[str, str], grading: list[Signature], *, seed: int,
                   level: str, platform: str) -> dict[str, Any]:
    """The rubric's scorecard of the stored programs (the grading signatures' only), with their hashes."""
    from ..grading import rubric
    from ..grading.candidates import Candidate

    table = {s.key: digests[s.key] for s in grading}
    program = ProgramAttention(str(folder), table, platform)
    candidate = Candidate(name, "external", f"Submitted kernel {name}, as the programs it exported.",
                          lambda: program)
    card = rubric.grade(candidate, seed=seed, level=level, isolation="process").to_dict()
    card["programs"] = sorted(set(table.values()))
    return card


TIMED_SHAPES_CHECK = "timed-shapes"


def grade_timed_shapes(card: dict[str, Any], templates: list[Case], programs: dict[str, Any],
                       digests: dict[str, str], *, seed: int) -> dict[str, Any]:
    """Add the check ``timed-shapes`` to ``card``: each program the benchmark times, run here (no submitter
    Python) on seeded inputs at its shape, forward and VJP, judged like the timed calls (``check_output``);
    its hash joins the graded programs."""
    details, passed = [], True
    for case in templates:
        sig = case_signature(case)
        exported = programs[sig.key]
        host = _fresh_inputs(case, seed + 1)(-100)[:3]
        lengths = case.make_inputs()[3] if sig.has_lengths else None
        extra = (lengths,) if lengths is not None else ()
        try:
            out = exported.call(*host, *extra)
            ok, detail = check_output(sig, [*host, *extra], out, backward=False, seed=seed)
            ct = np.random.default_rng([seed, 11]).standard_normal(host[0].shape).astype(host[0].dtype)
            _, pull = jax.vjp(lambda q, k, v: exported.call(q, k, v, *extra), *host)
            ok_dq, detail_dq = check_output(sig, [*host, ct], pull(ct), backward=True, seed=seed, lengths=lengths)
        except Exception as error:  # noqa: BLE001 - the program's failure is the check's verdict
            ok, ok_dq, detail, detail_dq = False, False, f"raised {type(error).__name__}: {error}"[:300], ""
        passed &= ok and ok_dq
        details.append(f"{submitted_case_id(case)}: {detail}; {detail_dq}")
    check = {"name": TIMED_SHAPES_CHECK, "passed": bool(passed), "points": 1.0 if passed else 0.0, "max_points": 1.0,
             "detail": " | ".join(details)[:2000], "error": None, "tolerance": None, "baseline_error": None}
    card = dict(card, checks=[*card["checks"], check])
    card.update(passed=bool(card["passed"] and passed), score=card["score"] + check["points"],
                max_score=card["max_score"] + 1.0,
                programs=sorted({*card.get("programs", []), *(digests[case_signature(c).key] for c in templates)}))
    return card


def scratch() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="submission-")


def run_benchmark_with(profile: Profile, *, warmups: int, samples: int, seed: int, progress: bool) -> BenchmarkResult:
    return run_benchmark(profile, bench_scopes(profile), warmups=warmups, samples=samples, seed=seed,
                         progress=progress)
