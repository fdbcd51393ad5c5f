"""glibc malloc tuning for a process that moves model-sized buffers: big blocks mmapped (returned to the OS when freed), one arena."""

from __future__ import annotations

import ctypes
import logging
import platform

log = logging.getLogger(__name__)

# <malloc.h>
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 1 << 20
ARENA_MAX = 1


def tune_for_large_buffers(*, mmap_threshold: int = MMAP_THRESHOLD_BYTES, arena_max: int = ARENA_MAX) -> bool:
    """Call once, early: every block of at least `mmap_threshold` bytes gets its own mapping, unmapped when freed, and
    all threads share `arena_max` arenas. Returns whether both settings took; off glibc a no-op (debug log).

    Why: a round's per-update buffers and tensors (MBs each, tens of MB per update) are allocated and freed from gRPC's
    worker threads. glibc raises its mmap threshold to the size of the last freed mapped block (up to 32 MiB), after
    which such blocks come from per-thread arenas, whose freed memory fragments and is seldom given back: RSS creeps
    up round after round. A fixed threshold also switches that dynamic adjustment off."""
    if platform.libc_ver()[0] != "glibc":
        log.debug("not glibc (%s): malloc left as it is", platform.libc_ver()[0] or "unknown libc")
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        log.debug("no mallopt in this process's C library: malloc left as it is")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1
    ok = mallopt(M_ARENA_MAX, arena_max) == 1 and ok
    log.debug("mallopt: mmap threshold %d bytes, %d arena(s): %s", mmap_threshold, arena_max, "set" if ok else "refused")
    return ok
