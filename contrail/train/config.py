"""Settings shared by every trainer built on the masked-token trainer (SFT, GRPO)."""

from __future__ import annotations

from dataclasses import dataclass

PRECISIONS = ("fp32", "bf16")


@dataclass
class TrainConfig:
    """Optimisation settings of the masked-token trainer.

    Micro-batches are packed by token budget (``micro_batch_tokens`` counts
    padded tokens), so memory stays bounded whatever the episode lengths.
    """

    lr: float = 1e-5
    weight_decay: float = 0.0
    warmup_steps: int = 0
    max_grad_norm: float | None = 1.0  # None disables clipping
    micro_batch_tokens: int = 4096
    precision: str = "fp32"
    gradient_checkpointing: bool = False
    lora: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: str = "all-linear"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.micro_batch_tokens < 2:
            raise ValueError(f"micro_batch_tokens must be >= 2, got {self.micro_batch_tokens}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0 (or None to disable clipping), got {self.max_grad_norm}")
        if self.lora and self.lora_r < 1:
            raise ValueError(f"lora_r must be >= 1 when lora is on, got {self.lora_r}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
