"""BabyAI: grid navigation in text, with the valid actions listed every step.

The engine is minigrid 3.x's BabyAI levels; the interface is AgentGym's
(``agentenv-babyai``): the agent reads a sentence description of its 7x7 view,
writes ``Thought: ...`` then ``Action: <macro>``, and every observation ends
with ``Available actions: [...]``. Macros (``go to red ball 1``,
``toggle and go through red closed door 1``, ...) expand into primitive moves
along a shortest path over the cells seen so far (`contrail.envs.babyai_text`).
The goal is minigrid's mission, verbatim.

Task ids follow AgentGym: id ``i`` is level ``i % 40 + 1`` of `LEVELS` with
seed ``i // 40``. On top of that:

- test  = seeds ``0 .. test_seeds - 1``   (ids ``0 .. 40 * test_seeds - 1``),
- train = seeds ``TRAIN_SEED_START ..``   (``train_seeds`` of them),

so the two never overlap. Difficulty is the level: easy = levels 1-22
(single-room GoTo/Open/Pickup/PutNextLocal), hard = levels 23-40 (Unlock,
KeyCorridor, Synth, Boss).

Reward: ``1 - 0.9 * primitive_steps / max_steps`` (minigrid's own reward,
``max_steps`` the level's) on the step that solves the task, else 0.

The test split keeps only the tasks the expert solves within the turn limit
(see `solvable`): some long multi-room missions cannot be finished in 20
macro turns, and minigrid's strict verifier fails every two-door mission of
``OpenDoorsOrderN4Debug`` whatever the agent does. The train split keeps all
tasks (``filter_train=True`` filters it too).

The expert is privileged: minigrid's `BabyAIBot`, told the map up to the
locked doors (`_ExpertBot`), plans the whole episode on a copy of the level;
each turn the available macro that lands farthest along that plan is
written out, and the plan is remade whenever the episode leaves it.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import random
import re
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import gymnasium
import minigrid  # also registers the BabyAI levels with gymnasium
import numpy as np
from minigrid.envs.babyai.core.verifier import AfterInstr, AndInstr, BeforeInstr, OpenInstr, PutNextInstr
from minigrid.utils.baby_ai_bot import BabyAIBot, DropSubgoal, GoNextToSubgoal, Subgoal

from contrail.envs import babyai_text as text
from contrail.envs.base import Env, Step, Task, register
from contrail.envs.parsing import action_lines
from contrail.paths import cache_root

# AgentGym's 40 levels (agentenv_babyai/environment.py, ``all_levels``), in order.
LEVELS: tuple[str, ...] = (
    "GoToRedBallGrey", "GoToRedBall", "GoToRedBallNoDists", "GoToObjS6", "GoToLocalS8N7",
    "GoToObjMazeS7", "GoToImpUnlock", "GoToSeqS5R2", "GoToRedBlueBall", "GoToDoor",
    "GoToObjDoor", "Open", "OpenRedDoor", "OpenDoorLoc", "OpenRedBlueDoorsDebug",
    "OpenDoorsOrderN4Debug", "Pickup", "UnblockPickup", "PickupLoc", "PickupDistDebug",
    "PickupAbove", "PutNextLocalS6N4", "PutNextS7N4Carrying", "Unlock", "UnlockLocalDist",
    "KeyInBox", "UnlockPickupDist", "BlockedUnlockPickup", "UnlockToUnlock", "ActionObjDoor",
    "FindObjS7", "KeyCorridorS6R3", "OneRoomS20", "MoveTwoAcrossS8N9", "SynthS5R2",
    "SynthLoc", "SynthSeq", "MiniBossLevel", "BossLevel", "BossLevelNoUnlock",
)  # fmt: skip
EASY_LEVELS = range(1, 23)  # 1-based level numbers
HARD_LEVELS = range(23, 41)
TRAIN_SEED_START = 10_000

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

NOT_RECOGNIZED_MESSAGE = text.NOT_RECOGNIZED
FORMAT_ERROR = "Your response must end with exactly one line of the form 'Action: <your action>'. Please check valid actions."
DONE_MESSAGE = "The task is completed."
FAILED_MESSAGE = "The task has failed."
OUT_OF_STEPS_MESSAGE = "You have run out of steps."


def level_number(task_id: int) -> int:
    """AgentGym's 1-based level of a task id."""
    return task_id % len(LEVELS) + 1


