"""Listing SearchQA's tasks generates its questions but builds no retrieval index."""

from __future__ import annotations

from contrail.envs import make


def test_the_index_is_built_at_the_first_search(tmp_path):
    env = make("searchqa", cache_dir=tmp_path, seed=12345)  # a source of its own: nothing shared yet
    task = env.tasks("test", "easy")[0]
    assert env.source._retriever is None and not any(tmp_path.iterdir())
    env.reset(task)
    assert env.source._retriever is None
    step = env.step("<search> anything at all </search>")
    assert step.valid and step.observation.startswith("<information>")
    assert env.source._retriever is not None
