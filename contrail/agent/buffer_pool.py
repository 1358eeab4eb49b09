"""Memory for the HF backend's KV-cache buffers, kept apart from small objects and reused.

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

`BufferPool` carves the buffers from segments of 256 MB that only cache
buffers share, first fit, merging neighbours as they are freed, so a cache
reuses its predecessors' pages. The segments themselves come from the heap,
into the large holes that training leaves (a warm-start's freed optimizer
state and activations), and go back to it whole once the last buffer dies
(the end of a rollout or an evaluation batch), for the GRPO update that
follows. The pool is used only where malloc keeps freed memory (`pool`).

>>> keys = empty(like=key_states, shape=(64, 3, 900, 64))   # from the pool when there is one
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import ctypes
import math
import os
import weakref
from collections.abc import Iterator

import torch

from contrail.allocator import keeps_freed_memory

ALIGN = 4096  # bytes: every buffer starts on a page
# Bytes a segment holds unless one buffer needs more: several of a 64-episode batch's per-layer caches (up to
# ~50 MB each), and small beside the holes a warm-start leaves in the heap (GBs), so a new segment finds one.
SEGMENT_BYTES = 256 << 20


class _Segment:
    """``size`` page-aligned bytes of heap memory, and its free ranges (sorted ``[offset, size]``)."""

    def __init__(self, size: int):
        self.memory = torch.empty(size + ALIGN, dtype=torch.uint8)  # from malloc, like any CPU tensor
        start = -(-self.memory.data_ptr() // ALIGN) * ALIGN
        self.bytes = memoryview((ctypes.c_char * size).from_address(start)).cast("B")
        self.size = size
        self.free: list[list[int]] = [[0, size]]

    def take(self, size: int) -> int | None:
        for index, (offset, free) in enumerate(self.free):
            if free >= size:  # first fit: low offsets are reused first
                if free == size:
                    del self.free[index]
                else:
                    self.free[index] = [offset + size, free - size]
                return offset
        return None

    def give_back(self, offset: int, size: int) -> None:
        index = bisect.bisect(self.free, [offset, size])
        self.free.insert(index, [offset, size])
        if index + 1 < len(self.free) and offset + size == self.free[index + 1][0]:  # the next range
            self.free[index][1] += self.free.pop(index + 1)[1]
        if index > 0 and self.free[index - 1][0] + self.free[index - 1][1] == offset:  # the previous one
            self.free[index - 1][1] += self.free.pop(index)[1]


class BufferPool:
    """Tensors carved from segments of heap memory, at most ``capacity`` bytes of them at once; a buffer's range
    is free again once the last tensor viewing it is gone, and every segment goes back to the heap once no buffer
    is left.

    A request that no segment fits gets a new segment of ``segment_bytes``
    (or its own size, if larger); one that would take the pool beyond
    ``capacity`` returns None (the caller allocates as usual).
    """

    def __init__(self, capacity: int, segment_bytes: int = SEGMENT_BYTES):
        self.capacity = capacity - capacity % ALIGN
        self.segment_bytes = segment_bytes - segment_bytes % ALIGN or ALIGN
        self._segments: list[_Segment] = []
        # Ranges whose tensors died, merged into their segment's free list at the next request: a tensor can
        # die (and its finalizer run) in the middle of `empty`, which must not see a free list change under it.
        self._returned: collections.deque[tuple[_Segment, int, int]] = collections.deque()
        self._live = 0  # buffers handed out whose last tensor is still alive
        self.high_water = 0  # the most bytes the pool has held in segments at once

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """An uninitialised contiguous CPU tensor of ``shape`` and ``dtype`` from the pool, or None if none fits."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return None
        size = -(-nbytes // ALIGN) * ALIGN
        self._live += 1  # counted first: no finalizer running meanwhile may find the pool unused and empty it
        try:
            self._merge_returned()
            segment, offset = self._place(size)
        except BaseException:
            self._live -= 1
            raise
        if segment is None:
            self._live -= 1
            return None
        window = segment.bytes[offset:offset + nbytes]
        # The tensor's storage holds ``window`` until its last view dies; then the range is free again.
        weakref.finalize(window, self._give_back, segment, offset, size)
        # Set into a fresh tensor rather than viewed: a view's ``_base`` would be the flat tensor, and decode
        # attention finds a cache's whole buffer as its views' ``_base`` (`contrail.agent.attention.whole_buffers`).
        storage = torch.frombuffer(window, dtype=dtype).untyped_storage()
        return torch.empty(0, dtype=dtype).set_(storage, 0, shape)  # no strides given: contiguous

    def held_bytes(self) -> int:
        """Bytes the pool holds in segments now (0 once no buffer is left)."""
        return sum(segment.size for segment in self._segments)

    def free_bytes(self) -> int:
        """Bytes free for new buffers in the segments held now (including ranges freed since the last request)."""
        self._merge_returned()
        return sum(size for segment in self._segments for _, size in segment.free)

    def _place(self, size: int) -> tuple[_Segment | None, int]:
        for segment in self._segments:
            offset = segment.take(size)
            if offset is not None:
                return segment, offset
        room = self.capacity - self.held_bytes()
        if size > room:
            return None, 0
        try:
            segment = _Segment(min(max(size, self.segment_bytes), room))
        except RuntimeError:  # the heap cannot grow: the caller's own allocation will say so
            return None, 0
        self._segments.append(segment)
        self.high_water = max(self.high_water, self.held_bytes())
        return segment, segment.take(size)

    def _give_back(self, segment: _Segment, offset: int, size: int) -> None:
        self._returned.append((segment, offset, size))
        self._live -= 1
        if self._live == 0:  # nothing left in the pool: its segments go back to the heap, for other work
            self._segments, self._returned = [], collections.deque()

    def _merge_returned(self) -> None:
        while self._returned:
            segment, offset, size = self._returned.popleft()
            segment.give_back(offset, size)


_pool: BufferPool | None = None
_pool_tried = False


def pool() -> BufferPool | None:
    """The process's pool, created on first use; None unless malloc keeps freed memory in this process
    (`contrail.allocator.keep_freed_memory`, which the ``contrail`` command calls)."""
    global _pool, _pool_tried
    if _pool is None and not _pool_tried and keeps_freed_memory():
        _pool_tried = True
        try:
            _pool = BufferPool(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        except (ValueError, AttributeError, OSError):  # no sysconf
            _pool = None
    return _pool


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
