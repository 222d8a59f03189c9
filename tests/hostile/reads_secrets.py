"""Looks for credentials and for the grader's files: HF_TOKEN (or any *_TOKEN) in its environment and in
/proc/self/environ, the grader's /proc environ, its home and working directory, stdin. Raises a
message that says what it saw (booleans and names, never a value), so the scorecard shows it."""

import os
import sys


def attention(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    marker = "hf_fakefakefake"
    names = sorted(n for n in os.environ if n.startswith(("HF_", "KAGGLE")) or n.endswith(("_TOKEN", "_KEY", "_SECRET")))
    own = open("/proc/self/environ", "rb").read()
    try:
        parent = marker.encode() in open(f"/proc/{os.getppid()}/environ", "rb").read()
    except OSError:
        parent = "unreadable"
    home, cwd = os.path.expanduser("~"), os.getcwd()
    try:
        stdin = repr(sys.stdin.read(1)) if sys.stdin is not None else "None"
    except (OSError, ValueError) as e:
        stdin = type(e).__name__
    raise RuntimeError(
        f"secret names {names or 'none'}; marker in own environ {marker.encode() in own}; in grader's environ "
        f"{parent}; HOME==cwd {home == cwd}; cwd entries {sorted(os.listdir(cwd))}; stdin read {stdin}")
