"""How every command ends: with its documented exit status, and nothing running behind it.

The grader computes ahead on background threads that sit inside XLA (``grading.dense.problems``), and
candidate workers may still be alive. Left to the interpreter's own shutdown, a thread still in XLA
when Python finalizes is unwound through C++ frames that do not allow it (``terminate called after
throwing an instance of ''``: SIGABRT, exit status 134 and a crash dump instead of the status the
command returned). :func:`exit_with` therefore kills every candidate worker, flushes the standard
streams and leaves with ``os._exit`` (which stops every thread where it stands), on success, failure
and Ctrl-C alike.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Callable, NoReturn, Sequence

EXIT_INTERRUPTED = 130  # the shell's status for a command ended by SIGINT


def shut_down() -> None:
    """Kill every candidate worker this process started (``os._exit`` runs no ``atexit`` handler)."""
    if "tpu_kernel_records_tools.sandbox.sandbox" in sys.modules:
        sys.modules["tpu_kernel_records_tools.sandbox.sandbox"].close_all()


def exit_with(main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None,
              prog: str = "tpu-kernel-records") -> NoReturn:
    """Run ``main(argv)`` and end the process with its status: 130 after Ctrl-C (one line on stderr),
    1 after an unexpected exception (its traceback), ``SystemExit``'s code as given."""
    try:
        code = main(argv)
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted", file=sys.stderr)
        code = EXIT_INTERRUPTED
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001  reported as the interpreter would, then the same cleanup
        traceback.print_exc()
        code = 1
    try:
        shut_down()
    except BaseException:  # noqa: BLE001  a second Ctrl-C during cleanup: still leave with the status
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(int(code or 0) & 0xFF)
