"""bench/_flops.py's matmul weight count N against the models themselves: transformers' Qwen2 and
Qwen3.5 text towers built from the same shape, every `nn.Linear` weight in their layers counted,
plus the value head (exact: both are integers)."""

from __future__ import annotations

import pytest
import torch

from bench._flops import flops_per_token, matmul_params
from tests.hf.hf_checkpoints import QWEN3_5_TEXT
from value_assets.core.backbone import BackboneConfig, qwen3_5

pytestmark = pytest.mark.unit


def _linear_weights(model: torch.nn.Module) -> int:
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_matmul_weights_of_qwen2_and_qwen3_5_equal_transformers():
    from transformers import Qwen2Config, Qwen2Model, Qwen3_5TextConfig, Qwen3_5TextModel

    tiny = BackboneConfig.tiny(vocab_size=300)
    q2 = Qwen2Model(
        Qwen2Config(
            vocab_size=300,
            hidden_size=tiny.hidden_size,
            intermediate_size=tiny.ffn_hidden_size,
            num_hidden_layers=tiny.num_layers,
            num_attention_heads=tiny.num_attention_heads,
            num_key_value_heads=tiny.num_query_groups,
        )
    )
    assert matmul_params(tiny, 3) == _linear_weights(q2) + tiny.hidden_size * 3

    from value_assets.gpu.convert.hf import backbone_config_kwargs
    from value_assets.gpu.convert.hf_config import parse_hf_config

    q35 = BackboneConfig(**backbone_config_kwargs(parse_hf_config({"model_type": "qwen3_5_text", **QWEN3_5_TEXT})))
    hf = Qwen3_5TextModel(Qwen3_5TextConfig(**QWEN3_5_TEXT))
    assert matmul_params(q35, 1) == _linear_weights(hf) + q35.hidden_size


def test_deltanet_layers_add_no_context_term():
    """Only attention layers grow with the context; a DeltaNet layer costs the same per token."""
    b = qwen3_5("0.8b")
    short, long = flops_per_token(b, 1, [128], train=False), flops_per_token(b, 1, [4096], train=False)
    d_attn = b.num_attention_heads * b.head_dim
    attention_layers = b.layer_types.count("full_attention")
    assert attention_layers == 6
    s_eff = lambda s: (s + 1) / 2  # noqa: E731  (one sequence of s tokens)
    assert long - short == pytest.approx(4 * attention_layers * d_attn * (s_eff(4096) - s_eff(128)))
