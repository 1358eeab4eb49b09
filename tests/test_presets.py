"""Presets: the shipped ones are valid, and a name resolves along the search path with a clear miss."""

from __future__ import annotations

from pathlib import Path

import pytest

from contrail import envs, presets, strategies
from contrail.experiment import ConfigError, StrategySpec, StreamSpec, load_experiment

ROOT = Path(__file__).resolve().parent.parent


def test_the_packaged_presets_are_the_top_level_folders_in_a_checkout():
    assert presets.packaged_root() == ROOT
    assert not (ROOT / "strategies" / "__init__.py").exists() and not (ROOT / "streams" / "__init__.py").exists()
    place = presets.search_path()[-1]
    assert place.label == "packaged"
    assert {"sequential", "mixture", "curriculum", "curriculum_measured", "replay"} <= set(place.names("strategy"))
    assert {"paper5", "paper5_all", "babyai_easy_hard", "textcraft_easy_hard", "quickstart"} <= set(
        place.names("stream"))


def test_every_packaged_preset_is_valid():
    import yaml

    place = presets.search_path()[-1]
    for name in place.names("strategy"):
        spec = StrategySpec(**yaml.safe_load(place.file("strategy", name).read_text()))
        strategies.make(spec.name, **spec.options)
    for name in place.names("stream"):
        spec = StreamSpec(**yaml.safe_load(place.file("stream", name).read_text()))
        for item in spec.train + spec.test:
            envs.parse_spec(item)


def write_preset(root: Path, section: str, name: str, text: str) -> Path:
    path = root / presets.GROUPS[section] / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_search_order_preset_dir_then_env_var_then_beside_the_file_then_packaged(tmp_path, monkeypatch):
    project = tmp_path / "project"
    experiment = project / "experiments" / "exp.yaml"
    experiment.parent.mkdir(parents=True)
    experiment.write_text("stream: quickstart\n")
    first, second = tmp_path / "first", tmp_path / "second"
    monkeypatch.setenv(presets.ENV_VAR, str(second))

    def trained() -> list[str]:
        return load_experiment(experiment, preset_dirs=[first]).stream.train

    assert trained() == ["babyai:easy", "textcraft:easy"]              # packaged
    write_preset(project, "stream", "quickstart", "train: [textcraft:hard]\n")
    assert trained() == ["textcraft:hard"]                             # above the file (project/streams/)
    write_preset(project / "experiments", "stream", "quickstart", "train: [babyai:hard]\n")
    assert trained() == ["babyai:hard"]                                # beside the file
    write_preset(second, "stream", "quickstart", "train: [webshop:easy]\n")
    assert trained() == ["webshop:easy"]                               # $CONTRAIL_PRESET_PATH
    write_preset(first, "stream", "quickstart", "train: [searchqa:easy]\n")
    assert trained() == ["searchqa:easy"]                              # --preset-dir


def test_a_user_stream_can_be_named_beside_the_experiment(tmp_path):
    write_preset(tmp_path, "stream", "my_stream", "train: [textcraft:easy]\ntest_tasks: 4\n")
    write_preset(tmp_path, "strategy", "my_replay", "name: replay\noptions: {replay_share: 0.4}\n")
    experiment = tmp_path / "exp.yaml"
    experiment.write_text("stream: my_stream\nstrategy: my_replay\n")
    exp = load_experiment(experiment)
    assert exp.stream.test_tasks == 4 and exp.strategy.options == {"replay_share": 0.4}


def test_an_unknown_name_lists_what_each_place_offers(tmp_path, monkeypatch):
    mine = tmp_path / "mine"
    write_preset(mine, "stream", "alpha", "train: [textcraft:easy]\n")
    monkeypatch.delenv(presets.ENV_VAR, raising=False)
    experiment = tmp_path / "exp.yaml"
    experiment.write_text("stream: nonesuch\n")
    with pytest.raises(ConfigError) as caught:
        load_experiment(experiment, preset_dirs=[mine])
    message = str(caught.value)
    assert message.startswith(f"{experiment}: stream: unknown stream preset 'nonesuch'; ")
    assert f"--preset-dir {mine}: alpha" in message
    assert "packaged: babyai_easy_hard, paper5, " in message
    assert len(message.splitlines()) == 1


def test_a_registered_strategy_needs_no_preset_file(tmp_path):
    experiment = tmp_path / "exp.yaml"
    experiment.write_text("stream: {train: [textcraft:easy]}\nstrategy: kl_anchor\n")
    assert load_experiment(experiment).strategy == StrategySpec(name="kl_anchor")
    experiment.write_text("stream: {train: [textcraft:easy]}\nstrategy: contrail.strategies.replay:Replay\n")
    assert load_experiment(experiment).strategy == StrategySpec(name="contrail.strategies.replay:Replay")
