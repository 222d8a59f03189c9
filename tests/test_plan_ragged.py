"""The static v5e plan's ragged rows: the ragged kernel against JAX's ``ragged_paged_attention`` over the ragged
scope's serving steps (compiler predictions, pipeline and DMA models). Cheap: the committed plan JSON and its
rendered document are read, never recompiled; the DMA models are checked against a tiny step whose page copies
are counted by hand and the ragged kernel's against its own work list; the goals' verdicts at their bounds; a
hand-edited ragged row is refused."""

from __future__ import annotations

import copy

import pytest

import release_fixtures as testing
from tpu_kernel_records_tools.bench.plan_ragged import (RAGGED_GOALS, RAGGED_KERNELS, RaggedStep, jax_block_visits,
                                                        ragged_dma_bytes, ragged_goals, ragged_item_copies,
                                                        ragged_kernel_plan, ragged_plan_steps, step_arrays)
from tpu_kernel_records_tools.builder import plan
from tpu_kernel_records_tools.records.rawio import RunError

# A decode row at position 6 of 7 keys, then a whole prompt of 5 rows, two padding rows; pages of 2 keys, one kv
# head of one number, 1 byte in the cache, 2 in q.
Q_LENS, KV_LENS = (1, 5), (7, 5)
TINY = RaggedStep("tiny", Q_LENS, KV_LENS, page_size=2, num_q_heads=1, num_kv_heads=1, head_dim=1, dtype="bfloat16",
                  kv_dtype="float8_e4m3fn", num_tokens=8, max_seqs=2, pages_per_sequence=4)


def test_the_ragged_kernels_copies_counted_page_by_page():
    """Items of 2 rows: the decode row's item reads pages 0-3 (keys 0-6); the prompt's items, rows at positions 0-1,
    2-3 and 4, read pages 0, 0-1 and 0-2 (each up to its last row): 4 + 6 pages of 2 keys, K and V, 1 byte; the 6
    rows of q in, all 8 rows out (2 of them padding zeros), 2 bytes. Items of 8 rows: the prompt's one item reads
    pages 0-2 once."""
    assert ragged_item_copies(Q_LENS, KV_LENS, 2, 2) == [(1, 4), (2, 1), (2, 2), (1, 3)]
    rows = (6 + 8) * 2
    assert ragged_dma_bytes("ragged-pallas", TINY, dict(block_q=2, sub_tiles=1)) == 2 * (4 + 6) * 2 + rows
    assert ragged_dma_bytes("ragged-pallas", TINY, dict(block_q=2, sub_tiles=4)) == 2 * (4 + 3) * 2 + rows
    wide = TINY._replace(num_q_heads=6, num_kv_heads=3, head_dim=4, kv_dtype="bfloat16", dtype="float32")
    assert ragged_dma_bytes("ragged-pallas", wide, dict(block_q=2, sub_tiles=1)) == (
        2 * (4 + 6) * 2 * 3 * 4 * 2 + (6 + 8) * 6 * 4 * 4)


