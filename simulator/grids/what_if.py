"""What-if hardware: a profile with some figures scaled or replaced, from one command-line string.

`nvlink=2x,ib=0.5x,hbm=6000,flops=+20%` asks what a faster network, a new GPU or a better kernel
would change without writing a profile file. Each item names a documented short name (a group of
related figures) or a dotted path to any numeric figure of `gpu`, `node` or `links`; the value is
a factor (`2x`, `+20%`, `-20%`) or, for a single figure, the new value in the figure's unit. Curves
(efficiencies by size) scale their fractions, never their sizes. The result is an ordinary,
validated `HardwareProfile` whose name and sources say what was changed, plus the list of changes
so every report can state the values it ran on.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from csbp.simulator.errors import InputError, one_line
from csbp.simulator.system.hardware import GPU, HardwareProfile, Links, Node

BANDWIDTHS = ("collective_gbs", "p2p_gbs", "alltoall_gbs", "all_reduce_gbs", "reduce_scatter_gbs")
LATENCIES = ("call_latency_us", "step_latency_us", "p2p_latency_us")

# short name -> (what it means, the dotted paths it scales); one path = a value may also be set
SHORT_NAMES: dict[str, tuple[str, tuple[str, ...]]] = {
    "nvlink": ("every bandwidth of the NVLink fabric", tuple(f"links.nvlink.{f}" for f in BANDWIDTHS)),
    "ib": ("every bandwidth of the InfiniBand fabric", tuple(f"links.infiniband.{f}" for f in BANDWIDTHS)),
    "nvlink-latency": ("every latency of the NVLink fabric", tuple(f"links.nvlink.{f}" for f in LATENCIES)),
    "ib-latency": ("every latency of the InfiniBand fabric",
                   tuple(f"links.infiniband.{f}" for f in LATENCIES)),
    "flops": ("dense BF16 peak", ("gpu.peak_tflops",)),
    "hbm": ("HBM bandwidth", ("gpu.hbm_gbs",)),
    "memory": ("HBM capacity", ("gpu.memory_gib",)),
    "reserve": ("memory reserved outside the model", ("gpu.reserved_gib",)),
    "attention": ("attention efficiency, forward and backward",
                  ("gpu.attention_forward_efficiency", "gpu.attention_backward_efficiency")),
    "gemm": ("GEMM efficiency", ("gpu.gemm_efficiency",)),
    "interference": ("compute slowed beside collectives: NCCL's SM share and HBM traffic ratio",
                     ("gpu.comm_sm_share", "gpu.comm_hbm_traffic_ratio")),
    "domain": ("GPUs per NVLink domain (node)", ("node.gpus_per_node",)),
}
SECTIONS = ("gpu", "node", "links")
_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?"


@dataclass(frozen=True)
class Setting:
    """One item of a what-if: scale by `factor`, or set to `value`."""

    name: str
    factor: float | None = None
    value: float | None = None
    text: str = ""  # as written, e.g. '2x'

    @property
    def how(self) -> str:
        return f"x{self.factor:g}" if self.factor is not None else "set"


@dataclass(frozen=True)
class Change:
    """One figure the what-if changed: its path, old and new value, and how."""

    field: str
    was: Any
    now: Any
    how: str  # 'x2' | 'set'

    def text(self) -> str:
        if isinstance(self.now, tuple):
            ys = lambda c: f"{min(y for _, y in c):.3g}-{max(y for _, y in c):.3g}"  # noqa: E731
            return f"{self.field}: fractions {ys(self.was)} -> {ys(self.now)} ({self.how})"
        was = "unset" if self.was is None else f"{self.was:g}"
        return f"{self.field}: {was} -> {self.now:g} ({self.how})"

    def to_json(self) -> dict:
        return {"field": self.field, "was": self.was, "now": self.now, "how": self.how}


@dataclass(frozen=True)
class WhatIf:
    """The scaled profile and what was scaled (`changes` is empty for no what-if)."""

    profile: HardwareProfile
    changes: tuple[Change, ...] = ()
    spec: str = ""

    def to_json(self) -> list[dict]:
        return [c.to_json() for c in self.changes]

    def lines(self) -> list[str]:
        return [f"what-if: {c.text()}" for c in self.changes]


def parse(text: str) -> list[Setting]:
    """'nvlink=2x,hbm=6000' -> settings; malformed items are one-line errors."""
    settings = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        name, sep, value = (p.strip() for p in item.partition("="))
        if not sep or not name or not value:
            raise InputError(f"--what-if {item!r}: write name=value, e.g. nvlink=2x, ib=0.5x, "
                             "hbm=6000, flops=+20%")
        v = value.lower()
        if m := re.fullmatch(rf"({_NUMBER})x", v):
            setting = Setting(name, factor=float(m[1]), text=value)
        elif m := re.fullmatch(rf"([+-])({_NUMBER})%", v):
            setting = Setting(name, factor=1 + (1 if m[1] == "+" else -1) * float(m[2]) / 100, text=value)
        elif re.fullmatch(_NUMBER, v):
            setting = Setting(name, value=float(v), text=value)
        else:
            raise InputError(f"--what-if {item!r}: {value!r} is neither a factor (2x, +20%, -20%) "
                             "nor a number")
        for x in (setting.factor, setting.value):
            if x is not None and not (math.isfinite(x) and x > 0):
                raise InputError(f"--what-if {item!r}: the result must be a positive number")
        settings.append(setting)
    if not settings:
        raise InputError("--what-if: give name=value items, e.g. nvlink=2x,ib=0.5x")
    return settings


def paths_of(setting: Setting, profile: HardwareProfile) -> tuple[str, ...]:
    """The dotted paths a setting touches on this profile (unset optional figures skipped)."""
    if setting.name in SHORT_NAMES:
        paths = SHORT_NAMES[setting.name][1]
        if paths[0].startswith("links.infiniband.") and profile.links.infiniband is None:
            raise InputError(f"--what-if {setting.name}: profile {profile.name!r} describes one host; "
                             "it has no infiniband link")
        if len(paths) > 1:  # a group: only the figures this profile has
            paths = tuple(p for p in paths if _get(profile, p) is not None)
            if setting.value is not None:
                raise InputError(f"--what-if {setting.name}={setting.text}: {setting.name} names "
                                 f"{len(paths)} figures; scale them with a factor (e.g. 2x) or set "
                                 "one by its dotted path")
        return paths
    if setting.name.split(".")[0] not in SECTIONS:
        raise InputError(f"--what-if {setting.name!r}: unknown name; use one of "
                         f"{', '.join(SHORT_NAMES)} or a dotted path to a figure of "
                         f"{', '.join(SECTIONS)} (e.g. gpu.peak_tflops, links.nvlink.p2p_gbs)")
    return (setting.name,)


def _get(profile: HardwareProfile, path: str) -> Any:
    obj: Any = profile
    for part in path.split("."):
        if not hasattr(obj, part) or part not in type(obj).model_fields:
            raise InputError(f"--what-if {path!r}: profile {profile.name!r} has no such field")
        obj = getattr(obj, part)
    return obj


def _new_value(path: str, old: Any, s: Setting) -> Any:
    curve = isinstance(old, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in old)
    number = isinstance(old, (int, float)) and not isinstance(old, bool)
    if not (curve or number or (old is None and s.value is not None)):
        raise InputError(f"--what-if {s.name}: {path} is not a number or a curve "
                         "(nothing to scale)" if old is not None else
                         f"--what-if {s.name}: {path} is not set in this profile; set it with a "
                         "value, not a factor")
    if curve:
        if s.factor is None:
            raise InputError(f"--what-if {s.name}={s.text}: {path} is a curve; scale it with a factor")
        new = tuple((x, y * s.factor) for x, y in old)
        if max(y for _, y in new) > 1:
            raise InputError(f"--what-if {s.name}={s.text}: {path} would exceed a fraction of 1 "
                             f"({max(y for _, y in old):.3g} x {s.factor:g})")
        return new
    value = s.value if s.factor is None else old * s.factor
    if isinstance(old, int) and not isinstance(old, bool):
        if abs(value - round(value)) > 1e-9:
            raise InputError(f"--what-if {s.name}={s.text}: {path} is a whole number, "
                             f"{old} gives {value:g}")
        return int(round(value))
    return float(value)


def _set(data: dict, path: str, value: Any) -> None:
    *head, last = path.split(".")
    for part in head:
        data = data[part]
    data[last] = value


def apply(profile: HardwareProfile, text: str | None) -> WhatIf:
    """The profile with the what-if applied (unchanged, and no changes, for None or '')."""
    if not text:
        return WhatIf(profile)
    return apply_settings(profile, parse(text))


def apply_settings(profile: HardwareProfile, settings: list[Setting]) -> WhatIf:
    data = profile.model_dump(exclude={"sources"})
    sources, changes, seen = dict(profile.sources), [], set()
    for s in settings:
        for path in paths_of(s, profile):
            if path in seen:
                raise InputError(f"--what-if: {path} is changed twice")
            seen.add(path)
            old = _get(profile, path)
            new = _new_value(path, old, s)
            _set(data, path, new)
            changes.append(Change(path, old, new, s.how))
            was = sources.get(path, "not set")
            sources[path] = f"what-if {s.name}={s.text} ({s.how}) over: {was}"
    spec = ",".join(f"{s.name}={s.text}" for s in settings)
    try:
        gpu, node = GPU.model_validate(data["gpu"]), Node.model_validate(data["node"])
        links = Links.model_validate(data["links"])
    except ValidationError as err:
        raise InputError(f"--what-if {spec}: {one_line(err)}") from None
    scaled = profile.model_copy(update={"name": f"{profile.name} what-if({spec})", "gpu": gpu,
                                        "node": node, "links": links, "sources": sources})
    return WhatIf(scaled, tuple(changes), spec)


def help_text() -> str:
    names = "; ".join(f"{n} = {meaning}" for n, (meaning, _) in SHORT_NAMES.items())
    return ("scale profile figures, e.g. nvlink=2x,ib=0.5x,hbm=6000,flops=+20%%: a short name or a "
            f"dotted path (gpu.peak_tflops, links.nvlink.p2p_gbs, ...) = factor (2x, +20%%, -20%%) "
            f"or new value. Short names: {names}")
