"""The candidate's side of the grading sandbox: one interpreter per candidate, arrays in, arrays out.

``grading.sandbox`` starts this module in a fresh interpreter (``python -I``) with an allow-listed
environment, an empty temporary working directory and home, closed stdin, and two pipe file
descriptors. The worker then

1. lowers its own limits, soft and hard (address space ``RLIMIT_AS``, open files ``RLIMIT_NOFILE``, no
   core dumps; under bubblewrap also ``RLIMIT_NPROC`` and ``RLIMIT_FSIZE``), joins a fresh session
   keyring and installs its system-call filter (``grading.syscalls``) before importing JAX,
2. answers ``hello`` once JAX is imported, saying whether the filter holds (the grader does not count
   that start against the candidate; nothing of the candidate has run yet, so the grader believes it),
3. loads the candidate by its spec (a built-in name through ``grading.candidates.resolve``,
   ``/abs/path.py:function`` or ``module:function``; or a function pickled by reference), after
   adding ``grading.candidates.CPU_COMPILE_OPTIONS`` to ``XLA_FLAGS`` when the grader computes on a CPU
   (the same results, compiled faster),
4. serves ``forward`` (``out``) and ``vjp`` (``out, dq, dk, dv`` through ``jax.vjp``) requests, ``paged``
   (``out`` of a paged candidate: q, k_pages, v_pages, kv_lengths, page_indices; ``kernel_src.contract``), and
   ``export`` (the candidate's programs per call signature, ``grading.export``: shapes only, no values).

Only problem inputs reach this process: q, k, v [batch, len, heads, head_dim], the cotangent, the flags
(causal, kv_lengths [batch] int32, scale). The float64 truth, the reference's baseline and the grader's
state never exist here, so a candidate that reads frames, rebinds functions or changes JAX's global
config only affects itself. After each call the worker compares the inputs with a hash taken before
the call and reports "inputs modified" if the candidate wrote into them.

Wire format (both directions, also used by ``grading.sandbox``): an 8-byte little-endian header length,
a JSON header (``arrays`` lists ``{"dtype", "shape"}``), then each array's C-order bytes. No pickle
crosses from the worker to the grader.
"""

from __future__ import annotations

import json
import os
import reprlib
import struct
import sys

HEADER_LIMIT = 1 << 20  # bytes: a JSON header larger than this is a protocol violation
OPEN_FILES = 4096       # RLIMIT_NOFILE of a worker
DTYPE_NAMES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
               "float16", "bfloat16", "float32", "float64")


class ProtocolError(Exception):
    """The other side sent something that is not a well-formed frame (or the pipe closed mid-frame)."""


def dtype_of(name: str):
    """NumPy dtype for one of ``DTYPE_NAMES`` (bfloat16 through JAX's ml_dtypes); else ProtocolError."""
    import numpy as np

    if name not in DTYPE_NAMES:
        raise ProtocolError(f"unsupported dtype {name!r:.60}")
    if name == "bfloat16":
        import jax.numpy as jnp
        return np.dtype(jnp.bfloat16)
    return np.dtype(name)


def encode(header: dict, arrays=()) -> list:
    """The frame of ``header`` and ``arrays`` as a list of bytes-like chunks."""
    import numpy as np

    arrays = [np.ascontiguousarray(a) for a in arrays]
    header = dict(header, arrays=[{"dtype": str(a.dtype), "shape": list(a.shape)} for a in arrays])
    head = json.dumps(header, allow_nan=False).encode()
    return [struct.pack("<Q", len(head)), head, *(_bytes_view(a) for a in arrays)]


