"""BabyAI's text interface: what the agent sees and which macro actions it may take.

A minigrid BabyAI level is a grid the agent sees through a 7x7 egocentric
window. This module turns that window into AgentGym's sentences ("There is a
grey key 1 1 steps in front of you and 1 steps to your left.") and into the
menu of macro actions available now, each expanded into the primitive minigrid
actions that carry it out along a shortest path.

Paths are planned over the cells the agent has seen so far in the episode
(``known``), never through unseen cells, so a macro only uses what the agent
could know. Objects are named by colour, state (doors) and type, and numbered
within one name from near to far ("red ball 1", "red ball 2"); the number is
the one the actions use.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

# minigrid's primitive actions (minigrid.core.actions.Actions) and directions
# (minigrid.core.constants.DIR_TO_VEC: 0 = east, 1 = south, 2 = west, 3 = north).
LEFT, RIGHT, FORWARD, PICKUP, DROP, TOGGLE, DONE = range(7)
PRIMITIVE_NAMES = ("left", "right", "forward", "pickup", "drop", "toggle", "done")
DIRECTIONS = ((1, 0), (0, 1), (-1, 0), (0, -1))

# Object types the agent is told about; walls are only reported straight ahead.
NAMED_TYPES = ("door", "key", "ball", "box")
PICKABLE_TYPES = ("key", "ball", "box")

NOT_RECOGNIZED = "The action is not recognized. Please check valid actions."


@dataclass(frozen=True)
class SeenObject:
    """One object in the agent's view, in the agent's frame.

    ``front`` counts steps ahead and ``right`` steps to the right (negative:
    left); ``number`` ranks the object among those sharing its ``name``.
    """

    name: str
    kind: str
    number: int
    pos: tuple[int, int]
    front: int
    right: int

    @property
    def label(self) -> str:
        return f"{self.name} {self.number}"


@dataclass
class Menu:
    """The macro actions available now and why named unavailable ones fail.

    ``actions`` maps each action text, in display order, to its primitive
    actions; ``errors`` maps action texts that name something real but cannot
    be done now to the message the agent gets for them.
    """

    actions: dict[str, tuple[int, ...]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    def listing(self) -> str:
        """``Available actions: ["turn left", ...]`` as AgentGym prints it."""
        return "Available actions: " + json.dumps(list(self.actions))


# --- what the agent sees ----------------------------------------------------------


def visible_cells(level) -> list[tuple[int, int]]:
    """Absolute positions of the grid cells in the agent's field of view.

    Uses minigrid's own visibility mask, so cells hidden behind walls and
    closed doors are excluded; the agent's own cell is included.
    """
    _, vis_mask = level.gen_obs_grid()
    size = level.agent_view_size
    pos = np.asarray(level.agent_pos)
    fwd, right = np.asarray(level.dir_vec), np.asarray(level.right_vec)
    # The view's row 0 is the farthest; its column size // 2 is straight ahead.
    top_left = pos + fwd * (size - 1) - right * (size // 2)
    cells = []
    for row in range(size):
        for col in range(size):
            if not vis_mask[col, row]:
                continue
            x, y = top_left - fwd * row + right * col
            if 0 <= x < level.width and 0 <= y < level.height:
                cells.append((int(x), int(y)))
    return cells


def object_name(obj) -> str:
    """``red ball``, or ``red closed door`` (doors carry their state)."""
    if obj.type == "door":
        state = "open" if obj.is_open else ("locked" if obj.is_locked else "closed")
        return f"{obj.color} {state} door"
    return f"{obj.color} {obj.type}"


def relative(level, pos: tuple[int, int]) -> tuple[int, int]:
    """(steps in front, steps to the right) of ``pos`` from the agent."""
    offset = np.asarray(pos) - np.asarray(level.agent_pos)
    return int(offset @ np.asarray(level.dir_vec)), int(offset @ np.asarray(level.right_vec))


def visible_objects(level, cells: list[tuple[int, int]]) -> list[SeenObject]:
    """Named objects among ``cells``, nearest first, numbered within each name."""
    found = []
    for pos in cells:
        obj = level.grid.get(*pos)
        if obj is None or obj.type not in NAMED_TYPES or pos == tuple(level.agent_pos):
            continue
        front, right = relative(level, pos)
        found.append((abs(front) + abs(right), front, right, pos, obj))
    found.sort(key=lambda item: item[:3])
    counts: dict[str, int] = {}
    objects = []
    for _, front, right, pos, obj in found:
        name = object_name(obj)
        counts[name] = counts.get(name, 0) + 1
        objects.append(SeenObject(name, obj.type, counts[name], pos, front, right))
    return objects


def _where(obj: SeenObject) -> str:
    if obj.right == 0:
        return f"right in front of you {obj.front} steps away."
    side = "right" if obj.right > 0 else "left"
    return f"{obj.front} steps in front of you and {abs(obj.right)} steps to your {side}."


def _ahead(level, cells: list[tuple[int, int]]) -> str:
    """The first visible thing that blocks the way straight ahead."""
    visible = set(cells)
    pos = np.asarray(level.agent_pos)
    for steps in range(1, level.agent_view_size):
        cell = tuple(int(v) for v in pos + steps * np.asarray(level.dir_vec))
        if cell not in visible:
            return ""
        obj = level.grid.get(*cell)
        if obj is not None and not obj.can_overlap():
            name = "wall" if obj.type == "wall" else object_name(obj)
            return f"You are facing a {name} {steps} steps away. "
    return ""


def describe(level, cells: list[tuple[int, int]], objects: list[SeenObject]) -> str:
    """AgentGym's sentence description of the view, the way ahead and the hands."""
    if objects:
        seen = " ".join(f"There is a {obj.label} {_where(obj)}" for obj in objects)
        text = f"In front of you in this room, you can see several objects: {seen} "
    else:
        text = "You cannot see any objects within sight. "
    text += "The room has walls around you. " + _ahead(level, cells)
    carrying = level.carrying
    if carrying is None:
        return text + "You are not carrying anything."
    return text + f"You are carrying a {carrying.color} {carrying.type}."


