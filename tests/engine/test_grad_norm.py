"""The sync-free gradient norm megatron's clipping uses here (gpu/runtime/grad_norm.py)."""

from __future__ import annotations

import math

import pytest
import torch

import value_assets.gpu  # noqa: F401  (before megatron, as every process of the job)
from value_assets.gpu.runtime import grad_norm

pytestmark = pytest.mark.unit


def test_foreach_l2_norm_matches_the_naive_float64_norm():
    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(3, generator=g),
        torch.randn(40, 25, generator=g) * 1e-3,
        torch.randn(7, generator=g).to(torch.bfloat16),
        torch.zeros(5),
    ]
    naive = math.sqrt(sum(float(x) ** 2 for t in tensors for x in t.double().reshape(-1)))
    total, extra = grad_norm.foreach_l2_norm(65536, None, [tensors], False)
    assert extra is None and total.dtype == torch.float32 and total.shape == (1,)
    assert float(total[0]) == pytest.approx(naive, rel=1e-6)
    # megatron's own fallback agrees (it reads every norm back to the host)
    from megatron.core.utils import local_multi_tensor_l2_norm

    if torch.cuda.is_available():
        assert float(local_multi_tensor_l2_norm(65536, None, [tensors], False)[0]) == pytest.approx(naive, rel=1e-6)
    with pytest.raises(NotImplementedError):
        grad_norm.foreach_l2_norm(65536, None, [tensors], True)


def test_install_replaces_only_megatrons_local_fallback(monkeypatch):
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    monkeypatch.setattr(clip_grads, "l2_norm_impl", utils.local_multi_tensor_l2_norm)
    assert grad_norm.install() and clip_grads.l2_norm_impl is grad_norm.foreach_l2_norm
    assert grad_norm.install() and clip_grads.l2_norm_impl is grad_norm.foreach_l2_norm  # idempotent

    def apex_kernel(*a):
        return None

    monkeypatch.setattr(clip_grads, "l2_norm_impl", apex_kernel)  # Apex / Transformer Engine present
    assert not grad_norm.install() and clip_grads.l2_norm_impl is apex_kernel
