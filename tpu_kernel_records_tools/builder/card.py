"""The generated parts of the dataset card, and the ratio figure.

Generated parts sit between marker comments; everything else in the card is written by hand:

    # BEGIN GENERATED: dataset_info          (inside the YAML front matter)
    <!-- BEGIN GENERATED: records -->        (markdown body; also: glance, usage, fields, power, figure,
                                                masks, paged, ragged, leaderboard, plan)

The ``plan`` section comes from ``data/plan/tpu-v5e.json`` (``builder.plan``), ``fields`` from
``builder.fields`` (every column's description), ``masks`` from the profiles' masked models
(``bench.cases.MaskedModel``) and the tables' ``masks-*`` rows, ``paged`` from the profiles' paged decode
steps (``bench.cases.PagedModel``) and the tables' ``paged-decode`` rows, ``ragged`` from the profiles' serving
steps and the tables' ``ragged`` rows (``builder.ragged_card``), the others from the tables.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import struct
import zlib
from typing import Any

import pyarrow as pa
import yaml

from . import fields
from .leaderboard import leaderboard
from .markdown import code, megabytes, table, text
from .ragged_card import ragged
from ..bench.stats import CONFIDENCE
from ..records.schema import CONFIG_NAMES, FEATURES, TAG

FIGURE = "figures/pallas_xla_ratio.png"  # relative to data/
FIGURE_KEY = "tpu-kernel-records-data-sha256"
BASELINE = "xla"  # the figure and its table show ratios to this implementation
YAML_SECTIONS = ("dataset_info",)
SECTIONS = ("dataset_info", "glance", "usage", "fields", "records", "power", "figure", "masks", "paged",
            "ragged", "leaderboard", "plan")
PLACEHOLDER_REPO = "OWNER/tpu-kernel-records"
MAX_LISTED_SHAPES = 6  # grader-power shapes listed one by one in the card up to this many  # the usage examples name the real repo once published


def _markers(name: str) -> tuple[str, str]:
    if name in YAML_SECTIONS:
        return f"# BEGIN GENERATED: {name}\n", f"# END GENERATED: {name}\n"
    return f"<!-- BEGIN GENERATED: {name} -->\n", f"<!-- END GENERATED: {name} -->\n"


def _span(text: str, name: str) -> tuple[int, int]:
    begin, end = _markers(name)
    if text.count(begin) != 1 or text.count(end) != 1:
        raise ValueError(f"the card needs exactly one {begin.strip()!r} and one {end.strip()!r}")
    start, stop = text.index(begin) + len(begin), text.index(end)
    if stop < start:
        raise ValueError(f"{end.strip()!r} comes before {begin.strip()!r}")
    return start, stop


def extract(text: str, name: str) -> str:
    """The current content of generated section ``name``."""
    start, stop = _span(text, name)
    return text[start:stop]


def replace(text: str, sections: dict[str, str]) -> str:
    """``text`` with every generated section replaced."""
    for name, content in sections.items():
        start, stop = _span(text, name)
        text = text[:start] + content + text[stop:]
    return text


def dataset_info(tables: dict[str, pa.Table]) -> str:
    """The ``dataset_info`` YAML of the card: each config's features (from ``records.schema.FEATURES``),
    rows and Arrow bytes, written by ``datasets``' own ``DatasetInfosDict.to_dataset_card_data``."""
    import datasets
    from datasets.info import DatasetInfosDict
    from huggingface_hub import DatasetCardData

    infos = DatasetInfosDict()
    for name in CONFIG_NAMES:
        splits = datasets.SplitDict()
        splits.add(datasets.SplitInfo(name="train", num_bytes=tables[name].nbytes,
                                      num_examples=tables[name].num_rows))
        infos[name] = datasets.DatasetInfo(features=datasets.Features.from_arrow_schema(FEATURES[name]),
                                           splits=splits, dataset_size=tables[name].nbytes)
    card_data = DatasetCardData()
    infos.to_dataset_card_data(card_data)
    return yaml.safe_dump({"dataset_info": card_data["dataset_info"]}, sort_keys=False,
                          default_flow_style=False, width=1000)


