"""``measure --candidate SPEC --name NAME``: a submitted kernel graded and timed as the same programs.

1. The call signatures: the benchmark's (the profile's ``flash`` scope and model scopes, forward; the
   ``model-fwd-bwd`` cases time the same program's VJP) and the grader's, found by grading the trusted
   reference in this process with a recorder (a correct kernel's control flow; a call the submission's
   grade meets without a program fails that check).
2. ``grading.export``: the submission is imported only in a sandboxed worker, which exports a program
   per signature (``grading.exporter``); here each is deserialized and checked (custom calls, effects,
   shapes) or refused.
3. The rubric grades :class:`grading.export.ProgramAttention` over those bytes at ``level``; the
   benchmark times the same bytes (``bench.submitted``) beside XLA and the project's flash kernel at the
   same shapes. Every program is kept as ``programs/<sha256>.jaxexport`` in the run, which the builder
   checks (``builder.submitted``).
4. At the timed shapes the timed calls' inputs, the checked calls and the rows judged follow from
   entropy drawn after the export (``measure.timed_checks``); the rubric's ``seed`` sets only the grade.

A paged kernel (``contract="paged"``, ``measure --candidate --paged``) goes the same way on the paged
contract: its signatures are :class:`grading.export.PagedSignature`s (the paged rubric's calls, recorded on
the paged reference, and one per ``paged-decode`` case of the profile that its declared features allow),
the rubric grades :class:`grading.export.ProgramPagedAttention` on the paged checks, and the programs are
timed (forward only) beside the paged implementations at those cases. A ragged kernel (``contract="ragged"``,
``--ragged``) likewise, at the profile's ``ragged`` cases (``measure.timed_contracts``: each contract's scopes,
templates and row check).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import re
import tempfile
import zlib
from functools import partial
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ..bench import roofline, stats
from ..bench.benchmark import BenchmarkResult, run_benchmark
from ..bench.cases import MODEL_SCOPES, Case, Profile
from ..bench.submitted import roofline_floor_ms, time_program
from ..builder.verdicts import features_used
from ..grading import contracts
from ..grading.contracts import Contract
from ..grading.export import PagedSignature, ProgramRefused, Signature, load_program, program_path
from ..grading.exporter import export_declared
from .supervise import DEFAULT_CASE_BUDGET_S, announce
from .timed_checks import check_output, check_rng
from . import timed_contracts
from .timed_contracts import BY_SCOPE, TIMED

NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{1,63}$")
SUBMITTED = "submitted"  # the implementation name of a submitted kernel's cases
SUBMITTED_NOTE = ("A submitted kernel ({name}): its Python ran only in a sandboxed exporter; the programs "
                  "it exported were graded and timed here, and are kept under programs/.")


def check_name(name: str) -> str:
    if not NAME.match(name or ""):
        raise ValueError(f"--name {name!r}: use 2-64 characters of a-z, 0-9, '.', '_', '-', starting with a "
                         f"letter or digit")
    return name


def bench_scopes(profile: Profile, contract: str = "attention") -> list[str]:
    """The scopes a submission is timed at: ``flash`` and the profile's model scopes; its contract's own
    (``measure.timed_contracts``: ``paged-decode`` for a paged kernel, ``ragged`` for a ragged one)."""
    if contract in TIMED:
        timed = TIMED[contract]
        if not getattr(profile, timed.models):
            raise ProgramRefused(f"profile {profile.name!r} has no {'/'.join(timed.scopes)} cases to time a "
                                 f"{contract} kernel at")
        return list(timed.scopes)
    return ["flash"] + [s for s in profile.scopes if s in MODEL_SCOPES]


# --- 1. signatures --------------------------------------------------------------------------------

class _Recorder:
    """The checks' runner (``grading.calls.Calls``) that calls the contract's reference in this process and
    notes each call's signature (the contract's ``signature_type``)."""

    def __init__(self, contract: Contract, features: tuple[str, ...] = ()):
        self.fn, self.signature_type = contract.reference(), contract.signature_type
        self.features = features  # the ragged checks call a kernel only with the features it declares
        self.signatures: list = []
        self.nonfinite, self.returned, self.timed_out, self.check = [], 0, False, ""

    def _call(self, *args, **kwargs) -> np.ndarray:
        self.signatures.append(self.signature_type.of_call(*args, **kwargs))
        self.returned += 1
        return np.asarray(self.fn(*args, **kwargs))

    def forward(self, p, *, check_shape: bool = True) -> np.ndarray:
        return self._call(p.q, p.k, p.v, **p.kwargs)

    def paged_forward(self, p) -> np.ndarray:
        return self._call(p.q, p.k_pages, p.v_pages, **p.kwargs)

    holes = True  # as the grader's runner (grading.runner): ragged-long's full level asks for a pool past 2^31
    BIG_POOL = 2 ** 31  # elements of a pool whose call is noted but not run here (grading.ragged.big_pool)

    def ragged_forward(self, p) -> np.ndarray:
        if p.k_pages.size >= self.BIG_POOL:
            self.signatures.append(self.signature_type.of_call(p.q, p.k_pages, p.v_pages, **p.kwargs))
            return np.zeros(p.q.shape, p.q.dtype)
        return self._call(p.q, p.k_pages, p.v_pages, **p.kwargs)

    def vjp(self, p):
        self.signatures.append(self.signature_type.of_call(p.q, p.k, p.v, **p.kwargs))
        kwargs = {n: x for n, x in p.kwargs.items() if n != "sinks"}
        if p.sinks is None:
            out, pull = jax.vjp(lambda q, k, v: self.fn(q, k, v, **kwargs), p.q, p.k, p.v)
        else:
            out, pull = jax.vjp(lambda q, k, v, s: self.fn(q, k, v, **kwargs, sinks=s), p.q, p.k, p.v, p.sinks)
        result = tuple(np.asarray(x) for x in (out, *pull(p.ct.astype(out.dtype))))
        self.returned += len(result)
        return result


def grading_signatures(seed: int, level: str, features: tuple[str, ...] = (), contract: str = "attention") -> list:
    """Every call signature the rubric makes at ``seed`` and ``level`` on a correct kernel that declares
    ``features`` (on the paged contract: the paged rubric's calls, as ``PagedSignature``s)."""
    from ..grading.dense.context import Context

    recorder = _Recorder(contracts.get(contract), features)
    ctx = Context(recorder, seed, level=level)
    for spec in contracts.get(contract).checks_for(features):
        recorder.check = spec.name
        try:
            spec.run(ctx)
        except Exception:  # noqa: BLE001 - a check's verdict does not matter here, only its calls
            pass
    return list(dict.fromkeys(recorder.signatures))


def case_signature(case: Case) -> Signature | PagedSignature:
    if case.scope in BY_SCOPE:
        return timed_contracts.case_signature(case)
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


# --- 3. the run -----------------------------------------------------------------------------------

def _fresh_inputs(case: Case, entropy: str):
    """Sample ``i``'s host inputs: fresh q, k, v (and cotangent) values from the run's check entropy (drawn
    after the export, so no program knows them); the profile's key lengths."""
    host = case.make_inputs()
    ints = {j: host[j] for j, a in enumerate(case.abstract_args) if np.dtype(a.dtype).kind == "i"}

    def make(i: int) -> list[np.ndarray]:
        rng = np.random.default_rng([int(entropy, 16), zlib.crc32(case.case_id.encode()), i + 2 ** 20])
        return [ints[j] if j in ints else rng.standard_normal(a.shape, dtype=np.float32).astype(a.dtype)
                for j, a in enumerate(case.abstract_args)]
    return make


def device_memory_bytes(device=None) -> int | None:
    """Bytes a program may use on ``device`` (default the first): the runtime's ``bytes_limit`` on an
    accelerator, the memory available now on a CPU; None where neither is known."""
    device = device or jax.devices()[0]
    try:
        limit = (device.memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001 - a backend without memory statistics
        limit = None
    if limit:
        return int(limit)
    if device.platform == "cpu":
        import psutil
        return int(psutil.virtual_memory().available)
    return None


def program_bytes(compiled) -> int | None:
    """What a compiled program holds while it runs, by XLA's memory analysis: its arguments, outputs,
    temporaries and code, less the outputs that alias arguments; None where XLA does not say."""
    try:
        stats = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - a backend without the analysis
        return None
    if stats is None:
        return None
    sizes = [getattr(stats, f"{name}_size_in_bytes", 0) or 0
             for name in ("argument", "output", "temp", "generated_code")]
    return int(sum(sizes) - (getattr(stats, "alias_size_in_bytes", 0) or 0))


def fits_device(compiled, case_id: str, available: int | None = None) -> None:
    """Raise ``ProgramRefused`` when the submitted program compiled for ``case_id`` needs more memory than
    the device has (``available`` bytes, default :func:`device_memory_bytes`), before it runs."""
    needed, available = program_bytes(compiled), device_memory_bytes() if available is None else available
    if needed is not None and available is not None and needed > available:
        raise ProgramRefused(f"the submitted program at case {case_id} needs {needed / (1 << 30):.2f} GiB "
                             f"(XLA's memory analysis), more than the device's {available / (1 << 30):.2f} GiB; "
                             f"no run was written")


def time_submission(bench: BenchmarkResult, templates: list[Case], programs: dict[str, Any], digests: dict[str, str],
                    *, warmups: int, samples: int, seed: int, entropy: str, device_kind: str, progress: bool,
                    case_budget_s: float | None = None) -> None:
    """Add one timed case per template (the submitted program at its shape) and its pairs to ``bench``: its
    inputs, checked calls and checked rows follow from ``entropy``; ``seed`` sets the ratios' bootstrap.
    Each case is announced to the supervising process with ``case_budget_s`` (``measure.supervise``), and its
    compiled program must fit the device's memory (``ProgramRefused`` otherwise, before it runs)."""
    from tqdm.auto import tqdm

    by_group: dict[tuple, list[str]] = {}
    for case in bench.cases:  # a paged or ragged case's peers: the implementations at its shape
        group = ((submitted_case_id(_Recorded(case)),) if case["scope"] in BY_SCOPE
                 else (case["scope"], case["seq_len"], case["shape"]["num_q_heads"]))
        by_group.setdefault(group, []).append(case["case_id"])
    for case in tqdm(templates, desc="submitted", unit="case", disable=not progress):
        backward = case.scope == "model-fwd-bwd"
        own = BY_SCOPE.get(case.scope)  # a contract's own scope: forward only, judged by its row check
        sig = case_signature(case)
        exported = programs[sig.key]
        scales = timed_contracts.scale_args(case)
        if own:
            def fn(*args, exported=exported, scales=scales):
                return exported.call(*args, *scales)
        elif backward:
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
        announce(case_id, case_budget_s or DEFAULT_CASE_BUDGET_S)
        try:
            timing = time_program(fn, case.abstract_args, _fresh_inputs(case, entropy), warmups=warmups,
                                  preflight=lambda compiled, case_id=case_id: fits_device(compiled, case_id),
                                  samples=samples, entropy=entropy, key=case_id,
                                  check=lambda i, host, out: (own.check if own else partial(
                                      check_output, backward=backward))(sig, [*host, *scales], out,
                                                                        rng=check_rng(entropy, case_id, i)))
            record.update(samples_ms=timing.samples_ms, lower_ms=timing.lower_ms, compile_ms=timing.compile_ms,
                          transfer_ms=timing.transfer_ms, output_checks=timing.output_checks)
            record.update(stats.summarize(timing.samples_ms))
            record.update(roofline.rates(case.flops, case.bytes_moved, record["median_ms"], device_kind, 1))
        except ProgramRefused:
            raise
        except Exception as error:  # noqa: BLE001 - recorded, and the builder refuses the run
            record.update(status="failed", error=f"{type(error).__name__}: {error}"[:2000], output_checks=[])
        finally:
            announce("", 0)
        bench.cases.append(record)
        for other in by_group.get((case_id,) if own else (case.scope, case.seq_len, case.shape["num_q_heads"]), []):
            ratio, low, high = (stats.ratio_of_medians(record["samples_ms"], _by_id(bench, other)["samples_ms"],
                                                       seed=seed, key=f"{case_id}/{other}")
                                if record["status"] == "ok" and _by_id(bench, other)["status"] == "ok"
                                else (None, None, None))
            bench.pairs.append({"scope": case.scope, "seq_len": case.seq_len, "numerator": case_id,
                                "denominator": other, "ratio": ratio, "ci_low": low, "ci_high": high})


class _Recorded:
    """A benchmark record as ``submitted_case_id`` reads a case."""

    def __init__(self, record: dict[str, Any]):
        self.case_id, self.implementation = record["case_id"], record["implementation"]


def _by_id(bench: BenchmarkResult, case_id: str) -> dict[str, Any]:
    return next(c for c in bench.cases if c["case_id"] == case_id)


def _template_record(case: Case) -> dict[str, Any]:
    return {"case_id": case.case_id, "scope": case.scope, "implementation": case.implementation,
            "seq_len": case.seq_len, "shape": dict(case.shape), "dtype": case.dtype, "causal": case.causal,
            "padded": case.padded, **(case.mask_fields() if case.scope in BY_SCOPE else {}), "devices_used": 1, "status": "ok", "error": None, "interpret": False,
            "transfer_ms": None, "lower_ms": None, "compile_ms": None, "samples_ms": [],
            **stats.summarize([]), "peak_memory_bytes": None, "flops": case.flops, "bytes_moved": case.bytes_moved,
            **roofline.rates(None, None, None, "", 1), "stablehlo": None, "stablehlo_tpu": None}


def templates_for(profile: Profile, scopes: list[str], seed: int, platform: str) -> list[Case]:
    """One case per shape of ``scopes`` (the first implementation's; a contract's own scope: its first template's),
    the shape a submission is timed at."""
    from ..bench.cases import build_cases

    cases, _ = build_cases(profile, scopes, seed=seed, platform=platform)
    templates = {name: i for timed in TIMED.values() for i, name in enumerate(timed.templates)}
    seen, out = set(), []
    for case in sorted(cases, key=lambda c: templates.get(c.implementation, 0)):  # (a stable sort)
        if case.scope in BY_SCOPE:  # a template's pools are laid out as the contract's
            if case.implementation not in BY_SCOPE[case.scope].templates:
                continue
            key = (submitted_case_id(case),)
        else:
            key = (case.scope, case.seq_len, case.shape["num_q_heads"], case.shape["num_kv_heads"])
        if key not in seen:
            seen.add(key)
            out.append(case)
    return out


def declared_templates(templates: list[Case], features: tuple[str, ...]) -> list[Case]:
    """The templates a kernel declaring ``features`` is timed at: those whose cases use no other feature."""
    return [c for c in templates if set(features_used([c.mask_fields()])) <= set(features)]


def prepare(spec: str, *, profile: Profile, seed: int, level: str, platform: str, isolation: str,
            folder: Path, candidate_dir: Path | None = None, contract: str = "attention",
            ) -> tuple[dict[str, Any], list[Case], dict[str, Any], dict[str, str], list[Signature]]:
    """Signatures, export and checks: ``(submission entry, templates, programs by key, sha256 by key,
    grading signatures)``; the programs' bytes are written under ``folder``. Raises ``ProgramRefused``.
    ``contract``: ``"paged"`` or ``"ragged"`` (timed at that contract's cases its declared features allow)."""
    from ..sandbox import isolation as isolations
    from ..grading.candidates import is_builtin, resolve

    templates = templates_for(profile, bench_scopes(profile, contract), seed, platform)
    asked: dict[str, list] = {}

    def wanted_for(features: tuple[str, ...]) -> list:  # once the worker says what it declares
        features = tuple(f for f in features if f in contracts.get(contract).features)
        templates[:] = declared_templates(templates, features)
        asked["grading"] = grading_signatures(seed, level, features, contract)
        asked["wanted"] = list(dict.fromkeys([*asked["grading"], *(case_signature(c) for c in templates)]))
        return asked["wanted"]

    try:
        where = isolations.choose(isolation, is_builtin(resolve(spec, root=candidate_dir)))
    except (isolations.IsolationUnavailable, ValueError) as e:
        raise ProgramRefused(str(e)) from None
    features, raw = export_declared(spec, wanted_for, platform=platform, isolation=where, root=candidate_dir)
    features = tuple(f for f in features if f in contracts.get(contract).features)
    if not templates:
        raise ProgramRefused(f"profile {profile.name!r} has no {'/'.join(bench_scopes(profile, contract))} case "
                             f"the kernel's features ({', '.join(features) or 'none'}) allow")
    grading, wanted = asked["grading"], asked["wanted"]
    bench_sigs = {case_signature(c).key: c for c in templates}
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
    if contract != contracts.DEFAULT.name:
        submission["contract"] = contract
    if features:
        submission["features"] = list(features)
    return submission, templates, programs, digests, grading


def grade_programs(name: str, folder: Path, digests: dict[str, str], grading: list[Signature], *, seed: int,
                   level: str, platform: str, features: tuple[str, ...] = (), contract: str = "attention",
                   slots_from: int | None = None) -> dict[str, Any]:
    """The rubric's scorecard of the stored programs (the grading signatures' only), with their hashes;
    ``features``: what the submission declared (graded by their checks too); ``contract``: ``"paged"``
    grades them on the paged rubric; ``slots_from``: the seed whose shapes the programs were exported for,
    when ``seed`` draws only new values (a regrade, ``rubric.grade``)."""
    from ..grading import rubric
    from ..grading.candidates import Candidate

    table = {s.key: digests[s.key] for s in grading}
    program = contracts.get(contract).program_type(str(folder), table, platform, features)
    candidate = Candidate(name, "external", f"Submitted kernel {name}, as the programs it exported.",
                          lambda: program, contract=contract)
    card = rubric.grade(candidate, seed=seed, level=level, isolation="process", contract=contract,
                        slots_from=slots_from).to_dict()
    card["programs"] = sorted(set(table.values()))
    return card


TIMED_SHAPES_CHECK = "timed-shapes"
GRADE_CALL = 2 ** 31  # the check generators' stream of ``grade_timed_shapes`` (timed calls use 0, 1, ...)


def grade_timed_shapes(card: dict[str, Any], templates: list[Case], programs: dict[str, Any],
                       digests: dict[str, str], *, entropy: str) -> dict[str, Any]:
    """Add the check ``timed-shapes`` to ``card``: each program the benchmark times, run here (no submitter
    Python) at its shape on inputs from ``entropy``, forward and VJP (output, dQ, dK, dV), judged like the
    timed calls (``measure.timed_checks.check_output``); its hash joins the graded programs."""
    details, passed = [], True
    for case in templates:
        sig = case_signature(case)
        exported = programs[sig.key]
        case_id = submitted_case_id(case)
        if case.scope in BY_SCOPE:  # forward only, as the paged and ragged contracts
            host = [*_fresh_inputs(case, entropy)(-100), *timed_contracts.scale_args(case)]
            try:
                ok, detail = BY_SCOPE[case.scope].check(sig, host, exported.call(*host),
                                                        rng=check_rng(entropy, case_id, GRADE_CALL))
            except Exception as error:  # noqa: BLE001 - the program's failure is the check's verdict
                ok, detail = False, f"raised {type(error).__name__}: {error}"[:300]
            passed &= ok
            details.insert(len(details) if ok else 0, f"{case_id}: {detail}")
            continue
        host = _fresh_inputs(case, entropy)(-100)[:3]
        lengths = case.make_inputs()[3] if sig.has_lengths else None
        extra = (lengths,) if lengths is not None else ()
        try:
            out = exported.call(*host, *extra)
            ok, detail = check_output(sig, [*host, *extra], out, backward=False,
                                      rng=check_rng(entropy, case_id, GRADE_CALL))
            rng = check_rng(entropy, case_id, GRADE_CALL + 1)
            ct = rng.standard_normal(host[0].shape, dtype=np.float32).astype(host[0].dtype)
            _, pull = jax.vjp(lambda q, k, v: exported.call(q, k, v, *extra), *host)
            ok_dq, detail_dq = check_output(sig, [*host, ct], pull(ct), backward=True, rng=rng, lengths=lengths)
        except Exception as error:  # noqa: BLE001 - the program's failure is the check's verdict
            ok, ok_dq, detail, detail_dq = False, False, f"raised {type(error).__name__}: {error}"[:300], ""
        passed &= ok and ok_dq
        details.insert(len(details) if ok and ok_dq else 0, f"{case_id}: {detail}; {detail_dq}")  # failures first
    check = {"name": TIMED_SHAPES_CHECK, "passed": bool(passed), "points": 1.0 if passed else 0.0, "max_points": 1.0,
             "detail": " | ".join(details)[:2000], "error": None, "tolerance": None, "baseline_error": None}
    card = dict(card, checks=[*card["checks"], check])
    card.update(passed=bool(card["passed"] and passed), score=card["score"] + check["points"],
                max_score=card["max_score"] + 1.0,
                programs=sorted({*card.get("programs", []), *(digests[case_signature(c).key] for c in templates)}))
    return card


def scratch() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="submission-")


def run_benchmark_with(profile: Profile, *, warmups: int, samples: int, seed: int, progress: bool,
                       contract: str = "attention") -> BenchmarkResult:
    return run_benchmark(profile, bench_scopes(profile, contract), warmups=warmups, samples=samples, seed=seed,
                         progress=progress)
