"""Memory that an address-space limit does not count: never-mapped memfds, and files in the tmpfs folders.

Each writes far past the worker's memory limit in 64 MiB pieces (under the per-file size limit), keeps
every file, and, if it is still alive, says how much it holds."""

import os

PIECE = 64 << 20
TARGET = 6 << 30


def memfd_hog(q, k, v, **kwargs):
    held, block = [], b"\1" * PIECE
    while len(held) * PIECE < TARGET:
        fd = os.memfd_create(f"hog{len(held)}")
        os.write(fd, block)
        held.append(fd)
    raise RuntimeError(f"survived holding {len(held) * PIECE >> 20} MiB in memfds")


def tmpfs_hog(q, k, v, **kwargs):
    written, block = 0, b"\1" * PIECE
    for folder in ("/dev/shm", "/tmp"):
        for i in range(TARGET // PIECE):
            try:
                with open(os.path.join(folder, f"hog{i}"), "wb") as f:
                    f.write(block)
                written += PIECE
            except OSError:
                break
    raise RuntimeError(f"survived holding {written >> 20} MiB in tmpfs files")
