"""SearchQA: search-augmented question answering with Search-R1's protocol.

The model reasons in ``<think>``, searches with ``<search> query </search>`` and
gets the top 3 passages back in ``<information>``, and answers with ``<answer>``
(see `searchqa.protocol`). A correct answer (normalised exact match against the
gold answers and aliases) ends the episode with reward 1; a wrong one says so
and the episode goes on, as AgentGym's SearchQA does.

Two sources of questions and passages:

- default: a generated encyclopedia of fictional entities (`searchqa.world`),
  so answers must be retrieved, not remembered. Easy = 1-hop questions, hard =
  2-3 hops. ``seed=`` picks the world.
- ``corpus_path=`` + ``questions_path=``: a real corpus and NQ/HotpotQA-style
  question files on local disk (`searchqa.data`), to run the original setting.

Retrieval is BM25 (``retriever="bm25"``) or MiniLM embeddings
(``retriever="dense"``, optional package). Worlds, passages and indices are built
once per process and shared by every episode; indices are also cached on disk.

Turn limits follow AgentGym-RL: 5 turns on training tasks, 30 on test tasks.

>>> from contrail.envs import make
>>> env = make("searchqa")
>>> task = env.tasks("test", "hard")[0]
>>> env.reset(task).startswith("Question: ")
True
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from contrail.envs.base import Env, Step, Task, register
from contrail.envs.searchqa.data import Hop, Passage, Question, load_passages, load_questions
from contrail.envs.searchqa.protocol import (
    INCORRECT_ANSWER,
    INSTRUCTION,
    INVALID_ACTION,
    exact_match,
    format_information,
    normalize_answer,
    parse_action,
    question_prompt,
)
from contrail.envs.searchqa.retrieval import RETRIEVERS, Retriever, build_retriever
from contrail.envs.searchqa.world import RELATIONS, World

CORRECT_ANSWER = "Your answer is correct."
QuestionsSpec = str | Path | Mapping[str, str | Path] | Sequence[str | Path]


@dataclass
class KnowledgeSource:
    """Passages, their retriever and the questions over them: shared by all episodes."""

    passages: list[Passage]
    questions: list[Question]
    answer_pool: list[str]  # what a random agent may answer: entity names or passage titles
    build_seconds: float
    retriever_name: str = "bm25"
    cache_dir: str | Path | None = None
    _tasks: dict[tuple[str, str | None], list[Task]] = field(default_factory=dict, repr=False)
    _retriever: Retriever | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def retriever(self) -> Retriever:
        """The search index over ``passages``, built (or loaded from disk) at the first search.

        Listing tasks never needs it, so ``contrail envs`` and ``--dry-run`` stay cheap.
        """
        with self._lock:
            if self._retriever is None:
                started = time.perf_counter()
                self._retriever = build_retriever(self.retriever_name, self.passages, self.cache_dir)
                self.build_seconds += time.perf_counter() - started
            return self._retriever

    def tasks(self, split: str, difficulty: str | None) -> list[Task]:
        """The tasks of ``split`` (and ``difficulty``), in id order; a fresh list each call."""
        key = (split, difficulty)
        if key not in self._tasks:
            self._tasks[key] = [
                Task(env="searchqa", id=index, split=question.split, difficulty=question.difficulty)
                for index, question in enumerate(self.questions)
                if question.split == split and difficulty in (None, question.difficulty)
            ]
        return list(self._tasks[key])


_SOURCES: dict[tuple, KnowledgeSource] = {}
_SOURCES_LOCK = threading.Lock()


def _source_key(seed: int, corpus_path, questions_path, retriever: str, cache_dir) -> tuple:
    if isinstance(questions_path, Mapping):
        questions_key = tuple(sorted((split, str(path)) for split, path in questions_path.items()))
    elif isinstance(questions_path, (str, Path)) or questions_path is None:
        questions_key = str(questions_path)
    else:
        questions_key = tuple(str(path) for path in questions_path)
    origin = ("files", str(corpus_path), questions_key) if corpus_path is not None else ("world", seed)
    return (*origin, retriever, str(cache_dir))


def knowledge_source(seed: int = 0, corpus_path=None, questions_path=None, retriever: str = "bm25",
                     cache_dir=None) -> KnowledgeSource:
    """The process-wide `KnowledgeSource` for these options, built on first use."""
    key = _source_key(seed, corpus_path, questions_path, retriever, cache_dir)
    with _SOURCES_LOCK:
        if key not in _SOURCES:
            _SOURCES[key] = _build_source(seed, corpus_path, questions_path, retriever, cache_dir)
        return _SOURCES[key]


def _build_source(seed, corpus_path, questions_path, retriever, cache_dir) -> KnowledgeSource:
    started = time.perf_counter()
    if corpus_path is not None:
        passages = load_passages(corpus_path)
        questions = load_questions(questions_path)
        pool = sorted({passage.title for passage in passages if passage.title})
    else:
        world = World(seed)
        passages, questions = world.passages, world.questions
        pool = [entity.name for entity in world.entities]
    return KnowledgeSource(passages, questions, pool, time.perf_counter() - started, retriever, cache_dir)


# --- the expert's words --------------------------------------------------------------

_FIRST_SEARCH = ("I need to find out {need}.", "To answer this, I first need to find out {need}.",
                 "The question depends on {need}. Let me look that up.")
_NEXT_SEARCH = ("{Fact}. Now I need to find out {need}.",
                "The results show that {fact}. Next I need to find out {need}.",
                "So {fact}. Let me now look up {need}.")
_RETRY_SEARCH = ("The results did not include the passage about {subject}. Let me search for it again.",
                 "None of these documents is about {subject}. I will try another query.")
_ANSWER = ("{Fact}. So the answer is {answer}.", "The results show that {fact}, so the answer is {answer}.",
           "Since {fact}, the answer is {answer}.")


def _fact(hop: Hop) -> str:
    article = "an" if hop.obj[:1].lower() in "aeiou" else "a"
    return RELATIONS[hop.relation].statement.format(s=hop.subject, o=hop.obj, an_o=f"{article} {hop.obj}")


def _need(hop: Hop) -> str:
    return RELATIONS[hop.relation].need.format(s=hop.subject)


def _fill(template: str, **values: str) -> str:
    capitalised = {key.capitalize(): value[:1].upper() + value[1:] for key, value in values.items()}
    return template.format(**values, **capitalised)


def _search(thought: str, query: str) -> str:
    return f"<think>{thought}</think>\n<search> {query} </search>"


def _answer(thought: str, answer: str) -> str:
    return f"<think>{thought}</think>\n<answer> {answer} </answer>"


# --- the environment -----------------------------------------------------------------------


@register("searchqa")
class SearchQAEnv(Env):
    """Search-augmented QA over a generated encyclopedia or a local corpus.

    Options: ``seed`` (generated world), ``corpus_path`` and ``questions_path``
    (real data, both required together), ``retriever`` (``bm25``/``dense``),
    ``top_k`` (documents per search, 3 as Search-R1), ``train_max_turns`` (5) and
    ``test_max_turns`` (30); ``max_turns`` sets both. ``cache_dir`` overrides
    where indices are cached.
    """

    name = "searchqa"
    difficulties = ("easy", "hard")
    default_max_turns = 30

    def __init__(
        self,
        max_turns: int | None = None,
        *,
        train_max_turns: int = 5,
        test_max_turns: int = 30,
        seed: int = 0,
        corpus_path: str | Path | None = None,
        questions_path: QuestionsSpec | None = None,
        retriever: str = "bm25",
        top_k: int = 3,
        cache_dir: str | Path | None = None,
    ) -> None:
        if max_turns is not None:
            train_max_turns = test_max_turns = max_turns
        for option, value in (("train_max_turns", train_max_turns), ("test_max_turns", test_max_turns),
                              ("top_k", top_k)):
            if value < 1:
                raise ValueError(f"{option} must be >= 1, got {value}")
        if retriever not in RETRIEVERS:
            raise ValueError(f"unknown SearchQA retriever {retriever!r}; valid: {', '.join(RETRIEVERS)}")
        if (corpus_path is None) != (questions_path is None):
            missing = "questions_path" if questions_path is None else "corpus_path"
            raise ValueError(f"SearchQA on local data needs both corpus_path and questions_path; {missing} is missing")
        super().__init__(max(train_max_turns, test_max_turns))
        self.train_max_turns, self.test_max_turns, self.top_k = train_max_turns, test_max_turns, top_k
        self._source_options = dict(seed=seed, corpus_path=corpus_path, questions_path=questions_path,
                                    retriever=retriever, cache_dir=cache_dir)
        self._question: Question | None = None
        self._seen: set[int] = set()       # passages shown so far: what the expert may rely on
        self._queries: list[str] = []      # normalised queries issued so far

    @property
    def source(self) -> KnowledgeSource:
        """The shared passages, questions and index (built on first use, once per process)."""
        return knowledge_source(**self._source_options)

    # --- the conversation -------------------------------------------------------------
    def instruction(self) -> str:
        return INSTRUCTION

    def turn_limit(self, task: Task) -> int:
        return self.train_max_turns if task.split == "train" else self.test_max_turns

    # --- tasks and episodes -----------------------------------------------------------
    def tasks(self, split: str, difficulty: str | None = None) -> list[Task]:
        self.check_split(split, difficulty)
        return self.source.tasks(split, difficulty)

    def question(self, task: Task) -> Question:
        """The question behind ``task`` (its text, gold answers and, if generated, its hops)."""
        questions = self.source.questions
        if task.env != self.name or not 0 <= task.id < len(questions):
            raise ValueError(f"{task} is not a task of this SearchQA source ({len(questions)} questions)")
        question = questions[task.id]
        if (question.split, question.difficulty) != (task.split, task.difficulty):
            raise ValueError(f"{task} does not match question {task.id} ({question.split}, {question.difficulty})")
        return question

    def on_reset(self, task: Task) -> str:
        self._question = self.question(task)
        self._seen = set()
        self._queries = []
        return question_prompt(self._question.text)

    def on_step(self, text: str) -> Step:
        action = parse_action(text)
        if action is None:
            return Step(observation=INVALID_ACTION, valid=False, info={"action": None})
        if action.kind == "search":
            return self._do_search(action.content)
        return self._do_answer(action.content)

    def _do_search(self, query: str) -> Step:
        indices = self.source.retriever.search(query, self.top_k)
        self._seen.update(indices)
        self._queries.append(normalize_answer(query))
        documents = [self.source.passages[index] for index in indices]
        observation = format_information((document.title, document.text) for document in documents)
        return Step(observation=observation, info={"action": "search", "query": query,
                                       "documents": [document.title for document in documents]})

    def _do_answer(self, answer: str) -> Step:
        info = {"action": "answer", "answer": answer}
        if exact_match(answer, self._question.answers):
            return Step(observation=CORRECT_ANSWER, reward=1.0, done=True, success=True, info=info)
        return Step(observation=INCORRECT_ANSWER, info=info)

    # --- reference agents -----------------------------------------------------------------
    def expert(self) -> str:
        """One search per hop, each only once the previous hop's passage was shown, then the answer."""
        self.require_episode("expert()")
        rng = random.Random(self.task.id * 7919 + self.turns)  # varied wording, reproducible
        hops = self._question.hops
        if not hops:
            return self._expert_without_hops(rng)
        for position, hop in enumerate(hops):
            if hop.passage not in self._seen:
                return self._expert_search(position, rng)
        thought = _fill(rng.choice(_ANSWER), fact=_fact(hops[-1]), answer=self._question.answers[0])
        return _answer(thought, self._question.answers[0])

    def _expert_search(self, position: int, rng: random.Random) -> str:
        hop = self._question.hops[position]
        name = self.source.passages[hop.passage].title
        candidates = [f"{name} {RELATIONS[hop.relation].keyword}", name, self.source.passages[hop.passage].text]
        fresh = [query for query in candidates if normalize_answer(query) not in self._queries]
        query = fresh[0] if fresh else candidates[-1]
        if query != candidates[0]:
            thought = rng.choice(_RETRY_SEARCH).format(subject=hop.subject)
        elif position == 0:
            thought = _fill(rng.choice(_FIRST_SEARCH), need=_need(hop))
        else:
            thought = _fill(rng.choice(_NEXT_SEARCH), fact=_fact(self._question.hops[position - 1]), need=_need(hop))
        return _search(thought, query)

    def _expert_without_hops(self, rng: random.Random) -> str:
        """Loaded questions carry no chain: search the question once, then give the gold answer."""
        if not self._queries:
            return _search("I need to look this up.", self._question.text)
        gold = self._question.answers[0]
        return _answer(f"I will answer {gold}.", gold)

    def random_action(self, rng: random.Random) -> str:
        """A search for a few words of the question, or a random entity name as the answer."""
        self.require_episode("random_action()")
        if rng.random() < 0.5:
            words = self._question.text.rstrip("?").split()
            query = " ".join(rng.sample(words, rng.randint(1, min(3, len(words)))))
            return _search("Let me search.", query)
        return _answer("Let me guess.", rng.choice(self.source.answer_pool))

    def close(self) -> None:
        self._question = None
