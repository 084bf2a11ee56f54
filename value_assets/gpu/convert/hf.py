"""Hugging Face <-> Megatron conversion for the critic: actor checkpoints in, critic out.

In: `load_hf_backbone_state` maps an actor's Hugging Face safetensors checkpoint (Llama, Qwen2,
Qwen3) onto the parameter names of Megatron-core's `GPTModel` built from the *local* (non-Transformer-
Engine) layer spec, optionally sliced for one tensor-parallel rank. Every backbone tensor is consumed
and every expected one found, or an `InputError` names the tensor. Out: `export_critic_to_hf` writes a
trained critic as a `transformers` token-classification checkpoint (`<Family>ForTokenClassification`,
value head = `score` with bias) plus `value_head.json`. transformers' generic token-classification
head is `nn.Linear(hidden, num_labels)` with bias on by default, so docs/rules.md#critic's head (bias on, float32)
maps onto it one to one, and `AutoModelForTokenClassification` loads the critic with no custom code.

Why our own converter and not a bridge (checked 2026-12-02 on PyPI):
- megatron-bridge 0.3.1 requires transformer-engine (CUDA build), megatron-core < 0.17 and
  transformers < 5. It cannot install on this CPU machine (transformers 5 here) nor on the H200
  image, whose Python 3.12 gets megatron-core 0.19.x and has no Transformer Engine.
- mbridge 0.15.1 installs (pure Python) but builds its models with
  `get_gpt_decoder_block_spec(use_transformer_engine=True)`, i.e. TE modules and TE parameter names
  (`linear_qkv.layer_norm_weight`), moves weights with `torch.cuda.current_device()`, and owns the
  model construction, while the critic is a local-spec GPTModel with a value head instead of the LM
  output layer. Using it would mean patching around it in both environments.
- The mapping for three dense families is ~150 lines of tensor reshapes that we can test exactly
  against `transformers` on CPU (tests/hf), runs unchanged on megatron-core 0.16 and 0.19, and
  keeps the strictness docs/rules.md#critic demands (no silent partial loads). Other families or MoE: add a
  family in `convert/hf_config.py` and a mapping here, or revisit a bridge when TE is available.

Both directions walk the one name table `names.HF_TABLE` (local name <- HF names, how the pieces
fuse, which dim TP slices): no name is spelled twice.

Megatron layout facts used here (megatron-core 0.16.1 local spec, checked by instantiating it;
the 0.19.2 wheel's local spec and fused-qkv split read the same):
- `self_attention.linear_qkv.weight` is [ng * (np/ng + 2) * hn, h], interleaved per query group g
  as [q heads of g; k_g; v_g]; TP shards split it contiguously along dim 0 (also when tp > ng,
  where Megatron all-gathers and re-slices).
- norms are separate modules: `input_layernorm.weight`, `pre_mlp_layernorm.weight`,
  `self_attention.{q,k}_layernorm.weight` (per head dim), `decoder.final_layernorm.weight`.
- `mlp.linear_fc1.weight` is [gate; up] per TP shard; `linear_proj`/`linear_fc2` are row-parallel
  (dim 1); the embedding is vocab-parallel (dim 0, padded vocab).
- RoPE is non-interleaved (rotate-half), the same convention as the HF families here.

Never unpickles: `.bin`/`.pt` checkpoints are refused; convert them to safetensors first.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from value_assets.core.errors import InputError, show
from value_assets.gpu.convert.hf_config import read_hf_config
from value_assets.gpu.convert.names import GATE_UP, GDN_CONV, GDN_IN, QKV, Dims, Rule, dims_of, rows

__all__ = [
    "read_hf_config",
    "load_hf_backbone_state",
    "export_critic_to_hf",
    "export_critic_to_openrlhf",
    "load_hf_value_head",
    "backbone_config_kwargs",
    "megatron_backbone_names",
    "HF_TOKEN_CLASSIFICATION",
    "VALUE_HEAD_FORMAT",
]

HF_TOKEN_CLASSIFICATION = {
    "llama": "LlamaForTokenClassification",
    "qwen2": "Qwen2ForTokenClassification",
    "qwen3": "Qwen3ForTokenClassification",
    "qwen3_5": "Qwen3_5ForTokenClassification",
}
# transformers' only Qwen3.5 token-classification model is the image-text one, so a Qwen3.5 critic
# is written in that layout: the text tower under `model.language_model.`, and the smallest vision
# tower transformers builds, all zeros, under `model.visual.` (the critic reads text only; a real
# tower would add hundreds of MB that no value depends on).
QWEN3_5_PLACEHOLDER_VISION = {
    "depth": 1,
    "hidden_size": 16,
    "intermediate_size": 16,
    "num_heads": 1,
    "patch_size": 2,
    "temporal_patch_size": 1,
    "spatial_merge_size": 1,
    "num_position_embeddings": 4,
}
VALUE_HEAD_FORMAT = "value_assets.value_head/1"
# Tensors of a Qwen3.5 checkpoint outside its text tower (vision tower, multi-token prediction).
_QWEN3_5_NOT_TEXT = ("model.visual.", "visual.", "mtp.")
# Non-weight entries some older checkpoints carry; they are recomputed from the config.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ----------------------------------------------------------------------------- reading files


class _SafetensorsFolder:
    """Lazy access to the tensors of a local safetensors checkpoint (single file or sharded)."""

    def __init__(self, folder: Path):
        self.folder = folder
        index = folder / "model.safetensors.index.json"
        single = folder / "model.safetensors"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise InputError(str(index), f"needs a non-empty 'weight_map', got {show(weight_map)}")
            self.where = {name: folder / shard for name, shard in weight_map.items()}
            for shard in sorted(set(self.where.values())):
                if not shard.is_file():
                    raise InputError(str(index), f"names shard {shard.name!r}, which does not exist")
        elif single.is_file():
            with safe_open(str(single), framework="pt") as f:
                self.where = {name: single for name in f.keys()}
        else:
            pickles = sorted(p.name for p in folder.glob("*") if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
            if pickles:
                raise InputError(
                    str(folder),
                    f"holds only pickle checkpoints {pickles}; refusing to unpickle. Convert them to "
                    "safetensors first (model.save_pretrained(..., safe_serialization=True)).",
                )
            raise InputError(str(folder), "has neither model.safetensors nor model.safetensors.index.json")
        self._open: dict[Path, Any] = {}

    def names(self) -> set[str]:
        return set(self.where)

    def get(self, name: str) -> torch.Tensor:
        path = self.where[name]
        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="pt")
        return self._open[path].get_tensor(name)


# ----------------------------------------------------------------------------- name mapping


# `read_hf_config` name -> the same field under `gpu.model.BackboneConfig`'s names, and defaults for
# fields that config does not carry.
_ALIASES = {
    "max_position_embeddings": "max_seq_len",
    "rope_theta": "rotary_base",
    "rms_norm_eps": "norm_epsilon",
    "kv_channels": "head_dim",
}
_DEFAULTS = {
    "rope_scaling": False,
    "rope_scaling_factor": 1.0,
    "layer_types": None,
    "linear_attention": None,
    "rotary_percent": 1.0,
    "attention_output_gate": False,
}


def _field(cfg: Any, name: str) -> Any:
    """A backbone field from a `read_hf_config` dict or a `BackboneConfig`-like object."""
    for key in (name, _ALIASES.get(name)):
        if key is None:
            continue
        if isinstance(cfg, Mapping) and key in cfg:
            return cfg[key]
        if not isinstance(cfg, Mapping) and hasattr(cfg, key) and getattr(cfg, key) is not None:
            return getattr(cfg, key)  # BackboneConfig.kv_channels None: the alias head_dim derives it
    if name in _DEFAULTS:
        return _DEFAULTS[name]
    raise InputError(f"backbone_config.{name}", f"missing on {type(cfg).__name__}")


def backbone_config_kwargs(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """`read_hf_config` output as keyword arguments of `gpu.model.BackboneConfig`.

    A head dim other than hidden/heads (Qwen3) becomes `kv_channels`; Llama 3.x RoPE scaling (the
    only scaling `read_hf_config` accepts) becomes `rope_scaling_factor`.
    """
    return {
        "family": cfg["family"],
        "num_layers": cfg["num_layers"],
        "hidden_size": cfg["hidden_size"],
        "ffn_hidden_size": cfg["ffn_hidden_size"],
        "num_attention_heads": cfg["num_attention_heads"],
        "num_query_groups": cfg["num_query_groups"],
        "vocab_size": cfg["vocab_size"],
        "max_seq_len": cfg["max_position_embeddings"],
        "rotary_base": cfg["rope_theta"],
        "norm_epsilon": cfg["rms_norm_eps"],
        "qkv_bias": cfg["qkv_bias"],
        "qk_layernorm": cfg["qk_layernorm"],
        "kv_channels": None
        if cfg["kv_channels"] * cfg["num_attention_heads"] == cfg["hidden_size"]
        else cfg["kv_channels"],
        "rope_scaling_factor": float(cfg["rope_scaling_factor"]) if cfg["rope_scaling"] else None,
        **(
            {
                "layer_types": tuple(cfg["layer_types"]),
                "linear_attention": dict(cfg["linear_attention"]),
                "rotary_percent": float(cfg["rotary_percent"]),
                "attention_output_gate": bool(cfg["attention_output_gate"]),
            }
            if cfg["family"] == "qwen3_5"
            else {}
        ),
    }


def megatron_backbone_names(cfg: Any) -> list[str]:
    """Megatron GPTModel (local spec) parameter names of the backbone, final norm included, in
    Megatron's order: the local-name column of `names.HF_TABLE`.

    `cfg` is a `read_hf_config` dict (or an object with those attributes).
    """
    return [local for local, _, _, _ in rows(dims_of(_field, cfg))]


def _shard(t: torch.Tensor, dim: int, rank: int, size: int, name: str) -> torch.Tensor:
    if size == 1:
        return t
    if t.shape[dim] % size:
        raise InputError(name, f"dim {dim} of shape {tuple(t.shape)} is not divisible by tp_size {size}")
    return t.chunk(size, dim=dim)[rank]


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d: Dims) -> torch.Tensor:
    """[q; k; v] (HF, head-major) -> Megatron's per-group interleave [q_g..., k_g, v_g] along dim 0.
    With an output gate (Qwen3.5: HF's q_proj holds [query_h; gate_h] per head) the group is
    [queries of g; gates of g; k_g; v_g], megatron's `attention_output_gate` split."""
    tail = q.shape[1:]
    if d.gate:
        qg = q.reshape(d.heads, 2, d.hd, *tail).transpose(0, 1)  # [2, heads, hd]: queries, gates
        q = torch.cat([qg[0].reshape(d.groups, -1, *tail), qg[1].reshape(d.groups, -1, *tail)], dim=1)
    qg = q.reshape(d.groups, -1, *tail)
    kg = k.reshape(d.groups, -1, *tail)
    vg = v.reshape(d.groups, -1, *tail)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *tail)


