"""Named models of the CSBP study (shared/reference/workloads.md), two plain autoregressive
models (Llama 3.1 8B, Llama 2 7B: issue 24) and tiny CPU models.

Each preset says where its shapes come from; figures the reference marks unverified say so in
`source`. `load_model(name_or_path)` is the one entry point: a preset name, or a path to a
Hugging Face `config.json`.
"""

from __future__ import annotations

from pathlib import Path

from csbp.simulator.errors import InputError
from csbp.simulator.workload.spec import AttentionSpec, ModelSpec, MoESpec


def _dense(name: str, layers: int, hidden: int, heads: int, kv: int, head_dim: int, ffn: int,
           vocab: int, source: str, tie: bool = False, qkv_bias: bool = False) -> ModelSpec:
    attn = AttentionSpec(n_heads=heads, n_kv_heads=kv, head_dim=head_dim)
    return ModelSpec(name=name, hidden=hidden, ffn=ffn, vocab=vocab, layers=(attn,) * layers,
                     tie_embeddings=tie, qkv_bias=qkv_bias, source=source)


def _diffusiongemma() -> ModelSpec:
    # 30 layers: 5 sliding-window (1024) layers then one global layer, repeated (Gemma 3 pattern).
    sliding = AttentionSpec(kind="sliding", n_heads=16, n_kv_heads=8, head_dim=256, window=1024)
    global_ = AttentionSpec(n_heads=16, n_kv_heads=2, head_dim=512, k_eq_v=True)
    layers = tuple(global_ if (i + 1) % 6 == 0 else sliding for i in range(30))
    return ModelSpec(
        name="diffusiongemma-26b-a4b", hidden=2816, ffn=0, vocab=262144, layers=layers,
        moe=MoESpec(n_experts=128, top_k=8, expert_ffn=704, dense_ffn=2112), tie_embeddings=True,
        source="workloads.md; config from a third-party copy (unverified); 25 sliding + 5 global "
               "layers placed every 6th (assumed Gemma-3 pattern); tied embeddings (assumed)",
    )


def _qwen35(name: str, note: str) -> ModelSpec:
    # 64 layers: three Gated-DeltaNet layers then one full-attention layer, repeated.
    full = AttentionSpec(n_heads=24, n_kv_heads=4, head_dim=256, gated_q=True)
    gdn = AttentionSpec(kind="linear", n_heads=48, n_kv_heads=16, head_dim=128, conv_kernel=4)
    layers = tuple(full if (i + 1) % 4 == 0 else gdn for i in range(64))
    return ModelSpec(
        name=name, hidden=5120, ffn=17408, vocab=248320, layers=layers,
        source="workloads.md (48 Gated-DeltaNet + 16 full attention); linear-attention head counts "
               "(16 key / 48 value heads of dim 128, conv 4) and the 3:1 interleave follow the "
               "Qwen3-Next family (unverified)" + note,
    )


# DFlash2 drafters' attention window (implementation.md section 14: the Muse-Glimmer fixture's
# layers are sliding-window 2048; the Qwen3.8 drafter "windowed like Muse [inference]")
DRAFTER_WINDOW = 2048


def _drafter(name: str, hidden: int, ffn: int, vocab: int, source: str) -> ModelSpec:
    """A DFlash2 drafter: 5 sliding-window layers of 32/8 heads of 128, conditioned on 5 target
    layers (implementation.md 14)."""
    attn = AttentionSpec(kind="sliding", n_heads=32, n_kv_heads=8, head_dim=128, window=DRAFTER_WINDOW)
    return ModelSpec(name=name, hidden=hidden, ffn=ffn, vocab=vocab, layers=(attn,) * 5,
                     conditioning_layers=5, source=source)


def _dflash2() -> ModelSpec:
    return _drafter(
        "dflash2-qwen3.8-27b", 5120, 17408, 248320,
        "implementation.md 14: 5 layers, hidden 5120, 32/8 heads of 128, FFN 17,408, vocab "
        "248,320 [third-party config]; sliding window 2048 as the Muse fixture [inference, U]")


