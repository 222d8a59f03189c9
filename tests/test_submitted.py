"""Submitted kernels as programs (issue 26), the cheap parts: export, refusal, dispatch, timing, leaderboard."""
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpu_kernel_records_tools.bench.submitted import checked_samples, roofline_floor_ms, time_program
from tpu_kernel_records_tools.builder.leaderboard import median_ci
from tpu_kernel_records_tools.measure.timed_checks import draw_entropy
from tpu_kernel_records_tools.grading.export import (ALLOWED_CUSTOM_CALLS, ProgramAttention, ProgramRefused, Signature,
                                                     custom_calls, export_programs, load_program, program_path, sha256)

HERE = Path(__file__).parent / "submitted"
sys.path.insert(0, str(HERE))
import callbacks  # noqa: E402
import pure_jax  # noqa: E402

SIG = Signature((1, 8, 2, 8), (1, 8, 1, 8), (1, 8, 1, 8), "float32", True, True, None)


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(SIG.q).astype(np.float32)
    k, v = (rng.standard_normal(SIG.k).astype(np.float32) for _ in range(2))
    return q, k, v, np.array([6], np.int32)


def _export(fn, sig=SIG):
    reply, arrays = export_programs(fn, [sig.to_dict()], "cpu")
    assert reply["ok"], reply
    return arrays[0].tobytes()


def test_program_dispatch_matches_the_function_and_its_gradient(tmp_path):
    data = _export(pure_jax.attention)
    (tmp_path / program_path(sha256(data))).parent.mkdir()
    (tmp_path / program_path(sha256(data))).write_bytes(data)
    program = ProgramAttention(str(tmp_path), {SIG.key: sha256(data)}, "cpu")
    q, k, v, lengths = _inputs()
    want = jax.jit(pure_jax.attention, static_argnames="causal")(q, k, v, causal=True, kv_lengths=lengths)
    np.testing.assert_array_equal(np.asarray(program(q, k, v, causal=True, kv_lengths=lengths)), np.asarray(want))
    grad = jax.jit(jax.grad(lambda q: program(q, k, v, causal=True, kv_lengths=lengths).sum()))(q)
    grad_want = jax.jit(jax.grad(lambda q: pure_jax.attention(q, k, v, causal=True, kv_lengths=lengths).sum()))(q)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(grad_want), rtol=1e-6, atol=1e-6)
    with pytest.raises(ProgramRefused, match="no exported program"):
        program(q, k, v, causal=False, kv_lengths=lengths)  # a signature the export did not cover
    (tmp_path / program_path(sha256(data))).write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(ProgramRefused, match="changed on disk"):
        ProgramAttention(str(tmp_path), {SIG.key: sha256(data)}, "cpu")(q, k, v, causal=True, kv_lengths=lengths)


@pytest.mark.parametrize("fn", [callbacks.pure, callbacks.io, callbacks.debug])
def test_an_export_with_a_host_callback_is_refused(fn):
    reply, arrays = export_programs(fn, [SIG.to_dict()], "cpu")
    if reply["ok"]:  # a JAX that serializes callbacks: the allow-list refuses the program
        with pytest.raises(ProgramRefused, match="callback|side effects|custom_call"):
            load_program(arrays[0].tobytes(), SIG, "cpu")
    else:
        assert "callback" in reply["error"] and "\n" not in reply["error"]


def test_custom_call_allow_list_names_only_kernel_lowerings():
    text = ('%0 = stablehlo.custom_call @tpu_custom_call(%a)\n'
            '%1 = "stablehlo.custom_call"(%b) {call_target_name = "xla_ffi_python_cpu_callback"}')
    assert custom_calls(text) == {"tpu_custom_call", "xla_ffi_python_cpu_callback"}
    assert custom_calls(text) - ALLOWED_CUSTOM_CALLS == {"xla_ffi_python_cpu_callback"}


def test_a_program_for_other_shapes_or_platform_is_refused():
    data = _export(pure_jax.attention)
    other = Signature((1, 8, 2, 8), (1, 8, 1, 8), (1, 8, 1, 8), "float32", True, True, 0.5)
    load_program(data, other, "cpu")  # scale is static: same shapes load (dispatch keys on it)
    wider = Signature((1, 16, 2, 8), (1, 16, 1, 8), (1, 16, 1, 8), "float32", True, True, None)
    with pytest.raises(ProgramRefused, match="not the signature"):
        load_program(data, wider, "cpu")
    with pytest.raises(ProgramRefused, match="targets"):
        load_program(data, SIG, "tpu")
    with pytest.raises(ProgramRefused, match="does not deserialize"):
        load_program(b"not a program", SIG, "cpu")


