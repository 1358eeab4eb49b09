"""Extracting actions from raw model text, shared by the Thought/Action environments."""

from __future__ import annotations

import re

_ACTION_LINE = re.compile(r"^\s*Action\s*:\s*(.*?)\s*$", re.IGNORECASE | re.MULTILINE)


def action_lines(text: str) -> list[str]:
    """Every non-empty ``Action: ...`` line in ``text``, in order."""
    return [match for match in _ACTION_LINE.findall(text or "") if match]


def last_action(text: str) -> str | None:
    """The content of the last ``Action:`` line, or None when there is none.

    AgentGym takes the last ``Action:`` line of the output; environments that
    reject several actions (BabyAI) check ``action_lines`` themselves.
    """
    found = action_lines(text)
    return found[-1] if found else None
