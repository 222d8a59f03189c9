"""Where a candidate's worker runs: inside bubblewrap (``bwrap``) or as a plain child process.

``"bubblewrap"``: the worker runs in new user, PID, network, IPC, UTS (and cgroup) namespaces, as an
unprivileged uid, with no capabilities, ``--new-session``, ``--die-with-parent``, further user
namespaces disabled, and a file system that is read-only everywhere except a private tmpfs ``/tmp``
of :data:`TMP_LIMIT_BYTES` (its working directory and home) and a ``/dev/shm`` of
:data:`SHM_LIMIT_BYTES`. Only what the worker imports is bound in, read-only: ``/usr`` (and the
``/lib*``, ``/bin`` links), the interpreter's folders with its standard library and site-packages
(:func:`interpreter_sources`), this project's package folders ``tpu_kernel_records_tools/`` and
``kernel_src/`` (not the checkout around them), with any ``.git`` inside a bound folder hidden; of the
candidate, its file alone (copied in at ``/candidate/NAME.py``), or the folder the user named for a kernel
of several files (``--candidate-dir``, at ``/candidate``), or a module candidate's top-level package.
Never the grader's working directory, the home folder, the candidate's neighbours or the checkout's
other files (``.env``, ``runs/``, ``data/``). Unless ``JAX_PLATFORMS=cpu``, an accelerator's device
nodes (``/dev/accel*``, ``/dev/vfio``, ``/dev/nvidia*``; then ``/sys`` read-only too). ``/dev`` is bwrap's minimal one
(null, zero, random, urandom, tty); of ``/sys``, the CPU topology. The network namespace's loopback reaches nothing outside.
bwrap itself gets the worker's allow-listed environment (it is PID 1 of the sandbox, its
``/proc/1/environ`` readable there), and ``--clearenv`` plus ``--setenv`` give the worker the same.

The sandbox's uid is never the host's root: a root grader starts bwrap through :data:`_STAGER`, a
small root helper that, in a private mount namespace, binds each source under a 0755 staging folder
(so paths below 0700 folders such as ``/root`` are reachable), drops to :data:`SANDBOX_UID` and
execs bwrap unprivileged. Inside, the worker's processes are the host's ``SANDBOX_UID`` in a user
namespace of their own, so the kernel counts ``RLIMIT_NPROC`` (set by the worker) over the sandbox
alone; a root-mapped sandbox would be exempt from it.

``"process"``: the worker is an ordinary child of the grader (``sandbox.sandbox``'s own limits only).
"""

from __future__ import annotations

import functools
import glob
import json
import os
import shutil
import subprocess
import sys

from ..sandbox import candidate_files
from ..sandbox.errors import CandidateLoadError

SANDBOX_UID = 65534            # the host uid a root grader's sandbox runs as ("nobody")
TMP_LIMIT_BYTES = 512 << 20    # the worker's /tmp (its home and working directory)
SHM_LIMIT_BYTES = 64 << 20     # /dev/shm
ISOLATIONS = ("bubblewrap", "process")
CHOICES = ("auto", *ISOLATIONS)
INSTALL_HINT = ("install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap) "
                "on a kernel that allows user namespaces, or grade without it with --isolation process")
CANDIDATE_DIR = "/candidate"  # a file candidate's folder and file, inside the sandbox
ACCELERATOR_NODES = ("/dev/accel*", "/dev/vfio", "/dev/nvidia*")


class IsolationUnavailable(Exception):
    """Bubblewrap was asked for (or is required for a stranger's code) and cannot run here."""


def process_limit() -> int:
    """``RLIMIT_NPROC`` of a sandboxed worker: its threads and processes together (JAX starts a
    thread pool per core)."""
    return 256 + 8 * (os.cpu_count() or 1)


