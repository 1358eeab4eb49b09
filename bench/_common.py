"""Shared helpers for the benchmarks: the machine, timing, tables, JSON, models.

Benchmarks in this folder print *ratios* of things measured side by side in
one run, because the machines they run on are shared and noisy: an absolute
number from one run says little, a ratio of two numbers measured a second
apart says much more. Every script states the machine it ran on.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

# Runnable as `python bench/x.py` from the repository root without installing.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

# --- the machine ------------------------------------------------------------------


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux, else platform)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The matrix-relevant instruction sets this CPU reports (bf16 speed depends on them)."""
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                present = set(line.split(":", 1)[1].split())
                return [flag for flag in wanted if flag in present]
    except OSError:
        pass
    return []


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    import transformers

    from contrail.allocator import keeps_freed_memory

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info: dict[str, Any] = {
        "cpu": cpu_model(), "cpu_flags": cpu_flags(), "cores": os.cpu_count(), "usable_cores": usable,
        "torch_threads": torch.get_num_threads(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "malloc_keeps_freed_memory": keeps_freed_memory(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def print_machine(console) -> dict[str, Any]:
    """Print the machine description in one block and return it."""
    info = machine()
    console.print(
        f"[bold]machine[/]: {info['cpu']} | {info['usable_cores']} usable of {info['cores']} cores | "
        f"flags {' '.join(info['cpu_flags']) or '-'} | torch {info['torch']} ({info['torch_threads']} threads, "
        f"OMP_NUM_THREADS={info['OMP_NUM_THREADS']}) | transformers {info['transformers']} | "
        f"python {info['python']} | load avg {info['load_average_1min']} | "
        f"malloc {'keeps freed memory' if info['malloc_keeps_freed_memory'] else 'as the system has it'}"
        + (f" | GPU {info['gpu']}" if "gpu" in info else "")
    )
    return info


def prepare_process(threads: int | None) -> None:
    """Run as the ``contrail`` command does: malloc keeps freed memory (`contrail.allocator`; not under
    ``CONTRAIL_MALLOC=system``), with ``threads`` intra-op threads (None keeps torch's default)."""
    from contrail.allocator import keep_freed_memory

    keep_freed_memory()
    if threads:
        torch.set_num_threads(threads)


# --- timing ---------------------------------------------------------------------


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """``(seconds, result)`` of one call, synchronising a GPU if one is used."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, result


def repeat(fn: Callable[[], Any], times: int, warmup: int = 1) -> list[float]:
    """Seconds of ``times`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    return [timed(fn)[0] for _ in range(times)]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB (Linux reports KiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1024 if sys.platform != "darwin" else peak / 2**20


def matmul_flops(dtype: torch.dtype, size: int = 2048, times: int = 3, device: str = "cpu") -> float:
    """Measured FLOP/s of a ``size``-square matrix multiply (best of ``times``): this machine's practical peak."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    seconds = min(repeat(lambda: torch.matmul(a, b), times, warmup=1))
    return 2 * size**3 / seconds


# --- output ---------------------------------------------------------------------


def console():
    from rich.console import Console

    return Console(width=160)


def table(title: str, columns: list[str], rows: list[list[Any]]):
    """A rich table; numbers are formatted by the caller."""
    from rich.table import Table

    out = Table(title=title, title_justify="left")
    for index, column in enumerate(columns):
        out.add_column(column, justify="left" if index == 0 else "right")
    for row in rows:
        out.add_row(*[str(cell) for cell in row])
    return out


def write_json(path: str | None, data: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=2, default=str))


def fmt(value: float, digits: int = 1) -> str:
    return f"{value:,.{digits}f}"


# --- models ---------------------------------------------------------------------


def load_policy(name: str, seed: int = 0, max_batch_size: int = 64):
    """A `contrail.policy.Policy`: ``tiny`` (random 2-layer Llama, word-level tokenizer) or any model name."""
    from contrail.policy import Policy

    if name == "tiny":
        model, tokenizer = tiny_model_and_tokenizer(seed)
        return Policy.from_model(model.eval(), tokenizer, seed=seed, max_batch_size=max_batch_size)
    policy = Policy.load(name, seed=seed)
    policy.backend.max_batch_size = max_batch_size
    policy.model.eval()
    return policy


def tiny_model_and_tokenizer(seed: int = 0):
    """The test suite's tiny random Llama (hidden 64, 2 layers) and its word-level chatML tokenizer."""
    from contrail.testing import tiny_model, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    return tiny_model(tokenizer, hidden_size=64, layers=2, seed=seed), tokenizer


def parameter_count(model) -> int:
    """Distinct parameters (tied embeddings once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
