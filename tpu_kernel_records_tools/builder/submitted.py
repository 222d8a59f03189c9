"""Acceptance rules for a submitted kernel's run (source ``submitted``, ``measure --candidate``).

Beside the rules every run meets (``builder.rules``: its scorecard passed every check, consistency,
samples), a submitted run is a record only if:

* ``program-file``: every program listed is a file of the run at ``programs/<sha256>.jaxexport`` whose
  bytes have that sha256 (a program replaced after the run, manifest and all, is refused);
* ``graded-programs``: the scorecard names the programs it graded, all of them listed for grading;
* ``graded-features``: the scorecard was graded on exactly the features the submission declared, and on
  its contract (``graded-contract``: a paged submission's scorecard is the paged rubric's, a ragged one's the
  ragged rubric's);
* ``graded-level``: under a TPU or GPU profile the scorecard is the rubric's full level (``--level
  quick`` is for trying a submission on a CPU, whose rows are labelled apart as not kernel speed);
* ``timed-not-graded``: every timed case's program is one of the graded programs (the same bytes) and
  is listed for that case, at that case's call (:func:`timed_signature`: shapes, dtype, masks, scale);
* ``interpret-profile``: no case ran in interpret mode, nor on a CPU, under a TPU or GPU profile;
* ``check-entropy``: the run records the entropy its measuring process drew after the export
  (``submission.check_entropy``), which chose the timed shapes' inputs, the checked calls and rows;
* ``output-check``: every timed case checked the outputs of the timed calls that entropy picks
  (``bench.submitted.checked_samples``), and each check passed;
* ``roofline-floor``: no timed median (the recorded one, nor its samples') below the least time the
  case's FLOPs and bytes allow on the device (recomputed here, with the recorded floor);
* ``missing-case`` / ``unexpected-case`` / ``derived``: one timed case per shape of the profile's
  flash and model scopes (a paged or ragged kernel: its contract's scope, less the cases that use a window or
  a quantized cache it does not declare), its work equal to the baselines' at that shape, its statistics and pairs
  following from the samples; ``unexpected-pair``: every pair naming a timed case is that case over one
  of its baselines (its ratio then checked); the baselines (XLA and the flash kernel) meet the
  ``measured`` rules.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any, Callable

from ..bench import roofline, stats
from ..bench.submitted import checked_samples, roofline_floor_ms
from ..grading import contracts
from ..grading.programs import program_path
from ..records.rawio import RunError, scorecard_features

from .recompute import check_measured

SUBMITTED = "submitted"
DEVICE_PROFILES = ("tpu-v5e", "gpu")


def _fail(rule: str, file: str, field: str | None, message: str):
    raise RunError(rule, file, field, message)


def _programs(run: dict[str, Any], read_file: Callable[[str], bytes] | None) -> dict[str, dict[str, Any]]:
    entry = run["correctness"].get("submission")
    if entry is None:
        _fail("submission", "correctness.json", "submission", "a submitted run names its kernel and programs")
    if entry["name"] != run["correctness"]["measured_candidate"]:
        _fail("submission", "correctness.json", "measured_candidate",
              f"{run['correctness']['measured_candidate']!r} is not the submission {entry['name']!r}")
    if not entry.get("check_entropy"):
        _fail("check-entropy", "correctness.json", "submission/check_entropy", "a submitted run records the entropy "
              "drawn after its export, which chose the timed inputs and the checked calls and rows")
    files = set(run["manifest"]["files"])
    programs = {}
    for i, program in enumerate(entry["programs"]):
        where = f"submission/programs/{i}"
        digest = program["sha256"]
        if program["path"] != program_path(digest) or program["path"] not in files:
            _fail("program-file", "correctness.json", f"{where}/path",
                  f"{program['path']!r} is not the run's file {program_path(digest)!r}")
        if read_file is None:
            _fail("program-file", "correctness.json", where, "programs are checked against their files: read the "
                  "run from its folder")
        actual = hashlib.sha256(read_file(program["path"])).hexdigest()
        if actual != digest:
            _fail("program-file", program["path"], None, f"sha256 {actual} is not the recorded {digest}")
        programs[digest] = program
    return programs


def _graded(run: dict[str, Any], programs: dict[str, dict[str, Any]]) -> set[str]:
    name = run["correctness"]["measured_candidate"]
    for i, card in enumerate(run["correctness"]["scorecards"]):
        if card["candidate"] == name:
            if run["benchmark"]["profile"] in DEVICE_PROFILES and card.get("level") != "full":
                _fail("graded-level", "correctness.json", f"scorecards/{i}/level",
                      f"a device profile's submission is graded at the full level, not {card.get('level')!r}")
            graded = card.get("programs") or []
            for digest in graded:
                if digest not in programs or not programs[digest]["grading"]:
                    _fail("graded-programs", "correctness.json", f"scorecards/{i}/programs",
                          f"graded program {digest[:12]} is not a grading program of the submission")
            if not graded:
                _fail("graded-programs", "correctness.json", f"scorecards/{i}/programs",
                      "the scorecard names no program it graded")
            contract = run["correctness"]["submission"].get("contract", contracts.DEFAULT.name)
            graded_on = card.get("contract", contracts.DEFAULT.name)
            if graded_on != contract:  # (the schema names the contracts, a test keeps it to grading.contracts)
                _fail("graded-contract", "correctness.json", f"scorecards/{i}/contract",
                      f"graded on the {graded_on!r} contract, but the submission is {contract!r}")
            declared = run["correctness"]["submission"].get("features", [])
            if card.get("features", []) != declared:
                _fail("graded-features", "correctness.json", f"scorecards/{i}/features",
                      f"graded on features {card.get('features', [])!r}, but the submission declared {declared!r}")
            return set(graded)
    _fail("correctness", "correctness.json", "measured_candidate", f"no scorecard for {name!r}")


def timed_signature(case: dict[str, Any]) -> dict[str, Any]:
    """The call a timed case makes (``grading.export.Signature.to_dict``), from its record: what
    ``measure.submission.case_signature`` exports for it."""
    s = case["shape"]
    if case.get("page_size") is not None:  # a paged-decode or ragged case: PagedSignature, RaggedSignature
        ragged = case.get("num_seqs") is not None  # q [num_tokens, heads, head_dim]: every sequence's rows
        d = {"contract": "ragged" if ragged else "paged",
             "q": [*([] if ragged else [s["batch"]]), s["q_len"], s["num_q_heads"], s["head_dim"]],
             "pool": [case["pool_pages"], case["page_size"], s["num_kv_heads"], s["head_dim"]],
             "table": [s["batch"], case["pages"]], "dtype": case["dtype"], "causal": case["causal"],
             "scale": s["head_dim"] ** -0.5}
        if case.get("window") is not None:
            d["window"] = list(case["window"])
        if case.get("quantized_kv"):
            d["pool_dtype"] = case["kv_dtype"]
        return d
    kv = [s["batch"], s["kv_len"], s["num_kv_heads"], s["head_dim"]]
    return {"q": [s["batch"], s["q_len"], s["num_q_heads"], s["head_dim"]], "k": kv, "v": kv, "dtype": case["dtype"],
            "causal": case["causal"], "has_lengths": case["padded"], "scale": s["head_dim"] ** -0.5}


def _check_timed(i: int, case: dict[str, Any], programs, graded: set[str], device_kind: str, entropy: str) -> None:
    where, name = f"cases/{i}", case["case_id"]
    digest = case.get("program_sha256")
    if digest not in graded:
        _fail("timed-not-graded", "benchmark.json", f"{where}/program_sha256",
              f"case {name!r} timed program {str(digest)[:12]}, which the scorecard did not grade")
    program = programs[digest]
    if name not in program["cases"] or program["signature"] != timed_signature(case):
        _fail("timed-not-graded", "benchmark.json", f"{where}/program_sha256",
              f"program {digest[:12]} is not listed for case {name!r} at its call (shapes, dtype, masks, scale)")
    checks = case.get("output_checks") or []
    if not checks:
        _fail("output-check", "benchmark.json", f"{where}/output_checks", f"case {name!r} checked no output")
    picked = checked_samples(len(case["samples_ms"]), entropy, name)
    if [c["sample"] for c in checks] != picked:
        _fail("output-check", "benchmark.json", f"{where}/output_checks", f"case {name!r} checked timed calls "
              f"{[c['sample'] for c in checks]}, but the run's check entropy picks {picked}")
    for j, check in enumerate(checks):
        if not check["passed"] or check["sample"] >= len(case["samples_ms"]):
            _fail("output-check", "benchmark.json", f"{where}/output_checks/{j}",
                  f"case {name!r}, timed call {check['sample']}: {check['detail']}")
    floor = roofline_floor_ms(case["flops"], case["bytes_moved"], device_kind)
    recorded = case.get("roofline_floor_ms")
    if (floor is None) != (recorded is None) or (floor is not None and abs(recorded - floor) > 1e-9 * floor):
        _fail("derived", "benchmark.json", f"{where}/roofline_floor_ms",
              f"recorded {recorded!r}, but the case's work on {device_kind!r} gives {floor!r}")
    summary = stats.summarize(case["samples_ms"])
    median = min(case["median_ms"], summary["median_ms"])  # the recorded one, and its samples' (not 1e-9 under)
    if floor is not None and median < floor:
        _fail("roofline-floor", "benchmark.json", f"{where}/median_ms",
              f"case {name!r}: median {median:.6g} ms is below the roofline floor {floor:.6g} ms "
              f"of its FLOPs and bytes on {device_kind!r}: refused, not ranked")
    rates = roofline.rates(case["flops"], case["bytes_moved"], summary["median_ms"], device_kind, 1)
    for field, value in {**summary, **rates}.items():
        if case[field] != value and not (isinstance(value, float) and abs(case[field] - value) <= 1e-9 * abs(value)):
            _fail("derived", "benchmark.json", f"{where}/{field}", f"recorded {case[field]!r}, its samples give {value!r}")


def check_submitted(run: dict[str, Any], read_file: Callable[[str], bytes] | None) -> None:
    """Refuse a submitted run that breaks a rule of the module doc (``rawio.RunError`` names it)."""
    env, bench = run["environment"], run["benchmark"]
    if bench["profile"] in DEVICE_PROFILES and (env["platform"] == "cpu" or env["interpret"]
                                                or any(c["interpret"] for c in bench["cases"])):
        _fail("interpret-profile", "benchmark.json", "profile",
              f"profile {bench['profile']!r} times a device, but this run ran in interpret mode or on a CPU")
    programs = _programs(run, read_file)
    graded = _graded(run, programs)
    timed = {i: c for i, c in enumerate(bench["cases"]) if c["implementation"] == SUBMITTED}
    baseline = copy.deepcopy(run)
    baseline["benchmark"]["cases"] = [c for c in bench["cases"] if c["implementation"] != SUBMITTED]
    baseline["benchmark"]["pairs"] = [p for p in bench["pairs"]
                                      if not any(p[k] == c["case_id"] for c in timed.values() for k in p
                                                 if k in ("numerator", "denominator"))]
    check_measured(baseline, read_file)
    groups: dict[str, list[dict[str, Any]]] = {}
    for case in baseline["benchmark"]["cases"]:
        groups.setdefault(case["case_id"].replace(f"-{case['implementation']}", f"-{SUBMITTED}", 1), []).append(case)
    for i, case in timed.items():
        peers = groups.get(case["case_id"])
        if not peers:
            _fail("unexpected-case", "benchmark.json", f"cases/{i}/case_id",
                  f"submitted case {case['case_id']!r} has no baseline at its shape")
        for field in ("scope", "seq_len", "shape", "dtype", "causal", "padded", "flops", "bytes_moved"):
            if case[field] != peers[0][field]:
                _fail("derived", "benchmark.json", f"cases/{i}/{field}",
                      f"{case[field]!r}, but the baselines at its shape have {peers[0][field]!r}")
        _check_timed(i, case, programs, graded, env["device_kind"], run["correctness"]["submission"]["check_entropy"])
    declared = run["correctness"]["submission"].get("features", [])
    missing = sorted(set(groups) - {c["case_id"] for c in timed.values()} - {  # a window, a quantized cache it lacks
        g for g, peers in groups.items() if peers[0].get("page_size") is not None
        and not {f for f in scorecard_features() if peers[0].get(f) not in (None, False)} <= set(declared)})
    if missing:
        _fail("missing-case", "benchmark.json", "cases", f"no submitted case {missing[0]!r}")
    by_id = {c["case_id"]: c for c in bench["cases"]}
    timed_ids = {c["case_id"] for c in timed.values()}
    for i, p in enumerate(bench["pairs"]):
        if {p["numerator"], p["denominator"]} & timed_ids and p["denominator"] not in {
                c["case_id"] for c in groups.get(p["numerator"], [])}:
            _fail("unexpected-pair", "benchmark.json", f"pairs/{i}", f"pair {p['numerator']!r} / "
                  f"{p['denominator']!r} is not a submitted case over a baseline at its shape")
    pairs = {(p["numerator"], p["denominator"]): p for p in bench["pairs"] if p["numerator"] in timed_ids}
    for case_id, peers in groups.items():
        for peer in peers:
            pair = pairs.get((case_id, peer["case_id"]))
            if pair is None:
                _fail("missing-pair", "benchmark.json", "pairs", f"pair {case_id!r} / {peer['case_id']!r} is missing")
            expected = stats.ratio_of_medians(by_id[case_id]["samples_ms"], peer["samples_ms"],
                                              seed=run["correctness"]["seed"], key=f"{case_id}/{peer['case_id']}")
            if [pair["scope"], pair["seq_len"]] != [peer["scope"], peer["seq_len"]]:
                _fail("pair", "benchmark.json", "pairs", f"pair {case_id!r} / {peer['case_id']!r} is not at "
                      f"its cases' scope and sequence length")
            if [pair["ratio"], pair["ci_low"], pair["ci_high"]] != list(expected):
                _fail("derived", "benchmark.json", "pairs", f"pair {case_id!r} / {peer['case_id']!r} does not "
                      f"follow from the samples")
