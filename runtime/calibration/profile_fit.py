"""The measured profile of a CPU host, fitted from one calibration run.

Every figure is derived from first principles and carries a source naming the measurement:

- compute: peak = the fastest GEMM; efficiency curves = measured rate / peak (nn.Linear as the
  runtime trains it, by GFLOP; attention tiles by length, with the runtime's attention code);
- memory-bound ops: copy bandwidth, and the fraction of it the eager layer ops and AdamW reach
  against the step graph's fused byte counts;
- core sharing: each op class's speed with 1..4 ranks busy at once and a pair's collective call
  with 2 and 4 ranks on the host (`sharing_fit`), and a training step with twice as many
  processes as cores;
- host: time per step-graph kernel, the reference probe step, and where it was measured;
- collectives (`collective_fit`) and explicit attention (`attention_fit`) in their own modules.

The fit never looks at a validation step: `csbp validate` checks it against those.
"""

from __future__ import annotations

import statistics

from csbp.runtime.calibration.attention_fit import dense_curves
from csbp.runtime.calibration.calibration_measurements import TINY_SPEC_TEXT, Measurements
from csbp.runtime.calibration.collective_fit import fit_links
from csbp.runtime.calibration.fit_figures import GIB, MIB, efficiency_curve, figure, rounded
from csbp.runtime.calibration.one_process_graph import graph_ops
from csbp.runtime.calibration.sharing_fit import sharing_figures
from csbp.runtime.validation.validation_suite import VALIDATION_MODEL
from csbp.simulator.system.hardware import HardwareProfile