def _dflash2_muse() -> ModelSpec:
    return _drafter(
        "dflash2-muse-glimmer-30b", 6656, 19968, 202048,
        "implementation.md 14, the Muse-Glimmer drafter fixture: 5 sliding-window (2048) "
        "layers, hidden 6656, 32/8 heads of 128, FFN 19,968, vocab 202,048; conditioned on 5 "
        "target layers of the drafter's hidden width [U]; its block-local convolutions (2 taps, "
        "groups of 16) and selector (rank 256, top-16) are not counted [U: small]")


_PRESETS = {
    "nemotron-diffusion-3b": lambda: _dense(
        "nemotron-diffusion-3b", 26, 3072, 32, 8, 128, 8192, 131072, tie=True,
        source="workloads.md; head dim 128 and FFN 8192 from Ministral 3B (unverified)"),
    "nemotron-diffusion-8b": lambda: _dense(
        "nemotron-diffusion-8b", 34, 4096, 32, 8, 128, 14336, 131072,
        source="workloads.md (HF config of Nemotron-Labs-Diffusion 8B)"),
    "nemotron-diffusion-14b": lambda: _dense(
        "nemotron-diffusion-14b", 40, 5120, 32, 8, 128, 16384, 131072,
        source="workloads.md; shapes of Ministral 3 14B (unverified)"),
    "diffusiongemma-26b-a4b": _diffusiongemma,
    "qwen3.5-27b": lambda: _qwen35("qwen3.5-27b", ""),
    "qwen3.8-27b": lambda: _qwen35("qwen3.8-27b", "; Qwen3.8 assumed identical to Qwen3.5 (unverified)"),
    "dflash2-qwen3.8-27b": _dflash2,
    "dflash2-muse-glimmer-30b": _dflash2_muse,
    "qwen3-8b": lambda: _dense("qwen3-8b", 36, 4096, 32, 8, 128, 12288, 151936,
                               source="workloads.md (Qwen3-8B config)"),
    "qwen2.5-7b": lambda: _dense("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064, qkv_bias=True,
                                 source="workloads.md (Qwen2.5-7B config)"),
    # plain autoregressive models TorchTitan and Megatron-Core train (issue 24), from their public
    # Hugging Face config.json files; RMSNorm, SwiGLU, RoPE (theta 500,000 / 10,000 and Llama 3.1's
    # rope scaling change no FLOP or byte csbp counts); 8.03B / 6.74B parameters
    "llama3.1-8b": lambda: _dense(
        "llama3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256,
        source="meta-llama/Llama-3.1-8B config.json: hidden_size 4096, num_hidden_layers 32, "
               "num_attention_heads 32, num_key_value_heads 8 (head dim 128), intermediate_size "
               "14336, vocab_size 128256, rope_theta 500000, tie_word_embeddings false"),
    "llama2-7b": lambda: _dense(
        "llama2-7b", 32, 4096, 32, 32, 128, 11008, 32000,
        source="meta-llama/Llama-2-7b-hf config.json: hidden_size 4096, num_hidden_layers 32, "
               "num_attention_heads 32, num_key_value_heads 32 (MHA, head dim 128), "
               "intermediate_size 11008, vocab_size 32000, rope_theta 10000, tie_word_embeddings "
               "false"),
    "tiny": lambda: _dense("tiny", 2, 64, 4, 2, 16, 128, 256, source="csbp test model for CPU runs"),
    "tiny-moe": lambda: ModelSpec(
        name="tiny-moe", hidden=64, ffn=0, vocab=256,
        layers=(AttentionSpec(n_heads=4, n_kv_heads=2, head_dim=16),) * 2,
        moe=MoESpec(n_experts=8, top_k=2, expert_ffn=64, dense_ffn=64),
        source="csbp test MoE model for CPU runs (expert and tensor parallelism)"),
}

PRESET_NAMES = tuple(_PRESETS)


def load_model(name_or_path: str) -> ModelSpec:
    """A preset by name, or a Hugging Face `config.json` by path."""
    if name_or_path in _PRESETS:
        return _PRESETS[name_or_path]()
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or path.exists():
        from csbp.simulator.workload.hf_config import model_from_hf_config

        return model_from_hf_config(path)
    raise InputError(f"unknown model {name_or_path!r}: use a preset ({', '.join(PRESET_NAMES)}) "
                     "or a path to a Hugging Face config.json")
