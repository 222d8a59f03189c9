"""The ragged rubric's checks (``tpu-kernel-rubric --ragged``): each draws calls at the ragged slots
(``grading.ragged.slots``, ``grading.ragged.problems``), calls the candidate through ``ctx.runner.ragged_forward``
(its own sandboxed worker) and judges the graded rows (those a sequence ``i < num_seqs[0]`` owns) of what came back.

Every pool is NaN wherever no key is, every padding row of q is NaN and the arrays past ``num_seqs`` hold random
values in range, so garbage that leaks shows in every check; a NaN leak is seen in the output rows, never through an
intermediate. Accuracy uses the one tolerance policy (``grading.tolerance``) with the ragged reference's error as the
baseline. The checks and what each probes (each slot's mix holds decode rows, chunks, whole prompts and empty
sequences between others, so every boundary between sequences is probed in every call):

* ragged-output: the output has q's shape and dtype (float32 and bfloat16).
* ragged-accuracy: every slot but ``long`` (page sizes 16, 32, 64, 128, 256 and one no power of two; head_dim 64,
  128, 256; groups 1-8; 5-64 sequences), causal, and two of them without causal (one with a given scale), within
  the forward bound.
* ragged-garbage: the same keys with the pool's other slots +-Inf, then +-1e38; padding rows +-Inf, then +-1e38;
  the arrays past ``num_seqs`` redrawn twice (offsets unsorted, inside the real rows); the table's trailing entries
  re-pointed: not one bit of a graded row may change.
* ragged-permutation: the pool permuted with the table permuted alike: not one bit may change.
* ragged-long: ``long`` (keys past 32,768 and 65,536 per sequence, page indices past 2^15), random V and V
  constant along keys; at the full level, keys past 2^31 pool elements where memory allows (else its detail says
  "not probed" and why: ``grading.ragged.big_pool``).
* ragged-window, ragged-softcap, ragged-sinks, ragged-quantized_kv: for a candidate that declares the feature,
  calls where it matters (window edges inside pages and many pages back, rows whose windows start on both sides of
  a page boundary, both sides without causal; logits far past caps of 30 and 50 and a cap of 2; random and high
  sinks; fp8 and int8 pools near their range with scales far from 1, given as floats and as 0-d arrays, q in
  float32 and bfloat16, and their garbage), and each combined with every other feature the candidate declares.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ...grading.check_context import CheckSpec, Outcome, _first_difference, _summarize
from ...grading.dense.checks import Context, problems
from ...grading.paged.checks import _sinks, _values_along_keys  # (they take a ragged slot and problem as well)
from ...grading.ragged import big_pool
from ...grading.ragged.problems import RaggedProblem, draw
from ...grading.ragged.slots import EDGE_SLOTS, RaggedSlot, draw_ragged_slots
from ...grading.tolerance import Verdict, judge
from kernel_src.contract import QUANTIZED_KV, RAGGED_FEATURES


def slots(ctx: Context) -> dict[str, RaggedSlot]:
    """The ragged slots of the context's slot seed and level."""
    return draw_ragged_slots(ctx.slot_seed, ctx.level)


def uses(p: RaggedProblem) -> set[str]:
    """The features a call uses."""
    return {f for f, on in (("window", p.window), ("softcap", p.softcap), ("sinks", p.sinks),
                            (QUANTIZED_KV, p.k_scale)) if on is not None}


def callable_with(ctx: Context, ps: list) -> list:
    """Those of ``ps`` (problems, or tuples led by one) whose features the candidate declares."""
    declared = set(getattr(ctx.runner, "features", RAGGED_FEATURES))
    return [x for x in ps if uses(x[0] if isinstance(x, tuple) else x) <= declared]


def _judge(p: RaggedProblem, out: np.ndarray) -> Verdict:
    """The forward verdict of ``out``'s graded rows on ``p``."""
    g = p.graded
    return judge(p.label, out[g], p.truth.out[g], p.baseline[0][g], p.dtype, gradient=False,
                 magnitude=p.truth.magnitude["out"][g], logit_scale=p.logit_max)


