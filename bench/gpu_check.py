"""A GPU check, no downloads: matmul rate, a GRPO step, the colocated vLLM engine, FSDP over the GPUs.

Every model is random-init from a config of Qwen2.5-1.5B's shape (hidden
1536, 28 layers, 12 heads, 2 KV heads, intermediate 8960, vocab 151936,
tied embeddings) with a word-level tokenizer built locally
(`contrail.testing.tiny_tokenizer`, padded to the model's vocabulary so
every sampled id decodes). Parts, each printing throughput, memory and the
share of the card's measured bf16 matmul rate:

    matmul  the card's bf16 rate: a large torch.matmul (best of several)
    grpo    two GRPO steps (rollouts with the HF backend + the update), bf16 autocast, fp32 weights
    vllm    the vLLM backend colocated with sleep mode (`contrail.agent.vllm.VLLMBackend`):
            generation tokens/s, GPU memory freed by sleep and its wake/reload time, and the engine's
            log-probs against the model's; skipped with a message where the module or vllm is missing
    vllm-grpo  two GRPO steps with ``rollout.backend: vllm`` (the engine asleep during updates),
            where the rollout config has that field
    fsdp    the masked-token trainer under FSDP2 across the processes `accelerate launch` started
            (one per GPU): tokens/s, memory per GPU, share of the matmul rate, and a full checkpoint
            save + optimizer resume through FSDP

    scripts/gpu_check.sh                        # everything (under 8 minutes on one H100/H200)
    python bench/gpu_check.py matmul grpo      # one process, one GPU (vllm, vllm-grpo likewise)
    accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes 8 bench/gpu_check.py fsdp
    scripts/gpu_check.sh --cpu-smoke            # the same code paths, tiny shape, on CPU (gloo for FSDP)

With ``--json-dir`` each part also writes ``<part>.json`` there.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import matmul_flops, parameter_count, peak_rss_mb, timed  # noqa: E402

from contrail.envs.base import Step, Task  # noqa: E402
from contrail.testing import MagicWordEnv, tiny_tokenizer  # noqa: E402

QWEN_1_5B = dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936)
SMOKE = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,  # head_dim 64
             intermediate_size=512, vocab_size=512)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("parts", nargs="+", choices=["matmul", "grpo", "vllm", "vllm-grpo", "fsdp"])
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="a tiny model on CPU through the same code paths (checks the script, measures nothing)")
    parser.add_argument("--json-dir", default=None, help="write <part>.json here (main process)")
    parser.add_argument("--vllm-compile", action="store_true",
                        help="let vLLM compile and capture CUDA graphs (faster decoding, ~1-2 min longer load)")
    parser.add_argument("--no-fsdp-checkpoint", action="store_true", help="skip the FSDP save/resume (~18 GB on disk)")
    return parser.parse_args(argv)


class Setup:
    """What every part shares: device, shape, sizes and the tokenizer."""

    def __init__(self, args: argparse.Namespace):
        self.smoke = args.cpu_smoke
        if not self.smoke and not torch.cuda.is_available():
            raise SystemExit("gpu_check: no CUDA device; use --cpu-smoke to check the script on a CPU")
        self.args = args
        self.device = "cpu" if self.smoke else "cuda"
        self.shape = SMOKE if self.smoke else QWEN_1_5B
        self.tokenizer = padded_tokenizer(self.shape["vocab_size"])
        # sizes: (GPU, smoke)
        def pick(gpu, smoke):
            return smoke if self.smoke else gpu

        self.matmul_size = pick(8192, 256)
        self.group, self.tasks = pick(8, 4), pick(8, 2)          # 64 episodes per GRPO step on a GPU
        self.new_tokens = pick(128, 8)
        self.vllm_prompts, self.prompt_len = pick(64, 4), pick(256, 16)
        self.fsdp_batch, self.fsdp_len = pick(8, 2), pick(2048, 32)  # per process and step

    def model(self, dtype: torch.dtype = torch.float32, seed: int = 0):
        """A random-init Qwen2 of the shape, built on the device (the same weights for a seed, on every process)."""
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config = Qwen2Config(**self.shape, max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=True,
                             pad_token_id=self.tokenizer.pad_token_id, eos_token_id=self.tokenizer.eos_token_id,
                             bos_token_id=self.tokenizer.bos_token_id, torch_dtype=dtype)
        torch.manual_seed(seed)
        with torch.device(self.device):
            model = Qwen2ForCausalLM(config).to(dtype)
        return model

    def matmul_rate(self) -> float:
        return matmul_flops(torch.bfloat16, self.matmul_size, times=5, device=self.device)


def padded_tokenizer(vocab_size: int):
    """The chatML word-level tokenizer of `contrail.testing`, with filler words up to ``vocab_size`` ids."""
    base = len(tiny_tokenizer())
    tokenizer = tiny_tokenizer(tuple(f"w{i}" for i in range(vocab_size - base)))
    assert len(tokenizer) == vocab_size, (len(tokenizer), vocab_size)
    return tokenizer


class CoinEnv(MagicWordEnv):
    """Reward 1 for replies whose checksum is even: a random model gets mixed rewards, so updates happen."""

    name = "gpu-check-coin"

    def on_step(self, text: str) -> Step:
        heads = zlib.crc32(text.encode()) % 2 == 0
        return Step(observation="ok", reward=float(heads), done=True, success=heads)


class Tasks:
    """The smallest task sampler (``sample(n)``): fresh coin tasks, seeded."""

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def sample(self, n: int) -> list[Task]:
        return [Task(CoinEnv.name, self.rng.randrange(10**6), "train", "easy") for _ in range(n)]


def memory() -> dict[str, float]:
    """Peak accelerator memory of this process (GiB), or peak RSS (MiB) on CPU."""
    if torch.cuda.is_available():
        return {"peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}
    return {"peak_rss_mib": peak_rss_mb()}


def say(text: str) -> None:
    print(text, flush=True)


# --- parts -------------------------------------------------------------------------------------


def part_matmul(setup: Setup) -> dict:
    rate = setup.matmul_rate()
    say(f"[matmul] bf16 {setup.matmul_size}^3: {rate / 1e12:.1f} TFLOP/s measured")
    return {"bf16_flops": rate, "size": setup.matmul_size}


def grpo_trainer(setup: Setup, model, rollout):
    from contrail.grpo.config import GRPOConfig
    from contrail.grpo.trainer import GRPOTrainer

    config = GRPOConfig(lr=1e-6, group_size=setup.group, tasks_per_step=setup.tasks, precision="bf16",
                        gradient_checkpointing=not setup.smoke, micro_batch_tokens=16384)
    return GRPOTrainer(model, setup.tokenizer, config, rollout, lambda task: CoinEnv(), seed=0, show_progress=False)


def timed_steps(trainer, steps: int = 2) -> dict:
    """``steps`` GRPO steps; the last one's stats (the first pays warm-up)."""
    sampler = Tasks()
    stats = {}
    for _ in range(steps):
        stats = trainer.step(sampler)
    return stats


