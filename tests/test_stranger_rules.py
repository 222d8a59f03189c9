"""Every rule a stranger's submitted run or program meets, pinned at its boundary (issue 32), in the default run.

``measure --candidate`` makes a run whose programs were exported in a sandbox; the builder
(``builder.submitted``) and the program checks (``grading.export.load_program``) are all that stand
between those bytes and a record. The slow end-to-end tests (``test_submitted_e2e.py``) make real runs;
here each rule meets the smallest case on each side of its line: a synthetic submitted run (made up
like ``release_fixtures``' runs, with made-up program bytes: the builder checks programs by hash only) that
every rule accepts, then one edit per refusal; and tiny real ``jax.export`` programs (forward and VJP)
that each break one of ``load_program``'s checks, or just keep to it.
"""

from __future__ import annotations

import copy
import re
import hashlib
import json
from typing import Any, Callable

import pytest

import release_fixtures as testing
from tpu_kernel_records_tools.bench import roofline, stats
from tpu_kernel_records_tools.bench.submitted import checked_samples, roofline_floor_ms
from tpu_kernel_records_tools.builder import rules
from tpu_kernel_records_tools.builder.submitted import timed_signature
from tpu_kernel_records_tools.grading.export import program_path
from tpu_kernel_records_tools.records import rawio

NAME, ENTROPY, SAMPLES = "mine", "5a" * 16, 5
TIMED_ID = "flash-submitted-s128"  # the tiny profile's one flash shape, as a submission's case
PROGRAMS = {role: f"synthetic {role} program: made up by tests/test_stranger_rules.py".encode()
            for role in ("timed", "graded", "unused")}
DIGEST = {role: hashlib.sha256(data).hexdigest() for role, data in PROGRAMS.items()}
V5E = {"platform": "tpu", "interpret": False, "device_kind": "TPU v5 lite", "device_count": 8,
       "env_vars": {"TPU_ACCELERATOR_TYPE": "v5litepod-8"}}


def derive(docs: dict[str, Any], device_kind: str) -> None:
    """Recompute the timed case's statistics, rates, floor and checked calls and its pairs from its samples."""
    bench = docs["benchmark"]
    by_id = {c["case_id"]: c for c in bench["cases"]}
    case = by_id[TIMED_ID]
    case.update(stats.summarize(case["samples_ms"]))
    case.update(roofline.rates(case["flops"], case["bytes_moved"], case["median_ms"], device_kind, 1))
    case["roofline_floor_ms"] = roofline_floor_ms(case["flops"], case["bytes_moved"], device_kind)
    case["output_checks"] = [{"sample": i, "passed": True, "detail": testing.SYNTHETIC}
                             for i in checked_samples(len(case["samples_ms"]), ENTROPY, TIMED_ID)]
    bench["pairs"] = [p for p in bench["pairs"] if p["numerator"] != TIMED_ID]
    for peer in [c for c in bench["cases"] if c["case_id"] != TIMED_ID]:
        ratio, low, high = stats.ratio_of_medians(case["samples_ms"], peer["samples_ms"], seed=testing.SEED,
                                                  key=f"{TIMED_ID}/{peer['case_id']}")
        bench["pairs"].append({"scope": "flash", "seq_len": 128, "numerator": TIMED_ID,
                               "denominator": peer["case_id"], "ratio": ratio, "ci_low": low, "ci_high": high})


