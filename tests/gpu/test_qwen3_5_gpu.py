"""GPU tier, Qwen3.5: flash-linear-attention's kernel against the torch delta rule, and the
Qwen3.5 critic on CUDA, in float32 and in bf16, against transformers' Qwen3.5, also on CUDA (where
transformers takes fla's kernel too: the kernel itself is held to the torch rule by the first test;
skipped without CUDA).

Tolerances: the fla kernel on float32 inputs against `gated_delta_rule` 2e-3 absolute (fla's
chunked kernels accumulate in float32 but use TF32 matmuls; values of order 1); the critic's bars
are in its test's docstring. flash-linear-attention must be importable where CUDA is: the device
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


def _critic_hidden_states(folder, tokens, lengths, *, bf16):
    from value_assets.core.objective import Objective
    from value_assets.gpu.convert.hf import backbone_config_kwargs, load_hf_backbone_state, read_hf_config
    from value_assets.gpu.model import gpt_critic as m
    from value_assets.gpu.runtime.parallel import destroy, init_distributed

    init_distributed(0, 1, "127.0.0.1", 0)
    try:
        backbone = m.BackboneConfig(**backbone_config_kwargs(read_hf_config(folder)))
        critic = m.build_critic(backbone, Objective(loss_type="mse"), bf16=bf16).eval().cuda()
        dtype = torch.bfloat16 if bf16 else torch.float32
        state = {k: v.to(dtype) for k, v in load_hf_backbone_state(folder).items()}
        critic.load_state_dict(state, strict=False)

        class Hidden(torch.nn.Module):
            def forward(self, hidden, weight=None, runtime_gather_output=None):
                return hidden.float(), None

        critic.output_layer = Hidden()
        pos = torch.cat([torch.arange(n) for n in lengths])
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        with torch.no_grad():
            return m.critic_forward(
                critic, tokens.cuda(), pos.cuda(), cu.cuda(), max(lengths), cu_seqlens_host=cu
            ).cpu()
    finally:
        destroy()


def test_qwen3_5_critic_on_cuda_matches_transformers_float32_and_bf16(tmp_path):
    """Both implementations on CUDA, both taking fla's kernels for the delta rule.

    Bars, fixed before the first comparison was seen (2026-12-06; the bf16 critic had been held to
    a flat 2e-2 against transformers' float32 and measured 0.034 on an H100, which could not tell a
    fault from bf16 rounding):
    - float32 critic against transformers' float32: 5e-3 absolute (fla's chunked kernels use TF32
      matmuls, about 1e-3 relative per use; four layers; hidden states of order 1 after the norm).
      A wrong layer, gate, norm or rotary would be off by far more.
    - bf16 critic against transformers' float32: at most twice transformers' own bf16 model's
      error against its float32 (the same weights rounded to bf16, the same kernels), plus 2e-3.
      A bf16 critic no worse than transformers' bf16 is what a user of either gets.
    """
    import copy

    hf = make_qwen3_5_checkpoint(tmp_path, redraw=False, seed=1)
    lengths = [70, 5, 33]
    tokens = torch.randint(0, QWEN3_5_TEXT["vocab_size"], (sum(lengths),), generator=torch.Generator().manual_seed(2))
    ours32 = _critic_hidden_states(tmp_path, tokens, lengths, bf16=False)
    ours16 = _critic_hidden_states(tmp_path, tokens, lengths, bf16=True)
    # transformers runs on CUDA: with fla importable, transformers 5.17 (the device image's) hands
    # CPU tensors to fla's Triton kernel (seen on the H100, 2026-12-06: "Pointer argument ...
    # cannot be accessed from Triton (cpu tensor?)").
    hf32 = hf.cuda()
    hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
    with torch.no_grad():
        ref32, ref16 = (
            torch.cat(
                [model(input_ids=row[None].cuda()).last_hidden_state[0].float().cpu() for row in tokens.split(lengths)]
            )
            for model in (hf32, hf16)
        )
    err32 = (ours32 - ref32).abs().max().item()
    err16 = (ours16 - ref32).abs().max().item()
    hf_err16 = (ref16 - ref32).abs().max().item()
    print(
        f"max abs against transformers' float32: critic float32 {err32:.2e}, critic bf16 {err16:.2e},"
        f" transformers bf16 {hf_err16:.2e}"
    )
    assert err32 < 5e-3
    assert err16 <= 2 * hf_err16 + 2e-3
