"""The cluster calibration's profile: the base profile's YAML with the measured figures put in.

Why from the base's YAML: the simulator reads one schema with a source on every figure, so a
measured profile must load with the same loader and say figure by figure what was measured
(`measured by <command> on <date>, hosts <list>, <NCCL or gloo version>: ...`) and what was
copied (`copied from <base>: not measured by the cluster calibration; there: <its source>`).
A measured link level replaces the base's table of measured calls (`call_seconds`) with one of
its own timings by group size, so a table from another host or method never prices this one.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import yaml

from csbp.runtime.calibration.collective_fit import non_decreasing
from csbp.runtime.calibration.fit_figures import figure, rounded
from csbp.runtime.calibration.host_identity import this_host
from csbp.runtime.calibration.link_fit import LevelFit, Sample, fit_level
from csbp.simulator.errors import InputError
from csbp.simulator.system.hardware import PROFILE_DIR, Link
from csbp.simulator.system.profile_files import read_mapping

LEVELS = ("nvlink", "infiniband")
REQUIRED = [name for name, f in Link.model_fields.items() if f.is_required()]


def copied(node, note: str):
    """`node` with every `{value, source}` figure's source prefixed by `note` (a copy)."""
    if isinstance(node, dict):
        if set(node) == {"value", "source"}:
            return {"value": node["value"], "source": f"{note}; there: {node['source']}"}
        return {key: copied(value, note) for key, value in node.items()}
    return node


def call_table(samples: list[Sample], where: str) -> dict | None:
    """The nvlink level's timed calls as the cost model reads them: by group size and op,
    seconds against the bytes each member receives (made non-decreasing over sizes)."""
    tables: dict[int, dict[str, list]] = {}
    for size in sorted({s.size for s in samples if s.level == "nvlink"}):
        for op in sorted({s.op for s in samples if s.level == "nvlink" and s.size == size}):
            pts = sorted((s for s in samples if s.level == "nvlink" and s.size == size and s.op == op),
                         key=lambda s: s.n_bytes)
            if len(pts) >= 2:
                seconds = non_decreasing([s.seconds for s in pts])
                tables.setdefault(size, {})[op] = [[rounded(s.received), rounded(t)]
                                                   for s, t in zip(pts, seconds)]
    if not tables:
        return None
    return figure(tables, f"{where}: every timed call inside a node, back to back, slowest rank, "
                          "median of the batches; x = bytes each member receives; made "
                          "non-decreasing over sizes (pool adjacent violators)")


def build(base: str, name: str, m: dict, command: str) -> tuple[dict, dict[str, LevelFit], list[str]]:
    """(profile as a YAML-ready dict, the fit per measured level, what was skipped)."""
    path, raw = read_mapping(base, PROFILE_DIR, "hardware profile")
    base_name = raw.get("name", path.stem)
    here = this_host()
    where = (f"measured by `{command}` on {m['date']}, hosts {', '.join(m['hosts'])} "
             f"({m['nodes']} x {m['ranks_per_node']} ranks), {m['backend_version']}")
    out = copied(raw, f"copied from {base_name} ({path.name}): not measured by the cluster "
                      "calibration")
    skipped = list(m["skipped"])
    fits: dict[str, LevelFit] = {}
    for level in LEVELS:
        if not any(s.level == level for s in m["samples"]):
            continue
        fit = fit_level(m["samples"], level, where)
        fits[level] = fit
        link = dict(out["links"].get(level) or {})
        link.pop("call_seconds", None)  # another method's or host's table must not price this one
        link.update(fit.figures)
        missing = [f for f in fit.skipped if f not in link and f in REQUIRED]
        if missing:
            raise InputError(f"{level}: the measurement gave no {', '.join(missing)} and the base "
                             f"profile {base_name} has none to copy: give a --hardware base with "
                             f"an {level} link")
        skipped += [f"{level}.{f}: not measured (kept the base's)" for f in fit.skipped]
        out["links"][level] = link
    table = call_table(m["samples"], where)
    if table is not None:
        out["links"]["nvlink"]["call_seconds"] = table
    out["node"]["gpus_per_node"] = figure(m["ranks_per_node"], f"{where}: ranks per node "
                                          "torchrun started (by host name or --ranks-per-node)")
    if m.get("kernels") and m["kernels"].get("gpu"):
        out["gpu"] = m["kernels"]["gpu"]  # the kit's: measured figures and the base's, sourced
    out.update(name=name, kind="measured", host=",".join(m["hosts"]), date=here.date,
               cpu_model=here.cpu_model, cpus=here.cpus, torch=here.torch,
               notes=(f"Cluster calibration ({m['backend_version']}, {m['nodes']} node(s) x "
                      f"{m['ranks_per_node']} ranks, hosts {', '.join(m['hosts'])}, {m['date']}): "
                      f"measured {', '.join(f'links.{lv}' for lv in fits) or 'no link'}"
                      + (", gpu (one-GPU kit)" if m.get("kernels") and m["kernels"].get("gpu") else "")
                      + f"; everything else copied from {base_name} with its source. Skipped: "
                      + ("; ".join(skipped) or "nothing") + "."))
    return out, fits, skipped


def write(path: Path, profile: dict, command: str) -> None:
    header = (f"# csbp hardware profile measured by `{command}`.\n# Figures whose source says "
              "'measured' come from this run; the rest were copied from the base profile with "
              "their sources.\n# Field meanings and units: hardware_profiles/README.md.\n\n")
    path.write_text(header + yaml.safe_dump(profile, sort_keys=False, width=100,
                                            default_flow_style=None))


def residuals(profile, samples: list[Sample]) -> list[dict]:
    """Every timed call against the fitted profile's price (the table where it has one) and the
    alpha-beta price alone: the check of the fit, the `world` group's included."""
    from csbp.simulator.cost.cost import collective_seconds
    from csbp.simulator.cost.step_ops import Comm, Group

    nvlink = profile.links.nvlink.model_copy(update={"call_seconds": None})
    bare = profile.model_copy(update={"links": profile.links.model_copy(update={"nvlink": nvlink})})
    rows = []
    for s in samples:
        work = Comm("p2p" if s.op == "send_recv" else s.op.replace("_", "-"), (s.received,),
                    Group(size=s.size, per_node=s.per_node, sync=((0,),)), "other")
        priced = collective_seconds(work, s.received, profile)
        alpha_beta = collective_seconds(work, s.received, bare)
        rows.append({"group": s.group, "level": s.level, "size": s.size, "op": s.op,
                     "bytes": s.n_bytes, "measured_s": s.seconds, "predicted_s": priced,
                     "error": priced / s.seconds - 1, "alpha_beta_s": alpha_beta,
                     "alpha_beta_error": alpha_beta / s.seconds - 1})
    return rows


def error_summary(rows: list[dict], key: str) -> dict:
    errors = sorted(abs(r[key]) for r in rows)
    return {"median_abs": statistics.median(errors), "max_abs": errors[-1]} if errors else {}
