"""BabyAI: grid navigation in text, with the valid actions listed every step.

The engine is minigrid 3.x's BabyAI levels (`contrail.envs.babyai.levels`);
the interface is AgentGym's (``agentenv-babyai``), reproduced to the byte: the
agent reads a sentence description of its 7x7 view (`contrail.envs.babyai.view`),
writes ``Thought: ...`` then ``Action: <macro>``, and every observation ends
with ``Available actions: [...]``. Macros (``go to red ball 1``,
``toggle and go through red closed door 1``, ...) expand into primitive moves
(`contrail.envs.babyai.actions`).

Reward: ``1 - 0.9 * primitive_steps / max_steps`` (minigrid's own reward,
``max_steps`` the level's) on the step that solves the task, else 0.

Where contrail departs from AgentGym, on purpose: a mission that minigrid
fails (a wrong object picked up) or runs out of primitive steps ends the
episode with "The task has failed." / "You have run out of steps." (AgentGym
prints "The task is completed." on a failure and plays on), and a solved task
always ends the episode (AgentGym keeps a slow success, reward <= 0.5, going).
Several ``Action:`` lines, or none, are an error observation, and
``pick up`` (the instruction's spelling) is accepted for ``pickup``.

The test split keeps only the tasks the expert solves within the turn limit
(`contrail.envs.babyai.solvable`); the expert (`contrail.envs.babyai.expert`)
is privileged: it plans on the true map.
"""

from __future__ import annotations

import random
import re

import numpy as np

from contrail.envs.babyai import levels
from contrail.envs.babyai.actions import CHECK, NOT_RECOGNIZED, Menu, Played, action_menu, play
from contrail.envs.babyai.expert import Expert, thought
from contrail.envs.babyai.levels import LEVELS, TRAIN_SEED_START, level_number, task_difficulty
from contrail.envs.babyai.solvable import solvable
from contrail.envs.babyai.view import View, describe, look
from contrail.envs.base import Env, EnvOptionError, Step, Task, register
from contrail.envs.parsing import action_lines

INSTRUCTION = (
    "You are an exploration master that wants to finish every goal you are given. Every round I will give "
    "you an observation, and you have to respond an action and your thought based on the observation to "
    "finish the given task. You are placed in a room and you need to accomplish the given goal with "
    "actions.\n\n"
    "You can use the following actions: \n\n"
    "- turn right \n\n"
    "- turn left \n\n"
    "- move forward \n\n"
    "- go to <obj> <id> \n\n"
    "- pick up <obj> <id> \n\n"
    "- go through <door> <id>: <door> must be an open door. \n\n"
    "- toggle and go through <door> <id>: <door> can be a closed door or a locked door. If you want to "
    "open a locked door, you need to carry a key that is of the same color as the locked door. \n\n"
    "- toggle: there is a closed or locked door right in front of you and you can toggle it.\n"
    "Your response should use the following format:\n"
    "Thought:\n<Your Thought>\n\n"
    "Action:\n<Your Action>\n\n"
    "For example:\n"
    "Thought:\nThe red ball I need is in front of me, so I go to it.\n\n"
    "Action:\ngo to red ball 1"
)

FORMAT_ERROR = (
    "Your response must end with exactly one line of the form 'Action: <your action>'. Please check valid actions."
)
ONE_ACTION_ERROR = "Error: Only one 'Action' is allowed per response. Please adjust your response."
NO_CHANGE = "No change in state."
DONE_MESSAGE = " The task is completed."  # AgentGym's, leading space included
FAILED_MESSAGE = "The task has failed."
OUT_OF_STEPS_MESSAGE = "You have run out of steps."


