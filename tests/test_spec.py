"""Model presets and Hugging Face config loading."""

import json

import pytest

from csbp.simulator.errors import InputError
from csbp.simulator.workload.presets import PRESET_NAMES, load_model

# total / active parameter counts the model cards state (billions), with a loose tolerance for
# the unverified shapes
CARD_SIZES = {
    "nemotron-diffusion-8b": (8.0, 9.0),
    "diffusiongemma-26b-a4b": (24.5, 26.0),
    "qwen3.5-27b": (26.0, 28.0),
    "qwen3-8b": (7.9, 8.4),
    "qwen2.5-7b": (7.4, 7.8),
}


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_presets_load(name):
    model = load_model(name)
    assert model.n_layers > 0 and model.total_params() > 0


@pytest.mark.parametrize("name,bounds", CARD_SIZES.items())
def test_preset_sizes_match_model_cards(name, bounds):
    assert bounds[0] <= load_model(name).total_params() / 1e9 <= bounds[1]


def test_diffusiongemma_active_params_and_layer_mix():
    model = load_model("diffusiongemma-26b-a4b")
    assert 3.5 <= model.active_params() / 1e9 <= 4.1
    kinds = [layer.kind for layer in model.layers]
    assert kinds.count("sliding") == 25 and kinds.count("full") == 5


def test_qwen35_is_hybrid():
    kinds = [layer.kind for layer in load_model("qwen3.5-27b").layers]
    assert kinds.count("linear") == 48 and kinds.count("full") == 16


def _write(tmp_path, cfg):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_hf_config_dense(tmp_path):
    cfg = {"model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36,
           "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
           "intermediate_size": 12288, "vocab_size": 151936, "tie_word_embeddings": False}
    model = load_model(_write(tmp_path, cfg))
    assert model.total_params() == load_model("qwen3-8b").total_params()


def test_hf_config_hybrid_and_moe(tmp_path):
    cfg = {"model_type": "qwen3_next", "hidden_size": 2048, "num_hidden_layers": 8,
           "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
           "intermediate_size": 5120, "vocab_size": 151936, "full_attention_interval": 4,
           "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
           "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 64,
           "num_experts_per_tok": 8, "moe_intermediate_size": 512,
           "shared_expert_intermediate_size": 512}
    model = load_model(_write(tmp_path, cfg))
    assert [layer.kind for layer in model.layers].count("linear") == 6
    assert model.moe.n_experts == 64 and model.moe.dense_ffn == 512


def test_hf_config_sliding_pattern_nested(tmp_path):
    cfg = {"text_config": {"model_type": "gemma3_text", "hidden_size": 1152, "num_hidden_layers": 12,
                           "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
                           "intermediate_size": 6912, "vocab_size": 262144, "sliding_window": 512,
                           "sliding_window_pattern": 6}}
    model = load_model(_write(tmp_path, cfg))
    assert [layer.kind for layer in model.layers].count("sliding") == 10


@pytest.mark.parametrize("content,msg", [
    ("{not json", "not valid JSON"),
    ('{"hidden_size": 8}', "missing key"),
    ("[1, 2]", "JSON object"),
    ('{"hidden_size": 64, "num_attention_heads": 3, "num_key_value_heads": 2, "num_hidden_layers": 2,'
     ' "vocab_size": 10, "intermediate_size": 8}', "multiple of n_kv_heads"),
])
def test_hf_config_bad_input_is_one_line(tmp_path, content, msg):
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(InputError, match=msg) as err:
        load_model(str(path))
    assert "\n" not in str(err.value)


def test_unknown_model_names_presets():
    with pytest.raises(InputError, match="unknown model 'nope'.*nemotron-diffusion-8b"):
        load_model("nope")