def level_seed(task_id: int) -> int:
    """AgentGym's seed of a task id."""
    return task_id // len(LEVELS)


def level_difficulty(level: int) -> str:
    return "easy" if level in EASY_LEVELS else "hard"


def level_env_id(level: int) -> str:
    """The gymnasium id of a 1-based level: the newest registered version.

    minigrid 3 retired some v0 ids (``GoToObjS6-v0`` is now ``-v1``).
    """
    prefix = f"BabyAI-{LEVELS[level - 1]}-v"
    versions = [int(key[len(prefix):]) for key in gymnasium.registry if key.startswith(prefix) and key[len(prefix):].isdigit()]
    if not versions:
        raise RuntimeError(f"minigrid does not register a BabyAI level named {LEVELS[level - 1]!r}")
    return f"{prefix}{max(versions)}"


def make_level(level: int):
    """A fresh, unwrapped minigrid environment of a 1-based level."""
    return gymnasium.make(level_env_id(level)).unwrapped


@contextlib.contextmanager
def _quiet():
    """minigrid prints 'Sampling rejected ...' while generating some levels."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


# --- the expert's planner ----------------------------------------------------------------

_MAX_REPLANS = 200
_TURN_DISCOUNT = 2  # plan steps a macro that lands facing the wrong way is worth less  # subgoal rewrites per step before the bot is declared stuck


class _BotStuck(RuntimeError):
    """The bot keeps rewriting its plan without suggesting an action."""


class _OpenBoxSubgoal(Subgoal):
    """Toggle the box in front, which replaces it with what it holds."""

    def replan_before_action(self):
        return self.actions.toggle

    def replan_after_action(self, action_taken):
        if action_taken is None or action_taken == self.actions.toggle:
            self.bot.stack.pop()


class _ExpertBot(BabyAIBot):
    """minigrid's BabyAIBot, adapted to plan from any point of an episode.

    Changes, each for a level the stock bot cannot finish:
    - parts of a sequenced mission that are already done are not planned
      again (a bot built mid-episode);
    - the object to move may already be in hand (``PutNextS7N4Carrying``);
    - a locked door's key may be hidden in a box (``KeyInBox``): open the box;
    - replanning is bounded, so a plan that loops raises `_BotStuck` instead of
      hanging (seen on ``GoToImpUnlock`` and ``UnlockToUnlock``).
    """

    def __init__(self, level):
        self._keeps_carried = False
        super().__init__(level)
        self._reveal_reachable()
        self._hands_free_if_needed()

    def _process_instr(self, instr):
        if isinstance(instr, (BeforeInstr, AfterInstr, AndInstr)):
            first, second = (instr.instr_b, instr.instr_a) if isinstance(instr, AfterInstr) else (instr.instr_a, instr.instr_b)
            done = {id(instr.instr_a): instr.a_done == "success", id(instr.instr_b): instr.b_done == "success"}
            for part in (second, first):  # the stack runs its top (the first part) first
                if not done[id(part)]:
                    self._process_instr(part)
            return
        carried = self.mission.unwrapped.carrying
        if isinstance(instr, PutNextInstr) and carried is not None and any(carried is obj for obj in instr.desc_move.obj_set):
            self._keeps_carried = True
            self.stack.append(DropSubgoal(self))
            self.stack.append(GoNextToSubgoal(self, instr.desc_fixed, reason="PutNext"))
            return
        super()._process_instr(instr)
        if isinstance(instr, OpenInstr):
            box = self._box_hiding_key(instr.desc)
            if box is not None:
                self.stack.append(_OpenBoxSubgoal(self))
                self.stack.append(GoNextToSubgoal(self, box))

    def _box_hiding_key(self, door_desc):
        """A box holding the key of a locked target door whose key is nowhere else."""
        level = self.mission.unwrapped
        for door in door_desc.obj_set:
            if not door.is_locked:
                continue
            key_in_hand = level.carrying is not None and level.carrying.type == "key" and level.carrying.color == door.color
            cells = [cell for cell in level.grid.grid if cell is not None]
            if key_in_hand or any(cell.type == "key" and cell.color == door.color for cell in cells):
                continue
            for cell in cells:
                inside = getattr(cell, "contains", None)
                if cell.type == "box" and inside is not None and inside.type == "key" and inside.color == door.color:
                    return cell
        return None

    def _hands_free_if_needed(self) -> None:
        """A bot built mid-episode while carrying something puts it down first.

        (The stock bot assumes empty hands; the carried object of a PutNext
        mission is kept, as the plan is to drop it at its place.)
        """
        level = self.mission.unwrapped
        if level.carrying is None or level.step_count == 0 or self._keeps_carried:
            return
        self.stack.append(DropSubgoal(self))
        self.stack.append(GoNextToSubgoal(self, self._find_drop_pos()))

    def _reveal_reachable(self) -> None:
        """Mark as seen every cell the agent can reach without unlocking a door.

        The expert is privileged: it knows the map up to the locked doors, so
        it walks straight to what it needs instead of exploring. What lies
        behind a locked door stays unknown until the door is open, because the
        stock planner treats a seen target it cannot reach as an error.
        """
        grid = self.mission.unwrapped.grid
        start = tuple(int(v) for v in self.mission.unwrapped.agent_pos)
        seen, queue = {start}, deque([start])
        while queue:
            x, y = queue.popleft()
            self.vis_mask[x, y] = True
            cell = grid.get(x, y)
            if cell is not None and (cell.type == "wall" or (cell.type == "door" and cell.is_locked)):
                continue
            for nx, ny in ((x + 1, y), (x - 1, y), (x, y + 1), (x, y - 1)):
                if 0 <= nx < grid.width and 0 <= ny < grid.height and (nx, ny) not in seen:
                    seen.add((nx, ny))
                    queue.append((nx, ny))

    def _shortest_path(self, accept_fn, try_with_blockers=False):
        # The stock explorer opens every unlocked door it has not opened yet,
        # to look behind it; with the map known up to the locked doors that
        # only wastes moves, so it goes straight for the locked door instead.
        if getattr(accept_fn, "__name__", "") == "unopened_unlocked_door":
            return None, None, False
        return super()._shortest_path(accept_fn, try_with_blockers)

    def _breadth_first_search(self, initial_states, accept_fn, ignore_blockers):
        """The stock search, except that closed (not locked) doors can be walked
        through: the bot opens them on its way (`GoNextToSubgoal` does), and with
        the whole map known a target behind a closed door must stay reachable."""
        self.bfs_counter += 1
        grid = self.mission.unwrapped.grid
        queue = deque((state, None) for state in initial_states)
        previous_pos: dict = {}
        while queue:
            (i, j, di, dj), prev_pos = queue.popleft()
            if (i, j) in previous_pos:
                continue
            self.bfs_step_counter += 1
            cell = grid.get(i, j)
            previous_pos[(i, j)] = prev_pos
            if accept_fn((i, j), cell):
                path, pos = [], (i, j)
                while pos:
                    path.append(pos)
                    pos = previous_pos[pos]
                return path, (i, j), previous_pos
            if not self.vis_mask[i, j]:
                continue
            if cell is not None:
                if cell.type == "wall" or (cell.type == "door" and cell.is_locked):
                    continue
                if cell.type != "door" and not ignore_blockers:
                    continue
            # Straight ahead first, so paths prefer not to turn.
            for k, l in ((di, dj), (dj, di), (-dj, -di), (-di, -dj)):
                queue.append(((i + k, j + l, k, l), (i, j)))
        return None, None, previous_pos

    def _check_erroneous_box_opening(self, action):
        # Opening a box is how KeyInBox is solved; the verifier, not the bot, judges it.
        return None

    def replan(self, action_taken=None):
        """`BabyAIBot.replan` with a bound on plan rewrites (and the map revealed)."""
        self._reveal_reachable()
        self._process_obs()
        for subgoal in self.stack:
            subgoal.update_agent_attributes()
        if self.stack:
            self.stack[-1].replan_after_action(action_taken)
        while self.stack and self.stack[-1].is_exploratory():
            self.stack.pop()
        suggested = None
        for _ in range(_MAX_REPLANS):
            if not self.stack:
                break
            suggested = self.stack[-1].replan_before_action()
            if suggested is not None:
                break
        else:
            raise _BotStuck("the bot keeps rewriting its plan")
        if not self.stack:
            suggested = self.mission.unwrapped.actions.done
        self._remember_current_state()
        return suggested


def mission_progress(level) -> tuple:
    """The verifier's record of which parts of a sequenced mission are done."""

    def flags(instr):
        if isinstance(instr, (BeforeInstr, AfterInstr, AndInstr)):
            return (instr.a_done == "success", instr.b_done == "success", flags(instr.instr_a), flags(instr.instr_b))
        return ()

    return flags(level.instrs)


