"""The rubric's checks: each builds its problems (``grading.problems``), calls the candidate through a
``grading.runner.Runner`` and judges what came back.

Every check draws fresh inputs from ``(seed, check name, trial)``, so a new seed means new values on
every trial; all candidates graded with one seed see the same inputs (and the float64 truth and the
reference's baseline are computed once per seed). Shapes are small on purpose (interpret-mode Pallas
runs a Python loop per grid step) but cover: q_len < kv_len, q_len == kv_len, q_len > kv_len, key
widths 12/24/40/136 (none a multiple of 128; 136 spans two 128-lane blocks), head_dim 16/32/48/64,
one kv head, two and three kv heads with groups of 2 and 3, float32 and bfloat16.

Tolerance checks use ``grading.tolerance``; the others are exact (bits, exact zeros, which kv head was
read) or metamorphic (change what must not matter, require the visible output to stay put).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable

import numpy as np

from grading import oracle
from grading.problems import EXPLICIT_SCALE, SHAPES, SHORT, Problem, normal  # noqa: F401
from grading.runner import CandidateFailure, Runner, TimedOut  # noqa: F401  (re-exported)
from grading.tolerance import Verdict, error, judge

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
                 magnitude=p.truth.magnitude["out"])


def _finite_or_none(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None


def _where(index) -> str:
    return "(" + ", ".join(f"{n}={i}" for n, i in zip("bihd", index)) + ")"


def _perturb_keys(p: Problem, rng: np.random.Generator, hidden: np.ndarray, label: str) -> Problem:
    """Redraw K and shift V by +100 at the key positions ``hidden`` (bool [batch, kv_len])."""
    k, v = p.host("k"), p.host("v")
    sel = hidden[:, :, None, None]
    k = np.where(sel, rng.standard_normal(k.shape, np.float32) * 3, k)
    v = np.where(sel, v + 100.0, v)
    return p.replace(label, k=k, v=v)


def _stays_put(ctx: "Context", p: Problem, changed: Problem, rows: np.ndarray,
               what: str) -> tuple[Verdict, str | None]:
    """Run ``p`` and ``changed``; on ``rows`` (bool [batch, q_len]) the output must not move.

    The change, measured like an error (relative to the magnitude of the protected output), is held
    to the forward bound of ``p`` on those rows (set by the reference's error there)."""
    before, after = ctx.runner.forward(p), ctx.runner.forward(changed)
    sel = np.broadcast_to(rows[:, :, None, None], before.shape)
    truth = np.where(sel, p.truth.out, 0.0)
    magnitude = np.where(sel, p.truth.magnitude["out"], 0.0)
    bound = judge(p.label, np.where(sel, before.astype(np.float64), 0.0), truth,
                  np.where(sel, p.baseline[0].astype(np.float64), 0.0), p.dtype, gradient=False,
                  magnitude=magnitude)
    change = error(np.where(sel, after.astype(np.float64), 0.0), np.where(sel, before.astype(np.float64), 0.0),
                   magnitude)
    moved = Verdict(f"{changed.label} change", change, bound.baseline, bound.tol_norm, bound.tol_worst,
                    p.dtype, False)
    if moved.ok:
        return moved, None
    return moved, (f"{changed.label}: {what}; rows that cannot see them moved by {change.worst:.3g} "
                   f"(relative, tol {bound.tol_worst:.3g}) at {_where(change.index)}")


# --------------------------------------------------------------------------------------------------
# The checks.

@dataclass
class Context:
    runner: Runner
    seed: int

    def rng(self, check: str, trial: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, zlib.crc32(check.encode()), trial])


_CACHE: dict = {}


def problems(ctx: Context, check: str, build: Callable[[Callable[[int], np.random.Generator]], list]) -> list:
    """``build(rng_of_trial)`` once per (seed, check); kept for the other candidates of the same seed."""
    key = (ctx.seed, check)
    if key not in _CACHE:
        if any(k[0] != ctx.seed for k in _CACHE):
            _CACHE.clear()
        _CACHE[key] = build(lambda trial: ctx.rng(check, trial))
    return _CACHE[key]


def check_output_shape_dtype(ctx: Context) -> Outcome:
    ps = problems(ctx, "output-shape-dtype", lambda r: [
        normal(r(0), "A", "float32"), normal(r(1), "A", "bfloat16", causal=True, lengths=True),
        normal(r(2), "D", "float32", causal=True, lengths=True)])
    bad = []
    for p in ps:
        out = ctx.runner.forward(p, check_shape=False)
        if out.shape != p.q.shape or str(out.dtype) != p.dtype:
            bad.append(f"{p.label}: returned shape {out.shape} dtype {out.dtype}, expected shape "
                       f"{tuple(p.q.shape)} dtype {p.dtype}")
    return Outcome(not bad, "; ".join(bad) or f"{len(ps)} calls returned q's shape in the input dtype "
                                                  f"(float32 and bfloat16)")