def records(environment: pa.Table) -> str:
    rows = []
    for r in environment.to_pylist():
        devices = f"{r['device_count']} / {r['devices_used']}"
        grader = r["source"] == "grader-power"  # times no kernel, grades no measured one: no "0 of 0"
        rows.append([code(r["record_id"]), r["source"], r["platform"], r["device_kind"], devices,
                     f"{r['jax']} / {r['jaxlib']}", None if grader else f"{r['cases_ok']} of {r['cases']}",
                     None if grader else f"{r['checks_passed']} of {r['checks']}", "yes" if r["interpret"] else "no"])
    return table(["Record", "Source", "Platform", "Device", "Devices visible / used", "JAX / jaxlib",
                  "Cases ok", "Checks passed (measured kernel)", "Interpret mode"], rows)


def _needed_k(detail: dict[str, Any] | None) -> str | None:
    if not detail:
        return None
    if detail.get("min_k_to_pass_tolerances") is not None:
        return f"{detail['min_k_to_pass_tolerances']:.3g}"
    ks = [c["needed_k"] for c in detail.get("calibration") or [] if c["needed_k"] is not None]
    return f"{max(ks):.3g}" if ks else None


def _power_settings(record_id: str, platform: str, s: dict[str, Any]) -> str:
    policy = s["policy"] or {}
    seeds = (f"{s['seeds']} seeds ({s['first_seed']}..{s['first_seed'] + s['seeds'] - 1})"
             if s["seeds"] is not None and s["first_seed"] is not None else f"{s['seeds']} seeds")
    all_shapes = s["shapes"] or []
    shapes = ", ".join(f"{text(sh['name'])} {sh['batch']}x{sh['q_len']}x{sh['kv_len']} "
                       f"{sh['num_q_heads']}/{sh['num_kv_heads']} heads d{sh['head_dim']}" for sh in all_shapes)
    if len(all_shapes) > MAX_LISTED_SHAPES:  # drawn per seed: summarise (the parquet holds them all)
        dims = sorted({sh["head_dim"] for sh in all_shapes if sh["head_dim"] is not None})
        longest = max((sh["kv_len"] or 0) for sh in all_shapes)
        shapes = f"{len(all_shapes)} (head_dim {', '.join(map(str, dims))}; kv_len up to {longest})"
    paged = next((json.loads(o["json"]) for o in s["other"] or [] if o["name"] == "paged_shapes"), None)
    if paged:
        sizes = ", ".join(map(str, sorted({sh["page_size"] for sh in paged})))
        shapes += f"; paged shapes {len(paged)} (page sizes {sizes})"
    totals = []
    if s["correct_trials"] is not None:
        totals.append(f"false rejects {s['false_rejects']} of {s['correct_trials']} correct trials")
    if s["bad_trials"] is not None:
        totals.append(f"missed {s['missed_bad']} of {s['bad_trials']} known-bad trials")
    return (f"Record {code(record_id)} (measured on {text(platform)}: the grader's numerics, "
            f"not kernel speed): {seeds}; "
            f"shapes {shapes or '—'}; tolerance k forward {text(policy.get('k_forward'))}, gradient "
            f"{text(policy.get('k_gradient'))}, floor {text(policy.get('floor'))}"
            + (f"; {'; '.join(totals)}" if totals else "") + ".\n")


def power(correctness: pa.Table) -> str:
    """The grader-power tables of the latest sweep of each contract (per candidate: trials, rejections, by which
    check, needed k), newest first; the earlier sweeps folded under ``<details>``."""
    rows = [r for r in correctness.to_pylist() if r["row_kind"] == "power"]
    if not rows:
        return "_No record carries a grader-power summary yet._\n"
    by_record: dict[str, list] = {}
    for r in rows:
        by_record.setdefault(r["record_id"], []).append(r)
    latest, covered = [], set()
    for rid in sorted(by_record, reverse=True):  # ids end in their UTC stamp
        contracts = {r["contract"] for r in by_record[rid]}
        if contracts - covered:
            latest.append(rid)
            covered |= contracts
    earlier = [rid for rid in sorted(by_record, reverse=True) if rid not in latest]
    parts = [_power_table(by_record[rid]) for rid in latest]
    if earlier:
        parts.append("<details><summary>Earlier grader-power records</summary>\n\n"
                     + "\n".join(_power_table(by_record[rid]) for rid in earlier) + "\n</details>\n")
    return "\n".join(parts)