# --- planning -----------------------------------------------------------------------


def passable(obj) -> bool:
    """Whether the agent can stand on a cell holding ``obj`` (lava is avoided)."""
    return obj is None or (obj.can_overlap() and obj.type != "lava")


def shortest_path(level, known: np.ndarray, accept: Callable[[tuple[int, int], int], bool]) -> list[int] | None:
    """Fewest primitive moves (left/right/forward) to a pose that ``accept``s.

    Breadth-first over (x, y, direction); the agent only steps on known,
    passable cells. Returns None when no such pose is reachable.
    """
    start = (int(level.agent_pos[0]), int(level.agent_pos[1]), int(level.agent_dir))
    parents: dict[tuple[int, int, int], tuple[tuple[int, int, int], int] | None] = {start: None}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        x, y, d = state
        if accept((x, y), d):
            return _unwind(parents, state)
        dx, dy = DIRECTIONS[d]
        moves = [((x + dx, y + dy, d), FORWARD), ((x, y, (d - 1) % 4), LEFT), ((x, y, (d + 1) % 4), RIGHT)]
        for nxt, action in moves:
            if nxt in parents:
                continue
            if action == FORWARD and not _steppable(level, known, nxt[0], nxt[1]):
                continue
            parents[nxt] = (state, action)
            queue.append(nxt)
    return None


def _steppable(level, known: np.ndarray, x: int, y: int) -> bool:
    if not (0 <= x < level.width and 0 <= y < level.height) or not known[x, y]:
        return False
    return passable(level.grid.get(x, y))


def _unwind(parents, state) -> list[int]:
    actions = []
    while parents[state] is not None:
        state, action = parents[state]
        actions.append(action)
    return actions[::-1]


