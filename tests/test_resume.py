"""Resuming after a kill at any moment reproduces the uninterrupted run exactly (issue #15, items 1 and 9).

Each case kills a two-stage sequential run at one moment (a `Killed`
exception raised from a patched public function, which unwinds like a kill:
nothing after that point runs), then `run(..., resume=True)` finishes it.
The resumed run must match an uninterrupted one: every row (timings aside),
the evaluation trajectories, the final weights, and the GRPO log with each
step exactly once. The reference rows all differ from each other (lr is
high), so a resume that ignored a checkpoint and retrained from an earlier
model would be caught.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from contrail import drift, evaluation
from contrail.agent.rollout import RolloutConfig
from contrail.experiment import EvalSpec, Experiment, ModelSpec, StrategySpec, StreamSpec
from contrail.grpo.config import GRPOConfig
from contrail.grpo.trainer import GRPOTrainer
from contrail.results import RunDir, RunExistsError
from contrail.runner import run
from contrail.strategies import Sequential
from contrail.testing import save_tiny_model


class Killed(BaseException):
    """Stands for SIGKILL: not an Exception, so nothing on the way up handles it."""


@pytest.fixture(scope="module", autouse=True)
def fast(tmp_path_factory):
    """One torch thread (tiny models run faster on a shared machine) and a quick report writer.

    The report itself is tested elsewhere; here only whether the runner (re)writes it matters, and the
    real one (heatmaps) would take most of each case's time.
    """
    import contrail.report

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    real = contrail.report.write_report

    def quick_report(run_dir):
        path = Path(run_dir) / "report.md"
        path.write_text(f"{len(RunDir(run_dir).rows())} rows\n")
        return [path]

    contrail.report.write_report = quick_report
    yield
    contrail.report.write_report = real
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def experiment(base_model, out, strategy="sequential", beta=0.0, checkpoint_minutes=0.0, lora=False) -> Experiment:
    """The two-stage run every case kills; by default it checkpoints after every step within a stage too."""
    return Experiment(
        name="resume",
        stream=StreamSpec(train=["magic:easy", "magic-berry:easy"], train_tasks=8, test_tasks=4,
                          steps_per_experience=2),
        strategy=StrategySpec(name=strategy),
        model=ModelSpec(name=base_model, dtype="float32", device="cpu"),
        rollout=RolloutConfig(max_new_tokens=3, max_episode_tokens=256),
        grpo=GRPOConfig(lr=3e-2, group_size=8, tasks_per_step=2, beta=beta, lora=lora),
        eval=EvalSpec(k=2),
        seed=1,  # a seed whose random-model rollouts make every reference row differ
        out=str(out),
        checkpoint_minutes=checkpoint_minutes,
    )


@pytest.fixture(scope="module")
def reference(base_model, tmp_path_factory):
    """The uninterrupted run."""
    out = tmp_path_factory.mktemp("reference") / "run"
    run(experiment(base_model, out), show_progress=False)
    return out


# --- what must be identical -----------------------------------------------------------------


def _timeless(value):
    """``value`` without the machine's measures: times and peak memory (the only things a resumed run may change)."""
    if isinstance(value, dict):
        return {k: _timeless(v) for k, v in value.items() if "seconds" not in k and k != "peak_memory_gb"}
    if isinstance(value, list):
        return [_timeless(v) for v in value]
    return value


def snapshot(out) -> dict:
    log = [json.loads(line) for line in (out / "grpo_log.jsonl").read_text().splitlines()]
    return {
        "rows": _timeless(RunDir(out).rows()),
        "plan": json.loads((out / "plan.json").read_text()),
        "trajectories": {p.name: p.read_text() for p in sorted((out / "trajectories").iterdir())},
        "drift_samples": (out / "drift-start.json").read_text(),
        "log": _timeless(log),
        "checkpoints": sorted(p.name for p in (out / "checkpoints").iterdir()),
        "trainer_states": sorted(p.parent.name for p in (out / "checkpoints").glob("*/trainer_state.pt")),
        "finished": (out / "FINISHED").is_file(),
        "report": (out / "report.md").read_text() if (out / "report.md").is_file() else None,
    }


