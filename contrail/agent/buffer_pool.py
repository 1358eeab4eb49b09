"""Memory for the HF backend's KV-cache buffers, kept apart from the heap and reused.

A CPU evaluation builds every turn a new cache of a few hundred MB to a few
GB (`contrail.agent.kv_cache`), frees the last one, and between them
allocates thousands of small objects (token lists, logits rows) that live on.
In malloc's one heap (`contrail.allocator` keeps freed memory there) those
small blocks land in the holes the freed caches leave, so the next, larger
cache rarely fits and the heap grows: after its warm-start, a quickstart's
first evaluation held 1.6-2.6 GB in use in a heap grown to 10.4 GB. Each
new page costs a fault, and on some cloud VMs, whose host backs a page only
when the guest first touches it, about 8 s per GB in the kernel (README,
"Measured here").

`BufferPool` carves the buffers from one anonymous mapping that only cache
buffers share, first fit, merging neighbours as they are freed, so a cache
reuses its predecessors' pages. Nothing is handed back to the kernel unless
asked: the pool's resident memory is its high-water mark, as the heap's is
when malloc keeps freed memory, and it is used only then (`pool`). A GRPO
update, whose memory comes from the heap, cannot use the pool's pages, so
the backend hands the free ones back before it (`release_free_pages`), and
after it backs as many again in one call (`refill_released_pages`) rather
than have the sampling threads fault them in page by page. Its pages are 4 kB:
with 2 MB pages (``huge_pages``) a whole evaluation took 1.12-1.21x the time
on a 2-core EPYC VM (``bench/rollout.py`` (k)).

>>> keys = empty(like=key_states, shape=(64, 3, 900, 64))   # from the pool when there is one
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import ctypes
import ctypes.util
import functools
import math
import mmap
import os
import sys
import weakref
from collections.abc import Iterator

import torch

from contrail.allocator import keeps_freed_memory

ALIGN = 4096  # bytes: every buffer starts on a page
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux's value; Python < 3.12 does not name it
# Linux >= 5.14 backs a whole range in one call; older Pythons do not name it, and elsewhere 23 means another advice.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform.startswith("linux") else None)


class BufferPool:
    """Tensors carved from ``capacity`` bytes of anonymous memory; a buffer's range is free again once the last
    tensor viewing it is gone.

    Address space only is reserved (``MAP_NORESERVE``): pages are backed as
    buffers first touch them, 2 MB at a time with ``huge_pages`` where the
    kernel's transparent huge pages allow it (``madvise``; not the default,
    see the module docstring). A request that no free range fits returns None
    (the caller allocates as usual).
    """

    def __init__(self, capacity: int, huge_pages: bool = False):
        self.capacity = capacity - capacity % ALIGN
        self._memory = mmap.mmap(-1, self.capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
        self.huge_pages = huge_pages and _advise_huge_pages(self._memory)
        self._free: list[list[int]] = [[0, self.capacity]]  # sorted [offset, size] ranges
        # Ranges whose tensors died, merged into ``_free`` at the next request: a tensor can die (and its
        # finalizer run) in the middle of `empty`, which must not see ``_free`` change under it.
        self._returned: collections.deque[tuple[int, int]] = collections.deque()
        # bytes: the end of the furthest range ever handed out (the pool's resident size until a `release`)
        self.high_water = 0
        # bytes: the furthest end handed out since the last `release` (what the phase in between needed), and
        # the released phases' largest, which `refill` backs again
        self._phase_high_water = 0
        self._refill_to = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """An uninitialised contiguous CPU tensor of ``shape`` and ``dtype`` from the pool, or None if none fits."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return None
        size = -(-nbytes // ALIGN) * ALIGN
        self._merge_returned()
        offset = self._take(size)
        if offset is None:
            return None
        self.high_water = max(self.high_water, offset + size)
        self._phase_high_water = max(self._phase_high_water, offset + size)
        window = memoryview(self._memory)[offset:offset + nbytes]
        # The tensor's storage holds ``window`` until its last view dies; then the range is free again.
        weakref.finalize(window, self._returned.append, (offset, size))
        # Set into a fresh tensor rather than viewed: a view's ``_base`` would be the flat tensor, and decode
        # attention finds a cache's whole buffer as its views' ``_base`` (`contrail.agent.attention.whole_buffers`).
        storage = torch.frombuffer(window, dtype=dtype).untyped_storage()
        return torch.empty(0, dtype=dtype).set_(storage, 0, shape)  # no strides given: contiguous

    def free_bytes(self) -> int:
        """Bytes free for new buffers (including ranges freed since the last request)."""
        self._merge_returned()
        return sum(size for _, size in self._free)

    def release(self) -> int:
        """Hand the pages of every free range back to the kernel (``MADV_DONTNEED``); returns their bytes.

        The live buffers keep their pages and contents; a freed range's pages
        fault in again, zeroed, when a later buffer uses them.
        """
        self._merge_returned()
        released = 0
        for offset, size in self._free:
            end = min(offset + size, self.high_water)  # beyond the high-water mark nothing was ever touched
            if end > offset:
                self._memory.madvise(mmap.MADV_DONTNEED, offset, end - offset)
                released += end - offset
        self._refill_to = max(self._refill_to, self._phase_high_water)
        self._phase_high_water = self._live_end()
        return released

    def refill(self) -> int:
        """Back again, in one call per free range, the pages `release` handed back up to where the phase before
        it reached; returns their bytes (0 where the kernel cannot populate: they then fault in as used).

        For the change back to the phase that released them: its next
        buffers will need about as much. Faulted in by the sampling threads
        as their first writes reach each 4 kB page, the same pages cost a
        quickstart step's rollout 4-5 s of system time and 2-4 s of wall time
        on a 2-core EPYC VM; populated at once (``MADV_POPULATE_WRITE``),
        about 0.3-0.6 s per GB. They are resident at once, so a phase that
        needs less than the last holds the difference until the next
        `release` (a training rollout after an evaluation, once a stage).
        """
        target, self._refill_to = self._refill_to, 0
        if target == 0 or MADV_POPULATE_WRITE is None:
            return 0
        self._merge_returned()
        filled = 0
        for offset, size in self._free:
            end = min(offset + size, target)
            if end <= offset:
                break
            try:
                self._memory.madvise(MADV_POPULATE_WRITE, offset, end - offset)
            except OSError:  # EINVAL before Linux 5.14, ENOMEM when memory runs short: fault in as used
                break
            filled += end - offset
        return filled

    def resident_bytes(self) -> int | None:
        """Bytes of the pool the kernel backs right now (``mincore``); None where that cannot be asked."""
        if self.high_water == 0:
            return 0
        libc = _libc()
        if libc is None:
            return None
        page = mmap.PAGESIZE
        pages = -(-self.high_water // page)
        flags = (ctypes.c_ubyte * pages)()
        address = ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(self._memory)))
        if libc.mincore(address, ctypes.c_size_t(pages * page), flags) != 0:
            return None
        return sum(flag & 1 for flag in flags) * page

    def _take(self, size: int) -> int | None:
        for index, (offset, free) in enumerate(self._free):
            if free >= size:  # first fit: low offsets are reused first, so the touched part stays small
                if free == size:
                    del self._free[index]
                else:
                    self._free[index] = [offset + size, free - size]
                return offset
        return None

    def _live_end(self) -> int:
        """The end of the furthest live buffer (0 when none is)."""
        if self._free and sum(self._free[-1]) == self.capacity:  # the last free range runs to the end
            return self._free[-1][0]
        return self.capacity

    def _merge_returned(self) -> None:
        while self._returned:
            offset, size = self._returned.popleft()
            index = bisect.bisect(self._free, [offset, size])
            self._free.insert(index, [offset, size])
            if index + 1 < len(self._free) and offset + size == self._free[index + 1][0]:  # the next range
                self._free[index][1] += self._free.pop(index + 1)[1]
            if index > 0 and self._free[index - 1][0] + self._free[index - 1][1] == offset:  # the previous one
                self._free[index - 1][1] += self._free.pop(index)[1]


