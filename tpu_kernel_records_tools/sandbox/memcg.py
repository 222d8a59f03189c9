"""A memory cgroup per candidate worker, so that all the memory a candidate holds counts against its limit.

An address-space limit (``RLIMIT_AS``) counts mappings only: memfds that are written and never mapped,
files in a tmpfs (``/tmp``, ``/dev/shm``), pipe buffers and page cache escape it, and a candidate can
fill the machine until the kernel's OOM killer takes whichever process it likes — the grader, or another
grade. A memory cgroup charges all of those to the processes inside it; past its limit the cgroup's own
OOM killer kills a process of the cgroup and nothing else.

:func:`create` makes one child cgroup of this process's own, with ``memory.max`` (cgroup v2; swap 0, the
whole group killed on OOM) or ``memory.limit_in_bytes`` (cgroup v1's memory controller; swap included
where accounted) set to the limit in bytes. Socket buffers count too: cgroup v2 and v1 charge Unix
sockets' to the limit; v1 keeps TCP buffers apart, bounded by ``memory.kmem.tcp.limit_in_bytes`` at
:data:`TCP_LIMIT_BYTES` (or the limit, when lower). It needs a cgroup this process may create children in: root,
or a cgroup v2 folder this user may write whose memory controller is enabled for its children (this
process's cgroup or the one around it: a desktop session's app scope, a ``systemd-run --user --scope``
shell, a container with a private cgroup). A worker joins it before it
starts (:data:`JOIN`, run as the first program of the worker's command), so all its descendants are
charged too. Where none can be had, :func:`unavailable_reason` says why in one line and the worker keeps
the address-space limit alone; each scorecard records which (``memory_limit``: :data:`KINDS`).
"""

from __future__ import annotations

import errno
import functools
import itertools
import os
import sys
import time

TCP_LIMIT_BYTES = 64 << 20  # cgroup v1: a worker's TCP buffers (it has no use for TCP; its filter refuses the sockets)
KINDS = ("cgroup", "address-space", "none")  # what bounded a worker's memory (a scorecard's memory_limit)
PREFIX = "tpu-kernel-records-worker-"

# The worker's first program: join the cgroup (argv[1]: its cgroup.procs), then exec the real command.
JOIN = ("import os, sys\n"
        "try:\n"
        "    with open(sys.argv[1], 'w') as f: f.write(str(os.getpid()))\n"
        "except OSError as e:\n"
        "    sys.stderr.write(f'cannot join the memory cgroup {sys.argv[1]}: {e}\\n'); os._exit(126)\n"
        "os.execv(sys.argv[2], sys.argv[2:])\n")

_COUNTER = itertools.count()


class CgroupUnavailable(Exception):
    """No memory cgroup can be made here; the message says why in one line."""


def _mounts() -> list[tuple[str, str, str, str]]:
    """(root inside the hierarchy, mount point, file system type, super options) of each mount."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            dash = fields.index("-")
            out.append((fields[3], fields[4], fields[dash + 1], fields[dash + 3] if len(fields) > dash + 3 else ""))
    return out


def own_cgroups() -> dict[str, str]:
    """This process's cgroup per hierarchy: ``{"": path}`` for v2, ``{"memory": path, ...}`` for v1."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for name in controllers.split(",") if controllers else [""]:
                out[name] = path
    return out


def _under(mount_root: str, mount_point: str, path: str) -> str | None:
    """The directory of cgroup ``path`` under a hierarchy mounted at ``mount_point`` from ``mount_root``."""
    root = mount_root.rstrip("/")
    if root and not (path == root or path.startswith(root + "/")):
        return None
    return os.path.join(mount_point, path[len(root):].lstrip("/"))


def parents() -> list[tuple[int, str]]:
    """Where a child memory cgroup may be made, in the order tried: ``(version, folder)``. cgroup v2 first:
    this process's own cgroup, then its parent (a v2 cgroup that holds processes cannot enable the memory
    controller for its children, but the slice around it usually has: a desktop session's app scopes, a
    ``systemd-run --user --scope`` shell); then cgroup v1's memory hierarchy, this process's own."""
    own, found = own_cgroups(), []
    for root, point, fstype, options in _mounts():
        if fstype == "cgroup2" and "" in own:
            folder = _under(root, point, own[""])
            if folder and os.path.isfile(os.path.join(folder, "cgroup.procs")):
                found += [(2, folder)] + ([(2, os.path.dirname(folder.rstrip("/")))]
                                          if os.path.normpath(folder) != os.path.normpath(point) else [])
        elif fstype == "cgroup" and "memory" in options.split(",") and "memory" in own:
            folder = _under(root, point, own["memory"])
            if folder and os.path.isfile(os.path.join(folder, "memory.limit_in_bytes")):
                found.append((1, folder))
    return sorted(dict.fromkeys(found), key=lambda place: -place[0])


