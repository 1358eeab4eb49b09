"""The ``contrail`` command.

    contrail envs                          list environments, difficulties, task counts
    contrail eval  --model M --env E ...   evaluate a model on test tasks
    contrail audit --env E ...             expert and random-action success through the model's parsing path
    contrail sft   --model M --env E ...   behaviour cloning on expert demonstrations (warm-start)
    contrail train --model M --env E ...   GRPO on some environments, evaluated before and after
    contrail run experiments/x.yaml [k=v]  a continual experiment (or an ablation family) from YAML
                                           (--list its runs, --shard i/n a share of them)
    contrail report RUN                    regenerate a run's report.md, matrix.csv and plots
    contrail compare RUN...                tabulate an ablation: mean ± std over seeds
    contrail serve-env ENV --port N        serve an environment over AgentGym's HTTP protocol

contrail's own user-facing errors (a config mistake, an unknown name, a
bad environment option or device, a run directory in the way, a missing
model) print one line naming the valid choices and exit with code 2, before
anything is written. Anything else is a bug: its traceback is kept (exit 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from contrail import envs
from contrail.allocator import keep_freed_memory
from contrail.precision import PRECISIONS

# Wide tables when printing to a file or a pipe (rich would otherwise assume 80 columns).
console = Console() if sys.stdout.isatty() else Console(width=150)


class UsageError(ValueError):
    """A user error in the command line reported in one line with exit code 2."""


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def _seed(value: str) -> int:
    """A root seed: an integer in [0, 2**63 - 1] (what `contrail.seeds` derives every other seed from)."""
    from contrail.seeds import check_seed

    try:
        return check_seed(int(value), "seed")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_model_arguments(parser: argparse.ArgumentParser, default_model: str | None = "smollm2-135m") -> None:
    """``--model``, ``--device``, ``--dtype`` and ``--seed``."""
    group = parser.add_argument_group("model")
    group.add_argument("--model", default=default_model,
                       help="HF id, local path, checkpoint dir, or the alias smollm2-135m (default)")
    group.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:N, mps")
    group.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    group.add_argument("--seed", type=_seed, default=0)


def add_rollout_arguments(parser: argparse.ArgumentParser) -> None:
    """The `RolloutConfig` options and ``--batch-episodes``."""
    group = parser.add_argument_group("rollouts")
    group.add_argument("--max-new-tokens", type=_positive, default=128, help="tokens per turn")
    group.add_argument("--max-episode-tokens", type=_positive, default=4096)
    group.add_argument("--max-turns", type=_positive, default=None, help="override the environments' limits")
    group.add_argument("--temperature", type=float, default=1.0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--batch-episodes", type=_positive, default=64, help="episodes played together")


def rollout_from_args(args: argparse.Namespace):
    """The `RolloutConfig` of the rollout options; a bad combination is a `UsageError` naming the option."""
    from contrail.agent.rollout import RolloutConfig

    try:
        return RolloutConfig(max_new_tokens=args.max_new_tokens, max_episode_tokens=args.max_episode_tokens,
                             temperature=args.temperature, top_p=args.top_p, max_turns=args.max_turns)
    except ValueError as error:
        raise UsageError(f"--{str(error).split()[0].replace('_', '-')}: {error}") from None


def output_dir(value: str | None, default: Path) -> Path:
    """``--out`` as a directory to write into; an existing file there is a `UsageError`."""
    out = Path(value) if value else default
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is an existing file, not a directory")
    return out


# --- contrail envs ---------------------------------------------------------------


def cmd_envs(args: argparse.Namespace) -> int:
    """A table of every registered environment: difficulties, task counts, turn limits."""
    table = Table(title="contrail environments")
    for column in ("environment", "difficulty", "train tasks", "test tasks", "turn limit"):
        table.add_column(column)
    for name in envs.names():
        try:
            env = envs.make(name)
        except ImportError as error:  # an optional extra not installed: say so, keep listing
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
    """Evaluate a model on ``--env`` tasks; ``results.json`` and ``trajectories.jsonl`` go to ``--out``."""
    from contrail.agent.vllm import VLLMNotInstalled
    from contrail.agent.vllm_server import VLLMServerMisconfigured
    from contrail.evaluation import evaluate
    from contrail.models import resolve_device
    from contrail.policy import Policy
    from contrail.stream import Experience, env_factory

    config = dataclasses.replace(rollout_from_args(args), backend=args.backend)
    if args.vllm_url is not None:  # server mode: a running `vllm serve` samples
        if args.backend != "vllm":
            raise UsageError("--vllm-url needs --backend vllm")
        try:
            server = dataclasses.replace(config.vllm, mode="server", url=args.vllm_url)
            config = dataclasses.replace(config, vllm=server)
        except ValueError as error:
            raise UsageError(f"--vllm-url: {error}") from None
    device = resolve_device(args.device)
    out = output_dir(args.out, Path("runs") / "eval" / time.strftime("%Y%m%d-%H%M%S"))
    experiences = [Experience.from_spec(spec, test_tasks=args.tasks, train_tasks=args.tasks, seed=args.seed)
                   for spec in args.env]
    task_lists = {e.name: (e.test_tasks if args.split == "test" else e.train_tasks) for e in experiences}
    try:
        policy = Policy.load(args.model, device=device, dtype=args.dtype, seed=args.seed, rollout=config,
                             max_batch_size=args.batch_episodes)
    except VLLMNotInstalled as error:
        raise UsageError(f"--backend vllm: {error}") from None
    except VLLMServerMisconfigured as error:
        raise UsageError(f"--vllm-url: {error}") from None
    out.mkdir(parents=True, exist_ok=True)
    trajectories = out / "trajectories.jsonl"
    trajectories.unlink(missing_ok=True)
    start = time.perf_counter()
    results = evaluate(policy.backend, policy.chat, task_lists, env_factory(experiences), k=args.k,
                       config=config, batch_episodes=args.batch_episodes, trajectories_path=trajectories,
                       seed=args.seed)
    wall = time.perf_counter() - start
    print_results(results, title=f"{args.model} on {args.split} tasks (k={args.k}, {wall:.0f} s)")
    summary = {"model": args.model, "split": args.split, "k": args.k, "wall_seconds": wall,
               "results": {name: r.to_dict() for name, r in results.items()}}
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    console.print(f"trajectories: {trajectories}\nsummary: {out / 'results.json'}")
    return 0


def print_results(results, title: str) -> None:
    """One row per experience: avg@k, pass@k, reward, turns, tokens, invalid and cut-turn rates, errors."""
    table = Table(title=title)
    columns = ("experience", "tasks", "avg@k", "pass@k", "reward", "turns", "gen tokens", "invalid", "cut", "errors")
    for column in columns:
        table.add_column(column, justify="right" if column != "experience" else "left")
    for name, r in results.items():
        table.add_row(name, str(r.tasks), f"{r.avg_at_k:.3f}", f"{r.pass_at_k:.3f}", f"{r.reward:.3f}",
                      f"{r.turns:.1f}", f"{r.generated_tokens:.0f}", f"{r.invalid_rate:.1%}", f"{r.cut_rate:.1%}",
                      str(r.errors))
    console.print(table)


# --- contrail audit ---------------------------------------------------------------


def cmd_audit(args: argparse.Namespace) -> int:
    """Expert and random-valid-action success through the same rollout path a model uses."""
    from contrail.agent import ChatFormat, RolloutConfig
    from contrail.agent.scripted import ExpertBackend, RandomBackend
    from contrail.evaluation import evaluate
    from contrail.models import load_tokenizer
    from contrail.stream import Experience, env_factory

    chat = ChatFormat.from_tokenizer(load_tokenizer(args.tokenizer))
    experiences = [Experience.from_spec(spec, test_tasks=args.tasks, train_tasks=args.tasks, seed=args.seed)
                   for spec in _checked_specs(args.env)]
    tasks = {e.name: (e.test_tasks if args.split == "test" else e.train_tasks) for e in experiences}
    config = RolloutConfig(max_new_tokens=1024, max_episode_tokens=args.max_episode_tokens)
    players = (("expert", ExpertBackend(chat), 1), ("random valid actions", RandomBackend(chat, args.seed), args.k))
    for label, backend, k in players:
        start = time.perf_counter()
        results = evaluate(backend, chat, tasks, env_factory(experiences), k=k, config=config,
                           description=f"{label} on {args.split} tasks")
        print_results(results, title=f"{label} ({args.split}, k={k}, {time.perf_counter() - start:.1f} s)")
    return 0


# --- contrail sft ----------------------------------------------------------------


def cmd_sft(args: argparse.Namespace) -> int:
    """Behaviour cloning into ``--out``: the `WarmStart` a run's ``model.warmstart`` would train, from the same seed."""
    from contrail.experiment import WarmStart
    from contrail.seeds import derive_seed
    from contrail.train.sft import train_sft

    output_dir(args.out, Path(args.out))
    try:
        spec = WarmStart(envs=list(_checked_specs(args.env)), episodes=args.episodes, epochs=args.epochs,
                         lr=args.lr, max_episode_tokens=args.max_episode_tokens, batch_size=args.batch_size,
                         precision=args.precision)
    except ValueError as error:
        raise UsageError(str(error)) from None
    start = time.perf_counter()
    model_dir = train_sft(args.model, spec, args.out, seed=derive_seed(args.seed, "warmstart"), dtype=args.dtype,
                          resume=not args.restart)
    summary = json.loads((Path(args.out) / "summary.json").read_text())
    made = summary["demonstrations"]
    console.print(
        f"behaviour cloning done in {time.perf_counter() - start:.0f} s: {made['kept']}/{made['episodes']} expert "
        f"episodes of {', '.join(made['envs'])} (training tasks only), {summary['steps']} steps\n"
        f"model: {model_dir}\nevaluate it: contrail eval --model {args.out} --env {args.env[0]}"
    )
    return 0


