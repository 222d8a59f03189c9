#!/usr/bin/env python3
"""What a grade of ``reference`` costs in CPU-seconds, part by part, each part alone in a fresh process.

    python scripts/grade_parts.py                      # base contract and every feature, seed 0
    python scripts/grade_parts.py --features none
    python scripts/grade_parts.py --level quick --features none     # what its test runs

The parts are everything a grade must do with the checks as they are: the grader's (its interpreter and JAX
starting, the seed's problems drawn, their float64 truths, the reference's baselines compiled and run) and the
candidate's worker's (its interpreter and JAX starting, then every call the checks make, each new shape compiled).
The worker's calls are replayed from a grade's own requests on inputs of the same shapes, dtypes and flags. The
parts run one after another, so their sum is the CPU a grade needs however well its processes and threads overlap,
and half of it is the least wall time two cores allow. A measurement, not a test (issue 50's figures,
CHANGELOG.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

RECORD = r"""
import pickle, sys
from tpu_kernel_records_tools.grading import rubric, runner
features = None if sys.argv[1] == "all" else []
calls, request = [], runner.Runner._request
def recording(self, what, header, arrays=(), *rest, **kw):
    if header.get("op") in ("forward", "vjp"):
        calls.append((dict(header), [(a.shape, str(a.dtype)) for a in arrays]))
    return request(self, what, header, arrays, *rest, **kw)
runner.Runner._request = recording
card = rubric.grade("reference", seed=int(sys.argv[3]), level=sys.argv[4], features=features)
assert card.passed, card.failed
pickle.dump(calls, open(sys.argv[2], "wb"))
"""

GRADER = r"""
import json, queue, sys, time
begin = time.process_time()
import jax
from tpu_kernel_records_tools.grading.dense import checks, feature_checks, problems
jax.devices()
parts = {"grader start": time.process_time() - begin}
# What a grade queues for its threads that compute ahead (a truth, then the baselines, of each judged problem),
# kept here with no thread to take it: each part is computed below, in turn
problems._JOBS, problems._THREADS = queue.Queue(), [None] * problems.AHEAD_THREADS
features = [] if sys.argv[1] == "none" else list(feature_checks.FEATURE_CHECKS)
seed, level, t = int(sys.argv[2]), sys.argv[3], time.process_time()
checks.plan_ahead(seed, level, [*checks.CHECKS, *(feature_checks.FEATURE_CHECKS[f] for f in features)]).join()
parts["problems drawn"] = time.process_time() - t
jobs = [problems._JOBS.get() for _ in range(problems._JOBS.qsize())]
problems.single_threaded_blas()
for name, part in (("float64 truths", jobs[0::2]), ("reference's baselines", jobs[1::2])):
    t = time.process_time()
    for job in part:
        job()
    parts[name] = time.process_time() - t
print(json.dumps({"problems": len(jobs) // 2, "parts": parts}))
"""


WORKER = r"""
import json, pickle, sys, time
begin = time.process_time()
from tpu_kernel_records_tools.sandbox.cpu_jit import worker_compile_options
from tpu_kernel_records_tools.sandbox.worker import _add_xla_flags
_add_xla_flags(worker_compile_options(sys.argv[2]))
import jax, numpy as np
from tpu_kernel_records_tools.grading.serve import AttentionServer
server = AttentionServer()
assert server.load({"spec": "reference"})["ok"]
jax.devices()
parts = {"worker start": time.process_time() - begin}
rng, requests = np.random.default_rng(0), []
for header, shapes in pickle.load(open(sys.argv[1], "rb")):
    arrays = [rng.standard_normal(s).astype(jax.numpy.dtype(d)) if d.startswith(("float", "bfloat"))
              else np.full(s, 1, d) for s, d in shapes]
    if header.get("has_lengths"):  # every key visible: the lengths' values change no program
        at = 4 if header["op"] == "vjp" else 3
        arrays[at] = np.full(shapes[at][0], shapes[1][0][1], np.int32)
    requests.append((header, arrays))
t = time.process_time()
for header, arrays in requests:
    assert server.handle(header, arrays)[0]["ok"]
parts["candidate's calls"] = time.process_time() - t
print(json.dumps({"calls": len(requests), "parts": parts}))
"""


def _run(code: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"a part failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else {}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--features", choices=("all", "none"), action="append",
                   help="the features graded (repeat; default: none, then all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--level", choices=("full", "quick"), default="full")
    args = p.parse_args(argv)
    for features in args.features or ["none", "all"]:
        with tempfile.TemporaryDirectory() as tmp:
            calls = str(Path(tmp) / "calls.pickle")
            _run(RECORD, features, calls, str(args.seed), args.level)
            grader = _run(GRADER, features, str(args.seed), args.level)
            worker = _run(WORKER, calls, args.level)
        parts = {**grader["parts"], **worker["parts"]}
        total = sum(parts.values())
        print(f"level={args.level} features={features} seed={args.seed}: {grader['problems']} problems judged, "
              f"{worker['calls']} calls of the candidate")
        for name, cpu in parts.items():
            print(f"  {name:24s} {cpu:7.2f} CPU-s")
        print(f"  {'in all':24s} {total:7.2f} CPU-s: at least {total / 2:.1f} s on 2 cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
