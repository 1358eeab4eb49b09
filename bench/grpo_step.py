"""GRPO update throughput, achieved FLOP rate, and one full step against TRL.

(a) One GRPO update (`GRPOTrainer.update`: advantages, forward + backward + optimizer
    step, and the no-grad old-log-prob forward where the trainer needs one) over a fixed batch of
    synthetic multi-turn trajectories (prompt, then assistant turns and
    observations; ~60% of tokens generated, i.e. mask 1), in fp32 and bf16.
    Tokens/s, and the achieved FLOP rate, estimated as
    ``6 x parameters x tokens`` for fwd+bwd, plus ``2 x parameters x tokens``
    when the trainer runs a separate old-log-prob forward, as a fraction of this machine's measured matrix-multiply rate
    (a large ``torch.matmul`` of the same dtype, timed in the same run).
    Each precision runs in its own process (Accelerate's state is a
    process-wide singleton), which also keeps their memory peaks apart.
(b) One full GRPO step (rollouts + update) of contrail against TRL's
    ``GRPOTrainer`` on the same model, environment, tasks, group size and
    token limits, each in its own process (wall time per step, peak RSS).
    TRL 1.16 has no loop for text-action environments of its own (its
    ``environment_factory`` drives *tool calls* in the chat template's
    tool-calling format, which SmolLM2's and the tiny test template lack), so
    TRL runs its documented multi-turn hook, ``rollout_func``: a loop that
    generates each turn with TRL's own generation path
    (``GRPOTrainer._generate_single_turn``: ``model.generate``), steps the
    same contrail environments, and appends observations with the same chat
    ids; TRL then scores, computes advantages and updates as it always does.
(c) ``--gpu``: bf16, a random-init model of Qwen2.5-1.5B's shape (no
    download), 16 sequences of 2,048 tokens with 60% generated: tokens/s,
    peak GPU memory, fraction of the card's measured bf16 matmul rate.
(d) ``--allocator``: a quickstart-shaped bf16 LoRA update (r 16, 24
    sequences of 400 tokens unless ``--batch``/``--seq-len`` say otherwise)
    in worker processes whose malloc keeps freed memory, as the ``contrail``
    command's does (`contrail.allocator`), and whose malloc is the
    system's (``CONTRAIL_MALLOC=system``), alternating: update seconds,
    the kernel's share of them (page faults), peak RSS.

Every process runs as the ``contrail`` command does (`contrail.allocator`),
except (b)'s TRL worker, which runs with the system's malloc as TRL's own
users do (``--trl-malloc kept`` gives it contrail's).

    python bench/grpo_step.py --quick          # (a) + (b), a few minutes on 2 cores
    python bench/grpo_step.py --compare-model smollm2-135m --steps 3
    python bench/grpo_step.py --gpu            # on a CUDA machine
    python bench/grpo_step.py --allocator      # (d), about 4 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time

import torch
from _common import (
    console,
    fmt,
    load_policy,
    matmul_flops,
    median,
    parameter_count,
    peak_rss_mb,
    prepare_process,
    print_machine,
    table,
    timed,
    write_json,
)

from contrail.allocator import OPT_OUT, keeps_freed_memory  # after _common, which puts the repo on sys.path


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the defaults below (a few minutes on 2 CPU cores)")
    # (a)
    parser.add_argument("--model", default="smollm2-135m", help="model for (a): 'tiny', 'smollm2-135m', an id")
    parser.add_argument("--batch", type=int, default=4, help="sequences per update")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--generated", type=float, default=0.6, help="share of tokens with mask 1")
    parser.add_argument("--updates", type=int, default=1, help="timed updates per precision (after one warm-up)")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--micro-batch-tokens", type=int, default=None,
                        help="default: the library's (CPU), 16384 (GPU)")
    parser.add_argument("--matmul-size", type=int, default=2048)
    # (b)
    parser.add_argument("--compare-model", default="tiny", help="model for (b): 'tiny', 'smollm2-135m', an id")
    parser.add_argument("--env", default="textcraft:easy")
    parser.add_argument("--tasks", type=int, default=2, help="tasks per step")
    parser.add_argument("--group", type=int, default=4, help="rollouts per task (GRPO group size)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="per turn")
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-episode-tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=2, help="GRPO steps per framework (the last is compared)")
    parser.add_argument("--compare-precision", choices=("fp32", "bf16"), default="fp32",
                        help="(b): bf16 = bf16 autocast over fp32 weights in both frameworks")
    parser.add_argument("--lora-r", type=int, default=0, help="(b): LoRA rank on all linear layers; 0 = full")
    parser.add_argument("--frameworks", default="contrail,trl", help="(b): which to run, comma-separated")
    parser.add_argument("--trl-malloc", choices=("system", "kept"), default="system",
                        help="(b): TRL's worker with the system's malloc (as TRL runs) or keeping freed memory "
                             "as the contrail command does")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="(b): contrail checkpoints its update's activations (TRL's GRPOConfig does by default)")
    parser.add_argument("--experiment", default=None,
                        help="(b) on an experiment file's workload: its model, first training experience, "
                             "tasks x group, turn and token limits, precision, LoRA and loss aggregation "
                             "(e.g. experiments/quickstart.yaml)")
    # which parts
    parser.add_argument("--skip-a", action="store_true")
    parser.add_argument("--skip-b", action="store_true")
    parser.add_argument("--gpu", action="store_true", help="(c) only: the Qwen2.5-1.5B-shaped bf16 update on CUDA")
    parser.add_argument("--allocator", action="store_true",
                        help="(d) only: a LoRA update with malloc keeping freed memory and not, alternating")
    parser.add_argument("--allocator-rounds", type=int, default=2, help="(d): rounds of one worker per setting")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # update:<precision> | contrail | trl
    return parser.parse_args(argv)


# --- synthetic samples -------------------------------------------------------------------


def synthetic_trajectories(vocab: int, batch: int, length: int, generated: float, turns: int = 3, seed: int = 0):
    """``batch`` multi-turn-shaped trajectories of ``length`` tokens, ``generated`` of them with mask 1.

    Layout: a prompt (half of the non-generated tokens), then ``turns``
    assistant turns (mask 1) separated by observations (the other half).
    They come in groups of two episodes of one task with rewards 1 and 0, so
    every advantage is non-zero and no sample is skipped.
    """
    from contrail.agent.rollout import Trajectory
    from contrail.envs.base import Task

    rng = random.Random(seed)
    assistant_total = round(generated * length)
    prompt = (length - assistant_total) // 2
    observation_total = length - assistant_total - prompt
    trajectories = []
    for row in range(batch):
        mask = [0] * prompt
        for turn in range(turns):
            mask += [1] * (assistant_total // turns + (turn < assistant_total % turns))
            if turn < turns - 1:
                mask += [0] * (observation_total // (turns - 1) + (turn < observation_total % (turns - 1)))
        assert len(mask) == length, (len(mask), length)
        ids = [rng.randrange(vocab) for _ in range(length)]
        trajectories.append(Trajectory(Task("bench", row // 2, "train", "easy"), ids, mask, [0.0] * length, [],
                                       reward=1.0 if row % 2 == 0 else 0.0))
    return trajectories


def grpo_trainer(model, tokenizer, precision: str, micro_batch_tokens: int | None, rollout=None, **overrides):
    """contrail's GRPOTrainer with quiet defaults; environments are not needed for ``update``."""
    from contrail import envs
    from contrail.agent.rollout import RolloutConfig
    from contrail.grpo.config import GRPOConfig
    from contrail.grpo.trainer import GRPOTrainer

    extra = {"micro_batch_tokens": micro_batch_tokens} if micro_batch_tokens else {}
    config = GRPOConfig(precision=precision, lr=1e-6, **extra, **overrides)
    return GRPOTrainer(model, tokenizer, config, rollout or RolloutConfig(), make_env=lambda task: envs.make(task.env),
                       show_progress=False)


