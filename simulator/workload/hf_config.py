"""Read a Hugging Face `config.json` as is into a ModelSpec.

Covers the families users convert to block diffusion: Llama/Mistral/Qwen2/Qwen3 (dense GQA),
Qwen-MoE/Mixtral/DeepSeek-style MoE key names, Gemma-3 style sliding-window interleaving
(`layer_types` or `sliding_window_pattern`), Qwen3-Next/3.5 hybrid linear attention
(`layer_types` with "linear_attention" or `full_attention_interval`), and multimodal wrappers
that nest the language model under `text_config`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from csbp.simulator.errors import InputError, one_line
from csbp.simulator.workload.spec import AttentionSpec, ModelSpec, MoESpec


def _first(cfg: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def _layer_kinds(cfg: dict[str, Any], n_layers: int) -> list[str]:
    types = cfg.get("layer_types")
    if types:
        if len(types) != n_layers:
            raise InputError(f"layer_types has {len(types)} entries but num_hidden_layers is {n_layers}")
        table = {"full_attention": "full", "sliding_attention": "sliding", "linear_attention": "linear",
                 "chunked_attention": "sliding"}
        unknown = sorted(set(types) - set(table))
        if unknown:
            raise InputError(f"unknown layer_types {unknown}: known {sorted(table)}")
        return [table[t] for t in types]
    if cfg.get("full_attention_interval"):
        k = int(cfg["full_attention_interval"])
        return ["full" if (i + 1) % k == 0 else "linear" for i in range(n_layers)]
    if cfg.get("sliding_window_pattern") and cfg.get("sliding_window"):
        k = int(cfg["sliding_window_pattern"])
        return ["full" if (i + 1) % k == 0 else "sliding" for i in range(n_layers)]
    if cfg.get("sliding_window") and cfg.get("use_sliding_window"):
        return ["sliding"] * n_layers
    return ["full"] * n_layers


def _layer(cfg: dict[str, Any], kind: str, hidden: int, heads: int) -> AttentionSpec:
    if kind == "linear":
        return AttentionSpec(
            kind="linear", n_heads=_first(cfg, "linear_num_value_heads", default=heads),
            n_kv_heads=_first(cfg, "linear_num_key_heads", default=heads),
            head_dim=_first(cfg, "linear_key_head_dim", "linear_value_head_dim", default=hidden // heads),
            conv_kernel=_first(cfg, "linear_conv_kernel_dim", default=0))
    head_dim = _first(cfg, "head_dim", default=hidden // heads)
    kv = _first(cfg, "num_key_value_heads", default=heads)
    if kind == "full" and cfg.get("global_head_dim"):  # models whose global layers are wider
        head_dim = cfg["global_head_dim"]
        kv = _first(cfg, "num_global_key_value_heads", default=kv)
    return AttentionSpec(kind=kind, n_heads=heads, n_kv_heads=kv, head_dim=head_dim,
                         window=cfg["sliding_window"] if kind == "sliding" else None,
                         gated_q=bool(cfg.get("attn_output_gate", False)))


def _moe(cfg: dict[str, Any]) -> MoESpec | None:
    n = _first(cfg, "num_experts", "num_local_experts", "n_routed_experts")
    if not n:
        return None
    shared = _first(cfg, "shared_expert_intermediate_size", default=0) or 0
    if not shared and cfg.get("n_shared_experts"):
        shared = cfg["n_shared_experts"] * cfg["moe_intermediate_size"]
    return MoESpec(n_experts=n, top_k=_first(cfg, "num_experts_per_tok", "top_k", default=1),
                   expert_ffn=_first(cfg, "moe_intermediate_size", "intermediate_size"),
                   dense_ffn=shared)


MAX_LAYERS = 4096  # far above any real model; keeps a typo like 10**7 from building for minutes
# Largest sizes the simulator models (about 100x today's models): beyond them FLOP and byte
# counts leave the range of the int64/float arithmetic the cost model uses.
MAX_SIZE = {"hidden": 2**20, "ffn": 2**20, "vocab": 2**22, "n_heads": 2**10, "n_kv_heads": 2**10,
            "head_dim": 2**10, "window": 2**24, "conv_kernel": 2**10, "n_experts": 2**12,
            "top_k": 2**12, "expert_ffn": 2**20, "dense_ffn": 2**20}


def _check_sizes(tree: Any, path: Path) -> None:
    """Every size of a ModelSpec dump within MAX_SIZE."""
    if isinstance(tree, (list, tuple)):
        tree = dict(enumerate(tree))
    for key, value in tree.items() if isinstance(tree, dict) else ():
        if key in MAX_SIZE and isinstance(value, int) and value > MAX_SIZE[key]:
            raise InputError(f"{path}: {key}={value} exceeds {MAX_SIZE[key]}, the largest the "
                             "simulator models")
        _check_sizes(value, path)


def model_from_hf_config(path: Path) -> ModelSpec:
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise InputError(f"no such model config: {path}") from None
    except OSError as err:
        raise InputError(f"cannot read model config {path}: {err.strerror or err}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputError(f"{path} is not valid JSON: {str(err).splitlines()[0]}") from None
    except RecursionError:
        raise InputError(f"{path} is nested too deeply to be a model config") from None
    if not isinstance(raw, dict):
        raise InputError(f"{path}: expected a JSON object")
    cfg = raw.get("text_config") or raw
    if not isinstance(cfg, dict):
        raise InputError(f"{path}: text_config must be a JSON object")
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        n_layers = int(cfg["num_hidden_layers"])
        vocab = int(cfg["vocab_size"])
    except KeyError as err:
        raise InputError(f"{path}: missing key {err.args[0]!r} (not a transformer config.json?)") from None
    except (TypeError, ValueError, OverflowError) as err:
        raise InputError(f"{path}: bad value: {err}") from None
    if not 1 <= n_layers <= MAX_LAYERS:
        raise InputError(f"{path}: num_hidden_layers={n_layers}: use 1 to {MAX_LAYERS}")
    if hidden < 1 or heads < 1:
        raise InputError(f"{path}: hidden_size and num_attention_heads must be positive "
                         f"(got {hidden}, {heads})")
    try:
        moe = _moe(cfg)
        kinds = _layer_kinds(cfg, n_layers)
        layers = tuple(_layer(cfg, k, hidden, heads) for k in kinds)
        spec = ModelSpec(
            name=str(raw.get("_name_or_path") or cfg.get("model_type") or Path(path).parent.name or "hf-model"),
            hidden=hidden, ffn=0 if moe and not cfg.get("intermediate_size") else int(cfg.get("intermediate_size", 0)),
            vocab=vocab, layers=layers, moe=moe,
            tie_embeddings=bool(raw.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
            qkv_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
            source=f"Hugging Face config {path}")
    except ValidationError as err:
        raise InputError(f"{path}: {one_line(err)}") from None
    except (TypeError, ValueError, ZeroDivisionError, OverflowError) as err:  # a key of the wrong type
        raise InputError(f"{path}: bad value: {one_line(err)}") from None
    _check_sizes(spec.model_dump(), path)
    return spec