@dataclass(frozen=True)
class _Pose:
    """Where the agent is, and the interactions (pickup/drop/toggle) it has made.

    Two runs from one state that end in the same pose after the same
    interactions at the same places leave the grid in the same state.
    """

    pos: tuple[int, int]
    direction: int
    interactions: tuple[tuple[int, tuple[int, int], int], ...] = ()

    def after(self, action: int) -> "_Pose":
        if action == text.LEFT:
            return _Pose(self.pos, (self.direction - 1) % 4, self.interactions)
        if action == text.RIGHT:
            return _Pose(self.pos, (self.direction + 1) % 4, self.interactions)
        if action == text.FORWARD:
            dx, dy = text.DIRECTIONS[self.direction]
            return _Pose((self.pos[0] + dx, self.pos[1] + dy), self.direction, self.interactions)
        if action in (text.PICKUP, text.DROP, text.TOGGLE):
            return _Pose(self.pos, self.direction, (*self.interactions, (action, self.pos, self.direction)))
        return self

    def place(self) -> tuple:
        """The pose without its direction."""
        return self.pos, self.interactions

    def moved_to(self, level) -> "_Pose":
        """This pose with the agent's actual position (a blocked move stays put)."""
        return _Pose((int(level.agent_pos[0]), int(level.agent_pos[1])), int(level.agent_dir), self.interactions)


