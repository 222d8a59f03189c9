"""builder.markdown: a run's strings reach the card (the Hub README) as literal text, never as HTML,
a link, an image, a table cell or a line of their own."""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pytest

import release_fixtures as testing
from tpu_kernel_records_tools.builder import card
from tpu_kernel_records_tools.builder.build import build
from tpu_kernel_records_tools.builder.leaderboard import leaderboard
from tpu_kernel_records_tools.builder.markdown import EMPTY, Markdown, code, table, text

HOSTILE = [
    "cpu <!-- the rest of the card is hidden",
    "v5e ![tracker](https://evil.example/p.png) [terms](http://evil.example)",
    "a | b\n\n## Licence: none\r\n",
    "x\u202ey\u2028z\u0000",
    "`code` *bold* _it_ ~~gone~~ $x^2$ \\",
    "<script>alert(1)</script> &amp; www.evil.example",
]


def _inert(rendered: str) -> None:
    assert "\n" not in rendered and "\r" not in rendered
    assert not re.search(r"[<>\x00-\x1f\u2028\u202e]", rendered), rendered
    assert not re.search(r"(?<!\\)[|`*_~\[\]$]", rendered), rendered  # every one backslashed
    assert "://" not in rendered and "www." not in rendered


@pytest.mark.parametrize("value", HOSTILE)
def test_text_makes_any_value_inert(value):
    _inert(text(value))
    _inert(code(value))


@pytest.mark.parametrize("value", ["TPU v5 lite", "0.10.2", "cpu", "flash-triton", "2026-12-04", "0.0.42.1"])
def test_plain_values_are_unchanged(value):
    assert text(value) == value
    assert code(value) == f"`{value}`"


def test_empty_and_table():
    assert text(None) == EMPTY
    rendered = table(["a", "b"], [[Markdown("`x`"), "p|q"], [None, 3]])
    assert rendered.splitlines() == ["| a | b |", "|---|---|", "| `x` | p\\|q |", f"| {EMPTY} | 3 |"]


def test_a_run_with_hostile_strings_cannot_change_the_cards_structure(tmp_path):
    """A re-signed run whose device name and versions carry an HTML comment, an image, a link and
    a newline: the card keeps one line per record and only its own markers, and shows the
    strings escaped."""
    ws = testing.workspace(tmp_path)
    run = testing.write(ws / "runs", "synthetic-cpu")
    env = json.loads((run / "environment.json").read_text())
    env["device_kind"] = HOSTILE[0]
    env["versions"]["jax"] = HOSTILE[1]
    env["versions"]["jaxlib"] = HOSTILE[2]
    testing.rewrite(run, "environment", env)
    before = (ws / "dataset_card.md").read_text()
    build([run], ws / "data", allow_interpret=True)
    after = (ws / "dataset_card.md").read_text()
    assert after.count("<!--") == before.count("<!--") and after.count("-->") == before.count("-->")
    assert "://evil.example" not in after and "![tracker](" not in after and "[terms](" not in after
    assert not any(line.startswith("## Licence: none") for line in after.splitlines())
    records = card.extract(after, "records")
    [line] = [line for line in records.splitlines() if "synthetic-cpu" in line]
    assert "cpu &lt;!-- the rest of the card is hidden" in line
    assert line.count(" | ") == records.splitlines()[0].count(" | ")  # no cell added


def test_the_leaderboard_escapes_what_a_submitted_run_names():
    row = dict(source="submitted", implementation="submitted", interpret=True, device_kind=HOSTILE[0],
               scope="flash", seq_len=128, num_q_heads=4, num_kv_heads=2, head_dim=64, batch=1,
               dtype="bfloat16 | x", median_ms=1.0, record_id="sub-run", samples_ms=[1.0, 1.1, 0.9],
               pairs=[])
    verdict = dict(record_id="sub-run", candidate="mine`<b>", candidate_passed=True, source="submitted",
                   measured=True, row_kind="check")
    rendered = leaderboard(pa.Table.from_pylist([row]), pa.Table.from_pylist([verdict]))
    [line] = [line for line in rendered.splitlines() if "sub-run" in line]
    assert "<" not in line and "&lt;!--" in line and "mine\\`&lt;b&gt;" in line
    assert line.count(" | ") == rendered.splitlines()[[i for i, l in enumerate(rendered.splitlines())
                                                        if l.startswith("| Device")][0]].count(" | ")
