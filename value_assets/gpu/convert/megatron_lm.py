"""Megatron-LM / Miles checkpoints (torch_dist), either layer spec: read an actor, write a critic.

Layout (Megatron-LM `save_checkpoint`, `--ckpt-format torch_dist`): `DIR/latest_checkpointed_iteration.txt`
holds N (or `release`); `DIR/iter_{N:07d}/` holds `.metadata` + `__*.distcp` (torch.distributed
.checkpoint: the sharded tensors, each under its *global* name), `common.pt` (the non-sharded
entries: `args`, an `argparse.Namespace`; `iteration`; `checkpoint_version`) and `metadata.json`.

Tensor names: megatron-core's `TransformerBlock.sharded_state_dict` stacks homogeneous layers, so a
layer parameter is one tensor `decoder.layers.<name>` of shape [num_layers, ...] (older or
heterogeneous checkpoints number them, `decoder.layers.<i>.<name>`; both are read). Global tensors
are the TP=1 tensors whatever TP they were saved with: TP slices are contiguous (the fused QKV
included) and SwiGLU's fc1 is stored as [all gate; all up] (`apply_swiglu_sharded_factory`). The
norms carry TE's fused names (`names.TE_RENAMES`) in *both* megatron-core specs: the local spec
maps its separate norms onto them when it saves. The specs differ in the `_extra_state` objects
(no weights) their modules save (`names.EXTRA_STATE`). Unfused norm names are read too.

Reading (`bootstrap`): the tensors are read with torch.distributed.checkpoint without a process
group, its index through `safe_pickle` (docs/rules.md#bad-input-and-safety); only backbone tensors are
taken, strictly: a missing or unexpected name is an error that lists them; the LM head (`output_layer.weight`) and a
critic head are read past (the critic adds its own), `_extra_state` objects and optimizer / RNG
state are ignored. The architecture comes from the saved `args` where present, else from a
Hugging Face `config.json` (`--hf-config`).

Writing (`export-miles`): megatron-core's `dist_checkpointing.save` (so the index, the object
encoding and `metadata.json` are megatron's own) of the critic at TP=1 under the checkpoint names (fused norm
names), untied embeddings (padded to a multiple of 128 rows as Megatron-LM pads at TP=1), the head
as `output_layer.weight` [K, hidden] / `output_layer.bias` [K], and one `_extra_state`
placeholder per module and layer that the spec's model requests (`names.EXTRA_STATE`; None for the
local spec as megatron's own linears save it, for TE the byte tensor of `pickle.dumps(None)`, which
Transformer Engine 1.x and 2.x both read as "no FP8 state").
`common.pt` carries `args` with the architecture, TP = PP = 1 and `no_save_optim`/`no_save_rng`
(there is no optimizer or RNG state: the RL run starts its own), `iteration` = N and
`checkpoint_version` 3.0. The files are written in this process (`runtime.checkpoint.in_process_save_strategy`: no
forked writer process, which a kill would leave the export waiting on).
"""

from __future__ import annotations

import argparse
import pickle
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from value_assets.core.errors import InputError, show
from value_assets.gpu.convert import names
from value_assets.gpu.runtime.checkpoint import in_process_save_strategy
from value_assets.gpu.runtime.safe_pickle import Opaque, load_common, load_dcp_metadata, loads_common

TRACKER = "latest_checkpointed_iteration.txt"
SPECS = ("te", "local")
HEAD = ("output_layer.weight", "output_layer.bias")
_LAYER = "decoder.layers."
_IGNORED_PREFIXES = ("optimizer.", "rng_state", "rerun_state_machine_state")
VOCAB_DIVISOR = 128  # Megatron-LM's --make-vocab-size-divisible-by default


def is_megatron_lm_folder(folder: Path) -> bool:
    return (folder / TRACKER).is_file()


