"""Megatron critic -> HF token-classification checkpoint: transformers reproduces the head's logits.

Tolerance: float32, max |HF logits - critic logits| < 1e-4 (measured ~1e-6).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.hf.hf_checkpoints import make_hf_checkpoint
from value_assets.core.errors import InputError
from value_assets.core.objective import Objective
from value_assets.gpu.convert.hf import (
    export_critic_to_hf,
    load_hf_backbone_state,
    load_hf_value_head,
    read_hf_config,
)

pytestmark = pytest.mark.unit
ATOL = 1e-4


def critic_state(folder, k, padded_vocab_size=None):
    """A fresh critic as docs/rules.md#critic builds it: the HF backbone plus a Linear(hidden -> K) value head."""
    cfg = read_hf_config(folder)
    state = load_hf_backbone_state(folder, padded_vocab_size=padded_vocab_size)
    head = torch.nn.Linear(cfg["hidden_size"], k)
    torch.nn.init.normal_(head.weight, 0.0, 0.02)
    torch.nn.init.uniform_(head.bias, -0.1, 0.1)  # nonzero so a dropped bias would show
    state["output_layer.weight"], state["output_layer.bias"] = head.weight.detach(), head.bias.detach()
    state["decoder.layers.0.self_attention.linear_qkv._extra_state"] = None  # skipped on export
    return cfg, state, head


@pytest.mark.parametrize(
    "family, objective",
    [
        ("llama", Objective(num_bins=51)),
        ("qwen2", Objective(loss_type="mse", reward_range=(-1.0, 1.0))),
        ("qwen3", Objective(num_bins=7, target_type="two_hot")),
    ],
)
def test_export_round_trip_logits(tmp_path, megatron_single_rank, family, objective):
    from transformers import AutoModelForTokenClassification

    from tests.hf.megatron_fixture import build_gpt, final_hidden, load_backbone

    src, out = tmp_path / "src", tmp_path / "out"
    make_hf_checkpoint(src, family)
    k = objective.head_size
    cfg, state, head = critic_state(src, k, padded_vocab_size=136)
    gpt = build_gpt(cfg, padded_vocab_size=136)
    load_backbone(gpt, {n: t for n, t in state.items() if not n.startswith("output_layer.") and t is not None})
    ids = torch.randint(0, cfg["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = head(final_hidden(gpt, ids).float())

    export_critic_to_hf(state, cfg, k, out, objective=objective)
    hf = AutoModelForTokenClassification.from_pretrained(str(out)).eval()
    assert (
        type(hf).__name__
        == {
            "llama": "LlamaForTokenClassification",
            "qwen2": "Qwen2ForTokenClassification",
            "qwen3": "Qwen3ForTokenClassification",
        }[family]
    )
    with torch.no_grad():
        got = hf(input_ids=ids).logits
    diff = (got - want).abs().max().item()
    print(f"{family}: export logits max abs diff {diff:.2e}")
    assert got.shape == (2, 20, k) and diff < ATOL
    head_info = json.loads((out / "value_head.json").read_text())
    assert head_info["num_outputs"] == k and head_info["hf_module"] == "score"
    assert head_info["objective"] == objective.canonical()
    # Re-importing the exported backbone gives the same tensors (embedding padding dropped).
    back = load_hf_backbone_state(out)
    for name, t in back.items():
        src_t = state[name][: cfg["vocab_size"]] if name.startswith("embedding") else state[name]
        assert torch.equal(t, src_t), name
    head_back = load_hf_value_head(out)
    assert torch.equal(head_back["output_layer.weight"], state["output_layer.weight"])
    assert torch.equal(head_back["output_layer.bias"], state["output_layer.bias"])


def test_export_is_strict(tmp_path):
    src = tmp_path / "src"
    make_hf_checkpoint(src, "llama")
    cfg, state, _ = critic_state(src, 3)
    with pytest.raises(InputError, match="disagrees with objective.head_size 51"):
        export_critic_to_hf(state, cfg, 3, tmp_path / "a", objective=Objective())
    with pytest.raises(InputError, match=r"output_layer.weight: has shape \(3, 64\), expected \(4, 64\)"):
        export_critic_to_hf(state, cfg, 4, tmp_path / "b")
    state["embedding.position_embeddings.weight"] = torch.zeros(64, 64)
    with pytest.raises(InputError, match=r"unexpected \['embedding.position_embeddings.weight'\]"):
        export_critic_to_hf(state, cfg, 3, tmp_path / "c")
    del state["embedding.position_embeddings.weight"], state["decoder.final_layernorm.weight"]
    with pytest.raises(InputError, match=r"missing \['decoder.final_layernorm.weight'\]"):
        export_critic_to_hf(state, cfg, 3, tmp_path / "d")
