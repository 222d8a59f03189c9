"""The static v5e plan's paged rows: the paged decode kernel against JAX's ``paged_attention``.

The shapes (``paged_plan_shapes``: the profile's paged models with ``PagedModel.plan``), each kernel's page
copies modelled from its DMA schedule (``paged_dma_bytes``), the compiled programs' traffic
(``paged_traffic``), the least bytes, and the goals' ratios (``PAGED_GOALS``). ``bench.plan`` renders them;
its module docstring says what the rows mean. Predicted, not measured.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, NamedTuple

import numpy as np

from ..bench import compiled, pipeline
from ..bench.cases import PAGED_SCOPES, build_cases, get_profile

# The paged rows' goals (issue 36): (row key, at most, label, what it is over); checked on the models.
PAGED_GOALS = (("paged_over_least", 1.1, "paged / least", "the least bytes: each visible key's K and V once, q, out"),
               ("paged_over_jax", 1.0, "paged / JAX paged_attention", "JAX paged_attention's traffic"))
PAGED_KERNELS = ("paged-pallas", "jax-paged")  # the project's paged kernel, then its peer


class PagedShape(NamedTuple):
    """One paged plan row: a ``paged-decode`` case's model, context and page size."""

    model: str
    seq: int
    page_size: int


def paged_plan_shapes(profile_name: str = "tpu-v5e", seq_lens: Iterable[int] | None = None) -> list[PagedShape]:
    """The paged rows' shapes: every context and page size of the profile's paged models with
    ``PagedModel.plan`` (``seq_lens`` restricts the contexts)."""
    wanted = None if seq_lens is None else set(seq_lens)
    return [PagedShape(m.name, context, page_size) for m in get_profile(profile_name).paged if m.plan
            for context, page_size in m.variants() if wanted is None or context in wanted]


