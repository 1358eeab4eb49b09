"""`AgentGymEnv` against a real `EnvServer`: specs, parity, retries, timeouts, concurrent steps, a dying server."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time

import pytest

import contrail.envs as envs
from contrail.agent import ChatFormat, RolloutConfig, rollout
from contrail.agent.scripted import _TextActor
from contrail.envs.agentgym import EnvServer, RemoteEnvError
from contrail.envs.base import EnvOptionError, Step
from contrail.testing import MagicWordEnv

EASY = list(range(0, 40, 2))  # magic's even train ids: 3 turns (the odd ones allow 1)


@pytest.fixture
def server():
    with EnvServer("magic") as running:
        yield running


def test_spec_names_a_remote_env_without_touching_the_network():
    spec = "agentgym:webshop@http://127.0.0.1:9"  # nothing listens on port 9
    assert envs.parse_spec(spec) == (spec, None)
    env = envs.make(spec, train_ids=[3, 4], test_ids=[7])
    assert [t.id for t in env.tasks("train")] == [3, 4] and env.tasks("test")[0].env == spec
    assert env.max_turns == 10  # webshop's own turn limit
    assert env.instruction() == envs.make("webshop").instruction()  # the local twin's wording
    assert envs.make(env.tasks("test")[0].env).dialect.session_key == "env_idx"


@pytest.mark.parametrize("spec", ["agentgym:webshop", "agentgym:webshop@ftp://x:1", "agentgym:@http://x:1"])
def test_bad_specs_say_the_format(spec):
    with pytest.raises(EnvOptionError, match="expected agentgym:<env>@http"):
        envs.parse_spec(spec)


def test_options_are_checked():
    spec = "agentgym:magic@http://127.0.0.1:9"
    with pytest.raises(EnvOptionError, match="unknown option 'bogus'"):
        envs.make(spec, bogus=1)
    with pytest.raises(EnvOptionError, match="overlap"):
        envs.make(spec, train_ids=[1, 2], test_ids=[2])
    with pytest.raises(EnvOptionError, match="timeout"):
        envs.make(spec, timeout=0)


@pytest.mark.parametrize("dialect", ["babyai", "webshop", "textcraft", "alfworld"])
def test_remote_play_matches_local_play(dialect, action_word):
    texts = ["Thought: hmm\nAction: berry", "no action line", "Action: apple"]
    local = envs.make(action_word)
    local.reset(local.tasks("train")[0])
    local_steps = [local.step(text) for text in texts]
    with EnvServer(action_word, dialect_name=dialect) as running:
        remote = envs.make(f"agentgym:{dialect}@{running.url}", train_ids=[0])
        assert remote.reset(remote.tasks("train")[0]) == "what is your word ?"
        steps = [remote.step(text) for text in texts]
        remote.close()
        assert running.session_count == (1 if dialect == "webshop" else 0)  # webshop's server has no /close
    assert [s.observation for s in steps[::2]] == [s.observation for s in local_steps[::2]]
    assert [(s.reward, s.done, s.success, s.valid) for s in steps] == [
        (s.reward, s.done, s.success, s.valid) for s in local_steps]


@pytest.mark.parametrize("dialect", ["generic", "searchqa"])
def test_raw_dialects_send_the_whole_text(server, dialect):
    with EnvServer("magic", dialect_name=dialect) as running:
        remote = envs.make(f"agentgym:{dialect}@{running.url}", train_ids=[0])
        remote.reset(remote.tasks("train")[0])
        assert remote.step("berry").observation == "wrong . try again"
        assert remote.step("apple, surely").success  # magic reads the first word: the text arrived whole


def test_textcraft_expert_solves_through_the_remote_path():
    """contrail's TextCraft served in textcraft's dialect, played by the local expert's text."""
    with EnvServer("textcraft") as running:
        remote = envs.make(f"agentgym:textcraft@{running.url}", train_ids=[0, 1, 130])
        local = envs.make("textcraft")
        for task in remote.tasks("train"):
            twin = next(t for t in local.tasks("train") + local.tasks("test") if t.id == task.id)
            assert remote.reset(task) == local.reset(twin)
            step = Step(observation="")
            while not step.done:
                text = local.expert()
                step, local_step = remote.step(text), local.step(text)
                assert step.observation == local_step.observation
            assert step.success and step.reward == 1.0
            remote.close()


def test_unreachable_server_fails_after_bounded_retries():
    env = envs.make("agentgym:magic@http://127.0.0.1:9", retries=2, timeout=1.0, train_ids=[0])
    started = time.monotonic()
    with pytest.raises(RemoteEnvError, match="ConnectionRefusedError"):
        env.reset(env.tasks("train")[0])
    assert 0.25 < time.monotonic() - started < 5  # two backed-off retries (0.1 s + 0.2 s), then the error


class SlowMagic(MagicWordEnv):
    """Magic whose steps take ``delay`` seconds; counts the steps applied and the most in flight at once."""

    delay = 0.3
    steps = 0
    in_flight = most_in_flight = 0
    lock = threading.Lock()  # the server steps its sessions in threads of its own

    def on_step(self, text: str) -> Step:
        cls = type(self)
        with cls.lock:
            cls.steps += 1
            cls.in_flight += 1
            cls.most_in_flight = max(cls.most_in_flight, cls.in_flight)
        try:
            time.sleep(self.delay)
        finally:
            with cls.lock:
                cls.in_flight -= 1
        return super().on_step(text)


