"""The GPU plan: every Triton kernel of ``kernel_src`` compiled for an H100 and an A100 without a GPU.

``programs()`` lists what is compiled: flash attention forward, and forward + backward (a VJP, which
holds the forward kernel too) plain and with each feature (sliding window, soft-cap, segment ids,
sinks); the paged decode kernel; the masked softmax, forward + backward. ``plan_rows`` compiles each for
each target (``bench.gpu_compiled``) and ``render_markdown`` writes the table of ``PLAN_H100.md``:
shared memory per block, registers per thread and spills per Triton kernel, as the compilers predict
them. Nothing runs on a GPU.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any, Callable

import jax
import jax.numpy as jnp

from .gpu_compiled import TARGETS, compile_facts, plugin_version

LABEL = ("Predicted by the GPU compilers, not measured: programs compiled for an NVIDIA H100 (sm_90) and A100 "
         "(sm_80) by XLA and ptxas on a machine without a GPU (nothing ran).")


@dataclasses.dataclass(frozen=True)
class Program:
    """One program to compile: ``fn(*args)`` at the abstract ``args``; ``kernel`` and ``shape`` name it,
    ``triton`` lists the Triton kernels it launches."""

    kernel: str
    shape: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    triton: tuple[str, ...] = ()


def _vjp(attend: Callable[..., Any], n_diff: int) -> Callable[..., Any]:
    """``attend``'s output and the gradients of its first ``n_diff`` arguments, the output as cotangent."""
    def program(*args):
        out, pullback = jax.vjp(lambda *diff: attend(*diff, *args[n_diff:]), *args[:n_diff])
        return out, pullback(out)
    return program


FEATURES: dict[str, dict[str, Any]] = {
    "base": {}, "window": {"window_size": (1023, 0)}, "softcap": {"softcap": 30.0},
    "segments": {"segments": True}, "sinks": {"sinks": True},
}


