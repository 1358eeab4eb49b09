"""`EnvServer` speaks AgentGym's wire format: requests shaped exactly as AgentGym's clients send them.

Each test sends what ``agentenv/agentenv/envs/<env>.py`` sends (routes, methods,
field names, integer ids) with `requests`, as those clients do, and checks the
answer's shape against what the matching ``agentenv-*`` server returns.
"""

from __future__ import annotations

import threading
import time

import pytest
import requests

import contrail.testing  # noqa: F401 -- registers "magic"
from contrail.envs.agentgym import EnvServer


@pytest.fixture
def serve(action_word):
    servers = []

    def start(env: str = "action-word", **kwargs) -> EnvServer:
        server = EnvServer(env, **kwargs).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def post(server, route, body=None):
    return requests.post(f"{server.url}{route}", json=body, timeout=10)


def test_babyai_dialect_session_lifecycle(serve):
    server = serve(dialect_name="babyai")
    assert post(server, "/create").json() == {"id": 0}
    assert post(server, "/create").json() == {"id": 1}
    reset = post(server, "/reset", {"id": 0, "data_idx": 0}).json()
    assert reset == {"observation": "what is your word ?", "reward": 0.0, "score": 0.0, "done": False}
    step = post(server, "/step", {"id": 0, "action": "berry"}).json()
    assert step == {"observation": "wrong . try again", "reward": 0.0, "score": 0.0, "done": False}
    won = post(server, "/step", {"id": 0, "action": "apple"}).json()
    assert won["score"] == 1.0 and won["done"] is True
    seen = requests.get(f"{server.url}/observation?id=0", timeout=10).json()
    assert seen["observation"] == "right" and seen["done"] is True
    assert post(server, "/close", {"id": 0}).json() is True
    assert post(server, "/close", {"id": 0}).json() is False  # AgentGym's wrappers: false for an unknown id
    assert server.session_count == 1


def test_errors_have_agentgym_and_fastapi_shapes(serve):
    server = serve(dialect_name="babyai", max_body=1000)
    session = post(server, "/create").json()["id"]
    assert post(server, "/step", {"id": 99, "action": "x"}).json() == {"error": "The id 99 is not valid."}
    assert "error" in post(server, "/step", {"id": session, "action": "apple"}).json()  # step before reset
    assert "no task 123456" in post(server, "/reset", {"id": session, "data_idx": 123456}).json()["error"]
    post(server, "/reset", {"id": session, "data_idx": 0})
    post(server, "/step", {"id": session, "action": "apple"})
    assert "EpisodeOver" in post(server, "/step", {"id": session, "action": "apple"}).json()["error"]

    missing = post(server, "/step", {"id": session})
    assert missing.status_code == 422 and missing.json()["detail"][0]["loc"] == ["body", "action"]
    wrong_type = post(server, "/reset", {"id": "zero", "data_idx": 0})
    assert wrong_type.status_code == 422 and wrong_type.json()["detail"][0]["loc"] == ["body", "id"]
    garbage = requests.post(f"{server.url}/step", data=b"{not json", timeout=10,
                            headers={"Content-Type": "application/json"})
    assert garbage.status_code == 422 and garbage.json()["detail"][0]["type"] == "json_invalid"
    assert post(server, "/nope").status_code == 404 and post(server, "/nope").json() == {"detail": "Not Found"}
    assert requests.get(f"{server.url}/step", timeout=10).status_code == 405
    huge = post(server, "/step", {"id": session, "action": "x" * 5000})
    assert huge.status_code == 413
    assert post(server, "/step", {"id": session, "action": "apple"}).status_code == 200  # still serving


# Recorded from FastAPI 0.165 / pydantic 2 serving agentenv-babyai's request models (id: int, action: str,
# data_idx: int): what AgentGym's servers answer to malformed requests, byte for byte.
FASTAPI_ANSWERS = [
    ("POST", "/step", {"id": 0}, 422,
     {"detail": [{"type": "missing", "loc": ["body", "action"], "msg": "Field required", "input": {"id": 0}}]}),
    ("POST", "/reset", {"id": "zero", "data_idx": 0}, 422,
     {"detail": [{"type": "int_parsing", "loc": ["body", "id"],
                  "msg": "Input should be a valid integer, unable to parse string as an integer", "input": "zero"}]}),
    ("POST", "/reset", {"id": 1.5, "data_idx": 0}, 422,
     {"detail": [{"type": "int_from_float", "loc": ["body", "id"],
                  "msg": "Input should be a valid integer, got a number with a fractional part", "input": 1.5}]}),
    ("POST", "/step", b"{not json", 422,
     {"detail": [{"type": "json_invalid", "loc": ["body", 1], "msg": "JSON decode error", "input": {},
                  "ctx": {"error": "Expecting property name enclosed in double quotes"}}]}),
    ("POST", "/step", [1, 2], 422,
     {"detail": [{"type": "model_attributes_type", "loc": ["body"],
                  "msg": "Input should be a valid dictionary or object to extract fields from", "input": [1, 2]}]}),
    ("POST", "/reset", None, 422, {"detail": [{"type": "missing", "loc": ["body"], "msg": "Field required",
                                               "input": None}]}),
    ("GET", "/observation?id=x", None, 422,
     {"detail": [{"type": "int_parsing", "loc": ["query", "id"],
                  "msg": "Input should be a valid integer, unable to parse string as an integer", "input": "x"}]}),
    ("GET", "/step", None, 405, {"detail": "Method Not Allowed"}),
]


