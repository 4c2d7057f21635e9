"""Which host, CPU and torch a measured profile came from, and whether this host is that one.

A measured profile is true of the host that measured it: another CPU, core count or torch build
runs the same step at another speed, and a VM's speed moves over days. Read off a profile from
another host, the errors of `csbp validate` are the hosts' difference, not the model's (a fresh
2-core host of the same kind saw 60 % with the committed profile, 13 % after calibrating).
`csbp calibrate` records the identity in the profile; `csbp validate` compares it with this
host and says what differs, so that nobody mistakes one for the other.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

MAX_AGE_DAYS = 7  # [U] a profile older than a week is re-measured: a shared VM's speed moves
FIELDS = ("host", "cpu_model", "cpus", "torch", "date")  # the profile's top-level keys


@dataclass(frozen=True)
class HostIdentity:
    """What a measurement depends on besides the code: host, CPU, cores, torch, and the day."""

    host: str
    cpu_model: str
    cpus: int
    torch: str | None
    date: str  # ISO date

    def as_profile_fields(self) -> dict:
        return {key: getattr(self, key) for key in FIELDS}


def this_host(today: dt.date | None = None) -> HostIdentity:
    return HostIdentity(host=os.uname().nodename, cpu_model=cpu_model(),
                        cpus=len(os.sched_getaffinity(0)), torch=torch_version(),
                        date=(today or dt.date.today()).isoformat())


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (the platform's guess where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def torch_version() -> str | None:
    """Installed torch, read without importing it (a second of start-up on a small host)."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages: other work on the host shows up in every figure."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def profile_warnings(profile, here: HostIdentity) -> list[str]:
    """One line per reason the profile may not describe this host now, each recommending
    `csbp calibrate`; none when it was measured here, with this torch, within MAX_AGE_DAYS."""
    advice = "run `csbp calibrate` on this host"
    if profile.kind != "measured":
        return [f"profile {profile.name} is a {profile.kind} profile, not a measurement of this "
                f"host: {advice} and validate against its profile"]
    out = []
    missing = [name for name, value in (("host name", profile.host), ("CPU model", profile.cpu_model),
                                        ("core count", profile.cpus), ("date", profile.date))
               if value is None]
    if missing:
        out.append(f"profile {profile.name} does not record its {_listed(missing)}: its origin is "
                   f"unknown, so its errors may be another host's; {advice}")
    differs = [f"{what} {there!r} there, {mine!r} here" for what, there, mine in (
        ("host", profile.host, here.host), ("CPU", profile.cpu_model, here.cpu_model),
        ("CPUs", profile.cpus, here.cpus)) if there is not None and there != mine]
    if differs:
        out.append(f"profile {profile.name} was measured on another host ({'; '.join(differs)}): "
                   f"its speeds are that host's; {advice}")
    if profile.torch is not None and here.torch is not None and profile.torch != here.torch:
        out.append(f"profile {profile.name} was measured with torch {profile.torch}, this host "
                   f"has {here.torch}: op speeds change between versions; {advice}")
    age = _age_days(profile.date, here.date)
    if profile.date is not None and age is None:
        out.append(f"profile {profile.name} has an unreadable date {profile.date!r}; {advice}")
    elif age is not None and age > MAX_AGE_DAYS:
        out.append(f"profile {profile.name} was measured {age} days ago ({profile.date}): a "
                   f"host's speed moves over days; {advice}")
    return out


def _age_days(then: str | None, today: str) -> int | None:
    try:
        return (dt.date.fromisoformat(today) - dt.date.fromisoformat(str(then))).days
    except ValueError:
        return None


def _listed(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