def documents(*, device: dict[str, Any] | None = None, samples_ms: list[float] | None = None) -> dict[str, Any]:
    """A submitted run of the tiny profile (its flash scope: XLA and the flash kernel, and the submission):
    on a CPU in interpret mode, or on ``device`` (``V5E``: a device the roofline table knows)."""
    device = device or {"platform": "cpu", "interpret": True, "device_kind": "cpu"}
    docs = testing.documents("synthetic-submitted", samples=SAMPLES, power=False, scopes=("flash",), **device)
    for doc in docs.values():
        doc["source"] = "submitted"
    bench, correctness = docs["benchmark"], docs["correctness"]
    timed = copy.deepcopy(bench["cases"][1])
    timed.update(case_id=TIMED_ID, implementation="submitted", interpret=device["interpret"],
                 program_sha256=DIGEST["timed"], samples_ms=samples_ms or [0.5 + 0.01 * i for i in range(SAMPLES)])
    bench["cases"].append(timed)
    derive(docs, device["device_kind"])
    flash = [c for c in correctness["scorecards"] if c["candidate"] == "flash"]  # the timed baseline's own grade
    card = correctness["scorecards"][1]
    card.update(candidate=NAME, level="quick", programs=sorted([DIGEST["timed"], DIGEST["graded"]]))
    correctness["scorecards"] = [card, *flash]
    correctness["measured_candidate"] = NAME
    grading_call = {**timed_signature(timed), "causal": False}

    def entry(role, signature, grading, cases):
        return {"sha256": DIGEST[role], "path": program_path(DIGEST[role]), "signature": signature,
                "grading": grading, "cases": cases}
    correctness["submission"] = {
        "name": NAME, "spec": "mine.py:attention", "file_sha256": None, "platform": device["platform"],
        "isolation": "bubblewrap", "check_entropy": ENTROPY,
        "programs": [entry("timed", timed_signature(timed), True, [TIMED_ID]),
                     entry("graded", grading_call, True, []), entry("unused", grading_call, False, [])]}
    return docs


def as_read(docs: dict[str, Any], files: dict[str, bytes] | None = None) -> tuple[dict[str, Any], Callable]:
    """``(run, read_file)`` as ``rawio.read_run`` and ``rules.run_files`` give them for these documents."""
    files = {program_path(DIGEST[r]): data for r, data in PROGRAMS.items()} if files is None else files
    listed = {**{f"{n}.json": "0" * 64 for n in rawio.DOCUMENTS}, **{rel: "0" * 64 for rel in files}}
    run = json.loads(json.dumps({"manifest": {"format_version": 1, "run_id": "synthetic-submitted", "files": listed},
                                 **docs}))
    return run, files.__getitem__


def refusal(run: dict[str, Any], read_file: Callable | None) -> rawio.RunError:
    with pytest.raises(rawio.RunError) as err:
        rules.accept(run, allow_interpret=True, read_file=read_file)
    return err.value


@pytest.fixture(scope="module")
def base() -> dict[str, dict[str, Any]]:
    return {"cpu": documents(), "v5e": documents(device=V5E)}


def test_the_builders_timed_call_is_the_one_measure_exports_for_every_profile():
    """Otherwise an honest run is refused ``timed-not-graded``; the cases below use the builder's statement."""
    from tpu_kernel_records_tools.bench.cases import PROFILES
    from tpu_kernel_records_tools.measure import submission

    for profile in PROFILES.values():
        for platform in ("cpu", "tpu") if profile.model is None else ("tpu",):
            for case in submission.templates_for(profile, submission.bench_scopes(profile), 0, platform):
                assert timed_signature(submission._template_record(case)) == submission.case_signature(case).to_dict()
    cross = {"shape": {"batch": 2, "q_len": 128, "kv_len": 384, "num_q_heads": 4, "num_kv_heads": 2, "head_dim": 64},
             "dtype": "bfloat16", "causal": True, "padded": False}  # no profile has q_len != kv_len yet
    assert timed_signature(cross) == {"q": [2, 128, 4, 64], "k": [2, 384, 2, 64], "v": [2, 384, 2, 64],
                                      "dtype": "bfloat16", "causal": True, "has_lengths": False, "scale": 0.125}


@pytest.mark.parametrize("kind", ["cpu", "v5e"])
def test_the_undamaged_submitted_run_is_accepted(base, kind):
    run, read_file = as_read(base[kind])
    assert rules.accept(run, allow_interpret=True, read_file=read_file).record_id == "synthetic-submitted"


def _programs(docs):
    return docs["correctness"]["submission"]["programs"]


