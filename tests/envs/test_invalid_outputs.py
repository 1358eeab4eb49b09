"""Invalid model output never raises and never earns reward, in every environment.

Seeded random garbage (ASCII, any Unicode, control characters, undecodable
bytes), huge and empty outputs, and near-misses of each environment's action
format all go through ``step()`` of one live episode: no exception, reward 0,
the episode not over, and ``valid=False`` (none of them is an action).
"""

from __future__ import annotations

import random
import string

import pytest

NAMES = ["textcraft", "alfworld", "webshop", "searchqa"]
# No environment can read an action without one of these: "Action:" (textcraft, alfworld),
# "[...]" (webshop), "<tag>" (searchqa). Garbage without them is never an action.
MARKERS = set(":[]<>")

NEAR_MISSES = [
    "", " ", "\n\n\t", "Action:", "Action: ", "Action:\n\n", "action :", "Thought: I will act.",
    "Action: craft using", "Action: craft 1 x using", "Action: get 99999999999999999999 stick",
    "Action: get -1 stick", "Action: put  in/on ", "Action: go to", "Action: take nothing from nowhere",
    "search[ ]", "click[]", "[]", "search[", "click[Buy Now", "Action: click[", "Action: search]x[",
    "<search></search>", "<search>   </search>", "<answer>\n</answer>", "<search>unclosed",
    "</search>x<search>", "<answer", "<Search>x</Search>", "<think>only thinking</think>",
    "\x00\x01\x02", "\uffff\ufffe", "Action: \u202e\u200b", "🙂" * 50,
]


def garbage(seed: int, count: int) -> list[str | bytes]:
    rng = random.Random(seed)
    ascii_pool = [c for c in string.printable if c not in MARKERS]
    texts: list[str | bytes] = []
    for index in range(count):
        length = rng.choice((1, 5, 40, 300))
        if index % 4 == 0:
            texts.append("".join(rng.choice(ascii_pool) for _ in range(length)))
        elif index % 4 == 1:  # any code point but surrogates and the markers
            points = (rng.randrange(0x110000) for _ in range(length))
            texts.append("".join(chr(p) for p in points if not 0xD800 <= p < 0xE000 and chr(p) not in MARKERS))
        elif index % 4 == 2:
            texts.append(bytes(rng.randrange(256) for _ in range(length)).replace(b":", b"").replace(b"[", b"")
                         .replace(b"]", b"").replace(b"<", b"").replace(b">", b""))
        else:
            word = rng.choice(("Action", "craft", "search", "click", "answer", "put", "go to", "inventory"))
            texts.append(f"{word} {rng.random()}" * rng.randint(1, 20))  # action words, never a marker
    return texts


HUGE = ["x" * 300_000, "Action" * 50_000, "\u00a0" * 200_000, " " * 100_000 + "Action"]


@pytest.mark.parametrize("name", NAMES)
def test_garbage_never_raises_never_rewards_and_is_invalid(name, make_env):
    texts = NEAR_MISSES + garbage(seed=NAMES.index(name), count=120) + HUGE
    env = make_env(name)
    env.reset(env.tasks("test")[0], turn_limit=len(texts) + 1)
    for text in texts:
        step = env.step(text)
        assert (step.reward, step.success, step.done, step.valid) == (0.0, False, False, False), repr(text)[:200]
        assert isinstance(step.observation, str) and step.observation
