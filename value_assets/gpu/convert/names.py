"""The name tables of the checkpoint formats the critic reads and writes, one table per format.

Each table is data, read in both directions (after torchtitan's `state_dict_adapter.py`
`from_hf_map`): `hf.py` walks `HF_TABLE` to load an actor (HF -> Megatron local spec) and to export
a critic (local spec -> HF); `megatron_lm.py` walks `TE_RENAMES` / `EXTRA_STATE` to read and to
write Megatron-LM checkpoints of either layer spec. Nothing else spells a parameter name.

Names of the *local* spec (megatron-core `get_gpt_layer_local_spec`, what `gpu.model.build_critic`
builds) are the hub: every other format maps onto them.

- `HF_TABLE`: local name <- HF name(s). `kind` says how the HF pieces become the local tensor:
  `copy` (one tensor), `qkv` (q, k, v fused per query group: Megatron's [q heads of g; k_g; v_g]
  interleave) or `gate_up` ([gate; up] along dim 0). `tp_dim` is the dim a tensor-parallel rank's
  slice is cut along (None: replicated); `gate_up` slices gate and up separately, as Megatron's
  SwiGLU sharding does. `when` names the backbone flag (`qkv_bias`, `qk_layernorm`) a row needs.
- `TE_RENAMES`: local module name -> its *checkpoint* name. Transformer Engine fuses the input
  norms into the following linear (`input_layernorm.weight` is `linear_qkv.layer_norm_weight`,
  `pre_mlp_layernorm.weight` is `linear_fc1.layer_norm_weight`; RMSNorm: no `layer_norm_bias`),
  and megatron-core's *local* spec saves its separate norms under those same names
  (`get_gpt_layer_local_spec`'s `sharded_state_dict_keys_map`, megatron-core 0.16.1 line ~417), so
  that both specs' torch_dist checkpoints load into either. Every other name is the module name.
  Checkpoints with unfused norm names (other writers) are read too.
- `EXTRA_STATE`: per spec, the modules of one dense layer whose `_extra_state` entry a Megatron
  model requests when it loads (megatron-core 0.16.1, checked by instantiating the local spec: its
  four parallel linears request one, holding None; TE's linears hold FP8 metadata, a placeholder
  without FP8; older megatron-core also requests one for TE's `core_attention`, 0.16.1 does not).
  They hold no weights: ignored on read; written because a requested key that is missing fails
  the load, while an unrequested one is skipped under Megatron-LM's default
  `--dist-ckpt-strictness assume_ok_unexpected`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Rule", "HF_TABLE", "TE_RENAMES", "EXTRA_STATE", "Dims", "rows", "to_te", "dims_of"]

COPY, QKV, GATE_UP = "copy", "qkv", "gate_up"


@dataclass(frozen=True)
class Dims:
    """The shape numbers the tables need."""

    h: int
    ffn: int
    hd: int
    heads: int
    groups: int
    vocab: int
    layers: int
    qkv_bias: bool
    qk_layernorm: bool


@dataclass(frozen=True)
class Rule:
    local: str  # under `decoder.layers.{i}.` for layer rows, the whole name otherwise
    hf: tuple[str, ...]  # under `{prefix}layers.{i}.` for layer rows, under `{prefix}` otherwise
    shape: Callable[[Dims], tuple[int, ...]]  # the local (whole-model, TP=1) tensor's shape
    kind: str = COPY
    tp_dim: int | None = None
    when: str | None = None

    def hf_shapes(self, d: Dims) -> list[tuple[int, ...]]:
        full = self.shape(d)
        if self.kind == QKV:
            return [(d.heads * d.hd, *full[1:]), (d.groups * d.hd, *full[1:]), (d.groups * d.hd, *full[1:])]
        if self.kind == GATE_UP:
            return [(d.ffn, *full[1:]), (d.ffn, *full[1:])]
        return [full]


_QKV_ROWS = lambda d: (d.heads + 2 * d.groups) * d.hd  # noqa: E731

# (position, rule): "embed" before the layers, "layer" once per layer, "final" after them.
HF_TABLE: tuple[tuple[str, Rule], ...] = (
    ("embed", Rule("embedding.word_embeddings.weight", ("embed_tokens.weight",), lambda d: (d.vocab, d.h), tp_dim=0)),
    ("layer", Rule("input_layernorm.weight", ("input_layernorm.weight",), lambda d: (d.h,))),
    (
        "layer",
        Rule(
            "self_attention.linear_qkv.weight",
            ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
            lambda d: (_QKV_ROWS(d), d.h),
            kind=QKV,
            tp_dim=0,
        ),
    ),
    (
        "layer",
        Rule(
            "self_attention.linear_qkv.bias",
            ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
            lambda d: (_QKV_ROWS(d),),
            kind=QKV,
            tp_dim=0,
            when="qkv_bias",
        ),
    ),
    (
        "layer",
        Rule("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), lambda d: (d.hd,), when="qk_layernorm"),
    ),
    (
        "layer",
        Rule("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), lambda d: (d.hd,), when="qk_layernorm"),
    ),
    (
        "layer",
        Rule(
            "self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), lambda d: (d.h, d.heads * d.hd), tp_dim=1
        ),
    ),
    ("layer", Rule("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), lambda d: (d.h,))),
    (
        "layer",
        Rule(
            "mlp.linear_fc1.weight",
            ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
            lambda d: (2 * d.ffn, d.h),
            kind=GATE_UP,
            tp_dim=0,
        ),
    ),
    ("layer", Rule("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), lambda d: (d.h, d.ffn), tp_dim=1)),
    ("final", Rule("decoder.final_layernorm.weight", ("norm.weight",), lambda d: (d.h,))),
)

TE_RENAMES: Mapping[str, str] = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
EXTRA_STATE: Mapping[str, tuple[str, ...]] = {
    "local": _LINEARS,
    "te": _LINEARS + ("self_attention.core_attention",),
}


def rows(d: Dims) -> Iterator[tuple[str, tuple[str, ...], Rule, int | None]]:
    """(local name, HF names without the `model.` prefix, rule, layer index or None), whole model,
    in Megatron's order, rows whose `when` flag is off left out."""

    def pick(where: str) -> list[Rule]:
        return [r for w, r in HF_TABLE if w == where and (r.when is None or getattr(d, r.when))]

    for r in pick("embed"):
        yield r.local, r.hf, r, None
    for i in range(d.layers):
        for r in pick("layer"):
            yield f"decoder.layers.{i}.{r.local}", tuple(f"layers.{i}.{n}" for n in r.hf), r, i
    for r in pick("final"):
        yield r.local, r.hf, r, None


def to_te(layer_name: str) -> str:
    """A local-spec layer name (the part after `decoder.layers.{i}.`) as checkpoints spell it;
    readers map back through the same table (`megatron_lm.checkpoint_names`)."""
    return TE_RENAMES.get(layer_name, layer_name)


def dims_of(field: Callable[[Any, str], Any], cfg: Any) -> Dims:
    """`Dims` from a config read through `field(cfg, name)` (hf.py's `_field`)."""
    return Dims(
        h=field(cfg, "hidden_size"),
        ffn=field(cfg, "ffn_hidden_size"),
        hd=field(cfg, "kv_channels"),
        heads=field(cfg, "num_attention_heads"),
        groups=field(cfg, "num_query_groups"),
        vocab=field(cfg, "vocab_size"),
        layers=field(cfg, "num_layers"),
        qkv_bias=bool(field(cfg, "qkv_bias")),
        qk_layernorm=bool(field(cfg, "qk_layernorm")),
    )