def _timed(docs):
    return docs["benchmark"]["cases"][2]


def _set(path: str, value: Any = None, *, times: float | None = None, drop: bool = False):
    """Edit: set ``document/key/.../key`` (integers index lists) to ``value``, multiply it, or drop it."""
    def edit(docs):
        *parents, leaf = path.split("/")
        node = docs
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        leaf = int(leaf) if isinstance(node, list) else leaf
        if drop:
            del node[leaf]
        else:
            node[leaf] = node[leaf] * times if times is not None else value
    return edit


def _time_the(role: str, grading: bool):
    """The timed case times program ``role``, listed for it at its call, ``grading`` or not."""
    def edit(docs):
        entry = next(e for e in _programs(docs) if e["sha256"] == DIGEST[role])
        entry.update(grading=grading, cases=[TIMED_ID], signature=timed_signature(_timed(docs)))
        _timed(docs)["program_sha256"] = DIGEST[role]
    return edit


def _reversed_pair(docs):
    pair = copy.deepcopy(docs["benchmark"]["pairs"][1])
    pair.update(numerator=pair["denominator"], denominator=TIMED_ID, ratio=1 / pair["ratio"])
    docs["benchmark"]["pairs"].append(pair)


def _no_timed_case(docs):
    docs["benchmark"]["cases"].pop(2)
    docs["benchmark"]["pairs"] = [p for p in docs["benchmark"]["pairs"] if p["numerator"] != TIMED_ID]


def _renamed(docs):
    """The timed case (and its pairs) at a sequence length the baselines were not timed at."""
    _timed(docs)["case_id"] = "flash-submitted-s256"
    for pair in docs["benchmark"]["pairs"][1:]:
        pair["numerator"] = "flash-submitted-s256"


def _profile(name: str, level: str):
    def edit(docs):
        docs["benchmark"]["profile"] = name
        docs["correctness"]["scorecards"][0]["level"] = level
    return edit


def _interpreted(how: str):
    """A device profile's run on a CPU (said not interpret), or on a v5e with the run or one case interpret."""
    def edit(docs):
        _profile("tpu-v5e", "full")(docs)
        flag = how == "run-interpret"
        docs["environment"]["interpret"] = docs["benchmark"]["interpret"] = flag
        for case in docs["benchmark"]["cases"]:
            case["interpret"] = False
        docs["benchmark"]["cases"][2]["interpret"] = how == "one-case-interpret"
    return edit