def part_grpo(setup: Setup) -> dict:
    from contrail.agent.rollout import RolloutConfig

    rate = setup.matmul_rate()
    model = setup.model(torch.float32)
    params = parameter_count(model)
    rollout = RolloutConfig(max_new_tokens=setup.new_tokens, max_episode_tokens=2048, max_turns=1)
    trainer = grpo_trainer(setup, model, rollout)
    stats = timed_steps(trainer)
    report = step_report("grpo", stats, params, rate, setup.group * setup.tasks)
    report.update(memory())
    say(f"[grpo] memory: {fmt_memory(report)}")
    return report


def step_report(tag: str, stats: dict, params: int, rate: float, episodes: int) -> dict:
    """Throughput of one GRPO step and its update's share of the matmul rate (6 x params x trained tokens)."""
    generated = stats["generated_tokens"]
    tokens = stats.get("tokens", 0.0)  # masked (trained) tokens of the update
    rollout, update = stats["rollout_seconds"], stats["update_seconds"]
    fraction = 6 * params * tokens / update / rate if update > 0 and tokens else float("nan")
    report = {"params": params, "episodes": episodes, "rollout_seconds": rollout, "update_seconds": update,
              "generated_tokens_per_s": generated / rollout, "episodes_per_s": episodes / rollout,
              "trained_tokens": tokens, "update_tokens_per_s": tokens / update if update else 0.0,
              "update_fraction_of_matmul": fraction, "skipped_update": stats.get("skipped_update", 0.0),
              "stats": {k: v for k, v in stats.items() if isinstance(v, (int, float))}}
    say(f"[{tag}] {params / 1e9:.2f}B params, {episodes} episodes: rollout {rollout:.1f} s "
        f"({generated / rollout:,.0f} generated tok/s, {episodes / rollout:.1f} episodes/s), update {update:.2f} s "
        f"({report['update_tokens_per_s']:,.0f} trained tok/s, {fraction:.1%} of the bf16 matmul rate)"
        + ("  [no update: all rewards equal]" if report["skipped_update"] else ""))
    return report


