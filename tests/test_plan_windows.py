"""The static v5e plan's windowed rows: flash with Mistral-7B's sliding window (4,096 keys) at 32k keys
against splash attention's ``LocalMask`` (compiler predictions and pipeline models). Cheap: the committed
plan JSON and its rendered document are read, never recompiled; the least the visible blocks need is
checked against a brute-force tile count; a hand-edited windowed row is refused."""

from __future__ import annotations

import copy

import numpy as np
import pytest

import release_fixtures as testing
from kernel_src.contract import visible
from tpu_kernel_records_tools.bench.plan import (LABEL, TILE_KEYS, WINDOW_GOALS, Shape, plan_shapes,
                                                 visible_block_least, visible_tile_pairs, window_goals,
                                                 window_ratios)
from tpu_kernel_records_tools.builder import plan
from tpu_kernel_records_tools.records.rawio import RunError


def _committed() -> dict:
    return plan.read_plan(testing.REPO / "data" / plan.PLAN_FILE)


def _windowed(doc: dict) -> list[dict]:
    return [r for r in doc["rows"] if r.get("window") is not None]


def test_the_profile_plans_mistrals_window_at_32k_in_both_passes():
    shapes = [s for s in plan_shapes("tpu-v5e") if s.window is not None]
    assert [(s.scope, s.model, s.window, s.seq, s.batch, s.num_q_heads, s.num_kv_heads, s.head_dim, s.mode)
            for s in shapes] == [
        ("masks-fwd", "mistral-7b", (4095, 0), 32768, 2, 32, 8, 128, "fwd"),
        ("masks-fwd-bwd", "mistral-7b", (4095, 0), 32768, 2, 32, 8, 128, "fwd+bwd")]
    assert not [s for s in plan_shapes("tpu-v5e", [8192]) if s.window is not None]


def _brute_tile_rows(seq: int, window, block_q: int, block_k: int) -> tuple[int, int]:
    mask = visible(np.arange(seq)[:, None], np.arange(seq)[None, :], seq, seq, True, None, window)
    q_rows = k_rows = 0
    for qi in range(0, seq, block_q):
        for ki in range(0, seq, block_k):
            tile = mask[qi:qi + block_q, ki:ki + block_k]
            if tile.any():
                q_rows, k_rows = q_rows + tile.shape[0], k_rows + tile.shape[1]
    return q_rows, k_rows


@pytest.mark.parametrize("seq,left,block_q,block_k", [(256, 31, 32, 16), (250, 63, 64, 32), (96, 200, 32, 64),
                                                      (128, 0, 16, 16), (200, 17, 48, 40)])
def test_visible_tiles_equal_a_brute_force_count_of_the_mask(seq, left, block_q, block_k):
    assert visible_tile_pairs(seq, (left, 0), block_q, block_k) == _brute_tile_rows(seq, (left, 0), block_q, block_k)


def test_the_visible_least_adds_the_re_reads_the_visible_tiles_force():
    """By hand: seq 1024, window (255, 0), 128 tiles: query tile i sees key tiles i - 2 .. i (3, fewer for
    the first two), so K and V stream 3 * 8 - 3 = 21 tiles of 128 rows where reading them once is 8."""
    shape = Shape("masks-fwd", 2, 1024, 4, 2, 16, "fwd", (255, 0), "mistral-7b")
    tiles = dict.fromkeys(TILE_KEYS, 128)
    kv_row = 2 * 2 * 16 * 2  # K and V: 2 kv heads of 16 bf16
    assert visible_tile_pairs(1024, (255, 0), 128, 128)[1] == 21 * 128
    assert visible_block_least(shape, tiles, 1000, 2) == 1000 + 2 * (21 - 8) * 128 * kv_row
    both = shape._replace(scope="masks-fwd-bwd", mode="fwd+bwd")
    q_row = 2 * 4 * 16 * 2 + 2 * 4 * 4  # Q and dO (4 heads of 16 bf16), lse and di (fp32 per head)
    assert visible_block_least(both, tiles, 1000, 2) == 1000 + 2 * (21 - 8) * 128 * (2 * kv_row + q_row)