P0, CARD, PAIR = "correctness/submission/programs/0", "correctness/scorecards/0", "benchmark/pairs/1"
TIMED = "benchmark/cases/2"
# name: (base, edit, rule, file, field); each edit one step past its rule's line (the base: just inside it)
REFUSALS: dict[str, tuple] = {
    "no-submission": ("cpu", _set("correctness/submission", drop=True), "submission", "correctness.json",
                      "submission"),
    "submission-of-another-name": ("cpu", _set("correctness/submission/name", "other"), "submission",
                                   "correctness.json", "measured_candidate"),
    "no-check-entropy": ("cpu", _set("correctness/submission/check_entropy", ""), "check-entropy",
                         "correctness.json", "submission/check_entropy"),
    "program-path-not-its-hash": ("cpu", _set(f"{P0}/path", program_path(DIGEST["graded"])), "program-file",
                                  "correctness.json", "submission/programs/0/path"),
    "program-not-a-file-of-the-run": ("cpu", _set(f"{P0}/path", "programs/./" + program_path(DIGEST["timed"])[9:]),
                                      "program-file", "correctness.json", "submission/programs/0/path"),
    "device-profile-graded-quick": ("v5e", _profile("tpu-v5e", "quick"), "graded-level", "correctness.json",
                                    "scorecards/0/level"),
    "gpu-profile-graded-quick": ("v5e", _profile("gpu", "quick"), "graded-level", "correctness.json",
                                 "scorecards/0/level"),
    "graded-program-not-for-grading": ("cpu", _set("correctness/submission/programs/1/grading", False),
                                       "graded-programs", "correctness.json", "scorecards/0/programs"),
    "graded-program-not-submitted": ("cpu", _set(f"{CARD}/programs", sorted([DIGEST["timed"], DIGEST["graded"],
                                                                           "f" * 64])),
                                     "graded-programs", "correctness.json", "scorecards/0/programs"),
    "no-graded-program": ("cpu", _set(f"{CARD}/programs", []), "graded-programs", "correctness.json",
                          "scorecards/0/programs"),
    "timed-program-submitted-but-not-graded": ("cpu", _time_the("unused", True), "timed-not-graded",
                                               "benchmark.json", "cases/2/program_sha256"),
    "timed-program-not-listed-for-the-case": ("cpu", _set(f"{P0}/cases", []), "timed-not-graded",
                                              "benchmark.json", "cases/2/program_sha256"),
    **{f"timed-program-at-another-{field}": ("cpu", _set(f"{P0}/signature/{field}", value), "timed-not-graded",
                                             "benchmark.json", "cases/2/program_sha256")
       for field, value in [("q", [1, 127, 4, 64]), ("k", [1, 127, 2, 64]), ("v", [1, 128, 1, 64]),
                            ("dtype", "float32"), ("causal", False), ("has_lengths", False), ("scale", 0.125001)]},
    "no-output-check": ("cpu", _set(f"{TIMED}/output_checks", []), "output-check", "benchmark.json",
                        "cases/2/output_checks"),
    "one-output-check-short": ("cpu", _set(f"{TIMED}/output_checks/0", drop=True), "output-check",
                               "benchmark.json", "cases/2/output_checks"),
    "a-failed-output-check": ("cpu", _set(f"{TIMED}/output_checks/2/passed", False), "output-check",
                              "benchmark.json", "cases/2/output_checks/2"),
    "a-floor-recorded-on-a-cpu": ("cpu", _set(f"{TIMED}/roofline_floor_ms", 1e-4), "derived", "benchmark.json",
                                  "cases/2/roofline_floor_ms"),
    "no-floor-recorded-on-a-v5e": ("v5e", _set(f"{TIMED}/roofline_floor_ms", None), "derived", "benchmark.json",
                                   "cases/2/roofline_floor_ms"),
    "a-floor-off-by-2e-9": ("v5e", _set(f"{TIMED}/roofline_floor_ms", times=1 + 2e-9), "derived", "benchmark.json",
                            "cases/2/roofline_floor_ms"),
    "a-median-not-of-its-samples": ("cpu", _set(f"{TIMED}/median_ms", times=1 + 2e-9), "derived", "benchmark.json",
                                    "cases/2/median_ms"),
    "a-gbps-not-of-its-median": ("v5e", _set(f"{TIMED}/gbps", times=1 + 2e-9), "derived", "benchmark.json",
                                 "cases/2/gbps"),
    **{f"device-profile-{how}": (kind, _interpreted(how), "interpret-profile", "benchmark.json", "profile")
       for kind, how in [("cpu", "on-a-cpu"), ("v5e", "run-interpret")]},
    "timed-case-without-baselines": ("cpu", _renamed, "unexpected-case",
                                     "benchmark.json", "cases/2/case_id"),
    "timed-case-other-work": ("cpu", _set(f"{TIMED}/flops", times=2), "derived", "benchmark.json", "cases/2/flops"),
    "no-timed-case": ("cpu", _no_timed_case, "missing-case", "benchmark.json", "cases"),
    "a-timed-pair-missing": ("cpu", _set(PAIR, drop=True), "missing-pair", "benchmark.json", "pairs"),
    "a-timed-ratio-not-of-samples": ("cpu", _set(f"{PAIR}/ratio", times=1 + 1e-12), "derived", "benchmark.json",
                                     "pairs"),
    "a-timed-pair-at-another-scope": ("cpu", _set(f"{PAIR}/scope", "attention"), "pair", "benchmark.json", "pairs"),
    "a-baseline-over-the-timed-case": ("cpu", _reversed_pair, "unexpected-pair", "benchmark.json", "pairs/3"),
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_each_submitted_rule_refuses_naming_rule_file_and_field(base, name):
    kind, edit, rule, file, field = REFUSALS[name]
    docs = copy.deepcopy(base[kind])
    edit(docs)
    e = refusal(*as_read(docs))
    assert (e.rule, e.file, e.field) == (rule, file, field), (name, str(e))
    assert str(e).startswith(f"[{rule}] {file}") and "\n" not in str(e)


def test_a_device_profile_with_one_case_in_interpret_mode_is_refused_by_the_submitted_rules_too(base):
    """``rules.accept`` refuses an interpret case on a device first; ``check_submitted`` does not lean on it."""
    from tpu_kernel_records_tools.builder.submitted import check_submitted

    docs = copy.deepcopy(base["v5e"])
    _interpreted("one-case-interpret")(docs)
    with pytest.raises(rawio.RunError, match=r"^\[interpret-profile\] benchmark.json at profile"):
        check_submitted(*as_read(docs))


def _at_floor(docs, *, samples: float = 0.0, recorded: float = 0.0, floor: float = 1.0):
    """Every sample at the v5e roofline floor, ``samples`` ulps off; the recorded median and floor as told."""
    import math

    case = _timed(docs)
    least = roofline_floor_ms(case["flops"], case["bytes_moved"], V5E["device_kind"])
    step = math.nextafter(least, math.inf) - least
    case["samples_ms"] = [least + samples * step] * SAMPLES
    derive(docs, V5E["device_kind"])
    case["median_ms"] += recorded * step
    case["roofline_floor_ms"] *= floor
    return docs


@pytest.mark.parametrize("samples, recorded, floor", [(0, 0, 1), (0, 0, 1 + 0.5e-9), (0, 0, 1 - 0.5e-9), (0, 1, 1)])
def test_a_median_at_the_roofline_floor_is_accepted(base, samples, recorded, floor):
    run, read_file = as_read(_at_floor(copy.deepcopy(base["v5e"]), samples=samples, recorded=recorded, floor=floor))
    rules.accept(run, allow_interpret=True, read_file=read_file)


@pytest.mark.parametrize("samples, recorded", [(-1, 0), (0, -1), (-1, 1)], ids=["both", "recorded", "samples"])
def test_a_median_one_ulp_under_the_roofline_floor_is_refused(base, samples, recorded):
    """The ranked median is the recorded one; its samples' may differ by 1e-9 relative: neither may be under."""
    e = refusal(*as_read(_at_floor(copy.deepcopy(base["v5e"]), samples=samples, recorded=recorded)))
    assert (e.rule, e.file, e.field) == ("roofline-floor", "benchmark.json", "cases/2/median_ms"), str(e)
    assert "below the roofline floor" in str(e) and "'TPU v5 lite'" in str(e)


def _folder(tmp_path, docs, change: Callable[[Any], None]):
    """The run written as a folder, ``change``\\ d, every checksum in its manifest made to match again."""
    run_dir = rawio.write_run(tmp_path / "run", docs, {program_path(DIGEST[r]): d for r, d in PROGRAMS.items()})
    change(run_dir)
    manifest = json.loads((run_dir / rawio.MANIFEST).read_text())
    manifest["files"] = {p.relative_to(run_dir).as_posix(): rawio.sha256_file(p) for p in run_dir.rglob("*")
                         if p.is_file() and p.name != rawio.MANIFEST}
    (run_dir / rawio.MANIFEST).write_bytes(rawio.dumps(manifest))
    return rawio.read_run(run_dir), rules.run_files(run_dir)


def _replace(role: str, data: bytes):
    return lambda run_dir: (run_dir / program_path(DIGEST[role])).write_bytes(data)


def _swap(run_dir):
    timed, graded = (run_dir / program_path(DIGEST[r]) for r in ("timed", "graded"))
    data = timed.read_bytes()
    timed.write_bytes(graded.read_bytes())
    graded.write_bytes(data)


@pytest.mark.parametrize("change, where", [
    (_replace("timed", PROGRAMS["timed"] + b"\0"), "timed"),      # one byte more
    (_replace("graded", PROGRAMS["timed"]), "graded"),            # another program's bytes
    (_replace("unused", b""), "unused"),                          # an ungraded program, emptied
    (_swap, "timed"),                                             # two programs' files swapped
    (lambda d: (d / program_path(DIGEST["timed"])).unlink(), None),  # gone, and from the manifest
], ids=["longer", "other-bytes", "emptied", "swapped", "removed"])
def test_a_program_file_replaced_manifest_and_all_is_refused(base, tmp_path, change, where):
    run, read_file = _folder(tmp_path, base["cpu"], lambda d: None)
    rules.accept(run, allow_interpret=True, read_file=read_file)  # the folder as written: accepted
    run, read_file = _folder(tmp_path / "changed", base["cpu"], change)
    e = refusal(run, read_file)
    if where is None:
        assert (e.rule, e.file, e.field) == ("program-file", "correctness.json", "submission/programs/0/path")
    else:
        assert (e.rule, e.file, e.field) == ("program-file", program_path(DIGEST[where]), None), str(e)


def test_programs_are_checked_only_against_their_files(base):
    run, _ = as_read(base["cpu"])
    e = refusal(run, None)
    assert (e.rule, e.file, e.field) == ("program-file", "correctness.json", "submission/programs/0")


# --- the programs: grading.export.load_program -------------------------------------------------------

SIG = {"q": (1, 8, 2, 8), "k": (1, 8, 1, 8), "v": (1, 8, 1, 8), "dtype": "float32", "causal": False,
       "has_lengths": False, "scale": None}
# Stated here, apart from grading.export: Pallas' lowerings (Mosaic TPU, Triton and Mosaic GPU) and JAX's markers.
ALLOWED = {"tpu_custom_call", "triton_kernel_call", "__gpu$xla.gpu.triton", "mosaic_gpu", "mosaic_gpu_v2",
           "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape", "shape_assertion"}


def _sig(**change):
    from tpu_kernel_records_tools.grading.export import Signature

    return Signature.from_dict({**SIG, **change})


def export(fn, *, sig=None, platforms=("cpu",), targets=(), **replace) -> bytes:
    """A real ``jax.export`` program of ``fn(q, k, v)`` with its VJP, as the sandboxed exporter serializes it
    (``targets``: custom calls JAX's own export check is told to let through; ``replace``: Exported fields)."""
    import dataclasses

    import jax
    import jax.export

    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in targets]
    exported = jax.export.export(jax.jit(fn), platforms=platforms, disabled_checks=checks)(
        *(sig or _sig()).abstract_args())
    return bytes(dataclasses.replace(exported, **replace).serialize(vjp_order=1))