def _power_table(rows: list[dict[str, Any]]) -> str:
    out = []
    for r in rows:
        rate = f"{r['rejected'] / r['trials']:.0%}" if r["trials"] and r["rejected"] is not None else None
        by = ", ".join(f"{b['check']}: {b['count']}" for b in r["rejected_by"]) or None
        out.append([code(r["record_id"]), r["candidate"], r["contract"], r["kind"], r["expected"], r["trials"],
                    r["rejected"], rate, by, _needed_k(r["power_detail"])])
    rendered = table(["Record", "Candidate", "Contract", "Kind", "Expected", "Trials", "Rejected", "Rejection rate",
                      "Rejected by", "Needed k"], out)
    contracts = sorted({r["contract"] for r in rows})
    swept = (f"Contracts swept: {', '.join(contracts)}"
             + ("" if "paged" in contracts else " (the paged built-ins are not in this record)") + ".\n")
    return (_power_settings(rows[0]["record_id"], rows[0]["platform"], rows[0]["power_settings"]) + swept + "\n"
            + rendered)


def ratio_series(benchmark: pa.Table) -> list[dict[str, Any]]:
    """Ratios to the XLA reference: one series per (record, scope, implementation), its points sorted by
    sequence length: ``[seq_len, ratio, ci_low, ci_high, median ms, XLA median ms]``."""
    rows = benchmark.to_pylist()
    cases = {(r["record_id"], r["case_id"]): r for r in rows}
    series: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        for pair in r["pairs"]:
            base = cases[(r["record_id"], pair["baseline_case_id"])]
            if base["implementation"] != BASELINE or pair["ratio"] is None:
                continue
            scope = r["scope"] if r.get("model") is None else f"{r['scope']} {r['model']}"  # a mask: per model
            key = (r["record_id"], scope, r["implementation"], base["implementation"])
            entry = series.setdefault(key, {"record_id": key[0], "scope": key[1], "numerator": key[2],
                                            "baseline": key[3], "interpret": r["interpret"],
                                            "summary": r["source"] == "published-summary", "points": []})
            entry["points"].append([r["seq_len"], pair["ratio"], pair["ci_low"], pair["ci_high"], r["median_ms"],
                                    base["median_ms"]])
    for entry in series.values():
        entry["points"].sort()
    return [series[key] for key in sorted(series)]


def glance(benchmark: pa.Table, environment: pa.Table) -> str:
    """Results at a glance: the records by source, then every ratio to XLA from records timed on a TPU or
    GPU (never interpret mode), one sentence per kernel and a small table (record and scope by sequence)."""
    kinds: dict[str, list[str]] = {}
    for r in environment.to_pylist():
        kinds.setdefault(r["source"], []).append(f"{r['platform']}{', interpret' if r['interpret'] else ''}")
    held = "; ".join(f"{len(v)} {text(k)} ({', '.join(sorted(set(map(text, v))))})" for k, v in sorted(kinds.items()))
    head = f"Records today: {held or 'none'}.\n\n"
    series = [s for s in ratio_series(benchmark) if not s["interpret"]]
    if not series:
        return head + "_No record timed on a TPU or GPU holds a kernel / XLA pair yet._\n"
    sentences = []
    for kernel in sorted({s["numerator"] for s in series}):
        mine = [s for s in series if s["numerator"] == kernel]
        ratios = [p[1] for s in mine for p in s["points"]]
        slower = sum(r > 1 for r in ratios)
        records = "; ".join(sorted({f"{code(s['record_id'])}" + (", published medians" if s["summary"] else "")
                                    for s in mine}))
        sentences.append(f"The {code(kernel)} kernel was slower than XLA in {slower} of {len(ratios)} pairs: its "
                         f"median time was {min(ratios):.2f}x to {max(ratios):.2f}x XLA's (from {records}).")
    seqs = sorted({p[0] for s in series for p in s["points"]})
    rows = [[code(s["record_id"]), s["scope"], f"{s['numerator']} / {s['baseline']}",
             *[next((f"{p[1]:.2f}x" for p in s["points"] if p[0] == q), None) for q in seqs]] for s in series]
    return (head + " ".join(sentences) + " Ratios are median time over XLA's median time: above 1, slower than XLA.\n\n"
            + table(["Record", "Scope", "Ratio of", *[f"seq {q}" for q in seqs]], rows))


