"""Checkpoint and resume with torch.distributed.checkpoint (DCP): weights, AdamW state, step.

Every rank holds the whole model and optimizer (replicated AdamW, no ZeRO), so DCP stores each
tensor once and any plan or world size can load it: resuming on another plan or world size needs
no resharding code. Data and noise are drawn from (seed, step) alone (`objective.make_batch`), so
the step is the whole RNG and data state.

A checkpoint is DIR/step-NNNNNN/. Its `job.json`, written by rank 0 after DCP finished, marks it
complete and says what was trained, so a resume is checked before any process starts; a run
killed while saving leaves no `job.json` and the previous checkpoint stands. Older complete
checkpoints are removed once a newer one is complete. Torch is imported only by save and load.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from pydantic import BaseModel, ConfigDict, NonNegativeInt, ValidationError

from csbp.simulator.errors import InputError
from csbp.simulator.errors import one_line
from csbp.simulator.plan.plan import Plan
from csbp.simulator.workload.spec import ModelSpec
from csbp.simulator.workload.workload import Workload

INFO = "job.json"
_STEP_DIR = re.compile(r"step-(\d+)")


class CheckpointInfo(BaseModel):
    """What a checkpoint holds: the state after `step` steps of this job."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    step: NonNegativeInt
    seed: int
    world: int
    model: ModelSpec
    workload: Workload
    plan: Plan


def step_dir(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step-{step:06d}"


def _complete(directory: Path) -> list[Path]:
    """Complete checkpoints in `directory`, oldest first."""
    found = [(int(m.group(1)), p) for p in directory.iterdir()
             if (m := _STEP_DIR.fullmatch(p.name)) and (p / INFO).is_file()]
    return [p for _, p in sorted(found)]


def latest(directory: str | Path) -> tuple[Path, CheckpointInfo]:
    """The newest complete checkpoint in `directory`; InputError if there is none."""
    directory = Path(directory)
    if not directory.is_dir():
        raise InputError(f"--resume {directory}: no such directory")
    complete = _complete(directory)
    if not complete:
        raise InputError(f"--resume {directory}: no complete checkpoint (step-N/{INFO}) in it")
    path = complete[-1]
    try:
        return path, CheckpointInfo.model_validate_json((path / INFO).read_text())
    except (ValidationError, ValueError) as err:
        raise InputError(f"{path / INFO}: {one_line(err)}") from None
    except OSError as err:
        raise InputError(f"{path / INFO}: cannot read: {err.strerror}") from None


def check_resumable(info: CheckpointInfo, path: Path, model: ModelSpec, seed: int,
                    end_step: int) -> None:
    """A checkpoint resumes a run of the same model and seed; plan and world size may differ."""
    if info.model != model:
        raise InputError(f"checkpoint {path} holds model {info.model.name!r} with other shapes "
                         f"than {model.name!r}: cannot resume it")
    if info.seed != seed:
        raise InputError(f"checkpoint {path} was trained with --seed {info.seed}, not {seed}: "
                         "its data would not continue")
    if info.step >= end_step:
        raise InputError(f"checkpoint {path} is at step {info.step}, and this run ends at step "
                         f"{end_step} (--warmup + --steps): nothing left to train")


def save(directory: str | Path, step: int, info: CheckpointInfo, model, optimizer,
         rank: int) -> None:
    """Write the state after `step` steps; collective: every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = step_dir(directory, step)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
    if rank == 0:  # DCP's save returns on every rank only after its metadata is written
        (path / INFO).write_text(info.model_dump_json(indent=2) + "\n")
        for old in _complete(Path(directory))[:-1]:
            shutil.rmtree(old, ignore_errors=True)


def load(path: str | Path, model, optimizer) -> None:
    """Read a checkpoint into `model` and `optimizer` in place; collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=Path(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