@pytest.mark.parametrize(("method", "route", "body", "status", "answer"), FASTAPI_ANSWERS)
def test_malformed_requests_get_fastapis_answers(serve, method, route, body, status, answer):
    server = serve(dialect_name="babyai")
    json_type = {"Content-Type": "application/json"}
    sent = {"data": body, "headers": json_type} if isinstance(body, bytes) else {"json": body}
    response = requests.request(method, f"{server.url}{route}", timeout=10, **sent)
    assert (response.status_code, response.json()) == (status, answer)


def test_webshop_dialect(serve):
    server = serve(dialect_name="webshop")
    session = post(server, "/create").json()
    assert isinstance(session, int)  # a bare integer, as webshop's server answers
    assert post(server, "/reset", {"env_idx": session, "session_id": 0}).json() == ["what is your word ?", None]
    page = requests.get(f"{server.url}/observation?env_idx={session}", timeout=10).json()
    assert page == "what is your word ?"
    step = post(server, "/step", {"env_idx": session, "action": "apple"}).json()
    assert step == {"state": "right", "reward": 1.0, "done": True, "info": None}


def test_searchqa_and_textcraft_dialects(serve):
    searchqa = serve(dialect_name="searchqa")
    session = post(searchqa, "/create", {"id": 0}).json()
    assert post(searchqa, "/reset", {"env_idx": session, "id": 0}).json() == "what is your word ?"
    assert set(post(searchqa, "/step", {"env_idx": session, "action": "apple"}).json()) == {
        "observation", "reward", "done", "info"}
    textcraft = serve(dialect_name="textcraft")
    created = post(textcraft, "/create", {"commands": None, "goal": None}).json()
    assert created == {"id": 0, "observation": "what is your word ?", "done": False, "reward": 0}


def test_idle_sessions_are_reaped_and_sessions_are_bounded(serve):
    server = serve(dialect_name="babyai", idle_timeout=3600, max_sessions=2)
    first = post(server, "/create").json()["id"]
    post(server, "/create")
    assert post(server, "/create").status_code == 503  # full: the client retries later
    assert server.reap(now=time.monotonic() + 10) == 0  # not idle long enough
    assert server.reap(now=time.monotonic() + 7200) == 2
    assert post(server, "/step", {"id": first, "action": "apple"}).json() == {"error": f"The id {first} is not valid."}
    assert post(server, "/create").status_code == 200


def test_reaper_thread_closes_idle_sessions(serve):
    server = serve(dialect_name="babyai", idle_timeout=0.2)
    post(server, "/create")
    deadline = time.monotonic() + 5
    while server.session_count and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.session_count == 0


def test_many_concurrent_sessions(serve):
    server = serve(dialect_name="babyai")
    results, errors = [], []

    def play(task_id: int) -> None:
        try:
            with requests.Session() as http:  # keep-alive, as a pooled client does
                key = http.post(f"{server.url}/create", timeout=10).json()["id"]
                http.post(f"{server.url}/reset", json={"id": key, "data_idx": task_id}, timeout=10)
                step = http.post(f"{server.url}/step", json={"id": key, "action": "apple"}, timeout=10).json()
                results.append((key, step["done"]))
                http.post(f"{server.url}/close", json={"id": key}, timeout=10)
        except Exception as error:  # noqa: BLE001 -- collected and asserted below
            errors.append(error)

    threads = [threading.Thread(target=play, args=(i,)) for i in range(24)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert sorted(key for key, _ in results) == list(range(24)) and all(done for _, done in results)
    assert server.session_count == 0


def test_binds_loopback_by_default(serve):
    assert serve().url.startswith("http://127.0.0.1:")