def figure_section(benchmark: pa.Table) -> str:
    rows = [[code(s["record_id"]), s["scope"], p[0], f"{s['numerator']} / {s['baseline']}", f"{p[4]:.4f}",
             f"{p[5]:.4f}", f"{p[1]:.2f}x", None if p[2] is None or p[3] is None else f"{p[2]:.2f}–{p[3]:.2f}"]
            for s in ratio_series(benchmark) for p in s["points"]]
    return (f"![Median-time ratio of each kernel to the XLA reference (Pallas / XLA) against sequence length, per "
            f"record and scope](data/{FIGURE})\n\n"
            + table(["Record", "Scope", "Sequence", "Ratio of", "Median (ms)", "XLA median (ms)",
                    "Ratio", f"{CONFIDENCE:.0%} CI"], rows))


def _window(window: tuple[int | None, int | None] | None) -> str | None:
    return None if window is None else f"({window[0]}, {window[1]})"


def masks(benchmark: pa.Table) -> str:
    """The masks models run (scopes ``masks-fwd`` / ``masks-fwd-bwd``): the cases each profile declares
    (``bench.cases.MaskedModel``: heads, window, soft-cap, sinks, documents, sizes, and the useful
    forward FLOPs its mask leaves, as the records count them), then every recorded case of those
    scopes, interpret-mode rows flagged."""
    from ..bench.cases import MASK_SCOPES, PROFILES, build_cases

    groups: dict[tuple, list[str]] = {}
    for name, profile in PROFILES.items():
        if profile.masks:
            groups.setdefault(profile.masks, []).append(name)
    declared = []
    for masks_, names in groups.items():
        profile = PROFILES[names[0]]
        cases, _ = build_cases(profile, ("masks-fwd",), platform="tpu")
        flops = {(c.model, c.seq_len, c.segments): c.flops for c in cases}
        for m in masks_:
            for seq, documents in m.variants():
                causal = 4.0 * m.num_q_heads * m.head_dim * m.batch_for(seq) * seq * (seq + 1) / 2
                useful = flops[(m.name, seq, documents)]
                declared.append([", ".join(names), code(m.name), f"{m.num_q_heads} / {m.num_kv_heads}", m.head_dim,
                                 _window(m.window), m.softcap, None if m.scale is None else f"{m.scale:.4g}",
                                 "yes" if m.sinks else None, documents, seq, m.batch_for(seq),
                                 f"{useful / 1e9:,.1f}" if useful >= 1e10 else f"{useful / 1e9:.3g}",
                                 f"{useful / causal:.3f}"])
    parts = [table(["Profiles", "Model", "Heads (q / kv)", "head_dim", "Window (left, right)", "Soft-cap", "Scale",
                    "Sinks", "Documents per row", "Sequence", "Batch", "Useful GFLOP (forward)",
                    "Of causal"], declared)]
    rows = [r for r in benchmark.to_pylist() if r["scope"] in MASK_SCOPES]
    if not rows:
        parts.append("_No record holds `masks-*` cases yet: `tpu-kernel-records measure` on a TPU or GPU (or, "
                     "in interpret mode, the `cpu` profile) writes them._\n")
    else:
        recorded = [[code(r["record_id"]), r["scope"], code(r["model"]), r["seq_len"], r["implementation"],
                     None if r["window"] is None else f"({r['window']['left']}, {r['window']['right']})",
                     r["softcap"], r["segments"], "yes" if r["sinks"] else None, f"{r['median_ms']:.4f}",
                     None if r["tflops"] is None else f"{r['tflops']:.3g}",
                     None if r["ratio_to_baseline"] is None
                     else f"{r['ratio_to_baseline']:.2f}x {text(r['baseline_case_id'])}",
                     "yes (not kernel speed)" if r["interpret"] else "no"]
                    for r in sorted(rows, key=lambda r: (r["record_id"], r["scope"], r["model"] or "", r["seq_len"],
                                                         r["case_id"]))]
        parts.append(table(["Record", "Scope", "Model", "Sequence", "Implementation", "Window", "Soft-cap",
                            "Documents per row", "Sinks", "Median (ms)", "TFLOP/s (useful)", "Ratio to baseline",
                            "Interpret mode"], recorded))
    return "\n".join(parts)


