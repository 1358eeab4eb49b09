"""SearchQA's text protocol (Search-R1): the prompt, the tags, the messages, exact match.

The model reasons in ``<think>...</think>``, searches with ``<search> query
</search>`` and answers with ``<answer> ... </answer>``. Only the FIRST
``<search>`` or ``<answer>`` element of an output counts (Search-R1 stops
generation at the first closing tag, so anything after it was never meant to be
read). Search results come back inside ``<information>...</information>`` as
``Doc i(Title: T) text`` lines. Answers are scored by exact match after
SQuAD-style normalisation, against every gold answer and alias.

The wording of the instruction, the invalid-action message and the wrong-answer
message follows Search-R1 and AgentGym's ``agentenv-searchqa`` so that a model
trained here sees the same text as in the original setting.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from typing import Iterable, Sequence

# Search-R1's prompt, without the trailing "Question: ..." (the question is the
# first observation, because `Env.instruction()` does not know the task).
INSTRUCTION = (
    "Answer the given question. "
    "You must conduct reasoning inside <think> and </think> first every time you get new information. "
    "After reasoning, if you find you lack some knowledge, you can call a search engine by "
    "<search> query </search> and it will return the top searched results between "
    "<information> and </information>. "
    "You can search as many times as your want. "
    "If you find no further external knowledge needed, you can directly provide the answer inside "
    "<answer> and </answer>, without detailed illustrations. For example, <answer> Beijing </answer>."
)

# Search-R1's corrective text for an output with no usable tag (its surrounding
# newlines dropped: here it is a user turn of its own, not spliced into a string).
INVALID_ACTION = (
    "My previous action is invalid. If I want to search, I should put the query between "
    "<search> and </search>. If I want to give the final answer, I should put the answer between "
    "<answer> and </answer>. Let me try again."
)

# AgentGym's SearchQA keeps the episode going after a wrong answer.
INCORRECT_ANSWER = "Sorry, your answer is incorrect. Please try again."

_OPENING = re.compile(r"<(search|answer)>")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


@dataclass(frozen=True)
class Action:
    """A parsed action: ``kind`` is ``"search"`` or ``"answer"``, ``content`` is stripped."""

    kind: str
    content: str


def parse_action(text: str | None) -> Action | None:
    """The first complete ``<search>``/``<answer>`` element of ``text``, or None.

    None means the output is not a valid action: no tag, an unclosed tag, or an
    element whose content is only whitespace. The same element as
    ``re.search(r"<(search|answer)>(.*?)</\1>", text, re.DOTALL)``, found in
    linear time: that expression rescans the rest of the text for every
    unclosed opening tag.
    """
    text = text or ""
    last_close = {kind: text.rfind(f"</{kind}>") for kind in ("search", "answer")}
    for opening in _OPENING.finditer(text):
        kind = opening.group(1)
        if last_close[kind] >= opening.end():  # this opening is closed somewhere after it
            content = text[opening.end():text.find(f"</{kind}>", opening.end())].strip()
            return Action(kind=kind, content=content) if content else None
    return None


def question_prompt(question: str) -> str:
    """The first observation: the question, as Search-R1 appends it to its prompt."""
    question = question.strip()
    # Search-R1 adds the question mark that NQ's questions lack.
    if question and question[-1] != "?":
        question += "?"
    return f"Question: {question}"


def format_information(documents: Iterable[tuple[str, str]]) -> str:
    """Search results as Search-R1 renders them: ``Doc i(Title: T) text`` lines in ``<information>``."""
    lines = "".join(f"Doc {rank}(Title: {title}) {text}\n" for rank, (title, text) in enumerate(documents, 1))
    return f"<information>{lines}</information>"


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower-case, drop punctuation, drop articles a/an/the, squeeze spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, gold_answers: Sequence[str]) -> bool:
    """True when ``prediction`` equals any gold answer after normalisation."""
    predicted = normalize_answer(prediction)
    return any(predicted == normalize_answer(gold) for gold in gold_answers)
