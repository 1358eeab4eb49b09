"""Rollout throughput: batched against one-episode-at-a-time, and turn cost against history length.

(a) The same model, tasks and sampling play the same episodes twice in one
    run: all together (one batched generation per turn, contrail's rollout)
    and one episode at a time (a batch of one). Greedy decoding by default,
    so both runs generate the same continuations and do the same work; the
    ratio of their rates is the gain from batching.
(b) One batched generation turn (fixed new tokens, no stop) timed at
    histories of 1, 2, 4, 8, 16 turns. The rollout re-prefills the whole
    history every turn (no KV cache is kept between turns), so the prefill
    share grows with the history; this measures how much.

    python bench/rollout.py --quick                       # embedded SmolLM2-135M, a few minutes on 2 cores
    python bench/rollout.py --model tiny                  # random 2-layer model: overheads only
    python bench/rollout.py --env babyai:easy --episodes 16 --max-new-tokens 64 --json out.json
"""

from __future__ import annotations

import argparse
import time

from _common import (console, fmt, load_policy, median, print_machine, set_threads, table, timed,
                     write_json)

import contrail.envs as envs
from contrail.agent.backend import HFBackend, SamplingParams
from contrail.agent.rollout import RolloutConfig, rollout
from contrail.agent.scripted import ExpertBackend


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the defaults below (a few minutes on 2 CPU cores)")
    parser.add_argument("--model", default="smollm2-135m", help="'tiny', 'smollm2-135m' or any HF id / path")
    parser.add_argument("--env", default="textcraft:easy", help="environment spec, e.g. babyai:easy")
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 = greedy: batched and sequential runs then do the same work")
    parser.add_argument("--history-turns", default="1,2,4,8,16", help="history lengths (in turns) for part (b)")
    parser.add_argument("--history-batch", type=int, default=2)
    parser.add_argument("--history-new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2,
                        help="timed repeats per history length (median; turn and prefill interleaved)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--skip-a", action="store_true")
    parser.add_argument("--skip-b", action="store_true")
    parser.add_argument("--json", default=None, help="write the results here")
    return parser.parse_args(argv)


# --- (a) batched vs sequential ------------------------------------------------------


def play(policy, tasks, make_env, config: RolloutConfig, seed: int, batched: bool):
    """Seconds and trajectories of ``tasks`` played together or one at a time, from one seed."""
    policy.backend.reseed(seed)
    start = time.perf_counter()
    if batched:
        trajectories = rollout(policy.backend, policy.chat, tasks, make_env, config)
    else:
        trajectories = []
        for task in tasks:
            trajectories += rollout(policy.backend, policy.chat, [task], make_env, config)
    return time.perf_counter() - start, trajectories


def batched_vs_sequential(policy, args, out) -> dict:
    name, difficulty = envs.parse_spec(args.env)
    tasks = envs.make(name).tasks("test", difficulty)[: args.episodes]
    make_env = lambda task: envs.make(task.env)  # noqa: E731
    config = RolloutConfig(max_new_tokens=args.max_new_tokens, max_episode_tokens=8192,
                           temperature=args.temperature, max_turns=args.max_turns)
    play(policy, tasks[:2], make_env, config, seed=0, batched=True)  # warm-up: first-call allocations, caches
    rows, results = [], {}
    for label, batched in (("batched", True), ("one at a time", False)):
        seconds, trajectories = play(policy, tasks, make_env, config, seed=0, batched=batched)
        tokens = sum(t.generated_tokens for t in trajectories)
        turns = sum(t.turns for t in trajectories)
        results[label] = {"seconds": seconds, "episodes": len(trajectories), "turns": turns,
                          "generated_tokens": tokens, "episodes_per_s": len(trajectories) / seconds,
                          "tokens_per_s": tokens / seconds,
                          "mean_episode_tokens": sum(len(t.ids) for t in trajectories) / len(trajectories)}
    base = results["one at a time"]
    for label, r in results.items():
        rows.append([label, r["episodes"], r["turns"], r["generated_tokens"], fmt(r["mean_episode_tokens"], 0),
                     fmt(r["seconds"], 2), fmt(r["episodes_per_s"], 3), fmt(r["tokens_per_s"], 1),
                     fmt(r["tokens_per_s"] / base["tokens_per_s"], 2) + "x"])
    out.print(table(
        f"(a) {args.env} test tasks, {len(tasks)} episodes, max_turns {args.max_turns}, "
        f"max_new_tokens {args.max_new_tokens}, temperature {args.temperature}",
        ["rollout", "episodes", "turns", "gen tokens", "tokens/episode", "seconds", "episodes/s", "gen tokens/s",
         "vs one at a time"], rows))
    results["speedup_tokens_per_s"] = results["batched"]["tokens_per_s"] / base["tokens_per_s"]
    results["speedup_episodes_per_s"] = results["batched"]["episodes_per_s"] / base["episodes_per_s"]
    return results


