"""The FlexAttention path (CUDA's) against the exact CPU path, on CPU.

For the queries and keys of every route of real layouts (several plans, windows, transports) and
of random position sets: the flex `mask_mod` evaluated densely equals the CPU path's mask; the
tile structure built from intervals equals the dense mask's; the BlockMask marks exactly the
tiles with visible pairs; and flex forward (eager on CPU: the unfused reference, forward only)
matches the exact math's output and LSE, empty rows included. The CUDA tile backward (through
FlexAttention's autograd) cannot run on CPU; its formula is checked with the exact attention.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from csbp.runtime.models.attention import Attention, _Collective, _Local, _Ring, attention_backward, \
    attention_with_lse, merge
from csbp.runtime.models.flex_attention import Visibility, flex_attention_with_lse
from csbp.simulator.layout.layout import Layout
from csbp.simulator.layout.mask import visible
from csbp.simulator.plan.plan import parse_plan
from csbp.simulator.workload.spec import AttentionSpec
from csbp.simulator.workload.workload import Workload
from test_runtime_plans import relative_error

TILE = 16  # small tiles: several per call, ragged edges
LAYERS = (AttentionSpec(n_heads=4, n_kv_heads=2, head_dim=16),
          AttentionSpec(kind="sliding", n_heads=4, n_kv_heads=2, head_dim=16, window=12))
LAYOUTS = [  # (seq_len, block, plan, transport, schedule)
    (56, 8, "dp=1", "collective", "dual-end"),
    (56, 8, "cp=2", "collective", "dual-end"),
    (56, 8, "cp=4", "ring", "dual-end"),
    (56, 8, "bp=4", "collective", "contiguous"),
    (56, 8, "cp=2,bp=2", "collective", "dual-end"),
    (64, 8, "cp=2,bp=4", "ring", "dual-end"),
    (96, 16, "cp=4,bp=4", "collective", "dual-end"),
]


def route_visibilities(seq_len, block, plan, transport, schedule):
    """Every Visibility the routes of every rank of a layout use, with a label."""
    w = Workload(seq_len=seq_len, block_size=block, dtype="fp32")
    layout = Layout.build(w, parse_plan(plan, transport=transport, schedule=schedule))
    found = []
    for rank in range(layout.size):
        att = Attention(LAYERS, layout, rank, global_ranks=tuple(range(layout.size)),
                        groups={g: None for a in LAYERS for g in layout.exchange(a, "forward").groups})
        for spec in LAYERS:
            route = att._build(spec, torch.device("cpu"))
            if isinstance(route, _Local):
                vis = [route.vis]
            elif isinstance(route, _Collective):
                vis = [route.local, route.remote]
            else:
                assert isinstance(route, _Ring)
                vis = [route.local_mask, *route.masks.values()]
            found += [(f"{plan}-{transport}-rank{rank}-{spec.kind}", v) for v in vis]
    return found


def random_visibilities(n: int, seed: int):
    """Random query and key position sets (keys shuffled: no order assumed)."""
    g = torch.Generator().manual_seed(seed)
    found = []
    for i in range(n):
        seq_len = int(torch.randint(8, 80, (1,), generator=g))
        divisors = [b for b in range(1, seq_len + 1) if seq_len % b == 0]  # workloads' rule
        block = divisors[int(torch.randint(len(divisors), (1,), generator=g))]
        window = None if i % 2 else int(torch.randint(1, seq_len + 1, (1,), generator=g))
        pool = torch.randperm(2 * seq_len, generator=g)
        q = pool[:int(torch.randint(1, 2 * seq_len, (1,), generator=g))].sort().values
        k = torch.randperm(2 * seq_len, generator=g)[:int(torch.randint(1, 2 * seq_len, (1,),
                                                                        generator=g))]
        found.append((f"random{i}", seq_len, block, window, q, k))
    return found


CASES = [c for layout in LAYOUTS for c in route_visibilities(*layout)]
CASES += [(name, Visibility(q, k, L, b, w, tile=TILE))
          for name, L, b, w, q, k in random_visibilities(24, seed=15)]


def _tiled(vis: Visibility) -> Visibility:
    return Visibility(vis.queries, vis.keys, vis.seq_len, vis.block, vis.window, tile=TILE)


@pytest.mark.timeout(120)
def test_mask_mod_evaluated_densely_equals_the_cpu_mask():
    for name, vis in CASES:
        vis = _tiled(vis)
        n_q, n_k = vis.shape
        dense = create_mask(vis.mask_mod("cpu"), None, None, n_q, n_k, device="cpu")[0, 0]
        want = visible(vis.queries.numpy()[:, None], vis.keys.numpy()[None, :], vis.seq_len,
                       vis.block, vis.window)
        assert torch.equal(dense, torch.from_numpy(want)), name
        assert torch.equal(dense, vis.dense("cpu")), name


def _dense_tiles(mask: torch.Tensor, tile: int) -> torch.Tensor:
    n_q, n_k = mask.shape
    padded = torch.zeros(-(-n_q // tile) * tile, -(-n_k // tile) * tile, dtype=torch.long)
    padded[:n_q, :n_k] = mask.long()
    return padded.view(padded.shape[0] // tile, tile, -1, tile).sum((1, 3))


@pytest.mark.timeout(120)
def test_block_structure_from_intervals_equals_the_dense_masks():
    for name, vis in CASES:
        vis = _tiled(vis)
        pairs = vis.tile_pairs()
        assert torch.equal(pairs, _dense_tiles(vis.dense("cpu"), TILE)), name
        bm = vis.block_mask("cpu")
        blocks = bm.to_dense()[0, 0]  # partial + full tiles the kernel visits
        assert torch.equal(blocks.bool(), pairs > 0), name
        full = torch.zeros_like(blocks)
        for row in range(full.shape[0]):
            n = int(bm.full_kv_num_blocks[0, 0, row])
            full[row, bm.full_kv_indices[0, 0, row, :n].long()] = 1
        n_q, n_k = vis.shape
        whole = TILE * TILE  # ragged edge tiles stay partial (mask_mod bounds them)
        assert torch.equal(full.bool(), pairs == whole), name


# Flex (eager on CPU: its unfused reference) and the exact path are two computations of the same
# float64 softmax: O(1) inputs, head_dim 16, at most 192 keys, so each output and LSE carries a
# rounding of ~(16 + 192) x 1.1e-16 ~ 2e-14. ATOL = 1e-10 leaves a margin of thousands; a wrong
# mask or scale is off by O(1e-1). (torch.allclose also adds its default rtol of 1e-5 x |want|.)
ATOL = 1e-10


def _qkv(vis: Visibility, seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    n_q, n_k = vis.shape
    q = torch.randn(2, 2, 3, n_q, 16, generator=g, dtype=dtype)  # B=2, Hkv=2, G=3
    k = torch.randn(2, 2, n_k, 16, generator=g, dtype=dtype)
    v = torch.randn(2, 2, n_k, 16, generator=g, dtype=dtype)
    return q, k, v


@pytest.mark.floats
@pytest.mark.timeout(180)
def test_flex_forward_on_cpu_matches_the_exact_outputs_and_lse():
    empty_rows = 0
    for i, (name, vis) in enumerate(CASES):
        vis = _tiled(vis)
        q, k, v = _qkv(vis, i)
        want_out, want_lse = attention_with_lse(q, k, v, vis.dense("cpu"), 0.25)
        out, lse = flex_attention_with_lse(q, k, v, vis, 0.25)
        assert lse.shape == want_lse.shape and out.shape == want_out.shape
        assert torch.equal(torch.isinf(lse), torch.isinf(want_lse)), name
        finite = torch.isfinite(want_lse)
        empty_rows += int((~finite).sum())
        assert torch.allclose(lse[finite].double(), want_lse[finite], atol=ATOL), name
        assert torch.allclose(out, want_out, atol=ATOL), name
    assert empty_rows > 0  # ring tiles and random sets leave queries that see nothing


@pytest.mark.floats
@pytest.mark.timeout(60)
def test_merged_flex_partials_equal_one_call_over_all_keys():
    """Keys split into disjoint sets (as the exchanges do), merged by LSE: exact."""
    for i, (name, vis) in enumerate(CASES[-8:]):
        n_k = vis.shape[1]
        cut = n_k // 2
        parts = [Visibility(vis.queries, vis.keys[s], vis.seq_len, vis.block, vis.window, TILE)
                 for s in (slice(0, cut), slice(cut, n_k))]
        q, k, v = _qkv(vis, 100 + i)
        out, lse = flex_attention_with_lse(q, k[:, :, :cut], v[:, :, :cut], parts[0], 0.3)
        out, lse = merge(out, lse, *flex_attention_with_lse(q, k[:, :, cut:], v[:, :, cut:],
                                                            parts[1], 0.3))
        want_out, want_lse = attention_with_lse(q, k, v, _tiled(vis).dense("cpu"), 0.3)
        assert torch.allclose(out, want_out, atol=ATOL), name
        finite = torch.isfinite(want_lse)
        assert torch.allclose(lse[finite].double(), want_lse[finite], atol=ATOL), name


@pytest.mark.floats
@pytest.mark.timeout(60)
def test_tile_backward_formula_through_autograd_equals_the_explicit_backward():
    """CUDA's ring backward differentiates each recomputed tile with grad_out scaled by
    w = exp(lse_t - lse) and an LSE gradient w grad_out . (out_t - out); checked here with the
    exact attention standing in for FlexAttention."""
    _, vis = CASES[-1]
    vis = _tiled(vis)
    q, k, v = _qkv(vis, 7)
    n_k = vis.shape[1]
    mask = vis.dense("cpu")
    tiles = [slice(0, n_k // 3), slice(n_k // 3, n_k)]
    out, lse = attention_with_lse(q, k[:, :, tiles[0]], v[:, :, tiles[0]], mask[:, tiles[0]], 0.3)
    out, lse = merge(out, lse, *attention_with_lse(q, k[:, :, tiles[1]], v[:, :, tiles[1]],
                                                   mask[:, tiles[1]], 0.3))
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3),
                           dtype=out.dtype)
    for t in tiles:
        want = attention_backward(q, k[:, :, t], v[:, :, t], mask[:, t], 0.3, out, lse, grad_out)
        inputs = [x.detach().clone().requires_grad_() for x in (q, k[:, :, t], v[:, :, t])]
        out_t, lse_t = attention_with_lse(*inputs, mask[:, t], 0.3)
        w = torch.exp(lse_t.detach() - lse.masked_fill(lse == float("-inf"), 0.0))
        grad_lse = w * (grad_out * (out_t.detach() - out)).sum(-1)
        got = torch.autograd.grad((out_t, lse_t), inputs, (w.unsqueeze(-1) * grad_out, grad_lse))
        for a, b in zip(got, want):
            assert torch.allclose(a, b, atol=ATOL)


# ---- CUDA only (skipped on CPU): the compiled kernels, forward and backward -----------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="needs CUDA: FlexAttention's compiled kernels and backward")


@pytest.mark.floats
@cuda
@pytest.mark.timeout(900)
def test_compiled_flex_on_cuda_matches_the_exact_path_forward_and_backward():
    """Two key sets merged by LSE (as the K/V exchanges do), differentiated through both
    outputs and LSEs; and the ring's tile backward (through flex) against the explicit one."""
    from csbp.runtime.models.attention import tile_backward

    dev = torch.device("cuda")
    picked = CASES[::max(1, len(CASES) // 6)]
    for i, (name, whole) in enumerate(picked):
        vis = Visibility(whole.queries, whole.keys, whole.seq_len, whole.block, whole.window)
        n_k = vis.shape[1]
        cut = n_k // 2
        parts = [Visibility(vis.queries, vis.keys[s], vis.seq_len, vis.block, vis.window)
                 for s in (slice(0, cut), slice(cut, n_k))]
        q, k, v = (t.float().to(dev).requires_grad_() for t in _qkv(vis, i))
        out, lse = flex_attention_with_lse(q, k[:, :, :cut], v[:, :, :cut], parts[0], 0.25)
        out, lse = merge(out, lse, *flex_attention_with_lse(q, k[:, :, cut:], v[:, :, cut:],
                                                            parts[1], 0.25))
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(i)).to(dev)
        got = torch.autograd.grad(out, (q, k, v), g)
        exact = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        want, want_lse = attention_with_lse(*exact, vis.dense(dev), 0.25)
        wanted = torch.autograd.grad(want, exact, g)
        # 1e-3: compiled fp32 kernels (tiled, online softmax) against the exact fp32 math, each
        # reducing in its own order; a wrong mask or tile is off by far more
        assert relative_error(out.detach().double().cpu().numpy(),
                              want.detach().double().cpu().numpy()) < 1e-3, name
        for a, b in zip(got, wanted):
            assert relative_error(a.double().cpu().numpy(), b.double().cpu().numpy()) < 1e-3, name
        with torch.no_grad():  # the ring's tile backward from the global out and lse
            for part, s in zip(parts, (slice(0, cut), slice(cut, n_k))):
                if part.shape[1] == 0:
                    continue
                a3 = tile_backward(q, k[:, :, s], v[:, :, s], part, 0.25, want, want_lse, g)
                b3 = attention_backward(q, k[:, :, s], v[:, :, s], part.dense(dev), 0.25, want,
                                        want_lse, g)
                for a, b in zip(a3, b3):
                    assert relative_error(a.double().cpu().numpy(),
                                          b.double().cpu().numpy()) < 1e-3, name


@cuda
@pytest.mark.timeout(900)
def test_flex_on_cuda_never_materialises_the_scores_at_32k_tokens():
    """One rank's 2L = 32K positions (L = 16K, block 256), 8 query heads of dim 128, bf16:
    the dense scores alone would be 8 x 32K x 32K x 2 bytes = 16 GiB; flex stays far below."""
    dev = torch.device("cuda")
    seq_len, block = 16 * 1024, 256
    positions = torch.arange(2 * seq_len)
    vis = Visibility(positions, positions, seq_len, block, None)
    g = torch.Generator(device=dev).manual_seed(0)
    shape = (1, 2, 4, 2 * seq_len, 128)
    q = torch.randn(shape, generator=g, device=dev, dtype=torch.bfloat16).requires_grad_()
    k, v = (torch.randn((1, 2, 2 * seq_len, 128), generator=g, device=dev,
                        dtype=torch.bfloat16).requires_grad_() for _ in range(2))
    flex_attention_with_lse(q, k, v, vis, 128 ** -0.5)[0].sum().backward()  # compile
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    out, lse = flex_attention_with_lse(q, k, v, vis, 128 ** -0.5)
    out.float().sum().backward()
    torch.cuda.synchronize()
    assert torch.isfinite(lse).all()
    assert torch.cuda.max_memory_allocated(dev) - base < 2 * 1024**3
