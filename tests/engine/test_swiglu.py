"""The Triton SwiGLU's routing into megatron's MLP (gpu/model/swiglu.py): which inputs take the
kernels and which go to megatron's own `SwiGLUFunction`, and that installing twice keeps megatron's
class behind the dispatch. The kernels' numerics (CUDA) are tests/gpu/test_swiglu_gpu.py."""

from __future__ import annotations

import pytest
import torch

import value_assets.gpu  # noqa: F401  (before megatron, as every process of the job)
from value_assets.gpu.model import swiglu

pytestmark = pytest.mark.unit


def test_install_twice_keeps_megatrons_class_behind_the_dispatch():
    from megatron.core.fusions import fused_bias_swiglu as mf

    swiglu.install()
    swiglu.install()  # a second build_critic in the same process
    assert mf.SwiGLUFunction is swiglu.SwiGLUDispatch
    behind = swiglu.SwiGLUDispatch.megatron_function
    assert behind is not swiglu.SwiGLUDispatch and issubclass(behind, torch.autograd.Function)
    assert behind.__module__ == "megatron.core.fusions.fused_bias_swiglu"


def test_cpu_and_odd_inputs_are_not_eligible_and_go_to_megatron(monkeypatch):
    calls = []

    class Megatron:  # records what the dispatch hands to megatron's class
        @staticmethod
        def apply(y, fp8, offload):
            calls.append((tuple(y.shape), fp8, offload))
            return y[:, : y.shape[1] // 2]

    monkeypatch.setattr(swiglu.SwiGLUDispatch, "megatron_function", Megatron)
    y = torch.randn(5, 8)
    assert not swiglu.eligible(y)  # CPU
    swiglu.SwiGLUDispatch.apply(y, False, False)
    swiglu.SwiGLUDispatch.apply(y, True, False)
    assert calls == [((5, 8), False, False), ((5, 8), True, False)]
    assert swiglu.TRITON_SWIGLU  # on by default: it passed the GPU tier and paid in the bench
    if torch.cuda.is_available():
        monkeypatch.setattr(swiglu, "TRITON_SWIGLU", True)
        cuda = torch.randn(6, 8, device="cuda", dtype=torch.bfloat16)
        assert swiglu.eligible(cuda)
        assert not swiglu.eligible(cuda[:, :6])  # not contiguous
        assert not swiglu.eligible(torch.randn(6, 7, device="cuda"))  # odd width
        assert not swiglu.eligible(cuda.double())
        monkeypatch.setattr(swiglu, "TRITON_SWIGLU", False)
        assert not swiglu.eligible(cuda)
