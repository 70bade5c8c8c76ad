"""Process memory: give freed tensor memory back to the operating system (glibc)."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
MMAP_THRESHOLD_BYTES = 128 * 1024


def return_freed_memory_to_os(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Serve every allocation above ``threshold`` bytes with its own mapping, unmapped when freed.

    glibc raises its mmap threshold (up to 32 MB) each time a large block is freed, after which
    activation-sized tensors (1-30 MB) come from the heap, where freed memory mostly stays
    resident: a training step's activations then keep the process's RSS at their high-water mark
    plus fragmentation. A fixed threshold keeps RSS close to the memory in use (measured on one
    policy update of the demo: 3.47 GB -> 2.62 GB peak RSS). Returns False where this is not
    glibc (nothing changed).
    """
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    except OSError:
        return False
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, int(threshold)))
