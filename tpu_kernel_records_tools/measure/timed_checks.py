"""Judging a submitted program's outputs at the timed shapes, with checks its author could not foresee.

The exporter sees every signature it exports and the benchmark's shapes are public, so a program may be
honest at the grader's shapes and cut corners at the timed ones. What it cannot know is the value of
:func:`draw_entropy`, drawn (``secrets``) in the measuring process after the sandbox has returned its
programs and recorded in the run (``submission.check_entropy``). It picks the timed inputs' values, the
timed calls whose outputs are checked (``bench.submitted.checked_samples``) and, per check
(:func:`check_output`):

* ``ROWS`` (batch element, query row) pairs scattered over every batch element: the output, or dQ, of
  each row. A query row against the keys it sees is a problem of its own with q_len 1, exactly: causal
  becomes a key length ``min(length, i + kv_len - q_len + 1)``, so every row has the same shapes and the
  contract-precision baseline (the reference, one row at a time under ``lax.map``) compiles once. The
  truth is :func:`_rows`, the oracle's (``grading.dense.truth``) formulas at per-row key lengths, a batch
  element's rows at once: the oracle called per row took 0.84 s a row at seq 16384 on this CPU (its
  q_len-1 products are matrix-vector ones), 54 s a check; tests hold ``_rows`` to the oracle;
* for a forward + backward: ``ROWS`` key rows of one (batch element, kv head), dK and dV there
  (:func:`key_rows`).

Each is judged by the rubric's tolerance policy (``grading.tolerance.judge``: bound by the error a
contract-precision computation makes on the same rows, relative to the oracle's magnitudes), dQ and dK
as the rubric judges them: against the nearer of the truth and the exact result with ``rowsum(dO * O)``
taken from the output rounded to the input dtype (``tolerance.STORED_OUTPUT``), as a
FlashAttention-style backward takes it from the output it stored.
"""

from __future__ import annotations

import secrets
import zlib
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

ROWS = 64                 # query rows, and key rows, judged per check
EXACT_WORK = 2 ** 28      # group * q_len * kv_len * head_dim up to which dK/dV's truth is float64 NumPy
CHUNK_LOGITS = 2 ** 23    # logits held at once while computing dK/dV rows
_HIGHEST = jax.lax.Precision.HIGHEST


def draw_entropy() -> str:
    """128 fresh random bits as 32 hex digits: call only after the export has finished."""
    return f"{secrets.randbits(128):032x}"


def check_rng(entropy: str, key: str, call: int) -> np.random.Generator:
    """The generator of one check (``call``) of one case (``key``), from the run's entropy."""
    return np.random.default_rng([int(entropy, 16), zlib.crc32(key.encode()), call])


def key_limits(sig, lengths: np.ndarray | None) -> np.ndarray:
    """``[batch, q_len]``: how many leading keys each query row sees (causal and padding as one length)."""
    batch, q_len = sig.q[:2]
    kv_len = sig.k[1]
    limit = np.full((batch, q_len), kv_len, np.int64)
    if sig.causal:
        limit = np.minimum(limit, np.arange(q_len)[None] + kv_len - q_len + 1)
    if lengths is not None:
        limit = np.minimum(limit, np.asarray(lengths).reshape(batch, 1))
    return np.maximum(limit, 0)


def check_output(sig, host: list[np.ndarray], out: Any, *, backward: bool, rng: np.random.Generator,
                 lengths: np.ndarray | None = None) -> tuple[bool, str]:
    """Judge one call's output: ``out`` (forward) or ``(dq, dk, dv)`` under cotangent ``host[3]``."""
    q, k, v = host[:3]
    if sig.has_lengths and lengths is None:
        lengths = host[-1]
    limits = key_limits(sig, lengths)
    batch, q_len = q.shape[:2]
    flat = np.sort(rng.choice(batch * q_len, size=min(ROWS, batch * q_len), replace=False))
    b, i = np.divmod(flat, q_len)
    ct = host[3] if backward else None
    got = np.asarray(jax.device_get(out[0] if backward else out))[b, i]
    verdicts = [query_rows(sig, q, k, v, ct, b, i, limits[b, i], got)]
    if backward:
        verdicts += key_rows(sig, q, k, v, ct, out, limits, rng)
    return all(v.ok for v in verdicts), "; ".join(v.describe() for v in verdicts)


