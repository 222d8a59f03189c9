"""The rubric's problems: inputs and flags of one candidate call (``Problem``, with the float64 truth
and the reference's result computed on demand), and ``normal``, which draws one at a slot's shape.

The shapes, the slots' dtypes and flags and the kv_lengths drawn are in ``grading.dense.slots`` (the table of
the full distribution is its docstring); their names are re-exported here for older callers.
"""

from __future__ import annotations

import functools
import queue
import threading

import jax
import jax.numpy as jnp
import numpy as np

from ...grading.dense import truth as oracle
from ...sandbox.cpu_jit import device_array, jit_cpu
from ...grading.dense.known_bad import reference
from ...grading.dense.slots import (EXPLICIT_SCALE, GROUPS, HEAD_DIMS, LEVELS, ODD_HEAD_DIMS, QUICK,  # noqa: F401
                             QUICK_SLOTS, SERVING_SLOTS, SHAPES, SHORT, SLOT_FLAGS, SLOT_MIN_LENGTH,
                             SMALL_FLAGS, TILES, draw_lengths, draw_shapes, gradient_slot, serving_lengths,
                             slot_flags)
from kernel_src.contract import Dims


def _on_device(x, dtype: str) -> jax.Array:
    """``x`` (NumPy, or a JAX array) as a JAX array of ``dtype``, as ``jnp.asarray`` gives it."""
    return jnp.asarray(x, dtype) if isinstance(x, jax.Array) else device_array(x, dtype)


