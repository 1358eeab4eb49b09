"""`AgentGymEnv`: an AgentGym environment server driven as a contrail `Env`.

The spec ``agentgym:webshop@http://127.0.0.1:36001`` names the environment the
server runs (which selects its `Dialect`) and the server's base URL. Each
instance holds one server session (``/create`` at the first ``reset``, not in
the constructor, so listing tasks or building a stream never touches the
network) and closes it in ``close``.

Failures stay per episode: every request has a timeout; a request the server
cannot have processed (connection refused, HTTP 503) is retried a bounded
number of times with backoff; a ``/step`` whose answer was lost is never
retried (the server may have applied it, and applying an action twice would
corrupt the episode). Anything else raises `RemoteEnvError`, which the rollout
records as that episode's error while the other episodes go on.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, ClassVar

from contrail.envs.agentgym.protocol import DIALECTS, Dialect, RemoteEnvError, check_answer, session_of
from contrail.envs.base import Env, EnvOptionError, Step, Task
from contrail.envs.parsing import action_lines

FAMILY = "agentgym"
DIFFICULTY = "default"  # an AgentGym server has no difficulty levels: one label for all its tasks
TWO_ACTIONS = "Error: Only one 'Action' is allowed per response. Please adjust your response."
INVALID = "Invalid Action.\n\n"
_UNSAFE = re.compile(r"[^A-Za-z0-9, ]+")  # what AgentGym's babyai/textcraft clients strip from an action


class AgentGymEnv(Env):
    """A remote AgentGym environment (subclassed per spec by `remote_class`).

    Options: ``timeout`` (seconds per request), ``retries`` (extra attempts for
    a request the server did not process), ``train_ids``/``test_ids`` (the
    server's task ids of each split; default 0-999 and 1000-1099: AgentGym's
    servers take any integer, so say which ones your data splits use).
    """

    difficulties: ClassVar[tuple[str, ...]] = (DIFFICULTY,)
    concurrent_steps: ClassVar[bool] = True  # the rollout steps these envs in threads (network-bound)
    server: ClassVar[str] = ""
    remote_name: ClassVar[str] = ""
    dialect: ClassVar[Dialect] = DIALECTS["generic"]

    def __init__(
        self,
        max_turns: int | None = None,
        timeout: float = 60.0,
        retries: int = 3,
        train_ids: list[int] | None = None,
        test_ids: list[int] | None = None,
    ) -> None:
        super().__init__(max_turns)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise EnvOptionError(f"option timeout of {self._label()}: expected seconds > 0, got {timeout!r}")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise EnvOptionError(f"option retries of {self._label()}: expected an int >= 0, got {retries!r}")
        self.timeout, self.retries = float(timeout), retries
        self.ids = {
            "train": list(range(0, 1000)) if train_ids is None else list(train_ids),
            "test": list(range(1000, 1100)) if test_ids is None else list(test_ids),
        }
        if set(self.ids["train"]) & set(self.ids["test"]):
            raise EnvOptionError(f"options train_ids and test_ids of {self._label()} overlap")
        self.session: int | None = None
        self.last_observation = ""

    # --- the conversation: the local twin's wording when contrail has one ------------------
    def instruction(self) -> str:
        twin = _twin(self.remote_name)
        if twin is not None:
            return twin.instruction()
        return (
            "You are an agent in a text environment. Every round I will give you an observation; "
            "respond with your thought and one action in the format:\n"
            "Thought:\n<your thought>\n\nAction:\n<your action>"
        )

    @property
    def acknowledgement(self) -> str:  # type: ignore[override]
        twin = _twin(self.remote_name)
        return twin.acknowledgement if twin is not None else Env.acknowledgement

    def tasks(self, split: str, difficulty: str | None = None) -> list[Task]:
        self.check_split(split, difficulty)
        return [Task(self.name, task_id, split, DIFFICULTY) for task_id in self.ids[split]]

    def expert(self) -> str:
        raise NotImplementedError(f"{self._label()}: an AgentGym server has no expert to ask")

    # --- the episode ------------------------------------------------------------------------
    def on_reset(self, task: Task) -> str:
        spoken = self.dialect
        if self.session is None:
            answer = self._request("POST", "/create", spoken.create_body, retry_lost=False)
            self.session = session_of(answer, spoken)
        body = {spoken.task_key: task.id, **spoken.reset_extra}
        answer = check_answer("/reset", self._post("/reset", body))
        if spoken.reset_answer == "pair":  # webshop: [page, null]; AgentGym's client re-reads the page
            observation = self._observation()
        elif spoken.reset_answer == "text":
            observation = answer
        else:
            observation = answer.get("observation") if isinstance(answer, dict) else None
        if not isinstance(observation, str):
            raise RemoteEnvError(f"/reset answered {answer!r}: no observation text")
        self.last_observation = observation
        return observation

    def on_step(self, text: str) -> Step:
        action, problem = self._action(text)
        if problem is not None:  # decided here, as AgentGym's clients do: the server never sees it
            return Step(observation=problem, valid=False)
        # The server does not say whether an action was valid; an empty one (nothing to extract) is not.
        valid = bool(action.strip())
        answer = check_answer("/step", self._post("/step", {"action": action}, retry_lost=False))
        if not isinstance(answer, dict):
            raise RemoteEnvError(f"/step answered {answer!r}, expected an object")
        text_key, reward_key = self.dialect.text_key, self.dialect.reward_key
        observation, reward, done = answer.get(text_key), answer.get(reward_key), answer.get("done")
        if not isinstance(observation, str) or not _is_number(reward) or not isinstance(done, bool):
            raise RemoteEnvError(f"/step answered {answer!r}: expected {text_key}, {reward_key}, done")
        self.last_observation = observation
        reward = float(reward)
        success = bool(done) and (reward > 0 if self.dialect.success_positive else reward >= 1.0)
        return Step(observation=observation, reward=reward, done=done, success=success, valid=valid)

    def close(self) -> None:
        """Delete the server session (webshop's server has no ``/close``: its sessions are recycled)."""
        session, self.session = self.session, None
        if session is not None and self.dialect.has_close:
            self._request("POST", "/close", {self.dialect.session_key: session}, retry_lost=True)

    # --- parsing the model's text as AgentGym's clients do ------------------------------
    def _action(self, text: str) -> tuple[str, str | None]:
        mode = self.dialect.action
        if mode == "raw":
            return text, None
        lines = action_lines(text)
        if mode == "sanitized":
            if len(lines) > 1:
                return "", TWO_ACTIONS
            action = _UNSAFE.sub("", lines[-1] if lines else "")
            return " ".join(action.split()), None
        if not lines:
            return "", INVALID + self.last_observation
        return lines[-1].strip(), None

    # --- HTTP -----------------------------------------------------------------------------
    def _observation(self) -> str:
        query = urllib.parse.urlencode({self.dialect.session_key: self.session})
        answer = check_answer("/observation", self._request("GET", f"/observation?{query}", None, retry_lost=True))
        text = answer.get("observation") if isinstance(answer, dict) else answer
        if not isinstance(text, str):
            raise RemoteEnvError(f"/observation answered {answer!r}, expected text")
        return text

    def _post(self, route: str, body: dict[str, Any], retry_lost: bool = True) -> Any:
        return self._request("POST", route, {self.dialect.session_key: self.session, **body}, retry_lost=retry_lost)

    def _request(self, method: str, route: str, body: Any, *, retry_lost: bool) -> Any:
        """One JSON request with bounded retries.

        ``retry_lost``: also retry when the request may have reached the
        server (a timeout, a dropped connection) -- only for requests that are
        safe to repeat.
        """
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.server + route, data=data, method=method)
        if data is not None:
            request.add_header("Content-Type", "application/json")
        for attempt in range(self.retries + 1):
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return json.loads(response.read() or b"null")
            except urllib.error.HTTPError as error:
                if error.code != 503 or attempt == self.retries:  # 503: busy, the request was not processed
                    raise RemoteEnvError(f"{method} {route}: HTTP {error.code} {_detail(error)}") from None
            except (urllib.error.URLError, OSError, http.client.HTTPException) as error:
                reason = getattr(error, "reason", error)
                unsent = isinstance(reason, ConnectionRefusedError)
                if attempt == self.retries or not (unsent or retry_lost):
                    raise RemoteEnvError(f"{method} {self.server}{route}: {_describe(reason)}") from None
            except json.JSONDecodeError as error:
                raise RemoteEnvError(f"{method} {route}: the answer is not JSON ({error})") from None
            time.sleep(min(2.0, 0.1 * 2**attempt))
        raise AssertionError("unreachable")  # the loop returns or raises


