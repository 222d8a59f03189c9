"""``tpu-kernel-records plan``: the static v5e performance plan (``bench.plan``), as Markdown.

Compiles flash attention, the XLA reference and JAX's own TPU attention kernels (splash, Pallas
flash: the peers) for a TPU v5e on this machine (libtpu, no TPU) at each shape of the profile, models
the bytes each kernel's Pallas pipeline moves (``bench.pipeline``) and writes the compiler's
predictions, labelled as such; then the windowed rows (flash with a model's sliding window against
splash attention's ``LocalMask``, with the goal's ratios and verdicts: ``bench.plan.window_row``) and the
paged rows (the paged decode kernel against JAX's ``paged_attention``: ``bench.plan_paged.paged_row``) and
the ragged rows (the ragged kernel against JAX's ``ragged_paged_attention`` over a serving step:
``bench.plan_ragged.ragged_row``).

``--scopes`` compiles only some of the row groups and ``--merge PLAN_JSON`` keeps the other groups'
rows from an existing plan (compiled with the same jax and libtpu): a full plan takes most of an hour
on a small machine, the paged rows alone minutes.
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
                    "visible blocks need, and whether the goal (at most 0.6 and 1.2) is met; then the paged "
                    "rows: the paged decode kernel against JAX's paged_attention at the paged-decode "
                    "benchmark's Llama-3-8B shapes, their traffic over the least bytes (goal <= 1.1) and over "
                    "JAX's (goal <= 1); then the ragged rows: the ragged kernel against JAX's "
                    "ragged_paged_attention over the ragged scope's serving steps, their traffic over the least "
                    "bytes (goal <= 1.1) and over JAX's (goal < 1). Predicted by the compiler, not measured.")
    p.add_argument("--profile", default="tpu-v5e",
                   help="benchmark profile (default tpu-v5e); h100: the GPU kernels compiled for an H100 and an "
                        "A100 instead (needs the gpu-plan extra; the other options but --out and --json are unused)")
    p.add_argument("--seq", type=int, nargs="+", metavar="N",
                   help="sequence lengths, of the flash scope, the model shapes and the windowed rows alike "
                        "(default: all of the profile's)")
    p.add_argument("--modes", nargs="+", choices=("fwd", "fwd+bwd"), default=["fwd", "fwd+bwd"])
    p.add_argument("--scopes", nargs="+", choices=GROUPS, metavar="SCOPE",
                   help=f"which rows to compile: any of {', '.join(GROUPS)} (default: all); with --merge, the "
                        "other rows come from that plan")
    p.add_argument("--merge", type=Path, metavar="PLAN_JSON",
                   help="keep the rows of the scopes not compiled from this plan JSON (e.g. data/plan/tpu-v5e.json; "
                        "it must have been compiled with this jax and libtpu); needs --scopes and --json")
    p.add_argument("--out", type=Path, metavar="FILE",
                   help="write the Markdown here (atomically); default standard output")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the rows as JSON")
    p.set_defaults(func=_plan)


GROUPS = ("flash", "model-fwd", "model-fwd-bwd", "masks-fwd", "masks-fwd-bwd", "paged-decode", "ragged")


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
    from .plan_gpu import GPU_PROFILES, gpu_plan
    if args.profile in GPU_PROFILES:
        return gpu_plan(args, _write_atomic, _emit)
    from ..bench import plan, plan_paged, plan_ragged
    from ..builder.plan import check_plan

    scopes = list(dict.fromkeys(args.scopes or GROUPS))
    if args.merge and (not args.scopes or not args.json):
        print("plan: --merge needs --scopes (the rows to compile) and --json (where the merged plan goes)",
              file=sys.stderr)
        return 2
    command = "tpu-kernel-records plan --profile " + args.profile
    if args.seq:
        command += " --seq " + " ".join(map(str, args.seq))
    if args.modes != ["fwd", "fwd+bwd"]:
        command += " --modes " + " ".join(args.modes)
    if args.scopes:
        command += " --scopes " + " ".join(scopes)
    if args.merge:
        command += f" --merge {args.merge}"
    if args.out:
        command += f" --out {args.out.name}"
    made = dict(jax=plan.jax.__version__, date=plan.datetime.date.today().isoformat(),
                libtpu=plan.compiled.libtpu_version())
    old = None
    if args.merge:
        old = json.loads(args.merge.read_text())
        replaced = {"paged_rows": "paged-decode", "ragged_rows": "ragged"}  # checked when made, not as they were
        check_plan({key: value for key, value in old.items() if replaced.get(key) not in scopes})
        if (old.get("jax"), old.get("libtpu")) != (made["jax"], made["libtpu"]):
            print(f"plan: {args.merge} was compiled with jax {old.get('jax')}, libtpu {old.get('libtpu')}; this is "
                  f"jax {made['jax']}, libtpu {made['libtpu']}: regenerate every row instead", file=sys.stderr)
            return 1
        # the steps that made the kept rows; this run takes the place of an earlier run of these scopes (its
        # rows are replaced), or comes last
        again = f" --scopes {' '.join(scopes)}"
        steps = [step for step in (old.get("command") or "").split("; then ") if step]
        rerun = [i for i, step in enumerate(steps) if again in step and step.split(again)[1][:1] in ("", " ")]
        at = rerun[0] if rerun else len(steps)
        command = "; then ".join([s for i, s in enumerate(steps[:at]) if i not in rerun] + [command]
                                 + [s for i, s in enumerate(steps) if i > at and i not in rerun])
    progress = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    wanted = [s for s in scopes if s not in ("paged-decode", "ragged")]
    rows = [] if not wanted else plan.plan_rows(args.profile, args.seq, args.modes, progress=progress,
                                                 scopes=wanted)
    paged = (plan_paged.paged_rows(args.profile, args.seq, progress=progress) if "paged-decode" in scopes
             else None)
    ragged = plan_ragged.ragged_rows(args.profile, progress=progress) if "ragged" in scopes else None
    if old is not None:
        kept = [r for r in old["rows"] if r.get("scope", "flash") not in scopes]
        rows = kept + rows
        if paged is None:
            paged = old.get("paged_rows")
        if ragged is None:
            ragged = old.get("ragged_rows")
    text = plan.render_markdown(rows, args.profile, command, made, paged_rows=paged or [], ragged_rows=ragged or [])
    if args.json:
        doc = dict(label=plan.LABEL, command=command, **made, rows=rows)  # for the card (builder.plan)
        if paged:
            doc["paged_rows"] = paged
        if ragged:
            doc["ragged_rows"] = ragged
        check_plan(doc)
        _write_atomic(args.json, json.dumps(doc, indent=1) + "\n")
    return _emit(args.out, text)


def _emit(out: Path | None, text: str) -> int:
    """The plan's Markdown written to ``out`` (atomically; its name printed) or printed."""
    if out:
        _write_atomic(out, text)
        print(out)
    else:
        print(text)
    return 0
