"""The static v5e plan's paged rows: the paged decode kernel against JAX's ``paged_attention`` at the
``paged-decode`` benchmark's Llama-3-8B shapes (compiler predictions, pipeline and DMA models). Cheap: the
committed plan JSON and its rendered document are read, never recompiled; the DMA models are checked against
a page-by-page walk of each kernel's schedule; a hand-edited paged row is refused; ``plan --merge`` refuses
what it cannot merge."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

import release_fixtures as testing
from tpu_kernel_records_tools.bench.cases import get_profile
from tpu_kernel_records_tools.bench.plan_paged import (PAGED_GOALS, PAGED_KERNELS, PagedShape, paged_dma_bytes,
                                                       paged_plan_shapes)
from tpu_kernel_records_tools.builder import plan
from tpu_kernel_records_tools.cli import main as commands
from tpu_kernel_records_tools.records.rawio import RunError


def _committed() -> dict:
    return plan.read_plan(testing.REPO / "data" / plan.PLAN_FILE)


def test_the_profile_plans_llama_at_every_context_and_page_size():
    assert paged_plan_shapes("tpu-v5e") == [PagedShape("llama-3-8b", seq, page) for seq in (1024, 8192, 32768)
                                            for page in (16, 128)]
    assert paged_plan_shapes("tpu-v5e", [8192]) == [PagedShape("llama-3-8b", 8192, 16),
                                                    PagedShape("llama-3-8b", 8192, 128)]


def _walk(kernel: str, lengths, page_size: int, pages: int, hk: int, d: int, blocks: int) -> int:
    """Bytes each kernel's schedule copies, page by page: the paged kernel every table entry ``c`` with a key
    (``c * page_size < length``), all kv heads; JAX's every block ``i`` with ``i * blocks * page_size < length``,
    its ``blocks`` pages, once per kv head."""
    total = 0
    for length in lengths:
        if kernel == "paged-pallas":
            total += sum(page_size * hk * d for c in range(pages) if c * page_size < length)
        else:
            total += sum(blocks * page_size * d for _ in range(hk) for i in range(pages // blocks)
                         if i * blocks * page_size < length)
    return 2 * 2 * total  # K and V, bf16


@pytest.mark.parametrize("kernel,page_size,blocks", [("paged-pallas", 16, 1), ("paged-pallas", 128, 1),
                                                     ("jax-paged", 16, 32), ("jax-paged", 128, 4),
                                                     ("jax-paged", 16, 3)])
def test_the_dma_models_equal_a_page_by_page_walk(kernel, page_size, blocks):
    rng = np.random.default_rng(36)
    pages = 96  # a multiple of every block size, as JAX requires
    lengths = np.concatenate([[0, 1, page_size, page_size + 1, pages * page_size], rng.integers(0, pages * page_size, 7)])
    assert paged_dma_bytes(kernel, lengths, page_size, 2, 16, 2, blocks) == _walk(
        kernel, lengths, page_size, pages, 2, 16, blocks)


def test_the_committed_paged_rows_cover_the_shapes_and_their_ratios_and_verdicts_follow():
    doc = _committed()
    rows = doc["paged_rows"]
    assert [(r["model"], r["seq"], r["page_size"]) for r in rows] == [tuple(s) for s in paged_plan_shapes()]
    model = next(m for m in get_profile("tpu-v5e").paged if m.name == "llama-3-8b")
    for r in rows:
        ours, theirs = (r["kernels"][k] for k in PAGED_KERNELS)
        assert r["least_bytes"] == model.work(r["seq"], 2)[1]
        assert ours["traffic_bytes"] == ours["pipeline_bytes"] + ours["dma_bytes"] + ours["outside_bytes"]
        assert r["paged_over_least"] == pytest.approx(ours["traffic_bytes"] / r["least_bytes"], rel=1e-12)
        assert r["paged_over_jax"] == pytest.approx(ours["traffic_bytes"] / theirs["traffic_bytes"], rel=1e-12)
        assert r["goals_met"] == {key: r[key] <= bound for key, bound, _, _ in PAGED_GOALS}
        assert ours["vmem_bytes"] > 0 and theirs["vmem_bytes"] > 0 and ours["kernels"] == theirs["kernels"] == 1
    document = (testing.REPO / "PLAN_V5E.md").read_text()
    assert "## Paged rows" in document and doc["command"] in document
    for r in rows:
        assert f"| llama-3-8b | {r['seq']} | {r['batch']} | 32 / 8 | {r['page_size']} |" in document
    card = (testing.REPO / "dataset_card.md").read_text()
    assert "### Paged rows" in card and "Paged rows not in this plan yet" not in card


@pytest.mark.parametrize("path,value", [
    (("least_bytes",), 1.0),  # the least bytes are the case's useful bytes
    (("kernels", "paged-pallas", "dma_bytes"), 1),  # the DMA model's bytes
    (("kernels", "jax-paged", "pages_per_block"), 7),  # no block of pages the table's entries split into
    (("kernels", "paged-pallas", "traffic_bytes"), 1.0),
    (("paged_over_jax",), 0.5),
    (("goals_met", "paged_over_least"), False),
    (("pool_pages",), 1),
])
def test_a_hand_edited_paged_row_is_refused(path, value):
    doc = copy.deepcopy(_committed())
    target = doc["paged_rows"][0]
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(RunError, match=r"\[plan\]"):
        plan.check_plan(doc)


def test_merge_refuses_without_its_scopes_and_across_versions(tmp_path, capsys):
    assert commands.main(["plan", "--merge", str(testing.REPO / "data" / plan.PLAN_FILE), "--json",
                          str(tmp_path / "p.json")]) == 2
    assert "--merge needs --scopes" in capsys.readouterr().err
    old = json.loads((testing.REPO / "data" / plan.PLAN_FILE).read_text())
    old["jax"] = "0.0.1"
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert commands.main(["plan", "--scopes", "paged-decode", "--merge", str(tmp_path / "old.json"), "--json",
                          str(tmp_path / "p.json")]) == 1
    assert "regenerate every row" in capsys.readouterr().err and not (tmp_path / "p.json").exists()


def test_merging_the_paged_rows_into_the_committed_plan_reproduces_it(tmp_path, monkeypatch):
    """``plan --scopes paged-decode --merge`` with the paged rows the committed plan holds (compiling stubbed):
    the other rows kept as they are, the same document and JSON; the command keeps the steps that made the
    kept rows and names this one once, however often it is rerun."""
    from tpu_kernel_records_tools.bench import compiled
    from tpu_kernel_records_tools.bench import plan as bench_plan
    from tpu_kernel_records_tools.bench import plan_paged

    committed = testing.REPO / "data" / plan.PLAN_FILE
    doc = json.loads(committed.read_text())
    made = dict(jax=bench_plan.jax.__version__, libtpu=compiled.libtpu_version())
    if (doc["jax"], doc["libtpu"]) != (made["jax"], made["libtpu"]):
        pytest.skip(f"the committed plan was compiled with jax {doc['jax']}, libtpu {doc['libtpu']}")
    monkeypatch.setattr(plan_paged, "paged_rows", lambda *a, **k: copy.deepcopy(doc["paged_rows"]))

    import datetime

    class Today(datetime.date):  # the day the committed plan was made
        @classmethod
        def today(cls):
            return datetime.date.fromisoformat(doc["date"])
    monkeypatch.setattr(bench_plan.datetime, "date", Today)
    monkeypatch.chdir(testing.REPO)  # the committed command names the plan it merged by this relative path
    out = tmp_path / "PLAN_V5E.md"
    assert commands.main(["plan", "--profile", "tpu-v5e", "--scopes", "paged-decode", "--merge",
                          f"data/{plan.PLAN_FILE}", "--json", str(tmp_path / "plan.json"), "--out", str(out)]) == 0
    merged = json.loads((tmp_path / "plan.json").read_text())
    assert plan.plan_bytes(merged) == (testing.REPO / "data" / plan.PLAN_FILE).read_bytes()
    assert out.read_text() == (testing.REPO / plan.PLAN_DOC).read_text()
    (tmp_path / "again.json").write_text((tmp_path / "plan.json").read_text())
    assert commands.main(["plan", "--profile", "tpu-v5e", "--scopes", "paged-decode", "--merge",
                          str(tmp_path / "again.json"), "--json", str(tmp_path / "plan.json")]) == 0
    again = json.loads((tmp_path / "plan.json").read_text())
    assert again["rows"] == doc["rows"] and again["paged_rows"] == doc["paged_rows"]
    assert again["command"].count("--scopes paged-decode") == 1 and again["command"].startswith(
        doc["command"].split("; then ")[0] + "; then ")
