"""Files a candidate must not change: the grader's own packages and the libraries its workers import.

A worker runs as the grader's user, so a hostile candidate can rewrite files on disk: the grader's
sources (``sandbox/worker.py`` is imported afresh by every later candidate's worker) or JAX and NumPy
themselves, turning the grade of every later candidate, and of later runs, into whatever it wants.
Nothing short of another user or a read-only file system prevents that; this module detects it.
``snapshot()`` records size and modification time of every file under the watched package
directories (about 3,000 files, a few tens of milliseconds); ``changes(before, after)`` lists what was
written, added or removed. The rubric takes a snapshot before each candidate and compares after its
worker and every process it started are dead (``grading.rubric``).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

# The packages the grader and its workers import: an edit to any of them changes what later grades compute.
WATCHED_PACKAGES = ("tpu_kernel_records_tools", "kernel_src", "jax", "jaxlib", "numpy", "ml_dtypes")
MAX_LISTED = 3


def watched_roots() -> list[Path]:
    """The directories of ``WATCHED_PACKAGES`` that are installed (each once)."""
    roots = []
    for name in WATCHED_PACKAGES:
        spec = importlib.util.find_spec(name)
        for location in (spec.submodule_search_locations or []) if spec else []:
            path = Path(location).resolve()
            if path not in roots:
                roots.append(path)
    return roots


Snapshot = dict[str, tuple[int, int]]


def snapshot(roots: list[Path] | None = None) -> Snapshot:
    """``path -> (size in bytes, modification time in ns)`` of every file under ``roots``
    (default ``watched_roots()``); ``__pycache__`` folders are left out (Python rewrites them itself)."""
    files: Snapshot = {}
    for root in watched_roots() if roots is None else roots:
        for folder, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in names:
                path = os.path.join(folder, name)
                try:
                    st = os.stat(path, follow_symlinks=False)
                except OSError:
                    continue
                files[path] = (st.st_size, st.st_mtime_ns)
    return files


def changes(before: Snapshot, after: Snapshot) -> list[str]:
    """Sorted ``"changed PATH"``, ``"added PATH"`` and ``"removed PATH"`` between two snapshots."""
    out = [f"changed {p}" for p in before.keys() & after.keys() if before[p] != after[p]]
    out += [f"added {p}" for p in after.keys() - before.keys()]
    out += [f"removed {p}" for p in before.keys() - after.keys()]
    return sorted(out)


def describe(found: list[str]) -> str:
    """One line naming the first few changes."""
    more = f" and {len(found) - MAX_LISTED} more" if len(found) > MAX_LISTED else ""
    return "; ".join(found[:MAX_LISTED]) + more
