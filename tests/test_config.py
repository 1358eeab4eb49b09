"""Experiment configs: presets, overrides, errors that name file/key/choices, fan-out, dry-run plans."""

import dataclasses
import textwrap
from pathlib import Path

import pytest

from contrail import envs
from contrail.config import (
    ConfigError,
    EnvUnavailableError,
    ExperimentConfig,
    StreamConfig,
    WarmStartConfig,
    expand_runs,
    load_experiment,
    preset_names,
    to_dict,
)
from contrail.envs import base
from contrail.envs.base import Env, Step, Task, register
from contrail.experiment import build_strategy, build_stream, describe_plan, to_plan_json
from contrail.strategies import Curriculum, Replay, Sequential

EXPERIMENTS = sorted((Path(__file__).parent.parent / "experiments").glob("*.yaml"))


class TinyEnv(Env):
    """A stand-in environment with easy/hard levels and a few tasks per split."""

    name = "tiny-a"
    difficulties = ("easy", "hard")

    def instruction(self):
        return "say done"

    def tasks(self, split, difficulty=None):
        self.check_split(split, difficulty)
        levels = [difficulty] if difficulty else list(self.difficulties)
        offset = 0 if split == "train" else 1000
        return [Task(self.name, offset + 100 * k + i, split, level)
                for k, level in enumerate(levels) for i in range(30 if split == "train" else 12)]

    def reset(self, task):
        return "go"

    def step(self, text):
        return Step("ok", 1.0, True, True)

    def expert(self):
        return "done"


@register("tiny-a")
class TinyA(TinyEnv):
    name = "tiny-a"


@register("tiny-b")
class TinyB(TinyEnv):
    name = "tiny-b"