def test_the_committed_plan_has_the_windowed_rows_and_meets_the_goal():
    """At Mistral-7B's window over 32k keys, forward and forward + backward (predictions and models):
    flash moves at most 0.6x splash-512's traffic with LocalMask and at most 1.2x the least its visible
    blocks need; every ratio and verdict follows from the row's bytes."""
    rows = _windowed(_committed())
    assert [(r["model"], r["window"], r["seq"], r["mode"]) for r in rows] == [
        ("mistral-7b", [4095, 0], 32768, "fwd"), ("mistral-7b", [4095, 0], 32768, "fwd+bwd")]
    for r in rows:
        assert r["xla_flops"] is None and r["flash_over_xla"] is None
        splash = r["peers"]["splash-512"]["traffic_bytes"]
        assert r["flash_over_splash_512"] == r["flash_traffic_bytes"] / splash
        assert r["peers"]["jax-flash"]["traffic_bytes"] is None  # no window
        assert r["flash_modelled_bytes"] >= r["flash_kernel_bytes"]
        assert window_ratios(r) == {k: r[k] for k in window_ratios(r)} and r["goals_met"] == window_goals(r)
        for key, bound, _, _ in WINDOW_GOALS:
            assert r[key] <= bound, (r["mode"], key, r[key])
        # a window's blocks: far less than the causal kernel would stream over 32k keys
        assert r["flash_visible_least_bytes"] < 0.5 * visible_block_least(
            Shape(r["scope"], r["batch"], 32768, 32, 8, 128, r["mode"], (32767, 0), "mistral-7b"),
            r["flash_tiles"], r["flash_kernel_bytes"], 2)


def test_the_plan_document_and_the_card_state_both_ratios_labelled():
    doc = _committed()
    text = (testing.REPO / plan.PLAN_DOC).read_text()
    card = (testing.REPO / "dataset_card.md").read_text().split("<!-- BEGIN GENERATED: plan -->")[1]
    for r in _windowed(doc):
        for key in ("flash_over_splash_512", "flash_over_visible_least", "flash_over_operands_once"):
            cell = f"| {r[key]:,.3f} |"
            assert cell in text and cell in card, key
    for document in (text, card):
        windowed = document.split("Windowed rows")[1]
        assert LABEL in windowed and "goal (issue 35)" in windowed and "Verdict: mistral-7b fwd: " in windowed


def _row() -> dict:
    """A windowed row with made-up bytes whose derived fields follow."""
    tiles = dict(block_q=512, block_k=256, block_q_dq=256, block_k_dq=256, block_q_dkv=256, block_k_dkv=512)
    shape = Shape("masks-fwd", 2, 32768, 32, 8, 128, "fwd", (4095, 0), "mistral-7b")
    row = dict(scope=shape.scope, model=shape.model, window=[4095, 0], seq=shape.seq, batch=shape.batch,
               num_q_heads=32, num_kv_heads=8, head_dim=128, mode="fwd", flash_outside_bytes=64,
               flash_outside_ops=["fusion"], flash_kernel_bytes=1.3e9, flash_modelled_bytes=3.3e9,
               flash_traffic_bytes=3.3e9 + 64, flash_kernel_flops=8e12, flash_vmem_bytes=2 ** 25, flash_kernels=1,
               flash_floor_ms=1e3 * max(8e12 / 197e12, (3.3e9 + 64) / 819e9), flash_tiles=tiles,
               flash_visible_least_bytes=visible_block_least(shape, tiles, 1.3e9, 2),
               xla_bytes=None, xla_flops=None, xla_floor_ms=None, flash_over_xla=None, forward_useful_flops=8e12,
               peers={"splash-512": dict(kernel_bytes=1e10, outside_bytes=0, traffic_bytes=1e10, kernels=1,
                                         vmem_bytes=0),
                      "splash-default": dict(kernel_bytes=2e10, outside_bytes=0, traffic_bytes=2e10, kernels=1,
                                             vmem_bytes=0),
                      "jax-flash": dict(kernel_bytes=None, outside_bytes=None, traffic_bytes=None, kernels=None,
                                        vmem_bytes=None, note="no window: not compiled")},
               best_peer="splash-512", flash_over_best_peer=(3.3e9 + 64) / 1e10)
    row.update(window_ratios(row))
    row["goals_met"] = window_goals(row)
    return row


