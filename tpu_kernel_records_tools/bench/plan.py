"""The static performance plan: flash attention and the XLA reference compiled for TPU v5e.

For each sequence length of a profile's ``flash`` scope, and each of its model-sized shapes where the
benchmark also runs the XLA reference (``plan_shapes``), ``flash_attention`` and
``reference_attention`` are compiled for one v5e chip (``bench.compiled``; no TPU needed), the
forward alone and the forward + backward (the VJP's gradients, given an output cotangent). From
each compiled program:

* bytes outside the kernels: read + write bytes of the XLA ops around the Pallas kernels
  (relayout copies, padding, the clip of kv_lengths), parsed from the optimized HLO;
* the kernels' least traffic and FLOPs: what their ``pl.CostEstimate`` declares (every operand
  read once, every result written once; matmul FLOPs over the causally visible pairs);
* the kernels' modelled traffic: what their Pallas pipelines move (``bench.pipeline``: a block is
  copied when its index changes between consecutive grid steps), every key valid
  (``kv_lengths = seq``, as the peers see them); traffic = modelled + bytes outside;
* VMEM: the most scoped VMEM any one kernel reserves;
* floor: the roofline floor ``max(FLOPs / 197 TFLOP/s, bytes / 819 GB/s)`` (v5e, bf16), with
  flash's bytes = its traffic, and XLA's FLOPs and bytes from its own cost analysis (its fp32
  logits round-trip HBM);
* flash / XLA: the ratio of the two floors;
* peers (``bench.peers``: JAX's splash attention at 512 tiles and at its defaults, JAX's Pallas
  flash attention), compiled the same way at the same shape on their own ``[b, h, s, d]``
  layout: modelled kernel bytes + bytes outside their kernels, and flash's traffic over the best
  (least) of them.

Windowed rows (``masks-fwd`` and ``masks-fwd-bwd``, model ``mistral-7b``: the profile's masked models
with ``MaskedModel.plan_seq_lens``): the flash kernels compiled with the model's window at its
batch and length (32k keys, window 4,096: ``window_size=(4095, 0)``, unpadded, no ``kv_lengths``)
against splash attention with ``LocalMask`` (``bench.peers.WINDOWED``; JAX's Pallas flash has no
window), each modelled as above. No XLA reference: its fp32 logits need hundreds of GB there. Each
states, as models and predictions, the issue's goal (``WINDOW_GOALS``):

* flash / splash-512: flash's traffic over splash-512's (``LocalMask``), at most 0.6;
* flash / visible least: flash's traffic over the least the visible blocks need
  (``visible_block_least``: at flash's own tiles, each query tile reads each key tile holding a key
  visible to one of its rows once, the dK/dV kernel each query tile holding a row that sees one of
  its keys once, every other operand once), plus the bytes outside the kernels: at most 1.2;
* for context (no goal), flash / every operand once: over the kernels' declared least traffic (every
  operand read once and every result written once: what no tiling can go below).

Paged rows (``paged-decode``, ``bench.plan_paged.paged_rows``: the profile's paged models with ``PagedModel.plan``, every
context and page size of theirs): the benchmark's own decode-step programs (``bench.cases``: the same
lengths, tables and pools) of the project's paged kernel (``paged-pallas``) and of JAX's
``paged_attention`` (``jax-paged``, on its own heads-first pools) compiled for v5e. Both copy K/V pages by
hand (``memory_space=ANY``), which the pipeline model does not see, so their page copies are modelled from
each kernel's DMA schedule (``paged_dma_bytes``): the project's kernel copies each page a sequence reaches
once, whole (``kernel_src.paged.tpu``), JAX's every block of ``pages_per_compute_block`` pages, per kv
head, that starts before the sequence's length; their BlockSpec operands (q, out, statistics) by the
pipeline model. Traffic = page copies + pipeline + bytes outside the kernels. Each row states, as
predictions, the issue's goals (``PAGED_GOALS``): the paged kernel's traffic at most 1.1x the least bytes
(each visible key's K and V read once, q and out: ``bench.roofline.paged_work``, the benchmark's useful
bytes) and at most JAX's ``paged_attention``'s.

All of it is the compiler's plan: predicted, not measured. A measured TPU record replaces it.
"""

from __future__ import annotations

import datetime
from typing import Any, Callable, Iterable, NamedTuple

import numpy as np

import jax
import jax.numpy as jnp

from ..bench import compiled, peers, pipeline, roofline
from ..bench.cases import MASK_SCOPES, MODEL_SCOPES, get_profile, kv_lengths_for
from ..bench.plan_paged import PAGED_GOALS, paged_dma_bytes  # noqa: F401 (named in the plan's notes as bench.plan.paged_dma_bytes)
from ..bench.plan_ragged import ragged_markdown