def write(tmp_path, text, name="exp.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


BASIC = textwrap.dedent("""\
    name: basic
    stream:
      train: [tiny-a:easy, tiny-b:easy]
      test_tasks: 5
      steps_per_experience: 3
    grpo: {group_size: 2, tasks_per_step: 3, lr: 1e-6}
    """)


# --- loading and presets -----------------------------------------------------------------


def test_basic_experiment_types_and_defaults(tmp_path):
    cfg = load_experiment(write(tmp_path, BASIC))
    assert isinstance(cfg, ExperimentConfig)
    assert cfg.out == "runs/basic" and cfg.seed == 0
    assert cfg.stream == StreamConfig(train=["tiny-a:easy", "tiny-b:easy"], test_tasks=5, steps_per_experience=3)
    assert cfg.grpo.lr == 1e-6 and isinstance(cfg.grpo.lr, float) and cfg.grpo.group_size == 2
    assert cfg.strategy.name == "sequential" and cfg.eval.k == 4 and cfg.model.name == "smollm2-135m"
    assert to_dict(cfg)["grpo"]["tasks_per_step"] == 3


def test_name_defaults_to_file_stem_and_interpolation(tmp_path):
    cfg = load_experiment(write(tmp_path, "stream: {train: [tiny-a]}\nout: results/${name}-x\n", "my_exp.yaml"))
    assert cfg.name == "my_exp" and cfg.out == "results/my_exp-x"


def test_presets_by_name_mapping_and_preset_key(tmp_path):
    cfg = load_experiment(write(tmp_path, """\
        stream: {train: [tiny-a:easy, tiny-b:easy]}
        strategy: replay
        model: some/hf-model
        """))
    assert cfg.strategy.name == "replay" and cfg.strategy.options == {"replay_share": 0.25}
    assert cfg.model.name == "some/hf-model"
    cfg = load_experiment(write(tmp_path, """\
        stream: {train: [tiny-a:easy, tiny-b:easy]}
        strategy: {preset: replay, options: {replay_share: 0.5}}
        """))
    assert cfg.strategy.name == "replay" and cfg.strategy.options == {"replay_share": 0.5}
    cfg = load_experiment(write(tmp_path, """\
        stream: {train: [tiny-a:easy, tiny-b:easy]}
        strategy: {name: curriculum, options: {by: measured}}
        """))
    assert isinstance(build_strategy(cfg), Curriculum) and build_strategy(cfg).needs_base_success


def test_every_preset_is_valid():
    assert {"sequential", "mixture", "curriculum", "curriculum_measured", "replay"} <= set(preset_names("strategy"))
    assert {"paper5", "babyai_easy_hard", "textcraft_easy_hard", "quickstart"} <= set(preset_names("stream"))
    from contrail.config import _preset
    import contrail.strategies as strategies

    for name in preset_names("strategy"):
        data, _ = _preset("strategy", name, "test", "strategy")
        strategies.make(data["name"], **data.get("options", {}))
    for name in preset_names("stream"):
        data, _ = _preset("stream", name, "test", "stream")
        StreamConfig(**data)
        for spec in data["train"] + data.get("test", []):
            assert spec.partition(":")[0] in envs.names()


def test_overrides(tmp_path):
    path = write(tmp_path, BASIC)
    cfg = load_experiment(path, [
        "grpo.lr=2e-6",
        "strategy=replay",
        "strategy.options.replay_share=0.5",
        "stream.train=[tiny-b:hard,tiny-a:easy]",
        "eval.max_turns=7",
        "model.warmstart.envs=[tiny-a:easy]",
        "name=renamed",
    ])
    assert cfg.grpo.lr == 2e-6
    assert cfg.strategy.name == "replay" and cfg.strategy.options == {"replay_share": 0.5}
    assert cfg.stream.train == ["tiny-b:hard", "tiny-a:easy"] and cfg.stream.test_tasks == 5
    assert cfg.eval.max_turns == 7
    assert cfg.model.warmstart == WarmStartConfig(envs=["tiny-a:easy"])
    assert cfg.out == "runs/renamed"
    assert load_experiment(path, ["eval.max_turns=null"]).eval.max_turns is None
    assert load_experiment(path, ["grpo.max_grad_norm=null"]).grpo.max_grad_norm is None


def test_seed_drives_grpo_seed(tmp_path):
    cfg = load_experiment(write(tmp_path, BASIC), ["seed=5"])
    assert cfg.grpo.seed == 5
    with pytest.raises(ConfigError, match="grpo.seed: set the top-level seed"):
        load_experiment(write(tmp_path, BASIC), ["grpo.seed=1"])


# --- errors: file, key, valid choices ----------------------------------------------------


@pytest.mark.parametrize(
    "text, pattern",
    [
        (BASIC + "colour: red\n", r"exp.yaml: colour: unknown key; valid keys of the experiment: name, out, seed"),
        (BASIC.replace("lr: 1e-6", "lrr: 1e-6"), r"exp.yaml: grpo.lrr: unknown key; valid keys of grpo: lr, weight_decay"),
        (BASIC + "eval: {k: 2, temp: 1}\n", r"eval.temp: unknown key; valid keys of eval: k, max_new_tokens"),
        (BASIC.replace("tiny-b:easy", "nope:easy"), r"exp.yaml: stream.train\[1\]: unknown environment 'nope'; valid: .*tiny-a"),
        (BASIC.replace("tiny-b:easy", "tiny-b:medium"), r"stream.train\[1\]: unknown difficulty 'medium' for tiny-b; valid: easy, hard"),
        (BASIC + "strategy: nonesuch\n", r"exp.yaml: strategy: unknown strategy preset 'nonesuch'; valid presets: curriculum, .*replay"),
        (BASIC + "strategy: {name: nonesuch}\n", r"strategy.name: unknown strategy 'nonesuch'; valid: curriculum, mixture"),
        (BASIC + "strategy: {name: replay, options: {share: 1}}\n", r"strategy.options.share: unknown option of strategy 'replay'; valid: replay_share"),
        (BASIC + "strategy: {name: replay, options: {replay_share: 2}}\n", r"strategy.options: replay_share must be in \[0, 1\)"),
        (BASIC + "strategy: {name: sequential, options: {steps_per_experience: 2}}\n", r"strategy.options.steps_per_experience: set stream.steps_per_experience instead"),
        (BASIC + "strategy: {name: mixture, options: {weights: {tiny-c:easy: 1}}}\n", r"strategy.options.weights.tiny-c:easy: not a training experience; valid: tiny-a:easy, tiny-b:easy"),
        (BASIC.replace("lr: 1e-6", "lr: fast"), r"exp.yaml: grpo.lr: expected a number, got str 'fast'"),
        (BASIC.replace("group_size: 2", "group_size: 1"), r"exp.yaml: grpo.group_size: group_size must be >= 2"),
        (BASIC.replace("group_size: 2", "group_size: 2.5"), r"grpo.group_size: expected an integer, got float 2.5"),
        (BASIC.replace("test_tasks: 5", "test_tasks: 0"), r"stream.test_tasks: test_tasks must be >= 1"),
        (BASIC.replace("train: [tiny-a:easy, tiny-b:easy]", "train: tiny-a:easy"), r"stream.train: expected a list of a string, got str"),
        (BASIC + "stream.extra: 1\n", r"stream.extra: unknown key; valid keys of the experiment"),
        ("name: x\n", r"exp.yaml: stream: missing required key"),
        (BASIC + "seeds: [1, 1]\n", r"exp.yaml: seeds: seeds must be distinct"),
        (BASIC + "orders: some\n", r"orders: orders must be 'all' or a list"),
        (BASIC + "model: {name: m, dtype: int8}\n", r"model.dtype: dtype must be one of float32, bfloat16, float16"),
        (BASIC + "model: {warmstart: {envs: [tiny-a:easy], episodes: many}}\n", r"model.warmstart.episodes: expected an integer"),
        (BASIC + "out: runs/${nope}\n", r"exp.yaml: cannot resolve an interpolation"),
        ("- a\n- b\n", r"exp.yaml: an experiment must be a mapping"),
    ],
)
def test_errors_name_file_key_and_choices(tmp_path, text, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_experiment(write(tmp_path, text))


def test_malformed_yaml_names_file_and_line(tmp_path):
    path = write(tmp_path, "name: x\nstream:\n  train: [a, b\n  test: []\n")
    with pytest.raises(ConfigError, match=r"exp.yaml:4: malformed YAML"):
        load_experiment(path)
    with pytest.raises(ConfigError, match="no such experiment file"):
        load_experiment(tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    "override, pattern",
    [
        ("grpo.lr", r"override 'grpo.lr': expected KEY=VALUE"),
        ("=3", r"override '=3': expected KEY=VALUE"),
        ("grpo.lrr=1e-6", r"override 'grpo.lrr=1e-6': grpo.lrr: unknown key; valid keys of grpo: lr"),
        ("strategy=nonesuch", r"override 'strategy=nonesuch': strategy: unknown strategy preset 'nonesuch'; valid presets"),
        ("stream=nonesuch", r"stream: unknown stream preset 'nonesuch'; valid presets: .*paper5"),
        ("grpo.group_size=1", r"override 'grpo.group_size=1': grpo.group_size: group_size must be >= 2"),
        ("stream.train=[tiny-a:easy,zzz:easy]", r"override 'stream.train=\[tiny-a:easy,zzz:easy\]': stream.train\[1\]: unknown environment 'zzz'"),
        ("grpo.lr.x=1", r"override 'grpo.lr.x=1': grpo.lr is 1e-06, not a section"),
        ("eval.k=[1,", r"override 'eval.k=\[1,': cannot parse the value"),
    ],
)
def test_bad_overrides_name_the_override(tmp_path, override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_experiment(write(tmp_path, BASIC), [override])


def test_errors_inside_a_preset_name_the_preset_file(tmp_path, monkeypatch):
    presets = tmp_path / "presets"
    (presets / "streams").mkdir(parents=True)
    (presets / "strategies").mkdir()
    (presets / "streams" / "broken.yaml").write_text("train: [tiny-a:easy]\ntest_taks: 3\n")
    (presets / "streams" / "ok.yaml").write_text("train: [tiny-a:easy]\n")
    (presets / "strategies" / "odd.yaml").write_text("name: replay\noptions: {replay_share: 3}\n")
    monkeypatch.setattr("contrail.config.PRESETS", presets)
    with pytest.raises(ConfigError, match=r"presets/streams/broken.yaml \(preset 'broken' named in .*exp.yaml\): "
                                          r"stream.test_taks: unknown key; valid keys of stream: train, test"):
        load_experiment(write(tmp_path, "stream: broken\n"))
    with pytest.raises(ConfigError, match=r"odd.yaml \(preset 'odd' named in override 'strategy=odd'\): "
                                          r"strategy.options: replay_share must be in"):
        load_experiment(write(tmp_path, BASIC), ["strategy=odd"])
    # a key the experiment sets next to `preset:` is reported against the experiment file
    with pytest.raises(ConfigError, match=r"exp.yaml: stream.test_tasks: expected an integer"):
        load_experiment(write(tmp_path, "stream: {preset: ok, test_tasks: x}\n"))


# --- orders and seeds -------------------------------------------------------------------


def test_orders_all_with_seeds(tmp_path):
    cfg = load_experiment(write(tmp_path, BASIC + "seeds: [0, 1]\norders: all\n"),
                          ["stream.train=[tiny-a:easy,tiny-b:easy,tiny-a:hard]"])
    runs = expand_runs(cfg)
    assert len(runs) == 6 * 2
    assert len({r.out for r in runs}) == 12
    assert runs[0].out == "runs/basic/tiny-a-easy__tiny-b-easy__tiny-a-hard/seed0"
    assert [r.seed for r in runs[:2]] == [0, 1] and [r.grpo.seed for r in runs[:2]] == [0, 1]
    assert all(r.seeds is None and r.orders is None for r in runs)
    # every run tests the same experiences in the same order
    assert {tuple(r.stream.test) for r in runs} == {("tiny-a:easy", "tiny-b:easy", "tiny-a:hard")}
    # seeds of one order share a label; orders differ
    assert runs[0].label == runs[1].label == "sequential: tiny-a:easy → tiny-b:easy → tiny-a:hard"
    assert len({r.label for r in runs}) == 6


def test_explicit_orders_and_single_run(tmp_path):
    cfg = load_experiment(write(tmp_path, BASIC + "orders: [[tiny-a:easy], [tiny-b:hard]]\nlabel: one-env\n"))
    runs = expand_runs(cfg)
    assert [r.stream.train for r in runs] == [["tiny-a:easy"], ["tiny-b:hard"]]
    assert [r.stream.test for r in runs] == [["tiny-a:easy", "tiny-b:hard"]] * 2
    assert [r.out for r in runs] == ["runs/basic/tiny-a-easy", "runs/basic/tiny-b-hard"]
    assert runs[0].label == "one-env: tiny-a:easy"
    (single,) = expand_runs(load_experiment(write(tmp_path, BASIC), ["strategy=replay"]))
    assert single.out == "runs/basic" and single.label == "replay(replay_share=0.25): tiny-a:easy → tiny-b:easy"
    seeds = expand_runs(load_experiment(write(tmp_path, BASIC + "seeds: [3, 4]\n")))
    assert [r.out for r in seeds] == ["runs/basic/seed3", "runs/basic/seed4"]


# --- building and describing -------------------------------------------------------------


def test_build_stream_strategy_and_plan_json(tmp_path):
    cfg = load_experiment(write(tmp_path, BASIC), ["strategy=replay", "stream.test=[tiny-a:easy,tiny-b:easy,tiny-b:hard]",
                                                   "stream.train_tasks=10", "seed=2"])
    stream = build_stream(cfg)
    assert [e.name for e in stream.train] == ["tiny-a:easy", "tiny-b:easy"]
    assert [len(e.test_tasks) for e in stream.test] == [5, 5, 5]
    assert all(len(e.train_tasks) == 10 and e.steps == 3 for e in stream.train)
    strategy = build_strategy(cfg)
    assert isinstance(strategy, Replay) and strategy.seed == 2 and strategy.steps_per_experience == 3
    stages = strategy.plan(stream)
    plan = to_plan_json(stream, stages, start_model="smollm2-135m", warmstart=WarmStartConfig(envs=["tiny-a:easy"]))
    assert plan["test"] == ["tiny-a:easy", "tiny-b:easy", "tiny-b:hard"]
    assert plan["trained_at"] == [1, 2, None]
    assert plan["stages"][1] == {"index": 2, "name": "tiny-b:easy", "experiences": ["tiny-b:easy"], "steps": 3,
                                 "weights": {"tiny-b:easy": 0.75, "tiny-a:easy": 0.25}}
    assert plan["start_model"] == "smollm2-135m" and plan["warmstart"]["envs"] == ["tiny-a:easy"]


def test_describe_plan(tmp_path):
    cfg = load_experiment(write(tmp_path, BASIC + "seeds: [0, 1]\n"), ["strategy=mixture", "eval.k=3",
                                                                            "stream.test=[tiny-a:easy,tiny-b:easy,tiny-a:hard]"])
    text = describe_plan(cfg)
    assert "experiment basic: 2 run(s)" in text
    assert "run 2/2: mixture: tiny-a:easy → tiny-b:easy" in text and "out runs/basic/seed1, seed 1" in text
    assert "stage 1 mixture: 6 steps × 3 tasks × group 2 = 36 rollouts" in text
    assert "tiny-a:easy 0.50 (30 train tasks), tiny-b:easy 0.50 (30 train tasks)" in text
    assert "k=3: tiny-a:easy 5 tasks (trained in stage 1); tiny-b:easy 5 tasks (trained in stage 1); " \
           "tiny-a:hard 5 tasks (held out)" in text
    assert "evaluation total: 90 episodes" in text  # 2 rows × 15 tasks × k 3
    measured = describe_plan(load_experiment(write(tmp_path, BASIC), ["strategy=curriculum_measured"]))
    assert "measured success" in measured


# --- the shipped experiment files ------------------------------------------------------------


def _stand_ins(monkeypatch):
    """Register tiny stand-ins for built-in environments that cannot load here."""
    replaced = []
    for name in envs.names():
        try:
            envs.make(name).close()
        except ImportError:  # a module or an optional extra (alfworld's engine) is missing
            cls = type(f"StandIn_{name}", (TinyEnv,), {"name": name})
            monkeypatch.setitem(base._REGISTRY, name, cls)
            replaced.append(name)
    return replaced


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.name)
def test_experiment_files_plan_with_stand_ins(path, monkeypatch):
    """Every shipped experiment validates and plans (environments that cannot load here are stood in for)."""
    _stand_ins(monkeypatch)
    cfg = load_experiment(path)
    text = describe_plan(cfg)
    runs = expand_runs(cfg)
    assert f"{len(runs)} run(s)" in text and "stage 1" in text
    for run in runs:
        assert build_strategy(run).plan(build_stream(run), {s: 0.0 for s in run.stream.train})


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.name)
def test_experiment_files_plan_with_real_environments(path):
    try:
        describe_plan(load_experiment(path))
    except (EnvUnavailableError, ImportError) as error:  # an environment's optional extra is not installed
        pytest.skip(str(error))


def test_shipped_experiments_cover_the_brief():
    names = {p.stem for p in EXPERIMENTS}
    assert {"quickstart", "within_env_babyai", "within_env_curriculum", "across_envs", "sequential_all",
            "mixture_all", "replay_all", "ordering_ablation"} <= names


def test_quickstart_is_small_and_paper_scale_uses_agentgym_settings(monkeypatch):
    _stand_ins(monkeypatch)
    root = EXPERIMENTS[0].parent
    quick = load_experiment(root / "quickstart.yaml")
    assert quick.model.name == "smollm2-135m" and quick.model.device == "cpu" and quick.model.warmstart
    assert quick.stream.train == ["babyai:easy", "textcraft:easy"] and quick.stream.test_tasks <= 8
    assert (quick.grpo.group_size, quick.grpo.tasks_per_step, quick.stream.steps_per_experience) == (4, 2, 2)
    assert quick.eval.k == 2
    ablation = load_experiment(root / "ordering_ablation.yaml")
    assert len(expand_runs(ablation)) == 6 * 3
    for name in ("sequential_all", "mixture_all", "replay_all", "across_envs", "within_env_babyai"):
        cfg = load_experiment(root / f"{name}.yaml")
        g = cfg.grpo
        assert (g.lr, g.group_size, g.tasks_per_step, g.clip_high, g.beta, g.max_episode_tokens) == (
            1e-6, 8, 16, 0.28, 1e-3, 4096)
        assert g.gradient_checkpointing and cfg.model.dtype == "bfloat16" and cfg.model.device == "cuda"
    across = expand_runs(load_experiment(root / "across_envs.yaml"))
    assert [len(r.stream.train) for r in across] == [1] * 5 and all(len(r.stream.test) == 5 for r in across)


def test_sequential_and_dataclass_round_trip(tmp_path):
    cfg = load_experiment(write(tmp_path, BASIC))
    assert isinstance(build_strategy(cfg), Sequential)
    again = dataclasses.replace(cfg)
    assert to_dict(again) == to_dict(cfg)