def paged(benchmark: pa.Table) -> str:
    """The paged decode steps (scope ``paged-decode``): the cases each profile declares
    (``bench.cases.PagedModel``: heads, window, page size, context, batch, table and pool, the
    sequences' lengths and the useful bytes as the records count them), then every recorded case of
    the scope, interpret-mode rows flagged."""
    from ..bench.cases import PAGED_SCOPES, PROFILES

    groups: dict[tuple, list[str]] = {}
    for name, profile in PROFILES.items():
        if profile.paged:
            groups.setdefault((profile.paged, profile.dtype), []).append(name)
    declared = []
    for (models, dtype), names in groups.items():
        itemsize = 2 if dtype == "bfloat16" else 4
        for m in models:
            for context, page_size in m.variants():
                lengths = m.lengths(context)
                _, table_pool = m.page_table(context, page_size)
                _, useful = m.work(context, itemsize)
                declared.append([", ".join(names), code(m.name), f"{m.num_q_heads} / {m.num_kv_heads}", m.head_dim,
                                 _window(m.window), page_size, context, len(lengths), context // page_size,
                                 table_pool, f"{int(lengths.min())}-{int(lengths.max())}",
                                 megabytes(useful)])
    parts = [table(["Profiles", "Model", "Heads (q / kv)", "head_dim", "Window (left, right)", "Page size",
                    "Context", "Batch", "Pages per sequence", "Pool pages", "Lengths", "Useful MB"], declared)]
    rows = [r for r in benchmark.to_pylist() if r["scope"] in PAGED_SCOPES]
    if not rows:
        parts.append("_No record holds `paged-decode` cases yet: `tpu-kernel-records measure` on a TPU or GPU (or, "
                     "in interpret mode, the `cpu` profile) writes them._\n")
    else:
        recorded = [[code(r["record_id"]), code(r["model"]), r["page_size"], r["seq_len"], r["batch"],
                     r["implementation"], f"{r['median_ms']:.4f}", None if r["gbps"] is None else f"{r['gbps']:.3g}",
                     None if r["ratio_to_baseline"] is None
                     else f"{r['ratio_to_baseline']:.2f}x {text(r['baseline_case_id'])}",
                     "yes (not kernel speed)" if r["interpret"] else "no"]
                    for r in sorted(rows, key=lambda r: (r["record_id"], r["model"] or "", r["seq_len"],
                                                         r["page_size"] or 0, r["case_id"]))]
        parts.append(table(["Record", "Model", "Page size", "Context", "Batch", "Implementation", "Median (ms)",
                            "GB/s (useful)", "Ratio to baseline", "Interpret mode"], recorded))
    return "\n".join(parts)


