"""A measured hardware profile from the kit's microbenchmarks, in the datasheet profile's schema.

Why: the simulator reads one schema (every figure `{value, source}`); a measured profile must load
with the same loader and say, figure by figure, what was measured and what was copied. So the
writer starts from the datasheet profile's own YAML (`--base`, h200.yaml) and replaces only the
figures it measured: every other field, including fields this kit does not know yet, is kept
with its source. One GPU cannot measure NVLink or InfiniBand: node and links stay the base's.

Attention: a base with per-family factors over FA3-class curves (`gpu.attention_kernels`) keeps
its FA3 curves unless FA3 itself was measured, and gets each measured family's factor (measured
efficiency over the curve at the same tile, median over tiles, head dim 128); a base without
them gets the best measured family's curves.
"""

from __future__ import annotations

import copy
import datetime as dt
import socket
import statistics
from pathlib import Path

import yaml

from kernel_bench import LABELS, Point, efficiency, log_bins

# the kit's family names -> the profile's attention_kernels keys
FAMILY_KEYS = {"fa3": "fa3", "fa4": "fa4", "flex-triton": "flex-triton", "cudnn": "cudnn",
               "fa2": "fa2"}


def _figure(value, source: str) -> dict:
    return {"value": value, "source": source}


def _significant(x: float) -> float:
    """Three significant digits, never 0 (the profile's factors are positive)."""
    return max(float(f"{x:.3g}"), 1e-9)


def _interpolate(curve, x: float) -> float:
    from csbp.simulator.system.hardware import interpolate

    return interpolate(curve, x)


def attention_curve(points: list[Point], family: str, direction: str, head_dim: int,
                    peak: float) -> list[list[float]]:
    return log_bins([(p.size, efficiency(p, peak)) for p in points
                     if p.what == "attention" and p.family == family and p.direction == direction
                     and p.head_dim == head_dim and "causal" not in p.shape
                     and p.seconds is not None], per_decade=10)


def best_curve(points: list[Point], direction: str, head_dim: int, peak: float
               ) -> tuple[list[list[float]], list[str]]:
    """Per tile, the fastest family's efficiency (and which families those were)."""
    best: dict[float, tuple[float, str]] = {}
    for p in points:
        if (p.what == "attention" and p.direction == direction and p.head_dim == head_dim
                and "causal" not in p.shape and p.seconds is not None):
            e = efficiency(p, peak)
            if p.size not in best or e > best[p.size][0]:
                best[p.size] = (e, p.family)
    curve = log_bins([(x, e) for x, (e, _) in best.items()], per_decade=10)
    return curve, sorted({f for _, f in best.values()})


def masked_factor(points: list[Point]) -> tuple[float, str] | None:
    """Block-causal against full attention at one tile: causal does half the FLOP, so at equal
    efficiency it takes half the time. Fastest family that measured both."""
    found = []
    for family in {p.family for p in points if p.what == "attention"}:
        mine = [p for p in points if p.family == family and p.what == "attention"
                and p.seconds is not None]
        causal = [p for p in mine if "causal" in p.shape]
        if len({p.direction for p in causal}) < 2:
            continue
        tile, head_dim = causal[0].size, causal[0].head_dim
        full = [p for p in mine if "causal" not in p.shape and p.size == tile
                and p.head_dim == head_dim]
        if len({p.direction for p in full}) < 2:
            continue
        c, f = sum(p.seconds for p in causal), sum(p.seconds for p in full)
        found.append((c, min(1.0, f / 2 / c), f"{family} at tile {tile:g}, head dim {head_dim}: "
                      f"causal fwd + bwd {c * 1e3:.3f} ms vs full {f * 1e3:.3f} ms for twice "
                      "the FLOP"))
    if not found:
        return None
    _, factor, why = min(found)
    return _significant(factor), why


def _mark_copied(section, copied: str) -> None:
    """Prefix every `{value, source}` figure's source under `section` with where it came from."""
    if not isinstance(section, dict):
        return
    for value in section.values():
        if isinstance(value, dict) and set(value) == {"value", "source"}:
            value["source"] = f"{copied}; there: {value['source']}"
        else:
            _mark_copied(value, copied)


