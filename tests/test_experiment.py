"""The Experiment: typed sections, YAML loading with presets and overrides, file/key errors, fan-out, plans."""

from __future__ import annotations

import dataclasses
import math
import random
import textwrap
from pathlib import Path

import pytest

from contrail.agent.rollout import RolloutConfig
from contrail.envs.base import Env, Step, Task, registered
from contrail.experiment import (
    ConfigError,
    EvalSpec,
    Experiment,
    ModelSpec,
    StrategySpec,
    StreamSpec,
    WarmStart,
    build_strategy,
    build_stream,
    describe_plan,
    expand_runs,
    load_experiment,
    run_label,
)
from contrail.grpo.config import GRPOConfig
from contrail.strategies import Curriculum, Replay


class TinyEnv(Env):
    """A stand-in environment with easy/hard levels and a few tasks per split; one option, ``size``."""

    difficulties = ("easy", "hard")

    def __init__(self, max_turns: int | None = None, size: int = 30) -> None:
        super().__init__(max_turns)
        self.size = size

    def instruction(self) -> str:
        return "say done"

    def tasks(self, split: str, difficulty: str | None = None) -> list[Task]:
        self.check_split(split, difficulty)
        levels = [difficulty] if difficulty else list(self.difficulties)
        offset = 0 if split == "train" else 1000
        count = self.size if split == "train" else 12
        return [Task(self.name, offset + 100 * k + i, split, level) for k, level in enumerate(levels)
                for i in range(count)]

    def on_reset(self, task: Task) -> str:
        return "go"

    def on_step(self, text: str) -> Step:
        return Step(observation="ok", reward=1.0, done=True, success=True)

    def expert(self) -> str:
        return "done"

    def random_action(self, rng: random.Random) -> str:
        return "done"


class TinyA(TinyEnv):
    pass


class TinyB(TinyEnv):
    pass


@pytest.fixture(autouse=True)
def tiny_envs():
    with registered("tiny-a", TinyA), registered("tiny-b", TinyB):
        yield