def final_weights(out) -> dict[str, torch.Tensor]:
    """The last stage's weights (a LoRA run's adapter)."""
    (path,) = (out / "checkpoints" / "stage-02" / "model").glob("*.safetensors")
    return load_file(path)


def assert_same_run(out, reference) -> None:
    got, want = snapshot(out), snapshot(reference)
    assert [entry["step"] for entry in got["log"]] == [1, 2, 3, 4]  # every GRPO step logged once
    for key in want:
        assert got[key] == want[key], key
    weights, expected = final_weights(out), final_weights(reference)
    assert weights.keys() == expected.keys()
    for name in expected:
        assert torch.equal(weights[name], expected[name]), name


def test_the_reference_rows_all_differ(reference):
    """Otherwise a resume that restarted from an earlier model could match by chance."""
    rows = RunDir(reference).rows()
    results = [json.dumps(row["results"], sort_keys=True) for row in rows]
    assert len(set(results)) == len(rows) == 3


def test_the_reference_rows_carry_drift_that_a_resume_must_reproduce(reference):
    """Each stage row's KL and parameter change are non-trivial, so `assert_same_run` comparing rows pins them."""
    rows = RunDir(reference).rows()
    assert "drift" not in rows[0]
    for row in rows[1:]:
        kl = row["drift"]["kl"]
        assert set(kl) == {"magic:easy", "magic-berry:easy"}
        assert all(estimate["k3"] > 0 for estimate in kl.values())
        assert 0 < row["drift"]["params"]["fraction"] <= 1
    # Stage 2's KL is to the start model, its parameter change to stage 1: they differ from stage 1's.
    assert rows[1]["drift"] != rows[2]["drift"]


# --- kill points ---------------------------------------------------------------------------------


def kill_on_call(monkeypatch, owner, name, call, *, before=True, partial_write=None):
    """Patch ``owner.name`` to raise `Killed` on its ``call``-th call (1-based), before or after the real call."""
    real = getattr(owner, name)
    count = {"n": 0}

    def patched(*args, **kwargs):
        count["n"] += 1
        if count["n"] == call and before:
            if partial_write:
                partial_write(*args, **kwargs)
            raise Killed(f"{name} call {call}")
        result = real(*args, **kwargs)
        if count["n"] == call:
            raise Killed(f"after {name} call {call}")
        return result

    monkeypatch.setattr(owner, name, patched)


def half_trajectory_line(backend, chat, experiences, make_env, **kwargs):
    """A kill in the middle of writing the trajectories: half a JSON line is left behind."""
    with open(kwargs["trajectories_path"], "a", encoding="utf-8") as sink:
        sink.write('{"task": {"env": "magic", "id"')


def in_training(step):
    return lambda mp: kill_on_call(mp, GRPOTrainer, "step", step)


def in_evaluation(call):
    return lambda mp: kill_on_call(mp, evaluation, "evaluate", call, partial_write=half_trajectory_line)


def in_checkpoint_write(call):
    def kill(mp):
        # The trainer wrote the whole staging directory; the kill lands before it is renamed into place.
        kill_on_call(mp, GRPOTrainer, "save", call, before=False)
    return kill


def after_last_row(mp):
    kill_on_call(mp, RunDir, "mark_finished", 1)


def after_finished(mp):
    import contrail.report

    kill_on_call(mp, contrail.report, "write_report", 1)


def between_weights_and_optimizer_state(call):
    from contrail.train.trainer import MaskedTokenTrainer

    return lambda mp: kill_on_call(mp, MaskedTokenTrainer, "save_model", call, before=False)


def after_row(call):
    return lambda mp: kill_on_call(mp, RunDir, "append_row", call, before=False)


