"""GPU tier: the Triton SwiGLU (gpu/model/swiglu.py) against megatron's compiled one and a float64
rule, forward and backward through megatron's `bias_swiglu_impl` as its MLP calls it, at several
token counts and widths (a width that is not a multiple of the block, the 0.5B's and the 1.5B's);
skipped without CUDA.

Bar, fixed before the first CUDA run: both kernels compute in float32 and round once, so in bf16
each output is within one rounding (2^-8 relative) of the float64 value, plus 1e-6 * max|ref| for
float32 cancellation in the backward's `1 + a (1 - sigmoid(a))`; the Triton output no further than
one bf16 ulp (2^-7 relative) from megatron's. In float32: within 1e-5 relative (+ 1e-6 * max|ref|)
of the float64 value. The kernels must have run (no fallback warning, both launched).
"""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.timeout(600),
]


def _within(got, ref, rel):
    ref = ref.double()
    bound = rel * ref.abs() + 1e-6 * ref.abs().max()
    excess = ((got.double() - ref).abs() - bound).max().item()
    return excess <= 0, excess


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_swiglu_equals_megatrons_and_the_float64_rule(dtype, monkeypatch):
    from megatron.core.fusions import fused_bias_swiglu as mf

    import value_assets.gpu  # noqa: F401
    from value_assets.gpu.model import swiglu

    swiglu.install()
    monkeypatch.setattr(swiglu, "TRITON_SWIGLU", True)  # the default; set here so the test holds if it changes
    megatron_cls = swiglu.SwiGLUDispatch.megatron_function
    rel = 2.0**-8 if dtype == torch.bfloat16 else 1e-5
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback warns: fail instead
        for seed, (t, i) in enumerate([(37, 1000), (4096, 4864), (1000, 8960), (17000, 8960)]):
            gen = torch.Generator().manual_seed(seed)
            y0 = (torch.randn(t, 2 * i, generator=gen) * 3).to("cuda", dtype)
            g = torch.randn(t, i, generator=gen).to("cuda", dtype)
            y = y0.clone().requires_grad_(True)
            ours = mf.bias_swiglu_impl(y, None)  # megatron's entry, through the dispatch
            (d_ours,) = torch.autograd.grad(ours, y, g)
            ym = y0.clone().requires_grad_(True)
            theirs = megatron_cls.apply(ym, False, False)
            (d_theirs,) = torch.autograd.grad(theirs, ym, g)
            a, b = y0.double().chunk(2, -1)
            s = torch.sigmoid(a)
            ref = a * s * b
            d_ref = torch.cat((g.double() * s * (1 + a * (1 - s)) * b, g.double() * a * s), -1)
            for name, got, want in (("forward", ours, ref), ("backward", d_ours, d_ref)):
                ok, excess = _within(got, want, rel)
                assert ok, (name, t, i, dtype, excess)
                assert got.dtype == dtype and got.shape == want.shape
            if dtype == torch.bfloat16:
                for name, got, other in (("forward", ours, theirs), ("backward", d_ours, d_theirs)):
                    ok, excess = _within(got, other, 2.0**-7)
                    assert ok, (name, "vs megatron", t, i, excess)
    assert swiglu._launched == {0, 1}