def check_forward_accuracy(ctx: Context) -> Outcome:
    ps = problems(ctx, "forward-accuracy", lambda r: [
        normal(r(0), "A", "float32"), normal(r(1), "A", "bfloat16", causal=True, lengths=True),
        normal(r(2), "B", "float32", causal=True, lengths=True),
        normal(r(3), "C", "bfloat16", causal=True, lengths=True),
        normal(r(4), "D", "float32", causal=True, lengths=True)])
    verdicts = [_judge_out(p, ctx.runner.forward(p)) for p in ps]
    return _summarize(verdicts, [], f"{len(ps)} random problems within the forward bound")


def _gradient_verdicts(ctx: Context, p: Problem) -> tuple[list[Verdict], list[str], tuple]:
    result = ctx.runner.vjp(p)
    t = p.truth
    verdicts = [_judge_out(p, result[0], f"{p.label} out")]
    for name, got, want, base in zip(("dq", "dk", "dv"), result[1:], (t.dq, t.dk, t.dv), p.baseline[1:]):
        verdicts.append(judge(f"{p.label} {name}", got, want, base, p.dtype, gradient=True,
                              magnitude=t.magnitude[name]))
    violations = []
    unseen = ~t.visible.any(axis=1)  # [batch, kv_len]: keys no query may see
    for name, got in zip(("dk", "dv"), result[2:]):
        hit = unseen[:, :, None, None] & (got.astype(np.float32) != 0)
        if hit.any():
            b, j, h, d = (int(i) for i in np.argwhere(hit)[0])
            violations.append(f"{p.label}: {name}[b={b}, j={j}, h={h}, d={d}] = {got[b, j, h, d]:.3g} but no "
                              f"query may see key {j} (contract: exact zero)")
    return verdicts, violations, result


def check_gradients(ctx: Context) -> Outcome:
    ps = problems(ctx, "gradients", lambda r: [
        normal(r(0), "A", "float32", grad=True),
        normal(r(1), "A", "bfloat16", causal=True, lengths=True, grad=True),
        normal(r(2), "D", "float32", causal=True, lengths=True, grad=True)])
    verdicts, violations = [], []
    for p in ps:
        v, bad, _ = _gradient_verdicts(ctx, p)
        verdicts += [x for x in v if not x.label.endswith(" out")]
        violations += bad
    return _summarize(verdicts, violations, f"dQ, dK, dV under random cotangents on {len(ps)} problems "
                                            f"(one unmasked) within the gradient bound")


def check_causal_leak(ctx: Context) -> Outcome:
    def build(r):
        out = []
        for trial, (shape, dtype) in enumerate((("A", "float32"), ("B", "float32"), ("D", "float32"))):
            rng = r(trial)
            p = normal(rng, shape, dtype, causal=True, lengths="full")
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
        verdicts.append(v)
        violations += [bad] if bad else []
    return _summarize(verdicts, violations, "future keys/values changed (K longer, equal, shorter than Q); "
                                            "rows that cannot see them stayed put", explained=True)


def check_padding_leak(ctx: Context) -> Outcome:
    def build(r):
        out = []
        for trial, (shape, dtype) in enumerate((("A", "float32"), ("C", "bfloat16"), ("B", "float32"))):
            rng = r(trial)
            p = normal(rng, shape, dtype, causal=True, lengths=True)
            hidden = np.arange(p.k.shape[1])[None, :] >= p.lengths[:, None]
            rows = np.ones(p.q.shape[:2], bool)
            out.append((p, _perturb_keys(p, rng, hidden, f"{p.label} padding changed"), rows))
        return out
    verdicts, violations = [], []
    for p, changed, rows in problems(ctx, "padding-leak", build):
        v, bad = _stays_put(ctx, p, changed, rows, f"keys at or past kv_lengths={p.lengths.tolist()} changed")
        verdicts.append(v)
        violations += [bad] if bad else []
    return _summarize(verdicts, violations, "keys/values past kv_lengths changed (one length past 128); "
                                            "the output stayed put", explained=True)


