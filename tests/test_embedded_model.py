"""The embedded SmolLM2-135M-Instruct end to end (slow: loads the real model; run with -m slow)."""

from __future__ import annotations

import pytest

from contrail import envs
from contrail.agent import RolloutConfig, rollout
from contrail.models import embedded_model_dir, load_model
from contrail.policy import Policy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def policy():
    model, tokenizer = load_model("smollm2-135m", dtype="bfloat16")
    return Policy.from_model(model, tokenizer, seed=0)


def test_embedded_model_is_cached_as_safetensors(policy):
    directory = embedded_model_dir()
    assert (directory / "model.safetensors").exists() and (directory / "tokenizer.json").exists()
    assert type(policy.model).__name__ == "LlamaForCausalLM"
    assert policy.model.config.num_hidden_layers == 30  # SmolLM2-135M's shape


def test_embedded_model_plays_two_turns_token_in_token_out(policy):
    env = envs.make("textcraft")
    tasks = env.tasks("test", "easy")[:2]
    config = RolloutConfig(max_new_tokens=12, max_turns=2, temperature=1.0)
    trajectories = rollout(policy.backend, policy.chat, tasks, lambda task: envs.make(task.env), config)
    for traj in trajectories:
        assert traj.turns == 2 and traj.error is None
        assert sum(traj.mask) == traj.generated_tokens > 0
        # The prompt the model saw is exactly the chat template's rendering of the opening turns.
        opening = policy.chat.prompt_ids(traj.messages[:3])
        assert traj.ids[: len(opening)] == opening
        assert "Goal: craft" in policy.tokenizer.decode(traj.ids[: len(opening)])


def test_embedded_model_runs_a_stage_end_to_end(tmp_path):
    """`run()` on the real model: one GRPO step on TextCraft, row 0 and row 1 with no environment errors."""
    import math

    from contrail.experiment import EvalSpec, Experiment, ModelSpec, StrategySpec, StreamSpec
    from contrail.grpo.config import GRPOConfig
    from contrail.runner import run

    exp = Experiment(
        name="embedded",
        stream=StreamSpec(train=["textcraft:easy"], train_tasks=4, test_tasks=2, steps_per_experience=1),
        strategy=StrategySpec(name="sequential"), model=ModelSpec(name="smollm2-135m", dtype="float32", device="cpu"),
        rollout=RolloutConfig(max_new_tokens=24, max_turns=2), grpo=GRPOConfig(lr=1e-6, group_size=2, tasks_per_step=1),
        eval=EvalSpec(k=1), out=str(tmp_path / "run"),
    )
    result = run(exp, show_progress=False)
    assert [row["stage"] for row in result.rows] == [0, 1]
    for row in result.rows:
        cell = row["results"]["textcraft:easy"]
        assert cell["errors"] == 0 and cell["tasks"] == 2 and math.isfinite(cell["avg_at_k"])
        assert cell["turns"] == 2 or cell["avg_at_k"] > 0
    assert (tmp_path / "run" / "report.md").is_file()
