"""Judging a submitted program's outputs at the timed shapes, with checks its author could not foresee.

The exporter sees every signature it exports and the benchmark's shapes are public, so a program may be
honest at the grader's shapes and cut corners at the timed ones. What it cannot know is the value of
:func:`draw_entropy`, drawn (``secrets``) in the measuring process after the sandbox has returned its
programs and recorded in the run (``submission.check_entropy``). It picks the timed inputs' values, the
timed calls whose outputs are checked (``bench.submitted.checked_samples``) and, per check
(:func:`check_output`):

* ``ROWS`` (batch element, query row) pairs scattered over every batch element: the output, or dQ, of
  each row against the float64 oracle (``grading.oracle``). A query row against the keys it sees is a
  problem of its own with q_len 1, exactly: causal becomes a key length ``min(length, i + kv_len - q_len
  + 1)``, so every row has the same shapes and the contract-precision baseline (the reference, one row
  at a time under ``lax.map``) compiles once;
* for a forward + backward: ``ROWS`` key rows of one (batch element, kv head), dK and dV there
  (:func:`key_rows`).

Each is judged by the rubric's tolerance policy (``grading.tolerance.judge``: bound by the error a
contract-precision computation makes on the same rows, relative to the oracle's magnitudes).
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


def query_rows(sig, q, k, v, ct, b, i, limits, got):
    """The verdict on rows ``(b, i)`` of the output (``ct`` None) or of dQ, judged one row at a time."""
    from ..grading import oracle, tolerance

    truths = []
    for bj, ij, lim in zip(b, i, limits):
        keys = slice(0, max(1, int(lim)))
        truths.append(oracle.attention(q[bj:bj + 1, ij:ij + 1], k[bj:bj + 1, keys], v[bj:bj + 1, keys],
                                       None if ct is None else ct[bj:bj + 1, ij:ij + 1], scale=sig.scale,
                                       kv_lengths=np.array([lim], np.int32)))
    what = "output" if ct is None else "dq"
    field = "out" if ct is None else "dq"
    expected = np.concatenate([getattr(t, field)[0] for t in truths])
    magnitude = np.concatenate([t.magnitude[field][0] for t in truths])
    baseline = np.asarray(_reference_rows(q[b, i], q[b, i] if ct is None else ct[b, i], k, v, b,
                                          np.asarray(limits, np.int32), scale=sig.scale, backward=ct is not None))
    rows = f"{what} of {len(b)} rows over {len(set(b.tolist()))} batch elements"
    return tolerance.judge(rows, got, expected, baseline, sig.dtype, gradient=ct is not None,
                           magnitude=magnitude, logit_scale=max(t.logit_max for t in truths))


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


class KeyRows(NamedTuple):
    dk: Any          # [group, n, head_dim]: each query head's share of dK at the key rows
    dv: Any
    dk_mag: Any      # [n, head_dim]: the magnitudes of the group's sums (``grading.oracle.Truth``)
    dv_mag: Any
    logit_max: float


def key_rows(sig, q, k, v, ct, out, limits, rng) -> list:
    """Verdicts on dK and dV at ``ROWS`` random key rows of a random (batch element, kv head).

    Their exact values need every query row's softmax statistics over all its keys, so
    :func:`_key_rows` computes them for that batch element and the kv head's group of query heads, a
    chunk of query rows at a time (``CHUNK_LOGITS``). The truth is float64 NumPy when the input is
    float32 or the work (``group * q_len * kv_len * head_dim``) is at most ``EXACT_WORK`` (about a second
    of CPU); beyond that (bfloat16 model shapes, up to seq 16384 on a TPU v5e, which has no float64) it
    is float32 on the default device at ``precision=HIGHEST``. There its error (float32 logits and
    sums over n keys: about ``sqrt(n) * 2**-24`` relative, ~1e-5 at n = 16384, plus ``|logit| * 2**-24``)
    is two to three orders of magnitude below the tolerance of a bfloat16 output (``k`` times the
    baseline's rounding error, ~2**-9 relative), so it cannot decide a verdict. The baseline is always
    that float32 computation rounded to the input dtype (the contract's precision, as the reference's
    VJP rounds its fp32 dK/dV), and, for bfloat16 with groups, also each query head's share rounded
    before the group sum (``tolerance.judge(alternative=...)``)."""
    from ..grading import tolerance

    batch, q_len, num_q, head_dim = q.shape
    kv_len, num_kv = k.shape[1], k.shape[2]
    group = num_q // num_kv
    b, head = int(rng.integers(batch)), int(rng.integers(num_kv))
    keys = np.sort(rng.choice(kv_len, size=min(ROWS, kv_len), replace=False))
    heads = slice(head * group, (head + 1) * group)
    parts = (q[b, :, heads].swapaxes(0, 1), k[b, :, head], v[b, :, head], ct[b, :, heads].swapaxes(0, 1))
    dtype = np.asarray(q[:0]).dtype
    on_device = _key_rows([jnp.asarray(np.asarray(x, np.float32)) for x in parts], limits[b], keys, sig.scale,
                          jnp, partial(jnp.matmul, precision=_HIGHEST))
    fp32 = KeyRows(*(np.asarray(x) for x in on_device[:4]), on_device.logit_max)
    exact = sig.dtype == "float32" or group * q_len * kv_len * head_dim <= EXACT_WORK
    truth = (_key_rows([np.asarray(x, np.float64) for x in parts], limits[b], keys, sig.scale, np, np.matmul)
             if exact else fp32)
    got = [np.asarray(jax.device_get(x))[b, keys, head] for x in out[1:3]]
    grouped = group > 1 and sig.dtype != "float32"
    verdicts = []
    for name, got_x, per_head, base_per_head, magnitude in (
            ("dk", got[0], truth.dk, fp32.dk, truth.dk_mag), ("dv", got[1], truth.dv, fp32.dv, truth.dv_mag)):
        alternative = (base_per_head.astype(dtype).astype(np.float32).sum(0).astype(dtype) if grouped else None)
        verdicts.append(tolerance.judge(
            f"{name} of {len(keys)} key rows, batch {b}, kv head {head} ({'float64' if exact else 'float32'} truth)",
            got_x, np.asarray(per_head, np.float64).sum(0), base_per_head.sum(0).astype(dtype), sig.dtype,
            gradient=True, magnitude=np.asarray(magnitude, np.float64), alternative=alternative,
            logit_scale=truth.logit_max))
    return verdicts


def _key_rows(parts, limits, keys, scale, xp, mm) -> KeyRows:
    """dK and dV of one kv head at key rows ``keys`` from query heads ``q`` ``[group, q_len, d]``,
    keys and values ``[kv_len, d]`` and cotangent ``[group, q_len, d]``; row ``i`` sees keys below
    ``limits[i]``. In ``xp``'s arrays and ``mm``'s products (the oracle's formulas)."""
    q, k, v, ct = parts
    group, q_len, head_dim = q.shape
    kv_len = k.shape[0]
    scale = head_dim ** -0.5 if scale is None else scale
    kj, vj, abs_v = k[keys], v[keys], xp.abs(v)
    dk = dv = dk_mag = dv_mag = 0.0
    logit_max = 0.0
    step = max(1, CHUNK_LOGITS // (group * kv_len))
    for start in range(0, q_len, step):
        rows = slice(start, start + step)
        qc, dc = q[:, rows], ct[:, rows]
        visible = xp.arange(kv_len)[None, :] < xp.asarray(limits[rows])[:, None]
        s = mm(qc, k.T) * scale
        logit_max = max(logit_max, float(xp.max(xp.where(visible, xp.abs(s), 0.0))))
        s = xp.where(visible, s, -xp.inf)
        m = xp.max(s, axis=-1, keepdims=True)
        e = xp.where(visible, xp.exp(s - xp.where(xp.isfinite(m), m, 0.0)), 0.0)
        total = e.sum(axis=-1, keepdims=True)
        p = e / xp.where(total > 0, total, 1.0)
        delta = (dc * mm(p, v)).sum(axis=-1, keepdims=True)
        delta_mag = (xp.abs(dc) * mm(p, abs_v)).sum(axis=-1, keepdims=True)
        pj = p[..., keys].swapaxes(-1, -2)                                 # [group, n, rows]
        ds = pj * (mm(vj, dc.swapaxes(-1, -2)) - delta.swapaxes(-1, -2))
        ds_mag = pj * (mm(xp.abs(vj), xp.abs(dc).swapaxes(-1, -2)) + delta_mag.swapaxes(-1, -2))
        dv = dv + mm(pj, dc)
        dk = dk + mm(ds, qc) * scale
        dv_mag = dv_mag + mm(pj, xp.abs(dc)).sum(axis=0)
        dk_mag = dk_mag + (mm(ds_mag, xp.abs(qc)) * scale).sum(axis=0)
    return KeyRows(dk, dv, dk_mag, dv_mag, logit_max)