# --- (a) one update, per precision, in a worker process -------------------------------------


def update_worker(args, precision: str, lora_r: int = 0) -> dict:
    """Time ``args.updates`` updates after one warm-up; report tokens/s, the FLOP rate and the kernel's seconds.

    ``lora_r`` > 0: a LoRA update of that rank (the quickstart's), whose FLOP rate is not reported.
    """
    if args.gpu:
        model, tokenizer = qwen15b_shaped()
    else:
        policy = load_policy(args.model)
        model, tokenizer = policy.model, policy.tokenizer
    params = parameter_count(model)
    if args.batch % 2:
        raise SystemExit(f"--batch must be even (groups of two episodes), got {args.batch}")
    lora = {"lora": True, "lora_r": lora_r, "aggregation": "seq-mean-token-mean"} if lora_r else {}
    trainer = grpo_trainer(model, tokenizer, precision, args.micro_batch_tokens, group_size=2,
                           tasks_per_step=args.batch // 2, **lora)
    trajectories = synthetic_trajectories(model.config.vocab_size, args.batch, args.seq_len, args.generated)
    tokens = args.batch * args.seq_len
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer.update(trajectories)  # warm-up: allocator, optimizer state, kernels
    kernel_before = resource.getrusage(resource.RUSAGE_SELF).ru_stime
    seconds = [timed(lambda: trainer.update(trajectories))[0] for _ in range(args.updates)]
    kernel_seconds = resource.getrusage(resource.RUSAGE_SELF).ru_stime - kernel_before
    best = min(seconds)
    # 6 x params per token for forward + backward, plus 2 x params when the
    # trainer runs a separate no-grad forward for the old log-probs (it skips it
    # when each batch gets a single optimizer step: the ratio is then 1).
    config = trainer.config
    passes = 6 if config.ppo_epochs * config.minibatches == 1 else 8
    result = {"precision": precision, "params": params, "tokens": tokens, "flop_multiplier": passes,
              "generated_tokens": sum(sum(t.mask) for t in trajectories), "seconds": seconds,
              "tokens_per_s": tokens / best, "flops_per_s": passes * params * tokens / best,
              "kernel_seconds": kernel_seconds, "malloc_keeps_freed_memory": keeps_freed_memory(),
              "peak_rss_mb": peak_rss_mb(), "threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        result["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return result


def run_worker(args, role: str, extra_env: dict | None = None) -> dict:
    """Run this script as ``--worker role`` in a fresh process; return its JSON (or the error)."""
    argv = [sys.executable, __file__, "--worker", role] + [a for a in sys.argv[1:] if a not in ("--quick",)]
    argv = _drop_option(argv, "--json")
    result = subprocess.run(argv, capture_output=True, text=True, check=False,  # the caller reports failures
                            env={**os.environ, **(extra_env or {})})
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        tail = "\n".join(result.stderr.strip().splitlines()[-15:])
        return {"error": f"exit {result.returncode}: {tail}"}
    return json.loads(lines[-1])


def _drop_option(argv: list[str], name: str) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == name:
            skip = True
            continue
        if not arg.startswith(name + "="):
            out.append(arg)
    return out


def update_throughput(args, out, device: str = "cpu") -> dict:
    precisions = args.precisions.split(",") if not args.gpu else ["bf16"]
    peaks = {p: matmul_flops(torch.float32 if p == "fp32" else torch.bfloat16, args.matmul_size, device=device)
             for p in precisions}
    results, rows = {}, []
    for precision in precisions:
        r = run_worker(args, f"update:{precision}")
        results[precision] = {**r, "matmul_peak_flops_per_s": peaks[precision]}
        if "error" in r:
            out.print(f"[red]{precision} update failed[/]: {r['error']}")
            continue
        fraction = r["flops_per_s"] / peaks[precision]
        results[precision]["fraction_of_matmul_peak"] = fraction
        rows.append([precision, f"{r['params'] / 1e6:.1f}M", r["tokens"], r["generated_tokens"],
                     " ".join(f"{s:.2f}" for s in r["seconds"]), fmt(r["tokens_per_s"]),
                     fmt(r["flops_per_s"] / 1e9, 1), fmt(peaks[precision] / 1e9, 1), f"{100 * fraction:.1f}%",
                     fmt(r.get("peak_gpu_gib", r["peak_rss_mb"] / 1024), 2)])
    if "fp32" in results and "bf16" in results and "tokens_per_s" in results["fp32"] and \
            "tokens_per_s" in results["bf16"]:
        results["bf16_over_fp32"] = results["bf16"]["tokens_per_s"] / results["fp32"]["tokens_per_s"]
    memory = "peak GPU GiB" if args.gpu else "peak RSS GiB"
    flop_multiplier = next((r["flop_multiplier"] for r in results.values()
                            if isinstance(r, dict) and "flop_multiplier" in r), "?")
    title = (f"(a) one GRPO update ({'Qwen2.5-1.5B shape' if args.gpu else args.model}): {args.batch} x "
             f"{args.seq_len} tokens, {args.generated:.0%} generated; FLOPs = "
             f"{flop_multiplier}"
             " x params x tokens")
    out.print(table(title, ["precision", "params", "tokens", "generated", "update s", "tokens/s", "GFLOP/s",
                            "matmul peak GFLOP/s", "of peak", memory], rows))
    if "bf16_over_fp32" in results:
        out.print(f"bf16 / fp32 update throughput: {results['bf16_over_fp32']:.2f}x")
    if device == "cpu":
        results["adamw_step"] = adamw_step_seconds(args, out)
    return results


def adamw_step_seconds(args, out, repeats: int = 4) -> dict:
    """One AdamW step over the model's trainable shapes: the fused kernel the trainer takes against the per-op
    loop that is PyTorch's CPU default, alternating, best of ``repeats`` each."""
    shapes = [p.shape for p in load_policy(args.model).model.parameters()]

    def optimizer(fused: bool):
        params = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
        for p in params:
            p.grad = torch.randn_like(p)
        adamw = torch.optim.AdamW(params, lr=1e-4, fused=fused)
        adamw.step()  # warm-up: the state tensors
        return adamw

    variants = {"fused": optimizer(True), "per-op": optimizer(False)}
    seconds = {name: [] for name in variants}
    for _ in range(repeats):
        for name, adamw in variants.items():
            seconds[name].append(timed(adamw.step)[0])
    best = {name: min(times) for name, times in seconds.items()}
    out.print(f"AdamW step over {args.model}'s {len(shapes)} tensors: fused {best['fused'] * 1e3:.0f} ms, "
              f"per-op {best['per-op'] * 1e3:.0f} ms: fused / per-op {best['fused'] / best['per-op']:.2f}x")
    return {"seconds": seconds, "fused_over_per_op": best["fused"] / best["per-op"]}


# --- (d) malloc keeping freed memory or not ---------------------------------------------------


def allocator_comparison(args, out) -> dict:
    """The same LoRA update in workers with freed memory kept and with the system's malloc, alternating.

    Each worker times ``args.updates`` updates after a warm-up; a setting's
    time is the median over rounds of its workers' best update.
    """
    settings = {"kept": {}, "system": {OPT_OUT: "system"}}
    results: dict[str, list[dict]] = {name: [] for name in settings}
    for round_number in range(args.allocator_rounds):
        order = list(settings) if round_number % 2 == 0 else list(reversed(settings))
        for name in order:
            result = run_worker(args, "allocator:bf16", settings[name])
            if "error" in result:
                out.print(f"[red]the {name} worker failed[/]: {result['error']}")
                return {"error": result["error"]}
            if result["malloc_keeps_freed_memory"] != (name == "kept"):
                raise SystemExit(f"the {name} worker's malloc setting did not take (CONTRAIL_MALLOC, MALLOC_*?)")
            results[name].append(result)
    best = {name: median([min(r["seconds"]) for r in runs]) for name, runs in results.items()}
    rows = [[name, " / ".join(" ".join(f"{s:.2f}" for s in r["seconds"]) for r in runs), fmt(best[name], 2),
             " / ".join(f"{r['kernel_seconds']:.2f}" for r in runs),
             fmt(max(r["peak_rss_mb"] for r in runs) / 1024, 2)] for name, runs in results.items()]
    out.print(table(f"(d) one bf16 LoRA update (r 16, {args.batch} x {args.seq_len} tokens), "
                    f"{args.allocator_rounds} alternating rounds",
                    ["malloc", "update s (per worker)", "median best s", "kernel s (per worker)", "peak RSS GiB"],
                    rows))
    ratio = best["kept"] / best["system"]
    out.print(f"freed memory kept / system malloc, update time: {ratio:.2f}x")
    return {"runs": results, "kept_over_system": ratio}


# --- (b) one full step: contrail vs TRL, each in a worker process ---------------------------------


def fixed_tasks(args):
    from contrail import envs

    name, difficulty = envs.parse_spec(args.env)
    return envs.make(name).tasks("test", difficulty)[: args.tasks]


def worker_memory() -> dict:
    """A (b) worker's peak RSS and whether its malloc kept freed memory (the table's last two columns)."""
    return {"peak_rss_mb": peak_rss_mb(), "malloc_keeps_freed_memory": keeps_freed_memory()}


def contrail_worker(args) -> dict:
    policy = load_policy(args.compare_model)
    tasks = fixed_tasks(args)

    class Fixed:  # the same tasks every step, as TRL's one-batch dataset gives
        def sample(self, n):
            return tasks[:n]

    from contrail.agent.rollout import RolloutConfig

    rollout = RolloutConfig(max_new_tokens=args.max_new_tokens, max_turns=args.max_turns,
                            max_episode_tokens=args.max_episode_tokens, temperature=1.0)
    lora = {"lora": True, "lora_r": args.lora_r} if args.lora_r else {}
    trainer = grpo_trainer(policy.model, policy.tokenizer, args.compare_precision, args.micro_batch_tokens, rollout,
                           group_size=args.group, tasks_per_step=args.tasks, aggregation=args.aggregation,
                           gradient_checkpointing=args.gradient_checkpointing,
                           skip_zero_advantage=False, **lora)  # TRL updates on zero-advantage groups too: same work
    steps = []
    for _ in range(args.steps):
        s = trainer.step(Fixed())
        steps.append({"step_s": s["step_seconds"], "rollout_s": s["rollout_seconds"], "update_s": s["update_seconds"],
                      "generated_tokens": s["generated_tokens"], "episode_tokens_mean": s["episode_tokens_mean"],
                      "turns_mean": s["turns_mean"], "updated": "skipped_update" not in s})
    return {"steps": steps, **worker_memory()}


def trl_worker(args) -> dict:
    """TRL's GRPOTrainer on the same tasks, with a multi-turn ``rollout_func`` over TRL's own generation."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from contrail import envs
    from contrail.agent.chat import ChatFormat
    from contrail.envs.base import Task

    policy = load_policy(args.compare_model)
    chat = ChatFormat.from_tokenizer(policy.tokenizer)
    tasks = fixed_tasks(args)
    timings = {"rollout_s": [], "generated_tokens": [], "episode_tokens": [], "turns": []}

    def rollout_func(prompts: list[str], trainer) -> dict:
        """Play one episode per prompt (a task as JSON): per turn one TRL generation over the live episodes."""
        start = time.perf_counter()
        episodes = []
        for prompt in prompts:
            task = Task.from_dict(json.loads(prompt))
            env = envs.make(task.env)
            observation = env.reset(task)
            ids = chat.prompt_ids(env.prompt_messages() + [{"role": "user", "content": observation}])
            episodes.append({"env": env, "prompt": ids, "completion": [], "mask": [], "reward": 0.0, "turns": 0,
                             "done": False, "limit": args.max_turns})
        while live := [e for e in episodes if not e["done"]]:
            generated, _ = trainer._generate_single_turn([e["prompt"] + e["completion"] for e in live], None, {}, 1)
            for episode, ids in zip(live, generated):
                episode["completion"] += ids
                episode["mask"] += [1] * len(ids)
                episode["turns"] += 1
                text = policy.tokenizer.decode([t for t in ids if t not in chat.stop_ids])
                step = episode["env"].step(text)
                episode["reward"] = float(step.reward)
                close = chat.close_after(ids)
                following = ([] if step.done or episode["turns"] >= episode["limit"]
                             else chat.user_turn_ids(step.observation))
                total = len(episode["prompt"]) + len(episode["completion"]) + len(close) + len(following)
                if (step.done or episode["turns"] >= episode["limit"]
                        or total + args.max_new_tokens > args.max_episode_tokens):
                    episode["done"] = True
                    continue
                episode["completion"] += close + following
                episode["mask"] += [0] * (len(close) + len(following))
        timings["rollout_s"].append(time.perf_counter() - start)
        timings["generated_tokens"].append(sum(sum(e["mask"]) for e in episodes))
        timings["episode_tokens"].append(sum(len(e["prompt"]) + len(e["completion"]) for e in episodes) / len(episodes))
        timings["turns"].append(sum(e["turns"] for e in episodes) / len(episodes))
        return {"prompt_ids": [e["prompt"] for e in episodes], "completion_ids": [e["completion"] for e in episodes],
                "logprobs": None, "env_mask": [e["mask"] for e in episodes],
                "env_reward": [e["reward"] for e in episodes]}

    def env_reward(prompts, completions, env_reward, **kwargs):
        return env_reward

    class StepClock(TrainerCallback):
        def __init__(self):
            self.marks = []

        def on_step_begin(self, *a, **k):
            self.marks.append(("begin", time.perf_counter()))

        def on_step_end(self, *a, **k):
            self.marks.append(("end", time.perf_counter()))

    dataset = Dataset.from_list([{"prompt": json.dumps(t.to_dict())} for t in tasks])
    output_dir = tempfile.mkdtemp(prefix="contrail-bench-trl-")
    config = GRPOConfig(
        output_dir=output_dir, per_device_train_batch_size=args.tasks * args.group, gradient_accumulation_steps=1,
        num_generations=args.group, max_completion_length=args.max_episode_tokens, max_steps=args.steps,
        generation_kwargs={"max_new_tokens": args.max_new_tokens},  # per turn, as contrail's max_new_tokens
        learning_rate=1e-6, beta=0.0, temperature=1.0, loss_type=TRL_LOSS[args.aggregation], num_iterations=1,
        max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
        bf16=args.compare_precision == "bf16", seed=0, disable_tqdm=True, dataloader_num_workers=0,
    )
    # contrail's LoRA defaults (alpha 32, no dropout, every linear layer), so both train the same parameters.
    peft = (LoraConfig(r=args.lora_r, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                       task_type="CAUSAL_LM") if args.lora_r else None)
    clock = StepClock()
    trainer = GRPOTrainer(model=policy.model, reward_funcs=env_reward, args=config, train_dataset=dataset,
                          processing_class=policy.tokenizer, rollout_func=rollout_func, callbacks=[clock],
                          peft_config=peft)
    trainer.train()
    begins = [t for kind, t in clock.marks if kind == "begin"]
    ends = [t for kind, t in clock.marks if kind == "end"]
    steps = []
    for i, (b, e) in enumerate(zip(begins, ends)):
        rollout_s = timings["rollout_s"][i] if i < len(timings["rollout_s"]) else float("nan")
        steps.append({"step_s": e - b, "rollout_s": rollout_s, "update_s": e - b - rollout_s,
                      "generated_tokens": timings["generated_tokens"][i],
                      "episode_tokens_mean": timings["episode_tokens"][i], "turns_mean": timings["turns"][i],
                      "updated": True})
    return {"steps": steps, **worker_memory()}


# contrail's loss aggregation -> TRL's loss_type with the same normalisation: "dapo" averages over
# all of the batch's generated tokens, "grpo" over each sequence's tokens, then over sequences.
TRL_LOSS = {"token-mean": "dapo", "seq-mean-token-mean": "grpo"}


def apply_experiment(args) -> None:
    """Take (b)'s workload from an experiment file, so the comparison is that experiment's GRPO step."""
    from contrail.experiment import load_experiment
    from contrail.precision import resolve_precision

    experiment = load_experiment(args.experiment)
    grpo, rollout = experiment.grpo, experiment.rollout
    if grpo.aggregation not in TRL_LOSS:
        raise SystemExit(f"{args.experiment}: grpo.aggregation {grpo.aggregation!r} has no TRL counterpart here "
                         f"(choose one of {', '.join(TRL_LOSS)})")
    args.compare_model = experiment.model.name
    args.env = experiment.stream.train[0]
    args.tasks, args.group = grpo.tasks_per_step, grpo.group_size
    args.max_new_tokens, args.max_turns = rollout.max_new_tokens, rollout.max_turns or args.max_turns
    args.max_episode_tokens = rollout.max_episode_tokens
    # Resolved here: both frameworks must run what contrail's ``auto`` picks on this machine (TRL takes bf16 or not).
    args.compare_precision = resolve_precision(grpo.precision, experiment.model.device)
    args.lora_r = grpo.lora_r if grpo.lora else 0
    args.aggregation = grpo.aggregation
    args.micro_batch_tokens = args.micro_batch_tokens or grpo.micro_batch_tokens
    args.gradient_checkpointing = args.gradient_checkpointing or grpo.gradient_checkpointing


def contrail_vs_trl(args, out) -> dict:
    import trl

    quiet = {"TRL_EXPERIMENTAL_SILENCE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    system_malloc = {OPT_OUT: "system"} if args.trl_malloc == "system" else {}
    environments = {"contrail": quiet, "trl": {**quiet, **system_malloc}}  # each as its own users run it
    results = {name: run_worker(args, name, environments[name]) for name in args.frameworks.split(",")}
    rows = []
    for name, r in results.items():
        if "error" in r:
            out.print(f"[red]{name} failed[/]: {r['error']}")
            continue
        for number, s in enumerate(r["steps"], 1):
            rows.append([name, number, fmt(s["step_s"], 2), fmt(s["rollout_s"], 2), fmt(s["update_s"], 2),
                         int(s["generated_tokens"]), fmt(s["episode_tokens_mean"], 0), fmt(s["turns_mean"], 2),
                         fmt(r["peak_rss_mb"], 0), "keeps freed" if r["malloc_keeps_freed_memory"] else "system"])
    out.print(table(
        f"(b) one GRPO step, contrail vs TRL {trl.__version__} (rollout_func, multi-turn): {args.compare_model}, "
        f"{args.env}, {args.tasks} tasks x group {args.group}, {args.max_turns} turns x {args.max_new_tokens} "
        f"tokens, temperature 1, {args.compare_precision}, {f'LoRA r {args.lora_r}' if args.lora_r else 'full'}, "
        f"{args.aggregation}; activations checkpointed: contrail {'yes' if args.gradient_checkpointing else 'no'}, "
        "TRL yes (its default)",
        ["framework", "step", "step s", "rollout s", "update s", "generated tokens", "tokens/episode", "turns/episode",
         "peak RSS MiB", "malloc"], rows))
    if set(results) == {"contrail", "trl"} and all("error" not in r and r["steps"] for r in results.values()):
        c, t = results["contrail"]["steps"][-1], results["trl"]["steps"][-1]
        results["trl_over_contrail_step"] = t["step_s"] / c["step_s"]
        results["trl_over_contrail_rss"] = results["trl"]["peak_rss_mb"] / results["contrail"]["peak_rss_mb"]
        out.print(f"last step: TRL / contrail wall time {results['trl_over_contrail_step']:.2f}x "
                  f"(rollout {t['rollout_s'] / c['rollout_s']:.2f}x, update {t['update_s'] / c['update_s']:.2f}x); "
                  f"peak RSS {results['trl_over_contrail_rss']:.2f}x. Sampling differs between the two, so "
                  "compare generated tokens too.")
        out.print("Both take the old log-probs from the training forward when on-policy (one optimizer step per "
                  "batch; no extra forward). TRL's step also includes its Trainer bookkeeping (dataloader, metrics).")
    return results


# --- (c) the GPU shape ------------------------------------------------------------------------------


def qwen15b_shaped():
    """A random-init model with Qwen2.5-1.5B's shape and a tiny tokenizer (nothing is downloaded)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from contrail.testing import tiny_tokenizer

    config = Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                         tie_word_embeddings=True, rope_theta=1_000_000.0)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    # Only the tokenizer's pad id and chat template are read by the update; the
    # synthetic ids span the model's own vocabulary (``model.config.vocab_size``).
    return model, tiny_tokenizer()


def require_cuda() -> None:
    if not torch.cuda.is_available():
        raise SystemExit(
            "--gpu needs a CUDA device, and torch.cuda.is_available() is False here "
            f"(torch {torch.__version__}). Run (c) on a GPU machine; on CPU run without --gpu."
        )


def main(argv=None) -> None:
    args = parse_args(argv)
    args.aggregation = "token-mean"
    if args.experiment:
        apply_experiment(args)
    if args.gpu:
        require_cuda()
        args.batch, args.seq_len = (16, 2048) if "--batch" not in sys.argv else (args.batch, args.seq_len)
        args.micro_batch_tokens = args.micro_batch_tokens or 16384
        args.matmul_size = max(args.matmul_size, 8192)
    if args.allocator and "--batch" not in sys.argv:
        args.batch, args.seq_len, args.updates = 24, 400, max(args.updates, 2)
    if args.worker:
        prepare_process(args.threads)
        role, _, precision = args.worker.partition(":")
        result = {"update": lambda: update_worker(args, precision),
                  "allocator": lambda: update_worker(args, precision, lora_r=args.lora_r or 16),
                  "contrail": lambda: contrail_worker(args),
                  "trl": lambda: trl_worker(args)}[role]()
        print(json.dumps(result, default=str))
        return
    prepare_process(args.threads)
    out = console()
    info = print_machine(out)
    report = {"machine": info, "args": vars(args)}
    if args.gpu:
        report["update"] = update_throughput(args, out, device="cuda")
    elif args.allocator:
        report["allocator"] = allocator_comparison(args, out)
    else:
        if not args.skip_a:
            report["update"] = update_throughput(args, out)
        if not args.skip_b:
            report["step"] = contrail_vs_trl(args, out)
    write_json(args.json, report)


if __name__ == "__main__":
    main()
