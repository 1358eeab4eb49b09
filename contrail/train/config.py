"""Settings shared by every trainer built on the masked-token trainer (SFT, GRPO).

Every value is checked when the config is built, so a bad value fails before
anything is trained or written; each message starts with the field's name.
Seeds are not settings: trainers take ``seed=`` (see `contrail.seeds`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from contrail.precision import PRECISIONS, Precision


@dataclass
class TrainConfig:
    """Optimisation settings of the masked-token trainer.

    Micro-batches are packed by token budget (``micro_batch_tokens`` counts
    padded tokens), so memory stays bounded whatever the episode lengths.
    An optimizer step whose loss or gradient is not finite is skipped;
    ``max_nonfinite_steps`` such steps in a row stop training.
    """

    lr: float = 1e-5
    weight_decay: float = 0.0
    warmup_steps: int = 0
    max_grad_norm: float | None = 1.0  # None disables clipping
    micro_batch_tokens: int = 4096
    precision: Precision = "fp32"
    gradient_checkpointing: bool = False
    # Forward the ids a micro-batch's rows share (a GRPO group's prompt) once; exact up to rounding.
    share_prefix: bool = True
    # On a CPU, forward the rows after that prefix end to end, without padding (`contrail.train.packed_rows`).
    pack_rows: bool = True
    # Those packed rows attend through bf16 products with a written-out backward (`contrail.train.row_attention`):
    # 0.82-0.87x a quickstart update's time on a 2-core EPYC, rounding otherwise than SDPA's kernel. Off by default:
    # over the quickstart's seeds 0-2 its stage-1 gains (+0.008, +0.086, +0.148) had the mean of SDPA's (+0.086,
    # +0.047, +0.102), but seed 0, the main job's, showed none (README, "Measured here", session 42).
    row_attention: bool = False
    lora: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: str = "all-linear"
    max_nonfinite_steps: int = 3       # skipped (non-finite) optimizer steps in a row before training stops

    def __post_init__(self) -> None:
        check_number("lr", self.lr, low=0.0, low_open=True)
        check_number("weight_decay", self.weight_decay, low=0.0)
        check_int("warmup_steps", self.warmup_steps, low=0)
        if self.max_grad_norm is not None:
            check_number("max_grad_norm", self.max_grad_norm, low=0.0, low_open=True, hint=" (or None: no clipping)")
        check_int("micro_batch_tokens", self.micro_batch_tokens, low=2)
        check_choice("precision", self.precision, PRECISIONS)
        check_bool("gradient_checkpointing", self.gradient_checkpointing)
        check_bool("share_prefix", self.share_prefix)
        check_bool("pack_rows", self.pack_rows)
        check_bool("row_attention", self.row_attention)
        check_bool("lora", self.lora)
        check_int("lora_r", self.lora_r, low=1)
        check_number("lora_alpha", self.lora_alpha, low=0.0, low_open=True)
        check_number("lora_dropout", self.lora_dropout, low=0.0, high=1.0, high_open=True)
        if not isinstance(self.lora_target_modules, str) or not self.lora_target_modules.strip():
            raise ValueError(
                f"lora_target_modules must be a non-empty string ('all-linear' or a module name), "
                f"got {self.lora_target_modules!r}"
            )
        check_int("max_nonfinite_steps", self.max_nonfinite_steps, low=1)


# --- checks shared by the configs built on this one -------------------------------------


def check_number(name: str, value: object, low: float | None = None, high: float | None = None,
                 low_open: bool = False, high_open: bool = False, hint: str = "") -> None:
    """A finite real number within the given bounds; otherwise a ValueError starting with ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number{hint}, got {value!r}")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        raise ValueError(f"{name} must be {_bounds(low, high, low_open, high_open)}{hint}, got {value!r}")


def _bounds(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if high is None:
        return f"{'>' if low_open else '>='} {low:g}"
    if low is None:
        return f"{'<' if high_open else '<='} {high:g}"
    return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def check_int(name: str, value: object, low: int | None = None) -> None:
    """An integer (not a bool) ``>= low``; otherwise a ValueError starting with ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        # A config value of the wrong type is a user mistake like any other: ValueError, as everywhere here.
        raise ValueError(f"{name} must be an integer, got {value!r}")  # noqa: TRY004
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")  # noqa: TRY004


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
