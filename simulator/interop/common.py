"""What every framework reader and writer shares: the imported run, model ids, key checks.

Each format module speaks one framework's terms; the rules that do not depend on the framework
(how a model id becomes a csbp model, how an unknown key gets a "did you mean", how a bad
value becomes one line) live here once.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Hashable, Mapping
from typing import Any

from pydantic import ValidationError

from csbp.simulator.workload.objectives import default_objective
from csbp.simulator.errors import InputError, one_line
from csbp.simulator.plan.plan import DEFAULT_PLACEMENT, Plan
from csbp.simulator.workload.presets import PRESET_NAMES, load_model
from csbp.simulator.workload.spec import ModelSpec
from csbp.simulator.workload.workload import Workload

# Checkpoint ids of the presets, so an emitted config names a checkpoint the framework can load.
# Ids seen in Turbo-dLLM's published recipes, plus the Nemotron 8B/14B ids by analogy with the 3B
# one (unverified). Presets without an id are written under their csbp name.
CHECKPOINT_IDS = {
    "nemotron-diffusion-3b": "nvidia/Nemotron-Labs-Diffusion-3B",
    "nemotron-diffusion-8b": "nvidia/Nemotron-Labs-Diffusion-8B",
    "nemotron-diffusion-14b": "nvidia/Nemotron-Labs-Diffusion-14B",
    "diffusiongemma-26b-a4b": "google/diffusiongemma-26B-A4B-it",
    "qwen3.5-27b": "Qwen/Qwen3.5-27B",
    "qwen3.8-27b": "Qwen/Qwen3.8-27B",
    "qwen3-8b": "Qwen/Qwen3-8B",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B",
    "llama3.1-8b": "meta-llama/Llama-3.1-8B",
    "llama2-7b": "meta-llama/Llama-2-7b-hf",
}
_PRESET_BY_ID = {v.lower(): k for k, v in CHECKPOINT_IDS.items()}


@dataclass(frozen=True)
class ImportedRun:
    """An existing run as csbp understands it, plus everything it could not understand."""

    model: str  # preset name or path to a config.json (or its directory)
    workload: Workload
    plan: Plan  # dp = 1 when the file does not state the world size (see plan_on)
    nodes: int | None
    gpus: int | None  # world size, when the format states it
    unknown_keys: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()  # one line each: ignored keys, near-miss typos

    def plan_on(self, world: int) -> Plan:
        """The plan on a cluster of `world` GPUs: files that leave DP to the launcher get dp filled in."""
        if self.gpus is not None:
            if self.gpus != world:
                raise InputError(f"the run uses {self.gpus} GPUs, but the cluster has {world}")
            return self.plan
        per_replica = self.plan.world // self.plan.dp
        if world % per_replica:
            raise InputError(f"world {world} is not a multiple of tp*ep*max(cp,bp) = {per_replica}")
        return self.plan.model_copy(update={"dp": world // per_replica})


def checkpoint_id(model_name: str) -> str:
    """What a framework config names the model by: the checkpoint id when known, else as given."""
    return CHECKPOINT_IDS.get(model_name, model_name)


def resolve_model(fmt: str, key: str, value: object, base_dir: Path | None) -> tuple[str, ModelSpec]:
    """A model reference from a config (preset, checkpoint id, or config.json path) -> csbp model."""
    text = str(value).strip()
    name = _PRESET_BY_ID.get(text.lower(), text)
    if name in PRESET_NAMES:
        return name, load_model(name)
    path = Path(text).expanduser()
    if base_dir is not None and not path.is_absolute():
        path = base_dir / path
    if path.is_file() or (path / "config.json").is_file():
        return str(path), load_model(str(path))
    raise InputError(f"{fmt}: {key} {text!r} is neither a csbp preset, a known checkpoint id "
                     f"({', '.join(CHECKPOINT_IDS.values())}) nor a local config.json")


def objective_of(model: ModelSpec, value: str | None) -> str:
    return value if value is not None else default_objective(model)


def make_workload(fmt: str, **fields: Any) -> Workload:
    try:
        return Workload(**fields)
    except ValidationError as err:
        raise InputError(f"{fmt}: {one_line(err)}") from None


def make_plan(fmt: str, model: ModelSpec, workload: Workload, **fields: Any) -> Plan:
    """A Plan from a framework's degrees, checked against the model (rules named by csbp)."""
    try:
        plan = Plan(**fields)
    except ValidationError as err:
        raise InputError(f"{fmt}: {one_line(err)}") from None
    try:
        plan.check_against(model, workload)
    except InputError as err:
        raise InputError(f"{fmt}: {err}") from None
    return plan


def check_emittable(fmt: str, model_name: str, workload: Workload, plan: Plan, world: int,
                    *, block_parallel: bool) -> ModelSpec:
    """What every writer checks first: the plan is valid on the cluster and expressible at all."""
    if not block_parallel and plan.bp > 1:
        raise InputError(f"{fmt} cannot express block parallelism (bp={plan.bp}): emit the baseline plan")
    model = load_model(model_name)
    plan.check_against(model, workload, world)
    return model


def require_default_placement(fmt: str, plan: Plan, rank_order: str) -> None:
    """Frameworks with one fixed rank order (csbp's default) cannot take another placement."""
    if plan.placement != DEFAULT_PLACEMENT:
        raise InputError(f"{fmt} lays ranks out {rank_order} (csbp placement {DEFAULT_PLACEMENT}); "
                         f"placement {plan.placement} cannot be expressed")


def as_int(fmt: str, key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InputError(f"{fmt}: {key} must be an integer, got {value!r}")
    try:
        return int(value)
    except ValueError:
        raise InputError(f"{fmt}: {key} must be an integer, got {value!r}") from None


def as_bool(fmt: str, key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InputError(f"{fmt}: {key} must be true or false, got {value!r}")
    return value


def choice(fmt: str, key: str, value: object, table: Mapping[str, Any]) -> Any:
    """Look a framework value up in its csbp meaning; a value csbp cannot model is one line."""
    if not isinstance(value, Hashable) or value not in table:
        raise InputError(f"{fmt}: {key} {value!r} is not one csbp models (use {', '.join(map(str, table))})")
    return table[value]


def key_for(table: Mapping[str, Any], meaning: Any) -> str:
    """The framework's name for a csbp value (the inverse of `choice`)."""
    return next(k for k, v in table.items() if v == meaning)


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'topology': {'cp': 8}} -> {'topology.cp': 8}: keys named as users write them in errors."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def settings(flat: Mapping[str, Any],
             defaults: Mapping[str, Any]) -> tuple[Callable[[str], Any], list[str]]:
    """A getter for the keys csbp reads (the framework's default where absent) and the other keys."""
    known = {**defaults, **{k: v for k, v in flat.items() if k in defaults}}
    return known.__getitem__, [k for k in flat if k not in defaults]


def unknown_key_warnings(fmt: str, unknown: list[str], known: list[str]) -> tuple[str, ...]:
    """One line for the keys csbp ignores, and one per key that looks like a typo of a known one."""
    lines = []
    plain = []
    for key in unknown:
        match = difflib.get_close_matches(key, known, n=1, cutoff=0.9)
        if match:
            lines.append(f"{fmt}: unknown key {key} ignored: did you mean {match[0]}?")
        else:
            plain.append(key)
    if plain:
        lines.insert(0, f"{fmt}: csbp ignores {len(plain)} key(s) it does not model: {', '.join(plain)}")
    return tuple(lines)