def flash_programs(batch: int = 1, seq: int = 4096, heads: tuple[int, int] = (32, 8), head_dim: int = 128
                   ) -> list[Program]:
    """Flash attention (bf16, causal, kv_lengths) forward, and forward + backward with each feature."""
    from kernel_src.flash import flash_attention

    hq, hk = heads
    q = jax.ShapeDtypeStruct((batch, seq, hq, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((batch, seq, hk, head_dim), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    sinks = jax.ShapeDtypeStruct((hq,), jnp.float32)
    shape = f"b{batch} s{seq} h{hq}/{hk} d{head_dim} bf16"

    def attend_with(options):
        options = dict(options)
        segments, with_sinks = options.pop("segments", False), options.pop("sinks", False)

        def attend(q, k, v, *rest):
            rest = list(rest)
            sink = rest.pop(0) if with_sinks else None
            length = rest.pop(0)
            q_ids, kv_ids = (rest[0], rest[1]) if segments else (None, None)
            return flash_attention(q, k, v, causal=True, kv_lengths=length, sinks=sink,
                                   q_segment_ids=q_ids, kv_segment_ids=kv_ids, **options)
        extra = ((sinks,) if with_sinks else ()) + (lengths,) + ((ids, ids) if segments else ())
        return attend, 3 + with_sinks, (q, kv, kv, *extra)

    attend, _, args = attend_with({})
    found = [Program("flash fwd", shape, attend, args, ("_forward_kernel",))]
    for feature, options in FEATURES.items():
        attend, n_diff, args = attend_with(options)
        found.append(Program(f"flash fwd+bwd {feature}", shape, _vjp(attend, n_diff), args,
                             ("_forward_kernel", "_dq_kernel", "_dkv_kernel")))
    return found


def paged_program(batch: int = 8, keys: int = 8192, heads: tuple[int, int] = (32, 8), head_dim: int = 128,
                  page_size: int = 16) -> Program:
    """The paged decode kernel: one new row per sequence over a bf16 page pool (Llama-3-8B's heads)."""
    from kernel_src.paged import paged_attention_triton

    hq, hk = heads
    pages = batch * keys // page_size
    q = jax.ShapeDtypeStruct((batch, 1, hq, head_dim), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((pages, page_size, hk, head_dim), jnp.bfloat16)
    args = (q, pool, pool, jax.ShapeDtypeStruct((batch,), jnp.int32),
            jax.ShapeDtypeStruct((batch, keys // page_size), jnp.int32))

    def decode(q, k_pages, v_pages, lengths, table):
        return paged_attention_triton(q, k_pages, v_pages, kv_lengths=lengths, page_indices=table)
    return Program("paged decode", f"b{batch} keys{keys} h{hq}/{hk} d{head_dim} page{page_size} bf16",
                   decode, args, ("_kernel",))


def softmax_program(batch: int = 1, heads: int = 8, seq: int = 2048) -> Program:
    """The masked softmax (fp32 logits, causal, kv_lengths), forward + backward."""
    from kernel_src.masked_softmax import masked_softmax

    logits = jax.ShapeDtypeStruct((batch, heads, seq, seq), jnp.float32)
    attend = lambda x, lengths: masked_softmax(x, causal=True, kv_lengths=lengths)  # noqa: E731
    return Program("masked softmax fwd+bwd", f"b{batch} h{heads} s{seq} f32", _vjp(attend, 1),
                   (logits, jax.ShapeDtypeStruct((batch,), jnp.int32)), ("_forward_kernel", "_backward_kernel"))


def programs() -> list[Program]:
    """Every program of the plan (see the module docstring)."""
    return [*flash_programs(), paged_program(), softmax_program()]


def plan_rows(targets: tuple[str, ...] = ("h100", "a100"), chosen: list[Program] | None = None,
              progress: Callable[[str], None] = lambda line: None) -> list[dict[str, Any]]:
    """``compile_facts`` of each program for each target; raises ``CompileFailure`` at the first refusal."""
    rows = []
    for target in targets:
        for program in chosen if chosen is not None else programs():
            progress(f"plan: {program.kernel} at {program.shape} for {target}")
            rows.append(compile_facts(program.fn, program.args, target, kernel=program.kernel,
                                      shape=program.shape))
    return rows


def made() -> dict[str, Any]:
    return dict(jax=jax.__version__, plugin=plugin_version(), date=datetime.date.today().isoformat())


def render_markdown(rows: list[dict[str, Any]], command: str, facts: dict[str, Any]) -> str:
    """The plan as Markdown: one line per Triton kernel of each program and target."""
    lines = [f"# Static plan of the GPU kernels: NVIDIA H100 and A100", "", f"**{LABEL}**", "",
             f"Written by `{command}` with jax {facts['jax']}, {facts['plugin']}, on {facts['date']}. "
             f"Targets: " + "; ".join(f"{t.name} = `{t.arch}`" for t in TARGETS.values()) + ". Shared memory "
             "per block and the launch (grid, threads) are XLA's (its thunk sequence); registers per thread "
             "and spills are ptxas's (`ptxas -v` on the PTX XLA emitted). XLA reports no `cost_analysis()` "
             "for a compiled GPU program.", "",
             "| target | program | shape | Triton kernel | grid | threads | shared memory (KiB) | registers / "
             "thread | spills (bytes, store / load) | program temp (MiB) |",
             "|---|---|---|---|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        for k in (k for k in row["kernels"] if k["triton"]):
            grid = "x".join(map(str, k["grid"]))
            lines.append(f"| {row['target']} | {row['kernel']} | {row['shape']} | `{k['name']}` | {grid} | "
                         f"{k['threads'][0]} | {k['shared_memory_bytes'] / 1024:.1f} | {k.get('registers', '-')} | "
                         f"{k.get('spill_store_bytes', '-')} / {k.get('spill_load_bytes', '-')} | "
                         f"{row['temp_bytes'] / 2**20:.1f} |")
    lines += ["", "Against published figures: FlashAttention-3 (Shah et al., 2024) and NVIDIA's cuDNN attention "
              "publish throughput on an H100 (TFLOP/s), not the bytes their kernels move or their shared memory "
              "and registers, so there is no stated figure to set these compiler facts against; a measured "
              "comparison waits for a run of `scripts/device_check.sh` on a lent GPU.", ""]
    return "\n".join(lines)
