"""A submitted ragged kernel (``measure --candidate FILE.py:fn --name NAME --ragged``): the rubric's calls recorded
with the kernel's declared features only, the timed calls' outputs judged row by row (a quantized pool dequantized
by the contract's rule), graded on the ragged rubric in its sandbox, timed at the cpu profile's ``ragged`` cases
and shown in the ragged leaderboard table; a wrong one graded failing and given no timed row."""
import dataclasses
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest

from doc_blocks import REPO, SHELL, blocks, shell_commands
from kernel_src.contract import RAGGED_FEATURES
from kernel_src.reference import reference_paged_attention, reference_ragged_paged_attention
from tpu_kernel_records_tools.builder import leaderboard, rules
from tpu_kernel_records_tools.grading import contracts
from tpu_kernel_records_tools.grading.check_context import CheckSpec
from tpu_kernel_records_tools.grading.export import ProgramRefused
from tpu_kernel_records_tools.grading.paged.signature import PagedSignature
from tpu_kernel_records_tools.grading.ragged import big_pool
from tpu_kernel_records_tools.grading.ragged import checks as ragged_checks
from tpu_kernel_records_tools.grading.ragged.signature import RaggedSignature
from tpu_kernel_records_tools.measure import submission, timed_checks
from tpu_kernel_records_tools.measure.run import run_submitted
from tpu_kernel_records_tools.records import rawio
from tpu_kernel_records_tools.sandbox import isolation

HERE = Path(__file__).parent / "submitted"
needs_bwrap = pytest.mark.skipif(isolation.unavailable_reason() is not None, reason="bubblewrap cannot run here")
Q_LENS, KV_LENS = (1, 0, 5, 7, 1), (9, 4, 21, 7, 30)  # a decode row, an empty sequence, a chunk, a prompt, a decode
PAGE, HEADS, KV_HEADS, DIM, PADDING = 4, 4, 2, 16, 3


