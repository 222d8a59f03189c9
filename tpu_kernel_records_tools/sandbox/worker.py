"""The candidate's side of the grading sandbox: one interpreter per candidate, arrays in, arrays out.

``sandbox.sandbox`` starts this module in a fresh interpreter (``python -I``) with an allow-listed
environment, an empty temporary working directory and home, closed stdin, and two pipe file
descriptors. The worker then

1. lowers its own limits, soft and hard (address space ``RLIMIT_AS``, open files ``RLIMIT_NOFILE``, no
   core dumps; under bubblewrap also ``RLIMIT_NPROC`` and ``RLIMIT_FSIZE``), joins a fresh session
   keyring and installs its system-call filter (``sandbox.syscalls``) before importing JAX,
2. answers ``hello`` once JAX is imported, saying whether the filter holds (the grader does not count
   that start against the candidate; nothing of the candidate has run yet, so the grader believes it),
3. hands every request to the service its caller named (``module:factory``, made after the filter is up:
   a :class:`Server`; ``grading.serve`` is the grader's), which loads the candidate and calls it, and
   answers each with the service's reply, or with the first line of whatever it raised.

Only what the grader sends reaches this process; its own state never exists here, so a candidate that
reads frames, rebinds functions or changes JAX's global config only affects itself.

Wire format (both directions, also used by ``sandbox.sandbox``): an 8-byte little-endian header length,
a JSON header (``arrays`` lists ``{"dtype", "shape"}``), then each array's C-order bytes. No pickle
crosses from the worker to the grader. From the grader, an array of :data:`HOLE_MIN` bytes or more is sent without
its all-zero chunks of :data:`HOLE_CHUNK` bytes (its spec's ``data`` lists the ``[start, end)`` byte spans that
follow): the worker reads it into a 64-byte aligned ``np.zeros`` buffer, whose holes are never touched, so a pool of
gigabytes of zeros stays out of resident memory, and ``jax.device_put`` on a CPU aliases an aligned buffer instead
of copying it. The worker's replies are always dense.
"""

from __future__ import annotations

import json
import os
import reprlib
import struct
import sys

HEADER_LIMIT = 1 << 20  # bytes: a JSON header larger than this is a protocol violation
HOLE_MIN = 64 << 20     # bytes: an array the grader sends this large goes without its all-zero chunks
HOLE_CHUNK = 1 << 20    # bytes per chunk (a multiple of 8)
ALIGNMENT = 64          # bytes: XLA:CPU aliases a host buffer aligned so in device_put, and copies it otherwise
OPEN_FILES = 4096       # RLIMIT_NOFILE of a worker
DTYPE_NAMES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
               "float16", "bfloat16", "float32", "float64", "float8_e4m3fn")


class ProtocolError(Exception):
    """The other side sent something that is not a well-formed frame (or the pipe closed mid-frame). Its message,
    which may quote what the other side sent, is one line of at most ``MESSAGE_LIMIT`` characters."""

    MESSAGE_LIMIT = 300

    def __init__(self, message: str):
        line = " ".join(str(message).split())
        super().__init__(line if len(line) <= self.MESSAGE_LIMIT else line[:self.MESSAGE_LIMIT - 3] + "...")


def dtype_of(name: str):
    """NumPy dtype for one of ``DTYPE_NAMES`` (bfloat16 and float8_e4m3fn through JAX's ml_dtypes); else
    ProtocolError."""
    import numpy as np

    if name not in DTYPE_NAMES:
        raise ProtocolError(f"unsupported dtype {name!r:.60}")
    if name in ("bfloat16", "float8_e4m3fn"):
        import jax.numpy as jnp
        return np.dtype(getattr(jnp, name))
    return np.dtype(name)


def encode(header: dict, arrays=(), *, holes: bool = True) -> list:
    """The frame of ``header`` and ``arrays`` as a list of bytes-like chunks; ``holes``: arrays of :data:`HOLE_MIN`
    bytes or more go without their all-zero chunks (module docstring)."""
    import numpy as np

    arrays = [np.ascontiguousarray(a).reshape(np.shape(a)) for a in arrays]  # (ascontiguousarray makes 0-d 1-d)
    specs, data = [], []
    for a in arrays:
        spec, flat = {"dtype": str(a.dtype), "shape": list(a.shape)}, _bytes_of(a)
        spans = data_spans(flat) if holes and flat.nbytes >= HOLE_MIN else [(0, flat.nbytes)]
        if holes and flat.nbytes >= HOLE_MIN:
            spec["data"] = [list(span) for span in spans]
        specs.append(spec)
        data += [memoryview(flat[start:end]) for start, end in spans]
    head = json.dumps(dict(header, arrays=specs), allow_nan=False).encode()
    return [struct.pack("<Q", len(head)), head, *data]


def _bytes_of(a):
    """The bytes of a C-contiguous array as a uint8 array (bfloat16 has no buffer-protocol format)."""
    return a.reshape(-1).view("u1")


