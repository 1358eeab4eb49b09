"""The warm-start: read from the one `WarmStart` type, cached by every field that changes it, weights only."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields, replace

import pytest
import torch
from safetensors.torch import load_file

from contrail.experiment import WarmStart
from contrail.models import load_model
from contrail.testing import save_tiny_model, tiny_tokenizer
from contrail.train import sft
from contrail.train.demos import demonstrations
from contrail.train.sft import sft_config, train_sft, warmstart, warmstart_key

SPEC = WarmStart(envs=["magic:easy"], episodes=4, epochs=1, lr=1e-3, max_episode_tokens=256, batch_size=2,
                 precision="fp32")


@pytest.fixture
def base_model(tmp_path):
    return save_tiny_model(tmp_path / "tiny")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CONTRAIL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def warm_experiment(base_model, out, *, seed=0, test_tasks=2, eval_spec=None):
    """A one-stage GRPO run on magic:easy that starts from ``SPEC``'s warm-start of ``base_model``."""
    from contrail.agent.rollout import RolloutConfig
    from contrail.experiment import EvalSpec, Experiment, ModelSpec, StrategySpec, StreamSpec
    from contrail.grpo.config import GRPOConfig

    return Experiment(
        name="warm",
        stream=StreamSpec(train=["magic:easy"], train_tasks=8, test_tasks=test_tasks, steps_per_experience=1),
        strategy=StrategySpec(name="sequential"),
        model=ModelSpec(name=base_model, dtype="float32", device="cpu", warmstart=SPEC),
        rollout=RolloutConfig(max_new_tokens=3, max_episode_tokens=256),
        grpo=GRPOConfig(lr=1e-2, group_size=2, tasks_per_step=1), eval=eval_spec or EvalSpec(k=1),
        seed=seed, out=str(out))


def test_the_trainer_settings_come_from_the_warm_start():
    config = sft_config(replace(SPEC, lr=3e-4, precision="bf16"))
    assert config.lr == 3e-4 and config.precision == "bf16"


def test_warm_start_is_trained_once_then_reused_from_the_cache(base_model, cache, monkeypatch):
    path = warmstart(base_model, SPEC, seed=7, dtype="float32", show_progress=False)
    key = warmstart_key(base_model, SPEC, seed=7, dtype="float32")
    assert path == cache / "warmstart" / key / "model"
    # the cache keeps the model and its summary, no optimizer state and no staging directory
    assert not list((cache / "warmstart").glob("*.partial"))
    assert not list(path.parent.rglob("trainer_state.pt")) and not (path.parent / "checkpoint").exists()
    summary = json.loads((path.parent / "summary.json").read_text())
    assert summary["warmstart"]["episodes"] == 4 and summary["seed"] == 7
    trained = load_file(path / "model.safetensors")
    untouched = load_file(f"{base_model}/model.safetensors")
    assert any(not (trained[name] == untouched[name]).all() for name in untouched)  # it learnt something
    model, _ = load_model(str(path))  # loadable as a model

    def no_training(*args, **kwargs):
        raise AssertionError("a cached warm-start was trained again")

    monkeypatch.setattr(sft, "train_sft", no_training)
    assert warmstart(base_model, SPEC, seed=7, dtype="float32", show_progress=False) == path


def test_runs_sharing_a_cache_train_a_warm_start_once(base_model, monkeypatch):
    """Two runs needing the same warm-start at once (a sweep's shards): one trains, the other waits and reuses."""
    real_training, calls = sft.train_sft, []

    def slow_training(*args, **kwargs):
        calls.append(1)
        time.sleep(0.5)  # the other run asks while this one trains
        return real_training(*args, **kwargs)

    monkeypatch.setattr(sft, "train_sft", slow_training)
    with ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(lambda _: warmstart(base_model, SPEC, seed=3, dtype="float32", show_progress=False),
                              range(2)))
    assert paths[0] == paths[1] and (paths[0] / "config.json").is_file()
    assert len(calls) == 1


