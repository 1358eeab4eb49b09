"""The ``contrail`` command.

    contrail envs                         list environments, difficulties, task counts
    contrail eval --model M --env E ...   evaluate a model on test tasks

Bad input (unknown environment or difficulty, k < 1, missing model) prints
one line naming the valid choices and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from contrail import envs
from contrail.envs.base import UnknownNameError

console = Console()


class UsageError(Exception):
    """A user error reported in one line with exit code 2."""


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def add_model_arguments(parser: argparse.ArgumentParser, default_model: str | None = "smollm2-135m") -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--model", default=default_model,
                       help="HF id, local path, checkpoint dir, or the alias smollm2-135m (default)")
    group.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    group.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    group.add_argument("--seed", type=int, default=0)


def add_rollout_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("rollouts")
    group.add_argument("--max-new-tokens", type=_positive, default=128, help="tokens per turn")
    group.add_argument("--max-episode-tokens", type=_positive, default=4096)
    group.add_argument("--max-turns", type=_positive, default=None, help="override the environments' limits")
    group.add_argument("--temperature", type=float, default=1.0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--batch-episodes", type=_positive, default=64, help="episodes played together")


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


# --- contrail envs ---------------------------------------------------------------


def cmd_envs(args: argparse.Namespace) -> int:
    table = Table(title="contrail environments")
    for column in ("environment", "difficulty", "train tasks", "test tasks", "turn limit"):
        table.add_column(column)
    for name in envs.names():
        try:
            env = envs.make(name)
        except Exception as error:  # an optional extra not installed: say so, keep listing
            table.add_row(name, "-", "-", "-", f"[red]unavailable: {error}")
            continue
        for difficulty in env.difficulties:
            table.add_row(name, difficulty, str(len(env.tasks("train", difficulty))),
                          str(len(env.tasks("test", difficulty))), str(env.max_turns))
        env.close()
    console.print(table)
    return 0


# --- contrail eval ---------------------------------------------------------------


def cmd_eval(args: argparse.Namespace) -> int:
    from contrail.agent import RolloutConfig
    from contrail.evaluation import evaluate
    from contrail.policy import Policy
    from contrail.stream import Experience, env_factory

    experiences = [Experience.from_spec(spec, test_tasks=args.tasks, train_tasks=args.tasks, seed=args.seed)
                   for spec in args.env]
    task_lists = {e.name: (e.test_tasks if args.split == "test" else e.train_tasks) for e in experiences}
    config = RolloutConfig(args.max_new_tokens, args.max_episode_tokens, args.temperature, args.top_p, args.max_turns)
    policy = Policy.load(args.model, device=resolve_device(args.device), dtype=args.dtype, seed=args.seed)
    out = Path(args.out) if args.out else Path("runs") / "eval" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    trajectories = out / "trajectories.jsonl"
    trajectories.unlink(missing_ok=True)
    start = time.perf_counter()
    results = evaluate(policy.backend, policy.chat, task_lists, env_factory(experiences), k=args.k,
                       config=config, batch_episodes=args.batch_episodes, trajectories_path=trajectories)
    wall = time.perf_counter() - start
    print_results(results, title=f"{args.model} on {args.split} tasks (k={args.k}, {wall:.0f} s)")
    summary = {"model": args.model, "split": args.split, "k": args.k, "wall_seconds": wall,
               "results": {name: r.to_dict() for name, r in results.items()}}
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    console.print(f"trajectories: {trajectories}\nsummary: {out / 'results.json'}")
    return 0


def print_results(results, title: str) -> None:
    table = Table(title=title)
    for column in ("experience", "tasks", "avg@k", "pass@k", "reward", "turns", "gen tokens", "invalid", "errors"):
        table.add_column(column, justify="right" if column != "experience" else "left")
    for name, r in results.items():
        table.add_row(name, str(r.tasks), f"{r.avg_at_k:.3f}", f"{r.pass_at_k:.3f}", f"{r.reward:.3f}",
                      f"{r.turns:.1f}", f"{r.generated_tokens:.0f}", f"{r.invalid_rate:.1%}", str(r.errors))
    console.print(table)


# --- the parser ------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="contrail", description="Continual RL for LLM agents across environments.")
    sub = parser.add_subparsers(dest="command", required=True)

    p_envs = sub.add_parser("envs", help="list environments with their difficulties and task counts")
    p_envs.set_defaults(run=cmd_envs)

    p_eval = sub.add_parser("eval", help="evaluate a model on environments' tasks")
    add_model_arguments(p_eval)
    p_eval.add_argument("--env", action="append", required=True,
                        help="environment spec, e.g. babyai:easy (repeatable)")
    p_eval.add_argument("--split", default="test", choices=["train", "test"])
    p_eval.add_argument("--tasks", type=_positive, default=20, help="tasks per environment (a fixed spread sample)")
    p_eval.add_argument("-k", type=_positive, default=1, help="samples per task (avg@k, pass@k)")
    p_eval.add_argument("--out", default=None, help="output directory (default runs/eval/<time>)")
    add_rollout_arguments(p_eval)
    p_eval.set_defaults(run=cmd_eval)

    return parser


def main(argv: list[str] | None = None) -> int:
    from contrail.models import ModelNotFoundError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (UnknownNameError, ModelNotFoundError, UsageError, ValueError) as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        print(f"contrail {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
