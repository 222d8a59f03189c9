"""The dense checks' context (``grading.dense.checks``, ``grading.dense.feature_checks``; the paged checks use it
too): ``Context`` (the candidate's runner, the seed, the level, the slots' draws, and the bookkeeping that
catches a result kept by shape), and the helpers that turn a candidate's outputs into verdicts: forward and
gradient bounds, the outputs that must stay put when hidden keys change and the one-hot readout of the
probabilities. What every contract's checks share is ``grading.check_context``.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np

from ...grading.calls import Calls
from ...grading.dense.problems import Problem, normal
from ...grading.dense.slots import SLOT_MIN_LENGTH, draw_shapes, serving_lengths, slot_flags
from ...grading.tolerance import STORED_OUTPUT, Verdict, error, judge
from kernel_src.contract import Dims


def _judge_out(p: Problem, out: np.ndarray, label: str | None = None) -> Verdict:
    """The forward verdict of ``out`` on ``p`` (bound from the reference's output on the same inputs)."""
    return judge(label or p.label, out, p.truth.out, p.baseline[0], p.dtype, gradient=False,
                 magnitude=p.truth.magnitude["out"], logit_scale=p.logit_max)


def _where(index) -> str:
    return "(" + ", ".join(f"{n}={i}" for n, i in zip("bihd", index)) + ")"


def _perturb_keys(p: Problem, rng: np.random.Generator, hidden: np.ndarray, label: str) -> Problem:
    """A derived problem: K redrawn x30 and V shifted by +-1e4 at the key positions ``hidden`` (bool
    [batch, kv_len]); large but finite, which is all the contract promises about such slots. Only the hidden
    values are drawn: a long cache's hidden keys are a fraction of it."""
    k, v = p.host("k"), p.host("v")
    sel = np.broadcast_to(hidden[:, :, None, None], k.shape)
    count = int(np.count_nonzero(sel))
    k[sel] = rng.standard_normal(count, np.float32) * 30
    v[sel] += 1e4 * np.sign(rng.standard_normal(count, np.float32))
    return p.derive(label, k=k, v=v)


def _stays_put(ctx: "Context", p: Problem, changed: Problem, rows: np.ndarray,
               what: str) -> tuple[list[Verdict], list[str]]:
    """Run ``p`` and ``changed``; on ``rows`` (bool [batch, q_len]) ``p``'s output must be accurate and
    must not move.

    The change, measured like an error (relative to the magnitude of the protected output), is held
    to the forward bound of ``p`` on those rows (set by the reference's error there)."""
    before, after = ctx.forward(p), ctx.forward(changed)
    sel = np.broadcast_to(rows[:, :, None, None], before.shape)
    truth = np.where(sel, p.truth.out, 0.0)
    magnitude = np.where(sel, p.truth.magnitude["out"], 0.0)
    bound = judge(f"{p.label} (rows that cannot see the change)", np.where(sel, before.astype(np.float64), 0.0),
                  truth, np.where(sel, p.baseline[0].astype(np.float64), 0.0), p.dtype, gradient=False,
                  magnitude=magnitude, logit_scale=p.logit_max)
    change = error(np.where(sel, after.astype(np.float64), 0.0), np.where(sel, before.astype(np.float64), 0.0),
                   magnitude)
    moved = Verdict(f"{changed.label} change", change, bound.baseline, bound.tol_norm, bound.tol_worst,
                    p.dtype, False, bound.floor_scale)
    bad = [] if bound.ok else [bound.describe()]
    if not moved.ok:
        bad.append(f"{changed.label}: {what}; rows that cannot see them moved by {change.worst:.3g} "
                   f"(relative, tol {bound.tol_worst:.3g}) at {_where(change.index)}")
    return [bound, moved], bad


@dataclass
class Context:
    """What every check receives: the candidate's runner, the seed, the level ("full" or "quick") and
    the outputs of this grade's fresh draws, by ``Problem.key`` (to catch a result reused across draws).

    ``slots_from``: the seed whose slots (shapes, dtypes and flags: ``draw_shapes``, ``draw_feature_slots``,
    ``draw_paged_slots``) the problems take, their values still drawn from ``seed``; None (every grade): ``seed``.
    A calibration lets several seeds share one seed's slots, so its compiled programs recur."""

    runner: Calls
    seed: int
    level: str = "full"
    seen: dict = field(default_factory=dict, repr=False)
    stale: list = field(default_factory=list, repr=False)
    ahead: bool = True  # queue each check's truths and baselines for the background threads as it builds them
    slots_from: int | None = None

    @property
    def slot_seed(self) -> int:
        """The seed the slots are drawn from (``slots_from``, else ``seed``)."""
        return self.seed if self.slots_from is None else self.slots_from

    def rng(self, check: str, trial: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, zlib.crc32(check.encode()), trial])

    @property
    def shapes(self) -> dict[str, Dims]:
        return draw_shapes(self.slot_seed, self.level)

    def problem(self, rng: np.random.Generator, slot: str, *, grad: bool = False, lengths=None,
                zero_batch: int | None = None, tag: str = "") -> Problem:
        """Normal inputs at ``slot``'s shape with its dtype and flags (``lengths``: an override array)."""
        dtype, causal, with_lengths, scale = slot_flags(self.shapes, slot)
        if with_lengths and lengths is not None:
            with_lengths = np.asarray(lengths, np.int32)
        elif with_lengths and self.shapes[slot].batch >= 8:  # a serving batch: 8 distinct lengths, 0 and full
            with_lengths = serving_lengths(rng, self.shapes[slot])
        return normal(rng, self.shapes[slot], dtype, causal=causal, lengths=with_lengths, scale=scale,
                      grad=grad, zero_batch=zero_batch if with_lengths is True else None, tag=tag, name=slot,
                      min_length=SLOT_MIN_LENGTH.get(slot, 1))

    def slots(self, *names: str) -> tuple[str, ...]:
        """Those of ``names`` drawn at this context's level (the serving slots are not in the quick one)."""
        return tuple(n for n in names if n in self.shapes)

    def _record(self, p: Problem, out: np.ndarray) -> None:
        """Fresh draws at one shape and flags must not get the same bits (memoized or input-blind)."""
        if p.derived:
            return
        earlier = self.seen.setdefault(p.key, [])
        for other, other_out in earlier:
            if other is not p and np.array_equal(out, other_out) and not np.array_equal(p.host("q"), other.host("q")):
                self.stale.append(f"{p.label}: returned the same bits as the earlier call at this shape and "
                                  f"flags on different inputs ({other.label}): a result kept by shape")
                break
        earlier.append((p, out))

    def forward(self, p: Problem, *, check_shape: bool = True) -> np.ndarray:
        out = self.runner.forward(p, check_shape=check_shape)
        if out.shape == p.q.shape:
            self._record(p, out)
        return out

    def vjp(self, p: Problem) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        result = self.runner.vjp(p)
        self._record(p, result[0])
        return result


