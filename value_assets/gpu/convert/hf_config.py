"""Reading a Hugging Face `config.json` into the backbone shape the Megatron critic is built from.

Supported families (by `config.json` `model_type`): ``llama``, ``qwen2`` (bias on q/k/v),
``qwen3`` (RMSNorm on q and k per head) and ``qwen3_5`` (its text tower: ``qwen3_5`` checkpoints keep it
under ``text_config``, ``qwen3_5_text`` ones at the top; Gated DeltaNet and gated full-attention layers,
partial RoPE; keys a Qwen3.5 config leaves out take transformers' `Qwen3_5TextConfig` defaults, as the
actor did). Anything the Megatron local-spec GPTModel would compute
differently (other activations, sliding-window layers, partial rotary, unsupported RoPE scaling,
biases on other projections) is refused with an `InputError` naming the file, the key and the value,
rather than converted into a model that silently disagrees with the actor.

Both config layouts are accepted: transformers < 5 (`rope_theta`, `rope_scaling`) and
transformers >= 5 (`rope_parameters`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from value_assets.core.errors import InputError, show

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_5")
# transformers' `Qwen3_5TextConfig` defaults for the keys a Qwen3.5 config.json may leave out.
_QWEN3_5_DEFAULTS = {
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "partial_rotary_factor": 0.25,
    "full_attention_interval": 4,
}

# Megatron's RotaryEmbedding._apply_scaling hard-codes these Llama-3.1 values; only the factor is
# configurable there, so a checkpoint with other values must be refused.
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# Field order of the dict returned by `read_hf_config`.
SHAPE_FIELDS = (
    "family",
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "vocab_size",
    "max_position_embeddings",
    "rope_theta",
    "rope_scaling",
    "rope_scaling_factor",
    "rms_norm_eps",
    "qkv_bias",
    "qk_layernorm",
    "tie_word_embeddings",
    "torch_dtype",
    "layer_types",
    "linear_attention",
    "rotary_percent",
    "attention_output_gate",
)


def _rope(cfg: dict[str, Any], where: str) -> tuple[float, bool, float]:
    """(rope_theta, rope_scaling, rope_scaling_factor) from either config layout."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params:
        # transformers 5: one dict (per layer type for some models: refuse those).
        if "rope_theta" not in params and all(isinstance(v, dict) for v in params.values()):
            raise InputError(f"{where}: rope_parameters", f"per-layer-type RoPE is not supported, got {show(params)}")
        theta = params.get("rope_theta", cfg.get("rope_theta"))
        scaling = dict(params)
    else:
        theta = cfg.get("rope_theta", 10000.0)
        scaling = dict(cfg.get("rope_scaling") or {})
    if theta is None:
        theta = 10000.0
    if not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
        raise InputError(f"{where}: rope_theta", f"must be a positive number, got {show(theta)}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if rope_type == "default":
        return float(theta), False, 1.0
    if rope_type == "llama3":
        for key, want in _LLAMA3_FIXED.items():
            if float(scaling.get(key, want)) != want:
                raise InputError(
                    f"{where}: rope scaling {key}",
                    f"Megatron's llama3 RoPE scaling fixes {key}={want}, got {show(scaling.get(key))}",
                )
        factor = scaling.get("factor")
        if not isinstance(factor, (int, float)) or factor <= 0:
            raise InputError(f"{where}: rope scaling factor", f"must be a positive number, got {show(factor)}")
        return float(theta), True, float(factor)
    raise InputError(
        f"{where}: rope scaling",
        f"rope_type {show(rope_type)} is not supported (supported: 'default', 'llama3'); got {show(scaling)}",
    )


def _int(cfg: dict[str, Any], key: str, where: str, default: Any = None) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InputError(f"{where}: {key}", f"must be a positive integer, got {show(value)}")
    return value


def _qwen3_5(cfg: dict[str, Any], where: str) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """(text config, where it is, the Qwen3.5 fields) of a ``qwen3_5`` / ``qwen3_5_text`` config."""
    if cfg.get("model_type") == "qwen3_5":
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise InputError(
                f"{where}: text_config", f"a qwen3_5 config needs its text tower's config, got {show(text)}"
            )
        where = f"{where}: text_config"
    else:
        text = cfg
    text = {**_QWEN3_5_DEFAULTS, **text}
    layers = _int(text, "num_hidden_layers", where)
    types = text.get("layer_types")
    if types is None:
        every = _int(text, "full_attention_interval", where)
        types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or set(types) - {"linear_attention", "full_attention"}:
        raise InputError(
            f"{where}: layer_types",
            f"must list {layers} layers, each 'linear_attention' or 'full_attention', got {show(types)}",
        )
    if text.get("attn_output_gate") is False:
        raise InputError(f"{where}: attn_output_gate", "Qwen3.5 attention without its output gate is not supported")
    rope = text.get("rope_parameters") if isinstance(text.get("rope_parameters"), dict) else {}
    partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor"))
    head_dim = _int(text, "head_dim", where)
    if not isinstance(partial, (int, float)) or isinstance(partial, bool) or not 0 < partial <= 1:
        raise InputError(f"{where}: partial_rotary_factor", f"must be in (0, 1], got {show(partial)}")
    if int(head_dim * partial) % 2 or int(head_dim * partial) != head_dim * partial:
        raise InputError(
            f"{where}: partial_rotary_factor", f"{partial} of head_dim {head_dim} is not an even number of channels"
        )
    la = {
        "key_heads": _int(text, "linear_num_key_heads", where),
        "value_heads": _int(text, "linear_num_value_heads", where),
        "key_head_dim": _int(text, "linear_key_head_dim", where),
        "value_head_dim": _int(text, "linear_value_head_dim", where),
        "conv_kernel": _int(text, "linear_conv_kernel_dim", where),
    }
    if la["value_heads"] % la["key_heads"]:
        raise InputError(
            f"{where}: linear_num_value_heads",
            f"{la['value_heads']} is not a multiple of linear_num_key_heads {la['key_heads']}",
        )
    # mrope (the multimodal positions) rotates the same angles as plain RoPE when every position
    # dim carries the text position, which is all a text critic ever sees.
    extra = {
        "layer_types": list(types),
        "linear_attention": la,
        "rotary_percent": float(partial),
        "attention_output_gate": True,
    }
    plain = {k: v for k, v in text.items() if k != "partial_rotary_factor"}
    if rope:
        plain["rope_parameters"] = {
            k: v for k, v in rope.items() if k not in ("partial_rotary_factor", "mrope_section", "mrope_interleaved")
        }
    plain["layer_types"] = ["full_attention"] * layers  # the checks below are for attention
    return plain, where, extra


def parse_hf_config(cfg: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """The backbone shape of one parsed `config.json` (see `read_hf_config`)."""
    family = cfg.get("model_type")
    extra: dict[str, Any] = {
        "layer_types": None,
        "linear_attention": None,
        "rotary_percent": 1.0,
        "attention_output_gate": False,
    }
    if family in ("qwen3_5", "qwen3_5_text"):
        cfg, where, extra = _qwen3_5(cfg, where)
        family = "qwen3_5"
    if family not in FAMILIES:
        raise InputError(f"{where}: model_type", f"{show(family)} is not supported; supported: {list(FAMILIES)}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise InputError(f"{where}: hidden_act", f"only 'silu' (SwiGLU) is supported, got {show(act)}")
    if cfg.get("mlp_bias"):
        raise InputError(f"{where}: mlp_bias", f"MLP biases are not supported, got {show(cfg['mlp_bias'])}")
    if cfg.get("use_sliding_window"):
        raise InputError(f"{where}: use_sliding_window", "sliding-window attention is not supported, got true")
    layer_types = cfg.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        bad = sorted({t for t in layer_types if t != "full_attention"})
        raise InputError(f"{where}: layer_types", f"only 'full_attention' layers are supported, got {bad}")
    partial = cfg.get("partial_rotary_factor", 1.0)
    if partial not in (None, 1, 1.0):
        raise InputError(f"{where}: partial_rotary_factor", f"only 1.0 is supported, got {show(partial)}")
    # Qwen2 always has q/k/v biases and no o_proj bias; Llama/Qwen3 `attention_bias` would also put
    # a bias on o_proj, which the Megatron critic (add_bias_linear=False) does not have.
    if family == "qwen2":
        qkv_bias = True
    else:
        if cfg.get("attention_bias"):
            raise InputError(
                f"{where}: attention_bias", f"attention biases (q/k/v/o) are not supported for {family}, got true"
            )
        qkv_bias = False

    num_layers = _int(cfg, "num_hidden_layers", where)
    hidden = _int(cfg, "hidden_size", where)
    heads = _int(cfg, "num_attention_heads", where)
    groups = _int(cfg, "num_key_value_heads", where, default=heads)
    if heads % groups:
        raise InputError(f"{where}: num_key_value_heads", f"{groups} does not divide num_attention_heads {heads}")
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise InputError(f"{where}: hidden_size", f"{hidden} is not divisible by num_attention_heads {heads}")
        head_dim = hidden // heads
    else:
        head_dim = _int(cfg, "head_dim", where)
    theta, scaling, factor = _rope(cfg, where)
    eps = cfg.get("rms_norm_eps", 1e-6)
    if not isinstance(eps, (int, float)) or not eps > 0:
        raise InputError(f"{where}: rms_norm_eps", f"must be a positive number, got {show(eps)}")
    return {
        "family": family,
        "num_layers": num_layers,
        "hidden_size": hidden,
        "ffn_hidden_size": _int(cfg, "intermediate_size", where),
        "num_attention_heads": heads,
        "num_query_groups": groups,
        "kv_channels": head_dim,
        "vocab_size": _int(cfg, "vocab_size", where),
        "max_position_embeddings": _int(cfg, "max_position_embeddings", where, default=2048),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rope_scaling_factor": factor,
        "rms_norm_eps": float(eps),
        "qkv_bias": qkv_bias,
        "qk_layernorm": family in ("qwen3", "qwen3_5"),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "torch_dtype": cfg.get("dtype") or cfg.get("torch_dtype"),
        **extra,
    }


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    """Backbone shape fields of the Hugging Face checkpoint in `folder` (its `config.json`).

    Returns a dict with the keys of `SHAPE_FIELDS`: ``family`` (llama/qwen2/qwen3), ``num_layers``,
    ``hidden_size``, ``ffn_hidden_size``, ``num_attention_heads``, ``num_query_groups``,
    ``kv_channels`` (head dim; Qwen3 sets it independently of hidden/heads), ``vocab_size``
    (unpadded), ``max_position_embeddings``, ``rope_theta``, ``rope_scaling`` (bool: llama3-style),
    ``rope_scaling_factor``, ``rms_norm_eps``, ``qkv_bias``, ``qk_layernorm``,
    ``tie_word_embeddings``, ``torch_dtype`` (string or None, informational).
    Raises `InputError` naming the file, key and value for anything unsupported.
    """
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise InputError(str(path), "not found: a Hugging Face checkpoint folder needs config.json")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise InputError(str(path), f"is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise InputError(str(path), f"must hold a JSON object, got {show(cfg)}")
    return parse_hf_config(cfg, str(path))
