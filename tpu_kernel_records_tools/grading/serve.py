"""What a grading worker serves: the attention candidate's requests, run inside the sandbox's worker.

``Runner`` starts its ``Sandbox`` with ``service=SERVICE``, so the worker (``sandbox.worker``) makes an
:class:`AttentionServer` after its filter is up and hands it every request:

- ``load``: the candidate by its spec (a built-in name through ``grading.candidates.resolve``,
  ``/abs/path.py:function`` or ``module:function``; or a function pickled by reference), after adding
  the XLA:CPU options the grader sends (``sandbox.cpu_jit.worker_compile_options`` of the level) to
  ``XLA_FLAGS`` when it computes on a CPU (the same results, compiled faster); the reply names the features it declares;
- ``forward`` (``out``) and ``vjp`` (``out, dq, dk, dv`` through ``jax.vjp``), ``paged`` (``out`` of a paged
  candidate: q, k_pages, v_pages, kv_lengths, page_indices; ``kernel_src.contract``), ``ragged`` (``out`` of a
  ragged candidate: its arrays by name and its flags), and ``export`` (the
  candidate's programs per call signature, ``grading.export``: shapes only, no values).

Only problem inputs reach it: q, k, v [batch, len, heads, head_dim], the cotangent, the flags (causal,
kv_lengths [batch] int32, scale). After each call it compares the inputs with a copy taken before the call
and reports "inputs modified" if the candidate wrote into them.
"""

from __future__ import annotations

from ..sandbox.worker import DTYPE_NAMES, HOLE_CHUNK, HOLE_MIN, Server, _add_xla_flags, _first_line, zero_chunks

SERVICE = "tpu_kernel_records_tools.grading.serve:AttentionServer"  # what Runner's workers serve