def write(tmp_path: Path, text: str, name: str = "exp.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


ROLLOUT = "rollout: {max_new_tokens: 16, max_episode_tokens: 256}"
BASIC = textwrap.dedent(f"""\
    name: basic
    stream:
      train: [tiny-a:easy, tiny-b:easy]
      test_tasks: 5
      steps_per_experience: 3
    {ROLLOUT}
    grpo: {{group_size: 2, tasks_per_step: 3, lr: 1e-6}}
    """)


def rollout(text: str) -> str:
    """BASIC with another rollout section."""
    return BASIC.replace(ROLLOUT, f"rollout: {text}")


# --- loading ---------------------------------------------------------------------------------


def test_basic_experiment_types_and_defaults(tmp_path):
    exp = load_experiment(write(tmp_path, BASIC))
    assert isinstance(exp, Experiment)
    assert exp.out == "runs/basic" and exp.seed == 0
    assert exp.stream == StreamSpec(train=["tiny-a:easy", "tiny-b:easy"], test_tasks=5, steps_per_experience=3)
    assert exp.grpo.lr == 1e-6 and isinstance(exp.grpo.lr, float) and exp.grpo.group_size == 2
    assert exp.rollout == RolloutConfig(max_new_tokens=16, max_episode_tokens=256)
    assert exp.strategy == StrategySpec() and exp.eval == EvalSpec() and exp.model == ModelSpec()
    assert exp.eval_rollout == exp.rollout  # evaluation takes the shared rollout section


def test_name_defaults_to_file_stem_and_interpolation(tmp_path):
    exp = load_experiment(write(tmp_path, "stream: {train: [tiny-a]}\nout: results/${name}-x\n", "my_exp.yaml"))
    assert exp.name == "my_exp" and exp.out == "results/my_exp-x"


def test_eval_overrides_only_what_differs(tmp_path):
    exp = load_experiment(write(tmp_path, BASIC), ["eval.temperature=0.5", "eval.max_turns=2", "rollout.top_p=0.9"])
    assert exp.eval_rollout == RolloutConfig(max_new_tokens=16, max_episode_tokens=256, temperature=0.5,
                                             top_p=0.9, max_turns=2)
    assert exp.rollout.temperature == 1.0 and exp.rollout.max_turns is None


def test_overrides(tmp_path):
    path = write(tmp_path, BASIC)
    exp = load_experiment(path, [
        "grpo.lr=2e-6",
        "strategy=replay",
        "strategy.options.replay_share=0.5",
        "stream.train=[tiny-b:hard,tiny-a:easy]",
        "rollout.max_turns=7",
        "model.warmstart.envs=[tiny-a:easy]",
        "name=renamed",
    ])
    assert exp.grpo.lr == 2e-6
    assert exp.strategy == StrategySpec(name="replay", options={"replay_share": 0.5})
    assert exp.stream.train == ["tiny-b:hard", "tiny-a:easy"] and exp.stream.test_tasks == 5
    assert exp.rollout.max_turns == 7
    assert exp.model.warmstart == WarmStart(envs=["tiny-a:easy"])
    assert exp.out == "runs/renamed"
    assert load_experiment(path, ["rollout.max_turns=null"]).rollout.max_turns is None
    assert load_experiment(path, ["grpo.max_grad_norm=null"]).grpo.max_grad_norm is None


def test_presets_by_name_mapping_and_preset_key(tmp_path):
    exp = load_experiment(write(tmp_path, "stream: {train: [tiny-a:easy, tiny-b:easy]}\nstrategy: replay\n"
                                          "model: some/hf-model\n"))
    assert exp.strategy == StrategySpec(name="replay", options={"replay_share": 0.25})
    assert exp.model.name == "some/hf-model"
    exp = load_experiment(write(tmp_path, "stream: {train: [tiny-a:easy, tiny-b:easy]}\n"
                                          "strategy: {preset: replay, options: {replay_share: 0.5}}\n"))
    assert exp.strategy == StrategySpec(name="replay", options={"replay_share": 0.5})
    exp = load_experiment(write(tmp_path, "stream: {train: [tiny-a:easy]}\nstrategy: curriculum_measured\n"))
    assert isinstance(build_strategy(exp), Curriculum) and build_strategy(exp).needs_base_success


def test_a_strategy_class_by_path_with_options(tmp_path):
    path = write(tmp_path, BASIC)
    exp = load_experiment(path, ["strategy={name: 'contrail.strategies.replay:Replay', options: {replay_share: 0.5}}"])
    strategy = build_strategy(exp)
    assert isinstance(strategy, Replay) and strategy.replay_share == 0.5 and strategy.steps_per_experience == 3
    with pytest.raises(ConfigError, match=r"override .*: strategy.options.share: unknown option of strategy "
                                          r"'contrail.strategies.replay:Replay'; valid: replay_share"):
        load_experiment(path, ["strategy={name: 'contrail.strategies.replay:Replay', options: {share: 1}}"])
    with pytest.raises(ConfigError, match=r"override .*: strategy.name: "):
        load_experiment(path, ["strategy.name=no.such.module:Nothing"])


# --- round trips: config.yaml is exactly to_yaml() ------------------------------------------------


def test_round_trip_from_yaml(tmp_path):
    exp = load_experiment(write(tmp_path, BASIC + "seeds: [0, 7]\norders: all\n"),
                          ["strategy=replay", "eval.temperature=0.25", "model.warmstart.envs=[tiny-a:easy]",
                           "stream.env_options={tiny-a: {size: 12}}"])
    text = exp.to_yaml()
    again = Experiment.from_yaml(text)
    assert again == exp
    assert again.to_yaml() == text
    (tmp_path / "config.yaml").write_text(text)
    assert Experiment.from_yaml(tmp_path / "config.yaml") == exp


def test_round_trip_from_python():
    exp = Experiment(
        name="py", seed=3,
        stream=StreamSpec(train=["tiny-a:easy", "tiny-b:hard"], test=["tiny-a:hard"], train_tasks=4,
                          env_options={"tiny-b": {"size": 5}}),
        strategy=StrategySpec(name="mixture", options={"weights": {"tiny-a:easy": 2.0, "tiny-b:hard": 1.0}}),
        model=ModelSpec(name="x/y", dtype="bfloat16", warmstart=WarmStart(envs=["tiny-a:easy"], episodes=7)),
        rollout=RolloutConfig(max_new_tokens=8, max_episode_tokens=64, top_p=0.5),
        grpo=GRPOConfig(lr=3e-6, group_size=3),
        eval=EvalSpec(k=2, temperature=0.0),
    ).check()
    assert exp.out == "runs/py"
    again = Experiment.from_yaml(exp.to_yaml())
    assert again == exp and again.eval_rollout.temperature == 0.0


def test_check_catches_what_python_construction_cannot(tmp_path):
    exp = Experiment(name="x", stream=StreamSpec(train=["nowhere:easy"]))
    with pytest.raises(ConfigError, match=r"experiment: stream.train\[0\]: unknown environment 'nowhere'"):
        exp.check()


# --- errors: file, key, valid choices --------------------------------------------------------------


@pytest.mark.parametrize("text, pattern", [
    (BASIC + "colour: red\n", r"exp.yaml: colour: unknown key; valid keys of an experiment: name, stream, strategy"),
    (BASIC.replace("lr: 1e-6", "lrr: 1e-6"), r"exp.yaml: grpo.lrr: unknown key; valid keys of grpo: lr, "),
    (BASIC + "eval: {k: 2, temp: 1}\n", r"eval.temp: unknown key; valid keys of eval: k, batch_episodes, "),
    (BASIC + "model: {warmstart: {envs: [tiny-a:easy], seed: 3}}\n", r"model.warmstart.seed: moved: set seed"),
    (BASIC.replace("lr: 1e-6", "max_new_tokens: 3"),
     r"exp.yaml: grpo.max_new_tokens: moved: set rollout.max_new_tokens"),
    (BASIC.replace("tiny-b:easy", "nope:easy"),
     r"exp.yaml: stream.train\[1\]: unknown environment 'nope'; valid: .*tiny-a"),
    (BASIC.replace("tiny-b:easy", "tiny-b:medium"),
     r"stream.train\[1\]: unknown difficulty 'medium' for tiny-b; valid: easy, hard"),
    (BASIC + "strategy: nonesuch\n",
     r"exp.yaml: strategy: unknown strategy preset 'nonesuch'; .*packaged: curriculum, "),
    (BASIC + "strategy: {name: nonesuch}\n", r"exp.yaml: strategy.name: unknown strategy 'nonesuch'; valid: "),
    (BASIC + "strategy: {name: replay, options: {share: 1}}\n",
     r"strategy.options.share: unknown option of strategy 'replay'; valid: replay_share"),
    (BASIC + "strategy: {name: replay, options: {replay_share: 2}}\n",
     r"strategy.options.replay_share: replay_share must be in \[0, 1\)"),
    (BASIC + "strategy: {name: sequential, options: {steps_per_experience: 2}}\n",
     r"strategy.options.steps_per_experience: moved: set stream.steps_per_experience"),
    (BASIC + "strategy: {name: mixture, options: {weights: {tiny-c:easy: 1}}}\n",
     r"strategy.options.weights.tiny-c:easy: not a training experience; valid: tiny-a:easy, tiny-b:easy"),
    (BASIC.replace("steps_per_experience: 3", "steps: {tiny-c:easy: 2}"),
     r"exp.yaml: stream.steps.tiny-c:easy: not a training experience; valid: tiny-a:easy, tiny-b:easy"),
    (BASIC.replace("steps_per_experience: 3", "steps: {tiny-a:easy: 0}"),
     r"exp.yaml: stream.steps.tiny-a:easy: must be an integer >= 1, got 0"),
    (BASIC.replace("steps_per_experience: 3", "test_tasks_for: {tiny-c:easy: 2}"),
     r"exp.yaml: stream.test_tasks_for.tiny-c:easy: not a test experience; valid: tiny-a:easy, tiny-b:easy"),
    (BASIC.replace("steps_per_experience: 3", "test_tasks_for: {tiny-a:easy: 0}"),
     r"exp.yaml: stream.test_tasks_for.tiny-a:easy: must be an integer >= 1, got 0"),
    (BASIC.replace("lr: 1e-6", "lr: fast"),
     r"exp.yaml: grpo.lr: expected a number, got str 'fast'"),
    (BASIC.replace("group_size: 2", "group_size: 1"), r"exp.yaml: grpo.group_size: must be >= 2"),
    (BASIC.replace("group_size: 2", "group_size: 2.5"),
     r"exp.yaml: grpo.group_size: expected an integer, got float 2.5"),
    (BASIC.replace("test_tasks: 5", "test_tasks: 0"), r"exp.yaml: stream.test_tasks: must be an integer >= 1, got 0"),
    (BASIC.replace("train: [tiny-a:easy, tiny-b:easy]", "train: tiny-a:easy"),
     r"exp.yaml: stream.train: expected a list, got str 'tiny-a:easy'"),
    (rollout("3"), r"exp.yaml: rollout: expected a mapping, got int 3"),
    ("name: x\n", r"exp.yaml: stream: missing required key"),
    (BASIC.replace("tiny-b:easy]", "{a: 1}]"), r"exp.yaml: stream.train\[1\]: must be an experience spec such as "),
    (BASIC + "seeds: [1, x]\n", r"exp.yaml: seeds\[1\]: expected an integer, got str 'x'"),
    (BASIC.replace("lr: 1e-6", "lora: maybe"), r"exp.yaml: grpo.lora: expected true or false, got str 'maybe'"),
    (BASIC.replace("lr: 1e-6", "aggregation: mean"),
     r"exp.yaml: grpo.aggregation: invalid value 'mean'; valid: token-mean"),
    (BASIC + "seeds: [1, 1]\n", r"exp.yaml: seeds: must be distinct"),
    (BASIC + "checkpoint_minutes: -1\n", r"exp.yaml: checkpoint_minutes: must be a finite number >= 0, got -1"),
    (BASIC + "checkpoint_minutes: soon\n", r"exp.yaml: checkpoint_minutes: expected a number, got str 'soon'"),
    (BASIC + "orders: some\n", r"exp.yaml: orders: must be 'all' or a non-empty list"),
    (BASIC + "orders: [[tiny-a:easy], []]\n", r"exp.yaml: orders\[1\]: must be a non-empty list"),
    (BASIC + "model: {name: m, dtype: int8}\n",
     r"model.dtype: invalid value 'int8'; valid: float32, bfloat16, float16"),
    (BASIC + "model: {warmstart: {envs: [tiny-a:easy], episodes: many}}\n",
     r"model.warmstart.episodes: expected an integer, got str 'many'"),
    (BASIC + "model: {warmstart: {envs: [tiny-a:easy], precision: fp16}}\n",
     r"model.warmstart.precision: invalid value 'fp16'; valid: auto, fp32, bf16"),
    (BASIC + "model: {warmstart: {envs: []}}\n", r"model.warmstart.envs: must name at least one environment"),
    (BASIC + "out: runs/${nope}\n", r"exp.yaml: cannot resolve an interpolation"),
    ("- a\n- b\n", r"exp.yaml: an experiment must be a mapping"),
    ("42\n", r"exp.yaml: an experiment must be a mapping"),
    # issue #15 item 4: values that used to fail only after the run folder existed
    (rollout("{max_new_tokens: 0}"), r"exp.yaml: rollout.max_new_tokens: must be an int >= 1, got 0"),
    (rollout("{top_p: 0}"), r"exp.yaml: rollout.top_p: must be in \(0, 1\], got 0"),
    (rollout("{top_p: 1.5}"), r"exp.yaml: rollout.top_p: must be in \(0, 1\], got 1.5"),
    (rollout("{max_turns: 0}"), r"exp.yaml: rollout.max_turns: must be an int >= 1, got 0"),
    (BASIC + "eval: {top_p: 2}\n", r"exp.yaml: eval.top_p: must be in \(0, 1\], got 2"),
    (BASIC.replace("lr: 1e-6", "lr: .nan"), r"exp.yaml: grpo.lr: must be a finite number, got nan"),
    (BASIC.replace("lr: 1e-6", "lr: .inf"), r"exp.yaml: grpo.lr: must be a finite number, got inf"),
    (BASIC.replace("lr: 1e-6", "lr: 0"), r"exp.yaml: grpo.lr: must be > 0, got 0.0"),
    (BASIC.replace("lr: 1e-6", "lr: -1e-6"), r"exp.yaml: grpo.lr: must be > 0, got -1e-06"),
    (BASIC.replace("lr: 1e-6", "weight_decay: -0.1"), r"exp.yaml: grpo.weight_decay: must be >= 0, got -0.1"),
    (BASIC.replace("lr: 1e-6", "lora_dropout: 1.0"), r"exp.yaml: grpo.lora_dropout: must be in \[0, 1\), got 1.0"),
    (BASIC + "model: {warmstart: {envs: [tiny-a:easy], lr: .inf}}\n",
     r"model.warmstart.lr: must be a finite number > 0, got inf"),
    (BASIC + "seed: 18446744073709551616\n", r"exp.yaml: seed: must be an integer in \[0, 2\*\*63 - 1\]"),
    (BASIC + "seed: -1\n", r"exp.yaml: seed: must be an integer in \[0, 2\*\*63 - 1\]"),
    (BASIC + "seeds: [0, 9223372036854775808]\n", r"exp.yaml: seeds\[1\]: must be an integer in \[0, 2\*\*63 - 1\]"),
    (BASIC.replace("test_tasks: 5", "task_seed: -3"), r"exp.yaml: stream.task_seed: must be an integer in"),
    (BASIC + "model: {device: banana}\n",
     r"exp.yaml: model.device: device 'banana' is not a device; valid: auto, cpu, cuda, cuda:N, mps"),
    (BASIC + "model: {device: 'cuda:99'}\n", r"exp.yaml: model.device: device 'cuda:99' is not available"),
    # issue #15 item 5: environment options
    (BASIC.replace("test_tasks: 5", "env_options: {tiny-a: {bogus_option: 1}}"),
     r"exp.yaml: stream.env_options.tiny-a.bogus_option: unknown option 'bogus_option' for tiny-a; "
     r"valid: max_turns, size"),
    (BASIC.replace("test_tasks: 5", "env_options: {tiny-a: {size: abc}}"),
     r"exp.yaml: stream.env_options.tiny-a.size: option size of tiny-a: expected int, got 'abc'"),
    (BASIC.replace("test_tasks: 5", "env_options: {nowhere: {size: 1}}"),
     r"exp.yaml: stream.env_options.nowhere: unknown environment 'nowhere'; valid: .*tiny-a"),
    (BASIC.replace("test_tasks: 5", "env_options: {tiny-a: 3}"),
     r"exp.yaml: stream.env_options.tiny-a: expected a mapping, got int 3"),
])
def test_errors_name_file_key_and_choices(tmp_path, text, pattern):
    with pytest.raises(ConfigError, match=pattern) as caught:
        load_experiment(write(tmp_path, text))
    assert len(str(caught.value).splitlines()) == 1


def test_cuda_on_a_machine_without_one_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"exp.yaml: model.device: device 'cuda' is not available: torch sees no "
                                          r"CUDA device here; valid here: auto, cpu"):
        load_experiment(write(tmp_path, BASIC + "model: {device: cuda}\n"))


