"""An environment in the Thought/Action format for the AgentGym protocol tests."""

from __future__ import annotations

import pytest

import contrail.envs as envs
from contrail.envs.base import Step
from contrail.envs.parsing import action_lines
from contrail.testing import MagicWordEnv


class ActionWordEnv(MagicWordEnv):
    """MagicWordEnv that reads the last ``Action:`` line, as contrail's Thought/Action environments do."""

    def on_step(self, text: str) -> Step:
        lines = action_lines(text)
        return super().on_step(lines[-1] if lines else "")


@pytest.fixture(autouse=True)
def forget_remote_specs():
    """Unregister the ``agentgym:...`` specs a test used (they would show in other tests' name lists)."""
    yield
    for name in [n for n in envs.names() if n.startswith("agentgym:")]:
        envs.unregister(name)


@pytest.fixture
def action_word():
    """The name ``action-word``, registered to `ActionWordEnv` for this test."""
    with envs.registered("action-word", type("ActionWord", (ActionWordEnv,), {})):
        yield "action-word"
