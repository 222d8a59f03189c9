"""Grade trusted built-ins in the test process: the rubric's checks without a worker process.

The rubric itself runs every candidate in a worker of its own (``grading.runner``, tested by the
isolation tests). The tests of the checks, problems and tolerance grade dozens of built-ins, so they
call them here, in-process, where compiled executables and the float64 truth are shared between
candidates: the checks and their verdicts are exactly the rubric's (``grading.dense.checks.CHECKS``).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tpu_kernel_records_tools.grading.dense import checks as C
from tpu_kernel_records_tools.grading.candidates import resolve
from tpu_kernel_records_tools.grading.rubric import CheckResult, Scorecard, checks_for
from kernel_src.contract import declared_features


class InProcessRunner:
    """``forward``/``vjp`` like ``grading.runner.Runner``, calling the function directly."""

    def __init__(self, fn):
        self.fn = fn
        self.new_scorecard()

    def new_scorecard(self) -> None:
        self.nonfinite: list[str] = []
        self.returned, self.timed_out, self.check = 0, False, ""

    def _observe(self, label: str, name: str, x: np.ndarray) -> None:
        self.returned += 1
        if not np.all(np.isfinite(x.astype(np.float32))):
            self.nonfinite.append(f"{self.check}: {label} {name}")

    def forward(self, p, *, check_shape: bool = True) -> np.ndarray:
        try:
            out = np.asarray(self.fn(p.q, p.k, p.v, **p.kwargs))
        except Exception as e:
            raise C.CandidateFailure(f"{p.label} forward: raised {type(e).__name__}: {e}") from None
        if check_shape and out.shape != tuple(p.q.shape):
            raise C.CandidateFailure(f"{p.label}: output shape {out.shape}, expected {tuple(p.q.shape)}")
        if out.shape == tuple(p.q.shape):
            self._observe(p.label, "out", out)
        return out

    def vjp(self, p):
        kwargs = {n: x for n, x in p.kwargs.items() if n != "sinks"}
        try:
            if p.sinks is None:
                out, pull = jax.vjp(lambda q, k, v: self.fn(q, k, v, **kwargs), p.q, p.k, p.v)
            else:
                out, pull = jax.vjp(lambda q, k, v, s: self.fn(q, k, v, **kwargs, sinks=s), p.q, p.k, p.v,
                                    jnp.asarray(p.sinks))
            result = tuple(np.asarray(x) for x in (out, *pull(p.ct.astype(out.dtype))))
        except Exception as e:
            raise C.CandidateFailure(f"{p.label} gradients: raised {type(e).__name__}: {e}") from None
        for name, x in zip(("out", "dq", "dk", "dv", "dsinks"), result):
            self._observe(p.label, name, x)
        return result


def grade(name, *, seed: int = 0, level: str = "quick", only: Sequence[str] | None = None,
          runner: InProcessRunner | None = None, features: Sequence[str] | None = None) -> Scorecard:
    """A scorecard of built-in (or Candidate) ``name`` at ``level``; ``only``: run just these checks;
    ``features``: grade only these of its declared features (None: all it declares)."""
    cand = resolve(name)
    runner = runner or InProcessRunner(cand.load())
    declared = declared_features(runner.fn)
    features = declared if features is None else tuple(f for f in declared if f in features)
    ctx = C.Context(runner, seed, level=level)
    results, verdicts = [], {}
    for spec in checks_for(features):
        if only is not None and spec.name not in only:
            continue
        runner.check = spec.name
        try:
            outcome = spec.run(ctx)
        except C.CandidateFailure as e:
            outcome = C.Outcome(False, str(e))
        verdicts[spec.name] = outcome.verdicts
        results.append(CheckResult(spec.name, outcome.passed, float(spec.points) if outcome.passed else 0.0,
                                   float(spec.points), outcome.detail, outcome.error, outcome.tolerance,
                                   outcome.baseline_error))
    if only is None:
        points = float(C.FINITE.points)
        ok = not runner.nonfinite and runner.returned > 0
        results.append(CheckResult("finite", ok, points if ok else 0.0, points,
                                   "all finite" if ok else f"non-finite value: {runner.nonfinite[:1]}"))
    return Scorecard(cand.name, cand.kind, results, seed=seed, verdicts=verdicts, features=features)


def grade_seeds(candidate, seeds: Sequence[int], *, level: str = "full", **_ignored) -> list[Scorecard]:
    """``grading.rubric.grade_seeds`` in-process (for ``sweeps.power`` in tests)."""
    runner = InProcessRunner(resolve(candidate).load())
    cards = []
    for seed in seeds:
        runner.new_scorecard()
        cards.append(grade(candidate, seed=seed, level=level, runner=runner))
    return cards
