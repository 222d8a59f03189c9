"""Candidates that try to leave the bubblewrap sandbox (tests/test_bubblewrap.py). Each raises a
RuntimeError whose message says what it saw or managed (names and booleans, never a value), so the
scorecard shows it."""

import os
import signal
import time

MARKER = b"hf_fakefakefake"


def reads_ancestors(q, k, v, **kwargs):
    """Every environ, cmdline and memory it can open under /proc: the grader's token, its --json path."""
    seen, pids = [], sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    for pid in pids:
        for name in ("environ", "cmdline"):
            try:
                with open(f"/proc/{pid}/{name}", "rb") as f:
                    text = f.read()
            except OSError:
                continue
            if MARKER in text or b"--json" in text:
                seen.append(f"{pid}/{name}")
        try:
            with open(f"/proc/{pid}/mem", "rb") as f:
                f.read(1)
            seen.append(f"{pid}/mem")
        except (OSError, ValueError):
            pass
    raise RuntimeError(f"pids visible {pids}; secrets seen in {seen or 'nothing'}; ppid {os.getppid()}")


def signals_everyone(q, k, v, **kwargs):
    """SIGKILL to its parent and to every pid up to 65536 but itself (the grader, the test, their children)."""
    me, hit = os.getpid(), 0
    for pid in range(2, 1 << 16):
        if pid != me:
            try:
                os.kill(pid, signal.SIGKILL)
                hit += 1
            except OSError:
                pass
    try:
        os.kill(os.getppid(), signal.SIGKILL)
    except OSError:
        pass
    raise RuntimeError(f"signalled {hit} processes")


def writes_everywhere(q, k, v, **kwargs):
    """Files in the project, site-packages and their __pycache__ folders, /tmp, /var/tmp, the home."""
    import numpy

    import tpu_kernel_records_tools.sandbox as sandbox

    targets = [os.path.join(os.path.dirname(sandbox.__file__), "__pycache__", "worker.cpython-311.pyc"),
               os.path.join(os.path.dirname(sandbox.__file__), "escaped.txt"),
               os.path.join(os.path.dirname(numpy.__file__), "__pycache__", "escaped.pyc"),
               os.path.join(os.path.dirname(os.path.dirname(numpy.__file__)), "escaped.pth"),
               "/tmp/escaped-by-candidate", "/var/tmp/escaped-by-candidate", "/dev/shm/escaped-by-candidate",
               os.path.expanduser("~/escaped-by-candidate"), "/root/escaped-by-candidate", "/escaped-by-candidate",
               "/usr/escaped-by-candidate", "/etc/escaped-by-candidate"]
    written, refused = [], []
    for path in targets:
        try:
            with open(path, "wb") as f:
                f.write(b"written by a candidate")
            written.append(path)
        except OSError:
            refused.append(path)
    raise RuntimeError(f"written {written}; refused {len(refused)}")


def fork_bomb(q, k, v, **kwargs):
    """Processes that each fork until the kernel refuses, then sleep."""
    me, made = os.getpid(), 0
    while True:
        try:
            if os.fork() == 0:
                continue
            made += 1
        except OSError as e:
            if os.getpid() != me:
                time.sleep(600)
                os._exit(0)
            raise RuntimeError(f"fork refused after {made} children of the worker: {type(e).__name__}") from None


def fills_tmp(q, k, v, **kwargs):
    """Writes 4 GiB into /tmp, then into /dev/shm."""
    block, got = b"\0" * (1 << 20), {}
    for folder in ("/tmp", "/dev/shm"):
        got[folder] = 0
        try:
            with open(os.path.join(folder, "fill"), "wb") as f:
                for _ in range(4096):
                    f.write(block)
                    got[folder] += 1
        except OSError as e:
            got[folder] = f"{got[folder]} MiB then {type(e).__name__}"
    raise RuntimeError(f"filled {got}")


def raises_limits(q, k, v, **kwargs):
    """Reads its resource limits, then tries to raise each back to unlimited."""
    import resource

    names = ("RLIMIT_AS", "RLIMIT_NPROC", "RLIMIT_CORE", "RLIMIT_FSIZE")
    before = {n: resource.getrlimit(getattr(resource, n)) for n in names}
    raised = []
    for n in names:
        try:
            resource.setrlimit(getattr(resource, n), (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            raised.append(n)
        except (ValueError, OSError):
            pass
    secret = sorted(n for n in os.environ if "TOKEN" in n or n.startswith("HF_"))
    raise RuntimeError(f"raised {raised or 'none'}; uid {os.getuid()}; secret names {secret or 'none'}; "
                       f"HOME {os.environ.get('HOME')}; limits {before}")