def _calls(target: str, *, in_vjp: bool = False):
    """``q`` through a custom call to ``target`` (made with ``jax.ffi``), in the forward or only in the VJP."""
    import jax

    def call(x):
        return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, x.dtype))(jax.lax.stop_gradient(x))
    if not in_vjp:
        return lambda q, k, v: call(q)

    @jax.custom_vjp
    def through(q):
        return q
    through.defvjp(lambda q: (q, None), lambda _, ct: (call(ct),))
    return lambda q, k, v: through(q)


def _honest(q, k, v):
    return q * (k.sum() + v.sum())


def _load(data: bytes, sig=None):
    from tpu_kernel_records_tools.grading.export import load_program

    return load_program(data, sig or _sig(), "cpu")


def _refused(data: bytes, match: str, sig=None):
    from tpu_kernel_records_tools.grading.export import ProgramRefused

    with pytest.raises(ProgramRefused, match=match) as err:
        _load(data, sig)
    assert "\n" not in str(err.value)


def test_the_allow_list_is_the_kernel_lowerings_and_jaxs_markers():
    from tpu_kernel_records_tools.grading.export import ALLOWED_CUSTOM_CALLS

    assert ALLOWED_CUSTOM_CALLS == ALLOWED


@pytest.mark.parametrize("target", sorted(ALLOWED))
def test_a_program_calling_an_allowed_custom_call_loads(target):
    exported = _load(export(_calls(target), targets=[target]))
    assert exported.has_vjp()