def test_a_windowed_row_that_follows_is_accepted_and_its_verdict_is_derived():
    row = _row()
    plan.check_plan(dict(label=LABEL, rows=[row]))
    assert row["goals_met"] == {"flash_over_splash_512": True, "flash_over_visible_least": True}
    slow = _row()
    slow["peers"]["splash-512"] = dict(kernel_bytes=4e9, outside_bytes=0, traffic_bytes=4e9, kernels=1, vmem_bytes=0)
    slow["flash_over_best_peer"] = slow["flash_traffic_bytes"] / 4e9
    slow.update(window_ratios(slow))
    slow["goals_met"] = window_goals(slow)
    plan.check_plan(dict(label=LABEL, rows=[slow]))
    assert slow["goals_met"]["flash_over_splash_512"] is False  # a goal missed is stated, not hidden


@pytest.mark.parametrize("field,value,where", [
    ("flash_over_splash_512", 0.1, "flash_over_splash_512"),
    ("flash_over_visible_least", 1.0, "flash_over_visible_least"),
    ("flash_visible_least_bytes", 3.3e9, "flash_visible_least_bytes"),
    ("goals_met", {"flash_over_splash_512": True, "flash_over_visible_least": False}, "goals_met"),
    ("window", [4095, 5], "window"),
    ("window", None, "window"),
    ("xla_flops", 1.0, "xla_flops"),
    ("model", "<b>x</b>", "model"),
    ("flash_tiles", {"block_q": 512}, "flash_tiles"),
])
def test_a_hand_edited_windowed_row_is_refused(field, value, where):
    row = copy.deepcopy(_row())
    row[field] = value
    with pytest.raises(RunError, match=rf"\[plan\].*rows/0/{where}"):
        plan.check_plan(dict(label=LABEL, rows=[row]))


@pytest.mark.slow
@pytest.mark.parametrize("mode,scope", [("fwd", "masks-fwd"), ("fwd+bwd", "masks-fwd-bwd")])
def test_a_small_windowed_row_compiles_and_reads_only_its_visible_blocks(mode, scope):
    """Compiled for v5e (libtpu, no TPU) at 2,048 keys and a 512-key window: the pipeline model of flash's
    kernels lands on the least its visible blocks need (a kept tile may save a block), far under the
    causal kernel's; the row checks."""
    from tpu_kernel_records_tools.bench import compiled, plan as bench_plan

    if compiled.unavailable_reason() is not None:
        pytest.skip(compiled.unavailable_reason())
    shape = Shape(scope, 1, 2048, 4, 2, 128, mode, (511, 0), "mistral-7b")
    row = bench_plan.window_row("tpu-v5e", shape)
    plan.check_plan(dict(label=LABEL, rows=[row]))
    assert 0.97 <= row["flash_over_visible_least"] <= 1.0 + 1e-12, row["flash_over_visible_least"]
    causal = visible_block_least(shape._replace(window=(2047, 0)), row["flash_tiles"], row["flash_kernel_bytes"], 2)
    assert row["flash_modelled_bytes"] < 0.7 * causal
    assert row["peers"]["splash-512"]["traffic_bytes"] and row["peers"]["jax-flash"]["traffic_bytes"] is None