def test_every_timed_call_gets_fresh_inputs_and_picked_outputs_are_rerun_and_checked():
    made, checked = [], []

    def make(i):
        made.append(i)
        return [np.full((4,), float(i), np.float32)]

    def check(i, host, out):
        checked.append(i)
        return bool(np.all(np.asarray(out) == 2 * host[0])), "ok"

    timing = time_program(lambda x: 2 * x, (jax.ShapeDtypeStruct((4,), jnp.float32),), make, warmups=2,
                          samples=6, check=check, entropy="3" * 32, key="case")
    assert len(timing.samples_ms) == 6 and all(t > 0 for t in timing.samples_ms)
    assert made[:2] == [-1, -2] and made[2:8] == list(range(6))  # a new input per timed call
    assert checked == checked_samples(6, "3" * 32, "case") and all(c["passed"] for c in timing.output_checks)
    picks = {tuple(checked_samples(6, draw_entropy(), "case")) for _ in range(8)}
    assert len(picks) > 1  # the checked calls follow the entropy drawn, not a public seed


def test_roofline_floor_and_median_interval():
    assert roofline_floor_ms(197e12, 1.0, "TPU v5 lite") == pytest.approx(1e3)
    assert roofline_floor_ms(1.0, 819e9, "TPU v5e") == pytest.approx(1e3)
    assert roofline_floor_ms(1.0, 1.0, "cpu") is None
    low, high = median_ci([float(x) for x in range(1, 21)])
    assert low <= 10.5 <= high and (low, high) == (6.0, 15.0)  # binomial(20, 1/2): ranks 6..15 cover 95.9%
    assert median_ci([1.0, 2.0]) == (None, None)


def _scorecard_run(profile: str, level: str, platform: str = "tpu", interpret: bool = False) -> dict:
    digest = "a" * 64
    program = {"sha256": digest, "path": program_path(digest), "grading": True, "cases": []}
    return {"manifest": {"files": {}}, "environment": {"platform": platform, "interpret": interpret, "device_kind": "TPU v5 lite"},
            "benchmark": {"profile": profile, "cases": [{"interpret": interpret}], "pairs": []},
            "correctness": {"measured_candidate": "mine", "submission": {"name": "mine", "programs": [program]},
                            "scorecards": [{"candidate": "mine", "level": level, "programs": [digest]}]}}


@pytest.mark.parametrize("profile", ["tpu-v5e", "gpu"])
def test_a_device_profile_submission_must_be_graded_at_the_full_level(profile):
    from tpu_kernel_records_tools.builder import submitted
    from tpu_kernel_records_tools.records.rawio import RunError

    programs = {"a" * 64: {"grading": True}}
    assert submitted._graded(_scorecard_run(profile, "full"), programs) == {"a" * 64}
    with pytest.raises(RunError, match=r"\[graded-level\].*'quick'"):
        submitted._graded(_scorecard_run(profile, "quick"), programs)
    assert submitted._graded(_scorecard_run("tiny", "quick"), programs) == {"a" * 64}  # a CPU try-out


@pytest.mark.parametrize("platform, interpret", [("cpu", False), ("tpu", True)])
def test_a_device_profile_timed_on_a_cpu_or_in_interpret_mode_is_refused(platform, interpret):
    from tpu_kernel_records_tools.builder import submitted
    from tpu_kernel_records_tools.records.rawio import RunError

    with pytest.raises(RunError, match=r"\[interpret-profile\]"):
        submitted.check_submitted(_scorecard_run("tpu-v5e", "full", platform, interpret), read_file=None)
    with pytest.raises(RunError) as later:  # the same run on a device passes that rule (and meets a later one)
        submitted.check_submitted(_scorecard_run("tpu-v5e", "full"), read_file=None)
    assert "[interpret-profile]" not in str(later.value)