@pytest.mark.parametrize("target", ["xla_ffi_python_cpu_callback", "xla_python_cpu_callback", "tpu_custom_call.x",
                                    "Sharding-x", "tpu_custom_call x", 'tpu_custom_call"', "tpu_custom_call\\"])
@pytest.mark.parametrize("in_vjp", [False, True], ids=["forward", "vjp"])
def test_a_program_calling_one_custom_call_outside_the_allow_list_is_refused(target, in_vjp):
    """Host callbacks, and names one character from an allowed one: printed bare, or quoted where MLIR must."""
    part = "VJP" if in_vjp else "forward"
    _refused(export(_calls(target, in_vjp=in_vjp), targets=[target]),
             rf"its {part} calls custom_call \[{re.escape(repr(target))}\]")


def test_a_program_calling_lapack_is_refused():
    """No hand-made target: JAX's own CPU lowering of an LU decomposition, a custom call it allows."""
    import jax

    _refused(export(lambda q, k, v: q * jax.lax.linalg.lu(k[0, :, 0, :])[0].sum()),
             r"its forward calls custom_call \['lapack_sgetrf_ffi'\]")


@pytest.fixture(scope="module")
def honest():
    import jax

    data = export(_honest)
    return data, jax.export.deserialize(bytearray(data))