class AttentionServer(Server):
    """Holds the candidate and answers requests. Helpers are bound before the candidate loads, so a
    candidate that rebinds NumPy's functions does not change how its results are reported."""

    def __init__(self):
        import jax
        import jax.numpy as jnp
        import numpy as np

        self.jax, self.jnp, self.np = jax, jnp, np
        self.array_equal, self.asarray, self.ascontiguous = np.array_equal, np.asarray, np.ascontiguousarray
        self.vjp, self.ndarray, self.device_put = jax.vjp, np.ndarray, jax.device_put
        self.fn = None

    def _bytes(self, a):
        return self.ascontiguous(self.asarray(a)).reshape(-1).view(self.np.uint8)

    def _copies(self, arrays) -> list:
        """The inputs' bytes before the call, copied (compared after it: a copy and a comparison cost a fraction
        of the SHA-256 digests they replace); of an array of ``HOLE_MIN`` bytes or more, which chunks are zero and
        a copy of the others (a copy of its zeros would make a pool the transport kept sparse resident)."""
        return [self._snapshot(self._bytes(a)) for a in arrays]

    def _snapshot(self, flat):
        if flat.nbytes < HOLE_MIN:
            return flat.copy()
        zero = zero_chunks(flat)
        return zero, {i: flat[i * HOLE_CHUNK:(i + 1) * HOLE_CHUNK].copy() for i, z in enumerate(zero) if not z}

    def _unchanged(self, before, flat) -> bool:
        if not isinstance(before, tuple):
            return self.array_equal(before, flat)
        zero, kept = before
        now = zero_chunks(flat)
        return len(now) == len(zero) and all(n for n, z in zip(now, zero) if z) and all(
            self.array_equal(x, flat[i * HOLE_CHUNK:(i + 1) * HOLE_CHUNK]) for i, x in kept.items())

    def handle(self, header: dict, arrays: list) -> tuple[dict, list]:
        op = header.get("op")
        if op == "load":
            return self.load(header), []
        if op == "export" and self.fn is not None:  # grading.export
            from ..grading.export import export_programs
            return export_programs(self.fn, header["signatures"], header["platform"])
        if op in ("forward", "vjp") and self.fn is not None:
            return self.call(header, arrays)
        if op == "paged" and self.fn is not None:
            return self.call_paged(header, arrays)
        if op == "ragged" and self.fn is not None:
            return self.call_ragged(header, arrays)
        return super().handle(header, arrays)

    def load(self, header: dict) -> dict:
        from ..grading.candidates import CandidateLoadError, resolve
        if header.get("cpu_compile"):  # the grader computes on a CPU, so does this worker: before the backend starts
            _add_xla_flags(dict(header["cpu_compile"]))  # sandbox.cpu_jit.worker_compile_options, sent by the grader
        try:
            if header.get("pickled"):
                import base64
                import pickle
                fn = pickle.loads(base64.b64decode(header["pickled"]))  # sent by the grader, never the reverse
            else:
                fn = resolve(header["spec"]).load()
        except CandidateLoadError as e:
            return {"ok": False, "error": str(e)}
        except BaseException as e:  # noqa: BLE001 - SystemExit from a module's top level included
            return {"ok": False, "error": f"cannot load the candidate: {_first_line(e)}"}
        if not callable(fn):
            return {"ok": False, "error": f"the candidate is a {type(fn).__name__}, not callable"}
        from kernel_src.contract import declared_features
        try:
            features = list(declared_features(fn))
        except BaseException as e:  # noqa: BLE001 - a malformed or raising ``features`` attribute
            return {"ok": False, "error": f"the candidate's declared features: {_first_line(e)}"}
        self.fn = fn
        return {"ok": True, "features": features}

    def call(self, header: dict, arrays: list) -> tuple[dict, list]:
        """``forward``: arrays q, k, v[, kv_lengths][, q_segment_ids, kv_segment_ids][, sinks] -> out.
        ``vjp``: q, k, v, cotangent[, ...] -> out, dq, dk, dv[, dsinks]. Feature arguments reach the
        candidate only when the request sets them (``window``, ``softcap`` in the header)."""
        grad = header["op"] == "vjp"
        names = ["q", "k", "v"] + (["cotangent"] if grad else []) + (["kv_lengths"] if header.get("has_lengths") else [])
        names += ["q_segment_ids", "kv_segment_ids"] if header.get("has_segments") else []
        names += ["sinks"] if header.get("has_sinks") else []
        if len(arrays) != len(names):
            return {"ok": False, "error": f"expected {len(names)} arrays, got {len(arrays)}"}, []
        before = self._copies(arrays)
        given = [self.device_put(a) for a in arrays]  # what the candidate reaches (jnp.asarray compiles per shape)
        named = dict(zip(names, given))
        q, k, v = given[:3]
        kwargs = {"causal": bool(header["causal"]), "kv_lengths": named.get("kv_lengths"), "scale": header.get("scale")}
        if header.get("window") is not None:
            kwargs["window_size"] = tuple(header["window"])
        if header.get("softcap") is not None:
            kwargs["softcap"] = float(header["softcap"])
        for name in ("q_segment_ids", "kv_segment_ids"):
            if name in named:
                kwargs[name] = named[name]
        sinks = named.get("sinks")
        if grad:
            if sinks is None:
                out, pull = self.vjp(lambda q, k, v: self.fn(q, k, v, **kwargs), q, k, v)
            else:
                out, pull = self.vjp(lambda q, k, v, s: self.fn(q, k, v, **kwargs, sinks=s), q, k, v, sinks)
            if not (hasattr(out, "shape") and hasattr(out, "dtype")):
                return {"ok": False, "error": f"output is a {type(out).__name__}, not an array"}, []
            if tuple(out.shape) != tuple(q.shape):
                return {"ok": False, "error": f"output shape {tuple(out.shape)}, expected {tuple(q.shape)}"}, []
            results = [out, *pull(named["cotangent"].astype(out.dtype))]
        else:
            results = [self.fn(q, k, v, **kwargs, **({} if sinks is None else {"sinks": sinks}))]
        return self._reply(names, before, given, results)

    def call_paged(self, header: dict, arrays: list) -> tuple[dict, list]:
        """``paged``: arrays q, k_pages, v_pages, kv_lengths, page_indices[, sinks] -> out, through
        ``paged_attention(q, k_pages, v_pages, *, kv_lengths, page_indices, causal, scale, ...)``; the
        features reach the candidate only when the request sets them."""
        names = ["q", "k_pages", "v_pages", "kv_lengths", "page_indices"]
        names += ["sinks"] if header.get("has_sinks") else []
        if len(arrays) != len(names):
            return {"ok": False, "error": f"expected {len(names)} arrays, got {len(arrays)}"}, []
        before = self._copies(arrays)
        given = [self.device_put(a) for a in arrays]
        named = dict(zip(names, given))
        kwargs = {"kv_lengths": named["kv_lengths"], "page_indices": named["page_indices"],
                  "causal": bool(header["causal"]), "scale": header.get("scale")}
        if header.get("window") is not None:
            kwargs["window_size"] = tuple(header["window"])
        if header.get("softcap") is not None:
            kwargs["softcap"] = float(header["softcap"])
        if "sinks" in named:
            kwargs["sinks"] = named["sinks"]
        return self._reply(names, before, given, [self.fn(*given[:3], **kwargs)])

    def call_ragged(self, header: dict, arrays: list) -> tuple[dict, list]:
        """``ragged``: arrays named by ``names`` (q, k_pages, v_pages, then keyword arrays: kv_lengths, page_indices,
        cu_q_lens, num_seqs[, sinks][, k_scale, v_scale]) -> out, through ``ragged_paged_attention(q, k_pages,
        v_pages, **keyword arrays, **static)``; ``static`` holds the flags and floats (a window as a pair)."""
        names = [str(n) for n in header.get("names", [])]
        if len(arrays) != len(names) or names[:3] != ["q", "k_pages", "v_pages"]:
            return {"ok": False, "error": f"expected arrays q, k_pages, v_pages, ..., got {len(arrays)}"}, []
        before = self._copies(arrays)
        given = [self.device_put(a) for a in arrays]
        static = {n: tuple(x) if isinstance(x, list) else x for n, x in dict(header.get("static", {})).items()}
        return self._reply(names, before, given, [self.fn(*given[:3], **dict(zip(names[3:], given[3:])), **static)])

    def _reply(self, names: list, before: list, given: list, results: list) -> tuple[dict, list]:
        """The results as host arrays, and which inputs the call wrote into (their bytes against ``before``)."""
        host = []
        for name, x in zip(("output", "dq", "dk", "dv", "dsinks"), results):
            if not (hasattr(x, "shape") and hasattr(x, "dtype")):
                return {"ok": False, "error": f"{name} is a {type(x).__name__}, not an array"}, []
            x = self.asarray(x)
            if not isinstance(x, self.ndarray) or str(x.dtype) not in DTYPE_NAMES:
                return {"ok": False, "error": f"{name} has dtype {getattr(x, 'dtype', '?')}, not a real "
                                               f"number type"}, []
            host.append(x)
        modified = [n for n, a, b in zip(names, before, given) if not self._unchanged(a, self._bytes(b))]
        return {"ok": True, "inputs_modified": modified}, host