def read_tracker(folder: Path) -> tuple[int, Path]:
    """(iteration, iter folder) that `latest_checkpointed_iteration.txt` names (`release`: 0)."""
    text = (folder / TRACKER).read_text().strip()
    if text == "release":
        step_dir = folder / "release"
        it = 0
    elif re.fullmatch(r"\d+", text):
        it = int(text)
        step_dir = folder / f"iter_{it:07d}"
    else:
        raise InputError(str(folder / TRACKER), f"holds {text!r}, neither an iteration number nor 'release'")
    if not step_dir.is_dir():
        raise InputError(str(step_dir), f"missing: {TRACKER} names it")
    return it, step_dir


# ----------------------------------------------------------------------------- architecture

# Megatron-LM argument -> our BackboneConfig field. An argument Megatron-LM renamed is listed under
# every name it has had, newest first. From core_v0.16 the transformer arguments are derived from
# megatron-core's TransformerConfig fields, so a checkpoint saved by Megatron-LM 0.16 or 0.17 (and
# Miles on it) holds `layernorm_epsilon` (0.12-0.15: `norm_epsilon`; the flag is --norm-epsilon in
# both) and `layernorm_zero_centered_gamma` (0.12-0.15: `apply_layernorm_1p`; flag
# --apply-layernorm-1p). Found by parsing Megatron-LM's own defaults at core_v0.15.3, core_v0.16.1
# and core_v0.17.0 and comparing the saved names (tests/rl/test_megatron_lm.py parses 0.17.0's); no
# other argument read here was renamed.
_ARG_FIELDS: dict[str, tuple[str, ...]] = {
    "num_layers": ("num_layers",),
    "hidden_size": ("hidden_size",),
    "ffn_hidden_size": ("ffn_hidden_size",),
    "num_attention_heads": ("num_attention_heads",),
    "max_seq_len": ("max_position_embeddings",),
    "rotary_base": ("rotary_base",),
    "norm_epsilon": ("layernorm_epsilon", "norm_epsilon"),
}
ZERO_CENTERED_GAMMA = ("layernorm_zero_centered_gamma", "apply_layernorm_1p")
# Saved arguments that change what the actor computes but leave no trace in its tensors, with the
# only value the critic computes with (None: unset): the critic (rotate-half RoPE over the whole
# head, full causal attention with 1/sqrt(d) scaling and a plain softmax, plain RMSNorm weights,
# pre-norm residuals, unscaled embeddings) would load every tensor strictly and still compute
# something else, so any other value is refused by name.
_TRACELESS: tuple[tuple[tuple[str, ...], Any], ...] = (
    (("rotary_interleaved",), False),
    (("rotary_percent",), 1.0),
    (ZERO_CENTERED_GAMMA, False),
    (("rotary_seq_len_interpolation_factor",), None),
    (("window_size",), None),
    (("no_rope_freq",), None),  # 0.13+: layers without RoPE
    (("apply_residual_connection_post_layernorm",), False),
    (("qk_l2_norm",), False),
    (("softmax_type",), "vanilla"),  # 0.15+: 'off-by-one' adds 1 to the softmax denominator
    (("experimental_attention_variant",), None),  # 0.16+
    (("attention_output_gate",), False),  # 0.16+
    (("use_mup",), False),  # 0.17+: muP scales the embeddings, attention and logits
)
# Fields an --hf-config may complete when the saved arguments lack them; where both give one they
# must agree, except max_seq_len (no tensor depends on it: the saved arguments win).
_HF_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "max_seq_len",
    "rotary_base",
    "norm_epsilon",
    "qkv_bias",
    "qk_layernorm",
    "vocab_size",
    "rope_scaling_factor",
)
_SAVED_ARGS_WIN = ("max_seq_len",)


# megatron-core 0.19+ keeps the common (non-sharded) state in the torch_dist files, as the bytes of
# one sharded object under this key, not in a common.pt beside them.
COMMON_STATE_KEY = "common_state/shard_0_1"


