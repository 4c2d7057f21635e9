"""Checkpoint and resume (torch.distributed.checkpoint): a run killed after its step-4 checkpoint
and resumed continues exactly the loss trajectory of the uninterrupted run (CPU, fp32), and
the checkpoint loads on another plan and world size. Resuming something else is one line."""

from __future__ import annotations

from dataclasses import replace

import pytest

from csbp.runtime.training import checkpoint, faults
from csbp.runtime.training.checkpoint import CheckpointInfo
from csbp.runtime.training.launch import RunFailed, spawn
from csbp.runtime.training.train import Job
from csbp.simulator.errors import InputError
from csbp.simulator.plan.plan import parse_plan
from csbp.simulator.workload.presets import load_model
from csbp.simulator.workload.spec import AttentionSpec, ModelSpec
from csbp.simulator.workload.workload import Workload

# tied embeddings: DCP must keep the shared weight shared
TIED = ModelSpec(name="tiny-tied", hidden=64, ffn=128, vocab=256, tie_embeddings=True,
                 layers=(AttentionSpec(n_heads=4, n_kv_heads=2, head_dim=16),) * 2)
WORKLOAD = Workload(seq_len=64, block_size=8, dtype="fp32")
STEPS, KILLED_AT = 6, 4
JOB = Job(TIED, WORKLOAD, parse_plan("cp=2"), steps=STEPS, warmup=0)
TIMEOUT_S = 120
# Relative, on the losses of a resumed run on another plan or world size: the same fp32 model
# reduced in other orders, through a few AdamW steps (test_runtime_plans.TOLERANCE's basis).
TOLERANCE = 1e-5


def killed_run(directory) -> tuple:
    """A run checkpointing every 2 steps whose rank 1 is killed in step 4 -> the latest checkpoint."""
    job = replace(JOB, checkpoint_dir=str(directory), checkpoint_every=2)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(faults.ENV, f"rank=1,step={KILLED_AT},kind=kill")
        with pytest.raises(RunFailed, match=f"rank 1 was killed .* at step {KILLED_AT}"):
            spawn([job], 2, "cpu", TIMEOUT_S)
    return checkpoint.latest(directory)


def resumed(job: Job, path, info: CheckpointInfo) -> Job:
    checkpoint.check_resumable(info, path, job.model, job.seed, job.end_step)
    return replace(job, resume_from=str(path), start_step=info.step)


@pytest.mark.floats
@pytest.mark.timeout(300)
def test_resume_after_a_kill_continues_the_exact_trajectory_and_reshards(tmp_path):
    path, info = killed_run(tmp_path)
    assert info.step == KILLED_AT and path.name == f"step-{KILLED_AT:06d}"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # older checkpoints removed
    same = resumed(JOB, path, info)
    other_plan = resumed(replace(JOB, plan=parse_plan("cp=2,bp=2", transport="ring")), path, info)
    # the uninterrupted run in the same process group (one start of the ranks less)
    (full, same_reports, other_reports) = spawn([JOB, same, other_plan], 2, "cpu", TIMEOUT_S)
    ((single,),) = spawn([resumed(replace(JOB, plan=parse_plan("dp=1")), path, info)], 1, "cpu",
                         TIMEOUT_S)
    want = full[0].losses[KILLED_AT:]
    # bit for bit: the same plan runs the same kernels on the same shapes in the same order, and
    # the checkpoint restores weights, AdamW moments and step, and the data position exactly
    assert same_reports[0].losses == want
    for report in (*other_reports, single):  # other reduction orders: equal to fp32 rounding
        assert report.losses == pytest.approx(want, rel=TOLERANCE)


def info(step=4, seed=0, model=TIED) -> CheckpointInfo:
    return CheckpointInfo(step=step, seed=seed, world=2, model=model, workload=WORKLOAD,
                          plan=parse_plan("cp=2"))


@pytest.mark.parametrize("saved, message", [
    (info(model=load_model("tiny")), "holds model 'tiny' with other shapes than 'tiny-tied'"),
    (info(seed=3), "trained with --seed 3, not 0"),
    (info(step=6), "is at step 6, and this run ends at step 6"),
])
def test_resuming_another_job_is_one_line(tmp_path, saved, message):
    with pytest.raises(InputError, match=message) as err:
        checkpoint.check_resumable(saved, tmp_path, TIED, 0, STEPS)
    assert "\n" not in str(err.value)


def test_latest_ignores_incomplete_checkpoints_and_rejects_damaged_ones(tmp_path):
    with pytest.raises(InputError, match="no complete checkpoint"):
        checkpoint.latest(tmp_path)
    complete = checkpoint.step_dir(tmp_path, 2)
    complete.mkdir()
    (complete / checkpoint.INFO).write_text(info(step=2).model_dump_json())
    checkpoint.step_dir(tmp_path, 4).mkdir()  # killed while saving: no job.json
    assert checkpoint.latest(tmp_path) == (complete, info(step=2))
    (complete / checkpoint.INFO).write_text('{"step": -1}')
    with pytest.raises(InputError, match="job.json: step") as err:
        checkpoint.latest(tmp_path)
    assert "\n" not in str(err.value)
