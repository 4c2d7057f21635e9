"""GEMM, attention and memory microbenchmarks per kernel family, on whatever device is present.

Why: the step graph prices GEMMs by the size of one call and attention by tile length per kernel
family; a measured profile needs those rates at the study's shapes (Nemotron-Diffusion 8B: hidden
4096, 32 query heads; head dim 128, and 256 as DiffusionGemma / Qwen3.5 use), forward and
backward, for each attention kernel the machine has: SDPA's flash, cuDNN and memory-efficient
backends, FlexAttention compiled (eager on CPU, forward only: no CPU backward), FA3 / FA4 when
importable. Timing is CUDA events on a GPU (median of repeats after warm-up, fresh random
inputs, never zeros) and the wall clock on CPU (the kit's dry run). Every measurement checks a
`Budget` first and is skipped, with the reason recorded, when it would not fit.
"""

from __future__ import annotations

import importlib.util
import math
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

HIDDEN, HEADS, HEAD_DIM, KV_HEADS, FFN, VOCAB = 4096, 32, 128, 8, 14336, 131072  # Nemotron 8B
# DiffusionGemma-26B-A4B's experts (simulator/workload/presets.py): hidden 2816, expert width 704,
# top-8 of 128 experts; 64 local experts at ep = 2. Widths around 704 give the curve its slope.
MOE_HIDDEN, MOE_WIDTHS, MOE_TOP_K, MOE_LOCAL_EXPERTS = 2816, (512, 704, 768), 8, 64
# Qwen3.5/3.8's Gated-DeltaNet layers: 48 value heads (q, k repeated to them) of 128, chunk 64
GDN_HEADS, GDN_HEAD_DIM, GDN_CHUNK = 48, 128, 64
BACKWARD_RATIO = 2.5  # attention backward / forward FLOP, as simulator/cost/graph.py prices it


class Budget:
    """Seconds left to the kit: a step asks before it starts and is skipped if it cannot fit."""

    def __init__(self, seconds: float) -> None:
        self.start, self.seconds = time.monotonic(), seconds

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def allows(self, need: float) -> bool:
        return self.left() >= need


@dataclass
class Point:
    """One measured call: family, kernel pass, shape, seconds, FLOP and the rate reached."""

    what: str  # gemm | attention | memory
    family: str
    direction: str  # fwd | bwd | copy | ...
    shape: str
    seconds: float | None
    flop: float
    tflops: float | None
    note: str = ""
    size: float = 0.0  # the x the profile reads (GFLOP of a GEMM, tile length of attention)
    head_dim: int = 0

    def to_json(self) -> dict:
        return asdict(self)


def device_seconds(fn, device: torch.device, repeats: int, warmup: int) -> float:
    """Median seconds of fn() (CUDA events on a GPU, the wall clock elsewhere)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclass(frozen=True)
class Shapes:
    """The sizes one run measures: the study's on a GPU, tiny ones for the CPU dry run."""

    tokens: tuple[int, ...]
    gemms: tuple[tuple[int, int], ...]  # (k, n) of x @ W
    tiles: tuple[int, ...]
    attention_tokens: int  # batch x tile per attention call
    heads: int
    head_dims: tuple[int, ...]
    memory_elements: int
    repeats: int
    warmup: int
    dtype: torch.dtype

    @classmethod
    def study(cls) -> "Shapes":
        q = HEADS * HEAD_DIM
        return cls(tokens=(2048, 8192, 32768),
                   gemms=((HIDDEN, q + 2 * KV_HEADS * HEAD_DIM), (q, HIDDEN), (HIDDEN, 2 * FFN),
                          (FFN, HIDDEN), (HIDDEN, VOCAB)),
                   tiles=(256, 1024, 4096, 16384), attention_tokens=32768, heads=HEADS,
                   head_dims=(128, 256), memory_elements=2**29, repeats=10, warmup=3,
                   dtype=torch.bfloat16)

    @property
    def moe(self) -> tuple[int, tuple[int, ...], int, int]:
        """(hidden, expert widths, local experts, tokens) of the grouped-GEMM points."""
        if self.dtype == torch.bfloat16:
            return MOE_HIDDEN, MOE_WIDTHS, MOE_LOCAL_EXPERTS, 32768
        return 32, (16, 32), 2, 16

    @property
    def gdn(self) -> tuple[int, int, int, int]:
        """(value heads, head dim, tokens, noisy block) of the delta-rule points."""
        if self.dtype == torch.bfloat16:
            return GDN_HEADS, GDN_HEAD_DIM, 32768, 256
        return 2, 16, 256, 64

    @classmethod
    def tiny(cls) -> "Shapes":
        return cls(tokens=(64, 256), gemms=((128, 128), (128, 512)), tiles=(32, 128),
                   attention_tokens=256, heads=2, head_dims=(16, 32), memory_elements=2**18,
                   repeats=2, warmup=1, dtype=torch.float32)


