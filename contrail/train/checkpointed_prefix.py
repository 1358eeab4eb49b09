"""A shared prefix forwarded once, under gradient checkpointing too.

`contrail.train.logprobs.sequence_logprobs` forwards the ids a micro-batch's
rows share (a GRPO group's prompt) once, at batch size 1, and the rows' own
tokens then attend to its keys and values through a KV cache. transformers'
checkpointed layers drop any cache (a layer replayed in the backward pass
would append to it a second time), which used to leave a choice between
prefix sharing and checkpointing. Here both hold:

- the prefix is forwarded with checkpointing paused (`checkpointing_paused`):
  one row, whose activations are kept as usual;
- its cache is made read-only (`read_only`): a layer's ``update`` returns the
  prefix's keys and values joined to the new ones without storing anything,
  so the replay in the backward pass computes exactly what the forward did;
- the rows' forward is checkpointed with that cache kept
  (`reading_cache_under_checkpointing`, transformers' own switch for layers
  that only read a cache: ``GradientCheckpointingLayer._can_checkpoint_with_cache``).

Gradients still flow back into the prefix's forward through its keys and values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


def _layer_class():
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # transformers without checkpointed layers of this kind
        return None
    return GradientCheckpointingLayer


def enable_checkpointing(model) -> None:
    """Turn on non-reentrant activation checkpointing (transformers' newer name for it, or the older one)."""
    options = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)


def supported() -> bool:
    """Whether this transformers can checkpoint a layer and keep its (read-only) cache."""
    layer = _layer_class()
    return layer is not None and hasattr(layer, "_can_checkpoint_with_cache")


def checkpointing_modules(model) -> list[torch.nn.Module]:
    """The model's modules with gradient checkpointing on: its replayed layers, and the model that then drops
    ``use_cache``."""
    return [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]


@contextlib.contextmanager
def checkpointing_paused(modules: list[torch.nn.Module]) -> Iterator[None]:
    """Within the block ``modules`` run (and keep their cache) as if checkpointing were off."""
    for module in modules:
        module.gradient_checkpointing = False
    try:
        yield
    finally:
        for module in modules:
            module.gradient_checkpointing = True


@contextlib.contextmanager
def reading_cache_under_checkpointing(modules: list[torch.nn.Module]) -> Iterator[None]:
    """Within the block the checkpointed layers among ``modules`` keep the cache they are given (`read_only`)."""
    layer_class = _layer_class()
    layers = [m for m in modules if layer_class is not None and isinstance(m, layer_class)]
    for layer in layers:
        layer._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for layer in layers:
            del layer._can_checkpoint_with_cache  # back to the class's False


class ReadOnlyLayer(DynamicLayer):
    """A cache layer holding fixed keys and values: ``update`` returns them joined to the new ones, storing nothing."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


def read_only(cache: DynamicCache) -> DynamicCache:
    """``cache`` with every layer replaced by a `ReadOnlyLayer` of the same keys and values."""
    cache.layers = [ReadOnlyLayer(layer.keys, layer.values) for layer in cache.layers]
    return cache