class Problem:
    """One call's inputs and flags. ``ct`` (a random cotangent) is set when gradients are checked.

    q: ``[batch, q_len, num_q_heads, head_dim]``; k, v: ``[batch, kv_len, num_kv_heads, head_dim]``;
    ct like q; ``lengths``: NumPy int32 ``[batch]`` or None. The features (``kernel_src.contract``), None
    when not used: ``window`` ``(left, right)``, ``softcap`` (float), ``q_segments`` / ``kv_segments``
    (NumPy int32 ``[batch, q_len]`` / ``[batch, kv_len]``), ``sinks`` (NumPy float32 ``[num_q_heads]``).
    ``truth`` is the float64 oracle on these inputs; ``baseline`` the contract-precision reference's
    results (``grouped_baseline``: the same with K/V repeated per query head, see there).
    """

    def __init__(self, label: str, dtype: str, q, k, v, *, causal: bool = False, kv_lengths=None,
                 scale: float | None = None, ct=None, window=None, softcap: float | None = None,
                 q_segments=None, kv_segments=None, sinks=None):
        self.label, self.dtype, self.causal, self.scale = label, dtype, causal, scale
        self.q, self.k, self.v = (_on_device(x, dtype) for x in (q, k, v))
        self.ct = None if ct is None else _on_device(ct, dtype)
        self.lengths = None if kv_lengths is None else np.asarray(kv_lengths, np.int32)
        self.kv_lengths = None if kv_lengths is None else device_array(self.lengths)
        self.window = None if window is None else tuple(window)
        self.softcap = None if softcap is None else float(softcap)
        self.q_segments = None if q_segments is None else np.asarray(q_segments, np.int32)
        self.kv_segments = None if kv_segments is None else np.asarray(kv_segments, np.int32)
        self.sinks = None if sinks is None else np.asarray(sinks, np.float32)
        self.derived = False  # True for a changed copy of another problem (stays-put and determinism checks)
        self.judged = True  # False where its check reads no truth or baseline of it (they are never computed)
        self.slot: str | None = None  # the slot drawn at (``normal``), if any

    @property
    def features(self) -> dict:
        """The feature arguments this problem uses, as the contract names them (NumPy arrays)."""
        found = {"window_size": self.window, "softcap": self.softcap, "q_segment_ids": self.q_segments,
                 "kv_segment_ids": self.kv_segments, "sinks": self.sinks}
        return {name: value for name, value in found.items() if value is not None}

    @property
    def kwargs(self) -> dict:
        """The candidate's keyword arguments: the base flags, and only the features this problem uses."""
        return {"causal": self.causal, "kv_lengths": self.kv_lengths, "scale": self.scale,
                **{n: device_array(x) if isinstance(x, np.ndarray) else x for n, x in self.features.items()}}

    @property
    def offset(self) -> int:
        return self.k.shape[1] - self.q.shape[1]

    @property
    def group(self) -> int:
        return self.q.shape[2] // self.k.shape[2]

    @property
    def key(self) -> tuple:
        """What a kernel that memoizes by shape would key on: shapes, dtype and flags."""
        return (tuple(self.q.shape), tuple(self.k.shape), self.dtype, self.causal, self.lengths is None,
                self.scale, self.window, self.softcap, self.q_segments is None, self.sinks is None)

    def replace(self, label: str, **arrays) -> "Problem":
        """The same flags with some of q/k/v/ct (NumPy float32 values) or of the feature arrays
        (``q_segments``, ``kv_segments``, ``sinks``) replaced; always fresh arrays."""
        a = {n: arrays.get(n, None if getattr(self, n) is None else self.host(n)) for n in ("q", "k", "v", "ct")}
        f = {n: arrays.get(n, getattr(self, n)) for n in ("q_segments", "kv_segments", "sinks")}
        p = Problem(label, self.dtype, a["q"], a["k"], a["v"], ct=a["ct"], causal=self.causal,
                    kv_lengths=self.lengths, scale=self.scale, window=self.window, softcap=self.softcap, **f)
        p.slot = self.slot
        return p

    def derive(self, label: str, **arrays) -> "Problem":
        """``replace`` marked as derived: compared with ``self``, not a fresh draw at its shape."""
        p = self.replace(label, **arrays)
        p.derived = True
        return p

    def host(self, name: str) -> np.ndarray:
        return np.asarray(getattr(self, name)).astype(np.float32)

    @functools.cached_property
    def truth(self) -> oracle.Truth:
        """The float64 oracle (magnitudes, a scale for errors, in float32; each query head's dK/dV share
        where ``grouped_baseline`` needs it)."""
        return oracle.attention(self.q, self.k, self.v, self.ct, causal=self.causal, kv_lengths=self.lengths,
                                scale=self.scale, window=self.window, softcap=self.softcap,
                                q_segment_ids=self.q_segments, kv_segment_ids=self.kv_segments, sinks=self.sinks,
                                magnitude_dtype=np.float32, per_head=self._grouped,
                                stored_dtype=self.q.dtype)

    @property
    def _grouped(self) -> bool:
        return self.ct is not None and self.dtype != "float32" and self.group > 1

    @functools.cached_property
    def baseline(self) -> tuple[np.ndarray, ...]:
        """The reference's ``(out,)`` or ``(out, dq, dk, dv)`` when ``ct`` is set (and ``dsinks`` after them
        when the problem has sinks).

        A slot graded with gradients (``grading.dense.slots.GRADIENT_SLOTS``) gets both from one compiled
        program per shape and flags (a forward-only problem runs it under a zero cotangent), so it
        compiles once; a forward-only slot runs the reference's forward alone."""
        features = {n: device_array(x) if isinstance(x, np.ndarray) else x for n, x in self.features.items()}
        if self.ct is None and not gradient_slot(self.slot):
            return (np.asarray(reference(self.q, self.k, self.v, causal=self.causal, kv_lengths=self.kv_lengths,
                                         scale=self.scale, **features)),)
        ct = np.zeros(self.q.shape, self.q.dtype) if self.ct is None else self.ct
        result = _reference_vjp(self.q, self.k, self.v, ct, self.kv_lengths, causal=self.causal, scale=self.scale,
                                **features)
        return tuple(np.asarray(x) for x in (result[:1] if self.ct is None else result))

    def prepare(self) -> None:
        """Compute what judging this problem needs (truth, baselines, largest logit) now; the rubric calls
        it while the candidate's worker computes, so the two overlap. Nothing for a problem not ``judged``."""
        if self.judged:
            self.truth, self.baseline, self.grouped_baseline  # noqa: B018  (cached)

    @property
    def logit_max(self) -> float:
        """The largest ``|scale * q.k|`` over visible (query, key) pairs (0 when none is visible): sets the
        tolerance floor's multiple (``grading.tolerance.judge``, ``logit_scale``); from the truth's logits."""
        return self.truth.logit_max

    @functools.cached_property
    def grouped_baseline(self) -> tuple[np.ndarray, np.ndarray] | None:
        """``(dk, dv)`` with each query head's contribution rounded to the input dtype before the group sum
        (in fp32) and the sum rounded to the input dtype, as FlashAttention-2-style backwards (and JAX's
        Pallas TPU flash kernel on repeated heads) do; each head's share is the float64 truth's, so all
        the error is that rounding. ``None`` when that rounding is exact (float32 or group 1)."""
        if not self._grouped:
            return None
        b, lk, hk, d = self.k.shape
        dtype = self.k.dtype

        def fold(x):
            return x.astype(dtype).astype(np.float32).reshape(b, lk, hk, self.group, d).sum(axis=3).astype(dtype)
        return tuple(fold(x) for x in self.truth.per_head_dkv)


# --------------------------------------------------------------------------------------------------
# Computing ahead: the float64 truth (NumPy, which releases the GIL in its products) and the
# reference's baseline (XLA compiles and runs outside the GIL) of the problems a check just built, on
# two background threads, while the check calls the candidate and judges earlier problems.

_JOBS: queue.Queue = queue.Queue()
_THREADS: list[threading.Thread] = []
AHEAD_THREADS = 2
STOPPING = threading.Event()  # set as the interpreter exits: no background work starts after it


def _stop_background() -> None:
    """Before the interpreter finalizes: start no queued job and wait for the running ones. A thread
    still inside XLA while Python finalizes is unwound through C++ frames that forbid it, and the whole
    process aborts (SIGABRT) after its work is done."""
    STOPPING.set()
    while True:
        try:
            _JOBS.get_nowait()
        except queue.Empty:
            break
    for _ in _THREADS:
        _JOBS.put(None)


