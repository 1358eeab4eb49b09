"""The expert's planner: minigrid's `BabyAIBot`, adapted, and its whole-episode plan.

The expert is privileged: the bot is told the map up to the locked doors
(`ExpertBot`), and `Reference.plan` plays its plan on a copy of the level,
recording where the plan passes (`Pose`, `mission_progress`) so that the
expert (`contrail.envs.babyai.expert`) can tell how far along it a macro lands.
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass, field

from minigrid.envs.babyai.core.verifier import (
    AfterInstr,
    AndInstr,
    BeforeInstr,
    OpenInstr,
    PutNextInstr,
)
from minigrid.utils.baby_ai_bot import BabyAIBot, DropSubgoal, GoNextToSubgoal, Subgoal

from contrail.envs.babyai.actions import (
    DIRECTIONS,
    DONE,
    DROP,
    FORWARD,
    LEFT,
    PICKUP,
    RIGHT,
    TOGGLE,
)

_MAX_REPLANS = 200  # subgoal rewrites per step before the bot is declared stuck


class _BotStuck(RuntimeError):
    """The bot keeps rewriting its plan without suggesting an action."""


class _OpenBoxSubgoal(Subgoal):
    """Toggle the box in front, which replaces it with what it holds."""

    def replan_before_action(self):
        return self.actions.toggle

    def replan_after_action(self, action_taken):
        if action_taken is None or action_taken == self.actions.toggle:
            self.bot.stack.pop()


class ExpertBot(BabyAIBot):
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
            if isinstance(instr, AfterInstr):
                first, second = instr.instr_b, instr.instr_a
            else:
                first, second = instr.instr_a, instr.instr_b
            done = {id(instr.instr_a): instr.a_done == "success", id(instr.instr_b): instr.b_done == "success"}
            for part in (second, first):  # the stack runs its top (the first part) first
                if not done[id(part)]:
                    self._process_instr(part)
            return
        carried = self.mission.unwrapped.carrying
        if (isinstance(instr, PutNextInstr) and carried is not None
                and any(carried is obj for obj in instr.desc_move.obj_set)):
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
            key_in_hand = (level.carrying is not None and level.carrying.type == "key"
                           and level.carrying.color == door.color)
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
            for next_di, next_dj in ((di, dj), (dj, di), (-dj, -di), (-di, -dj)):
                queue.append(((i + next_di, j + next_dj, next_di, next_dj), (i, j)))
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
class Pose:
    """Where the agent is, and the interactions (pickup/drop/toggle) it has made.

    Two runs from one state that end in the same pose after the same
    interactions at the same places leave the grid in the same state.
    """

    pos: tuple[int, int]
    direction: int
    interactions: tuple[tuple[int, tuple[int, int], int], ...] = ()

    def after(self, action: int) -> Pose:
        if action == LEFT:
            return Pose(self.pos, (self.direction - 1) % 4, self.interactions)
        if action == RIGHT:
            return Pose(self.pos, (self.direction + 1) % 4, self.interactions)
        if action == FORWARD:
            dx, dy = DIRECTIONS[self.direction]
            return Pose((self.pos[0] + dx, self.pos[1] + dy), self.direction, self.interactions)
        if action in (PICKUP, DROP, TOGGLE):
            return Pose(self.pos, self.direction, (*self.interactions, (action, self.pos, self.direction)))
        return self

    def place(self) -> tuple:
        """The pose without its direction."""
        return self.pos, self.interactions

    def moved_to(self, level) -> Pose:
        """This pose with the agent's actual position (a blocked move stays put)."""
        return Pose((int(level.agent_pos[0]), int(level.agent_pos[1])), int(level.agent_dir), self.interactions)


def pose_of(level) -> Pose:
    return Pose((int(level.agent_pos[0]), int(level.agent_pos[1])), int(level.agent_dir))


@dataclass
class Reference:
    """The bot's whole plan from one state, played on a copy of the level.

    ``reach`` maps (pose, mission progress) at each step of the plan to the
    last step index at which the plan is there (index 0: the start);
    ``reach_any_direction`` does the same ignoring the direction.
    """

    actions: list[int] = field(default_factory=list)
    reach: dict[tuple, int] = field(default_factory=dict)
    reach_any_direction: dict[tuple, int] = field(default_factory=dict)

    def record(self, pose: Pose, progress: tuple) -> None:
        self.reach[(pose, progress)] = len(self.actions)
        self.reach_any_direction[(pose.place(), progress)] = len(self.actions)

    @classmethod
    def plan(cls, level) -> Reference:
        shadow = copy.deepcopy(level)
        pose = pose_of(shadow)
        reference = cls()
        reference.record(pose, mission_progress(shadow))
        try:
            bot = ExpertBot(shadow)
            action = bot.replan()
            while action != DONE and shadow.step_count < shadow.max_steps:
                _, _, terminated, truncated, _ = shadow.step(action)
                pose = pose.after(action).moved_to(shadow)
                reference.actions.append(action)
                reference.record(pose, mission_progress(shadow))
                if terminated or truncated:
                    break
                action = bot.replan()
        except Exception:  # noqa: BLE001, S110 - the bot asserts or loops on a few layouts; keep the plan so far
            pass
        return reference
