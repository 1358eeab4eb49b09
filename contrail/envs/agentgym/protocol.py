"""AgentGym's HTTP wire format, one `Dialect` per ``agentenv-*`` server.

AgentGym (github WooooDyy/AgentGym) serves every environment over HTTP with the
same five routes -- ``POST /create``, ``POST /reset``, ``POST /step``,
``GET /observation``, ``POST /close`` -- but its servers grew apart in the
details, so a client must know which one it talks to:

- babyai: session ``id``; ``/create`` (no body) answers ``{"id": n}``; ``/reset``
  takes ``data_idx``; ``/step`` answers ``observation``, ``reward``, ``score``
  (the reward AgentGym's client reads) and ``done``.
- textcraft: as babyai, but ``/create`` takes ``{"commands", "goal"}`` and
  resets at once (its answer carries an ``observation``); no ``score``.
- alfworld: as babyai, but ``/reset`` takes ``game`` and ``world_type``.
- webshop: session ``env_idx``; ``/create`` answers a bare integer; ``/reset``
  takes ``session_id`` and answers ``[page, null]`` (the client re-reads the
  page with ``GET /observation``); ``/step`` answers ``state``, ``reward``,
  ``done``, ``info``; the server has no ``/close``.
- searchqa: session ``env_idx``; ``/create`` takes ``{"id": 0}`` and answers a
  bare integer; ``/reset`` takes ``id`` and answers the question text.
- generic: babyai's shape without ``score``, for any other environment; the
  model's whole text travels as the action (the environment parses it).

Actions: AgentGym's clients extract the action from the model's text before
``/step`` (babyai and textcraft also strip it to letters, digits, commas and
spaces; searchqa sends the whole text). `AgentGymEnv` does the same per
dialect, and `EnvServer` hands a contrail environment (which parses full model
text) ``"Action: <action>"`` for the dialects whose clients extract.

Errors follow the servers too: a wrapper's failure is HTTP 200 with
``{"error": "<message>"}``; FastAPI's own are 422 ``{"detail": [{"loc", "msg",
"type"}]}`` (a malformed body) and 404 ``{"detail": "Not Found"}``. Session ids
are JSON integers. Both the client (`AgentGymEnv`) and the server
(`serve_env`) read this table, so they cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from contrail.envs.base import UnknownNameError


class RemoteEnvError(RuntimeError):
    """The environment server answered with an error, or could not be reached in time."""


@dataclass(frozen=True)
class Dialect:
    """How one AgentGym server spells the five routes (see the module table)."""

    name: str
    session_key: str = "id"               # the session id's field in bodies and query strings
    create_body: dict[str, Any] | None = None   # JSON sent to /create (None: no body)
    create_answers_dict: bool = True      # {"id": n, ...} (else a bare integer)
    task_key: str = "data_idx"            # the task id's field in /reset
    reset_extra: dict[str, Any] = field(default_factory=dict)  # fixed extra /reset fields
    reset_answer: str = "dict"            # "dict" {"observation": ...}, "pair" [page, null], "text"
    text_key: str = "observation"         # the observation's field in /step answers
    reward_key: str = "reward"            # the field the client reads as the reward
    action: str = "action_line"           # the client sends: "action_line", "sanitized" (babyai) or "raw" text
    has_close: bool = True                # webshop's server has no /close route
    success_positive: bool = False        # success: done with reward > 0 (babyai's scaled reward), else reward >= 1

    def create_payload(self, session: int, observation: str | None) -> Any:
        """What a server answers to /create (AgentGym's shape for this dialect)."""
        if not self.create_answers_dict:
            return session
        payload: dict[str, Any] = {"id": session}
        if observation is not None and self.name == "textcraft":  # textcraft resets inside /create
            payload.update(observation=observation, done=False, reward=0)
        return payload

    def reset_payload(self, observation: str) -> Any:
        """What a server answers to /reset."""
        if self.reset_answer == "pair":
            return [observation, None]
        if self.reset_answer == "text":
            return observation
        payload: dict[str, Any] = {"observation": observation, "reward": 0.0, "done": False}
        if self.reward_key != "reward":
            payload[self.reward_key] = 0.0
        return payload

    def step_payload(self, observation: str, reward: float, done: bool, info: dict[str, Any]) -> dict[str, Any]:
        """What a server answers to /step."""
        payload: dict[str, Any] = {self.text_key: observation, "reward": reward, "done": done}
        if self.reward_key != "reward":
            payload[self.reward_key] = reward
        if self.session_key == "env_idx":  # the env_idx servers' StepResponse has an ``info`` field
            payload["info"] = None
        return payload


DIALECTS: dict[str, Dialect] = {
    "generic": Dialect("generic", action="raw"),
    "babyai": Dialect("babyai", reward_key="score", action="sanitized", success_positive=True),
    "textcraft": Dialect("textcraft", create_body={"commands": None, "goal": None}, action="sanitized"),
    "alfworld": Dialect("alfworld", task_key="game", reset_extra={"world_type": "Text"}),
    "webshop": Dialect(
        "webshop", session_key="env_idx", create_answers_dict=False, task_key="session_id",
        reset_answer="pair", text_key="state", has_close=False,
    ),
    "searchqa": Dialect(
        "searchqa", session_key="env_idx", create_body={"id": 0}, create_answers_dict=False,
        task_key="id", reset_answer="text", action="raw",
    ),
}


def dialect(name: str) -> Dialect:
    """The dialect called ``name``; an unknown name lists the valid ones."""
    try:
        return DIALECTS[name]
    except KeyError:
        raise UnknownNameError(f"unknown AgentGym dialect {name!r}; valid: {', '.join(DIALECTS)}") from None


def session_of(payload: Any, spoken: Dialect) -> int:
    """The session id in a /create answer."""
    value = payload.get("id") if isinstance(payload, dict) else payload
    if isinstance(payload, dict) and "error" in payload:
        raise RemoteEnvError(f"/create failed: {payload['error']}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise RemoteEnvError(f"/create answered {payload!r}, expected a {spoken.name} session id")
    return value


def check_answer(route: str, payload: Any) -> Any:
    """Raise `RemoteEnvError` for AgentGym's in-band error shape ``{"error": ...}``."""
    if isinstance(payload, dict) and "error" in payload:
        raise RemoteEnvError(f"{route} failed on the server: {payload['error']}")
    return payload
