"""The card's ``ragged`` section: the serving steps each profile declares (``bench.ragged_profiles.RaggedModel``:
heads, the mix, page size, cache dtype, table and pool, and the useful bytes as the records count them), then every
recorded case of the ``ragged`` scope, interpret-mode rows flagged."""

from __future__ import annotations

import pyarrow as pa

from .markdown import code, megabytes, table, text


def ragged(benchmark: pa.Table) -> str:
    from ..bench.profiles import PROFILES, RAGGED_SCOPES
    from ..bench.ragged_profiles import KV_ITEMSIZE

    groups: dict[tuple, list[str]] = {}
    for name, profile in PROFILES.items():
        if profile.ragged:
            groups.setdefault((profile.ragged, profile.dtype), []).append(name)
    declared = []
    for (models, dtype), names in groups.items():
        for m in models:
            q_lens, kv_lens = m.mix()
            for page_size, kv_dtype in m.variants():
                table_, pool = m.page_table(page_size)
                _, useful = m.work(KV_ITEMSIZE[kv_dtype], 2 if dtype == "bfloat16" else 4)
                declared.append([", ".join(names), code(m.name), f"{m.num_q_heads} / {m.num_kv_heads}", m.head_dim,
                                 f"{m.decode_rows} x 1 ({int(kv_lens[:m.decode_rows].min())}-{m.decode_context})",
                                 ", ".join(f"{q} of {kv}" for q, kv in m.chunks), ", ".join(map(str, m.prompts)),
                                 f"{m.rows} ({m.num_tokens})", code(kv_dtype), page_size, table_.shape[1], pool,
                                 "yes" if m.xla_fits() else "no", megabytes(useful)])
    parts = [table(["Profiles", "Model", "Heads (q / kv)", "head_dim", "Decode rows (keys)", "Prefill chunks (rows "
                    "of keys)", "Whole prompts", "Query rows (padded)", "Cache", "Page size", "Pages per sequence",
                    "Pool pages", "XLA reference", "Useful MB"], declared)]
    rows = [r for r in benchmark.to_pylist() if r["scope"] in RAGGED_SCOPES]
    if not rows:
        parts.append("_No record holds `ragged` cases yet: `tpu-kernel-records measure` on a TPU or GPU (or, in "
                     "interpret mode, the `cpu` profile) writes them._\n")
    else:
        recorded = [[code(r["record_id"]), code(r["model"]), code(r["kv_dtype"]), r["page_size"], r["implementation"],
                     f"{r['median_ms']:.4f}", None if r["gbps"] is None else f"{r['gbps']:.3g}",
                     None if r["ratio_to_baseline"] is None
                     else f"{r['ratio_to_baseline']:.2f}x {text(r['baseline_case_id'])}",
                     "yes (not kernel speed)" if r["interpret"] else "no"]
                    for r in sorted(rows, key=lambda r: (r["record_id"], r["model"] or "", r["kv_dtype"] or "",
                                                         r["page_size"] or 0, r["case_id"]))]
        parts.append(table(["Record", "Model", "Cache", "Page size", "Implementation", "Median (ms)",
                            "GB/s (useful)", "Ratio to baseline", "Interpret mode"], recorded))
    return "\n".join(parts)
