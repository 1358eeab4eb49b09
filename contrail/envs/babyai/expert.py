"""BabyAI's expert: the offered macro that lands farthest along the planner's plan.

The planner (`contrail.envs.babyai.planner`) plans the whole episode on a copy
of the level at the expert's first call; each turn the expert predicts where
each available macro would leave the agent and writes the one that lands
farthest along that plan. The plan is remade whenever the episode leaves it.
"""

from __future__ import annotations

import copy

from contrail.envs.babyai.actions import DROP, FORWARD, PICKUP, TOGGLE, Menu, play
from contrail.envs.babyai.planner import Pose, Reference, mission_progress, pose_of

_TURN_DISCOUNT = 2  # plan steps a macro that lands facing the wrong way is worth less

# "toggle and go through" must come before "toggle": the first matching prefix names the kind.
_PHRASES = {
    "go to": ("I should go to the {obj} next.", "Next I head to the {obj}.", "Going to the {obj} is my next step."),
    "pickup": (
        "I need to pick up the {obj}.",
        "The {obj} is reachable, so I pick it up.",
        "I will pick up the {obj} now.",
    ),
    "drop": (
        "I should put down what I am carrying here.",
        "I drop the object I am holding here.",
        "Time to drop what I carry.",
    ),
    "go through": (
        "I will go through the {obj}.",
        "The {obj} is open, so I walk through it.",
        "I pass through the {obj}.",
    ),
    "toggle and go through": (
        "I open the {obj} and go through it.",
        "I open the {obj} and pass through it.",
        "I will toggle the {obj} and walk through.",
    ),
    "toggle": (
        "I toggle what is right in front of me.",
        "I open what is in front of me.",
        "Toggling the thing ahead is next.",
    ),
    "turn left": ("I turn left to face where I need to go.", "Turning left is the way forward.", "I turn to my left."),
    "turn right": (
        "I turn right to face where I need to go.",
        "Turning right is the way forward.",
        "I turn to my right.",
    ),
    "move forward": ("I move forward.", "I step forward.", "Moving ahead is the way to go."),
    "check available actions": ("Let me check which actions I can take.",) * 3,
}


class Expert:
    """The expert of one episode on ``level`` (privileged: it plans on the true map).

    The environment tells it every macro it plays (`played`), so that it can
    tell whether the episode is still on its plan.
    """

    def __init__(self, level) -> None:
        self.level = level
        self.reference: Reference | None = None  # made on the first call to `action`
        self.trace = pose_of(level)  # the episode's pose, with its interactions since the plan's start

    def played(self, primitives: tuple[int, ...], changed: int) -> None:
        """Record that the first ``changed`` of ``primitives`` took effect."""
        trace = self.trace
        for primitive in primitives[:changed]:
            trace = trace.after(primitive)
        self.trace = trace.moved_to(self.level)

    def action(self, menu: Menu, image, turn: int) -> str:
        """The available macro in ``menu`` that lands farthest along the plan.

        ``image`` is minigrid's latest observation (a macro stops where it
        stops changing).
        """
        if not self._on_reference():
            self.reference, self.trace = Reference.plan(self.level), pose_of(self.level)
        reference = self.reference
        here = reference.reach[(self.trace, mission_progress(self.level))]
        best, best_value = None, here
        for action, primitives in menu.actions.items():
            if not primitives:
                continue
            end, progress = self._outcome(primitives, image)
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
            for action, primitives in menu.actions.items():
                if primitives == (reference.actions[here],):
                    return action
        self.reference = None  # the plan is spent or unusable; plan afresh next turn
        return "turn left" if turn % 2 else "turn right"

    def _on_reference(self) -> bool:
        """Whether the episode is still at a state the current plan passes through."""
        if self.reference is None:
            return False
        return (self.trace, mission_progress(self.level)) in self.reference.reach

    def _outcome(self, primitives: tuple[int, ...], image) -> tuple[Pose, tuple]:
        """The pose and mission progress after the macro ``primitives``, without playing it.

        A plain mission's progress cannot change on the way, so the pose is
        predicted from the grid (`_predict`); a sequenced mission ("go to X,
        then go to Y") is played on a copy of the level.
        """
        progress = mission_progress(self.level)
        if not progress:
            return _predict(self.level, self.trace, primitives), progress
        shadow = copy.deepcopy(self.level)
        played = play(shadow, primitives, image)
        end = self.trace
        for primitive in primitives[:played.changed]:
            end = end.after(primitive)
        return end.moved_to(shadow), mission_progress(shadow)


def _predict(level, start: Pose, primitives: tuple[int, ...]) -> Pose:
    """Where ``primitives`` leave the agent: up to the first one that would change nothing.

    The level is not touched; doors opened and objects picked up on the way
    are tracked aside.
    """
    grid, carrying = level.grid, level.carrying
    opened: set[tuple[int, int]] = set()
    taken: set[tuple[int, int]] = set()
    pose = start
    for primitive in primitives:
        front = pose.after(FORWARD).pos
        cell = None if front in taken else grid.get(*front)
        if primitive == FORWARD and cell is not None and not cell.can_overlap() and front not in opened:
            break
        if primitive == PICKUP:
            if carrying is not None or cell is None or not cell.can_pickup():
                break
            carrying = cell
            taken.add(front)
        if primitive == TOGGLE:
            if cell is None or cell.type != "door" or front in opened:
                break
            if cell.is_locked and (carrying is None or carrying.type != "key" or carrying.color != cell.color):
                break
            opened.add(front)
        if primitive == DROP and (carrying is None or cell is not None):
            break
        pose = pose.after(primitive)
    return pose


def thought(action: str, task_id: int, turn: int, goal: str) -> str:
    """A short true sentence about ``action``, phrased one of a few ways (the goal on turn 0)."""
    kind = next(k for k in _PHRASES if action == k or action.startswith(k + " "))
    phrases = _PHRASES[kind]
    text = phrases[(task_id * 7 + turn) % len(phrases)].format(obj=action[len(kind):].strip())
    if turn == 0:
        text = f"My goal is to {goal}. {text}"
    return text
