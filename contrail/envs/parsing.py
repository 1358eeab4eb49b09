"""Extracting actions from raw model text, shared by the Thought/Action environments.

Model output is untrusted and can be huge (a model that never stops), so every
parser here runs in time linear in the text. The reading is the one AgentGym's
``^\\s*Action\\s*:\\s*(.*?)\\s*$`` (multi-line, any case) gives: a line whose
first word is ``Action``, then optional whitespace, a colon, and the action is
the first non-blank text after the colon (on the same line or a later one),
up to the end of its line, stripped. That regular expression itself is
quadratic in runs of whitespace (its ``\\s*`` pieces can start anywhere in a
run and overlap), so it is replaced by a scan with the same result.
"""

from __future__ import annotations

import re

# A line start, blanks within the line, then the word: only ever tried at line starts, so linear.
_ACTION_WORD = re.compile(r"^[^\S\n]*action", re.IGNORECASE | re.MULTILINE)
_SPACE = re.compile(r"\s*")  # one greedy run, matched at a position: no backtracking


def action_lines(text: str) -> list[str]:
    """Every non-empty ``Action: ...`` line in ``text``, in order."""
    text = text or ""
    found: list[str] = []
    position = 0
    while (word := _ACTION_WORD.search(text, position)) is not None:
        colon = _SPACE.match(text, word.end()).end()
        if colon >= len(text) or text[colon] != ":":
            position = word.end()  # "Actions", "Action plan": not a marker
            continue
        start = _SPACE.match(text, colon + 1).end()
        if start >= len(text):
            break  # "Action:" then only whitespace: nothing to act on
        end = text.find("\n", start)
        end = len(text) if end < 0 else end
        found.append(text[start:end].rstrip())
        position = end
    return found


def last_action(text: str) -> str | None:
    """The content of the last ``Action:`` line, or None when there is none.

    AgentGym takes the last ``Action:`` line of the output; environments that
    reject several actions (BabyAI) check ``action_lines`` themselves.
    """
    found = action_lines(text)
    return found[-1] if found else None
