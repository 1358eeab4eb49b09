"""BabyAI's macro actions: which are available now, what each expands to, and playing one.

The menu follows AgentGym's ``agentenv-babyai`` exactly, since the model reads
it every turn: its order (turns, ``move forward``, pickups, ``drop``, door
actions, ``go to``s, ``check available actions``), its numbering and its
error messages for named actions that cannot be taken now.

A macro's primitive moves come from a breadth-first search over poses inside
the agent's window (`View.xs`/`View.ys`) that avoids the walls, boxes, balls
and keys the agent sees; unseen cells count as free and doors as passable.
Such a path can run into a closed door or a wall the agent did not see:
`play` stops a macro at the first primitive that leaves the observation
unchanged, as AgentGym does.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from contrail.envs.babyai.view import Thing, View

# minigrid's primitive actions (minigrid.core.actions.Actions) and directions
# (minigrid.core.constants.DIR_TO_VEC: 0 = east, 1 = south, 2 = west, 3 = north).
LEFT, RIGHT, FORWARD, PICKUP, DROP, TOGGLE, DONE = range(7)
DIRECTIONS = ((1, 0), (0, 1), (-1, 0), (0, -1))

# What a path may not enter, and what a dropped object may not land on.
OBSTACLE_TYPES = ("wall", "box", "lava", "ball", "key")
PICKABLE_TYPES = ("key", "ball", "box", "lava")  # lava as AgentGym lists it; BabyAI has none
CHECK = "check available actions"
NOT_RECOGNIZED = "The action is not recognized. Please check valid actions."

Pose = tuple[tuple[int, int], int]


@dataclass
class Menu:
    """The macro actions available now and why named unavailable ones fail.

    ``actions`` maps each action text, in display order, to its primitive
    actions; ``errors`` maps action texts that cannot be taken now to the
    message the agent gets for them.
    """

    actions: dict[str, tuple[int, ...]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    def listing(self) -> str:
        """``Available actions: ["turn left", ...]`` as AgentGym prints it."""
        return "Available actions: " + json.dumps(list(self.actions))


# --- paths ------------------------------------------------------------------------------


def _after(pose: Pose, action: int) -> Pose:
    (x, y), d = pose
    if action == LEFT:
        return (x, y), (d - 1) % 4
    if action == RIGHT:
        return (x, y), (d + 1) % 4
    dx, dy = DIRECTIONS[d]
    return (x + dx, y + dy), d


def find_path(start: Pose, target: tuple[int, int], view: View, *, arrive: bool) -> list[int] | None:
    """Primitive moves from ``start`` to face ``target`` (or stand on it, ``arrive``).

    Breadth-first over poses, trying forward, left, right in that order. A
    pose counts as explored when it leaves the queue, and a pose queued twice
    keeps the parent it was queued from last: both as AgentGym's search does,
    since they decide which of several shortest paths a macro takes.
    """
    blocked = {thing.pos for thing in view.things if thing.kind in OBSTACLE_TYPES}
    parents: dict[Pose, tuple[Pose, int]] = {}
    explored: set[Pose] = set()
    queue = deque([start])
    while queue:
        pose = queue.popleft()
        explored.add(pose)
        if _reaches(pose, target, arrive):
            return _unwind(parents, pose, start)
        for action in (FORWARD, LEFT, RIGHT):
            nxt = _after(pose, action)
            (x, y), _ = nxt
            if x not in view.xs or y not in view.ys or nxt in explored or (x, y) in blocked:
                continue
            parents[nxt] = (pose, action)
            queue.append(nxt)
    return None


def _reaches(pose: Pose, target: tuple[int, int], arrive: bool) -> bool:
    (x, y), d = pose
    if arrive:
        return (x, y) == target
    dx, dy = DIRECTIONS[d]
    return (x + dx, y + dy) == target


def _unwind(parents: dict[Pose, tuple[Pose, int]], pose: Pose, start: Pose) -> list[int]:
    actions = []
    while pose != start:
        pose, action = parents[pose]
        actions.append(action)
    return actions[::-1]


# --- the menu -------------------------------------------------------------------------


def action_menu(level, view: View) -> Menu:
    """Every macro action available now, in AgentGym's order, with its primitives."""
    start: Pose = ((int(level.agent_pos[0]), int(level.agent_pos[1])), int(level.agent_dir))
    carrying = level.carrying
    menu = Menu()
    menu.actions["turn left"] = (LEFT,)
    menu.actions["turn right"] = (RIGHT,)
    # Only a wall or box right ahead stops "move forward" being offered; a ball,
    # key or closed door there does not (the move then changes nothing).
    if view.facing is None or view.facing[1] > 1:
        menu.actions["move forward"] = (FORWARD,)
    else:
        menu.errors["move forward"] = "There is a barrier in front of you, you can't move forward."

    def facing_path(thing: Thing) -> list[int] | None:
        return find_path(start, thing.pos, view, arrive=False)

    if carrying is None:  # while carrying, pickups are neither offered nor explained
        pickable = [thing for thing in view.things if thing.kind in PICKABLE_TYPES]
        _add_numbered(menu, "pickup", pickable, lambda thing: _then(facing_path(thing), PICKUP))
    _add_drop(menu, start, view, carrying)
    _add_doors(menu, start, view, carrying)
    for thing in view.things:
        if thing.kind == "goal":
            path = find_path(start, thing.pos, view, arrive=True)
            if path is None:
                menu.errors["go to goal"] = "You cannot go to the goal, as there is no path leading to it."
            else:
                menu.actions["go to goal"] = tuple(path)
    reachable = [thing for thing in view.things if thing.kind not in ("wall", "goal")]
    _add_numbered(menu, "go to", reachable, facing_path)
    menu.actions[CHECK] = ()
    return menu


