"""A submitted kernel's programs are timed in a measuring process that a supervisor watches.

``measure --candidate`` runs the whole measurement in a child process (the device is opened there, never
in the supervisor) and waits for it. Before the child times a submitted program at a case it says so
on a status pipe (:func:`announce`); the supervisor kills it when that case runs past its budget, and
turns a child killed by a signal (an XLA crash, an abort in the runtime) into one refusal line that names
the case. Either way no run is written: the run folder is only ever written whole, at the end
(``records.rawio.write_run``), and a partial folder the child leaves is removed.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..sandbox.sandbox import exit_description

STATUS_FD = "TPU_KERNEL_RECORDS_STATUS_FD"  # the child's end of the status pipe, in its environment
DEFAULT_CASE_BUDGET_S = 600.0  # seconds a submitted program may take at one case: compile, warm-ups, samples


class Refused(Exception):
    """The measuring process was stopped or died while timing a submitted program; one line."""


def announce(case_id: str, budget_s: float) -> None:
    """Tell the supervisor (if any) that the submitted program's timing at ``case_id`` starts now and may
    take ``budget_s`` seconds; ``""`` when it is over."""
    fd = os.environ.get(STATUS_FD)
    if fd:
        os.write(int(fd), f"{budget_s:.3f} {case_id}\n".encode())


def supervised(argv: list[str], *, leftovers: list[Path], poll_s: float = 0.5,
               command: list[str] | None = None) -> int:
    """Run ``command`` (default ``python -m tpu_kernel_records_tools.cli.main``) with ``argv`` as the
    measuring child and return its exit status; raises :class:`Refused` when a case ran past its budget (the child and its
    process group killed) or the child died of a signal while timing one. ``leftovers``: folders whose
    ``*.partial`` entries made after the start are removed when the child did not finish."""
    read_fd, write_fd = os.pipe()
    started = time.time()
    env = {**os.environ, STATUS_FD: str(write_fd)}
    command = command or [sys.executable, "-m", "tpu_kernel_records_tools.cli.main"]
    child = subprocess.Popen([*command, *argv], env=env,
                             pass_fds=(write_fd,), start_new_session=True)
    os.close(write_fd)
    case, deadline, buffer = "", None, b""
    try:
        while child.poll() is None:
            ready, _, _ = select.select([read_fd], [], [], poll_s)
            if ready:
                chunk = os.read(read_fd, 4096)
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    budget, _, case = line.decode(errors="replace").partition(" ")
                    deadline = time.monotonic() + float(budget) if case else None
            if deadline is not None and time.monotonic() > deadline:
                _kill(child)
                raise Refused(f"the submitted program at case {case} ran past its budget of {budget}s; the "
                              f"measuring process was killed and no run was written")
        if child.returncode < 0 and case:
            raise Refused(f"the measuring process {exit_description(child.returncode)} while timing the "
                          f"submitted program at case {case}; no run was written")
        return child.returncode
    except BaseException:
        _kill(child)
        _remove_partials(leftovers, started)
        raise
    finally:
        os.close(read_fd)


def _kill(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except OSError:
        pass
    child.wait()


def _remove_partials(folders: list[Path], since: float) -> None:
    import shutil

    for folder in folders:
        for path in Path(folder).glob(".*.partial") if Path(folder).is_dir() else ():
            if path.stat().st_mtime >= since - 1:
                shutil.rmtree(path, ignore_errors=True)