@functools.cache
def _libc():
    """The C library when it has ``mincore`` (Linux, the BSDs, macOS), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mincore  # noqa: B018
    except (OSError, AttributeError, TypeError):
        return None
    return libc


def _advise_huge_pages(memory: mmap.mmap) -> bool:
    """Ask the kernel to back ``memory`` with transparent huge pages; False where it cannot (not Linux, no THP)."""
    try:
        memory.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        return False
    return True


_pool: BufferPool | None = None
_pool_tried = False


def pool() -> BufferPool | None:
    """The process's pool, created on first use; None unless malloc keeps freed memory in this process
    (`contrail.allocator.keep_freed_memory`, which the ``contrail`` command calls) or where no address space
    the size of physical memory can be reserved."""
    global _pool, _pool_tried
    if _pool is None and not _pool_tried and keeps_freed_memory():
        _pool_tried = True
        try:
            _pool = BufferPool(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        except (OSError, ValueError, AttributeError):  # strict overcommit, or no sysconf
            _pool = None
    return _pool


def release_free_pages() -> int:
    """`BufferPool.release` on the process's pool if it has one (bytes handed back; 0 without a pool)."""
    return _pool.release() if _pool is not None else 0


def refill_released_pages() -> int:
    """`BufferPool.refill` on the process's pool if it has one (bytes backed again; 0 without a pool)."""
    return _pool.refill() if _pool is not None else 0


@contextlib.contextmanager
def pooling(buffers: BufferPool | None) -> Iterator[BufferPool | None]:
    """Within the block, cache buffers come from ``buffers`` (None: from the heap), whatever `pool` would say.

    For a program that imports contrail and wants the pool without keeping
    all freed memory (`contrail.allocator`), or a test that compares both.
    """
    global _pool, _pool_tried
    before = _pool, _pool_tried
    _pool, _pool_tried = buffers, True
    try:
        yield buffers
    finally:
        _pool, _pool_tried = before


def empty(like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised tensor of ``shape`` with ``like``'s dtype and device: from the pool for a CPU tensor when
    there is one, else as ``like.new_empty`` allocates."""
    source = pool() if like.device.type == "cpu" else None
    tensor = source.empty(tuple(shape), like.dtype) if source is not None else None
    return tensor if tensor is not None else like.new_empty(shape)


def select_rows(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` of ``tensor`` (its first dimension), copied into a buffer from `empty`."""
    return torch.index_select(tensor, 0, index, out=empty(tensor, (len(index), *tensor.shape[1:])))
