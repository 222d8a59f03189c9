"""Calling a candidate: each call guarded, its output validated, non-finite values recorded.

``Runner.forward(problem)`` and ``Runner.vjp(problem)`` are all the checks know of a candidate.
Calls run in a daemon worker thread with the candidate's remaining time budget as deadline. A call
that does not return in time is abandoned: its thread is left running in the background (it cannot
be killed from Python) and every later call of that candidate fails at once as "not run".
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import jax
import numpy as np

from grading.problems import Problem

class CandidateFailure(Exception):
    """The candidate raised, returned something that is not a usable array, or ran out of time."""


class TimedOut(CandidateFailure):
    pass


class Runner:
    """Calls one candidate under a budget of ``time_limit_s`` seconds spent inside its calls, all together."""

    def __init__(self, fn: Callable, time_limit_s: float):
        self.fn, self.time_limit_s = fn, time_limit_s
        self.used_s = 0.0  # time inside the candidate's calls only (not the oracle's or the baseline's)
        self.timed_out = False
        self.returned = 0
        self.nonfinite: list[str] = []
        self.check = ""

    def _guarded(self, what: str, thunk: Callable):
        if self.timed_out:
            raise TimedOut(f"not run: the candidate's time limit ({self.time_limit_s:g} s) ran out earlier")
        remaining = self.time_limit_s - self.used_s
        if remaining <= 0:
            self.timed_out = True
            raise TimedOut(f"not run: the candidate's time limit ({self.time_limit_s:g} s) ran out")
        box: dict = {}

        def target():
            try:
                box["value"] = thunk()
            except BaseException as e:  # reported, never re-raised into the grader
                box["error"] = e

        worker = threading.Thread(target=target, name=f"rubric-call:{what}", daemon=True)
        start = time.monotonic()
        worker.start()
        worker.join(remaining)
        self.used_s += time.monotonic() - start
        if worker.is_alive():
            self.timed_out = True
            raise TimedOut(f"{what}: no result within the candidate's time limit ({self.time_limit_s:g} s); "
                           f"the call was abandoned in a daemon thread")
        if "error" in box:
            e = box["error"]
            if isinstance(e, CandidateFailure):
                raise e
            message = (str(e).strip().splitlines() or [""])[0][:300]
            raise CandidateFailure(f"{what}: raised {type(e).__name__}: {message}")
        return box["value"]

    def _observe(self, label: str, name: str, x: np.ndarray) -> None:
        self.returned += 1
        bad = ~np.isfinite(x.astype(np.float32))
        if bad.any():
            index = tuple(int(i) for i in np.argwhere(bad)[0])
            value = x.astype(np.float32)[index]
            self.nonfinite.append(f"{self.check}: {label} {name}[{index}] = {value}")

    def forward(self, p: Problem, *, check_shape: bool = True) -> np.ndarray:
        """The candidate's output on ``p`` as a NumPy array (bf16 stays bf16)."""
        def call():
            return _host(self.fn(p.q, p.k, p.v, **p.kwargs), "output")
        out = self._guarded(f"{p.label} forward", call)
        if check_shape and out.shape != p.q.shape:
            raise CandidateFailure(f"{p.label}: output shape {out.shape}, expected {tuple(p.q.shape)}")
        if out.shape == p.q.shape:
            self._observe(p.label, "out", out)
        return out

    def vjp(self, p: Problem) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(out, dq, dk, dv)`` under the cotangent ``p.ct`` (cast to the output's dtype)."""
        def call():
            out, pull = jax.vjp(lambda q, k, v: self.fn(q, k, v, **p.kwargs), p.q, p.k, p.v)
            if tuple(out.shape) != tuple(p.q.shape):
                raise CandidateFailure(f"{p.label}: output shape {tuple(out.shape)}, expected {tuple(p.q.shape)}")
            grads = pull(p.ct.astype(out.dtype))
            return tuple(_host(x, name) for x, name in zip((out, *grads), ("output", "dq", "dk", "dv")))
        result = self._guarded(f"{p.label} gradients", call)
        for name, x in zip(("out", "dq", "dk", "dv"), result):
            self._observe(p.label, name, x)
        return result


def _host(x, name: str) -> np.ndarray:
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise CandidateFailure(f"{name} is a {type(x).__name__}, not an array")
    return np.asarray(x)


