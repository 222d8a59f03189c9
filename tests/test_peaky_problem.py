"""The peaky-attention problems: every row's dominant key is one it may see, drawn from all of them."""

from __future__ import annotations

import numpy as np
import pytest

from tpu_kernel_records_tools.grading.dense.checks import Context, _peaky


def _dominant_keys(p) -> tuple[np.ndarray, np.ndarray]:
    """``(argmax key, largest visible key)`` per (batch, row, head); -1 where a row sees no key."""
    q, k = p.host("q"), p.host("k")
    b, lq, hq, d = q.shape
    hk = k.shape[2]
    kh = k[:, :, np.arange(hq) // (hq // hk)]  # [b, lk, hq, d]: the kv head each query head reads
    logits = np.einsum("bihd,bjhd->bihj", q, kh)
    visible = p.truth.visible  # [b, lq, lk]
    last = np.where(visible.any(-1), visible.shape[-1] - 1 - np.argmax(visible[..., ::-1], axis=-1), -1)
    return np.argmax(logits, axis=-1), np.broadcast_to(last[:, :, None], (b, lq, hq))


@pytest.mark.parametrize("level, slot", [("quick", "batch"), ("quick", "gqa"), ("full", "batch")])
def test_each_rows_dominant_key_is_visible_and_drawn_from_its_whole_visible_range(level, slot):
    ctx = Context(runner=None, seed=0, level=level)
    p = _peaky(ctx.problem(ctx.rng("peaky-attention", 1), slot), ctx.rng("peaky-attention", 11))
    top, last = _dominant_keys(p)
    rows = last >= 1  # rows that see at least two keys
    assert rows.sum() >= 20
    assert np.all(top[rows] <= last[rows]), "a dominant key in the row's future or in the padding"
    late = (top[rows] > last[rows] / 2).mean()  # uniform over [0, last]: about half in the later half
    assert 0.25 < late < 0.75, f"dominant keys in the later half of the visible range: {late:.2f}"
