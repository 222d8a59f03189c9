"""A ``measured`` run's numbers follow from its samples and shapes, or it is refused.

The builder trusts no derived number: it expands the run's profile over the run's scopes with the
benchmark's own code (``bench.cases.build_cases``) and recomputes with ``bench.stats`` and
``bench.roofline``:

* the run holds exactly the cases and pairs the profile defines for those scopes (a missing case or
  pair is refused by name, an extra one too), each case at the profile's shape, dtype, masks,
  interpret mode (interpret only for Pallas on a CPU) and device count (the sharded scope's ``@n``
  case uses every device of the run);
* per case: median, min, max, quartiles and IQR from ``samples_ms``; FLOPs and bytes from the shape
  and the mask (``bench.roofline``: the visible pairs of the causal mask, a window and the case's
  segment ids, counted exactly; a case whose stated mask or FLOPs differ is refused);
  TFLOP/s, GB/s and the peak fractions from those, the median, the device kind and devices used;
* per pair: the ratio of medians and its bootstrap interval (seed: the run's recorded seed, key
  ``numerator/denominator``), devices and scaling efficiency for the sharded scope.

* per case with a compiled TPU program (``compiled_tpu``; predicted by the compiler, not measured,
  and not derived from the samples): present exactly where the case has one
  (``bench.benchmark.has_tpu_program``), either the facts or a reason, labelled with the source
  its platform implies; the kernels, VMEM and bytes outside the kernels re-derived from the stored
  optimized HLO (``bench.benchmark.hlo_facts``). The cost and memory analyses are the compiler's
  statements: the schema checks their types, nothing can re-derive them without compiling again.

A disagreement beyond float rounding (relative 1e-9) raises ``RunError`` naming case and field.
A ``published-summary`` is not recomputed (it has no samples); its medians are checked against the
published card by ``scripts/transcribe_published.py``.
"""

from __future__ import annotations

import dataclasses
import gzip
import math
import zlib
from typing import Any, Callable

from ..bench import roofline, stats
from ..bench.benchmark import COMPILED_SOURCES, compiled_hlo_path, has_tpu_program, hlo_facts
from ..bench.cases import Case, Pair, build_cases, get_profile
from ..records.rawio import RunError

REL_TOL = 1e-9
STAT_FIELDS = ("median_ms", "min_ms", "max_ms", "q1_ms", "q3_ms", "iqr_ms")
RATE_FIELDS = ("tflops", "gbps", "peak_flops_fraction", "peak_bandwidth_fraction")


def _same(recorded: Any, expected: Any) -> bool:
    if recorded is None or expected is None:
        return recorded is None and expected is None
    if isinstance(expected, float) or isinstance(recorded, float):
        if isinstance(recorded, bool) or not isinstance(recorded, (int, float)):
            return False
        return math.isclose(recorded, expected, rel_tol=REL_TOL, abs_tol=1e-300)
    return recorded == expected


def _expect(recorded: Any, expected: Any, rule: str, field: str, what: str) -> None:
    if not _same(recorded, expected):
        raise RunError(rule, "benchmark.json", field, f"{what}: recorded {recorded!r}, but it follows as {expected!r}")


def expected_cases(benchmark: dict[str, Any], device_count: int) -> tuple[dict[str, Case], list[Pair]]:
    """The cases (by id) and pairs the run's profile defines over the scopes the run measured."""
    try:
        profile = get_profile(benchmark["profile"])
    except ValueError as e:
        raise RunError("profile", "benchmark.json", "profile", str(e)) from None
    scopes = list(dict.fromkeys(case["scope"] for case in benchmark["cases"]))
    try:
        cases, pairs = build_cases(profile, scopes, platform=benchmark["platform"])
    except ValueError as e:
        raise RunError("profile", "benchmark.json", "cases", str(e)) from None
    # The sharded scope runs on every device of the run's machine, not of the building one.
    one = [c for c in cases if c.scope == "sharded" and c.implementation.endswith("@1")]
    cases = [c for c in cases if c.scope != "sharded"] + one
    pairs = [p for p in pairs if p.scope != "sharded"]
    if device_count > 1:
        for c in one:
            base = c.implementation.split("@")[0]
            many = dataclasses.replace(c, implementation=f"{base}@{device_count}",
                                       case_id=c.case_id.replace("-d1-", f"-d{device_count}-"),
                                       mesh_devices=device_count)
            cases.append(many)
            pairs.append(Pair("sharded", c.seq_len, many.case_id, c.case_id, devices=device_count))
    return {c.case_id: c for c in cases}, pairs


