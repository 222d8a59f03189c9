"""The ragged level's draws probe what issue 53 lists, on seeds 0-2 and at the quick level: engine-like mixes (decode
rows, chunks, whole prompts, empty sequences between others), every page size, head_dim and group, keys and page
indices past 16 bits, garbage everywhere a kernel must not look. Draws only: no candidate runs here."""

import numpy as np
import pytest

from tpu_kernel_records_tools.grading.paged.slots import INDEX_LIMIT
from tpu_kernel_records_tools.grading.ragged.checks import across_a_page
from tpu_kernel_records_tools.grading.ragged.problems import draw
from tpu_kernel_records_tools.grading.ragged.slots import EDGE_SLOTS, draw_ragged_slots

SEEDS = (0, 1, 2)


def kinds(slot) -> set[str]:
    return {"empty" if q == 0 else "decode" if q == 1 else "prompt" if q == k else "chunk"
            for q, k in zip(slot.q_lens, slot.kv_lens)}


@pytest.mark.parametrize("level", ["full", "quick"])
@pytest.mark.parametrize("seed", SEEDS)
def test_every_slot_mixes_what_an_engines_step_holds(seed, level):
    s = draw_ragged_slots(seed, level)
    for name in EDGE_SLOTS:
        x = s[name]
        assert kinds(x) == {"empty", "decode", "prompt", "chunk"}, (name, x.q_lens, x.kv_lens)
        assert x.q_lens[-1] != 0 or 0 in x.q_lens[:-1]  # an empty sequence between others
        ps, full = x.page_size, x.page_size * x.pages_per_sequence
        assert {1, ps - 1, ps, full} <= set(x.kv_lens), name
        assert all(0 <= q <= k <= full for q, k in zip(x.q_lens, x.kv_lens))
        assert x.num_seqs < x.max_seqs and sum(x.q_lens) < x.num_tokens  # garbage rows and sequences after them


@pytest.mark.parametrize("level", ["full", "quick"])
def test_a_step_of_one_sequence_is_drawn_as_a_decode_row_a_chunk_or_a_prompt(level):
    """The contract's batches run from 1 sequence: the solo slot holds one, of each kind over the seeds, with
    garbage sequences and padding rows after it."""
    seen = set()
    for seed in range(12):
        x = draw_ragged_slots(seed, level)["solo"]
        assert x.num_seqs == 1 and x.max_seqs > 1 and sum(x.q_lens) < x.num_tokens
        assert 1 <= x.q_lens[0] <= x.kv_lens[0] <= x.page_size * x.pages_per_sequence
        seen |= kinds(x)
    assert seen == {"decode", "prompt", "chunk"}


@pytest.mark.parametrize("seed", SEEDS)
def test_the_full_level_covers_every_page_size_head_dim_and_group(seed):
    s = draw_ragged_slots(seed, "full")
    sizes = {x.page_size for x in s.values()}
    assert {16, 32, 64, 128, 256} <= sizes and any(n & (n - 1) for n in sizes)
    assert {64, 128, 256} <= {x.head_dim for x in s.values()}
    groups = {x.group for x in s.values()}
    assert {1, 2, 4, 8} <= groups and groups - {1, 2, 4, 8}
    assert max(x.num_seqs for x in s.values()) >= 24 and max(x.num_seqs for x in s.values()) <= 64
    assert {x.dtype for x in s.values()} == {"float32", "bfloat16"}
    long = s["long"]
    assert long.kv_lens[0] > 32_768 and long.kv_lens[1] > 65_536 and long.num_pages > INDEX_LIMIT + 4096


@pytest.mark.parametrize("seed", SEEDS)
def test_quick_shapes_are_the_same_on_every_seed(seed):
    def shapes(s):
        return {n: (x.num_tokens, x.max_seqs, x.num_pages, x.pages_per_sequence, x.page_size, x.head_dim)
                for n, x in s.items()}
    assert shapes(draw_ragged_slots(seed, "quick")) == shapes(draw_ragged_slots(99, "quick"))


def test_a_drawn_call_hides_garbage_everywhere_a_kernel_must_not_look():
    x = draw_ragged_slots(0, "quick")["odd"]
    rng = np.random.default_rng(0)
    p = draw(rng, x)
    n = x.num_seqs
    assert np.isnan(p.q[~p.graded].astype(np.float32)).all() and np.isfinite(p.q[p.graded].astype(np.float32)).all()
    assert np.isnan(p.k_pages[~p.holds].astype(np.float32)).all()
    assert p.graded.sum() == sum(x.q_lens) and list(p.cu[:n + 1]) == [0, *np.cumsum(x.q_lens)]
    again = p.regarbaged(rng)
    assert (again.cu[:n + 1] == p.cu[:n + 1]).all() and (again.lengths[:n] == p.lengths[:n]).all()
    assert (again.table[:n] == p.table[:n]).all() and (again.table[n:] != p.table[n:]).any()
    assert again.cu[n + 1:].max() <= x.num_tokens and (again.graded == p.graded).all()
    fp8 = draw(rng, x, quantized="float8_e4m3fn")
    stored = fp8.k_pages[fp8.holds].astype(np.float32)
    assert fp8.k_pages.dtype.name == "float8_e4m3fn" and np.abs(stored).max() == 448 and fp8.k_scale < 0.01
    int8 = draw(rng, x, quantized="int8", value_scales=(1.0, 300.0))
    assert np.abs(int8.k_pages[int8.holds]).max() == 127 and int8.v_scale > 100 * int8.k_scale


@pytest.mark.parametrize("seed", SEEDS)
def test_a_window_across_a_page_starts_rows_on_both_sides_of_a_boundary(seed):
    for name in EDGE_SLOTS:
        x = draw_ragged_slots(seed, "quick")[name]
        left, _ = across_a_page(x)
        i = max((i for i in range(x.num_seqs) if 2 <= x.q_lens[i] < x.kv_lens[i]),
                key=lambda i: x.kv_lens[i] - x.q_lens[i])
        starts = [x.kv_lens[i] - x.q_lens[i] + j - left for j in range(x.q_lens[i])]
        assert starts[0] % x.page_size == x.page_size - 1 and starts[0] > 0, (x.name, starts)  # a page's last key
