"""A GRPO update with the rows after a micro-batch's shared prefix packed (no padding) against padded.

An experiment's first training experience plays one GRPO step of episodes
(its tasks per step, group size and rollout limits) with the given model;
those episodes are then updated on from the same starting weights, in
alternating rounds, with ``pack_rows`` off and on
(`contrail.train.packed_rows`): update seconds, micro-batches, and the
tokens each way forwards (each micro-batch's shared prefix once; padded to
its widest row, or each row's own tokens). Each round loads the model
afresh, so every update starts from the same weights.

With ``--attention``, both ways pack rows and what alternates is the
packed rows' attention: PyTorch's SDPA kernel against the bf16 products of
`contrail.train.row_attention` (``TrainConfig.row_attention``, in bf16
on a CPU without AMX); the update's loss and gradient norm are printed each way.

    python bench/packed_rows.py --model $CONTRAIL_CACHE/warmstart/<key>/model   # the quickstart's warm-start
    python bench/packed_rows.py --experiment experiments/quickstart.yaml --rounds 3 --json out.json
    python bench/packed_rows.py --model $CONTRAIL_CACHE/warmstart/<key>/model --attention --rounds 3
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys

import torch
from _common import console, fmt, load_policy, median, prepare_process, print_machine, table, timed, write_json

from contrail.experiment import build_stream, load_experiment
from contrail.grpo.trainer import GRPOTrainer
from contrail.stream import env_factory
from contrail.train import row_attention
from contrail.train.trainer import Sample, pack_by_prompt, shared_prefix_length


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiment", default="experiments/quickstart.yaml")
    parser.add_argument("--model", default=None, help="model to play and update (default: the experiment's)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of one update each way")
    parser.add_argument("--seed", type=int, default=0, help="draws the step's tasks")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--attention", action="store_true",
                        help="packed rows both ways; compare their attention: SDPA's kernel against row_attention")
    parser.add_argument("--json", default=None)
    return parser.parse_args(argv)


def forwarded_tokens(trainer: GRPOTrainer, trajectories, packed: bool) -> tuple[int, int]:
    """``(micro-batches, tokens forwarded)`` of an update on ``trajectories``' groups with reward variance."""
    size = trainer.config.group_size
    groups = [trajectories[i:i + size] for i in range(0, len(trajectories), size)]
    samples = [Sample(t.ids, t.mask) for group in groups if len({t.reward for t in group}) > 1 for t in group]
    batches = pack_by_prompt(samples, trainer.config.micro_batch_tokens, packed=packed)
    tokens = 0
    for batch in batches:
        rows = [samples[i] for i in batch]
        shared = shared_prefix_length(rows)
        own = [len(row.ids) - shared for row in rows]
        tokens += shared + (sum(own) if packed and shared else len(rows) * max(own))
    return len(batches), tokens


def main(argv=None) -> None:
    args = parse_args(argv)
    prepare_process(args.threads)
    out = console()
    info = print_machine(out)
    experiment = load_experiment(args.experiment)
    stream = build_stream(experiment)
    model_name = args.model or experiment.model.name

    def trainer(pack_rows: bool, products: bool = False) -> GRPOTrainer:
        policy = load_policy(model_name)
        config = dataclasses.replace(experiment.grpo, pack_rows=pack_rows, row_attention=products)
        return GRPOTrainer(policy.model, policy.tokenizer, config, experiment.rollout,
                           env_factory(stream.experiences), seed=args.seed, show_progress=False)

    experience = stream.experiences[0]
    tasks = random.Random(args.seed).sample(experience.train_tasks, experiment.grpo.tasks_per_step)
    player = trainer(True)
    if not player.masked_trainer.pack_rows:
        sys.exit(f"pack_rows needs a model attending through SDPA on a CPU; {model_name} here does not")
    rollout_s, trajectories = timed(lambda: player.collect(tasks))
    out.print(f"{experience.name}: {len(trajectories)} episodes played in {rollout_s:.0f} s, "
              f"{sum(len(t.ids) for t in trajectories):,} tokens")
    if args.attention:
        compare_attention(out, info, args, trainer, trajectories)
        return
    seconds: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.rounds):
        for packed in (False, True):
            update = trainer(packed)
            elapsed, stats = timed(lambda update=update: update.update(trajectories))
            seconds[packed].append(elapsed)
            out.print(f"pack_rows={packed}: {elapsed:.1f} s ({stats.get('micro_batches', 0):.0f} micro-batches)")
    shape = {packed: forwarded_tokens(player, trajectories, packed) for packed in (False, True)}
    rows = [[("packed" if packed else "padded"), shape[packed][0], f"{shape[packed][1]:,}",
             ", ".join(fmt(s) for s in seconds[packed]), fmt(median(seconds[packed]))] for packed in (False, True)]
    out.print(table("one GRPO update on the same episodes", ["rows", "micro-batches", "tokens forwarded",
                                                               "seconds (rounds)", "median"], rows))
    ratio = median(seconds[True]) / median(seconds[False])
    out.print(f"packed / padded: {ratio:.2f}x the time, {shape[True][1] / shape[False][1]:.2f}x the tokens")
    write_json(args.json, {"machine": info, "args": vars(args), "seconds": {str(k): v for k, v in seconds.items()},
                           "micro_batches_and_tokens": {str(k): v for k, v in shape.items()}, "ratio": ratio})


def compare_attention(out, info, args, trainer, trajectories) -> None:
    """Updates on ``trajectories`` alternating the packed rows' attention: SDPA's kernel, then row_attention."""
    ways = {"sdpa": False, "products": True}
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(args.rounds):
        for way, products in ways.items():
            update = trainer(True, products)
            elapsed, stats = timed(lambda update=update: update.update(trajectories))
            seconds[way].append(elapsed)
            out.print(f"{way}: {elapsed:.1f} s (loss {stats.get('loss', 0.0):+.5f}, "
                      f"gradient norm {stats.get('grad_norm', 0.0):.4f})")
    rows = [[way, ", ".join(fmt(s) for s in seconds[way]), fmt(median(seconds[way]))] for way in ways]
    out.print(table("one GRPO update on the same episodes, packed rows", ["attention", "seconds (rounds)", "median"],
                    rows))
    ratio = median(seconds["products"]) / median(seconds["sdpa"])
    with row_attention.in_use():
        applies = row_attention.applies(torch.empty(0).bfloat16())
    out.print(f"row_attention / SDPA: {ratio:.2f}x the time"
              + ("" if applies else " (row_attention does not apply here: the trainer uses SDPA)"))
    write_json(args.json, {"machine": info, "args": vars(args), "seconds": seconds, "ratio": ratio,
                           "row_attention_applies": applies})


if __name__ == "__main__":
    main()
