"""``tpu-kernel-rubric --ragged``: a ragged candidate file graded through the sandboxed worker (fp8 pools and 0-d
scales through its transport), the scorecard naming ``contract: ragged``, usage errors one line each; the ragged
call's export signature."""

import json
import os
import threading

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tpu_kernel_records_tools.cli import rubric as cli
from tpu_kernel_records_tools.grading import contracts
from tpu_kernel_records_tools.grading.ragged.checks import RAGGED_CHECKS
from tpu_kernel_records_tools.grading.ragged.problems import draw
from tpu_kernel_records_tools.grading.ragged.signature import RaggedSignature
from tpu_kernel_records_tools.grading.ragged.slots import draw_ragged_slots
from tpu_kernel_records_tools.sandbox.worker import _receive, encode

CANDIDATE = '''
import jax

from kernel_src.contract import supports
from kernel_src.reference import reference_ragged_paged_attention

_jitted = jax.jit(reference_ragged_paged_attention, static_argnames=("causal", "scale", "window_size", "softcap"))


@supports("window", "softcap", "sinks", "quantized_kv")
def ragged_paged_attention(q, k_pages, v_pages, **kw):
    return _jitted(q, k_pages, v_pages, **kw)
'''


def test_a_feature_that_does_not_apply_is_a_usage_error(capsys):
    assert cli.main(["--ragged", "--candidate", "ragged-reference", "--features", "segments"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert "ragged_paged_attention's features are window, softcap, sinks, quantized_kv" in err and "\n" not in err


def test_a_ragged_file_that_cannot_load_gets_a_ragged_scorecard(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("raise ImportError('no kernel here')\n")
    out = tmp_path / "card.json"
    status = cli.main(["--ragged", "--candidate", f"{bad}:ragged_paged_attention", "--isolation", "process",
                       "--quiet", "--json", str(out)])
    assert status == cli.EXIT_FAILED
    card = json.loads(out.read_text())["scorecards"][0]
    assert card["contract"] == "ragged" and "no kernel here" in card["error"]
    assert [c["name"] for c in card["checks"]] == [c.name for c in RAGGED_CHECKS] + ["finite"]


@pytest.mark.slow  # a quick grade through bubblewrap's worker: about 14 CPU-s
def test_a_ragged_file_passes_the_quick_level_through_the_cli(tmp_path):
    (tmp_path / "mine.py").write_text(CANDIDATE)
    out = tmp_path / "card.json"
    assert cli.main(["--ragged", "--candidate", f"{tmp_path / 'mine.py'}:ragged_paged_attention", "--quick",
                     "--quiet", "--json", str(out)]) == 0
    card = json.loads(out.read_text())["scorecards"][0]
    assert card["passed"] and card["contract"] == "ragged"
    assert card["features"] == ["window", "softcap", "sinks", "quantized_kv"]
    assert {c["name"] for c in card["checks"]} >= {"ragged-garbage", "ragged-long", "ragged-quantized_kv"}


def test_fp8_pools_and_0d_scales_cross_the_workers_transport_as_they_are():
    arrays = [np.zeros((2, 3), ml_dtypes.float8_e4m3fn) + ml_dtypes.float8_e4m3fn(448), np.float32(0.25).reshape(())]
    read, write = os.pipe()
    threading.Thread(target=lambda: [os.write(write, bytes(c)) for c in encode({"op": "x"}, arrays)]).start()
    header, back = _receive(read)
    os.close(read), os.close(write)
    assert [(b.dtype, b.shape) for b in back] == [(a.dtype, a.shape) for a in arrays]
    assert float(back[0][1, 2]) == 448.0 and float(back[1]) == 0.25


@pytest.mark.parametrize("quantized", [None, "int8"])
def test_a_ragged_signature_comes_back_as_itself(quantized):
    p = draw(np.random.default_rng(0), draw_ragged_slots(0, "quick")["chunk32"], window=(5, 0), quantized=quantized,
             sinks=np.zeros(2, np.float32), scale_arrays=True)
    sig = RaggedSignature.of_call(jnp.asarray(p.q), jnp.asarray(p.k_pages), jnp.asarray(p.v_pages), **p.kwargs)
    again = contracts.signature_from_dict(sig.to_dict())
    assert type(again) is RaggedSignature and again == sig and sig.pool_dtype == quantized
    args = sig.abstract_args()
    assert [a.shape for a in args[3:7]] == [(10,), (10, 2), (11,), (1,)]
    assert len(args) == 8 + 2 * (quantized is not None)
    assert RaggedSignature.mismatch({"q": 0, "page_indices": 0}) and RaggedSignature.mismatch({"cu_q_lens": 0}) is None


def test_the_worker_calls_a_ragged_file_and_counts_only_graded_rows_for_finite(tmp_path):
    """One call through the worker: a quantized pool with 0-d scales arrives as sent, and the NaN a kernel leaves in
    padding rows (the contract does not grade them) is not a non-finite output."""
    from tpu_kernel_records_tools.grading.runner import Runner

    (tmp_path / "mine.py").write_text(CANDIDATE.replace("return _jitted(q, k_pages, v_pages, **kw)",
                                                        "return _jitted(q, k_pages, v_pages, **kw) + 0 * q"))
    p = draw(np.random.default_rng(1), draw_ragged_slots(0, "quick")["chunk32"], quantized="int8", scale_arrays=True)
    runner = Runner(f"{tmp_path / 'mine.py'}:ragged_paged_attention", isolation="process", level="quick")
    try:
        assert runner.start() is None
        out = runner.ragged_forward(p)
    finally:
        runner.close()
    assert np.isnan(out[~p.graded]).all() and runner.nonfinite == [] and runner.returned == 1
    np.testing.assert_allclose(out[p.graded], p.baseline[0][p.graded], rtol=1e-6, atol=1e-6)


def test_export_records_a_ragged_call_as_its_signature():
    """``measure --candidate --ragged``'s first step: the rubric's calls on the reference, noted as signatures."""
    from tpu_kernel_records_tools.measure.submission import _Recorder

    recorder = _Recorder(contracts.RAGGED)
    p = draw(np.random.default_rng(2), draw_ragged_slots(0, "quick")["chunk32"], quantized="float8_e4m3fn",
             scale_arrays=True)
    out = recorder.ragged_forward(p)
    assert out.shape == p.q.shape and np.array_equal(out[p.graded], p.baseline[0][p.graded])
    (sig,) = recorder.signatures
    assert isinstance(sig, RaggedSignature) and sig.pool_dtype == "float8_e4m3fn" and sig.q == p.q.shape
