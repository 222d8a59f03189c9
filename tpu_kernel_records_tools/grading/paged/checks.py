"""The paged rubric's checks (``tpu-kernel-rubric --paged``): each draws problems at the paged slots
(``grading.paged.slots``, ``grading.paged.problems``), calls the candidate through ``ctx.runner.paged_forward``
(its own sandboxed worker, as for the dense contract) and judges what came back.

Every pool is NaN wherever no key is (unused slots of last pages, unused pages, the pages trailing table
entries point at), so garbage that leaks shows in every check. Accuracy uses the project's one tolerance
policy (``grading.tolerance``) with the paged reference's error as the baseline; rows that see no key
must be exact zeros. The checks and what each probes:

* paged-output: the output has q's shape and dtype (float32 and bfloat16).
* paged-accuracy: every slot but ``long`` (page sizes 16, 32, 128 and one no power of two; lengths 0, 1,
  ``page_size - 1``, ``page_size``, ``page_size + 1``, multiples and the full table; batches 1-64; q_len 1-8;
  groups 1-8; shared pages) within the forward bound, exact zeros on rows that see no key.
* paged-garbage: the same keys with everything else NaN, then +-Inf, then +-1e38, then the table's trailing
  entries re-pointed (NaN pages <-> page 0): not one bit of the output may change.
* paged-permutation: the pool permuted with the table permuted alike: not one bit may change.
* paged-dense: judged against the dense contract's float64 truth on the gathered cache
  (``grading.paged.truth.dense_twin``: right-aligned, segment ids hiding the slots before a shorter
  sequence), causal and not.
* paged-long: ``long`` (32,768-131,072 keys in bfloat16, thousands of pages per sequence, page indices past
  2^15), random V and V constant along keys (exact for fp32 accumulation, drifts in a bfloat16 one).
* paged-window, paged-softcap, paged-sinks: for a candidate that declares the feature, problems where it
  matters (windows across page boundaries, speculative rows whose windows start on both sides of one, logits
  far past the cap, sinks high and random), judged like paged-accuracy.
"""

from __future__ import annotations

import numpy as np

from ...grading.dense import truth as oracle
from ...grading.dense.checks import CheckSpec, Context, Outcome, _first_difference, _summarize, problems
from ...grading.paged.problems import FILLS, PagedProblem, draw
from ...grading.paged.slots import PagedSlot, draw_paged_slots
from ...grading.paged.truth import dense_twin
from ...grading.tolerance import Verdict, judge
from kernel_src.contract import PAGED_FEATURES


def slots(ctx: Context) -> dict[str, PagedSlot]:
    """The paged slots of the context's slot seed and level."""
    return draw_paged_slots(ctx.slot_seed, ctx.level)


def _judge(p: PagedProblem, out: np.ndarray, truth: np.ndarray | None = None, label: str | None = None) -> Verdict:
    """The forward verdict of ``out`` on ``p`` (against ``truth``, default the paged float64 truth)."""
    return judge(label or p.label, out, p.truth.out if truth is None else truth, p.baseline[0], p.dtype,
                 gradient=False, magnitude=p.truth.magnitude["out"], logit_scale=p.logit_max)


def _empty_rows(p: PagedProblem, out: np.ndarray) -> list[str]:
    """The first row that sees no key but is not exact zeros, as a line (none: [])."""
    bad = p.truth.empty[:, :, None, None] & (out.astype(np.float32) != 0)
    if not bad.any():
        return []
    b, i, h, d = (int(x) for x in np.argwhere(bad)[0])
    why = "kv_lengths is 0" if p.lengths[b] == 0 else f"its position {int(p.lengths[b]) - p.q.shape[1] + i} < 0"
    return [f"{p.label}: row (b={b}, i={i}) sees no key ({why}) but out[b={b}, i={i}, h={h}, d={d}] = "
            f"{out[b, i, h, d]:.3g}; the contract says exact zeros"]


def _accurate(ctx: Context, ps: list[PagedProblem], what: str) -> Outcome:
    verdicts, violations = [], []
    for p in ps:
        out = ctx.runner.paged_forward(p)
        verdicts.append(_judge(p, out))
        violations += _empty_rows(p, out)
    return _summarize(verdicts, violations, what)


def check_paged_output(ctx: Context) -> Outcome:
    s = slots(ctx)
    ps = problems(ctx, "paged-output", lambda r: [draw(r(0), s["spec32"]), draw(r(1), s["vllm16"])])
    bad = []
    for p in ps:
        out = ctx.runner.paged_forward(p)
        if str(out.dtype) != p.dtype:
            bad.append(f"{p.label}: returned dtype {out.dtype}, expected {p.dtype} (contract: the output has q's "
                       f"shape and dtype)")
    return Outcome(not bad, "; ".join(bad) or f"{len(ps)} calls returned q's shape in q's dtype (float32, bfloat16)")


