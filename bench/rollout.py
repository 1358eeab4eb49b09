"""Rollout throughput: batched against one-episode-at-a-time, and turn cost against history length.

(a) The same model, tasks and sampling play the same episodes twice in one
    run: all together (one batched generation per turn, contrail's rollout)
    and one episode at a time (a batch of one). Greedy decoding by default,
    so both runs generate the same continuations and do the same work; the
    ratio of their rates is the gain from batching.
(b) One batched generation turn (fixed new tokens, no stop) timed at
    histories of 1, 2, 4, 8, 16 turns, twice: re-prefilling the whole
    history (``reuse_cache=False``: the cost grows with the history) and
    with the backend's kept KV cache (the default: only the new turn's
    tokens are prefilled). Also the prefill alone (a 1-token turn).
(f) The attention of a turn's prefill at the quickstart evaluation's shapes
    (rows, new tokens, cached keys, left padding as measured there), in bf16
    and fp32: row by row over each row's visible keys
    (`contrail.agent.attention.decode_attention` as on a CPU without AMX
    tiles: bf16 from 64 new tokens, else SDPA) against PyTorch's SDPA
    kernel, alternating, one layer's call; and which of the two contrail
    uses on this CPU (SDPA where it has AMX).
(e) An experiment's evaluation episodes (its test experiences in its
    proportions, its rollout limits and sampling, one batch) played with
    the HF backend's ``park_stopped`` on and off, in alternating rounds on
    one loaded model: the same seeded episodes either way, so the ratio is
    what parking stopped rows saves.
(g) ``--evaluation-order``: an experiment's whole evaluation (every test
    task, its ``eval.batch_episodes``), batched by opening length
    (contrail's default) against batches in task order, in alternating
    rounds on one loaded model. Each episode draws its own seeded numbers,
    so only rounding in differently shaped batches can part their episodes.
(h) ``--buckets A,B``: an experiment's whole evaluation with a turn's new
    parts prefilled in at most A and at most B length buckets
    (``HFBackend(max_buckets=)``), in alternating rounds on one loaded model.
(i) ``--experience-batches``: an experiment's whole evaluation with each
    test experience in batches of its own (contrail's default) against all
    experiences mixed by opening length, alternating on one loaded model,
    and per experience how many episodes the two played differently (in
    bf16, rounding that depends on a batch's shape).
(j) ``--buffer-pool``: an experiment's whole evaluation with the KV caches'
    buffers from `contrail.agent.buffer_pool` against from the heap,
    alternating in one process (whose malloc keeps freed memory, as the
    ``contrail`` command's), with the process's system seconds in each round:
    the first round of each pays for its fresh memory, later rounds reuse it.
(k) ``--pool-huge-pages``: the same with two pools, one with 4 kB pages
    (contrail's) and one whose memory asks for 2 MB pages
    (``BufferPool(huge_pages=True)``), alternating, 4 kB pages first.
(l) ``--packed-weights``: an experiment's whole evaluation with sampling's linear layers on weights packed
    once per call for oneDNN (`contrail.agent.packed_linear`, the default) against autocast's plain bf16
    weights, alternating on one loaded model, and how many episodes differ (none expected: the same
    kernel on the same values); then one linear product per weight shape of the model, both ways, at
    8, 64 and 2,000 rows (a small decode batch, a full one, a prefill).

    python bench/rollout.py --quick                       # embedded SmolLM2-135M, a few minutes on 2 cores
    python bench/rollout.py --model tiny                  # random 2-layer model: overheads only
    python bench/rollout.py --env babyai:easy --episodes 16 --max-new-tokens 64 --json out.json
    /work/venv-vllm/bin/python bench/rollout.py --vllm --json vllm.json   # (c), SmolLM2, ~10 minutes here
    python bench/rollout.py --decode                      # (d) the HF backend's CPU decoding, side by side
    python bench/rollout.py --evaluation experiments/quickstart.yaml --model runs/quickstart/stage-00 \
        --eval-episodes 64 --repeats 2                    # (e) parking stopped rows, on and off, alternating
    python bench/rollout.py --prefill-attention           # (f) a turn's prefill attention, row spans vs SDPA
    python bench/rollout.py --evaluation experiments/quickstart.yaml --model runs/quickstart/stage-00 \
        --evaluation-order                                # (g) batches by opening length vs task order
    python bench/rollout.py --evaluation experiments/quickstart.yaml --model runs/quickstart/stage-00 \
        --buckets 3,6                                     # (h) at most 3 against at most 6 prefill buckets
    python bench/rollout.py --evaluation experiments/quickstart.yaml --experience-batches   # (i) apart vs mixed
    python bench/rollout.py --evaluation experiments/quickstart.yaml --model runs/quickstart/stage-00 \
        --buffer-pool                                     # (j) KV buffers from the pool vs the heap
    python bench/rollout.py --evaluation experiments/quickstart.yaml --model runs/quickstart/stage-00 \
        --packed-weights                                  # (l) linears on packed weights vs autocast's
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch
from _common import console, fmt, load_policy, median, prepare_process, print_machine, repeat, table, timed, write_json

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
    parser.add_argument("--vllm", action="store_true", help="run (c) only: vLLM against HF")
    parser.add_argument("--train-episodes", type=int, default=32, help="(c) training-sized batch (groups of 8)")
    parser.add_argument("--eval-episodes", type=int, default=64, help="(c) evaluation-sized batch; (e) episodes played")
    parser.add_argument("--eval-temperature", type=float, default=0.7, help="(c) evaluation sampling temperature")
    parser.add_argument("--vllm-eager", action="store_true", help="(c) enforce_eager: no compilation")
    parser.add_argument("--vllm-backends", default="hf,vllm", help="(c) backends to time (a partial rerun)")
    parser.add_argument("--vllm-batches", default="train,eval", help="(c) batches to play (a partial rerun)")
    parser.add_argument("--decode", action="store_true",
                        help="run (d) only: the HF backend's CPU decoding against its plain path")
    parser.add_argument("--evaluation", default=None, metavar="EXPERIMENT",
                        help="run (e) only: EXPERIMENT's evaluation batch with stopped rows parked and not")
    parser.add_argument("--evaluation-order", action="store_true",
                        help="with --evaluation, run (g) instead of (e): batches by opening length vs task order")
    parser.add_argument("--buckets", default=None, metavar="A,B",
                        help="with --evaluation, run (h) instead of (e): at most A against at most B prefill buckets")
    parser.add_argument("--experience-batches", action="store_true",
                        help="with --evaluation, run (i) instead of (e): experiences in batches apart vs mixed")
    parser.add_argument("--buffer-pool", action="store_true",
                        help="with --evaluation, run (j) instead of (e): KV buffers from the pool vs the heap")
    parser.add_argument("--pool-huge-pages", action="store_true",
                        help="with --evaluation, run (k) instead of (e): the pool's memory in 2 MB vs 4 kB pages")
    parser.add_argument("--packed-weights", action="store_true",
                        help="with --evaluation, run (l) instead of (e): linears on packed weights vs autocast's")
    parser.add_argument("--prefill-attention", action="store_true",
                        help="run (f) only: a prefill's attention, row spans against SDPA's kernel")
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


def expert_turns(policy, env_spec: str) -> tuple[list[int], list[tuple[list[int], list[int]]]]:
    """A real episode's ids: the prompt, and per turn (assistant ids, the ids appended after them).

    The expert plays the task through the rollout path, so the sizes are
    those of real turns in this environment with this tokenizer.
    """
    name, difficulty = envs.parse_spec(env_spec)
    task = envs.make(name).tasks("test", difficulty)[0]
    config = RolloutConfig(max_new_tokens=256, max_episode_tokens=32768, max_turns=30)
    trajectory = rollout(ExpertBackend(policy.chat), policy.chat, [task], lambda t: envs.make(t.env), config)[0]
    ids, mask = trajectory.ids, trajectory.mask
    first = mask.index(1)
    turns, i = [], first
    while i < len(ids):
        j = i
        while j < len(ids) and mask[j] == 1:
            j += 1
        k = j
        while k < len(ids) and mask[k] == 0:
            k += 1
        turns.append((ids[i:j], ids[j:k]))
        i = k
    return ids[:first], turns


def history(prompt: list[int], turns: list[tuple[list[int], list[int]]], count: int) -> list[int]:
    """The prompt plus ``count - 1`` earlier turns (cycling the episode's turns if it was shorter)."""
    ids = list(prompt)
    for k in range(count - 1):
        assistant, after = turns[k % len(turns)]
        ids += assistant + after
    return ids


def turn_cost(policy, args, out) -> dict:
    """One batched turn at growing histories: re-prefilling everything, and with the kept KV cache."""
    prompt, turns = expert_turns(policy, args.env)
    pad = policy.tokenizer.pad_token_id
    # No stop ids: every turn generates exactly the same number of tokens.
    fresh = HFBackend(policy.model, frozenset(), pad, seed=0, reuse_cache=False)
    kept = HFBackend(policy.model, frozenset(), pad, seed=0, reuse_cache=True)
    turn = SamplingParams(args.history_new_tokens, temperature=0.0)
    prefill = SamplingParams(1, temperature=0.0)
    batch = args.history_batch
    fresh.generate([prompt] * batch, turn)  # warm-up once: first-call allocations
    rows, results = [], []
    for count in [int(t) for t in args.history_turns.split(",")]:
        prompts = [history(prompt, turns, count)] * batch
        # Interleaved, so a burst of load on the shared machine hits all three alike.
        full, only_prefill, reused = [], [], []
        for _ in range(args.repeats):
            full.append(timed(lambda: fresh.generate(prompts, turn))[0])  # noqa: B023 - called at once, inside the loop
            only_prefill.append(timed(lambda: fresh.generate(prompts, prefill))[0])  # noqa: B023 - called at once, inside the loop
            if count > 1:  # the previous turn leaves its cache; this turn prefills only what is new
                before = history(prompt, turns, count - 1)
                generated = kept.generate([before] * batch, turn)
                after = turns[(count - 2) % len(turns)][1]
                reused.append(timed(lambda: kept.generate([before + g.ids + after for g in generated], turn))[0])  # noqa: B023 - called at once, inside the loop
        results.append({"turns": count, "history_tokens": len(prompts[0]), "turn_ms": 1e3 * median(full),
                        "prefill_ms": 1e3 * median(only_prefill),
                        "kept_cache_turn_ms": 1e3 * median(reused) if reused else 1e3 * median(full)})
    first = results[0]["turn_ms"]
    for r in results:
        r["ratio_to_turn_1"] = r["turn_ms"] / first
        r["kept_ratio_to_turn_1"] = r["kept_cache_turn_ms"] / first
        rows.append([r["turns"], r["history_tokens"], fmt(r["turn_ms"]), fmt(r["ratio_to_turn_1"], 2) + "x",
                     fmt(r["prefill_ms"]), fmt(r["kept_cache_turn_ms"]), fmt(r["kept_ratio_to_turn_1"], 2) + "x"])
    out.print(table(
        f"(b) one batched turn: batch {batch}, {args.history_new_tokens} greedy tokens, histories from an expert "
        f"{args.env} episode ({len(turns)} turns, cycled beyond); median of {args.repeats}",
        ["turns in history", "history tokens", "ms/turn, re-prefill", "vs turn 1", "prefill ms (1 token)",
         "ms/turn, kept KV cache", "vs turn 1"], rows))
    out.print("re-prefill: HFBackend(reuse_cache=False), the whole history is prefilled every turn. kept KV cache: "
              "the default backend, which keeps the previous turn's cache and prefills only the new tokens.")
    return {"expert_episode_turns": len(turns), "prompt_tokens": len(prompt), "rows": results}


# --- (c) vLLM against HF ----------------------------------------------------------------


def vllm_vs_hf(policy, args, out) -> dict:
    """Both backends on the same batches; HF is timed first, before the engine exists in the process.

    The in-process engine binds the process's OpenMP threads; timing HF first
    keeps that from counting against it.
    """
    from contrail.agent.vllm import VLLMConfig
    from contrail.policy import Policy

    name, difficulty = envs.parse_spec(args.env)
    pool = envs.make(name).tasks("test", difficulty)
    make_env = lambda task: envs.make(task.env)  # noqa: E731
    group = 8
    batches = {
        "train": ([task for task in pool[: max(1, args.train_episodes // group)] for _ in range(group)], 1.0),
        "eval": ((pool * args.eval_episodes)[: args.eval_episodes], args.eval_temperature),
    }
    configs = {label: RolloutConfig(max_new_tokens=args.max_new_tokens, max_episode_tokens=8192,
                                    temperature=temperature, max_turns=args.max_turns)
               for label, (_, temperature) in batches.items()}
    import vllm

    out.print(f"vllm {vllm.__version__}")
    model, tokenizer = policy.model, policy.tokenizer
    hf = Policy.from_model(model, tokenizer, seed=0, max_batch_size=64, autocast_bf16=True)
    engine = RolloutConfig(max_new_tokens=args.max_new_tokens, max_episode_tokens=8192, backend="vllm",
                           vllm=VLLMConfig(dtype="bfloat16", enforce_eager=args.vllm_eager))
    batches = {label: batches[label] for label in args.vllm_batches.split(",")}
    results: dict = {label: {} for label in batches}
    backends = args.vllm_backends.split(",")
    for backend in backends:
        if backend == "vllm":
            load_s, sampler = timed(lambda: Policy.from_model(model, tokenizer, seed=0, max_batch_size=64,
                                                              rollout=engine))
            out.print(f"vLLM engine built and loaded in {load_s:.1f}s (enforce_eager={args.vllm_eager})")
            results["vllm_load_seconds"] = load_s
        else:
            sampler = hf
        for label, (tasks, _) in batches.items():
            play(sampler, tasks[:2], make_env, configs[label], seed=1, batched=True)  # warm-up
            results[label][backend] = rate(sampler, tasks, make_env, configs[label], seed=0)
            r = results[label][backend]
            r["load_average_1min"] = os.getloadavg()[0]  # other jobs on the cores skew the ratio: say so
            out.print(f"  {label} {backend}: {r['episodes']} episodes, {r['generated_tokens']} tokens, "
                      f"{r['seconds']:.1f}s (load avg {r['load_average_1min']:.1f} after it)")
    rows = []
    for label in batches if backends == ["hf", "vllm"] else ():
        r = results[label]
        r["episodes_per_s_ratio"] = r["vllm"]["episodes_per_s"] / r["hf"]["episodes_per_s"]
        r["tokens_per_s_ratio"] = r["vllm"]["tokens_per_s"] / r["hf"]["tokens_per_s"]
        for backend in ("hf", "vllm"):
            b = r[backend]
            rows.append([label, backend, b["episodes"], b["turns"], b["generated_tokens"], fmt(b["seconds"], 1),
                         fmt(b["episodes_per_s"], 3), fmt(b["tokens_per_s"], 1)])
        rows.append([label, "vllm / hf", "", "", "", "", fmt(r["episodes_per_s_ratio"], 2) + "x",
                     fmt(r["tokens_per_s_ratio"], 2) + "x"])
    out.print(table(
        f"(c) vLLM against HF: {args.env} test tasks, max_turns {args.max_turns}, max_new_tokens "
        f"{args.max_new_tokens}; train = groups of {group} at temperature 1, eval = distinct tasks at "
        f"temperature {args.eval_temperature}; same tasks and seeds for both; both bf16",
        ["batch", "backend", "episodes", "turns", "gen tokens", "seconds", "episodes/s", "gen tokens/s"], rows))
    return results


# --- (d) the HF backend's CPU decoding against its plain path -----------------------------


def decode_paths(policy, args, out) -> dict:
    """The quickstart's two batch shapes played by the HF backend twice, side by side, greedily.

    "plain": every prompt prefilled in full, each turn's new parts padded to the
    longest, decode steps through transformers' SDPA (``share_prefix=False,
    decode_attention=False``). "contrail": the defaults (shared prefixes and
    identical prompts prefilled once, length buckets, the direct decode-step
    attention). Greedy decoding, so both play the same episodes; sampling's
    own cost (inverse CDF against ``torch.multinomial``) is timed apart.
    """
    from contrail.stream import Experience, env_factory

    experience = Experience.from_spec("babyai:easy", test_tasks=64)
    config = RolloutConfig(max_new_tokens=40, max_episode_tokens=2048, temperature=0.0, max_turns=4)
    shapes = {"GRPO step (6 tasks x 4)": [t for t in experience.test_tasks[:6] for _ in range(4)],
              "evaluation (64 tasks)": list(experience.test_tasks)}
    make_env = env_factory([experience])
    backends = {
        "plain": HFBackend(policy.model, policy.chat.stop_ids, policy.tokenizer.pad_token_id, autocast_bf16=True,
                           share_prefix=False, decode_attention=False),
        "contrail": HFBackend(policy.model, policy.chat.stop_ids, policy.tokenizer.pad_token_id, autocast_bf16=True),
    }
    results, rows = {}, []
    for shape, tasks in shapes.items():
        for label, backend in backends.items():
            start = time.perf_counter()
            trajectories = rollout(backend, policy.chat, tasks, make_env, config)
            seconds = time.perf_counter() - start
            tokens = sum(t.generated_tokens for t in trajectories)
            results[f"{shape}/{label}"] = {"seconds": seconds, "episodes": len(trajectories),
                                           "generated_tokens": tokens, "ids": [t.ids for t in trajectories]}
        plain, mine = results[f"{shape}/plain"], results[f"{shape}/contrail"]
        same = plain["ids"] == mine["ids"]
        rows.append([shape, plain["episodes"], plain["generated_tokens"], fmt(plain["seconds"], 1),
                     fmt(mine["seconds"], 1), fmt(plain["seconds"] / mine["seconds"], 2) + "x",
                     "yes" if same else "no (bf16 rounding)"])
    out.print(table("(d) babyai:easy, SmolLM2 in bf16 autocast, 4 turns x 40 tokens, greedy",
                    ["batch", "episodes", "gen tokens", "plain s", "contrail s", "speed-up", "same episodes"], rows))
    results["sampling"] = sampling_cost(out)
    for value in results.values():
        value.pop("ids", None)
    return results


def sampling_cost(out) -> dict:
    """One sampling step at batch 64 over a 49k vocabulary: inverse CDF against ``torch.multinomial``."""
    import torch

    from contrail.agent.backend import draw

    probs = torch.softmax(torch.randn(64, 49_152), -1)
    generator = torch.Generator().manual_seed(0)
    multinomial = median([timed(lambda: torch.multinomial(probs, 1, generator=generator))[0] for _ in range(9)])
    inverse = median([timed(lambda: draw(probs, generator))[0] for _ in range(9)])
    out.print(f"sampling one token for 64 rows: torch.multinomial {multinomial * 1e3:.1f} ms, "
              f"inverse CDF {inverse * 1e3:.1f} ms ({multinomial / inverse:.1f}x)")
    return {"multinomial_s": multinomial, "inverse_cdf_s": inverse}


# --- (e) stopped rows leaving the decode batch -------------------------------------------------


def parking(policy, args, out) -> dict:
    """An experiment's evaluation played with ``park_stopped`` on and off, in alternating rounds, one batch.

    The experiment's own test tasks (about ``--eval-episodes`` in all, each
    test experience's first, in the experiment's proportions), evaluation
    rollout, k and per-episode seeds, in its precision: both settings play
    the same episodes (checked); only where stopped rows sit during decode differs.
    """
    from contrail.evaluation import evaluate
    from contrail.experiment import build_stream, load_experiment
    from contrail.precision import resolve_precision
    from contrail.seeds import derive_seed
    from contrail.stream import env_factory

    experiment = load_experiment(args.evaluation)
    stream = build_stream(experiment)
    total = sum(len(e.test_tasks) for e in stream.test)
    tasks = {e.name: e.test_tasks[:max(1, round(args.eval_episodes * len(e.test_tasks) / total))] for e in stream.test}
    episodes = sum(len(t) for t in tasks.values()) * experiment.eval.k
    bf16 = resolve_precision(experiment.grpo.precision, next(policy.model.parameters()).device) == "bf16"
    seconds: dict[str, list[float]] = {"parked": [], "kept": []}
    played: dict[str, list] = {}
    for _ in range(args.repeats):
        for label, park in (("parked", True), ("kept", False)):
            backend = HFBackend(policy.model, policy.chat.stop_ids, policy.tokenizer.pad_token_id,
                                autocast_bf16=bf16, max_batch_size=episodes, park_stopped=park)
            trajectories: dict[str, list] = {}
            start = time.perf_counter()
            evaluate(backend, policy.chat, tasks, env_factory(stream.experiences), k=experiment.eval.k,
                     config=experiment.eval_rollout, batch_episodes=episodes, show_progress=False,
                     episodes=trajectories, seed=derive_seed(experiment.seed, "eval"))
            seconds[label].append(time.perf_counter() - start)
            played[label] = [t.ids for name in tasks for t in trajectories[name]]
    tokens = sum(len(ids) for ids in played["parked"])
    same = played["parked"] == played["kept"]
    ratio = median(seconds["parked"]) / median(seconds["kept"])
    rows = [[episodes, tokens, " / ".join(fmt(s, 1) for s in seconds["kept"]),
             " / ".join(fmt(s, 1) for s in seconds["parked"]), fmt(ratio, 2) + "x", "yes" if same else "no (rounding)"]]
    out.print(table(f"(e) {args.evaluation}: its evaluation as one batch, {'bf16' if bf16 else 'fp32'}, "
                    f"{args.repeats} alternating rounds",
                    ["episodes", "episode tokens", "stopped rows kept (s)", "parked (s)", "median ratio",
                     "same episodes"], rows))
    return {"episodes": episodes, "tokens": tokens, "seconds": seconds, "ratio": ratio, "same_episodes": same}


# --- (g) evaluation batches by opening length ---------------------------------------------------


def alternate_evaluations(policy, args, variants: dict) -> tuple[dict, dict, int, int, bool, dict, dict]:
    """``args.evaluation``'s whole evaluation once per variant in each of ``args.repeats`` rounds, alternating.

    ``variants`` maps a label to ``(backend options, evaluate options)``, or with a third element, a function
    returning the context manager each of its rounds runs in. Returns the seconds and the avg@k per label, the
    episodes, the batch size, whether it ran in bf16, the episodes' token ids and the system seconds per label.
    """
    from contrail.evaluation import evaluate
    from contrail.experiment import build_stream, load_experiment
    from contrail.precision import resolve_precision
    from contrail.seeds import derive_seed
    from contrail.stream import env_factory

    experiment = load_experiment(args.evaluation)
    stream = build_stream(experiment)
    tasks = {e.name: e.test_tasks for e in stream.test}
    bf16 = resolve_precision(experiment.grpo.precision, next(policy.model.parameters()).device) == "bf16"
    batch = experiment.eval.batch_episodes
    seconds: dict = {label: [] for label in variants}
    scores: dict = {}
    played: dict = {}
    system_seconds: dict = {label: [] for label in variants}
    for _ in range(args.repeats):
        for label, (backend_options, evaluate_options, *setting) in variants.items():
            backend = HFBackend(policy.model, policy.chat.stop_ids, policy.tokenizer.pad_token_id,
                                autocast_bf16=bf16, max_batch_size=batch, **backend_options)
            trajectories: dict = {}
            start, system = time.perf_counter(), os.times().system
            with setting[0]() if setting else contextlib.nullcontext():
                results = evaluate(backend, policy.chat, tasks, env_factory(stream.experiences),
                                   k=experiment.eval.k, config=experiment.eval_rollout, batch_episodes=batch,
                                   show_progress=False, seed=derive_seed(experiment.seed, "eval"),
                                   episodes=trajectories, **evaluate_options)
                del backend  # its kept cache goes back (to the pool, inside the setting) before the next round
            seconds[label].append(time.perf_counter() - start)
            system_seconds[label].append(os.times().system - system)
            scores[label] = {name: result.avg_at_k for name, result in results.items()}
            played[label] = {name: [t.ids for t in episodes] for name, episodes in trajectories.items()}
    episodes = sum(len(t) for t in tasks.values()) * experiment.eval.k
    return seconds, scores, episodes, batch, bf16, played, system_seconds


def _evaluation_rows(seconds: dict, scores: dict) -> list[list[str]]:
    return [[label, " / ".join(fmt(s, 1) for s in seconds[label]),
             ", ".join(f"{name} {score:.3f}" for name, score in scores[label].items())] for label in seconds]


def evaluation_order(policy, args, out) -> dict:
    """An experiment's whole evaluation, batched by opening length and in task order, alternating rounds."""
    variants = {"task order": ({}, {"by_opening_length": False}),
                "by opening length": ({}, {"by_opening_length": True})}
    seconds, scores, episodes, batch, bf16, _, _ = alternate_evaluations(policy, args, variants)
    ratio = median(seconds["by opening length"]) / median(seconds["task order"])
    out.print(table(f"(g) {args.evaluation}: its evaluation, {episodes} episodes in batches of {batch}, "
                    f"{'bf16' if bf16 else 'fp32'}, {args.repeats} alternating rounds; "
                    f"by opening length / task order: {fmt(ratio, 2)}x (medians)",
                    ["batches", "seconds", "avg@k"], _evaluation_rows(seconds, scores)))
    return {"episodes": episodes, "batch_episodes": batch, "seconds": seconds, "ratio": ratio, "avg_at_k": scores}


# --- (i) evaluation batches per experience -------------------------------------------------------


def experience_batches(policy, args, out) -> dict:
    """An experiment's whole evaluation with each experience in batches of its own and all mixed, alternating.

    Both play every episode from the same seeded streams; the table counts,
    per experience, the episodes whose tokens differ between the two: in
    bf16, rounding that depends on a batch's shape (fp32 should show none).
    """
    variants = {"mixed": ({}, {"mixed_batches": True}), "apart": ({}, {})}
    seconds, scores, episodes, batch, bf16, played, _ = alternate_evaluations(policy, args, variants)
    differ = _episodes_that_differ(played, "mixed", "apart")
    ratio = median(seconds["apart"]) / median(seconds["mixed"])
    out.print(table(f"(i) {args.evaluation}: its evaluation, {episodes} episodes in batches of {batch}, "
                    f"{'bf16' if bf16 else 'fp32'}, {args.repeats} alternating rounds; "
                    f"apart / mixed: {fmt(ratio, 2)}x (medians); episodes that differ: "
                    f"{_differ_text(differ, played['apart'])}",
                    ["experiences", "seconds", "avg@k"], _evaluation_rows(seconds, scores)))
    return {"episodes": episodes, "batch_episodes": batch, "seconds": seconds, "ratio": ratio, "avg_at_k": scores,
            "episodes_that_differ": differ}


# --- (j) the KV buffer pool ---------------------------------------------------------------------


def buffer_pool(policy, args, out) -> dict:
    """An experiment's whole evaluation with KV buffers from a `BufferPool` and from the heap, alternating."""
    from contrail.agent.buffer_pool import BufferPool

    pool = BufferPool(_physical_memory())  # as `buffer_pool.pool` reserves
    report = _alternating_buffers(policy, args, out, "j", {"heap": None, "pool": pool},
                                  lambda: f"the pool's high-water mark {pool.high_water / 1e9:.2f} GB")
    return {**report, "pool_high_water": pool.high_water}


def pool_huge_pages(policy, args, out) -> dict:
    """An experiment's whole evaluation with KV buffers from a pool of 4 kB pages and one of 2 MB pages, alternating."""
    from contrail.agent.buffer_pool import BufferPool

    huge = BufferPool(_physical_memory(), huge_pages=True)
    sources = {"4 kB pages": BufferPool(_physical_memory()), "2 MB pages": huge}
    return _alternating_buffers(policy, args, out, "k", sources, lambda: f"huge pages granted: {huge.huge_pages}")


def _alternating_buffers(policy, args, out, mark: str, sources: dict, note) -> dict:
    """The whole evaluation with KV buffers from each of ``sources`` (label -> pool, None: the heap) in alternating
    rounds, the first label first and the baseline of the ratio; ``note()`` adds to the table's title."""
    from contrail.agent.buffer_pool import pooling

    variants = {label: ({}, {}, lambda buffers=buffers: pooling(buffers)) for label, buffers in sources.items()}
    seconds, scores, episodes, batch, bf16, played, system = alternate_evaluations(policy, args, variants)
    base, other = sources
    differ = _episodes_that_differ(played, base, other)
    ratio = median(seconds[other]) / median(seconds[base])
    rows = [[label, " / ".join(fmt(s, 1) for s in seconds[label]), " / ".join(fmt(s, 1) for s in system[label]),
             ", ".join(f"{name} {score:.3f}" for name, score in scores[label].items())] for label in seconds]
    out.print(table(f"({mark}) {args.evaluation}: its evaluation, {episodes} episodes in batches of {batch}, "
                    f"{'bf16' if bf16 else 'fp32'}, {args.repeats} alternating rounds, {base} first; {other} / {base}: "
                    f"{fmt(ratio, 2)}x (medians); {note()}; "
                    f"episodes that differ: {_differ_text(differ, played[other])}",
                    ["KV buffers", "seconds", "system seconds", "avg@k"], rows))
    return {"episodes": episodes, "batch_episodes": batch, "seconds": seconds, "system_seconds": system,
            "ratio": ratio, "avg_at_k": scores, "episodes_that_differ": differ}


# --- (l) linear layers on packed weights ------------------------------------------------------------


def packed_weights(policy, args, out) -> dict:
    """An experiment's whole evaluation with linears on packed weights and on autocast's, alternating; then
    one product per weight shape both ways."""
    variants = {"autocast weights": ({"pack_weights": False}, {}), "packed": ({"pack_weights": True}, {})}
    seconds, scores, episodes, batch, bf16, played, _ = alternate_evaluations(policy, args, variants)
    differ = _episodes_that_differ(played, "autocast weights", "packed")
    ratio = median(seconds["packed"]) / median(seconds["autocast weights"])
    out.print(table(f"(l) {args.evaluation}: its evaluation, {episodes} episodes in batches of {batch}, "
                    f"{'bf16' if bf16 else 'fp32'}, {args.repeats} alternating rounds; packed / autocast: "
                    f"{fmt(ratio, 2)}x (medians); episodes that differ: {_differ_text(differ, played['packed'])}",
                    ["linear weights", "seconds", "avg@k"], _evaluation_rows(seconds, scores)))
    products = _linear_products(policy.model, out)
    return {"episodes": episodes, "batch_episodes": batch, "seconds": seconds, "ratio": ratio, "avg_at_k": scores,
            "episodes_that_differ": differ, "products": products}


def _linear_products(model, out, rows_list=(8, 64, 2000), repeats: int = 20) -> list[dict]:
    """Milliseconds of one bf16 product per distinct linear weight shape of ``model``: autocast's and packed."""
    from contrail.agent.packed_linear import packed_linears

    shapes = sorted({tuple(m.weight.shape) for m in model.modules() if type(m) is torch.nn.Linear})
    results = []
    for rows in rows_list:
        for out_features, in_features in shapes:
            layer = torch.nn.Linear(in_features, out_features, bias=False)
            hidden = torch.randn(rows, in_features)
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                plain = median(repeat(lambda layer=layer, hidden=hidden: layer(hidden), repeats)) * 1000
                with packed_linears(layer):  # the first call (repeat's warm-up) builds oneDNN's primitive
                    packed = median(repeat(lambda layer=layer, hidden=hidden: layer(hidden), repeats)) * 1000
            results.append({"rows": rows, "shape": [out_features, in_features], "autocast_ms": plain,
                            "packed_ms": packed})
    out.print(table("(l) one bf16 linear product, autocast's weight against the packed one (medians)",
                    ["rows", "weight", "autocast ms", "packed ms", "packed / autocast"],
                    [[str(r["rows"]), "x".join(map(str, r["shape"])), fmt(r["autocast_ms"], 3),
                      fmt(r["packed_ms"], 3), fmt(r["packed_ms"] / r["autocast_ms"], 2)] for r in results]))
    return results


def _physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _episodes_that_differ(played: dict, first: str, second: str) -> dict[str, int]:
    """Per experience, how many episodes variants ``first`` and ``second`` played with other tokens."""
    return {name: sum(a != b for a, b in zip(played[first][name], played[second][name], strict=True))
            for name in played[second]}


def _differ_text(differ: dict[str, int], played: dict) -> str:
    return ", ".join(f"{name} {count} of {len(played[name])}" for name, count in differ.items())


# --- (h) prefill buckets ------------------------------------------------------------------------


def prefill_buckets(policy, args, out) -> dict:
    """An experiment's whole evaluation with at most A and at most B prefill buckets, alternating rounds."""
    counts = [int(count) for count in args.buckets.split(",")]
    variants = {f"at most {count}": ({"max_buckets": count}, {}) for count in counts}
    seconds, scores, episodes, batch, bf16, _, _ = alternate_evaluations(policy, args, variants)
    ratio = median(seconds[f"at most {counts[-1]}"]) / median(seconds[f"at most {counts[0]}"])
    out.print(table(f"(h) {args.evaluation}: its evaluation, {episodes} episodes in batches of {batch}, "
                    f"{'bf16' if bf16 else 'fp32'}, {args.repeats} alternating rounds; "
                    f"{counts[-1]} / {counts[0]} buckets: {fmt(ratio, 2)}x (medians)",
                    ["prefill buckets", "seconds", "avg@k"], _evaluation_rows(seconds, scores)))
    return {"episodes": episodes, "batch_episodes": batch, "seconds": seconds, "ratio": ratio, "avg_at_k": scores}


# --- (f) a turn's prefill attention ---------------------------------------------------------------

# (rows, new tokens, keys, most left padding): extends of the quickstart's evaluation (SmolLM2-135M, 2-core EPYC)
PREFILL_SHAPES = [(20, 147, 891, 400), (6, 460, 783, 100), (12, 115, 438, 0), (64, 30, 700, 300), (64, 8, 900, 300)]


def prefill_attention(args, out) -> dict:
    """Row-by-row prefill attention against PyTorch's SDPA kernel, SmolLM2-135M's heads (9 over 3, 64 wide)."""
    import torch

    from contrail.precision import cpu_has_amx

    rows, results = [], []
    for dtype in (torch.bfloat16, torch.float32):
        for shape in PREFILL_SHAPES:
            result = prefill_case(dtype, *shape, repeats=max(3, args.repeats))
            results.append(result)
            rows.append([str(dtype).removeprefix("torch."), *shape, fmt(result["sdpa_s"] * 1e3, 1),
                         fmt(result["row_spans_s"] * 1e3, 1), fmt(result["ratio"], 2) + "x",
                         f"{result['max_abs_difference']:.3f}", result["contrail_uses"]])
    out.print(table(f"(f) one layer's prefill attention: row by row over each row's visible keys vs SDPA, medians "
                    f"of alternating runs (this CPU {'has' if cpu_has_amx() else 'lacks'} AMX tiles)",
                    ["dtype", "rows", "new tokens", "keys", "left padding <=", "SDPA ms", "row spans ms",
                     "row spans / SDPA", "max |diff|", "contrail uses"], rows))
    return {"amx": cpu_has_amx(), "shapes": results}


def prefill_case(dtype, batch: int, queries: int, keys: int, padding: int, repeats: int) -> dict:
    """One shape timed both ways, alternating; rows left-padded by up to ``padding`` keys.

    The row-by-row side is `decode_attention` told the CPU has no AMX tiles,
    so it goes row by row wherever the shape allows; ``contrail_uses`` says
    which of the two it picks on this CPU.
    """
    import types
    from unittest import mock

    import torch

    from contrail.agent import attention

    module = types.SimpleNamespace(num_key_value_groups=3, training=False, is_causal=True)
    g = torch.Generator().manual_seed(0)
    query = torch.randn(batch, 9, queries, 64, generator=g).to(dtype)
    key, value = (torch.randn(batch, 3, keys, 64, generator=g).to(dtype) for _ in range(2))
    mask = torch.ones(batch, 1, queries, keys, dtype=torch.bool).tril(keys - queries)
    for row, start in enumerate(torch.randint(0, padding + 1, (batch,), generator=g).tolist()):
        mask[row, :, :, :start] = False  # left padding, as a batch of turns of different lengths has

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.125,
                                                                enable_gqa=True).transpose(1, 2)

    def row_spans():
        with mock.patch.object(attention, "cpu_has_amx", lambda: False):
            return attention.decode_attention(module, query, key, value, mask, scaling=0.125)[0]

    times: dict[str, list[float]] = {"sdpa": [], "row_spans": []}
    for _ in range(repeats):
        for label, run in (("sdpa", sdpa), ("row_spans", row_spans)):
            times[label].append(timed(run)[0])
    sdpa_s, row_spans_s = median(times["sdpa"]), median(times["row_spans"])
    uses = "row spans" if attention.prefills_by_row(key, mask, queries) else "SDPA"
    return {"dtype": str(dtype), "rows": batch, "queries": queries, "keys": keys, "padding": padding,
            "sdpa_s": sdpa_s, "row_spans_s": row_spans_s, "ratio": row_spans_s / sdpa_s, "contrail_uses": uses,
            "max_abs_difference": (row_spans().float() - sdpa().float()).abs().max().item()}


def rate(policy, tasks, make_env, config: RolloutConfig, seed: int) -> dict:
    """Episodes/s and generated tokens/s of one batched rollout of ``tasks``."""
    seconds, trajectories = play(policy, tasks, make_env, config, seed=seed, batched=True)
    tokens = sum(t.generated_tokens for t in trajectories)
    return {"seconds": seconds, "episodes": len(trajectories), "turns": sum(t.turns for t in trajectories),
            "generated_tokens": tokens, "episodes_per_s": len(trajectories) / seconds, "tokens_per_s": tokens / seconds}


def main(argv=None) -> None:
    args = parse_args(argv)
    prepare_process(args.threads)
    out = console()
    info = print_machine(out)
    if args.prefill_attention:
        write_json(args.json, {"machine": info, "args": vars(args), "prefill_attention": prefill_attention(args, out)})
        return
    load_s, policy = timed(lambda: load_policy(args.model))
    out.print(f"model {args.model}: {sum(p.numel() for p in policy.model.parameters()) / 1e6:.1f}M parameters, "
              f"loaded in {load_s:.1f}s")
    report = {"machine": info, "args": vars(args)}
    for wanted, key, part in (
        (args.vllm, "vllm_vs_hf", vllm_vs_hf),
        (args.evaluation and args.buckets, "prefill_buckets", prefill_buckets),
        (args.evaluation and args.buffer_pool, "buffer_pool", buffer_pool),
        (args.evaluation and args.packed_weights, "packed_weights", packed_weights),
        (args.evaluation and args.pool_huge_pages, "pool_huge_pages", pool_huge_pages),
        (args.evaluation and args.experience_batches, "experience_batches", experience_batches),
        (args.evaluation and args.evaluation_order, "evaluation_order", evaluation_order),
        (args.evaluation, "parking", parking),
        (args.decode, "decode_paths", decode_paths),
    ):
        if wanted:  # one part per run, the first asked for
            report[key] = part(policy, args, out)
            write_json(args.json, report)
            return
    if not args.skip_a:
        report["batched_vs_sequential"] = batched_vs_sequential(policy, args, out)
    if not args.skip_b:
        report["turn_cost"] = turn_cost(policy, args, out)
    write_json(args.json, report)


if __name__ == "__main__":
    main()