@pytest.mark.parametrize("which", ["ordered_effects", "unordered_effects", "vjp"])
def test_a_program_with_side_effects_is_refused(honest, which):
    """JAX 0.10 will not serialize a host callback, but the exporter's bytes are the submitter's: effects
    as bytes may carry them (FfiEffect, one JAX deserializes), in the forward or only in the VJP."""
    import dataclasses

    from jax._src.ffi import FfiEffect

    _, exported = honest
    if which == "vjp":
        vjp = dataclasses.replace(exported.vjp(), unordered_effects=(FfiEffect(),))
        data = bytes(dataclasses.replace(exported, _get_vjp=lambda _: vjp).serialize(vjp_order=1))
    else:
        data = bytes(dataclasses.replace(exported, **{which: (FfiEffect(),)}).serialize(vjp_order=1))
    _refused(data, rf"its {'VJP' if which == 'vjp' else 'forward'} has side effects \(\['FFI'\]\)")


def test_the_honest_program_loads_and_one_for_two_platforms_or_devices_does_not(honest):
    import dataclasses

    data, exported = honest
    assert _load(data).has_vjp()
    _refused(export(_honest, platforms=("cpu", "tpu")), r"targets \['cpu', 'tpu'\], not \['cpu'\]")
    _refused(bytes(dataclasses.replace(exported, nr_devices=2).serialize(vjp_order=1)), "runs on 2 devices, not 1")


@pytest.mark.parametrize("change, sig", [
    (None, _sig(dtype="bfloat16")),                                     # inputs of another dtype only
    (None, _sig(has_lengths=True)),                                     # one argument fewer
    (lambda q, k, v: (q, q), None),                                     # inputs right, two results
    (lambda q, k, v: q[..., :7], None),                                 # inputs right, a narrower result
    (lambda q, k, v: (q * 2).astype("bfloat16"), None),                 # inputs right, a bfloat16 result
    (lambda q, k, v: (q * 2).astype("bfloat16"), _sig(dtype="bfloat16")),  # result right, float32 inputs
], ids=["input-dtype", "input-count", "two-results", "result-shape", "result-dtype", "input-dtype-only"])
def test_a_program_not_of_the_signatures_shapes_is_refused(honest, change, sig):
    data = honest[0] if change is None else export(change)
    _refused(data, "not the signature's", sig)