def ragged_step(dtype="float32", pool_dtype=None, seed=0):
    """Host inputs of one ragged call (q, pools, kv_lengths, page_indices, cu_q_lens, num_seqs[, scales]) over
    ``Q_LENS`` and ``KV_LENS`` in a shuffled pool, ``PADDING`` NaN rows after the graded ones and a garbage
    sequence after ``num_seqs``; and its signature."""
    rng = np.random.default_rng(seed)
    pages = [-(-n // PAGE) for n in KV_LENS] + [2]
    order = rng.permutation(sum(pages) + 2)  # two pool pages no sequence owns
    table = np.zeros((len(pages), max(pages)), np.int32)
    starts = np.cumsum([0, *pages])
    for i, n in enumerate(pages):
        table[i, :n] = order[starts[i]:starts[i + 1]]
    lengths = np.array([*KV_LENS, 5], np.int32)
    cu = np.array([0, *np.cumsum(Q_LENS), 2], np.int32)
    q = rng.standard_normal((int(cu[-2]) + PADDING, HEADS, DIM), dtype=np.float32)
    q[int(cu[-2]):] = np.nan
    pool = (len(order), PAGE, KV_HEADS, DIM)
    k, v = (rng.standard_normal(pool, dtype=np.float32) * 2 for _ in range(2))
    host = [q.astype(dtype), *(x.astype(pool_dtype or dtype) for x in (k, v)), lengths, table, cu,
            np.array([len(Q_LENS)], np.int32)]
    host += [np.float32(0.5), np.float32(0.25)] if pool_dtype else []
    sig = RaggedSignature.of_call(*host[:3], kv_lengths=lengths, page_indices=table, cu_q_lens=cu,
                                  num_seqs=host[6], k_scale=host[7] if pool_dtype else None,
                                  v_scale=host[8] if pool_dtype else None)
    return sig, host


def reference(sig, host, **kwargs):
    q, k, v, lengths, table, cu, num_seqs, *scales = host
    return np.asarray(reference_ragged_paged_attention(
        q, k, v, kv_lengths=lengths, page_indices=table, cu_q_lens=cu, num_seqs=num_seqs, causal=sig.causal,
        **dict(zip(("k_scale", "v_scale"), scales)), **kwargs))


def judge(sig, host, out, seed=0):
    return timed_checks.check_ragged_output(sig, host, out, rng=np.random.default_rng(seed))


@pytest.mark.parametrize("dtype, pool_dtype", [("float32", None), ("bfloat16", None), ("bfloat16", "float8_e4m3fn"),
                                               ("float32", "int8")])
def test_the_references_ragged_output_passes_and_a_row_of_the_wrong_sequence_fails(dtype, pool_dtype):
    sig, host = ragged_step(dtype, pool_dtype)
    out = reference(sig, host)
    ok, detail = judge(sig, host, out)
    assert ok, detail
    assert "14 rows" in detail  # every graded row (1 + 0 + 5 + 7 + 1), none of the padding's
    wrong = out.copy()
    wrong[6:13] = out[1:8]  # the prompt's rows answered with the chunk's (and the prompt's own first two)
    ok, detail = judge(sig, host, wrong)
    assert not ok, detail


def test_a_quantized_pool_is_judged_dequantized_by_its_scales():
    sig, host = ragged_step("float32", "float8_e4m3fn")
    unscaled = host[:7] + [np.float32(1.0), np.float32(1.0)]
    ok, detail = judge(sig, host, reference(sig, unscaled))  # the kernel that ignores k_scale and v_scale
    assert not ok, detail


def test_a_window_hides_the_keys_before_it():
    sig, host = ragged_step()
    windowed = dataclasses.replace(sig, window=(3, 0))
    ok, detail = judge(windowed, host, reference(sig, host, window_size=(3, 0)))
    assert ok, detail
    ok, detail = judge(windowed, host, reference(sig, host))  # every key seen
    assert not ok, detail


def test_softcap_and_sinks_are_refused_in_one_line():
    sig, host = ragged_step()
    with pytest.raises(ValueError, match="no softcap or sinks"):
        judge(dataclasses.replace(sig, softcap=30.0), host, reference(sig, host))


def test_the_paged_check_still_judges_each_rows_visible_keys():
    rng = np.random.default_rng(1)
    lengths, table = np.array([9, 16], np.int32), np.array([[3, 0, 5, 1], [2, 6, 4, 7]], np.int32)
    q = rng.standard_normal((2, 2, HEADS, DIM), dtype=np.float32)
    k, v = (rng.standard_normal((8, PAGE, KV_HEADS, DIM), dtype=np.float32) for _ in range(2))
    host = [q, k, v, lengths, table]
    sig = PagedSignature.of_call(q, k, v, kv_lengths=lengths, page_indices=table, causal=True)
    out = np.asarray(reference_paged_attention(q, k, v, kv_lengths=lengths, page_indices=table))
    ok, detail = timed_checks.check_paged_output(sig, host, out, rng=np.random.default_rng(0))
    assert ok, detail
    ok, detail = timed_checks.check_paged_output(sig, host, out[::-1], rng=np.random.default_rng(0))
    assert not ok, detail


def test_the_rubrics_calls_are_recorded_with_the_declared_features_only(monkeypatch):
    sig, host = ragged_step()
    q, k, v, lengths, table, cu, num_seqs = host
    base = dict(kv_lengths=lengths, page_indices=table, cu_q_lens=cu, num_seqs=num_seqs)
    quantized = [x.astype("int8") for x in (k, v)]
    calls = [SimpleNamespace(q=q, k_pages=k, v_pages=v, window=None, softcap=None, sinks=None, k_scale=None,
                             kwargs=base),  # the base contract
             SimpleNamespace(q=q, k_pages=k, v_pages=v, window=(3, 0), softcap=None, sinks=None, k_scale=None,
                             kwargs={**base, "window_size": (3, 0)}),
             SimpleNamespace(q=q, k_pages=quantized[0], v_pages=quantized[1], window=None, softcap=None, sinks=None,
                             k_scale=0.5, kwargs={**base, "k_scale": 0.5, "v_scale": 0.25})]
    check = CheckSpec("ragged-stand-in", 1, lambda ctx: [ctx.runner.ragged_forward(p)
                                                         for p in ragged_checks.callable_with(ctx, calls)], "")
    stand_in = dataclasses.replace(contracts.RAGGED, checks_for=lambda features: (check,))
    monkeypatch.setattr(submission.contracts, "get", lambda name: stand_in)
    monkeypatch.setattr(contracts.Contract, "reference", lambda self: lambda q, *a, **kw: np.zeros(q.shape, q.dtype))
    signatures = submission.grading_signatures(0, "quick", ("quantized_kv",), "ragged")
    assert signatures == [sig, dataclasses.replace(sig, pool_dtype="int8")]  # no call with a window


def test_a_pool_past_2_31_elements_is_recorded_without_running_the_reference():
    recorder = submission._Recorder(contracts.RAGGED, ("quantized_kv",))
    recorder.fn = None  # not called
    assert big_pool.unprobed(recorder, True, available_bytes=2 ** 50) is None  # asked for, as the grader's runner
    pool = np.broadcast_to(np.int8(0), (2 ** 21, 16, 4, 16))  # 2^31 elements, none allocated
    lengths, table, cu = np.array([16], np.int32), np.array([[2 ** 21 - 1]], np.int32), np.array([0, 1], np.int32)
    problem = SimpleNamespace(q=np.ones((2, 4, 16), np.float32), k_pages=pool, v_pages=pool, kwargs=dict(
        kv_lengths=lengths, page_indices=table, cu_q_lens=cu, num_seqs=np.array([1], np.int32), k_scale=1.0,
        v_scale=1.0))
    out = recorder.ragged_forward(problem)
    assert out.shape == (2, 4, 16) and not out.any()
    assert recorder.signatures == [RaggedSignature((2, 4, 16), pool.shape, (1, 1), "float32", True, None,
                                                   pool_dtype="int8")]


def test_the_leaderboard_gives_ragged_kernels_their_own_table_and_baselines():
    def timed(record, scope, kv_dtype=None):
        return dict(record_id=record, source="submitted", implementation="submitted", interpret=True, device_kind="cpu",
                    scope=scope, seq_len=64, batch=4, num_q_heads=4, num_kv_heads=2, head_dim=128, dtype="bfloat16",
                    median_ms=1.0, samples_ms=[1.0] * 5, page_size=16, kv_dtype=kv_dtype,
                    pairs=[dict(baseline_case_id=f"{scope}-{scope}-{b}-m", ratio=r, ci_low=None, ci_high=None)
                           for b, r in (("xla", 2.0), ("pallas", 3.0))])

    def verdict(record, contract):
        return dict(record_id=record, candidate=record, candidate_passed=True, source="submitted", measured=True,
                    row_kind="check", features=["quantized_kv"] if contract == "ragged" else [], contract=contract)
    bench = pa.Table.from_pylist([timed("r1", "ragged", kv_dtype="float8_e4m3fn"), timed("p1", "paged")])
    checks = pa.Table.from_pylist([verdict("r1", "ragged"), verdict("p1", "paged")])
    paged, ragged = leaderboard.leaderboard(bench, checks).strip().split("\n\n")[1::2]
    assert "vs paged-xla" in paged and "| 2.00x | 3.00x |" in paged
    assert "(batch, seq, q/kv heads, head_dim, dtype, page size, cache)" in ragged
    assert "| vs ragged-xla [95% CI] | vs ragged-pallas [95% CI] |" in ragged
    assert "| 4, 64, 4/2, 128, bfloat16, 16, float8\\_e4m3fn | `r1` | ragged: base + quantized\\_kv |" in ragged
    assert "| 2.00x | 3.00x |" in ragged


def measure(tmp: Path, file: str, name: str, function: str = "ragged_paged_attention", ragged: bool = True,
            candidate_dir: Path = HERE) -> Path:
    return run_submitted(f"{candidate_dir / file}:{function}", name, tmp / name, profile="cpu", level="quick",
                         warmups=0, samples=3, progress=False, candidate_dir=candidate_dir,
                         contract="ragged" if ragged else "attention")


def accept(run_dir: Path):
    return rules.accept(rawio.read_run(run_dir), allow_interpret=True, read_file=rules.run_files(run_dir))


@pytest.mark.slow  # with the next test about 115 CPU-s: the example's export, its quick grade (every feature), 2 steps
@needs_bwrap
def test_the_documented_ragged_submission_becomes_a_ragged_leaderboard_row(tmp_path, monkeypatch, capsys):
    from tpu_kernel_records_tools.builder.build import build
    from tpu_kernel_records_tools.cli.main import main
    import pyarrow.parquet as pq

    [documented] = [argv for b in blocks(SHELL) for argv in shell_commands(b)
                    if argv[:2] == ["tpu-kernel-records", "measure"] and "--ragged" in argv]
    run_dir = tmp_path / "my-ragged"
    monkeypatch.chdir(REPO)
    assert main([*documented[1:-1], str(run_dir)]) == 0 and documented[-2] == "--out"
    acc = accept(run_dir)
    card = acc.run["correctness"]["scorecards"][0]
    assert card["passed"] and card["contract"] == "ragged" and card["features"] == list(RAGGED_FEATURES)
    assert {c["name"] for c in card["checks"]} >= {"ragged-accuracy", "ragged-quantized_kv", "timed-shapes"}
    assert acc.run["correctness"]["submission"]["contract"] == "ragged"
    timed = [c for c in acc.run["benchmark"]["cases"] if c["implementation"] == "submitted"]
    assert {c["scope"] for c in timed} == {"ragged"} and {c["kv_dtype"] for c in timed} == {"bfloat16", "float8_e4m3fn"}
    assert all(c["output_checks"] and all(x["passed"] for x in c["output_checks"]) for c in timed)
    data, card_path = tmp_path / "data", tmp_path / "card.md"
    shutil.copy(REPO / "dataset_card.md", card_path)
    build([run_dir], data_dir=data, card_path=card_path, allow_interpret=True)
    rows = [r for r in pq.read_table(data / "benchmark").to_pylist() if r["implementation"] == "submitted"]
    assert len(rows) == 2 and all(r["scope"] == "ragged" and r["interpret"] for r in rows)
    text = card_path.read_text()
    assert "`my-ragged`" in text and "ragged: base + window + softcap + sinks + quantized\\_kv" in text
    assert "the ragged contract (`ragged_paged_attention`" in text and "vs ragged-pallas" in text


@pytest.mark.slow  # its export in bubblewrap, its quick grade on the base contract, one step
@needs_bwrap
def test_a_ragged_kernel_leaking_a_padding_row_is_graded_failing_and_gets_no_row(tmp_path):
    from tpu_kernel_records_tools.builder.build import BuildError, build

    kernel = tmp_path / "kernel"
    kernel.mkdir()
    shutil.copy(REPO / "examples" / "ragged_kernel.py", kernel)
    shutil.copy(HERE / "ragged_padding_leak.py", kernel)
    run_dir = measure(tmp_path, "ragged_padding_leak.py", "ragged-padding-leak", candidate_dir=kernel)
    run = rawio.read_run(run_dir)
    card = run["correctness"]["scorecards"][0]
    assert not card["passed"] and not next(c for c in card["checks"] if c["name"] == "ragged-garbage")["passed"]
    timed = [c for c in run["benchmark"]["cases"] if c["implementation"] == "submitted"]
    assert [c["kv_dtype"] for c in timed] == ["bfloat16"]  # no quantized_kv declared: no float8 step
    with pytest.raises(rawio.RunError, match=r"\[correctness\]") as refused:
        accept(run_dir)
    assert "\n" not in str(refused.value)
    with pytest.raises(BuildError):
        build([run_dir], data_dir=tmp_path / "data", card_path=tmp_path / "card.md", allow_interpret=True)
    assert not (tmp_path / "data" / "benchmark").exists()


@pytest.mark.slow  # about 6 s: the ragged cases built, the exporter's worker started in bubblewrap
@needs_bwrap
def test_a_dense_kernel_given_ragged_is_refused_in_one_line(tmp_path):
    with pytest.raises(ProgramRefused, match="takes no cu_q_lens") as refused:
        measure(tmp_path, "pure_jax.py", "other-contract", "attention")
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("contract", ["paged", "ragged"])
def test_the_builders_timed_call_is_the_one_measure_exports_at_each_profiles_own_cases(contract):
    from tpu_kernel_records_tools.bench.cases import PROFILES
    from tpu_kernel_records_tools.builder.submitted import timed_signature

    checked = set()
    for profile in PROFILES.values():
        for platform in ("cpu", "tpu", "gpu"):
            for case in submission.templates_for(profile, submission.bench_scopes(profile, contract), 0, platform):
                exported = submission.case_signature(case).to_dict()
                assert timed_signature(submission._template_record(case)) == exported, case.case_id
                checked |= {(case.implementation, exported.get("pool_dtype"))}
    if contract == "ragged":  # the XLA reference's steps and, where it does not fit, the kernel's; both caches
        assert checked >= {("ragged-xla", None), ("ragged-xla", "float8_e4m3fn"), ("ragged-pallas", None),
                           ("ragged-triton", "float8_e4m3fn")}
