"""GPU tier: the compiled RoPE of q and k (rope.rope_qk on CUDA) against the eager `apply_rope`
and a float64 reference, forward and backward, at several token counts (dynamic shapes: no
recompilation error, no fallback warning), full and partial rotary; skipped without CUDA.

Bar, fixed before the first CUDA run: in bf16 the compiled kernel rounds once where the eager path
rounds each of its two products, so each may sit up to about one bf16 rounding (2^-8 relative)
from the float64 reference: both must be within 2 * 2^-8 * max|x| of it, and the compiled path no
further from it than the eager one plus 2^-8 * max|x|; gradients within 2 * 2^-8 of eager,
relative to 2 max|g| (the bound of |dx|). In float32: within 1e-5 of eager.
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


def _inputs(t, hq, hk, d, r, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, hq + 2 * hk, d, generator=gen).to("cuda", dtype)
    q, k, _ = qkv.split([hq, hk, hk], dim=1)  # non-contiguous views, as megatron's qkv split gives
    ang = torch.rand(t, 1, r // 2, generator=gen, dtype=torch.float64) * 50
    emb = torch.cat((ang, ang), dim=-1)
    half = r // 2
    sin = torch.sin(emb)
    signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return q, k, torch.cos(emb), signed


@pytest.mark.parametrize("r", [128, 32])  # full rotary, partial (Qwen3.5's 0.25)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_rope_equals_eager_and_the_float64_rule(r, dtype):
    from value_assets.gpu.model import rope

    assert rope.FUSED_ROPE
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a compile fallback warns: fail instead
        for seed, t in enumerate([37, 4096, 1000, 12288]):
            q, k, cos64, sin64 = _inputs(t, 12, 2, 128, r, dtype, seed)
            cos, sin = cos64.to("cuda", dtype), sin64.to("cuda", dtype)
            q.requires_grad_(True)
            k.requires_grad_(True)
            fused = rope.rope_qk(q, k, cos, sin)
            eager = rope._rope_qk(q, k, cos, sin)
            ref = (
                rope.apply_rope(q.double(), cos.double(), sin.double()),
                rope.apply_rope(k.double(), cos.double(), sin.double()),
            )
            g = [torch.randn_like(x) for x in fused]
            grads_f = torch.autograd.grad(fused, (q, k), g)
            grads_e = torch.autograd.grad(eager, (q, k), g)
            for a, b, c, x in zip(fused, eager, ref, (q, k), strict=True):
                scale = x.detach().abs().max().item()
                if dtype == torch.float32:
                    assert (a - b).abs().max().item() <= 1e-5 * scale
                else:
                    ulp = 2.0**-8 * scale
                    err_f, err_e = ((y.double() - c).abs().max().item() for y in (a, b))
                    assert err_f <= 2 * ulp and err_e <= 2 * ulp, (t, err_f, err_e, ulp)
                    assert err_f <= err_e + ulp, (t, err_f, err_e)
            for a, b, gg in zip(grads_f, grads_e, g, strict=True):  # |dx| <= 2 max|g|
                tol = (1e-5 if dtype == torch.float32 else 2 * 2.0**-8) * 2 * gg.abs().max().item()
                assert (a - b).abs().max().item() <= tol, (t, (a - b).abs().max().item(), tol)