def test_a_lost_step_is_never_retried():
    with envs.registered("slow-magic", SlowMagic), EnvServer("slow-magic") as running:
        SlowMagic.steps = 0
        env = envs.make(f"agentgym:slow-magic@{running.url}", timeout=0.1, retries=3, train_ids=[0])
        env.reset(env.tasks("train")[0])
        with pytest.raises(RemoteEnvError, match="timed out"):
            env.step("Action: berry")
        time.sleep(SlowMagic.delay + 0.1)
        assert SlowMagic.steps == 1  # the server applied it once; a retry would have applied it twice


class Script(_TextActor):
    """Writes a wrong fruit on the first turn and the magic word after; ``before_turn(n)`` runs first.

    The generic dialect sends the whole text, which magic reads by its first word.
    """

    def __init__(self, chat, before_turn=None):
        super().__init__(chat)
        self.turn, self.before_turn = 0, before_turn

    def generate(self, prompts, params, envs):
        self.turn += 1
        if self.before_turn:
            self.before_turn(self.turn)
        return super().generate(prompts, params, envs)

    def text_for(self, env) -> str:
        return "berry" if env.turns == 0 else "apple"


def test_remote_envs_of_a_turn_step_concurrently(tokenizer):
    with envs.registered("slow-magic", SlowMagic), EnvServer("slow-magic") as running:
        spec = f"agentgym:slow-magic@{running.url}"
        tasks = envs.make(spec, train_ids=EASY[:8]).tasks("train")
        chat = ChatFormat.from_tokenizer(tokenizer)
        SlowMagic.most_in_flight = 0
        done = rollout(Script(chat), chat, tasks, lambda task: envs.make(task.env), RolloutConfig(max_new_tokens=8))
    assert len(done) == 8 and all(t.success and t.turns == 2 for t in done)
    # Each step sleeps 0.3 s on the server: stepped one after another, one would be in flight at a time.
    assert SlowMagic.most_in_flight == 8


def _serve_in_subprocess() -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "contrail", "serve-env", "contrail.testing:MagicWordEnv", "--port", "0"],
        stdout=subprocess.PIPE, text=True,
    )
    line = process.stdout.readline()
    found = re.search(r"on (http://\S+)", line)
    assert found, f"serve-env printed {line!r}"
    return process, found.group(1)


def test_a_server_killed_mid_episode_fails_only_its_episodes(tokenizer, server):
    process, url = _serve_in_subprocess()
    try:
        doomed = envs.make(f"agentgym:magic@{url}", retries=1, timeout=5.0, train_ids=EASY[:2])
        healthy = envs.make(f"agentgym:magic@{server.url}", train_ids=EASY[2:4])
        tasks = doomed.tasks("train") + healthy.tasks("train")

        def kill_before_second_turn(turn: int) -> None:
            if turn == 2:
                process.kill()
                process.wait()

        chat = ChatFormat.from_tokenizer(tokenizer)
        done = rollout(Script(chat, kill_before_second_turn), chat, tasks, lambda task: envs.make(task.env),
                       RolloutConfig(max_new_tokens=8))
    finally:
        process.kill()
        process.wait()
    assert len(done) == 4
    for trajectory in done[:2]:
        assert trajectory.error and "RemoteEnvError" in trajectory.error and not trajectory.success
        assert trajectory.turns == 2
    for trajectory in done[2:]:
        assert trajectory.error is None and trajectory.success and trajectory.turns == 2


def test_a_continual_run_trains_and_evaluates_on_a_served_environment(server, tmp_path):
    """YAML names the remote environment and its options; the runner trains and evaluates through HTTP."""
    from contrail.experiment import Experiment, build_stream
    from contrail.runner import run
    from contrail.testing import tiny_model, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tiny_model(tokenizer).save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    spec = f"agentgym:magic@{server.url}"
    exp = Experiment.from_yaml(f"""
name: remote
out: {tmp_path / "run"}
stream:
  train: ["{spec}"]
  env_options: {{"{spec}": {{train_ids: [0, 2, 4, 6], test_ids: [10000, 10002], timeout: 10.0}}}}
  steps_per_experience: 1
model: {{name: {tmp_path / "tiny"}, dtype: float32, device: cpu}}
rollout: {{max_new_tokens: 3, max_episode_tokens: 256}}
grpo: {{lr: 0.01, group_size: 2, tasks_per_step: 2}}
eval: {{k: 1}}
""")
    stream = build_stream(exp)
    assert [t.id for t in stream.experiences[0].train_tasks] == [0, 2, 4, 6]  # the options reached the env
    result = run(exp, show_progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    assert [row["stage"] for row in rows] == [0, 1]
    assert all(row["results"][spec]["errors"] == 0 for row in rows)
    assert result.test == [spec] and server.session_count == 0  # every episode closed its session
