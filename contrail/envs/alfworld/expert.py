"""A planner for ALFWorld games that reads the engine's current facts.

The expert knows the whole state (as ALFWorld's own planner expert does) and
answers from the state it finds, so it recovers after any detour a model took.
The goal comes from the problem's ``(:goal ...)`` section, so the same expert
plays generated games and the real ``game.tw-pddl`` files.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

# What each state-change task does to its object, and with which appliance.
_TRANSFORMS = {
    "pick_clean_then_place_in_recep": ("clean", "isclean", "sinkbasin"),
    "pick_heat_then_place_in_recep": ("heat", "ishot", "microwave"),
    "pick_cool_then_place_in_recep": ("cool", "iscool", "fridge"),
}


@dataclass(frozen=True)
class Goal:
    """What a game asks for, in the engine's lower-case type names."""

    task_type: str
    object_type: str
    receptacle_type: str | None = None
    toggle_type: str | None = None


def parse_goal(pddl_problem: str) -> Goal:
    """Read the task type and its arguments off a problem's goal section."""
    goal = pddl_problem[pddl_problem.lower().rindex("(:goal") :]

    def argument(pattern: str) -> str | None:
        found = re.search(pattern, goal, re.IGNORECASE)
        return found.group(1).lower() if found else None

    lowered = goal.lower()
    if "istoggled" in lowered:
        task_type = "look_at_obj_in_light"
    elif "?o2" in lowered:
        task_type = "pick_two_obj_and_place"
    else:
        task_type = next(
            (name for name, (_, state, _) in _TRANSFORMS.items() if state in lowered), "pick_and_place_simple"
        )
    object_type = argument(r"\(objectType \?o\d? (\w+?)Type\)")
    if object_type is None:
        raise ValueError("the goal names no object type")
    return Goal(
        task_type=task_type,
        object_type=object_type,
        receptacle_type=argument(r"\(receptacleType \?r (\w+?)Type\)"),
        toggle_type=argument(r"\(objectType \?ot (\w+?)Type\)"),
    )


def natural_key(name: str):
    """Sort ``cabinet 2`` before ``cabinet 10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


@dataclass
class World:
    """The facts the planner needs, indexed by entity name."""

    kind: dict[str, str] = field(default_factory=dict)  # entity -> object/receptacle type
    inside: dict[str, str] = field(default_factory=dict)  # object -> receptacle
    location: dict[str, str] = field(default_factory=dict)  # receptacle -> location
    unary: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))  # predicate -> entities
    can_contain: set[tuple[str, str]] = field(default_factory=set)
    held: str | None = None
    agent_at: str | None = None

    @classmethod
    def from_facts(cls, facts) -> "World":
        world = cls()
        for fact in facts:
            names = [variable.name.strip() for variable in fact.arguments]
            predicate = fact.name.lower()
            if predicate in ("objecttype", "receptacletype"):
                world.kind[names[0]] = names[1].removesuffix("type").strip()
            elif predicate == "inreceptacle":
                world.inside[names[0]] = names[1]
            elif predicate == "receptacleatlocation":
                world.location[names[0]] = names[1]
            elif predicate == "holds":
                world.held = names[1]
            elif predicate == "atlocation":
                world.agent_at = names[1]
            elif predicate == "cancontain":
                world.can_contain.add((names[0].removesuffix("type").strip(), names[1].removesuffix("type").strip()))
            elif len(names) == 1:
                world.unary[predicate].add(names[0])
        return world

    def of_type(self, kind: str, among=None) -> list[str]:
        pool = self.kind if among is None else among
        return sorted((name for name in pool if self.kind.get(name) == kind), key=natural_key)

    def at(self, receptacle: str) -> bool:
        return self.location.get(receptacle) == self.agent_at

    def closed(self, receptacle: str) -> bool:
        return receptacle in self.unary["openable"] and receptacle not in self.unary["opened"]


@dataclass(frozen=True)
class Move:
    """One planned command and why (``purpose`` names the step for the thought)."""

    command: str
    purpose: str
    item: str = ""
    place: str = ""


def next_move(world: World, goal: Goal) -> Move:
    """The next command, in the engine's grammar, towards ``goal`` from ``world``."""
    if goal.task_type == "look_at_obj_in_light":
        return _look_move(world, goal)
    return _place_move(world, goal)


