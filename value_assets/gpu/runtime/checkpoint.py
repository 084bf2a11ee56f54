"""Critic checkpoint IO with megatron `dist_checkpointing` (re-shardable across TP/PP/DP).

A checkpoint folder holds the model's sharded state dict (and optionally the optimizer's) in
megatron's torch_dist format; loading with a different tensor-parallel size re-shards. The
folder must exist and be empty before saving (megatron refuses otherwise). psutil must be
installed: without it `dist_checkpointing.save` hangs.

All ranks call `save_critic` / `load_critic` collectively. Only tensors are stored (the iteration
is a tensor too). On load, torch's reader still unpickles `.metadata` (the format's index), and its
planner loads byte entries (megatron's `_extra_state`) with `weights_only=False`; we load those with
`weights_only=True` (`safe_byte_entries`), and the driver verifies every file against the contract
before any worker reads one (core/checkpoint_files.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def _load_bytes_weights_only(self, read_item, value) -> None:
    obj = torch.load(value, weights_only=True)
    if self.flatten_state_dict:
        from torch.distributed.checkpoint._traverse import set_element

        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
    else:
        self.state_dict[read_item.dest_index.fqn] = obj


def safe_byte_entries() -> None:
    """Make megatron's load planner read byte entries with `torch.load(weights_only=True)` (tensors,
    containers and plain values only; never arbitrary objects). Idempotent; megatron's planner only."""
    from megatron.core.dist_checkpointing.strategies.torch import MCoreLoadPlanner

    MCoreLoadPlanner.load_bytes = _load_bytes_weights_only


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if hasattr(model, "module") else model


def _model_sharded_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    sd = _unwrap(model).sharded_state_dict(prefix="")
    # megatron marks output_layer.* shape-mismatch-tolerant for vocab padding; for the value
    # head a shape mismatch means a different objective (K) and must fail loudly.
    for key in ("output_layer.weight", "output_layer.bias"):
        if key in sd:
            sd[key].allow_shape_mismatch = False
    return sd


# The distributed optimizer's sharded format: each rank writes its own shard of the fp32 master
# weights and Adam moments, with no gather ('fully_reshardable' would gather the whole optimizer
# state on one rank; megatron 0.16's default format is refused by its own checkpointing). It
# re-shards over data-parallel sizes only, so a resume keeps tp and pp. Ignored by the plain
# optimizer.
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _state(model: torch.nn.Module, optimizer: Any, iteration: int) -> dict[str, Any]:
    model_sd = _model_sharded_state_dict(model)
    state: dict[str, Any] = {"model": model_sd, "iteration": torch.tensor(iteration, dtype=torch.int64)}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=False, metadata=_OPTIMIZER_METADATA)
    return state


def save_critic(path: str | os.PathLike, model: torch.nn.Module, optimizer: Any = None,
                iteration: int = 0) -> None:
    """Save model (and optimizer) to `path`, an existing empty folder. Collective."""
    from megatron.core import dist_checkpointing

    p = Path(path)
    if torch.distributed.get_rank() == 0:
        if not p.is_dir():
            raise FileNotFoundError(f"checkpoint folder {p} must exist (and be empty)")
        if any(p.iterdir()):
            raise FileExistsError(f"checkpoint folder {p} is not empty")
    torch.distributed.barrier()
    dist_checkpointing.save(_state(model, optimizer, iteration), str(p))
    torch.distributed.barrier()


def load_critic(path: str | os.PathLike, model: torch.nn.Module, optimizer: Any = None,
                strict: bool = True) -> int:
    """Load model (and optimizer when given) from `path` into the already-built modules, for any
    TP size. Returns the stored iteration. Collective."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    safe_byte_entries()
    m = _unwrap(model)
    model_sd = _model_sharded_state_dict(m)
    state: dict[str, Any] = {"model": model_sd, "iteration": torch.tensor(0, dtype=torch.int64)}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=_OPTIMIZER_METADATA)
    loaded = dist_checkpointing.load(
        state, str(path),
        strict=StrictHandling.RAISE_ALL if strict else StrictHandling.LOG_UNEXPECTED,
    )
    m.load_state_dict(loaded["model"], strict=strict)
    if optimizer is not None:
        with torch.no_grad():  # the distributed optimizer copies into views of fp32 parameters
            optimizer.load_state_dict(loaded["optimizer"])
        _own_adam_steps(optimizer)
    it = loaded.get("iteration")
    return int(it) if it is not None else 0


def _own_adam_steps(optimizer: Any) -> None:
    """Restore torch Adam's per-parameter step count under megatron's distributed optimizer
    (without Transformer Engine / Apex). megatron keeps the step in the checkpoint's param groups
    and writes it into the parameter states as ONE shared tensor, which its 'dp_reshardable'
    parameter-state copy then overwrites with the fresh optimizer's count; torch's Adam also
    increments each state's step in place, so a shared tensor would advance once per parameter.
    Every parameter gets its own tensor holding its group's saved step."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam):
            continue
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for p in group["params"]:
                if "step" in inner.state[p]:
                    inner.state[p]["step"] = torch.tensor(float(group["step"]))


def load_model_weights(path: str | os.PathLike, model: torch.nn.Module) -> int:
    """Load only the model's tensors (forward-only use, export); every one must be in the
    checkpoint, its optimizer state is left unread. Returns the stored iteration. Collective."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    safe_byte_entries()
    m = _unwrap(model)
    state = {"model": _model_sharded_state_dict(m), "iteration": torch.tensor(0, dtype=torch.int64)}
    loaded = dist_checkpointing.load(state, str(path), strict=StrictHandling.RAISE_UNEXPECTED)
    m.load_state_dict(loaded["model"], strict=True)
    return int(loaded["iteration"])
