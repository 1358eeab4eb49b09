"""Environment costs against generation: is the environment ever the bottleneck?

For every registered environment (one that fails to import is skipped with
a note):

- first use in a fresh process, twice: with an empty disk cache (indices,
  catalogues, generated games are built) and with the cache the first run
  left (loaded); then a second construction in the same process (the
  in-memory cache). Each is split into import, construct, tasks(), reset()
  and the first step;
- per-episode costs over ``--episodes`` expert episodes: construct, reset,
  step (the expert's text through ``step()``), and the expert itself;
- ``step()`` on 1 MB adversarial outputs (whitespace runs, unclosed tags,
  brackets, thousands of action lines): parsing must stay linear, so a model
  that never stops cannot stall a rollout (``--parse-only`` runs just this);
- one batched generation turn of the model on that environment's first
  prompts (``--gen-batch`` episodes x ``--gen-tokens`` tokens, no stop),
  measured in the same run, and the ratio of the environments' share of a
  turn (``gen-batch`` steps) to it.

    python bench/envs.py --quick                      # all environments, a few minutes on 2 cores
    python bench/envs.py --envs textcraft,webshop --episodes 50 --json out.json
    python bench/envs.py --parse-only                 # 1 MB outputs through step(), no model
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from _common import console, fmt, load_policy, median, prepare_process, print_machine, repeat, table, write_json

import contrail.envs as envs
from contrail.agent.backend import HFBackend, SamplingParams


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the defaults below (a few minutes on 2 CPU cores)")
    parser.add_argument("--envs", default=None, help="comma-separated names (default: every registered one)")
    parser.add_argument("--episodes", type=int, default=20)
    parser.add_argument("--max-steps", type=int, default=30, help="expert steps per episode at most")
    parser.add_argument("--model", default="smollm2-135m", help="model for the generation turn ('tiny' too)")
    parser.add_argument("--gen-batch", type=int, default=8)
    parser.add_argument("--gen-tokens", type=int, default=32)
    parser.add_argument("--skip-first-use", action="store_true", help="skip the fresh-process measurements")
    parser.add_argument("--parse-only", action="store_true", help="only time step() on 1 MB adversarial outputs")
    parser.add_argument("--parse-bytes", type=int, default=1_000_000, help="size of the adversarial outputs")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--first-use-worker", nargs=2, metavar=("ENV", "CACHE_DIR"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# Cache locations set by environment variables (`contrail --help` lists them).
CACHE_VARIABLES = ("CONTRAIL_CACHE", "CONTRAIL_SEARCHQA_CACHE", "CONTRAIL_WEBSHOP_CACHE", "CONTRAIL_ALFWORLD_CACHE")


def options_for(name: str, cache_dir: str) -> dict:
    """Point the environment's disk cache at ``cache_dir`` when it has one (so 'cold' really is cold)."""
    return {"cache_dir": str(Path(cache_dir) / name)} if "cache_dir" in envs.options(name) else {}


# --- first use, in a fresh process -------------------------------------------------


def first_use_worker(name: str, cache_dir: str) -> None:
    """Run in a fresh process: time every phase of a first and a second use; print JSON."""
    def phases() -> dict:
        out = {}
        start = time.perf_counter()
        cls = envs.env_class(name)
        out["import"] = time.perf_counter() - start
        options = options_for(name, cache_dir)
        t = time.perf_counter()
        env = cls(**options)
        out["construct"] = time.perf_counter() - t
        t = time.perf_counter()
        tasks = env.tasks("test")
        out["tasks"] = time.perf_counter() - t
        t = time.perf_counter()
        env.reset(tasks[0])
        out["reset"] = time.perf_counter() - t
        text = env.expert()
        t = time.perf_counter()
        env.step(text)
        out["first_step"] = time.perf_counter() - t
        env.close()
        out["total"] = sum(out.values())
        return out

    print(json.dumps({"first": phases(), "second": phases()}))


