"""Calling a candidate: in its own worker process, each call bounded, its output validated.

``Runner.forward(problem)`` and ``Runner.vjp(problem)`` (``Runner.paged_forward(problem)`` for a paged
candidate) are all the checks know of a candidate. The
candidate runs in a ``sandbox.sandbox.Sandbox`` (one worker process per candidate, started once and
reused across its calls): the runner sends copies of the problem's inputs (q, k, v [batch, len, heads,
head_dim], the cotangent, causal, kv_lengths [batch], scale) and gets arrays back. The grader keeps
its own inputs, truth and baseline; the candidate never sees them.

Budget: ``time_limit_s`` wall-clock seconds of waiting on the worker per scorecard, all calls together
(loading the candidate included, the interpreter's and JAX's start not). When it runs out, the worker
and every process it started are killed and the remaining calls fail at once as "not run". A worker
that dies (any exit status, a signal, a memory-limit failure) fails the call that was running and,
as "not run", every later one.
"""

from __future__ import annotations

import time

import numpy as np

from ..grading.calls import CandidateFailure, TimedOut  # noqa: F401  (re-exported)
from ..sandbox.cpu_jit import worker_compile_options
from ..grading.candidates import (Candidate, CandidateLoadError, cpu_compile_options, load_request, names_a_file,
                                  resolve)
from ..sandbox.isolation import inside_path
from ..grading.paged.problems import PagedProblem
from ..grading.dense.problems import Problem
from ..grading.serve import SERVICE
from ..sandbox.sandbox import DEFAULT_MEMORY_LIMIT_GB, STARTUP_LIMIT_S, Expired, Sandbox, WorkerGone
from ..sandbox.worker import ProtocolError
from kernel_src.contract import canonical_features

DEFAULT_TIME_LIMIT_S = 600.0  # per scorecard; a Pallas kernel in interpret mode needs minutes on 2 CPU cores


def _clean(text: str, limit: int = 300) -> str:
    """Text from the worker as one printable line of at most ``limit`` characters."""
    text = str(text).encode("utf-8", "replace").decode("utf-8", "replace")
    text = "".join(ch if ch.isprintable() else " " for ch in text).strip()
    return text[:limit]


