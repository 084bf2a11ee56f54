"""The shape of a critic: the actor transformer it is built from (`BackboneConfig`) and its value
head (`CriticShape`).

Torch-free, so that the job drivers (which only read, check and record it) and the memory model
(`core/memory.py`) need neither torch nor megatron-core; the model is built from it in
`gpu/model/gpt_critic.py`, on the workers.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

# The files of an actor's Hugging Face folder that decide how text becomes ids; their bytes make the
# tokenizer's sha, export-hf carries them into a critic's folder, and a hand-off without them tells
# verl where the tokenizer is.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_5")
# Qwen3.5's layer kinds (transformers' `layer_types`): Gated DeltaNet token mixing or gated full attention.
LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True, kw_only=True)
class LinearAttention:
    """The Gated DeltaNet shape of a Qwen3.5 backbone (transformers' `linear_*` config keys)."""

    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4

    def __post_init__(self) -> None:
        for name in ("key_heads", "value_heads", "key_head_dim", "value_head_dim", "conv_kernel"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"backbone.linear_attention.{name} must be an int >= 1, got {v!r}")
        if self.value_heads % self.key_heads:
            raise ValueError(
                f"backbone.linear_attention.value_heads {self.value_heads} not divisible by key_heads {self.key_heads}"
            )

    @property
    def ratio(self) -> int:
        """Value heads per key head."""
        return self.value_heads // self.key_heads

    @property
    def conv_channels(self) -> int:
        """Channels of the short convolution: q, k (key heads x dk) and v (value heads x dv)."""
        return 2 * self.key_heads * self.key_head_dim + self.value_heads * self.value_head_dim

    @property
    def in_proj_width(self) -> int:
        """Output width of the in-projection: q, k (key heads x dk), v, z (value heads x dv), b and a
        (one per value head)."""
        return self.conv_channels + self.value_heads * self.value_head_dim + 2 * self.value_heads

    def params(self, hidden: int) -> int:
        """in_proj (q, k, v, z, b, a), the convolution, A_log, dt_bias, the gated norm and out_proj."""
        vd = self.value_heads * self.value_head_dim
        in_proj = hidden * self.in_proj_width
        conv = self.conv_channels * self.conv_kernel
        return in_proj + conv + 2 * self.value_heads + self.value_head_dim + vd * hidden


@dataclass(frozen=True, kw_only=True)
class BackboneConfig:
    """Shape of the actor transformer the critic is built from."""

    family: str = "qwen2"
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    max_seq_len: int
    rotary_base: float = 10000.0
    norm_epsilon: float = 1e-6
    qkv_bias: bool = False
    qk_layernorm: bool = False
    kv_channels: int | None = None  # head dim; None means hidden_size / num_attention_heads (Qwen3 sets its own)
    # Llama 3.x RoPE scaling factor (megatron's form: low/high frequency factors 1 and 4, original
    # context 8192); None: plain RoPE.
    rope_scaling_factor: float | None = None
    # Qwen3.5 (family "qwen3_5") only; the others keep the defaults, which `to_json` leaves out.
    layer_types: tuple[str, ...] | None = None  # LINEAR / FULL per layer
    linear_attention: LinearAttention | None = None
    rotary_percent: float = 1.0  # the share of the head dim RoPE rotates (transformers' partial_rotary_factor)
    attention_output_gate: bool = False  # a sigmoid gate per head on the attention output (q_proj doubled)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"backbone.family must be one of {FAMILIES}, got {self.family!r}")
        if isinstance(self.layer_types, list):
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if isinstance(self.linear_attention, dict):
            object.__setattr__(self, "linear_attention", LinearAttention(**self.linear_attention))
        hybrid = (self.layer_types, self.linear_attention, self.rotary_percent, self.attention_output_gate)
        if self.family == "qwen3_5":
            if self.layer_types is None or self.linear_attention is None:
                raise ValueError("backbone.family 'qwen3_5' needs layer_types and linear_attention")
            if len(self.layer_types) != self.num_layers or set(self.layer_types) - {LINEAR, FULL}:
                raise ValueError(
                    f"backbone.layer_types must name {self.num_layers} layers, each {LINEAR!r} or {FULL!r}, "
                    f"got {list(self.layer_types)!r}"
                )
            r = self.rotary_percent
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1:
                raise ValueError(f"backbone.rotary_percent must be in (0, 1], got {r!r}")
        elif hybrid != (None, None, 1.0, False):
            raise ValueError(
                f"backbone.layer_types, linear_attention, rotary_percent and attention_output_gate are for "
                f"family 'qwen3_5', not {self.family!r}"
            )
        for name in (
            "num_layers",
            "hidden_size",
            "ffn_hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "vocab_size",
            "max_seq_len",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"backbone.{name} must be an int >= 1, got {v!r}")
        if self.kv_channels is not None and (
            not isinstance(self.kv_channels, int) or isinstance(self.kv_channels, bool) or self.kv_channels < 1
        ):
            raise ValueError(f"backbone.kv_channels must be an int >= 1 or None, got {self.kv_channels!r}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"backbone.hidden_size {self.hidden_size} not divisible by "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"backbone.num_attention_heads {self.num_attention_heads} not divisible by "
                f"num_query_groups {self.num_query_groups}"
            )
        f = self.rope_scaling_factor
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or f <= 0):
            raise ValueError(f"backbone.rope_scaling_factor must be a finite number > 0 or None, got {f!r}")
        if not (self.rotary_base > 0 and self.norm_epsilon > 0):
            raise ValueError(
                f"backbone.rotary_base and norm_epsilon must be > 0, got {self.rotary_base!r}, {self.norm_epsilon!r}"
            )

    @property
    def rope_scaling(self) -> bool:
        return self.rope_scaling_factor is not None

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def q_size(self) -> int:
        """Width of the attention queries (heads x head dim)."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the keys (and of the values): query groups x head dim."""
        return self.num_query_groups * self.head_dim

    def layer_type(self, index: int) -> str:
        """LINEAR or FULL: what token mixer layer `index` (from 0) has."""
        return FULL if self.layer_types is None else self.layer_types[index]

    def layer_params(self, index: int | None = None) -> int:
        """Parameters of transformer layer `index` (None: the largest layer): the token mixer (qkv
        with its bias where the family has one, its output gate rows, the attention output; or the
        Gated DeltaNet), the SwiGLU MLP (gate, up, down) and the two norms."""
        if index is None:
            kinds = {self.layer_type(i): i for i in range(self.num_layers)} if self.layer_types else {FULL: 0}
            return max(self.layer_params(i) for i in kinds.values())
        h, f = self.hidden_size, self.ffn_hidden_size
        common = 3 * h * f + 2 * h
        if self.layer_type(index) == LINEAR:
            assert self.linear_attention is not None
            return self.linear_attention.params(h) + common
        qkv_out = self.q_size + 2 * self.kv_size + (self.q_size if self.attention_output_gate else 0)
        qk_norm = 2 * self.head_dim if self.qk_layernorm else 0
        return h * qkv_out + (qkv_out if self.qkv_bias else 0) + self.q_size * h + qk_norm + common

    def layers_params(self) -> int:
        """Parameters of all transformer layers."""
        return sum(self.layer_params(i) for i in range(self.num_layers))

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if self.family != "qwen3_5":  # the Qwen3.5 fields stay out: older records read the same
            for name in ("layer_types", "linear_attention", "rotary_percent", "attention_output_gate"):
                out.pop(name)
        else:
            out["layer_types"] = list(self.layer_types or ())
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> BackboneConfig:
        return cls(**obj)

    @classmethod
    def tiny(cls, **overrides: Any) -> BackboneConfig:
        """2 layers, hidden 64, 4 heads / 2 KV groups; vocab 49152 covers the demo token ids."""
        base: dict[str, Any] = dict(
            family="qwen2",
            num_layers=2,
            hidden_size=64,
            ffn_hidden_size=128,
            num_attention_heads=4,
            num_query_groups=2,
            vocab_size=49152,
            max_seq_len=1024,
            rotary_base=10000.0,
            norm_epsilon=1e-6,
            qkv_bias=True,
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def qwen2_5(cls, size: str) -> BackboneConfig:
        """The Qwen2.5 dense shape of `size` ("0.5b", "1.5b", "3b", "7b", "14b")."""
        try:
            layers, hidden, ffn, heads, groups, vocab = QWEN2_5_SHAPES[size]
        except KeyError:
            raise ValueError(f"no Qwen2.5 shape {size!r}; known: {', '.join(QWEN2_5_SHAPES)}") from None
        return cls(
            family="qwen2",
            num_layers=layers,
            hidden_size=hidden,
            ffn_hidden_size=ffn,
            num_attention_heads=heads,
            num_query_groups=groups,
            vocab_size=vocab,
            max_seq_len=32768,
            rotary_base=1000000.0,
            norm_epsilon=1e-6,
            qkv_bias=True,
        )

    @classmethod
    def qwen2_5_0_5b(cls) -> BackboneConfig:
        return cls.qwen2_5("0.5b")

    @classmethod
    def qwen2_5_1_5b(cls) -> BackboneConfig:
        return cls.qwen2_5("1.5b")


# Qwen3.5 dense text towers (the published config.json files): layers, hidden, ffn, heads, query
# groups, linear-attention key heads, value heads; every size has head_dim 256 (a quarter rotated,
# RoPE theta 1e7), DeltaNet head dims 128, conv kernel 4, a 3:1 DeltaNet/attention pattern and
# vocabulary 248320.
QWEN3_5_SHAPES = {
    "0.8b": (24, 1024, 3584, 8, 2, 16, 16),
    "4b": (32, 2560, 9216, 16, 4, 16, 32),
}


def qwen3_5(size: str) -> BackboneConfig:
    """The Qwen3.5 dense text tower of `size` ("0.8b", "4b"), for benchmarks and planning."""
    try:
        layers, hidden, ffn, heads, groups, key_heads, value_heads = QWEN3_5_SHAPES[size]
    except KeyError:
        raise ValueError(f"no Qwen3.5 shape {size!r}; known: {', '.join(QWEN3_5_SHAPES)}") from None
    return BackboneConfig(
        family="qwen3_5",
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_attention_heads=heads,
        num_query_groups=groups,
        vocab_size=248320,
        max_seq_len=262144,
        rotary_base=1e7,
        norm_epsilon=1e-6,
        qk_layernorm=True,
        kv_channels=256,
        layer_types=tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(layers)),
        linear_attention=LinearAttention(
            key_heads=key_heads, value_heads=value_heads, key_head_dim=128, value_head_dim=128
        ),
        rotary_percent=0.25,
        attention_output_gate=True,
    )


# Qwen2.5 dense models: layers, hidden, ffn, heads, query groups, vocabulary.
QWEN2_5_SHAPES = {
    "0.5b": (24, 896, 4864, 14, 2, 151936),
    "1.5b": (28, 1536, 8960, 12, 2, 151936),
    "3b": (36, 2048, 11008, 16, 2, 151936),
    "7b": (28, 3584, 18944, 28, 4, 152064),
    "14b": (48, 5120, 13824, 40, 8, 152064),
}


@dataclass(frozen=True)
class CriticShape:
    """A critic: the actor's backbone and a value head of `head_size` outputs (the objective's bins,
    1 for mse). What the memory model plans with."""

    backbone: BackboneConfig
    head_size: int

    def num_params(self) -> int:
        b = self.backbone
        h = b.hidden_size
        return b.vocab_size * h + b.layers_params() + h + h * self.head_size + self.head_size