def _gradient_verdicts(ctx: Context, p: Problem) -> tuple[list[Verdict], list[str], tuple]:
    """Output and dQ, dK, dV judged (dK/dV may round per query head, ``Problem.grouped_baseline``; dQ/dK
    may take ``rowsum(dO * O)`` from the stored output: judged against that answer too,
    ``Truth.stored_out_grads``), and
    the contract's exact zeros: dK, dV on keys no query sees. With sinks, dsinks too (judged on float32
    problems: on bfloat16 ones the reference's float32 dsinks sets no bound for a kernel that computes it
    from its bfloat16 output, as FlashAttention-style backwards do)."""
    result = ctx.vjp(p)
    t = p.truth
    verdicts = [_judge_out(p, result[0], f"{p.label} out")]
    grouped = p.grouped_baseline or (None, None)
    stored = t.stored_out_grads or (None, None)
    for name, got, want, base, alt, answer in zip(("dq", "dk", "dv"), result[1:4], (t.dq, t.dk, t.dv),
                                                  p.baseline[1:4], (None, *grouped), (*stored, None)):
        verdicts.append(judge(f"{p.label} {name}", got, want, base, p.dtype, gradient=True,
                              magnitude=t.magnitude[name], alternatives=(alt,),
                              answers={STORED_OUTPUT: answer}, logit_scale=p.logit_max))
    if p.sinks is not None and p.dtype == "float32":
        verdicts.append(judge(f"{p.label} dsinks", result[4], t.dsinks, p.baseline[4], "float32", gradient=True,
                              magnitude=t.magnitude["dsinks"], logit_scale=p.logit_max))
    violations = []
    unseen = ~t.visible.any(axis=1)  # [batch, kv_len]: keys no query may see
    for name, got in zip(("dk", "dv"), result[2:4]):
        hit = unseen[:, :, None, None] & (got.astype(np.float32) != 0)
        if hit.any():
            b, j, h, d = (int(i) for i in np.argwhere(hit)[0])
            violations.append(f"{p.label}: {name}[b={b}, j={j}, h={h}, d={d}] = {got[b, j, h, d]:.3g} but no "
                              f"query may see key {j} (contract: dK, dV exactly zero for keys no query sees)")
    return verdicts, violations, result