def _split_qkv(qkv: torch.Tensor, d: Dims) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `_fuse_qkv`."""
    per = d.heads // d.groups
    q_rows = per * d.hd * (2 if d.gate else 1)
    tail = qkv.shape[1:]
    g = qkv.reshape(d.groups, q_rows + 2 * d.hd, *tail)
    q, k, v = torch.split(g, [q_rows, d.hd, d.hd], dim=1)
    if d.gate:  # [groups, (queries, gates) of per heads] -> per head [query_h; gate_h]
        q = q.reshape(d.groups, 2, per, d.hd, *tail).permute(0, 2, 1, 3, *range(4, 4 + len(tail)))
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def _gdn_groups(d: Dims) -> tuple[int, list[int]]:
    """Key-head groups and the per-group row widths of [q, k, v, z, b, a] (`gated_delta.py`)."""
    nk, nv, dk, dv, _ = d.la
    r = nv // nk
    return nk, [dk, dk, r * dv, r * dv, r, r]


def _fuse_gdn_in(qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, d: Dims) -> torch.Tensor:
    """HF's in_proj_qkv ([q all; k all; v all]), in_proj_z, in_proj_b, in_proj_a -> per key-head group
    [q_j; k_j; v_j; z_j; b_j; a_j] (the value heads of group j are j*r .. j*r + r - 1)."""
    nk, widths = _gdn_groups(d)
    dk, vd = widths[0], d.la[1] * d.la[3]
    q, k, v = qkv.split([nk * dk, nk * dk, vd], dim=0)
    pieces = [x.reshape(nk, -1, x.shape[-1]) for x in (q, k, v, z, b, a)]
    return torch.cat(pieces, dim=1).reshape(-1, qkv.shape[-1])


def _split_gdn_in(t: torch.Tensor, d: Dims) -> tuple[torch.Tensor, ...]:
    nk, widths = _gdn_groups(d)
    q, k, v, z, b, a = t.reshape(nk, sum(widths), t.shape[-1]).split(widths, dim=1)
    flat = [x.reshape(-1, t.shape[-1]) for x in (q, k, v, z, b, a)]
    return torch.cat(flat[:3], dim=0), flat[3], flat[4], flat[5]


def _fuse_gdn_conv(w: torch.Tensor, d: Dims) -> torch.Tensor:
    """HF's conv1d.weight channels [q all; k all; v all] -> per key-head group [q_j; k_j; v_j]."""
    nk, widths = _gdn_groups(d)
    q, k, v = w.split([nk * widths[0], nk * widths[1], d.la[1] * d.la[3]], dim=0)
    return torch.cat([x.reshape(nk, -1, *w.shape[1:]) for x in (q, k, v)], dim=1).reshape(w.shape)