def _timed_case(samples=6, entropy="0" * 32):
    from tpu_kernel_records_tools.bench import roofline, stats
    from tpu_kernel_records_tools.bench.submitted import checked_samples as picks

    from tpu_kernel_records_tools.builder.submitted import timed_signature

    times = [1.0 + 0.1 * i for i in range(samples)]
    case = {"case_id": "flash-submitted-s128", "program_sha256": "a" * 64, "samples_ms": times,
            "shape": {"batch": 1, "q_len": 8, "kv_len": 8, "num_q_heads": 2, "num_kv_heads": 1, "head_dim": 8},
            "dtype": "float32", "causal": True, "padded": True, "flops": 1e6, "bytes_moved": 1e5,
            "roofline_floor_ms": None, **stats.summarize(times), **roofline.rates(1e6, 1e5, None, "cpu", 1),
            "output_checks": [{"sample": i, "passed": True, "detail": "ok"}
                              for i in picks(samples, entropy, "flash-submitted-s128")]}
    case.update(roofline.rates(case["flops"], case["bytes_moved"], case["median_ms"], "cpu", 1))
    programs = {"a" * 64: {"cases": [case["case_id"]], "signature": timed_signature(case)}}
    return case, programs


def test_a_timed_case_whose_output_check_failed_or_names_no_timed_call_is_refused():
    from tpu_kernel_records_tools.builder import submitted
    from tpu_kernel_records_tools.records.rawio import RunError

    def check(case, programs):
        submitted._check_timed(0, case, programs, {"a" * 64}, "cpu", "0" * 32)

    case, programs = _timed_case()
    check(case, programs)  # as recorded: accepted
    case["output_checks"][0]["passed"] = False
    with pytest.raises(RunError, match=r"\[output-check\].*timed call"):
        check(case, programs)
    case, programs = _timed_case()
    case["samples_ms"] = case["samples_ms"][:max(c["sample"] for c in case["output_checks"])]
    with pytest.raises(RunError, match=r"\[output-check\]"):  # a checked call that was never timed
        check(case, programs)
    case, programs = _timed_case()
    case["roofline_floor_ms"] = 0.5  # a CPU has no floor: a recorded one does not follow from the work
    with pytest.raises(RunError, match=r"\[derived\].*roofline_floor_ms"):
        check(case, programs)


def test_a_base_signature_keeps_the_key_it_had_before_features_existed():
    """Older runs' programs are found by these keys: a base call's key must not gain feature fields."""
    assert SIG.key == ('{"causal": true, "dtype": "float32", "has_lengths": true, "k": [1, 8, 1, 8], "q": [1, 8, 2, 8], '
                       '"scale": null, "v": [1, 8, 1, 8]}')
    assert Signature.from_dict(SIG.to_dict()) == SIG


def test_a_feature_call_is_exported_and_dispatched_with_its_arguments(tmp_path):
    from kernel_src.reference import reference_attention

    q, k, v, lengths = _inputs(1)
    seg_q, seg_kv = np.array([[0, 0, 1, 1, 1, 0, 0, 1]], np.int32), np.array([[0, 1, 1, 0, 0, 1, 1, 0]], np.int32)
    sinks = np.array([0.5, -1.0], np.float32)
    kw = dict(window_size=(2, None), softcap=3.0, q_segment_ids=seg_q, kv_segment_ids=seg_kv)
    sig = Signature.of_call(q, k, v, causal=True, kv_lengths=lengths, sinks=sinks, **kw)
    assert Signature.from_dict(sig.to_dict()) == sig and sig.key != SIG.key
    assert "window_size=(2, None)" in sig.describe() and "sinks" in sig.describe()
    data = _export(reference_attention, sig)
    (tmp_path / program_path(sha256(data))).parent.mkdir()
    (tmp_path / program_path(sha256(data))).write_bytes(data)
    program = ProgramAttention(str(tmp_path), {sig.key: sha256(data)}, "cpu", ("window", "softcap", "segments", "sinks"))
    got = program(q, k, v, causal=True, kv_lengths=lengths, sinks=sinks, **kw)
    # jitted: op by op, the reference and its gradient compile a program per operation
    want = jax.jit(lambda: reference_attention(q, k, v, causal=True, kv_lengths=lengths, sinks=sinks, **kw))()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    dsinks = jax.jit(jax.grad(lambda s: program(q, k, v, causal=True, kv_lengths=lengths, sinks=s, **kw).sum()))(sinks)
    dsinks_want = jax.jit(jax.grad(
        lambda s: reference_attention(q, k, v, causal=True, kv_lengths=lengths, sinks=s, **kw).sum()))(sinks)
    np.testing.assert_allclose(np.asarray(dsinks), np.asarray(dsinks_want), rtol=1e-5, atol=1e-6)
    import pickle
    assert pickle.loads(pickle.dumps(program)).features == program.features
    with pytest.raises(ProgramRefused, match="no exported program"):
        program(q, k, v, causal=True, kv_lengths=lengths, sinks=sinks, **{**kw, "softcap": 4.0})
