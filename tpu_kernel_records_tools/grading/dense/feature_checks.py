"""The checks of the contract's features, one per feature and named after it (``kernel_src.contract``):
``window``, ``softcap``, ``segments``, ``sinks``. The rubric runs a feature's check only for a candidate
that declares the feature; the base checks (``grading.dense.checks``) always run, without feature arguments.

Each check draws its problems at its feature's slots (``grading.dense.slots.draw_feature_slots``: every slot on
every seed) and judges them four ways:

* accuracy: the output (and, where the slot says so, dQ, dK, dV and dsinks) against the float64 truth
  within the tolerance policy's bounds, exact zeros on every row that sees no key (and a zero dQ
  there), exact zero dK, dV on keys no row sees;
* readout (window, segments): with V one-hot the output is the probability matrix, so every key the
  mask hides must get exactly zero and every visible key some probability;
* leaks: keys that no protected row may see (outside every row's window, padding under a cap, another
  document's keys) changed to large finite values; the protected rows must stay put;
* no-ops: a window that covers every key, all-equal segment ids, a cap of 1e30 and sinks of -1e30 must
  give what the same call without them gives (within the forward bound).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ...grading.dense.checks import (CHECKS, CheckSpec, Context, Outcome, _fresh, _gradient_verdicts, _judge_out,
                                     _one_hot_values, _perturb_keys, _stays_put, _summarize, plan_ahead, problems,
                                     readout_violations)
from ...grading.dense.problems import Problem, normal
from ...grading.dense.slots import BLOCK_SIZES, draw_feature_slots, draw_lengths
from kernel_src.contract import FEATURES, Dims


def feature_slots(ctx: Context, feature: str) -> dict[str, dict]:
    """The slots of ``feature`` of the context's slot seed and level, by name."""
    return {n: s for n, s in draw_feature_slots(ctx.slot_seed, ctx.level).items() if n.startswith(feature + "/")}


def _runs(rng: np.random.Generator, length: int, longest: int, ids) -> np.ndarray:
    """Ids in runs of 1..``longest`` positions, each run's id drawn from ``ids`` (it may repeat: A B A)."""
    out = np.empty(length, np.int32)
    start = 0
    while start < length:
        n = int(rng.integers(1, longest + 1))
        out[start:start + n] = rng.choice(ids)
        start += n
    return out