# The root helper: private mount namespace, staged read-only sources, drop to SANDBOX_UID, exec bwrap.
_STAGER = r"""
import ctypes, json, os, sys
plan = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
def check(ok, what):
    if not ok:
        e = ctypes.get_errno(); sys.stderr.write(f"sandbox stager: {what}: {os.strerror(e)}\n"); os._exit(126)
check(libc.unshare(0x00020000) == 0, "unshare(CLONE_NEWNS)")
check(libc.mount(None, b"/", None, 0x4000 | 0x40000, None) == 0, "mount --make-rprivate /")
for source, target in plan["stage"]:
    check(libc.mount(source.encode(), target.encode(), None, 0x1000 | 0x4000, None) == 0, f"bind {source}")
os.setgroups([]); os.setgid(plan["uid"]); os.setuid(plan["uid"])
os.execv(plan["argv"][0], plan["argv"])
"""


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


def accelerator_nodes(environ) -> list[str]:
    """Device nodes of an accelerator the worker may need (none when JAX is told to use the CPU)."""
    if environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return []
    return sorted({p for pattern in ACCELERATOR_NODES for p in glob.glob(pattern)})


def _contains(folder: str, path: str) -> bool:
    folder = folder.rstrip("/") or "/"
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _keep_out() -> list[str]:
    """What no bound folder may hold: the working directory and the home folder (tokens, notes, checkouts)."""
    try:
        cwd = os.getcwd()
    except FileNotFoundError:  # a working directory deleted under the grader holds nothing
        cwd = ""
    return [os.path.realpath(p) for p in (cwd, os.path.expanduser("~")) if p]


def interpreter_sources() -> list[str]:
    """Folders of the interpreter: its prefixes (a virtual environment's and the base installation's, with
    their standard library and site-packages) and its real executable's folder. A prefix holding the
    working directory or the home folder is replaced by its ``bin`` and ``lib*`` folders."""
    import sysconfig

    wanted = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
              os.path.dirname(os.path.realpath(sys.executable)),
              *(path for name, path in sysconfig.get_paths().items() if name.endswith(("lib", "stdlib")))}
    keep_out, out = _keep_out(), []
    for folder in sorted({os.path.realpath(p) for p in wanted}):
        parts = [folder]
        if any(_contains(folder, secret) for secret in keep_out):
            parts = [os.path.join(folder, name) for name in ("bin", "lib", "lib64")]
        out += [p for p in parts if os.path.isdir(p) and not any(_contains(p, s) for s in keep_out)]
    return out


def project_packages() -> list[str]:
    """The folders of this project's packages that a worker imports (not the checkout around them)."""
    import importlib.util

    out = []
    for name in ("tpu_kernel_records_tools", "kernel_src"):
        spec = importlib.util.find_spec(name)
        out += [os.path.realpath(p) for p in (spec.submodule_search_locations or [])] if spec else []
    return out


