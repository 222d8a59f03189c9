"""The rubric's checks: each builds its problems (``grading.dense.problems``), calls the candidate through the
``Context`` (``ctx.forward(problem)`` / ``ctx.vjp(problem)``, which call ``ctx.runner``) and judges what
came back.

Every check draws fresh inputs from ``(seed, check name, trial)`` at the shapes of the context's level
(``grading.dense.problems.draw_shapes``: by seed at the sizes models run for "full", four toy shapes for
"quick"), so a new seed means new shapes and values; all candidates graded with one seed and level see
the same inputs (and the float64 truth and the reference's baseline are computed once per seed). Each
shape is drawn from a *slot* whose dtype and flags are fixed (``grading.dense.problems.SLOT_FLAGS``), and every
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
from typing import Callable

import numpy as np

from ...grading.dense import truth as oracle
from ...grading.calls import CandidateFailure, TimedOut  # noqa: F401  (re-exported)
from ...grading.check_context import FINITE, CheckSpec, Outcome, _first_difference, _summarize  # noqa: F401
from ...grading.dense.context import (Context, _gradient_verdicts, _judge_out, _one_hot_values,  # noqa: F401
                                      _perturb_keys, _stays_put, readout_violations)  # (re-exported: tests)
from ...grading.dense.problems import BACKGROUND_DAEMON, STOPPING, Problem, compute_ahead, normal  # noqa: F401
from ...grading.dense.slots import EXPLICIT_SCALE, QUICK, SHAPES, SHORT  # noqa: F401

# --------------------------------------------------------------------------------------------------
# The checks.

_CACHE: dict = {}
_BUILDING = threading.Lock()  # one check's problems are built at a time (a planning thread and the grade)
CACHE_SEEDS = 4  # the problems (inputs, truth, baseline) of this many (seed, level) pairs are kept


def problems(ctx: Context, check: str, build: Callable[[Callable[[int], np.random.Generator]], list], *,
             judged: bool = True) -> list:
    """``build(rng_of_trial)`` once per (seed, level, check); kept for the other candidates graded on the
    same seed (the most recent ``CACHE_SEEDS`` seeds and levels). ``judged=False``: the check reads no truth or
    baseline of them (``Problem.judged``), so none is computed."""
    with _BUILDING:
        return _problems(ctx, check, build, judged)


def cache_key(ctx: Context, check: str) -> tuple:
    """Where ``problems`` keeps ``check``'s problems: (seed, level, check), and the slots' seed if it is not the
    seed's own."""
    return (ctx.seed, ctx.level, check) + (() if ctx.slots_from in (None, ctx.seed) else (ctx.slots_from,))


def _problems(ctx: Context, check: str, build: Callable, judged: bool = True) -> list:
    key = cache_key(ctx, check)
    if key not in _CACHE:
        recent = list(dict.fromkeys(k[:2] for k in _CACHE))  # insertion order: oldest first
        if key[:2] not in recent and len(recent) >= CACHE_SEEDS:
            for old in [k for k in _CACHE if k[:2] == recent[0]]:
                del _CACHE[old]
        _CACHE[key] = build(lambda trial: ctx.rng(check, trial))
        if not judged:
            for p in _CACHE[key]:  # a flat list of problems
                p.judged = False
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
    baselines for the threads that compute ahead (``grading.dense.problems.compute_ahead``), so those work
    through the whole grade from the worker's start on instead of a check at a time. Each check runs
    until its first call of the candidate; an error is left for the graded run to meet and report. A
    check that asks for its problems while they are being built waits for them (``problems``). ``specs``:
    the checks to plan (default: ``CHECKS``)."""
    def run() -> None:
        ctx = _Planning(None, seed, level=level)
        for spec in CHECKS if specs is None else specs:
            if STOPPING.is_set():  # the interpreter is exiting (grading.dense.problems)
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
        ctx.problem(r(0), "gqa"), ctx.problem(r(1), "batch"), ctx.problem(r(2), "decode")], judged=False)
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


def check_mask_readout(ctx: Context) -> Outcome:
    ps = problems(ctx, "mask-readout", lambda r: [_one_hot_values(ctx.problem(r(n), "readout")) for n in range(2)])
    verdicts, violations = [], []
    for p in ps:
        out = ctx.forward(p)
        verdicts.append(_judge_out(p, out))
        violations += readout_violations(p, out)
    return _summarize(verdicts, violations, "with V one-hot the output is the probability matrix: exact zeros "
                                            "on every invisible key, none on visible ones")


CONSTANT_V = "V = kv head + 1"  # the tag of _constant_values' problems


def _constant_values(ctx: Context, rng: np.random.Generator, slot: str) -> Problem:
    """A draw at ``slot`` with V = kv head + 1 everywhere: query head h's output is h // group + 1."""
    p = ctx.problem(rng, slot, tag=CONSTANT_V)
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


def _mapping_only(p: Problem) -> bool:
    """With V constant the reference is exact; a kernel may round P to bfloat16 before P·V (the contract allows
    it), which moves a bfloat16 output by an ulp there: only the mapping is judged then (no truth, no baseline)."""
    return p.label.endswith(CONSTANT_V) and p.dtype != "float32"


def check_gqa_mapping(ctx: Context) -> Outcome:
    def build(r):
        ps = [_constant_values(ctx, r(0), "gqa"), ctx.problem(r(1), "gqa"), ctx.problem(r(2), "gqa")]
        for n, slot in enumerate(ctx.slots(*MANY_HEAD_SLOTS)):
            ps += [_constant_values(ctx, r(10 + 2 * n), slot), ctx.problem(r(11 + 2 * n), slot)]
        for p in ps:
            p.judged = not _mapping_only(p)
        return ps
    verdicts, violations = [], []
    for p in problems(ctx, "gqa-mapping", build):
        out = ctx.forward(p)
        const = p.label.endswith(CONSTANT_V)
        if not _mapping_only(p):
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


def check_determinism(ctx: Context) -> Outcome:
    def build(r):
        small = next(s for s in ctx.shapes if s.startswith("small"))
        return [ctx.problem(r(0), small, grad=True), ctx.problem(r(1), "batch")]
    violations = []
    for p in problems(ctx, "determinism", build, judged=False):
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