def _accurate(ctx: Context, ps: list[RaggedProblem], what: str) -> Outcome:
    verdicts = [_judge(p, ctx.runner.ragged_forward(p)) for p in callable_with(ctx, ps)]
    return _summarize(verdicts, [], what)


def _same_bits(ctx: Context, pairs: list, what: str, rule: str) -> Outcome:
    """Each ``(p, changed...)``: ``p`` judged, and every changed call's graded rows the same bits as ``p``'s."""
    verdicts, violations = [], []
    for p, *changed in callable_with(ctx, pairs):
        base = ctx.runner.ragged_forward(p)
        verdicts.append(_judge(p, base))
        for c in changed:
            out = ctx.runner.ragged_forward(c)
            index = _first_difference(base[p.graded], out[p.graded])
            if index == ():
                violations.append(f"{c.label}: returned {out.dtype}, the unchanged call {base.dtype}")
            elif index is not None:
                row = int(np.flatnonzero(p.graded)[index[0]])
                where = (row, *index[1:])
                violations.append(f"{c.label}: out{list(where)} = {out[where]:.6g}, but {base[where]:.6g} on the "
                                  f"unchanged call (contract: {rule})")
    return _summarize(verdicts, violations, what)


def check_ragged_output(ctx: Context) -> Outcome:
    s = slots(ctx)
    ps = problems(ctx, "ragged-output", lambda r: [draw(r(0), s["chunk32"]), draw(r(1), s["serve16"])])
    bad = [f"{p.label}: returned dtype {out.dtype}, expected {p.dtype} (contract: out has q's shape and dtype)"
           for p in ps for out in [ctx.runner.ragged_forward(p)] if str(out.dtype) != p.dtype]
    return Outcome(not bad, "; ".join(bad) or f"{len(ps)} calls returned q's shape in q's dtype (float32, bfloat16)")


def check_ragged_accuracy(ctx: Context) -> Outcome:
    s = slots(ctx)
    ps = problems(ctx, "ragged-accuracy", lambda r: [draw(r(n), s[name]) for n, name in enumerate(EDGE_SLOTS)] + [
        draw(r(10), s["serve16"], causal=False), draw(r(11), s["odd"], causal=False, scale=0.3),
        draw(r(12), s["solo"])])
    sizes = sorted({p.slot.page_size for p in ps})
    return _accurate(ctx, ps, f"{len(ps)} ragged calls (page sizes {sizes}; decode rows, chunks, whole prompts and "
                              f"empty sequences mixed, and a step of one sequence; causal and not; a given scale) within "
                              f"the forward bound")


def check_ragged_garbage(ctx: Context) -> Outcome:
    s = slots(ctx)

    def build(r):
        out = []
        for n, name in enumerate(("chunk32", "odd", "wide256")):
            p = draw(r(n), s[name])
            out.append((p, p.refilled("inf", r(10 + n)), p.refilled("huge", r(20 + n)), p.padded_with("inf", r(30 + n)),
                        p.padded_with("huge", r(40 + n)), p.regarbaged(r(50 + n)), p.regarbaged(r(60 + n)),
                        p.retabled(r(70 + n))))
        return out
    return _same_bits(ctx, problems(ctx, "ragged-garbage", build),
                      "NaN, +-Inf and +-1e38 wherever no key is and in padding rows, the arrays past num_seqs "
                      "redrawn, trailing table entries re-pointed: the same bits each time",
                      "padding rows, slots no key is on and entries past num_seqs change no bit of a graded row")


def check_ragged_permutation(ctx: Context) -> Outcome:
    s = slots(ctx)
    return _same_bits(ctx, problems(ctx, "ragged-permutation", lambda r: [
        (p, p.permuted(r(10 + n))) for n, p in enumerate((draw(r(0), s["serve16"]), draw(r(1), s["tpu128"])))]),
        "pools permuted with their tables: the same bits",
        "a permutation of the pool with the table permuted alike changes no bit of a graded row")


