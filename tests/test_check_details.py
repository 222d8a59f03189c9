"""Details of ``grading.dense.checks`` that a count of passes cannot see: where the large-logits check puts its
needles, and how the mask-readout check explains a leak under bottom-right causal masking (a row ahead
of every key sees none; the others may see keys up to ``i + kv_len - q_len``)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tpu_kernel_records_tools.grading.dense import checks as C
from tpu_kernel_records_tools.grading.candidates import BUILTIN
from tpu_kernel_records_tools.grading.dense.context import _why_hidden
from tpu_kernel_records_tools.grading.dense.problems import Dims, draw_shapes, normal
from tests.grading_inprocess import InProcessRunner


def _spots(label: str) -> list[int]:
    return [int(x) for x in re.search(r"needles b0:\[([\d, ]+)\]", label).group(1).split(",")]


def test_needles_sit_past_the_first_512_keys_from_key_512_on():
    """kv_len 641 leaves room past a split-KV kernel's first 512-key chunk: the needles start there, and
    the chunk's first key, 512, is one of the places they may sit."""
    p = normal(np.random.default_rng(0), Dims(1, 1, 641, 2, 1, 64), "float32")
    seen = [j for t in range(300) for j in _spots(C._needles(p, np.random.default_rng(t)).label)]
    assert min(seen) == 512 and max(seen) == 640


def test_needles_are_keys_that_every_causal_row_sees():
    """Causal, 16 queries on 700 keys: row 0 sees keys 0..684, so no needle lies past 684 (and some lie
    close to it: the draw covers the whole visible range)."""
    p = normal(np.random.default_rng(1), Dims(1, 16, 700, 2, 1, 64), "float32", causal=True)
    seen = [j for t in range(60) for j in _spots(C._needles(p, np.random.default_rng(t)).label)]
    assert max(seen) <= p.offset and max(seen) > p.offset - 30 and min(seen) >= 512


def _seed_with_readout_offset(sign: int) -> int:
    return next(s for s in range(100) if np.sign((d := draw_shapes(s)["readout"]).kv_len - d.q_len) == sign)


@pytest.mark.parametrize("sign", [1, -1], ids=["keys-ahead", "queries-ahead"])
def test_a_causal_leak_is_explained_by_the_row_it_happens_in(sign):
    """ignores-causal leaks into row 0's future first. With more keys than queries row 0 may see keys up
    to the offset; with more queries than keys it sees none, and the detail must say so (not quote a
    negative last key)."""
    seed = _seed_with_readout_offset(sign)
    dims = draw_shapes(seed)["readout"]
    offset = dims.kv_len - dims.q_len
    runner = InProcessRunner(BUILTIN["ignores-causal"].load())
    check = next(spec for spec in C.CHECKS if spec.name == "mask-readout")
    outcome = check.run(C.Context(runner, seed, level="full"))
    assert not outcome.passed
    first = re.search(r"query \(b=\d+, i=(\d+), h=\d+\) gave probability [^ ]+ to key (\d+), which is ([^;]*)",
                      outcome.detail)
    i, j, why = int(first.group(1)), int(first.group(2)), first.group(3)
    if i + offset >= 0:
        assert f"bottom-right causal allows j <= {i + offset})" in why and j > i + offset
    else:
        assert "under bottom-right causal this row sees no key" in why and "allows j <=" not in why
    assert sign < 0 or "sees no key" not in why
    assert sign > 0 or i + offset < 0  # the first leak lies in a row that sees nothing


@pytest.mark.parametrize("level", ["quick", "full"])
def test_a_problem_asked_for_an_empty_sequence_has_one(level):
    """``zero_batch`` gives that sequence length 0 in a slot drawn with kv_lengths (empty-rows' batch probe)."""
    ctx = C.Context(InProcessRunner(lambda *a, **k: None), 0, level=level)
    p = ctx.problem(np.random.default_rng(0), "batch", zero_batch=1)
    assert p.lengths is not None and p.lengths[1] == 0 and p.lengths.max() > 0


def test_first_difference_of_arrays_of_other_shapes_or_dtypes_is_the_empty_index():
    a = np.arange(6, dtype=np.float32)
    assert C._first_difference(a, a.copy()) is None
    assert C._first_difference(a, a[:4]) == () and C._first_difference(a[:4], a) == ()
    assert C._first_difference(a, a.astype(np.float64)) == ()
    b = a.copy()
    b[3] = -1
    assert C._first_difference(a, b) == (3,)


def test_a_key_outside_a_window_is_explained_with_the_windows_keys():
    """Row 5 of 8 over 10 keys sits at position 7 (bottom-right): window (2, 1) lets it see keys 5..8, and
    the reason names those bounds; an open side (None) is left blank."""
    p = normal(np.random.default_rng(0), Dims(1, 8, 10, 1, 1, 16), "float32")
    windowed = C.Problem("w", "float32", p.host("q"), p.host("k"), p.host("v"), window=(2, 1))
    assert _why_hidden(windowed, 0, 5, 4) == [
        "outside its window_size=(2, 1) (keys 5..8 around its position 7)"]
    assert _why_hidden(windowed, 0, 5, 9) == _why_hidden(windowed, 0, 5, 4)
    assert _why_hidden(windowed, 0, 5, 5) == [] and _why_hidden(windowed, 0, 5, 8) == []
    left_open = C.Problem("w", "float32", p.host("q"), p.host("k"), p.host("v"), window=(None, 0))
    assert _why_hidden(left_open, 0, 5, 8) == ["outside its window_size=(None, 0) (keys ..7 around its position 7)"]


def test_a_misread_kv_head_is_explained_with_the_head_and_output_it_should_have_read():
    """gqa-mapping's V = kv head + 1: the detail names the query head, what it read, and the kv head and output
    that ``h // group`` gives."""
    p = normal(np.random.default_rng(1), Dims(1, 4, 8, 4, 2, 16), "float32")
    out = np.ones((1, 4, 4, 16), np.float32) * np.array([1, 1, 2, 2], np.float32)[None, None, :, None]
    assert C._misread_head(p, out) is None  # heads 0, 1 read kv head 0 (output 1); heads 2, 3 kv head 1 (output 2)
    out[:, :, 3] = 1.0  # head 3 reads kv head 0
    assert C._misread_head(p, out).endswith(
        ": q head 3 read kv head 0 (output ~ 1), expected kv head 1 = 3 // 2 (output 2)")
    out[:, :, 3] = 7.0
    assert "q head 3 matches no kv head (output ~ 7), expected kv head 1" in C._misread_head(p, out)
