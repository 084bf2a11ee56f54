"""gpu/model/wgrad.py, the stand-in for Apex's `fused_weight_gradient_mlp_cuda`: its accumulation
against a float64 reference, and megatron's own linear backward (the code its
`gradient_accumulation_fusion` runs) calling it once installed, on CPU. The CUDA path (cuBLAS with
an fp32 output from bf16 inputs) and a training step with it: tests/gpu/test_wgrad_gpu.py.

Bars: fp32 inputs within 1e-5 relative of the float64 sum (fp32 rounding over <= 64 terms); bf16
inputs: the float64 sum of the same bf16 values within 1e-5 relative (the products are exact in
fp32, only the fp32 accumulation rounds)."""

from __future__ import annotations

import pytest
import torch

from value_assets.gpu.model import wgrad

pytestmark = pytest.mark.unit


def _close(got, ref, rel=1e-5):
    return ((got.double() - ref).abs() <= rel * ref.abs().max()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accumulates_grad_output_t_times_input_into_fp32_main_grad(dtype):
    gen = torch.Generator().manual_seed(0)
    main = torch.randn(24, 40, generator=gen)
    start = main.double().clone()
    ref = start.clone()
    for tokens in (17, 64):  # two micro-batches add up
        x = torch.randn(tokens, 40, generator=gen).to(dtype)
        g = torch.randn(tokens, 24, generator=gen).to(dtype)
        wgrad.wgrad_gemm_accum_fp32(x, g, main)
        ref += g.double().t() @ x.double()
    assert main.dtype == torch.float32
    assert _close(main, ref)
    assert not _close(main, start)  # it did add


def test_three_dimensional_inputs_are_flattened_over_their_leading_dimensions():
    gen = torch.Generator().manual_seed(1)
    x, g = torch.randn(5, 3, 8, generator=gen), torch.randn(5, 3, 6, generator=gen)
    main = torch.zeros(6, 8)
    wgrad.wgrad_gemm_accum_fp32(x, g, main)
    assert _close(main, g.double().reshape(15, 6).t() @ x.double().reshape(15, 8))


def test_the_fp32_entry_refuses_another_main_grad_dtype_and_the_fp16_entry_keeps_its_dtype():
    x, g = torch.randn(4, 8), torch.randn(4, 6)
    with pytest.raises(TypeError, match="main_grad must be float32"):
        wgrad.wgrad_gemm_accum_fp32(x, g, torch.zeros(6, 8, dtype=torch.bfloat16))
    main = torch.zeros(6, 8, dtype=torch.bfloat16)
    wgrad.wgrad_gemm_accum_fp16(x.bfloat16(), g.bfloat16(), main)
    assert main.dtype == torch.bfloat16
    assert _close(main.float(), g.bfloat16().double().t() @ x.bfloat16().double(), rel=2.0**-7)


def _linear_args(x, weight):
    """megatron's linear autograd function's arguments, by name: the fusion on, no tensor or sequence
    parallelism (0.19 adds `gtp_remat_size`, 1: off). A name not listed fails here, so a new
    megatron argument is looked at, not guessed."""
    import inspect

    from megatron.core.tensor_parallel import layers

    known = {
        "input": x,
        "weight": weight,
        "bias": None,
        "gradient_accumulation_fusion": True,
        "allreduce_dgrad": False,
        "sequence_parallel": False,
        "grad_output_buffer": None,
        "wgrad_deferral_limit": 0,
        "tp_group": None,
        "gtp_remat_size": 1,
    }
    names = list(inspect.signature(layers.LinearWithGradAccumulationAndAsyncCommunication.forward).parameters)[1:]
    assert set(names) <= set(known), set(names) - set(known)
    return [known[n] for n in names]


def test_megatrons_linear_backward_accumulates_through_it_and_hands_back_no_weight_grad(monkeypatch):
    from megatron.core.tensor_parallel import layers

    monkeypatch.delattr(layers, "fused_weight_gradient_mlp_cuda", raising=False)
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", False)
    wgrad.install()
    assert layers.fused_weight_gradient_mlp_cuda is wgrad.EXTENSION and layers._grad_accum_fusion_available
    wgrad.install()  # idempotent
    assert layers.fused_weight_gradient_mlp_cuda is wgrad.EXTENSION

    gen = torch.Generator().manual_seed(2)
    weight = torch.nn.Parameter(torch.randn(6, 8, generator=gen))
    weight.main_grad = torch.zeros(6, 8)  # megatron's DDP buffer view
    ref = torch.zeros(6, 8, dtype=torch.float64)
    for tokens in (5, 9):
        x = torch.randn(tokens, 1, 8, generator=gen, requires_grad=True)  # [s, b, h], as megatron's layers pass it
        g = torch.randn(tokens, 1, 6, generator=gen)
        out = layers.LinearWithGradAccumulationAndAsyncCommunication.apply(*_linear_args(x, weight))
        out.backward(g)
        ref += g.double().reshape(-1, 6).t() @ x.detach().double().reshape(-1, 8)
        assert torch.allclose(x.grad, g @ weight.detach(), atol=1e-6)  # the input gradient as before
    assert weight.grad is None  # nothing for DDP's hook to add: the GEMM added it
    assert _close(weight.main_grad, ref)


def test_without_the_fp32_output_gemm_it_warns_once_and_adds_the_unfused_product(monkeypatch):
    # torch's bf16-in, fp32-out GEMM (aten::addmm.dtype) has no CPU kernel: the fallback path of a
    # torch without it, run here for real.
    monkeypatch.setattr(wgrad, "_dtype_gemm", None)
    gen = torch.Generator().manual_seed(3)
    x, g = torch.randn(7, 8, generator=gen).bfloat16(), torch.randn(7, 6, generator=gen).bfloat16()
    main = torch.ones(6, 8)
    with pytest.warns(RuntimeWarning, match="fp32-output GEMM is not available here"):
        wgrad._fp32_output_gemm(main, g, x)
    assert wgrad._dtype_gemm is False
    assert torch.equal(main, torch.ones(6, 8) + torch.mm(g.t(), x))  # megatron's unfused numerics
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wgrad._fp32_output_gemm(main, g, x)  # no second warning, no second try
    # once the GEMM has run, a failure is a real one and is raised
    monkeypatch.setattr(wgrad, "_dtype_gemm", True)
    with pytest.raises(RuntimeError):
        wgrad._fp32_output_gemm(main, g, x)


def test_off_by_default_and_never_on_cpu(monkeypatch):
    from value_assets.core.backbone import BackboneConfig
    from value_assets.gpu.model.gpt_critic import transformer_config

    assert not wgrad.FUSED_WGRAD  # off until it has passed the GPU tier and paid in the bench
    assert not transformer_config(BackboneConfig.tiny()).gradient_accumulation_fusion
    monkeypatch.setattr(wgrad, "FUSED_WGRAD", True)
    assert wgrad.enabled(cuda=True) and not wgrad.enabled(cuda=False)
    assert transformer_config(BackboneConfig.tiny()).gradient_accumulation_fusion is torch.cuda.is_available()
