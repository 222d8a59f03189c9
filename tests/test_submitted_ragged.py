"""A submitted ragged kernel (``measure --candidate FILE.py:fn --name NAME --ragged``): the rubric's calls recorded
with the kernel's declared features only, the timed calls' outputs judged row by row (a quantized pool dequantized
by the contract's rule), graded on the ragged rubric in its sandbox, timed at the cpu profile's ``ragged`` cases
and shown in the ragged leaderboard table; a wrong one graded failing and given no timed row."""
import dataclasses

import numpy as np
import pytest

from kernel_src.reference import reference_paged_attention, reference_ragged_paged_attention
from tpu_kernel_records_tools.grading.paged.signature import PagedSignature
from tpu_kernel_records_tools.grading.ragged.signature import RaggedSignature
from tpu_kernel_records_tools.measure import timed_checks

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
