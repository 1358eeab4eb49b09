"""`EnvServer`: any contrail environment served over AgentGym's HTTP protocol.

``contrail serve-env babyai --port 36005`` lets AgentGym's own clients (and
AgentGym-RL) play contrail's environments unchanged: the routes, field names,
integer session ids and error shapes are those of the `Dialect` the served
environment's AgentGym server speaks (babyai, textcraft, alfworld, webshop,
searchqa; any other environment speaks the common ``generic`` one).

Safety: it binds loopback unless told otherwise; bodies above ``max_body``
bytes are refused (413) before they are read; each connection's socket has a
timeout so a stalled client cannot hold a thread; sessions idle for
``idle_timeout`` seconds are reaped (closed and forgotten), and at most
``max_sessions`` live at once (then ``/create`` answers 503, which AgentGym's
clients and `AgentGymEnv` retry). Every request runs on its own thread; one
session's requests are serialised by its lock, different sessions run in
parallel.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
import traceback
import urllib.parse
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from contrail.envs import base
from contrail.envs.agentgym.protocol import DIALECTS, Dialect, dialect
from contrail.envs.base import Env, Task
from contrail.envs.parsing import action_lines

MAX_BODY = 1 << 20  # 1 MiB: a model's action is a few KiB at most


class HTTPProblem(Exception):
    """A request the protocol layer refuses (FastAPI's status and ``detail`` shape)."""

    def __init__(self, status: int, detail: Any) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


@dataclass
class _Session:
    env: Env
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_used: float = field(default_factory=time.monotonic)
    reward: float = 0.0
    observation: str = ""  # the last observation sent, for GET /observation


class EnvServer:
    """Serve environment ``env`` (a contrail name) with ``env_options`` over HTTP.

    ``port=0`` picks a free port (see `url`). Use `start` (a background
    thread) and `stop`, or `serve_forever`; or ``with EnvServer(...) as server``.
    """

    def __init__(
        self,
        env: str,
        *,
        env_options: dict[str, Any] | None = None,
        dialect_name: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        max_sessions: int = 1024,
        idle_timeout: float = 600.0,
        max_body: int = MAX_BODY,
        socket_timeout: float = 60.0,
    ) -> None:
        self.env_name = env
        self.options = base.check_options(env, env_options or {})
        self.dialect: Dialect = dialect(dialect_name) if dialect_name else DIALECTS.get(env, DIALECTS["generic"])
        self.max_sessions, self.idle_timeout, self.max_body = max_sessions, idle_timeout, max_body
        self._catalogue = base.make(env, **self.options)  # lists tasks only: never reset
        self._tasks: dict[str, dict[int, Task]] = {}
        self._sessions: dict[int, _Session] = {}
        self._next_id = 0
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        handler = type("Handler", (_Handler,), {"app": self, "timeout": socket_timeout})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "EnvServer":
        """Serve on a background thread (and reap idle sessions on another)."""
        for target in (self.httpd.serve_forever, self._reap_forever):
            thread = threading.Thread(target=target, daemon=True, name=f"contrail-serve-env-{target.__name__}")
            thread.start()
            self._threads.append(thread)
        return self

    def serve_forever(self) -> None:
        """Serve on this thread until interrupted (the CLI)."""
        reaper = threading.Thread(target=self._reap_forever, daemon=True)
        reaper.start()
        try:
            self.httpd.serve_forever()
        finally:
            self.stop()

    def stop(self) -> None:
        """Stop serving and close every session's environment."""
        self._stopped.set()
        if any(t.name.endswith("serve_forever") for t in self._threads):
            self.httpd.shutdown()
        self.httpd.server_close()
        with self._lock:
            sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            _close_quietly(session.env)

    def __enter__(self) -> "EnvServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def session_count(self) -> int:
        with self._lock:
            return len(self._sessions)

    def reap(self, now: float | None = None) -> int:
        """Close sessions idle longer than ``idle_timeout``; returns how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            stale = [
                key for key, s in self._sessions.items()
                if now - s.last_used > self.idle_timeout and not s.lock.locked()  # never one mid-request
            ]
            gone = [self._sessions.pop(key) for key in stale]
        for session in gone:
            _close_quietly(session.env)
        return len(gone)

    def _reap_forever(self) -> None:
        while not self._stopped.wait(max(0.05, min(30.0, self.idle_timeout / 4))):
            self.reap()

    # --- the routes ----------------------------------------------------------------------------
    def route(self, method: str, path: str, query: dict[str, str], body: Any) -> Any:
        """Answer one request (the JSON value), or raise `HTTPProblem`."""
        key, task_key = self.dialect.session_key, self.dialect.task_key
        routes: dict[tuple[str, str], Callable[[], Any]] = {
            ("GET", "/"): lambda: f"This is environment {self.env_name} (contrail).",
            ("POST", "/create"): self._create,
            ("POST", "/reset"): lambda: self._reset(_field(body, key), _field(body, task_key)),
            ("POST", "/step"): lambda: self._step(_field(body, key), _field(body, "action", str)),
            ("GET", "/observation"): lambda: self._observe(_query_int(query, key)),
            ("POST", "/close"): lambda: self._close(_field(body, key)),
            ("GET", "/list_envs"): lambda: sorted(self._sessions),
        }
        if (method, path) not in routes:
            if any(p == path for _, p in routes):
                raise HTTPProblem(HTTPStatus.METHOD_NOT_ALLOWED, "Method Not Allowed")
            raise HTTPProblem(HTTPStatus.NOT_FOUND, "Not Found")
        return routes[method, path]()

    def _create(self) -> Any:
        with self._lock:
            if len(self._sessions) >= self.max_sessions:
                raise HTTPProblem(HTTPStatus.SERVICE_UNAVAILABLE, f"at most {self.max_sessions} sessions; close some")
            key, self._next_id = self._next_id, self._next_id + 1
        observation = None
        try:
            session = _Session(env=base.make(self.env_name, **self.options))
            if self.dialect.name == "textcraft":  # AgentGym's textcraft server resets inside /create (task = its id)
                observation = session.observation = session.env.reset(self._task(key, wrap=True))
        except Exception as error:  # noqa: BLE001 -- the wrappers' in-band error shape
            return {"error": f"{type(error).__name__}: {error}"}
        with self._lock:
            self._sessions[key] = session
        return self.dialect.create_payload(key, observation)

    def _reset(self, key: int, task_id: int) -> Any:
        return self._with(key, lambda s: self._do_reset(s, task_id))

    def _do_reset(self, session: _Session, task_id: int) -> Any:
        observation = session.env.reset(self._task(task_id))
        session.reward, session.observation = 0.0, observation
        return self.dialect.reset_payload(observation)

    def _step(self, key: int, action: str) -> Any:
        if self.dialect.action != "raw" and not action_lines(action):
            action = f"Action: {action}"  # AgentGym's clients send the bare action; contrail's envs parse text

        def play(session: _Session) -> Any:
            step = session.env.step(action)
            session.reward, session.observation = float(step.reward), step.observation
            return self.dialect.step_payload(step.observation, session.reward, step.done, step.info)

        return self._with(key, play)

    def _observe(self, key: int) -> Any:
        def look(session: _Session) -> Any:
            text = session.observation
            if self.dialect.name == "babyai":  # its server answers the state as an object
                reward, done = session.reward, session.env.done
                return {"observation": text, "reward": reward, "score": reward, "done": done, "deleted": False}
            return text

        return self._with(key, look)

    def _close(self, key: int) -> bool:
        with self._lock:
            session = self._sessions.pop(key, None)
        if session is None:
            return False  # AgentGym's wrappers answer false for an unknown id
        with session.lock:
            _close_quietly(session.env)
        return True

    def _with(self, key: int, action: Callable[[_Session], Any]) -> Any:
        """Run ``action`` on session ``key`` under its lock; failures in AgentGym's ``{"error"}`` shape."""
        with self._lock:
            session = self._sessions.get(key)
        if session is None:
            return {"error": f"The id {key} is not valid."}
        with session.lock:
            session.last_used = time.monotonic()
            try:
                return action(session)
            except Exception as error:  # noqa: BLE001 -- the env's failure goes back to the client in-band
                return {"error": f"{type(error).__name__}: {error}"}
            finally:
                session.last_used = time.monotonic()

    def _task(self, task_id: int, wrap: bool = False) -> Task:
        """The served environment's task with id ``task_id`` (train first, then test).

        ``wrap``: an unknown id picks a train task by its remainder (textcraft's ``/create``).
        """
        for split in ("train", "test"):
            with self._lock:
                known = self._tasks.get(split)
            if known is None:
                known = {task.id: task for task in self._catalogue.tasks(split)}
                with self._lock:
                    self._tasks[split] = known
            if task_id in known:
                return known[task_id]
        train = list(self._tasks["train"].values())
        if wrap and train:
            return train[task_id % len(train)]
        raise ValueError(f"{self.env_name} has no task {task_id}")


def _close_quietly(env: Env) -> None:
    try:
        env.close()
    except Exception:  # noqa: BLE001 -- a session being reaped must not take the server down
        pass


def _invalid(kind: str, loc: list, message: str, given: Any, **extra: Any) -> HTTPProblem:
    """FastAPI's (pydantic 2's) 422 shape: ``{"detail": [{"type", "loc", "msg", "input"}]}``."""
    return HTTPProblem(HTTPStatus.UNPROCESSABLE_ENTITY,
                       [{"type": kind, "loc": loc, "msg": message, "input": given, **extra}])


_NOT_AN_INT = "Input should be a valid integer, unable to parse string as an integer"


def _field(body: Any, name: str, kind: type = int) -> Any:
    if body is None:
        raise _invalid("missing", ["body"], "Field required", None)
    if not isinstance(body, dict):
        raise _invalid("model_attributes_type", ["body"],
                       "Input should be a valid dictionary or object to extract fields from", body)
    if name not in body:
        raise _invalid("missing", ["body", name], "Field required", body)
    value = body[name]
    if kind is int:
        return _as_int(value, ["body", name])
    if not isinstance(value, str):
        raise _invalid("string_type", ["body", name], "Input should be a valid string", value)
    return value


def _as_int(value: Any, loc: list) -> int:
    """An int the way pydantic's lax mode reads one ("3" is 3; "x", 1.5 and true are not)."""
    if isinstance(value, str):
        if not value.strip().lstrip("-").isdigit():
            raise _invalid("int_parsing", loc, _NOT_AN_INT, value)
        return int(value)
    if isinstance(value, float) and not isinstance(value, bool):
        if not value.is_integer():
            message = "Input should be a valid integer, got a number with a fractional part"
            raise _invalid("int_from_float", loc, message, value)
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid("int_type", loc, "Input should be a valid integer", value)
    return value


def _query_int(query: dict[str, str], name: str) -> int:
    if name not in query:
        raise _invalid("missing", ["query", name], "Field required", None)
    return _as_int(query[name], ["query", name])


class _Handler(BaseHTTPRequestHandler):
    """HTTP plumbing: bounded body, JSON in and out, FastAPI-shaped errors."""

    app: EnvServer
    protocol_version = "HTTP/1.1"  # keep-alive for clients that reuse connections (requests.Session)

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in two writes: without NODELAY, Nagle's algorithm meets the client's
        # delayed ACK and a small answer can wait ~40 ms.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def do_GET(self) -> None:  # noqa: N802 -- http.server's naming
        self._serve("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._serve("POST")

    def _serve(self, method: str) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        try:
            body = self._body() if method == "POST" else None
            status, payload = HTTPStatus.OK, self.app.route(method, url.path.rstrip("/") or "/", query, body)
        except HTTPProblem as problem:
            status, payload = problem.status, {"detail": problem.detail}
        except Exception:  # a bug in the server or the environment: FastAPI's plain 500, the server goes on
            self.log_error("%s", traceback.format_exc())
            self._answer(HTTPStatus.INTERNAL_SERVER_ERROR, b"Internal Server Error", "text/plain; charset=utf-8")
            return
        self._answer(status, json.dumps(payload).encode())

    def _body(self) -> Any:
        length = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            raise HTTPProblem(HTTPStatus.LENGTH_REQUIRED, "chunked bodies are not accepted; send Content-Length")
        size = int(length) if length and length.isdigit() else 0
        if size > self.app.max_body:
            self.close_connection = True  # the unread body is still on the socket
            raise HTTPProblem(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body of {size} bytes exceeds {self.app.max_body}")
        raw = self.rfile.read(size) if size else b""
        if not raw:
            return None
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            position = getattr(error, "pos", 0)
            raise _invalid("json_invalid", ["body", position], "JSON decode error", {},
                           ctx={"error": getattr(error, "msg", str(error))}) from None

    def _answer(self, status: int, data: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 -- quiet: one line per request would flood a run
        pass

    def log_error(self, format: str, *args: Any) -> None:  # noqa: A002 -- errors still reach stderr
        sys.stderr.write(f"serve-env: {format % args}\n")
