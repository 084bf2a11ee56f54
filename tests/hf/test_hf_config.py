"""read_hf_config: fields per family and clear errors for what the critic cannot reproduce."""

from __future__ import annotations

import json

import pytest

from value_assets.core.errors import InputError
from value_assets.gpu.convert.hf import read_hf_config

pytestmark = pytest.mark.unit

BASE = {
    "model_type": "llama",
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000,
    "rope_scaling": None,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}


def write(tmp_path, **changes):
    cfg = {**BASE, **changes}
    cfg = {k: v for k, v in cfg.items() if v is not ...}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_smollm2_shaped_llama_config(tmp_path):
    cfg = read_hf_config(write(tmp_path))
    assert cfg == {
        "family": "llama",
        "num_layers": 30,
        "hidden_size": 576,
        "ffn_hidden_size": 1536,
        "num_attention_heads": 9,
        "num_query_groups": 3,
        "kv_channels": 64,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
        "rope_scaling": False,
        "rope_scaling_factor": 1.0,
        "rms_norm_eps": 1e-5,
        "qkv_bias": False,
        "qk_layernorm": False,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "layer_types": None,
        "linear_attention": None,
        "rotary_percent": 1.0,
        "attention_output_gate": False,
    }


def test_family_flags_and_transformers5_rope_layout(tmp_path):
    q2 = read_hf_config(
        write(tmp_path, model_type="qwen2", rope_theta=..., rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    )
    assert (q2["family"], q2["qkv_bias"], q2["qk_layernorm"], q2["rope_theta"]) == ("qwen2", True, False, 1e6)
    q3 = read_hf_config(write(tmp_path, model_type="qwen3", head_dim=128))
    assert (q3["qkv_bias"], q3["qk_layernorm"], q3["kv_channels"]) == (False, True, 128)


def test_llama3_rope_scaling_supported(tmp_path):
    scaling = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    cfg = read_hf_config(write(tmp_path, rope_scaling=scaling))
    assert (cfg["rope_scaling"], cfg["rope_scaling_factor"]) == (True, 32.0)


@pytest.mark.parametrize(
    "changes, fragment",
    [
        ({"model_type": "mistral"}, "model_type: 'mistral' is not supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn' is not supported"),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 4096}},
            "original_max_position_embeddings",
        ),
        ({"hidden_act": "gelu"}, "hidden_act: only 'silu'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
        ({"model_type": "qwen3", "layer_types": ["full_attention", "sliding_attention"]}, "sliding_attention"),
        ({"num_key_value_heads": 4}, "num_key_value_heads: 4 does not divide"),
        ({"hidden_size": "576"}, "hidden_size: must be a positive integer, got '576'"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ],
)
def test_unsupported_features_name_file_key_and_value(tmp_path, changes, fragment):
    with pytest.raises(InputError) as info:
        read_hf_config(write(tmp_path, **changes))
    assert fragment in str(info.value)
    assert str(tmp_path / "config.json") in str(info.value)


def test_missing_config(tmp_path):
    with pytest.raises(InputError, match="config.json: not found"):
        read_hf_config(tmp_path)
