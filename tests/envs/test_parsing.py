"""Action parsing is linear in the model's output, and reads exactly what the old expressions read.

The old parsers were regular expressions that backtrack quadratically (a
50,000-character output took 8.6-19.7 s in ``step()``). Each replacement is
checked against the expression it replaces on many small random texts, and
every environment's ``step()`` on 1 MB adversarial outputs.
"""

from __future__ import annotations

import random
import re
import time

import pytest

from contrail.envs.parsing import action_lines, last_action
from contrail.envs.searchqa.protocol import parse_action as parse_tags
from contrail.envs.webshop.env import split_bracketed

OLD_ACTION_LINE = re.compile(r"^\s*Action\s*:\s*(.*?)\s*$", re.IGNORECASE | re.MULTILINE)
OLD_BRACKETED = re.compile(r"(.+)\[(.+)\]")
OLD_TAGS = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)


def random_texts(pieces: list[str], count: int = 3000, length: int = 12, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(count):
        yield "".join(rng.choice(pieces) for _ in range(rng.randint(0, length)))


def test_action_lines_read_what_agentgyms_expression_reads():
    pieces = ["Action", "action", "ACTION", ":", " ", "  ", "\n", "\t", "\r", "\u00a0", "\u2028", "x", "go to", "s"]
    for text in random_texts(pieces):
        expected = [found for found in OLD_ACTION_LINE.findall(text) if found]
        assert action_lines(text) == expected, repr(text)


def test_last_action_examples():
    assert last_action("Thought:\nI will get it.\n\nAction:\nget 1 stick  \n") == "get 1 stick"
    assert last_action("Action: a\nAction: b") == "b"
    assert last_action("Actions: a\nmy Action: b") is None
    assert last_action("Action:   \n\n") is None and last_action("") is None and last_action(None) is None


def test_webshop_brackets_split_where_webshops_expression_splits():
    for text in random_texts(["[", "]", "a", " ", "click", "search", "[x]"], length=10):
        match = OLD_BRACKETED.match(text)
        assert split_bracketed(text) == (match.groups() if match else None), repr(text)


def test_searchqa_tags_are_found_as_search_r1s_expression_finds_them():
    pieces = ["<search>", "</search>", "<answer>", "</answer>", "<search", "x", " ", "\n", "</"]
    for text in random_texts(pieces, length=8):
        match = OLD_TAGS.search(text)
        content = match.group(2).strip() if match else ""
        expected = (match.group(1), content) if match and content else None
        found = parse_tags(text)
        assert (None if found is None else (found.kind, found.content)) == expected, repr(text)


MEGABYTE = 1_000_000
HUGE_OUTPUTS = {
    "blank lines": "\n" * MEGABYTE,
    "spaces inside an action": "Action: a" + " " * MEGABYTE + "b",
    "whitespace after the marker": "Action:" + " \t\n" * (MEGABYTE // 3),
    "unclosed tags": "<search>" * (MEGABYTE // 8),
    "brackets": "Action: click[" + "[" * MEGABYTE,
    "many action lines": "Action: get 1 stick\n" * (MEGABYTE // 20),
    "long craft": "Action: craft " + "1 stick, " * (MEGABYTE // 9) + " using",
    "long put": "Action: put " + "apple in " * (MEGABYTE // 9),
}


@pytest.mark.parametrize("name", ["textcraft", "alfworld", "webshop", "searchqa"])
def test_a_megabyte_output_is_parsed_without_backtracking(name, make_env):
    """A guard against patterns that backtrack (seconds per step growing with the square of the output or
    worse: hours at a megabyte), not a speed claim: a step measured 0.04-0.11 s here (bench/envs.py
    times the parsers)."""
    env = make_env(name)
    env.reset(env.tasks("test")[0], turn_limit=len(HUGE_OUTPUTS) + 1)
    for label, text in HUGE_OUTPUTS.items():
        started = time.perf_counter()
        step = env.step(text)
        seconds = time.perf_counter() - started
        assert seconds < 10.0, f"{name}: {label} took {seconds:.2f} s"
        assert step.reward == 0 and not step.done, label