def check_empty_rows(ctx: Context) -> Outcome:
    ps = problems(ctx, "empty-rows", lambda r: [
        normal(r(0), "D", "float32", causal=True, lengths=True, zero_batch=1, grad=True),
        normal(r(1), "A", "bfloat16", causal=True, lengths=True, zero_batch=0, grad=True)])
    violations, rows_seen = [], 0
    for p in ps:
        out, dq, _, _ = ctx.runner.vjp(p)
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
                              f"visible key (contract: exact zero)")
    return Outcome(not violations, "; ".join(violations[:3]) or
                   f"{rows_seen} rows with no visible key (causal q_len > kv_len, kv_lengths = 0) gave exact "
                   f"zeros in the output and in dQ")


def _one_hot_values(rng, shape, *, causal, lengths, tag) -> Problem:
    p = normal(rng, shape, "float32", causal=causal, lengths=lengths, tag=tag)
    v = np.zeros(p.v.shape, np.float32)
    lk, d = v.shape[1], v.shape[3]
    assert d >= lk, "one-hot values need head_dim >= kv_len"
    v[:, np.arange(lk), :, np.arange(lk)] = 1.0  # v[b, j, h, j] = 1: out[b, i, h, j] = P[b, h, i, j]
    return p.replace(p.label, v=v)


def check_mask_readout(ctx: Context) -> Outcome:
    ps = problems(ctx, "mask-readout", lambda r: [
        _one_hot_values(r(0), "A", causal=True, lengths=True, tag="one-hot V"),
        _one_hot_values(r(1), "D", causal=True, lengths=True, tag="one-hot V"),
        _one_hot_values(r(2), "B", causal=True, lengths=True, tag="one-hot V")])
    verdicts, violations = [], []
    for p in ps:
        out = ctx.runner.forward(p)
        verdicts.append(_judge_out(p, out))
        lk = p.k.shape[1]
        got = np.transpose(out.astype(np.float64)[..., :lk], (0, 2, 1, 3))  # [b, h, i, j] probabilities
        vis = np.broadcast_to(p.truth.visible[:, None], got.shape)
        leaked = ~vis & (got != 0)
        hidden = vis & (got == 0) & (p.truth.probs > 1e-30)
        for kind, where in (("leak", leaked), ("hidden", hidden)):
            if not where.any():
                continue
            b, h, i, j = (int(x) for x in np.argwhere(where)[0])
            if kind == "leak":
                why = []
                if p.causal and j > i + p.offset:
                    why.append(f"in its future (bottom-right causal allows j <= {i + p.offset})" if i + p.offset >= 0
                               else "in its future (under bottom-right causal this row sees no key)")
                if p.lengths is not None and j >= p.lengths[b]:
                    why.append(f"padding (kv_lengths[{b}] = {p.lengths[b]})")
                violations.append(f"{p.label}: query (b={b}, i={i}, h={h}) gave probability {got[b, h, i, j]:.3g} "
                                  f"to key {j}, which is {' and '.join(why)}")
            else:
                hint = " (causal mask aligned top-left?)" if p.causal and j > i else ""
                violations.append(f"{p.label}: query (b={b}, i={i}, h={h}) gave zero probability to visible key "
                                  f"{j}{hint}")
    return _summarize(verdicts, violations, "with V one-hot the output is the probability matrix: exact zeros "
                                            "on every invisible key, none on visible ones")


def check_gqa_mapping(ctx: Context) -> Outcome:
    def build(r):
        const = normal(r(0), "A", "float32", tag="V = kv head + 1")
        v = np.broadcast_to(np.arange(1, const.v.shape[2] + 1, dtype=np.float32)[None, None, :, None],
                            const.v.shape)
        return [const.replace(const.label, v=v), normal(r(1), "A", "bfloat16", causal=True, lengths=True),
                normal(r(2), "D", "float32", causal=True, lengths=True)]
    const, *randoms = problems(ctx, "gqa-mapping", build)
    verdicts, violations = [], []
    out = ctx.runner.forward(const)
    verdicts.append(_judge_out(const, out))
    group, heads = const.q.shape[2] // const.k.shape[2], const.k.shape[2]
    for h in range(const.q.shape[2]):
        level = float(np.mean(out[:, :, h].astype(np.float64)))
        read = int(np.rint(level)) - 1 if np.isfinite(level) else None
        if read == h // group or read is None:  # non-finite output: the accuracy verdict says so
            continue
        where = f"read kv head {read}" if 0 <= read < heads else "matches no kv head"
        violations.append(f"{const.label}: q head {h} {where} (output ~ {level:.3g}), expected kv head "
                          f"{h // group} = {h} // {group} (output {h // group + 1})")
        break
    for p in randoms:
        out = ctx.runner.forward(p).astype(np.float64)
        verdicts.append(_judge_out(p, out))
        per_head = oracle.per_head_outputs(p.q, p.k, p.v, causal=p.causal, kv_lengths=p.lengths, scale=p.scale)
        group = p.q.shape[2] // p.k.shape[2]
        for h in range(p.q.shape[2]):
            if not np.all(np.isfinite(out[:, :, h])):
                continue
            errs = [float(np.linalg.norm(out[:, :, h] - per_head[g][:, :, h])) for g in range(p.k.shape[2])]
            best = int(np.argmin(errs))
            if best != h // group:
                violations.append(f"{p.label}: q head {h}'s output matches kv head {best}'s, expected kv head "
                                  f"{h // group} = {h} // {group}")
                break
    return _summarize(verdicts, violations, "6 query heads on 3 kv heads and 4 on 2: every query head read kv "
                                            "head h // group")


