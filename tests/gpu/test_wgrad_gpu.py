"""GPU tier: weight gradients accumulated into megatron's fp32 main_grad by the GEMM
(gpu/model/wgrad.py, megatron's `gradient_accumulation_fusion`); skipped without CUDA.

Bars, fixed before the first CUDA run:
- the kernel (bf16 inputs, fp32 buffer, two micro-batches of up to 17,000 tokens): within 1e-4 of
  max|ref| of the float64 sum of the same bf16 values (fp32 accumulation), and no further from it
  than megatron's unfused path (a bf16 gradient per micro-batch, then added in fp32);
- a training step of a bf16 critic over three packed micro-batches, fused against unfused, the
  same weights and rows: the same loss (the forward is the same code), and every weight's main_grad
  within 2^-7 of its max|main_grad| of the unfused one (the unfused path rounds each micro-batch's
  gradient to bf16); 30 fused steps halve the loss, as test_gpu's unfused critic does.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu.gpu_helpers import two_task_rows

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.timeout(600),
]


def test_the_fused_accumulation_is_at_least_as_close_to_the_float64_sum_as_megatrons_unfused_one():
    import warnings

    from value_assets.gpu.model import wgrad

    warnings.simplefilter("error", RuntimeWarning)  # a fallback to the unfused sum warns: fail instead
    gen = torch.Generator().manual_seed(0)
    shape = (1536, 8960)  # the 1.5B's down projection, [out, in] as megatron stores its weight
    fused = torch.zeros(shape, device="cuda")
    unfused = torch.zeros(shape, device="cuda")
    ref = torch.zeros(shape, dtype=torch.float64, device="cuda")
    for tokens in (17000, 4096):
        x = torch.randn(tokens, shape[1], generator=gen).to("cuda", torch.bfloat16)
        g = torch.randn(tokens, shape[0], generator=gen).to("cuda", torch.bfloat16)
        wgrad.wgrad_gemm_accum_fp32(x, g, fused)
        unfused.add_(g.t().matmul(x))  # bf16 grad (megatron's wgrad GEMM), then DDP's fp32 add
        ref += g.double().t() @ x.double()
    scale = ref.abs().max().item()
    err_fused = (fused.double() - ref).abs().max().item()
    err_unfused = (unfused.double() - ref).abs().max().item()
    assert err_fused <= 1e-4 * scale, (err_fused, scale)
    assert err_fused <= err_unfused, (err_fused, err_unfused)
    assert wgrad._dtype_gemm is True  # torch's fp32-output GEMM ran


def test_a_fused_training_step_matches_the_unfused_one_and_the_critic_learns(monkeypatch):
    from value_assets.core.objective import Objective
    from value_assets.gpu.model import wgrad
    from value_assets.gpu.model.gpt_critic import BackboneConfig, build_critic
    from value_assets.gpu.model.packing import pack_rows
    from value_assets.gpu.runtime.parallel import destroy, init_distributed
    from value_assets.gpu.runtime.step import optimizer_step, wrap_for_training

    init_distributed(0, 1, "127.0.0.1", 0)
    try:
        obj = Objective()
        backbone = BackboneConfig.tiny(hidden_size=256, ffn_hidden_size=512)
        rows = two_task_rows()
        batches = pack_rows(rows, 512)
        assert len(batches) >= 3  # several micro-batches accumulate into one main_grad
        models = {}
        for fused in (False, True):
            monkeypatch.setattr(wgrad, "FUSED_WGRAD", fused)
            models[fused] = build_critic(backbone, obj)
            assert models[fused].config.gradient_accumulation_fusion is fused
        models[True].load_state_dict(models[False].state_dict())  # the same weights
        built = {}
        for fused, model in models.items():
            ddp, opt = wrap_for_training(model, lr=2e-3, weight_decay=0.0, clip_grad=1.0)
            metrics = optimizer_step(ddp, opt, batches, 32, obj)
            grads = {n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters() if p.requires_grad}
            built[fused] = (ddp, opt, metrics, grads)
        (_, _, m0, g0), (ddp, opt, m1, g1) = built[False], built[True]
        assert m1["loss"] == pytest.approx(m0["loss"], rel=1e-6)
        assert g0.keys() == g1.keys()
        fused_linear = 0
        for name, a in g0.items():
            b = g1[name]
            bound = 2.0**-7 * a.abs().max().item() + 1e-12
            assert (b - a).abs().max().item() <= bound, (name, (b - a).abs().max().item(), bound)
            fused_linear += "linear" in name
        assert fused_linear > 0
        losses = [m1["loss"]]
        for _ in range(29):
            losses.append(optimizer_step(ddp, opt, pack_rows(rows, 512), 32, obj)["loss"])
            assert np.isfinite(losses[-1])
        assert losses[-1] < 0.5 * losses[0], losses
    finally:
        destroy()
