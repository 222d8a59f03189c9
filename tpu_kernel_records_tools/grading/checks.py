"""The rubric's checks: each builds its problems (``grading.problems``), calls the candidate through the
``Context`` (``ctx.forward(problem)`` / ``ctx.vjp(problem)``, which call ``ctx.runner``) and judges what
came back.

Every check draws fresh inputs from ``(seed, check name, trial)`` at the shapes of the context's level
(``grading.problems.draw_shapes``: by seed at the sizes models run for "full", four toy shapes for
"quick"), so a new seed means new shapes and values; all candidates graded with one seed and level see
the same inputs (and the float64 truth and the reference's baseline are computed once per seed). Each
shape is drawn from a *slot* whose dtype and flags are fixed (``grading.problems.SLOT_FLAGS``), and every
slot is called at least twice with different values in one grade: a fresh draw that gets the bits of an
earlier draw at the same shape and flags fails the check where it happens ("a result kept by shape").
Problem sizes: one large problem per check where that suffices, small ones where the check is exact
(head mapping, one-hot readout). Every failure detail starts with the problem's label: slot, dims
``(batch, q_len, kv_len, num_q_heads, num_kv_heads, head_dim)``, dtype and flags.

Tolerance checks use ``grading.tolerance``; the others are exact (bits, exact zeros, which kv head was
read) or metamorphic (change what must not matter, require the visible output to stay put). The
contract's rules (``kernel_src.contract``) and the check that judges each: output shape and dtype
(output-shape-dtype); exact zeros and zero dQ for rows that see no key (empty-rows); zero dK, dV for keys
no query sees (gradients, every check that takes gradients); padded K/V slots may hold any finite values
(padding-leak); bottom-right causal (causal-leak, mask-readout); kv head ``h // group`` (gqa-mapping);
the scale (scale, and every problem with an explicit scale).
"""

from __future__ import annotations

import threading
import zlib
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..grading import oracle
from ..grading.problems import BACKGROUND_DAEMON, STOPPING, Problem, compute_ahead, normal
from ..grading.slots import (EXPLICIT_SCALE, QUICK, SHAPES, SHORT, SLOT_MIN_LENGTH, draw_shapes,  # noqa: F401
                             serving_lengths, slot_flags)
from ..grading.runner import CandidateFailure, Runner, TimedOut  # noqa: F401  (re-exported)
from ..grading.tolerance import STORED_OUTPUT, Verdict, error, judge
from kernel_src.contract import Dims

# --------------------------------------------------------------------------------------------------
# Outcomes and helpers shared by the checks.

@dataclass
class Outcome:
    passed: bool
    detail: str
    error: float | None = None
    tolerance: float | None = None
    baseline_error: float | None = None
    verdicts: tuple[Verdict, ...] = ()


def _summarize(verdicts: list[Verdict], violations: list[str], what: str, *, explained: bool = False) -> Outcome:
    """Pass iff every verdict passed and no exact rule was violated; numbers from the closest verdict.

    ``explained``: each failed verdict already has its own line in ``violations`` (leak checks)."""
    failed = [] if explained else [v for v in verdicts if not v.ok]
    worst = max(verdicts, key=lambda v: v.ratio) if verdicts else None
    numbers = {}
    if worst is not None:
        _, err, tol, base = worst.binding
        numbers = {"error": _finite_or_none(err), "tolerance": tol, "baseline_error": base}
    parts = violations[:3] + [v.describe() for v in failed[:3]]
    if parts:
        more = len(violations) + len(failed) - len(parts)
        detail = "; ".join(parts) + (f"; and {more} more" if more > 0 else "")
    else:
        detail = f"{what}; closest to its bound: {worst.describe()}" if worst else what
    return Outcome(not parts, detail, verdicts=tuple(verdicts), **numbers)


def _judge_out(p: Problem, out: np.ndarray, label: str | None = None) -> Verdict:
    """The forward verdict of ``out`` on ``p`` (bound from the reference's output on the same inputs)."""
    return judge(label or p.label, out, p.truth.out, p.baseline[0], p.dtype, gradient=False,
                 magnitude=p.truth.magnitude["out"], logit_scale=p.logit_max)


