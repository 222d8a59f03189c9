"""The timed shapes' output checks (issue 26 follow-up): rows scattered over every batch element and dK/dV
key rows, chosen by entropy drawn after the export, catch programs that are right only where a public
seed would have looked; correct programs pass; the run records the entropy and the builder needs it."""
import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from kernel_src.reference import reference_attention
from tpu_kernel_records_tools.builder.submitted import check_submitted
from tpu_kernel_records_tools.grading.export import Signature
from tpu_kernel_records_tools.measure import timed_checks
from tpu_kernel_records_tools.measure.timed_checks import check_output, check_rng, draw_entropy
from tpu_kernel_records_tools.records import rawio

ENTROPIES = ["0" * 32, "9" * 32, "deadbeef" * 4]


def _problem(dtype="bfloat16", batch=2, seq=128, heads=(4, 2), head_dim=16):
    rng = np.random.default_rng(5)
    dt = jnp.dtype(dtype)
    q = rng.standard_normal((batch, seq, heads[0], head_dim), dtype=np.float32).astype(dt)
    k, v = (rng.standard_normal((batch, seq, heads[1], head_dim), dtype=np.float32).astype(dt) for _ in "kv")
    ct = rng.standard_normal(q.shape, dtype=np.float32).astype(dt)
    lengths = np.array([seq - seq // 4, seq], np.int32)[:batch]
    sig = Signature.of_call(q, k, v, causal=True, kv_lengths=lengths)

    @jax.jit  # op by op, the reference's VJP compiles a program per operation
    def vjp(q, k, v, ct):
        out, pull = jax.vjp(lambda q, k, v: reference_attention(q, k, v, causal=True, kv_lengths=lengths), q, k, v)
        return out, pull(ct)

    out, grads = vjp(q, k, v, ct)
    return sig, (q, k, v, ct, lengths), np.asarray(out), [np.asarray(g) for g in grads]


def _forward(sig, args, out, entropy):
    q, k, v, _, lengths = args
    return check_output(sig, [q, k, v, lengths], out, backward=False, rng=check_rng(entropy, "case", 0))


def _backward(sig, args, grads, entropy):
    q, k, v, ct, lengths = args
    return check_output(sig, [q, k, v, ct], tuple(grads), backward=True, rng=check_rng(entropy, "case", 1),
                        lengths=lengths)


@pytest.fixture(params=["float64 truth", "float32 truth"])
def truth_path(request, monkeypatch):
    if request.param == "float32 truth":  # the device path model shapes take, forced at a tiny shape
        monkeypatch.setattr(timed_checks, "EXACT_WORK", 0)
    return request.param


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_correct_program_passes_on_every_entropy(dtype, truth_path):
    sig, args, out, grads = _problem(dtype)
    for entropy in ENTROPIES:
        ok, detail = _forward(sig, args, out, entropy)
        assert ok, detail
        ok, detail = _backward(sig, args, grads, entropy)
        assert ok and "dk of 64 key rows" in detail and "dv of 64 key rows" in detail, detail
        assert truth_path.split()[0] + " truth" in detail or dtype == "float32"  # float32 inputs: always float64


def test_rows_right_only_in_a_window_or_one_batch_element_are_caught():
    sig, args, out, grads = _problem()
    window = np.zeros_like(out)
    window[0, 32:96] = out[0, 32:96]  # what one 64-row window of one batch element would have seen
    one_batch = out.copy()
    one_batch[1] = 0
    for entropy in ENTROPIES:
        assert not _forward(sig, args, window, entropy)[0]
        assert not _forward(sig, args, one_batch, entropy)[0]
        dq_window = np.zeros_like(grads[0])
        dq_window[0, 32:96] = grads[0][0, 32:96]
        assert not _backward(sig, args, [dq_window, *grads[1:]], entropy)[0]


@pytest.mark.parametrize("zeroed", [1, 2], ids=["dk", "dv"])
def test_a_vjp_with_zero_dk_or_dv_is_caught(zeroed, truth_path):
    sig, args, _, grads = _problem()
    for entropy in ENTROPIES:
        bad = list(grads)
        bad[zeroed] = np.zeros_like(bad[zeroed])
        ok, detail = _backward(sig, args, bad, entropy)
        verdicts = {part.split(" of ")[0]: part for part in detail.split("; ")}
        assert not ok and " > tol" in verdicts[["dk", "dv"][zeroed - 1]], detail
        assert " <= tol" in verdicts["dq"] and " <= tol" in verdicts[["dv", "dk"][zeroed - 1]], detail


def test_entropy_is_fresh_and_its_record_is_required():
    drawn = {draw_entropy() for _ in range(4)}
    block = rawio.load_schema("correctness")["properties"]["submission"]
    assert len(drawn) == 4 and all(jsonschema.Draft202012Validator(block["properties"]["check_entropy"])
                                   .is_valid(e) for e in drawn)
    assert "check_entropy" in block["required"]
    run = {"environment": {"platform": "cpu", "interpret": True, "device_kind": "cpu"},
           "benchmark": {"profile": "tiny", "cases": [], "pairs": []}, "manifest": {"files": {}},
           "correctness": {"measured_candidate": "k1", "scorecards": [],
                           "submission": {"name": "k1", "programs": []}}}
    with pytest.raises(rawio.RunError, match=r"\[check-entropy\]"):
        check_submitted(run, None)


def test_the_row_truth_is_the_oracles_at_every_row_and_key_row():
    from tpu_kernel_records_tools.grading.dense import truth as oracle

    sig, (q, k, v, ct, lengths), _, _ = _problem("float32", seq=40)
    truth = oracle.attention(q, k, v, ct, causal=True, kv_lengths=lengths)
    limits = timed_checks.key_limits(sig, lengths)
    keys = np.array([0, 7, 39])
    logit_max = 0.0
    for b in range(2):
        for head in range(2):
            heads = slice(2 * head, 2 * head + 2)
            parts = (q[b, :, heads].swapaxes(0, 1), k[b, :, head], v[b, :, head], ct[b, :, heads].swapaxes(0, 1))
            rows = timed_checks._rows_in(True, parts, limits[b], None)
            at_keys = timed_checks._rows_in(True, parts, limits[b], None, keys)
            for name, got in [("out", rows.out), ("dq", rows.dq)]:
                np.testing.assert_allclose(got.swapaxes(0, 1), getattr(truth, name)[b, :, heads], atol=1e-12)
                np.testing.assert_allclose(getattr(rows, name + "_mag").swapaxes(0, 1),
                                           truth.magnitude[name][b, :, heads], atol=1e-12)
            for name in ("dk", "dv"):
                np.testing.assert_allclose(getattr(at_keys, name).sum(0), getattr(truth, name)[b, keys, head],
                                           atol=1e-12)
                np.testing.assert_allclose(getattr(at_keys, name + "_mag"), truth.magnitude[name][b, keys, head],
                                           atol=1e-12)
            logit_max = max(logit_max, rows.logit_max)
    assert logit_max == pytest.approx(truth.logit_max, rel=1e-12)


@pytest.mark.parametrize("exact", [True, False], ids=["float64", "float32"])
def test_the_stored_output_answer_is_the_oracles(exact):
    """dQ and dK with rowsum(dO * O) from the output rounded to bfloat16: the oracle's ``stored_out_grads``, at
    every row and key row, in both precisions."""
    from tpu_kernel_records_tools.grading.dense import truth as oracle

    sig, (q, k, v, ct, lengths), _, _ = _problem("float32", seq=40)
    q = q * 8  # peaked rows: the rounding of O moves dQ and dK well past the float32 truth's own error
    truth = oracle.attention(q, k, v, ct, causal=True, kv_lengths=lengths, stored_dtype=jnp.bfloat16)
    dq_stored, dk_stored = truth.stored_out_grads
    limits, keys = timed_checks.key_limits(sig, lengths), np.array([0, 7, 39])
    tol = dict(atol=1e-12) if exact else dict(rtol=2e-4, atol=2e-4 * np.abs(dq_stored).max())
    for b in range(2):
        for head in range(2):
            heads = slice(2 * head, 2 * head + 2)
            parts = (q[b, :, heads].swapaxes(0, 1), k[b, :, head], v[b, :, head], ct[b, :, heads].swapaxes(0, 1))
            rows = timed_checks._rows_in(exact, parts, limits[b], None, stored_dtype="bfloat16")
            at_keys = timed_checks._rows_in(exact, parts, limits[b], None, keys, stored_dtype="bfloat16")
            np.testing.assert_allclose(rows.dq_stored.swapaxes(0, 1), dq_stored[b, :, heads], **tol)
            np.testing.assert_allclose(at_keys.dk_stored.sum(0), dk_stored[b, keys, head],
                                       **(tol if exact else dict(rtol=2e-4, atol=2e-4 * np.abs(dk_stored).max())))
            assert not np.allclose(rows.dq_stored, rows.dq, rtol=1e-3, atol=0)  # the rounding shows
    plain = timed_checks._rows_in(True, parts, limits[1], None)
    assert plain.dq_stored is None and plain.dk_stored is None


def test_dq_and_dk_rows_are_judged_against_the_stored_output_answer_too():
    """bfloat16, peaked rows: dQ rows and dK key rows exactly as a FlashAttention-style backward computes them
    (di from the output rounded to bfloat16) are judged against that answer (nearer to them than the truth
    is); dV, which takes no di, against the truth; the forward against the truth alone."""
    from tpu_kernel_records_tools.grading.dense import truth as oracle

    from tpu_kernel_records_tools.grading import tolerance
    sig, (q, k, v, ct, lengths), _, _ = _problem("bfloat16", seq=64)
    q = (np.asarray(q, np.float32) * 8).astype(jnp.bfloat16)
    sig = Signature.of_call(q, k, v, causal=True, kv_lengths=lengths)
    truth = oracle.attention(*(np.asarray(x, np.float64) for x in (q, k, v, ct)), causal=True, kv_lengths=lengths,
                             stored_dtype=jnp.bfloat16)
    dq, dk = (x.astype(jnp.bfloat16) for x in truth.stored_out_grads)
    limits = timed_checks.key_limits(sig, lengths)
    b, i = np.divmod(np.arange(2 * 64), 64)
    rows = timed_checks.query_rows(sig, q, k, v, ct, b, i, limits[b, i], dq[b, i])
    assert rows.ok and rows.against == tolerance.STORED_OUTPUT, rows.describe()
    against_truth = tolerance.error(np.asarray(dq[b, i], np.float64), truth.dq[b, i], truth.magnitude["dq"][b, i])
    assert rows.candidate.norm < against_truth.norm / 2
    grads = (dq, dk, truth.dv.astype(jnp.bfloat16))
    verdicts = timed_checks.key_rows(sig, q, k, v, ct, grads, limits, np.random.default_rng(0))
    assert [v.against for v in verdicts] == [tolerance.STORED_OUTPUT, ""] and all(v.ok for v in verdicts)
    out = truth.out.astype(jnp.bfloat16)
    assert timed_checks.query_rows(sig, q, k, v, None, b, i, limits[b, i], out[b, i]).against == ""
