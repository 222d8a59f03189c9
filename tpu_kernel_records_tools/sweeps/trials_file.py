"""A JSON Lines file of trials that a killed run cannot corrupt: a header line, then one line per trial.

Each line is written with one ``write`` on a file opened for appending and flushed to disk before the
next trial starts, so a run killed at any moment leaves every earlier line whole and at most a cut-off
last line. :func:`read` drops such a last line (and says so: its trial is graded again), and
:meth:`TrialsFile.open` cuts it off the file before appending, so the next line starts on a line of its
own. A line that is not JSON anywhere else is damage no run makes, and is refused.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Contents:
    """The lines of a trials file: its header, the other lines, and the cut-off last line if there was one."""

    header: dict
    lines: list[dict]
    cut_off: str | None = None  # what was dropped: the last line, unterminated or not JSON
    good_bytes: int = 0         # the length of the file up to the end of its last whole line


def read(path: Path) -> Contents:
    """The lines of ``path``; a cut-off last line is dropped (``Contents.cut_off``). Raises ``ValueError``
    for an empty file, a header that is not a JSON object, or a line before the last that is not JSON."""
    data = Path(path).read_bytes()
    parts = data.split(b"\n")
    tail = parts.pop()  # the bytes after the last newline: empty unless the last line was cut off
    lines, good, cut_off = [], 0, None
    for n, raw in enumerate(parts):
        try:
            lines.append(json.loads(raw) if raw.strip() else None)
        except ValueError:
            if n == len(parts) - 1 and not tail:  # the last line, not JSON: a write that was cut off
                cut_off = raw.decode("utf-8", "replace")
                break
            raise ValueError(f"{path}: line {n + 1} is not JSON (only a cut-off last line is tolerated)") from None
        good += len(raw) + 1
    if tail:
        cut_off = tail.decode("utf-8", "replace")
    lines = [line for line in lines if line is not None]
    if not lines or not isinstance(lines[0], dict):
        raise ValueError(f"{path}: no header line")
    return Contents(lines[0], lines[1:], cut_off, good)


class TrialsFile:
    """Appends lines to ``path`` (nothing when ``path`` is None), each whole or not at all (module doc)."""

    def __init__(self, path: Path | None):
        self.path = None if path is None else Path(path)

    @classmethod
    def open(cls, path: Path | None, header: dict, resume: bool) -> tuple["TrialsFile", Contents | None]:
        """A new file with ``header`` as its first line, or (``resume``) the lines of an existing one whose
        header equals ``header``, its cut-off last line removed. Raises ``FileExistsError`` for an existing
        file without ``resume`` and ``ValueError`` for another sweep's file."""
        log = cls(path)
        if path is None:
            return log, None
        path = Path(path)
        if path.exists() and not resume:
            raise FileExistsError(f"{path} exists: pass --resume to go on with it, or choose another file")
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            log.write(header)
            return log, None
        found = read(path)
        if found.header != header:
            raise ValueError(f"{path} holds another sweep (its first line must be {json.dumps(header)}, it is "
                             f"{json.dumps(found.header)}); choose another file")
        if found.cut_off is not None:
            os.truncate(path, found.good_bytes)
        return log, found

    def write(self, line: dict) -> None:
        if self.path is None:
            return
        data = (json.dumps(line) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            written = os.write(fd, data)
            while written < len(data):  # a regular file takes it whole; this only guards a short write
                written += os.write(fd, data[written:])
            os.fsync(fd)
        finally:
            os.close(fd)
