"""GPU tier, Qwen3.5: flash-linear-attention's kernel against the torch delta rule, and a bf16
Qwen3.5 critic on CUDA against transformers' Qwen3.5 in float32, also on CUDA (where transformers
takes fla's kernel too: the kernel itself is held to the torch rule by the first test; skipped
without CUDA).

Tolerances: the fla kernel on float32 inputs against `gated_delta_rule` 2e-3 absolute (fla's
chunked kernels accumulate in float32 but use TF32 matmuls; values of order 1); the bf16 critic's
final hidden states against transformers' float32 2e-2 (bf16 has 8 mantissa bits; hidden states of
order 1 after the final norm). flash-linear-attention must be importable where CUDA is: the device
bundle carries fla-core; without it the test fails rather than skip.
"""

from __future__ import annotations

import pytest

from tests.hf.hf_checkpoints import QWEN3_5_TEXT, make_qwen3_5_checkpoint

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.timeout(600),
]


def test_fla_kernel_equals_the_torch_delta_rule():
    from value_assets.gpu.model.gated_delta import _fla_delta_rule, gated_delta_rule

    kernel = _fla_delta_rule()
    assert kernel is not None, "flash-linear-attention (fla-core) is not importable on this CUDA machine"
    gen = torch.Generator().manual_seed(0)
    lengths, key_heads, ratio, dk, dv = [70, 5, 129, 1], 2, 2, 16, 8
    t = sum(lengths)
    q = torch.nn.functional.normalize(torch.randn(t, key_heads, dk, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(t, key_heads, dk, generator=gen), dim=-1)
    v = torch.randn(t, key_heads * ratio, dv, generator=gen)
    g = -torch.rand(t, key_heads * ratio, generator=gen)
    beta = torch.rand(t, key_heads * ratio, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out, _ = kernel(*(x.cuda()[None] for x in (q, k, v, g, beta)), scale=dk**-0.5, cu_seqlens=cu.cuda())
    want = torch.cat(
        [
            gated_delta_rule(
                q[a:b].repeat_interleave(ratio, 1) * dk**-0.5,
                k[a:b].repeat_interleave(ratio, 1),
                v[a:b],
                g[a:b],
                beta[a:b],
            )
            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)
        ]
    )
    assert (out[0].float().cpu() - want).abs().max().item() < 2e-3


def test_bf16_qwen3_5_critic_on_cuda_matches_transformers(tmp_path):
    from value_assets.core.objective import Objective
    from value_assets.gpu.convert.hf import backbone_config_kwargs, load_hf_backbone_state, read_hf_config
    from value_assets.gpu.model import gpt_critic as m
    from value_assets.gpu.runtime.parallel import destroy, free_port, init_distributed

    hf = make_qwen3_5_checkpoint(tmp_path, redraw=False, seed=1)
    init_distributed(0, 1, "127.0.0.1", free_port())
    try:
        backbone = m.BackboneConfig(**backbone_config_kwargs(read_hf_config(tmp_path)))
        critic = m.build_critic(backbone, Objective(loss_type="mse"), bf16=True).eval()
        state = {k: v.to(torch.bfloat16) for k, v in load_hf_backbone_state(tmp_path).items()}
        critic.load_state_dict(state, strict=False)

        class Hidden(torch.nn.Module):
            def forward(self, hidden, weight=None, runtime_gather_output=None):
                return hidden.float(), None

        critic.output_layer = Hidden()
        lengths = [70, 5, 33]
        tokens = torch.randint(
            0, QWEN3_5_TEXT["vocab_size"], (sum(lengths),), generator=torch.Generator().manual_seed(2)
        )
        pos = torch.cat([torch.arange(n) for n in lengths])
        cu = torch.tensor([0, 70, 75, 108], dtype=torch.int32)
        with torch.no_grad():
            got = m.critic_forward(critic, tokens.cuda(), pos.cuda(), cu.cuda(), 70, cu_seqlens_host=cu).cpu()
            # transformers' reference runs on CUDA too: with fla importable, transformers 5.17 (the
            # device image's) hands CPU tensors to fla's Triton kernel (seen on the H100, 2026-12-06:
            # "Pointer argument ... cannot be accessed from Triton (cpu tensor?)").
            hf = hf.cuda()
            want = torch.cat(
                [hf(input_ids=row[None].cuda()).last_hidden_state[0].cpu() for row in tokens.split(lengths)]
            )
    finally:
        destroy()
    assert (got - want).abs().max().item() < 2e-2
