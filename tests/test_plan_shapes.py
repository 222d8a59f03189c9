"""What the static v5e plan compiles (``bench.plan.plan_shapes``, no compiler needed) and the scope rule
of the builder's plan check: every flash-scope length in both passes, the model-sized shapes exactly
where the benchmark also runs the XLA reference, and the masked models' windowed rows."""

from __future__ import annotations

import pytest

from tpu_kernel_records_tools.bench.cases import MASK_SCOPES, MODEL_SCOPES, get_profile
from tpu_kernel_records_tools.bench.plan import MODES, plan_shapes
from tpu_kernel_records_tools.builder.plan import check_plan
from tpu_kernel_records_tools.records.rawio import RunError


def test_every_flash_length_and_every_model_shape_where_xla_fits():
    profile = get_profile("tpu-v5e")
    shapes = plan_shapes("tpu-v5e")
    flash = {(s.seq, s.mode) for s in shapes if s.scope == "flash"}
    assert flash == {(seq, mode) for seq in profile.seq_lens_for("flash") for mode in MODES}
    model = profile.model
    expected = {(scope, hq, hk, seq) for hq, hk in model.heads for seq in model.seq_lens
                for scope in MODEL_SCOPES if model.xla_fits(scope, hq, seq)}
    models = [s for s in shapes if s.scope in MODEL_SCOPES]
    got = {(s.scope, s.num_q_heads, s.num_kv_heads, s.seq) for s in models}
    assert got == expected and ("model-fwd", 16, 16, 4096) in got and ("model-fwd-bwd", 16, 16, 4096) not in got
    assert all(s.mode == dict(zip(MODEL_SCOPES, MODES))[s.scope] for s in models)
    assert all(s.batch == model.batch and s.head_dim == model.head_dim and s.window is None for s in models)
    # then the windowed rows of the masked models the plan sets against splash's LocalMask, both passes
    windowed = [s for s in shapes if s.scope not in ("flash", *MODEL_SCOPES)]
    assert windowed == shapes[len(shapes) - len(windowed):]
    assert {(s.model, s.seq, s.mode, s.scope) for s in windowed} == {
        (m.name, seq, mode, scope) for m in profile.masks for seq in m.plan_seq_lens
        for mode, scope in zip(MODES, MASK_SCOPES)} != set()


def test_lengths_and_modes_restrict_both_parts():
    shapes = plan_shapes("tpu-v5e", [2048], ["fwd"])
    assert {(s.scope, s.num_q_heads, s.seq, s.mode) for s in shapes} == {
        ("flash", 4, 2048, "fwd"), ("model-fwd", 32, 2048, "fwd"), ("model-fwd", 16, 2048, "fwd")}
    assert all(s.scope == "flash" for s in plan_shapes("tiny"))
    with pytest.raises(ValueError, match="unknown mode"):
        plan_shapes("tpu-v5e", modes=["bwd"])


def test_a_row_with_an_unknown_scope_is_refused():
    from tpu_kernel_records_tools.bench.plan import LABEL

    row = dict(scope="model-bwd", seq=128, batch=8, num_q_heads=4, num_kv_heads=2, head_dim=128, mode="fwd",
               xla_flops=1.0, xla_bytes=1.0, xla_floor_ms=1e3 / 819e9, flash_kernel_flops=None,
               flash_kernel_bytes=None, flash_floor_ms=None, flash_over_xla=None, flash_outside_bytes=0)
    with pytest.raises(RunError, match=r"rows/0/scope"):
        check_plan(dict(label=LABEL, rows=[row]))
    check_plan(dict(label=LABEL, rows=[{**row, "scope": "model-fwd", "xla_floor_ms": _xla_floor(row)}]))


def _xla_floor(row):
    from tpu_kernel_records_tools.builder.plan import _floor_ms

    return _floor_ms(row["xla_flops"], row["xla_bytes"])


def test_the_card_names_the_profile_shapes_a_plan_lacks(tmp_path):
    import json

    from tpu_kernel_records_tools.bench.plan import LABEL
    from tpu_kernel_records_tools.builder.plan import PLAN_FILE, missing_shapes, section

    shapes = [s for s in plan_shapes("tpu-v5e") if s.window is None]  # windowed rows: tests/test_plan_windows.py
    windowed = [s for s in plan_shapes("tpu-v5e") if s.window is not None]
    rows = []
    for s in shapes[:-1]:
        row = dict(scope=s.scope, seq=s.seq, batch=s.batch, num_q_heads=s.num_q_heads, num_kv_heads=s.num_kv_heads,
                   head_dim=s.head_dim, mode=s.mode, xla_flops=1.0, xla_bytes=1.0, flash_kernel_flops=None,
                   flash_kernel_bytes=None, flash_floor_ms=None, flash_over_xla=None, flash_outside_bytes=0)
        rows.append({**row, "xla_floor_ms": _xla_floor(row)})
    doc = dict(label=LABEL, rows=rows)
    assert missing_shapes(doc) == [shapes[-1], *windowed]
    (tmp_path / PLAN_FILE).parent.mkdir(parents=True)
    (tmp_path / PLAN_FILE).write_text(json.dumps(doc))
    text = section(tmp_path)
    assert f"Not in this plan yet ({1 + len(windowed)} shape(s)" in text
    assert "model-fwd seq 4096 heads 16 / 16 fwd" in text and "masks-fwd seq 32768 heads 32 / 8 fwd" in text
    last = shapes[-1]
    full = rows + [{**rows[-1], "scope": last.scope, "seq": last.seq, "num_q_heads": last.num_q_heads,
                    "num_kv_heads": last.num_kv_heads, "mode": last.mode}]
    assert missing_shapes({**doc, "rows": full}) == windowed
