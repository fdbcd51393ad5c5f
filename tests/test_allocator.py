"""fedsynth.process.allocator: with glibc, blocks of 1 MiB and more are mmapped even after a bigger block was freed; elsewhere a no-op."""

from __future__ import annotations

import ctypes
import platform
import subprocess
import sys

import pytest

from fedsynth.process import allocator

# In a fresh interpreter: free an 8 MiB block (glibc then raises its dynamic mmap threshold to 8 MiB), allocate 4 MiB,
# and print how many blocks are mmapped (mallinfo2's hblks) while it is held.
PROBE = r"""
import ctypes, sys
from fedsynth.process import allocator
if sys.argv[1] == "tuned":
    assert allocator.tune_for_large_buffers()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = MallInfo2
libc.free(libc.malloc(8 << 20))
before = libc.mallinfo2().hblks
block = libc.malloc(4 << 20)
print(libc.mallinfo2().hblks - before)
libc.free(block)
"""


def _has_mallinfo2() -> bool:
    return platform.libc_ver()[0] == "glibc" and hasattr(ctypes.CDLL(None), "mallinfo2")


@pytest.mark.skipif(not _has_mallinfo2(), reason="needs glibc >= 2.33 (mallinfo2)")
def test_after_tuning_a_4_mib_block_is_mmapped_even_after_a_bigger_one_was_freed() -> None:
    def mapped(mode: str) -> int:
        done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60, check=True)
        return int(done.stdout.strip())

    assert mapped("default") == 0  # glibc's dynamic threshold: the 4 MiB block came from the heap
    assert mapped("tuned") == 1


def test_off_glibc_it_leaves_malloc_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator.platform, "libc_ver", lambda: ("", ""))
    assert allocator.tune_for_large_buffers() is False