def fmt_memory(report: dict) -> str:
    if "peak_allocated_gib" in report:
        return f"peak {report['peak_allocated_gib']:.1f} GiB allocated, {report['peak_reserved_gib']:.1f} GiB reserved"
    return f"peak RSS {report['peak_rss_mib']:,.0f} MiB"


def part_vllm(setup: Setup) -> dict:
    try:
        from contrail.agent.vllm import VLLMBackend, VLLMConfig, require_vllm
    except ImportError as error:
        say(f"[vllm] SKIPPED: contrail.agent.vllm is not in this tree ({error}); it is written on branch vllm")
        return {"skipped": f"contrail.agent.vllm missing: {error}"}
    try:
        require_vllm()
    except ValueError as error:
        say(f"[vllm] SKIPPED: {error}")
        return {"skipped": str(error)}
    from contrail.agent.backend import SamplingParams

    rate = setup.matmul_rate()
    config = VLLMConfig(gpu_memory_utilization=0.35, sleep=True, dtype="bfloat16",
                        enforce_eager=not setup.args.vllm_compile)
    model = setup.model(torch.bfloat16)
    started = time.perf_counter()
    backend = VLLMBackend(model, {setup.tokenizer.eos_token_id}, seed=0, config=config, max_model_len=2048,
                          max_batch_size=setup.vllm_prompts)
    load_seconds = time.perf_counter() - started
    rng = random.Random(0)
    prompts = [[rng.randrange(setup.shape["vocab_size"]) for _ in range(setup.prompt_len)]
               for _ in range(setup.vllm_prompts)]
    params = SamplingParams(max_new_tokens=setup.new_tokens)
    backend.generate(prompts[:2], params)  # first call loads the weights
    started = time.perf_counter()
    outputs = backend.generate(prompts, params)
    seconds = time.perf_counter() - started
    generated = sum(len(o.ids) for o in outputs)
    # Decoding is memory-bound: its compute share (2 x params per token) is low by nature; shown for scale.
    fraction = 2 * parameter_count(model) * generated / seconds / rate
    report = {"engine_load_seconds": load_seconds, "generated_tokens": generated,
              "generated_tokens_per_s": generated / seconds, "decode_fraction_of_matmul": fraction,
              "sleep_mode": backend.engine.sleep_mode}
    say(f"[vllm] engine up in {load_seconds:.0f} s; {len(prompts)} prompts x {setup.new_tokens} tokens: "
        f"{generated / seconds:,.0f} generated tok/s ({fraction:.1%} of the bf16 matmul rate)")
    report.update(sleep_cycle(backend, prompts, params))
    report["logprob_max_abs_diff"] = logprob_gap(backend, model, prompts[0] + outputs[0].ids)
    say(f"[vllm] engine vs model log-probs of one sequence: max |diff| {report['logprob_max_abs_diff']:.3g} (bf16)")
    report.update(memory())
    return report


