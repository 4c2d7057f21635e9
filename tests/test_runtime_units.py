"""Single-process pieces of the runtime: LSE attention and merge, the model, BD3-LM, plan files."""

from __future__ import annotations

import json

import pytest
import torch

from csbp.simulator.planner import planfile
from csbp.runtime.models.attention import attention_backward, attention_with_lse, merge
from csbp.runtime.models.model import BlockDiffusionLM
from csbp.runtime.models.objective import make_batch
from csbp.simulator.errors import InputError
from csbp.simulator.layout.mask import visible
from csbp.simulator.plan.plan import Plan
from csbp.simulator.workload.presets import load_model
from csbp.simulator.workload.spec import AttentionSpec, ModelSpec, MoESpec
from csbp.simulator.workload.workload import Workload

L, B = 12, 4  # 2L = 24 positions, 3 blocks
# The exact attention against torch's softmax, and tiles merged by LSE against one call: float64,
# O(1) inputs, 24 keys and head_dim 8, so a few dozen roundings of 1.1e-16 each: rtol/atol 1e-12
# keeps a margin of ~100 and still sees any wrong mask or merge (off by O(1e-1)). The backward's
# tiles subtract nearly equal terms (softmax's dS = P (dP - rowsum)), hence rtol 1e-10 there.


def grouped_qkv(n_q: int, n_k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 2, 3, n_q, 8, generator=g, dtype=torch.float64)  # B, Hkv, G, N, D
    k = torch.randn(2, 2, n_k, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, n_k, 8, generator=g, dtype=torch.float64)
    return q, k, v


def bd3lm_mask(window=None) -> torch.Tensor:
    pos = torch.arange(2 * L)
    return visible(pos[:, None], pos[None, :], L, B, window)


@pytest.mark.floats
def test_attention_matches_softmax_and_empty_rows_are_zero_with_finite_gradients():
    q, k, v = grouped_qkv(24, 24)
    allowed = bd3lm_mask(window=3)
    allowed[5] = False  # a query that sees nothing
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    out, lse = attention_with_lse(q, k, v, allowed, 0.5)
    s = (q @ k.unsqueeze(2).transpose(-1, -2) * 0.5).masked_fill(~allowed, float("-inf"))
    want = torch.nan_to_num(torch.softmax(s, -1)) @ v.unsqueeze(2)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    assert torch.all(out[..., 5, :] == 0) and torch.all(lse[..., 5] == float("-inf"))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.floats