def check_paged_accuracy(ctx: Context) -> Outcome:
    s = slots(ctx)
    ps = problems(ctx, "paged-accuracy", lambda r: [draw(r(n), s[name]) for n, name in enumerate(
        ("vllm16", "spec32", "tpu128", "odd", "single"))])
    sizes = sorted({p.slot.page_size for p in ps})
    return _accurate(ctx, ps, f"{len(ps)} NaN-filled pools (page sizes {sizes}, lengths 0, 1, page_size - 1, "
                              f"page_size, page_size + 1, multiples, full) within the forward bound; rows with no "
                              f"visible key exact zeros")


def _same_bits(p: PagedProblem, base: np.ndarray, changed: PagedProblem, out: np.ndarray, rule: str) -> list[str]:
    index = _first_difference(base, out)
    if index is None:
        return []
    if index == ():
        return [f"{changed.label}: returned {out.dtype} {out.shape}, the unchanged pool {base.dtype} {base.shape}"]
    return [f"{changed.label}: out{list(index)} = {out[index]:.6g}, but {base[index]:.6g} on the unchanged pool "
            f"(contract: {rule})"]


def check_paged_garbage(ctx: Context) -> Outcome:
    s = slots(ctx)

    def build(r):
        out = []
        for n, name in enumerate(("spec32", "odd", "vllm16")):
            p = draw(r(n), s[name])
            out.append((p, [p.refilled(kind, r(10 + n)) for kind in FILLS if kind != "nan"] + [p.retabled(r(20 + n))]))
        return out
    verdicts, violations = [], []
    for p, changed in problems(ctx, "paged-garbage", build):
        base = ctx.runner.paged_forward(p)
        verdicts.append(_judge(p, base))
        for q in changed:
            violations += _same_bits(p, base, q, ctx.runner.paged_forward(q),
                                     "slots past a length, unused pages and trailing table entries change nothing")
    return _summarize(verdicts, violations, "NaN, +-Inf and +-1e38 wherever no key is, and trailing table entries "
                                            "re-pointed (NaN pages, page 0): the same bits each time")


def check_paged_permutation(ctx: Context) -> Outcome:
    s = slots(ctx)

    def build(r):
        ps = [draw(r(n), s[name]) for n, name in enumerate(("vllm16", "tpu128"))]
        return [(p, p.permuted(r(10 + n))) for n, p in enumerate(ps)]
    verdicts, violations = [], []
    for p, moved in problems(ctx, "paged-permutation", build):
        base = ctx.runner.paged_forward(p)
        verdicts.append(_judge(p, base))
        violations += _same_bits(p, base, moved, ctx.runner.paged_forward(moved),
                                 "a permutation of the pool with the table permuted alike changes no bit")
    return _summarize(verdicts, violations, "pools permuted with their tables: the same bits")


def dense_truth(p: PagedProblem) -> np.ndarray:
    """The dense contract's float64 output on ``p``'s gathered cache (``paged_oracle.dense_twin``)."""
    twin = dense_twin(p.q.shape[1], p.k_pages, p.v_pages, p.lengths, p.table)
    return oracle.attention(p.q, twin.k, twin.v, causal=p.causal, scale=p.scale, window=p.window,
                            softcap=p.softcap, q_segment_ids=twin.q_segment_ids, kv_segment_ids=twin.kv_segment_ids,
                            sinks=p.sinks, magnitudes=False).out


def check_paged_dense(ctx: Context) -> Outcome:
    s = slots(ctx)

    def build(r):
        ps = [draw(r(0), s["spec32"]), draw(r(1), s["odd"], causal=False), draw(r(2), s["single"])]
        return [(p, dense_truth(p)) for p in ps]
    verdicts, violations = [], []
    for p, truth in problems(ctx, "paged-dense", build):
        out = ctx.runner.paged_forward(p)
        verdicts.append(_judge(p, out, truth, f"{p.label} against the dense contract on the gathered cache"))
        violations += _empty_rows(p, out)
    return _summarize(verdicts, violations, "the dense contract's answer on each gathered cache (right-aligned, "
                                            "segment ids before shorter sequences), causal and not")


def _values_along_keys(p: PagedProblem, rng: np.random.Generator) -> PagedProblem:
    """V the same on every key (per kv head and channel): the exact output is that value wherever a row sees
    a key, so fp32 accumulation returns it exactly in bfloat16 while a bfloat16 running sum drifts."""
    value = rng.standard_normal(p.v_pages.shape[2:], np.float32).astype(p.v_pages.dtype)
    v = np.where(p.holds[:, :, None, None], value[None, None], p.v_pages)
    return p.replace(f"{p.label} V constant along keys", v_pages=v, derived=False)


