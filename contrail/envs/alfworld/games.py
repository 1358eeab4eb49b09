"""Generated ALFWorld games: PDDL problems built from the tables that ship with `alfworld`.

ALFWorld's own game files (``game.tw-pddl``) are a download; the `alfworld`
package ships only what produced them: the PDDL domain and TextWorld grammar
(``alfworld/data``), the 120 AI2-THOR floor plans as navigable grids plus the
receptacle instances the ALFRED generator could reach
(``alfworld/gen/layouts/FloorPlan*-{layout.npy,objects.json,openable.json}``),
and the object tables (``alfworld/gen/constants.py``: what each receptacle can
hold, what can be heated, cooled, cleaned, toggled) and goal library
(``alfworld/gen/goal_library.py``: the goal PDDL and the task sentences).

This module writes, for one ``(task type, floor plan, seed)``, a problem in the
format of ALFWorld's ``initial_state.pddl`` and wraps it as a ``tw-pddl`` game
exactly as ``alfworld-generate`` does (domain + grammar with the task sentence
+ problem). What differs from the real games, and why:

- Receptacles the layout tables do not place (e.g. stove burners, toasters,
  coffee machines, garbage cans in most kitchens) are placed at a random
  navigable point of the floor plan; in the real games they stand where
  AI2-THOR put them.
- Object instances (1-3 per object type of the scene) are scattered over
  receptacles that can hold them; the real games use ALFRED's recorded
  initial scenes. Decorative, non-pickable objects (windows, paintings, ...)
  are left out; lamps are placed on a furniture receptacle so that
  ``look_at_obj_in_light`` is playable.
- Goal objects and receptacles are drawn from the scene's own object and
  receptacle types, with the constraints of ALFRED's task families (room types
  from ``GOALS_VALID``, the appliance is never the target receptacle).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from contrail.envs.alfworld.expert import Goal  # the same goal the expert reads back from a problem
from contrail.paths import environment_cache

TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)
EASY_TYPES = ("pick_and_place_simple", "look_at_obj_in_light")

# Bumped whenever generation changes, so cached games are never stale.
GENERATOR_VERSION = 1
CACHE_ENV_VAR = "CONTRAIL_ALFWORLD_CACHE"

# Lamps are not held by any receptacle in ALFRED's tables; they stand on furniture.
_LAMP_HOSTS = ("Desk", "SideTable", "Dresser", "DiningTable", "CoffeeTable", "TVStand", "Shelf", "ArmChair", "Sofa")
_LAMPS = ("DeskLamp", "FloorLamp")
# The appliance a state-change task needs, which is then never its target receptacle.
_APPLIANCE = {
    "pick_clean_then_place_in_recep": ("SinkBasin", "BathtubBasin"),
    "pick_heat_then_place_in_recep": ("Microwave",),
    "pick_cool_then_place_in_recep": ("Fridge",),
}
_REQUIRED_PROPERTY = {
    "pick_clean_then_place_in_recep": "Cleanable",
    "pick_heat_then_place_in_recep": "Heatable",
    "pick_cool_then_place_in_recep": "Coolable",
}
# Object types the layout tables name by the fixture, whose receptacle is the basin.
_BASINS = {"Sink": "SinkBasin", "Bathtub": "BathtubBasin"}
_GRID = 0.25  # metres per navigation grid step (AI2-THOR's AGENT_STEP_SIZE)


# --- the shipped tables ---------------------------------------------------------


@lru_cache(maxsize=1)
def _constants():
    import alfworld.gen.constants as constants

    return constants


@lru_cache(maxsize=1)
def _goal_library():
    import alfworld.gen.goal_library as goal_library

    return goal_library.gdict


def _layouts_dir() -> Path:
    import alfworld.gen

    return Path(alfworld.gen.__file__).parent / "layouts"


@lru_cache(maxsize=1)
def game_logic() -> dict[str, str]:
    """ALFWorld's PDDL domain and TextWorld grammar, read once per process."""
    from alfworld.info import ALFRED_PDDL_PATH, ALFRED_TWL2_PATH

    return {
        "pddl_domain": Path(ALFRED_PDDL_PATH).read_text(),
        "grammar": Path(ALFRED_TWL2_PATH).read_text(),
    }


