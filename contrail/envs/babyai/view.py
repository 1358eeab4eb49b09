"""What the BabyAI agent sees, in AgentGym's sentences.

The agent sees minigrid's 7x7 egocentric window (walls and closed doors hide
what lies behind them). This module reads that window from minigrid's own
encoded observation (``image``) into a `View` and writes it the way AgentGym's
``agentenv-babyai`` does, byte for byte:

- every visible door, key, ball, box (and goal or lava, absent from BabyAI)
  is listed, nearest first by Manhattan distance; at equal distance in the
  window's reading order (farthest row first, left to right);
- objects are numbered per name (``red ball 1``, ``red ball 2``) in that order,
  doors named with their state (``red closed door``);
- walls are never listed, but a visible wall makes the list's opening sentence
  appear even when nothing follows it;
- "You are facing a <wall|box> N steps away." names the nearest wall or box on
  the line straight ahead by its type only (no colour); other objects on that
  line do not count, and when a closed door hides the wall behind it there is
  no such sentence at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from minigrid.core.constants import IDX_TO_COLOR, IDX_TO_OBJECT

# minigrid's door state encoding (minigrid.core.constants.STATE_TO_IDX).
DOOR_STATES = ("open", "closed", "locked")
# Cell types the agent is told about (walls only through the facing sentence).
SEEN_TYPES = ("door", "key", "ball", "box", "goal", "lava", "wall")
# What the facing sentence reports.
BARRIER_TYPES = ("box", "wall")


@dataclass(frozen=True)
class Thing:
    """One visible cell of interest, with its place relative to the agent.

    ``front`` counts steps ahead, ``right`` steps to the right (negative: to
    the left); ``distance`` is their Manhattan sum.
    """

    kind: str
    color: str
    state: str  # a door's open/closed/locked; "" for the rest
    pos: tuple[int, int]
    front: int
    right: int

    @property
    def name(self) -> str:
        """``red ball``, or ``red closed door``."""
        return f"{self.color} {self.state} {self.kind}" if self.kind == "door" else f"{self.color} {self.kind}"

    @property
    def distance(self) -> int:
        return abs(self.front) + abs(self.right)


@dataclass(frozen=True)
class View:
    """The agent's window now.

    ``things`` are nearest first (see the module docstring); ``facing`` is the
    nearest wall or box straight ahead as ``(kind, steps)``, or None;
    ``xs``/``ys`` bound the window in grid coordinates, the area AgentGym's
    macro paths may use; ``image`` is minigrid's encoded observation.
    """

    things: tuple[Thing, ...]
    facing: tuple[str, int] | None
    xs: range
    ys: range
    image: np.ndarray

    def named(self) -> list[tuple[Thing, int]]:
        """Every listed (non-wall) thing with its number among those of its name."""
        return _numbered(thing for thing in self.things if thing.kind != "wall")


def look(level, image: np.ndarray) -> View:
    """Read the agent's window from ``image``, minigrid's latest observation of ``level``.

    The observation minigrid returned, not a fresh one: ``PutNextS7N4Carrying``
    hands the agent its object only after making the first observation, which
    still shows the object on the floor (and AgentGym describes it so).
    """
    size = level.agent_view_size
    pos = np.asarray(level.agent_pos)
    fwd, right = np.asarray(level.dir_vec), np.asarray(level.right_vec)
    # Row 0 of the window is the farthest; column size // 2 is straight ahead.
    top_left = pos + fwd * (size - 1) - right * (size // 2)
    things = []
    for row in range(size):
        for col in range(size):
            x, y = (int(v) for v in top_left - fwd * row + right * col)
            # Cells past the grid's far edges read as walls (minigrid fills them so);
            # AgentGym drops only negative coordinates, and the agent's own cell.
            if x < 0 or y < 0 or (x, y) == tuple(pos):
                continue
            kind = IDX_TO_OBJECT[int(image[col, row, 0])]
            if kind not in SEEN_TYPES:
                continue
            offset = np.array((x, y)) - pos
            state = DOOR_STATES[int(image[col, row, 2])] if kind == "door" else ""
            color = IDX_TO_COLOR[int(image[col, row, 1])]
            things.append(Thing(kind, color, state, (x, y), int(offset @ fwd), int(offset @ right)))
    things.sort(key=lambda thing: thing.distance)  # stable: ties keep the reading order
    return View(tuple(things), _facing(things), *_window_span(top_left, fwd, right, size), image)


def _facing(things: list[Thing]) -> tuple[str, int] | None:
    ahead = [thing for thing in things if thing.kind in BARRIER_TYPES and thing.right == 0]
    if not ahead:
        return None
    nearest = min(ahead, key=lambda thing: thing.front)
    return nearest.kind, nearest.front


def _window_span(top_left: np.ndarray, fwd: np.ndarray, right: np.ndarray, size: int) -> tuple[range, range]:
    """The coordinate ranges AgentGym lets a macro path use.

    They come from the window's corner and the opposite corner one step past
    it; along an axis that runs backwards the range reaches one cell beyond
    the window (behind the agent, or past its right edge), as AgentGym's does.
    """
    far = top_left + size * (right - fwd)
    spans = []
    for axis in (0, 1):
        start, end = int(top_left[axis]), int(far[axis])
        spans.append(range(end, start + 1) if end < start else range(start, end))
    return spans[0], spans[1]


def _numbered(things) -> list[tuple[Thing, int]]:
    counts: dict[str, int] = {}
    numbered = []
    for thing in things:
        counts[thing.name] = counts.get(thing.name, 0) + 1
        numbered.append((thing, counts[thing.name]))
    return numbered


def _where(thing: Thing) -> str:
    if thing.right == 0:
        return f"right in front of you {thing.front} steps away."
    side = "right" if thing.right > 0 else "left"
    return f"{thing.front} steps in front of you and {abs(thing.right)} steps to your {side}."


def describe(view: View, carrying) -> str:
    """AgentGym's description: the objects, the walls, what is ahead, the hands.

    The spacing is AgentGym's too: two spaces after each object's sentence,
    none between "within sight." and "The room".
    """
    if view.things:
        seen = "".join(f"There is a {thing.name} {number} {_where(thing)}  " for thing, number in view.named())
        text = f"In front of you in this room, you can see several objects: {seen}"
    else:
        text = "You cannot see any objects within sight."
    text += "The room has walls around you. "
    if view.facing is not None:
        kind, steps = view.facing
        text += f"You are facing a {kind} {steps} steps away. "
    if carrying is None:
        return text + "You are not carrying anything."
    return text + f"You are carrying a {carrying.color} {carrying.type}."
