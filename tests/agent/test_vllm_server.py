"""Server mode against a real ``vllm serve`` on this machine (marker ``vllm``).

The fixture starts the server the way docs/vllm.md does (`serve_command`,
``VLLM_SERVER_DEV_MODE=1``) on a free port, with dummy weights, eager mode
and the model shape of the trainer (a random-init Llama of the tiny
tokenizer's vocabulary, fp32 on both sides so they agree to ~1e-5). Run in
the vLLM environment:
``/work/venv-vllm/bin/python -m pytest -q -m vllm tests/agent/test_vllm_server.py``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request

import pytest

pytest.importorskip("vllm")

from vllm_helpers import check_per_prompt_seeds, make_env, max_gap, tasks, trainer_logprobs  # noqa: E402

from contrail.agent import RolloutConfig, SamplingParams, rollout  # noqa: E402
from contrail.agent.vllm import VLLMConfig, fingerprint  # noqa: E402
from contrail.agent.vllm_server import VLLMServerBackend, serve_command  # noqa: E402
from contrail.grpo.config import GRPOConfig  # noqa: E402
from contrail.grpo.trainer import GRPOTrainer  # noqa: E402
from contrail.testing import tiny_model  # noqa: E402

pytestmark = pytest.mark.vllm

SERVED = VLLMConfig(enforce_eager=True, dtype="float32", kv_cache_gb=0.25)  # the server's launch settings
SYNC_TOLERANCE = 1e-4  # max |server - trainer| log-prob, fp32 on both sides
STARTUP_S = 600  # a niced server on a loaded 2-core machine can take minutes to come up


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until_healthy(url: str, process: subprocess.Popen, log_path) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"vllm serve exited ({process.returncode}):\n{log_path.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return
        except OSError:
            time.sleep(2)
    pytest.fail(f"vllm serve did not come up in {STARTUP_S}s:\n{log_path.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokenizer):
    """A running ``vllm serve`` of the trainer's model shape; yields its URL."""
    from vllm.platforms import current_platform

    directory = tmp_path_factory.mktemp("served")
    model = tiny_model(tokenizer, hidden_size=256, layers=2, seed=0)
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    port = free_port()
    command = serve_command(str(directory), port, max_model_len=256, config=SERVED,
                            device_type=current_platform.device_type, dummy_weights=True)
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "OMP_NUM_THREADS": "1"}
    log_path = directory / "serve.log"
    with open(log_path, "w") as log:
        # Its own session: the API server spawns engine and worker processes, stopped together below.
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, process, log_path)
        yield url
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def trainer(server, tokenizer):
    rollout_config = RolloutConfig(max_new_tokens=6, max_episode_tokens=256, max_turns=3, backend="vllm",
                                   vllm=VLLMConfig(mode="server", url=server))
    model = tiny_model(tokenizer, hidden_size=256, layers=2, seed=0)
    config = GRPOConfig(lr=3e-3, group_size=4, tasks_per_step=2, warmup_steps=0)
    return GRPOTrainer(model, tokenizer, config, rollout_config, make_env, seed=0, show_progress=False)


def test_weight_push_makes_the_server_score_like_the_trainer(trainer):
    backend = trainer.policy.backend
    assert isinstance(backend, VLLMServerBackend)
    trajectories = trainer.collect(tasks(2))  # the first generation pushes the weights (the server had dummy ones)
    fixed = trajectories[0].ids
    before = backend.sequence_logprobs(fixed)
    gap_before = max_gap(before, trainer_logprobs(trainer.model, fixed))
    assert gap_before < SYNC_TOLERANCE
    for index, trajectory in enumerate(trajectories):  # rewards that differ within each group: a real update
        trajectory.reward = float(index % 2)
    stats = trainer.update(trajectories)
    assert "skipped_update" not in stats
    assert backend._owner == fingerprint(trainer.model)  # the trainer pushed after its update, unasked
    after = backend.sequence_logprobs(fixed)
    trained = trainer_logprobs(trainer.model, fixed)
    assert max_gap(after, trained) < SYNC_TOLERANCE
    assert max_gap(after, before) > 100 * SYNC_TOLERANCE
    print(f"\nserver weight push over {len(fixed) - 1} tokens: max |server - trainer| before the update "
          f"{gap_before:.2e}, after it {max_gap(after, trained):.2e}; "
          f"server before vs after {max_gap(after, before):.2e}")


def test_multi_turn_rollout_through_the_server_keeps_the_bookkeeping(trainer):
    chat = trainer.policy.chat
    trajectories = rollout(trainer.policy.backend, chat, tasks(32), make_env, trainer.rollout)
    assert any(t.turns > 1 for t in trajectories)
    stopped = 0
    for trajectory in trajectories:
        assert trajectory.error is None
        assert len(trajectory.ids) == len(trajectory.mask) == len(trajectory.logprobs)
        assert sum(trajectory.mask) == trajectory.generated_tokens
        # Sampled at temperature 1: the server's log-probs are the trainer's.
        trained = [0.0] + trainer_logprobs(trainer.model, trajectory.ids)
        sampled = [(lp, t) for lp, t, m in zip(trajectory.logprobs, trained, trajectory.mask) if m]
        assert max(abs(a - b) for a, b in sampled) < SYNC_TOLERANCE
        stopped += sum(1 for i, m in enumerate(trajectory.mask) if m and trajectory.ids[i] in chat.stop_ids)
    assert stopped > 0, "no turn ended on a stop id: the stop-id path went untested"


def test_server_samples_are_seeded(trainer):
    backend = trainer.policy.backend
    prompts = [trainer.policy.chat.prompt_ids([{"role": "user", "content": "say apple"}])] * 8
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    backend.reseed(7)
    first = [g.ids for g in backend.generate(prompts, params)]
    backend.reseed(7)
    assert [g.ids for g in backend.generate(prompts, params)] == first
    assert len({tuple(ids) for ids in first}) > 1, "rows of one call must get different seeds"
    state = backend.generator_state()
    next_call = [g.ids for g in backend.generate(prompts, params)]
    backend.set_generator_state(state)
    assert [g.ids for g in backend.generate(prompts, params)] == next_call


def test_per_prompt_seeds_make_a_sample_independent_of_its_batch(trainer):
    """The evaluation's per-episode seeds: a prompt's sample depends on its seed, not on its neighbours."""
    check_per_prompt_seeds(trainer.policy)