def gemm_points(shapes: Shapes, device: torch.device, budget: Budget, peak_tflops: float
                ) -> list[Point]:
    out = []
    for m in shapes.tokens:
        for k, n in shapes.gemms:
            if not budget.allows(5):
                out.append(Point("gemm", "torch.mm", "fwd", f"{m}x{k}x{n}", None, 0, None,
                                 "skipped: budget"))
                continue
            a = torch.randn(m, k, device=device, dtype=shapes.dtype)
            b = torch.randn(k, n, device=device, dtype=shapes.dtype)
            s = device_seconds(lambda: a @ b, device, shapes.repeats, shapes.warmup)
            flop = 2.0 * m * k * n
            out.append(Point("gemm", "torch.mm", "fwd", f"{m}x{k}x{n}", s, flop, flop / s / 1e12,
                             size=flop / 1e9, note=f"{flop / s / 1e12 / peak_tflops:.3f} of peak"))
    return out


def memory_points(shapes: Shapes, device: torch.device) -> list[Point]:
    """HBM copy (bytes read + written), a SwiGLU product, and a tiny kernel's launch cost."""
    n = shapes.memory_elements
    src = torch.randn(n, device=device, dtype=shapes.dtype)
    dst = torch.empty_like(src)
    y = torch.randn_like(src)
    nbytes = n * src.element_size()
    copy = device_seconds(lambda: dst.copy_(src), device, shapes.repeats, shapes.warmup)
    swiglu = device_seconds(lambda: F.silu(src) * y, device, shapes.repeats, shapes.warmup)
    tiny = torch.ones(8, device=device)
    launch = device_seconds(lambda: [tiny.add_(1) for _ in range(100)], device,
                            shapes.repeats, shapes.warmup) / 100
    return [Point("memory", "copy_", "copy", f"{n}", copy, 0, None, size=2 * nbytes / copy / 1e9,
                  note="GB/s read + write in size"),
            Point("memory", "silu(x)*y", "elementwise", f"{n}", swiglu, 0, None,
                  size=3 * nbytes / swiglu / 1e9, note="GB/s (2 reads, 1 write) in size"),
            Point("memory", "add_", "launch", "8", launch, 0, None, note="seconds per tiny kernel")]


# ---- grouped GEMM (MoE experts) -------------------------------------------------------------------
def _grouped_mm():
    """torch's grouped GEMM over jagged groups (F.grouped_mm, or torch._grouped_mm before it)."""
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None:
        return None, f"no F.grouped_mm / torch._grouped_mm in torch {torch.__version__}"
    return fn, "F.grouped_mm" if fn is getattr(F, "grouped_mm", None) else "torch._grouped_mm"


