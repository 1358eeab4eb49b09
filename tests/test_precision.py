"""``precision: auto``: bf16 only where the device has bf16 matrix units, resolved once and used everywhere."""

from __future__ import annotations

import pytest
import torch

from contrail import precision
from contrail.precision import describe_precision, fast_bf16, resolve_precision
from contrail.testing import tiny_model
from contrail.train.config import TrainConfig
from contrail.train.trainer import MaskedTokenTrainer


@pytest.fixture
def cpu_bf16(monkeypatch):
    """``cpu_bf16(amx, avx512_bf16)``: what torch's CPU checks report for the rest of the test."""
    def set_units(amx: bool, avx512_bf16: bool) -> None:
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    return set_units


@pytest.mark.parametrize(("amx", "avx512_bf16", "expected"),
                         [(False, False, "fp32"), (True, False, "bf16"), (False, True, "bf16"), (True, True, "bf16")])
def test_auto_is_bf16_exactly_when_the_cpu_has_bf16_matrix_units(cpu_bf16, amx, avx512_bf16, expected):
    cpu_bf16(amx, avx512_bf16)
    assert fast_bf16("cpu") is (expected == "bf16")
    assert resolve_precision("auto", "cpu") == expected
    assert resolve_precision("auto", torch.device("cpu")) == expected


def test_a_torch_without_the_cpu_checks_means_fp32(monkeypatch):
    for name in precision._CPU_BF16_CHECKS:
        monkeypatch.delattr(torch.cpu, name, raising=False)
    assert resolve_precision("auto", "cpu") == "fp32"


def test_an_explicit_precision_is_kept_whatever_the_device(cpu_bf16):
    cpu_bf16(False, False)
    assert resolve_precision("bf16", "cpu") == "bf16"
    cpu_bf16(True, True)
    assert resolve_precision("fp32", "cpu") == "fp32"
    assert resolve_precision("auto", "meta") == "fp32"  # neither a CPU nor CUDA: fp32


def test_an_unknown_precision_names_the_choices():
    with pytest.raises(ValueError, match="precision must be one of auto, fp32, bf16, got 'fp16'"):
        resolve_precision("fp16", "cpu")


def test_the_log_line_says_what_auto_chose_and_why(cpu_bf16):
    cpu_bf16(False, False)
    assert describe_precision("auto", "cpu") == "fp32 (auto: cpu without bf16 matrix units)"
    assert describe_precision("bf16", "cpu") == "bf16"
    cpu_bf16(True, False)
    assert describe_precision("auto", "cpu") == "bf16 (auto: cpu with bf16 matrix units)"


@pytest.mark.parametrize(("units", "expected"), [(False, "fp32"), (True, "bf16")])
def test_the_trainer_resolves_auto_once_and_autocasts_by_it(tokenizer, cpu_bf16, units, expected):
    cpu_bf16(units, units)
    trainer = MaskedTokenTrainer(tiny_model(tokenizer), tokenizer, TrainConfig(precision="auto"))
    assert trainer.precision == expected
    with trainer.autocast():
        assert torch.is_autocast_enabled("cpu") is (expected == "bf16")
    cpu_bf16(not units, not units)  # what the hardware reports later does not change a built trainer
    assert trainer.precision == expected


def test_train_config_accepts_auto_and_rejects_other_names():
    assert TrainConfig(precision="auto").precision == "auto"
    with pytest.raises(ValueError, match="precision"):
        TrainConfig(precision="fp16")