def build(base_path: Path, points: list[Point], env: dict, name: str) -> dict:
    """The measured profile as a YAML-ready dict (see the module docstring)."""
    raw = yaml.safe_load(base_path.read_text())
    out = copy.deepcopy(raw)
    gpu = out["gpu"]
    where = env["where"]
    base_name = raw.get("name", base_path.stem)
    copied = f"copied from {base_name} ({base_path.name}): not measured by the kit"
    _mark_copied(out, copied)  # every figure; the measured ones are replaced below
    peak = float(raw["gpu"]["peak_tflops"]["value"])
    out.update(name=name, kind="measured", host=socket.gethostname(),
               date=dt.date.today().isoformat(), torch=env["torch"],
               notes=(f"Compute side measured by benchmarks/gpu_check.py on {where}; every other "
                      f"figure copied from {base_name} with its source. " + env.get("caveat", "")))
    gpu["name"] = env["device_name"]
    if env.get("memory_total_bytes"):
        total = env["memory_total_bytes"] / 2**30
        gpu["memory_gib"] = _figure(round(total, 2), f"measured: torch.cuda.mem_get_info total ({where})")
        context = env["context_bytes"] / 2**30
        gpu["reserved_gib"] = _figure(round(context + 0.05 * total, 2),
                                      f"measured CUDA context {context:.2f} GiB (total - free after "
                                      "init) plus assumption [U]: ~5% of HBM lost to allocator "
                                      "fragmentation; NCCL buffers not measured on one GPU")
    gemms = [p for p in points if p.what == "gemm" and p.seconds is not None]
    if gemms:
        top = max(gemms, key=lambda p: p.tflops)
        gpu["peak_tflops"]["source"] = (f"{copied}; there: {raw['gpu']['peak_tflops']['source']}; "
                                        f"best measured GEMM {top.shape}: {top.tflops:.1f} TFLOP/s")
        gpu["gemm_efficiency"] = _figure(
            log_bins([(p.size, efficiency(p, peak)) for p in gemms]),
            f"measured: {len(gemms)} GEMMs x @ W ({', '.join(sorted({p.shape.split('x', 1)[1] for p in gemms}))} "
            f"at {', '.join(sorted({p.shape.split('x')[0] for p in gemms}, key=int))} tokens, "
            f"{env['dtype']}, {where}); median per third of a decade of GFLOP, fraction of "
            "peak_tflops")
    memory = {p.direction: p for p in points if p.what == "memory" and p.seconds is not None}
    if "copy" in memory:
        copy_gbs = memory["copy"].size
        gpu["hbm_gbs"] = _figure(round(copy_gbs, 1), f"measured: copy_ of {memory['copy'].shape} "
                                 f"elements, read + write counted ({where})")
        if "elementwise" in memory:
            gpu["hbm_efficiency"] = _figure(
                round(min(1.0, memory["elementwise"].size / copy_gbs), 3),
                f"measured: silu(x) * y reaches {memory['elementwise'].size:.0f} GB/s of the copy's "
                f"{copy_gbs:.0f} GB/s")
    if "launch" in memory:
        gpu["op_overhead_us"] = _figure(round(memory["launch"].seconds * 1e6, 3),
                                        "measured: per tiny kernel (in-place add of 8 elements) "
                                        "launched back to back")
    _attention(gpu, points, peak, where)
    _head_dims(gpu, points, peak, where)
    _grouped(gpu, points, peak, where, env)
    _linear(gpu, points, peak, where)
    factor = masked_factor(points)
    if factor:
        gpu["masked_attention_efficiency_factor"] = _figure(factor[0], f"measured: {factor[1]}")
    return out


def _attention(gpu: dict, points: list[Point], peak: float, where: str) -> None:
    head_dim = min((p.head_dim for p in points if p.what == "attention" and p.head_dim), default=0)
    kernels = gpu.get("attention_kernels")
    if isinstance(kernels, dict) and any(p.family == "fa3" and p.seconds for p in points):
        for direction, key in (("fwd", "attention_forward_efficiency"),
                               ("bwd", "attention_backward_efficiency")):
            curve = attention_curve(points, "fa3", direction, head_dim, peak)
            if curve:
                gpu[key] = _figure(curve, f"measured: FA3 (flash_attn_interface), head dim "
                                   f"{head_dim}, non-causal, {where}")
    if not isinstance(kernels, dict):  # no families in the schema: the best measured kernel
        for direction, key in (("fwd", "attention_forward_efficiency"),
                               ("bwd", "attention_backward_efficiency")):
            curve, families = best_curve(points, direction, head_dim, peak)
            if curve:
                gpu[key] = _figure(curve, f"measured: fastest of {'/'.join(families)} per tile, "
                                   f"head dim {head_dim}, non-causal, batch x tile fixed, {where}; "
                                   "FLOP 4 B S^2 d H (x2.5 backward) / time / peak")
        return
    for family, key in FAMILY_KEYS.items():
        entry = kernels.get(key)
        if not isinstance(entry, dict):
            continue
        for direction, field, curve_key in (("fwd", "forward_factor", "attention_forward_efficiency"),
                                            ("bwd", "backward_factor", "attention_backward_efficiency")):
            curve = gpu[curve_key]["value"]
            ratios = [efficiency(p, peak) / _interpolate(curve, p.size) for p in points
                      if p.what == "attention" and p.family == family and p.direction == direction
                      and p.head_dim == head_dim and "causal" not in p.shape and p.seconds]
            if ratios and field in entry:
                entry[field] = _figure(_significant(statistics.median(ratios)),
                                       f"measured: {LABELS.get(family, family)} efficiency "
                                       "over the profile's "
                                       f"FA3-class curve at the same tile, median of "
                                       f"{len(ratios)} tiles, head dim {head_dim}, non-causal, "
                                       f"{where}")


