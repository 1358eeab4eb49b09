"""AgentGym's menu rules on hand-built views: numbering, what is offered, the odd messages."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from contrail.envs.babyai.actions import DIRECTIONS, FORWARD, PICKUP, TOGGLE, action_menu
from contrail.envs.babyai.view import Thing, View, describe

AGENT = (3, 3)  # facing east (direction 0): front is +x, right is +y


def thing(kind: str, pos: tuple[int, int], color: str = "red", state: str = "") -> Thing:
    dx, dy = pos[0] - AGENT[0], pos[1] - AGENT[1]
    return Thing(kind, color, state, pos, front=dx, right=dy)


def view_of(*things: Thing) -> View:
    ordered = tuple(sorted(things, key=lambda t: t.distance))
    ahead = [t for t in ordered if t.kind in ("box", "wall") and t.right == 0]
    facing = (ahead[0].kind, ahead[0].front) if ahead else None
    return View(ordered, facing, range(10), range(10), np.zeros((7, 7, 3), dtype=np.uint8))


def level(carrying=None) -> SimpleNamespace:
    return SimpleNamespace(agent_pos=AGENT, agent_dir=0, carrying=carrying)


def end_of(primitives) -> tuple[tuple[int, int], int]:
    (x, y), d = AGENT, 0
    for primitive in primitives:
        if primitive == FORWARD:
            x, y = x + DIRECTIONS[d][0], y + DIRECTIONS[d][1]
        elif primitive in (0, 1):
            d = (d - 1) % 4 if primitive == 0 else (d + 1) % 4
    return (x, y), d


def walled(pos: tuple[int, int]) -> list[Thing]:
    x, y = pos
    return [thing("wall", cell, "grey") for cell in ((x + 1, y), (x - 1, y), (x, y + 1), (x, y - 1))]


def test_actions_number_a_name_among_its_reachable_objects_only():
    shut_in, open_ball = (4, 1), (6, 4)  # the walled-in ball is nearer: the description calls it "red ball 1"
    view = view_of(thing("ball", shut_in), thing("ball", open_ball), *walled(shut_in))
    assert "There is a red ball 1 1 steps in front of you and 2 steps to your left." in describe(view, None)
    assert "There is a red ball 2 3 steps in front of you and 1 steps to your right." in describe(view, None)
    menu = action_menu(level(), view)
    assert "go to red ball 2" not in menu.actions and "pickup red ball 2" not in menu.actions
    (x, y), d = end_of(menu.actions["go to red ball 1"])  # the reachable one, numbered 1
    assert (x + DIRECTIONS[d][0], y + DIRECTIONS[d][1]) == open_ball
    assert menu.actions["pickup red ball 1"] == (*menu.actions["go to red ball 1"], PICKUP)


def test_while_carrying_pickups_are_neither_offered_nor_explained():
    menu = action_menu(level(carrying=SimpleNamespace(type="key", color="red")), view_of(thing("ball", (5, 3))))
    assert not [action for action in list(menu.actions) + list(menu.errors) if action.startswith("pickup")]
    assert "drop" in menu.actions and "go to red ball 1" in menu.actions


def test_only_a_wall_or_box_right_ahead_withdraws_move_forward():
    assert "move forward" in action_menu(level(), view_of(thing("ball", (4, 3)))).actions
    assert "move forward" in action_menu(level(), view_of(thing("door", (4, 3), state="closed"))).actions
    blocked = action_menu(level(), view_of(thing("box", (4, 3))))
    assert "move forward" not in blocked.actions
    assert blocked.errors["move forward"] == "There is a barrier in front of you, you can't move forward."


def test_doors_toggle_when_faced_and_an_unreachable_one_gets_agentgyms_counter_message():
    faced = action_menu(level(), view_of(thing("door", (4, 3), "yellow", "closed")))
    assert faced.actions["toggle"] == (TOGGLE,)
    assert faced.actions["toggle and go through yellow closed door 1"] == (TOGGLE, FORWARD)
    door = (6, 1)
    shut = action_menu(level(), view_of(thing("door", door, "green", "closed"), *walled(door)))
    assert shut.errors["toggle and go through green closed door 1"] == (
        "You cannot toggle and go through green closed door {'green closed door': 1}, "
        "as there is no path leading to it."
    )
    locked = action_menu(level(), view_of(thing("door", (5, 3), "blue", "locked")))
    assert locked.errors["toggle and go through blue locked door 1"].endswith("as you are not carrying a key.")
    assert "go to blue locked door 1" in locked.actions
