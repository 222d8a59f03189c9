"""The static v5e plan's ragged rows: the ragged kernel against JAX's ``ragged_paged_attention``.

For a serving step (``RaggedStep``: each sequence's new rows and keys, the page size, heads, dtypes),
each kernel's page copies modelled from its DMA schedule (``ragged_dma_bytes``), the compiled
programs' traffic (``ragged_traffic``: BlockSpec operands, the modelled copies and XLA's ops outside
the kernel), the least bytes (``bench.roofline.ragged_work``) and the goals' ratios (``RAGGED_GOALS``).
Predicted from the compiler's plan and these models, not measured.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import numpy as np

from ..bench import compiled, pipeline
from ..bench.profiles import get_profile
from ..bench.ragged_profiles import QUANTIZED_SCALES
from ..bench.roofline import ragged_work

# The ragged rows' goals (issue 54): (row key, at most, label, what it is over); checked on the models.
RAGGED_GOALS = (("ragged_over_least", 1.1, "ragged / least",
                 "the least bytes: each visible key's K and V once, q, out"),
                ("ragged_over_jax", 1.0, "ragged / JAX ragged_paged_attention",
                 "JAX ragged_paged_attention's traffic"))
RAGGED_KERNELS = ("ragged-pallas", "jax-ragged")  # the project's ragged kernel, then its peer
JAX_DEVICE = "TPU v5"  # the name JAX's block-size table files a v5e under (``get_device_name``)
# JAX's kernel may use a v5e's whole VMEM: its tuned blocks of 64 pages of 128 keys need more than ours asks (64 MiB)
JAX_VMEM_LIMIT = 128 * 2 ** 20


class RaggedStep(NamedTuple):
    """One serving step at one model's shape: sequence ``i`` has ``q_lens[i]`` new rows, the last of
    its ``kv_lens[i]`` keys; ``num_tokens`` rows of q (padded), ``max_seqs`` table rows of
    ``pages_per_sequence`` pages of ``page_size`` keys; q in ``dtype``, the cache in ``kv_dtype``."""

    model: str
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    page_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    kv_dtype: str
    num_tokens: int
    max_seqs: int
    pages_per_sequence: int


def ragged_plan_steps(profile_name: str = "tpu-v5e") -> list[RaggedStep]:
    """The ragged rows' steps: every page size and cache dtype of the profile's ``RaggedModel`` s with
    ``plan``, each table as long as the longest sequence's pages."""
    profile = get_profile(profile_name)
    steps = []
    for m in profile.ragged:
        q_lens, kv_lens = m.mix()
        for page_size, kv_dtype in (m.variants() if m.plan else ()):
            steps.append(RaggedStep(m.name, tuple(map(int, q_lens)), tuple(map(int, kv_lens)), page_size,
                                    m.num_q_heads, m.num_kv_heads, m.head_dim, profile.dtype, kv_dtype,
                                    m.num_tokens, m.num_seqs, m.page_table(page_size)[0].shape[1]))
    return steps