def fit_profile(m: Measurements, name: str) -> dict:
    """The profile (YAML form, every figure with its source) that these measurements imply."""
    rates = [(2 * mm * k * n / 1e9, 2 * mm * k * n / s) for mm, k, n, s in m.gemm]
    peak = max(r for _, r in rates)
    best = max(m.gemm, key=lambda g: 2 * g[0] * g[1] * g[2] / g[3])
    rank = f"fp32, {m.threads} thread{'s' if m.threads > 1 else ''} per rank"
    if m.linear:  # training with full recompute: each projection forward twice, backward once
        mix = [(2 * mm * k * n / 1e9, 4 * (2 * mm * k * n) / (2 * tf + tb) / peak)
               for mm, k, n, tf, tb in m.linear]
        gemm_source = (f"measured: {len(mix)} nn.Linear layers at the model's projection shapes "
                       "(tokens x hidden x width) as the runtime trains them under full "
                       "checkpointing (forward twice, autograd backward once: 4 x 2mkn FLOP over "
                       "2 forward + 1 backward time) / peak, by GFLOP of one GEMM, median per "
                       "third of a decade; backward GEMMs (transposed operands, .grad "
                       "accumulation) reach ~0.7 of the forward rate")
    else:
        mix = [(g, r / peak) for g, r in rates]
        gemm_source = (f"measured: rate / peak of {len(rates)} fp32 GEMMs at the model's "
                       "projection shapes (tokens x hidden x width), median per third of a "
                       "decade of GFLOP")
    fwd = [(tile, flop / s / peak) for tile, _, bwd, flop, s in m.attention if not bwd]
    bwd = [(tile, flop / s / peak) for tile, _, b, flop, s in m.attention if b]
    head_dims = sorted({hd for _, hd, *_ in m.attention})
    copy_gbs = m.copy[0] / m.copy[1] / 1e9
    full_s, masked_s = m.masked_attention
    load_rates = {p: sum(r) for p, r in m.gemm_load.items()}
    single = load_rates[1]
    effective = max(load_rates.values()) / single
    cpus = m.identity.cpus
    link, _, node_extra = fit_links(m)
    tiles = ", ".join(str(t) for t in sorted({t for t, *_ in m.attention}))
    profile = {
        "name": name,
        "kind": "measured",
        **m.identity.as_profile_fields(),
        "notes": (f"{m.identity.cpu_model}; one rank = one process with {rank}; ranks share {cpus} cores "
                  f"({effective:.2f} cores' worth measured) and talk through gloo over TCP loopback. Measured by csbp calibrate "
                  f"under load {m.load} (load average 1/5/15 min, before -> after); other work on "
                  "the host makes every figure noisier. " + " ".join(m.notes)).strip(),
        "gpu": {
            "name": f"{m.identity.cpu_model} ({rank})",
            "memory_gib": figure(rounded(m.memory_bytes / GIB), "MemTotal in /proc/meminfo (shared by "
                                  "all ranks of the host)"),
            "reserved_gib": figure(rounded(m.baseline_rss_bytes / GIB), "measured: peak resident set "
                                    "(VmHWM) of a worker process after importing torch, before any "
                                    "model: a rank's high-water RSS includes it"),
            "peak_tflops": figure(rounded(peak / 1e12), f"measured: fastest fp32 GEMM of the sweep, "
                                   f"{best[0]}x{best[1]}x{best[2]} in {best[3] * 1e3:.2f} ms, one process alone"),
            "hbm_gbs": figure(rounded(copy_gbs), f"measured: copy_ of {m.copy[0] // 2 // MIB} MiB fp32 "
                               f"(read + write counted) in {m.copy[1] * 1e3:.2f} ms"),
            **_memory_bound(m, copy_gbs),
            "gemm_efficiency": figure(efficiency_curve(mix), gemm_source),
            "attention_forward_efficiency": figure(
                efficiency_curve(fwd), f"measured: the runtime's CPU attention (explicit masked "
                f"math) forward, FLOP 4 x q x k x head_dim x heads per tile / time / peak, tiles "
                f"{tiles}, head dim {head_dims}"),
            "attention_backward_efficiency": figure(
                efficiency_curve(bwd), "measured: same tiles, backward (dQ, dK, dV: 2.5 x the "
                "forward FLOP) / time / peak"),
            "masked_attention_efficiency_factor": figure(
                rounded(min(1.0, full_s / masked_s)), f"measured: full tile {full_s * 1e3:.2f} ms vs the "
                f"same tile under the BD3-LM mask {masked_s * 1e3:.2f} ms (explicit math computes "
                "every score either way, so the mask adds work, never removes it)"),
            "dense_attention": figure(True, "runtime/models/attention.py on CPU: attention_with_lse "
                                       "computes the whole queries x keys score matrix and masks it"),
            "op_overhead_us": _op_overhead(m),
            **dense_curves(m, peak),
            **_score_copies(m),
        },
        "node": {
            "gpus_per_node": figure(4, "ranks per host csbp validate runs (world sizes 2 and 4); "
                                     "they share node.cores"),
            "cores": figure(float(cpus), "CPUs this process may run on (sched_getaffinity); "
                             "check, summed nn.Linear forward + backward rate of " + ", ".join(
                                 f"{p} process{'es' if p > 1 else ''} at once {load_rates[p] / 1e9:.0f} GFLOP/s"
                                 for p in sorted(load_rates))
                             + f": {effective:.2f} cores' worth under load {m.load}"),
            **{k: v for k, v in node_extra.items() if v is not None},
            **_sharing(m, cpus),
            **sharing_figures(m),
            **_probe(m),
        },
        "links": {"nvlink": link},
    }
    HardwareProfile.model_validate(profile)  # a fit that breaks the schema is a bug, not input
    return profile


def _score_copies(m: Measurements) -> dict:
    if not m.score_copies:
        return {}
    return {"dense_score_copies": figure(rounded(statistics.median(c for *_, c in m.score_copies)), (
        "measured: peak resident growth of the runtime's attention_with_lse (forward, recompute, "
        "backward, keep-freed-memory allocator) over its queries x keys x heads fp32 score matrix, "
        "median of " + ", ".join(f"{q}x{k}: {c:.1f}" for q, k, c in m.score_copies)))}


def _probe(m: Measurements) -> dict:
    if m.probe is None:
        return {}
    return {"probe_step_s": figure(rounded(statistics.median(m.probe)), (
        "measured: the validation model's one-process training step at L = 256, median of 8, "
        f"timed before each stage of the calibration and at its end ({len(m.probe)} times: "
        + ", ".join(f"{p * 1e3:.1f}" for p in m.probe) + " ms), the median of those; "
        "csbp validate re-times it to report the host's drift since"))}


