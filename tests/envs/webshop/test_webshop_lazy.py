"""Building WebShop and listing its tasks never builds the catalogue or its search index."""

from __future__ import annotations

import pytest

import contrail.envs.webshop.env as webshop_env
from contrail.envs import make


def test_tasks_are_listed_without_the_shop(tmp_path, monkeypatch):
    def no_shop(*args, **kwargs):
        raise AssertionError("the shop was built")

    monkeypatch.setattr(webshop_env, "get_shop", no_shop)
    env = make("webshop", cache_dir=tmp_path)
    assert len(env.tasks("test")) > 0 and len(env.tasks("train", "hard")) > 0
    env.prompt_messages()
    assert not any(tmp_path.iterdir())
    with pytest.raises(AssertionError, match="the shop was built"):
        env.reset(env.tasks("test")[0])  # the first episode is where the shop comes from
