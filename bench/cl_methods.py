"""Stage-1 forgetting with and without the continual-learning methods, on the tiny two-environment stream.

Stream: ``magic:easy`` then ``magic-berry:easy`` (contrail.testing): the same
question, "apple" wins the first, "berry" the second; easy tasks allow three
turns, so one policy can solve both ("berry", then "apple" after "wrong").
For each seed and method, a tiny random model is trained stage by stage
exactly as the runner does (plan, before_stage, train on the stage's
sampler, after_stage), and evaluated after each stage on both test sets
(success over test tasks x k samples, the same evaluation seed every row).

    forgetting = success on magic after stage 1 - success on magic after stage 2

``--difficulty hard`` keeps one turn per episode, so the two words conflict
outright; on the tiny model it mostly collapses onto the first word, leaving
stage 2 no reward to learn from, so the default is ``easy``.

    python bench/cl_methods.py                 # 3 seeds, a few minutes on 2 cores
    python bench/cl_methods.py --seeds 0 1 2 --steps 30 --json out.json
"""

from __future__ import annotations

import argparse
import statistics

from _common import console, prepare_process, table, write_json

from contrail import strategies
from contrail.agent.backend import HFBackend
from contrail.agent.rollout import RolloutConfig, rollout
from contrail.grpo.config import GRPOConfig
from contrail.grpo.trainer import GRPOTrainer
from contrail.seeds import derive_seed
from contrail.stream import Stream, env_factory
from contrail.testing import tiny_model, tiny_tokenizer


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=20, help="GRPO steps per stage")
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--betas", type=float, nargs="+", default=[0.1, 1.0], help="kl_anchor's beta values")
    parser.add_argument("--lams", type=float, nargs="+", default=[100.0, 1000.0], help="ewc's lambda values")
    parser.add_argument("--difficulty", default="easy", choices=["easy", "hard"],
                        help="hard: one turn, the two words conflict; easy: three turns, one policy can solve both")
    parser.add_argument("--k", type=int, default=4, help="samples per test task")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    return parser.parse_args(argv)


ROLLOUT = RolloutConfig(max_new_tokens=3, max_episode_tokens=256)


def methods(args) -> dict[str, tuple[str, dict]]:
    out: dict[str, tuple[str, dict]] = {"sequential": ("sequential", {})}
    out.update({f"kl_anchor beta={b:g}": ("kl_anchor", {"beta": b}) for b in args.betas})
    out.update({f"ewc lam={lam:g}": ("ewc", {"lam": lam, "fisher_tasks": 4}) for lam in args.lams})
    return out


def success(trainer: GRPOTrainer, stream: Stream, seed: int, k: int) -> dict[str, float]:
    """Success per test experience, sampled from the same evaluation seed at every row."""
    chat = trainer.policy.chat
    out = {}
    for experience in stream.test:
        backend = HFBackend(trainer.model, chat.stop_ids, trainer.tokenizer.pad_token_id,
                            seed=derive_seed(seed, "eval"))
        tasks = [task for task in experience.test_tasks for _ in range(k)]
        trajectories = rollout(backend, chat, tasks, env_factory(stream.experiences), ROLLOUT)
        out[experience.name] = sum(t.success for t in trajectories) / len(trajectories)
    return out


def run(name: str, options: dict, seed: int, args) -> list[dict[str, float]]:
    """Rows of success after stage 0 (start), 1 and 2."""
    stream = Stream.from_specs([f"magic:{args.difficulty}", f"magic-berry:{args.difficulty}"], train_tasks=10,
                               test_tasks=20)
    strategy = strategies.make(name, steps_per_experience=args.steps, **options)
    tokenizer = tiny_tokenizer()
    config = GRPOConfig(lr=args.lr, group_size=8, tasks_per_step=4)
    trainer = GRPOTrainer(tiny_model(tokenizer, seed=seed), tokenizer, config, ROLLOUT, env_factory(stream.experiences),
                          seed=seed, show_progress=False)
    rows = [success(trainer, stream, seed, args.k)]
    for stage in strategy.plan(stream, seed=seed):
        strategy.before_stage(stage, trainer)
        trainer.train(strategies.stage_sampler(stage, stream), stage.steps)
        strategy.after_stage(stage, trainer)
        rows.append(success(trainer, stream, seed, args.k))
    return rows


def main(argv=None) -> None:
    args = parse_args(argv)
    prepare_process(args.threads)
    out = console()
    results: dict[str, list] = {}
    first, second = f"magic:{args.difficulty}", f"magic-berry:{args.difficulty}"
    for label, (name, options) in methods(args).items():
        for seed in args.seeds:
            rows = run(name, options, seed, args)
            results.setdefault(label, []).append(rows)
            out.print(f"{label} seed {seed}: " + "  ".join(
                f"row {i}: magic {r[first]:.2f} berry {r[second]:.2f}" for i, r in enumerate(rows)))
    lines = []
    for label, runs in results.items():
        forgetting = [r[1][first] - r[2][first] for r in runs]
        lines.append([label, len(runs), _mean_sd([r[1][first] for r in runs]), _mean_sd([r[2][first] for r in runs]),
                      _mean_sd(forgetting), _mean_sd([r[2][second] for r in runs])])
    out.print(table(f"stage-1 forgetting on {first} -> {second}, {args.steps} steps per stage, lr {args.lr:g}",
                    ["method", "seeds", "magic after 1", "magic after 2", "forgetting", "berry after 2"], lines))
    write_json(args.json, {"args": vars(args), "results": results})


def _mean_sd(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.2f} ± {sd:.2f}"


if __name__ == "__main__":
    main()