def _check_case(i: int, case: dict[str, Any], exp: Case, device_kind: str) -> None:
    where, name = f"cases/{i}", case["case_id"]
    shape = {"scope": exp.scope, "implementation": exp.implementation, "seq_len": exp.seq_len, "dtype": exp.dtype,
             "causal": exp.causal, "padded": exp.padded}
    for field, value in shape.items():
        _expect(case[field], value, "case-shape", f"{where}/{field}", f"case {name!r} under its profile")
    for field, value in exp.shape.items():
        _expect(case["shape"][field], value, "case-shape", f"{where}/shape/{field}", f"case {name!r} under its profile")
    for field, value in exp.mask_fields().items():  # absent in runs from before masks: no mask
        _expect(case.get(field), value, "case-shape", f"{where}/{field}", f"case {name!r}'s mask under its profile")
    _expect(case["interpret"], exp.interpret, "interpret", f"{where}/interpret",
            f"case {name!r} (interpret mode only for Pallas on a CPU)")
    _expect(case["devices_used"], exp.mesh_devices or 1, "devices", f"{where}/devices_used", f"case {name!r}")
    _expect(case["flops"], float(exp.flops), "derived", f"{where}/flops", f"case {name!r} from its shape")
    _expect(case["bytes_moved"], float(exp.bytes_moved), "derived", f"{where}/bytes_moved",
            f"case {name!r} from its shape")
    summary = stats.summarize(case["samples_ms"])
    for field in STAT_FIELDS:
        _expect(case[field], summary[field], "derived", f"{where}/{field}", f"case {name!r} from its samples")
    rates = roofline.rates(exp.flops, exp.bytes_moved, summary["median_ms"], device_kind, case["devices_used"])
    for field in RATE_FIELDS:
        _expect(case[field], rates[field], "derived", f"{where}/{field}",
                f"case {name!r} from its work, median and {device_kind!r}")


ReadFile = Callable[[str], bytes]


def _check_compiled(i: int, case: dict[str, Any], exp: Case, platform: str,
                    read_file: ReadFile | None) -> None:
    """``compiled_tpu`` where the case has a TPU program, its HLO-derived fields from its HLO."""
    if "compiled_tpu" not in case and "compiled_tpu_reason" not in case:
        return  # a run from before the field existed
    where, name = f"cases/{i}", case["case_id"]
    facts, reason = case.get("compiled_tpu"), case.get("compiled_tpu_reason")
    if not has_tpu_program(exp, platform):
        if facts is not None or reason is not None:
            raise RunError("compiled-tpu", "benchmark.json", f"{where}/compiled_tpu",
                           f"case {name!r} has no TPU program on a {platform} run")
        return
    if (facts is None) == (reason is None):
        raise RunError("compiled-tpu", "benchmark.json", f"{where}/compiled_tpu",
                       f"case {name!r} needs either compiled facts or the reason there are none, not "
                       f"{'both' if facts is not None else 'neither'}")
    if facts is None:
        return
    source = COMPILED_SOURCES["device" if platform == "tpu" else "deviceless"]
    _expect(facts["source"], source, "compiled-tpu", f"{where}/compiled_tpu/source", f"case {name!r}")
    _expect(facts["hlo"], compiled_hlo_path(name), "compiled-tpu", f"{where}/compiled_tpu/hlo",
            f"case {name!r}")
    if read_file is None:
        raise RunError("compiled-tpu", "benchmark.json", f"{where}/compiled_tpu",
                       "compiled facts are checked against their HLO file: read the run from its folder")
    try:
        text = gzip.decompress(read_file(facts["hlo"])).decode()
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as e:
        raise RunError("compiled-tpu", facts["hlo"], None, f"not a gzipped HLO text ({e})") from None
    for field, value in hlo_facts(text).items():
        _expect(facts[field], value, "derived", f"{where}/compiled_tpu/{field}",
                f"case {name!r} from its compiled HLO")