def _static_receptacle_types() -> set[str]:
    c = _constants()
    return set(c.RECEPTACLES) - set(c.MOVABLE_RECEPTACLES)


def _containable_types() -> set[str]:
    """Object types some receptacle can hold, i.e. objects an agent can pick up."""
    c = _constants()
    held = set().union(*c.VAL_RECEPTACLE_OBJECTS.values())
    return {t for t in held if not t.endswith("Sliced")} - _static_receptacle_types()


def room_type(floor_plan: int) -> str:
    for name, numbers in _constants().SCENE_TYPE.items():
        if floor_plan in numbers:
            return name
    raise ValueError(f"unknown floor plan {floor_plan}")


def scene_numbers(split: str) -> list[int]:
    """ALFRED's seen (train) and unseen (test) floor plans: the test rooms are never trained on."""
    c = _constants()
    numbers = c.TRAIN_SCENE_NUMBERS if split == "train" else c.TEST_SCENE_NUMBERS
    return sorted(numbers)


# --- one floor plan ---------------------------------------------------------------


@dataclass(frozen=True)
class Scene:
    """What the layout tables say about one floor plan."""

    floor_plan: int
    object_types: frozenset[str]
    # (ALFRED object id, receptacle type, (x, z, rotation, horizon) in metres/degrees)
    placed_receptacles: tuple[tuple[str, str, tuple[float, float, int, int]], ...]
    grid: tuple[tuple[float, float], ...]

    @property
    def receptacle_types(self) -> frozenset[str]:
        """Receptacle types of the scene, basins named as the domain names them."""
        static = _static_receptacle_types()
        named = {_BASINS.get(t, t) for t in self.object_types}
        return frozenset(t for t in named if t in static) | frozenset(r[1] for r in self.placed_receptacles)


@lru_cache(maxsize=None)
def load_scene(floor_plan: int) -> Scene:
    """Read the three layout files of ``FloorPlan<floor_plan>`` (cached)."""
    import numpy as np

    folder = _layouts_dir()
    object_types = json.loads((folder / f"FloorPlan{floor_plan}-objects.json").read_text())
    placed = json.loads((folder / f"FloorPlan{floor_plan}-openable.json").read_text())
    grid = np.load(folder / f"FloorPlan{floor_plan}-layout.npy")
    static = _static_receptacle_types()
    receptacles = []
    for object_id, (x, z, rotation, horizon) in sorted(placed.items()):
        kind = object_id.split("|", 1)[0]
        if kind in _BASINS:  # the basin, not the fixture, is the receptacle (ALFRED's ids)
            object_id, kind = f"{object_id}|{_BASINS[kind]}", _BASINS[kind]
        if kind in static:
            receptacles.append((object_id, kind, (float(x), float(z), int(rotation), int(horizon))))
    return Scene(
        floor_plan=floor_plan,
        object_types=frozenset(object_types),
        placed_receptacles=tuple(receptacles),
        grid=tuple((float(x), float(z)) for x, z in grid),
    )


# --- goals ------------------------------------------------------------------------


def _object_candidates(task_type: str, scene: Scene) -> list[str]:
    c = _constants()
    objects = sorted(scene.object_types & _containable_types())
    needed = _REQUIRED_PROPERTY.get(task_type)
    if needed:
        objects = [o for o in objects if o in c.VAL_ACTION_OBJECTS[needed]]
    return objects


def _holders(object_type: str, receptacle_types) -> list[str]:
    c = _constants()
    return sorted(r for r in receptacle_types if object_type in c.VAL_RECEPTACLE_OBJECTS.get(r, ()))