def zero_chunks(flat) -> list[bool]:
    """Which :data:`HOLE_CHUNK`-byte chunks of ``flat`` (1-d uint8) are all zero, in order. It only reads (an
    untouched page of an ``np.zeros`` buffer stays out of resident memory) and calls array methods alone (a
    candidate cannot rebind them)."""
    whole = flat.nbytes // HOLE_CHUNK * HOLE_CHUNK
    zero = (~flat[:whole].view("u8").reshape(-1, HOLE_CHUNK // 8).any(axis=1)).tolist()
    return zero if whole == flat.nbytes else [*zero, not flat[whole:].any()]


def data_spans(flat) -> list[tuple[int, int]]:
    """The ``[start, end)`` byte spans of ``flat`` (1-d uint8) that hold its chunks with a non-zero byte."""
    spans: list[tuple[int, int]] = []
    for i, zero in enumerate(zero_chunks(flat)):
        start, end = i * HOLE_CHUNK, min((i + 1) * HOLE_CHUNK, flat.nbytes)
        if zero:
            continue
        if spans and spans[-1][1] == start:
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((start, end))
    return spans


def aligned_zeros(nbytes: int):
    """A writable uint8 array of ``nbytes`` zeros at a :data:`ALIGNMENT`-byte boundary (``np.zeros``: calloc'd, so
    pages nobody writes are never resident)."""
    import numpy as np
    raw = np.zeros(nbytes + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start:start + nbytes]


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

def _read_into(fd: int, view) -> None:
    view, got = memoryview(view).cast("B"), 0
    while got < view.nbytes:
        chunk = os.readv(fd, [view[got:]])
        if chunk == 0:
            raise EOFError("the grader closed the pipe")
        got += chunk


def _read_exact(fd: int, n: int) -> bytearray:
    buf = bytearray(n)
    _read_into(fd, buf)
    return buf


def _spans(spec: dict, nbytes: int) -> list[tuple[int, int]]:
    """The byte spans an array's spec says follow (all of it without ``data``); ProtocolError unless they are
    sorted, disjoint and inside the array."""
    spans = spec.get("data", [[0, nbytes]])
    end = 0
    if not isinstance(spans, list) or not all(isinstance(x, list) and len(x) == 2 and type(x[0]) is int and
                                              type(x[1]) is int for x in spans):
        raise ProtocolError(f"bad data spans {reprlib.repr(spans)}")
    for start, stop in spans:
        if not end <= start <= stop <= nbytes:
            raise ProtocolError(f"data span [{start}, {stop}) out of order or past {nbytes} bytes")
        end = stop
    return [tuple(x) for x in spans]


def _receive(fd: int):
    (length,) = struct.unpack("<Q", _read_exact(fd, 8))
    if length > HEADER_LIMIT:
        raise ProtocolError(f"header of {length} bytes")
    header, specs = decode_header(bytes(_read_exact(fd, length)))
    arrays = []
    for (dtype, shape, nbytes), spec in zip(specs, header.get("arrays", [])):
        spans = _spans(spec, nbytes)
        buf = aligned_zeros(nbytes)
        for start, end in spans:
            _read_into(fd, buf[start:end])
        arrays.append(buf.view(dtype).reshape(shape))
    return header, arrays


def _send(fd: int, header: dict, arrays=()) -> None:
    for chunk in encode(header, arrays, holes=False):
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


BARE_SERVICE = "tpu_kernel_records_tools.sandbox.worker:Server"  # answers the hello, refuses every request


class Server:
    """What a worker serves; a service (``Sandbox(service=...)``) subclasses it. This bare one answers the
    hello and refuses every request. ``handle`` runs in the worker, where the candidate's code does too."""

    def handle(self, header: dict, arrays: list) -> tuple[dict, list]:
        """The reply (a header the grader checks, and arrays) to one request; may raise (reported)."""
        return {"ok": False, "error": f"unexpected request {header.get('op')!r}"}, []


def _service(spec: str) -> Server:
    """The ``module:factory`` a worker serves, made (imported by the worker, never the candidate's)."""
    import importlib

    module, _, factory = spec.partition(":")
    return getattr(importlib.import_module(module), factory)()


def main(argv: list[str] | None = None, service: str = BARE_SERVICE) -> None:
    """``worker IN_FD OUT_FD MEMORY_BYTES [PROCESSES FILE_BYTES]``: serve requests with ``service``
    (``module:factory``, a :class:`Server`) until the grader closes the pipe."""
    argv = sys.argv[1:] if argv is None else argv
    fd_in, fd_out, memory = int(argv[0]), int(argv[1]), int(argv[2])
    processes, file_bytes = (int(argv[3]), int(argv[4])) if len(argv) >= 5 else (0, 0)
    _limit(memory, processes, file_bytes)
    from ..sandbox.syscalls import confine
    syscall_filter, _ = confine()  # before JAX starts a thread and long before the candidate loads
    server = _service(service)
    _send(fd_out, {"op": "hello", "pid": os.getpid(), "syscall_filter": syscall_filter})
    while True:
        try:
            header, arrays = _receive(fd_in)
        except (EOFError, ProtocolError, OSError):
            os._exit(0)
        try:
            reply, out = server.handle(header, arrays)
        except BaseException as e:  # the candidate's exception is reported, never fatal to the worker
            reply, out = {"ok": False, "raised": True, "error": _first_line(e)}, []
        seq = header.get("seq")
        try:
            _send(fd_out, {**reply, "seq": seq}, out)
        except (TypeError, ValueError) as e:  # e.g. a NaN where JSON needs a number
            _send(fd_out, {"ok": False, "error": f"unreportable result: {_first_line(e)}", "seq": seq})