def check_paged_output(sig, host: list[np.ndarray], out: Any, *, rng: np.random.Generator) -> tuple[bool, str]:
    """Judge one paged call's output (``grading.export.PagedSignature``; host ``q, k_pages, v_pages,
    kv_lengths, page_indices``): ``ROWS`` query rows, each as a problem of its own with q_len 1 over the keys
    it sees (gathered from its pages: the first visible key to its position, so a window is a shorter
    row), judged like a dense row (:func:`query_rows`). Softcap and sinks are not judged here."""
    if sig.softcap is not None or sig.sinks:
        raise ValueError("check_paged_output judges no softcap or sinks (no paged-decode case uses them)")
    q, k_pages, v_pages, lengths, table = host[:5]
    batch, q_len = q.shape[:2]
    flat = np.sort(rng.choice(batch * q_len, size=min(ROWS, batch * q_len), replace=False))
    b, i = np.divmod(flat, q_len)
    length = lengths[b].astype(np.int64)
    low, high = _visible(sig, length - q_len + i, length)  # (the row's place in its sequence)
    keys, values = (_gather(pages, table, b, low, high) for pages in (k_pages, v_pages))
    got = np.asarray(jax.device_get(out))[b, i]
    verdict = query_rows(sig, q[b, i][:, None], keys, values, None, np.arange(len(b)), np.zeros(len(b), np.int64),
                         (high - low).astype(np.int64), got)
    return verdict.ok, verdict.describe()


def check_ragged_output(sig, host: list[np.ndarray], out: Any, *, rng: np.random.Generator) -> tuple[bool, str]:
    """Judge one ragged call's output (``grading.ragged.signature.RaggedSignature``; host ``q, k_pages, v_pages,
    kv_lengths, page_indices, cu_q_lens, num_seqs[, k_scale, v_scale]``): ``ROWS`` of the graded rows (those
    below ``cu_q_lens[num_seqs[0]]``), each a q_len-1 problem over the keys it sees, as
    :func:`check_paged_output` judges a paged row. A quantized pool's keys and values are dequantized by the
    contract's rule (``float32(stored) * scale``) for the truth, and rounded to q's dtype for the baseline, as
    the contract allows. Softcap and sinks are not judged here."""
    if sig.softcap is not None or sig.sinks:
        raise ValueError("check_ragged_output judges no softcap or sinks (no ragged case uses them)")
    q, k_pages, v_pages, lengths, table, cu_q_lens, num_seqs = host[:7]
    scales = sig.feature_kwargs(tuple(host[7:]))
    num_seqs = int(np.asarray(num_seqs).reshape(-1)[0])
    graded = int(cu_q_lens[num_seqs])
    rows = np.sort(rng.choice(graded, size=min(ROWS, graded), replace=False))
    seq = np.searchsorted(cu_q_lens[1:num_seqs + 1], rows, side="right")  # the sequence owning each row
    q_len = cu_q_lens[seq + 1].astype(np.int64) - cu_q_lens[seq]
    position = lengths[seq].astype(np.int64) - q_len + rows - cu_q_lens[seq]
    low, high = _visible(sig, position, lengths[seq].astype(np.int64))
    keys, values = (_gather(pages, table, seq, low, high, scales.get(name))
                    for pages, name in ((k_pages, "k_scale"), (v_pages, "v_scale")))
    got = np.asarray(jax.device_get(out))[rows]
    baseline_kv = None if sig.pool_dtype is None else tuple(x.astype(q.dtype) for x in (keys, values))
    verdict = query_rows(sig, q[rows][:, None], keys, values, None, np.arange(len(rows)),
                         np.zeros(len(rows), np.int64), high - low, got, baseline_kv=baseline_kv)
    return verdict.ok, verdict.describe()