def _lamp_types(scene: Scene) -> list[str]:
    hosts = scene.receptacle_types & set(_LAMP_HOSTS)
    return [lamp for lamp in _LAMPS if lamp in scene.object_types] if hosts else []


def goal_candidates(task_type: str, scene: Scene) -> list[Goal]:
    """Every goal of ``task_type`` the scene supports, in a fixed order."""
    if room_type(scene.floor_plan) not in _constants().GOALS_VALID[task_type]:
        return []
    receptacles = scene.receptacle_types
    appliances = _APPLIANCE.get(task_type, ())
    if appliances and not any(a in receptacles for a in appliances if a != "BathtubBasin"):
        return []  # the domain cleans only in a SinkBasin
    goals = []
    for object_type in _object_candidates(task_type, scene):
        holders = _holders(object_type, receptacles)
        if task_type == "look_at_obj_in_light":
            if holders:
                goals += [Goal(task_type, object_type, toggle_type=lamp) for lamp in _lamp_types(scene)]
            continue
        for target in holders:
            # The objects must start somewhere other than the target (and the appliance).
            others = [h for h in holders if h != target and h not in appliances]
            if target not in appliances and others:
                goals.append(Goal(task_type, object_type, receptacle_type=target))
    return goals


def task_sentence(goal: Goal, rng: random.Random) -> str:
    """The task sentence, from alfworld's goal-library templates (as ``alfworld-generate`` picks one)."""
    template = rng.choice(_goal_library()[goal.task_type]["templates"])
    return template.format(
        obj=goal.object_type.lower(),
        recep=(goal.receptacle_type or "").lower(),
        toggle=(goal.toggle_type or "").lower(),
        mrecep="",
    )


def goal_pddl(goal: Goal) -> str:
    """The goal section, from alfworld's goal library, in PDDL syntax."""
    text = _goal_library()[goal.task_type]["pddl"].format(
        obj=goal.object_type,
        recep=goal.receptacle_type or "",
        toggle=goal.toggle_type or "",
        mrecep="",
    )
    return text.replace("#", "-")


# --- the problem ------------------------------------------------------------------


def mangle(name: str) -> str:
    """ALFRED's escaping of THOR ids into PDDL names (``PlannedGameState.fix_pddl_str_chars``)."""
    for old, new in (("-", "_minus_"), ("|", "_bar_"), ("+", "_plus_"), (".", "_dot_"), (",", "_comma_")):
        name = name.replace(old, new)
    return name


def _location(x: float, z: float, rotation: int, horizon: int) -> str:
    return mangle(f"loc|{round(x / _GRID)}|{round(z / _GRID)}|{(rotation // 90) % 4}|{horizon}")


def _thor_id(kind: str, x: float, y: float, z: float) -> str:
    return f"{kind}|{x:+06.2f}|{y:+06.2f}|{z:+06.2f}"


@dataclass
class _Placement:
    """The world being written: receptacles, objects and where everything is."""

    receptacles: dict[str, tuple[str, str]]  # id -> (type, location)
    objects: dict[str, tuple[str, str]]  # id -> (type, receptacle id)
    agent_location: str


def _random_point(scene: Scene, rng: random.Random) -> tuple[float, float, int, int]:
    x, z = rng.choice(scene.grid)
    return x, z, rng.choice((0, 90, 180, 270)), rng.choice((0, 30, 45, 60))


def _unique_id(kind: str, taken: set[str], rng: random.Random, near=(0.0, 0.0)) -> str:
    while True:
        object_id = _thor_id(kind, near[0] + rng.uniform(-0.6, 0.6), rng.uniform(0.0, 2.0),
                             near[1] + rng.uniform(-0.6, 0.6))
        if object_id not in taken:
            taken.add(object_id)
            return object_id


