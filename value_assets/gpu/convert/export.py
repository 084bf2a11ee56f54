"""Export a contracted critic checkpoint to Hugging Face format (one process, any saved TP size)."""

from __future__ import annotations

from pathlib import Path

from value_assets.core.contract import load_verified, resolve_step_dir
from value_assets.core.errors import InputError
from value_assets.core.objective import Objective


def export_checkpoint(checkpoint: Path, out: Path) -> Path:
    from value_assets.gpu.convert.hf import export_critic_to_hf
    from value_assets.gpu.model.critic import BackboneConfig, build_critic
    from value_assets.gpu.runtime.parallel import destroy, free_port, init_distributed
    from value_assets.gpu.runtime.checkpoint import load_model_weights

    step_dir, pinned = resolve_step_dir(checkpoint)
    # Every file checked against the contract before any is deserialized (SPEC 6).
    contract, _ = load_verified(step_dir, pinned_sha256=pinned)
    if out.exists() and any(out.iterdir()):
        raise InputError(str(out), "output folder exists and is not empty")
    backbone = BackboneConfig.from_json(contract["backbone_config"])
    objective = Objective.from_json(contract["objective"])
    init_distributed(0, 1, "127.0.0.1", free_port(), backend="gloo" if not _cuda() else None)
    try:
        model = build_critic(backbone, objective, bf16=False)
        load_model_weights(step_dir, model)
        state = {k: v.detach().float().cpu() for k, v in model.state_dict().items() if hasattr(v, "detach")}
        export_critic_to_hf(state, backbone, objective.head_size, out, objective=objective)
    finally:
        destroy()
    return out


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