@register("babyai")
class BabyAIEnv(Env):
    """BabyAI levels behind AgentGym's text interface (see the module docstring).

    Options: ``max_turns`` (default 20), ``test_seeds`` (seeds per level in the
    test split, default 10), ``train_seeds`` (default 250) and ``filter_train``
    (keep only expert-solvable train tasks too; slow the first time, default False).
    """

    difficulties = ("easy", "hard")
    default_max_turns = 20

    def __init__(
        self, max_turns: int | None = None, test_seeds: int = 10, train_seeds: int = 250, filter_train: bool = False
    ) -> None:
        super().__init__(max_turns)
        for option, value in (("test_seeds", test_seeds), ("train_seeds", train_seeds)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EnvOptionError(f"option {option} of babyai: expected an int >= 1, got {value!r}")
        if test_seeds > TRAIN_SEED_START:
            raise EnvOptionError(f"option test_seeds of babyai: at most {TRAIN_SEED_START} (the first train seed)")
        self.test_seeds = test_seeds
        self.train_seeds = train_seeds
        self.filter_train = filter_train
        self._level = None  # minigrid starts at the first reset
        self._expert: Expert | None = None
        self._view: View | None = None
        self._menu = Menu()
        self._description = ""

    # --- the conversation -------------------------------------------------------------------
    def instruction(self) -> str:
        return INSTRUCTION

    # --- tasks --------------------------------------------------------------------------------
    def seeds(self, split: str) -> range:
        """The level seeds of ``split``."""
        self.check_split(split)
        if split == "test":
            return range(self.test_seeds)
        return range(TRAIN_SEED_START, TRAIN_SEED_START + self.train_seeds)

    def tasks(self, split: str, difficulty: str | None = None) -> list[Task]:
        """Tasks of ``split``; test tasks are those the expert solves (see `solvable`)."""
        self.check_split(split, difficulty)
        found = []
        for seed in self.seeds(split):
            for level in range(1, len(LEVELS) + 1):
                task_id = seed * len(LEVELS) + level - 1
                label = task_difficulty(task_id)
                if difficulty in (None, label):
                    found.append(Task(self.name, task_id, split, label))
        if split == "test" or self.filter_train:
            keep = solvable([task.id for task in found], self.max_turns)
            found = [task for task in found if keep[task.id]]
        return found

    # --- episodes -----------------------------------------------------------------------------
    def on_reset(self, task: Task) -> str:
        if task.id < 0:
            raise ValueError(f"BabyAI task ids are non-negative, got {task.id}")
        expected = task_difficulty(task.id)
        if task.difficulty != expected:
            raise ValueError(f"task {task.id} is level {level_number(task.id)} ({expected}), not {task.difficulty!r}")
        self.close()
        self._level, image = levels.start_level(task.id)
        self._expert = Expert(self._level)
        self._look(image)
        return f"Your goal: {self.goal}\n{self._description}\n{self._menu.listing()}"

    @property
    def goal(self) -> str:
        """The mission as AgentGym words it (`levels.goal_text`)."""
        return levels.goal_text(self._level.mission)

    def on_step(self, text: str) -> Step:
        action, error = self._parse(text)
        if error is not None:
            return Step(observation=f"{error}\n{self._menu.listing()}", valid=False, info=self._info(action))
        if "check" in action:  # as in AgentGym, any action that mentions "check"
            listed = "You can take the following actions: " + ", ".join(self._menu.actions)
            return Step(observation=f"{listed}\n{self._menu.listing()}", info=self._info(CHECK))
        primitives = self._menu.actions[action]
        if not primitives:  # e.g. "go to" what the agent already faces
            return Step(observation=f"{NO_CHANGE}\n{self._menu.listing()}", info=self._info(action))
        played = play(self._level, primitives, self._view.image)
        self._expert.played(primitives, played.changed)
        self._look(played.image)
        return self._outcome(played, action)

    def _outcome(self, played: Played, action: str) -> Step:
        """The step after a macro was played: the new view, and how minigrid judged the mission."""
        success = played.terminated and played.reward > 0
        observation = self._description
        if success:
            observation += f"\n{DONE_MESSAGE}"
        elif played.terminated:
            observation += f"\n{FAILED_MESSAGE}"
        elif played.truncated:
            observation += f"\n{OUT_OF_STEPS_MESSAGE}"
        return Step(
            observation=f"{observation}\n{self._menu.listing()}",
            reward=played.reward if success else 0.0,
            done=played.terminated or played.truncated,
            success=success,
            info=self._info(action),
        )

    def macros(self) -> dict[str, tuple[int, ...]]:
        """The actions available now, in display order, each with its primitive minigrid actions."""
        self.require_episode("macros()")
        return dict(self._menu.actions)

    def random_action(self, rng: random.Random) -> str:
        self.require_episode("random_action()")
        action = rng.choice(list(self._menu.actions))
        return f"Thought: I will try this.\nAction: {action}"

    def close(self) -> None:
        if self._level is not None:
            self._level.close()
        self._level, self._expert = None, None

    # --- the expert -----------------------------------------------------------------------------
    def expert(self) -> str:
        self.require_episode("expert()")
        action = self._expert.action(self._menu, self._view.image, self.turns)
        return f"Thought: {thought(action, self.task.id, self.turns, self.goal)}\nAction: {action}"

    # --- helpers --------------------------------------------------------------------------------
    def _look(self, image: np.ndarray) -> None:
        """Refresh what the agent sees and may do from minigrid's observation ``image``."""
        self._view = look(self._level, image)
        self._description = describe(self._view, self._level.carrying)
        self._menu = action_menu(self._level, self._view)

    def _parse(self, output: str) -> tuple[str | None, str | None]:
        """(normalised action, None) or (what was read, error message)."""
        lines = action_lines(output)
        if len(lines) > 1:
            return None, ONE_ACTION_ERROR
        if not lines:
            return None, FORMAT_ERROR
        action = normalise_action(lines[0])
        if action in self._menu.actions or "check" in action:
            return action, None
        return action, self._menu.errors.get(action, NOT_RECOGNIZED)

    def _info(self, action: str | None) -> dict:
        level = self._level
        return {
            "action": action,
            "level": LEVELS[level_number(self.task.id) - 1],
            "primitive_steps": int(level.step_count),
            "max_steps": int(level.max_steps),
        }


# AgentGym's client keeps only these characters of the action it reads.
_DROPPED = re.compile(r"[^A-Za-z0-9, ]+")


def normalise_action(raw: str) -> str:
    """The action as AgentGym reads it: only letters, digits, commas and spaces, single-spaced, lower-case.

    (So ``**Go to red ball 1**.`` is ``go to red ball 1``.) ``pick up`` (the
    instruction's spelling) is accepted for ``pickup`` (the action list's).
    """
    action = " ".join(_DROPPED.sub("", raw).split()).lower()
    if action.startswith("pick up "):
        action = "pickup " + action[len("pick up "):]
    return action
