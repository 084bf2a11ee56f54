"""Vectorized packed RoPE (`gpu/model/rope.py`) against megatron's per-sequence 'thd' RoPE, on CPU."""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from value_assets.gpu.model.rope import (
    CriticPackedSeqParams,
    PackedRotaryEmbedding,
    apply_rope,
    find_rotary,
    install,
    packed_cos_sin,
)
from value_assets.gpu.runtime import compat

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True, scope="module")
def _cpu_compat():
    compat.apply_cpu_compat()  # RotaryEmbedding puts inv_freq on "the current CUDA device"


class _NoCP:  # a context-parallel group of one, all megatron's thd RoPE asks of it
    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def _rotary(head_dim: int, base: float = 10000.0, percent: float = 1.0) -> PackedRotaryEmbedding:
    holder = torch.nn.Module()
    holder.rotary_pos_emb = RotaryEmbedding(
        kv_channels=head_dim, rotary_percent=percent, rotary_base=base, use_cpu_initialization=True
    )
    install(holder)
    install(holder)  # idempotent
    assert find_rotary(holder) is holder.rotary_pos_emb
    return holder.rotary_pos_emb


@pytest.mark.parametrize(
    "dtype,heads,head_dim,percent,base,tol",
    [
        (torch.float32, 4, 16, 1.0, 10000.0, 1e-6),
        (torch.float32, 2, 128, 1.0, 1000000.0, 1e-6),
        (torch.float32, 3, 32, 0.5, 10000.0, 1e-6),
        (torch.bfloat16, 4, 64, 1.0, 1000000.0, 1e-2),
    ],
)
def test_vectorized_rope_equals_megatron_per_sequence_thd(dtype, heads, head_dim, percent, base, tol):
    g = torch.Generator().manual_seed(3)
    lens = [7, 1, 33, 12, 2, 20]
    t = sum(lens)
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(lens), 0).tolist()], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lens])
    rope = _rotary(head_dim, base, percent)
    # megatron: freqs [max_seqlen, 1, 1, r] (what GPTModel passes), looped per sequence
    freqs = RotaryEmbedding.forward(rope, max(lens))
    cos, sin = packed_cos_sin(rope, pos, max(lens))
    assert cos.shape == sin.shape == (t, 1, freqs.shape[-1]) and cos.dtype == torch.float32
    for n_heads in (heads, 1):  # q and (GQA) k shapes
        x = torch.randn(t, n_heads, head_dim, generator=g).to(dtype)
        # a non-contiguous view, as q/k are views of the fused qkv projection
        wide = torch.randn(t, n_heads, 3 * head_dim, generator=g).to(dtype)
        wide[..., head_dim : 2 * head_dim] = x
        xv = wide[..., head_dim : 2 * head_dim]
        ref = _apply_rotary_pos_emb_thd(x, cu, freqs, cp_group=_NoCP())
        got = apply_rope(xv, cos.to(dtype), sin.to(dtype))
        assert got.dtype == dtype and got.shape == x.shape
        torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


def test_packed_rotary_embedding_is_off_for_packed_forwards_only():
    rope = _rotary(16)
    assert rope(8, packed_seq=True) is None
    emb = rope(8)
    assert emb.shape == (8, 1, 1, 16)
    torch.testing.assert_close(emb, RotaryEmbedding.get_emb(rope, 8))
    cos, sin = rope.cos_sin_table(5)
    assert cos.shape[0] >= 5 and not cos.requires_grad
    assert rope.cos_sin_table(3)[0] is cos  # cached, grown only when needed
    torch.testing.assert_close(cos[:8], torch.cos(emb[:, 0, 0]))
    torch.testing.assert_close(sin[:8, 8:], torch.sin(emb[:, 0, 0, 8:]))
    torch.testing.assert_close(sin[:8, :8], -torch.sin(emb[:, 0, 0, :8]))


def test_critic_packed_seq_params_casts_once_per_dtype():
    p = CriticPackedSeqParams(
        qkv_format="thd", bounds=(0, 2), rope_cos=torch.ones(2, 1, 4), rope_sin=torch.zeros(2, 1, 4)
    )
    a = p.rope_for(torch.bfloat16)
    assert a[0].dtype == torch.bfloat16 and p.rope_for(torch.bfloat16)[0] is a[0]