def sleep_cycle(backend, prompts, params) -> dict:
    """Sleep (free the engine's memory for an update), wake by reloading weights, generate again."""
    free = (lambda: torch.cuda.mem_get_info()[0] / 2**30) if torch.cuda.is_available() else (lambda: float("nan"))
    before = free()
    sleep_seconds, _ = timed(backend.prepare_update)
    freed = free() - before
    wake_seconds, _ = timed(backend.sync_weights)
    seconds, outputs = timed(lambda: backend.generate(prompts, params))
    generated = sum(len(o.ids) for o in outputs)
    asleep = (f"sleep: {freed:.1f} GiB freed in {sleep_seconds:.2f} s" if backend.engine.sleep_mode
              else "no sleep mode on this platform (the engine stays resident)")
    say(f"[vllm] {asleep}; wake + weight reload {wake_seconds:.2f} s; after waking {generated / seconds:,.0f} "
        "generated tok/s")
    return {"sleep_freed_gib": freed, "sleep_seconds": sleep_seconds, "wake_reload_seconds": wake_seconds,
            "after_wake_tokens_per_s": generated / seconds}


def logprob_gap(backend, model, ids: list[int]) -> float:
    from contrail.train.logprobs import sequence_logprobs

    engine = torch.tensor(backend.sequence_logprobs(ids))
    with torch.no_grad():
        tensor = torch.tensor([ids], device=model.device)
        mine = sequence_logprobs(model, tensor, torch.ones_like(tensor))[0, 1:].float().cpu()
    return float((engine - mine[: len(engine)]).abs().max())


def part_vllm_grpo(setup: Setup) -> dict:
    """Two GRPO steps whose rollouts come from the colocated engine, asleep during updates (``rollout.backend: vllm``).

    A part of its own (its own process in gpu_check.sh), so its engine does
    not share the card with the one `part_vllm` built.
    """
    from contrail.agent.rollout import RolloutConfig

    try:
        from contrail.agent.vllm import VLLMConfig, require_vllm

        require_vllm()
    except (ImportError, ValueError) as error:
        say(f"[vllm-grpo] SKIPPED: {error}")
        return {"skipped": str(error)}
    if "backend" not in RolloutConfig.__dataclass_fields__:
        say("[vllm-grpo] SKIPPED: this tree's RolloutConfig has no backend field")
        return {"skipped": "RolloutConfig has no backend field"}
    rate = setup.matmul_rate()
    config = VLLMConfig(gpu_memory_utilization=0.35, sleep=True, dtype="bfloat16",
                        enforce_eager=not setup.args.vllm_compile)
    rollout = RolloutConfig(max_new_tokens=setup.new_tokens, max_episode_tokens=2048, max_turns=1,
                            backend="vllm", vllm=config)
    model = setup.model(torch.float32)
    trainer = grpo_trainer(setup, model, rollout)
    report = step_report("vllm-grpo", timed_steps(trainer), parameter_count(model), rate, setup.group * setup.tasks)
    report.update(memory())
    say(f"[vllm-grpo] memory: {fmt_memory(report)}")
    return report


def part_fsdp(setup: Setup) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    state = Accelerator().state  # first: reads ACCELERATE_USE_CPU, so CPU launches get gloo
    if setup.smoke and state.distributed_type == DistributedType.MULTI_CPU:
        force_fsdp_on_cpu(state)
    if state.distributed_type != DistributedType.FSDP:
        say(f"[fsdp] SKIPPED: not launched with FSDP ({state.distributed_type}); "
            "use accelerate launch --config_file configs/accelerate/fsdp.yaml")
        return {"skipped": str(state.distributed_type)}
    rate = setup.matmul_rate()
    trainer, params = fsdp_trainer(setup)
    samples = synthetic_samples(setup, state.process_index)
    from contrail.train.trainer import cross_entropy_loss

    trainer.step(samples, cross_entropy_loss)  # warm-up
    steps = 3
    seconds, _ = timed(lambda: [trainer.step(samples, cross_entropy_loss) for _ in range(steps)])
    local_tokens = sum(len(s.ids) for s in samples) * steps
    total_tokens = trainer.sum_over_processes(float(local_tokens))
    per_process = local_tokens / seconds
    fraction = 6 * params * per_process / rate
    report = {"processes": state.num_processes, "params": params, "tokens_per_s": total_tokens / seconds,
              "tokens_per_s_per_process": per_process, "fraction_of_matmul": fraction, **memory()}
    if state.is_main_process:
        say(f"[fsdp] {state.num_processes} processes, {params / 1e9:.2f}B params, {setup.fsdp_batch} x "
            f"{setup.fsdp_len} tokens per process per step: {total_tokens / seconds:,.0f} tok/s in all, "
            f"{fraction:.1%} of the bf16 matmul rate per device; {fmt_memory(report)} (process 0)")
    if not setup.args.no_fsdp_checkpoint:
        report["checkpoint"] = fsdp_checkpoint(trainer, state)
    trainer.accelerator.wait_for_everyone()
    return report


