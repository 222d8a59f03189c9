"""``tpu-kernel-records plan --profile h100``: the GPU kernels compiled for an H100 and an A100, no GPU.

Compiles every Triton kernel of ``kernel_src`` (``bench.plan_gpu.programs``) for each target with the
CUDA plugin of the ``gpu-plan`` extra and writes the compilers' facts as Markdown (``PLAN_H100.md``).
A kernel that does not compile ends the command with one line naming kernel, shape, target and the
compiler's message (exit status 1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

#: ``plan`` profiles compiled for GPUs (the rest are TPU v5e plans).
GPU_PROFILES = {"h100": ("h100", "a100")}


def gpu_plan(args: argparse.Namespace, write_atomic, emit) -> int:
    """The ``plan`` command for a GPU profile; ``write_atomic(path, text)`` writes a file, ``emit(out, text)``
    the Markdown (to ``out`` or standard output) and returns the exit status."""
    import jax

    if not os.environ.get("JAX_PLATFORMS"):  # the plugin then loads without looking for a driver
        jax.config.update("jax_platforms", "cpu")
    from ..bench import gpu_compiled, plan_gpu

    reason = gpu_compiled.unavailable_reason()
    if reason is not None:
        print(f"plan: cannot compile for a GPU here: {reason}", file=sys.stderr)
        return 1
    command = f"tpu-kernel-records plan --profile {args.profile}" + (f" --out {args.out.name}" if args.out else "")
    progress = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    try:
        rows = plan_gpu.plan_rows(GPU_PROFILES[args.profile], progress=progress)
    except gpu_compiled.CompileFailure as failure:
        print(f"plan: {failure}", file=sys.stderr)
        return 1
    made = plan_gpu.made()
    text = plan_gpu.render_markdown(rows, command, made)
    if args.json:
        write_atomic(args.json, json.dumps(dict(label=plan_gpu.LABEL, command=command, **made, rows=rows),
                                           indent=1) + "\n")
    return emit(args.out, text)