def common_state(step_dir: Path) -> tuple[Any, str] | None:
    """The checkpoint's common state (Megatron-LM's `args`, the iteration, ...) and where it was
    read, from `common.pt` (megatron-core up to 0.17) or from the `common_state` object inside the
    torch_dist files (0.19+); None when the folder has neither. Read without running foreign code
    (`safe_pickle`)."""
    common = step_dir / "common.pt"
    if common.is_file():
        return load_common(common), str(common)
    if not (step_dir / ".metadata").is_file():
        return None
    md = load_dcp_metadata(step_dir / ".metadata")
    found = [(index, info) for index, info in md.storage_data.items() if index.fqn == COMMON_STATE_KEY]
    if not found:
        return None
    if len(found) != 1:
        raise InputError(f"{step_dir}/.metadata", f"{COMMON_STATE_KEY} is stored {len(found)} times")
    _, info = found[0]
    where = f"{step_dir / info.relative_path}: {COMMON_STATE_KEY}"
    if getattr(info, "transform_descriptors", None):
        raise InputError(where, f"is stored with transforms {info.transform_descriptors}, which are not read")
    path = (step_dir / info.relative_path).resolve()
    if path.parent != step_dir.resolve():
        raise InputError(where, "names a file outside the checkpoint folder")
    with open(path, "rb") as f:
        f.seek(int(info.offset))
        blob = f.read(int(info.length))
    if len(blob) != int(info.length):
        raise InputError(where, f"is cut short: {len(blob)} of {info.length} bytes")
    obj = loads_common(blob, where)
    if isinstance(obj, list | tuple) and len(obj) == 1:
        obj = obj[0]
    return obj, where


def saved_args(step_dir: Path) -> dict[str, Any] | None:
    """The checkpoint's saved Megatron-LM arguments as a dict, or None when it has none."""
    state = common_state(step_dir)
    if state is None:
        return None
    obj, where = state
    args = obj.get("args") if isinstance(obj, dict) else None
    if args is None:
        return None
    if not isinstance(args, argparse.Namespace):
        raise InputError(f"{where}: args", f"is {args!r}, not an argparse.Namespace")
    return dict(vars(args))


def _named_arg(args: Mapping[str, Any], keys: tuple[str, ...], where: str) -> tuple[str, Any]:
    """(the name it was found under, its value) of an argument saved under any of its names;
    (keys[0], None) when absent or None under all. Two names holding different values are refused:
    which one the actor ran with cannot be told."""
    found: dict[str, Any] = {}
    for key in keys:
        v = args.get(key)
        if isinstance(v, Opaque):
            raise InputError(f"{where}: args.{key}", f"is an object of {v.qualname}, not a plain value")
        if v is not None:
            found[key] = v
    if len({repr(v) for v in found.values()}) > 1:
        held = " and ".join(f"{k}={show(v)}" for k, v in found.items())
        raise InputError(
            f"{where}: args", f"hold {held}: one setting under its old and new name, with different values"
        )
    return next(iter(found.items()), (keys[0], None))