def _split_gdn_conv(w: torch.Tensor, d: Dims) -> torch.Tensor:
    nk, widths = _gdn_groups(d)
    q, k, v = w.reshape(nk, -1, *w.shape[1:]).split(widths[:3], dim=1)
    return torch.cat([x.reshape(-1, *w.shape[1:]) for x in (q, k, v)], dim=0)


def _check_shape(name: str, t: torch.Tensor, want: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(want):
        raise InputError(name, f"has shape {tuple(t.shape)}, expected {tuple(want)} from config.json")


def _to_local(rule: Rule, pieces: list[torch.Tensor], d: Dims) -> torch.Tensor:
    """HF piece(s) of one table row -> the local-spec tensor (whole model, TP=1)."""
    if rule.kind == QKV:
        return _fuse_qkv(*pieces, d)
    if rule.kind == GDN_IN:
        return _fuse_gdn_in(*pieces, d)
    if rule.kind == GDN_CONV:
        return _fuse_gdn_conv(pieces[0], d)
    if rule.kind == GATE_UP:
        return torch.cat(pieces, dim=0)
    return pieces[0]


def _to_hf(rule: Rule, t: torch.Tensor, d: Dims) -> tuple[torch.Tensor, ...]:
    """The local-spec tensor of one table row -> its HF piece(s); the inverse of `_to_local`."""
    if rule.kind == QKV:
        return _split_qkv(t, d)
    if rule.kind == GDN_IN:
        return _split_gdn_in(t, d)
    if rule.kind == GDN_CONV:
        return (_split_gdn_conv(t, d),)
    if rule.kind == GATE_UP:
        return tuple(t.chunk(2, dim=0))
    return (t,)


def shard_for_tp(rule: Rule, t: torch.Tensor, tp_rank: int, tp_size: int, name: str) -> torch.Tensor:
    """This TP rank's slice of the whole-model tensor of one table row (gate and up sliced apart)."""
    if rule.tp_dim is None:
        return t
    if rule.kind == GATE_UP:
        gate, up = t.chunk(2, dim=0)
        return torch.cat([_shard(gate, 0, tp_rank, tp_size, name), _shard(up, 0, tp_rank, tp_size, name)], dim=0)
    return _shard(t, rule.tp_dim, tp_rank, tp_size, name)


# ----------------------------------------------------------------------------- HF -> Megatron


def load_hf_backbone_state(
    folder: str | Path,
    tp_rank: int = 0,
    tp_size: int = 1,
    *,
    padded_vocab_size: int | None = None,
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Backbone tensors of the HF checkpoint in `folder`, named and sliced for Megatron TP rank `tp_rank`.

    Returns {megatron name: tensor} with exactly `megatron_backbone_names(read_hf_config(folder))`:
    the embedding (rows padded with zeros to `padded_vocab_size` when given, then vocab-sharded),
    every layer and `decoder.final_layernorm.weight`. No LM head: the critic replaces it (a
    `lm_head.weight` in the checkpoint is read past; tied checkpoints have none). Tensors keep the
    checkpoint dtype unless `dtype` is given. Raises `InputError` naming the tensor for anything
    missing, unexpected or of the wrong shape.
    """
    folder = Path(folder)
    cfg = read_hf_config(folder)
    if not (isinstance(tp_size, int) and tp_size >= 1 and isinstance(tp_rank, int) and 0 <= tp_rank < tp_size):
        raise InputError("tp_rank/tp_size", f"need 0 <= tp_rank < tp_size, got {tp_rank}/{tp_size}")
    files = _SafetensorsFolder(folder)
    available = files.names()
    # Qwen3.5's image-text checkpoints keep the text tower under `model.language_model.`.
    prefixes = ("model.language_model.", "model.", "") if cfg["family"] == "qwen3_5" else ("model.", "")
    prefix = next((p for p in prefixes if f"{p}embed_tokens.weight" in available), None)
    if prefix is None:
        raise InputError(str(folder), f"has no {' nor '.join(repr(p + 'embed_tokens.weight') for p in prefixes)}")

    d = dims_of(_field, cfg)
    h, vocab = d.h, d.vocab
    consumed: set[str] = set()

    def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in available:
            raise InputError(f"{folder}: {name}", "missing from the checkpoint")
        t = files.get(name)
        _check_shape(f"{folder}: {name}", t, shape)
        consumed.add(name)
        return t if dtype is None else t.to(dtype)

    out: dict[str, torch.Tensor] = {}
    for local, hf_names, rule, _ in rows(d):
        t = _to_local(rule, [take(prefix + n, s) for n, s in zip(hf_names, rule.hf_shapes(d), strict=True)], d)
        if local == "embedding.word_embeddings.weight" and padded_vocab_size is not None:
            if padded_vocab_size < vocab:
                raise InputError("padded_vocab_size", f"{padded_vocab_size} is smaller than vocab_size {vocab}")
            t = torch.cat([t, t.new_zeros(padded_vocab_size - vocab, h)])
        out[local] = shard_for_tp(rule, t, tp_rank, tp_size, local)

    # Heads are not backbone: the LM head (actor) or the value head `score.*` (an exported critic)
    # is read past on purpose; the critic adds its own head. Everything else must be consumed.
    if "lm_head.weight" in available:
        _check_shape(f"{folder}: lm_head.weight", files.get("lm_head.weight"), (vocab, h))
        consumed.add("lm_head.weight")
    consumed.update(n for n in ("score.weight", "score.bias") if n in available)
    if cfg["family"] == "qwen3_5":
        # A Qwen3.5 actor's vision tower and its multi-token-prediction layers are not the text
        # tower a critic starts from: read past, by name.
        consumed.update(n for n in available if n.startswith(_QWEN3_5_NOT_TEXT))
    leftover = sorted(n for n in available - consumed if not n.endswith(_IGNORED_SUFFIXES))
    if leftover:
        raise InputError(
            str(folder),
            f"unexpected tensor(s) for a {cfg['family']} backbone: {leftover[:8]}"
            + (" ..." if len(leftover) > 8 else ""),
        )
    want = megatron_backbone_names(cfg)
    assert list(out) == want, (list(out), want)  # internal consistency, not input validation
    return {k: v.contiguous() for k, v in out.items()}


def load_hf_value_head(folder: str | Path, head_prefix: str = "output_layer") -> dict[str, torch.Tensor]:
    """The value head of a critic exported by `export_critic_to_hf` (`score.weight` [K, hidden],
    `score.bias` [K]), renamed to `{head_prefix}.weight`/`.bias` for a resume from that folder."""
    folder = Path(folder)
    cfg = read_hf_config(folder)
    files = _SafetensorsFolder(folder)
    missing = [n for n in ("score.weight", "score.bias") if n not in files.names()]
    if missing:
        raise InputError(str(folder), f"has no value head: missing {missing} (not an exported critic?)")
    w, b = files.get("score.weight"), files.get("score.bias")
    if w.dim() != 2 or w.shape[1] != cfg["hidden_size"] or tuple(b.shape) != (w.shape[0],):
        raise InputError(
            f"{folder}: score.weight",
            f"shapes {tuple(w.shape)} / {tuple(b.shape)} do not form a [K, {cfg['hidden_size']}] head with a [K] bias",
        )
    return {f"{head_prefix}.weight": w, f"{head_prefix}.bias": b}


# ----------------------------------------------------------------------------- Megatron -> HF


def _hf_config_dict(cfg: Any, num_labels: int, dtype: torch.dtype) -> dict[str, Any]:
    family = _field(cfg, "family")
    if family not in HF_TOKEN_CLASSIFICATION:
        raise InputError(
            "backbone_config.family", f"{show(family)} is not supported; supported: {list(HF_TOKEN_CLASSIFICATION)}"
        )
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(_field(cfg, "rope_theta"))}
    if _field(cfg, "rope_scaling"):
        rope = {
            "rope_type": "llama3",
            "rope_theta": float(_field(cfg, "rope_theta")),
            "factor": float(_field(cfg, "rope_scaling_factor")),
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    out = {
        "model_type": family,
        "architectures": [HF_TOKEN_CLASSIFICATION[family]],
        "num_hidden_layers": _field(cfg, "num_layers"),
        "hidden_size": _field(cfg, "hidden_size"),
        "intermediate_size": _field(cfg, "ffn_hidden_size"),
        "num_attention_heads": _field(cfg, "num_attention_heads"),
        "num_key_value_heads": _field(cfg, "num_query_groups"),
        "head_dim": _field(cfg, "kv_channels"),
        "vocab_size": _field(cfg, "vocab_size"),
        "max_position_embeddings": _field(cfg, "max_position_embeddings"),
        "rms_norm_eps": float(_field(cfg, "rms_norm_eps")),
        "hidden_act": "silu",
        # Both layouts: transformers 5 reads rope_parameters, 4.x reads rope_theta/rope_scaling.
        "rope_parameters": rope,
        "rope_theta": rope["rope_theta"],
        "rope_scaling": None
        if rope["rope_type"] == "default"
        else {k: v for k, v in rope.items() if k != "rope_theta"},
        "tie_word_embeddings": False,  # the critic's embeddings are untied (docs/rules.md#critic)
        "num_labels": num_labels,
        "id2label": {str(i): f"LABEL_{i}" for i in range(num_labels)},
        "label2id": {f"LABEL_{i}": i for i in range(num_labels)},
        "classifier_dropout": 0.0,
        "attention_dropout": 0.0,
        "dtype": str(dtype).removeprefix("torch."),
        "use_cache": False,
    }
    if family == "qwen3_5":
        la = dims_of(_field, cfg).la
        assert la is not None
        text = {k: v for k, v in out.items() if k not in _TOP_LEVEL}
        rope["partial_rotary_factor"] = float(_field(cfg, "rotary_percent"))
        text.update(
            model_type="qwen3_5_text",
            layer_types=list(_field(cfg, "layer_types")),
            linear_num_key_heads=la[0],
            linear_num_value_heads=la[1],
            linear_key_head_dim=la[2],
            linear_value_head_dim=la[3],
            linear_conv_kernel_dim=la[4],
            attention_bias=False,
            rope_parameters=rope,
            partial_rotary_factor=rope["partial_rotary_factor"],
        )
        text.pop("rope_theta")
        text.pop("rope_scaling")
        vision = {**QWEN3_5_PLACEHOLDER_VISION, "out_hidden_size": out["hidden_size"]}
        top = {k: out[k] for k in _TOP_LEVEL}
        return {**top, "text_config": text, "vision_config": vision}
    if family == "llama":
        out.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif family == "qwen3":
        out.update(attention_bias=False, use_sliding_window=False)
    else:
        out.update(use_sliding_window=False)
    return out


# Keys of a Qwen3.5 export's config.json that stay at its top level (the rest is `text_config`).
_TOP_LEVEL = (
    "model_type",
    "architectures",
    "num_labels",
    "id2label",
    "label2id",
    "classifier_dropout",
    "dtype",
    "use_cache",
    "tie_word_embeddings",
)


def _placeholder_vision(hidden: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Zero tensors for transformers' smallest Qwen3.5 vision tower (names and shapes taken from
    transformers itself, so they are the ones its loader expects)."""
    from transformers import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    with torch.device("meta"):
        tower = Qwen3_5VisionModel(Qwen3_5VisionConfig(**QWEN3_5_PLACEHOLDER_VISION, out_hidden_size=hidden))
    return {f"model.visual.{n}": torch.zeros(t.shape, dtype=dtype) for n, t in tower.state_dict().items()}


def export_critic_to_hf(
    megatron_state: Mapping[str, torch.Tensor],
    backbone_config: Any,
    objective_head_size: int,
    out_folder: str | Path,
    *,
    head_prefix: str = "output_layer",
    objective: Any = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a full (TP=1, unsharded) Megatron critic state as an HF token-classification checkpoint.

    `megatron_state`: the critic's state dict (backbone names of `megatron_backbone_names` plus
    `{head_prefix}.weight` [K, hidden] and `{head_prefix}.bias` [K] -- the default prefix is where
    `gpu.model.build_critic` puts its `ValueHead`; `_extra_state` entries are
    skipped; embedding rows beyond `vocab_size` (TP padding) are dropped). `backbone_config`: a
    `read_hf_config` dict or a `BackboneConfig` (its names `max_seq_len`, `rotary_base`,
    `norm_epsilon`, `head_dim` are accepted as aliases). `objective`: optional
    `core.objective.Objective`, recorded in `value_head.json`.

    Writes `model.safetensors` (all tensors in `dtype`), `config.json` for
    `<Family>ForTokenClassification` with `num_labels=K`, the head as `score.weight`/`score.bias`
    (transformers' `GenericForTokenClassification` head: `nn.Linear(hidden, num_labels)`, bias on
    by default), and `value_head.json`. The HF model's logits [b, s, K] equal the critic head's.
    Returns the folder.
    """
    out_folder = Path(out_folder)
    k = objective_head_size
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise InputError("objective_head_size", f"must be a positive integer, got {show(k)}")
    if objective is not None and getattr(objective, "head_size", k) != k:
        raise InputError("objective_head_size", f"{k} disagrees with objective.head_size {objective.head_size}")
    h, vocab = _field(backbone_config, "hidden_size"), _field(backbone_config, "vocab_size")
    state = {n: t for n, t in megatron_state.items() if not n.endswith("_extra_state")}
    head_names = [f"{head_prefix}.weight", f"{head_prefix}.bias"]
    want = megatron_backbone_names(backbone_config)
    missing = [n for n in want + head_names if n not in state]
    unexpected = sorted(set(state) - set(want) - set(head_names))
    if missing or unexpected:
        raise InputError("megatron_state", f"missing {missing[:8]}, unexpected {unexpected[:8]}")
    _check_shape(head_names[0], state[head_names[0]], (k, h))
    _check_shape(head_names[1], state[head_names[1]], (k,))

    def get(name: str) -> torch.Tensor:
        return state[name].detach().to("cpu", dtype)

    emb = get("embedding.word_embeddings.weight")
    if emb.shape[0] < vocab or emb.shape[1] != h:
        raise InputError(
            "embedding.word_embeddings.weight", f"shape {tuple(emb.shape)} does not cover vocab {vocab} x hidden {h}"
        )
    state["embedding.word_embeddings.weight"] = emb[:vocab]  # TP padding rows dropped
    d = dims_of(_field, backbone_config)
    hf: dict[str, torch.Tensor] = {}
    qwen3_5 = _field(backbone_config, "family") == "qwen3_5"
    text_prefix = "model.language_model." if qwen3_5 else "model."
    if qwen3_5:
        hf.update(_placeholder_vision(h, dtype))
    for local, hf_names, rule, _ in rows(d):
        t = get(local)
        _check_shape(local, t, rule.shape(d))
        hf.update(zip((text_prefix + n for n in hf_names), _to_hf(rule, t, d), strict=True))
    hf["score.weight"] = get(head_names[0])
    hf["score.bias"] = get(head_names[1])

    out_folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {n: t.contiguous() for n, t in hf.items()}, str(out_folder / "model.safetensors"), metadata={"format": "pt"}
    )
    (out_folder / "config.json").write_text(json.dumps(_hf_config_dict(backbone_config, k, dtype), indent=2) + "\n")
    head_info: dict[str, Any] = {
        "format": VALUE_HEAD_FORMAT,
        "hf_module": "score",
        "num_outputs": k,
        "logits_dtype": "float32",
        "objective": objective.canonical() if objective is not None else None,
    }
    if objective is not None:
        low, high = objective.reward_range
        head_info["prediction"] = (
            f"V = softmax(logits) . linspace({low}, {high}, {k})"
            if objective.loss_type == "classification"
            else "V = logits[..., 0]"
        )
        head_info["support"] = [low, high, k] if objective.loss_type == "classification" else None
    head_info["read_position"] = "value of response token j at absolute position prompt_len + j - 1"
    (out_folder / "value_head.json").write_text(json.dumps(head_info, indent=2, sort_keys=True) + "\n")
    return out_folder


def check_openrlhf_head(megatron_state: Mapping[str, torch.Tensor], head_prefix: str = "output_layer") -> None:
    """Refuse a value head with a non-zero bias for OpenRLHF, whose critic head has none."""
    bias = megatron_state.get(f"{head_prefix}.bias")
    if bias is not None and bool((bias.detach().float() != 0).any()):
        raise InputError(
            "--format openrlhf",
            f"the critic's value head has bias {bias.detach().float().tolist()}, and OpenRLHF's critic head has none: "
            "under OpenRLHF's default flags every value would be short by exactly that bias. Train the critic with "
            "`value-assets train --head-bias zero` (the bias stays 0) for an OpenRLHF export, or export --format "
            "scalar (verl)",
        )


def export_critic_to_openrlhf(
    megatron_state: Mapping[str, torch.Tensor],
    backbone_config: Any,
    out_folder: str | Path,
    *,
    head_prefix: str = "output_layer",
    objective: Any = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """An mse critic in OpenRLHF's critic layout (openrlhf/models/model.py `_get_critic_model`):
    the base model under `model.*` and the head `score.weight` [1, hidden] with no bias, as
    OpenRLHF builds it (`nn.Linear(hidden, 1, bias=False)` under `value_head_prefix`, which it
    reads from config.json before its own flag, so `value_head_prefix: "score"` is written there).

    Exact only for a critic whose head bias is 0 (`--head-bias zero`): OpenRLHF 0.11's head has no
    bias, and config.json's `normalize_reward`/`mean`/`std` cannot carry one: the caller's argument
    (`--reward.normalize_enable`, off by default) overwrites `normalize_reward`, and with it on the
    `mean`/`std` buffers hold uninitialised memory after `from_pretrained` under transformers 5
    (OpenRLHF PR #1343). A critic with any other bias is refused, before anything is written."""
    if objective is not None and objective.head_size != 1:
        raise InputError("objective", "OpenRLHF critics are scalar: export an mse critic")
    check_openrlhf_head(megatron_state, head_prefix)
    out_folder = export_critic_to_hf(
        megatron_state, backbone_config, 1, out_folder, head_prefix=head_prefix, objective=objective, dtype=dtype
    )
    files = _SafetensorsFolder(out_folder)
    tensors = {n: files.get(n).clone() for n in files.names()}  # clones: the file is rewritten below
    tensors.pop("score.bias")
    save_file(tensors, str(out_folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out_folder / "config.json").read_text())
    cfg.update(value_head_prefix="score")
    (out_folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    info = json.loads((out_folder / "value_head.json").read_text())
    info.update(layout="openrlhf", prediction="V = hidden . score.weight (no bias)")
    (out_folder / "value_head.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    return out_folder