def test_the_cache_key_covers_every_field_and_the_seed(base_model):
    keys = {warmstart_key(base_model, SPEC, seed=0, dtype="float32")}
    changed = {"envs": ["magic-berry:easy"], "episodes": 5, "epochs": 2, "lr": 2e-3, "max_episode_tokens": 300,
               "batch_size": 3, "precision": "bf16"}
    assert set(changed) == {f.name for f in fields(WarmStart)}  # a new field must be added here (and to the key)
    for name, value in changed.items():
        keys.add(warmstart_key(base_model, replace(SPEC, **{name: value}), seed=0, dtype="float32"))
    keys.add(warmstart_key(base_model, SPEC, seed=1, dtype="float32"))
    keys.add(warmstart_key(base_model, SPEC, seed=0, dtype="bfloat16"))
    keys.add(warmstart_key(base_model + "-other", SPEC, seed=0, dtype="float32"))
    assert len(keys) == len(changed) + 4


def test_demonstrations_are_deterministic_from_the_seed_and_only_from_training_tasks():
    tokenizer = tiny_tokenizer()
    spec = replace(SPEC, episodes=6)
    samples, summary = demonstrations(spec, tokenizer, seed=1, use_cache=False)
    again, _ = demonstrations(spec, tokenizer, seed=1, use_cache=False)
    other, _ = demonstrations(spec, tokenizer, seed=2, use_cache=False)
    assert summary["splits"] == ["train"] and summary["kept"] == len(samples) == 6
    assert [s.extras for s in samples] == [s.extras for s in again]
    assert [s.extras for s in samples] != [s.extras for s in other]
    assert all(sum(s.mask) > 0 for s in samples)


