"""``tpu-kernel-records plan``: the static v5e performance plan (``bench.plan``), as Markdown.

Compiles flash attention, the XLA reference and JAX's own TPU attention kernels (splash, Pallas
flash: the peers) for a TPU v5e on this machine (libtpu, no TPU) at each shape of the profile, models
the bytes each kernel's Pallas pipeline moves (``bench.pipeline``) and writes the compiler's
predictions, labelled as such; then the windowed rows (flash with a model's sliding window against
splash attention's ``LocalMask``, with the goal's ratios and verdicts: ``bench.plan.window_row``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path


def register(subparsers: "argparse._SubParsersAction") -> None:
    """Add the ``plan`` subcommand."""
    p = subparsers.add_parser(
        "plan", help="predict flash vs XLA and JAX's TPU kernels on TPU v5e from compiled programs "
                     "(no TPU needed)",
        description="Compile flash_attention, the XLA reference and the peers (JAX's splash attention at "
                    "512 and default tiles, JAX's Pallas flash attention) for a TPU v5e with libtpu (no "
                    "TPU needed; nothing runs) at each sequence length of the profile's flash scope and "
                    "each of its model-sized shapes where the XLA reference fits HBM, forward and "
                    "forward + backward, and write a Markdown table: bytes outside the kernels, "
                    "the kernels' declared least traffic and FLOPs, the bytes their Pallas pipelines "
                    "move (modelled from grids and BlockSpecs), VMEM, roofline floors, the peers' "
                    "traffic, flash / best peer and flash / XLA; then the windowed rows: flash with a "
                    "masked model's sliding window (Mistral-7B's 4,096 at 32k keys) against splash "
                    "attention's LocalMask, with flash / splash-512, flash / the least traffic the "
                    "visible blocks need, and whether the goal (at most 0.6 and 1.2) is met. "
                    "Predicted by the compiler, not measured.")
    p.add_argument("--profile", default="tpu-v5e", help="benchmark profile (default tpu-v5e)")
    p.add_argument("--seq", type=int, nargs="+", metavar="N",
                   help="sequence lengths, of the flash scope, the model shapes and the windowed rows alike "
                        "(default: all of the profile's)")
    p.add_argument("--modes", nargs="+", choices=("fwd", "fwd+bwd"), default=["fwd", "fwd+bwd"])
    p.add_argument("--out", type=Path, metavar="FILE",
                   help="write the Markdown here (atomically); default standard output")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the rows as JSON")
    p.set_defaults(func=_plan)


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _plan(args: argparse.Namespace) -> int:
    from ..bench import plan

    command = "tpu-kernel-records plan --profile " + args.profile
    if args.seq:
        command += " --seq " + " ".join(map(str, args.seq))
    if args.modes != ["fwd", "fwd+bwd"]:
        command += " --modes " + " ".join(args.modes)
    if args.out:
        command += f" --out {args.out.name}"
    rows = plan.plan_rows(args.profile, args.seq, args.modes,
                          progress=lambda line: print(line, file=sys.stderr, flush=True))
    text = plan.render_markdown(rows, args.profile, command)
    if args.json:
        provenance = dict(command=command, jax=plan.jax.__version__, date=plan.datetime.date.today().isoformat(),
                          libtpu=plan.compiled.libtpu_version())  # for the card's plan section (builder.plan)
        _write_atomic(args.json, json.dumps(dict(label=plan.LABEL, **provenance, rows=rows), indent=1) + "\n")
    if args.out:
        _write_atomic(args.out, text)
        print(args.out)
    else:
        print(text)
    return 0
