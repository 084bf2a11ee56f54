"""Helpers for the job tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Resumed and uninterrupted CPU runs take bitwise-equal losses, but their final parameters may differ
# in the last bits (measured: up to ~3e-6 after 64 steps on 2 CPU cores); this is the bound the tests
# hold them to.
WEIGHT_ATOL = 1e-5


def model_weights(step_dir: Path, scratch: Path) -> dict:
    """The model tensors of a (verified) torch_dist save, read on the CPU in one process."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = scratch / f"{step_dir.parent.name}-{step_dir.name}.pt"
    dcp_to_torch_save(str(step_dir), str(out))
    state = torch.load(out, weights_only=True)
    out.unlink()
    return {
        k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.is_floating_point() and "optimizer" not in k
    }


def a_weight_byte(save: Path) -> tuple[Path, int]:
    """The file and offset of a byte inside a model weight (not optimizer state) of a torch_dist save:
    a byte every load reads, forward-only and bootstrap included, wherever the writer put it (its
    index says). A checked load reads only the chunks it needs, so a flipped byte elsewhere (in
    optimizer state, on a forward-only load) is never read and never refused."""
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(str(save)).read_metadata().storage_data
    index, info = next((i, s) for i, s in sorted(storage.items(), key=str) if not i.fqn.startswith("optimizer"))
    return save / info.relative_path, info.offset + info.length // 2


def max_weight_difference(a: Path, b: Path, scratch: Path) -> float:
    wa, wb = model_weights(a, scratch), model_weights(b, scratch)
    assert wa.keys() == wb.keys() and wa
    return max(float((wa[k].double() - wb[k].double()).abs().max()) for k in wa)


def quiet(_msg: str) -> None:
    """A job log that keeps nothing."""


def tiny_train_job(manifest: Path, output: Path, **overrides: Any):
    """The job tests' training config: the tiny backbone on two CPU workers, one epoch, seed 0,
    lr 2e-3, global batch 32; `overrides` replace any of it."""
    from value_assets.core.job_configs import TrainJob

    settings = dict(backbone="tiny", global_batch_size=32, epochs=1, seed=0, gpus=2, lr=2e-3)
    return TrainJob(manifest=manifest, output=output, **(settings | overrides))