def _packed(rng: np.random.Generator, length: int, quick: bool) -> np.ndarray:
    """Document ids 0, 1, ... of a packed training row: 4-16 documents (3-6 at the quick level), one of
    them a single key long, boundaries anywhere (inside tiles), the last past three quarters of the row
    (its rows see no key of the leading quarters: whole leading key blocks masked, at any tile size)."""
    docs = int(rng.integers(3, 7) if quick else rng.integers(4, 17))
    cuts = np.sort(rng.choice(np.arange(2, length - 1), size=docs - 2, replace=False))
    if cuts[-1] < 3 * length // 4:
        cuts[-1] = rng.integers(3 * length // 4, length - 1)
        cuts = np.unique(cuts)
    cuts = np.concatenate([cuts, [cuts[-1] + 1]]) if cuts[-1] + 1 < length else np.concatenate([[1], cuts])
    return np.searchsorted(np.unique(cuts), np.arange(length), side="right").astype(np.int32)


def _cache_documents(rng: np.random.Generator, length: int, padded: int, more=()) -> np.ndarray:
    """Ids of a packed cache of ``padded`` keys: a document starts 1-3 keys after each of ``BLOCK_SIZES`` that
    leaves room before ``length`` and at each of ``more``; distinct ids in random order, the keys from ``length``
    on (padding) an id of their own."""
    starts = [size + int(rng.integers(1, 4)) for size in BLOCK_SIZES if size + 3 < length] + list(more)
    labels = rng.permutation(64)[:len(starts) + 2]
    ids = labels[np.searchsorted(np.array(starts), np.arange(padded), side="right")]
    ids[length:] = labels[-1]
    return ids.astype(np.int32)


def _cache_lengths(rng: np.random.Generator, d: Dims, quick: bool) -> np.ndarray:
    """segments/decode's kv_lengths: 1-7 keys past 128, 256, 512 and 1024 (32, 64 and 128 at the quick level)."""
    bases = (32, 64, 128) if quick else (128, 256, 512, 1024)
    return rng.permutation(np.array([n + int(rng.integers(1, 8)) for n in bases[:d.batch]], np.int32))


def _segments(rng: np.random.Generator, kind: str, d: Dims, quick: bool,
              lengths: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(q_segment_ids, kv_segment_ids)`` of a slot's kind (``grading.dense.slots`` table)."""
    b, lq, lk = d.batch, d.q_len, d.kv_len
    if kind == "chunk":  # the queries are the cache's last rows: its leading documents only among the keys
        kv = np.stack([_cache_documents(rng, lk - lq, lk, [lk - lq + int(rng.integers(1, lq))]) for _ in range(b)])
        return kv[:, lk - lq:], kv
    if kind == "decode":  # the queries continue each sequence's last document
        kv = np.stack([_cache_documents(rng, int(n), lk) for n in lengths])
        return np.repeat(kv[np.arange(b), lengths - 1][:, None], lq, axis=1), kv
    if kind == "packed":
        kv = np.stack([_packed(rng, lk, quick) for _ in range(b)])
        return kv[:, lk - lq:], kv
    if kind == "repeat":
        kv = np.stack([_runs(rng, lk, 6 if quick else 40, [0, 1, 2]) for _ in range(b)])
        return kv[:, lk - lq:], kv
    if kind == "cross":
        kv = np.stack([_runs(rng, lk, 6 if quick else 40, [1, 2, 3, 4, 5]) for _ in range(b)])
        q = rng.integers(1, 6, size=(b, lq)).astype(np.int32)
        q[:, rng.choice(lq, size=2, replace=False)] = 7  # an id no key has: those rows see nothing
        return q, kv
    if kind == "equal":
        value = int(rng.integers(0, 10))
        return np.full((b, lq), value, np.int32), np.full((b, lk), value, np.int32)
    raise ValueError(f"unknown segment kind {kind!r}")


def _sinks(rng: np.random.Generator, kind: str, q: np.ndarray, k: np.ndarray, scale: float) -> np.ndarray:
    """Float32 ``[num_q_heads]`` of a slot's kind; "high" lies 40-60 above every logit of its head."""
    hq, hk = q.shape[2], k.shape[2]
    if kind == "random":
        return (rng.standard_normal(hq) * 2).astype(np.float32)
    if kind == "high":
        kh = np.repeat(k, hq // hk, axis=2)
        top = np.einsum("bqhd,bkhd->hqk", q.astype(np.float64), kh.astype(np.float64)).reshape(hq, -1)
        return (np.abs(top).max(axis=1) * scale + rng.uniform(40, 60, size=hq)).astype(np.float32)
    if kind == "low":
        return (-60 - rng.uniform(0, 5, size=hq)).astype(np.float32)
    if kind == "off":
        return np.full(hq, -1e30, np.float32)
    raise ValueError(f"unknown sinks kind {kind!r}")


def _window_lengths(rng: np.random.Generator, d: Dims, window, quick: bool) -> np.ndarray:
    """kv_lengths for windowed decoding (the query at position kv_len - 1): the whole cache, one inside the
    window, and two that leave the row no visible key (its window holds only padding)."""
    w, lk = window[0] + 1, d.kv_len
    out = [lk, lk - int(rng.integers(1, w - 1)), lk - w - int(rng.integers(0, 4 if quick else 500)),
           int(rng.integers(1, 4 if quick else 100))]
    return rng.permutation(np.array(out[:d.batch], np.int32))


def feature_problem(ctx: Context, rng: np.random.Generator, name: str, *, grad: bool | None = None,
                    tag: str = "") -> Problem:
    """One draw at feature slot ``name`` (``grading.dense.slots.draw_feature_slots``) with every one of its flags."""
    spec = draw_feature_slots(ctx.slot_seed, ctx.level)[name]
    d, quick = spec["dims"], ctx.level == "quick"
    if spec["lengths"] and name == "window/decode":
        lengths = _window_lengths(rng, d, spec["window"], quick)
    elif spec["lengths"] and name == "segments/decode":
        lengths = _cache_lengths(rng, d, quick)
    elif spec["lengths"]:
        lengths = draw_lengths(rng, d)
    else:
        lengths = False
    grad = spec["grad"] if grad is None else grad
    p = normal(rng, d, spec["dtype"], causal=spec["causal"], lengths=lengths, scale=spec["scale"], grad=grad,
               name=name, tag=tag)
    q = p.host("q") * spec["q_boost"]
    scale = d.head_dim ** -0.5 if spec["scale"] is None else spec["scale"]
    segments = _segments(rng, spec["segments"], d, quick, p.lengths) if spec["segments"] else (None, None)
    sinks = None if spec["sinks"] is None else _sinks(rng, spec["sinks"], q, p.host("k"), scale)
    more = [f"window_size={spec['window']}"] if spec["window"] is not None else []
    more += [f"softcap={spec['softcap']:g}"] if spec["softcap"] is not None else []
    more += [f"q x{spec['q_boost']:g}"] if spec["q_boost"] != 1.0 else []
    more += [f"{spec['segments']} segment ids"] if spec["segments"] else []
    more += [f"{spec['sinks']} sinks"] if spec["sinks"] else []
    out = Problem(f"{p.label} {' '.join(more)}", p.dtype, q, p.host("k"), p.host("v"),
                  ct=None if p.ct is None else p.host("ct"), causal=p.causal, kv_lengths=p.lengths, scale=p.scale,
                  window=spec["window"], softcap=spec["softcap"], q_segments=segments[0], kv_segments=segments[1],
                  sinks=sinks)
    out.slot = name
    return out


def _without(p: Problem, feature: str) -> Problem:
    """``p``'s inputs and flags without ``feature``'s arguments (a fresh problem, judged on its own truth)."""
    keep = {"window": p.window, "softcap": p.softcap, "q_segments": p.q_segments, "kv_segments": p.kv_segments,
            "sinks": p.sinks}
    for name in {"window": ("window",), "softcap": ("softcap",), "segments": ("q_segments", "kv_segments"),
                 "sinks": ("sinks",)}[feature]:
        keep[name] = None
    plain = Problem(f"{p.label} without {feature}", p.dtype, p.host("q"), p.host("k"), p.host("v"), causal=p.causal,
                    kv_lengths=p.lengths, scale=p.scale, **keep)
    plain.slot = p.slot
    return plain


def _empty_row_violations(p: Problem, out: np.ndarray, dq: np.ndarray | None = None) -> list[str]:
    """Rows that see no key must be exact zeros, and so must their dQ."""
    empty = ~p.truth.visible.any(axis=2)  # [batch, q_len]
    bad = []
    for name, x in (("out", out), ("dq", dq)):
        if x is None:
            continue
        hit = empty[:, :, None, None] & (x.astype(np.float32) != 0)
        if hit.any():
            b, i, h, c = (int(n) for n in np.argwhere(hit)[0])
            bad.append(f"{p.label}: {name}[b={b}, i={i}, h={h}, d={c}] = {x[b, i, h, c]:.3g} on a row that sees no "
                       f"key (contract: exact zeros)")
    return bad


def _accuracy(ctx: Context, p: Problem, verdicts: list, violations: list) -> None:
    if p.ct is None:
        out = ctx.forward(p)
        verdicts.append(_judge_out(p, out))
        violations += _empty_row_violations(p, out)
    else:
        v, bad, result = _gradient_verdicts(ctx, p)
        verdicts += v
        violations += bad + _empty_row_violations(p, result[0], result[1])


def _readout(ctx: Context, p: Problem, verdicts: list, violations: list) -> None:
    out = ctx.forward(p)
    verdicts.append(_judge_out(p, out))
    violations += readout_violations(p, out)


def _leak(ctx: Context, p: Problem, changed: Problem, rows: np.ndarray, what: str, verdicts: list,
          violations: list) -> None:
    v, bad = _stays_put(ctx, p, changed, rows, what)
    verdicts += v
    violations += bad


def _hidden_from_all(p: Problem) -> np.ndarray:
    """Bool ``[batch, kv_len]``: real keys (before kv_lengths) that no row of ``p`` sees."""
    hidden = ~p.truth.visible.any(axis=1)
    if p.lengths is not None:
        hidden &= np.arange(p.k.shape[1])[None, :] < p.lengths[:, None]
    return hidden


def _run(ctx: Context, name: str, build, what: str) -> Outcome:
    verdicts, violations = [], []
    for probe in problems(ctx, name, build):
        kind = probe[0]
        if kind == "accuracy":
            _accuracy(ctx, probe[1], verdicts, violations)
        elif kind == "readout":
            _readout(ctx, probe[1], verdicts, violations)
        elif kind == "leak":
            _leak(ctx, *probe[1:], verdicts, violations)
    return _summarize(verdicts, violations, what)


def _no_op(p: Problem, feature: str) -> tuple:
    """A call with ``feature`` set so that it changes nothing, against the same call without it."""
    return ("leak", _without(p, feature), p.derive(p.label), np.ones(p.q.shape[:2], bool),
            f"{feature} set so that it hides or changes nothing, yet the output moved")


def check_window(ctx: Context) -> Outcome:
    def build(r):
        out = []
        for n, name in enumerate(("window/train", "window/wide", "window/chunk", "window/decode", "window/short",
                                  "window/self", "window/odd", "window/ahead")):
            out.append(("accuracy", feature_problem(ctx, r(n), name)))
        for n in range(2):
            out.append(("readout", _one_hot_values(feature_problem(ctx, r(10 + n), "window/readout"))))
        for n, name in enumerate(("window/chunk", "window/odd")):
            rng = r(20 + n)
            p = feature_problem(ctx, rng, name, grad=False)
            hidden = _hidden_from_all(p)
            out.append(("leak", p, _perturb_keys(p, rng, hidden, f"{p.label} keys outside every window changed"),
                        np.ones(p.q.shape[:2], bool), f"{int(hidden.sum())} keys outside every row's window changed"))
        out.append(_no_op(feature_problem(ctx, r(30), "window/all"), "window"))
        return out
    return _run(ctx, "window", build, "sliding windows at W - 1 and W for models' W (128, 1024, 4096), shorter and "
                                      "longer than the window, (0, 0), two-sided and off every tile, decoding with "
                                      "kv_lengths, queries ahead of every key, one-hot readout, keys outside every "
                                      "window changed, a window that covers every key")


def padding_under_cap(ctx: Context, rng: np.random.Generator) -> tuple:
    """The softcap check's leak probe: padding keys (past kv_lengths) changed under a cap of 5."""
    p = feature_problem(ctx, rng, "softcap/cap5", grad=False)
    hidden = np.arange(p.k.shape[1])[None, :] >= p.lengths[:, None]
    return ("leak", p, _perturb_keys(p, rng, hidden, f"{p.label} padding changed"), np.ones(p.q.shape[:2], bool),
            "padding keys changed under a cap of 5 (a cap applied after the mask lets them back in)")


def check_softcap(ctx: Context) -> Outcome:
    def build(r):
        out = [("accuracy", feature_problem(ctx, r(n), name))
               for n, name in enumerate(("softcap/cap5", "softcap/cap50", "softcap/d256"))]
        out.append(padding_under_cap(ctx, r(10)))
        out.append(_no_op(feature_problem(ctx, r(20), "softcap/huge"), "softcap"))
        return out
    return _run(ctx, "softcap", build, "caps of 5 and 50 with logits far past them, a non-default scale, causal and "
                                       "padding masks (forward and gradients), padding changed under the cap, a cap "
                                       "of 1e30")


def check_segments(ctx: Context) -> Outcome:
    def build(r):
        out = [("accuracy", feature_problem(ctx, r(n), name))
               for n, name in enumerate(("segments/packed", "segments/cross"))]
        out += [("accuracy", feature_problem(ctx, r(40 + n), name))
                for n, name in enumerate(("segments/chunk", "segments/decode"))]
        out += [("readout", _one_hot_values(feature_problem(ctx, r(10 + n), "segments/repeat"))) for n in range(2)]
        rng = r(20)
        p = feature_problem(ctx, rng, "segments/packed", grad=False)
        doc = int(np.median(p.kv_segments[0]))
        hidden = p.kv_segments == doc
        rows = p.q_segments != doc
        out.append(("leak", p, _perturb_keys(p, rng, hidden, f"{p.label} document {doc} changed"), rows,
                    f"the keys of document {doc} changed"))
        out.append(_no_op(feature_problem(ctx, r(30), "segments/equal"), "segments"))
        return out
    return _run(ctx, "segments", build, "packed documents (one a single key long, forward and gradients), chunked "
                                        "prefill and decoding over a packed cache (documents only among the keys, "
                                        "boundaries past every block size), repeated ids (A B A) read out one-hot, "
                                        "query ids of their own against a longer cache (an id no key has), one "
                                        "document's keys changed, all ids equal")


def check_sinks(ctx: Context) -> Outcome:
    def build(r):
        out = [("accuracy", feature_problem(ctx, r(n), name))
               for n, name in enumerate(("sinks/random", "sinks/high", "sinks/low"))]
        out.append(_no_op(feature_problem(ctx, r(20), "sinks/off"), "sinks"))
        return out
    return _run(ctx, "sinks", build, "a sink per query head (different within a kv group; forward, gradients and "
                                     "dsinks), sinks far above every logit with fully masked rows, far below, and "
                                     "at -1e30")


FEATURE_CHECKS: dict[str, CheckSpec] = {name: CheckSpec(name, 8, _fresh(run), summary) for name, run, summary in (
    ("window", check_window, "window_size (left, right) around each row's position, ends inclusive"),
    ("softcap", check_softcap, "logits capped as softcap * tanh(s / softcap) before the mask"),
    ("segments", check_segments, "keys visible only where q and kv segment ids are equal"),
    ("sinks", check_sinks, "one logit per query head in each row's denominator, no value"),
)}
assert tuple(FEATURE_CHECKS) == FEATURES


def checks_for(features: Sequence[str] = ()) -> tuple[CheckSpec, ...]:
    """The checks a candidate declaring ``features`` gets: every base check, then each feature's own."""
    return (*CHECKS, *(FEATURE_CHECKS[f] for f in features))


def plan_checks(seed: int, level: str, features: Sequence[str] = ()) -> None:
    """Build the problems of ``(seed, level)`` ahead on a thread (``checks.plan_ahead``): the base checks',
    or, given ``features``, those features' checks'."""
    plan_ahead(seed, level, [FEATURE_CHECKS[f] for f in features] if features else None)