def _then(path: list[int] | None, action: int) -> list[int] | None:
    return None if path is None else [*path, action]


def _add_numbered(menu: Menu, verb: str, things: list[Thing], route) -> None:
    """``<verb> <name> <n>`` for each thing a route reaches.

    AgentGym numbers these among the *reachable* things of a name, so when an
    earlier one has no path the numbers differ from the description's (its
    error message then names the number the next reachable one would take).
    """
    counts: dict[str, int] = {}
    for thing in things:
        primitives = route(thing)
        seen_one = f"{verb} {thing.name} 1" in menu.actions
        if primitives is not None:
            counts[thing.name] = counts[thing.name] + 1 if seen_one else 1
            menu.actions[f"{verb} {thing.name} {counts[thing.name]}"] = tuple(primitives)
        else:
            label = f"{thing.name} {counts[thing.name] + 1 if seen_one else 1}"
            menu.errors[f"{verb} {label}"] = f"You cannot {verb} {label}, as there is no path leading to it."


def _add_drop(menu: Menu, start: Pose, view: View, carrying) -> None:
    if carrying is None:
        menu.errors["drop"] = "You cannot drop the object, as you are not carrying anything."
        return
    (x, y), d = start
    ahead = (x + DIRECTIONS[d][0], y + DIRECTIONS[d][1])
    if any(thing.pos == ahead and thing.kind in OBSTACLE_TYPES for thing in view.things):
        menu.errors["drop"] = "You cannot drop the object, as there is already an object in front of you."
    else:
        menu.actions["drop"] = (DROP,)


def _add_doors(menu: Menu, start: Pose, view: View, carrying) -> None:
    """``go through`` open doors, ``toggle and go through`` closed (or unlockable) ones, ``toggle``.

    Doors are numbered per name among all visible doors, reachable or not.
    """
    counts: dict[str, int] = {}
    for door in view.things:
        if door.kind != "door":
            continue
        counts[door.name] = counts.get(door.name, 0) + 1
        label = f"{door.name} {counts[door.name]}"
        if door.state == "open":
            path = find_path(start, door.pos, view, arrive=True)
            if path is None:
                menu.errors[f"go through {label}"] = (
                    f"You cannot go through {label}, as there is no path leading to it."
                )
            else:
                menu.actions[f"go through {label}"] = tuple(path)
            continue
        if door.state == "locked" and not _opens(carrying, door, label, menu):
            continue
        path = find_path(start, door.pos, view, arrive=False)
        through = f"toggle and go through {label}"
        if path is None:
            # AgentGym's message prints its door counter here instead of the number.
            menu.errors[through] = (
                f"You cannot toggle and go through {door.name} {counts}, as there is no path leading to it."
            )
        else:
            menu.actions[through] = (*path, TOGGLE, FORWARD)
            if not path:
                menu.actions["toggle"] = (TOGGLE,)
        if door.state == "closed":
            menu.errors[f"go through {label}"] = (
                f"You cannot go through {label}, as it is closed. You should toggle it first."
            )


def _opens(carrying, door: Thing, label: str, menu: Menu) -> bool:
    """Whether the carried object unlocks ``door``; if not, say why in ``menu.errors``."""
    through = f"toggle and go through {label}"
    if carrying is None or carrying.type != "key":
        menu.errors[through] = f"You cannot toggle and go through {label}, as you are not carrying a key."
        return False
    if carrying.color != door.color:
        menu.errors[through] = (
            f"You cannot toggle and go through {label}, "
            "as the color of the key you are carrying does not match the color of door."
        )
        return False
    return True


# --- playing a macro ----------------------------------------------------------------------


@dataclass(frozen=True)
class Played:
    """What minigrid answered to the last primitive of a macro that was taken."""

    reward: float
    terminated: bool
    truncated: bool
    changed: int  # how many primitives changed the observation (all of them, unless one was blocked)
    image: np.ndarray  # minigrid's observation after the last one


def play(level, primitives: tuple[int, ...], image: np.ndarray) -> Played:
    """Take ``primitives`` on ``level`` until one leaves the observation ``image`` unchanged.

    As in AgentGym, the outcome is the last primitive's: a mission met halfway
    through a macro and undone by its later moves does not count.
    """
    reward, terminated, truncated, changed = 0.0, False, False, 0
    for primitive in primitives:
        obs, reward, terminated, truncated, _ = level.step(primitive)
        if np.array_equal(obs["image"], image):
            break  # blocked: the rest of the path no longer applies
        image = obs["image"]
        changed += 1
    return Played(float(reward), bool(terminated), bool(truncated), changed, image)