def after_drift_samples(mp):
    kill_on_call(mp, drift, "save_samples", 1, before=False)


# Each stage's two steps are followed by a checkpoint: after its first one within the stage (`trainer.save`
# calls 1 and 3), after its last one the stage's own (calls 2 and 4).
KILL_POINTS = {
    "row 0 evaluation": in_evaluation(1),
    "start samples saved, row 0 not written": after_drift_samples,
    "stage 1 training, first step": in_training(1),
    "stage 1 checkpoint write within the stage": in_checkpoint_write(1),
    "stage 1 training, second step": in_training(2),
    "stage 1 checkpoint write": in_checkpoint_write(2),
    "stage 1 evaluation": in_evaluation(2),
    "stage 1 row written, before stage 2": after_row(2),
    "stage 2 training, first step": in_training(3),
    "stage 2 training, after its first step": in_training(4),
    "stage 2 checkpoint write within the stage, weights saved": between_weights_and_optimizer_state(3),
    "stage 2 checkpoint write": in_checkpoint_write(4),
    "stage 2 checkpoint write, weights saved, optimizer state not": between_weights_and_optimizer_state(4),
    "stage 2 row written, earlier optimizer state not yet deleted": after_row(3),
    "stage 2 evaluation": in_evaluation(3),
    "after the last row, before FINISHED": after_last_row,
    "after FINISHED, before the report": after_finished,
}


def kill_at(moment: str, exp: Experiment, monkeypatch) -> None:
    """Run ``exp`` until it is killed at ``moment`` (a key of `KILL_POINTS`)."""
    with monkeypatch.context() as patch:
        KILL_POINTS[moment](patch)
        with pytest.raises(Killed):
            run(exp, show_progress=False)


@pytest.mark.parametrize("moment", list(KILL_POINTS))
def test_resume_after_a_kill_reproduces_the_uninterrupted_run(moment, base_model, reference, tmp_path,
                                                              monkeypatch):
    out = tmp_path / "run"
    exp = experiment(base_model, out)
    kill_at(moment, exp, monkeypatch)
    if not (out / "FINISHED").is_file():
        with pytest.raises(RunExistsError, match="--resume"):
            run(exp, show_progress=False)
    run(exp, resume=True, show_progress=False)
    assert_same_run(out, reference)


