"""Export a contracted critic checkpoint: Hugging Face (`export-hf`) or Miles (`export-miles`).

Both run in one process (gloo on CPU), for any saved TP size: the checkpoint is re-sharded to TP=1
on load. Both refuse a checkpoint whose contract does not verify. Both build `--out` under a hidden
temporary name beside it and rename it into place when complete (`core.paths.staged_folder`): a
write the system refuses (a full disk, a file-size limit) is a PublishError naming `--out` (exit 2)
and, like a killed export, leaves no partial export.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from value_assets.core.contract import load_verified, resolve_step_dir
from value_assets.core.errors import InputError
from value_assets.core.objective import Objective
from value_assets.core.paths import staged_folder
from value_assets.gpu.convert.tokenizer import TOKENIZER_FILES, has_tokenizer_files, tokenizer_sha256

HF_FORMATS = ("token-classification", "scalar", "openrlhf")


def contracted_step(checkpoint: Path) -> tuple[Path, dict[str, Any], str]:
    """(step folder, contract, contract sha) of a contracted `iter_*` folder or a critic folder
    (its `latest`), every file of the step verified against the contract before any is
    deserialized (docs/rules.md#checkpoint-binding)."""
    step_dir, pinned = resolve_step_dir(checkpoint)
    contract, sha = load_verified(step_dir, pinned_sha256=pinned)
    return step_dir, contract, sha


def _empty_out(out: Path) -> None:
    """Refused before anything is loaded (`staged_folder` checks again when it writes)."""
    if out.is_symlink():
        raise InputError(str(out), "output folder is a symlink: never written through one")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(str(out), "output folder exists and is not empty")


def _load_full_state(step_dir: Path, contract: dict[str, Any]):
    """(backbone, objective, whole-model TP=1 state dict on CPU float32) of a contracted step."""
    from value_assets.gpu.model.gpt_critic import BackboneConfig, build_critic
    from value_assets.gpu.runtime.checkpoint import load_model_weights
    from value_assets.gpu.runtime.parallel import destroy, init_distributed

    backbone = BackboneConfig.from_json(contract["backbone_config"])
    objective = Objective.from_json(contract["objective"])
    init_distributed(0, 1, "127.0.0.1", 0, backend="gloo" if not _cuda() else None)
    try:
        model = build_critic(backbone, objective, bf16=False)
        load_model_weights(step_dir, model, contract=contract)
        state = {k: v.detach().float().cpu() for k, v in model.state_dict().items() if hasattr(v, "detach")}
    finally:
        destroy()
    return backbone, objective, state


def export_checkpoint(
    checkpoint: Path,
    out: Path,
    fmt: str = "token-classification",
    *,
    tokenizer: Path | None = None,
    warn: Callable[[str], None] | None = None,
) -> Path:
    """`export-hf`. `fmt`: `token-classification` (K outputs, `score` with bias), `scalar` (mse
    critics only: the same model with num_labels=1; verl's HF critic reads `logits[..., 0]`),
    `openrlhf` (mse only: OpenRLHF's critic layout, `score` [1, hidden] without bias; the critic's
    head bias must be 0, as `--head-bias zero` trains it: `hf.export_critic_to_openrlhf`).

    Every format carries the actor's tokenizer files (`tokenizer_source`: `tokenizer`, else the
    Hugging Face backbone the contract names, checked against the sha recorded at training), so the
    folder alone is a complete model folder: verl's `critic.model.tokenizer_path` defaults to its
    `critic.model.path`. With no tokenizer known, the export is written without one and `warn`
    (default: stderr) says what the RL side must set instead."""
    from value_assets.gpu.convert.hf import export_critic_to_hf, export_critic_to_openrlhf

    if fmt not in HF_FORMATS:
        raise InputError("--format", f"must be one of {HF_FORMATS}, got {fmt!r}")
    step_dir, contract, _ = contracted_step(checkpoint)
    objective = Objective.from_json(contract["objective"])
    if fmt != "token-classification" and objective.loss_type != "mse":
        raise InputError(
            "--format",
            f"{fmt!r} needs an mse critic; this one is a {objective.num_bins}-bin classification "
            "critic, whose value softmax(logits) . support is not linear in the hidden state, so no "
            "single linear scalar head reproduces it. Export it with --format token-classification.",
        )
    source = tokenizer_source(contract, tokenizer)  # refused before anything is written
    _empty_out(out)
    backbone, objective, state = _load_full_state(step_dir, contract)
    with staged_folder(out) as staged:  # a full disk or a kill leaves no partial export at `out`
        if fmt == "openrlhf":
            export_critic_to_openrlhf(state, backbone, staged, objective=objective)
        else:
            export_critic_to_hf(state, backbone, objective.head_size, staged, objective=objective)
        carry_tokenizer(staged, source, contract, warn=warn, shown_as=out)
    return out


def tokenizer_source(contract: dict[str, Any], explicit: Path | None) -> Path | None:
    """The folder whose tokenizer files an HF export carries: `explicit` (`--tokenizer`), else the
    Hugging Face backbone folder the contract names. Its files must hash to the
    `model.tokenizer_sha256` the contract recorded at training, where it recorded one (a contract
    from before that record takes the folder's files as they are). None: no tokenizer is known (the
    `tiny` backbone, a Megatron checkpoint, an HF folder without tokenizer files)."""
    model = contract.get("model") or {}
    recorded = model.get("tokenizer_sha256")
    hf_path = model.get("path") if model.get("kind") == "huggingface" else None
    if explicit is not None:
        folder, where = Path(explicit), "--tokenizer"
    elif hf_path is not None and (recorded is not None or "tokenizer_sha256" not in model):
        folder, where = Path(hf_path), "the contract's model.path"
        if recorded is None and not (folder.is_dir() and has_tokenizer_files(folder)):
            return None
    else:
        return None
    if not folder.is_dir():
        raise InputError(f"{where} {folder}", "is not a folder: the actor's tokenizer files cannot be carried")
    sha = tokenizer_sha256(folder)
    if recorded is not None and sha != recorded:
        raise InputError(
            f"{where} {folder}",
            f"holds tokenizer files with sha256 {sha}; the critic was trained with {recorded} (the contract's "
            "model.tokenizer_sha256): pass --tokenizer with the actor's own tokenizer folder",
        )
    return folder


def carry_tokenizer(
    out: Path,
    source: Path | None,
    contract: dict[str, Any],
    warn: Callable[[str], None] | None = None,
    *,
    shown_as: Path | None = None,
) -> None:
    """Copy the tokenizer files of `source` into the export and record them in value_head.json
    (`tokenizer`: files and sha, or null); without a source, say by name what the RL side must set
    (naming the export `shown_as`, where `out` is its staging folder)."""
    info_path = out / "value_head.json"
    info = json.loads(info_path.read_text())
    if source is None:
        model = contract.get("model") or {}
        message = (
            f"no tokenizer known for this critic (backbone {model.get('kind')} {model.get('path', '')}): "
            f"{shown_as or out} has no tokenizer files, so verl needs critic.model.tokenizer_path=<the actor's Hugging "
            "Face folder> (its default, critic.model.path, would build an empty tokenizer). Pass --tokenizer DIR to "
            "carry the actor's tokenizer files."
        )
        (warn or (lambda m: print(f"warning: {m}", file=sys.stderr)))(message)
        info["tokenizer"] = None
    else:
        files = [name for name in TOKENIZER_FILES if (source / name).is_file()]
        for name in files:
            shutil.copyfile(source / name, out / name)
        info["tokenizer"] = {"files": files, "sha256": tokenizer_sha256(out)}
    info_path.write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def export_miles(checkpoint: Path, out: Path, model_identity: str, layer_spec: str = "te") -> tuple[Path, str]:
    """`export-miles`: docs/rules.md#hand-off's `OUT/latest_checkpointed_iteration.txt`, `OUT/iter_{N:07d}/` and
    `OUT/value_pretrain_contract.json` (written last: it is what publishes the hand-off).
    Returns (OUT, the Miles contract's sha)."""
    from value_assets.core.miles import (
        MILES_CONTRACT_NAME,
        MILES_TRACKER_NAME,
        build_miles_contract,
        miles_contract_bytes,
        miles_iter_dirname,
    )
    from value_assets.core.publish import atomic_write
    from value_assets.gpu.convert.megatron_lm import SPECS, write_critic
    from value_assets.gpu.runtime.parallel import destroy, init_distributed

    if layer_spec not in SPECS:
        raise InputError("--layer-spec", f"must be one of {SPECS}, got {layer_spec!r}")
    step_dir, contract, _ = contracted_step(checkpoint)
    family = (contract.get("backbone_config") or {}).get("family")
    if family == "qwen3_5" and layer_spec != "te":
        raise InputError(
            "--layer-spec",
            f"{layer_spec!r}: Miles builds a Qwen3.5 model only with Transformer Engine (its "
            "miles_plugins.models.qwen3_5 get_qwen3_5_spec), so a Qwen3.5 critic is written with --layer-spec te",
        )
    miles = build_miles_contract(contract, model_identity)
    data = miles_contract_bytes(miles)
    _empty_out(out)
    backbone, _, state = _load_full_state(step_dir, contract)
    n = miles["completed_steps"]
    with staged_folder(out) as staged:  # a full disk or a kill leaves no partial bundle at `out`
        target = staged / miles_iter_dirname(n)
        target.mkdir()
        init_distributed(0, 1, "127.0.0.1", 0, backend="gloo" if not _cuda() else None)
        try:
            write_critic(target, state, backbone, layer_spec, n)
        finally:
            destroy()
        atomic_write(staged / MILES_TRACKER_NAME, f"{n}\n".encode())
        sha = atomic_write(staged / MILES_CONTRACT_NAME, data)
    return out, sha


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