def _shifted_logits(rng, shape, dtype, *, grad=False, masked=False) -> Problem:
    """Logits near +-500: every key gets a large common component along a per-(batch, kv head) direction."""
    p = normal(rng, shape, dtype, grad=grad, causal=masked, lengths=masked, tag="logits ~ +-500")
    d = p.q.shape[-1]
    u = rng.standard_normal((p.k.shape[0], 1, p.k.shape[2], d)).astype(np.float32)
    u /= np.linalg.norm(u, axis=-1, keepdims=True)
    q = p.host("q") * 2
    k = p.host("k") + u * (250.0 * np.sqrt(d) / 2)
    return p.replace(p.label, q=q, k=k)


def check_large_logits(ctx: Context) -> Outcome:
    ps = problems(ctx, "large-logits", lambda r: [
        _shifted_logits(r(0), "A", "float32"), _shifted_logits(r(1), "A", "bfloat16", masked=True),
        _shifted_logits(r(2), "A", "float32", grad=True)])
    verdicts, violations = [], []
    for p in ps:
        if p.ct is None:
            verdicts.append(_judge_out(p, ctx.runner.forward(p)))
        else:
            v, bad, _ = _gradient_verdicts(ctx, p)
            verdicts += v
            violations += bad
    return _summarize(verdicts, violations, "logits shifted by up to several hundred (softmax is shift-invariant)")


