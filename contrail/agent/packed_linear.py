"""Sampling's linear layers on a CPU multiply with bf16 weights packed once per call, not at every product.

Under autocast a linear layer hands oneDNN a plain bf16 weight, which oneDNN
reorders into its blocked layout inside every product. `packed_linears`
reorders each weight once, for a whole generation call, and calls oneDNN's
linear with the packed weight: the same kernel on the same bf16 values, so
the outputs are the same bits as autocast's (tests/agent/test_packed_linear.py).
On a 2-core AVX512-BF16 EPYC (SmolLM2-135M's shapes, bench/rollout.py (l))
a product took 0.36-0.83x the time at 8 rows (a late decode step; the
49k-row head 2.1 ms against 5.7), 0.71-0.81x at 64 (a full one) and
0.89-0.96x at 2,000 (a prefill); the quickstart's whole evaluation took
0.95x (104 against 106-112 s), every episode the same.

Weights are packed anew on every call: an optimizer step or a LoRA merge
changes them between calls, and a merge writes through ``.data``, which no
version counter sees. Packing SmolLM2-135M takes about 0.2 s, a fraction of
what one call saves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["packed_linears", "supported"]


def supported(model, autocast_bf16: bool) -> bool:
    """Whether `packed_linears` changes anything: bf16 autocast on a CPU whose oneDNN multiplies in bf16."""
    if not autocast_bf16 or not torch.backends.mkldnn.is_available():
        return False
    parameter = next(model.parameters(), None)
    return parameter is not None and parameter.device.type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@contextlib.contextmanager
def packed_linears(model, enabled: bool = True) -> Iterator[None]:
    """Within the block (no gradients), each ``nn.Linear`` of ``model`` multiplies with a bf16 weight packed for oneDNN.

    Meant for bf16 autocast on a CPU (`supported`): it computes what autocast
    would, bf16 inputs and weights with a bf16 output. Layers are switched by
    an instance ``forward``, removed on exit; subclasses of ``nn.Linear``
    (quantized or adapter layers) keep their own, as do layers whose weight
    is a tensor subclass (an FSDP shard outside its unsharded sampling).
    """
    if not enabled:
        yield
        return
    if torch.is_grad_enabled():
        raise RuntimeError("packed_linears is for sampling: its packed weights record no gradients")
    switched = []
    try:
        for layer in model.modules():
            if type(layer) is torch.nn.Linear and _plain(layer.weight):
                layer.forward = _packed_forward(layer)
                switched.append(layer)
        yield
    finally:
        for layer in switched:
            del layer.forward  # back to the class's forward


def _plain(weight: torch.Tensor) -> bool:
    return type(weight.detach()) is torch.Tensor and weight.dim() == 2


def _packed_forward(layer: torch.nn.Linear):
    weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach().to(torch.bfloat16), None)
    bias = None if layer.bias is None else layer.bias.detach().to(torch.bfloat16)

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(hidden.to(torch.bfloat16), weight, bias, "none", [], "")

    return forward