def check_measured(run: dict[str, Any], read_file: ReadFile | None = None) -> None:
    """Refuse a ``measured`` run whose cases, pairs or derived numbers do not follow (see module doc).

    ``read_file(relative path) -> bytes`` reads a file of the run folder (the compiled HLO); a run
    with compiled TPU facts is refused without it."""
    env, bench, seed = run["environment"], run["benchmark"], run["correctness"]["seed"]
    expected, pairs = expected_cases(bench, env["device_count"])
    index = {case["case_id"]: i for i, case in enumerate(bench["cases"])}
    for case_id in expected:
        if case_id not in index:
            raise RunError("missing-case", "benchmark.json", "cases",
                           f"case {case_id!r} of profile {bench['profile']!r} is missing")
    for case_id, i in index.items():
        if case_id not in expected:
            raise RunError("unexpected-case", "benchmark.json", f"cases/{i}/case_id",
                           f"case {case_id!r} is not a case of profile {bench['profile']!r}")
        _check_case(i, bench["cases"][i], expected[case_id], env["device_kind"])
        _check_compiled(i, bench["cases"][i], expected[case_id], bench["platform"], read_file)
    by_id = {case["case_id"]: case for case in bench["cases"]}
    recorded = {(p["numerator"], p["denominator"]): (i, p) for i, p in enumerate(bench["pairs"])}
    wanted = {(p.numerator, p.denominator): p for p in pairs}
    for key in wanted:
        if key not in recorded:
            raise RunError("missing-pair", "benchmark.json", "pairs", f"pair {key[0]!r} / {key[1]!r} is missing")
    for key, (i, pair) in recorded.items():
        if key not in wanted:
            raise RunError("unexpected-pair", "benchmark.json", f"pairs/{i}",
                           f"pair {key[0]!r} / {key[1]!r} is not a pair of profile {bench['profile']!r}")
        exp, where, what = wanted[key], f"pairs/{i}", f"pair {key[0]!r} / {key[1]!r}"
        _expect(pair["scope"], exp.scope, "pair", f"{where}/scope", what)
        _expect(pair["seq_len"], exp.seq_len, "pair", f"{where}/seq_len", what)
        num, den = by_id[key[0]], by_id[key[1]]
        ratio, low, high = stats.ratio_of_medians(num["samples_ms"], den["samples_ms"], seed=seed,
                                                  key=f"{key[0]}/{key[1]}")
        for field, value in (("ratio", ratio), ("ci_low", low), ("ci_high", high)):
            _expect(pair[field], value, "derived", f"{where}/{field}", f"{what} from the samples (seed {seed})")
        if exp.devices is not None:
            _expect(pair.get("devices"), num["devices_used"], "pair", f"{where}/devices", what)
            efficiency = stats.scaling_efficiency(den["median_ms"], num["median_ms"], num["devices_used"])
            _expect(pair.get("scaling_efficiency"), efficiency, "derived", f"{where}/scaling_efficiency", what)
        elif "devices" in pair or "scaling_efficiency" in pair:
            raise RunError("pair", "benchmark.json", f"{where}/devices", f"{what} is not a scaling pair")
    used = max(case["devices_used"] for case in bench["cases"])
    if env["devices_used"] != used:
        raise RunError("devices", "environment.json", "devices_used",
                       f"{env['devices_used']}, but the most devices any case used is {used}")
    if env["interpret"] != any(case["interpret"] for case in bench["cases"]):
        raise RunError("interpret", "environment.json", "interpret",
                       f"{env['interpret']!r} disagrees with the cases' interpret flags")
