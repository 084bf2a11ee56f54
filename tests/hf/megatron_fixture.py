"""Minimal single-process Megatron setup for the conversion tests (CPU, gloo, TP=1).

Kept private to tests/hf so these tests do not depend on the engine's model module: a 1-rank gloo
group, `initialize_model_parallel(1, 1)`, `torch.cuda.current_device` pointed at the CPU (rotary
`inv_freq` and attention scratch tensors allocate on "the current device"), and a local-spec
GPTModel built from a `read_hf_config` dict. The critic here is that backbone plus a Linear value
head on the final-norm hidden states, which is what docs/rules.md#critic prescribes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def init_single_rank() -> None:
    """A 1-rank gloo group and megatron parallel state through the engine's own helper (which
    applies the CPU compatibility layer without CUDA)."""
    from megatron.core import parallel_state as ps

    from value_assets.gpu.runtime.parallel import init_distributed

    if not ps.model_parallel_is_initialized():
        init_distributed(0, 1, "127.0.0.1", 0)


def teardown_single_rank() -> None:
    from value_assets.gpu.runtime.parallel import destroy

    destroy()


def build_gpt(cfg: dict, *, padded_vocab_size: int | None = None, dtype=torch.float32, tp: int = 1):
    """Local-spec GPTModel (post_process=True: final norm present) in the shape of `cfg`."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    tc = TransformerConfig(
        num_layers=cfg["num_layers"],
        hidden_size=cfg["hidden_size"],
        ffn_hidden_size=cfg["ffn_hidden_size"],
        num_attention_heads=cfg["num_attention_heads"],
        num_query_groups=cfg["num_query_groups"],
        kv_channels=cfg["kv_channels"],
        normalization="RMSNorm",
        layernorm_epsilon=cfg["rms_norm_eps"],
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=cfg["qkv_bias"],
        qk_layernorm=cfg["qk_layernorm"],
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        use_cpu_initialization=True,
        perform_initialization=False,
        params_dtype=dtype,
        tensor_model_parallel_size=tp,
        bf16=dtype == torch.bfloat16,
    )
    spec = get_gpt_layer_local_spec(qk_layernorm=cfg["qk_layernorm"], normalization="RMSNorm")
    return GPTModel(
        config=tc,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size or cfg["vocab_size"],
        max_sequence_length=cfg["max_position_embeddings"],
        position_embedding_type="rope",
        rotary_base=cfg["rope_theta"],
        rope_scaling=cfg["rope_scaling"],
        rope_scaling_factor=cfg["rope_scaling_factor"],
        share_embeddings_and_output_weights=False,
        post_process=True,
    ).eval()


def load_backbone(model, state: dict) -> None:
    """Strict load of a backbone state: only the LM output layer (unused by the critic) may be absent."""
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state") and k != "output_layer.weight"]
    assert not missing, missing
    assert not result.unexpected_keys, result.unexpected_keys


def final_hidden(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Final-norm hidden states [b, s, h] of a GPTModel for `input_ids` [b, s] (causal attention)."""
    captured = {}
    handle = model.decoder.register_forward_hook(lambda m, i, o: captured.__setitem__("h", o))
    try:
        b, s = input_ids.shape
        position_ids = torch.arange(s).unsqueeze(0).expand(b, s)
        with torch.no_grad():
            # Explicit causal mask (True = masked): Megatron's default one is allocated on CUDA.
            mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
            model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask)
    finally:
        handle.remove()
    out = captured["h"]
    out = out[0] if isinstance(out, tuple) else out
    return out.transpose(0, 1).contiguous()  # Megatron is [s, b, h]