def check_paged_long(ctx: Context) -> Outcome:
    s = slots(ctx)

    def build(r):
        p = draw(r(0), s["long"])
        return [p, _values_along_keys(p, r(1))]
    ps = problems(ctx, "paged-long", build)
    p = ps[0]
    return _accurate(ctx, ps, f"kv_lengths {p.lengths.tolist()} in bfloat16, {int(p.table.shape[1])} pages per "
                              f"sequence, page indices up to {int(p.table.max())} (past 2^15), random V and V "
                              f"constant along keys, within the forward bound")


def _sinks(rng: np.random.Generator, slot: PagedSlot, kind: str) -> np.ndarray:
    if kind == "high":  # 40-60 above every logit of N(0, 1) data at the default scale
        return (rng.uniform(40, 60, slot.num_q_heads) + np.sqrt(slot.head_dim)).astype(np.float32)
    return (rng.standard_normal(slot.num_q_heads) * 2).astype(np.float32)


def rows_across_a_page(slot: PagedSlot) -> tuple[int, int]:
    """A window ``(left, 0)`` under which the first of the slot's rows (q_len >= 2) in its longest sequence starts
    its window on a page's last key and the last row past that page (issue 51): a page skipped from one row's
    window start drops keys the other rows see."""
    n, ps, lq = max(slot.lengths), slot.page_size, slot.q_len
    return n - lq - (max(1, (n - lq) // (2 * ps)) * ps - 1), 0


def check_paged_window(ctx: Context) -> Outcome:
    s = slots(ctx)

    def build(r):
        a, b, c = s["spec32"], s["vllm16"], s["odd"]
        return [draw(r(0), a, window=(int(r(10).integers(5, 3 * a.page_size)), 0)),
                draw(r(1), b, window=(int(r(11).integers(b.page_size, 4 * b.page_size)) - 1, 0)),
                draw(r(2), c, causal=False, window=(int(r(12).integers(c.page_size, 2 * c.page_size)),
                                                    int(r(12).integers(1, 9)))),
                draw(r(3), a, window=rows_across_a_page(a))]
    return _accurate(ctx, problems(ctx, "paged-window", build),
                     "windows across page boundaries (decoding, speculative rows, both sides; the rows' windows "
                     "starting on both sides of one) within the forward bound; rows with no visible key exact zeros")


def check_paged_softcap(ctx: Context) -> Outcome:
    s = slots(ctx)
    return _accurate(ctx, problems(ctx, "paged-softcap", lambda r: [
        draw(r(0), s["spec32"], softcap=30.0, q_boost=8.0), draw(r(1), s["vllm16"], softcap=50.0, q_boost=20.0)]),
        "logits far past caps of 30 and 50 within the forward bound")


def check_paged_sinks(ctx: Context) -> Outcome:
    s = slots(ctx)
    return _accurate(ctx, problems(ctx, "paged-sinks", lambda r: [
        draw(r(0), s["spec32"], sinks=_sinks(r(10), s["spec32"], "random")),
        draw(r(1), s["tpu128"], sinks=_sinks(r(11), s["tpu128"], "high"))]),
        "random sinks and sinks 40-60 above every logit (zero-length rows stay exact zeros) within the forward bound")


PAGED_CHECKS: tuple[CheckSpec, ...] = tuple(CheckSpec(*spec) for spec in (
    ("paged-output", 5, check_paged_output, "output is [batch, q_len, num_q_heads, head_dim] in q's dtype"),
    ("paged-accuracy", 20, check_paged_accuracy, "every page size, edge length, batch, q_len and group within the "
     "forward bound on NaN-filled pools; rows with no key exact zeros"),
    ("paged-garbage", 15, check_paged_garbage, "NaN, Inf, huge values and re-pointed trailing entries where no key "
     "is change no bit"),
    ("paged-permutation", 10, check_paged_permutation, "a permuted pool with its table permuted alike changes no bit"),
    ("paged-dense", 10, check_paged_dense, "the dense contract's answer on the gathered cache"),
    ("paged-long", 15, check_paged_long, "32k-131k keys in bfloat16, > 128 pages per sequence, page indices past 2^15"),
))
PAGED_FEATURE_CHECKS: dict[str, CheckSpec] = {
    "window": CheckSpec("paged-window", 8, check_paged_window, "windows across page boundaries"),
    "softcap": CheckSpec("paged-softcap", 8, check_paged_softcap, "logits far past the cap"),
    "sinks": CheckSpec("paged-sinks", 8, check_paged_sinks, "random and high sinks"),
}
assert tuple(PAGED_FEATURE_CHECKS) == PAGED_FEATURES


def paged_checks_for(features=()) -> tuple[CheckSpec, ...]:
    """The checks a paged candidate declaring ``features`` gets: every base paged check, then each feature's."""
    return (*PAGED_CHECKS, *(PAGED_FEATURE_CHECKS[f] for f in features if f in PAGED_FEATURE_CHECKS))
