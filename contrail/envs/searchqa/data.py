"""SearchQA's records (passages, questions) and the loader for real corpora on disk.

Two sources feed the environment: the generated encyclopedia
(`searchqa.world`) and files a user already has, in the layouts Search-R1 and
FlashRAG use:

- passages, JSONL, one per line: ``{"id", "title", "text"}``, or Search-R1's
  Wikipedia dump ``{"id", "contents": "\\"Title\\"\\ntext"}``;
- questions, JSONL, one per line: ``question`` plus a list of gold answers
  (``golden_answers`` as FlashRAG's NQ/HotpotQA files, or ``answers``/``answer``),
  optionally ``split`` (train/test), ``difficulty`` (easy/hard) and
  ``data_source`` (multi-hop sources such as HotpotQA count as hard).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Sequence

# Search-R1's multi-hop benchmarks; every other source counts as single-hop.
MULTI_HOP_SOURCES = frozenset({"hotpotqa", "2wikimultihopqa", "musique", "bamboogle"})
# Without a split field or a per-split file, every fifth question goes to test.
TEST_EVERY = 5


@dataclass(frozen=True)
class Passage:
    """One retrievable document."""

    id: str
    title: str
    text: str


@dataclass(frozen=True)
class Hop:
    """One step of a generated question: the fact ``relation(subject) = obj``.

    ``passage`` indexes the subject's passage, where the fact is written.
    """

    passage: int
    subject: str
    relation: str
    obj: str


@dataclass(frozen=True)
class Question:
    """A question, its gold answers (aliases included), split and difficulty.

    ``hops`` is the chain of facts that leads to the answer: known for generated
    questions, empty for loaded ones.
    """

    text: str
    answers: tuple[str, ...]
    split: str
    difficulty: str
    hops: tuple[Hop, ...] = ()


# --- passages --------------------------------------------------------------------


def _passage_from_record(record: Mapping, line_number: int) -> Passage:
    """Read either layout; Search-R1's ``contents`` is a quoted title line, then the text."""
    identifier = str(record.get("id", line_number))
    if "contents" in record:
        title, _, text = str(record["contents"]).partition("\n")
        title = title.strip()
        # The dump quotes its titles ('"Paris"'): keep the bare title.
        if len(title) >= 2 and title[0] == title[-1] == '"':
            title = title[1:-1]
        return Passage(id=identifier, title=title, text=text.strip())
    if "text" in record:
        return Passage(id=identifier, title=str(record.get("title", "")).strip(), text=str(record["text"]).strip())
    raise ValueError(f"passage line {line_number} has neither 'contents' nor 'text': keys {sorted(record)}")


def _jsonl_records(path: Path, what: str) -> Iterator[tuple[int, dict]]:
    if not path.is_file():
        raise FileNotFoundError(f"SearchQA {what} file not found: {path}")
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                yield line_number, json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_number} is not valid JSON: {error}") from error


def load_passages(path: str | Path) -> list[Passage]:
    """Every passage of a JSONL corpus, in file order."""
    path = Path(path).expanduser()
    passages = [_passage_from_record(record, number) for number, record in _jsonl_records(path, "corpus")]
    if not passages:
        raise ValueError(f"SearchQA corpus {path} holds no passages")
    return passages


# --- questions ---------------------------------------------------------------------


def _gold_answers(record: Mapping, where: str) -> tuple[str, ...]:
    for key in ("golden_answers", "answers", "answer"):
        if key in record:
            value = record[key]
            answers = [value] if isinstance(value, str) else list(value)
            answers = tuple(str(answer) for answer in answers if str(answer).strip())
            if answers:
                return answers
    raise ValueError(f"{where} has no gold answers (expected 'golden_answers', 'answers' or 'answer')")


def _difficulty(record: Mapping) -> str:
    declared = str(record.get("difficulty", "")).lower()
    if declared in ("easy", "hard"):
        return declared
    source = str(record.get("data_source", record.get("dataset", ""))).lower()
    return "hard" if source in MULTI_HOP_SOURCES else "easy"


def _read_questions(path: Path, split: str | None) -> list[Question]:
    questions = []
    for index, (line_number, record) in enumerate(_jsonl_records(path, "questions")):
        where = f"{path}:{line_number}"
        if "question" not in record:
            raise ValueError(f"{where} has no 'question' field")
        record_split = split or str(record.get("split", "")).lower()
        if record_split not in ("train", "test"):
            record_split = "test" if index % TEST_EVERY == TEST_EVERY - 1 else "train"
        questions.append(
            Question(
                text=str(record["question"]).strip(),
                answers=_gold_answers(record, where),
                split=record_split,
                difficulty=_difficulty(record),
            )
        )
    return questions


def load_questions(spec: str | Path | Mapping[str, str | Path] | Sequence[str | Path]) -> list[Question]:
    """Questions from one file, several files, or a ``{"train": path, "test": path}`` mapping.

    A mapping fixes each file's split. Otherwise a line's ``split`` field decides,
    and lines without one are split deterministically (every fifth to test).
    """
    if isinstance(spec, Mapping):
        unknown = set(spec) - {"train", "test"}
        if unknown:
            raise ValueError(f"questions_path keys must be 'train' and/or 'test', got {sorted(unknown)}")
        sources = [(Path(spec[split]).expanduser(), split) for split in ("train", "test") if split in spec]
    elif isinstance(spec, (str, Path)):
        sources = [(Path(spec).expanduser(), None)]
    else:
        sources = [(Path(path).expanduser(), None) for path in spec]
    questions = [question for path, split in sources for question in _read_questions(path, split)]
    if not questions:
        raise ValueError(f"no SearchQA questions found in {spec}")
    return questions
