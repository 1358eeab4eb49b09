"""A KV cache that appends into spare capacity instead of copying itself every step.

transformers' ``DynamicLayer`` grows by ``torch.cat``: every decode step
copies the layer's whole cache to add one position. With a batch of 64 rows
and ~700 cached tokens that copy was 47% of a CPU decode step of
SmolLM2-135M (256 of 540 ms, measured with the torch profiler), more than
the model's matrix products. `GrowingLayer` keeps its keys and values in a
buffer with headroom and returns views of the filled part, so a step writes
one position; the buffer is reallocated (and copied once) only when it is
full, growing by an eighth (at least `MIN_HEADROOM`), so copies are
amortised over many steps. The room is kept small because decode attention
reads the whole buffer, spare positions masked (`whole_buffers`): with a
quarter, a 700-token cache read 175 empty positions at every step.

Under autocast (the HF backend's bf16 sampling from fp32 weights) keys and
values are stored in the autocast dtype. Keys come out of the rotary
embedding in fp32 (its cos/sin follow the fp32 residual stream), and every
attention product casts them to bf16 on use: kept in fp32, the cache was
cast, one full copy per layer, at every decode step, and took twice the
memory. Stored in bf16 it holds exactly the values attention reads.

Code that replaces a layer's ``keys``/``values`` with tensors of its own
(``batch_select_indices``, the HF backend's row selection) keeps
working: the next update sees the tensors are not views of this layer's
buffer and adopts them into a new one.

>>> cache = growing_cache()            # pass as the model's cache on a fresh prefill
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from contrail.agent.buffer_pool import empty as pooled
from contrail.agent.buffer_pool import select_rows

MIN_HEADROOM = 64  # positions: one turn's generation (the quickstart's 40 tokens) fits without a reallocation


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose ``update`` writes into preallocated capacity; ``keys``/``values`` are views."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._buffers: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (owner id, keys, values)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        key_states, value_states = _as_autocast(key_states), _as_autocast(value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        needed = length + key_states.shape[-2]
        if not self._fits(key_states, needed):
            self._reserve(key_states, value_states, needed)
        _, keys, values = self._buffers
        keys[..., length:needed, :] = key_states
        values[..., length:needed, :] = value_states
        self.keys, self.values = keys[..., :needed, :], values[..., :needed, :]
        return self.keys, self.values

    def __copy__(self) -> "GrowingLayer":
        """A copy that shares no buffer: a session cut from this one (`HFBackend`'s ``take``) must neither
        write into this layer's buffer nor keep the whole of it alive for the few rows it took."""
        twin = type(self).__new__(type(self))
        twin.__dict__.update(self.__dict__)
        twin._buffers = None
        return twin

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows ``indices``: one copy, into a buffer of their own with this one's headroom.

        Selecting from the filled view and reallocating at the next update
        were two copies of the kept rows (and kept the old buffer alive until then).
        """
        if self.get_seq_length() == 0 or self._buffers is None or not self._owns_views():
            super().batch_select_indices(indices)
            return
        length = self.keys.shape[-2]
        _, keys, values = self._buffers
        keys, values = select_rows(keys, indices), select_rows(values, indices)
        self._buffers = (id(self), keys, values)
        self.keys, self.values = keys[..., :length, :], values[..., :length, :]

    def assemble(self, rows: list[tuple[DynamicLayer, int]], width: int, room: int = 0,
                 ends: list[int] | None = None) -> None:
        """Hold, in order, row ``r`` of layer ``l`` for each ``(l, r)`` of ``rows`` (repeats allowed), left-padded
        to end at position ``ends[i]`` (``width`` for all by default), ``width`` positions filled, with room for
        ``room`` more before this class's headroom.

        One buffer is filled once, a slice copy per run of consecutive rows
        of one layer. This is how the HF backend builds a turn's cache from
        the last turn's pieces, its duplicate rows and its prefill buckets
        (which end where each bucket's new tokens begin, `rows`):
        selecting, concatenating, reordering and adopting were up to five
        copies of the whole cache a turn, each into freshly allocated memory,
        whose page faults cost more than the copies (a turn's joins were 7%
        of an evaluation's time on a 2-core EPYC, 14% on a 2-core AMX Xeon).
        Padding and unfilled positions are zero.
        """
        first, runs = rows[0][0].keys, _runs(rows, ends or [width] * len(rows))
        capacity = _capacity(width + room)
        buffers = []
        for which in ("keys", "values"):
            buffer = pooled(first, (len(rows), *first.shape[1:-2], capacity, first.shape[-1]))
            for start, layer, row, count, end in runs:
                tensor = getattr(layer, which)[row:row + count]
                offset = end - tensor.shape[-2]
                buffer[start:start + count, ..., :offset, :].zero_()
                buffer[start:start + count, ..., offset:end, :] = tensor
                buffer[start:start + count, ..., end:, :].zero_()  # attention reads unfilled positions too, masked
            buffers.append(buffer)
        self.is_initialized = True
        self.device = first.device
        self._buffers = (id(self), buffers[0], buffers[1])
        self.keys, self.values = buffers[0][..., :width, :], buffers[1][..., :width, :]

    def rows(self, start: int, end: int, length: int) -> "GrowingLayer":
        """A layer over rows ``start``..``end - 1`` of this one's buffer, filled up to ``length`` positions.

        Its updates write into this layer's buffer, in place: a prefill
        bucket extends its rows where the joined cache holds them, and no
        join copies them afterwards (`writes_into`).
        """
        _, keys, values = self._buffers
        part = GrowingLayer()
        part.is_initialized, part.device = True, self.device
        part._buffers = (id(part), keys[start:end], values[start:end])
        part.keys, part.values = keys[start:end, ..., :length, :], values[start:end, ..., :length, :]
        return part

    def filled(self, length: int) -> None:
        """Take this layer's first ``length`` positions as filled (its `rows` parts wrote them in place)."""
        _, keys, values = self._buffers
        self.keys, self.values = keys[..., :length, :], values[..., :length, :]

    def writes_into(self, other: "GrowingLayer") -> bool:
        """Whether this layer's filled positions still lie in ``other``'s buffer (a `rows` part not reallocated)."""
        return (self._buffers is not None and other._buffers is not None and self._owns_views()
                and self._buffers[1].untyped_storage().data_ptr() == other._buffers[1].untyped_storage().data_ptr()
                and self._buffers[2].untyped_storage().data_ptr() == other._buffers[2].untyped_storage().data_ptr())

    def spare(self) -> int:
        """Positions this layer's buffer has left before an update must reallocate (0 without one of its own)."""
        if self._buffers is None or not self._owns_views():
            return 0
        return self._buffers[1].shape[-2] - self.keys.shape[-2]

    def _owns_views(self) -> bool:
        """Whether ``keys`` and ``values`` are still the filled start of this layer's own buffers."""
        owner, keys, values = self._buffers
        return (owner == id(self) and self.keys is not None and self.keys.numel() > 0
                and self.keys.data_ptr() == keys.data_ptr() and self.values.data_ptr() == values.data_ptr()
                and self.keys.stride() == keys.stride() and self.keys.shape[:-2] == keys.shape[:-2])

    def _fits(self, key_states: torch.Tensor, needed: int) -> bool:
        """Whether ``keys`` is still a view of this layer's own buffer, with room for ``needed`` positions."""
        # A copied layer (``copy.copy``) has no buffer: it must not write into its original's.
        return (self._buffers is not None and self._owns_views() and needed <= self._buffers[1].shape[-2]
                and self._buffers[1].dtype == key_states.dtype)

    def _reserve(self, key_states: torch.Tensor, value_states: torch.Tensor, needed: int) -> None:
        """A new buffer of ``needed`` positions plus headroom, holding the cache so far."""
        capacity = _capacity(needed)
        length = self.get_seq_length()
        buffers = []
        for cached, new in ((self.keys, key_states), (self.values, value_states)):
            shape = list(new.shape)
            shape[-2] = capacity
            buffer = pooled(new, shape)
            buffer[..., length:, :].zero_()  # attention reads the unfilled positions too, masked out: keep them finite
            if length:
                buffer[..., :length, :] = cached
            buffers.append(buffer)
        self._buffers = (id(self), buffers[0], buffers[1])


def _capacity(needed: int) -> int:
    """A buffer's positions for ``needed`` filled ones: an eighth more, at least `MIN_HEADROOM` (see above)."""
    return needed + max(MIN_HEADROOM, needed // 8)


def _runs(rows: list[tuple[DynamicLayer, int]], ends: list[int]) -> list[tuple[int, DynamicLayer, int, int, int]]:
    """``rows`` as runs ``(first output row, layer, first row, count, end)`` of consecutive rows of one layer
    that end at one position."""
    runs: list[tuple[int, DynamicLayer, int, int, int]] = []
    for position, ((layer, row), end) in enumerate(zip(rows, ends)):
        if runs and runs[-1][1] is layer and runs[-1][2] + runs[-1][3] == row and runs[-1][4] == end:
            start, _, first, count, _ = runs[-1]
            runs[-1] = (start, layer, first, count + 1, end)
        else:
            runs.append((position, layer, row, 1, end))
    return runs


def _as_autocast(states: torch.Tensor) -> torch.Tensor:
    """``states`` in the autocast dtype of their device when autocast is on there (else unchanged)."""
    device = states.device.type
    if states.is_floating_point() and torch.is_autocast_enabled(device):
        return states.to(torch.get_autocast_dtype(device))
    return states


def growing_cache() -> DynamicCache:
    """An empty ``DynamicCache`` whose layers are `GrowingLayer` (created as the model first writes them)."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = GrowingLayer
    return cache