def _pose_of(level) -> _Pose:
    return _Pose((int(level.agent_pos[0]), int(level.agent_pos[1])), int(level.agent_dir))


@dataclass
class _Reference:
    """The bot's whole plan from one state, played on a copy of the level.

    ``reach`` maps (pose, mission progress) at each step of the plan to the
    last step index at which the plan is there (index 0: the start);
    ``reach_any_direction`` does the same ignoring the direction.
    """

    actions: list[int] = field(default_factory=list)
    reach: dict[tuple, int] = field(default_factory=dict)
    reach_any_direction: dict[tuple, int] = field(default_factory=dict)

    def record(self, pose: _Pose, progress: tuple) -> None:
        self.reach[(pose, progress)] = len(self.actions)
        self.reach_any_direction[(pose.place(), progress)] = len(self.actions)

    @classmethod
    def plan(cls, level) -> "_Reference":
        shadow = copy.deepcopy(level)
        pose = _pose_of(shadow)
        reference = cls()
        reference.record(pose, mission_progress(shadow))
        try:
            bot = _ExpertBot(shadow)
            action = bot.replan()
            while action != text.DONE and shadow.step_count < shadow.max_steps:
                _, _, terminated, truncated, _ = shadow.step(action)
                pose = pose.after(action).moved_to(shadow)
                reference.actions.append(action)
                reference.record(pose, mission_progress(shadow))
                if terminated or truncated:
                    break
                action = bot.replan()
        except Exception:  # noqa: BLE001 - the bot asserts or loops on a few layouts; keep the plan so far
            pass
        return reference


# --- the environment ----------------------------------------------------------------------