def _checked_specs(specs: list[str]) -> list[str]:
    for spec in specs:
        envs.parse_spec(spec)  # unknown names fail here, listing the valid ones
    return specs


# --- contrail train --------------------------------------------------------------


def cmd_train(args: argparse.Namespace) -> int:
    """GRPO on a mixture of ``--env``: the same `Experiment` a YAML file would give, run by the runner."""
    experiment = train_experiment(args)
    from contrail.runner import run

    result = run(experiment, resume=args.resume, force=args.force)
    if _is_main_process():
        print_run(result)
    return 0


def train_experiment(args: argparse.Namespace):
    """The `Experiment` of ``contrail train``'s options (checked, so mistakes are one line).

    ``--steps`` is the total budget of one mixture stage over the
    environments (rounded up to a multiple of their number); the warm-start is
    the same `WarmStart` an experiment file's ``model.warmstart`` builds.
    """
    from contrail.experiment import EvalSpec, Experiment, ModelSpec, StrategySpec, StreamSpec, WarmStart
    from contrail.grpo.config import GRPOConfig

    specs = _checked_specs(args.env)
    rollout = rollout_from_args(args)
    output_dir(args.out, Path(args.out))
    try:
        warm = WarmStart(envs=list(specs), episodes=args.warmstart_episodes) if args.warmstart_episodes else None
        grpo = GRPOConfig(lr=args.lr, group_size=args.group_size, tasks_per_step=args.tasks_per_step, beta=args.beta,
                          clip_high=args.clip_high, lora=args.lora, precision=args.precision,
                          gradient_checkpointing=args.gradient_checkpointing,
                          micro_batch_tokens=args.micro_batch_tokens)
        experiment = Experiment(
            name=Path(args.out).name or "train", out=args.out, seed=args.seed,
            stream=StreamSpec(train=list(specs), test_tasks=args.eval_tasks,
                              steps_per_experience=-(-args.steps // len(specs))),
            strategy=StrategySpec(name="mixture"),
            model=ModelSpec(name=args.model, dtype=args.dtype, device=args.device, warmstart=warm),
            rollout=rollout, grpo=grpo, eval=EvalSpec(k=args.k, batch_episodes=args.batch_episodes),
            checkpoint_minutes=args.checkpoint_minutes,
        )
    except ValueError as error:
        raise UsageError(str(error)) from None
    return experiment.check()


def _is_main_process() -> bool:
    from accelerate import PartialState

    return PartialState().is_main_process


def print_run(result) -> None:
    """The per-stage avg@k table and the continual-learning metrics of a run."""
    matrix = result.matrix()
    table = Table(title=f"avg@k after each stage ({result.path})")
    table.add_column("stage")
    for name, stage in zip(result.test, result.trained_at, strict=True):
        table.add_column(f"{name}" + ("" if stage else " (held out)"), justify="right")
    for row, values in zip(result.rows, matrix, strict=True):
        table.add_row(f"{row['stage']} {row['name']}", *(f"{v:.3f}" for v in values))
    console.print(table)
    metrics = "  ".join(f"{k} {v:+.3f}" for k, v in result.metrics.items())
    console.print(f"metrics: {metrics}\nreport: {result.path / 'report.md'}")


# --- contrail run / report / compare -------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    """Every run of an experiment file (orders × seeds), or a ``--shard`` of them; ``--list``/``--dry-run`` only show.

    A sweep spreads over machines by sharding: run ``j`` of `expand_runs`
    belongs to share ``j % n``, so ``--shard i/n`` in every task of an
    ``n``-task array runs each run exactly once (each into its own ``out``),
    and ``contrail compare`` gathers the run directories afterwards.
    """
    from contrail.experiment import describe_plan, expand_runs, load_experiment, parse_shard, shard

    index, count = parse_shard(args.shard) if args.shard is not None else (0, 1)
    experiment = load_experiment(args.experiment, args.overrides, preset_dirs=args.preset_dir or ())
    if args.dry_run:
        print(describe_plan(experiment))
        return 0
    runs = expand_runs(experiment)
    mine = shard(runs, index, count)
    if args.list:
        print_run_list(mine, len(runs))
        return 0
    return _run_all(mine, len(runs), sharded=count > 1, resume=args.resume, force=args.force)


def print_run_list(runs, total: int) -> None:
    """One tab-separated line per run: its index in the sweep, its label and its run directory.

    Plain text (no table) so that scripts can read it: ``cut -f3`` gives the directories.
    """
    for index, one in runs:
        print(f"{index}\t{one.label} (seed {one.seed})\t{one.out}")
    if len(runs) < total:
        print(f"# {len(runs)} of {total} runs in this share", file=sys.stderr)


def _run_all(runs, total: int, *, sharded: bool, resume: bool, force: bool) -> int:
    from contrail.report import compare
    from contrail.runner import run

    started = time.perf_counter()
    if not runs:
        console.print(f"this share holds none of the {total} runs (more shares than runs)")
    for number, (index, one) in enumerate(runs, start=1):
        console.rule(f"run {number}/{len(runs)} (#{index} of {total}): {one.label} (seed {one.seed}) → {one.out}")
        result = run(one, resume=resume, force=force)
        if _is_main_process():
            print_run(result)
    if len(runs) > 1 and not sharded and _is_main_process():
        console.print(compare([one.out for _, one in runs]), markup=False)
    console.print(f"wall time: {time.perf_counter() - started:.0f} s")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """Rewrite a run's report files from its directory."""
    from contrail.report import write_report

    for path in write_report(_run_dir(args.run_dir)):
        console.print(f"wrote {path}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    """A table over runs, grouped by label (strategy with its options, and order), over seeds."""
    from contrail.report import compare

    console.print(compare([_run_dir(path) for path in args.runs]), markup=False)
    return 0


def _run_dir(path: str) -> Path:
    """A run directory named on the command line; a missing one, or one without results, is a `UsageError`."""
    run = Path(path)
    if not run.is_dir():
        raise UsageError(f"{path}: no such run directory")
    if not (run / "results.jsonl").is_file():
        raise UsageError(f"{path}: not a contrail run with results (no results.jsonl)")
    return run


def add_training_arguments(parser: argparse.ArgumentParser, lr: float) -> None:
    """GRPO optimisation options of ``contrail train``."""
    group = parser.add_argument_group("optimisation")
    group.add_argument("--lr", type=float, default=lr)
    group.add_argument("--precision", default="fp32", choices=PRECISIONS,
                       help="auto: bf16 where the device has bf16 matrix units, else fp32")
    group.add_argument("--lora", action="store_true", help="train a LoRA adapter (peft) instead of all weights")
    group.add_argument("--micro-batch-tokens", type=_positive, default=4096, help="padded tokens per micro-batch")
    group.add_argument("--gradient-checkpointing", action="store_true")


# --- the parser ------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (the usage is one `--help` away)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


ENVIRONMENT_HELP = """environment variables:
  CONTRAIL_CACHE        the embedded model, demonstrations, warm-starts, environment data (default ~/.cache/contrail)
  CONTRAIL_WEBSHOP_CACHE, CONTRAIL_ALFWORLD_CACHE, CONTRAIL_SEARCHQA_CACHE
                        one environment's data elsewhere (default: its folder in CONTRAIL_CACHE)
  CONTRAIL_PRESET_PATH  more folders of strategy and stream presets (os.pathsep-separated)
  CONTRAIL_MALLOC       'system' leaves glibc's malloc as it is; by default the command has it keep
                        freed memory for reuse (contrail.allocator)"""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="contrail", description="Continual RL for LLM agents across environments.",
                     epilog=ENVIRONMENT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p_envs = sub.add_parser("envs", help="list environments with their difficulties and task counts")
    p_envs.set_defaults(handler=cmd_envs)

    p_eval = sub.add_parser("eval", help="evaluate a model on environments' tasks")
    add_model_arguments(p_eval)
    p_eval.add_argument("--env", action="append", required=True,
                        help="environment spec, e.g. babyai:easy (repeatable)")
    p_eval.add_argument("--split", default="test", choices=["train", "test"])
    p_eval.add_argument("--tasks", type=_positive, default=20, help="tasks per environment (a fixed spread sample)")
    p_eval.add_argument("-k", type=_positive, default=1, help="samples per task (avg@k, pass@k)")
    p_eval.add_argument("--out", default=None, help="output directory (default runs/eval/<time>)")
    p_eval.add_argument("--backend", default="hf", choices=["hf", "vllm"],
                        help="what samples: hf (the model itself) or vllm (a vLLM engine; docs/vllm.md)")
    p_eval.add_argument("--vllm-url", default=None, metavar="URL",
                        help="with --backend vllm: sample with the `vllm serve` at URL (server mode; docs/vllm.md)")
    add_rollout_arguments(p_eval)
    p_eval.set_defaults(handler=cmd_eval)

    p_audit = sub.add_parser("audit", help="expert and random-action success through the model's parsing path")
    p_audit.add_argument("--env", action="append", required=True, help="environment spec (repeatable)")
    p_audit.add_argument("--split", default="test", choices=["train", "test"])
    p_audit.add_argument("--tasks", type=_positive, default=None, help="tasks per environment (default: all)")
    p_audit.add_argument("-k", type=_positive, default=4, help="random-action samples per task")
    p_audit.add_argument("--seed", type=_seed, default=0)
    p_audit.add_argument("--max-episode-tokens", type=_positive, default=32768)
    p_audit.add_argument("--tokenizer", default="smollm2-135m", help="whose tokenizer renders the episodes")
    p_audit.set_defaults(handler=cmd_audit)

    p_sft = sub.add_parser("sft", help="behaviour cloning on expert demonstrations (training tasks only)")
    add_model_arguments(p_sft)
    p_sft.add_argument("--env", action="append", required=True, help="environment spec (repeatable)")
    # Defaults are WarmStart's, so `contrail sft` trains what a run's `model.warmstart: {envs: ...}` trains.
    p_sft.add_argument("--episodes", type=_positive, default=100, help="expert episodes, split over the envs")
    p_sft.add_argument("--epochs", type=_positive, default=2)
    p_sft.add_argument("--batch-size", type=_positive, default=8, help="episodes per optimizer step")
    p_sft.add_argument("--max-episode-tokens", type=_positive, default=2048)
    p_sft.add_argument("--lr", type=float, default=1e-4)
    p_sft.add_argument("--precision", default="auto", choices=PRECISIONS,
                       help="auto (default): bf16 where the device has bf16 matrix units, else fp32")
    p_sft.add_argument("--out", required=True, help="output directory (its model/ is loadable by eval)")
    p_sft.add_argument("--restart", action="store_true", help="ignore a checkpoint in --out and start over")
    p_sft.set_defaults(handler=cmd_sft)

    p_train = sub.add_parser("train", help="GRPO on environments, evaluated before and after on test tasks")
    add_model_arguments(p_train)
    p_train.add_argument("--env", action="append", required=True, help="environment spec (repeatable)")
    p_train.add_argument("--steps", type=_positive, default=20)
    p_train.add_argument("--out", required=True)
    p_train.add_argument("--group-size", type=_positive, default=4)
    p_train.add_argument("--tasks-per-step", type=_positive, default=4)
    p_train.add_argument("--beta", type=float, default=0.0, help="KL coefficient to the start model")
    p_train.add_argument("--clip-high", type=float, default=0.2)
    p_train.add_argument("--eval-tasks", type=_positive, default=10, help="held-out test tasks per environment")
    p_train.add_argument("-k", type=_positive, default=2, help="samples per evaluation task")
    p_train.add_argument("--warmstart-episodes", type=int, default=0,
                         help="behaviour-clone this many expert episodes first (cached and reused)")
    p_train.add_argument("--resume", action="store_true",
                         help="continue an interrupted run in --out from its last checkpoint")
    p_train.add_argument("--checkpoint-minutes", type=float, default=5.0, metavar="M",
                         help="checkpoint within training every M minutes, so a killed run loses at most that "
                              "much (0: after every step; default 5)")
    p_train.add_argument("--force", action="store_true", help="overwrite a run in --out")
    add_rollout_arguments(p_train)
    p_train.set_defaults(max_new_tokens=64, max_episode_tokens=2048, batch_episodes=32)
    add_training_arguments(p_train, lr=2e-5)
    p_train.set_defaults(handler=cmd_train)

    p_run = sub.add_parser("run", help="run a continual experiment from YAML")
    p_run.add_argument("experiment", help="experiment YAML, e.g. experiments/quickstart.yaml")
    p_run.add_argument("overrides", nargs="*",
                       help="dotted overrides, e.g. grpo.lr=1e-6 strategy=replay (before or after the options)")
    p_run.add_argument("--dry-run", action="store_true", help="print the plan without loading a model")
    p_run.add_argument("--resume", action="store_true",
                       help="continue interrupted runs from their last checkpoint (a stage's end, or within a stage "
                            "every checkpoint_minutes)")
    p_run.add_argument("--force", action="store_true", help="overwrite finished or unfinished runs")
    p_run.add_argument("--list", action="store_true",
                       help="print the runs (index, label, run directory) without loading a model")
    p_run.add_argument("--shard", metavar="I/N", default=None,
                       help="run only share I of N (run j is in share j %% N), e.g. $SLURM_ARRAY_TASK_ID/4")
    p_run.add_argument("--preset-dir", action="append", metavar="DIR",
                       help="a folder holding streams/ and strategies/ presets, searched first (repeatable; "
                            "also $CONTRAIL_PRESET_PATH)")
    p_run.set_defaults(handler=cmd_run)

    p_report = sub.add_parser("report", help="regenerate a run's report files")
    p_report.add_argument("run_dir", metavar="RUN", help="run directory")
    p_report.set_defaults(handler=cmd_report)

    p_compare = sub.add_parser("compare", help="compare runs (mean ± std over seeds)")
    p_compare.add_argument("runs", nargs="+", help="run directories")
    p_compare.set_defaults(handler=cmd_compare)

    from contrail.envs.agentgym import command as serve_env  # its own module: the protocol lives there

    serve_env.add_parser(sub)
    return parser


def user_errors() -> tuple[type[BaseException], ...]:
    """contrail's own user-facing errors: one line and exit code 2 (everything else keeps its traceback)."""
    from contrail.envs import EnvOptionError, UnknownNameError
    from contrail.experiment import ConfigError
    from contrail.models import DeviceError, ModelNotFoundError
    from contrail.results import RunExistsError

    return (ConfigError, UnknownNameError, EnvOptionError, DeviceError, ModelNotFoundError, RunExistsError,
            UsageError)


def parse_arguments(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``argv`` parsed, a command's dotted overrides taken after its options too.

    argparse gives a positional list only the words before the first option,
    so ``contrail run X.yaml --force grpo.lr=1e-5`` would refuse
    ``grpo.lr=1e-5`` as an unrecognized argument. Anything else left over is
    still refused, as argparse does.
    """
    args, extra = parser.parse_known_args(argv)
    takes_overrides = getattr(args, "overrides", None) is not None
    overrides = [word for word in extra if takes_overrides and "=" in word and not word.startswith("-")]
    refused = [word for word in extra if word not in overrides]
    if refused:
        parser.error(f"unrecognized arguments: {' '.join(refused)}")
    if overrides:
        args.overrides = [*args.overrides, *overrides]
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the ``contrail`` command with ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    parser = build_parser()
    args = parse_arguments(parser, argv)
    keep_freed_memory()  # reused blocks instead of fresh pages from the kernel (`contrail.allocator`)
    try:
        return args.handler(args)
    except user_errors() as error:
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        print(f"contrail {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
