"""The shipped accelerate configs, and checkpoint/resume through them with two CPU processes (gloo).

The fast tests check that accelerate reads each config as the kind of
training its comment promises. The ``multiprocess`` tests (``-m multiprocess``,
about a minute each on two cores) launch real process groups with
``accelerate launch --config_file configs/accelerate/<x>.yaml --num_processes 2``:
the masked-token trainer must resume a checkpoint exactly under DDP and FSDP2,
and a two-stage run killed between its stages must, resumed under DDP,
finish exactly as the uninterrupted run.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils import DistributedType
from safetensors.torch import load_file

from contrail.agent.rollout import RolloutConfig
from contrail.experiment import EvalSpec, Experiment, ModelSpec, StrategySpec, StreamSpec
from contrail.grpo.config import GRPOConfig
from contrail.testing import tiny_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs" / "accelerate"
multiprocess = pytest.mark.multiprocess


def config(name: str):
    return load_config_from_file(str(CONFIGS / f"{name}.yaml"))


def test_ddp_config_is_plain_data_parallel():
    ddp = config("ddp")
    assert ddp.distributed_type == DistributedType.MULTI_GPU
    assert ddp.mixed_precision == "no"  # contrail's own bf16 autocast, chosen per trainer


def test_fsdp_config_fully_shards_by_transformer_block_with_full_state_dicts():
    fsdp = config("fsdp")
    assert fsdp.distributed_type == DistributedType.FSDP
    options = fsdp.fsdp_config
    assert options["fsdp_version"] == 2
    assert options["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert options["fsdp_reshard_after_forward"] is True          # full shard (ZeRO-3-like)
    assert options["fsdp_state_dict_type"] == "FULL_STATE_DICT"   # what save_model gathers
    assert fsdp.mixed_precision == "no"


def test_zero3_config_is_deepspeed_stage_3_saving_full_weights():
    zero3 = config("zero3")
    assert zero3.distributed_type == DistributedType.DEEPSPEED
    assert zero3.deepspeed_config["zero_stage"] == 3
    assert zero3.deepspeed_config["zero3_save_16bit_model"] is True
    assert "UNTESTED" in (CONFIGS / "zero3.yaml").read_text()     # says so until someone runs it


# --- two real processes --------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(config_name: str, *argv: str, env: dict[str, str] | None = None, timeout: int = 600):
    """``accelerate launch`` two CPU processes of ``argv`` (a script and its arguments) with this tree's contrail."""
    command = [sys.executable, "-m", "accelerate.commands.launch",
               "--config_file", str(CONFIGS / f"{config_name}.yaml"),
               "--num_processes", "2", "--main_process_port", str(free_port()), *argv]
    environment = {**os.environ, "ACCELERATE_USE_CPU": "true", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                   **(env or {})}
    with subprocess.Popen(command, cwd=ROOT, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # A launch that hangs (a collective nobody joins) is killed whole. Its workers lead sessions
            # of their own, so killing `accelerate launch` alone would leave them spinning, holding the pipes.
            launcher = psutil.Process(process.pid)
            for worker in launcher.children(recursive=True) + [launcher]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    worker.kill()
            stdout, stderr = process.communicate()
            pytest.fail(f"accelerate launch {' '.join(argv)} hung for {timeout} s\n{stderr[-6000:]}")
    done = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done


def resume_report(done) -> dict:
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, done.stdout  # only the main process reports
    return json.loads(lines[0])


@multiprocess
def test_trainer_checkpoint_resumes_exactly_under_ddp(tmp_path):
    report = resume_report(launch("ddp", "scripts/sharded_resume.py", "--out", str(tmp_path)))
    assert report["distributed_type"] == "DistributedType.MULTI_CPU" and report["processes"] == 2
    assert report["backend"] == "gloo"
    assert report["ok"], report
    # `end` let the DDP wrapper go and ended the process group: nothing of either is left for shutdown
    assert report["wrappers_left"] == 0 and not report["process_group_left"], report


@multiprocess
def test_trainer_checkpoint_resumes_exactly_under_fsdp2(tmp_path):
    report = resume_report(launch("fsdp", "scripts/sharded_resume.py", "--out", str(tmp_path), "--force-fsdp"))
    assert report["distributed_type"] == "DistributedType.FSDP" and report["fsdp_version"] == 2
    assert report["model_class"].startswith("FSDP")   # fully_shard really wrapped it
    assert report["ok"], report
    saved = load_file(str(tmp_path / "checkpoint" / "model" / "model.safetensors"))
    assert saved["model.embed_tokens.weight"].shape[0] == len(tiny_tokenizer())  # full, not a shard


RUN_SCRIPT = textwrap.dedent("""
    import os, sys
    import contrail.testing  # registers the magic environments in every process
    import contrail.runner as runner
    from contrail.experiment import Experiment

    if os.environ.get("FORCE_FSDP"):  # accelerate enables FSDP on accelerators only; FSDP2 itself runs on CPU
        from accelerate import Accelerator, PartialState
        sys.path.insert(0, "scripts")
        from sharded_resume import force_fsdp
        force_fsdp(Accelerator().state)
    experiment = Experiment.from_yaml(sys.argv[1])
    kill_after = int(os.environ.get("KILL_AFTER_STAGE", "0"))
    real_stage = runner._run_stage

    def stage_then_die(stage, *args, **kwargs):
        real_stage(stage, *args, **kwargs)
        if stage.index == kill_after:  # every process, after the stage's closing barrier
            os._exit(0)

    runner._run_stage = stage_then_die
    kill_at_step = int(os.environ.get("KILL_AT_STEP", "0"))
    if kill_at_step:
        from contrail.grpo.trainer import GRPOTrainer
        real_step, steps = GRPOTrainer.step, []

        def step_or_die(self, sampler):
            steps.append(1)
            if len(steps) == kill_at_step:  # every process, before the step: the checkpoint before it is whole
                os._exit(0)
            return real_step(self, sampler)

        GRPOTrainer.step = step_or_die
    runner.run(experiment, resume="--resume" in sys.argv, show_progress=False)
    import json
    from accelerate import PartialState
    if PartialState().is_main_process:
        print(json.dumps({"distributed_type": PartialState().distributed_type.value}))
""")


def two_stage_experiment(tmp_path: Path, out: str, checkpoint_minutes: float = 5.0, lora: bool = False) -> str:
    """A two-stage run of the tiny model on the magic environments, written to ``<out>.yaml``."""
    experiment = Experiment(
        name=out, out=str(tmp_path / out), seed=0, checkpoint_minutes=checkpoint_minutes,
        stream=StreamSpec(train=["magic:easy", "magic-berry:easy"], train_tasks=8, test_tasks=4,
                          steps_per_experience=2),
        strategy=StrategySpec(name="sequential"),
        model=ModelSpec(name=str(tmp_path / "start"), dtype="float32", device="cpu"),
        rollout=RolloutConfig(max_new_tokens=3, max_episode_tokens=256),
        grpo=GRPOConfig(lr=3e-2, group_size=4, tasks_per_step=2, lora=lora), eval=EvalSpec(k=2))
    path = tmp_path / f"{out}.yaml"
    path.write_text(experiment.to_yaml())
    return str(path)


def run_rows(run_dir: Path) -> list[dict]:
    """A run's rows without the machine's measures (wall, evaluation and system times, peak memory)."""
    rows = [{k: v for k, v in json.loads(line).items() if "seconds" not in k and k != "peak_memory_gb"}
            for line in (run_dir / "results.jsonl").read_text().splitlines()]
    for row in rows:
        row["train"].pop("seconds", None)
        for part in ("first", "last"):
            row["train"].get(part, {}).pop("step_seconds", None)
    return rows


def run_outcome(run_dir: Path) -> tuple[list[dict], dict]:
    """A two-stage run's rows (without wall times) and its final weights (a LoRA run's: its adapter)."""
    model = run_dir / "checkpoints" / "stage-02" / "model"
    weights = load_file(str(next(model / name for name in ("model.safetensors", "adapter_model.safetensors")
                                 if (model / name).is_file())))
    return run_rows(run_dir), weights


def save_start_model(tmp_path: Path) -> None:
    tokenizer = tiny_tokenizer()
    tiny_model(tokenizer).save_pretrained(tmp_path / "start")
    tokenizer.save_pretrained(tmp_path / "start")


@multiprocess
def test_a_run_killed_between_stages_resumes_exactly_under_ddp(tmp_path):
    save_start_model(tmp_path)
    script = tmp_path / "run.py"
    script.write_text(RUN_SCRIPT)

    launch("ddp", str(script), two_stage_experiment(tmp_path, "straight"))
    killed = two_stage_experiment(tmp_path, "killed")
    launch("ddp", str(script), killed, env={"KILL_AFTER_STAGE": "1"})
    rows = (tmp_path / "killed" / "results.jsonl").read_text().splitlines()
    assert len(rows) == 2 and not (tmp_path / "killed" / "FINISHED").exists()   # row 0 and stage 1 only
    launch("ddp", str(script), killed, "--resume")

    straight_rows, straight_weights = run_outcome(tmp_path / "straight")
    resumed_rows, resumed_weights = run_outcome(tmp_path / "killed")
    assert len(straight_rows) == 3
    assert resumed_rows == straight_rows
    assert straight_weights.keys() == resumed_weights.keys()
    assert all((straight_weights[k] == resumed_weights[k]).all() for k in straight_weights)


def kill_within_stage_2_and_resume(tmp_path: Path, config_name: str, env: dict[str, str] | None = None,
                                   lora: bool = False) -> None:
    """An uninterrupted two-stage run (``straight``) and one killed before stage 2's second step, with a
    checkpoint after every step, then resumed (``killed``): the resume runs that step alone."""
    save_start_model(tmp_path)
    script = tmp_path / "run.py"
    script.write_text(RUN_SCRIPT)

    launch(config_name, str(script), two_stage_experiment(tmp_path, "straight", lora=lora), env=env)
    killed = two_stage_experiment(tmp_path, "killed", checkpoint_minutes=0.0, lora=lora)
    launch(config_name, str(script), killed, env={**(env or {}), "KILL_AT_STEP": "4"})
    assert len((tmp_path / "killed" / "results.jsonl").read_text().splitlines()) == 2  # row 0 and stage 1
    assert (tmp_path / "killed" / "checkpoints" / "in-progress" / "trainer_state.pt").is_file()
    resumed = launch(config_name, str(script), killed, "--resume", env=env)
    assert "stage 2 goes on after its step 1 of 2" in resumed.stdout + resumed.stderr
    assert not (tmp_path / "killed" / "checkpoints" / "in-progress").exists()
    log = [json.loads(line)["step"] for line in (tmp_path / "killed" / "grpo_log.jsonl").read_text().splitlines()]
    assert log == [1, 2, 3, 4]

    straight_rows, straight_weights = run_outcome(tmp_path / "straight")
    resumed_rows, resumed_weights = run_outcome(tmp_path / "killed")
    assert resumed_rows == straight_rows
    assert straight_weights.keys() == resumed_weights.keys()
    assert all((straight_weights[k] == resumed_weights[k]).all() for k in straight_weights)


@multiprocess
def test_a_run_killed_within_a_stage_resumes_exactly_under_ddp(tmp_path):
    kill_within_stage_2_and_resume(tmp_path, "ddp")


@multiprocess
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_run_killed_within_a_stage_resumes_exactly_under_fsdp2(tmp_path, lora):
    """Each process takes its shard of the checkpoint's full weights (or adapter) back in place
    (`set_model_state_dict`)."""
    kill_within_stage_2_and_resume(tmp_path, "fsdp", env={"FORCE_FSDP": "1"}, lora=lora)


@multiprocess
def test_a_run_trains_and_evaluates_under_fsdp2(tmp_path):
    """Rollouts (each process its own number of forwards) and evaluation (the main process alone) sample
    from the whole model, not through FSDP's all-gathers, which would wait forever for the other process.

    The run finishes, and its row 0 -- the start model, evaluated while sharded for training -- is the
    same row DDP's run records: the unsharded weights are the real ones.
    """
    save_start_model(tmp_path)
    script = tmp_path / "run.py"
    script.write_text(RUN_SCRIPT)
    done = launch("fsdp", str(script), two_stage_experiment(tmp_path, "fsdp"), env={"FORCE_FSDP": "1"},
                  timeout=300)
    assert resume_report(done)["distributed_type"] == "FSDP"
    launch("ddp", str(script), two_stage_experiment(tmp_path, "ddp"))
    fsdp_rows, ddp_rows = run_rows(tmp_path / "fsdp"), run_rows(tmp_path / "ddp")
    assert (tmp_path / "fsdp" / "FINISHED").exists() and len(fsdp_rows) == 3
    assert fsdp_rows[0] == ddp_rows[0]
    assert all(row["train"].get("steps") for row in fsdp_rows[1:])   # both stages trained
