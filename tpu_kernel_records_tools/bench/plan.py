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
* VMEM: the most scoped VMEM any one kernel reserves;
* floor: the roofline floor ``max(FLOPs / 197 TFLOP/s, bytes / 819 GB/s)`` (v5e, bf16), with
  flash's bytes = kernels' least traffic + bytes outside, and XLA's FLOPs and bytes from its own
  cost analysis (its fp32 logits round-trip HBM);
* flash / XLA: the ratio of the two floors.

All of it is the compiler's plan: predicted, not measured. A measured TPU record replaces it.
"""

from __future__ import annotations

import datetime
from typing import Any, Callable, Iterable, NamedTuple

import jax
import jax.numpy as jnp

from ..bench import compiled, roofline
from ..bench.cases import MODEL_SCOPES, get_profile, kv_lengths_for

LABEL = ("Predicted by the TPU compiler, not measured: programs compiled for a TPU v5e by libtpu "
         "on a machine without a TPU (nothing ran).")
MODES = ("fwd", "fwd+bwd")
_MB, _MIB = 1e6, 2 ** 20


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
    """One plan row's problem: ``scope`` is ``flash`` (the profile's flash scope) or a model scope."""

    scope: str
    batch: int
    seq: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    mode: str


def plan_shapes(profile_name: str = "tpu-v5e", seq_lens: Iterable[int] | None = None,
                modes: Iterable[str] = MODES) -> list[Shape]:
    """Every shape the plan compiles: the profile's ``flash`` scope at each of its sequence lengths (or
    ``seq_lens``), then its model-sized shapes (``bench.cases.ModelShapes``) wherever the benchmark
    also runs the XLA reference there (``ModelShapes.xla_fits``: elsewhere it needs more HBM than a
    v5e has, and there is no ratio to predict). ``seq_lens`` restricts both."""
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
    return shapes


def plan_row(profile_name: str, shape: Shape) -> dict[str, Any]:
    """One row of the plan: both programs compiled at ``shape`` (one of ``plan_shapes``) for its pass."""
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
    peak = roofline.device_peak(str(compiled.v5e_devices()[0].device_kind))
    useful, _ = roofline.attention_work(batch, seq, seq, hq, hk, d, dtype.itemsize, profile.causal,
                                        kv_lengths_for(batch, seq) if profile.padded else None)
    flash_floor = _floor_ms(kernel_flops, kernel_bytes + flash["outside_bytes"], peak)
    xla_floor = _floor_ms(xla["flops"], xla["bytes_accessed"], peak)
    return dict(
        scope=shape.scope, seq=seq, batch=batch, num_q_heads=hq, num_kv_heads=hk, head_dim=d, mode=mode,
        flash_outside_bytes=flash["outside_bytes"], flash_outside_ops=flash["outside_ops"],
        flash_kernel_bytes=None if undeclared else kernel_bytes,
        flash_kernel_flops=None if undeclared else kernel_flops,
        flash_vmem_bytes=flash["vmem_bytes"], flash_kernels=len(flash["kernels"]),
        flash_floor_ms=None if undeclared else flash_floor,
        xla_bytes=xla["bytes_accessed"], xla_flops=xla["flops"], xla_floor_ms=xla_floor,
        flash_over_xla=None if undeclared else flash_floor / xla_floor,
        forward_useful_flops=useful,
        outside_over_kernel=None if undeclared or not kernel_bytes
        else flash["outside_bytes"] / kernel_bytes)


def plan_rows(profile_name: str = "tpu-v5e", seq_lens: Iterable[int] | None = None,
              modes: Iterable[str] = MODES, progress: Callable[[str], None] | None = None
              ) -> list[dict[str, Any]]:
    """Rows for every shape of ``plan_shapes``."""
    reason = compiled.unavailable_reason()
    if reason is not None:
        raise ValueError(f"cannot compile for TPU v5e here: {reason}")
    rows = []
    for shape in plan_shapes(profile_name, seq_lens, modes):
        if progress:
            progress(f"compiling {shape.scope} seq {shape.seq} heads {shape.num_q_heads}/{shape.num_kv_heads} "
                     f"{shape.mode}")
        rows.append(plan_row(profile_name, shape))
    return rows


def _num(value, scale: float, digits: int) -> str:
    return "undeclared" if value is None else f"{value / scale:,.{digits}f}"


def render_markdown(rows: list[dict[str, Any]], profile_name: str, command: str) -> str:
    """The plan as a Markdown document: label, provenance, the table, and how to read it."""
    first = rows[0] if rows else {}
    lines = [
        f"# Static performance plan, TPU v5e, profile `{profile_name}`", "",
        f"**{LABEL}**", "",
        f"Written by `{command}` with jax {jax.__version__}, libtpu "
        f"{compiled.libtpu_version()}, on {datetime.date.today().isoformat()}. Shapes: "
        f"as in the table, head_dim {first.get('head_dim')}, bf16, causal, kv_lengths given (runtime "
        f"values); scope `flash` is the profile's flash scope, `model-*` its model-sized cases (only where "
        f"the XLA reference fits a v5e's HBM, as in the benchmark). Peaks: 197 TFLOP/s bf16, 819 GB/s HBM.",
        "",
        "| scope | seq | batch | heads (q / kv) | pass | outside kernels (MB) | kernels' least traffic (MB) "
        "| outside / kernels | kernels' GFLOP | VMEM (MiB) | flash floor (ms) | XLA bytes (MB) | XLA GFLOP "
        "| XLA floor (ms) | flash / XLA |",
        "|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.get('scope', 'flash')} | {r['seq']} | {r['batch']} | {r['num_q_heads']} / {r['num_kv_heads']} "
            f"| {r['mode']} | {_num(r['flash_outside_bytes'], _MB, 1)} "
            f"| {_num(r['flash_kernel_bytes'], _MB, 1)} | {_num(r['outside_over_kernel'], 1, 2)} "
            f"| {_num(r['flash_kernel_flops'], 1e9, 1)} | {_num(r['flash_vmem_bytes'], _MIB, 2)} "
            f"| {_num(r['flash_floor_ms'], 1, 3)} | {_num(r['xla_bytes'], _MB, 1)} "
            f"| {_num(r['xla_flops'], 1e9, 1)} | {_num(r['xla_floor_ms'], 1, 3)} "
            f"| {_num(r['flash_over_xla'], 1, 3)} |")
    lines += ["", "How to read it:", "",
              "- *outside kernels*: read + write bytes of the XLA ops the flash program runs "
              "around its Pallas kernels (relayout copies, padding, the clip of kv_lengths), from "
              "the optimized HLO; XLA's prefetches of kernel operands into VMEM are left out.",
              "- *kernels' least traffic* and *GFLOP*: what the kernels declare with "
              "`pl.CostEstimate`: each operand read once and each result written once; matmul "
              "FLOPs over the causally visible (query, key) pairs (forward 2 products per pair, "
              "dQ 3, dK/dV 4). Real kernels re-read K/V tiles, so their traffic is higher.",
              "- *floor*: `max(FLOPs / 197 TFLOP/s, bytes / 819 GB/s)`, a roofline lower bound, "
              "not a time. Flash: kernels' least traffic plus bytes outside. XLA: the reference's "
              "own cost analysis (all of its FLOPs, its fp32 logits in HBM).",
              "- *flash / XLA*: ratio of the two floors; below 1 the compiler's plan favours "
              "flash. Measured rows from a TPU record replace this table.", ""]
    return "\n".join(lines)