def _finite_or_none(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None


def _where(index) -> str:
    return "(" + ", ".join(f"{n}={i}" for n, i in zip("bihd", index)) + ")"


def _perturb_keys(p: Problem, rng: np.random.Generator, hidden: np.ndarray, label: str) -> Problem:
    """A derived problem: K redrawn x30 and V shifted by +-1e4 at the key positions ``hidden`` (bool
    [batch, kv_len]); large but finite, which is all the contract promises about such slots."""
    k, v = p.host("k"), p.host("v")
    sel = hidden[:, :, None, None]
    k = np.where(sel, rng.standard_normal(k.shape, np.float32) * 30, k)
    v = np.where(sel, v + 1e4 * np.sign(rng.standard_normal(v.shape, np.float32)), v)
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


# --------------------------------------------------------------------------------------------------
# The checks.

@dataclass
class Context:
    """What every check receives: the candidate's runner, the seed, the level ("full" or "quick") and
    the outputs of this grade's fresh draws, by ``Problem.key`` (to catch a result reused across draws).

    ``slots_from``: the seed whose slots (shapes, dtypes and flags: ``draw_shapes``, ``draw_feature_slots``,
    ``draw_paged_slots``) the problems take, their values still drawn from ``seed``; None (every grade): ``seed``.
    A calibration lets several seeds share one seed's slots, so its compiled programs recur."""

    runner: Runner
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


_CACHE: dict = {}
_BUILDING = threading.Lock()  # one check's problems are built at a time (a planning thread and the grade)
CACHE_SEEDS = 4  # the problems (inputs, truth, baseline) of this many (seed, level) pairs are kept


def problems(ctx: Context, check: str, build: Callable[[Callable[[int], np.random.Generator]], list]) -> list:
    """``build(rng_of_trial)`` once per (seed, level, check); kept for the other candidates graded on the
    same seed (the most recent ``CACHE_SEEDS`` seeds and levels)."""
    with _BUILDING:
        return _problems(ctx, check, build)


def cache_key(ctx: Context, check: str) -> tuple:
    """Where ``problems`` keeps ``check``'s problems: (seed, level, check), and the slots' seed if it is not the
    seed's own."""
    return (ctx.seed, ctx.level, check) + (() if ctx.slots_from in (None, ctx.seed) else (ctx.slots_from,))


def _problems(ctx: Context, check: str, build: Callable) -> list:
    key = cache_key(ctx, check)
    if key not in _CACHE:
        recent = list(dict.fromkeys(k[:2] for k in _CACHE))  # insertion order: oldest first
        if key[:2] not in recent and len(recent) >= CACHE_SEEDS:
            for old in [k for k in _CACHE if k[:2] == recent[0]]:
                del _CACHE[old]
        _CACHE[key] = build(lambda trial: ctx.rng(check, trial))
        if ctx.ahead:
            compute_ahead(_CACHE[key])
    return _CACHE[key]


class _Planned(Exception):
    """A planning run reached its first call of the candidate: the check's problems are built."""


class _Planning(Context):
    def forward(self, p: Problem, *, check_shape: bool = True) -> np.ndarray:
        raise _Planned

    def vjp(self, p: Problem) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        raise _Planned


def plan_ahead(seed: int, level: str = "full", specs=None) -> threading.Thread:
    """Build every check's problems of ``(seed, level)`` on a thread of its own and queue their truths and
    baselines for the threads that compute ahead (``grading.problems.compute_ahead``), so those work
    through the whole grade from the worker's start on instead of a check at a time. Each check runs
    until its first call of the candidate; an error is left for the graded run to meet and report. A
    check that asks for its problems while they are being built waits for them (``problems``). ``specs``:
    the checks to plan (default: ``CHECKS``)."""
    def run() -> None:
        ctx = _Planning(None, seed, level=level)
        for spec in CHECKS if specs is None else specs:
            if STOPPING.is_set():  # the interpreter is exiting (grading.problems)
                return
            try:
                spec.run(ctx)
            except Exception:  # noqa: BLE001  _Planned, or a failure the graded run reports
                pass
    thread = threading.Thread(target=run, name="grading-plan", daemon=BACKGROUND_DAEMON)
    thread.start()
    return thread


def check_output_shape_dtype(ctx: Context) -> Outcome:
    ps = problems(ctx, "output-shape-dtype", lambda r: [
        ctx.problem(r(0), "gqa"), ctx.problem(r(1), "batch"), ctx.problem(r(2), "decode")])
    bad = []
    for p in ps:
        out = ctx.forward(p, check_shape=False)
        if out.shape != p.q.shape or str(out.dtype) != p.dtype:
            bad.append(f"{p.label}: returned shape {out.shape} dtype {out.dtype}, expected shape "
                       f"{tuple(p.q.shape)} dtype {p.dtype} (contract: the output has q's shape and dtype)")
    return Outcome(not bad, "; ".join(bad) or f"{len(ps)} calls returned q's shape in q's dtype "
                                                  f"(float32 and bfloat16)")


def _values_along_keys(p: Problem) -> Problem:
    """V the same at every key (each batch element, kv head and channel keeps its first key's value, a
    number with all of bfloat16's mantissa bits): the exact output is that value whatever the weights,
    so a kernel that accumulates in fp32 returns it exactly after rounding to bfloat16 (the reference's
    error is zero), while a running output or sum kept in bfloat16 over thousands of keys drifts by a
    few bfloat16 ulps (an output and a sum rounded alike stay in step only when the value is a power of 2)."""
    v = np.broadcast_to(p.host("v")[:, :1], p.v.shape)
    return p.replace(f"{p.label} V constant along keys", v=v)


def check_forward_accuracy(ctx: Context) -> Outcome:
    def build(r):
        ps = [ctx.problem(r(n), slot) for n, slot in enumerate(ctx.slots(
            "long", "accum", "batch", "ahead", "serve8", "spec", "longcache", "longdecode", "longspec", "prefill",
            "exact512", "exact2048", "exact4096"))]
        return ps + [_values_along_keys(ctx.problem(r(20), slot)) for slot in ctx.slots("longcache")]
    ps = problems(ctx, "forward-accuracy", build)
    verdicts = [_judge_out(p, ctx.forward(p)) for p in ps]
    return _summarize(verdicts, [], f"{len(ps)} random problems within the forward bound")


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


def check_gradients(ctx: Context) -> Outcome:
    ps = problems(ctx, "gradients", lambda r: [
        ctx.problem(r(n), slot, grad=True) for n, slot in enumerate(ctx.slots(
            "long", "accum", "decode", "gqa", "heads40", "exact512"))])
    verdicts, violations = [], []
    for p in ps:
        v, bad, _ = _gradient_verdicts(ctx, p)
        verdicts += [x for x in v if not x.label.endswith(" out")]
        violations += bad
    return _summarize(verdicts, violations, f"dQ, dK, dV under random cotangents on {len(ps)} problems "
                                            f"(causal, kv_lengths with an explicit scale, kv_lengths, unmasked; "
                                            f"many heads, training at exact tile multiples) within the gradient "
                                            f"bound")


def check_causal_leak(ctx: Context) -> Outcome:
    def build(r):
        out = []
        for trial, slot in enumerate(ctx.slots("long", "ahead", "spec", "prefill", "exact2048", "exact4096")):
            rng = r(trial)
            p = ctx.problem(rng, slot)
            lq, lk = p.q.shape[1], p.k.shape[1]
            cut = int(rng.integers(max(1, p.offset + 1), lk))  # keys >= cut are future for rows < cut - offset
            rows = np.zeros((p.q.shape[0], lq), bool)
            rows[:, :max(0, min(lq, cut - p.offset))] = True
            hidden = np.zeros((p.k.shape[0], lk), bool)
            hidden[:, cut:] = True
            out.append((p, _perturb_keys(p, rng, hidden, f"{p.label} keys>={cut} changed"), rows, cut))
        return out
    verdicts, violations = [], []
    for p, changed, rows, cut in problems(ctx, "causal-leak", build):
        v, bad = _stays_put(ctx, p, changed, rows, f"keys j >= {cut} (in the future of rows i < "
                                                     f"{cut - p.offset}, bottom-right causal) changed")
        verdicts += v
        violations += bad
    return _summarize(verdicts, violations, "future keys/values changed (K longer and shorter than Q); "
                                            "rows that cannot see them stayed put", explained=True)


def check_padding_leak(ctx: Context) -> Outcome:
    def build(r):
        out = []
        for trial, slot in enumerate(ctx.slots("accum", "decode", "serve8", "spec", "longcache", "longdecode",
                                               "longspec")):
            rng = r(trial)
            p = ctx.problem(rng, slot)
            hidden = np.arange(p.k.shape[1])[None, :] >= p.lengths[:, None]
            rows = np.ones(p.q.shape[:2], bool)
            out.append((p, _perturb_keys(p, rng, hidden, f"{p.label} padding changed"), rows))
        return out
    verdicts, violations = [], []
    for p, changed, rows in problems(ctx, "padding-leak", build):
        v, bad = _stays_put(ctx, p, changed, rows, f"keys at or past kv_lengths={p.lengths.tolist()} changed "
                                                   f"to large finite values (contract: padded K/V slots may hold "
                                                   f"any finite values)")
        verdicts += v
        violations += bad
    return _summarize(verdicts, violations, "keys/values past kv_lengths changed to large finite values; "
                                            "the output stayed put", explained=True)


def check_empty_rows(ctx: Context) -> Outcome:
    ps = problems(ctx, "empty-rows", lambda r: [
        ctx.problem(r(0), "batch", grad=True, zero_batch=1), ctx.problem(r(1), "ahead", grad=True),
        *(ctx.problem(r(2), slot, grad=True) for slot in ctx.slots("serve8"))])
    verdicts, violations, rows_seen = [], [], 0
    for p in ps:
        v, bad, (out, dq, _, _) = _gradient_verdicts(ctx, p)
        verdicts += v
        violations += bad
        empty = ~p.truth.visible.any(axis=2)  # [batch, q_len]
        rows_seen += int(empty.sum())
        o = out.astype(np.float64)
        for b, i in np.argwhere(empty):
            row = o[b, i]
            if np.all(row == 0):
                continue
            group = p.q.shape[2] // p.k.shape[2]
            mean_v = p.host("v")[b].astype(np.float64).mean(axis=0)  # [kv_heads, d]
            expect_mean = np.repeat(mean_v, group, axis=0)
            if not np.all(np.isfinite(row)):
                rule = ("NaN/Inf: the softmax of an all-masked row left undefined (what JAX's GPU reference "
                        "returns)")
            elif np.allclose(row, expect_mean, rtol=2e-2, atol=2e-2 * np.abs(expect_mean).max()):
                rule = ("the mean of V over all keys: uniform weights from a finite mask value (what JAX's "
                        "Pallas flash kernel returns)")
            else:
                rule = f"nonzero values (max |out| {np.nanmax(np.abs(row)):.3g})"
            violations.append(f"{p.label}: row (b={b}, i={i}) sees no key but got {rule}; the contract says "
                              f"exact zeros")
            break
        bad_dq = empty[:, :, None, None] & (dq.astype(np.float32) != 0)
        if bad_dq.any():
            b, i, h, d = (int(x) for x in np.argwhere(bad_dq)[0])
            violations.append(f"{p.label}: dq[b={b}, i={i}, h={h}, d={d}] = {dq[b, i, h, d]:.3g} on a row with no "
                              f"visible key (contract: dQ exactly zero for rows that see no key)")
    return _summarize(verdicts, violations, f"{rows_seen} rows with no visible key (queries ahead of every key "
                                            f"under bottom-right causal, kv_lengths = 0) gave exact zeros in the "
                                            f"output and dQ; gradients within bounds")


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


def check_mask_readout(ctx: Context) -> Outcome:
    ps = problems(ctx, "mask-readout", lambda r: [_one_hot_values(ctx.problem(r(n), "readout")) for n in range(2)])
    verdicts, violations = [], []
    for p in ps:
        out = ctx.forward(p)
        verdicts.append(_judge_out(p, out))
        violations += readout_violations(p, out)
    return _summarize(verdicts, violations, "with V one-hot the output is the probability matrix: exact zeros "
                                            "on every invisible key, none on visible ones")


def _constant_values(ctx: Context, rng: np.random.Generator, slot: str) -> Problem:
    """A draw at ``slot`` with V = kv head + 1 everywhere: query head h's output is h // group + 1."""
    p = ctx.problem(rng, slot, tag="V = kv head + 1")
    v = np.broadcast_to(np.arange(1, p.v.shape[2] + 1, dtype=np.float32)[None, None, :, None], p.v.shape)
    return p.replace(p.label, v=v)


def _misread_head(p: Problem, out: np.ndarray) -> str | None:
    """With V = kv head + 1: the first query head whose output names another kv head than h // group."""
    group, heads = p.group, p.k.shape[2]
    for h in range(p.q.shape[2]):
        level = float(np.mean(out[:, :, h].astype(np.float64)))
        read = int(np.rint(level)) - 1 if np.isfinite(level) else None
        if read == h // group or read is None:  # non-finite output: the accuracy verdict says so
            continue
        where = f"read kv head {read}" if 0 <= read < heads else "matches no kv head"
        return (f"{p.label}: q head {h} {where} (output ~ {level:.3g}), expected kv head {h // group} = "
                f"{h} // {group} (output {h // group + 1})")
    return None


def _misread_random(p: Problem, out: np.ndarray) -> str | None:
    """On random inputs: the first query head whose output is closer to another kv head's (only computed
    for an output outside the bound: it costs one float64 attention per kv head)."""
    per_head = oracle.per_head_outputs(p.q, p.k, p.v, causal=p.causal, kv_lengths=p.lengths, scale=p.scale)
    for h in range(p.q.shape[2]):
        if not np.all(np.isfinite(out[:, :, h])):
            continue
        errs = [float(np.linalg.norm(out[:, :, h] - per_head[g][:, :, h])) for g in range(p.k.shape[2])]
        best = int(np.argmin(errs))
        if best != h // p.group:
            return f"{p.label}: q head {h}'s output matches kv head {best}'s, expected kv head {h // p.group} = " \
                   f"{h} // {p.group}"
    return None


MANY_HEAD_SLOTS = ("heads24", "heads40", "heads64", "mha24", "mha40", "mha64")


def check_gqa_mapping(ctx: Context) -> Outcome:
    def build(r):
        ps = [_constant_values(ctx, r(0), "gqa"), ctx.problem(r(1), "gqa"), ctx.problem(r(2), "gqa")]
        for n, slot in enumerate(ctx.slots(*MANY_HEAD_SLOTS)):
            ps += [_constant_values(ctx, r(10 + 2 * n), slot), ctx.problem(r(11 + 2 * n), slot)]
        return ps
    verdicts, violations = [], []
    for p in problems(ctx, "gqa-mapping", build):
        out = ctx.forward(p)
        const = p.label.endswith("V = kv head + 1")
        # With V constant the reference is exact; a kernel may round P to bfloat16 before P·V (the contract
        # allows it), which moves a bfloat16 output by an ulp there: only the mapping is judged then.
        if not const or p.dtype == "float32":
            verdicts.append(_judge_out(p, out))
        if const:
            bad = _misread_head(p, out)
        elif verdicts and not verdicts[-1].ok and p.group > 1:
            bad = _misread_random(p, out.astype(np.float64))
        else:
            bad = None
        if bad and not any(v.startswith(p.label.split(" ")[0]) for v in violations if "'s output" in v):
            violations.append(bad)
    first = ctx.shapes["gqa"]
    more = sorted({(d.num_q_heads, d.num_kv_heads) for s, d in ctx.shapes.items() if s in MANY_HEAD_SLOTS})
    others = "; and " + ", ".join(f"{a}/{b}" for a, b in more) if more else ""
    return _summarize(verdicts, violations, f"{first.num_q_heads} query heads on {first.num_kv_heads} kv heads"
                      f"{others}: every query head read kv head h // group")


def _shifted_logits(p: Problem, rng: np.random.Generator) -> Problem:
    """Logits near +-500: every key gets a large common component along a per-(batch, kv head) direction."""
    d = p.q.shape[-1]
    u = rng.standard_normal((p.k.shape[0], 1, p.k.shape[2], d)).astype(np.float32)
    u /= np.linalg.norm(u, axis=-1, keepdims=True)
    q = p.host("q") * 2
    k = p.host("k") + u * (250.0 * np.sqrt(d) / 2)
    return p.replace(p.label + " logits ~ +-500", q=q, k=k)


def _needles(p: Problem, rng: np.random.Generator) -> Problem:
    """A few "needle" keys whose scaled logits exceed every other key's by 50-150 for every query row.

    Per (batch, kv head) a unit direction ``u``: every other key loses its ``u`` component, every query
    gains ``sqrt(head_dim) u``, and needle ``n`` gets ``a_n u`` with ``scale * sqrt(head_dim) * a_n`` equal to
    its gap: 100-150 for the first (past exp's float32 range, 88.7), 50-100 for the others. Needles sit
    where every query row of the batch element sees them, past the first 128 keys (past 512 when that
    fits), so chunked and split-KV kernels meet them after a first chunk without them."""
    b, lq, hq, d = p.q.shape
    lk, hk = p.k.shape[1], p.k.shape[2]
    scale = d ** -0.5 if p.scale is None else p.scale
    q, k = p.host("q"), p.host("k")
    u = rng.standard_normal((b, 1, hk, d)).astype(np.float32)
    u /= np.linalg.norm(u, axis=-1, keepdims=True)
    k -= np.sum(k * u, axis=-1, keepdims=True) * u
    q = q - np.sum(q * np.repeat(u, hq // hk, axis=2), axis=-1, keepdims=True) * np.repeat(u, hq // hk, axis=2)
    q += np.sqrt(d) * np.repeat(u, hq // hk, axis=2)
    where = []
    for batch in range(b):
        end = lk if p.lengths is None else int(p.lengths[batch])
        if p.causal:
            end = min(end, p.offset + 1)  # keys every row sees
        if end <= 0:
            continue
        start = 512 if end > 640 else 128 if end > 192 else 0
        spots = rng.choice(np.arange(start, end), size=min(3, end - start), replace=False)
        gaps = np.concatenate([[rng.uniform(100, 150)], rng.uniform(50, 100, size=len(spots) - 1)])
        for j, gap in zip(spots, gaps):
            k[batch, j] += (gap / (scale * np.sqrt(d))) * u[batch, 0]
        where.append(f"b{batch}:{sorted(int(j) for j in spots)}")
    return p.replace(f"{p.label} needles {' '.join(where)}", q=q, k=k)


def check_large_logits(ctx: Context) -> Outcome:
    def build(r):
        return [_shifted_logits(ctx.problem(r(0), "needle"), r(10)), _needles(ctx.problem(r(1), "needle"), r(11)),
                _needles(ctx.problem(r(2), "needle", grad=True), r(12)), _needles(ctx.problem(r(3), "decode"), r(13))]
    verdicts, violations = [], []
    for p in problems(ctx, "large-logits", build):
        if p.ct is None:
            verdicts.append(_judge_out(p, ctx.forward(p)))
        else:
            v, bad, _ = _gradient_verdicts(ctx, p)
            verdicts += v
            violations += bad
    return _summarize(verdicts, violations, "logits near +-500, and needle keys 50-150 above the rest "
                                            "(forward, gradients, split-KV decoding)")


def _peaky(p: Problem, rng: np.random.Generator) -> Problem:
    """Each query row puts a logit gap of 4..120 on one visible key; V integer-valued."""
    b, lq, hq, d = p.q.shape
    lk, hk = p.k.shape[1], p.k.shape[2]
    k = p.host("k")[:, :, np.arange(hq) // (hq // hk)]  # [b, lk, hq, d]: the key each query head reads
    limit = np.full(b, lk) if p.lengths is None else np.maximum(p.lengths, 1)
    scale = d ** -0.5 if p.scale is None else p.scale
    q = np.empty((b, lq, hq, d), np.float32)
    for i in range(lq):
        last = np.minimum(limit - 1, i + p.offset if p.causal else lk - 1)  # [b]
        last = np.maximum(last, 0)
        targets = (rng.random((b, hq)) * (last[:, None] + 1)).astype(int)
        gaps = rng.uniform(4, 120, size=(b, hq))
        kt = np.take_along_axis(k, targets[:, None, :, None], axis=1)[:, 0]  # [b, hq, d]
        q[:, i] = kt * (gaps / scale / np.sum(kt * kt, axis=-1))[..., None]
    v = rng.integers(-3, 4, size=p.v.shape).astype(np.float32)
    return p.replace(p.label + " peaky, integer V", q=q, v=v)


def check_peaky(ctx: Context) -> Outcome:
    ps = problems(ctx, "peaky-attention", lambda r: [
        _peaky(ctx.problem(r(0), "gqa"), r(10)), _peaky(ctx.problem(r(1), "batch"), r(11))])
    verdicts = [_judge_out(p, ctx.forward(p)) for p in ps]
    return _summarize(verdicts, [], "low-entropy rows (one key dominates by 4..120 in the logits)")


def check_scale(ctx: Context) -> Outcome:
    def build(r):
        slots = [s for s in ctx.shapes if s.startswith("small")]
        return [ctx.problem(r(2 * n + grad), slot, grad=bool(grad)) for n, slot in enumerate(slots)
                for grad in (0, 1)]
    verdicts, violations = [], []
    for p in problems(ctx, "scale", build):
        if p.ct is None:
            verdicts.append(_judge_out(p, ctx.forward(p)))
        else:
            v, bad, _ = _gradient_verdicts(ctx, p)
            verdicts += v
            violations += bad
    dims = sorted({ctx.shapes[s].head_dim for s in ctx.shapes if s.startswith("small")})
    return _summarize(verdicts, violations, f"scale={EXPLICIT_SCALE:g} at head_dim {dims} (forward and "
                                            f"gradients, every flag combination)")


def _first_difference(a: np.ndarray, b: np.ndarray) -> tuple[int, ...] | None:
    if a.shape != b.shape or a.dtype != b.dtype:
        return ()
    bits = f"u{a.dtype.itemsize}"
    diff = a.view(bits) != b.view(bits)
    return tuple(int(i) for i in np.argwhere(diff)[0]) if diff.any() else None


def check_determinism(ctx: Context) -> Outcome:
    def build(r):
        small = next(s for s in ctx.shapes if s.startswith("small"))
        return [ctx.problem(r(0), small, grad=True), ctx.problem(r(1), "batch")]
    violations = []
    for p in problems(ctx, "determinism", build):
        copy = p.derive(p.label)  # equal values, fresh arrays
        if p.ct is not None:
            first, second = ctx.vjp(p), ctx.vjp(copy)
        else:
            first, second = (ctx.forward(p),), (ctx.forward(copy),)
        for name, a, b in zip(("out", "dq", "dk", "dv"), first, second):
            index = _first_difference(a, b)
            if index is not None:
                violations.append(f"{p.label}: {name} differs between two calls on the same inputs at {index} "
                                  f"({a[index] if index else a.dtype} vs {b[index] if index else b.dtype})")
                break
    return Outcome(not violations, "; ".join(violations) or
                   "same inputs twice gave the same bits (gradients and a bfloat16 forward)")


def check_fresh_inputs(ctx: Context) -> Outcome:
    ps = problems(ctx, "fresh-inputs", lambda r: [ctx.problem(r(t), "readout", tag=f"draw {t + 1}")
                                                  for t in range(3)])
    verdicts, violations, outs = [], [], []
    for n, p in enumerate(ps):
        out = ctx.forward(p)
        verdicts.append(_judge_out(p, out))
        for m, earlier in enumerate(outs):
            if np.array_equal(out, earlier):
                violations.append(f"{p.label}: draw {n + 1} returned the same bits as draw {m + 1} although the "
                                  f"inputs differ (memoized or input-independent output)")
        stale = [m for m, q in enumerate(ps[:n]) if
                 np.linalg.norm(out - q.truth.out) < 0.5 * np.linalg.norm(out - p.truth.out)]
        if stale:
            violations.append(f"{p.label}: draw {n + 1} is closer to the answer for draw {stale[0] + 1}'s inputs "
                              f"than to its own (stale result)")
        outs.append(out)
    return _summarize(verdicts, violations, "three fresh draws on one shape and flags: each output answers "
                                            "its own inputs")


def _fresh(run: Callable[[Context], Outcome]) -> Callable[[Context], Outcome]:
    """Fail a check in which a fresh draw got the bits of an earlier draw at the same shape and flags."""
    def checked(ctx: Context) -> Outcome:
        outcome = run(ctx)
        stale, ctx.stale[:] = list(ctx.stale), []
        if not stale:
            return outcome
        detail = "; ".join(stale[:2]) + ("" if outcome.passed else "; " + outcome.detail)
        return Outcome(False, detail, outcome.error, outcome.tolerance, outcome.baseline_error, outcome.verdicts)
    checked.__name__ = checked.__qualname__ = run.__name__
    checked.__doc__ = run.__doc__
    return checked


@dataclass(frozen=True)
class CheckSpec:
    name: str
    points: float
    run: Callable[[Context], Outcome]
    summary: str


CHECKS: tuple[CheckSpec, ...] = tuple(CheckSpec(name, points, _fresh(run), summary) for name, points, run, summary in (
    ("output-shape-dtype", 5, check_output_shape_dtype, "output is [batch, q_len, num_q_heads, head_dim] in q's "
     "dtype"),
    ("forward-accuracy", 12, check_forward_accuracy, "random problems within the forward bound"),
    ("gradients", 12, check_gradients, "dQ, dK, dV under random cotangents, also unmasked; exact zero dK/dV on "
     "keys no query sees"),
    ("causal-leak", 8, check_causal_leak, "changing future keys/values leaves earlier rows put"),
    ("padding-leak", 8, check_padding_leak, "changing keys past kv_lengths (to any finite values) leaves the "
     "output put"),
    ("empty-rows", 8, check_empty_rows, "rows with no visible key give exact zeros (and zero dQ)"),
    ("mask-readout", 8, check_mask_readout, "one-hot V reads out the probabilities: exact zeros on invisible keys"),
    ("gqa-mapping", 8, check_gqa_mapping, "query head h reads kv head h // group"),
    ("large-logits", 6, check_large_logits, "logits near +-500 and needle keys 50-150 above the rest (forward, "
     "gradients, split-KV decoding)"),
    ("peaky-attention", 5, check_peaky, "low-entropy attention, integer V"),
    ("scale", 5, check_scale, "an explicit scale at every head_dim, forward and gradients"),
    ("determinism", 5, check_determinism, "same inputs twice give the same bits"),
    ("fresh-inputs", 6, check_fresh_inputs, "fresh inputs get fresh answers (no memoizing, no input-independent "
     "output)"),
))
FINITE = CheckSpec("finite", 4, lambda ctx: None, "no NaN or Inf in any output or gradient returned")
