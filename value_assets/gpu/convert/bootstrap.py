"""Where a fresh critic's backbone comes from (docs/rules.md#critic bootstrap).

`resolve_backbone` runs on the driver (CPU, before anything is reserved): it reads the backbone's
shape and identity. `load_backbone_into` runs on each worker: it loads every backbone tensor
strictly, leaving only the value head new.

Sources:
* ``tiny``: a small random backbone (seeded; the same weights for every TP x PP layout), for demos
  and tests;
* a Hugging Face folder (``config.json`` + safetensors; Llama, Qwen2, Qwen3);
* a Megatron distributed checkpoint folder saved by this project (``backbone.json`` beside the
  torch_dist files), e.g. a critic's checkpoint reused as another critic's actor;
* a Megatron-LM / Miles checkpoint folder (``latest_checkpointed_iteration.txt`` + ``iter_NNNNNNN/``
  in torch_dist, Transformer-Engine or local-spec names; see `megatron_lm.py`). Its architecture
  comes from the checkpoint's saved arguments, else from ``--hf-config`` (a ``config.json``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from value_assets.core.errors import InputError
from value_assets.core.hashing import sha256_file
from value_assets.core.strict_json import canonical_bytes

BACKBONE_JSON = "backbone.json"


def _folder_digest(folder: Path, patterns: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for pattern in patterns:
        for f in sorted(folder.glob(pattern)):
            h.update(f.name.encode() + b"\0" + sha256_file(f).encode() + b"\n")
    return h.hexdigest()


def resolve_backbone(spec: str, *, seed: int = 0, hf_config: str | Path | None = None):
    """(BackboneConfig, worker source, identity for the contract) for `spec` ("tiny" or a folder).
    `hf_config`: a Hugging Face config.json (or its folder) for a Megatron-LM checkpoint whose
    saved arguments are absent (ignored for other sources)."""
    from value_assets.core.backbone import BackboneConfig

    if spec == "tiny":
        cfg = BackboneConfig.tiny()
        return cfg, {"kind": "tiny", "seed": seed}, {"kind": "tiny-random", "seed": seed}
    folder = Path(spec)
    if not folder.is_dir():
        raise InputError("--backbone", f"{spec!r} is neither 'tiny' nor an existing folder")
    if (folder / "config.json").is_file():
        from value_assets.gpu.convert.hf import backbone_config_kwargs, read_hf_config

        cfg = BackboneConfig(**backbone_config_kwargs(read_hf_config(folder)))
        from value_assets.gpu.convert.tokenizer import has_tokenizer_files, tokenizer_sha256

        ident = {
            "kind": "huggingface",
            "path": str(folder.resolve()),
            "sha256": _folder_digest(folder, ("config.json", "*.safetensors", "*.safetensors.index.json")),
            # The RL trainers read the tokenizer from the exported critic's folder: export-hf carries
            # these files, checked against this sha (None: the folder has none).
            "tokenizer_sha256": tokenizer_sha256(folder) if has_tokenizer_files(folder) else None,
        }
        return cfg, {"kind": "hf", "path": str(folder.resolve())}, ident
    if (folder / BACKBONE_JSON).is_file():
        from value_assets.core.contract import CONTRACT_NAME, load_verified

        contract = None
        if (folder / CONTRACT_NAME).is_file():
            # A contracted save reused as a backbone: its files must match first, and the workers
            # use only bytes that still match (gpu/runtime/checkpoint.py).
            contract, _ = load_verified(folder)
        try:
            cfg = BackboneConfig.from_json(json.loads((folder / BACKBONE_JSON).read_text()))
        except (ValueError, TypeError) as exc:
            raise InputError(str(folder / BACKBONE_JSON), f"not a backbone config: {exc}") from None
        ident = {"kind": "megatron", "path": str(folder.resolve()), "sha256": _folder_digest(folder, ("*",))}
        return cfg, {"kind": "megatron", "path": str(folder.resolve()), "contract": contract}, ident
    from value_assets.gpu.convert import megatron_lm

    if megatron_lm.is_megatron_lm_folder(folder):
        cfg, step_dir, it, layer_spec = megatron_lm.resolve(folder, Path(hf_config) if hf_config else None)
        ident = {
            "kind": "megatron-lm",
            "path": str(folder.resolve()),
            "iteration": it,
            "layer_spec": layer_spec,
            "sha256": _folder_digest(step_dir, ("*",)),
        }  # pathlib globs dotfiles too
        return cfg, {"kind": "megatron_lm", "path": str(step_dir.resolve()), "backbone": cfg.to_json()}, ident
    raise InputError(
        "--backbone",
        f"{spec!r} holds neither a Hugging Face checkpoint (config.json), a Megatron one "
        f"({BACKBONE_JSON}) nor a Megatron-LM one ({megatron_lm.TRACKER})",
    )


def write_backbone_json(folder: Path, cfg) -> None:
    (folder / BACKBONE_JSON).write_bytes(canonical_bytes(cfg.to_json()))


def load_backbone_into(module, source: dict[str, Any], *, tp: int) -> dict[str, Any]:
    """Load the backbone into a freshly built critic module on this rank; only the head stays new."""
    kind = source["kind"]
    if kind == "tiny":
        from value_assets.gpu.model.gpt_critic import init_layout_invariant

        init_layout_invariant(module, int(source["seed"]))
        return {"loaded": 0}
    if kind in ("hf", "megatron_lm"):
        from megatron.core import parallel_state as ps

        from value_assets.gpu.model.gpt_critic import BackboneConfig, stage_state

        rank = ps.get_tensor_model_parallel_rank()
        if kind == "hf":
            from value_assets.gpu.convert.hf import load_hf_backbone_state

            whole = load_hf_backbone_state(source["path"], tp_rank=rank, tp_size=tp)
        else:
            from value_assets.gpu.convert.megatron_lm import load_backbone_state

            whole = load_backbone_state(
                source["path"], BackboneConfig.from_json(source["backbone"]), tp_rank=rank, tp_size=tp
            )
        # Whole-model names, sliced for this TP rank; then only this pipeline stage's layers.
        state = stage_state(module, whole)
        own = module.state_dict()
        state = {k: v.to(dtype=own[k].dtype) if k in own else v for k, v in state.items()}
        result = module.load_state_dict(state, strict=False)
        _check_only_head_missing(result.missing_keys, result.unexpected_keys, source["path"])
        return {"loaded": len(state)}
    if kind == "megatron":
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.validation import StrictHandling

        from value_assets.gpu.runtime.checkpoint import checked_reads, safe_byte_entries

        safe_byte_entries()
        sd = module.sharded_state_dict(prefix="")
        backbone_sd = {k: v for k, v in sd.items() if not k.startswith("output_layer.")}
        with checked_reads(source["path"], source.get("contract")) as strategies:
            loaded = dist_checkpointing.load(
                {"model": backbone_sd}, source["path"], strict=StrictHandling.LOG_UNEXPECTED, **strategies
            )
        result = module.load_state_dict(loaded["model"], strict=False)
        _check_only_head_missing(result.missing_keys, result.unexpected_keys, source["path"])
        return {"loaded": len(loaded["model"])}
    raise InputError("backbone", f"unknown backbone source {kind!r}")


def _check_only_head_missing(missing, unexpected, where: str) -> None:
    missing = [k for k in missing if not k.endswith("_extra_state") and not k.startswith("output_layer.")]
    unexpected = [k for k in unexpected if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise InputError(
            where, f"backbone does not match the critic: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