def backbone_from_args(args: Mapping[str, Any], where: str, hf: Any = None, hf_where: str = "--hf-config"):
    """`BackboneConfig` from Megatron-LM's saved arguments (dense Llama / Qwen2 / Qwen3 shapes),
    under the argument names of Megatron-LM 0.12 to 0.17 (`_ARG_FIELDS`).

    `hf`: a `BackboneConfig` read from the actor's config.json (`--hf-config`). The rule: the saved
    arguments describe the checkpoint; `--hf-config` completes what they lack (e.g. `vocab_size`,
    which Megatron-LM saves only padded when its tokenizer set it, or an argument saved under a name
    this reader does not know), and where both give a value they must agree, else `InputError`
    naming the field and both values; except `max_seq_len`, which no tensor depends on: the saved
    arguments win.
    """
    from value_assets.gpu.model.gpt_critic import BackboneConfig

    def get(key: str, default: Any = None) -> Any:
        v = _named_arg(args, (key,), where)[1]
        return default if v is None else v

    for key, want in (("normalization", "RMSNorm"), ("swiglu", True), ("position_embedding_type", "rope")):
        if get(key, want) != want:
            raise InputError(f"{where}: args.{key}", f"is {show(get(key))}; the critic supports {want!r} only")
    if get("num_experts"):
        raise InputError(f"{where}: args.num_experts", f"is {get('num_experts')}; MoE backbones are not supported")
    for keys, plain in _TRACELESS:
        key, value = _named_arg(args, keys, where)
        if value is not None and value != plain:
            raise InputError(f"{where}: args.{key}", f"is {show(value)}; the critic computes with {plain!r} only")
    kw: dict[str, Any] = {field: _named_arg(args, keys, where)[1] for field, keys in _ARG_FIELDS.items()}
    given = {field for field, v in kw.items() if v is not None}  # what the saved arguments say
    heads, hidden = kw["num_attention_heads"], kw["hidden_size"]
    if heads is not None and hidden is not None:
        groups = get("num_query_groups") if get("group_query_attention") else heads
        kw["num_query_groups"] = groups or heads
        kw["kv_channels"] = get("kv_channels") or hidden // heads  # the head dim (None below when implied)
        given |= {"num_query_groups", "kv_channels"}
    for field, key in (("qkv_bias", "add_qkv_bias"), ("qk_layernorm", "qk_layernorm")):
        kw[field] = bool(get(key, False))
        if key in args:
            given.add(field)
    kw["rope_scaling_factor"] = float(get("rope_scaling_factor", 8.0)) if get("use_rope_scaling", False) else None
    if "use_rope_scaling" in args:
        given.add("rope_scaling_factor")
    kw["vocab_size"] = get("vocab_size")
    if kw["vocab_size"] is not None:
        given.add("vocab_size")
    if hf is not None:
        for field in _HF_FIELDS:
            theirs = hf.head_dim if field == "kv_channels" else getattr(hf, field)
            if field not in given:
                kw[field] = theirs
            elif field not in _SAVED_ARGS_WIN and kw[field] != theirs:
                raise InputError(
                    f"{hf_where}: {field}",
                    f"is {show(theirs)}, but the checkpoint's saved arguments ({where}) say {show(kw[field])}: "
                    "--hf-config may complete the saved arguments, not contradict them. Pass the config.json of "
                    "the actor this checkpoint was saved from",
                )
    if kw["vocab_size"] is None:
        kw["vocab_size"] = get("padded_vocab_size")
    required = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "max_seq_len")
    missing = sorted(f for f in (*required, "rotary_base", "norm_epsilon", "vocab_size") if kw.get(f) is None)
    if missing:
        named = [" / ".join(_ARG_FIELDS.get(f, (f,))) for f in missing]
        raise InputError(f"{where}: args", f"lack {named}; pass --hf-config with the actor's config.json")
    if kw["kv_channels"] is not None and kw["kv_channels"] * kw["num_attention_heads"] == kw["hidden_size"]:
        kw["kv_channels"] = None  # BackboneConfig: None is hidden / heads
    kw["family"] = "qwen3" if kw["qk_layernorm"] else "qwen2" if kw["qkv_bias"] else "llama"
    kw["rotary_base"] = float(kw["rotary_base"])
    try:
        return BackboneConfig(**kw)
    except (TypeError, ValueError) as exc:
        raise InputError(f"{where}: args", f"do not describe a supported backbone: {exc}") from None