def check_ragged_long(ctx: Context) -> Outcome:
    s = slots(ctx)

    def build(r):
        p = draw(r(0), s["long"])
        return [p, _values_along_keys(p, r(1))]
    ps = problems(ctx, "ragged-long", build)
    p, pool, unprobed = ps[0], "", None
    if ctx.level == "full":
        quantized = QUANTIZED_KV in getattr(ctx.runner, "features", ())
        unprobed = big_pool.unprobed(ctx.runner, quantized)
        if unprobed is None:
            ps = ps + problems(ctx, f"ragged-long-pool{'-int8' * quantized}",
                               lambda r: [big_pool.big_problem(lambda n: r(10 + n), quantized)])
            pool = f", keys at pages past 2^20 of a pool of {big_pool.PAGES} pages (past 2^31 elements)"
    outcome = _accurate(ctx, ps, f"kv_lens {list(p.slot.kv_lens)} in bfloat16, page indices up to "
                                 f"{int(p.table[:p.slot.num_seqs].max())} (past 2^15), random V and V constant along "
                                 f"keys{pool}, within the forward bound")
    if unprobed:
        outcome = dataclasses.replace(outcome, detail=f"{outcome.detail}; a pool past 2^31 elements {unprobed}")
    return outcome


def _combined(r, slot: RaggedSlot, **given) -> RaggedProblem:
    """A call at ``slot`` with every feature on: ``given`` ones as given, the others drawn."""
    window = given.pop("window", (int(r(90).integers(3, 2 * slot.page_size)), 0))
    return draw(r(91), slot, window=window, softcap=given.pop("softcap", 20.0), q_boost=4.0,
                sinks=given.pop("sinks", _sinks(r(92), slot, "random")), quantized=given.pop("quantized", "int8"),
                value_scales=(1.0, 50.0), tag="every feature", **given)