# "toggle and go through" must come before "toggle": the first matching prefix names the kind.
_PHRASES = {
    "go to": ("I should go to the {obj} next.", "Next I head to the {obj}.", "Going to the {obj} is my next step."),
    "pickup": ("I need to pick up the {obj}.", "The {obj} is reachable, so I pick it up.", "I will pick up the {obj} now."),
    "drop": ("I should put down what I am carrying here.", "I drop the object I am holding here.", "Time to drop what I carry."),
    "go through": ("I will go through the {obj}.", "The {obj} is open, so I walk through it.", "I pass through the {obj}."),
    "toggle and go through": (
        "I open the {obj} and go through it.",
        "I open the {obj} and pass through it.",
        "I will toggle the {obj} and walk through.",
    ),
    "toggle": ("I toggle what is right in front of me.", "I open what is in front of me.", "Toggling the thing ahead is next."),
    "turn left": ("I turn left to face where I need to go.", "Turning left is the way forward.", "I turn to my left."),
    "turn right": ("I turn right to face where I need to go.", "Turning right is the way forward.", "I turn to my right."),
    "move forward": ("I move forward.", "I step forward.", "Moving ahead is the way to go."),
    "check available actions": ("Let me check which actions I can take.",) * 3,
}


@register("babyai")
class BabyAIEnv(Env):
    """BabyAI levels behind AgentGym's text interface (see the module docstring).

    Options: ``max_turns`` (default 20), ``test_seeds`` (seeds per level in the
    test split, default 10), ``train_seeds`` (default 250) and ``filter_train``
    (keep only expert-solvable train tasks too; slow the first time, default False).
    """

    name = "babyai"
    difficulties = ("easy", "hard")
    default_max_turns = 20

    def __init__(
        self, max_turns: int | None = None, test_seeds: int = 10, train_seeds: int = 250, filter_train: bool = False
    ) -> None:
        super().__init__(max_turns)
        if test_seeds < 1 or train_seeds < 1:
            raise ValueError(f"test_seeds and train_seeds must be >= 1, got {test_seeds} and {train_seeds}")
        if test_seeds > TRAIN_SEED_START:
            raise ValueError(f"test_seeds must be <= {TRAIN_SEED_START} so test and train seeds stay disjoint")
        self.test_seeds = test_seeds
        self.train_seeds = train_seeds
        self.filter_train = filter_train
        self._task: Task | None = None
        self._level = None
        self._done = True
        self._reference: _Reference | None = None

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
                label = level_difficulty(level)
                if difficulty in (None, label):
                    found.append(Task(self.name, seed * len(LEVELS) + level - 1, split, label))
        if split == "test" or self.filter_train:
            keep = solvable([task.id for task in found], self.max_turns)
            found = [task for task in found if keep[task.id]]
        return found

    # --- episodes -----------------------------------------------------------------------------
    def reset(self, task: Task) -> str:
        self._check_task(task)
        level = make_level(level_number(task.id))
        with _quiet():
            level.reset(seed=level_seed(task.id))
        self._task, self._level, self._done = task, level, False
        self._reference: _Reference | None = None  # the expert's plan, made on its first call
        self._trace = _pose_of(level)  # the episode's pose since the plan's start
        self._turn = 0
        self._known = np.zeros((level.width, level.height), dtype=bool)
        self._look()
        return f"Your goal: {level.mission}\n{self._description}\n{self._menu.listing()}"

    def step(self, text_out: str) -> Step:
        self._require_live()
        self._turn += 1
        action, error = self._parse(text_out)
        if error is not None:
            return self._invalid(error, action)
        if action == "check available actions":
            listed = "You can take the following actions: " + ", ".join(self._menu.actions)
            return Step(observation=f"{listed}\n{self._menu.listing()}", info=self._info(action))
        reward, terminated, truncated = self._execute(self._menu.actions[action])
        self._look()
        observation = self._description
        success = terminated and reward > 0
        if success:
            observation += f"\n{DONE_MESSAGE}"
        elif terminated:
            observation += f"\n{FAILED_MESSAGE}"
        elif truncated:
            observation += f"\n{OUT_OF_STEPS_MESSAGE}"
        self._done = terminated or truncated
        reward = float(reward) if success else 0.0
        return Step(
            observation=f"{observation}\n{self._menu.listing()}", reward=reward, done=self._done, success=success,
            info=self._info(action),
        )

    def random_action(self, rng: random.Random) -> str:
        self._require_live()
        action = rng.choice(list(self._menu.actions))
        return f"Thought: I will try this.\nAction: {action}"

    def close(self) -> None:
        if self._level is not None:
            self._level.close()
        self._level, self._reference, self._done = None, None, True

    # --- the expert -----------------------------------------------------------------------------
    def expert(self) -> str:
        self._require_live()
        action = self._expert_action()
        return f"Thought: {self._thought(action)}\nAction: {action}"

    def _expert_action(self) -> str:
        """The available macro that lands farthest along the bot's plan."""
        if not self._on_reference():
            self._reference, self._trace = _Reference.plan(self._level), _pose_of(self._level)
        reference = self._reference
        here = reference.reach[(self._trace, mission_progress(self._level))]
        best, best_value = None, here
        for action, primitives in self._menu.actions.items():
            if not primitives:
                continue
            end, progress = self._outcome(primitives)
            # Landing on the plan exactly is best; landing on its path facing
            # another way costs a replan and up to two turns, hence the discount.
            value = max(
                reference.reach.get((end, progress), -1),
                reference.reach_any_direction.get((end.place(), progress), -1) - _TURN_DISCOUNT,
            )
            if value > best_value:
                best, best_value = action, value
        if best is not None:
            return best
        # No macro skips ahead: take the plan's next primitive as it is.
        if here < len(reference.actions):
            for action, primitives in self._menu.actions.items():
                if primitives == (reference.actions[here],):
                    return action
        self._reference = None  # the plan is spent or unusable; plan afresh next turn
        return "turn left" if self._turn % 2 else "turn right"

    def _outcome(self, primitives: tuple[int, ...]) -> tuple[_Pose, tuple]:
        """The pose and mission progress after ``primitives``, without taking them.

        Poses follow from the primitives alone; the progress of a sequenced
        mission ("go to X, then go to Y") can change on the way, so those are
        played on a copy of the level.
        """
        end = self._trace
        for primitive in primitives:
            end = end.after(primitive)
        progress = mission_progress(self._level)
        if not progress:
            return end, progress
        shadow = copy.deepcopy(self._level)
        for primitive in primitives:
            _, _, terminated, truncated, _ = shadow.step(primitive)
            if terminated or truncated:
                break
        return end, mission_progress(shadow)

    def _on_reference(self) -> bool:
        """Whether the episode is still at a state the current plan passes through."""
        if self._reference is None:
            return False
        return (self._trace, mission_progress(self._level)) in self._reference.reach

    def _thought(self, action: str) -> str:
        """A short true sentence about ``action``, phrased one of a few ways."""
        kind = next(k for k in _PHRASES if action == k or action.startswith(k + " "))
        phrases = _PHRASES[kind]
        thought = phrases[(self._task.id * 7 + self._turn) % len(phrases)].format(obj=action[len(kind):].strip())
        if self._turn == 0:
            thought = f"My goal is to {self._level.mission}. {thought}"
        return thought

    # --- helpers --------------------------------------------------------------------------------
    def _check_task(self, task: Task) -> None:
        if not isinstance(task, Task):
            raise TypeError(f"reset expects a Task, got {type(task).__name__}")
        if task.env != self.name:
            raise ValueError(f"task belongs to environment {task.env!r}, not {self.name!r}")
        if task.id < 0:
            raise ValueError(f"BabyAI task ids are non-negative, got {task.id}")
        expected = level_difficulty(level_number(task.id))
        if task.difficulty != expected:
            raise ValueError(f"task {task.id} is level {level_number(task.id)} ({expected}), not {task.difficulty!r}")

    def _require_live(self) -> None:
        if self._level is None:
            raise RuntimeError("BabyAIEnv: call reset(task) before step/expert/random_action")
        if self._done:
            raise RuntimeError("BabyAIEnv: the episode is over; call reset(task) to start a new one")

    def _look(self) -> None:
        """Refresh what the agent sees, remembers and may do."""
        cells = text.visible_cells(self._level)
        for x, y in cells:
            self._known[x, y] = True
        objects = text.visible_objects(self._level, cells)
        self._description = text.describe(self._level, cells, objects)
        self._menu = text.action_menu(self._level, objects, self._known)

    def _parse(self, output: str) -> tuple[str | None, str | None]:
        """(normalised action, None) or (what was read, error message)."""
        lines = action_lines(output if isinstance(output, str) else "")
        if len(lines) != 1:
            return None, FORMAT_ERROR
        action = normalise_action(lines[0])
        if action in self._menu.actions:
            return action, None
        return action, self._menu.errors.get(action, NOT_RECOGNIZED_MESSAGE)

    def _invalid(self, error: str, action: str | None) -> Step:
        return Step(observation=f"{error}\n{self._menu.listing()}", valid=False, info=self._info(action))

    def _execute(self, primitives: tuple[int, ...]) -> tuple[float, bool, bool]:
        """Run primitive actions until they end or the episode does."""
        reward, terminated, truncated = 0.0, False, False
        for primitive in primitives:
            before = tuple(self._level.agent_pos)
            _, reward, terminated, truncated, _ = self._level.step(primitive)
            self._trace = self._trace.after(primitive).moved_to(self._level)
            if terminated or truncated:
                break
            if primitive == text.FORWARD and tuple(self._level.agent_pos) == before:
                break  # blocked: the rest of the path no longer applies
        return reward, terminated, truncated

    def _info(self, action: str | None) -> dict:
        level = self._level
        return {
            "action": action,
            "level": LEVELS[level_number(self._task.id) - 1],
            "primitive_steps": int(level.step_count),
            "max_steps": int(level.max_steps),
        }