def figure_png(benchmark: pa.Table) -> bytes:
    """The ratio figure as PNG bytes: Agg, default style, no timestamp or software metadata.

    The sha256 of the plotted series is stored in the PNG text chunk ``FIGURE_KEY``, so a verifier
    can tell that the figure shows the current data without depending on pixel-exact rendering.
    """
    import matplotlib.style
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    series = ratio_series(benchmark)
    digest = figure_digest(series)
    with matplotlib.style.context("default"):
        fig = Figure(figsize=(8, 4.5), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for s in series:
            xs, ys = [p[0] for p in s["points"]], [p[1] for p in s["points"]]
            label = f"{s['record_id']} · {s['scope']} ({s['numerator']}/{s['baseline']})".replace("$", r"\$")
            if s["interpret"]:
                label += " [interpret: not kernel speed]"
            if s["summary"]:
                label += " [published medians]"
            ax.plot(xs, ys, marker="o", linestyle="--" if s["interpret"] else "-", label=label)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("median time / XLA median time (>1: slower)")
        ax.set_title("Pallas / XLA median-time ratio by sequence length")
        if series:
            ax.legend(fontsize=7, loc="upper left")
        else:
            ax.text(0.5, 0.5, "no paired cases yet", transform=ax.transAxes, ha="center")
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", metadata={"Software": None, FIGURE_KEY: digest})
    return buffer.getvalue()


def figure_digest(series: list[dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(series, sort_keys=True, allow_nan=False).encode()).hexdigest()


def png_text(png: bytes) -> dict[str, str]:
    """The tEXt chunks of a PNG (raises ``ValueError`` on a malformed file)."""
    if png[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG file")
    out, pos = {}, 8
    while pos + 8 <= len(png):
        length, kind = struct.unpack(">I4s", png[pos:pos + 8])
        data = png[pos + 8:pos + 8 + length]
        crc = png[pos + 8 + length:pos + 12 + length]
        if len(data) != length or len(crc) != 4 or struct.unpack(">I", crc)[0] != zlib.crc32(kind + data):
            raise ValueError(f"corrupt PNG chunk {kind!r} at byte {pos}")
        if kind == b"tEXt":
            key, _, value = data.partition(b"\0")
            out[key.decode("latin-1")] = value.decode("latin-1")
        pos += 12 + length
    return out


def usage(repo_id: str = PLACEHOLDER_REPO, tag: str = TAG) -> str:
    """How to load the release from ``repo_id`` at ``tag``: the parquet route, the script route on
    ``datasets`` 2.x/3.x, and the script's builder on 4 and later. ``publish`` names the real repo."""
    placeholder = (f"\n`{PLACEHOLDER_REPO}` stands for the repository the release is published to (`publish` writes "
                   "its real name here).") if repo_id == PLACEHOLDER_REPO else ""
    return f'''The configs are plain parquet, so `datasets` loads them directly (after accepting the terms and
logging in, `hf auth login` or `HF_TOKEN`); pin the release with its tag. Loading needs `datasets`
alone (`python -m pip install datasets`), not the source project or JAX.{placeholder}

```python
from datasets import load_dataset

bench = load_dataset("{repo_id}", "benchmark", split="train", revision="{tag}")
checks = load_dataset("{repo_id}", "correctness", split="train", revision="{tag}")
env = load_dataset("{repo_id}", "environment", split="train", revision="{tag}")
```

Every `datasets` version reads these parquet configs. The module `tpu_kernel_records` is the loading
script `tpu_kernel_records.py` that ships in this repository beside `data/` (the source project's
`pip install` installs it too). It gives the same rows and features and checks the sha256 of every
file against `data/SHA256SUMS`; with a downloaded copy of the release (e.g. `hf download {repo_id}
--repo-type dataset --revision {tag} --local-dir tpu-kernel-records`):

```python
import sys

sys.path.insert(0, "tpu-kernel-records")   # the downloaded release folder
from tpu_kernel_records import TpuKernelRecords, load

checks = load("correctness")                                      # data/ beside the script
builder = TpuKernelRecords(config_name="benchmark")               # the same, as a datasets builder
builder.download_and_prepare()
bench = builder.as_dataset(split="train")
env = load("environment", repo_id="{repo_id}", revision="{tag}")  # from the Hub
```

In a clone of the source project the script sits beside the checkout's `data/`, so the same
`load("correctness")`, run from the clone's root, reads the records there (no download).
`load` explains how to get access when the Hub refuses it; its cache is keyed on `data/SHA256SUMS`,
so changed data is never served from a stale cache. With `datasets` 2.x or 3.x,
`load_dataset("tpu-kernel-records/tpu_kernel_records.py", "benchmark", trust_remote_code=True)` runs
the script too; `datasets` 4 and later no longer run scripts through `load_dataset`.
'''


def usage_repo(text: str) -> str | None:
    """The repo id the card's usage section names (None where it names none)."""
    match = re.search(r'load_dataset\("([^"]+)", "benchmark"', extract(text, "usage"))
    return match.group(1) if match else None


def without_usage(text: str) -> str:
    """The card with its usage section emptied: what ``CARD.sha256`` covers, so that naming the repo at
    publish time is the only change a published README has over the built card."""
    return replace(text, {"usage": ""})


def sections(tables: dict[str, pa.Table]) -> dict[str, str]:
    """Every generated section of the card, from the combined tables of all records."""
    return {"dataset_info": dataset_info(tables), "glance": glance(tables["benchmark"], tables["environment"]),
            "fields": fields.section(tables), "records": records(tables["environment"]),
            "power": power(tables["correctness"]), "figure": figure_section(tables["benchmark"]),
            "masks": masks(tables["benchmark"]), "paged": paged(tables["benchmark"]),
            "ragged": ragged(tables["benchmark"]),
            "leaderboard": leaderboard(tables["benchmark"], tables["correctness"]),
            "usage": usage()}

