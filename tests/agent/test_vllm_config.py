"""The vLLM backend's settings, its selection, and the importance-sampling correction: no vLLM needed."""

from __future__ import annotations

import math
import sys
import textwrap

import pytest
import torch

from contrail.agent import RolloutConfig
from contrail.agent.vllm import VLLMConfig, VLLMNotInstalled
from contrail.experiment import ConfigError, load_experiment
from contrail.grpo.config import GRPOConfig
from contrail.grpo.trainer import GRPOTrainer
from contrail.policy import Policy
from contrail.testing import MagicWordEnv, tiny_model


@pytest.mark.parametrize("options, message", [
    ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization must be in (0, 1]"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in (0, 1]"),
    ({"kv_cache_gb": 0}, "kv_cache_gb must be a number > 0"),
    ({"enforce_eager": "yes"}, "enforce_eager must be true or false"),
    ({"max_model_len": 0}, "max_model_len must be an int >= 1"),
    ({"dtype": "int8"}, "dtype must be one of auto, float32, bfloat16, float16"),
])
def test_vllm_config_names_the_bad_setting(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        VLLMConfig(**options)


def test_rollout_backend_is_hf_or_vllm():
    assert RolloutConfig().backend == "hf"
    assert RolloutConfig(backend="vllm").vllm == VLLMConfig()
    with pytest.raises(ValueError, match="backend must be one of hf, vllm, got 'sglang'"):
        RolloutConfig(backend="sglang")


def _experiment(tmp_path, rollout: str):
    path = tmp_path / "exp.yaml"
    path.write_text(textwrap.dedent(f"""\
        stream: {{train: [textcraft:easy], test_tasks: 2, steps_per_experience: 1}}
        rollout: {rollout}
        """))
    return path


def test_experiment_file_selects_vllm_for_training_and_evaluation(tmp_path):
    exp = load_experiment(_experiment(tmp_path, "{backend: vllm, vllm: {enforce_eager: true, dtype: bfloat16}}"))
    assert exp.rollout.backend == "vllm"
    assert exp.rollout.vllm == VLLMConfig(enforce_eager=True, dtype="bfloat16")
    assert exp.eval_rollout.backend == "vllm" and exp.eval_rollout.vllm == exp.rollout.vllm


def test_experiment_file_error_names_the_vllm_key(tmp_path):
    with pytest.raises(ConfigError, match="rollout.vllm.dtype"):
        load_experiment(_experiment(tmp_path, "{backend: vllm, vllm: {dtype: int8}}"))
    with pytest.raises(ConfigError, match="rollout.vllm.swap_space"):
        load_experiment(_experiment(tmp_path, "{backend: vllm, vllm: {swap_space: 4}}"))


def test_vllm_backend_without_vllm_says_how_to_install(monkeypatch, tokenizer, model):
    monkeypatch.setitem(sys.modules, "vllm", None)  # importing it now raises ImportError
    with pytest.raises(VLLMNotInstalled, match="scripts/install_vllm_cpu.sh"):
        Policy.from_model(model, tokenizer, rollout=RolloutConfig(backend="vllm"))
    assert type(Policy.from_model(model, tokenizer, rollout=RolloutConfig()).backend).__name__ == "HFBackend"


# --- importance-sampling correction --------------------------------------------------------

ROLLOUT = RolloutConfig(max_new_tokens=3, max_episode_tokens=256)


def _trainer(tokenizer, correction: bool, cap: float = 2.0) -> GRPOTrainer:
    config = GRPOConfig(lr=1e-3, group_size=2, tasks_per_step=2, warmup_steps=0,
                        importance_sampling_correction=correction, importance_sampling_cap=cap)
    return GRPOTrainer(tiny_model(tokenizer, seed=0), tokenizer, config, ROLLOUT, lambda task: MagicWordEnv(),
                       seed=0, show_progress=False)


def _trajectories_with_mismatch(trainer: GRPOTrainer, shift: float):
    """Two groups of rollouts with rewards that differ within each group, sampler log-probs moved by ``shift``."""
    trajectories = trainer.collect(MagicWordEnv().tasks("train", "easy")[:2])
    for index, trajectory in enumerate(trajectories):
        trajectory.reward = float(index % 2)
        trajectory.logprobs = [lp + shift if m else lp for lp, m in zip(trajectory.logprobs, trajectory.mask)]
    return trajectories


@pytest.mark.parametrize("shift, weight", [(-math.log(1.5), 1.5), (-5.0, 2.0)])
def test_importance_weight_is_truncated_ratio_of_trainer_to_sampler(tokenizer, shift, weight):
    plain, corrected = _trainer(tokenizer, correction=False), _trainer(tokenizer, correction=True)
    trajectories = _trajectories_with_mismatch(plain, shift)
    reference = plain.update([_copy(t) for t in trajectories])
    stats = corrected.update([_copy(t) for t in trajectories])
    # The sampler (fp32 HF here) agrees with the trainer to ~1e-6 before the fake shift.
    assert stats["is_weight_mean"] == pytest.approx(weight, rel=1e-3)
    # Every token's loss is scaled by the weight, so the gradient is (the loss is ~0 at ratio 1).
    assert stats["grad_norm"] == pytest.approx(weight * reference["grad_norm"], rel=1e-3)
    assert "is_weight_mean" not in reference


def test_without_mismatch_the_correction_changes_nothing(tokenizer):
    plain, corrected = _trainer(tokenizer, correction=False), _trainer(tokenizer, correction=True)
    trajectories = _trajectories_with_mismatch(plain, 0.0)
    reference = plain.update([_copy(t) for t in trajectories])
    stats = corrected.update([_copy(t) for t in trajectories])
    assert stats["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-4)
    for a, b in zip(plain.model.parameters(), corrected.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_correction_refuses_tempered_sampling(tokenizer):
    config = GRPOConfig(group_size=2, tasks_per_step=1, importance_sampling_correction=True)
    with pytest.raises(ValueError, match="importance_sampling_correction needs rollout.temperature 1"):
        GRPOTrainer(tiny_model(tokenizer), tokenizer, config, RolloutConfig(temperature=0.7),
                    lambda task: MagicWordEnv(), show_progress=False)
    with pytest.raises(ValueError, match="importance_sampling_cap"):
        GRPOConfig(importance_sampling_cap=0.5)


def _copy(trajectory):
    import dataclasses

    return dataclasses.replace(trajectory, ids=list(trajectory.ids), mask=list(trajectory.mask),
                               logprobs=list(trajectory.logprobs))


def test_eval_backend_flag_without_vllm_is_one_line(monkeypatch, tmp_path, tokenizer, capsys):
    from contrail.cli import main

    tiny_model(tokenizer).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    monkeypatch.setitem(sys.modules, "vllm", None)
    code = main(["eval", "--model", str(tmp_path / "model"), "--env", "textcraft:easy", "--tasks", "1",
                 "--backend", "vllm", "--out", str(tmp_path / "out")])
    assert code == 2
    assert "--backend vllm: rollout.backend: vllm needs the vllm package" in capsys.readouterr().err


def test_update_syncs_the_backend_after_the_optimizer_step(tokenizer):
    trainer = _trainer(tokenizer, correction=False)
    calls = []

    class Recording:
        """The trainer's backend, recording the update seams (with the parameters' versions at each call)."""

        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def prepare_update(self):
            calls.append(("prepare", [p._version for p in trainer.model.parameters()]))

        def sync_weights(self, model):
            assert model is trainer.model
            calls.append(("sync", [p._version for p in trainer.model.parameters()]))

    trajectories = _trajectories_with_mismatch(trainer, 0.0)
    trainer.policy.backend = Recording(trainer.policy.backend)
    trainer.update(trajectories)
    assert [name for name, _ in calls] == ["prepare", "sync"]
    assert calls[1][1] != calls[0][1], "sync must come after the optimizer changed the weights"


def test_cpu_engines_never_split_a_prompt_across_steps():
    from contrail.agent.vllm import scheduler_settings

    # CPU: no chunked prefill, and a step's budget holds the longest prompt (vLLM refuses less).
    assert scheduler_settings("cpu", 8192, 64) == {"enable_chunked_prefill": False, "max_num_batched_tokens": 8192}
    assert scheduler_settings("cpu", 256, 64) == {"enable_chunked_prefill": False, "max_num_batched_tokens": 4096}
    assert scheduler_settings("cuda", 8192, 64) == {}  # GPU generators rewind; vLLM's defaults stay


# --- server mode: settings and the checks made before sampling (a stub server; no vLLM needed) --------


@pytest.mark.parametrize("options, message", [
    ({"mode": "remote"}, "mode must be one of colocate, server, got 'remote'"),
    ({"mode": "server"}, "url must be the server's address"),
    ({"mode": "server", "url": "127.0.0.1:8000"}, "url must be the server's address"),
    ({"url": "http://127.0.0.1:8000"}, "url is only read with mode: server"),
    ({"mode": "server", "url": "http://h:1", "sync_dir": ""}, "sync_dir must be a directory path or null"),
])
def test_server_settings_name_the_bad_key(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        VLLMConfig(**options)


def test_experiment_file_selects_server_mode(tmp_path):
    exp = load_experiment(_experiment(tmp_path, "{backend: vllm, vllm: {mode: server, url: 'http://10.0.0.5:8000'}}"))
    assert exp.rollout.vllm.mode == "server" and exp.rollout.vllm.url == "http://10.0.0.5:8000"
    with pytest.raises(ConfigError, match="rollout.vllm.url"):
        load_experiment(_experiment(tmp_path, "{backend: vllm, vllm: {mode: server}}"))


GOOD_SETTINGS = {"logprobs_mode": "processed_logprobs", "max_model_len": 4096, "enable_chunked_prefill": False,
                 "enable_prefix_caching": True, "device": "cpu"}


@pytest.fixture
def stub_server():
    """A local HTTP server answering /health and /collective_rpc as ``answer(method) -> (status, body)`` says."""
    import http.server
    import json
    import threading

    state = {"answer": lambda method: (200, {"results": [GOOD_SETTINGS]})}

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def reply(self, status, body):
            payload = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_GET(self):
            self.reply(200, {}) if self.path == "/health" else self.reply(404, {"detail": "Not Found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.reply(*state["answer"](body.get("method")))

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    state["url"] = f"http://127.0.0.1:{server.server_address[1]}"
    yield state
    server.shutdown()


def _server_policy(tokenizer, model, url):
    rollout = RolloutConfig(backend="vllm", max_episode_tokens=1024, vllm=VLLMConfig(mode="server", url=url))
    return Policy.from_model(model, tokenizer, rollout=rollout)


def test_server_mode_needs_no_vllm_in_the_trainer(monkeypatch, stub_server, tokenizer, model):
    from contrail.agent.vllm_server import VLLMServerBackend

    monkeypatch.setitem(sys.modules, "vllm", None)
    backend = _server_policy(tokenizer, model, stub_server["url"]).backend
    assert isinstance(backend, VLLMServerBackend) and backend.needs_weight_sync


@pytest.mark.parametrize("answer, message", [
    (lambda method: (404, {"detail": "Not Found"}), "has no /collective_rpc; start it with VLLM_SERVER_DEV_MODE=1"),
    (lambda method: (500, {"error": {"message": f"'CPUWorker' object has no attribute '{method}'"}}),
     "lacks contrail's worker extension; start it with --worker-extension-cls "
     "contrail.agent.vllm_worker.WeightSyncExtension"),
    (lambda method: (200, {"results": [{**GOOD_SETTINGS, "logprobs_mode": "raw_logprobs"}]}),
     "reports logprobs_mode raw_logprobs; start it with --logprobs-mode processed_logprobs"),
    (lambda method: (200, {"results": [{**GOOD_SETTINGS, "enable_chunked_prefill": True}]}),
     "has chunked prefill on"),
    (lambda method: (200, {"results": [{**GOOD_SETTINGS, "max_model_len": 256}]}),
     "rollout.max_episode_tokens: episodes reach 1024 tokens but the server .* --max-model-len 256"),
])
def test_misconfigured_server_is_one_line_saying_what_to_fix(stub_server, tokenizer, model, answer, message):
    from contrail.agent.vllm_server import VLLMServerMisconfigured

    stub_server["answer"] = answer
    with pytest.raises(VLLMServerMisconfigured, match=message) as raised:
        _server_policy(tokenizer, model, stub_server["url"])
    assert "\n" not in str(raised.value)


def test_no_server_at_the_url_is_one_line(tokenizer, model):
    import socket

    from contrail.agent.vllm_server import VLLMServerMisconfigured

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(VLLMServerMisconfigured, match=f"rollout.vllm.url: no vLLM server answers at http://127.0.0.1:{port}"):
        _server_policy(tokenizer, model, f"http://127.0.0.1:{port}")


def test_serve_command_has_what_the_backend_checks():
    from contrail.agent.vllm_server import EXTENSION, serve_command

    cpu = serve_command("/models/m", 8001, max_model_len=8192, config=VLLMConfig(kv_cache_gb=2), device_type="cpu")
    text = " ".join(cpu)
    for flag in ("--port 8001", "--logprobs-mode processed_logprobs", f"--worker-extension-cls {EXTENSION}",
                 "--max-model-len 8192", "--enable-prefix-caching", "--no-enable-chunked-prefill",
                 "--max-num-batched-tokens 8192", f"--kv-cache-memory-bytes {2 << 30}"):
        assert flag in text
    gpu = " ".join(serve_command("/models/m", max_model_len=8192, device_type="cuda"))
    assert "--gpu-memory-utilization 0.3" in gpu and "chunked" not in gpu and "--load-format" not in gpu


# --- LoRA: merge-on-sync ----------------------------------------------------------------------


def _lora_model(tokenizer):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_model(tokenizer, hidden_size=64, seed=2),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                lora_dropout=0.0))
    with torch.no_grad():  # B starts at zero (the adapter a no-op): give it weight, so a missed merge shows
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    return model


def test_merged_weights_are_peft_s_own_merge_under_the_plain_names(tokenizer):
    import copy

    from contrail.agent.vllm import merged_weights

    model = _lora_model(tokenizer)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    merged = dict(merged_weights(model))
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    assert merged.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(merged[name], tensor, rtol=0, atol=1e-6)
    base_q = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    assert (merged["model.layers.0.self_attn.q_proj.weight"] - base_q).abs().max() > 1e-3  # the adapter is in it
    for name, tensor in model.state_dict().items():  # computed beside the model: nothing merged in place
        assert torch.equal(tensor, before[name])
    with model.disable_adapter():  # a disabled adapter is not merged
        torch.testing.assert_close(dict(merged_weights(model))["model.layers.0.self_attn.q_proj.weight"], base_q)


def test_dora_is_refused_in_one_line(tokenizer):
    peft = pytest.importorskip("peft")
    from contrail.agent.vllm import refuse_unmergeable

    model = peft.get_peft_model(tiny_model(tokenizer, hidden_size=64),
                                peft.LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(ValueError, match="merges plain LoRA adapters only; adapter 'default' is LoraConfig with "
                                         "use_dora"):
        refuse_unmergeable(model)


def test_eval_vllm_url_without_a_server_is_one_line(tmp_path, tokenizer, capsys):
    import socket

    from contrail.cli import main

    tiny_model(tokenizer).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    common = ["eval", "--model", str(tmp_path / "model"), "--env", "textcraft:easy", "--tasks", "1",
              "--out", str(tmp_path / "out")]
    assert main(common + ["--backend", "vllm", "--vllm-url", f"http://127.0.0.1:{port}"]) == 2
    assert f"--vllm-url: rollout.vllm.url: no vLLM server answers at http://127.0.0.1:{port}" in capsys.readouterr().err
    assert main(common + ["--vllm-url", f"http://127.0.0.1:{port}"]) == 2
    assert "--vllm-url needs --backend vllm" in capsys.readouterr().err