def _sharing(m: Measurements, cpus: int) -> dict:
    """How much of its cores / ranks share a rank gets with twice as many ranks as cores."""
    if cpus not in m.step_load or 2 * cpus not in m.step_load:
        return {}
    alone, shared = m.step_load[cpus], m.step_load[2 * cpus]
    return {"sharing_efficiency": figure(rounded(min(1.0, 2 * alone / shared)), (
        f"measured: the validation model's one-process training step (L = 256) in {cpus} "
        f"processes at once took {alone * 1e3:.1f} ms, in {2 * cpus} at once {shared * 1e3:.1f} ms "
        f"(ideal: twice as long): 2 x {alone * 1e3:.1f} / {shared * 1e3:.1f}"))}


def _op_overhead(m: Measurements) -> dict:
    """Host time per step-graph kernel: a whole runtime step at negligible arithmetic (eager
    PyTorch issues dozens of dispatched, autograd-recorded ops per kernel of the graph)."""
    if m.tiny_step is None:
        return figure(rounded(m.op_overhead_s * 1e6), "measured: median time of an 8-element add "
                       "(dispatch + allocation, no arithmetic to speak of)")
    seconds, kernels = m.tiny_step
    return figure(rounded(seconds / kernels * 1e6), (
        f"measured: one whole training step of the runtime (one process, {TINY_SPEC_TEXT}, full "
        f"checkpointing, AdamW) in {seconds * 1e3:.2f} ms, over the {kernels} kernels its step "
        f"graph counts: host time (Python, dispatch, autograd, allocation) per kernel; an "
        f"8-element add alone takes {m.op_overhead_s * 1e6:.2f} us"))


def _memory_bound(m: Measurements, copy_gbs: float) -> dict:
    """Fractions of the copy bandwidth the runtime's memory-bound ops reach, against the bytes
    the step graph counts for them (host time per kernel taken off first).

    The graph counts fused kernels (one pass per RMSNorm, one per RoPE); eager PyTorch makes a
    pass per op (pow, mean, rsqrt, two multiplies for one RMSNorm) and AdamW's foreach update a
    pass per term, so the measured fraction is well below a single copy's.
    """
    spec, overhead = VALIDATION_MODEL, _op_overhead(m)["value"] * 1e-6
    names = ("norm-rope", "norm-swiglu", "norm-rope-bwd", "norm-swiglu-bwd")
    fractions = []
    for tokens, seconds in m.layer_elementwise:
        nbytes, kernels = graph_ops(spec, tokens // 2, names, 0)
        fractions.append(nbytes / (copy_gbs * 1e9 * max(seconds - kernels * overhead, 1e-9)))
    out = {"hbm_efficiency": figure(rounded(min(1.0, statistics.median(fractions))), (
        "measured: one layer's memory-bound ops as the runtime trains them (2 RMSNorms, RoPE on q "
        "and k, 2 residual adds, silu(gate) * up; forward, recompute, backward) at "
        + ", ".join(f"{n} tokens {s * 1e3:.1f} ms ({f:.2f})" for (n, s), f in zip(m.layer_elementwise, fractions))
        + f": the step graph's bytes for them / time / copy bandwidth {copy_gbs:.2f} GB/s, median; "
        "eager ops each make their own pass, the graph counts fused ones"))}
    if m.optimizer:
        params, seconds = m.optimizer
        nbytes, kernels = graph_ops(spec, min(n for n, _ in m.layer_elementwise) // 2, ("adamw",), None)
        fraction = nbytes / (copy_gbs * 1e9 * max(seconds - kernels * overhead, 1e-9))
        out["optimizer_efficiency"] = figure(rounded(min(1.0, fraction)), (
            f"measured: torch.optim.AdamW step (foreach, fp32) over the validation model's "
            f"{params:,} parameters in {seconds * 1e3:.2f} ms: the step graph's bytes for it / time "
            f"/ copy bandwidth {copy_gbs:.2f} GB/s"))
    return out