def _reach(world: World, receptacle: str, purpose: str, item: str = "") -> Move | None:
    """Go to ``receptacle`` and open it if needed; None once it can be used."""
    if not world.at(receptacle):
        return Move(f"go to {receptacle}", f"go_{purpose}", item, receptacle)
    if world.closed(receptacle):
        return Move(f"open {receptacle}", "open", item, receptacle)
    return None


def _fetch(world: World, candidates: list[str]) -> Move:
    if not candidates:
        raise RuntimeError("no object left that the goal can use")
    # Prefer an object where the agent already stands, then the first by name.
    candidates = sorted(candidates, key=lambda o: (not world.at(world.inside[o]), natural_key(o)))
    item = candidates[0]
    host = world.inside[item]
    return _reach(world, host, "fetch", item) or Move(f"take {item} from {host}", "take", item, host)


def _drop(world: World, goal_receptacles: list[str]) -> Move:
    """Put away an object the goal does not need (after a model's detour)."""
    item = world.held
    kind = world.kind.get(item, "")
    hosts = [r for r in world.location if (world.kind.get(r), kind) in world.can_contain and r not in goal_receptacles]
    if not hosts:
        raise RuntimeError(f"nowhere to put down {item}")
    hosts.sort(key=lambda r: (not world.at(r), natural_key(r)))
    return _reach(world, hosts[0], "drop", item) or Move(f"move {item} to {hosts[0]}", "drop", item, hosts[0])


def _place_move(world: World, goal: Goal) -> Move:
    verb, state, appliance_type = _TRANSFORMS.get(goal.task_type, (None, None, None))
    wanted = world.of_type(goal.object_type, world.inside.keys() | ({world.held} if world.held else set()))
    targets = world.of_type(goal.receptacle_type or "", world.location)
    if not targets:
        raise RuntimeError(f"no {goal.receptacle_type} in this game")
    # The receptacle already holding most goal objects (pick_two needs both in one).
    target = max(targets, key=lambda r: sum(world.inside.get(o) == r for o in wanted))
    ready = [o for o in wanted if world.inside.get(o) == target and (state is None or o in world.unary[state])]
    if world.held and world.held in wanted:
        item = world.held
        if state is not None and item not in world.unary[state]:
            appliances = world.of_type(appliance_type, world.location)
            if not appliances:
                raise RuntimeError(f"no {appliance_type} to {verb} with")
            station = min(appliances, key=lambda r: not world.at(r))
            if not world.at(station):
                return Move(f"go to {station}", "go_appliance", item, station)
            return Move(f"{verb} {item} with {station}", verb, item, station)
        return _reach(world, target, "target", item) or Move(f"move {item} to {target}", "place", item, target)
    if world.held:
        return _drop(world, targets)
    return _fetch(world, [o for o in wanted if o not in ready])


def _look_move(world: World, goal: Goal) -> Move:
    if world.held and world.kind.get(world.held) != goal.object_type:
        return _drop(world, [])
    if not world.held:
        return _fetch(world, world.of_type(goal.object_type, world.inside))
    lamps = [lamp for lamp in world.of_type(goal.toggle_type or "", world.inside) if lamp in world.inside]
    if not lamps:
        raise RuntimeError(f"no {goal.toggle_type} in this game")
    lamp = min(lamps, key=lambda name: not world.at(world.inside[name]))
    host = world.inside[lamp]
    if not world.at(host):
        return Move(f"go to {host}", "go_lamp", lamp, host)
    return Move(f"use {lamp}", "use", world.held, lamp)
