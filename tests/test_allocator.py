"""glibc's allocator kept from returning freed memory (contrail.allocator)."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import ctypes, sys
from contrail.allocator import keep_freed_memory
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
if sys.argv[1] == "keep":
    assert keep_freed_memory()
small = libc.malloc(64)
big = libc.malloc(64 << 20)  # glibc maps an allocation this large on its own, far from its heap
print(abs(big - small) < (1 << 30))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_large_allocations_come_from_the_heap_once_freed_memory_is_kept():
    def from_heap(mode: str) -> bool:
        out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
        return out.stdout.strip() == "True"

    assert not from_heap("default")  # a mapping of its own, as glibc does by default
    assert from_heap("keep")


def test_it_can_be_switched_off(monkeypatch):
    from contrail.allocator import keep_freed_memory

    monkeypatch.setenv("CONTRAIL_SYSTEM_MALLOC", "1")
    assert keep_freed_memory() is False