class MemoryCgroup:
    """One worker's memory cgroup (a folder of a cgroup file system)."""

    def __init__(self, version: int, path: str, limit_bytes: int):
        self.version, self.path, self.limit_bytes = version, path, limit_bytes

    @property
    def procs(self) -> str:
        return os.path.join(self.path, "cgroup.procs")

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` started inside this cgroup (``argv[0]`` an absolute path)."""
        return [os.path.realpath(sys.executable), "-I", "-S", "-c", JOIN, self.procs, *argv]

    def _counters(self) -> dict[str, int]:
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            with open(os.path.join(self.path, name)) as f:
                pairs = (line.split() for line in f)
                return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[1].isdigit()}
        except OSError:
            return {}

    def oom_kills(self) -> int:
        """How many processes the cgroup's OOM killer has killed (0 where the kernel does not say)."""
        return self._counters().get("oom_kill", 0)

    def remove(self, wait_s: float = 5.0) -> bool:
        """Remove the (emptied) cgroup; False if its processes had not all gone within ``wait_s``."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                os.rmdir(self.path)
                return True
            except FileNotFoundError:
                return True
            except OSError as e:
                if e.errno != errno.EBUSY or time.monotonic() > deadline:
                    return False
                time.sleep(0.05)


def _write(folder: str, name: str, value: str, *, required: bool) -> None:
    try:
        with open(os.path.join(folder, name), "w") as f:
            f.write(value)
    except OSError:
        if required:
            raise


def create(limit_bytes: int) -> MemoryCgroup:
    """A new memory cgroup limited to ``limit_bytes`` (> 0); raises :class:`CgroupUnavailable`."""
    if not sys.platform.startswith("linux"):
        raise CgroupUnavailable("memory cgroups are Linux only")
    why = []
    for version, parent in parents():
        path = os.path.join(parent, f"{PREFIX}{os.getpid()}-{next(_COUNTER)}")
        try:
            os.mkdir(path)
        except OSError as e:
            why.append(f"cannot create a cgroup under {parent} ({e.strerror})")
            continue
        try:
            if version == 2:
                if not os.path.isfile(os.path.join(path, "memory.max")):
                    raise CgroupUnavailable(f"{parent} does not enable the memory controller for its children")
                _write(path, "memory.max", str(limit_bytes), required=True)
                _write(path, "memory.swap.max", "0", required=False)
                _write(path, "memory.oom.group", "1", required=False)
            else:
                _write(path, "memory.limit_in_bytes", str(limit_bytes), required=True)
                _write(path, "memory.memsw.limit_in_bytes", str(limit_bytes), required=False)
                # v1 charges TCP buffers to a counter of their own, off until a limit is set (v2 counts them)
                _write(path, "memory.kmem.tcp.limit_in_bytes", str(min(limit_bytes, TCP_LIMIT_BYTES)),
                       required=os.path.exists(os.path.join(path, "memory.kmem.tcp.limit_in_bytes")))
            if not os.access(os.path.join(path, "cgroup.procs"), os.W_OK):
                raise CgroupUnavailable(f"{path}/cgroup.procs is not writable")
            return MemoryCgroup(version, path, limit_bytes)
        except (OSError, CgroupUnavailable) as e:
            why.append(str(e) if isinstance(e, CgroupUnavailable) else f"cannot limit {path} ({e.strerror})")
            try:
                os.rmdir(path)
            except OSError:
                pass
    raise CgroupUnavailable("; ".join(why) or "no cgroup v2 or cgroup v1 memory hierarchy holds this process")


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """None when a memory cgroup can be made here (tried once per process), else why not, in one line."""
    try:
        create(1 << 30).remove()
        return None
    except (CgroupUnavailable, OSError) as e:
        return str(e)


def warning(prog: str) -> str | None:
    """The one line a command prints where workers run without a memory cgroup; None where they have one."""
    reason = unavailable_reason()
    if reason is None:
        return None
    return (f"{prog}: warning: no memory cgroup for candidate workers ({reason}); --memory-limit bounds their "
            f"address space only, so memory held in memfds, tmpfs files or pipes is not counted "
            f"(run as root, or under systemd-run --user --scope)")
