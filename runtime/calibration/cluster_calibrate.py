"""`torchrun ... -m csbp.runtime.training.torchrun --calibrate --out my-cluster.yaml`: the fabric
of the ranks torchrun started, measured into a hardware profile.

On every kind of group the planner places (`cluster_groups`: pairs and whole nodes inside a node,
one rank per node across nodes, the whole world as a check), all instances at once, it times
all-gather, reduce-scatter, all-reduce, all-to-all and send/recv through the runtime's comm layer
over a short ladder of buffer sizes (default 1 MiB..1 GiB on NCCL, 256 KiB..4 MiB on gloo), as
nccl-tests does: calls back to back after a warm-up, the slowest rank's time, median of repeats.
Where CUDA is present, rank 0 also runs the one-GPU kit's kernel measurements
(benchmarks/kernel_bench.py, `measured_profile.build`), if the kit is in this checkout. The
fit is `link_fit`; the profile, with a source on every figure, `cluster_profile`. A time budget
bounds the whole run (default 8 minutes; the ladder above takes well under one on 16 GPUs), and
whatever it or the node layout leaves out is listed in the result and in the profile's notes.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from csbp.runtime.calibration.cluster_groups import GroupKind, group_kinds, nodes_of
from csbp.runtime.calibration.fit_figures import GIB, KIB, MIB
from csbp.runtime.calibration.link_fit import Sample
from csbp.runtime.distributed.comm import Comm
from csbp.simulator.errors import InputError

DEFAULT_SIZES = {"nccl": (1 * MIB, 8 * MIB, 64 * MIB, 256 * MIB, 1 * GIB),
                 "gloo": (256 * KIB, 1 * MIB, 4 * MIB)}
UNITS = {"K": KIB, "M": MIB, "G": GIB}
TARGET_S = 0.02  # each timed batch of calls lasts about this long (timer and launch noise << it)
MAX_CALLS = 50


def add_calibrate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--calibrate", action="store_true",
                   help="measure the fabric of the ranks torchrun started into a hardware "
                        "profile at --out (collectives inside and across nodes, and on CUDA the "
                        "one-GPU kit's kernels); --hardware names the profile copied for "
                        "everything not measured")
    p.add_argument("--sizes", default=None, metavar="LIST",
                   help="with --calibrate: buffer sizes, e.g. 1M,16M,256M,1G (default "
                        "1M,8M,64M,256M,1G on NCCL, 256K,1M,4M on gloo)")
    p.add_argument("--repeats", type=int, default=3, help="with --calibrate: timed batches per "
                   "size (median; default 3)")
    p.add_argument("--budget-s", type=float, default=480.0, help="with --calibrate: seconds "
                   "the measurement may take; what does not fit is skipped and listed (default 480)")
    p.add_argument("--kernel-budget-s", type=float, default=120.0, help="with --calibrate on "
                   "CUDA: seconds of the budget for the one-GPU kit's kernels (default 120; 0 skips)")
    p.add_argument("--ranks-per-node", type=int, default=None, metavar="K",
                   help="with --calibrate: treat blocks of K consecutive ranks as nodes (default: "
                        "by host name)")
    p.add_argument("--name", default=None, help="with --calibrate: profile name (default: the "
                   "--out file's stem)")


def parse_sizes(text: str) -> tuple[int, ...]:
    """'64K,1M,1G' -> bytes, increasing; one clear line for anything else."""
    sizes = []
    for item in text.split(","):
        item = item.strip().upper().removesuffix("B")
        unit = UNITS.get(item[-1:], 1)
        number = item[:-1] if item[-1:] in UNITS else item
        try:
            value = float(number) * unit
        except ValueError:
            raise InputError(f"--sizes {text!r}: write sizes like 256K,1M,1G") from None
        if value < 4 * 16 or value > 16 * GIB:
            raise InputError(f"--sizes: {item} is outside 64 B..16 GiB")
        sizes.append(int(value))
    if len(set(sizes)) < 2:
        raise InputError("--sizes: give at least two different sizes (the fit needs a slope)")
    return tuple(sorted(set(sizes)))


@dataclass(frozen=True)
class Settings:
    out: Path
    name: str
    base: str
    sizes: tuple[int, ...] | None
    repeats: int
    budget_s: float
    kernel_budget_s: float
    ranks_per_node: int | None
    timeout_s: float


def settings_from_args(args: argparse.Namespace, default_base: str) -> Settings:
    """The calibration's flags, checked before any process group starts."""
    from csbp.simulator.system.hardware import load_profile

    if not args.out:
        raise InputError("--calibrate needs --out PROFILE.yaml")
    out = Path(args.out)
    if out.suffix not in (".yaml", ".yml"):
        raise InputError(f"{out}: the profile path must end in .yaml")
    if not out.parent.is_dir():
        raise InputError(f"{out.parent}: no such directory")
    name = args.name or out.stem
    if not name.replace("-", "").replace("_", "").isalnum():
        raise InputError(f"bad profile name {name!r}: use letters, digits, '-' and '_'")
    if args.repeats < 1 or args.budget_s <= 0 or args.kernel_budget_s < 0:
        raise InputError("--repeats must be at least 1, --budget-s positive, --kernel-budget-s >= 0")
    base = args.hardware or default_base
    load_profile(base)  # a bad base is refused now, not after the measurement
    return Settings(out, name, base, parse_sizes(args.sizes) if args.sizes else None, args.repeats,
                    args.budget_s, args.kernel_budget_s, args.ranks_per_node, args.timeout)


