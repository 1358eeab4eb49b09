"""The ALFWorld engine: textworld's PDDL environment behind alfworld's wrappers, pooled.

This is the path ``AlfredTWEnv`` plays a ``game.tw-pddl`` file through
(``textworld.envs.PddlEnv`` -> ``AlfredDemangler`` -> ``AlfredInfos``), minus
the gym batching, with two costs removed:

- Translating a PDDL problem with fast-downward takes about a second and
  textworld does it twice on ``load`` and twice more on every ``reset``. The
  translation depends only on the game file, so it is done once per game and
  kept in a small LRU cache (a GRPO group replays the same game many times).
- textworld interns every ``Proposition`` and ``Signature`` it builds in a
  process-wide dict (``mementos``) that is never emptied: a few thousand per
  game, so memory grows with every new game played. Both classes compare by
  value, so the dict is cleared whenever it grows past a bound.
- Every ``PddlEnv`` loads a private copy of fast-downward's 33 MB shared
  library (the library keeps one global search state) and a loaded library is
  never unloaded. Engines therefore live in a process-wide pool: an episode
  borrows one and gives it back when it ends, so the number of libraries is
  the number of episodes alive at once, not the number ever played.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter, OrderedDict, defaultdict
from dataclasses import dataclass
from typing import Any

import fast_downward
import textworld
from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
from textworld.core import GameState
from textworld.envs import PddlEnv
from textworld.envs.pddl import logic as pddl_logic
from textworld.logic import Proposition, Variable

_CACHED_GAMES = 32
_INTERNED_LIMIT = 50_000  # about 20 games' propositions


@dataclass
class _Translation:
    """fast-downward's view of one game: parsed task, search encoding, replanning encoding."""

    task: Any
    sas: bytes
    sas_replan: bytes
    logic: pddl_logic.GameLogic


class _TranslationCache:
    """Least-recently-used translations, keyed by the game's domain, grammar and problem."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, _Translation] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, game: dict) -> _Translation:
        key = hashlib.sha256(
            "\0".join((game["pddl_domain"], game["grammar"], game["pddl_problem"])).encode()
        ).hexdigest()
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        translation = _translate(game)
        with self._lock:
            self._items[key] = translation
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)
        return translation


def _bound_interned_propositions() -> None:
    """Empty textworld's intern table of propositions once it is large (they compare by value)."""
    import mementos.core

    if len(mementos.core._memento_cache) > _INTERNED_LIMIT:
        mementos.core._memento_cache.clear()


def _translate(game: dict) -> _Translation:
    domain, problem = game["pddl_domain"], game["pddl_problem"]
    task, sas = fast_downward.pddl2sas(domain, problem)
    _, sas_replan = fast_downward.pddl2sas(domain, problem, optimize=True)
    logic = pddl_logic.GameLogic(domain=domain, grammar=game["grammar"])
    return _Translation(task, sas.encode("utf-8"), sas_replan.encode("utf-8"), logic)


_TRANSLATIONS = _TranslationCache(_CACHED_GAMES)


class _TranslatedState(pddl_logic.PddlState):
    """A ``PddlState`` started from a cached translation instead of translating again.

    It ends in the same place as ``PddlState.__init__``: the library holds the
    initial search state and the state's facts are the problem's init facts
    plus the library's state atoms.
    """

    def __init__(self, downward_lib, translation: _Translation) -> None:  # noqa: D107 - see class
        # The fields textworld.logic.State keeps (its constructor insists on its own logic class).
        self._logic = translation.logic
        self._facts = defaultdict(set)
        self._vars_by_name = {}
        self._vars_by_type = defaultdict(set)
        self._var_counts = Counter()
        self.downward_lib = downward_lib
        self.task, self.sas = translation.task, translation.sas
        self.pddl_problem = None
        self._actions = {action.name: action for action in self.task.actions}
        for kind in self.task.types:
            try:
                self._logic.types.add(textworld.logic.Type(kind.name, kind.supertype_names))
            except ValueError:  # already known from an earlier game
                pass
        downward_lib.load_sas(translation.sas)
        downward_lib.load_sas_replan(translation.sas_replan)
        self.name2type = {o.name: o.type_name for o in self.task.objects}
        self.add_facts(self._initial_facts())
        self.add_facts(self._library_facts())

    def _initial_facts(self) -> list[Proposition]:
        facts = []
        for atom in self.task.init:
            if isinstance(atom, fast_downward.translate.pddl.conditions.Atom):
                if atom.predicate != "=":
                    facts.append(self._proposition(atom.predicate, atom.args))
            elif isinstance(atom, fast_downward.translate.pddl.f_expression.Assign):
                name = str(atom.expression.value)
                # Costs and distances are numbers, not facts.
                if atom.fluent.symbol != "total-cost" and not name.isdigit():
                    facts.append(self._proposition(name, atom.fluent.args))
        return facts

    def _proposition(self, name: str, args) -> Proposition:
        return Proposition(name, [Variable(arg, self.name2type[arg]) for arg in args])

    def _library_facts(self) -> list[Proposition]:
        atoms = (pddl_logic.Atom * self.downward_lib.get_state_size())()
        self.downward_lib.get_state(atoms)
        facts = [atom.get_fact(self.name2type) for atom in atoms]
        return [fact for fact in facts if not fact.is_negation]


class _TranslatedPddlEnv(PddlEnv):
    """``PddlEnv`` whose ``load`` and ``reset`` start from the cached translation."""

    def load(self, filename_or_data) -> None:
        if isinstance(filename_or_data, dict):
            data, self._game_file = filename_or_data, None
        else:
            with open(filename_or_data) as handle:
                data = json.load(handle)
            self._game_file = filename_or_data
        _bound_interned_propositions()
        self._game_data = data
        self.walkthrough = data.get("walkthrough")
        self._translation = _TRANSLATIONS.get(data)
        self._logic = self._translation.logic
        self._pddl_state = _TranslatedState(self.downward_lib, self._translation)
        self._entity_infos = self._get_entity_infos()

    @property
    def game(self) -> dict:
        """The loaded game's data (domain, grammar, problem, ...)."""
        return self._game_data

    def reset(self) -> GameState:
        self._pddl_state = _TranslatedState(self.downward_lib, self._translation)
        self.prev_state = None
        self._last_action = None
        self._moves = 0
        self.state = GameState()
        context = {
            "state": self._pddl_state,
            "facts": list(self._pddl_state.facts),
            "variables": {},
            "mapping": {},
            "entity_infos": self._entity_infos,
        }
        self.state.feedback = self._logic.grammar.derive("#intro#", context)
        self.state.raw = self.state.feedback
        self._gather_infos()
        return self.state


def _new_engine() -> textworld.core.Environment:
    infos = textworld.EnvInfos(won=True, admissible_commands=True, facts=True, extras=["gamefile"])
    return AlfredInfos(AlfredDemangler(shuffle=False)(_TranslatedPddlEnv(infos)))


class EnginePool:
    """Engines lent to live episodes; an engine returned is reused by the next episode."""

    def __init__(self) -> None:
        self._idle: list[textworld.core.Environment] = []
        self._lock = threading.Lock()
        self.created = 0

    def acquire(self) -> textworld.core.Environment:
        with self._lock:
            if self._idle:
                return self._idle.pop()
            self.created += 1
        return _new_engine()

    def release(self, engine: textworld.core.Environment) -> None:
        with self._lock:
            if all(engine is not idle for idle in self._idle):
                self._idle.append(engine)


ENGINES = EnginePool()
