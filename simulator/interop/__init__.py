"""Interop: a csbp plan in the configuration of the framework a team trains with, and back.

`emit` writes a plan as Turbo-dLLM RunSpec YAML, Megatron-LM flags or TorchTitan TOML;
`read` turns such a file into an `ImportedRun` that csbp can simulate. Frameworks without block
parallelism get the best plan they can express (bp = 1); asking them for more is an InputError.
"""

from __future__ import annotations

from pathlib import Path

from csbp.simulator.errors import InputError
from csbp.simulator.interop import megatron, torchtitan, turbo_dllm
from csbp.simulator.interop.common import ImportedRun
from csbp.simulator.plan.plan import Plan
from csbp.simulator.workload.workload import Workload

FORMATS = ("turbo-dllm", "megatron", "torchtitan")
_MODULES = {"turbo-dllm": turbo_dllm, "megatron": megatron, "torchtitan": torchtitan}

__all__ = ["FORMATS", "ImportedRun", "emit", "read"]


def _module(fmt: str):
    if fmt not in _MODULES:
        raise InputError(f"unknown format {fmt!r}: use {', '.join(FORMATS)}")
    return _MODULES[fmt]


def emit(fmt: str, model_name: str, workload: Workload, plan: Plan, nodes: int, gpus_per_node: int) -> str:
    """The plan in `fmt`'s own terms, for `nodes` x `gpus_per_node` GPUs."""
    return _module(fmt).emit(model_name, workload, plan, nodes, gpus_per_node)


def read(fmt: str, text: str, *, base_dir: Path | None = None) -> ImportedRun:
    """An existing run in `fmt` -> csbp's model, workload and plan (model paths relative to base_dir)."""
    return _module(fmt).read(text, base_dir=base_dir)
