"""The grader's side of the grading sandbox: start, talk to, and kill one candidate's worker process.

A :class:`Sandbox` runs ``sandbox.worker`` in a fresh interpreter (``python -I``) with

- an allow-listed environment (:func:`worker_environment`: locale, ``PATH``, the JAX/XLA/TPU and
  BLAS variables the platform needs; never ``HF_*``, ``KAGGLE_*``, ``AWS_*``, ``GOOGLE_*``,
  ``*_TOKEN``, ``*_KEY``, ``*_SECRET`` or anything else), ``HOME``, ``TMPDIR`` and the working
  directory set to its own new empty temporary folder, stdin closed, stdout/stderr to a log file;
- a memory limit of ``memory_limit_gb`` GiB (default :data:`DEFAULT_MEMORY_LIMIT_GB`): a memory cgroup
  of its own (``sandbox.memcg``: memory, memfds, tmpfs files, pipe buffers all counted; past it the
  cgroup's OOM killer kills the worker and nothing else) which it joins before it starts; where no cgroup
  can be had, an address-space limit (``RLIMIT_AS``) instead, which those escape. ``memory_limit`` says
  which (``memcg.KINDS``). No core dumps;
- every wait bounded by a deadline the caller gives (``request(..., timeout_s)``); on expiry the worker
  and all its descendants are killed.

No process a candidate starts outlives its grading: the grader makes itself a child subreaper
(Linux ``prctl(PR_SET_CHILD_SUBREAPER)``, and not dumpable), so orphans of the worker, including ones that called
``setsid()``, are re-parented to the grader; :meth:`Sandbox.close` then kills (SIGKILL) the worker,
every descendant psutil finds, and every child of the grader that appeared since the worker started,
until none is left, and reaps them.

Under ``isolation="process"`` that is all: the worker runs as the grader's user, so files that user can
read (a token saved under the real home, say) are readable by the candidate, and a root grader's
``/proc/PID/environ`` is readable by a root worker. Under ``isolation="bubblewrap"`` (the default for a
file or module candidate, ``sandbox.isolation``) the worker also runs in its own user, PID, network, IPC
and UTS namespaces as an unprivileged uid, on a read-only file system with a private size-limited
``/tmp``, under a process-count and a file-size limit: it sees neither the grader's processes nor its
environment, reaches no network and writes nothing outside its ``/tmp``.

Only arrays come back, and nothing the worker says is trusted: replies are parsed with
``sandbox.worker.decode_header`` (JSON header, a whitelist of dtypes, sizes checked against a cap), never
unpickled; each reply header must match :data:`REPLY_SCHEMA` and carry the number of the request it
answers, and a frame the grader did not ask for (written while the candidate was imported, or between
requests) is refused. Every malformed frame is a ``ProtocolError``, which fails that candidate alone.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from typing import Callable

import jsonschema
import numpy as np
import psutil

from ..sandbox import isolation, memcg, syscalls
from ..sandbox.isolation import ISOLATIONS
from ..sandbox.worker import BARE_SERVICE, HEADER_LIMIT, ProtocolError, decode_header, encode

DEFAULT_MEMORY_LIMIT_GB = 16.0  # address space of a worker; JAX on CPU needs about 2 GB to start
STARTUP_LIMIT_S = 120.0         # interpreter + JAX import, before the candidate's own code runs
PR_SET_CHILD_SUBREAPER, PR_SET_DUMPABLE = 36, 4

ALLOWED_VARIABLES = {"PATH", "LANG", "LANGUAGE", "TZ", "TERM", "LD_LIBRARY_PATH", "JAX_PLATFORMS",
                     "JAX_PLATFORM_NAME", "XLA_FLAGS", "TF_CPP_MIN_LOG_LEVEL", "OMP_NUM_THREADS",
                     "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "LIBTPU_INIT_ARGS"}
ALLOWED_PREFIXES = ("LC_", "OPENBLAS_", "MKL_", "TPU_")
DENIED = re.compile(r"^(HF_|HUGGING|KAGGLE|AWS_|GOOGLE_|GCP_|GCLOUD|AZURE_|GITHUB_|GH_)|TOKEN|KEY|SECRET|"
                    r"PASSW|CREDENTIAL|AUTH|COOKIE", re.IGNORECASE)

_BOOTSTRAP = ("import sys, json; sys.path[:0] = json.loads(sys.argv[1]); "
              "from tpu_kernel_records_tools.sandbox.worker import main; main(sys.argv[2:], service={service!r})")


# What a worker's reply header may hold (``arrays`` is checked by decode_header); bounded, no other keys.
_TEXT = {"type": "string", "maxLength": 20000}
REPLY_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "seq": {"type": "integer"}, "arrays": {"type": "array"}, "ok": {"type": "boolean"},
        "raised": {"type": "boolean"}, "error": _TEXT,
        "features": {"type": "array", "maxItems": 64, "items": {"type": "string", "maxLength": 100}},
        "inputs_modified": {"type": "array", "maxItems": 16, "items": {"type": "string", "maxLength": 100}},
        "op": {"const": "hello"}, "pid": {"type": "integer"}, "syscall_filter": {"type": "string", "maxLength": 100},
    },
}


class SandboxError(Exception):
    """A request got no well-formed answer."""


class Expired(SandboxError):
    """The deadline passed; the worker and its descendants have been killed."""


class WorkerGone(SandboxError):
    """The worker exited (or closed its pipe) before answering."""


def worker_environment(home: str, environ=None) -> dict[str, str]:
    """The worker's environment: allow-listed names from ``environ`` (default ``os.environ``), minus
    anything that looks like a credential, plus ``HOME``/``TMPDIR``/``XDG_*`` pointing at ``home``."""
    environ = os.environ if environ is None else environ
    env = {name: value for name, value in environ.items()
           if (name in ALLOWED_VARIABLES or name.startswith(ALLOWED_PREFIXES)) and not DENIED.search(name)}
    env.setdefault("PATH", os.defpath)
    for name in ("HOME", "TMPDIR", "TMP", "TEMP", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME"):
        env[name] = home
    return env


def harden_grader() -> bool:
    """Linux: make this process the reaper of its orphaned descendants (``PR_SET_CHILD_SUBREAPER``) and
    not dumpable (``PR_SET_DUMPABLE`` 0: a same-user, unprivileged process cannot read its
    ``/proc/PID/environ`` or memory; root still can). False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _own_children() -> dict[int, float]:
    out = {}
    for child in psutil.Process().children():
        try:
            out[child.pid] = child.create_time()
        except psutil.Error:
            pass
    return out