def first_use(name: str, cache_dir: str) -> dict:
    """A fresh process's first use of ``name`` (its own timings) and its wall time, or the error."""
    # Every cache location the environments read from an environment variable, moved
    # under ``cache_dir`` too (babyai, for one, takes no cache_dir option).
    caches = {var: str(Path(cache_dir) / var) for var in CACHE_VARIABLES}
    start = time.perf_counter()
    result = subprocess.run([sys.executable, __file__, "--first-use-worker", name, cache_dir],
                            capture_output=True, text=True, env={**os.environ, **caches})
    wall = time.perf_counter() - start
    if result.returncode != 0:
        return {"error": result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed"}
    return {**json.loads(result.stdout.strip().splitlines()[-1]), "process_wall": wall}


# --- per-episode costs ----------------------------------------------------------------


def expert_episodes(name: str, cache_dir: str, episodes: int, max_steps: int) -> dict:
    """Construct/reset/step/expert times over ``episodes`` expert episodes of the test split."""
    options = options_for(name, cache_dir)
    tasks = envs.make(name, **options).tasks("test")
    tasks = tasks[:: max(1, len(tasks) // episodes)][:episodes]  # spread over the split (both difficulties)
    construct, reset, step, expert = [], [], [], []
    successes = 0
    for task in tasks:
        t = time.perf_counter()
        env = envs.make(name, **options)
        construct.append(time.perf_counter() - t)
        t = time.perf_counter()
        env.reset(task)
        reset.append(time.perf_counter() - t)
        for _ in range(max_steps):
            t = time.perf_counter()
            text = env.expert()
            expert.append(time.perf_counter() - t)
            t = time.perf_counter()
            result = env.step(text)
            step.append(time.perf_counter() - t)
            if result.done:
                successes += bool(result.success)
                break
        env.close()
    ms = lambda values: 1e3 * median(values)  # noqa: E731
    return {"episodes": len(tasks), "steps": len(step), "expert_success": successes / len(tasks),
            "construct_ms": ms(construct), "reset_ms": ms(reset), "step_ms": ms(step), "expert_ms": ms(expert),
            "step_ms_max": 1e3 * max(step), "reset_ms_max": 1e3 * max(reset)}


def generation_turn(policy, name: str, cache_dir: str, batch: int, tokens: int) -> dict:
    """One batched turn of ``batch`` first prompts of ``name``, ``tokens`` new tokens each (no stop)."""
    env = envs.make(name, **options_for(name, cache_dir))
    prompts = []
    for task in env.tasks("test")[:batch]:
        observation = env.reset(task)
        prompts.append(policy.chat.prompt_ids(env.prompt_messages() + [{"role": "user", "content": observation}]))
    prompts = (prompts * batch)[:batch]  # an environment with fewer test tasks repeats them
    backend = HFBackend(policy.model, frozenset(), policy.tokenizer.pad_token_id, seed=0)
    seconds = median(repeat(lambda: backend.generate(prompts, SamplingParams(tokens, temperature=0.0)), 1, warmup=0))
    return {"turn_ms": 1e3 * seconds, "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts)}


# --- huge outputs through step() ----------------------------------------------------------


def huge_outputs(size: int) -> dict[str, str]:
    """Adversarial model outputs of about ``size`` characters, one per parser weakness."""
    return {
        "blank lines": "\n" * size,
        "spaces in an action": "Action: a" + " " * size + "b",
        "whitespace after Action:": "Action:" + " \t\n" * (size // 3),
        "unclosed tags": "<search>" * (size // 8),
        "brackets": "Action: click[" + "[" * size,
        "action lines": "Action: get 1 stick\n" * (size // 20),
        "long craft": "Action: craft " + "1 stick, " * (size // 9) + " using",
    }


def parse_costs(name: str, cache_dir: str, size: int) -> dict[str, float]:
    """Seconds of one ``step()`` per adversarial output, all in one episode."""
    env = envs.make(name, **options_for(name, cache_dir))
    outputs = huge_outputs(size)
    env.reset(env.tasks("test")[0], turn_limit=len(outputs) + 1)
    seconds = {}
    for label, text in outputs.items():
        started = time.perf_counter()
        env.step(text)
        seconds[label] = time.perf_counter() - started
    env.close()
    return seconds


def report_parse_costs(out, names: list[str], cache_dir: str, size: int, report: dict, notes: list[str]) -> None:
    rows = []
    for name in names:
        try:
            costs = parse_costs(name, cache_dir, size)
        except Exception as error:  # an environment that cannot run here is reported, not fatal
            notes.append(f"{name}: parse costs skipped ({type(error).__name__}: {error})")
            continue
        report["envs"].setdefault(name, {})["parse_seconds"] = costs
        worst = max(costs, key=costs.get)
        rows.append([name] + [fmt(1e3 * costs[label], 1) for label in costs] + [f"{worst}"])
    labels = list(huge_outputs(10))
    out.print(table(f"step() on {size:,}-character outputs (ms): parsing is linear",
                    ["env", *labels, "slowest"], rows))


def report_first_use(out, names: list[str], cache_dir: str, report: dict, notes: list[str]) -> None:
    """Time each environment's first use in fresh processes (empty cache, then cached) and in the same one."""
    rows = []
    for name in names:
        for label in ("fresh process, empty disk cache", "fresh process, cache on disk", "same process again"):
            if label == "same process again":
                r = report["envs"].get(name, {}).get("fresh process, cache on disk", {}).get("second")
                if r is None:
                    continue
            else:
                result = first_use(name, cache_dir)
                report["envs"].setdefault(name, {})[label] = result
                if "error" in result:
                    notes.append(f"{name}: skipped ({result['error']})")
                    break
                r = result["first"]
            rows.append([name, label] + [fmt(1e3 * r[k]) for k in
                                         ("import", "construct", "tasks", "reset", "first_step", "total")])
    out.print(table("first use (ms): the one-off index / catalogue build",
                    ["env", "when", "import", "construct", "tasks()", "reset()", "first step", "total"], rows))


# --- the report -------------------------------------------------------------------------


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.first_use_worker:
        first_use_worker(*args.first_use_worker)
        return
    prepare_process(args.threads)
    out = console()
    info = print_machine(out)
    names = args.envs.split(",") if args.envs else envs.names()
    cache_dir = tempfile.mkdtemp(prefix="contrail-bench-envs-")
    report = {"machine": info, "args": vars(args), "cache_dir": cache_dir, "envs": {}}
    notes = []
    report_parse_costs(out, names, cache_dir, args.parse_bytes, report, notes)
    if args.parse_only:
        for note in notes:
            out.print(f"[yellow]note[/]: {note}")
        write_json(args.json, {**report, "notes": notes})
        return

    if not args.skip_first_use:
        report_first_use(out, names, cache_dir, report, notes)

    policy = load_policy(args.model)
    warm = HFBackend(policy.model, frozenset(), policy.tokenizer.pad_token_id)
    warm.generate([[1, 2, 3]] * args.gen_batch, SamplingParams(4, temperature=0.0))  # first-call allocations
    rows = []
    for name in names:
        if any(note.startswith(f"{name}:") for note in notes):
            continue
        try:
            costs = expert_episodes(name, cache_dir, args.episodes, args.max_steps)
            gen = generation_turn(policy, name, cache_dir, args.gen_batch, args.gen_tokens)
        except Exception as error:  # an environment that cannot run here is reported, not fatal
            notes.append(f"{name}: skipped ({type(error).__name__}: {error})")
            traceback.print_exc()
            continue
        env_turn_ms = args.gen_batch * costs["step_ms"]  # the rollout steps each live episode in turn
        ratio = env_turn_ms / gen["turn_ms"]
        reset_ratio = args.gen_batch * costs["reset_ms"] / gen["turn_ms"]  # once per episode, before turn 1
        report["envs"].setdefault(name, {})["episodes"] = {**costs, **gen, "env_ms_per_turn": env_turn_ms,
                                                           "env_over_generation": ratio,
                                                           "resets_over_generation": reset_ratio}
        rows.append([name, costs["episodes"], costs["steps"], f"{costs['expert_success']:.2f}",
                     fmt(costs["construct_ms"], 2), fmt(costs["reset_ms"], 2), fmt(costs["step_ms"], 3),
                     fmt(costs["step_ms_max"], 2), fmt(costs["expert_ms"], 3), fmt(gen["prompt_tokens_mean"], 0),
                     fmt(gen["turn_ms"], 0), f"{ratio:.3g}", f"{reset_ratio:.3g}"])
    out.print(table(
        f"per episode (median ms) over expert episodes, against one batched generation turn of {args.model} "
        f"({args.gen_batch} episodes x {args.gen_tokens} tokens) on the same environment's prompts",
        ["env", "episodes", "steps", "expert success", "construct", "reset", "step", "step max", "expert()",
         "prompt tokens", "gen turn ms", f"{args.gen_batch} steps / gen turn", f"{args.gen_batch} resets / gen turn"],
        rows))
    for note in notes:
        out.print(f"[yellow]note[/]: {note}")
    report["notes"] = notes
    write_json(args.json, report)


if __name__ == "__main__":
    main()