def _peaky(rng, shape, dtype, *, masked: bool) -> Problem:
    """Each query row puts a logit gap of 4..120 on one visible key; V integer-valued."""
    p = normal(rng, shape, dtype, causal=masked, lengths=masked, tag="peaky, integer V")
    b, lq, hq, d = p.q.shape
    lk, hk = p.k.shape[1], p.k.shape[2]
    k = p.host("k")[:, :, np.arange(hq) // (hq // hk)]  # [b, lk, hq, d]: the key each query head reads
    limit = np.full(b, lk) if p.lengths is None else p.lengths
    q = np.empty((b, lq, hq, d), np.float32)
    for i in range(lq):
        last = np.minimum(limit - 1, i + p.offset if masked else lk - 1)  # [b], every row sees key 0
        targets = (rng.random((b, hq)) * (last[:, None] + 1)).astype(int)
        gaps = rng.uniform(4, 120, size=(b, hq))
        kt = np.take_along_axis(k, targets[:, None, :, None], axis=1)[:, 0]  # [b, hq, d]
        q[:, i] = kt * (gaps * d ** 0.5 / np.sum(kt * kt, axis=-1))[..., None]
    v = rng.integers(-3, 4, size=p.v.shape).astype(np.float32)
    return p.replace(p.label, q=q, v=v)


def check_peaky(ctx: Context) -> Outcome:
    ps = problems(ctx, "peaky-attention", lambda r: [
        _peaky(r(0), "A", "float32", masked=False), _peaky(r(1), "A", "bfloat16", masked=True)])
    verdicts = [_judge_out(p, ctx.runner.forward(p)) for p in ps]
    return _summarize(verdicts, [], "low-entropy rows (one key dominates by 4..120 in the logits)")


def check_scale(ctx: Context) -> Outcome:
    ps = problems(ctx, "scale", lambda r: [
        normal(r(0), "B", "float32", causal=True, lengths=True, tag="scale=None"),
        normal(r(1), "C", "bfloat16", causal=True, lengths=True, tag="scale=None"),
        normal(r(2), "A", "float32", scale=EXPLICIT_SCALE)])
    verdicts = [_judge_out(p, ctx.runner.forward(p)) for p in ps]
    return _summarize(verdicts, [], "scale=None (head_dim 32 and 48, so head_dim**-0.5) and an explicit scale")


def _first_difference(a: np.ndarray, b: np.ndarray) -> tuple[int, ...] | None:
    if a.shape != b.shape or a.dtype != b.dtype:
        return ()
    bits = f"u{a.dtype.itemsize}"
    diff = a.view(bits) != b.view(bits)
    return tuple(int(i) for i in np.argwhere(diff)[0]) if diff.any() else None


def check_determinism(ctx: Context) -> Outcome:
    ps = problems(ctx, "determinism", lambda r: [
        normal(r(0), "A", "float32", grad=True),
        normal(r(1), "C", "bfloat16", causal=True, lengths=True)])
    violations = []
    for p in ps:
        copy = p.replace(p.label)  # equal values, fresh arrays
        if p.ct is not None:
            first, second = ctx.runner.vjp(p), ctx.runner.vjp(copy)
        else:
            first, second = (ctx.runner.forward(p),), (ctx.runner.forward(copy),)
        for name, a, b in zip(("out", "dq", "dk", "dv"), first, second):
            index = _first_difference(a, b)
            if index is not None:
                violations.append(f"{p.label}: {name} differs between two calls on the same inputs at {index} "
                                  f"({a[index] if index else a.dtype} vs {b[index] if index else b.dtype})")
                break
    return Outcome(not violations, "; ".join(violations) or
                   "same inputs twice gave the same bits (forward float32+bfloat16, gradients float32)")


def check_fresh_inputs(ctx: Context) -> Outcome:
    ps = problems(ctx, "fresh-inputs", lambda r: [
        normal(r(t), "A", "float32", causal=True, lengths=True, tag=f"draw {t + 1}") for t in range(3)])
    verdicts, violations, outs = [], [], []
    for n, p in enumerate(ps):
        out = ctx.runner.forward(p)
        verdicts.append(_judge_out(p, out))
        for m, earlier in enumerate(outs):
            if np.array_equal(out, earlier):
                violations.append(f"draw {n + 1} returned the same bits as draw {m + 1} although the inputs "
                                  f"differ (memoized or input-independent output)")
        stale = [m for m, q in enumerate(ps[:n]) if
                 np.linalg.norm(out - q.truth.out) < 0.5 * np.linalg.norm(out - p.truth.out)]
        if stale:
            violations.append(f"draw {n + 1} is closer to the answer for draw {stale[0] + 1}'s inputs than to its "
                              f"own (stale result)")
        outs.append(out)
    return _summarize(verdicts, violations, "three fresh draws on one shape and flags: each output answers "
                                            "its own inputs")


@dataclass(frozen=True)
class CheckSpec:
    name: str
    points: float
    run: Callable[[Context], Outcome]
    summary: str


CHECKS: tuple[CheckSpec, ...] = (
    CheckSpec("output-shape-dtype", 5, check_output_shape_dtype, "output is [batch, q_len, num_q_heads, head_dim] "
              "in the input dtype"),
    CheckSpec("forward-accuracy", 12, check_forward_accuracy, "random problems within the forward bound"),
    CheckSpec("gradients", 12, check_gradients, "dQ, dK, dV under random cotangents, also unmasked; exact zero "
              "dK/dV on keys no query sees"),
    CheckSpec("causal-leak", 8, check_causal_leak, "changing future keys/values leaves earlier rows put"),
    CheckSpec("padding-leak", 8, check_padding_leak, "changing keys past kv_lengths leaves the output put"),
    CheckSpec("empty-rows", 8, check_empty_rows, "rows with no visible key give exact zeros (and zero dQ)"),
    CheckSpec("mask-readout", 8, check_mask_readout, "one-hot V reads out the probabilities: exact zeros on "
              "invisible keys"),
    CheckSpec("gqa-mapping", 8, check_gqa_mapping, "query head h reads kv head h // group"),
    CheckSpec("large-logits", 6, check_large_logits, "logits near +-500 (forward and gradients)"),
    CheckSpec("peaky-attention", 5, check_peaky, "low-entropy attention, integer V"),
    CheckSpec("scale", 5, check_scale, "default scale head_dim**-0.5 and an explicit scale"),
    CheckSpec("determinism", 5, check_determinism, "same inputs twice give the same bits"),
    CheckSpec("fresh-inputs", 6, check_fresh_inputs, "fresh inputs get fresh answers (no memoizing, no "
              "input-independent output)"),
)
FINITE = CheckSpec("finite", 4, lambda ctx: None, "no NaN or Inf in any output or gradient returned")
