"""Give back the pages of a model file that llama.cpp mapped and no longer reads.

llama.cpp maps the GGUF file and reads every page of it at load. Weights it computes
with in place stay in that mapping; weights it copies elsewhere (rearranged for the CPU's
matrix kernels, or offloaded to a GPU) are read once, and tensors a stage never uses (a
non-final stage's output head) are not read at all, yet all of those pages stay
resident in the process: on a CPU the resident size is then about twice the weights.

:func:`release_file_pages` drops the process's resident pages of every mapping of the
file (``madvise(MADV_DONTNEED)``). The mapping is read-only and backed by the file, so
nothing is lost: a page the model does read again comes back from the page cache on its
first use, and the rest stay out.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

logger = logging.getLogger(__name__)

MADV_DONTNEED = 4
"""Linux's ``MADV_DONTNEED``: drop the range's pages; a file mapping refaults them."""


def file_mappings(path: str | os.PathLike, maps: str = "/proc/self/maps") -> list[tuple[int, int]]:
    """The ``(start, end)`` address ranges of this process's read-only mappings of the
    file at ``path``: matched by device and inode, whatever name the mapping shows, or by
    its path (an overlay file system may show the device and inode of the layer below)."""
    info = os.stat(path)
    device = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}"
    real = os.path.realpath(path)
    ranges = []
    with open(maps, encoding="utf-8", errors="replace") as lines:
        for line in lines:
            fields = line.rstrip("\n").split(maxsplit=5)
            if len(fields) < 5 or "w" in fields[1]:
                continue
            same_file = fields[3] == device and fields[4] == str(info.st_ino)
            if same_file or (len(fields) == 6 and fields[5] == real):
                start, end = (int(address, 16) for address in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


def release_file_pages(path: str | os.PathLike) -> int:
    """Drop this process's resident pages of ``path``'s mappings; the bytes mapped.

    Linux only; elsewhere, or if the mappings cannot be read, nothing happens and 0 is
    returned (the pages then stay resident, as they were).
    """
    if not sys.platform.startswith("linux"):
        return 0
    try:
        ranges = file_mappings(path)
    except OSError as exc:
        logger.debug("cannot read this process's mappings of %s: %s", path, exc)
        return 0
    if not ranges:
        logger.debug("%s is not mapped read-only here: no pages to give back", path)
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    released = 0
    for start, end in ranges:
        if madvise(start, end - start, MADV_DONTNEED) != 0:
            logger.debug("madvise of %s failed: %s", path, os.strerror(ctypes.get_errno()))
            continue
        released += end - start
    return released