def exit_description(code: int | None) -> str:
    """``exited with status 0`` / ``was killed by SIGABRT`` for a ``Popen.returncode``."""
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


_REPLY_VALIDATOR = jsonschema.Draft202012Validator(REPLY_SCHEMA)
_LIVE: "set[Sandbox]" = set()  # held until closed: a dropped Sandbox's worker is still killed at exit


class Sandbox:
    """One candidate's worker process. ``start()`` launches it; ``request()`` sends one frame and waits
    for the answer; ``close()`` kills it and everything it started. Usable as a context manager."""

    def __init__(self, *, memory_limit_gb: float = DEFAULT_MEMORY_LIMIT_GB, isolation: str = "process",
                 candidate_file: str | None = None, candidate_root: str | None = None,
                 candidate_module: str | None = None, service: str = BARE_SERVICE):
        """``service``: ``"module:factory"``, what the worker imports (after its filter, before the candidate)
        to answer requests (``worker.Server``'s interface); the caller's, so this package knows no request."""
        if isolation not in ISOLATIONS:
            raise ValueError(f"isolation must be one of {ISOLATIONS}, got {isolation!r}")
        if not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", service):
            raise ValueError(f"service must be module:factory, got {service!r:.80}")
        self.memory_limit_gb, self.isolation, self.candidate_file = memory_limit_gb, isolation, candidate_file
        self.candidate_root, self.candidate_module, self.service = candidate_root, candidate_module, service
        self.cgroup: memcg.MemoryCgroup | None = None
        self.memory_limit = "none"  # what bounds the worker's memory: memcg.KINDS
        self.syscall_filter: str | None = None  # what filtered its system calls: syscalls.KINDS (said at hello)
        self._oom_kills = 0
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None  # set once the worker is seen dead
        self.closed = False
        self.grader_s = 0.0  # seconds of the grader's own work during the last request
        self._seq = 0  # the number of the last request sent
        self._dir = None

    # -- life cycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Launch the worker (returns at once; :meth:`wait_ready` waits for JAX to be imported)."""
        harden_grader()
        self._dir = tempfile.mkdtemp(prefix="rubric-worker-")
        home = os.path.join(self._dir, "home")
        os.mkdir(home, 0o700)
        to_worker_r, self._w = os.pipe()
        self._r, from_worker_w = os.pipe()
        if self.isolation == "bubblewrap":
            path = isolation.worker_path(self.candidate_root, self.candidate_module)
        else:
            path = [os.path.abspath(p) for p in [self.candidate_root] if p] + \
                [os.path.abspath(p or os.curdir) for p in sys.path]
        memory = int(self.memory_limit_gb * (1 << 30)) if self.memory_limit_gb and self.memory_limit_gb > 0 else 0
        address_space = memory
        if memory:
            try:
                self.cgroup = memcg.create(memory)
                self.memory_limit, address_space = "cgroup", 0  # the cgroup counts what the address space misses
            except memcg.CgroupUnavailable:
                self.memory_limit = "address-space"
        self._before = _own_children()
        _LIVE.add(self)
        log = open(os.path.join(self._dir, "worker.log"), "wb")
        command = [sys.executable, "-I", "-B", "-c", _BOOTSTRAP.format(service=self.service), json.dumps(path),
                   str(to_worker_r), str(from_worker_w), str(address_space)]
        argv, env, fds, cwd, close_after = command, worker_environment(home), (to_worker_r, from_worker_w), home, []
        try:
            if self.isolation == "bubblewrap":
                os.chmod(self._dir, 0o711)
                stage = os.path.join(self._dir, "stage")
                os.mkdir(stage)
                launch = isolation.build(command + [str(isolation.process_limit()), str(isolation.TMP_LIMIT_BYTES)],
                                         env, stage_dir=stage, keep_fds=fds, candidate_file=self.candidate_file,
                                         candidate_root=self.candidate_root, candidate_module=self.candidate_module)
                argv, env, fds, cwd, close_after = launch.argv, launch.env, launch.pass_fds, "/", launch.close_after
            if self.cgroup is not None:
                argv = self.cgroup.command(argv)
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=cwd, env=env, pass_fds=fds, start_new_session=True)
        finally:
            log.close()
            for fd in (to_worker_r, from_worker_w, *close_after):
                os.close(fd)
        os.set_blocking(self._w, False)

    def wait_ready(self, timeout_s: float = STARTUP_LIMIT_S) -> None:
        header, _ = self._receive(time.monotonic() + timeout_s, 0, seq=None)
        if header.get("op") != "hello":
            raise ProtocolError("the worker did not say hello")
        said = header.get("syscall_filter")
        self.syscall_filter = said if said in syscalls.KINDS else "none"  # why none: the command's warning

    def close(self) -> None:
        """Kill the worker and every process it started (also those that left its session); reap them."""
        if self.closed:
            return
        self.closed = True
        _LIVE.discard(self)
        for fd in (getattr(self, "_r", None), getattr(self, "_w", None)):
            try:
                if fd is not None:
                    os.close(fd)
            except OSError:
                pass
        if self.proc is not None:
            spare = {box.proc.pid for box in list(_LIVE) if box.proc is not None}  # other sandboxes' workers
            kill_descendants(self.proc, self._before, spare=spare)
        if self.cgroup is not None:
            self._oom_kills = self.cgroup.oom_kills()
            self.cgroup.remove()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "Sandbox":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return self.proc is not None and not self.closed and self.proc.poll() is None

    # -- one request ------------------------------------------------------------------------------

    def request(self, header: dict, arrays=(), *, timeout_s: float, reply_limit_bytes: int,
                while_waiting: Callable[[], None] | None = None) -> tuple[dict, list]:
        """Send ``header`` + ``arrays``; return the worker's reply (header, arrays). Raises
        :class:`Expired` (after killing everything) or :class:`WorkerGone` or ``ProtocolError``.

        ``while_waiting``: the grader's own work, run once the request is sent and before the reply is
        awaited; its duration is added to the deadline (the candidate is not charged for it) and kept in
        ``self.grader_s``."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        self.grader_s = 0.0
        if self.closed or self.proc is None:
            raise WorkerGone("the worker was already stopped")
        if self._pending():
            self.close()
            raise ProtocolError("the worker wrote a frame no request asked for")
        self._seq += 1
        self._send(encode(dict(header, seq=self._seq), arrays), deadline)
        if while_waiting is not None:
            begin = time.monotonic()
            try:
                while_waiting()
            except Exception:  # noqa: BLE001  (the reply must still be read; the work is redone, and fails, when needed)
                pass
            self.grader_s = time.monotonic() - begin
            deadline += self.grader_s
        return self._receive(deadline, reply_limit_bytes, seq=self._seq)

    def _pending(self) -> bool:
        """Whether the worker has written something the grader has not asked for (a dead worker's closed
        pipe is not that: the request finds it gone)."""
        poller = select.poll()
        poller.register(self._r, select.POLLIN)
        return any(event & select.POLLIN for _, event in poller.poll(0)) and self.proc.poll() is None

    def _expired(self):
        self.close()
        return Expired("deadline passed")

    def oom_killed(self) -> bool:
        """Whether the memory cgroup's OOM killer killed a process of this worker's."""
        if self.cgroup is None:
            return False
        return (self._oom_kills if self.closed else self.cgroup.oom_kills()) > 0

    def _gone(self):
        self.returncode = self.proc.poll()
        if self.returncode is None:  # it closed the pipe but still runs: stop it
            self.close()
            self.returncode = self.proc.returncode
        what = exit_description(self.returncode)
        if self.oom_killed():
            what = (f"was killed by its memory cgroup's OOM killer ({what}): it held more than its "
                    f"{self.memory_limit_gb:g} GiB limit in memory, memfds, tmpfs files and pipes together")
        return WorkerGone(what)

    def _send(self, chunks: list, deadline: float) -> None:
        poller = select.poll()
        poller.register(self._w, select.POLLOUT)
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            while view.nbytes:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._expired()
                if not poller.poll(min(remaining, 0.25) * 1000):
                    if self.proc.poll() is not None:
                        raise self._gone()
                    continue
                try:
                    view = view[os.write(self._w, view[:1 << 20]):]
                except BlockingIOError:
                    continue
                except (BrokenPipeError, OSError):
                    raise self._gone() from None

    def _read(self, n: int, deadline: float, poller) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._expired()
            if poller.poll(min(remaining, 0.25) * 1000):
                count = os.readv(self._r, [view[got:]])
                if count == 0:
                    raise self._gone()
                got += count
            elif self.proc.poll() is not None and not poller.poll(0):
                raise self._gone()  # exited; a descendant may still hold the pipe open
        return buf

    def _receive(self, deadline: float, limit: int, *, seq: int | None) -> tuple[dict, list]:
        """One reply frame, which must answer request ``seq`` (None: the hello, before any request)."""
        poller = select.poll()
        poller.register(self._r, select.POLLIN)
        (length,) = struct.unpack("<Q", self._read(8, deadline, poller))
        if length > HEADER_LIMIT:
            raise ProtocolError(f"a reply header of {length} bytes")
        header, specs = parse_reply(bytes(self._read(length, deadline, poller)), seq)
        total = sum(nbytes for _, _, nbytes in specs)
        if total > max(limit, HEADER_LIMIT):
            raise ProtocolError(f"a reply of {total} bytes of arrays (at most {limit} expected)")
        arrays = [np.frombuffer(self._read(nbytes, deadline, poller), dtype).reshape(shape)
                  for dtype, shape, nbytes in specs]
        return header, arrays


def parse_reply(head: bytes, seq: int | None) -> tuple[dict, list]:
    """A reply header from a worker, checked: JSON (``decode_header``), :data:`REPLY_SCHEMA`, and the
    answer to request ``seq`` (None: the hello). Raises ``ProtocolError`` and nothing else."""
    header, specs = decode_header(head)
    problem = next(iter(_REPLY_VALIDATOR.iter_errors(header)), None)
    if problem is not None:
        where = "/".join(map(str, problem.absolute_path)) or "the header"
        raise ProtocolError(f"a reply whose {where[:40]} is malformed ({problem.validator})")
    if header.get("seq") != seq:
        raise ProtocolError("a reply to a request never made (or a second reply to one)")
    return header, specs


def kill_descendants(proc: subprocess.Popen, before: dict[int, float], *, spare: set[int] = frozenset(),
                     rounds: int = 50) -> None:
    """SIGKILL ``proc``, its descendants, and this process's children not in ``before`` (pid ->
    create time) nor in ``spare`` (other open sandboxes' workers), with their descendants, until none
    is found; reap them."""
    me = os.getpid()
    for _ in range(rounds):
        found: dict[int, psutil.Process] = {}
        try:
            worker = psutil.Process(proc.pid)
            if proc.returncode is None:
                found[worker.pid] = worker
                found.update((c.pid, c) for c in worker.children(recursive=True))
        except psutil.Error:
            pass
        for child in psutil.Process().children():
            try:
                if before.get(child.pid) == child.create_time() or child.pid in spare:
                    continue
                found[child.pid] = child
                found.update((c.pid, c) for c in child.children(recursive=True))
            except psutil.Error:
                pass
        if not found:
            break
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the worker's session, where prctl is unavailable
        except OSError:
            pass
        for p in found.values():
            try:
                p.kill()
            except psutil.Error:
                pass
        if proc.returncode is None:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        ours = [p for p in found.values() if p.pid != proc.pid and _ppid(p) == me]
        psutil.wait_procs(ours, timeout=1)  # reaps our (re-parented) children
        others = [p for p in found.values() if p.pid != proc.pid and p not in ours]
        if others:
            psutil.wait_procs(others, timeout=0.2)


def _ppid(p: psutil.Process) -> int | None:
    try:
        return p.ppid()
    except psutil.Error:
        return None


@atexit.register
def close_all() -> None:
    """Close every sandbox still open in this process (killing its worker and descendants)."""
    for box in list(_LIVE):
        box.close()