@pytest.mark.parametrize("moment, resumed", [
    ("stage 1 training, second step", "after stage 0 of 2: stage 1 goes on after its step 1 of 2"),
    ("stage 1 checkpoint write within the stage", "after stage 0 of 2: stage 1 trains from its start"),
    ("stage 2 training, first step", "after stage 1 of 2: stage 2 trains from its start"),
    ("stage 2 training, after its first step", "after stage 1 of 2: stage 2 goes on after its step 1 of 2"),
    # Killed while evaluating stage 2: its row is not written, so it goes on from its checkpoint within it.
    ("stage 2 evaluation", "after stage 1 of 2: stage 2 goes on after its step 1 of 2"),
])
def test_a_resume_says_where_the_stage_goes_on(moment, resumed, base_model, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    exp = experiment(base_model, out)
    kill_at(moment, exp, monkeypatch)
    capsys.readouterr()
    run(exp, resume=True, show_progress=False)
    said = " ".join(capsys.readouterr().err.split())  # the console wraps long paths
    assert f"resuming {out} {resumed}" in said


def test_a_resumed_stage_runs_only_the_steps_after_its_checkpoint(base_model, reference, tmp_path, monkeypatch):
    out = tmp_path / "run"
    exp = experiment(base_model, out)
    kill_at("stage 2 training, after its first step", exp, monkeypatch)
    assert (out / "checkpoints" / "in-progress" / "trainer_state.pt").is_file()
    steps = count_calls(monkeypatch, GRPOTrainer, "step")
    run(exp, resume=True, show_progress=False)
    assert steps["n"] == 1  # step 4 alone; step 3 came from the checkpoint within stage 2
    assert_same_run(out, reference)


def test_without_checkpoints_within_stages_a_cut_short_stage_trains_again(base_model, reference, tmp_path,
                                                                         monkeypatch):
    out = tmp_path / "run"
    exp = experiment(base_model, out, checkpoint_minutes=60.0)
    kill_at("stage 2 training, after its first step", exp, monkeypatch)
    assert not (out / "checkpoints" / "in-progress").exists()
    steps = count_calls(monkeypatch, GRPOTrainer, "step")
    run(exp, resume=True, show_progress=False)
    assert steps["n"] == 2
    assert_same_run(out, reference)


@pytest.mark.parametrize("minutes_per_step, saves", [(3.0, 2), (6.0, 4)])
def test_checkpoints_within_a_stage_are_spaced_by_checkpoint_minutes(minutes_per_step, saves, base_model,
                                                                      tmp_path, monkeypatch):
    """Every 5 minutes: a clock that moves 3 minutes a step saves the stages' ends alone, 6 minutes a step
    after each stage's first step too."""
    import types

    import contrail.checkpoints

    clock = {"now": 0.0}

    def tick():
        clock["now"] += 60.0 * minutes_per_step
        return clock["now"]

    # The checkpoints' clock only: the rest of the process keeps the real one.
    monkeypatch.setattr(contrail.checkpoints, "time", types.SimpleNamespace(monotonic=tick))
    calls = count_calls(monkeypatch, GRPOTrainer, "save")
    run(experiment(base_model, tmp_path / "run", checkpoint_minutes=5.0), show_progress=False)
    assert calls["n"] == saves
    assert not (tmp_path / "run" / "checkpoints" / "in-progress").exists()


def count_calls(monkeypatch, owner, name) -> dict[str, int]:
    """Count calls of ``owner.name`` (it still runs)."""
    real, count = getattr(owner, name), {"n": 0}

    def counted(*args, **kwargs):
        count["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return count


def test_resuming_a_finished_run_changes_nothing(base_model, reference, tmp_path):
    out = tmp_path / "run"
    exp = experiment(base_model, out)
    run(exp, show_progress=False)
    before = snapshot(out)
    result = run(exp, resume=True, show_progress=False)
    assert snapshot(out) == before and [r["stage"] for r in result.rows] == [0, 1, 2]


def test_a_real_sigkill_during_the_evaluation_after_stage_two(base_model, reference, tmp_path):
    """The kill of issue #15.1, delivered for real (SIGKILL: no cleanup runs) in a child process."""
    out = tmp_path / "run"
    script = textwrap.dedent(f"""
        import os, signal, sys
        import torch
        torch.set_num_threads(1)
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from contrail import evaluation
        from contrail.runner import run
        from test_resume import experiment

        real, calls = evaluation.evaluate, []
        def evaluate(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                with open(kwargs["trajectories_path"], "a") as sink:
                    sink.write('{{"task": ')
                    sink.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)
        evaluation.evaluate = evaluate
        run(experiment({base_model!r}, {str(out)!r}), show_progress=False)
    """)
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                           cwd=os.path.dirname(os.path.dirname(__file__)))
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    assert RunDir(out).completed_stages() == 1
    run(experiment(base_model, out), resume=True, show_progress=False)
    assert_same_run(out, reference)


# --- strategies that carry something from one stage to the next ------------------------------------


@pytest.mark.parametrize("strategy", ["kl_anchor", "ewc"])
def test_continual_learning_methods_resume_exactly(strategy, base_model, tmp_path):
    """The anchor (the policy at the stage's start) and the Fisher (from the previous stage's tasks) are rebuilt."""
    straight = tmp_path / "straight"
    run(experiment(base_model, straight, strategy), show_progress=False)
    out = tmp_path / "resumed"
    with pytest.MonkeyPatch.context() as patch:
        in_training(4)(patch)
        with pytest.raises(Killed):
            run(experiment(base_model, out, strategy), show_progress=False)
    run(experiment(base_model, out, strategy), resume=True, show_progress=False)
    assert_same_run(out, straight)


def test_a_lora_run_resumes_within_a_stage_exactly(base_model, tmp_path, monkeypatch):
    """The checkpoint within a stage holds the adapter alone; it is loaded into the live model's adapter."""
    straight = tmp_path / "straight"
    run(experiment(base_model, straight, lora=True), show_progress=False)
    out = tmp_path / "resumed"
    kill_at("stage 2 training, after its first step", experiment(base_model, out, lora=True), monkeypatch)
    assert (out / "checkpoints" / "in-progress" / "model" / "adapter_model.safetensors").is_file()
    run(experiment(base_model, out, lora=True), resume=True, show_progress=False)
    assert_same_run(out, straight)


class CarriesState(Sequential):
    """Adds each finished stage's index to a tensor it carries into the next stage's ``before_stage``."""

    seen_before_stage: list = []

    def __post_init__(self) -> None:
        super().__post_init__()
        self.total = torch.zeros(1)

    def before_stage(self, stage, trainer):
        CarriesState.seen_before_stage.append(float(self.total))

    def after_stage(self, stage, trainer):
        self.total = self.total + stage.index

    def state_dict(self):
        return {"total": self.total}

    def load_state_dict(self, state):
        self.total = state["total"].clone()


def test_a_strategys_own_state_is_saved_with_the_checkpoint_and_restored(base_model, tmp_path, monkeypatch):
    out = tmp_path / "run"
    exp = experiment(base_model, out, f"{__name__}:CarriesState")
    CarriesState.seen_before_stage = seen = []
    with monkeypatch.context() as patch:
        in_training(4)(patch)  # in stage 2, after the stage-1 checkpoint
        with pytest.raises(Killed):
            run(exp, show_progress=False)
    assert seen == [0.0, 1.0]
    assert load_file(out / "checkpoints" / "stage-01" / "strategy_state.safetensors")["total"].item() == 1.0
    run(exp, resume=True, show_progress=False)
    assert seen == [0.0, 1.0, 1.0]  # the resumed stage 2 starts from what stage 1 left
    checkpoints = out / "checkpoints"
    assert not (checkpoints / "stage-01" / "strategy_state.safetensors").exists()  # like the optimizer state
    assert load_file(checkpoints / "stage-02" / "strategy_state.safetensors")["total"].item() == 3.0


def test_resume_refuses_a_plan_the_strategy_no_longer_makes(base_model, tmp_path, monkeypatch):
    out = tmp_path / "run"
    with monkeypatch.context() as patch:
        in_evaluation(2)(patch)
        with pytest.raises(Killed):
            run(experiment(base_model, out), show_progress=False)
    plan = json.loads((out / "plan.json").read_text())
    plan["stages"][1]["steps"] = 7  # as if the strategy's code had changed since
    (out / "plan.json").write_text(json.dumps(plan))
    with pytest.raises(RunExistsError, match="now plans other stages than .*plan.json records; use --force"):
        run(experiment(base_model, out), resume=True, show_progress=False)


def test_a_resumed_run_keeps_the_start_model_as_its_kl_reference(base_model, tmp_path, monkeypatch):
    """With ``grpo.beta > 0`` the KL reference is the run's start model, not the checkpoint resumed from."""
    straight = tmp_path / "straight"
    run(experiment(base_model, straight, beta=0.5), show_progress=False)
    out = tmp_path / "resumed"
    with monkeypatch.context() as patch:
        in_training(4)(patch)
        with pytest.raises(Killed):
            run(experiment(base_model, out, beta=0.5), show_progress=False)
    run(experiment(base_model, out, beta=0.5), resume=True, show_progress=False)
    assert_same_run(out, straight)
