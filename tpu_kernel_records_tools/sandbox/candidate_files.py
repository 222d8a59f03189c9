"""What of a stranger's kernel the grader may open on the host: the files the user named, never a link.

A candidate arrives as a file, a folder (``--candidate-dir``) or a module's package, often unpacked from
a downloaded archive, and the grader reads it on the host (as root, on CI and Kaggle) before the sandbox
starts. So before anything is opened:

- a candidate file must be a regular file that is not a symbolic link and has no other name
  (``st_nlink == 1``): a link to the home folder's Hub token or a ``.env`` would otherwise be read as
  the candidate's source and printed in its load error;
- a folder is walked without following links, and refused when it holds a symbolic link, anything
  but folders and regular files, or a hard link (whose other names may lie outside it); its files'
  apparent sizes together (holes of a sparse file count) and their number are bounded by
  :class:`FolderLimits` (``--candidate-max-mib``, ``--candidate-max-files``), so that a copy for the
  sandbox cannot fill the disk.

Each refusal is a :class:`~tpu_kernel_records_tools.sandbox.errors.CandidateSpecError` of one line
that names the path the user gave and what is wrong with it, never a byte of what it points to.
:func:`open_file` opens a candidate file with ``O_NOFOLLOW`` and checks what it opened, so a link put
in its place after the check is refused too.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass


@dataclass(frozen=True)
class FolderLimits:
    """Bounds on a candidate folder: ``max_bytes`` of apparent file sizes together, ``max_files`` files."""

    max_bytes: int = 256 << 20
    max_files: int = 10_000


DEFAULT_LIMITS = FolderLimits()
_limits = DEFAULT_LIMITS


def set_limits(limits: FolderLimits) -> None:
    """The bounds every later check in this process uses (a command's flags set them once)."""
    global _limits
    _limits = limits


def limits() -> FolderLimits:
    return _limits


class LinkRefused(ValueError):
    """A candidate path is a link, holds one, or is too large; the message is one line."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a named pipe"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"),
                       (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "not a regular file"


def check_file(path: str | os.PathLike, shown: str | None = None) -> None:
    """Refuse ``path`` unless it is a regular file with one name (``shown``: how the user wrote it)."""
    shown = str(path) if shown is None else shown
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise LinkRefused(f"candidate file {shown} does not exist") from None
    except OSError as e:
        raise LinkRefused(f"candidate file {shown} cannot be read ({e.strerror})") from None
    _check_stat(st, shown)


def _check_stat(st: os.stat_result, shown: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise LinkRefused(f"candidate file {shown} is {_kind(st.st_mode)}; give the file itself (the grader "
                          f"follows no links out of what you name)")
    if st.st_nlink > 1:
        raise LinkRefused(f"candidate file {shown} is a hard link ({st.st_nlink} names); give a copy of it")


def open_file(path: str | os.PathLike, shown: str | None = None) -> int:
    """A read-only descriptor of the candidate file ``path``, opened without following a link and checked
    again after opening (a link swapped in after :func:`check_file` is refused all the same)."""
    shown = str(path) if shown is None else shown
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise LinkRefused(f"candidate file {shown} is a symbolic link or cannot be opened ({e.strerror})") from None
    try:
        _check_stat(os.fstat(fd), shown)
    except LinkRefused:
        os.close(fd)
        raise
    return fd


def check_folder(folder: str | os.PathLike, bounds: FolderLimits | None = None, what: str = "candidate folder") -> None:
    """Refuse ``folder`` (see module doc) before anything in it is opened or copied. ``.git`` is not
    looked into (the sandbox hides it)."""
    bounds = _limits if bounds is None else bounds
    shown = str(folder)
    try:
        top = os.lstat(folder)
    except OSError as e:
        raise LinkRefused(f"{what} {shown} cannot be read ({e.strerror})") from None
    if not stat.S_ISDIR(top.st_mode):
        raise LinkRefused(f"{what} {shown} is {_kind(top.st_mode)}, not a folder")
    total = count = 0
    for here, dirs, files in os.walk(folder, onerror=_raise, followlinks=False):
        dirs[:] = [d for d in dirs if d != ".git"]
        for name in [*dirs, *files]:
            path = os.path.join(here, name)
            st = os.lstat(path)
            relative = os.path.relpath(path, folder)
            if stat.S_ISDIR(st.st_mode):
                continue
            if not stat.S_ISREG(st.st_mode):
                raise LinkRefused(f"{what} {shown} holds {relative}, {_kind(st.st_mode)}: the grader follows "
                                  f"no links and copies nothing but files")
            count += 1
            total += st.st_size
            if count > bounds.max_files:
                raise LinkRefused(f"{what} {shown} holds more than {bounds.max_files} files "
                                  f"(--candidate-max-files raises the bound)")
            if total > bounds.max_bytes:
                raise LinkRefused(f"{what} {shown} holds more than {bounds.max_bytes / (1 << 20):g} MiB of files "
                                  f"(sizes as listed, holes included; --candidate-max-mib raises the bound)")
            if st.st_nlink > 1:
                raise LinkRefused(f"{what} {shown} holds {relative}, a hard link ({st.st_nlink} names, which "
                                  f"may lie outside it); give copies of its files")


def _raise(error: OSError) -> None:
    raise LinkRefused(f"a candidate folder cannot be read ({error.strerror}: {error.filename})")


def add_arguments(parser) -> None:
    """``--candidate-max-mib`` and ``--candidate-max-files``: the bounds of a candidate folder (argparse)."""
    parser.add_argument("--candidate-max-mib", type=float, default=DEFAULT_LIMITS.max_bytes / (1 << 20), metavar="MIB",
                        help=f"a candidate folder or package may hold at most this many MiB of files, sizes as "
                             f"listed (a sparse file's holes count), checked before it is copied for the sandbox "
                             f"(default {DEFAULT_LIMITS.max_bytes >> 20})")
    parser.add_argument("--candidate-max-files", type=int, default=DEFAULT_LIMITS.max_files, metavar="N",
                        help=f"... and at most this many files (default {DEFAULT_LIMITS.max_files})")


def apply_arguments(args) -> None:
    """Set this process's bounds from the flags of :func:`add_arguments`."""
    if args.candidate_max_mib <= 0 or args.candidate_max_files <= 0:
        raise ValueError("--candidate-max-mib and --candidate-max-files must be positive")
    set_limits(FolderLimits(int(args.candidate_max_mib * (1 << 20)), args.candidate_max_files))
