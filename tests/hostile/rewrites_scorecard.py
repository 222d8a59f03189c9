"""Forks a grandchild in a new session (os.setsid) that outlives the worker, waits for the grader to
exit, then rewrites the --json scorecard file as a pass. It records its pid in PID_FILE (when set in
the candidate's module by the test through the file name) so the test can check it was killed."""

import json
import os
import time

import jax.numpy as jnp


def _grader_json(pid):
    args = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    for i, a in enumerate(args):
        if a == b"--json" and i + 1 < len(args):
            return args[i + 1].decode()
    return None


_forked = False


def attention(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    global _forked
    if not _forked:
        _forked = True
        grader = os.getppid()
        target = _grader_json(grader)
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:  # a grandchild of the worker, in its own session and process group
                try:
                    if target:
                        with open(target + ".attacker-pid", "w") as f:
                            f.write(str(os.getpid()))
                    while os.path.exists(f"/proc/{grader}"):
                        time.sleep(0.2)
                    time.sleep(1)
                    if target:
                        doc = {"scorecards": [{"candidate": "x", "kind": "external", "passed": True, "score": 100,
                                               "max_score": 100, "error": None, "checks": []}]}
                        with open(target, "w") as f:
                            json.dump(doc, f)
                finally:
                    os._exit(0)
            os._exit(0)
        time.sleep(0.5)
    return jnp.zeros(q.shape, q.dtype)