def test_the_model_follows_the_kernels_own_work_list():
    """At every plan step, the ragged kernel's own work list (``schedule`` over the step's arrays, its plan as
    compiled for a v5e) and each item's keys (``key_range``, pages as its walk copies them) are the model's items
    (``ragged_item_copies``), and its padding items, of no keys, hold the padding rows; items of many rows."""
    import jax.numpy as jnp
    import numpy as np

    from kernel_src.ragged.plan import key_range, schedule

    for step in ragged_plan_steps("tpu-v5e")[::2]:  # the work list does not depend on the cache's dtype
        kernel_plan = ragged_kernel_plan(step)
        arrays = {k: jnp.asarray(v) for k, v in step_arrays(step).items()}
        items = schedule(arrays["cu_q_lens"], arrays["kv_lengths"], arrays["num_seqs"], kernel_plan)
        start, end = (np.asarray(x) for x in key_range(items.length, items.q_len, items.j0, kernel_plan))
        rows, ps = np.asarray(items.rows), step.page_size
        sees = end > start
        copies = [(int(r), int(-(-e // ps) - s // ps)) for r, s, e in zip(rows[sees], start[sees], end[sees])]
        assert copies == ragged_item_copies(step.q_lens, step.kv_lens, kernel_plan.item_rows, ps)
        assert rows[~sees].sum() == step.num_tokens - sum(step.q_lens)
        assert kernel_plan.item_rows >= 256


def test_jaxs_copies_counted_block_by_block():
    """Six token rows in q blocks of 4: block 0 visits the decode sequence (7 keys: 2 kv blocks of 4) and the
    prompt (5 keys: 2), block 1 the prompt again (2): 6 kv blocks of 2 pages of 2 keys, K and V, 1 byte (its q and
    output are BlockSpec operands, counted by the pipeline model)."""
    assert jax_block_visits(Q_LENS, KV_LENS, 4, 4) == [2, 4]
    assert ragged_dma_bytes("jax-ragged", TINY, dict(num_queries_per_block=4, num_kv_pages_per_block=2)) == 2 * 6 * 2 * 2
    # one q block holding both: each sequence walked once
    assert jax_block_visits(Q_LENS, KV_LENS, 8, 4) == [2, 2]
    # a sequence ending exactly at a block's end is not visited by the next block
    assert jax_block_visits((4, 4), (9, 4), 4, 4) == [3, 1]
    with pytest.raises(ValueError, match="no DMA model"):
        ragged_dma_bytes("ragged-triton", TINY, {})


@pytest.mark.parametrize("least,jax_,met", [(1.1, 0.999, {"ragged_over_least": True, "ragged_over_jax": True}),
                                            (1.1001, 0.5, {"ragged_over_least": False, "ragged_over_jax": True}),
                                            (0.9, 1.0, {"ragged_over_least": True, "ragged_over_jax": False}),
                                            (None, 0.5, {"ragged_over_least": None, "ragged_over_jax": True})])
def test_the_goals_at_their_bounds(least, jax_, met):
    assert ragged_goals(dict(ragged_over_least=least, ragged_over_jax=jax_)) == met
    assert [bound for _, bound, _, _ in RAGGED_GOALS] == [1.1, 1.0]


def _committed() -> dict:
    return plan.read_plan(testing.REPO / "data" / plan.PLAN_FILE)


def test_the_committed_ragged_rows_cover_the_steps_labelled_and_rendered():
    doc = _committed()
    rows = doc["ragged_rows"]
    steps = ragged_plan_steps("tpu-v5e")
    assert len(steps) == 8 and {s.model for s in steps} == {"llama-3-8b", "qwen2.5-7b"}
    assert [(r["model"], r["page_size"], r["kv_dtype"]) for r in rows] == [(s.model, s.page_size, s.kv_dtype)
                                                                           for s in steps]
    for r in rows:
        ours, theirs = (r["kernels"][k] for k in RAGGED_KERNELS)
        assert ours["traffic_bytes"] == ours["pipeline_bytes"] + ours["dma_bytes"] + ours["outside_bytes"]
        # q and the output move by the kernel's own copies, not through tiles XLA gathers around it: no more bytes
        # outside than around JAX's kernel, whose q and output are BlockSpec operands
        assert ours["pipeline_bytes"] + ours["outside_bytes"] < theirs["outside_bytes"] + 1e-3 * r["least_bytes"]
        assert r["ragged_over_least"] == pytest.approx(ours["traffic_bytes"] / r["least_bytes"], rel=1e-12)
        assert r["ragged_over_jax"] == pytest.approx(ours["traffic_bytes"] / theirs["traffic_bytes"], rel=1e-12)
        assert ours["vmem_bytes"] > 0 and theirs["vmem_bytes"] > 0 and ours["kernels"] == theirs["kernels"] == 1
    document = (testing.REPO / plan.PLAN_DOC).read_text()
    section = document.split("## Ragged rows")[1]
    assert plan.LABEL in section and "(issue 54), stated as predictions" in section
    for r in rows:
        assert f"| {r['model']} | {r['page_size']} | {r['kv_dtype']} |" in section


@pytest.mark.parametrize("path,value", [
    (("least_bytes",), 1.0),  # the least bytes follow from the step
    (("kernels", "ragged-pallas", "dma_bytes"), 1),  # the DMA model's bytes
    (("kernels", "jax-ragged", "num_kv_pages_per_block"), 7),  # not what JAX's table picks for a v5e
    (("kernels", "ragged-pallas", "block_q"), 7),  # not the kernel's TPU default
    (("kernels", "ragged-pallas", "sub_tiles"), 1),
    (("kernels", "jax-ragged", "traffic_bytes"), 1.0),
    (("ragged_over_jax",), 0.5),
    (("goals_met", "ragged_over_least"), "flipped"),
    (("kv_lens",), [1, 2]),  # no step of the profile
    (("kernels", "ragged-pallas", "vmem_bytes"), -1),
])
def test_a_hand_edited_ragged_row_is_refused(path, value):
    doc = copy.deepcopy(_committed())
    target = doc["ragged_rows"][0]
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = (not target[path[-1]]) if value == "flipped" else value
    with pytest.raises(RunError, match=r"\[plan\].*ragged_rows/0"):
        plan.check_plan(doc)


def test_merging_the_ragged_rows_into_the_committed_plan_reproduces_it(tmp_path, monkeypatch):
    """``plan --scopes ragged --merge`` with the ragged rows the committed plan holds (compiling stubbed): the
    other rows kept as they are, the same JSON and document; rerun, the step keeps its place in the command."""
    import datetime
    import json

    from tpu_kernel_records_tools.bench import compiled, plan_ragged
    from tpu_kernel_records_tools.bench import plan as bench_plan
    from tpu_kernel_records_tools.cli import main as commands

    doc = json.loads((testing.REPO / "data" / plan.PLAN_FILE).read_text())
    if (doc["jax"], doc["libtpu"]) != (bench_plan.jax.__version__, compiled.libtpu_version()):
        pytest.skip(f"the committed plan was compiled with jax {doc['jax']}, libtpu {doc['libtpu']}")
    monkeypatch.setattr(plan_ragged, "ragged_rows", lambda *a, **k: copy.deepcopy(doc["ragged_rows"]))

    class Today(datetime.date):  # the day the committed plan was made
        @classmethod
        def today(cls):
            return datetime.date.fromisoformat(doc["date"])
    monkeypatch.setattr(bench_plan.datetime, "date", Today)
    monkeypatch.chdir(testing.REPO)  # the committed command names the plan it merged by this relative path
    out = tmp_path / "PLAN_V5E.md"
    assert commands.main(["plan", "--profile", "tpu-v5e", "--scopes", "ragged", "--merge", f"data/{plan.PLAN_FILE}",
                          "--json", str(tmp_path / "plan.json"), "--out", str(out)]) == 0
    assert plan.plan_bytes(json.loads((tmp_path / "plan.json").read_text())) == (
        testing.REPO / "data" / plan.PLAN_FILE).read_bytes()
    assert out.read_text() == (testing.REPO / plan.PLAN_DOC).read_text()
    assert doc["command"].count("--scopes ragged") == 1


def test_a_merge_replaces_ragged_rows_that_no_longer_follow_but_checks_the_kept_ones(tmp_path, monkeypatch, capsys):
    """After a kernel change the old ragged rows no longer follow from it; ``--scopes ragged --merge`` replaces them
    rather than refusing the plan, but still refuses a kept row that is wrong."""
    import json

    from tpu_kernel_records_tools.bench import compiled, plan_ragged
    from tpu_kernel_records_tools.bench import plan as bench_plan
    from tpu_kernel_records_tools.cli import main as commands

    doc = json.loads((testing.REPO / "data" / plan.PLAN_FILE).read_text())
    if (doc["jax"], doc["libtpu"]) != (bench_plan.jax.__version__, compiled.libtpu_version()):
        pytest.skip(f"the committed plan was compiled with jax {doc['jax']}, libtpu {doc['libtpu']}")
    monkeypatch.setattr(plan_ragged, "ragged_rows", lambda *a, **k: copy.deepcopy(doc["ragged_rows"]))
    stale = copy.deepcopy(doc)
    stale["ragged_rows"][0]["kernels"]["ragged-pallas"]["dma_bytes"] += 1
    (tmp_path / "stale.json").write_text(json.dumps(stale))
    args = ["plan", "--scopes", "ragged", "--merge", str(tmp_path / "stale.json"), "--json", str(tmp_path / "p.json"),
            "--out", str(tmp_path / "p.md")]
    assert commands.main(args) == 0
    assert json.loads((tmp_path / "p.json").read_text())["ragged_rows"] == doc["ragged_rows"]
    stale["paged_rows"][0]["least_bytes"] = 1.0
    (tmp_path / "stale.json").write_text(json.dumps(stale))
    (tmp_path / "p.json").unlink()
    assert commands.main(args) == 2
    assert "paged_rows/0/least_bytes" in capsys.readouterr().err and not (tmp_path / "p.json").exists()