LABEL = ("Predicted by the TPU compiler, not measured: programs compiled for a TPU v5e by libtpu "
         "on a machine without a TPU (nothing ran).")
MODES = ("fwd", "fwd+bwd")
_MB, _MIB = 1e6, 2 ** 20
# The windowed rows' goal (issue 35): (row key, at most, what it is over); checked on the models.
WINDOW_GOALS = (("flash_over_splash_512", 0.6, "flash / splash-512", "splash-512's traffic with LocalMask"),
                ("flash_over_visible_least", 1.2, "flash / visible least", "the least traffic the visible blocks need"))
TILE_KEYS = ("block_q", "block_k", "block_q_dq", "block_k_dq", "block_q_dkv", "block_k_dkv")


def _programs() -> dict[str, Callable[..., Any]]:
    from kernel_src import flash_attention, reference_attention

    return {"flash": flash_attention, "xla": reference_attention}


def _program(kernel, causal: bool, mode: str):
    """``(q, k, v, lengths[, ct]) -> out`` (forward) or ``-> (dq, dk, dv)`` (forward + backward)."""
    def forward(q, k, v, lengths):
        return kernel(q, k, v, causal=causal, kv_lengths=lengths)
    if mode == "fwd":
        return forward

    def forward_backward(q, k, v, lengths, ct):
        _, pullback = jax.vjp(lambda q, k, v: forward(q, k, v, lengths), q, k, v)
        return pullback(ct)
    return forward_backward


def _floor_ms(flops: float, nbytes: float, peak: roofline.Peak) -> float:
    return 1e3 * max(flops / peak.flops_per_s, nbytes / peak.bytes_per_s)


class Shape(NamedTuple):
    """One plan row's problem: ``scope`` is ``flash`` (the profile's flash scope), a model scope or a
    masks scope (then ``window`` and ``model`` name the masked model's window)."""

    scope: str
    batch: int
    seq: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    mode: str
    window: tuple[int, int] | None = None
    model: str | None = None


def plan_shapes(profile_name: str = "tpu-v5e", seq_lens: Iterable[int] | None = None,
                modes: Iterable[str] = MODES) -> list[Shape]:
    """Every shape the plan compiles: the profile's ``flash`` scope at each of its sequence lengths (or
    ``seq_lens``), then its model-sized shapes (``bench.cases.ModelShapes``) wherever the benchmark
    also runs the XLA reference there (``ModelShapes.xla_fits``: elsewhere it needs more HBM than a
    v5e has, and there is no ratio to predict), then its masked models' windowed rows
    (``MaskedModel.plan_seq_lens``, at the model's batch). ``seq_lens`` restricts all three."""
    modes = list(modes)
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose from {MODES}")
    profile = get_profile(profile_name)
    wanted = None if seq_lens is None else set(seq_lens)
    shapes = [Shape("flash", profile.batch_for("flash", seq), seq, profile.num_q_heads, profile.num_kv_heads,
                    profile.head_dim, mode)
              for seq in (seq_lens or profile.seq_lens_for("flash")) for mode in modes]
    model = profile.model
    if model is not None:
        for hq, hk in model.heads:
            for seq in model.seq_lens:
                for mode, scope in zip(MODES, MODEL_SCOPES):
                    if mode in modes and (wanted is None or seq in wanted) and model.xla_fits(scope, hq, seq):
                        shapes.append(Shape(scope, model.batch, seq, hq, hk, model.head_dim, mode))
    for masked in profile.masks:
        for seq in masked.plan_seq_lens:
            for mode, scope in zip(MODES, MASK_SCOPES):
                if mode in modes and (wanted is None or seq in wanted):
                    shapes.append(Shape(scope, masked.batch_for(seq), seq, masked.num_q_heads,
                                        masked.num_kv_heads, masked.head_dim, mode, tuple(masked.window),
                                        masked.name))
    return shapes