_SPACES = re.compile(r"\s+")


def normalise_action(raw: str) -> str:
    """Lower-case, single-spaced, without wrapping quotes/brackets or a final period.

    ``pick up`` (the instruction's spelling) is accepted for ``pickup`` (the
    action list's).
    """
    action = _SPACES.sub(" ", raw).strip().strip("\"'`[]").strip().rstrip(".").strip().lower()
    if action.startswith("pick up "):
        action = "pickup " + action[len("pick up "):]
    return action


# --- which tasks the expert solves ----------------------------------------------------------

# Bump when the interface or the expert changes what can be solved.
SOLVABLE_CACHE_VERSION = 1


def expert_solves(task_id: int, max_turns: int) -> bool:
    """Whether the expert solves task ``task_id`` within ``max_turns`` through `BabyAIEnv.step`."""
    env = BabyAIEnv(max_turns=max_turns)
    env.reset(Task(env.name, task_id, "test", level_difficulty(level_number(task_id))))
    for _ in range(max_turns):
        result = env.step(env.expert())
        if result.done:
            return result.success
    return False


def _cache_path() -> Path:
    root = cache_root()
    return root / f"babyai-solvable-v{SOLVABLE_CACHE_VERSION}-minigrid{minigrid.__version__}.json"


_SOLVED: dict[tuple[int, int], bool] = {}