def measure(s: Settings, rank: int, world: int, device: torch.device) -> dict:
    """Every rank runs this after the process group is up; rank 0's return has it all."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    hosts: list = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    nodes = nodes_of(hosts, s.ranks_per_node)
    kinds = group_kinds(nodes)
    comm = Comm()
    groups = {kind.name: [comm.new_group(list(m)) for m in kind.instances] for kind in kinds}
    sizes = s.sizes or DEFAULT_SIZES[backend]
    began = time.monotonic()
    samples, skipped = [], []
    link_budget = s.budget_s - (s.kernel_budget_s if device.type == "cuda" else 0.0)
    for kind in kinds:
        for op in kind.ops:
            for n_bytes in sizes:
                if _elapsed(began, device) > link_budget:
                    skipped.append(f"{kind.name} {op} {n_bytes // KIB} KiB (budget)")
                    continue
                seconds = _time_call(kind, groups[kind.name], op, n_bytes, rank, device, comm, s.repeats)
                samples.append(Sample(kind.name, kind.level, kind.size, kind.per_node, op, n_bytes, seconds))
    if len(nodes[0]) < 2:
        skipped.append("inside a node: one rank per node, no intra-node group to time")
    if len(nodes) < 2:
        skipped.append("across nodes: one node (InfiniBand figures stay the base profile's)")
    kernels = _kernels(s, rank, device, skipped)
    return {"samples": samples, "skipped": skipped, "hosts": sorted(set(hosts)), "nodes": len(nodes),
            "ranks_per_node": len(nodes[0]), "backend": backend, "backend_version": _version(backend),
            "sizes": sizes, "kinds": [(k.name, k.level, k.size, k.per_node, len(k.instances)) for k in kinds],
            "kernels": kernels, "seconds": time.monotonic() - began,
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def _elapsed(began: float, device: torch.device) -> float:
    """Seconds since `began`, the largest over ranks: every rank takes the same budget decision."""
    t = torch.tensor([time.monotonic() - began], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _call(op: str, n_bytes: int, members: tuple[int, ...], group, rank: int,
          device: torch.device, comm: Comm):
    """One call of the runtime's comm layer by this rank's instance, over a buffer of `n_bytes`
    (the whole: gathered, scattered, reduced or exchanged; send/recv: the message)."""
    size, me = len(members), members.index(rank)
    elements = max(size, n_bytes // 4 // size * size)
    full = torch.ones(elements, device=device)
    part = full[: elements // size].clone()
    splits = [elements // size] * size
    peer = members[1 - me] if size == 2 else None
    table = {
        "all_gather": lambda: comm.all_gather(part, group, "other"),
        "reduce_scatter": lambda: comm.reduce_scatter(full, group, "other"),
        "all_reduce": lambda: comm.all_reduce(full, "other", group),
        "all_to_all": lambda: comm.all_to_all(full, splits, splits, me, group, "other"),
        "send_recv": lambda: comm.send_recv({peer: full}, {peer: elements}, full, "other"),
    }
    return table[op]


def _time_call(kind: GroupKind, groups: list, op: str, n_bytes: int, rank: int,
               device: torch.device, comm: Comm, repeats: int) -> float:
    """Seconds of one call, the slowest rank's, median over `repeats` batches of back-to-back
    calls (as nccl-tests times them). Ranks outside every instance only keep the barriers."""
    members = kind.instance_of(rank)
    if members is None:
        call = lambda: None  # noqa: E731
    else:
        call = _call(op, n_bytes, members, groups[kind.instances.index(members)], rank, device, comm)

    def batch(calls: int) -> float:
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            call()
        _sync(device)
        return time.perf_counter() - start

    batch(1)  # warm-up: connections, buffers
    first = torch.tensor([batch(1)], dtype=torch.float64, device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MAX)
    calls = int(min(MAX_CALLS, max(1, TARGET_S // max(float(first.item()), 1e-9))))
    times = torch.tensor([batch(calls) / calls for _ in range(repeats)], dtype=torch.float64,
                         device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # per batch, the slowest rank
    return max(statistics.median(times.tolist()), 1e-9)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _version(backend: str) -> str:
    if backend == "nccl":
        version = torch.cuda.nccl.version()
        return "NCCL " + (".".join(map(str, version)) if isinstance(version, tuple) else str(version))
    return f"gloo (torch {torch.__version__})"


def kit_modules():
    """The one-GPU kit's modules (benchmarks/ of this checkout), or None where it is absent
    (an installed package has no benchmarks/)."""
    kit = Path(__file__).resolve().parents[2] / "benchmarks"
    if not (kit / "gpu_check.py").is_file():
        return None
    if str(kit) not in sys.path:
        sys.path.insert(0, str(kit))
    return tuple(importlib.import_module(m) for m in ("kernel_bench", "measured_profile", "gpu_check"))


def _kernels(s: Settings, rank: int, device: torch.device, skipped: list[str]) -> dict | None:
    """On CUDA, rank 0 runs the kit's GEMM, memory and attention measurements at the study's
    shapes and builds its measured profile on the base (`measured_profile.build`); the other
    ranks wait at a barrier. None elsewhere, with the reason in `skipped`."""
    if device.type != "cuda":
        skipped.append("per-GPU kernels: no CUDA (the gpu section stays the base profile's)")
        return None
    if s.kernel_budget_s <= 0:
        skipped.append("per-GPU kernels: --kernel-budget-s 0")
        return None
    kit = kit_modules()
    if kit is None:
        skipped.append("per-GPU kernels: benchmarks/ (the one-GPU kit) is not in this checkout")
        return None
    out = None
    if rank == 0:
        out = _run_kit(kit, s, device)
    dist.barrier()
    if rank == 0 and out.get("error"):
        skipped.append(f"per-GPU kernels: {out['error']}")
    return out


def _run_kit(kit, s: Settings, device: torch.device) -> dict:
    from csbp.simulator.system.profile_files import read_mapping
    from csbp.simulator.system.hardware import PROFILE_DIR

    kb, measured_profile, gpu_check = kit
    try:
        path, raw = read_mapping(s.base, PROFILE_DIR, "hardware profile")
        budget = kb.Budget(s.kernel_budget_s)
        shapes = kb.Shapes.study()
        peak = float(raw["gpu"]["peak_tflops"]["value"])
        points = kb.gemm_points(shapes, device, budget, peak) + kb.memory_points(shapes, device)
        points += kb.attention_points(shapes, device, budget, 10.0, 30.0)
        env = {**gpu_check.environment(device), "dtype": str(shapes.dtype).split(".")[-1]}
        built = measured_profile.build(path, points, env, s.name)
        torch.cuda.empty_cache()
        return {"gpu": built["gpu"], "points": len(points),
                "measured": sum(1 for p in points if p.seconds is not None)}
    except Exception as err:  # noqa: BLE001 - the links are measured already: keep them
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}


def calibrate(s: Settings, rank: int, world: int, device: torch.device, command: str,
              as_json: bool) -> int:
    """The whole calibration on this rank (process group up): measure on every rank, then rank 0
    fits, writes and re-reads the profile, and prints what was measured, fitted and skipped."""
    from csbp.runtime.calibration import cluster_profile
    from csbp.simulator.report.report import print_json
    from csbp.simulator.system.hardware import load_profile

    m = measure(s, rank, world, device)
    if rank != 0:
        return 0
    raw, fits, skipped = cluster_profile.build(s.base, s.name, m, command)
    cluster_profile.write(s.out, raw, command)
    profile = load_profile(str(s.out))  # the simulator's own loader: the profile is valid
    rows = cluster_profile.residuals(profile, m["samples"])
    summary = {"profile": str(s.out), "name": s.name, "base": s.base, "hosts": m["hosts"],
               "nodes": m["nodes"], "ranks_per_node": m["ranks_per_node"],
               "backend": m["backend_version"], "sizes_bytes": list(m["sizes"]),
               "seconds": m["seconds"], "groups": [dict(zip(("name", "level", "size", "per_node",
                                                              "instances"), k)) for k in m["kinds"]],
               "links": {level: {f: getattr(profile.link(level), f)
                                 for f in fit.figures if f not in ("size_efficiency", "call_seconds")}
                         for level, fit in fits.items()},
               "kernels": {k: v for k, v in (m["kernels"] or {}).items() if k != "gpu"} or None,
               "skipped": skipped, "fit": rows,
               "fit_error": cluster_profile.error_summary(rows, "error"),
               "alpha_beta_error": cluster_profile.error_summary(rows, "alpha_beta_error")}
    if as_json:
        print_json(summary)
    else:
        _print_summary(summary)
    return 0


def _print_summary(summary: dict) -> None:
    print(f"wrote {summary['profile']} ({summary['backend']}, {summary['nodes']} node(s) x "
          f"{summary['ranks_per_node']} ranks, {summary['seconds']:.1f} s; base {summary['base']})")
    for level, figures in summary["links"].items():
        print(f"  {level}: " + ", ".join(f"{f} {v:.4g}" for f, v in figures.items()))
    print(f"  {'group':<10} {'op':<15} {'size':>9} {'measured':>11} {'profile':>11} {'alpha-beta':>11}")
    for r in summary["fit"]:
        print(f"  {r['group']:<10} {r['op']:<15} {r['bytes'] / KIB:>7.0f} K {r['measured_s'] * 1e3:>8.3f} ms "
              f"{r['predicted_s'] * 1e3:>8.3f} ms {r['alpha_beta_s'] * 1e3:>8.3f} ms")
    for key, label in (("fit_error", "profile (measured table where it has one)"),
                       ("alpha_beta_error", "alpha-beta alone")):
        e = summary[key]
        if e:
            print(f"  error of the {label}: median |e| {e['median_abs']:.1%}, max {e['max_abs']:.1%}")
    for item in summary["skipped"]:
        print(f"  skipped: {item}")
