"""The engine's critic (`gpu.model.build_critic`) bootstrapped from an HF actor checkpoint.

Skipped where `value_assets.gpu.model.gpt_critic` is absent. A fresh critic loads every backbone tensor
strictly (only the head is new); its per-token head outputs, after `export_critic_to_hf`, equal
`AutoModelForTokenClassification` logits (float32, max abs diff < 1e-4).
"""

from __future__ import annotations

import pytest
import torch

from tests.hf.hf_checkpoints import make_hf_checkpoint
from value_assets.core.objective import Objective
from value_assets.gpu.convert.hf import (
    backbone_config_kwargs,
    export_critic_to_hf,
    load_hf_backbone_state,
    read_hf_config,
)

pytestmark = pytest.mark.unit
model_mod = pytest.importorskip("value_assets.gpu.model.gpt_critic")


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "llama3-scaled"])
def test_engine_critic_bootstrap_and_export(tmp_path, megatron_single_rank, family):
    from transformers import AutoModelForTokenClassification

    src, out = tmp_path / "src", tmp_path / "out"
    make_hf_checkpoint(src, family)
    cfg = read_hf_config(src)
    backbone = model_mod.BackboneConfig(**backbone_config_kwargs(cfg))
    objective = Objective(num_bins=11)
    critic = model_mod.build_critic(backbone, objective, bf16=False, head_seed=0).eval()

    result = critic.load_state_dict(load_hf_backbone_state(src), strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    head = [k for k in critic.state_dict() if k.startswith("output_layer.") and not k.endswith("_extra_state")]
    assert sorted(missing) == sorted(head) and len(head) == 2  # only the value head is new
    assert result.unexpected_keys == []

    # Positions up to 60: far enough for llama3 RoPE scaling's low frequencies to change the output.
    lengths = [61, 5]
    tokens = torch.randint(0, cfg["vocab_size"], (sum(lengths),), generator=torch.Generator().manual_seed(4))
    position_ids = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, 61, 66], dtype=torch.int32)
    with torch.no_grad():
        values = model_mod.critic_forward(critic, tokens, position_ids, cu, max(lengths))
    assert values.dtype == torch.float32 and values.shape == (66, objective.head_size)

    export_critic_to_hf(critic.state_dict(), backbone, objective.head_size, out, objective=objective)
    hf = AutoModelForTokenClassification.from_pretrained(str(out)).eval()
    with torch.no_grad():
        ref = torch.cat([hf(input_ids=tokens[a:b][None]).logits[0] for a, b in ((0, 61), (61, 66))])
    assert (values - ref).abs().max().item() < 1e-4
