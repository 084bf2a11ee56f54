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


# A tiny Qwen3.5 text tower: three Gated DeltaNet layers then one gated full-attention layer (the
# real 3:1 pattern), 2 key heads serving 4 value heads, head_dim 32 with a quarter of it rotated.
QWEN3_5_TEXT = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_parameters=dict(
        rope_type="default",
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        mrope_section=[2, 1, 1],
        mrope_interleaved=True,
    ),
)
# The smallest vision tower transformers' Qwen3.5 builds (the image-text checkpoints carry one).
QWEN3_5_VISION = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=16,
    num_heads=1,
    patch_size=2,
    temporal_patch_size=1,
    spatial_merge_size=1,
)


def make_qwen3_5_checkpoint(
    folder: Path, *, image_text: bool = False, seed: int = 0, redraw: bool = True, **text_changes
):
    """A random tiny Qwen3.5 saved as safetensors in `folder`: `Qwen3_5ForCausalLM` (text tower under
    `model.`) or, with `image_text`, `Qwen3_5ForConditionalGeneration` (text tower under
    `model.language_model.`, a vision tower under `model.visual.`). Every weight is drawn at random
    (norms around 0: Qwen3.5's norms scale by 1 + weight), so a misplaced tensor shows; `redraw=False`
    keeps transformers' own initialisation (an actor a critic can learn from in a few steps). Returns
    the text model (eval)."""
    from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig

    text = {**QWEN3_5_TEXT, **text_changes}
    torch.manual_seed(seed)
    if image_text:
        config = Qwen3_5Config(
            text_config=text, vision_config={**QWEN3_5_VISION, "out_hidden_size": text["hidden_size"]}
        )
        model = Qwen3_5ForConditionalGeneration(config).eval()
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters() if redraw else ():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)
            elif name.endswith(("A_log", "dt_bias")):
                p.uniform_(-1.0, 1.0)
            else:
                p.normal_(0.0, 0.1)
    model.save_pretrained(str(folder))
    return model.model.language_model if image_text else model.model