def _bytes_view(a) -> memoryview:
    """The bytes of a C-contiguous array (bfloat16 has no buffer-protocol format, so view it as uint8)."""
    import numpy as np
    return memoryview(a.reshape(-1).view(np.uint8))


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def decode_header(head: bytes) -> tuple[dict, list[tuple[object, tuple[int, ...], int]]]:
    """Parse a header; returns it and ``(dtype, shape, nbytes)`` per announced array. Anything that is not
    a JSON object with a well-formed ``arrays`` list (bad UTF-8, ``NaN``, nesting deep enough to exhaust
    the parser's recursion, a shape of the wrong type) is a :class:`ProtocolError`, never another error."""
    try:
        header = json.loads(head.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError, MemoryError) as e:
        raise ProtocolError(f"header is not JSON ({type(e).__name__}: {str(e)[:100]})") from None
    if not isinstance(header, dict) or not isinstance(header.get("arrays", []), list):
        raise ProtocolError("header is not a JSON object with an 'arrays' list")
    specs = []
    for spec in header.get("arrays", []):
        if not isinstance(spec, dict) or not isinstance(spec.get("shape"), list) or len(spec["shape"]) > 8 or \
                not all(type(n) is int and 0 <= n < 1 << 40 for n in spec["shape"]):
            raise ProtocolError(f"bad array spec {reprlib.repr(spec)}")
        dtype = dtype_of(spec.get("dtype") if isinstance(spec.get("dtype"), str) else reprlib.repr(spec.get("dtype")))
        count = 1
        for n in spec["shape"]:
            count *= n
        specs.append((dtype, tuple(spec["shape"]), count * dtype.itemsize))
    return header, specs


# --------------------------------------------------------------------------------------------------
# Worker side: blocking reads and writes (the grader bounds how long it waits).