def grouped_mm_points(shapes: Shapes, device: torch.device, budget: Budget) -> list[Point]:
    """The routed experts as the reference runs them (implementation.md 11): one grouped GEMM
    for gate+up ([rows, h] x [E, h, 2I]) and one for down ([rows, I] x [E, I, h]) over rows
    grouped by expert in equal groups (balanced routing), forward and backward, bf16, at each
    expert width I; `size` is I, the x of the profile's `gemm_kernels.grouped-mm` curve."""
    fn, label = _grouped_mm()
    hidden, widths, experts, tokens = shapes.moe
    rows = tokens * MOE_TOP_K // experts * experts  # routed rows arriving, equal groups
    out = []
    for width in widths:
        shape = f"E{experts} rows{rows} h{hidden} I{width}"
        flop = 2.0 * rows * hidden * 2 * width + 2.0 * rows * width * hidden
        for backward in (False, True):
            direction = "bwd" if backward else "fwd"
            if fn is None or not budget.allows(5):
                out.append(Point("grouped-gemm", "grouped-mm", direction, shape, None, flop, None,
                                 "unavailable: " + label if fn is None else "skipped: budget",
                                 size=width))
                continue
            try:
                offs = torch.arange(1, experts + 1, device=device, dtype=torch.int32) * (rows // experts)
                dt = torch.bfloat16  # the kernel's dtype (fp32 has no backward on every backend)
                x = torch.randn(rows, hidden, device=device, dtype=dt, requires_grad=backward)
                up = torch.randn(experts, 2 * width, hidden, device=device, dtype=dt, requires_grad=backward)
                down = torch.randn(experts, hidden, width, device=device, dtype=dt, requires_grad=backward)

                def forward():
                    h = fn(x, up.transpose(-2, -1), offs=offs)  # weights stored [E, N, K]
                    g, u = h.chunk(2, dim=-1)
                    return fn((F.gelu(g) * u).contiguous(), down.transpose(-2, -1), offs=offs)
                if backward:
                    grad = torch.randn(rows, hidden, device=device, dtype=dt)
                    both = device_seconds(lambda: torch.autograd.grad(forward(), (x, up, down), grad),
                                          device, shapes.repeats, shapes.warmup)
                    with torch.no_grad():
                        fwd = device_seconds(forward, device, shapes.repeats, shapes.warmup)
                    sec, f = max(both - fwd, 1e-9), 2 * flop
                else:
                    with torch.no_grad():
                        sec, f = device_seconds(forward, device, shapes.repeats, shapes.warmup), flop
            except Exception as err:  # noqa: BLE001 - a shape the kernel refuses is a finding
                out.append(Point("grouped-gemm", "grouped-mm", direction, shape, None, flop, None,
                                 f"unavailable: {type(err).__name__}: {str(err).splitlines()[0][:160]}",
                                 size=width))
                continue
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            out.append(Point("grouped-gemm", "grouped-mm", direction, shape, sec, f, f / sec / 1e12,
                             note=f"{label}; gelu x up unfused between the two", size=width))
    return out


# ---- linear attention (Gated-DeltaNet) ------------------------------------------------------------
def _delta_rule_flops_per_token(dk: int, dv: int, chunk: int = GDN_CHUNK) -> float:
    """As simulator/cost/linear_ops.delta_rule_flops_per_token (the kit runs without csbp)."""
    return 6 * chunk * dk + 4 * chunk * dv + 2 * chunk * chunk / 3 + 6 * dk * dv


def linear_points(shapes: Shapes, device: torch.device, budget: Budget) -> list[Point]:
    """flash-linear-attention's Triton chunk_gated_delta_rule (implementation.md 13), if
    importable: the clean pass (one sequence) and the noisy pass (every block its own sequence,
    cu_seqlens), forward and backward; FLOP as the simulator counts them (x2.5 backward)."""
    heads, dim, tokens, block = shapes.gdn
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        why = None if device.type == "cuda" else "Triton kernels need a GPU"
    except Exception as err:  # noqa: BLE001 - not installed here is a finding
        chunk_gated_delta_rule, why = None, f"fla not importable ({type(err).__name__})"
    out = []
    flop = _delta_rule_flops_per_token(dim, dim) * tokens * heads
    for case, seqs in (("clean", None), ("noisy blocks", tokens // block)):
        shape = f"T{tokens} H{heads} d{dim}" + (f" {seqs}x{block} varlen" if seqs else "")
        for backward in (False, True):
            direction = "bwd" if backward else "fwd"
            f = flop * (BACKWARD_RATIO if backward else 1.0)
            if why or not budget.allows(5):
                out.append(Point("linear", "fla-triton", direction, shape, None, f, None,
                                 f"unavailable: {why}" if why else "skipped: budget", note_case(case)))
                continue
            try:
                dt = shapes.dtype
                q, k, v = (torch.randn(1, tokens, heads, dim, device=device, dtype=dt,
                                       requires_grad=backward) for _ in range(3))
                g = F.logsigmoid(torch.randn(1, tokens, heads, device=device, dtype=torch.float32))
                beta = torch.rand(1, tokens, heads, device=device, dtype=dt).sigmoid()
                kw = {"use_qk_l2norm_in_kernel": True}
                if seqs:
                    kw["cu_seqlens"] = torch.arange(0, tokens + 1, block, device=device, dtype=torch.long)

                def call():
                    return chunk_gated_delta_rule(q, k, v, g, beta, **kw)[0]
                if backward:
                    grad = torch.randn(1, tokens, heads, dim, device=device, dtype=dt)
                    both = device_seconds(lambda: torch.autograd.grad(call(), (q, k, v), grad),
                                          device, shapes.repeats, shapes.warmup)
                    with torch.no_grad():
                        fwd = device_seconds(call, device, shapes.repeats, shapes.warmup)
                    sec = max(both - fwd, 1e-9)
                else:
                    with torch.no_grad():
                        sec = device_seconds(call, device, shapes.repeats, shapes.warmup)
            except Exception as err:  # noqa: BLE001
                out.append(Point("linear", "fla-triton", direction, shape, None, f, None,
                                 f"unavailable: {type(err).__name__}: {str(err).splitlines()[0][:160]}",
                                 note_case(case)))
                continue
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            out.append(Point("linear", "fla-triton", direction, shape, sec, f, f / sec / 1e12,
                             f"fla chunk_gated_delta_rule, {case}", note_case(case)))
    return out


def note_case(case: str) -> float:
    """`size` of a linear point: 1 for the clean pass, 0.5 for the noisy blocks' (varlen)."""
    return 1.0 if case == "clean" else 0.5


# ---- attention families --------------------------------------------------------------------------
def _sdpa(backend_name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def call(q, k, v, causal):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return call


_FLEX: dict = {}


def _flex(device: torch.device):
    """FlexAttention, compiled on a GPU; eager (unfused) on CPU, where nothing compiles fast."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    fn = flex_attention
    if device.type == "cuda":  # one graph per shape and pass: past dynamo's default of 8 it
        config = torch._dynamo.config  # would fall back, silently, to materialised scores
        for name in ("recompile_limit", "cache_size_limit"):  # renamed across releases
            if hasattr(config, name):
                setattr(config, name, max(getattr(config, name), 64))
        fn = torch.compile(flex_attention, dynamic=False)

    def call(q, k, v, causal):
        mask = None
        if causal:
            key = (q.shape[-2], k.shape[-2])
            if key not in _FLEX:
                _FLEX[key] = create_block_mask(lambda b, h, i, j: i >= j, None, None, *key,
                                               device=str(q.device))
            mask = _FLEX[key]
        return fn(q, k, v, block_mask=mask)
    return call


def _fa3():
    import flash_attn_interface  # noqa: F401 - FA3's Hopper package

    def call(q, k, v, causal):
        out = flash_attn_interface.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)),
                                                   causal=causal)
        out = out[0] if isinstance(out, tuple) else out
        return out.transpose(1, 2)
    return call


def _fa4():
    from flash_attn.cute import flash_attn_func  # FA4 (CuTe DSL)

    def call(q, k, v, causal):
        out = flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=causal)
        out = out[0] if isinstance(out, tuple) else out
        return out.transpose(1, 2)
    return call


LABELS = {"fa2": "torch SDPA FLASH_ATTENTION (FlashAttention-2)", "cudnn": "torch SDPA CUDNN_ATTENTION",
          "efficient": "torch SDPA EFFICIENT_ATTENTION", "flex-triton": "torch FlexAttention",
          "fa3": "FA3 (flash_attn_interface)", "fa4": "FA4 (flash_attn.cute)"}


def attention_families(device: torch.device) -> dict[str, tuple[object, str]]:
    """Family name -> (call or None, why not). Names follow the profile's kernel families."""
    families: dict[str, tuple[object, str]] = {}
    for name, backend in (("fa2", "FLASH_ATTENTION"), ("cudnn", "CUDNN_ATTENTION"),
                          ("efficient", "EFFICIENT_ATTENTION")):
        families[name] = (_sdpa(backend), f"torch SDPA {backend}")
    families["flex-triton"] = (_flex(device), "torch FlexAttention" +
                               (" (torch.compile)" if device.type == "cuda" else " (eager)"))
    for name, module, make in (("fa3", "flash_attn_interface", _fa3),
                               ("fa4", "flash_attn.cute", _fa4)):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        families[name] = (make(), module) if found and device.type == "cuda" else \
            (None, f"{module} not importable")
    return families


def attention_point(call, family: str, tile: int, head_dim: int, causal: bool, backward: bool,
                    shapes: Shapes, device: torch.device) -> Point:
    """One (family, tile, head dim, causal, pass) measurement; failures become a note."""
    batch = max(1, shapes.attention_tokens // tile)
    direction = "bwd" if backward else "fwd"
    shape = f"B{batch} H{shapes.heads} S{tile} D{head_dim}" + (" causal" if causal else "")
    flop = 4.0 * batch * tile * tile * head_dim * shapes.heads * (0.5 if causal else 1.0)
    flop *= BACKWARD_RATIO if backward else 1.0
    try:
        q, k, v = (torch.randn(batch, shapes.heads, tile, head_dim, device=device,
                               dtype=shapes.dtype, requires_grad=backward) for _ in range(3))
        if not backward:
            with torch.no_grad():
                s = device_seconds(lambda: call(q, k, v, causal), device, shapes.repeats,
                                   shapes.warmup)
        else:
            grad = torch.randn_like(q)
            both = device_seconds(lambda: torch.autograd.grad(call(q, k, v, causal), (q, k, v),
                                                              grad), device, shapes.repeats,
                                  shapes.warmup)
            with torch.no_grad():
                fwd = device_seconds(lambda: call(q, k, v, causal), device, shapes.repeats,
                                     shapes.warmup)
            s = max(both - fwd, 1e-9)
    except Exception as err:  # noqa: BLE001 - a family without this shape is a finding
        return Point("attention", family, direction, shape, None, flop, None,
                     f"unavailable: {type(err).__name__}: {str(err).splitlines()[0][:160]}",
                     size=tile, head_dim=head_dim)
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return Point("attention", family, direction, shape, s, flop, flop / s / 1e12, size=tile,
                 head_dim=head_dim)


def attention_points(shapes: Shapes, device: torch.device, budget: Budget, reserve_s: float,
                     per_family_s: float) -> list[Point]:
    """Every family at every tile and head dim, forward and backward, then block-causal at the
    middle tile (the masked-tile factor). A family stops when it has spent `per_family_s`;
    everything stops `reserve_s` before the budget ends (the emulations come next)."""
    out = []
    for family, (call, label) in attention_families(device).items():
        if call is None:
            out.append(Point("attention", family, "-", "-", None, 0, None, f"unavailable: {label}"))
            continue
        began = time.monotonic()
        cases = [(t, d, False, b) for d in shapes.head_dims for t in shapes.tiles
                 for b in (False, True)]
        middle = shapes.tiles[len(shapes.tiles) // 2]
        cases += [(middle, shapes.head_dims[0], True, b) for b in (False, True)]
        for tile, head_dim, causal, backward in cases:
            spent = time.monotonic() - began
            if spent > per_family_s or budget.left() < reserve_s:
                out.append(Point("attention", family, "bwd" if backward else "fwd",
                                 f"S{tile} D{head_dim}" + (" causal" if causal else ""), None, 0,
                                 None, "skipped: budget", size=tile, head_dim=head_dim))
                continue
            point = attention_point(call, family, tile, head_dim, causal, backward, shapes, device)
            point.note = (point.note + "; " if point.note else "") + label
            out.append(point)
            if point.seconds is None and "unavailable" in point.note and not backward \
                    and tile == shapes.tiles[0] and head_dim == shapes.head_dims[0]:
                break  # the family does not run at all here: one line says why
    return out


def efficiency(point: Point, peak_tflops: float) -> float | None:
    return None if point.tflops is None else point.tflops / peak_tflops


def log_bins(points: list[tuple[float, float]], per_decade: int = 3) -> list[list[float]]:
    """Median (x, y) per log-spaced bin of x: the form a profile's curves take (x increasing).
    y is clamped into (0, 1], as the profile's fractions must be."""
    bins: dict[int, list] = {}
    for x, y in points:
        if x > 0 and y > 0:
            bins.setdefault(math.floor(math.log10(x) * per_decade), []).append((x, y))
    out = []
    for _, b in sorted(bins.items()):
        x = float(f"{statistics.median(p[0] for p in b):.4g}")
        y = float(f"{min(1.0, max(1e-6, statistics.median(p[1] for p in b))):.4g}")
        if not out or x > out[-1][0]:
            out.append([x, y])
    return out
