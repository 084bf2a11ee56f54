"""megatron-core's own loader accepts what `export-miles` writes, strictly, at TP=1 and TP=2.

Each export (TE and local spec) is loaded by `dist_checkpointing.load` with `RAISE_ALL` into the
request a Megatron-LM / Miles critic makes (see megatron_lm_worker.py), re-sharded to TP=2 on 2 gloo
processes; the critic values equal those of the HF model plus the same head (float32, < 1e-4).
"""

from __future__ import annotations

import pytest
import torch

from tests.hf.hf_checkpoints import make_hf_checkpoint
from tests.ranks import start_ranks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _export(tmp_path, hf, k, specs):
    from value_assets.gpu.convert.bootstrap import resolve_backbone
    from value_assets.gpu.convert.hf import load_hf_backbone_state
    from value_assets.gpu.convert.megatron_lm import write_critic
    from value_assets.gpu.runtime.parallel import destroy, init_distributed

    cfg, _, _ = resolve_backbone(str(hf))
    state = load_hf_backbone_state(hf)
    g = torch.Generator().manual_seed(9)
    state["output_layer.weight"] = torch.randn(k, cfg.hidden_size, generator=g) * 0.02
    state["output_layer.bias"] = torch.randn(k, generator=g)
    init_distributed(0, 1, "127.0.0.1", 0)
    try:
        for spec in specs:
            step = tmp_path / spec / "iter_0000004"
            step.mkdir(parents=True)
            write_critic(step, state, cfg, spec, 4)
            (tmp_path / spec / "latest_checkpointed_iteration.txt").write_text("4")
    finally:
        destroy()
    return state


@pytest.mark.parametrize("world", [1, 2])
def test_megatron_loads_the_export_strictly(tmp_path, world):
    """TP=1 runs in this process (one rank); TP=2 spawns two gloo processes."""
    from tests.hf import megatron_lm_worker
    from value_assets.gpu.runtime.parallel import destroy, init_distributed

    hf_folder, k = tmp_path / "hf", 3
    hf = make_hf_checkpoint(hf_folder, "qwen2")
    state = _export(tmp_path, hf_folder, k, ("te", "local"))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(4))
    torch.save(ids, tmp_path / "ids.pt")
    cases = [
        (str(tmp_path / spec), spec, str(hf_folder), k, str(tmp_path / "ids.pt"), str(tmp_path / f"{spec}.pt"))
        for spec in ("te", "local")
    ]
    if world == 1:
        init_distributed(0, 1, "127.0.0.1", 0)
        try:
            megatron_lm_worker.check(0, 1, cases)
        finally:
            destroy()
    else:
        start_ranks(megatron_lm_worker.run, (cases,), world)
    with torch.no_grad():
        ref = hf.model(ids).last_hidden_state @ state["output_layer.weight"].T + state["output_layer.bias"]
    for spec in ("te", "local"):
        diff = (torch.load(tmp_path / f"{spec}.pt") - ref).abs().max().item()
        print(f"{spec} TP={world}: max abs diff {diff:.2e}")
        assert diff < 1e-4, (spec, world, diff)
