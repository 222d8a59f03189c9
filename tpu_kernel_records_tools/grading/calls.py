"""What a check calls: a candidate behind :class:`Calls` (``grading.runner.Runner`` in a worker, a stand-in in
tests and sweeps), and the failures a call raises instead of returning."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class CandidateFailure(Exception):
    """The candidate raised, returned something that is not a usable array, ran out of time or died."""


class TimedOut(CandidateFailure):
    pass


class Calls(Protocol):
    """A candidate as the checks see it; each call raises :class:`CandidateFailure` rather than return junk."""

    def forward(self, p, *, check_shape: bool = True) -> np.ndarray:
        """The output [batch, q_len, q_heads, head_dim] on the dense problem ``p``."""

    def vjp(self, p) -> tuple[np.ndarray, ...]:
        """``(out, dq, dk, dv[, dsinks])`` on the dense problem ``p`` under its cotangent."""

    def paged_forward(self, p) -> np.ndarray:
        """The output [batch, q_len, q_heads, head_dim] on the paged problem ``p``."""

    def ragged_forward(self, p) -> np.ndarray:
        """The output [num_tokens, q_heads, head_dim] on the ragged problem ``p``."""