def _place_receptacles(scene: Scene, rng: random.Random, taken: set[str]) -> dict[str, tuple[str, str]]:
    receptacles = {}
    for object_id, kind, point in scene.placed_receptacles:
        receptacles[object_id] = (kind, _location(*point))
        taken.add(object_id)
    missing = sorted(scene.receptacle_types - {kind for kind, _ in receptacles.values()})
    for kind in missing:
        count = 4 if kind == "StoveBurner" else 1
        for _ in range(count):
            point = _random_point(scene, rng)
            object_id = _unique_id(kind, taken, rng, near=point[:2])
            if kind in _BASINS.values():
                fixture = next(k for k, v in _BASINS.items() if v == kind)
                object_id = f"{fixture}{object_id[len(kind):]}|{kind}"
            receptacles[object_id] = (kind, _location(*point))
    return receptacles


def _instances(object_type: str, goal: Goal, rng: random.Random) -> int:
    count = rng.choice((1, 1, 1, 2, 2, 3))
    if object_type == goal.object_type:
        count = max(count, 2 if goal.task_type == "pick_two_obj_and_place" else 1)
    return count


def _place_objects(scene: Scene, goal: Goal, receptacles, rng: random.Random, taken: set[str]):
    by_type: dict[str, list[str]] = {}
    for object_id, (kind, _) in sorted(receptacles.items()):
        by_type.setdefault(kind, []).append(object_id)
    objects = {}
    for object_type in sorted(scene.object_types & _containable_types()):
        holders = _holders(object_type, by_type)
        if object_type == goal.object_type:
            # The goal must not hold at the start, and the appliance must be a step of the plan.
            excluded = {goal.receptacle_type, *_APPLIANCE.get(goal.task_type, ())}
            holders = [h for h in holders if h not in excluded]
        if not holders:
            continue
        for _ in range(_instances(object_type, goal, rng)):
            host = rng.choice(by_type[rng.choice(holders)])
            objects[_unique_id(object_type, taken, rng)] = (object_type, host)
    if goal.toggle_type:
        hosts = [r for r in _LAMP_HOSTS if r in by_type]
        host = rng.choice(by_type[rng.choice(hosts)])
        objects[_unique_id(goal.toggle_type, taken, rng)] = (goal.toggle_type, host)
    return objects


def _agent_start(scene: Scene, receptacles, rng: random.Random) -> str:
    occupied = {location for _, location in receptacles.values()}
    while True:
        location = _location(*_random_point(scene, rng))
        if location not in occupied:  # the first look must be "in the middle of a room"
            return location


def _write_problem(name: str, world: _Placement, goal: Goal) -> str:
    c = _constants()
    lines = [f"(define (problem {name})", "(:domain alfred)", "(:objects", "agent1 - agent"]
    object_types = (set(c.OBJECTS) | set(_LAMPS)) - _static_receptacle_types()
    lines += [f"        {t}Type - otype" for t in sorted(object_types)]
    lines += [f"        {t}Type - rtype" for t in sorted(_static_receptacle_types())]
    lines += [f"        {mangle(o)} - object" for o in sorted(world.objects)]
    lines += [f"        {mangle(r)} - receptacle" for r in sorted(world.receptacles)]
    locations = sorted({loc for _, loc in world.receptacles.values()} | {world.agent_location})
    lines += [f"        {loc} - location" for loc in locations]
    lines += ["        )", "(:init"]
    facts = _init_facts(world)
    lines += [f"        {fact}" for fact in facts]
    lines += ["        )", goal_pddl(goal).strip()]
    return "\n".join(lines) + "\n"


