"""What an update's scoring pass costs: the precision ``auto`` picks, and the LM head run only at sampled tokens.

(a) The matrix-product rate of fp32 and bf16 on this machine, side by side,
    and what ``precision: auto`` resolves to here (`contrail.precision`): a
    CPU without bf16 matrix units emulates bf16 products.
(b) One LoRA update's scoring pass (forward and backward of
    `contrail.train.logprobs.sequence_logprobs` with the entropy, as
    `GRPOTrainer` runs it) over quickstart-shaped micro-batches: each row a
    shared prompt, then turns of sampled tokens between observations. Scored
    at every position from the first sampled token on (before) against
    ``positions=loss_mask`` (the LM head and log-softmax only where they
    predict a sampled token), in alternating rounds; the table gives each
    round's times and the ratio of medians.
(c) Under bf16 autocast, the same LoRA scoring pass (sampled positions only)
    in the trainer's ``MaskedTokenTrainer.autocast()``, where adapters take
    their input as it comes, against a plain ``torch.autocast``, where PEFT
    casts a bf16 input up to the adapter's fp32 first (autocast then casts it
    back), in alternating rounds.
(d) The log-softmax's rows per chunk (`contrail.train.logprobs`): forward
    and backward of ``logprobs_and_entropy`` over ``--lsm-rows`` bf16 rows of
    the model's vocabulary, for each of ``--chunk-sizes``, in alternating
    rounds, and whether every chunk size gave the same bits (each row is
    computed alone, so it must).

    python bench/scoring.py --quick            # SmolLM2-135M, 2 micro-batches of 5 rows, 3 rounds
    python bench/scoring.py --model tiny       # overheads only
"""

from __future__ import annotations

import argparse
import functools

import _common as common
import torch


def quickstart_batch(rows: int, prefix: int, turns: int, generated: int, observation: int, vocab: int, seed: int):
    """``(ids, attention, loss_mask)``: ``rows`` episodes sharing ``prefix`` prompt ids, then ``turns`` turns.

    A turn is ``generated`` sampled ids (mask 1) followed by an observation of
    ``observation`` ids (mask 0), except the last, which ends the episode.
    Rows end a turn apart (some episodes finish sooner), right-padded.
    """
    generator = torch.Generator().manual_seed(seed)
    lengths, masks = [], []
    for row in range(rows):
        own_turns = turns - (row % 2)  # half the rows finish a turn early
        mask = [0] * prefix
        for turn in range(own_turns):
            mask += [1] * generated + ([0] * observation if turn < own_turns - 1 else [])
        lengths.append(len(mask))
        masks.append(mask)
    width = max(lengths)
    head = torch.randint(5, vocab, (prefix,), generator=generator)
    ids = torch.zeros((rows, width), dtype=torch.long)
    attention = torch.zeros_like(ids)
    loss_mask = torch.zeros_like(ids)
    for row, (length, mask) in enumerate(zip(lengths, masks)):
        ids[row, :length] = torch.cat([head, torch.randint(5, vocab, (length - prefix,), generator=generator)])
        attention[row, :length] = 1
        loss_mask[row, :length] = torch.tensor(mask)
    return ids, attention, loss_mask


def bf16_autocast(enabled: bool = True):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled)


def scoring_pass(model, batches, positions: bool, autocast) -> None:
    """Forward and backward of every micro-batch's scoring, as one update runs it, inside ``autocast()``."""
    from contrail.train.logprobs import sequence_logprobs

    for ids, attention, loss_mask in batches:
        start = int(torch.nonzero(loss_mask.any(0))[0])
        with autocast():
            logprobs, entropy = sequence_logprobs(model, ids, attention, start=start, return_entropy=True,
                                                  shared_prefix=start - 1,
                                                  positions=loss_mask if positions else None)
        loss = -(logprobs * loss_mask).sum() / loss_mask.sum() + 0.0 * (entropy * loss_mask).sum()
        loss.backward()
    model.zero_grad(set_to_none=True)


