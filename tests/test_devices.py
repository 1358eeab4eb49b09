"""Device names: known forms, availability on this machine, and `auto`."""

from __future__ import annotations

import pytest

from contrail.models import DeviceError, available_devices, check_device, check_device_name, load_model, resolve_device


@pytest.mark.parametrize("name", ["auto", "cpu", "cuda", "cuda:0", "cuda:12", "mps"])
def test_known_device_names(name):
    assert check_device_name(name) == name


@pytest.mark.parametrize("name", ["banana", "gpu", "cuda:", "cuda:x", "cpu:0", "mps:1", "CUDA", "", None, 0])
def test_unknown_device_names_list_the_valid_forms(name):
    with pytest.raises(DeviceError, match=r"is not a device; valid: auto, cpu, cuda, cuda:N, mps"):
        check_device_name(name)


def fake_cuda(monkeypatch, count: int) -> None:
    monkeypatch.setattr("torch.cuda.is_available", lambda: count > 0)
    monkeypatch.setattr("torch.cuda.device_count", lambda: count)


def test_cuda_without_a_gpu_is_a_clear_error(monkeypatch):
    fake_cuda(monkeypatch, 0)
    for name in ("cuda", "cuda:0"):
        with pytest.raises(DeviceError, match=rf"device '{name}' is not available: torch sees no CUDA device here; "
                                              r"valid here: auto, cpu"):
            check_device(name)
    assert check_device("cpu") == "cpu" and resolve_device("auto") == "cpu"


def test_cuda_index_beyond_the_machine(monkeypatch):
    fake_cuda(monkeypatch, 2)
    assert check_device("cuda:1") == "cuda:1" and resolve_device("auto") == "cuda"
    assert available_devices()[:5] == ["auto", "cpu", "cuda", "cuda:0", "cuda:1"]
    with pytest.raises(DeviceError, match=r"device 'cuda:2' is not available: this machine has 2 CUDA device\(s\)"):
        check_device("cuda:2")


def test_load_model_checks_the_device_before_loading(monkeypatch):
    fake_cuda(monkeypatch, 0)
    with pytest.raises(DeviceError, match="device 'cuda' is not available"):
        load_model("no/such-model-anywhere", device="cuda")  # fails on the device, never reaches the hub