def _one_hot_values(p: Problem) -> Problem:
    v = np.zeros(p.v.shape, np.float32)
    lk, d = v.shape[1], v.shape[3]
    assert d >= lk, "one-hot values need head_dim >= kv_len"
    v[:, np.arange(lk), :, np.arange(lk)] = 1.0  # v[b, j, h, j] = 1: out[b, i, h, j] = P[b, h, i, j]
    return p.replace(p.label + " one-hot V", v=v)


def _why_hidden(p: Problem, b: int, i: int, j: int) -> list[str]:
    """Each reason key ``j`` is invisible to row ``(b, i)`` of ``p`` under the contract, in words."""
    why, position = [], i + p.offset
    if p.causal and j > position:
        why.append(f"in its future (bottom-right causal allows j <= {position})" if position >= 0
                   else "in its future (under bottom-right causal this row sees no key)")
    if p.lengths is not None and j >= p.lengths[b]:
        why.append(f"padding (kv_lengths[{b}] = {p.lengths[b]})")
    if p.window is not None:
        left, right = p.window
        if (left is not None and j < position - left) or (right is not None and j > position + right):
            low = "" if left is None else position - left
            high = "" if right is None else position + right
            why.append(f"outside its window_size={p.window} (keys {low}..{high} around its position {position})")
    if p.q_segments is not None and p.q_segments[b, i] != p.kv_segments[b, j]:
        why.append(f"in segment {p.kv_segments[b, j]} (the row's is {p.q_segments[b, i]})")
    return why


def readout_violations(p: Problem, out: np.ndarray) -> list[str]:
    """With V one-hot (``_one_hot_values``) the output is the probability matrix: the first key that got
    probability while invisible, and the first visible key that got none, each as a line."""
    lk = p.k.shape[1]
    got = np.transpose(out.astype(np.float64)[..., :lk], (0, 2, 1, 3))  # [b, h, i, j] probabilities
    vis = np.broadcast_to(p.truth.visible[:, None], got.shape)
    leaked = ~vis & (got != 0)
    hidden = vis & (got == 0) & (p.truth.probs > 1e-30)
    violations = []
    for kind, where in (("leak", leaked), ("hidden", hidden)):
        if not where.any():
            continue
        b, h, i, j = (int(x) for x in np.argwhere(where)[0])
        if kind == "leak":
            violations.append(f"{p.label}: query (b={b}, i={i}, h={h}) gave probability {got[b, h, i, j]:.3g} "
                              f"to key {j}, which is {' and '.join(_why_hidden(p, b, i, j))}")
        else:
            hint = " (causal mask aligned top-left?)" if p.causal and j > i else ""
            violations.append(f"{p.label}: query (b={b}, i={i}, h={h}) gave zero probability to visible key "
                              f"{j}{hint}")
    return violations