def test_unreadable_files_name_the_file(tmp_path):
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe")
    with pytest.raises(ConfigError, match=r"binary.yaml: not a UTF-8 text file"):
        load_experiment(binary)
    nul = tmp_path / "nul.yaml"
    nul.write_bytes(b"name: x\x00\n")
    with pytest.raises(ConfigError, match=r"nul.yaml(:\d+)?: malformed YAML"):
        load_experiment(nul)
    with pytest.raises(ConfigError, match=r"exp.yaml:4: malformed YAML"):
        load_experiment(write(tmp_path, "name: x\nstream:\n  train: [a, b\n  test: []\n"))
    with pytest.raises(ConfigError, match="no such experiment file"):
        load_experiment(tmp_path / "missing.yaml")


@pytest.mark.parametrize("override, pattern", [
    ("grpo.lr", r"^override 'grpo.lr': expected KEY=VALUE"),
    ("=3", r"^override '=3': expected KEY=VALUE"),
    ("grpo.lrr=1e-6", r"^override 'grpo.lrr=1e-6': grpo.lrr: unknown key; valid keys of grpo: lr"),
    ("strategy=nonesuch", r"^override 'strategy=nonesuch': strategy: unknown strategy preset 'nonesuch'; "),
    ("stream=nonesuch", r"^override 'stream=nonesuch': stream: unknown stream preset 'nonesuch'; .*paper5"),
    ("grpo.group_size=1", r"^override 'grpo.group_size=1': grpo.group_size: must be >= 2"),
    ("rollout.top_p=0", r"^override 'rollout.top_p=0': rollout.top_p: must be in \(0, 1\]"),
    ("grpo.lr=nan", r"^override 'grpo.lr=nan': grpo.lr: must be a finite number, got nan$"),
    ("model.device=banana", r"^override 'model.device=banana': model.device: device 'banana' is not a device"),
    ("seed=99999999999999999999", r"^override 'seed=99999999999999999999': seed: must be an integer"),
    ("stream.env_options.tiny-a.bogus=1",
     r"^override 'stream.env_options.tiny-a.bogus=1': stream.env_options.tiny-a.bogus: unknown option"),
    ("stream.train=[tiny-a:easy,zzz:easy]",
     r"^override 'stream.train=\[tiny-a:easy,zzz:easy\]': stream.train\[1\]: unknown environment 'zzz'"),
    ("grpo.lr.x=1", r"^override 'grpo.lr.x=1': grpo.lr is 1e-06, not a section"),
    ("eval.k=[1,", r"^override 'eval.k=\[1,': cannot parse the value"),
])
def test_bad_overrides_name_the_override_not_the_file(tmp_path, override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_experiment(write(tmp_path, BASIC), [override])


def test_a_file_mistake_is_still_the_file_s_with_overrides_elsewhere(tmp_path):
    with pytest.raises(ConfigError, match=r"exp.yaml: rollout.top_p: must be in"):
        load_experiment(write(tmp_path, rollout("{top_p: 3}")), ["grpo.lr=1e-5", "rollout.max_turns=2"])


def test_errors_inside_a_preset_name_the_preset_file(tmp_path):
    presets = tmp_path / "mine"
    (presets / "streams").mkdir(parents=True)
    (presets / "strategies").mkdir()
    (presets / "streams" / "broken.yaml").write_text("train: [tiny-a:easy]\ntest_taks: 3\n")
    (presets / "streams" / "ok.yaml").write_text("train: [tiny-a:easy]\n")
    (presets / "strategies" / "odd.yaml").write_text("name: replay\noptions: {replay_share: 3}\n")
    with pytest.raises(ConfigError, match=r"mine/streams/broken.yaml \(preset 'broken' named in .*exp.yaml\): "
                                          r"stream.test_taks: unknown key; valid keys of stream: train, test"):
        load_experiment(write(tmp_path, "stream: broken\n"), preset_dirs=[presets])
    with pytest.raises(ConfigError, match=r"odd.yaml \(preset 'odd' named in override 'strategy=odd'\): "
                                          r"strategy.options.replay_share: replay_share must be in"):
        load_experiment(write(tmp_path, BASIC), ["strategy=odd"], preset_dirs=[presets])
    # a key the experiment sets beside `preset:` is the experiment file's
    with pytest.raises(ConfigError, match=r"exp.yaml: stream.test_tasks: expected an integer or null, got str 'x'"):
        load_experiment(write(tmp_path, "stream: {preset: ok, test_tasks: x}\n"), preset_dirs=[presets])


# --- labels and fan-out --------------------------------------------------------------------------


def test_run_label_has_every_strategy_option_and_never_the_seed(tmp_path):
    path = write(tmp_path, BASIC)
    half = load_experiment(path, ["strategy=replay", "strategy.options.replay_share=0.5"])
    quarter = load_experiment(path, ["strategy=replay"])
    assert run_label(half) != run_label(quarter)
    assert "replay_share=0.5" in run_label(half) and "steps_per_experience=3" in run_label(half)
    # the default spelled out and the default implied are one setting; the seed is not part of it
    implied = load_experiment(path, ["strategy={name: replay}", "seed=9"])
    assert run_label(implied) == run_label(quarter)
    assert run_label(quarter) == "replay(replay_share=0.25, steps_per_experience=3): tiny-a:easy → tiny-b:easy"
    labels = {r.label for r in expand_runs(load_experiment(path, ["strategy=replay", "seeds=[1,2]"]))}
    assert labels == {run_label(quarter)}


def test_run_label_shows_each_experiences_budget_when_stream_steps_sets_one(tmp_path):
    path = write(tmp_path, BASIC)
    budgets = load_experiment(path, ["stream.steps={tiny-a:easy: 6}"])
    # the stream's budgets, not the strategy's default, are what the stages train
    assert run_label(budgets) == "sequential(steps={tiny-a:easy: 6, tiny-b:easy: 3}): tiny-a:easy → tiny-b:easy"
    assert run_label(load_experiment(path, ["stream.steps={tiny-a:easy: 4}"])) != run_label(budgets)


def test_orders_all_with_seeds(tmp_path):
    exp = load_experiment(write(tmp_path, BASIC + "seeds: [0, 1]\norders: all\n"),
                          ["stream.train=[tiny-a:easy,tiny-b:easy,tiny-a:hard]"])
    runs = expand_runs(exp)
    assert len(runs) == 6 * 2 and len({r.out for r in runs}) == 12
    assert runs[0].out == "runs/basic/tiny-a-easy__tiny-b-easy__tiny-a-hard/seed0"
    assert [r.seed for r in runs[:2]] == [0, 1]
    assert all(r.seeds is None and r.orders is None for r in runs)
    assert {tuple(r.stream.test) for r in runs} == {("tiny-a:easy", "tiny-b:easy", "tiny-a:hard")}
    assert runs[0].label == runs[1].label
    assert len({r.label for r in runs}) == 6
    assert all(Experiment.from_yaml(r.to_yaml()) == r for r in runs[:2])


def test_explicit_orders_and_single_run(tmp_path):
    exp = load_experiment(write(tmp_path, BASIC + "orders: [[tiny-a:easy], [tiny-b:hard]]\nlabel: one-env\n"))
    runs = expand_runs(exp)
    assert [r.stream.train for r in runs] == [["tiny-a:easy"], ["tiny-b:hard"]]
    assert [r.stream.test for r in runs] == [["tiny-a:easy", "tiny-b:hard"]] * 2
    assert [r.out for r in runs] == ["runs/basic/tiny-a-easy", "runs/basic/tiny-b-hard"]
    assert runs[0].label == "one-env: tiny-a:easy"
    seeds = expand_runs(load_experiment(write(tmp_path, BASIC + "seeds: [3, 4]\n")))
    assert [r.out for r in seeds] == ["runs/basic/seed3", "runs/basic/seed4"]


# --- building and describing ----------------------------------------------------------------------


def test_build_stream_and_strategy(tmp_path):
    exp = load_experiment(write(tmp_path, BASIC), ["strategy=replay",
                                                    "stream.test=[tiny-a:easy,tiny-b:easy,tiny-b:hard]",
                                                    "stream.train_tasks=10", "stream.env_options={tiny-b: {size: 4}}"])
    stream = build_stream(exp)
    assert [e.name for e in stream.train] == ["tiny-a:easy", "tiny-b:easy"]
    assert [len(e.test_tasks) for e in stream.test] == [5, 5, 5]
    assert [len(e.train_tasks) for e in stream.train] == [10, 4]  # tiny-b has only 4 train tasks per level
    strategy = build_strategy(exp)
    assert isinstance(strategy, Replay) and strategy.steps_per_experience == 3


@pytest.mark.parametrize("strategy", ["sequential", "replay", "mixture"])
def test_per_experience_steps_override_the_streams_budget(tmp_path, strategy):
    exp = load_experiment(write(tmp_path, BASIC.replace("steps_per_experience: 3",
                                                        "steps_per_experience: 3\n  steps: {tiny-a:easy: 5}")),
                          [f"strategy={strategy}"])
    assert [e.steps for e in build_stream(exp).train] == [5, 3]
    text = describe_plan(exp)
    if strategy == "mixture":  # one stage, the experiences' budgets summed
        assert "stage 1 mixture: 8 steps" in text
    else:
        assert "stage 1 tiny-a:easy: 5 steps" in text and "stage 2 tiny-b:easy: 3 steps" in text


def test_per_experience_test_tasks_override_the_streams_count(tmp_path):
    exp = load_experiment(write(tmp_path, BASIC.replace("steps_per_experience: 3",
                                                        "steps_per_experience: 3\n  test_tasks_for: {tiny-b:easy: 2}")))
    stream = build_stream(exp)
    assert [len(e.test_tasks) for e in stream.test] == [5, 2]
    plain = build_stream(load_experiment(write(tmp_path, BASIC)))
    assert stream.test[0].test_tasks == plain.test[0].test_tasks  # the others keep stream.test_tasks
    assert "tiny-a:easy 5 tasks (trained in stage 1); tiny-b:easy 2 tasks" in describe_plan(exp)


def test_describe_plan(tmp_path):
    exp = load_experiment(write(tmp_path, BASIC + "seeds: [0, 1]\n"),
                          ["strategy=mixture", "eval.k=3", "eval.temperature=0.5",
                           "stream.test=[tiny-a:easy,tiny-b:easy,tiny-a:hard]"])
    text = describe_plan(exp)
    assert "experiment basic: 2 run(s)" in text
    assert "rollouts: 16 tokens/turn, 256 tokens/episode, temperature 1" in text
    assert "evaluation: 16 tokens/turn, 256 tokens/episode, temperature 0.5" in text
    assert "run 2/2: mixture(" in text and "out runs/basic/seed1, seed 1" in text
    assert "stage 1 mixture: 6 steps × 3 tasks × group 2 = 36 rollouts" in text
    assert "tiny-a:easy 0.50 (30 train tasks), tiny-b:easy 0.50 (30 train tasks)" in text
    assert ("k=3: tiny-a:easy 5 tasks (trained in stage 1); tiny-b:easy 5 tasks (trained in stage 1); "
            "tiny-a:hard 5 tasks (held out)") in text
    assert "evaluation total: 90 episodes" in text  # 2 rows × 15 tasks × k 3
    measured = describe_plan(load_experiment(write(tmp_path, BASIC), ["strategy=curriculum_measured"]))
    assert "measured success" in measured


def test_sections_validate_when_built_in_python():
    with pytest.raises(ValueError, match="precision must be one of auto, fp32, bf16"):
        WarmStart(envs=["tiny-a"], precision="fp16")
    with pytest.raises(ValueError, match="device: device 'gpu' is not a device"):
        ModelSpec(device="gpu")
    with pytest.raises(ValueError, match="eval.max_new_tokens must be an int >= 1"):
        Experiment(name="x", stream=StreamSpec(train=["tiny-a"]), eval=EvalSpec(max_new_tokens=0))
    with pytest.raises(ValueError, match="env_options.tiny-a must be a mapping of option: value, got 3"):
        StreamSpec(train=["tiny-a"], env_options={"tiny-a": 3})
    with pytest.raises(ValueError, match="options must be a mapping"):
        StrategySpec(options=[1])
    with pytest.raises(ValueError, match="lr must be a finite number > 0, got nan"):
        dataclasses.replace(WarmStart(envs=["a"]), lr=math.nan)


@pytest.mark.parametrize(("epochs", "said"), [(1, "1 epoch, lr"), (2, "2 epochs, lr")])
def test_describe_plan_counts_the_warm_starts_epochs(tmp_path, epochs, said):
    exp = load_experiment(write(tmp_path, BASIC),
                          [f"model.warmstart={{envs: [tiny-a:easy], episodes: 4, epochs: {epochs}}}"])
    assert said in describe_plan(exp)
