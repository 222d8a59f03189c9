"""A runner for the project's built-ins that calls the worker's own request handler in this process.

``sweeps.calibration`` grades its built-ins through it: the same calls and results as in a worker process,
their jitted functions and compiled programs kept across seeds.
"""

from __future__ import annotations

import numpy as np

from ..grading.candidates import BUILTIN, Candidate
from ..grading.runner import CandidateFailure, Runner


class InProcessRunner(Runner):
    """``grading.runner.Runner`` whose requests go to the worker's own handler (``grading.serve.AttentionServer``)
    in this process: for the project's built-ins only (our code; a stranger's never runs here)."""

    def __init__(self, candidate: Candidate):
        if BUILTIN.get(candidate.name) is not candidate:
            raise ValueError(f"{candidate.name} is not a built-in: it runs in a sandboxed worker, never in-process")
        super().__init__(candidate, isolation="in-process")
        self.server = None

    def start(self) -> str | None:
        from ..grading.serve import AttentionServer

        self.server = AttentionServer()
        reply = self.server.load({"op": "load", "spec": self.candidate.name})
        if not reply.get("ok"):
            self.down = reply.get("error", "the candidate could not be loaded")
            return self.down
        self.features = tuple(reply.get("features") or ())
        self.down = None
        return None

    @property
    def alive(self) -> bool:
        return self.server is not None and self.down is None

    @property
    def memory_limit(self) -> str | None:
        return None

    def close(self) -> None:
        pass

    def _exchange(self, what: str, p, header: dict, arrays: list, count: int):
        if self.down is not None:
            raise CandidateFailure(f"not run: {self.down}")
        arrays = [np.array(a, copy=True) for a in arrays]  # fresh buffers, as the worker receives: never the grader's
        try:
            reply, results = self.server.call(header, arrays)
        except Exception as e:  # the worker reports a raising candidate the same way
            raise CandidateFailure(f"{what}: raised {type(e).__name__}: {str(e)[:300]}") from None
        if not reply.get("ok"):
            raise CandidateFailure(f"{what}: {'raised ' if reply.get('raised') else ''}{reply.get('error')}")
        if reply.get("inputs_modified"):
            raise CandidateFailure(f"{what}: inputs modified: {', '.join(reply['inputs_modified'])}")
        if len(results) != count:
            raise CandidateFailure(f"{what}: the worker returned {len(results)} arrays")
        return results