def _detail(error: urllib.error.HTTPError) -> str:
    try:
        return error.read(2000).decode("utf-8", "replace")
    except OSError:
        return ""


def _describe(reason: Any) -> str:
    if isinstance(reason, (socket.timeout, TimeoutError)):
        return "timed out"
    return f"{type(reason).__name__}: {reason}"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_TWINS: dict[str, Env | None] = {}


def _twin(name: str) -> Env | None:
    """contrail's own environment of the same name (for its instruction), if there is one."""
    if name not in _TWINS:
        from contrail.envs import base

        _TWINS[name] = base.make(name) if name in base._BUILTIN_MODULES else None
    return _TWINS[name]


def parse_remote(spec: str) -> tuple[str, str]:
    """``"webshop@http://127.0.0.1:36001"`` -> ``("webshop", "http://127.0.0.1:36001")``."""
    name, at, url = spec.partition("@")
    parsed = urllib.parse.urlparse(url)
    if not at or not name or parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise EnvOptionError(
            f"environment {FAMILY}:{spec!r}: expected {FAMILY}:<env>@http://<host>:<port>, "
            f"e.g. {FAMILY}:webshop@http://127.0.0.1:36001"
        )
    return name, url.rstrip("/")


def remote_class(spec: str) -> type[AgentGymEnv]:
    """A subclass of `AgentGymEnv` bound to the server and dialect that ``spec`` names."""
    name, url = parse_remote(spec)
    attributes = {
        "server": url,
        "remote_name": name,
        "dialect": DIALECTS.get(name, DIALECTS["generic"]),
        "default_max_turns": _twin(name).default_max_turns if _twin(name) is not None else Env.default_max_turns,
        "__module__": __name__,
    }
    return type("AgentGym_" + re.sub(r"\W", "_", name), (AgentGymEnv,), attributes)
