"""Tiny random HF checkpoints for the conversion tests (imported by the test modules and workers)."""

from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(
    num_hidden_layers=2,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)
# family -> extra config: Qwen2 has q/k/v bias by construction; Qwen3 has q/k norm and its own
# head_dim (32 != 64/4 here, as in real Qwen3 where head_dim is set independently).
FAMILIES = {
    "llama": dict(rope_theta=5000.0),
    "qwen2": dict(rope_theta=1e6),
    "qwen3": dict(rope_theta=1e6, head_dim=32),
    "llama3-scaled": dict(
        model_type="llama",
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    ),
}


def make_hf_checkpoint(
    folder: Path, family: str, seed: int = 0, tie: bool = False, num_key_value_heads: int = 2, **save_kwargs
):
    """Random tiny `<family>ForCausalLM` saved as safetensors in `folder`; returns the model (eval)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = dict(FAMILIES[family])
    model_type = extra.pop("model_type", family)
    config = AutoConfig.for_model(
        model_type, **{**TINY, "num_key_value_heads": num_key_value_heads}, **extra, tie_word_embeddings=tie
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        # Default init leaves norms at 1 and biases at 0, which would hide mapping mistakes.
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    model.save_pretrained(str(folder), **save_kwargs)
    return model
