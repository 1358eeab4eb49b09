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
(``batch_select_indices``, the HF backend's row selection and joins) keeps
working: the next update sees the tensors are not views of this layer's
buffer and adopts them into a new one.

>>> cache = growing_cache()            # pass as the model's cache on a fresh prefill
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

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
        keys, values = keys.index_select(0, indices), values.index_select(0, indices)
        self._buffers = (id(self), keys, values)
        self.keys, self.values = keys[..., :length, :], values[..., :length, :]

    def join(self, layers: list[DynamicLayer], width: int) -> None:
        """Hold the rows of ``layers`` (this one may be among them), each left-padded to ``width`` positions.

        One buffer with this class's headroom is filled once: concatenating
        left-padded copies and adopting the result at the next update were
        three copies of the whole cache, each into freshly allocated memory,
        whose page faults cost more than the copies (a turn's joins were 7%
        of an evaluation's time on a 2-core EPYC). Padding positions are zero.
        """
        parts = [(layer.keys, layer.values) for layer in layers]
        first = parts[0][0]
        rows = sum(keys.shape[0] for keys, _ in parts)
        capacity = width + max(MIN_HEADROOM, width // 8)
        buffers = []
        for which in (0, 1):
            shape = (rows, *first.shape[1:-2], capacity, first.shape[-1])
            buffer = first.new_empty(shape)
            start = 0
            for part in parts:
                tensor = part[which]
                end, offset = start + tensor.shape[0], width - tensor.shape[-2]
                buffer[start:end, ..., :offset, :].zero_()
                buffer[start:end, ..., offset:width, :] = tensor
                start = end
            buffer[..., width:, :].zero_()  # attention reads the unfilled positions too, masked out
            buffers.append(buffer)
        self.is_initialized = True
        self.device = first.device
        self._buffers = (id(self), buffers[0], buffers[1])
        self.keys, self.values = buffers[0][..., :width, :], buffers[1][..., :width, :]

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
        capacity = needed + max(MIN_HEADROOM, needed // 8)
        length = self.get_seq_length()
        buffers = []
        for cached, new in ((self.keys, key_states), (self.values, value_states)):
            shape = list(new.shape)
            shape[-2] = capacity
            buffer = new.new_empty(shape)
            buffer[..., length:, :].zero_()  # attention reads the unfilled positions too, masked out: keep them finite
            if length:
                buffer[..., :length, :] = cached
            buffers.append(buffer)
        self._buffers = (id(self), buffers[0], buffers[1])


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