def fsdp_trainer(setup: Setup):
    from contrail.train.config import TrainConfig
    from contrail.train.trainer import MaskedTokenTrainer

    model = setup.model(torch.float32, seed=0)  # every process builds the same weights; FSDP keeps its shard
    params = parameter_count(model)
    config = TrainConfig(lr=1e-6, precision="bf16", micro_batch_tokens=16384, gradient_checkpointing=not setup.smoke)
    return MaskedTokenTrainer(model, setup.tokenizer, config, seed=0), params


def synthetic_samples(setup: Setup, process: int):
    """This process's sequences: random ids, the last 60% of each trained on."""
    from contrail.train.trainer import Sample

    rng = random.Random(process)
    prompt = int(setup.fsdp_len * 0.4)
    return [Sample(ids=[rng.randrange(setup.shape["vocab_size"]) for _ in range(setup.fsdp_len)],
                   mask=[0] * prompt + [1] * (setup.fsdp_len - prompt)) for _ in range(setup.fsdp_batch)]


def fsdp_checkpoint(trainer, state) -> dict:
    """Save a full checkpoint through FSDP (gathered model, full optimizer state) and load its state back."""
    directory = Path(tempfile.mkdtemp(prefix="contrail-gpu-check-")) if state.is_main_process else None
    shared = [str(directory) if directory else None]
    if state.num_processes > 1:
        torch.distributed.broadcast_object_list(shared, src=0)
    directory = Path(shared[0])
    step = trainer.global_step
    save_seconds, _ = timed(lambda: trainer.save(directory, extra={"check": 1}))
    load_seconds, extra = timed(lambda: trainer.load_state(directory))
    size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file()) / 2**30
    ok = extra.get("check") == 1 and trainer.global_step == step
    if state.is_main_process:
        say(f"[fsdp] checkpoint: saved {size:.1f} GiB in {save_seconds:.1f} s, optimizer state loaded back in "
            f"{load_seconds:.1f} s ({'ok' if ok else 'MISMATCH'})")
    trainer.accelerator.wait_for_everyone()
    if state.is_main_process:
        import shutil

        shutil.rmtree(directory, ignore_errors=True)
    return {"save_seconds": save_seconds, "load_seconds": load_seconds, "gib": size, "ok": ok}


def force_fsdp_on_cpu(state) -> None:
    """accelerate enables FSDP only on accelerators; FSDP2 itself runs on CPU with gloo.

    The same switch as ``scripts/sharded_resume.py --force-fsdp``: for ``--cpu-smoke`` only.
    """
    from accelerate import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state.fsdp_plugin = FullyShardedDataParallelPlugin()
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


PARTS = {"matmul": part_matmul, "grpo": part_grpo, "vllm": part_vllm, "vllm-grpo": part_vllm_grpo,
         "fsdp": part_fsdp}


def main(argv=None) -> int:
    args = parse_args(argv)
    setup = Setup(args)
    started = time.perf_counter()
    results = {}
    for name in args.parts:
        part_started = time.perf_counter()
        results[name] = PARTS[name](setup)
        results[name]["seconds"] = time.perf_counter() - part_started
    main_process = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if args.json_dir and main_process:
        Path(args.json_dir).mkdir(parents=True, exist_ok=True)
        for name, result in results.items():
            (Path(args.json_dir) / f"{name}.json").write_text(json.dumps(result, indent=2, default=str))
    if main_process:
        say(f"[done] {', '.join(args.parts)} in {time.perf_counter() - started:.0f} s"
            + (" (cpu smoke: code paths only, the numbers mean nothing)" if setup.smoke else ""))
    if "fsdp" in args.parts and torch.distributed.is_initialized():  # accelerate's group (vLLM tears down its own)
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