def visible_tile_pairs(seq: int, window: tuple[int | None, int | None] | None, block_q: int,
                       block_k: int) -> tuple[int, int]:
    """``(query-tile rows, key-tile rows)`` summed over every (query tile, key tile) pair that holds a
    visible (query, key) pair of the contract's mask: causal, ``window``, ``q_len == kv_len == seq``,
    every key valid. From each row's interval of visible keys (``roofline``'s), marked on the tile
    grid with a difference array: exact for any interval mask."""
    lo, hi = roofline._row_intervals(seq, seq, True, seq, window)
    rows = np.arange(seq)
    keep = hi >= lo
    n_q, n_k = -(-seq // block_q), -(-seq // block_k)
    marks = np.zeros((n_q, n_k + 1), np.int64)
    np.add.at(marks, (rows[keep] // block_q, lo[keep] // block_k), 1)
    np.add.at(marks, (rows[keep] // block_q, hi[keep] // block_k + 1), -1)
    visible = np.cumsum(marks, axis=1)[:, :n_k] > 0
    q_rows = np.minimum(block_q, seq - block_q * np.arange(n_q))
    k_rows = np.minimum(block_k, seq - block_k * np.arange(n_k))
    return int((visible * q_rows[:, None]).sum()), int((visible * k_rows[None, :]).sum())


def visible_block_least(shape: Shape, tiles: dict[str, int], declared_bytes: float, itemsize: int) -> float:
    """The least HBM bytes flash's kernels need for the blocks a window leaves visible, at their own
    tiles (``tiles``: ``TILE_KEYS``): the kernels' declared least (``declared_bytes``: every operand
    read once, every result written once) plus the re-reads the visible blocks force, as the
    FlashAttention-2 passes stream them: the forward and dQ kernels read each key tile's K and V once
    for every query tile with a row that sees one of its keys; the dK/dV kernel reads each query
    tile's Q, dO and its rows' fp32 statistics (log-sum-exp, di) once for every key tile one of its
    rows sees. Nothing for blocks no row of the tile sees; nothing for keeping a block across steps."""
    rows = shape.batch  # per sequence position, all heads
    kv_row = 2 * shape.num_kv_heads * shape.head_dim * itemsize  # K and V
    q_row = 2 * shape.num_q_heads * shape.head_dim * itemsize + 2 * 4 * shape.num_q_heads  # Q, dO, lse, di
    _, k_rows = visible_tile_pairs(shape.seq, shape.window, tiles["block_q"], tiles["block_k"])
    extra = (k_rows - shape.seq) * kv_row
    if shape.mode == "fwd+bwd":
        _, k_rows_dq = visible_tile_pairs(shape.seq, shape.window, tiles["block_q_dq"], tiles["block_k_dq"])
        q_rows_dkv, _ = visible_tile_pairs(shape.seq, shape.window, tiles["block_q_dkv"], tiles["block_k_dkv"])
        extra += (k_rows_dq - shape.seq) * kv_row + (q_rows_dkv - shape.seq) * q_row
    return float(declared_bytes + rows * extra)


def window_ratios(row: dict[str, Any]) -> dict[str, float | None]:
    """A windowed row's ratios from its bytes: ``flash_over_splash_512``, ``flash_over_visible_least``
    (flash's traffic over the visible least plus the bytes outside the kernels) and
    ``flash_over_operands_once`` (over the declared least plus those bytes); ``None`` without both."""
    traffic, outside = row.get("flash_traffic_bytes"), row.get("flash_outside_bytes") or 0
    splash = ((row.get("peers") or {}).get("splash-512") or {}).get("traffic_bytes")
    least, once = row.get("flash_visible_least_bytes"), row.get("flash_kernel_bytes")
    return dict(
        flash_over_splash_512=None if traffic is None or not splash else traffic / splash,
        flash_over_visible_least=None if traffic is None or least is None else traffic / (least + outside),
        flash_over_operands_once=None if traffic is None or once is None else traffic / (once + outside))


def window_goals(row: dict[str, Any]) -> dict[str, bool | None]:
    """Whether each ``WINDOW_GOALS`` ratio of a windowed row is met (``None``: no ratio)."""
    return {key: None if row.get(key) is None else row[key] <= bound for key, bound, _, _ in WINDOW_GOALS}


def peer_traffic(peer: str, shape: Shape, dtype) -> dict[str, Any]:
    """One peer compiled for v5e at ``shape``: ``kernel_bytes`` (modelled), ``outside_bytes``,
    ``traffic_bytes`` (their sum), ``kernels`` and ``vmem_bytes``; for a windowed shape and a peer
    without a window (``bench.peers.WINDOWED``), nulls and a ``note``."""
    if shape.window is not None and peer not in peers.WINDOWED:
        return dict(kernel_bytes=None, outside_bytes=None, traffic_bytes=None, kernels=None, vmem_bytes=None,
                    note="no window: not compiled")
    args = peers.arguments(shape.batch, shape.seq, shape.num_q_heads, shape.num_kv_heads,
                           shape.head_dim, dtype, shape.mode, compiled.struct)
    fn = peers.program(peer, shape.seq, shape.num_q_heads, shape.num_kv_heads, shape.mode, shape.window)
    facts = compiled.analyse(compiled.compile_program(fn, args))
    modelled = pipeline.total_bytes(pipeline.kernel_traffic(fn, args))
    return dict(kernel_bytes=modelled, outside_bytes=facts["outside_bytes"],
                traffic_bytes=None if modelled is None else modelled + facts["outside_bytes"],
                kernels=len(facts["kernels"]), vmem_bytes=facts["vmem_bytes"])


def best_peer(row_peers: dict[str, dict[str, Any]]) -> str | None:
    """The peer with the least traffic (``None`` if none was modelled)."""
    modelled = {name: p["traffic_bytes"] for name, p in row_peers.items() if p.get("traffic_bytes")}
    return min(modelled, key=modelled.get) if modelled else None


def least_over_best_peer(row: dict[str, Any]) -> float | None:
    """The lowest flash / best peer any schedule of the kernels can reach: their least traffic
    (every operand read once, every result written once) plus the bytes outside them, over the
    best peer's traffic; ``None`` without both. Where it is above a bar, no tiling meets the bar."""
    least, best = row.get("flash_kernel_bytes"), row.get("best_peer")
    peer = (row.get("peers") or {}).get(best) or {}
    if least is None or not peer.get("traffic_bytes"):
        return None
    return (least + row["flash_outside_bytes"]) / peer["traffic_bytes"]


def _window_program(window: tuple[int, int], mode: str):
    """Flash with ``window``, causal, unpadded: ``(q, k, v[, ct])`` as the ``masks-*`` cases call it."""
    from kernel_src import flash_attention

    def forward(q, k, v):
        return flash_attention(q, k, v, causal=True, window_size=window)
    if mode == "fwd":
        return forward

    def forward_backward(q, k, v, ct):
        _, pullback = jax.vjp(forward, q, k, v)
        return pullback(ct)
    return forward_backward


def window_row(profile_name: str, shape: Shape) -> dict[str, Any]:
    """A windowed row (``shape.window``): flash compiled with the window and modelled, its tiles, the
    least its visible blocks need, the windowed peers, the ratios and the goals; no XLA reference."""
    from kernel_src.flash.plan import mosaic_layout, tpu_tiles, window_span

    profile = get_profile(profile_name)
    dtype = jnp.dtype(profile.dtype)
    batch, seq, hq, hk, d, mode = (shape.batch, shape.seq, shape.num_q_heads, shape.num_kv_heads,
                                   shape.head_dim, shape.mode)
    q = compiled.struct((batch, seq, hq, d), dtype)
    kv = compiled.struct((batch, seq, hk, d), dtype)
    args = (q, kv, kv) + ((q,) if mode == "fwd+bwd" else ())
    program = _window_program(shape.window, mode)
    flash = compiled.analyse(compiled.compile_program(program, args))
    undeclared = any(k["declared_bytes"] is None for k in flash["kernels"])
    kernel_bytes = None if undeclared else sum(k["declared_bytes"] for k in flash["kernels"])
    kernel_flops = None if undeclared else sum(k["declared_flops"] for k in flash["kernels"])
    modelled = pipeline.total_bytes(pipeline.kernel_traffic(program, args))
    traffic = None if modelled is None else modelled + flash["outside_bytes"]
    # the tiles the kernels take compiled for this shape (kernel_src.flash.api: tpu_tiles with the span)
    blocks, _ = tpu_tiles(seq, seq, hq, hk, d, dtype.itemsize, layout=mosaic_layout(hq, hk, d),
                          span=window_span(shape.window, True))
    tiles = {key: getattr(blocks, key) for key in TILE_KEYS}
    peak = roofline.device_peak(str(compiled.v5e_devices()[0].device_kind))
    useful, _ = roofline.attention_work(batch, seq, seq, hq, hk, d, dtype.itemsize, True, None,
                                        window=shape.window)
    row = dict(
        scope=shape.scope, model=shape.model, window=list(shape.window), seq=seq, batch=batch, num_q_heads=hq,
        num_kv_heads=hk, head_dim=d, mode=mode,
        flash_outside_bytes=flash["outside_bytes"], flash_outside_ops=flash["outside_ops"],
        flash_kernel_bytes=kernel_bytes, flash_modelled_bytes=modelled, flash_traffic_bytes=traffic,
        flash_kernel_flops=kernel_flops, flash_vmem_bytes=flash["vmem_bytes"], flash_kernels=len(flash["kernels"]),
        flash_floor_ms=None if kernel_flops is None or traffic is None else _floor_ms(kernel_flops, traffic, peak),
        flash_tiles=tiles,
        flash_visible_least_bytes=None if undeclared else visible_block_least(shape, tiles, kernel_bytes,
                                                                               dtype.itemsize),
        xla_bytes=None, xla_flops=None, xla_floor_ms=None, flash_over_xla=None,
        forward_useful_flops=useful)
    row["peers"] = {peer: peer_traffic(peer, shape, dtype) for peer in peers.PEERS}
    row["best_peer"] = best_peer(row["peers"])
    row["flash_over_best_peer"] = (None if traffic is None or row["best_peer"] is None
                                   else traffic / row["peers"][row["best_peer"]]["traffic_bytes"])
    row.update(window_ratios(row))
    row["goals_met"] = window_goals(row)
    return row


def plan_row(profile_name: str, shape: Shape, with_peers: bool = True) -> dict[str, Any]:
    """One row of the plan: both programs compiled at ``shape`` (one of ``plan_shapes``) for its
    pass, flash's kernels modelled, and (``with_peers``) the peers compiled and modelled; a windowed
    shape is ``window_row``'s."""
    if shape.window is not None:
        return window_row(profile_name, shape)
    profile = get_profile(profile_name)
    batch, seq, hq, hk, d, mode = (shape.batch, shape.seq, shape.num_q_heads, shape.num_kv_heads,
                                   shape.head_dim, shape.mode)
    dtype = jnp.dtype(profile.dtype)
    q = compiled.struct((batch, seq, hq, d), dtype)
    kv = compiled.struct((batch, seq, hk, d), dtype)
    lengths = compiled.struct((batch,), jnp.int32)
    args = (q, kv, kv, lengths) + ((q,) if mode == "fwd+bwd" else ())
    facts = {name: compiled.analyse(compiled.compile_program(
        _program(kernel, profile.causal, mode), args))
        for name, kernel in _programs().items()}
    flash, xla = facts["flash"], facts["xla"]
    kernel_bytes = sum(k["declared_bytes"] or 0 for k in flash["kernels"])
    kernel_flops = sum(k["declared_flops"] or 0 for k in flash["kernels"])
    undeclared = any(k["declared_bytes"] is None for k in flash["kernels"])
    # every key valid (kv_lengths = seq): the causal mask alone decides which blocks are needed
    modelled = pipeline.total_bytes(pipeline.kernel_traffic(
        _program(_programs()["flash"], profile.causal, mode), args,
        known={3: np.full((batch,), seq, np.int32)}))
    traffic = None if modelled is None else modelled + flash["outside_bytes"]
    peak = roofline.device_peak(str(compiled.v5e_devices()[0].device_kind))
    useful, _ = roofline.attention_work(batch, seq, seq, hq, hk, d, dtype.itemsize, profile.causal,
                                        kv_lengths_for(batch, seq) if profile.padded else None)
    no_floor = undeclared or traffic is None
    flash_floor = None if no_floor else _floor_ms(kernel_flops, traffic, peak)
    xla_floor = _floor_ms(xla["flops"], xla["bytes_accessed"], peak)
    row = dict(
        scope=shape.scope, seq=seq, batch=batch, num_q_heads=hq, num_kv_heads=hk, head_dim=d, mode=mode,
        flash_outside_bytes=flash["outside_bytes"], flash_outside_ops=flash["outside_ops"],
        flash_kernel_bytes=None if undeclared else kernel_bytes,
        flash_modelled_bytes=modelled, flash_traffic_bytes=traffic,
        flash_kernel_flops=None if undeclared else kernel_flops,
        flash_vmem_bytes=flash["vmem_bytes"], flash_kernels=len(flash["kernels"]),
        flash_floor_ms=flash_floor,
        xla_bytes=xla["bytes_accessed"], xla_flops=xla["flops"], xla_floor_ms=xla_floor,
        flash_over_xla=None if no_floor else flash_floor / xla_floor,
        forward_useful_flops=useful,
        outside_over_kernel=None if undeclared or not kernel_bytes
        else flash["outside_bytes"] / kernel_bytes)
    if with_peers:
        row["peers"] = {peer: peer_traffic(peer, shape, dtype) for peer in peers.PEERS}
        row["best_peer"] = best_peer(row["peers"])
        row["flash_over_best_peer"] = (None if traffic is None or row["best_peer"] is None
                                       else traffic / row["peers"][row["best_peer"]]["traffic_bytes"])
    return row


def plan_rows(profile_name: str = "tpu-v5e", seq_lens: Iterable[int] | None = None,
              modes: Iterable[str] = MODES, progress: Callable[[str], None] | None = None,
              scopes: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """Rows for every shape of ``plan_shapes`` (of ``scopes`` only, when given)."""
    reason = compiled.unavailable_reason()
    if reason is not None:
        raise ValueError(f"cannot compile for TPU v5e here: {reason}")
    rows = []
    wanted = None if scopes is None else set(scopes)
    for shape in plan_shapes(profile_name, seq_lens, modes):
        if wanted is not None and shape.scope not in wanted:
            continue
        if progress:
            window = "" if shape.window is None else f" {shape.model} window {shape.window}"
            progress(f"compiling {shape.scope} seq {shape.seq} heads {shape.num_q_heads}/{shape.num_kv_heads} "
                     f"{shape.mode}{window}")
        rows.append(plan_row(profile_name, shape))
    return rows


def _paged_verdict(row: dict[str, Any]) -> str:
    met = row.get("goals_met") or {}
    if any(met.get(key) is None for key, _, _, _ in PAGED_GOALS):
        return "not modelled"
    missed = [f"{label} {row[key]:.3f} > {bound}" for key, bound, label, _ in PAGED_GOALS if not met[key]]
    return "met" if not missed else "**not met**: " + ", ".join(missed)


def paged_markdown(rows: list[dict[str, Any]], escape: Callable[[Any], str] = str) -> list[str]:
    """The paged rows' section of the plan (lines; none without paged rows): the table, the goals' verdict
    per row, and how to read it."""
    if not rows:
        return []
    goals = "; ".join(f"*{label}* at most {bound} (over {what})" for _, bound, label, what in PAGED_GOALS)
    met = sum(_paged_verdict(r) == "met" for r in rows)
    lines = [
        "## Paged rows: the paged decode kernel against JAX's `paged_attention`", "",
        f"**{LABEL}** Page copies are modelled from each kernel's DMA schedule, the rest as above.", "",
        f"The goals (issue 36), stated as predictions: {goals}. Verdict: met at {met} of {len(rows)} shapes.", "",
        "| model | seq | batch | heads (q / kv) | page size | pages | pool pages | least (MB) | paged traffic (MB) "
        "| paged / least | JAX paged_attention (MB) | JAX pages per block | paged / JAX | paged VMEM (MiB) "
        "| JAX VMEM (MiB) | goal |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ours, theirs = r["kernels"]["paged-pallas"], r["kernels"]["jax-paged"]
        lines.append(
            f"| {escape(r['model'])} | {r['seq']} | {r['batch']} | {r['num_q_heads']} / {r['num_kv_heads']} "
            f"| {r['page_size']} | {r['pages']} | {r['pool_pages']} | {_num(r['least_bytes'], _MB, 1)} "
            f"| {_num(ours.get('traffic_bytes'), _MB, 1)} | {_num(r.get('paged_over_least'), 1, 3)} "
            f"| {_num(theirs.get('traffic_bytes'), _MB, 1)} | {theirs.get('pages_per_block')} "
            f"| {_num(r.get('paged_over_jax'), 1, 3)} | {_num(ours.get('vmem_bytes'), _MIB, 2)} "
            f"| {_num(theirs.get('vmem_bytes'), _MIB, 2)} | {_paged_verdict(r)} |")
    lines += ["", "How to read it:", "",
              "- The programs are the `paged-decode` benchmark's own (`bench.cases`): one new row per sequence, "
              "causal, bf16, the sequences' distinct lengths (one full, the others ragged between half and all "
              "of the context), each sequence's pages permuted in a pool of `batch x pages` pages; JAX's "
              "`paged_attention` gets the same pool in its own `[kv heads, pages, page_size, head_dim]` layout "
              "and `pages_per_compute_block` pages of at most 512 keys a step.",
              "- *least*: each key a new row sees, its K and V read once, plus q and the output "
              "(`bench.roofline.paged_work`: the benchmark's useful bytes); no kernel can move less.",
              "- *paged traffic*, *JAX paged_attention*: the page copies each kernel's DMA schedule makes "
              "(`bench.plan.paged_dma_bytes`: the paged kernel every page holding a key once, all kv heads "
              "together; JAX's every block of pages whose first key is below the length, per kv head, so a "
              "sequence's last block is read whole), plus the BlockSpec operands the pipeline model counts, "
              "plus the bytes of the XLA ops around the kernels (q's relayout, the scale).",
              "- *paged / least* above 1 is the last page's unused slots (and q's relayout); *paged / JAX* "
              "below 1 is JAX's whole last block.", ""]
    return lines


def _num(value, scale: float, digits: int) -> str:
    return "undeclared" if value is None else f"{value / scale:,.{digits}f}"


def render_markdown(rows: list[dict[str, Any]], profile_name: str, command: str,
                    made: dict[str, str] | None = None, paged_rows: list[dict[str, Any]] = (),
                    ragged_rows: list[dict[str, Any]] = ()) -> str:
    """The plan as a Markdown document: label, provenance, the table, and how to read it; then the
    windowed rows', the paged rows' and the ragged rows' (``bench.plan_ragged``) sections.

    ``made``: the ``jax``, ``libtpu`` and ``date`` the rows were compiled with (a plan JSON's),
    by default this process's and today."""
    made = made or dict(jax=jax.__version__, libtpu=compiled.libtpu_version(),
                        date=datetime.date.today().isoformat())
    windowed = [r for r in rows if r.get("window") is not None]
    rows = [r for r in rows if r.get("window") is None]
    first = rows[0] if rows else {}
    lines = [
        f"# Static performance plan, TPU v5e, profile `{profile_name}`", "",
        f"**{LABEL}**", "",
        f"Written by `{command}` with jax {made['jax']}, libtpu "
        f"{made['libtpu']}, on {made['date']}. Shapes: "
        f"as in the table, head_dim {first.get('head_dim')}, bf16, causal, kv_lengths given (runtime "
        f"values); scope `flash` is the profile's flash scope, `model-*` its model-sized cases (only where "
        f"the XLA reference fits a v5e's HBM, as in the benchmark). Peaks: 197 TFLOP/s bf16, 819 GB/s HBM.",
        "",
        "| scope | seq | batch | heads (q / kv) | pass | outside kernels (MB) | kernels' least traffic (MB) "
        "| kernels, modelled (MB) | flash traffic (MB) | kernels' GFLOP | VMEM (MiB) | flash floor (ms) "
        + "".join(f"| {peer} (MB) " for peer in peers.PEERS)
        + "| flash / best peer | least / best peer | XLA bytes (MB) | XLA GFLOP | XLA floor (ms) "
        "| flash / XLA |",
        "|---|---:|---:|---|---|" + "---:|" * (13 + len(peers.PEERS)),
    ]
    for r in rows:
        row_peers = r.get("peers") or {}
        best = r.get("best_peer")
        cells = "".join(
            f"| {_num((row_peers.get(peer) or {}).get('traffic_bytes'), _MB, 1)}{' *' if peer == best else ''} "
            for peer in peers.PEERS)
        lines.append(
            f"| {r.get('scope', 'flash')} | {r['seq']} | {r['batch']} | {r['num_q_heads']} / {r['num_kv_heads']} "
            f"| {r['mode']} | {_num(r['flash_outside_bytes'], _MB, 1)} "
            f"| {_num(r['flash_kernel_bytes'], _MB, 1)} | {_num(r.get('flash_modelled_bytes'), _MB, 1)} "
            f"| {_num(r.get('flash_traffic_bytes'), _MB, 1)} "
            f"| {_num(r['flash_kernel_flops'], 1e9, 1)} | {_num(r['flash_vmem_bytes'], _MIB, 2)} "
            f"| {_num(r['flash_floor_ms'], 1, 3)} {cells}| {_num(r.get('flash_over_best_peer'), 1, 2)} "
            f"| {_num(least_over_best_peer(r), 1, 3)} "
            f"| {_num(r['xla_bytes'], _MB, 1)} "
            f"| {_num(r['xla_flops'], 1e9, 1)} | {_num(r['xla_floor_ms'], 1, 3)} "
            f"| {_num(r['flash_over_xla'], 1, 3)} |")
    lines += ["", "How to read it:", "",
              "- *outside kernels*: read + write bytes of the XLA ops the flash program runs "
              "around its Pallas kernels (relayout copies, padding, the clip of kv_lengths), from "
              "the optimized HLO; XLA's prefetches of kernel operands into VMEM are left out.",
              "- *kernels' least traffic* and *GFLOP*: what the kernels declare with "
              "`pl.CostEstimate`: each operand read once and each result written once; matmul "
              "FLOPs over the causally visible (query, key) pairs (forward 2 products per pair, "
              "dQ 3, dK/dV 4).",
              "- *kernels, modelled*: the HBM bytes the kernels' Pallas pipelines move "
              "(`bench.pipeline`): a BlockSpec block is copied when its block index changes between "
              "consecutive grid steps (row-major, last axis fastest), an output block written once "
              "per run of equal indices; index maps evaluated at every grid step with their "
              "scalar-prefetch values, every key valid (kv_lengths = seq, as the peers see them); "
              "only the kernels of the branch a TPU lowering takes. *flash traffic* = modelled + "
              "outside.",
              "- *floor*: `max(FLOPs / 197 TFLOP/s, bytes / 819 GB/s)`, a roofline lower bound, "
              "not a time. Flash: its traffic (modelled kernels plus bytes outside). XLA: the "
              "reference's own cost analysis (all of its FLOPs, its fp32 logits in HBM).",
              "- *peers* (`bench.peers`), compiled for the same chip at the same shape, causal, on "
              "their own `[b, h, s, d]` layout: JAX's splash attention (`make_splash_mha`, native "
              "grouped-query K/V, vmapped over the batch) with 512 tiles (or the sequence, if "
              "shorter) and with its default 128 tiles, and JAX's Pallas flash attention (default "
              "tiles; no grouped-query attention, so K/V are repeated to the query heads in the "
              "program, counted outside its kernels). Each: modelled kernel bytes + bytes outside "
              "its kernels, by the same rules; a small constant kernel operand (splash's "
              "`q_sequence`) counts once, as XLA keeps it in VMEM. `*` marks the best (least) peer; "
              "*flash / best peer* is flash's traffic over that peer's.",
              "- *least / best peer*: the kernels' least traffic plus the bytes outside them, over "
              "the best peer's traffic: the lowest *flash / best peer* any tiling or order of these "
              "kernels can reach, since each must read every operand and write every result once. "
              "Where it is above a target ratio, no schedule meets that target.",
              "- *flash / XLA*: ratio of the two floors; below 1 the compiler's plan favours "
              "flash. Measured rows from a TPU record replace this table.", ""]
    return "\n".join(lines + window_markdown(windowed) + paged_markdown(list(paged_rows))
                     + ragged_markdown(list(ragged_rows), LABEL))


def _verdict(row: dict[str, Any]) -> str:
    met = row.get("goals_met") or {}
    if any(met.get(key) is None for key, _, _, _ in WINDOW_GOALS):
        return "not modelled"
    missed = [f"{label} {row[key]:.3f} > {bound}" for key, bound, label, _ in WINDOW_GOALS if not met[key]]
    return "met" if not missed else "**not met**: " + ", ".join(missed)


def window_markdown(rows: list[dict[str, Any]], escape: Callable[[Any], str] = str) -> list[str]:
    """The windowed rows' section of the plan (lines; none without windowed rows): the table, the
    goal's verdict per row, and how to read it. ``escape`` renders the model's name (the card's
    ``builder.markdown.text``)."""
    if not rows:
        return []
    goals = "; ".join(f"*{label}* at most {bound} (over {what})" for _, bound, label, what in WINDOW_GOALS)
    verdicts = [f"{escape(r.get('model'))} {r['mode']}: {_verdict(r)}" for r in rows]
    lines = [
        "## Windowed rows: flash with a sliding window against splash attention's `LocalMask`", "",
        f"**{LABEL}** Bytes below are modelled from the compiled kernels' pipelines, as above.", "",
        f"The goal (issue 35), stated as predictions: {goals}. Verdict: " + "; ".join(verdicts) + ".", "",
        "| model | window (left, right) | seq | batch | heads (q / kv) | head_dim | pass | flash tiles (fwd q x k) "
        "| flash traffic (MB) | splash-512 LocalMask (MB) | splash-default LocalMask (MB) | flash / splash-512 "
        "| visible least (MB) | flash / visible least | every operand once (MB) | flash / every operand once "
        "| flash GFLOP (declared) | goal |",
        "|---|---|---:|---:|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        row_peers, tiles = r.get("peers") or {}, r.get("flash_tiles") or {}
        left, right = r["window"]
        lines.append(
            f"| {escape(r.get('model'))} | ({left}, {right}) | {r['seq']} | {r['batch']} | {r['num_q_heads']} / "
            f"{r['num_kv_heads']} | {r['head_dim']} | {r['mode']} | {tiles.get('block_q')} x {tiles.get('block_k')} "
            f"| {_num(r.get('flash_traffic_bytes'), _MB, 1)} "
            f"| {_num((row_peers.get('splash-512') or {}).get('traffic_bytes'), _MB, 1)} "
            f"| {_num((row_peers.get('splash-default') or {}).get('traffic_bytes'), _MB, 1)} "
            f"| {_num(r.get('flash_over_splash_512'), 1, 3)} | {_num(r.get('flash_visible_least_bytes'), _MB, 1)} "
            f"| {_num(r.get('flash_over_visible_least'), 1, 3)} | {_num(r.get('flash_kernel_bytes'), _MB, 1)} "
            f"| {_num(r.get('flash_over_operands_once'), 1, 3)} | {_num(r.get('flash_kernel_flops'), 1e9, 1)} "
            f"| {_verdict(r)} |")
    lines += ["", "How to read it:", "",
              "- *window*: the contract's `window_size`; a model's `sliding_window = W` is `(W - 1, 0)`: each "
              "query sees itself and the W - 1 keys before it. Causal, every key valid (no `kv_lengths`), "
              "bf16, as the benchmark's `masks-*` cases. No XLA reference: its fp32 logits would need "
              "hundreds of GB of HBM.",
              "- *splash-512 / splash-default LocalMask*: splash attention (`make_splash_mha`) with a "
              "`LocalMask(window_size=(left, 0))` per query head, 512 tiles and its default 128 tiles, "
              "modelled as the peers above (JAX's Pallas flash attention has no window).",
              "- *visible least*: the least bytes the blocks the window leaves visible need, at flash's own "
              "tiles (`bench.plan.visible_block_least`): every operand read once and every result written "
              "once (the kernels' declared least), plus, for every query tile, the K and V tiles holding a key "
              "one of its rows sees (forward and dQ kernels), and for every key tile of the dK/dV kernel the "
              "Q, dO and statistics tiles of the rows that see it. *flash / visible least* is flash's traffic "
              "over it plus the bytes outside the kernels: 1 means no hidden block is read; a pipeline that "
              "keeps a tile across two query tiles may come in a hair under it.",
              "- *every operand once*: the kernels' declared least (each operand read once, each result "
              "written once), what no tiling can go below; *flash / every operand once* shows what flash's "
              "tiles cost on top: each query tile re-reads its window's K and V (dK/dV: each key tile its "
              "rows' Q and dO), so the shorter the tile against the window, the more. No goal is set on it.",
              ""]
    return lines
