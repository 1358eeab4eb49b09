"""Tiny models, tokenizers and environments for tests, benchmarks and examples.

Everything here is built locally from a config: nothing is downloaded. The
tokenizer is word-level with a chatML template (append-only, like SmolLM2's
and Qwen's), so multi-turn bookkeeping is exercised exactly as with a real
chat model, at a size that trains in seconds on a CPU.
"""

from __future__ import annotations

import contextlib
import random
import re
from collections.abc import Iterator

import torch

from contrail.envs.base import Env, Step, Task, register

SPECIAL_TOKENS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
BASE_WORDS = (
    "user assistant system ok the a to of and you say word reply with one what is your task "
    "goal action thought done wrong right try again apple berry cherry grape lemon mango "
    "red blue green go turn left right pick up door key ball box"
).split()


def tiny_tokenizer(extra_words: tuple[str, ...] = ()):
    """A word-level chatML tokenizer over a small vocabulary (unknown words map to <unk>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = list(dict.fromkeys(BASE_WORDS + list(extra_words) + list(".,:!?")))
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + words)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", eos_token="<|im_end|>",
        bos_token="<|im_start|>", additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.padding_side = "left"
    return tokenizer


def tiny_model(tokenizer, hidden_size: int = 32, layers: int = 2, seed: int = 0):
    """A random-init Llama of a few layers sized to ``tokenizer``'s vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=hidden_size * 2,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


def save_tiny_model(path, seed: int = 0) -> str:
    """Save `tiny_model` and `tiny_tokenizer` to ``path`` (a model directory any loader reads); returns it."""
    tokenizer = tiny_tokenizer()
    tiny_model(tokenizer, seed=seed).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@contextlib.contextmanager
def fed_widths(model) -> Iterator[list[int]]:
    """Within the block, the list collects how many positions each forward of ``model`` was fed.

    >>> with fed_widths(model) as widths:
    ...     backend.generate(prompts, params)   # widths[0]: the first prefill's width
    """
    widths: list[int] = []
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]),
                                           with_kwargs=True)
    try:
        yield widths
    finally:
        hook.remove()


class MagicWordEnv(Env):
    """Win by replying with the magic word; a tiny environment for learning tests.

    The observation asks for a word; a reply whose first word is the magic word
    wins (reward 1). Any other reply that contains a known fruit is a valid but
    wrong action ("wrong . try again"); anything else is invalid. Easy tasks
    allow 3 turns, hard tasks 1.
    """

    name = "magic"
    difficulties = ("easy", "hard")
    default_max_turns = 3
    magic = "apple"
    fruits = ("apple", "berry", "cherry", "grape", "lemon", "mango")

    def __init__(self, max_turns: int | None = None, tasks_per_split: int = 40):
        super().__init__(max_turns)
        self.tasks_per_split = tasks_per_split

    def instruction(self) -> str:
        return "say the word ."

    def tasks(self, split: str, difficulty: str | None = None) -> list[Task]:
        self.check_split(split, difficulty)
        offset = 0 if split == "train" else 10_000
        tasks = [Task(self.name, offset + i, split, "easy" if i % 2 == 0 else "hard")
                 for i in range(self.tasks_per_split)]
        return [t for t in tasks if difficulty in (None, t.difficulty)]

    def turn_limit(self, task: Task) -> int:
        return 1 if task.difficulty == "hard" else self.max_turns

    def on_reset(self, task: Task) -> str:
        return "what is your word ?"

    def on_step(self, text: str) -> Step:
        words = re.findall(r"[a-z]+", text.lower())
        if words and words[0] == self.magic:
            return Step(observation="right", reward=1.0, done=True, success=True)
        if any(w in self.fruits for w in words):
            return Step(observation="wrong . try again", valid=True)
        return Step(observation="say one word .", valid=False)

    def expert(self) -> str:
        return self.magic

    def random_action(self, rng: random.Random) -> str:
        return rng.choice(self.fruits)


@register("magic-berry")
class BerryWordEnv(MagicWordEnv):
    """The same game with another magic word: a second tiny environment for streams."""

    name = "magic-berry"
    magic = "berry"


register("magic")(MagicWordEnv)