def _facing(target: tuple[int, int]) -> Callable[[tuple[int, int], int], bool]:
    def accept(pos: tuple[int, int], d: int) -> bool:
        dx, dy = DIRECTIONS[d]
        return (pos[0] + dx, pos[1] + dy) == target

    return accept


def _standing_on(target: tuple[int, int]) -> Callable[[tuple[int, int], int], bool]:
    return lambda pos, d: pos == target


# --- the menu -------------------------------------------------------------------------


def action_menu(level, objects: list[SeenObject], known: np.ndarray) -> Menu:
    """Every macro action available now, in AgentGym's order, with its primitives."""
    menu = Menu()
    menu.actions["turn left"] = (LEFT,)
    menu.actions["turn right"] = (RIGHT,)
    front_pos = tuple(int(v) for v in np.asarray(level.agent_pos) + np.asarray(level.dir_vec))
    front = level.grid.get(*front_pos)
    if passable(front):
        menu.actions["move forward"] = (FORWARD,)
    else:
        menu.errors["move forward"] = "There is a barrier in front of you, you can't move forward."

    paths = {obj.label: shortest_path(level, known, _facing(obj.pos)) for obj in objects}
    carrying = level.carrying
    for obj in objects:
        if obj.kind not in PICKABLE_TYPES:
            continue
        action = f"pickup {obj.label}"
        if carrying is not None:
            menu.errors[action] = f"You cannot pickup {obj.label}, as you are already carrying something."
        elif paths[obj.label] is None:
            menu.errors[action] = f"You cannot pickup {obj.label}, as there is no path leading to it."
        else:
            menu.actions[action] = (*paths[obj.label], PICKUP)

    if carrying is None:
        menu.errors["drop"] = "You cannot drop the object, as you are not carrying anything."
    elif front is not None:
        menu.errors["drop"] = "You cannot drop the object, as there is already an object in front of you."
    else:
        menu.actions["drop"] = (DROP,)

    for obj in objects:
        if obj.kind == "door":
            _add_door_actions(menu, level, obj, paths[obj.label], known)
    if front is not None and front.type == "box" and "toggle" not in menu.actions:
        menu.actions["toggle"] = (TOGGLE,)
    if "toggle" not in menu.actions:
        menu.errors["toggle"] = "There is nothing in front of you that you can toggle."

    for obj in objects:
        action = f"go to {obj.label}"
        if paths[obj.label] is None:
            menu.errors[action] = f"You cannot go to {obj.label}, as there is no path leading to it."
        else:
            menu.actions[action] = tuple(paths[obj.label])
    menu.actions["check available actions"] = ()
    return menu


def _add_door_actions(menu: Menu, level, door: SeenObject, path: list[int] | None, known: np.ndarray) -> None:
    through = f"go through {door.label}"
    toggle_through = f"toggle and go through {door.label}"
    obj = level.grid.get(*door.pos)
    if obj.is_open:
        route = shortest_path(level, known, _standing_on(door.pos))
        if route is None:
            menu.errors[through] = f"You cannot go through {door.label}, as there is no path leading to it."
        else:
            menu.actions[through] = tuple(route)
        return
    menu.errors[through] = f"You cannot go through {door.label}, as it is closed. You should toggle it first."
    if obj.is_locked:
        carrying = level.carrying
        if carrying is None or carrying.type != "key":
            menu.errors[toggle_through] = f"You cannot toggle and go through {door.label}, as you are not carrying a key."
            return
        if carrying.color != obj.color:
            menu.errors[toggle_through] = (
                f"You cannot toggle and go through {door.label}, "
                "as the color of the key you are carrying does not match the color of door."
            )
            return
    if path is None:
        menu.errors[toggle_through] = f"You cannot toggle and go through {door.label}, as there is no path leading to it."
        return
    menu.actions[toggle_through] = (*path, TOGGLE, FORWARD)
    if not path:
        menu.actions["toggle"] = (TOGGLE,)
