"""Which precision a run computes in; ``"auto"`` picks bf16 only where the hardware multiplies it fast.

bf16 autocast (fp32 master weights, bf16 matrix products) halves the memory
traffic and, on hardware with bf16 matrix units, runs the products several
times faster than fp32: CUDA GPUs from Ampere on, x86 CPUs with AVX512-BF16
or AMX (measured on a 2-core Xeon with AMX: a GRPO update 2.2x faster than
in fp32; on a 2-core AMD EPYC with AVX512-BF16 and no AMX, bf16 products ran
2.3x as fast as fp32's, 408 against 176 GFLOP/s, and an update 1.36x).
Without them PyTorch emulates each bf16 product: on an AVX2-only
CPU (a 2-core AMD EPYC of the Zen 3 family) a bf16 matrix product of
SmolLM2's shapes ran at 1.2 GFLOP/s against fp32's 127, so a bf16
warm-start that took 2.3 minutes on the Xeon had not finished after ten.
``"auto"`` resolves to bf16 where it pays and to fp32 elsewhere.

>>> resolve_precision("auto", "cpu") in ("fp32", "bf16")
True
"""

from __future__ import annotations

import functools
from typing import Literal, get_args

import torch

__all__ = ["PRECISIONS", "Precision", "cpu_has_amx", "describe_precision", "fast_bf16", "resolve_precision"]

Precision = Literal["auto", "fp32", "bf16"]
PRECISIONS: tuple[str, ...] = get_args(Precision)

# torch's checks for the CPU's bf16 matrix instructions (private names, so each is optional).
_CPU_BF16_CHECKS = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")


def resolve_precision(precision: str, device: torch.device | str) -> Literal["fp32", "bf16"]:
    """``precision`` itself, or for ``"auto"`` bf16 when `fast_bf16` on ``device`` and fp32 otherwise."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision != "auto":
        return precision  # type: ignore[return-value]
    return "bf16" if fast_bf16(device) else "fp32"


def describe_precision(precision: str, device: torch.device | str) -> str:
    """What ``precision`` means on ``device``, for a log line: ``"fp32 (auto: cpu without bf16 matrix units)"``."""
    resolved = resolve_precision(precision, device)
    if precision != "auto":
        return resolved
    kind = torch.device(device).type
    return f"{resolved} (auto: {kind} {'with' if resolved == 'bf16' else 'without'} bf16 matrix units)"


def fast_bf16(device: torch.device | str) -> bool:
    """Whether ``device`` has bf16 matrix units (not emulation): CUDA with native bf16, or an AVX512-BF16/AMX CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        return any(_cpu_supports(name) for name in _CPU_BF16_CHECKS)
    return False  # MPS and others: fp32, the precision every backend runs at full speed


@functools.cache
def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (bf16 products in tiles: PyTorch's SDPA kernel uses them too)."""
    return _cpu_supports("_is_amx_tile_supported")


def _cpu_supports(check: str) -> bool:
    """torch's private CPU feature check ``check`` (False where this torch lacks it)."""
    return bool(getattr(torch.cpu, check, lambda: False)())
