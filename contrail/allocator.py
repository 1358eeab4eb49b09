"""Keep freed memory in the process for the next tensor, instead of handing it back to the kernel.

On Linux, glibc's ``malloc`` serves every block above 32 MB (and, by its
default trimming, much of the freed heap) with fresh pages from the kernel,
and returns them on ``free``. A CPU training step allocates and frees such
blocks by the hundred: activations, the LM head's logits chunks, a prefill's
KV caches. Each reuse then costs a page fault per 4 KiB and the kernel's
zeroing of the page. On a 2-core Xeon a quickstart-shaped LoRA update spent
about 5 s of its 16-17 s in the kernel; with the memory kept, 0.5-1 s, and
the update took 0.82x the time (``bench/grpo_step.py --allocator``).

`keep_freed_memory` turns both off through glibc's own ``mallopt``: blocks
come from the heap and stay there once freed, so the process's resident
memory stays near its peak instead of falling between phases. The
``contrail`` command calls it at start; a program that imports contrail
decides for itself. ``CONTRAIL_MALLOC=system`` (or glibc's own malloc
settings: ``MALLOC_*_`` variables, ``glibc.malloc`` tunables) leaves
``malloc`` as it is.

Kept memory serves the phase that freed it; a GRPO step alternates two
phases that allocate differently (the rollout's KV caches in their own pool,
`contrail.agent.buffer_pool`; the update's activations in the heap), and
each would otherwise hold the other's freed memory through its own peak.
`hand_back_freed_memory` returns the heap's free pages at such a change
(the pool has its own `BufferPool.release`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

# mallopt's parameter numbers (glibc's <malloc.h>).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
# mallopt takes an int: the largest trim threshold it accepts. Free memory at the heap's top beyond
# this (2 GiB) is still handed back.
KEEP_UP_TO = 2**31 - 1
OPT_OUT = "CONTRAIL_MALLOC"
GLIBC_SETTINGS = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
_kept = False  # whether this process's malloc keeps freed memory (`keeps_freed_memory`)


@functools.cache
def _glibc():
    """The process's C library when it is glibc (it has ``mallopt``), else None (macOS, musl, Windows)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def keep_freed_memory() -> bool:
    """Have ``malloc`` keep freed memory for reuse (see the module docstring); True if it now does.

    False, changing nothing, where the C library is not glibc, where
    ``CONTRAIL_MALLOC=system`` is set, or where the environment already sets
    glibc's malloc tunables (the user's choice stands). Call it once, early;
    it affects the whole process.
    """
    if os.environ.get(OPT_OUT, "").lower() == "system" or _user_tuned_malloc():
        return False
    libc = _glibc()
    if libc is None:
        return False
    global _kept
    # Both must hold: with mmap off every block comes from the heap, and with trimming (nearly) off
    # the heap keeps what was freed.
    _kept = bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, KEEP_UP_TO))
    return _kept


def _user_tuned_malloc() -> bool:
    return any(name in os.environ for name in GLIBC_SETTINGS) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "")


def hand_back_freed_memory() -> bool:
    """Return the heap's free pages to the kernel now (glibc's ``malloc_trim``); True if any went back.

    For a change of phase, when what the last phase freed is memory the next
    will not allocate from the heap: the pages then serve it instead of
    sitting beside it. The blocks still in use stay where they are; the
    freed ones fault in again when the heap reuses them. Nothing happens
    (False) where the C library is not glibc.
    """
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


def keeps_freed_memory() -> bool:
    """Whether `keep_freed_memory` has taken effect in this process."""
    return _kept