def _init_facts(world: _Placement) -> list[str]:
    c = _constants()
    facts = [f"(atLocation agent1 {world.agent_location})"]
    receptacle_types = {}
    for object_id, (kind, location) in sorted(world.receptacles.items()):
        name = mangle(object_id)
        receptacle_types[kind] = True
        facts.append(f"(receptacleType {name} {kind}Type)")
        facts.append(f"(receptacleAtLocation {name} {location})")
        if kind in c.OPENABLE_CLASS_SET:
            facts.append(f"(openable {name})")
    object_types = set()
    for object_id, (kind, host) in sorted(world.objects.items()):
        name, host_name = mangle(object_id), mangle(host)
        object_types.add(kind)
        facts.append(f"(objectType {name} {kind}Type)")
        facts.append(f"(inReceptacle {name} {host_name})")
        facts.append(f"(objectAtLocation {name} {world.receptacles[host][1]})")
        if kind in _LAMPS:
            facts.append(f"(toggleable {name})")
            continue
        facts.append(f"(pickupable {name})")
        if kind in c.MOVABLE_RECEPTACLES_SET:
            facts.append(f"(isReceptacleObject {name})")
        for prop, predicate in (("Cleanable", "cleanable"), ("Heatable", "heatable"),
                                ("Coolable", "coolable"), ("Sliceable", "sliceable")):
            if kind in c.VAL_ACTION_OBJECTS[prop]:
                facts.append(f"({predicate} {name})")
    for receptacle_type in sorted(receptacle_types):
        for object_type in sorted(object_types & set(c.VAL_RECEPTACLE_OBJECTS.get(receptacle_type, ()))):
            facts.append(f"(canContain {receptacle_type}Type {object_type}Type)")
    return facts


# --- tasks ------------------------------------------------------------------------


@dataclass(frozen=True)
class GameSpec:
    """Everything that determines one generated game."""

    task_type: str
    floor_plan: int
    variant: int

    @property
    def seed(self) -> int:
        key = f"{GENERATOR_VERSION}|{self.task_type}|{self.floor_plan}|{self.variant}"
        return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")

    @property
    def name(self) -> str:
        return f"{self.task_type}-FloorPlan{self.floor_plan}-{self.variant}"


def generate_game(spec: GameSpec) -> dict:
    """The ``tw-pddl`` game of ``spec``: the same JSON keys ``alfworld-generate`` writes."""
    rng = random.Random(spec.seed)
    scene = load_scene(spec.floor_plan)
    goals = goal_candidates(spec.task_type, scene)
    if not goals:
        raise ValueError(f"FloorPlan{spec.floor_plan} supports no {spec.task_type} task")
    goal = rng.choice(goals)
    taken: set[str] = set()
    receptacles = _place_receptacles(scene, rng, taken)
    objects = _place_objects(scene, goal, receptacles, rng, taken)
    world = _Placement(receptacles, objects, _agent_start(scene, receptacles, rng))
    logic = game_logic()
    return {
        "pddl_domain": logic["pddl_domain"],
        "grammar": logic["grammar"].replace("UNKNOWN GOAL", task_sentence(goal, rng)),
        "pddl_problem": _write_problem(f"plan_{mangle(spec.name)}", world, goal),
        "solvable": True,
        "walkthrough": None,
    }


@lru_cache(maxsize=None)
def supporting_scenes(task_type: str, split: str) -> tuple[int, ...]:
    """The floor plans of ``split`` where a ``task_type`` goal exists."""
    return tuple(n for n in scene_numbers(split) if goal_candidates(task_type, load_scene(n)))


def game_spec(task_type: str, split: str, index: int) -> GameSpec:
    """The ``index``-th game of ``task_type`` in ``split``: floor plans in turn, then new variants."""
    scenes = supporting_scenes(task_type, split)
    return GameSpec(task_type, scenes[index % len(scenes)], index // len(scenes))


def default_cache_dir() -> Path:
    import alfworld.info

    return environment_cache("alfworld", CACHE_ENV_VAR) / f"gen{GENERATOR_VERSION}-alfworld{alfworld.info.__version__}"


def game_file(spec: GameSpec, cache_dir: Path | None = None) -> Path:
    """Path of ``spec``'s game file, written on first use (atomically, so parallel writers agree)."""
    folder = Path(cache_dir) if cache_dir else default_cache_dir()
    path = folder / spec.task_type / f"{spec.name}.tw-pddl"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(generate_game(spec)))
        os.replace(temporary, path)
    return path