def resolve(folder: Path, hf_config: Path | None = None):
    """(BackboneConfig, step folder, iteration, layer spec named by the saved arguments or None)
    of a Megatron-LM checkpoint folder. `hf_config` completes the saved arguments
    (`backbone_from_args`), or gives the whole architecture of a checkpoint without them."""
    from value_assets.gpu.model.gpt_critic import BackboneConfig

    it, step_dir = read_tracker(folder)
    args = saved_args(step_dir)
    hf_cfg = None
    if hf_config is not None:
        from value_assets.gpu.convert.hf import backbone_config_kwargs, read_hf_config

        p = Path(hf_config)
        hf_cfg = BackboneConfig(**backbone_config_kwargs(read_hf_config(p if p.is_dir() else p.parent)))
    if args is not None:
        cfg = backbone_from_args(args, f"{step_dir}: saved args", hf=hf_cfg, hf_where=f"--hf-config {hf_config}")
    elif hf_cfg is not None:
        cfg = hf_cfg
    else:
        raise InputError(
            str(step_dir),
            "has no saved arguments (`args` in common.pt, or in the torch_dist common_state of megatron-core 0.19+); "
            "pass --hf-config with the actor's config.json",
        )
    has_fused_norms(tensor_shapes(step_dir), str(step_dir))  # a mixed index is refused before any launch
    return cfg, step_dir, it, layer_spec_of(args)


# ----------------------------------------------------------------------------- names


def _dims(cfg: Any) -> names.Dims:
    from value_assets.gpu.convert.hf import _field

    return names.dims_of(_field, cfg)


def checkpoint_names(cfg: Any, fused_norms: bool = True) -> dict[str, tuple[str, int | None]]:
    """{stacked checkpoint name: (local name, None for a global tensor / 0 for a layer tensor)}
    of the backbone of `cfg`: the names a strict reader expects. `fused_norms`: the norms under
    TE's names, as both megatron-core specs save them (False: another writer's unfused names)."""
    out: dict[str, tuple[str, int | None]] = {}
    for local, _, rule, layer in names.rows(_dims(cfg)):
        if layer is None:
            out[local] = (local, None)
        elif layer == 0:
            out[_LAYER + (names.to_te(rule.local) if fused_norms else rule.local)] = (rule.local, 0)
    return out


def has_fused_norms(shapes: Mapping[str, tuple[int, ...]], where: str) -> bool:
    fused = any(k.endswith(".layer_norm_weight") for k in shapes)
    unfused = any(k.endswith(("input_layernorm.weight", "pre_mlp_layernorm.weight")) for k in shapes)
    if fused and unfused:
        raise InputError(where, "mixes fused norm names (layer_norm_weight) with separate input/pre-MLP norms")
    return not unfused


def layer_spec_of(args: Mapping[str, Any] | None) -> str | None:
    """The layer spec the saved arguments name (`--transformer-impl`), None when unknown."""
    impl = (args or {}).get("transformer_impl")
    return {"transformer_engine": "te", "local": "local"}.get(impl) if isinstance(impl, str) else None