def solvable(task_ids: list[int], max_turns: int) -> dict[int, bool]:
    """``{id: expert_solves(id, max_turns)}``, cached in memory and on disk.

    Some BabyAI tasks cannot be finished in the turn limit even by the expert
    (long multi-room missions), and minigrid's strict verifier makes the
    two-door missions of ``OpenDoorsOrderN4Debug`` unwinnable; the test split
    keeps only the tasks the expert solves. A first run computes ~0.1 s per
    task; the answers are stored under ``$CONTRAIL_CACHE`` (default
    ``~/.cache/contrail``), keyed by minigrid's version.
    """
    missing = [i for i in task_ids if (i, max_turns) not in _SOLVED]
    if missing:
        _load_cache()
        missing = [i for i in missing if (i, max_turns) not in _SOLVED]
    for task_id in missing:
        _SOLVED[(task_id, max_turns)] = expert_solves(task_id, max_turns)
    if missing:
        _save_cache()
    return {i: _SOLVED[(i, max_turns)] for i in task_ids}


def _load_cache() -> None:
    try:
        stored = json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return
    for key, value in stored.items():
        task_id, _, turns = key.partition("@")
        if task_id.isdigit() and turns.isdigit():
            _SOLVED.setdefault((int(task_id), int(turns)), bool(value))


def _save_cache() -> None:
    """Merge what is known into the cache file; a lost race only costs recomputation."""
    path = _cache_path()
    _load_cache()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({f"{i}@{turns}": solved for (i, turns), solved in sorted(_SOLVED.items())}))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home still works, just without the disk cache