def paged_dma_bytes(kernel: str, lengths: np.ndarray, page_size: int, num_kv_heads: int, head_dim: int,
                    itemsize: int, pages_per_block: int = 1) -> int:
    """K and V bytes a paged kernel's hand-written DMAs copy over sequences of ``lengths`` keys (no window):
    ``paged-pallas`` copies every page holding a key of the sequence once, whole (all kv heads;
    ``kernel_src.paged.tpu``); ``jax-paged`` copies, per kv head, every block of ``pages_per_block`` pages
    whose first key is below the length (JAX's ``paged_flash_attention_kernel``: ``i * bk < length``)."""
    keys = page_size * (pages_per_block if kernel == "jax-paged" else 1)
    if kernel not in PAGED_KERNELS:
        raise ValueError(f"no DMA model of {kernel!r}; choose from {PAGED_KERNELS}")
    copied = sum(-(-int(n) // keys) * keys for n in lengths)  # keys of whole pages (blocks) copied
    return 2 * copied * num_kv_heads * head_dim * itemsize


def paged_traffic(case, model) -> dict[str, Any]:
    """One paged case's program compiled for v5e and modelled: ``kernels``, ``vmem_bytes``,
    ``outside_bytes``, the kernels' ``declared_bytes`` / ``declared_flops`` (``pl.CostEstimate``),
    ``pipeline_bytes`` (BlockSpec operands, ``bench.pipeline``), ``dma_bytes`` (``paged_dma_bytes``),
    ``traffic_bytes`` (their sum with the bytes outside) and ``pages_per_block`` (JAX's). ``model``: the
    case's ``PagedModel`` (its lengths and table are the scalar-prefetch values the pipeline model needs)."""
    from kernel_src.vendor import jax_pages_per_block

    facts = compiled.analyse(compiled.compile_program(case.fn, compiled.on_v5e(case.abstract_args)))
    lengths, (table, _) = model.lengths(case.seq_len), model.page_table(case.seq_len, case.page_size)
    records = pipeline.kernel_traffic(case.fn, case.abstract_args, known={3: lengths, 4: table})
    manual = [e for r in records for e in r["inputs"] if e.get("note", "").startswith("memory_space ANY")]
    if len(manual) != 2:  # the K and V pools, and nothing else copied by hand
        raise ValueError(f"{case.case_id}: expected the two pools in memory_space ANY, found {len(manual)}")
    blocks = jax_pages_per_block(case.page_size, case.pages) if case.implementation == "jax-paged" else 1
    dma = paged_dma_bytes(case.implementation, lengths, case.page_size, model.num_kv_heads, model.head_dim,
                          np.dtype(case.dtype).itemsize, blocks)
    piped = pipeline.total_bytes(records)
    undeclared = any(kern["declared_bytes"] is None for kern in facts["kernels"])
    return dict(kernels=len(facts["kernels"]), vmem_bytes=facts["vmem_bytes"], outside_bytes=facts["outside_bytes"],
                declared_bytes=None if undeclared else sum(kern["declared_bytes"] for kern in facts["kernels"]),
                declared_flops=None if undeclared else sum(kern["declared_flops"] for kern in facts["kernels"]),
                pipeline_bytes=piped, dma_bytes=dma, pages_per_block=blocks,
                traffic_bytes=None if piped is None else piped + dma + facts["outside_bytes"])


def paged_least_bytes(profile_name: str, shape: PagedShape) -> float:
    """The least bytes of a paged row: the benchmark's useful bytes of its case (``PagedModel.work``)."""
    profile = get_profile(profile_name)
    model = next(m for m in profile.paged if m.name == shape.model)
    return model.work(shape.seq, np.dtype(profile.dtype).itemsize)[1]


def paged_ratios(row: dict[str, Any]) -> dict[str, float | None]:
    """A paged row's ``paged_over_least`` and ``paged_over_jax`` from its bytes (``None`` without both)."""
    ours = (row.get("kernels") or {}).get("paged-pallas", {}).get("traffic_bytes")
    jax_ = (row.get("kernels") or {}).get("jax-paged", {}).get("traffic_bytes")
    least = row.get("least_bytes")
    return dict(paged_over_least=None if ours is None or not least else ours / least,
                paged_over_jax=None if ours is None or not jax_ else ours / jax_)


def paged_goals(row: dict[str, Any]) -> dict[str, bool | None]:
    """Whether each ``PAGED_GOALS`` ratio of a paged row is met (``None``: no ratio)."""
    return {key: None if row.get(key) is None else row[key] <= bound for key, bound, _, _ in PAGED_GOALS}


def paged_row(profile_name: str, shape: PagedShape) -> dict[str, Any]:
    """A paged row: the benchmark's decode-step programs of the paged kernel and of JAX's ``paged_attention``
    at ``shape`` compiled for v5e and modelled (``paged_traffic``), the least bytes, the ratios and goals."""
    profile = get_profile(profile_name)
    cases, _ = build_cases(profile, PAGED_SCOPES, platform="tpu")
    mine = {c.implementation: c for c in cases
            if (c.model, c.seq_len, c.page_size) == (shape.model, shape.seq, shape.page_size)}
    first = mine["paged-pallas"]
    model = next(m for m in profile.paged if m.name == shape.model)
    row = dict(scope="paged-decode", model=shape.model, seq=shape.seq, page_size=shape.page_size,
               pages=first.pages, pool_pages=first.pool_pages, batch=first.shape["batch"],
               num_q_heads=first.shape["num_q_heads"], num_kv_heads=first.shape["num_kv_heads"],
               head_dim=first.shape["head_dim"], mode="fwd", least_bytes=paged_least_bytes(profile_name, shape),
               kernels={name: paged_traffic(mine[name], model) for name in PAGED_KERNELS})
    row.update(paged_ratios(row))
    row["goals_met"] = paged_goals(row)
    return row


def paged_rows(profile_name: str = "tpu-v5e", seq_lens: Iterable[int] | None = None,
               progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Rows for every shape of ``paged_plan_shapes``."""
    reason = compiled.unavailable_reason()
    if reason is not None:
        raise ValueError(f"cannot compile for TPU v5e here: {reason}")
    rows = []
    for shape in paged_plan_shapes(profile_name, seq_lens):
        if progress:
            progress(f"compiling paged-decode {shape.model} seq {shape.seq} page size {shape.page_size}")
        rows.append(paged_row(profile_name, shape))
    return rows
