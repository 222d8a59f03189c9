"""The card's static v5e plan: ``build --plan`` keeps a checked ``tpu-kernel-records plan --json``
file in data/, the card shows its flash / XLA ratios labelled as predicted, and a ratio that does
not follow from the row's FLOPs and bytes is refused. No compiling here: the rows are synthetic."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

import release_fixtures as testing
from tpu_kernel_records_tools.bench.peers import PEERS
from tpu_kernel_records_tools.bench.plan import LABEL
from tpu_kernel_records_tools.builder import plan
from tpu_kernel_records_tools.builder.build import BuildError, build
from tpu_kernel_records_tools.builder.verify import verify
from tpu_kernel_records_tools.cli import main as commands
from tpu_kernel_records_tools.records import rawio
from release_fixtures import PUBLISHED


def _row(seq: int, mode: str, kernel_flops: float, kernel_bytes: float, modelled: float, outside: float,
         xla_flops: float, xla_bytes: float, peer_bytes: tuple[float, float, float]) -> dict:
    traffic = modelled + outside
    flash_floor = 1e3 * max(kernel_flops / 197e12, traffic / 819e9)
    xla_floor = 1e3 * max(xla_flops / 197e12, xla_bytes / 819e9)
    peers = {name: dict(kernel_bytes=b, outside_bytes=1e6, traffic_bytes=b + 1e6, kernels=1, vmem_bytes=2 ** 20)
             for name, b in zip(PEERS, peer_bytes)}
    best = min(peers, key=lambda name: peers[name]["traffic_bytes"])
    return dict(seq=seq, batch=8, num_q_heads=4, num_kv_heads=2, head_dim=128, mode=mode,
                flash_outside_bytes=outside, flash_outside_ops=["copy"], flash_kernel_bytes=kernel_bytes,
                flash_modelled_bytes=modelled, flash_traffic_bytes=traffic,
                flash_kernel_flops=kernel_flops, flash_vmem_bytes=3 * 2 ** 20, flash_kernels=1,
                flash_floor_ms=flash_floor, xla_bytes=xla_bytes, xla_flops=xla_flops,
                xla_floor_ms=xla_floor, flash_over_xla=flash_floor / xla_floor,
                forward_useful_flops=kernel_flops, outside_over_kernel=outside / kernel_bytes,
                peers=peers, best_peer=best, flash_over_best_peer=traffic / peers[best]["traffic_bytes"])


PLAN = dict(label=LABEL, command="tpu-kernel-records plan --profile tpu-v5e --json plan.json",
            jax="0.10.2", libtpu="0.0.42.1", date="2026-12-03",
            rows=[_row(2048, "fwd", 34.4e9, 50.3e6, 100.6e6, 50.4e6, 70.0e9, 1965.3e6, (199e6, 300e6, 250e6)),
                  _row(2048, "fwd+bwd", 154.7e9, 185.9e6, 400e6, 55.7e6, 176.3e9, 5614.6e6,
                       (900e6, 1200e6, 800e6))])


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    ws = testing.workspace(tmp_path_factory.mktemp("plan"))
    build([ws / "runs" / PUBLISHED], ws / "data")
    return ws


@pytest.fixture
def ws(base, tmp_path) -> Path:
    return Path(shutil.copytree(base, tmp_path / "ws", symlinks=True))


def _write(path: Path, doc: dict) -> Path:
    path.write_text(json.dumps(doc))
    return path


def test_without_a_plan_the_card_says_there_is_none(base):
    card = (base / "dataset_card.md").read_text()
    assert "_No static plan in this release yet" in card and not (base / "data" / plan.PLAN_FILE).exists()


def test_the_plan_builds_into_data_and_the_card_labelled_as_predicted(ws):
    assert build([], ws / "data", plan_path=_write(ws / "plan.json", PLAN)) == []
    assert json.loads((ws / "data" / plan.PLAN_FILE).read_text()) == PLAN
    section = (ws / "dataset_card.md").read_text().split("<!-- BEGIN GENERATED: plan -->")[1]
    section = section.split("<!-- END GENERATED: plan -->")[0]
    assert LABEL in section and "not measured" in section and "[PLAN_V5E.md](PLAN_V5E.md)" in section
    fwd = PLAN["rows"][0]
    # flash: 100.6 + 50.4 = 151.0 MB at 819 GB/s = 0.184 ms; XLA: 1965.3 MB = 2.400 ms; ratio 0.077;
    # best peer splash-512 at 199 + 1 = 200 MB: 151.0 / 200 = 0.76; least / best peer: the least
    # 50.3 + outside 50.4 = 100.7 MB over 200 = 0.503. Backward: jax-flash's 801 MB, bound
    # (185.9 + 55.7) / 801 = 0.302.
    assert (f"| 2048 | 8 | 4 / 2 | 128 | fwd | 151.0 | 200.0 (splash-512) | 0.76 | 0.503 | 0.184 | 2.400 "
            f"| {fwd['flash_over_xla']:.3f} |") in section
    assert f"{fwd['flash_over_xla']:.3f}" == "0.077"
    assert "| fwd+bwd | 455.7 | 801.0 (jax-flash) | 0.57 | 0.302 |" in section
    assert "jax 0.10.2, libtpu 0.0.42.1" in section
    assert verify(ws / "data") == []


@pytest.mark.parametrize("edit, field", [
    (lambda d: d["rows"][0].__setitem__("flash_over_xla", 0.05), "rows/0/flash_over_xla"),
    (lambda d: d["rows"][1].__setitem__("xla_floor_ms", 1.0), "rows/1/xla_floor_ms"),
    (lambda d: d["rows"][1].__setitem__("flash_floor_ms", 0.1), "rows/1/flash_floor_ms"),
    (lambda d: d.__setitem__("label", "Measured on a TPU v5e."), "label"),
    (lambda d: d["rows"][0].__setitem__("mode", "bwd"), "rows/0/mode"),
    (lambda d: d["rows"][0].__setitem__("flash_traffic_bytes", 120e6), "rows/0/flash_traffic_bytes"),
    (lambda d: d["rows"][0].__setitem__("flash_modelled_bytes", 40e6), "rows/0/flash_modelled_bytes"),
    (lambda d: d["rows"][0]["peers"]["splash-512"].__setitem__("traffic_bytes", 1e6),
     "rows/0/peers/splash-512/traffic_bytes"),
    (lambda d: d["rows"][1].__setitem__("best_peer", "splash-512"), "rows/1/best_peer"),
    (lambda d: d["rows"][1].__setitem__("flash_over_best_peer", 0.4), "rows/1/flash_over_best_peer"),
    (lambda d: d["rows"][1]["peers"].pop("jax-flash"), "rows/1/peers"),
    (lambda d: d.__setitem__("rows", []), "rows"),
    (lambda d: d["rows"][0].__setitem__("seq", True), "rows/0/seq"),
    (lambda d: d["rows"][0].__setitem__("batch", 2 ** 40), "rows/0/batch"),
])
def test_a_plan_whose_numbers_do_not_follow_is_refused_and_nothing_written(ws, edit, field):
    doc = copy.deepcopy(PLAN)
    edit(doc)
    before = testing.tree_hash(ws / "data", ws / "dataset_card.md")
    with pytest.raises(BuildError, match=rf"\[plan\].* at {field}"):
        build([], ws / "data", plan_path=_write(ws / "plan.json", doc))
    assert testing.tree_hash(ws / "data", ws / "dataset_card.md") == before


def test_a_hand_edited_plan_in_data_fails_verify(ws):
    build([], ws / "data", plan_path=_write(ws / "plan.json", PLAN))
    doc = copy.deepcopy(PLAN)
    doc["rows"][0]["flash_over_xla"] = 0.01
    (ws / "data" / plan.PLAN_FILE).write_bytes(plan.plan_bytes(doc))
    problems = verify(ws / "data")
    assert any("plan/tpu-v5e.json: sha256 differs" in p for p in problems)
    assert any("[plan]" in p and "flash_over_xla" in p for p in problems)


def test_build_plan_on_the_command_line(ws, capsys):
    code = commands.main(["build", "--data", str(ws / "data"), "--plan", str(_write(ws / "p.json", PLAN)),
                          "--quiet"])
    assert code == 0 and (ws / "data" / plan.PLAN_FILE).is_file()
    assert commands.main(["build", "--data", str(ws / "data"), "--plan", str(ws / "missing.json")]) == 1
    assert "missing.json" in capsys.readouterr().err


def test_the_committed_plan_doc_is_its_json_rendered_and_states_the_least_traffic_bound():
    """``PLAN_V5E.md`` is ``data/plan/tpu-v5e.json`` rendered (same rows, same provenance), and
    its least / best peer column shows why 16 / 16 heads at seq 2048, forward, cannot reach
    0.6x splash: reading q, k, v and writing o once (8 x 2048 x 16 x 128 bf16 each, plus the
    int32 lengths) is already more than 0.6 of splash-512's traffic."""
    from tpu_kernel_records_tools.bench.plan import least_over_best_peer, render_markdown

    doc = plan.read_plan(testing.REPO / "data" / plan.PLAN_FILE)
    made = {key: doc[key] for key in ("jax", "libtpu", "date")}
    assert (testing.REPO / plan.PLAN_DOC).read_text() == render_markdown(
        doc["rows"], "tpu-v5e", doc["command"], made, paged_rows=doc.get("paged_rows") or [],
        ragged_rows=doc.get("ragged_rows") or [])
    for row in doc["rows"]:  # no schedule goes below its bound
        assert row["flash_over_best_peer"] >= least_over_best_peer(row) * (1 - 1e-9), row
    [mha] = [r for r in doc["rows"] if r["scope"] == "model-fwd" and r["seq"] == 2048
             and r["num_kv_heads"] == 16]
    assert mha["flash_kernel_bytes"] == 4 * 8 * 2048 * 16 * 128 * 2 + 8 * 4
    assert mha["best_peer"] == "splash-512"
    bound = least_over_best_peer(mha)
    assert bound == (mha["flash_kernel_bytes"] + mha["flash_outside_bytes"]) / (
        mha["peers"]["splash-512"]["traffic_bytes"])
    assert bound > 0.6
    assert f"| {bound:.3f} |" in (testing.REPO / plan.PLAN_DOC).read_text()