def load_lora_model(name: str):
    import peft

    if name == "tiny":
        model, _ = common.tiny_model_and_tokenizer()
    else:
        from contrail.models import load_model

        model, _ = load_model(name)
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    return model.train()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the defaults below (about five minutes on 2 cores)")
    parser.add_argument("--model", default="smollm2-135m", help="'tiny', 'smollm2-135m' or a model id")
    parser.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"))
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--rows", type=int, default=5, help="rows per micro-batch (the quickstart packs 4-6)")
    parser.add_argument("--prefix", type=int, default=300, help="shared prompt ids per row")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--generated", type=int, default=25, help="sampled ids per turn (BabyAI's median: 24)")
    parser.add_argument("--observation", type=int, default=110, help="observation ids between turns")
    parser.add_argument("--rounds", type=int, default=3, help="alternating before/after rounds")
    parser.add_argument("--matmul-size", type=int, default=1024, help="(a): square size (bf16 may be emulated: slow)")
    parser.add_argument("--lsm-rows", type=int, default=2400, help="(d): scored rows (a micro-batch's worth)")
    parser.add_argument("--chunk-sizes", default="4,8,16,32", help="(d): rows per chunk, comma-separated")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    common.prepare_process(args.threads)
    console = common.console()
    info = common.print_machine(console)

    from contrail.precision import resolve_precision

    fp32, bf16 = (common.matmul_flops(dtype, size=args.matmul_size) for dtype in (torch.float32, torch.bfloat16))
    resolved = resolve_precision(args.precision, "cpu")
    console.print(common.table(f"(a) matrix products, {args.matmul_size}², best of 3", ["fp32 GFLOP/s", "bf16 GFLOP/s",
                                                                          "bf16 / fp32", "precision auto"],
                               [[common.fmt(fp32 / 1e9), common.fmt(bf16 / 1e9), common.fmt(bf16 / fp32, 2),
                                 resolve_precision("auto", "cpu")]]))

    model = load_lora_model(args.model)
    vocab = model.get_output_embeddings().weight.shape[0]
    batches = [quickstart_batch(args.rows, args.prefix, args.turns, args.generated, args.observation, vocab, seed)
               for seed in range(args.micro_batches)]
    autocast = functools.partial(bf16_autocast, resolved == "bf16")
    scoring_pass(model, batches[:1], positions=True, autocast=autocast)  # warm-up: allocator, first-call costs
    times: dict[str, list[float]] = {"every position": [], "sampled only": []}
    for _ in range(args.rounds):
        for label, positions in (("every position", False), ("sampled only", True)):
            seconds, _ = common.timed(lambda positions=positions: scoring_pass(model, batches, positions, autocast))
            times[label].append(seconds)
    before, after = common.median(times["every position"]), common.median(times["sampled only"])
    sampled = sum(int(mask.sum()) for _, _, mask in batches)
    scored = sum(int(attention[:, int(torch.nonzero(mask.any(0))[0]):].sum()) for _, attention, mask in batches)
    rows = [[label, " / ".join(common.fmt(t, 2) for t in values), common.fmt(common.median(values), 2)]
            for label, values in times.items()]
    console.print(common.table(
        f"(b) LoRA scoring pass, {resolved}: {args.micro_batches} micro-batches x {args.rows} rows, "
        f"{sampled} sampled of {scored} scored tokens", ["LM head at", "seconds per round", "median"], rows))
    console.print(f"sampled only / every position: [bold]{after / before:.2f}x[/]")
    uncast = adapter_inputs(args, batches, console) if resolved == "bf16" else None
    chunks = chunk_sizes(args, vocab, console)
    common.write_json(args.json, {"machine": info, "matmul_gflops": {"fp32": fp32 / 1e9, "bf16": bf16 / 1e9},
                                  "precision": resolved, "seconds": times, "ratio": after / before,
                                  "sampled_tokens": sampled, "scored_tokens": scored, "adapter_inputs": uncast,
                                  "chunk_sizes": chunks})


def adapter_inputs(args, batches, console) -> dict:
    """(c): the trainer's autocast (adapter inputs uncast) against a plain one (PEFT's cast), alternating."""
    from contrail.models import load_model
    from contrail.train.config import TrainConfig
    from contrail.train.trainer import MaskedTokenTrainer

    if args.model == "tiny":
        model, tokenizer = common.tiny_model_and_tokenizer()
    else:
        model, tokenizer = load_model(args.model)
    trainer = MaskedTokenTrainer(model, tokenizer, TrainConfig(lora=True, lora_r=16, lora_alpha=32, precision="bf16"))
    contexts = {"trainer's autocast": trainer.autocast, "torch.autocast": bf16_autocast}
    scoring_pass(trainer.model, batches[:1], True, trainer.autocast)  # warm-up
    times: dict[str, list[float]] = {label: [] for label in contexts}
    for _ in range(args.rounds):
        for label, context in contexts.items():
            seconds, _ = common.timed(lambda context=context: scoring_pass(trainer.model, batches, True, context))
            times[label].append(seconds)
    rows = [[label, " / ".join(common.fmt(t, 2) for t in values), common.fmt(common.median(values), 2)]
            for label, values in times.items()]
    console.print(common.table("(c) LoRA scoring pass, bf16, sampled positions: where adapters take their input",
                               ["autocast", "seconds per round", "median"], rows))
    ratio = common.median(times["trainer's autocast"]) / common.median(times["torch.autocast"])
    console.print(f"trainer's autocast (input uncast) / torch.autocast (PEFT's cast): [bold]{ratio:.2f}x[/]")
    return {"seconds": times, "ratio": ratio}


def chunk_sizes(args, vocab: int, console) -> dict:
    """(d): the log-softmax's forward and backward per rows-per-chunk, alternating; and whether the bits agree."""
    from contrail.train.logprobs import DEFAULT_CHUNK_SIZE, logprobs_and_entropy

    sizes = [int(size) for size in args.chunk_sizes.split(",")]
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(args.lsm_rows, vocab, generator=generator) * 3).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, vocab, (args.lsm_rows,), generator=generator)
    weights = torch.rand(2, args.lsm_rows, generator=generator)  # the loss's weights on log-probs and entropies

    def scored(size: int) -> tuple[torch.Tensor, ...]:
        logprobs, entropies = logprobs_and_entropy(logits, targets, chunk_size=size)
        (logprobs * weights[0] + entropies * weights[1]).sum().backward()
        grad, logits.grad = logits.grad, None
        return logprobs.detach(), entropies.detach(), grad

    results = {size: scored(size) for size in sizes}  # warm-up, and the outputs compared below
    times: dict[int, list[float]] = {size: [] for size in sizes}
    for _ in range(args.rounds):
        for size in sizes:
            times[size].append(common.timed(lambda size=size: scored(size))[0])
    reference = common.median(times[sizes[-1]])
    same = all(all(torch.equal(a, b) for a, b in zip(results[sizes[0]], results[size])) for size in sizes)
    rows = [[str(size) + (" (default)" if size == DEFAULT_CHUNK_SIZE else ""),
             " / ".join(common.fmt(t, 3) for t in times[size]), common.fmt(common.median(times[size]), 3),
             common.fmt(common.median(times[size]) / reference, 2)] for size in sizes]
    console.print(common.table(f"(d) log-softmax with entropy, forward + backward, {args.lsm_rows} bf16 rows x {vocab}",
                               ["rows per chunk", "seconds per round", "median", f"/ {sizes[-1]} rows"], rows))
    console.print(f"same log-probs, entropies and gradients at every chunk size: [bold]{'yes' if same else 'NO'}[/]")
    return {"seconds": {str(size): values for size, values in times.items()}, "same_bits": same}


if __name__ == "__main__":
    main()
