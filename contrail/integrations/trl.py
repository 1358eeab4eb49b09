"""A TRL ``rollout_func``: train with ``trl.GRPOTrainer`` on contrail's environments and tasks.

TRL 1.16's ``GRPOTrainer(rollout_func=...)`` calls ``rollout_func(prompts,
trainer)`` with the prompts of this process's slice of the batch (each
dataset row already repeated ``num_generations`` times by TRL's sampler) and
expects one completion per prompt: ``{"prompt_ids", "completion_ids",
"logprobs"}`` plus optional fields, of which ``env_mask`` marks the
completion tokens the policy sampled (1) against those the environment wrote
(0: observations, template tokens), and every other field is handed to the
reward functions as a keyword argument.

`ContrailRollout` plays one multi-turn contrail episode per prompt with
contrail's own batched rollout (token-in/token-out, text actions, the
environment's parsing), and returns:

- ``prompt_ids``: the conversation up to the first sampled token (instruction,
  acknowledgement, first observation, generation prompt);
- ``completion_ids``: every later token (the turns and the observations
  between them, up to the last sampled token), ``env_mask`` 1 exactly where
  the policy sampled, ``logprobs`` the sampler's log-probabilities (0 under
  ``env_mask`` 0);
- ``env_reward``, ``env_success``, ``env_error``: per-episode fields for
  `env_reward` (the reward function to pass) and for logging.

The dataset rows name tasks: `task_dataset` writes each task as a JSON
prompt string (TRL hands ``rollout_func`` the prompts only, not the other
columns), which `task_of` reads back.

>>> from trl import GRPOConfig, GRPOTrainer
>>> from contrail.integrations.trl import ContrailRollout, env_reward, task_dataset
>>> import contrail.envs as envs
>>> tasks = envs.make("textcraft").tasks("train", "easy")[:64]
>>> trainer = GRPOTrainer(model="HuggingFaceTB/SmolLM2-135M-Instruct", reward_funcs=env_reward,
...                       train_dataset=task_dataset(tasks), rollout_func=ContrailRollout(),
...                       args=GRPOConfig(num_generations=8, ...))
"""

from __future__ import annotations

import json
from typing import Any, Callable, Sequence

from contrail import envs
from contrail.agent.backend import HFBackend
from contrail.agent.chat import ChatFormat
from contrail.agent.rollout import RolloutConfig, Trajectory, rollout
from contrail.envs.base import Env, Task
from contrail.seeds import derive_seed

PROMPT_KEY = "contrail_task"


def task_prompt(task: Task) -> str:
    """The prompt string that names ``task`` in a TRL dataset."""
    return json.dumps({PROMPT_KEY: task.to_dict()}, sort_keys=True)


def task_of(prompt: Any) -> Task:
    """The task a `task_prompt` names; anything else is a ValueError saying how to build the dataset."""
    try:
        return Task.from_dict(json.loads(prompt)[PROMPT_KEY])
    except (TypeError, ValueError, KeyError) as error:
        raise ValueError(
            f"prompt {str(prompt)[:80]!r} does not name a contrail task ({error}); "
            "build the train_dataset with contrail.integrations.trl.task_dataset(tasks)"
        ) from None


def task_dataset(tasks: Sequence[Task]):
    """A ``datasets.Dataset`` with one ``prompt`` per task (repeat tasks to weight them)."""
    import datasets

    if not tasks:
        raise ValueError("task_dataset needs at least one task")
    return datasets.Dataset.from_dict({"prompt": [task_prompt(task) for task in tasks]})


def env_reward(completions: list, env_reward: list[float], **_: Any) -> list[float]:
    """TRL reward function: the environment's episode reward (forwarded by `ContrailRollout`)."""
    return [float(value) for value in env_reward]


class ContrailRollout:
    """``rollout_func`` for ``trl.GRPOTrainer`` playing contrail environments (see the module doc).

    ``make_env(task)`` builds a fresh environment per episode (default:
    ``envs.make(task.env, **env_options.get(task.env, {}))``); ``rollout``
    limits each episode (``max_new_tokens`` per turn, ``max_episode_tokens``,
    ``max_turns``; its temperature and top-p are used as they are, not TRL's).
    Sampling is seeded by ``seed``, the process index and TRL's global step.
    """

    def __init__(
        self,
        make_env: Callable[[Task], Env] | None = None,
        rollout: RolloutConfig = RolloutConfig(),
        *,
        env_options: dict[str, dict[str, Any]] | None = None,
        seed: int = 0,
    ) -> None:
        options = {name: envs.check_options(name, values) for name, values in (env_options or {}).items()}
        self.make_env = make_env or (lambda task: envs.make(task.env, **options.get(task.env, {})))
        self.config = rollout
        self.seed = seed
        self.last_trajectories: list[Trajectory] = []  # the latest batch, for logging and tests

    def __call__(self, prompts: list, trainer: Any) -> dict[str, list]:
        tasks = [task_of(prompt) for prompt in prompts]
        tokenizer = trainer.processing_class
        chat = ChatFormat.from_tokenizer(tokenizer)
        model = trainer.accelerator.unwrap_model(trainer.model)
        seed = derive_seed(self.seed, "trl-rollout", trainer.accelerator.process_index, trainer.state.global_step)
        backend = HFBackend(model, chat.stop_ids, tokenizer.pad_token_id, seed=seed)
        trajectories = rollout(backend, chat, tasks, self.make_env, self.config)
        self.last_trajectories = trajectories
        fallback = tokenizer.eos_token_id
        pieces = [split_trajectory(trajectory, fallback) for trajectory in trajectories]
        return {
            "prompt_ids": [p["prompt_ids"] for p in pieces],
            "completion_ids": [p["completion_ids"] for p in pieces],
            "logprobs": [p["logprobs"] for p in pieces],
            "env_mask": [p["env_mask"] for p in pieces],
            "env_reward": [t.reward for t in trajectories],
            "env_success": [float(t.success) for t in trajectories],
            "env_error": [t.error or "" for t in trajectories],
        }


def split_trajectory(trajectory: Trajectory, fallback_id: int) -> dict[str, list]:
    """Cut a contrail trajectory into TRL's prompt / completion / env_mask / logprobs.

    The completion ends at the last sampled token (the template's closing
    after it is not trained on and would read as truncation to TRL). An
    episode that sampled nothing (its environment failed at reset, or the
    prompt filled the budget) gets a one-token completion, ``fallback_id``
    under ``env_mask`` 0, since TRL needs a non-empty completion: it trains
    on nothing and its ``env_reward`` is 0.
    """
    sampled = [i for i, bit in enumerate(trajectory.mask) if bit]
    if not sampled:
        return {"prompt_ids": list(trajectory.ids) or [fallback_id], "completion_ids": [fallback_id],
                "logprobs": [0.0], "env_mask": [0]}
    start, end = sampled[0], sampled[-1] + 1
    return {
        "prompt_ids": trajectory.ids[:start],
        "completion_ids": trajectory.ids[start:end],
        "logprobs": trajectory.logprobs[start:end],
        "env_mask": trajectory.mask[start:end],
    }
