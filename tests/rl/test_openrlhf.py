"""OpenRLHF 0.11.2's own critic loader and forward on the product's `--format openrlhf` export
(`make test-rl`), under OpenRLHF's default flags.

What OpenRLHF runs (openrlhf/trainer/ray/ppo_critic.py): `get_llm_for_sequence_regression(path,
"critic", normalize_reward=--reward.normalize_enable (default off), attn_implementation=
--ds.attn_implementation, param_dtype=--ds.param_dtype, value_head_prefix=--ds.value_head_prefix
(config.json's wins), packing_samples=...)`, then `CriticModel.forward(sequences, action_mask,
attention_mask)`: prompts left-padded, responses right-padded, values[:, :-1][:, -R:], i.e. the
value of response token j at absolute position prompt_len + j - 1. Compared with the product's
engine values: fp32, 1e-5.

Shims (tests/rl/harness.py): S1 (flash_attn import stub), S3 (param_dtype "fp32"; OpenRLHF knows
bf16/fp16 only). attn_implementation "eager" and ds_config None (ZeRO stage below 3) are OpenRLHF's
own arguments.
"""

from __future__ import annotations

import pytest
import torch

from tests.rl.harness import import_openrlhf
from tests.rl.rltest_helpers import FAMILIES, response_values, rollouts

pytestmark = [pytest.mark.rl, pytest.mark.timeout(600)]
ATOL = 1e-5


def openrlhf_values(model_path: str, prompts, responses) -> torch.Tensor:
    """OpenRLHF's critic values [batch, max response length], every flag at its default."""
    get_llm_for_sequence_regression, _ = import_openrlhf()
    critic = get_llm_for_sequence_regression(
        model_path, "critic", attn_implementation="eager", param_dtype="fp32", ds_config=None
    ).eval()
    P, R = max(map(len, prompts)), max(map(len, responses))
    seq = torch.zeros(len(prompts), P + R, dtype=torch.long)
    att = torch.zeros_like(seq)
    action_mask = torch.zeros(len(prompts), R, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        seq[i, P - len(p) : P], seq[i, P : P + len(r)] = torch.tensor(p), torch.tensor(r)
        att[i, P - len(p) : P + len(r)] = 1
        action_mask[i, : len(r)] = True
    with torch.no_grad():
        return critic(seq, action_mask, att)


def _diffs(got, want, responses) -> torch.Tensor:
    return torch.cat([got[i, : len(r)] - want[i] for i, r in enumerate(responses)])


@pytest.mark.parametrize("family", FAMILIES)
def test_openrlhf_default_flags_give_the_products_values(critics, family):
    """The export of a critic trained with --head-bias zero: exact under OpenRLHF's defaults (this
    also shows the bias stayed bitwise 0 through training: the export refuses any other)."""
    from safetensors import safe_open

    paths = critics[family]
    with safe_open(str(paths["openrlhf"] / "model.safetensors"), "pt") as f:
        assert "score.bias" not in f.keys()
    prompts, responses = rollouts()
    got = openrlhf_values(str(paths["openrlhf"]), prompts, responses)
    diff = _diffs(got, response_values(paths["critic-zero"], prompts, responses), responses).abs().max().item()
    print(f"OpenRLHF {family}: max abs diff {diff:.2e}")
    assert diff < ATOL


def test_openrlhf_drops_a_head_bias(critics, capsys):
    """Why the OpenRLHF export needs --head-bias zero: OpenRLHF's critic head is bias-free, so a
    biased critic's `score.bias` is not loaded and every value is short by exactly the bias; and
    `export-hf --format openrlhf` refuses such a critic, saying how to train one."""
    from safetensors import safe_open

    from value_assets.cli import main

    paths = critics["qwen2"]
    with safe_open(str(paths["scalar"] / "model.safetensors"), "pt") as f:
        bias = f.get_tensor("score.bias").item()
    assert abs(bias) > 1e-3, bias  # a trained bias, large enough to show
    prompts, responses = rollouts()
    got = openrlhf_values(str(paths["scalar"]), prompts, responses)
    d = _diffs(got, response_values(paths["critic-trained"], prompts, responses), responses)
    assert (d + bias).abs().max().item() < ATOL, (d, bias)
    capsys.readouterr()
    refused = paths["root"] / "refused"
    assert (
        main(["export-hf", "--checkpoint", str(paths["critic-trained"]), "--out", str(refused), "--format", "openrlhf"])
        == 2
    )
    err = capsys.readouterr().err
    assert "--format openrlhf" in err and "--head-bias zero" in err and "value head has bias" in err
    assert not refused.exists()