class Runner:
    """The checks' :class:`~tpu_kernel_records_tools.grading.calls.Calls`: runs ``candidate`` in a worker process under ``time_limit_s`` seconds per scorecard (see module doc).

    ``start()`` launches the worker and loads the candidate (returns the load error, or None);
    ``new_scorecard()`` resets the budget and the observations; ``close()`` kills the worker and all
    its descendants.
    """

    holes = True  # a large input's all-zero chunks are never resident in the worker (``sandbox.worker``)

    def __init__(self, candidate: str | Candidate, *, time_limit_s: float = DEFAULT_TIME_LIMIT_S,
                 memory_limit_gb: float = DEFAULT_MEMORY_LIMIT_GB, isolation: str = "process", level: str = "full"):
        self.candidate = resolve(candidate)
        self.level = level  # the worker's XLA:CPU options follow it (sandbox.cpu_jit.worker_compile_options)
        self.isolation = isolation  # "bubblewrap" or "process" (sandbox.isolation)
        self.time_limit_s, self.memory_limit_gb = float(time_limit_s), memory_limit_gb
        self.sandbox: Sandbox | None = None
        self.down: str | None = None  # why the worker is gone, once it is
        self.startup_s = 0.0          # seconds from launch to a loaded candidate (last start)
        self.features: tuple[str, ...] = ()  # what the loaded candidate declares (kernel_src.contract.FEATURES)
        self.new_scorecard()

    def new_scorecard(self) -> None:
        self.used_s = 0.0  # seconds waiting on the worker (not the oracle's or the baseline's time)
        self.timed_out = False
        self.returned = 0
        self.nonfinite: list[str] = []
        self.check = ""

    # -- life cycle -------------------------------------------------------------------------------

    def start(self) -> str | None:
        """Launch the worker and load the candidate; the reason it cannot be graded, or None."""
        self.close()
        begin = time.monotonic()
        self.down = None
        try:
            options = worker_compile_options(self.level) if cpu_compile_options() else {}
            load = dict(load_request(self.candidate), cpu_compile=options)
            target = load.get("spec", "").rpartition(":")[0]
            candidate_file = target if names_a_file(target) else None
            root = self.candidate.root
            if candidate_file and self.isolation == "bubblewrap":
                load = dict(load, spec=f"{inside_path(candidate_file, root)}:{load['spec'].rpartition(':')[2]}")
            module = target if target and not candidate_file else None  # package.module:function
            self.sandbox = Sandbox(memory_limit_gb=self.memory_limit_gb, isolation=self.isolation,
                                   candidate_file=candidate_file, candidate_root=root, candidate_module=module,
                                   service=SERVICE)
            self.sandbox.start()
            self.sandbox.wait_ready(STARTUP_LIMIT_S)
        except CandidateLoadError as e:
            self.down = str(e)
            return self.down
        except (Expired, WorkerGone, ProtocolError, OSError) as e:
            self.down = f"the worker process could not start: {_describe(e, STARTUP_LIMIT_S)}"
            self.close()
            return self.down
        try:
            reply, _ = self._request("loading the candidate", load)
        except CandidateFailure as e:
            self.down = str(e)
            return self.down
        finally:
            self.startup_s = time.monotonic() - begin
        if not reply.get("ok"):
            self.down = _clean(reply.get("error", "the candidate could not be loaded"), 500)
            if "ModuleNotFoundError" in self.down and self.isolation == "bubblewrap" and root is None:
                self.down += (" (the sandbox sees the candidate's file alone: give a kernel of several files "
                              "with --candidate-dir DIR, or as an installed package)")
            self.close()
            return self.down
        try:
            self.features = canonical_features(reply.get("features") or ())
        except (ValueError, TypeError) as e:
            self.down = f"the candidate's declared features: {_clean(str(e))}"
            self.close()
            return self.down
        return None

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()

    @property
    def alive(self) -> bool:
        return self.sandbox is not None and self.sandbox.alive and self.down is None

    @property
    def syscall_filter(self) -> str | None:
        """What filtered the last worker's system calls (``sandbox.syscalls.KINDS``); None before one said."""
        return self.sandbox.syscall_filter if self.sandbox is not None else None

    @property
    def memory_limit(self) -> str | None:
        """What bounded the last worker's memory (``sandbox.memcg.KINDS``); None before one started."""
        return self.sandbox.memory_limit if self.sandbox is not None else None

    # -- calls ------------------------------------------------------------------------------------

    def _request(self, what: str, header: dict, arrays=(), reply_limit: int = 0,
                 while_waiting=None) -> tuple[dict, list]:
        if self.timed_out:
            raise TimedOut(f"not run: the candidate's time limit ({self.time_limit_s:g} s) ran out earlier")
        if self.down is not None or self.sandbox is None:
            raise CandidateFailure(f"not run: {self.down or 'the worker is not running'}")
        remaining = self.time_limit_s - self.used_s
        if remaining <= 0:
            self.timed_out = True
            raise TimedOut(f"not run: the candidate's time limit ({self.time_limit_s:g} s) ran out")
        start = time.monotonic()
        try:
            return self.sandbox.request(header, arrays, timeout_s=remaining, reply_limit_bytes=reply_limit,
                                        while_waiting=while_waiting)
        except Expired:
            self.timed_out = True
            self.down = f"the candidate's time limit ({self.time_limit_s:g} s) ran out during {what}"
            raise TimedOut(f"{what}: no result within the candidate's time limit ({self.time_limit_s:g} s); "
                           f"its worker and every process it started were killed") from None
        except WorkerGone as e:
            self.down = f"the candidate's worker process {e} during {what}"
            self.close()
            raise CandidateFailure(f"{what}: the candidate's worker process {e}") from None
        except ProtocolError as e:
            self.down = f"the candidate's worker sent a malformed reply during {what}"
            self.close()
            raise CandidateFailure(f"{what}: malformed reply from the worker ({_clean(str(e))})") from None
        finally:
            self.used_s += time.monotonic() - start - (self.sandbox.grader_s if self.sandbox else 0.0)

    def _call(self, what: str, p: Problem, grad: bool) -> list[np.ndarray]:
        arrays = [np.asarray(p.q), np.asarray(p.k), np.asarray(p.v)] + ([np.asarray(p.ct)] if grad else [])
        if p.kv_lengths is not None:
            arrays.append(np.asarray(p.kv_lengths))
        if p.q_segments is not None:
            arrays += [p.q_segments, p.kv_segments]
        if p.sinks is not None:
            arrays.append(p.sinks)
        header = {"op": "vjp" if grad else "forward", "causal": bool(p.causal),
                  "scale": None if p.scale is None else float(p.scale), "has_lengths": p.kv_lengths is not None,
                  "has_segments": p.q_segments is not None, "has_sinks": p.sinks is not None,
                  "window": None if p.window is None else list(p.window), "softcap": p.softcap}
        return self._exchange(what, p, header, arrays, (5 if p.sinks is not None else 4) if grad else 1)

    def _exchange(self, what: str, p, header: dict, arrays: list, count: int) -> list[np.ndarray]:
        """Send one call of problem ``p``, wait for its ``count`` result arrays (computing ``p``'s truth and
        baselines meanwhile unless it is derived from another problem); a failure is ``CandidateFailure``."""
        limit = 8 * sum(a.nbytes for a in arrays) + (1 << 20)
        # The truth and baselines a fresh problem is judged by are computed while the candidate computes.
        prepare = None if p.derived else p.prepare
        reply, results = self._request(what, header, arrays, limit, prepare)
        if not reply.get("ok"):
            error = _clean(reply.get("error", "no result"))
            raise CandidateFailure(f"{what}: {'raised ' if reply.get('raised') else ''}{error}")
        modified = reply.get("inputs_modified") or []
        if modified:
            names = ", ".join(_clean(n, 20) for n in modified[:5])
            raise CandidateFailure(f"{what}: inputs modified: the candidate wrote into {names} during the call "
                                   f"(the grader judges against its own copies)")
        if len(results) != count:
            raise CandidateFailure(f"{what}: the worker returned {len(results)} arrays")
        return results

    def _observe(self, label: str, name: str, x: np.ndarray) -> None:
        self.returned += 1
        with np.errstate(all="ignore"):
            bad = ~np.isfinite(x.astype(np.float32))
        if bad.any():
            index = tuple(int(i) for i in np.argwhere(bad)[0])
            value = x.astype(np.float32)[index]
            self.nonfinite.append(f"{self.check}: {label} {name}[{index}] = {value}")

    def forward(self, p: Problem, *, check_shape: bool = True) -> np.ndarray:
        """The candidate's output on ``p`` as a NumPy array (bf16 stays bf16)."""
        (out,) = self._call(f"{p.label} forward", p, grad=False)
        if check_shape and out.shape != tuple(p.q.shape):
            raise CandidateFailure(f"{p.label}: output shape {out.shape}, expected {tuple(p.q.shape)}")
        if out.shape == tuple(p.q.shape):
            self._observe(p.label, "out", out)
        return out

    def paged_forward(self, p: PagedProblem) -> np.ndarray:
        """The paged candidate's output on ``p`` (``grading.paged.problems``) as a NumPy array; the shape is
        checked, the dtype left to the checks."""
        arrays = [p.q, p.k_pages, p.v_pages, p.lengths, p.table] + ([p.sinks] if p.sinks is not None else [])
        header = {"op": "paged", "causal": bool(p.causal), "scale": None if p.scale is None else float(p.scale),
                  "has_sinks": p.sinks is not None, "window": None if p.window is None else list(p.window),
                  "softcap": p.softcap}
        (out,) = self._exchange(f"{p.label} forward", p, header, arrays, 1)
        if out.shape != p.out_shape:
            raise CandidateFailure(f"{p.label}: output shape {out.shape}, expected {p.out_shape}")
        self._observe(p.label, "out", out)
        return out

    def ragged_forward(self, p) -> np.ndarray:
        """The ragged candidate's output on ``p`` (``grading.ragged.problems``: its ``arrays`` by argument name, q
        and the pools first, and its ``static`` keyword arguments) as a NumPy array; the shape is checked, and only
        the graded rows (``p.graded``) count for ``finite``: padding rows may hold anything."""
        header = {"op": "ragged", "names": list(p.arrays), "static": p.static}
        (out,) = self._exchange(f"{p.label} forward", p, header, list(p.arrays.values()), 1)
        if out.shape != p.out_shape:
            raise CandidateFailure(f"{p.label}: output shape {out.shape}, expected {p.out_shape}")
        self._observe(p.label, "out (graded rows)", out[p.graded])
        return out

    def vjp(self, p: Problem) -> tuple[np.ndarray, ...]:
        """``(out, dq, dk, dv)`` under the cotangent ``p.ct`` (cast to the output's dtype in the worker), and
        ``dsinks`` after them when ``p`` has sinks."""
        result = tuple(self._call(f"{p.label} gradients", p, grad=True))
        names = ("out", "dq", "dk", "dv", "dsinks")
        likes = (p.q, p.q, p.k, p.v, p.sinks)
        for name, x, like in zip(names, result, likes):
            if x.shape != tuple(like.shape):
                raise CandidateFailure(f"{p.label}: {name} shape {x.shape}, expected {tuple(like.shape)}")
        for name, x in zip(names, result):
            self._observe(p.label, name, x)
        return result


def _describe(e: Exception, limit_s: float) -> str:
    if isinstance(e, Expired):
        return f"no answer within {limit_s:g} s"
    if isinstance(e, WorkerGone):
        return f"it {e}"
    return _clean(f"{type(e).__name__}: {e}")
