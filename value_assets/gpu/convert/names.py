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
- `miles_qwen3_5_rows` / `MILES_QWEN3_5_EXTRA_STATE`: a Qwen3.5 critic under the names of Miles' own
  Qwen3.5 model (`--spec miles_plugins.models.qwen3_5 get_qwen3_5_spec`, radixark/miles @ 31f1ca96,
  `miles_plugins/models/qwen3_5.py`): megatron-core's Transformer Engine block spec
  (`get_gpt_decoder_block_spec(config, use_transformer_engine=True)`, hard-coded there) in which
  every linear-attention layer's `self_attention` is Miles' `Attention`: an HF-style module holding
  `input_layernorm` (transformers' `Qwen3NextRMSNorm`, x(1+w)) and `linear_attn`
  (`Qwen3_5GatedDeltaNet`: transformers' parameter names and layouts, `conv1d` fla's
  `ShortConvolution`, `norm` fla's `FusedRMSNormGated` with a plain weight). So those layers save
  `self_attention.input_layernorm.weight` and `self_attention.linear_attn.<HF name>` with the HF
  tensors unchanged (Miles' mbridge `miles_plugins/mbridge/qwen3_5.py` copies them so), while
  full-attention and MLP parts keep TE's names (`TE_RENAMES`; the gated `linear_qkv` in the
  per-group [queries; gates; k; v] layout both sides share). Every zero-centred norm stores w of
  x(1+w), as HF does (Miles' scripts pass `--apply-layernorm-1p`). `get_qwen3_5_spec` sets
  `moe_layer_freq` to a list, so megatron-core numbers the layers (`decoder.layers.{i}.`) instead of
  stacking them.
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

__all__ = [
    "Rule",
    "HF_TABLE",
    "TE_RENAMES",
    "EXTRA_STATE",
    "MILES_QWEN3_5_SPEC",
    "MILES_QWEN3_5_EXTRA_STATE",
    "Dims",
    "rows",
    "miles_qwen3_5_rows",
    "to_te",
    "dims_of",
]

COPY, QKV, GATE_UP = "copy", "qkv", "gate_up"
# Qwen3.5's Gated DeltaNet: q, k, v, z, b, a regrouped per key head (`gated_delta.py`'s layout), and
# the convolution's [q; k; v] channels regrouped the same way.
GDN_IN, GDN_CONV = "gdn_in", "gdn_conv"
# Which layers a row belongs to (core/backbone.py's layer kinds); None: every layer.
LINEAR, FULL = "linear_attention", "full_attention"


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
    # Qwen3.5: the per-layer kinds (None: every layer full attention), the output gate's rows in
    # q_proj, and the Gated DeltaNet shape (key heads, value heads, dk, dv, conv kernel).
    layer_types: tuple[str, ...] | None = None
    gate: bool = False
    la: tuple[int, int, int, int, int] | None = None

    def layer_type(self, i: int) -> str:
        return FULL if self.layer_types is None else self.layer_types[i]


@dataclass(frozen=True)
class Rule:
    local: str  # under `decoder.layers.{i}.` for layer rows, the whole name otherwise
    hf: tuple[str, ...]  # under `{prefix}layers.{i}.` for layer rows, under `{prefix}` otherwise
    shape: Callable[[Dims], tuple[int, ...]]  # the local (whole-model, TP=1) tensor's shape
    kind: str = COPY
    tp_dim: int | None = None
    when: str | None = None
    layer: str | None = None  # LINEAR / FULL: only layers of that kind have the row

    def hf_shapes(self, d: Dims) -> list[tuple[int, ...]]:
        full = self.shape(d)
        if self.kind == QKV:
            q_rows = d.heads * d.hd * (2 if d.gate else 1)
            return [(q_rows, *full[1:]), (d.groups * d.hd, *full[1:]), (d.groups * d.hd, *full[1:])]
        if self.kind == GDN_IN:
            nk, nv, dk, dv, _ = d.la
            return [(2 * nk * dk + nv * dv, d.h), (nv * dv, d.h), (nv, d.h), (nv, d.h)]
        if self.kind == GATE_UP:
            return [(d.ffn, *full[1:]), (d.ffn, *full[1:])]
        return [full]


_QKV_ROWS = lambda d: (d.heads * (2 if d.gate else 1) + 2 * d.groups) * d.hd  # noqa: E731
_GDN_IN_ROWS = lambda d: d.la[0] * (2 * d.la[2]) + d.la[1] * (2 * d.la[3] + 2)  # noqa: E731
_GDN_CONV = lambda d: (2 * d.la[0] * d.la[2] + d.la[1] * d.la[3], 1, d.la[4])  # noqa: E731

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
            layer=FULL,
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
            layer=FULL,
        ),
    ),
    (
        "layer",
        Rule(
            "self_attention.q_layernorm.weight",
            ("self_attn.q_norm.weight",),
            lambda d: (d.hd,),
            when="qk_layernorm",
            layer=FULL,
        ),
    ),
    (
        "layer",
        Rule(
            "self_attention.k_layernorm.weight",
            ("self_attn.k_norm.weight",),
            lambda d: (d.hd,),
            when="qk_layernorm",
            layer=FULL,
        ),
    ),
    (
        "layer",
        Rule(
            "self_attention.linear_proj.weight",
            ("self_attn.o_proj.weight",),
            lambda d: (d.h, d.heads * d.hd),
            tp_dim=1,
            layer=FULL,
        ),
    ),
    (
        "layer",
        Rule(
            "self_attention.in_proj.weight",
            tuple(f"linear_attn.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")),
            lambda d: (_GDN_IN_ROWS(d), d.h),
            kind=GDN_IN,
            tp_dim=0,
            layer=LINEAR,
        ),
    ),
    (
        "layer",
        Rule(
            "self_attention.conv1d.weight",
            ("linear_attn.conv1d.weight",),
            _GDN_CONV,
            kind=GDN_CONV,
            tp_dim=0,
            layer=LINEAR,
        ),
    ),
    ("layer", Rule("self_attention.A_log", ("linear_attn.A_log",), lambda d: (d.la[1],), tp_dim=0, layer=LINEAR)),
    ("layer", Rule("self_attention.dt_bias", ("linear_attn.dt_bias",), lambda d: (d.la[1],), tp_dim=0, layer=LINEAR)),
    ("layer", Rule("self_attention.out_norm", ("linear_attn.norm.weight",), lambda d: (d.la[3],), layer=LINEAR)),
    (
        "layer",
        Rule(
            "self_attention.out_proj.weight",
            ("linear_attn.out_proj.weight",),
            lambda d: (d.h, d.la[1] * d.la[3]),
            tp_dim=1,
            layer=LINEAR,
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
        kind = d.layer_type(i)
        for r in pick("layer"):
            if r.layer is None or r.layer == kind:
                yield f"decoder.layers.{i}.{r.local}", tuple(f"layers.{i}.{n}" for n in r.hf), r, i
    for r in pick("final"):
        yield r.local, r.hf, r, None


# Miles' Qwen3.5 model (module docstring): the layer spec its scripts pass, and the modules per layer
# kind whose `_extra_state` a Transformer Engine model requests (Miles' GDN `Attention` is plain
# torch modules: none there).
MILES_QWEN3_5_SPEC = ("miles_plugins.models.qwen3_5", "get_qwen3_5_spec")
MILES_QWEN3_5_EXTRA_STATE: Mapping[str, tuple[str, ...]] = {
    FULL: EXTRA_STATE["te"],
    LINEAR: ("mlp.linear_fc1", "mlp.linear_fc2"),
}
_MILES_GDN_NORM = {"input_layernorm.weight": "self_attention.input_layernorm.weight"}


def miles_qwen3_5_rows(d: Dims) -> Iterator[tuple[str, str, int | None, Rule]]:
    """(Miles checkpoint name, local name, piece, rule) of a whole Qwen3.5 critic backbone in Miles'
    names (module docstring), layers numbered. `piece` None: the local tensor as it is; an index:
    that HF piece of it (`hf._to_hf`), which Miles' linear-attention module holds under its HF name."""
    for local, _, rule, layer in rows(d):
        if layer is None:
            yield local, local, None, rule
            continue
        at = f"decoder.layers.{layer}."
        if d.layer_type(layer) == LINEAR and rule.hf[0].startswith("linear_attn."):
            for j, hf_name in enumerate(rule.hf):
                yield f"{at}self_attention.{hf_name}", local, j, rule
        elif d.layer_type(layer) == LINEAR and rule.local in _MILES_GDN_NORM:
            yield at + _MILES_GDN_NORM[rule.local], local, None, rule
        else:
            yield at + to_te(rule.local), local, None, rule


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
        layer_types=tuple(field(cfg, "layer_types")) if field(cfg, "layer_types") else None,
        gate=bool(field(cfg, "attention_output_gate")),
        la=_la_tuple(field(cfg, "linear_attention")),
    )


def _la_tuple(la: Any) -> tuple[int, int, int, int, int] | None:
    """(key heads, value heads, dk, dv, conv kernel) of a `LinearAttention` or its JSON dict."""
    if la is None:
        return None
    get = la.get if isinstance(la, Mapping) else lambda k: getattr(la, k)
    return (get("key_heads"), get("value_heads"), get("key_head_dim"), get("value_head_dim"), get("conv_kernel"))