def module_sources(module: str) -> list[str]:
    """Where the top-level package (or single-file module) of a ``module:function`` candidate lies, found
    without running it; [] for one that is not found or lies in the interpreter's or project's folders."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(module.split(".")[0])
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    places = list(spec.submodule_search_locations or []) or ([spec.origin] if spec.origin else [])
    bound = interpreter_sources() + project_packages()
    return [p for p in map(os.path.realpath, places)
            if os.path.exists(p) and not any(_contains(b, p) for b in bound)]


def _bound_sources(extra=()) -> list[str]:
    """Existing folders the worker reads: the interpreter's, the project's packages, ``extra``; nested
    ones dropped (their parent is bound). Never ``/``, ``/usr`` (bound apart) or ``/proc``, ``/sys``,
    ``/dev``."""
    dirs = []
    for p in [*interpreter_sources(), *project_packages(), *extra]:
        p = os.path.realpath(p)
        if os.path.isdir(p) and p not in ("/", "/usr") and not p.startswith(("/usr/", "/proc", "/sys", "/dev")):
            dirs.append(p)
    dirs = sorted(set(dirs))
    return [d for d in dirs if not any(d != o and _contains(o, d) for o in dirs)]


def worker_path(candidate_root: str | None = None, module: str | None = None) -> list[str]:
    """The folders put first on a sandboxed worker's ``sys.path``: the candidate's root (seen at
    :data:`CANDIDATE_DIR`), its module's parent folder, the project packages' parents."""
    out = [CANDIDATE_DIR] if candidate_root else []
    out += [os.path.dirname(p) for p in (module_sources(module) if module and not candidate_root else [])]
    out += [os.path.dirname(p) for p in project_packages()]
    return list(dict.fromkeys(out))


def inside_path(candidate_file: str, candidate_root: str | None = None) -> str:
    """Where a candidate's file is seen inside the sandbox (its host path may lie under /tmp): under
    :data:`CANDIDATE_DIR`, by its path inside ``candidate_root`` when one is bound, else by its name."""
    if candidate_root:
        relative = os.path.relpath(os.path.realpath(candidate_file), os.path.realpath(candidate_root))
        return f"{CANDIDATE_DIR}/{relative}"
    return f"{CANDIDATE_DIR}/{os.path.basename(candidate_file)}"


class Launch:
    """How to start one sandboxed command: ``argv``, the ``env`` for Popen, ``pass_fds`` (and fds to
    close once it started)."""

    def __init__(self, argv: list[str], env: dict, pass_fds: tuple, close_after: list[int]):
        self.argv, self.env, self.pass_fds, self.close_after = argv, env, pass_fds, close_after


def _readable(folder: str, stage_dir: str) -> str:
    """A copy of a candidate's own folder that the sandbox's uid may read (a root grader's files are often
    its own alone): links kept as links, ``.git`` left out. Also pins what the candidate runs."""
    copy = os.path.join(stage_dir, f"copy-{len(os.listdir(stage_dir))}")
    shutil.copytree(folder, copy, symlinks=True, ignore=shutil.ignore_patterns(".git"))
    for top, dirs, files in os.walk(copy):
        os.chmod(top, 0o755)
        for name in files:
            if not os.path.islink(os.path.join(top, name)):
                os.chmod(os.path.join(top, name), 0o644)
    return copy


def build(command: list[str], env: dict, *, stage_dir: str, keep_fds=(), candidate_file: str | None = None,
          candidate_root: str | None = None, candidate_module: str | None = None) -> Launch:
    """The launch of ``command`` inside bubblewrap with ``env`` (already allow-listed; HOME etc. are
    replaced by /tmp), keeping ``keep_fds`` open. Of the candidate, only what names its code is bound:
    ``candidate_root`` (a folder the user named) at :data:`CANDIDATE_DIR`; else ``candidate_file`` alone,
    copied in at :func:`inside_path`, and a ``candidate_module``'s top-level package (or file) at its own
    path. ``stage_dir``: an empty folder of this sandbox (a root grader stages its sources there)."""
    bwrap = bwrap_path()
    if bwrap is None:
        raise IsolationUnavailable(f"bubblewrap (bwrap) is not installed: {INSTALL_HINT}")
    inner_env = dict(env)
    for name in ("HOME", "TMPDIR", "TMP", "TEMP", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME"):
        inner_env[name] = "/tmp"
    inner_env["PYTHONDONTWRITEBYTECODE"] = "1"
    root = os.geteuid() == 0
    module_places = module_sources(candidate_module) if candidate_module and not candidate_root else []
    for folder in [candidate_root] if candidate_root else [p for p in module_places if os.path.isdir(p)]:
        try:  # before anything is copied: no link out of it, bounded in size
            candidate_files.check_folder(folder, what="candidate folder" if candidate_root else "candidate package")
        except candidate_files.LinkRefused as e:
            raise CandidateLoadError(str(e)) from None
    sources = _bound_sources([p for p in module_places if os.path.isdir(p)])
    copies = {p: _readable(p, stage_dir) for p in module_places if root and os.path.isdir(p)}
    stage = []
    argv = [bwrap, "--unshare-user", "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
            "--unshare-cgroup-try", "--disable-userns", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
            "--die-with-parent", "--new-session", "--hostname", "sandbox",
            "--ro-bind", "/usr", "/usr"]
    for name in ("lib", "lib32", "lib64", "libx32", "bin", "sbin"):
        path = f"/{name}"
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    for path in ("/etc/ld.so.cache", "/etc/localtime", "/etc/passwd", "/etc/group", "/etc/nsswitch.conf"):
        if os.path.exists(path):
            argv += ["--ro-bind", path, path]
    # The private /tmp before the sources: bwrap mounts in order, so a source under /tmp (a CI job's
    # virtualenv, a clone in a temporary folder) is bound on top of it instead of hidden by it.
    argv += ["--size", str(TMP_LIMIT_BYTES), "--tmpfs", "/tmp"]

    def bind(source: str, target: str) -> None:
        seen = source
        if root:
            seen = os.path.join(stage_dir, str(len(stage)))
            os.mkdir(seen, 0o755)
            stage.append((source, seen))
        nonlocal argv
        argv += ["--ro-bind", seen, target]
        git = os.path.join(source, ".git")
        if os.path.isdir(git):
            argv += ["--tmpfs", os.path.join(target, ".git"), "--remount-ro", os.path.join(target, ".git")]
        elif os.path.lexists(git):
            argv += ["--ro-bind", "/dev/null", os.path.join(target, ".git")]

    for source in sources:
        bind(copies.get(source, source), source)
    fds, close_after = list(keep_fds), []

    def copy_in(path: str, target: str) -> None:
        try:
            fd = candidate_files.open_file(path)
        except candidate_files.LinkRefused as e:
            raise CandidateLoadError(str(e)) from None
        fds.append(fd)
        close_after.append(fd)
        argv.extend(["--ro-bind-data", str(fd), target])

    if candidate_root:
        bind(_readable(os.path.realpath(candidate_root), stage_dir) if root else candidate_root, CANDIDATE_DIR)
    elif candidate_file:
        copy_in(candidate_file, inside_path(candidate_file))
    for place in module_places:
        if os.path.isfile(place):
            copy_in(place, place)
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(SHM_LIMIT_BYTES), "--tmpfs", "/dev/shm"]
    nodes = accelerator_nodes(env)
    for node in nodes:
        argv += ["--dev-bind", node, node]
    if nodes:
        argv += ["--ro-bind", "/sys", "/sys"]
    else:  # the CPU topology only (tcmalloc and XLA size their pools by it)
        argv += [a for path in ("/sys/devices/system/cpu", "/sys/devices/system/node") if os.path.isdir(path)
                 for a in ("--ro-bind", path, path)]
    argv += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp", "--clearenv"]
    for name, value in sorted(inner_env.items()):
        argv += ["--setenv", name, value]
    argv += ["--", *command]
    if root:  # bwrap runs unprivileged as SANDBOX_UID; the stager makes the sources reachable for it
        os.chmod(stage_dir, 0o755)
        plan = {"stage": stage, "uid": SANDBOX_UID, "argv": argv}
        argv = [sys.executable, "-I", "-S", "-c", _STAGER, json.dumps(plan)]
    return Launch(argv, dict(env), tuple(fds), close_after)


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """None when a bubblewrap sandbox starts here (tried once per process), else why not, in one line."""
    import tempfile

    if bwrap_path() is None:
        return f"bubblewrap (bwrap) is not installed: {INSTALL_HINT}"
    folder = tempfile.mkdtemp(prefix="rubric-probe-")
    try:
        launch = build([os.path.realpath(sys.executable), "-I", "-S", "-c", "print('ok')"],
                       {"PATH": os.defpath}, stage_dir=folder)
        try:
            done = subprocess.run(launch.argv, env=launch.env, capture_output=True, text=True, timeout=60,
                                  pass_fds=launch.pass_fds)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"bubblewrap cannot start a sandbox here ({type(e).__name__}: {e}): {INSTALL_HINT}"
        if done.returncode != 0 or done.stdout.strip() != "ok":
            why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            return f"bubblewrap cannot start a sandbox here ({why}): {INSTALL_HINT}"
        return None
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def choose(requested: str, builtin: bool) -> str:
    """The isolation a candidate is graded under. ``"auto"``: bubblewrap for a stranger's code (a file,
    module or programmatic candidate), ``"process"`` for a built-in (``builtin``: the project's own code);
    ``"bubblewrap"``/``"process"`` as asked. Raises :class:`IsolationUnavailable` when bubblewrap is needed
    and cannot run."""
    if requested not in CHOICES:
        raise ValueError(f"isolation must be one of {CHOICES}, got {requested!r}")
    if requested == "process":
        return "process"
    if requested == "auto" and builtin:
        return "process"
    reason = unavailable_reason()
    if reason is not None:
        raise IsolationUnavailable(reason)
    return "bubblewrap"
