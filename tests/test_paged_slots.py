"""The paged level's draws probe what issue 36 lists, on seeds 0-2 (and the quick level), and the dense
contract's decoding slots reach 32k-131k keys. Draws only: no candidate runs here."""

import numpy as np
import pytest

from tpu_kernel_records_tools.grading.dense import slots
from tpu_kernel_records_tools.grading.paged.problems import draw, layout
from tpu_kernel_records_tools.grading.paged.slots import INDEX_LIMIT, draw_paged_slots

SEEDS = (0, 1, 2)
EDGE_SLOTS = ("vllm16", "spec32", "tpu128", "odd")


@pytest.mark.parametrize("seed", SEEDS)
def test_full_level_slots_cover_every_probe(seed):
    s = draw_paged_slots(seed, "full")
    sizes = {x.page_size for x in s.values()}
    assert {16, 32, 128} <= sizes and any(n & (n - 1) for n in sizes), sizes  # and one no power of two
    for name in EDGE_SLOTS:
        x = s[name]
        full = x.page_size * x.pages_per_sequence
        assert {0, 1, x.page_size - 1, x.page_size, x.page_size + 1, 2 * x.page_size, full} <= set(x.lengths), name
        assert len(set(x.lengths)) == x.batch  # distinct lengths, 0 and full among them
    batches = {x.batch for x in s.values()}
    assert 1 in batches and max(batches) >= 24 and max(batches) <= 64
    q_lens = {x.q_len for x in s.values()}
    assert 1 in q_lens and any(2 <= q <= 8 for q in q_lens) and max(q_lens) <= 8
    assert s["spec32"].q_len >= 2 and s["odd"].q_len >= 2 and s["vllm16"].q_len == 1
    groups = {x.group for x in s.values()}
    assert {1, 2, 4, 8} <= groups and groups - {1, 2, 4, 8}, groups  # and one group no power of two
    assert {x.dtype for x in s.values()} == {"float32", "bfloat16"}
    for x in s.values():
        assert x.num_pages >= 3 * x.pages_used, x  # several times larger than needed


@pytest.mark.parametrize("seed", SEEDS)
def test_the_long_slot_passes_every_16_bit_limit(seed):
    x = draw_paged_slots(seed, "full")["long"]
    assert x.dtype == "bfloat16" and x.q_len <= 8
    assert all(32_768 <= n <= 131_072 for n in x.lengths) and any(n % x.page_size == 0 for n in x.lengths)
    assert min(-(-n // x.page_size) for n in x.lengths) > 128  # pages per sequence
    table, holds = layout(np.random.default_rng(seed), x)
    for b, n in enumerate(x.lengths):
        used = table[b, :-(-n // x.page_size)]
        assert used.max() > INDEX_LIMIT  # every sequence reads a page past 2^15
    assert table.shape[1] > -(-max(x.lengths) // x.page_size)  # trailing entries past the longest


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("level", ["full", "quick"])
def test_pools_are_permuted_shared_and_nan_everywhere_else(seed, level):
    s = {n: x for n, x in draw_paged_slots(seed, level).items() if n != "long"}
    shared = page_zero = scattered = 0
    for n, x in s.items():
        p = draw(np.random.default_rng([seed, len(n)]), x)
        assert np.isnan(p.k_pages[~p.holds].astype(np.float32)).all()
        assert np.isnan(p.v_pages[~p.holds].astype(np.float32)).all()
        assert np.isfinite(p.k_pages[p.holds].astype(np.float32)).all()
        assert not p.holds.all(axis=1).all()  # pages no sequence uses
        used = [-(-int(m) // x.page_size) for m in x.lengths]
        firsts = [tuple(p.table[b, :u]) for b, u in enumerate(used) if u]
        scattered += sum(t != tuple(range(t[0], t[0] + len(t))) for t in firsts)  # non-contiguous, permuted
        pages = [q for t in firsts for q in t]
        shared += len(pages) - len(set(pages))
        for b, u in enumerate(used):
            if u < x.pages_per_sequence:
                assert not p.holds[p.table[b, u]].any()  # the first trailing entry is a NaN page
                page_zero += int((p.table[b, u + 1:] == 0).sum())
    assert shared > 0 and page_zero > 0 and scattered > 0  # shared, at page 0, non-contiguous in every seed


def test_quick_level_is_fixed_and_small():
    """The same shapes (so the same compiled programs) on every seed; only the drawn lengths move."""
    a, b = draw_paged_slots(0, "quick"), draw_paged_slots(5, "quick")
    assert {n: x.__class__(**{**vars(x), "lengths": ()}) for n, x in a.items()} == \
        {n: x.__class__(**{**vars(x), "lengths": ()}) for n, x in b.items()}
    assert all(x.head_dim <= 32 for x in a.values())
    long = a["long"]
    assert min(long.lengths) >= 32_768 and long.num_pages > INDEX_LIMIT


@pytest.mark.parametrize("seed", SEEDS)
def test_dense_decoding_slots_reach_32k_to_131k_keys(seed):
    """The dense contract's decode and speculative slots grow to serving contexts (issue 36): every length
    past 2^15, q_len <= 8, bfloat16."""
    s = slots.draw_shapes(seed, "full")
    for name, q_lens in (("longdecode", {1}), ("longspec", set(range(2, 9)))):
        d = s[name]
        assert 32_768 < d.kv_len < 131_072 and d.q_len in q_lens and d.kv_len % 128
        assert slots.slot_flags(s, name)[:3] == ("bfloat16", True, True)
        # The lengths a check draws there (grading.dense.checks.Context.problem: a batch of 2 with the slot's minimum).
        lengths = slots.draw_lengths(np.random.default_rng(seed), d, None, slots.SLOT_MIN_LENGTH[name])
        assert lengths.min() > 32_768 and d.kv_len in lengths
    assert {"longdecode", "longspec"} <= set(slots.SERVING_SLOTS)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_window_checks_windows_span_pages(seed, monkeypatch):
    """paged-window's promise, "windows across page boundaries": every problem has a row whose visible keys
    lie on two pages or more, and vllm16's decoding window is at least a page long."""
    from tpu_kernel_records_tools.grading.dense import checks as C
    from tpu_kernel_records_tools.grading.paged.checks import check_paged_window

    monkeypatch.setattr(C, "compute_ahead", lambda found: None)
    monkeypatch.setattr(C, "_CACHE", {})
    class Stop:  # the candidate is never called: its first call ends the check once its problems are drawn
        def paged_forward(self, *args, **kwargs):
            raise C._Planned

    planning = C._Planning(None, seed, level="full")
    planning.runner = Stop()
    with pytest.raises(C._Planned):
        check_paged_window(planning)
    found = C._CACHE[(seed, "full", "paged-window")]
    assert len(found) == 4  # three drawn slots and the page-boundary window probe (issue 51)
    for p in found:
        left, right = p.window
        ps, q_len = p.slot.page_size, p.q.shape[1]
        spans = []
        for n in p.lengths:
            for i in range(q_len):
                position = int(n) - q_len + i
                first, last = max(0, position - left), min(int(n) - 1, position + right)
                if first <= last:
                    spans.append(last // ps - first // ps + 1)
        assert max(spans) >= 2, (p.label, p.window, ps)
        if p.slot.name == "vllm16":
            assert left + 1 >= ps and q_len == 1, p.window