def _read_exact(fd: int, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        chunk = os.readv(fd, [view[got:]])
        if chunk == 0:
            raise EOFError("the grader closed the pipe")
        got += chunk
    return buf


def _receive(fd: int):
    import numpy as np

    (length,) = struct.unpack("<Q", _read_exact(fd, 8))
    if length > HEADER_LIMIT:
        raise ProtocolError(f"header of {length} bytes")
    header, specs = decode_header(bytes(_read_exact(fd, length)))
    arrays = [np.frombuffer(_read_exact(fd, nbytes), dtype).reshape(shape) for dtype, shape, nbytes in specs]
    return header, arrays


def _send(fd: int, header: dict, arrays=()) -> None:
    for chunk in encode(header, arrays):
        view = memoryview(chunk).cast("B")
        while view.nbytes:
            view = view[os.write(fd, view):]


def _limit(memory_bytes: int, processes: int = 0, file_bytes: int = 0) -> None:
    """Lower soft and hard limits together (the candidate cannot raise them back): no core dumps,
    :data:`OPEN_FILES` open files (sockets and pipes among them), address space ``memory_bytes``,
    ``processes`` threads and processes of this uid (counted over the sandbox's own user namespace under
    bubblewrap), files of at most ``file_bytes``; 0 leaves one as is."""
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for limit, value in ((resource.RLIMIT_AS, memory_bytes), (resource.RLIMIT_NPROC, processes),
                         (resource.RLIMIT_FSIZE, file_bytes), (resource.RLIMIT_NOFILE, OPEN_FILES)):
        if value > 0:
            _, hard = resource.getrlimit(limit)
            if hard != resource.RLIM_INFINITY:
                value = min(value, hard)
            resource.setrlimit(limit, (value, value))


def _first_line(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [""])[0][:300]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _add_xla_flags(options: dict) -> None:
    """Add ``options`` to ``XLA_FLAGS`` (those it does not set already); XLA reads them when JAX's backend
    starts, which importing JAX does not do."""
    given = os.environ.get("XLA_FLAGS", "")
    more = [f"--{name}={str(value).lower()}" for name, value in options.items() if f"--{name}=" not in given]
    os.environ["XLA_FLAGS"] = " ".join([given, *more]).strip()


class _Server:
    """Holds the candidate and answers requests. Helpers are bound before the candidate loads, so a
    candidate that rebinds NumPy or hashlib functions does not change how its results are reported."""

    def __init__(self):
        import hashlib

        import jax
        import jax.numpy as jnp
        import numpy as np

        self.jax, self.jnp, self.np = jax, jnp, np
        self.sha256, self.asarray, self.ascontiguous = hashlib.sha256, np.asarray, np.ascontiguousarray
        self.vjp, self.ndarray = jax.vjp, np.ndarray
        self.fn = None

    def _digest(self, arrays) -> list[str]:
        return [self.sha256(self.ascontiguous(self.asarray(a)).reshape(-1).view(self.np.uint8)).hexdigest()
                for a in arrays]

    def load(self, header: dict) -> dict:
        from ..grading.candidates import CPU_COMPILE_OPTIONS, CandidateLoadError, resolve
        if header.get("cpu_compile"):  # the grader computes on a CPU, so does this worker: before the backend starts
            _add_xla_flags(CPU_COMPILE_OPTIONS)
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
        jnp = self.jnp
        grad = header["op"] == "vjp"
        names = ["q", "k", "v"] + (["cotangent"] if grad else []) + (["kv_lengths"] if header.get("has_lengths") else [])
        names += ["q_segment_ids", "kv_segment_ids"] if header.get("has_segments") else []
        names += ["sinks"] if header.get("has_sinks") else []
        if len(arrays) != len(names):
            return {"ok": False, "error": f"expected {len(names)} arrays, got {len(arrays)}"}, []
        before = self._digest(arrays)
        given = [jnp.asarray(a) for a in arrays]  # what the candidate can reach, in ``names`` order
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
        before = self._digest(arrays)
        given = [self.jnp.asarray(a) for a in arrays]
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

    def _reply(self, names: list, before: list, given: list, results: list) -> tuple[dict, list]:
        """The results as host arrays, and which inputs the call wrote into (their hashes against ``before``)."""
        host = []
        for name, x in zip(("output", "dq", "dk", "dv", "dsinks"), results):
            if not (hasattr(x, "shape") and hasattr(x, "dtype")):
                return {"ok": False, "error": f"{name} is a {type(x).__name__}, not an array"}, []
            x = self.asarray(x)
            if not isinstance(x, self.ndarray) or str(x.dtype) not in DTYPE_NAMES:
                return {"ok": False, "error": f"{name} has dtype {getattr(x, 'dtype', '?')}, not a real "
                                               f"number type"}, []
            host.append(x)
        modified = [n for n, a, b in zip(names, before, self._digest(given)) if a != b]
        return {"ok": True, "inputs_modified": modified}, host


def main(argv: list[str] | None = None) -> None:
    """``worker IN_FD OUT_FD MEMORY_BYTES [PROCESSES FILE_BYTES]``: serve requests until the grader
    closes the pipe."""
    argv = sys.argv[1:] if argv is None else argv
    fd_in, fd_out, memory = int(argv[0]), int(argv[1]), int(argv[2])
    processes, file_bytes = (int(argv[3]), int(argv[4])) if len(argv) >= 5 else (0, 0)
    _limit(memory, processes, file_bytes)
    from ..grading.syscalls import confine
    syscall_filter, _ = confine()  # before JAX starts a thread and long before the candidate loads
    server = _Server()
    _send(fd_out, {"op": "hello", "pid": os.getpid(), "syscall_filter": syscall_filter})
    while True:
        try:
            header, arrays = _receive(fd_in)
        except (EOFError, ProtocolError, OSError):
            os._exit(0)
        try:
            if header.get("op") == "load":
                reply, out = server.load(header), []
            elif header.get("op") == "export" and server.fn is not None:  # grading.export
                from ..grading.export import export_programs
                reply, out = export_programs(server.fn, header["signatures"], header["platform"])
            elif header.get("op") in ("forward", "vjp") and server.fn is not None:
                reply, out = server.call(header, arrays)
            elif header.get("op") == "paged" and server.fn is not None:
                reply, out = server.call_paged(header, arrays)
            else:
                reply, out = {"ok": False, "error": f"unexpected request {header.get('op')!r}"}, []
        except BaseException as e:  # the candidate's exception is reported, never fatal to the worker
            reply, out = {"ok": False, "raised": True, "error": _first_line(e)}, []
        seq = header.get("seq")
        try:
            _send(fd_out, {**reply, "seq": seq}, out)
        except (TypeError, ValueError) as e:  # e.g. a NaN where JSON needs a number
            _send(fd_out, {"ok": False, "error": f"unreportable result: {_first_line(e)}", "seq": seq})