def test_merged_tiles_and_global_lse_backward_equal_whole_attention():
    """The ring's two identities: LSE merge forward, per-tile backward with the global LSE."""
    q, k, v = grouped_qkv(24, 24, seed=1)
    allowed = bd3lm_mask()
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    out, lse = attention_with_lse(q, k, v, allowed, 0.3)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    tiles = [slice(0, 4), slice(4, 14), slice(14, 24)]  # the first tile is empty for most rows
    with torch.no_grad():
        merged, merged_lse = attention_with_lse(q, k[:, :, tiles[0]], v[:, :, tiles[0]],
                                                allowed[:, tiles[0]], 0.3)
        for t in tiles[1:]:
            merged, merged_lse = merge(merged, merged_lse,
                                       *attention_with_lse(q, k[:, :, t], v[:, :, t], allowed[:, t], 0.3))
        torch.testing.assert_close(merged, out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(merged_lse, lse, rtol=1e-12, atol=1e-12)
        dq = torch.zeros_like(q)
        for t in tiles:
            dq_t, dk_t, dv_t = attention_backward(q, k[:, :, t], v[:, :, t], allowed[:, t], 0.3,
                                                  out, lse, grad_out)
            dq += dq_t
            torch.testing.assert_close(dk_t, k.grad[:, :, t], rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(dv_t, v.grad[:, :, t], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(dq, q.grad, rtol=1e-10, atol=1e-12)


def test_merge_of_two_empty_pieces_stays_empty_without_nan():
    out, lse = torch.zeros(1, 2, 3), torch.full((1, 2), float("-inf"))
    merged, merged_lse = merge(out, lse, out, lse)
    assert not merged.isnan().any() and torch.all(merged_lse == float("-inf"))


@pytest.mark.parametrize("spec", [
    load_model("tiny"),
    ModelSpec(name="moe", hidden=32, ffn=0, vocab=64, tie_embeddings=True,
              layers=(AttentionSpec(n_heads=4, n_kv_heads=2, head_dim=8, gated_q=True),
                      AttentionSpec(kind="sliding", n_heads=4, n_kv_heads=1, head_dim=16, window=8)),
              moe=MoESpec(n_experts=3, top_k=2, expert_ffn=16, dense_ffn=8)),
], ids=["tiny", "moe-gated-tied-mixed-heads"])
def test_model_has_exactly_the_parameters_the_simulator_counts(spec):
    model = BlockDiffusionLM(spec)
    assert sum(p.numel() for p in model.parameters()) == spec.total_params()


@pytest.mark.parametrize("preset", ["qwen3.5-27b", "diffusiongemma-26b-a4b", "dflash2-qwen3.8-27b"])
def test_unsupported_model_features_are_one_line_input_errors(preset):
    with pytest.raises(InputError, match="not supported by the runtime yet"):
        BlockDiffusionLM(load_model(preset))


def test_weights_and_batches_are_deterministic_and_sliceable():
    spec = load_model("tiny")
    a, b = BlockDiffusionLM(spec, seed=3), BlockDiffusionLM(spec, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    whole = make_batch(range(3), step=2, seed=7, seq_len=L, block=B, vocab=spec.vocab)
    one = make_batch([1], step=2, seed=7, seq_len=L, block=B, vocab=spec.vocab)
    assert torch.equal(whole.tokens[1:2], one.tokens) and torch.equal(whole.noise[1:2], one.noise)
    x_t, x_0 = whole.tokens[:, :L], whole.tokens[:, L:]
    masked = x_t == spec.vocab - 1
    assert masked.any() and not (x_0 == spec.vocab - 1).any()
    assert torch.equal(x_t[~masked], x_0[~masked])  # unmasked noisy tokens are the clean ones


def test_plan_file_round_trips_presets_and_inline_models(tmp_path):
    workload = Workload(seq_len=64, block_size=8, dtype="fp32")
    inline = ModelSpec(name="inline", hidden=32, ffn=64, vocab=64,
                       layers=(AttentionSpec(n_heads=2, n_kv_heads=1, head_dim=16),))
    for model in ("tiny", inline):
        pf = planfile.PlanFile(model=model, workload=workload, plan=Plan(cp=2, bp=2), nodes=1)
        planfile.dump(pf, tmp_path / "plan.json")
        loaded = planfile.load(tmp_path / "plan.json")
        assert loaded == pf and loaded.model_spec().name == (model if isinstance(model, str) else "inline")


@pytest.mark.parametrize("content, message", [
    ({"version": 2, "model": "tiny", "workload": {"seq_len": 64}, "plan": {}}, "version 2 is not supported"),
    ({"model": "tiny", "workload": {"seq_len": 64}, "plan": {"cp": 2}, "gpus": 4}, "gpus"),
    ({"model": "tiny", "workload": {"seq_len": 64, "block_size": 7}, "plan": {}}, "not a multiple"),
])
def test_bad_plan_files_are_one_line_input_errors(tmp_path, content, message):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(content))
    with pytest.raises(InputError, match=message) as err:
        planfile.load(path)
    assert "\n" not in str(err.value)
    with pytest.raises(InputError, match="cannot read plan file"):
        planfile.load(tmp_path / "missing.json")


@pytest.mark.timeout(120)
def test_a_spawned_rank_reports_its_own_peak_memory_not_its_launchers():
    """ru_maxrss survives fork + exec on Linux; the rank must read its own VmHWM."""
    from csbp.runtime.training.launch import spawn
    from csbp.runtime.training.train import Job

    ballast = bytearray(1024**3)  # the launcher's peak: 1 GiB more than a tiny rank needs
    ballast[::4096] = b"\x01" * len(ballast[::4096])
    job = Job(load_model("tiny"), Workload(seq_len=16, block_size=4, dtype="fp32"), Plan(),
              steps=1, warmup=0)
    ((report,),) = spawn([job], 1, "cpu", 100)
    del ballast
    assert 0 < report.peak_memory_bytes < 1024**3