def _counting_steps(monkeypatch, die_at: int | None = None) -> dict:
    """Count the masked-token trainer's steps; raise KeyboardInterrupt at step ``die_at`` (1-based)."""
    from contrail.train.trainer import MaskedTokenTrainer

    real_step, calls = MaskedTokenTrainer.step, {"n": 0}

    def step(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == die_at:
            raise KeyboardInterrupt
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(MaskedTokenTrainer, "step", step)
    return calls


def test_interrupted_warm_start_resumes_from_its_last_epoch(base_model, tmp_path, monkeypatch):
    spec = replace(SPEC, epochs=2)  # two steps an epoch
    out = tmp_path / "sft"
    straight = train_sft(base_model, spec, tmp_path / "straight", seed=0, show_progress=False)
    with monkeypatch.context() as patch:
        _counting_steps(patch, die_at=3)  # killed as epoch 1 begins
        with pytest.raises(KeyboardInterrupt):
            train_sft(base_model, spec, out, seed=0, show_progress=False)
    assert json.loads((out / "checkpoint" / "trainer_state.json").read_text())["extra"] == {"epoch": 0}
    with monkeypatch.context() as patch:
        calls = _counting_steps(patch)
        resumed = train_sft(base_model, spec, out, seed=0, show_progress=False)
    assert calls["n"] == 2  # epoch 1 alone
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [entry["epoch"] for entry in log] == [0, 0, 1, 1]
    a, b = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert all((a[name] == b[name]).all() for name in a)
    assert not (out / "checkpoint").exists()  # the model supersedes it


def test_a_finished_warm_start_skips_its_last_checkpoint_and_is_not_trained_again(base_model, tmp_path,
                                                                                    monkeypatch):
    from contrail.train.trainer import MaskedTokenTrainer

    spec, out = replace(SPEC, epochs=2), tmp_path / "sft"
    saved, real_save = [], MaskedTokenTrainer.save
    monkeypatch.setattr(MaskedTokenTrainer, "save",
                        lambda self, directory, extra=None: saved.append(extra) or real_save(self, directory, extra))
    model = train_sft(base_model, spec, out, seed=0, show_progress=False)
    assert saved == [{"epoch": 0}]  # after epoch 0 only: the last epoch's would be deleted unread
    weights = (model / "model.safetensors").stat().st_mtime_ns
    with monkeypatch.context() as patch:
        calls = _counting_steps(patch)
        assert train_sft(base_model, spec, out, seed=0, show_progress=False) == model
        assert calls["n"] == 0 and (model / "model.safetensors").stat().st_mtime_ns == weights
        train_sft(base_model, replace(spec, lr=spec.lr / 2), out, seed=0, show_progress=False)
        assert calls["n"] == 4  # other settings: trained again, from the start
        train_sft(base_model, replace(spec, lr=spec.lr / 2), out, seed=0, show_progress=False, resume=False)
        assert calls["n"] == 8  # resume=False always trains
        with pytest.raises(KeyboardInterrupt):  # and, cut short, leaves nothing that reads as finished
            _counting_steps(patch, die_at=1)
            train_sft(base_model, spec, out, seed=0, show_progress=False, resume=False)
    assert not (out / "summary.json").exists()


def test_demonstrations_render_like_rollouts_and_mask_assistant_tokens():
    from contrail.agent import ChatFormat, rollout
    from contrail.agent.scripted import ExpertBackend
    from contrail.stream import Experience
    from contrail.testing import MagicWordEnv
    from contrail.train.demos import expert_rollout_config, plan_tasks

    tokenizer = tiny_tokenizer()
    samples, summary = demonstrations(SPEC, tokenizer, seed=3, use_cache=False)
    assert summary["kept"] == 4
    chat = ChatFormat.from_tokenizer(tokenizer)
    tasks = plan_tasks([Experience.from_spec("magic:easy")], 4, 3)
    direct = rollout(ExpertBackend(chat), chat, tasks, lambda t: MagicWordEnv(), expert_rollout_config(SPEC))
    assert [s.ids for s in samples] == [t.ids for t in direct]
    for sample, traj in zip(samples, direct, strict=True):
        rendered = tokenizer.apply_chat_template(traj.messages, tokenize=False)
        assert sample.ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
        learned = [i for i, m in zip(sample.ids, sample.mask, strict=True) if m]
        assert learned == tokenizer("apple", add_special_tokens=False)["input_ids"] + chat.assistant_close_ids[:1]


def test_demonstrations_are_cached_by_what_shapes_them():
    tokenizer = tiny_tokenizer()
    first, _ = demonstrations(SPEC, tokenizer, seed=1)
    assert len(list((sft.cache_dir() / "demos").glob("*.jsonl"))) == 1
    # training settings do not shape demonstrations: the same cached file serves them
    second, _ = demonstrations(replace(SPEC, lr=0.5, epochs=9, batch_size=1), tokenizer, seed=1)
    assert len(list((sft.cache_dir() / "demos").glob("*.jsonl"))) == 1
    assert [s.ids for s in first] == [s.ids for s in second]
    demonstrations(replace(SPEC, episodes=5), tokenizer, seed=1)
    demonstrations(SPEC, tokenizer, seed=2)
    assert len(list((sft.cache_dir() / "demos").glob("*.jsonl"))) == 3


def test_a_cut_short_epoch_is_logged_once_after_resuming(base_model, tmp_path, monkeypatch):
    spec = replace(SPEC, epochs=2)
    with monkeypatch.context() as patch:
        # epoch 1's second step: its first step is logged, its checkpoint never written
        _counting_steps(patch, die_at=4)
        with pytest.raises(KeyboardInterrupt):
            train_sft(base_model, spec, tmp_path / "bc", seed=0, show_progress=False)
    train_sft(base_model, spec, tmp_path / "bc", seed=0, show_progress=False)
    log = [json.loads(line) for line in (tmp_path / "bc" / "log.jsonl").read_text().splitlines()]
    assert [(entry["epoch"], entry["step"]) for entry in log] == [(0, 1), (0, 2), (1, 3), (1, 4)]


def test_a_run_with_a_warm_start_starts_from_the_cached_model(base_model, tmp_path, cache, monkeypatch):
    from contrail.runner import run
    from contrail.seeds import derive_seed

    def experiment(out, seed=0):
        return warm_experiment(base_model, out, seed=seed)

    monkeypatch.setattr("contrail.report.write_report", lambda run_dir: [])  # the report is tested elsewhere
    result = run(experiment(tmp_path / "a"), show_progress=False)
    expected = warmstart(base_model, SPEC, seed=derive_seed(0, "warmstart"), dtype="float32")
    plan = json.loads((tmp_path / "a" / "plan.json").read_text())
    assert plan["start_model"] == str(expected)
    assert plan["warmstart"] == {"base_model": base_model, **{f.name: getattr(SPEC, f.name) for f in fields(SPEC)}}
    assert result.rows[0]["name"] == "warm-start"
    # another run of the same warm-start reuses it; another seed trains its own
    trained = []
    monkeypatch.setattr(sft, "train_sft", lambda *a, **k: trained.append(a) or (_ for _ in ()).throw(KeyError))
    run(experiment(tmp_path / "b"), show_progress=False)
    assert trained == []
    with pytest.raises(KeyError):
        run(experiment(tmp_path / "c", seed=1), show_progress=False)
    assert len(trained) == 1


def test_demonstrations_only_read_training_tasks(monkeypatch):
    from contrail.testing import MagicWordEnv

    seen_splits = set()
    original = MagicWordEnv.on_reset

    def spy(self, task):
        seen_splits.add(task.split)
        return original(self, task)

    monkeypatch.setattr(MagicWordEnv, "on_reset", spy)
    demonstrations(replace(SPEC, envs=["magic", "magic-berry"], episodes=10), tiny_tokenizer(), use_cache=False)
    assert seen_splits == {"train"}


def test_behaviour_cloning_lowers_the_loss_on_the_demonstrations(base_model, tmp_path):
    spec = replace(SPEC, episodes=8, epochs=3, batch_size=4, lr=3e-3)
    model_dir = train_sft(base_model, spec, tmp_path / "bc", seed=0, show_progress=False)
    log = [json.loads(line) for line in (tmp_path / "bc" / "log.jsonl").read_text().splitlines()]
    assert [entry["epoch"] for entry in log] == [0, 0, 1, 1, 2, 2]
    assert log[-1]["nll_per_token"] < log[0]["nll_per_token"]
    assert (model_dir / "config.json").exists()
    summary = json.loads((tmp_path / "bc" / "summary.json").read_text())
    assert summary["demonstrations"]["envs"] == ["magic:easy"] and summary["demonstrations"]["kept"] == 8


def test_row_0_is_read_back_from_the_warm_starts_cache_until_an_input_changes(base_model, tmp_path, monkeypatch):
    from contrail.evaluation import Evaluator
    from contrail.experiment import EvalSpec
    from contrail.runner import run

    def experiment(out, k=1):
        return warm_experiment(base_model, out, test_tasks=3, eval_spec=EvalSpec(k=k, drift=False))

    monkeypatch.setattr("contrail.report.write_report", lambda run_dir: [])
    played = []
    real_call = Evaluator.__call__
    monkeypatch.setattr(Evaluator, "__call__", lambda self, *a, **kw: played.append(1) or real_call(self, *a, **kw))
    first = run(experiment(tmp_path / "a"), show_progress=False)
    assert len(played) == 2  # row 0 and stage 1
    again = run(experiment(tmp_path / "b"), show_progress=False)
    assert len(played) == 3  # stage 1 only: row 0 came from the cache
    untimed = lambda row: {k: v for k, v in row.items()  # noqa: E731 - the machine's measures differ run to run
                           if k not in ("wall_seconds", "eval_seconds", "system_seconds", "peak_memory_gb")}
    assert untimed(again.rows[0]) == untimed(first.rows[0])
    row0 = lambda out: (out / "trajectories" / "stage-00.jsonl").read_text()  # noqa: E731
    assert row0(tmp_path / "b") == row0(tmp_path / "a") != ""
    run(experiment(tmp_path / "c", k=2), show_progress=False)  # another evaluation: played again
    assert len(played) == 5


def test_auto_precision_shares_the_cache_entry_of_what_it_resolves_to(base_model, monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    path = warmstart(base_model, SPEC, seed=3, dtype="float32", show_progress=False)  # SPEC trains in fp32

    def no_training(*args, **kwargs):
        raise AssertionError("auto (fp32 on this device) trained a second warm-start")

    monkeypatch.setattr(sft, "train_sft", no_training)
    assert warmstart(base_model, replace(SPEC, precision="auto"), seed=3, dtype="float32",
                     show_progress=False) == path
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)  # now bf16: another entry
    with pytest.raises(AssertionError, match="trained a second"):
        warmstart(base_model, replace(SPEC, precision="auto"), seed=3, dtype="float32", show_progress=False)
