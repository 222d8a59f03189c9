"""What a candidate is: a named callable the rubric grades, and the two ways naming or loading one fails.

``Candidate.contract`` names the contract it follows (``grading.contracts``); ``kind`` is one of ``KINDS``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import jax

from ..sandbox.errors import CandidateLoadError, CandidateSpecError  # noqa: F401  (re-exported)

Attention = Callable[..., jax.Array]
KINDS = ("reference", "kernel", "correct-variant", "known-bad", "external")


@dataclass(frozen=True)
class Candidate:
    """A named attention implementation. ``doc``'s first line says what it is (for known-bad: its bug)."""

    name: str
    kind: str
    doc: str
    loader: Callable[[], Attention] = field(repr=False)
    catches: tuple[str, ...] = ()
    root: str | None = None  # a folder the user named for a kernel of several files: bound, first on sys.path
    contract: str = "attention"  # which contract it follows and which checks grade it (grading.contracts)

    def load(self) -> Attention:
        """Import and return the callable; raises :class:`CandidateLoadError` with the reason."""
        try:
            fn = self.loader()
        except CandidateLoadError:
            raise
        except Exception as e:  # an import error in the candidate's own code is the candidate's problem
            raise CandidateLoadError(f"cannot load {self.name!r}: {type(e).__name__}: {e}") from e
        if not callable(fn):
            raise CandidateLoadError(f"{self.name!r} resolved to a {type(fn).__name__}, which is not callable")
        return fn

    @property
    def summary(self) -> str:
        return self.doc.strip().splitlines()[0] if self.doc.strip() else ""