# Background threads are waited for at exit (after _stop_background) where Python lets a callback run
# before it joins them; elsewhere they are daemons, as before.
BACKGROUND_DAEMON = not hasattr(threading, "_register_atexit")
if not BACKGROUND_DAEMON:
    threading._register_atexit(_stop_background)


def _work() -> None:
    while True:
        job = _JOBS.get()
        if job is None:
            return
        try:
            job()
        except Exception:  # noqa: BLE001  the property is computed again (and raises) where it is read
            pass


def single_threaded_blas() -> bool:
    """Set NumPy's OpenBLAS to one thread in this process (True when it could). The truth's float64
    products are mostly small-M (a few query rows against thousands of keys); OpenBLAS's own threads,
    spinning on a loaded 2-core machine and locking against a second calling thread, made one 16 x 11k
    product take 3.7 s instead of 0.07 s. The grader's parallelism is its two ahead threads instead."""
    import ctypes
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower() and ".so" in line}
        for path in paths:
            lib = ctypes.CDLL(path)
            for name in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                         "openblas_set_num_threads64_", "openblas_set_num_threads"):
                if hasattr(lib, name):
                    getattr(lib, name)(1)
                    return True
    except OSError:
        pass
    return False


def compute_ahead(found) -> None:
    """Queue the truth and baseline of every fresh ``Problem`` in ``found`` (nested lists and tuples) for the
    background threads. Reading a property that a thread is computing waits for it (``cached_property``'s
    lock); one whose job failed is computed again where it is read."""
    ps = []

    def walk(x):
        if isinstance(x, Problem):
            if not x.derived and x.judged:
                ps.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
    walk(found)
    if not ps or STOPPING.is_set():
        return
    if not _THREADS:
        single_threaded_blas()  # before the threads start: no product is running now
    while len(_THREADS) < AHEAD_THREADS:
        _THREADS.append(threading.Thread(target=_work, name="grading-ahead", daemon=BACKGROUND_DAEMON))
        _THREADS[-1].start()
    for p in ps:  # truths and baselines alternate, so the two threads run one of each
        _JOBS.put(lambda p=p: p.truth)
        _JOBS.put(lambda p=p: (p.baseline, p.grouped_baseline))


@functools.partial(jit_cpu, static_argnames=("causal", "scale", "window_size", "softcap"))
def _reference_vjp(q, k, v, ct, kv_lengths, *, causal: bool, scale: float | None, window_size=None,
                   softcap: float | None = None, q_segment_ids=None, kv_segment_ids=None, sinks=None):
    """The reference's output and its gradients under ``ct`` (and ``dsinks`` last, with sinks), compiled as
    one program per shape and flags."""
    def call(q, k, v, sinks):
        return reference(q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale, window_size=window_size,
                         softcap=softcap, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, sinks=sinks)
    if sinks is None:
        out, pull = jax.vjp(lambda q, k, v: call(q, k, v, None), q, k, v)
    else:
        out, pull = jax.vjp(call, q, k, v, sinks)
    return (out, *pull(ct))


def normal(rng: np.random.Generator, shape: str | Dims, dtype: str, *, causal: bool = False,
           lengths: bool | str = False, scale: float | None = None, grad: bool = False,
           zero_batch: int | None = None, tag: str = "", name: str | None = None,
           min_length: int = 1) -> Problem:
    """N(0, 1) q, k, v (and cotangent when ``grad``) of ``shape`` (a ``QUICK`` name or a Dims).

    ``lengths``: False (kv_lengths=None), True (``draw_lengths``), "full" (kv_len each) or an int array.
    The label names the shape (``name`` or the quick name), its dims, the dtype and every flag.
    """
    d = QUICK[shape] if isinstance(shape, str) else shape
    name = name or (shape if isinstance(shape, str) else "")
    q = rng.standard_normal((d.batch, d.q_len, d.num_q_heads, d.head_dim), np.float32)
    k = rng.standard_normal((d.batch, d.kv_len, d.num_kv_heads, d.head_dim), np.float32)
    v = rng.standard_normal(k.shape, np.float32)
    ct = rng.standard_normal(q.shape, np.float32) if grad else None
    if isinstance(lengths, np.ndarray):
        kv_lengths = lengths
    else:
        kv_lengths = None if not lengths else np.full(d.batch, d.kv_len) if lengths == "full" else \
            draw_lengths(rng, d, zero_batch, min_length if min_length < d.kv_len else 1)
    flags = ["causal"] if causal else []
    flags += [] if kv_lengths is None else [f"kv_lengths={np.asarray(kv_lengths).tolist()}"]
    flags += [f"scale={scale:g}"] if scale is not None else []
    label = f"{name}{tuple(d)} {SHORT[dtype]} {'+'.join(flags) or 'unmasked'}{' ' + tag if tag else ''}"
    p = Problem(label, dtype, q, k, v, causal=causal, kv_lengths=kv_lengths, scale=scale, ct=ct)
    p.slot = name or None
    return p