def _median_efficiency(points: list[Point], peak: float, **match) -> float | None:
    found = [efficiency(p, peak) for p in points if p.seconds is not None
             and all(getattr(p, k) == v for k, v in match.items())]
    return statistics.median(found) if found else None


def _head_dims(gpu: dict, points: list[Point], peak: float, where: str) -> None:
    """Each family's efficiency at the larger head dim over its own at the smaller one (same
    tiles, non-causal), forward and backward: `head_dim_factors` [[hd, fwd, bwd]]."""
    kernels = gpu.get("attention_kernels")
    dims = sorted({p.head_dim for p in points if p.what == "attention" and p.head_dim})
    if not isinstance(kernels, dict) or len(dims) < 2:
        return
    low, high = dims[0], dims[-1]
    for family, key in FAMILY_KEYS.items():
        entry = kernels.get(key)
        if not isinstance(entry, dict):
            continue
        ratios = []
        for direction in ("fwd", "bwd"):
            pts = [p for p in points if p.what == "attention" and p.family == family
                   and p.direction == direction and "causal" not in p.shape and p.seconds]
            by = {(p.size, p.head_dim): efficiency(p, peak) for p in pts}
            r = [by[(t, high)] / by[(t, low)] for t, d in by if d == low and (t, high) in by]
            ratios.append(_significant(statistics.median(r)) if r else None)
        if None not in ratios:
            entry["head_dim_factors"] = _figure(
                [[high, *ratios]], f"measured: {LABELS.get(family, family)} efficiency at head dim "
                f"{high} over its own at {low}, median over tiles, forward / backward, non-causal, {where}")


def _grouped(gpu: dict, points: list[Point], peak: float, where: str, env: dict) -> None:
    """`gemm_kernels.grouped-mm.efficiency`: forward + backward FLOP over time, per expert width."""
    widths = sorted({p.size for p in points if p.what == "grouped-gemm" and p.seconds})
    curve = []
    for w in widths:
        mine = [p for p in points if p.what == "grouped-gemm" and p.size == w and p.seconds]
        if {p.direction for p in mine} == {"fwd", "bwd"}:
            flop, sec = sum(p.flop for p in mine), sum(p.seconds for p in mine)
            curve.append([w, _significant(min(1.0, flop / sec / 1e12 / peak))])
    if curve:
        shape = next(p.shape for p in points if p.what == "grouped-gemm" and p.seconds)
        gpu.setdefault("gemm_kernels", {})["grouped-mm"] = {"efficiency": _figure(
            curve, f"measured: gate+up and down grouped GEMMs ({shape.rsplit(' ', 1)[0]}, equal "
            f"groups), forward + backward FLOP over their time, by expert width, {env['dtype']}, {where}")}


def _linear(gpu: dict, points: list[Point], peak: float, where: str) -> None:
    """`linear_attention_kernels.fla-triton`: the clean pass's efficiency (the noisy blocks'
    varlen pass is reported beside it, not in the profile)."""
    fwd = _median_efficiency(points, peak, what="linear", family="fla-triton", direction="fwd", size=1.0)
    bwd = _median_efficiency(points, peak, what="linear", family="fla-triton", direction="bwd", size=1.0)
    if fwd and bwd:
        shape = next(p.shape for p in points if p.what == "linear" and p.seconds)
        src = (f"measured: flash-linear-attention chunk_gated_delta_rule, one sequence {shape}, on "
               "linear_ops.delta_rule_flops_per_token (x2.5 backward) / time / peak, " + where)
        gpu.setdefault("linear_attention_kernels", {})["fla-triton"] = {
            "forward_efficiency": _figure(_significant(min(1.0, fwd)), src),
            "backward_efficiency": _figure(_significant(min(1.0, bwd)), src)}


def write(path: Path, profile: dict) -> None:
    header = ("# csbp hardware profile written by benchmarks/gpu_check.py: measured figures say "
              "'measured', the rest\n# were copied from the base profile with their sources.\n")
    path.write_text(header + yaml.safe_dump(profile, sort_keys=False, width=100))
