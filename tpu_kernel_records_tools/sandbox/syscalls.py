"""System calls a candidate's worker may not make, and a keyring of its own.

:func:`confine` runs in the worker before it imports JAX and long before the candidate loads. It

1. joins a fresh, empty, anonymous session keyring (``keyctl(KEYCTL_JOIN_SESSION_KEYRING, NULL)``): the
   kernel's keyrings are not namespaced, so without this the worker inherits the grader's session keyring
   (login tokens, Kerberos ``KEYRING:`` caches, keys kept with ``keyctl``) even inside bubblewrap;
2. installs a seccomp filter, built with libseccomp (the ``pyseccomp`` binding), that refuses with
   ``EPERM`` (``EAFNOSUPPORT`` for sockets, ``ENOSYS`` for ``clone3``) the calls a kernel has no business
   making, the way container runtimes' default profiles do: :data:`DENIED` (keyrings, tracing, BPF,
   perf events, userfaultfd, mounts, modules, kexec, namespaces, io_uring, ...), ``clone`` with any
   namespace flag, and ``socket``/``socketpair`` of any family but ``AF_UNIX``. The filter holds for the
   worker's threads and every process it starts, and cannot be removed. A call of another architecture's
   ABI (``int 0x80`` on x86-64) kills the process (libseccomp's default for a foreign architecture).

Where either step cannot be done (not Linux, no libseccomp), :func:`confine` says why in one line and the
worker goes on without it: the scorecard records what held (``syscall_filter``: :data:`KINDS`), as
``memory_limit`` records the memory bound.
"""

from __future__ import annotations

import ctypes
import errno
import socket
import sys

KINDS = ("seccomp", "none")  # what filtered a worker's system calls (a scorecard's syscall_filter)

DENIED = (
    "keyctl", "add_key", "request_key",
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "bpf", "perf_event_open", "userfaultfd", "fanotify_init", "lookup_dcookie",
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsmount", "fsconfig",
    "fspick", "mount_setattr", "name_to_handle_at", "open_by_handle_at",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "unshare", "setns",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "swapon", "swapoff", "reboot", "syslog", "acct", "quotactl", "quotactl_fd", "iopl", "ioperm",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "vhangup", "personality",
)
NAMESPACE_FLAGS = {"CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
                   "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
                   "CLONE_NEWNET": 0x40000000}  # (CLONE_NEWTIME exists for clone3 and unshare alone)
KEYCTL_JOIN_SESSION_KEYRING = 1


class Unavailable(Exception):
    """The filter or the fresh keyring cannot be had here; the message says why in one line."""


def _seccomp():
    if not sys.platform.startswith("linux"):
        raise Unavailable(f"seccomp is Linux's ({sys.platform} has none)")
    try:
        import pyseccomp
    except (ImportError, RuntimeError, OSError) as e:  # RuntimeError: the binding found no libseccomp
        raise Unavailable(f"libseccomp cannot be loaded ({type(e).__name__}: {e})") from None
    return pyseccomp


def build_filter():
    """The worker's filter (a ``pyseccomp.SyscallFilter``, not loaded): allow by default, refuse the rest.
    A name this kernel's architecture or libseccomp does not know is skipped (it cannot be called)."""
    sc = _seccomp()
    flt = sc.SyscallFilter(sc.ALLOW)
    refused = sc.ERRNO(errno.EPERM)
    for name in DENIED:
        try:
            flt.add_rule(refused, name)
        except (RuntimeError, ValueError, OSError):
            pass
    for flag in NAMESPACE_FLAGS.values():
        flt.add_rule(refused, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    try:  # clone3's flags lie behind a pointer a filter cannot read: C libraries fall back to clone
        flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    except (RuntimeError, ValueError, OSError):
        pass
    for name in ("socket", "socketpair"):
        flt.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), name, sc.Arg(0, sc.NE, socket.AF_UNIX))
    return flt


def join_fresh_keyring() -> None:
    """Make this process's session keyring a new, empty, anonymous one (its children inherit it)."""
    sc = _seccomp()
    try:
        number = sc.resolve_syscall(sc.system_arch(), "keyctl")
    except (RuntimeError, ValueError, OSError) as e:
        raise Unavailable(f"keyctl is unknown here ({e})") from None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    if libc.syscall(ctypes.c_long(number), ctypes.c_long(KEYCTL_JOIN_SESSION_KEYRING), ctypes.c_void_p(None)) < 0:
        code = ctypes.get_errno()
        raise Unavailable(f"cannot join a fresh session keyring: {errno.errorcode.get(code, code)}")


def confine() -> tuple[str, str | None]:
    """A fresh keyring, then the filter, in this process: ``("seccomp", None)`` when the filter holds, else
    ``("none", why)`` in one line (the worker runs on without it). A keyring that cannot be joined (an
    outer filter that already refuses ``keyctl``, as Docker's does) leaves nothing to reach once the
    filter refuses ``keyctl`` itself."""
    try:
        join_fresh_keyring()
    except Unavailable:
        pass
    try:
        build_filter().load()
    except Unavailable as e:
        return "none", str(e)
    except (RuntimeError, OSError) as e:
        return "none", f"the seccomp filter cannot be installed ({type(e).__name__}: {e})"
    return "seccomp", None


def warning(prog: str) -> str | None:
    """The one line a command prints where workers run without the filter; None where they have it."""
    try:
        build_filter()
    except Unavailable as e:
        return (f"{prog}: warning: candidate workers run without a system-call filter ({e}): keyrings, "
                f"ptrace, BPF and non-Unix sockets stay open to them (install libseccomp: Debian/Ubuntu "
                f"apt-get install libseccomp2)")
    return None
