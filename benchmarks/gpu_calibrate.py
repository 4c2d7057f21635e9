"""Measure one CUDA GPU's compute side and write it as a csbp hardware profile (torch only).

What it measures, at the study's shapes (Nemotron-Diffusion 8B: hidden 4096, 32/8 heads of 128,
FFN 14336, vocab 131072), in bf16:
- GEMM rate over the model's projections at 1K-16K tokens -> `gemm_efficiency` (vs peak);
- attention forward and backward (torch SDPA: flash and cuDNN backends, the faster counted) at
  tile lengths 128-16K, non-causal, ~32K tokens per call -> the attention efficiency curves;
  causal vs non-causal at 4K -> `masked_attention_efficiency_factor`;
- HBM copy bandwidth and a SwiGLU elementwise op -> `hbm_gbs`, `hbm_efficiency`;
- launch overhead of a tiny kernel -> `op_overhead_us`; memory and the CUDA context.

One GPU cannot measure NVLink or InfiniBand: the `node` and `links` sections are copied from the
datasheet profile (`--links-from`, default hardware_profiles/h200.yaml) and say so. The YAML is
written by hand so the script needs nothing but torch (no pydantic, no PyYAML).

    python benchmarks/gpu_calibrate.py --out hardware_profiles/h200-measured.yaml
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import socket
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the kit's own modules
import kernel_bench as kb  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 4096, 32, 8, 128, 14336, 131072
TOKENS = (1024, 2048, 4096, 8192, 16384)
TILES = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
ATTENTION_TOKENS = 32768  # batch x tile per attention call
PEAK_TFLOPS = 989.4  # dense BF16 tensor peak, H100/H200 SXM (hardware.md 3.1)
BACKWARD_RATIO = 2.5  # FlashAttention backward FLOP / forward FLOP (as simulator/cost/graph.py)
GIB = 1024**3


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def cuda_seconds(fn, repeats: int = 20, warmup: int = 3) -> float:
    """Median seconds of `fn()` on the GPU, timed with CUDA events (the kit's own timer)."""
    return kb.device_seconds(fn, torch.device("cuda"), repeats, warmup)


def gemm_points() -> list[tuple[float, float, str]]:
    """(GFLOP, fraction of peak, shape) for x @ W of every projection at every token count."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes = ((HIDDEN, q), (HIDDEN, kv), (q, HIDDEN), (HIDDEN, 2 * FFN), (FFN, HIDDEN), (HIDDEN, VOCAB))
    out = []
    for m in TOKENS:
        for k, n in shapes:
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
            s = cuda_seconds(lambda: a @ b)
            flop = 2 * m * k * n
            out.append((flop / 1e9, flop / s / 1e12 / PEAK_TFLOPS, f"{m}x{k}x{n}"))
    return out


def _sdpa_seconds(tile: int, causal: bool, backward: bool, backend) -> float:
    from torch.nn.attention import sdpa_kernel

    batch = max(1, ATTENTION_TOKENS // tile)
    q, k, v = (torch.randn(batch, HEADS, tile, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                           requires_grad=backward) for _ in range(3))
    with sdpa_kernel([backend]):
        if not backward:
            with torch.no_grad():
                return cuda_seconds(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        grad = torch.randn_like(out)
        both = cuda_seconds(lambda: torch.autograd.grad(
            F.scaled_dot_product_attention(q, k, v, is_causal=causal), (q, k, v), grad))
        with torch.no_grad():
            fwd = cuda_seconds(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
        return both - fwd


def attention_seconds(tile: int, causal: bool, backward: bool) -> tuple[float, str]:
    """Fastest of the flash and cuDNN SDPA backends: (seconds, backend name)."""
    from torch.nn.attention import SDPBackend

    best = (math.inf, "none")
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        try:
            best = min(best, (_sdpa_seconds(tile, causal, backward, backend), backend.name))
        except RuntimeError as err:  # backend unavailable for this shape
            log(f"  {backend.name} at tile {tile}: {str(err).splitlines()[0]}")
        torch.cuda.empty_cache()
    return best


def attention_points() -> tuple[list, list, dict]:
    """Forward and backward (tile, fraction of peak, backend); the causal factor details."""
    fwd, bwd = [], []
    for tile in TILES:
        batch = max(1, ATTENTION_TOKENS // tile)
        flop = 4 * batch * tile * tile * HEAD_DIM * HEADS
        s, name = attention_seconds(tile, False, False)
        fwd.append((tile, flop / s / 1e12 / PEAK_TFLOPS, name))
        s, name = attention_seconds(tile, False, True)
        bwd.append((tile, BACKWARD_RATIO * flop / s / 1e12 / PEAK_TFLOPS, name))
        log(f"  attention tile {tile}: fwd {fwd[-1][1]:.3f} bwd {bwd[-1][1]:.3f} of peak")
    tile = 4096
    full = sum(attention_seconds(tile, False, b)[0] for b in (False, True))
    causal = sum(attention_seconds(tile, True, b)[0] for b in (False, True))
    # causal does half the FLOP: at equal efficiency it would take full / 2
    return fwd, bwd, {"tile": tile, "full_s": full, "causal_s": causal,
                      "factor": min(1.0, full / 2 / causal)}


def memory_points() -> dict:
    n = GIB // 2  # 1 GiB of bf16
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy = cuda_seconds(lambda: dst.copy_(src))
    y = torch.randn_like(src)
    swiglu = cuda_seconds(lambda: F.silu(src) * y)
    tiny = torch.ones(8, device="cuda")
    launch = cuda_seconds(lambda: [tiny.add_(1) for _ in range(100)], repeats=20) / 100
    return {"copy_gbs": 2 * n * 2 / copy / 1e9, "swiglu_gbs": 3 * n * 2 / swiglu / 1e9,
            "launch_s": launch}


def curve(points: list[tuple[float, float]], per_decade: int = 3) -> list[list[float]]:
    """Median fraction per log-spaced bin, the form csbp's curves take."""
    bins: dict[int, list] = {}
    for x, y in points:
        bins.setdefault(math.floor(math.log10(x) * per_decade), []).append((x, y))
    return [[float(f"{statistics.median(x for x, _ in b):.4g}"),
             float(f"{min(1.0, statistics.median(y for _, y in b)):.4g}")]
            for _, b in sorted(bins.items())]


def figure(key: str, value, source: str, indent: int = 2) -> str:
    pad = " " * indent
    return f"{pad}{key}:\n{pad}  value: {json.dumps(value)}\n{pad}  source: {json.dumps(source)}\n"


def datasheet_tail(path: Path) -> str:
    """The node and links sections of a datasheet profile, verbatim."""
    text = path.read_text()
    return text[text.index("\nnode:") + 1:]


def profile_text(name: str, links_from: str, where: str, gpu_name: str, total: int,
                 context_gib: float, gemms: list, fwd: list, bwd: list, causal: dict,
                 mem: dict) -> str:
    """The profile YAML (every figure `{value, source}`) from the measured numbers."""
    best = max(gemms, key=lambda g: g[1])
    backends = sorted({backend for *_, backend in fwd + bwd})
    date = dt.date.today().isoformat()
    text = (f"# csbp hardware profile: compute measured by benchmarks/gpu_calibrate.py on one GPU\n"
            f"# ({where}), {date}. node and links: copied from {links_from} (one GPU cannot\n"
            "# measure NVLink or InfiniBand).\n\n"
            f"name: {name}\nkind: measured\nhost: {json.dumps(socket.gethostname())}\n"
            f"date: {json.dumps(date)}\n"
            f"notes: {json.dumps(f'Compute side measured on {where} (bf16, study shapes); fabric figures from the datasheet profile {links_from}.')}\n\n"
            f"gpu:\n  name: {json.dumps(gpu_name)}\n")
    text += figure("memory_gib", round(total / GIB, 2), f"measured: torch.cuda.mem_get_info total ({where})")
    text += figure("reserved_gib", round(context_gib + 0.05 * total / GIB, 2),
                   f"measured CUDA context {context_gib:.2f} GiB (total - free after init) plus "
                   "assumption [U]: ~5% of HBM lost to allocator fragmentation (datasheet profile); "
                   "NCCL buffers not measured on one GPU")
    text += figure("peak_tflops", PEAK_TFLOPS, "dense BF16 tensor peak (hardware.md 3.1, datasheet); "
                   f"best measured GEMM {best[2]} reached {best[1] * PEAK_TFLOPS:.1f} TFLOP/s")
    text += figure("hbm_gbs", round(mem["copy_gbs"], 1), "measured: copy_ of 1 GiB bf16, read + write "
                   f"counted ({where})")
    text += figure("hbm_efficiency", round(min(1.0, mem["swiglu_gbs"] / mem["copy_gbs"]), 3),
                   f"measured: silu(x) * y on 1 GiB tensors reaches {mem['swiglu_gbs']:.0f} GB/s "
                   f"of the copy bandwidth {mem['copy_gbs']:.0f} GB/s")
    text += figure("gemm_efficiency", curve([(g, e) for g, e, _ in gemms]),
                   f"measured: {len(gemms)} bf16 GEMMs x @ W at the Nemotron-Diffusion 8B projections "
                   f"(hidden {HIDDEN}, q {HEADS * HEAD_DIM}, kv {KV_HEADS * HEAD_DIM}, SwiGLU {FFN}, "
                   f"vocab {VOCAB}) for {TOKENS[0]}-{TOKENS[-1]} tokens; median per third of a "
                   "decade of GFLOP, fraction of peak_tflops")
    text += figure("attention_forward_efficiency", curve([(t, e) for t, e, _ in fwd], per_decade=10),
                   f"measured: torch SDPA ({'/'.join(backends)}, faster per shape), bf16, "
                   f"{HEADS} heads x {HEAD_DIM}, non-causal, batch x tile = {ATTENTION_TOKENS}; "
                   "FLOP 4 x B x tile^2 x d x heads / time / peak")
    text += figure("attention_backward_efficiency", curve([(t, e) for t, e, _ in bwd], per_decade=10),
                   f"measured: same shapes, backward (autograd.grad of SDPA minus its forward), "
                   f"FLOP {BACKWARD_RATIO} x forward")
    text += figure("masked_attention_efficiency_factor", round(causal["factor"], 3),
                   f"measured at tile {causal['tile']}: causal fwd + bwd {causal['causal_s'] * 1e3:.2f} ms "
                   f"vs non-causal {causal['full_s'] * 1e3:.2f} ms for twice the FLOP")
    text += figure("op_overhead_us", round(mem["launch_s"] * 1e6, 2),
                   "measured: per tiny kernel (in-place add of 8 elements) launched back to back")
    return text + "\n" + datasheet_tail(Path(links_from))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="hardware_profiles/h200-measured.yaml")
    p.add_argument("--name", default="h200-measured")
    p.add_argument("--links-from", default="hardware_profiles/h200.yaml")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu_calibrate: error: no CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info()
    context_gib = (total - free) / GIB
    where = f"{props.name}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    log(f"calibrating {where}")
    log("GEMMs")
    gemms = gemm_points()
    best = max(gemms, key=lambda g: g[1])
    log(f"  best {best[2]}: {best[1] * PEAK_TFLOPS:.0f} TFLOP/s")
    log("attention")
    fwd, bwd, causal = attention_points()
    log("memory")
    mem = memory_points()
    text = profile_text(args.name, args.links_from, where, props.name, total, context_gib,
                        gemms, fwd, bwd, causal, mem)
    Path(args.out).write_text(text)
    log(f"wrote {args.out}")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
