"""The synchronized benchmark: run every case, keep every sample, pair the implementations.

A case that raises or returns non-finite values is recorded with ``status: "failed"`` and its
error, and the run goes on. Case records follow benchmark.schema.json ``$defs/case``.

Every TPU case also gets the TPU compiler's facts about its program (``compiled_tpu``; predicted
by the compiler, not measured): on a TPU, the program the run compiled and timed; on another host,
a case with a TPU lowering (``Case.tpu_fn``) compiled for one TPU v5e by libtpu without a chip
(``bench.compiled``). Its optimized HLO is kept, gzipped, beside the StableHLO, so the builder
re-derives the kernels, VMEM and bytes outside the kernels from it. Where it cannot be compiled
(no matching libtpu, a compiler error), ``compiled_tpu`` is null and ``compiled_tpu_reason`` says
why; the run goes on.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

from ..bench import compiled, evidence, roofline, stats
from ..bench.cases import Case, Pair, Profile, build_cases
from ..bench.timing import Clock, Timing, block_until_ready, peak_memory_bytes, time_jitted

MAX_ERROR_CHARS = 2000
COMPILED_DIR = "compiled"
# ``compiled_tpu.source``: how the program was compiled; both are the compiler's plan.
COMPILED_SOURCES = {
    "deviceless": "compiled for TPU v5e by libtpu without a chip: predicted by the compiler, not measured",
    "device": "compiled by the run's own TPU backend for the chip it ran on: predicted by the compiler, "
              "not measured",
}


@dataclass
class BenchmarkResult:
    """Case and pair records, the evidence files they name, and notes for the environment."""

    cases: list[dict[str, Any]]
    pairs: list[dict[str, Any]]
    files: dict[str, bytes] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    pending: list[Callable[[dict[str, bytes]], None]] = field(default_factory=list)  # run_benchmark(defer_tpu=True)

    def finish(self) -> None:
        """Run the deviceless TPU compiles ``run_benchmark(defer_tpu=True)`` left, in order: each fills its case's
        ``compiled_tpu`` (or ``compiled_tpu_reason``) and adds the case's compiled HLO to ``files``."""
        while self.pending:
            self.pending.pop(0)(self.files)

    @property
    def interpret(self) -> bool:
        return any(c["interpret"] for c in self.cases)

    @property
    def devices_used(self) -> int:
        return max(c["devices_used"] for c in self.cases)