def tensor_shapes(step_dir: Path) -> dict[str, tuple[int, ...]]:
    """{name: global shape} of every tensor in the torch_dist folder (objects left out)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = load_dcp_metadata(step_dir / ".metadata")
    return {k: tuple(v.size) for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def _model_tensor(name: str) -> bool:
    return not name.startswith(_IGNORED_PREFIXES) and "_extra_state" not in name


def _read(step_dir: Path, wanted: Iterable[str]) -> dict[str, torch.Tensor]:
    """Read the named whole tensors (no process group; the index through `safe_pickle`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    md = load_dcp_metadata(step_dir / ".metadata")
    if getattr(md, "storage_meta", None) is None:
        md.storage_meta = StorageMeta()

    class _Reader(FileSystemReader):
        def read_metadata(self, *a: Any, **k: Any):  # never torch's plain pickle.load
            md.storage_meta.load_id = self.load_id
            return md

    out = {}
    for k in wanted:
        meta = md.state_dict_metadata[k]
        out[k] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    dcp.load(out, storage_reader=_Reader(str(step_dir)), no_dist=True)
    return out


def load_backbone_state(step_dir: str | Path, cfg: Any, tp_rank: int = 0, tp_size: int = 1) -> dict[str, torch.Tensor]:
    """Backbone tensors of a Megatron-LM torch_dist folder, under the local spec's whole-model names
    (exactly `hf.megatron_backbone_names(cfg)`), sliced for TP rank `tp_rank`. Strict: every
    backbone tensor of the checkpoint is taken and every expected one found, else an `InputError`
    lists the unexpected and the missing names. The embedding keeps its rows up to `vocab_size`."""
    from value_assets.gpu.convert.hf import _check_shape, shard_for_tp

    step_dir = Path(step_dir)
    shapes = tensor_shapes(step_dir)
    fused = has_fused_norms(shapes, str(step_dir))
    d = _dims(cfg)
    want = checkpoint_names(cfg, fused)
    model = {k for k in shapes if _model_tensor(k)}
    numbered = {k for k in model if re.match(r"decoder\.layers\.\d+\.", k)}
    available: dict[str, str] = {}  # stacked-form name -> how it is stored
    for k in model - numbered:
        available[k] = k
    for k in numbered:
        rest = k[len(_LAYER) :].split(".", 1)[1]
        available.setdefault(_LAYER + rest, "numbered")
    unexpected = sorted(set(available) - set(want) - set(HEAD))
    missing = sorted(set(want) - set(available))
    missing += sorted(
        f"{_LAYER}{i}.{k[len(_LAYER) :]}"
        for k in want
        if available.get(k) == "numbered"
        for i in range(d.layers)
        if f"{_LAYER}{i}.{k[len(_LAYER) :]}" not in numbered
    )
    if unexpected or missing:
        raise InputError(
            str(step_dir),
            f"is not a checkpoint of this {cfg.family} backbone: unexpected {unexpected}, missing {missing}",
        )
    stacked = [k for k in want if available[k] != "numbered"]
    per_layer = [f"{_LAYER}{i}.{k[len(_LAYER) :]}" for k in want if available[k] == "numbered" for i in range(d.layers)]
    tensors = _read(step_dir, stacked + per_layer)
    rules = {rule.local: rule for _, rule in names.HF_TABLE}
    out: dict[str, torch.Tensor] = {}
    for ck, (local, layer) in want.items():
        rule = rules[local]
        if layer is None:
            t = tensors[ck]
            if local == "embedding.word_embeddings.weight":
                if t.shape[0] < d.vocab:
                    raise InputError(f"{step_dir}: {ck}", f"has {t.shape[0]} rows, fewer than vocab_size {d.vocab}")
                t = t[: d.vocab]
            _check_shape(f"{step_dir}: {ck}", t, rule.shape(d))
            out[local] = shard_for_tp(rule, t, tp_rank, tp_size, local)
            continue
        if available[ck] == "numbered":
            layers = [tensors[f"{_LAYER}{i}.{ck[len(_LAYER) :]}"] for i in range(d.layers)]
        else:
            t = tensors[ck]
            if t.shape[0] != d.layers:
                raise InputError(f"{step_dir}: {ck}", f"stacks {t.shape[0]} layers, the config has {d.layers}")
            layers = list(t.unbind(0))
        for i, t in enumerate(layers):
            name = f"decoder.layers.{i}.{local}"
            _check_shape(f"{step_dir}: {ck}[{i}]", t, rule.shape(d))
            out[name] = shard_for_tp(rule, t.contiguous(), tp_rank, tp_size, name)
    from value_assets.gpu.convert.hf import megatron_backbone_names

    order = megatron_backbone_names(cfg)
    return {k: out[k] for k in order}


def load_head(step_dir: str | Path) -> dict[str, torch.Tensor]:
    """The critic head `output_layer.weight` [K, hidden] / `.bias` [K] of a written critic."""
    step_dir = Path(step_dir)
    shapes = tensor_shapes(step_dir)
    missing = [k for k in HEAD if k not in shapes]
    if missing:
        raise InputError(str(step_dir), f"has no critic head: missing {missing}")
    return _read(step_dir, HEAD)


# ----------------------------------------------------------------------------- writing


def megatron_lm_args(cfg: Any, padded_vocab: int, spec: str) -> argparse.Namespace:
    """The saved-arguments namespace of a written critic: what Megatron-LM's loader reads
    (TP / PP sizes, `no_save_optim`, `no_save_rng`) and the architecture `backbone_from_args` reads."""
    qwen3_5 = getattr(cfg, "family", None) == "qwen3_5"
    extra: dict[str, Any] = {}
    if qwen3_5:  # Miles' scripts/models/qwen3.5-*.py flags (names.miles_qwen3_5_rows)
        if spec != "te":
            raise InputError("--layer-spec", f"Miles builds Qwen3.5 with Transformer Engine only, got {show(spec)}")
        extra = {
            "spec": list(names.MILES_QWEN3_5_SPEC),
            "apply_layernorm_1p": True,  # Megatron-LM 0.12-0.15's name
            "layernorm_zero_centered_gamma": True,  # 0.16+'s
            "attention_output_gate": True,
            "rotary_percent": cfg.rotary_percent,
        }
    return argparse.Namespace(
        **extra,
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        group_query_attention=cfg.num_query_groups != cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.head_dim,
        vocab_size=cfg.vocab_size,
        padded_vocab_size=padded_vocab,
        make_vocab_size_divisible_by=VOCAB_DIVISOR,
        max_position_embeddings=cfg.max_seq_len,
        rotary_base=cfg.rotary_base,
        norm_epsilon=cfg.norm_epsilon,  # Megatron-LM 0.12-0.15's name
        layernorm_epsilon=cfg.norm_epsilon,  # 0.16+'s
        normalization="RMSNorm",
        swiglu=True,
        add_qkv_bias=cfg.qkv_bias,
        add_bias_linear=False,
        qk_layernorm=cfg.qk_layernorm,
        position_embedding_type="rope",
        use_rope_scaling=cfg.rope_scaling,
        rope_scaling_factor=cfg.rope_scaling_factor or 8.0,
        untie_embeddings_and_output_weights=True,
        transformer_impl="transformer_engine" if spec == "te" else "local",
        ckpt_format="torch_dist",
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        no_save_optim=True,
        no_save_rng=True,
    )


def sharded_critic_state(
    state: Mapping[str, torch.Tensor], cfg: Any, spec: str, fused_norms: bool = True
) -> dict[str, Any]:
    """megatron-core ShardedTensors / ShardedObjects of a whole (TP=1) local-spec critic `state`
    under the checkpoint names, layers stacked as `TransformerBlock` saves them, with the
    `_extra_state` objects `spec`'s model requests. `fused_norms=False` writes another writer's
    unfused norm names (tests of the reader only)."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    if spec not in SPECS:
        raise InputError("--layer-spec", f"must be one of {SPECS}, got {show(spec)}")
    if getattr(cfg, "family", None) == "qwen3_5":
        return _sharded_miles_qwen3_5(state, cfg, spec)
    d = _dims(cfg)
    want = checkpoint_names(cfg, fused_norms)
    sd: dict[str, Any] = {}
    for ck, (local, layer) in want.items():
        if layer is None:
            t = state[local]
            if local == "embedding.word_embeddings.weight":
                padded = -(-d.vocab // VOCAB_DIVISOR) * VOCAB_DIVISOR
                t = torch.cat([t[: d.vocab], t.new_zeros(padded - d.vocab, d.h)])
            sd[ck] = ShardedTensor.from_rank_offsets(ck, t.contiguous(), replica_id=0)
            continue
        for i in range(d.layers):
            t = state[f"decoder.layers.{i}.{local}"].contiguous()
            sd[f"{ck}#{i}"] = ShardedTensor.from_rank_offsets(ck, t, (0, i, d.layers), replica_id=0, prepend_axis_num=1)
    for k in HEAD:
        sd[k] = ShardedTensor.from_rank_offsets(k, state[k].detach().float().contiguous(), replica_id=0)
    for module in names.EXTRA_STATE[spec]:
        key = f"{_LAYER}{module}._extra_state"
        for i in range(d.layers):
            sd[f"{key}#{i}"] = ShardedObject(key, _extra_state_placeholder(spec), (d.layers,), (i,), replica_id=0)
    return sd


def _sharded_miles_qwen3_5(state: Mapping[str, torch.Tensor], cfg: Any, spec: str) -> dict[str, Any]:
    """A Qwen3.5 critic under the names of Miles' own Qwen3.5 model (`names.miles_qwen3_5_rows`):
    layers numbered, each tensor whole (TP=1), the linear-attention tensors in HF's layout, and
    the `_extra_state` objects of its Transformer Engine modules (numbered: shape (1,), offset (0,),
    as megatron-core's `make_sharded_object_for_checkpoint` gives a layer saved under its number)."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    from value_assets.gpu.convert.hf import _to_hf

    if spec != "te":
        raise InputError("--layer-spec", f"Miles builds Qwen3.5 with Transformer Engine only, got {show(spec)}")
    d = _dims(cfg)
    sd: dict[str, Any] = {}
    pieces: dict[str, tuple[torch.Tensor, ...]] = {}
    for ck, local, piece, rule in names.miles_qwen3_5_rows(d):
        t = state[local]
        if local == "embedding.word_embeddings.weight":
            padded = -(-d.vocab // VOCAB_DIVISOR) * VOCAB_DIVISOR
            t = torch.cat([t[: d.vocab], t.new_zeros(padded - d.vocab, d.h)])
        elif piece is not None:
            if local not in pieces:
                pieces[local] = _to_hf(rule, t, d)
            t = pieces[local][piece]
        sd[ck] = ShardedTensor.from_rank_offsets(ck, t.contiguous(), replica_id=0)
    for k in HEAD:
        sd[k] = ShardedTensor.from_rank_offsets(k, state[k].detach().float().contiguous(), replica_id=0)
    for i in range(d.layers):
        for module in names.MILES_QWEN3_5_EXTRA_STATE[d.layer_type(i)]:
            key = f"{_LAYER}{i}.{module}._extra_state"
            sd[key] = ShardedObject(key, _extra_state_placeholder(spec), (1,), (0,), replica_id=0)
    return sd


def miles_qwen3_5_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """{checkpoint name: global shape} of the tensors `export-miles` writes for a Qwen3.5 critic of
    `cfg` (the backbone, the embedding padded; the head is `HEAD`): what Miles' model must request."""
    from value_assets.gpu.convert.hf import _to_hf

    d = _dims(cfg)
    out: dict[str, tuple[int, ...]] = {}
    for ck, _, piece, rule in names.miles_qwen3_5_rows(d):
        shape = rule.shape(d)
        if ck == "embedding.word_embeddings.weight":
            shape = (-(-d.vocab // VOCAB_DIVISOR) * VOCAB_DIVISOR, d.h)
        elif piece is not None:
            shape = tuple(_to_hf(rule, torch.empty(shape, device="meta"), d)[piece].shape)
        out[ck] = tuple(shape)
    return out


def _extra_state_placeholder(spec: str) -> Any:
    """What a module without FP8 state saves: None for megatron's local linears; for TE the byte
    tensor of `pickle.dumps(None)`, which TE 1.x unpickles to None and TE 2.x (which writes an
    empty tensor itself) also unpickles to None: both then skip it."""
    if spec == "local":
        return None
    return torch.frombuffer(bytearray(pickle.dumps(None)), dtype=torch.uint8).clone()


def write_critic(
    step_dir: Path, state: Mapping[str, torch.Tensor], cfg: Any, spec: str, iteration: int, *, fused_norms: bool = True
) -> None:
    """Save the critic into the existing empty `step_dir` (collective over the current process
    group; one process at TP=1 is enough)."""
    from megatron.core import dist_checkpointing

    padded = -(-cfg.vocab_size // VOCAB_DIVISOR) * VOCAB_DIVISOR
    dist_checkpointing.save(
        {
            "model": sharded_critic_state(state, cfg, spec, fused_norms),
            "args": megatron_lm_args(cfg, padded, spec),
            "iteration": int(iteration),
            "checkpoint_version": 3.0,
        },
        str(step_dir),
        sharded_strategy=in_process_save_strategy(),
    )
