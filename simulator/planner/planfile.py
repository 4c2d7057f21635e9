"""The plan file: what `csbp plan --out` writes and `csbp run --plan` / `csbp.runtime.training.torchrun` execute.

It is the planner's output, so it lives on the simulator side (no torch here).

One JSON object, versioned so a runtime never guesses at a file from another release:

    {"version": 1,
     "model": "nemotron-diffusion-8b",            # preset name, config.json path, or a ModelSpec
     "workload": {"seq_len": 262144, "block_size": 256, "dtype": "bf16", ...},
     "plan": {"dp": 2, "cp": 8, "bp": 8, "transport": "collective", ...},
     "hardware": "h200", "nodes": 2,              # optional: what the plan was made for
     "prediction": {...}}                         # optional: the simulator's Result.to_json()

No torch here: the planner imports this module to write the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, PositiveInt, ValidationError, field_validator

from csbp.simulator.errors import InputError, one_line
from csbp.simulator.plan.plan import Plan
from csbp.simulator.workload.presets import load_model
from csbp.simulator.workload.spec import ModelSpec
from csbp.simulator.workload.workload import Workload

VERSION = 1


class PlanFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int = VERSION
    model: str | ModelSpec
    workload: Workload
    plan: Plan
    hardware: str | None = None
    nodes: PositiveInt | None = None
    prediction: dict[str, Any] | None = None

    @field_validator("version")
    @classmethod
    def _known_version(cls, v: int) -> int:
        if v != VERSION:
            raise ValueError(f"plan file version {v} is not supported (this csbp reads {VERSION})")
        return v

    def model_spec(self) -> ModelSpec:
        return load_model(self.model) if isinstance(self.model, str) else self.model


def load(path: str | Path) -> PlanFile:
    """Read and validate a plan file; every problem is one InputError line naming the file."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise InputError(f"cannot read plan file {path}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise InputError(f"plan file {path} is not a text file") from None
    try:
        return PlanFile.model_validate(json.loads(text))
    except json.JSONDecodeError as err:
        raise InputError(f"plan file {path} is not JSON: {err.msg} (line {err.lineno})") from None
    except RecursionError:
        raise InputError(f"plan file {path} is nested too deeply") from None
    except ValidationError as err:
        raise InputError(f"plan file {path}: {one_line(err)}") from None


def dump(plan_file: PlanFile, path: str | Path) -> None:
    Path(path).write_text(plan_file.model_dump_json(indent=2, exclude_none=True) + "\n")