def _error_text(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + " ...[truncated]"


def _non_finite(output: Any) -> str | None:
    bad = total = 0
    for leaf in jax.tree_util.tree_leaves(output):
        values = np.asarray(jax.device_get(leaf), dtype=np.float32)
        bad += int(values.size - np.isfinite(values).sum())
        total += values.size
    return f"non-finite output: {bad} of {total} values" if bad else None


def _devices_of(compiled_shardings: Any) -> int:
    devices = set()
    for sharding in jax.tree_util.tree_leaves(compiled_shardings,
                                              is_leaf=lambda s: hasattr(s, "device_set")):
        if hasattr(sharding, "device_set"):
            devices |= set(sharding.device_set)
    return max(1, len(devices))


def compiled_hlo_path(case_id: str) -> str:
    """Relative path of a case's gzipped compiled TPU HLO, e.g. ``compiled/attention-pallas-s128.tpu.hlo.gz``."""
    return f"{COMPILED_DIR}/{case_id}.tpu.hlo.gz"


def has_tpu_program(case: Case, platform: str) -> bool:
    """Whether a case gets ``compiled_tpu`` facts: every case of a TPU run, and elsewhere the
    cases with a TPU lowering (``Case.tpu_fn``)."""
    return platform == "tpu" or case.tpu_fn is not None


def hlo_facts(hlo_text: str) -> dict[str, Any]:
    """What the optimized HLO text alone shows: each Pallas kernel (``bench.compiled.kernels``),
    the most VMEM one reserves, and the bytes and opcodes of the ops around them
    (``bench.compiled.outside_ops``). The builder re-derives these from the stored HLO."""
    found, moved = compiled.kernels(hlo_text), compiled.outside_ops(hlo_text)
    return dict(kernels=found, vmem_bytes=max((k["vmem_bytes"] or 0 for k in found), default=0),
                outside_bytes=sum(o["bytes"] for o in moved),
                outside_ops=sorted({o["opcode"] for o in moved}))


def compiled_tpu_facts(program: Any, source: str, device_kind: str) -> tuple[dict[str, Any], str]:
    """``(facts, optimized HLO text)`` of a compiled TPU program, labelled with ``source``.

    The facts are ``bench.compiled.analyse``'s (cost and memory analysis) and ``hlo_facts`` of the
    text kept, with a cost analysis that counts no FLOPs stated as ``None``.
    """
    text = program.as_text()
    facts = {**compiled.analyse(program), **hlo_facts(text)}
    for key in ("flops", "bytes_accessed"):
        facts[key] = None if facts[key] < 0 else facts[key]
    return dict(source=COMPILED_SOURCES[source], device_kind=device_kind, jax=jax.__version__,
                libtpu=compiled.libtpu_version(), **facts), text


def _compile_for_tpu(case: Case, timing: Timing, platform: str, unavailable: str | None
                     ) -> tuple[dict[str, Any] | None, str | None, str | None]:
    """``(facts, reason, hlo)``: the facts and HLO, or ``None`` for both and why."""
    try:
        if platform == "tpu":
            if timing.compiled is None:
                return None, "the case did not compile on the TPU", None
            facts, text = compiled_tpu_facts(timing.compiled, "device", jax.devices()[0].device_kind)
            return facts, None, text
        if unavailable is not None:
            return None, unavailable, None
        program = compiled.compile_program(case.tpu_fn, compiled.on_v5e(case.abstract_args))
        facts, text = compiled_tpu_facts(program, "deviceless",
                                         str(compiled.v5e_devices()[0].device_kind))
        return facts, None, text
    except Exception as error:  # noqa: BLE001 - recorded as the reason, the run goes on
        return None, f"compiling for TPU failed: {_error_text(error)[:500]}", None


def _add_tpu_facts(record: dict[str, Any], files: dict[str, bytes], case: Case, timing: Timing | None,
                   platform: str, unavailable: str | None) -> None:
    facts, reason, hlo = _compile_for_tpu(case, timing, platform, unavailable)
    if facts is not None:
        rel = compiled_hlo_path(case.case_id)
        files[rel] = evidence.gzip_text(hlo)
        facts["hlo"] = rel
    record["compiled_tpu"], record["compiled_tpu_reason"] = facts, reason


def run_case(case: Case, *, warmups: int, samples: int, device_kind: str,
             clock: Clock = time.perf_counter,
             sync: Callable[[Any], Any] = block_until_ready, platform: str | None = None,
             tpu_unavailable: str | None = None,
             deferred: list[Callable[[dict[str, bytes]], None]] | None = None
             ) -> tuple[dict[str, Any], dict[str, bytes], list[str]]:
    """Measure one case. Returns its record, its evidence files and any notes; never raises
    for a failure of the case itself (the record says ``failed``).

    ``platform`` (default: JAX's default backend) decides whether the case gets ``compiled_tpu``
    facts (``has_tpu_program``); ``tpu_unavailable`` is why a v5e program cannot be compiled on
    this host (``bench.compiled.unavailable_reason()``), ``None`` when it can. ``deferred``: off a TPU,
    the deviceless compile is appended there as a job (called with the files dict its HLO goes to)
    instead of run, and the record's ``compiled_tpu`` stays null until it runs."""
    platform = platform or jax.default_backend()
    record: dict[str, Any] = {
        "case_id": case.case_id, "scope": case.scope, "implementation": case.implementation,
        "seq_len": case.seq_len, "shape": dict(case.shape), "dtype": case.dtype,
        "causal": case.causal, "padded": case.padded, **case.mask_fields(),
        "devices_used": case.mesh_devices or 1,
        "status": "ok", "error": None, "interpret": case.interpret,
        "transfer_ms": None, "lower_ms": None, "compile_ms": None, "samples_ms": [],
        **stats.summarize([]), "peak_memory_bytes": None,
        "flops": case.flops, "bytes_moved": case.bytes_moved,
        **roofline.rates(None, None, None, device_kind, 1),
        "stablehlo": None, "stablehlo_tpu": None,
    }
    files, notes = {}, []
    timing = Timing()
    try:
        time_jitted(case.fn, case.abstract_args, case.make_inputs(), warmups=warmups, samples=samples,
                    clock=clock, sync=sync, timing=timing)
    except Exception as error:  # noqa: BLE001 - any failure of the case is recorded, the run goes on
        record["status"], record["error"] = "failed", _error_text(error)
        timing.samples_ms = []
    record.update(transfer_ms=timing.transfer_ms, lower_ms=timing.lower_ms, compile_ms=timing.compile_ms,
                  samples_ms=list(timing.samples_ms))
    if timing.lowered is not None:
        rel = evidence.stablehlo_path(case.case_id)
        files[rel] = evidence.gzip_text(evidence.lowered_text(timing.lowered))
        record["stablehlo"] = rel
    if timing.compiled is not None:
        record["devices_used"] = _devices_of(timing.compiled.input_shardings)
    if record["status"] == "ok":
        problem = _non_finite(timing.output)
        if problem:
            record["status"], record["error"] = "failed", problem
    if has_tpu_program(case, platform):
        if deferred is not None and platform != "tpu":  # the placeholders keep the keys' order
            record["compiled_tpu"] = record["compiled_tpu_reason"] = None
            deferred.append(lambda target: _add_tpu_facts(record, target, case, None, platform, tpu_unavailable))
        else:
            _add_tpu_facts(record, files, case, timing, platform, tpu_unavailable)
    timing.output = timing.compiled = None
    gc.collect()
    if record["samples_ms"]:
        record.update(stats.summarize(record["samples_ms"]))
        record.update(roofline.rates(case.flops, case.bytes_moved, record["median_ms"], device_kind,
                                     record["devices_used"]))
    record["peak_memory_bytes"] = peak_memory_bytes(jax.devices()[:record["devices_used"]])
    if case.tpu_fn is not None:
        try:
            rel = evidence.stablehlo_path(case.case_id, ".tpu")
            files[rel] = evidence.gzip_text(evidence.tpu_export_text(case.tpu_fn, case.abstract_args))
            record["stablehlo_tpu"] = rel
        except Exception as error:  # noqa: BLE001
            notes.append(f"TPU export of {case.case_id} failed ({_error_text(error)[:300]}).")
    return record, files, notes


def pair_record(pair: Pair, by_id: dict[str, dict[str, Any]], seed: int) -> dict[str, Any]:
    """The ratio of medians of ``pair`` with its bootstrap 95% CI (nulls where a side failed)."""
    num, den = by_id[pair.numerator], by_id[pair.denominator]
    ok = num["status"] == "ok" and den["status"] == "ok"
    ratio, low, high = (stats.ratio_of_medians(num["samples_ms"], den["samples_ms"], seed=seed,
                                               key=f"{pair.numerator}/{pair.denominator}")
                        if ok else (None, None, None))
    record = {"scope": pair.scope, "seq_len": pair.seq_len, "numerator": pair.numerator,
              "denominator": pair.denominator, "ratio": ratio, "ci_low": low, "ci_high": high}
    if pair.devices is not None:
        record["devices"] = num["devices_used"]
        record["scaling_efficiency"] = (stats.scaling_efficiency(den["median_ms"], num["median_ms"],
                                                                 num["devices_used"]) if ok else None)
    return record


def run_benchmark(profile: Profile, scopes: Sequence[str], *, warmups: int, samples: int,
                  seed: int = 0, progress: bool = True, defer_tpu: bool = False) -> BenchmarkResult:
    """Build, run and pair every case of ``profile`` over ``scopes`` on the default backend.

    ``defer_tpu``: off a TPU, leave each case's deviceless TPU compile (the costliest part of a CPU run's
    benchmark after the timing itself) in ``result.pending`` for ``result.finish()``, which the caller may run
    once every case is timed, beside other work (``measure`` runs it beside the rubric), so that it never
    shares the machine with a timed sample."""
    platform = jax.default_backend()
    cases, pairs = build_cases(profile, scopes, seed=seed, platform=platform)
    device_kind = jax.devices()[0].device_kind
    unavailable = (compiled.unavailable_reason()
                   if platform != "tpu" and any(c.tpu_fn is not None for c in cases) else None)
    result = BenchmarkResult(cases=[], pairs=[])
    if unavailable is not None:
        result.notes.append(f"No compiled TPU facts (compiled_tpu is null): {unavailable}.")
    bar = tqdm(cases, desc="benchmark", unit="case", disable=not progress)
    for case in bar:
        bar.set_postfix_str(case.case_id)
        record, files, notes = run_case(case, warmups=warmups, samples=samples, device_kind=device_kind,
                                        platform=platform, tpu_unavailable=unavailable,
                                        deferred=result.pending if defer_tpu else None)
        result.cases.append(record)
        result.files.update(files)
        result.notes += notes
    by_id = {c["case_id"]: c for c in result.cases}
    result.pairs = [pair_record(p, by_id, seed) for p in pairs]
    return result