# --- (b) turn cost against history length --------------------------------------------


def expert_chunks(policy, env_spec: str) -> tuple[list[int], list[list[int]]]:
    """A real episode's ids split into the prompt and per-turn chunks (assistant ids + next observation).

    The expert plays the task through the rollout path, so the chunk sizes are
    those of real turns in this environment with this tokenizer.
    """
    name, difficulty = envs.parse_spec(env_spec)
    task = envs.make(name).tasks("test", difficulty)[0]
    config = RolloutConfig(max_new_tokens=256, max_episode_tokens=32768, max_turns=30)
    trajectory = rollout(ExpertBackend(policy.chat), policy.chat, [task], lambda t: envs.make(t.env), config)[0]
    ids, mask = trajectory.ids, trajectory.mask
    first = mask.index(1)
    starts = [i for i in range(first, len(ids)) if mask[i] == 1 and mask[i - 1] == 0]
    bounds = starts + [len(ids)]
    return ids[:first], [ids[a:b] for a, b in zip(bounds, bounds[1:])]


def history(prompt: list[int], chunks: list[list[int]], turns: int) -> list[int]:
    """The prompt plus ``turns - 1`` earlier turns (cycling the episode's turns if it was shorter)."""
    ids = list(prompt)
    for k in range(turns - 1):
        ids += chunks[k % len(chunks)]
    return ids


def turn_cost(policy, args, out) -> dict:
    prompt, chunks = expert_chunks(policy, args.env)
    # No stop ids: every turn generates exactly the same number of tokens.
    backend = HFBackend(policy.model, frozenset(), policy.tokenizer.pad_token_id, seed=0)
    turn = SamplingParams(args.history_new_tokens, temperature=0.0)
    prefill = SamplingParams(1, temperature=0.0)
    rows, results = [], []
    backend.generate([prompt] * args.history_batch, turn)  # warm-up once: first-call allocations
    for turns in [int(t) for t in args.history_turns.split(",")]:
        prompts = [history(prompt, chunks, turns)] * args.history_batch
        # Interleaved, so a burst of load on the shared machine hits both alike.
        turn_times, prefill_times = [], []
        for _ in range(args.repeats):
            turn_times.append(timed(lambda: backend.generate(prompts, turn))[0])
            prefill_times.append(timed(lambda: backend.generate(prompts, prefill))[0])
        turn_s, prefill_s = median(turn_times), median(prefill_times)
        results.append({"turns": turns, "history_tokens": len(prompts[0]), "turn_ms": turn_s * 1e3,
                        "prefill_ms": prefill_s * 1e3})
    first = results[0]["turn_ms"]
    for r in results:
        r["ratio_to_turn_1"] = r["turn_ms"] / first
        r["prefill_share"] = r["prefill_ms"] / r["turn_ms"]
        rows.append([r["turns"], r["history_tokens"], fmt(r["turn_ms"]), fmt(r["ratio_to_turn_1"], 2) + "x",
                     fmt(r["prefill_ms"]), f"{100 * r['prefill_share']:.0f}%"])
    out.print(table(
        f"(b) one batched turn: batch {args.history_batch}, {args.history_new_tokens} greedy tokens, "
        f"histories from an expert {args.env} episode ({len(chunks)} turns, cycled beyond)",
        ["turns in history", "history tokens", "ms/turn", "vs turn 1", "prefill ms (1 token)", "prefill share"],
        rows))
    out.print("The rollout re-prefills the whole history each turn (no KV reuse across turns): "
              "the prefill column is that cost.")
    return {"expert_episode_turns": len(chunks), "prompt_tokens": len(prompt), "rows": results}


def main(argv=None) -> None:
    args = parse_args(argv)
    set_threads(args.threads)
    out = console()
    info = print_machine(out)
    load_s, policy = timed(lambda: load_policy(args.model))
    out.print(f"model {args.model}: {sum(p.numel() for p in policy.model.parameters()) / 1e6:.1f}M parameters, "
              f"loaded in {load_s:.1f}s")
    report = {"machine": info, "args": vars(args)}
    if not args.skip_a:
        report["batched_vs_sequential"] = batched_vs_sequential(policy, args, out)
    if not args.skip_b:
        report["turn_cost"] = turn_cost(policy, args, out)
    write_json(args.json, report)


if __name__ == "__main__":
    main()