def across_a_page(slot: RaggedSlot) -> tuple[int, int]:
    """A window ``(left, 0)`` under which the rows of the slot's chunk that sits furthest in start their windows on
    both sides of a page boundary (the first row's on a page's last key): a key block skipped from one row's window
    start drops keys the other rows see."""
    chunks = [i for i in range(slot.num_seqs) if 2 <= slot.q_lens[i] < slot.kv_lens[i]]
    i = max(chunks, key=lambda i: slot.kv_lens[i] - slot.q_lens[i])
    first, ps = slot.kv_lens[i] - slot.q_lens[i], slot.page_size  # the first row's position
    return max(0, first - (max(1, (first + 1) // ps) * ps - 1)), 0


def check_ragged_window(ctx: Context) -> Outcome:
    s = slots(ctx)

    def build(r):
        a, b, c = s["chunk32"], s["serve16"], s["odd"]
        return [draw(r(0), a, window=(int(r(10).integers(5, 3 * a.page_size)), 0)),
                draw(r(1), b, window=(int(r(11).integers(3 * b.page_size, 6 * b.page_size)) - 1, 0)),
                draw(r(2), c, causal=False, window=(int(r(12).integers(c.page_size, 2 * c.page_size)),
                                                    int(r(12).integers(1, 9)))),
                draw(r(3), a, window=across_a_page(a)), draw(r(4), s["wide256"], window=across_a_page(s["wide256"])),
                _combined(r, s["mid64"], window=(int(r(13).integers(3, 100)), int(r(13).integers(1, 4))),
                          causal=False)]
    return _accurate(ctx, problems(ctx, "ragged-window", build),
                     "windows with their left edges inside pages and many pages back, rows whose windows start on "
                     "both sides of a page boundary, both sides without causal, and with every other declared "
                     "feature, within the forward bound")


def check_ragged_softcap(ctx: Context) -> Outcome:
    s = slots(ctx)
    return _accurate(ctx, problems(ctx, "ragged-softcap", lambda r: [
        draw(r(0), s["chunk32"], softcap=30.0, q_boost=8.0), draw(r(1), s["serve16"], softcap=50.0, q_boost=20.0),
        draw(r(2), s["odd"], softcap=2.0), _combined(r, s["tpu128"], softcap=5.0)]),
        "logits far past caps of 30 and 50, a cap of 2, and with every other declared feature, within the forward "
        "bound")


def check_ragged_sinks(ctx: Context) -> Outcome:
    s = slots(ctx)
    return _accurate(ctx, problems(ctx, "ragged-sinks", lambda r: [
        draw(r(0), s["chunk32"], sinks=_sinks(r(10), s["chunk32"], "random")),
        draw(r(1), s["tpu128"], sinks=_sinks(r(11), s["tpu128"], "high")),
        _combined(r, s["serve16"], sinks=_sinks(r(12), s["serve16"], "high"))]),
        "random sinks, sinks 40-60 above every logit, and with every other declared feature, within the forward "
        "bound")


def check_ragged_quantized_kv(ctx: Context) -> Outcome:
    s = slots(ctx)

    def build(r):
        fp8 = draw(r(0), s["chunk32"], quantized="float8_e4m3fn", value_scales=(1.0, 300.0))
        int8 = draw(r(1), s["serve16"], quantized="int8", value_scales=(0.5, 1 / 300), scale_arrays=True)
        return [(fp8, fp8.refilled("inf", r(10)), fp8.padded_with("inf", r(11))),
                (int8, int8.refilled("inf", r(12)), int8.regarbaged(r(13))),
                (draw(r(2), s["odd"], quantized="float8_e4m3fn", value_scales=(2.0, 1 / 64), scale_arrays=True),),
                (draw(r(3), s["tpu128"], quantized="int8", value_scales=(1.0, 1000.0)),),
                (_combined(r, s["wide256"], quantized="float8_e4m3fn"),)]
    return _same_bits(ctx, problems(ctx, "ragged-quantized_kv", build),
                      "fp8 and int8 pools near their range with scales far from 1 (floats and 0-d arrays), q in "
                      "float32 and bfloat16, with every other declared feature, within the forward bound; their "
                      "garbage changes no bit", "slots no key is on and padding rows change no bit of a graded row")


RAGGED_CHECKS: tuple[CheckSpec, ...] = tuple(CheckSpec(*spec) for spec in (
    ("ragged-output", 5, check_ragged_output, "output is [num_tokens, num_q_heads, head_dim] in q's dtype"),
    ("ragged-accuracy", 25, check_ragged_accuracy, "decode rows, chunks, whole prompts and empty sequences at every "
     "page size, head_dim and group, causal and not, within the forward bound on NaN-filled pools"),
    ("ragged-garbage", 15, check_ragged_garbage, "NaN, Inf and huge values where no key is and in padding rows, and "
     "anything past num_seqs, change no bit of a graded row"),
    ("ragged-permutation", 10, check_ragged_permutation, "a permuted pool with its table permuted alike changes no bit"),
    ("ragged-long", 15, check_ragged_long, "keys past 32k and 64k per sequence in bfloat16, page indices past 2^15; "
     "at the full level, keys past 2^31 pool elements where memory allows"),
))
RAGGED_FEATURE_CHECKS: dict[str, CheckSpec] = {
    "window": CheckSpec("ragged-window", 8, check_ragged_window, "window edges inside and across pages, both sides"),
    "softcap": CheckSpec("ragged-softcap", 8, check_ragged_softcap, "logits far past the cap, a small cap"),
    "sinks": CheckSpec("ragged-sinks", 8, check_ragged_sinks, "random and high sinks"),
    QUANTIZED_KV: CheckSpec("ragged-quantized_kv", 10, check_ragged_quantized_kv, "fp8 and int8 pools, scales far "
                            "from 1"),
}
assert tuple(RAGGED_FEATURE_CHECKS) == RAGGED_FEATURES


def ragged_checks_for(features=()) -> tuple[CheckSpec, ...]:
    """The checks a ragged candidate declaring ``features`` gets: every base ragged check, then each feature's."""
    return (*RAGGED_CHECKS, *(RAGGED_FEATURE_CHECKS[f] for f in features if f in RAGGED_FEATURE_CHECKS))
