"""The ragged-long check's pool past 2^31 elements (``grading.ragged.big_pool``) and the sparse transport that lets
it reach a worker without gigabytes of zeros in memory (``sandbox.worker``, ``grading.serve``)."""

import os
import threading
from pathlib import Path

import numpy as np
import pytest

from tpu_kernel_records_tools.grading.ragged import big_pool
from tpu_kernel_records_tools.grading.ragged.checks import _judge
from tpu_kernel_records_tools.grading.serve import AttentionServer
from tpu_kernel_records_tools.sandbox.worker import ALIGNMENT, HOLE_CHUNK, _receive, encode

GIB = 1 << 30


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


def _through_a_pipe(arrays):
    """``arrays`` encoded by the grader's side and received by the worker's; and the bytes that crossed."""
    chunks = encode({"op": "x"}, arrays)
    r, w = os.pipe()

    def write():
        with os.fdopen(w, "wb") as f:
            for c in chunks:
                f.write(c)
    writer = threading.Thread(target=write)
    writer.start()
    try:
        header, got = _receive(r)
    finally:
        writer.join()
        os.close(r)
    return header, got, sum(memoryview(c).nbytes for c in chunks)


def test_zero_chunks_cross_as_holes_and_stay_out_of_memory():
    pool = np.zeros((512 << 20) // 2, np.uint16)  # 512 MiB of zeros: calloc'd, not resident
    pool[3 * HOLE_CHUNK // 2 + 5] = 7  # one non-zero chunk at a time, at both ends and inside
    pool[-1] = 9
    small = np.arange(6, dtype=np.float32).reshape(2, 3)
    before = _rss()
    header, (got, got_small), sent = _through_a_pipe([pool, small])
    assert _rss() - before < 64 << 20  # the worker's buffer took the data chunks only
    assert header["arrays"][0]["data"] == [[3 * HOLE_CHUNK, 4 * HOLE_CHUNK], [pool.nbytes - HOLE_CHUNK, pool.nbytes]]
    assert "data" not in header["arrays"][1] and sent < 3 * HOLE_CHUNK
    assert got.ctypes.data % ALIGNMENT == 0 and got.flags.writeable
    assert np.array_equal(got, pool) and np.array_equal(got_small, small) and got.dtype == pool.dtype


def test_the_inputs_check_sees_writes_into_holes_and_data():
    server = AttentionServer.__new__(AttentionServer)
    server.np, server.array_equal = np, np.array_equal
    server.asarray, server.ascontiguous = np.asarray, np.ascontiguousarray
    pool = np.zeros(96 << 20, np.uint8)
    pool[HOLE_CHUNK + 1] = 1
    (before,) = server._copies([pool])
    assert isinstance(before, tuple) and len(before[1]) == 1  # one chunk copied, the zeros only noted
    assert server._unchanged(before, server._bytes(pool))
    for where in (5, HOLE_CHUNK + 1, pool.size - 1):  # a hole, the data chunk, the last hole
        changed = pool.copy()
        changed[where] ^= 3
        assert not server._unchanged(before, server._bytes(changed)), where


class _Runner:
    holes, memory_limit_gb, memory_limit = True, 16.0, "cgroup"


def test_the_gate_says_why_it_does_not_probe():
    need = big_pool.need_bytes(True)
    assert need == 2 * big_pool.PAGES * 16 * 128 + GIB and big_pool.need_bytes(False) == 4 * (need - GIB) + GIB
    assert big_pool.unprobed(_Runner(), True, available_bytes=need) is None
    assert big_pool.unprobed(_Runner(), True, available_bytes=need - 1) == (
        f"not probed: needs {need / GIB:.1f} GiB, {(need - 1) / GIB:.1f} available")
    assert big_pool.unprobed(_Runner(), False, available_bytes=64 * GIB) == (
        "not probed: the worker needs 17.0 GiB, its memory limit is 16 GiB")
    spaced = type("Spaced", (_Runner,), {"memory_limit": "address-space", "memory_limit_gb": 10.0})()
    assert big_pool.unprobed(spaced, True, available_bytes=64 * GIB).startswith("not probed: the worker needs 13.0")
    copying = type("InProcess", (), {})()
    assert big_pool.unprobed(copying, True, available_bytes=64 * GIB).startswith("not probed: its caller would copy")


def test_the_big_pool_holds_the_small_calls_keys_past_2_31_elements():
    p = big_pool.big_problem(lambda n: np.random.default_rng([5, n]), quantized=True)
    elements = int(np.prod(p.k_pages.shape))
    assert elements > 2 ** 31 and p.k_pages.dtype == np.int8 and p.k_scale is not None
    n = int(p.num_seqs[0])
    used = np.unique(p.table[:n][p.table[:n] >= 0])
    assert int(used.min()) * 16 * 128 >= 2 ** 31  # every page a graded key reads is past 2^31 elements
    assert (p.k_pages[0] != 0).all()  # where a wrapped offset lands: garbage
    assert _judge(p, p.baseline[0]).ok  # judged by the small call's truth and baseline


@pytest.mark.slow  # two workers, one big call each: about 8 CPU-s and 20 s (under load); 0.35 GiB each resident
@pytest.mark.parametrize("candidate, ok", [("ragged-reference", True),
                                           (f"{Path(__file__).parent / 'ragged_int32_offsets.py'}:"
                                            "ragged_paged_attention", False)])
def test_int32_offsets_are_rejected_past_2_31_elements(candidate, ok):
    from tpu_kernel_records_tools.grading.runner import Runner
    runner = Runner(candidate, level="full")
    try:
        assert runner.start() is None
        why = big_pool.unprobed(runner, True)
        if why:
            pytest.skip(why)
        p = big_pool.big_problem(lambda n: np.random.default_rng([0, n]), quantized=True)
        verdict = _judge(p, runner.ragged_forward(p))
        assert verdict.ok == ok, verdict.describe()
    finally:
        runner.close()