def ragged_item_copies(q_lens, kv_lens, item_rows: int, page_size: int) -> list[tuple[int, int]]:
    """``(rows, pages)`` of each work item of the ragged kernel over a causal step (no window), in
    the kernel's order (``kernel_src.ragged.plan.schedule``; the padding rows' item, of no keys, not
    listed): one item per ``item_rows`` rows of a sequence, each copying its rows of q in and out
    and every page holding a key below its last row's position + 1 (``key_range``), once, whole."""
    items = []
    for q_len, length in zip(map(int, q_lens), map(int, kv_lens)):
        for j0 in range(0, q_len, item_rows):
            rows = min(item_rows, q_len - j0)
            items.append((rows, -(-min(length, length - q_len + j0 + rows) // page_size)))
    return items


def jax_block_visits(q_lens, kv_lens, num_queries_per_block: int, num_kv_per_block: int) -> list[int]:
    """Per sequence, the kv blocks JAX's ``ragged_paged_attention_kernel`` walks for it: its loop
    over q blocks of ``num_queries_per_block`` token rows, each visiting from the carried sequence on
    while the sequence's rows reach into the block, each visit walking blocks ``0, 1, ...`` of
    ``num_kv_per_block`` keys while the block starts below the sequence's kv length (no causal or
    window skipping)."""
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(int)
    num_seqs, visits, seq = len(q_lens), [0] * len(q_lens), 0
    for block_start in range(0, int(cu[-1]), num_queries_per_block):
        block_end, done = block_start + num_queries_per_block, False
        while not done and seq < num_seqs:
            visits[seq] += -(-int(kv_lens[seq]) // num_kv_per_block)
            done = cu[seq + 1] >= block_end
            seq = seq + 1 if cu[seq + 1] <= block_end else seq
    return visits


def ragged_dma_bytes(kernel: str, step: RaggedStep, blocks: dict[str, int]) -> int:
    """Bytes a ragged kernel's hand-written DMAs copy over one causal ``step`` (no window) at its block
    sizes ``blocks`` (``kernel_blocks``). ``ragged-pallas`` (``kernel_src.ragged.tpu``): per work item
    (``ragged_item_copies``, items of ``block_q * sub_tiles`` rows) every page its rows can see, once,
    whole (all kv heads), K and V, its rows of q in and its output rows out, and the padding rows past
    the last sequence's out (zeros). ``jax-ragged`` (its q and output are BlockSpec operands, not
    counted here): per kv block it walks (``jax_block_visits``) ``num_kv_pages_per_block`` whole pages
    (pages past the length copy the sequence's first page again: ``MultiPageAsyncCopyDescriptor``), K
    and V together."""
    kv_page = 2 * step.page_size * step.num_kv_heads * step.head_dim * np.dtype(step.kv_dtype).itemsize
    if kernel == "ragged-pallas":
        items = ragged_item_copies(step.q_lens, step.kv_lens, blocks["block_q"] * blocks["sub_tiles"],
                                   step.page_size)
        row = step.num_q_heads * step.head_dim * np.dtype(step.dtype).itemsize
        rows_in = sum(rows for rows, _ in items)
        return sum(pages for _, pages in items) * kv_page + (rows_in + step.num_tokens) * row
    if kernel == "jax-ragged":
        pages = blocks["num_kv_pages_per_block"]
        visits = jax_block_visits(step.q_lens, step.kv_lens, blocks["num_queries_per_block"], pages * step.page_size)
        return pages * sum(visits) * kv_page
    raise ValueError(f"no DMA model of {kernel!r}; choose from {RAGGED_KERNELS}")


def jax_block_sizes(step: RaggedStep) -> tuple[int, int]:
    """``(num_kv_pages_per_block, num_queries_per_block)`` that JAX's ``ragged_paged_attention`` picks
    for ``step`` on a v5e (its ``get_tuned_block_sizes`` with the v5e's device name; it asks a device
    for that name, so the plan names it)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel, tuned_block_sizes as tuned

    q_heads, combined = kernel.get_min_heads_per_blk(step.num_q_heads, 2 * step.num_kv_heads, step.dtype,
                                                     step.kv_dtype)
    key = tuned.simplify_key((step.dtype, step.kv_dtype, q_heads, combined // 2, step.head_dim,
                              step.page_size, step.num_tokens, step.pages_per_sequence))
    pages, queries = tuned.TUNED_BLOCK_SIZES.get(JAX_DEVICE, {}).get(key, (128, 32))
    return min(step.pages_per_sequence, pages), min(step.num_tokens, queries)


def step_arrays(step: RaggedStep) -> dict[str, np.ndarray]:
    """The step's scalar operands: int32 ``kv_lengths [max_seqs]``, ``page_indices [max_seqs,
    pages_per_sequence]`` (sequence ``i`` owns pages ``i * pages_per_sequence + t``), ``cu_q_lens
    [max_seqs + 1]``, ``num_seqs [1]``."""
    n, s, pps = len(step.q_lens), step.max_seqs, step.pages_per_sequence
    lengths = np.zeros(s, np.int32)
    lengths[:n] = step.kv_lens
    cu = np.full(s + 1, sum(step.q_lens), np.int32)
    cu[:n + 1] = np.concatenate([[0], np.cumsum(step.q_lens)])
    table = np.arange(s * pps, dtype=np.int32).reshape(s, pps)
    return dict(kv_lengths=lengths, page_indices=table, cu_q_lens=cu, num_seqs=np.array([n], np.int32))


def _scales(step: RaggedStep) -> dict[str, float]:
    return {} if step.kv_dtype == step.dtype else dict(zip(("k_scale", "v_scale"), QUANTIZED_SCALES))


def _programs(step: RaggedStep):
    """``{kernel: (fn, abstract args)}``: each kernel's call over the step, ``fn(q, pools...,
    kv_lengths, page_indices, cu_q_lens, num_seqs)``; JAX's on its own pool, K and V interleaved
    along the heads ``[pages, page_size, 2 * kv heads, head_dim]``."""
    import jax
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    from kernel_src.ragged import ragged_paged_attention_tpu

    pages = step.max_seqs * step.pages_per_sequence
    q = jax.ShapeDtypeStruct((step.num_tokens, step.num_q_heads, step.head_dim), step.dtype)
    pool = jax.ShapeDtypeStruct((pages, step.page_size, step.num_kv_heads, step.head_dim), step.kv_dtype)
    both = jax.ShapeDtypeStruct((pages, step.page_size, 2 * step.num_kv_heads, step.head_dim), step.kv_dtype)
    scalars = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in step_arrays(step).values()]
    kv_pages, queries = jax_block_sizes(step)

    def ours(q, k, v, lengths, table, cu, num_seqs):
        return ragged_paged_attention_tpu(q, k, v, kv_lengths=lengths, page_indices=table, cu_q_lens=cu,
                                          num_seqs=num_seqs, **_scales(step))

    theirs = functools.partial(ragged_paged_attention, sm_scale=step.head_dim ** -0.5,
                               num_kv_pages_per_block=kv_pages, num_queries_per_block=queries,
                               vmem_limit_bytes=JAX_VMEM_LIMIT, **_scales(step))
    return {"ragged-pallas": (ours, [q, pool, pool, *scalars]), "jax-ragged": (theirs, [q, both, *scalars])}


def ragged_kernel_plan(step: RaggedStep):
    """The ragged kernel's static plan (``kernel_src.ragged.plan.RaggedPlan``) of ``step`` compiled for a v5e
    at its default block sizes (``kernel_src.ragged.api.ragged_plan``: VMEM fitted as a v5e's)."""
    from kernel_src.contract import RaggedDims
    from kernel_src.ragged.api import ragged_plan

    dims = RaggedDims(step.num_tokens, step.num_q_heads, step.num_kv_heads, step.head_dim,
                      step.max_seqs * step.pages_per_sequence, step.page_size, step.max_seqs, step.pages_per_sequence,
                      step.kv_dtype)
    return ragged_plan("mosaic", dims, np.dtype(step.dtype).itemsize, "tpu", False)[0]


def kernel_blocks(step: RaggedStep) -> dict[str, dict[str, int]]:
    """Each kernel's block sizes on a v5e at ``step``'s sizes: the ragged kernel's rows per tile and tiles
    per item (``ragged_kernel_plan``) and JAX's tuned ones (``jax_block_sizes``)."""
    plan = ragged_kernel_plan(step)
    kv_pages, queries = jax_block_sizes(step)
    return {"ragged-pallas": dict(block_q=plan.block_q, sub_tiles=plan.sub_tiles),
            "jax-ragged": dict(num_queries_per_block=queries, num_kv_pages_per_block=kv_pages)}


def ragged_traffic(step: RaggedStep, kernel: str, fn, abstract_args) -> dict[str, Any]:
    """One kernel's step program compiled for v5e and modelled: ``vmem_bytes``, ``outside_bytes``,
    ``declared_bytes``, ``pipeline_bytes`` (BlockSpec operands, ``bench.pipeline``), ``dma_bytes``
    (``ragged_dma_bytes``) and ``traffic_bytes`` (their sum with the bytes outside)."""
    import jax

    # JAX's kernel lowers ``lax.sign`` by the default device's TPU generation: make it the v5e's
    with jax.default_device(compiled.v5e_devices()[0]):
        facts = compiled.analyse(compiled.compile_program(fn, compiled.on_v5e(abstract_args)))
    scalars = step_arrays(step)
    first = len(abstract_args) - len(scalars)
    records = pipeline.kernel_traffic(fn, abstract_args, known={first + i: v for i, v in enumerate(scalars.values())})
    blocks = kernel_blocks(step)[kernel]
    dma = ragged_dma_bytes(kernel, step, blocks)
    piped = pipeline.total_bytes(records)
    declared = [k["declared_bytes"] for k in facts["kernels"]]
    return dict(kernels=len(facts["kernels"]), vmem_bytes=facts["vmem_bytes"], outside_bytes=facts["outside_bytes"],
                declared_bytes=None if None in declared else sum(declared), pipeline_bytes=piped, dma_bytes=dma,
                traffic_bytes=None if piped is None else piped + dma + facts["outside_bytes"], **blocks)


def ragged_least_bytes(step: RaggedStep) -> float:
    """The least bytes of a step (``bench.roofline.ragged_work``)."""
    return ragged_work(np.array(step.q_lens), np.array(step.kv_lens), step.num_q_heads, step.num_kv_heads,
                       step.head_dim, np.dtype(step.kv_dtype).itemsize, np.dtype(step.dtype).itemsize)[1]


def ragged_ratios(row: dict[str, Any]) -> dict[str, float | None]:
    """A ragged row's ``ragged_over_least`` and ``ragged_over_jax`` (``None`` without both bytes)."""
    kernels = row.get("kernels") or {}
    ours = kernels.get("ragged-pallas", {}).get("traffic_bytes")
    theirs = kernels.get("jax-ragged", {}).get("traffic_bytes")
    least = row.get("least_bytes")
    return dict(ragged_over_least=None if ours is None or not least else ours / least,
                ragged_over_jax=None if ours is None or not theirs else ours / theirs)


def ragged_goals(row: dict[str, Any]) -> dict[str, bool | None]:
    """Whether each ``RAGGED_GOALS`` ratio of a ragged row is met (``None``: no ratio); ours must be
    strictly below JAX's."""
    return {key: None if row.get(key) is None else (row[key] <= bound if key.endswith("least") else row[key] < bound)
            for key, bound, _, _ in RAGGED_GOALS}


def ragged_row(step: RaggedStep) -> dict[str, Any]:
    """A ragged row: both kernels' step programs compiled for v5e and modelled, the least bytes,
    the ratios and goals."""
    row = dict(scope="ragged", **step._asdict(), least_bytes=ragged_least_bytes(step),
               kernels={name: ragged_traffic(step, name, *program) for name, program in _programs(step).items()})
    row["q_lens"], row["kv_lens"] = list(step.q_lens), list(step.kv_lens)
    row.update(ragged_ratios(row))
    row["goals_met"] = ragged_goals(row)
    return row


def ragged_rows(profile_name: str = "tpu-v5e", progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Rows for every step of ``ragged_plan_steps``."""
    reason = compiled.unavailable_reason()
    if reason is not None:
        raise ValueError(f"cannot compile for TPU v5e here: {reason}")
    rows = []
    for step in ragged_plan_steps(profile_name):
        if progress:
            progress(f"compiling ragged {step.model} page size {step.page_size} cache {step.kv_dtype}")
        rows.append(ragged_row(step))
    return rows


def _verdict(row: dict[str, Any]) -> str:
    met = row.get("goals_met") or {}
    if any(met.get(key) is None for key, _, _, _ in RAGGED_GOALS):
        return "not modelled"
    missed = [f"{label} {row[key]:.3f}" for key, _, label, _ in RAGGED_GOALS if not met[key]]
    return "met" if not missed else "**not met**: " + ", ".join(missed)


def _mb(value) -> str:
    return "undeclared" if value is None else f"{value / 1e6:,.1f}"


def ragged_markdown(rows: list[dict[str, Any]], label: str, escape: Callable[[Any], str] = str) -> list[str]:
    """The ragged rows' section of the plan (lines; none without rows): the table, each row's verdict on
    ``RAGGED_GOALS``, and how to read it; ``label`` says it is a prediction."""
    if not rows:
        return []
    goals = "; ".join(f"*{name}* {'at most' if key.endswith('least') else 'below'} {bound} (over {what})"
                      for key, bound, name, what in RAGGED_GOALS)
    met = sum(_verdict(r) == "met" for r in rows)
    lines = [
        "## Ragged rows: the ragged kernel against JAX's `ragged_paged_attention`", "",
        f"**{label}** Page copies are modelled from each kernel's DMA schedule, the rest as above.", "",
        f"The goals (issue 54), stated as predictions: {goals}. Verdict: met at {met} of {len(rows)} steps.", "",
        "| model | page size | cache | sequences (decode / chunks / prompts) | rows | least (MB) "
        "| ragged traffic (MB) | of it outside the kernel (MB) | ragged / least | JAX (MB) | ragged / JAX "
        "| ragged VMEM (MiB) | JAX VMEM (MiB) | goal |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ours, theirs = r["kernels"]["ragged-pallas"], r["kernels"]["jax-ragged"]
        kinds = [sum(q == 1 for q in r["q_lens"]),
                 sum(1 < q < k for q, k in zip(r["q_lens"], r["kv_lens"])),
                 sum(1 < q == k for q, k in zip(r["q_lens"], r["kv_lens"]))]
        ratio = [("undeclared" if r.get(key) is None else f"{r[key]:.3f}") for key, _, _, _ in RAGGED_GOALS]
        lines.append(
            f"| {escape(r['model'])} | {r['page_size']} | {escape(r['kv_dtype'])} | {' / '.join(map(str, kinds))} "
            f"| {sum(r['q_lens'])} | {_mb(r['least_bytes'])} | {_mb(ours.get('traffic_bytes'))} "
            f"| {_mb(ours.get('outside_bytes'))} | {ratio[0]} | {_mb(theirs.get('traffic_bytes'))} | {ratio[1]} "
            f"| {ours['vmem_bytes'] / 2 ** 20:.2f} | {theirs['vmem_bytes'] / 2 ** 20:.2f} | {_verdict(r)} |")
    lines += ["", "How to read it:", "",
              "- The steps are the profile's `RaggedModel` mixes (`bench.ragged_profiles`): decode rows, chunks of "
              "a prefill and a whole prompt in one call, causal, bf16 queries, the cache in bf16 or float8_e4m3fn "
              "(scaled); JAX's `ragged_paged_attention` gets the same cache with K and V interleaved along the heads "
              "(its own layout), the block sizes its tuned table gives a v5e, and a v5e's whole VMEM as its scoped "
              "limit (its blocks of 64 pages of 128 keys need more than the 64 MiB ours asks for).",
              "- *least*: each key some row sees, its K and V read once, plus q and the output "
              "(`bench.roofline.ragged_work`); no kernel can move less.",
              "- *ragged traffic*, *JAX*: the copies each kernel's DMA schedule makes "
              "(`bench.plan_ragged.ragged_dma_bytes`: the ragged kernel, per work item of up to `block_q` x "
              "`sub_tiles` rows of one sequence, every page its rows can see, once, and exactly its rows of q in "
              "and of the output out, the padding rows written as zeros; JAX's, per block of "
              "`num_queries_per_block` token rows and sequence in it, every block of `num_kv_pages_per_block` pages "
              "from the first to the length, no causal skipping), plus the BlockSpec operands the pipeline model "
              "counts (JAX's q and output), plus the bytes of the XLA ops around the kernel (the ragged kernel's: "
              "its work list; and, for both kernels, where q's heads fill no whole sublane tiles, as qwen2.5-7b's 28, "
              "the copies that turn q from the layout TPU gives a program's parameter into the row-major one a "
              "Pallas call takes, and the output back: about four times q's bytes).",
              "- *ragged / least* above 1 is each sequence's last page read whole, a prompt's first pages read once "
              "per work item of its rows (items of "
              f"{', '.join(sorted({str(_item_rows(r)) for r in rows}))} rows), and the padding rows' zeros; "
              "*ragged / JAX* below 1 is JAX's reading every page of a "
              "sequence, whole blocks of them, once per block of `num_queries_per_block` token rows it has rows in.",
              ""]
    return lines


def _item_rows(row: dict[str, Any]):
    blocks = row["kernels"]["ragged-pallas"]
    return None if blocks.get("block_q") is None else blocks["block_q"] * blocks.get("sub_tiles", 1)


_NUMBERS = ("vmem_bytes", "outside_bytes", "declared_bytes", "pipeline_bytes", "dma_bytes", "traffic_bytes")


def _close(a, b) -> bool:
    return a is None and b is None or a is not None and b is not None and abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1)


def ragged_row_problem(row: Any, profile_name: str = "tpu-v5e") -> tuple[str, str] | None:
    """``(field, message)`` of the first thing wrong with a ragged plan row, or ``None``: it must be a step of
    ``ragged_plan_steps``, and its least bytes, each kernel's block sizes, page copies (``ragged_dma_bytes``),
    traffic, the ratios and the goals' verdicts must follow from it."""
    if not isinstance(row, dict):
        return "", "not an object"
    step = RaggedStep(*(tuple(row.get(k) or ()) if k.endswith("_lens") else row.get(k) for k in RaggedStep._fields))
    if step not in ragged_plan_steps(profile_name) or row.get("scope") != "ragged":
        return "model", f"{step.model!r} at page size {step.page_size} ({step.kv_dtype}) is no ragged plan step"
    if not _close(row.get("least_bytes"), ragged_least_bytes(step)):
        return "least_bytes", f"{row.get('least_bytes')!r}, but the step's least bytes are {ragged_least_bytes(step)!r}"
    kernels = row.get("kernels")
    if not isinstance(kernels, dict) or set(kernels) != set(RAGGED_KERNELS):
        return "kernels", f"must name exactly {RAGGED_KERNELS}"
    blocks = kernel_blocks(step)
    for name, k in kernels.items():
        for key in _NUMBERS:
            value = k.get(key)
            if value is not None and not (type(value) in (int, float) and np.isfinite(value) and value >= 0):
                return f"kernels/{name}/{key}", f"{value!r} is not a finite number >= 0"
        if {key: k.get(key) for key in blocks[name]} != blocks[name]:
            return f"kernels/{name}", f"block sizes {({key: k.get(key) for key in blocks[name]})!r}, not {blocks[name]!r}"
        dma = ragged_dma_bytes(name, step, blocks[name])
        if k.get("dma_bytes") != dma:
            return f"kernels/{name}/dma_bytes", f"{k.get('dma_bytes')!r}, but its DMA schedule copies {dma!r}"
        traffic = None if k.get("pipeline_bytes") is None else k["pipeline_bytes"] + dma + (k.get("outside_bytes") or 0)
        if not _close(k.get("traffic_bytes"), traffic):
            return f"kernels/{name}/traffic_bytes", f"{k.get('traffic_bytes')!r}, but it follows as {traffic!r}"
    for key, value in ragged_ratios(row).items():
        if not _close(row.get(key), value):
            return key, f"{row.get(key)!r}, but it follows as {value!r}"
    if row.get("goals_met") != ragged_goals(row):
        return "goals_met", f"{row.get('goals_met')!r}, but the ratios give {ragged_goals(row)!r}"
    return None