def _visible(sig, position: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(low, high)``: the keys ``low <= t < high`` a row at ``position`` of a sequence of ``length`` keys sees
    (causal and window as ``sig`` says)."""
    high = np.minimum(length, position + 1) if sig.causal else length
    low = np.zeros_like(high)
    if sig.window is not None:
        left, right = sig.window
        low = np.maximum(low, position - left) if left is not None else low
        high = np.minimum(high, position + right + 1) if right is not None else high
    return low, np.maximum(high, low)


def _gather(pages: np.ndarray, table: np.ndarray, seq: np.ndarray, low: np.ndarray, high: np.ndarray,
            scale=None) -> np.ndarray:
    """``[rows, width, num_kv_heads, head_dim]``: row ``r``'s keys ``low[r] <= t < high[r]`` of sequence
    ``seq[r]`` from its pages, zeros after them; dequantized (float32 ``stored * scale``) with a ``scale``."""
    page_size = pages.shape[1]
    dtype = pages.dtype if scale is None else np.float32
    out = np.zeros((len(seq), max(1, int((high - low).max()))) + pages.shape[2:], dtype)
    for r, (i, lo, hi) in enumerate(zip(seq, low, high)):
        t = np.arange(lo, hi)
        stored = pages[table[i, t // page_size], t % page_size]
        out[r, :hi - lo] = stored if scale is None else stored.astype(np.float32) * np.float32(scale)
    return out


def query_rows(sig, q, k, v, ct, b, i, limits, got, baseline_kv=None):
    """The verdict on rows ``(b, i)`` of the output (``ct`` None) or of dQ: truth per (batch element, kv
    head) from :func:`_rows` (precision as :func:`key_rows` says), the reference's rows as the baseline
    (over ``baseline_kv``'s keys and values where given: a dequantized pool rounded to q's dtype)."""
    from ..grading import tolerance

    num_kv = k.shape[2]
    group = q.shape[2] // num_kv
    exact = _exact(sig, len(b) * q.shape[2] * k.shape[1] * q.shape[3])
    field = "out" if ct is None else "dq"
    expected, magnitude, stored = np.zeros(got.shape), np.zeros(got.shape), np.zeros(got.shape)
    logit_max = 0.0
    for batch_element in np.unique(b):
        sel = np.flatnonzero(b == batch_element)
        for head in range(num_kv):
            heads = slice(head * group, (head + 1) * group)
            q_rows, ct_rows = (None if x is None else x[batch_element, i[sel]][:, heads].swapaxes(0, 1)
                               for x in (q, ct))
            parts = (q_rows, k[batch_element, :, head], v[batch_element, :, head], ct_rows)
            rows = _rows_in(exact, parts, limits[sel], sig.scale, stored_dtype=sig.dtype)
            expected[sel, heads] = np.asarray(getattr(rows, field), np.float64).swapaxes(0, 1)
            if ct is not None:
                stored[sel, heads] = np.asarray(rows.dq_stored, np.float64).swapaxes(0, 1)
            magnitude[sel, heads] = np.asarray(getattr(rows, field + "_mag"), np.float64).swapaxes(0, 1)
            logit_max = max(logit_max, rows.logit_max)
    base_k, base_v = (k, v) if baseline_kv is None else baseline_kv
    baseline = np.asarray(_reference_rows(q[b, i], q[b, i] if ct is None else ct[b, i], base_k, base_v, b,
                                          np.asarray(limits, np.int32), scale=sig.scale, backward=ct is not None))
    label = (f"{'output' if ct is None else 'dq'} of {len(b)} rows over {len(set(b.tolist()))} batch elements "
             f"({'float64' if exact else 'float32'} truth)")
    return tolerance.judge(label, got, expected, baseline, sig.dtype, gradient=ct is not None,
                           magnitude=magnitude, logit_scale=logit_max,
                           answers=None if ct is None else {tolerance.STORED_OUTPUT: stored})


def _exact(sig, work: int) -> bool:
    return sig.dtype == "float32" or work <= EXACT_WORK


def _rows_in(exact: bool, parts, limits, scale, keys=None, stored_dtype: str | None = None) -> "Rows":
    """:func:`_rows` in float64 NumPy (``exact``) or in float32 on the default device at HIGHEST."""
    if exact:
        return _rows([None if x is None else np.asarray(x, np.float64) for x in parts], limits, scale, np,
                     np.matmul, keys, stored_dtype)
    n = parts[0].shape[1]
    pad = max(0, ROWS - n)  # a check's rows of one batch element, padded with rows that see no key: one compile
    q, k, v, ct = (None if x is None else jnp.asarray(np.asarray(x, np.float32)) for x in parts)
    q, ct = (None if x is None else jnp.pad(x, ((0, 0), (0, pad), (0, 0))) for x in (q, ct))
    rows = _rows((q, k, v, ct), np.pad(limits, (0, pad)), scale, jnp, partial(jnp.matmul, precision=_HIGHEST), keys,
                 stored_dtype)
    per_row = ("out", "out_mag", "dq", "dq_mag", "dq_stored")  # [group, rows, ...]: the padding rows dropped
    return Rows(**{name: None if x is None else np.asarray(x)[:, :n] if name in per_row else
                   x if name == "logit_max" else np.asarray(x) for name, x in rows._asdict().items()})


@partial(jax.jit, static_argnames=("scale", "backward"))
def _reference_rows(q_rows, ct_rows, k, v, batch_index, limits, *, scale, backward):
    from kernel_src.reference import reference_attention

    def one(args):
        q_row, ct_row, b, limit = args
        kb, vb = (jax.lax.dynamic_index_in_dim(x, b) for x in (k, v))

        def row(q_):
            return reference_attention(q_[None, None], kb, vb, kv_lengths=limit[None], scale=scale)[0, 0]
        if not backward:
            return row(q_row)
        out, pull = jax.vjp(row, q_row)
        return pull(ct_row.astype(out.dtype))[0]
    return jax.lax.map(one, (q_rows, ct_rows, batch_index, limits))


class Rows(NamedTuple):
    """What :func:`_rows` computes: per query row ``[group, n, head_dim]`` (``None`` where not asked),
    per key row each query head's share ``[group, keys, head_dim]``, and magnitudes (``grading.dense.truth``); with a
    stored dtype, dQ and dK again with ``rowsum(dO * O)`` from the output rounded to it."""
    out: Any
    out_mag: Any
    dq: Any
    dq_mag: Any
    dk: Any
    dv: Any
    dk_mag: Any      # [keys, head_dim]: the magnitude of the group's sum
    dv_mag: Any
    logit_max: float
    dq_stored: Any = None  # dQ, dK with rowsum(dO * O) from O rounded to the stored dtype (when asked)
    dk_stored: Any = None


def key_rows(sig, q, k, v, ct, out, limits, rng) -> list:
    """Verdicts on dK and dV at ``ROWS`` random key rows of a random (batch element, kv head).

    Their exact values need every query row's softmax statistics over all its keys, so :func:`_rows`
    computes them for that batch element and the kv head's group of query heads, a chunk of query rows at
    a time (``CHUNK_LOGITS``). The truth (here and in :func:`query_rows`) is float64 NumPy when the input
    is float32 or the work (``group * q_len * kv_len * head_dim``) is at most ``EXACT_WORK`` (about a
    second of CPU); beyond that (bfloat16 model shapes, up to seq 16384 on a TPU v5e, which has no
    float64) it is float32 on the default device at ``precision=HIGHEST``. There its error (float32
    logits and sums over n keys: about ``sqrt(n) * 2**-24`` relative, ~1e-5 at n = 16384, plus
    ``|logit| * 2**-24``) is two to three orders of magnitude below the tolerance of a bfloat16 result
    (``k`` times the baseline's rounding error, ~2**-9 relative), so it cannot decide a verdict. The
    baseline is always that float32 computation rounded to the input dtype (the contract's precision, as
    the reference's VJP rounds its fp32 dK/dV), and, for bfloat16 with groups, also each query head's
    share rounded before the group sum (``tolerance.judge(alternatives=...)``)."""
    from ..grading import tolerance

    batch, q_len, num_q, head_dim = q.shape
    kv_len, num_kv = k.shape[1], k.shape[2]
    group = num_q // num_kv
    b, head = int(rng.integers(batch)), int(rng.integers(num_kv))
    keys = np.sort(rng.choice(kv_len, size=min(ROWS, kv_len), replace=False))
    heads = slice(head * group, (head + 1) * group)
    parts = (q[b, :, heads].swapaxes(0, 1), k[b, :, head], v[b, :, head], ct[b, :, heads].swapaxes(0, 1))
    dtype = np.asarray(q[:0]).dtype
    exact = _exact(sig, group * q_len * kv_len * head_dim)
    fp32 = _rows_in(False, parts, limits[b], sig.scale, keys, None if exact else sig.dtype)  # the answer once
    truth = _rows_in(True, parts, limits[b], sig.scale, keys, sig.dtype) if exact else fp32
    got = [np.asarray(jax.device_get(x))[b, keys, head] for x in out[1:3]]
    grouped = group > 1 and sig.dtype != "float32"
    verdicts = []
    for name, got_x, per_head, base_per_head, magnitude, answer in (
            ("dk", got[0], truth.dk, fp32.dk, truth.dk_mag, truth.dk_stored),
            ("dv", got[1], truth.dv, fp32.dv, truth.dv_mag, None)):
        alternative = (base_per_head.astype(dtype).astype(np.float32).sum(0).astype(dtype) if grouped else None)
        verdicts.append(tolerance.judge(
            f"{name} of {len(keys)} key rows, batch {b}, kv head {head} ({'float64' if exact else 'float32'} truth)",
            got_x, np.asarray(per_head, np.float64).sum(0), base_per_head.sum(0).astype(dtype), sig.dtype,
            gradient=True, magnitude=np.asarray(magnitude, np.float64), alternatives=(alternative,),
            answers={tolerance.STORED_OUTPUT: None if answer is None else np.asarray(answer, np.float64).sum(0)},
            logit_scale=truth.logit_max))
    return verdicts


def _rows(parts, limits, scale, xp, mm, keys=None, stored_dtype: str | None = None) -> Rows:
    """The contract at query rows ``q`` ``[group, n, d]`` of one kv head (keys, values ``[kv_len, d]``,
    cotangent ``[group, n, d]`` or None), row ``r`` seeing the keys below ``limits[r]``, in ``xp``'s arrays
    and ``mm``'s products, by the oracle's formulas: each row's output and dQ (``keys`` None), or dK and dV
    at key rows ``keys`` from these query rows (all of them, for the exact values); with ``stored_dtype`` and a
    cotangent, also dQ / dK with ``rowsum(dO * O)`` from the output rounded to ``stored_dtype``."""
    q, k, v, ct = parts
    group, n, head_dim = q.shape
    kv_len = k.shape[0]
    scale = head_dim ** -0.5 if scale is None else scale
    abs_k, abs_v = xp.abs(k), xp.abs(v)
    per_row = {name: [] for name in ("out", "out_mag", "dq", "dq_mag", "dq_stored")}
    dk = dv = dk_mag = dv_mag = dk_stored = 0.0
    stored = None if stored_dtype is None or ct is None else jnp.dtype(stored_dtype)
    logit_max = 0.0
    step = max(1, CHUNK_LOGITS // (group * kv_len))
    for start in range(0, n, step):
        rows = slice(start, start + step)
        qc = q[:, rows]
        visible = xp.arange(kv_len)[None, :] < xp.asarray(limits[rows])[:, None]
        s = mm(qc, k.T) * scale                                            # [group, rows, kv_len]
        logit_max = max(logit_max, float(xp.max(xp.where(visible, xp.abs(s), 0.0))))
        s = xp.where(visible, s, -xp.inf)
        m = xp.max(s, axis=-1, keepdims=True)
        e = xp.where(visible, xp.exp(s - xp.where(xp.isfinite(m), m, 0.0)), 0.0)
        total = e.sum(axis=-1, keepdims=True)
        p = e / xp.where(total > 0, total, 1.0)
        out, out_mag = mm(p, v), mm(p, abs_v)
        if keys is None:
            per_row["out"].append(out)
            per_row["out_mag"].append(out_mag)
        if ct is None:
            continue
        dc = ct[:, rows]
        delta = (dc * out).sum(axis=-1, keepdims=True)
        delta_mag = (xp.abs(dc) * out_mag).sum(axis=-1, keepdims=True)
        if stored is not None:  # dq, dk move by p * (delta - delta_stored) times k, q
            shift = p * (delta - (dc * out.astype(stored).astype(out.dtype)).sum(axis=-1, keepdims=True))
        if keys is None:
            per_row["dq"].append(mm(p * (mm(dc, v.T) - delta), k) * scale)
            per_row["dq_mag"].append(mm(p * (mm(xp.abs(dc), abs_v.T) + delta_mag), abs_k) * scale)
            if stored is not None:
                per_row["dq_stored"].append(per_row["dq"][-1] + mm(shift, k) * scale)
            continue
        pj = p[..., keys].swapaxes(-1, -2)                                 # [group, keys, rows]
        ds = pj * (mm(v[keys], dc.swapaxes(-1, -2)) - delta.swapaxes(-1, -2))
        ds_mag = pj * (mm(abs_v[keys], xp.abs(dc).swapaxes(-1, -2)) + delta_mag.swapaxes(-1, -2))
        dv = dv + mm(pj, dc)
        dk = dk + mm(ds, qc) * scale
        if stored is not None:
            dk_stored = dk_stored + mm(ds + shift[..., keys].swapaxes(-1, -2), qc) * scale
        dv_mag = dv_mag + mm(pj, xp.abs(dc)).sum(axis=0)
        dk_mag = dk_mag + (mm(ds_mag, xp.abs(qc)) * scale).sum(axis=0)
    joined = {name: xp.concatenate(parts_, axis=1) if parts_ else None for name, parts_ in per_row.items()}
    return Rows(**joined, dk=dk, dv=dv, dk_mag=dk_mag, dv_mag=dv_mag, logit_max=logit_max,
                dk_stored=None if stored is None or keys is None else dk_stored)