def test_the_committed_plan_meets_the_model_shape_goal_or_sits_on_its_bound():
    """At every model shape of the committed plan (compiler predictions), flash moves at most 0.6x
    the traffic of splash attention at 512 tiles, forward and forward + backward, or, where even
    its least traffic is above 0.6x (16 / 16 heads, seq 2048, forward), its pipeline moves no
    more than that least traffic; and it is below splash-512 at every plan shape."""
    doc = plan.read_plan(testing.REPO / "data" / plan.PLAN_FILE)
    for row in doc["rows"]:
        splash = row["peers"]["splash-512"]["traffic_bytes"]
        ratio = row["flash_traffic_bytes"] / splash
        assert ratio < 1, row
        if row["scope"] == "flash" or row.get("window") is not None:  # windowed: tests/test_plan_windows.py
            continue
        least = (row["flash_kernel_bytes"] + row["flash_outside_bytes"]) / splash
        assert ratio <= 0.6 or (least > 0.6 and row["flash_modelled_bytes"] == row["flash_kernel_bytes"]), (
            row["scope"], row["seq"], row["num_q_heads"], row["mode"], ratio, least)


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, "1" * 5000, "{\"label\": \udcff}"])
def test_a_plan_file_python_cannot_parse_is_refused_in_one_line(tmp_path, text):
    """Nesting too deep for Python's parser, a number too long for it, text that is not UTF-8 (the
    builder turns this refusal into its own, as for any plan error above)."""
    path = tmp_path / "plan.json"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(rawio.RunError, match=r"\[plan\].*not valid JSON") as info:
        plan.read_plan(path)
    assert "\n" not in str(info.value)
