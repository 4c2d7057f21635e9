"""What an implementation executes for each plan family: data, like a hardware profile.

The method fixes which pairs a rank computes and which K/V rows move; how a framework runs them
does not follow from it (implementation.md): which kernel family runs each attention call, how
the calls are cut (one call over every key, or local keys apart from received ones), whether the
K/V collective is waited on at once or hidden behind local work, which copies sit on the critical
path, whether collectives are padded to the largest shard, and the dtype dK/dV travel in. The
step graph reads these facts; nothing about a particular framework is written in the builder.

A profile is a YAML file in `implementations/` (or anywhere, by path), every fact written
`{value: ..., source: "..."}` as in hardware profiles.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from csbp.simulator.errors import InputError, one_line
from csbp.simulator.system.hardware import FIGURE, _unwrap
from csbp.simulator.system.profile_files import names_in, read_mapping

IMPLEMENTATION_DIR = Path(__file__).resolve().parents[2] / "implementations"
DEFAULT_IMPLEMENTATION = "turbo-dllm"

# How a pass cuts one layer's attention into kernel calls (calls named in brackets):
# whole: one call over every key, after the exchange (attn);
# local-remote: keys the rank holds apart from received ones (local, remote);
# noisy-prefix: the noisy queries over their own block apart from every query over the clean
#   prefix, own shard included (noisy-block, prefix).
# A ring transport always calls once per step (local, ring).
Split = Literal["whole", "local-remote", "noisy-prefix"]
CALLS = {"whole": ("attn",), "local-remote": ("local", "remote"), "noisy-prefix": ("noisy-block", "prefix")}
FAMILIES = ("dp", "bp", "cp", "csbp", "cp-ring", "csbp-ring")

_Bool = Annotated[bool, Field(strict=True), FIGURE]
_NonNegative = Annotated[float, Field(ge=0), FIGURE]


class Pass(BaseModel):
    """One layer's attention in one phase (forward, recompute or backward) of one plan family.

    Defaults are "nothing extra": an implementation states only what it does beyond the method.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    split: Annotated[Split, FIGURE] = "local-remote"
    # kernel family per call name ("default": any call not named); "best" = the GPU's fastest
    kernels: Annotated[dict[str, str], FIGURE] = Field(default_factory=lambda: {"default": "best"})
    # calls that pack a K/V head's query heads into one query tile (FA3/FA4 pack-GQA); "all", or
    # "auto": every call packed or not, whichever computes fewer tiles
    pack_gqa: Annotated[tuple[str, ...], FIGURE] = ()
    # immediate: the collective is waited on before any attention of the layer runs
    exchange: Annotated[Literal["overlapped", "immediate"], FIGURE] = "overlapped"
    # full passes (read + write) over the call's K/V (backward: dK/dV) rows on the critical path
    copy_passes: _NonNegative = 0.0
    pad_to_largest_shard: _Bool = False  # collective buffers sized by the group's largest shard
    gradient_bytes: Annotated[int | None, Field(ge=1, le=4), FIGURE] = None  # dK/dV element; None = the step dtype

    @model_validator(mode="after")
    def _default_kernel(self) -> "Pass":
        if "default" not in self.kernels:
            raise ValueError("kernels must name a 'default' family")
        return self

    def kernel(self, call: str) -> str:
        return self.kernels.get(call, self.kernels["default"])

    def packs(self, call: str) -> bool | str:
        """Whether the call packs GQA heads into its query tiles; "auto": whichever wastes less."""
        if "auto" in self.pack_gqa:
            return "auto"
        return call in self.pack_gqa or "all" in self.pack_gqa


class Family(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    forward: Pass = Field(default_factory=Pass)
    recompute: Pass | None = None  # None: as the forward
    backward: Pass = Field(default_factory=Pass)

    def phase(self, phase: str) -> Pass:
        if phase == "recompute":
            return self.recompute or self.forward
        return self.backward if phase == "backward" else self.forward


class Implementation(BaseModel):
    """Per plan family (dp, bp, cp, csbp and the ring transports) what runs; a family not
    listed runs as `ideal` does (best kernel, collectives hidden where the graph allows)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    notes: str
    families: dict[str, Family] = Field(default_factory=dict)
    # beyond the strict shape rules (plan_rules.py): TP over a multiple of a layer's K/V heads,
    # each K/V head copied on tp / kv ranks; false (the default): TP must divide the K/V heads
    tp_replicates_kv_heads: _Bool = False
    sources: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _unwrap_facts(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if "sources" in data:
            raise ValueError("sources is filled from the {value, source} facts; do not write it")
        sources: dict[str, str] = {}
        # top-level facts (tp_replicates_kv_heads); families are unwrapped pass by pass below
        out = data | _unwrap(cls, {k: v for k, v in data.items() if k != "families"}, "", sources)
        families = data.get("families")
        if isinstance(families, dict):
            out["families"] = {
                name: {ph: _unwrap(Pass, p, f"families.{name}.{ph}.", sources) if isinstance(p, dict) else p
                       for ph, p in fam.items()} if isinstance(fam, dict) else fam
                for name, fam in families.items()}
        return {**out, "sources": sources}

    @model_validator(mode="after")
    def _known_families(self) -> "Implementation":
        unknown = sorted(set(self.families) - set(FAMILIES))
        if unknown:
            raise ValueError(f"unknown plan families {unknown}: use {', '.join(FAMILIES)}")
        for name, fam in self.families.items():
            for p in (fam.forward, fam.recompute, fam.backward):
                if p is not None and p.split == "noisy-prefix" and name != "csbp":
                    raise ValueError(f"{name}: the noisy-prefix split needs whole noisy blocks and the "
                                     "whole clean sequence on each rank after the exchange (csbp only)")
        return self

    def family(self, kind: str, transport: str) -> Family:
        """What runs for a plan of this layout kind (single, dp, bp, cp, csbp) and transport."""
        name = {"single": "dp"}.get(kind, kind)
        if name in ("cp", "csbp") and transport == "ring":
            name += "-ring"
        return self.families.get(name) or Family()

    def kernels(self) -> set[str]:
        """Every kernel family this implementation names (a profile must list them)."""
        return {k for fam in self.families.values() for p in (fam.forward, fam.recompute, fam.backward)
                if p is not None for k in p.kernels.values()} - {"best"}


def list_implementations() -> list[str]:
    return names_in(IMPLEMENTATION_DIR)


_LOADED: dict[str, Implementation] = {}


def load_implementation(name_or_path: str | Implementation) -> Implementation:
    """A shipped implementation by name (`turbo-dllm`, `ideal`) or any YAML file by path."""
    if isinstance(name_or_path, Implementation):
        return name_or_path
    if name_or_path in _LOADED:
        return _LOADED[name_or_path]
    path, raw = read_mapping(name_or_path, IMPLEMENTATION_DIR, "implementation")
    try:
        impl = Implementation.model_validate(raw)
    except ValidationError as err:
        raise InputError(f"{path}: {one_line(err)}") from None
    _LOADED[name_or_path] = impl
    return impl


def check_kernels(impl: Implementation, gpu) -> None:
    """One line if the implementation names a kernel family the GPU does not list."""
    if not gpu.attention_kernels:
        return
    missing = sorted(impl.kernels() - set(gpu.attention_kernels))
    if missing:
        raise InputError(f"implementation {impl.name!r} runs {', '.join(missing)}, which the GPU "
                         f"{gpu.name!r} does not list (it has {', '.join(gpu.attention_kernels)})")
