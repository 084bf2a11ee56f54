"""Vectorized RoPE for packed ('thd') micro-batches.

Megatron's packed RoPE without Transformer Engine (`rope_utils._apply_rotary_pos_emb_thd`) calls
`cu_seqlens.tolist()` and loops over the sequences in Python, for q and for k in every layer:
a device->host sync plus a few small kernels per sequence. Here RoPE for a packed micro-batch
is instead:

- once per micro-batch: per-token cos / sin gathered from a cached table by `position_ids`
  (which restart at 0 for every sequence), [t, 1, d];
- per layer, for q and for k: one rotate-half multiply-add, `x * cos + swap_halves(x) * sin'`
  with sin' = [-sin_lo, sin_hi] (the sign of `rotate_half` folded into the table; negation is exact).

The hook (the same in megatron-core 0.16.1 and 0.19.2, whose `GPTModel._preprocess`,
`RotaryEmbedding.forward` signature and `Attention.forward` RoPE branch agree):

- `GPTModel` builds its `RotaryEmbedding` and calls `self.rotary_pos_emb(seq_len, packed_seq=...,
  cp_group=...)` once per forward; `PackedRotaryEmbedding` (the class swapped onto that module by
  `install`) returns None when `packed_seq` is true, so `Attention.forward` skips its own RoPE
  (`if rotary_pos_emb is not None`). Unpacked forwards are unchanged.
- `value_assets.gpu.model.gpt_critic.packed_seq_params` builds `CriticPackedSeqParams` (a `PackedSeqParams`
  carrying the per-token cos / sin and a host copy of `cu_seqlens`), and `PackedCoreAttention`
  applies `apply_rope` to q and k before attention. Megatron's order is q/k projection ->
  q/k layernorm -> RoPE -> core attention, so applying it first thing in core attention is the same.

Numerics equal megatron's `_apply_rotary_pos_emb_bshd`: cos / sin computed in float32 from the
same `inv_freq` and positions, then cast to the activation dtype (mscale 1 for plain RoPE).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.packed_seq_params import PackedSeqParams

_TABLE_ROUND = 1024  # table rows are allocated in multiples of this (grown on demand, cached)


class PackedRotaryEmbedding(RotaryEmbedding):
    """`RotaryEmbedding` that returns None for packed forwards (RoPE then happens in
    `PackedCoreAttention`), plus a cached float32 cos / signed-sin table for that."""

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group: Any = None):
        if packed_seq:
            return None
        return super().forward(max_seq_len, offset, packed_seq, cp_group)

    def cos_sin_table(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) float32 [L, d] for positions 0..L-1, L >= length."""
        if self.rotary_interleaved:
            raise NotImplementedError("packed RoPE supports rotary_interleaved=False only")
        cached = getattr(self, "_packed_cos_sin", None)
        if cached is not None and cached[0].shape[0] >= length:
            return cached
        n = -(-max(length, 1) // _TABLE_ROUND) * _TABLE_ROUND
        # Plain tensors even when first built under inference_mode / no_grad (they are cached).
        with torch.inference_mode(False), torch.no_grad():
            emb = self.get_emb(n)[:, 0, 0, :]  # float32 [n, d] = cat(freqs, freqs), megatron's
            half = emb.shape[-1] // 2
            sin = torch.sin(emb)
            signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
            self._packed_cos_sin = (torch.cos(emb), signed)
        return self._packed_cos_sin


def install(model: torch.nn.Module) -> None:
    """Make `model.rotary_pos_emb` (a megatron `RotaryEmbedding`) a `PackedRotaryEmbedding` in
    place (same state; the class only adds behaviour)."""
    rope = getattr(model, "rotary_pos_emb", None)
    if rope is None:
        return
    if type(rope) is RotaryEmbedding:
        rope.__class__ = PackedRotaryEmbedding
    elif not isinstance(rope, PackedRotaryEmbedding):
        raise TypeError(f"packed RoPE needs megatron's plain RotaryEmbedding, got {type(rope)}")


def find_rotary(model: torch.nn.Module) -> PackedRotaryEmbedding:
    """The model's `PackedRotaryEmbedding`, through DDP / Float16Module style `.module` wrappers."""
    m = model
    for _ in range(8):
        rope = getattr(m, "rotary_pos_emb", None)
        if isinstance(rope, PackedRotaryEmbedding):
            return rope
        if not hasattr(m, "module"):
            break
        m = m.module
    raise TypeError("model has no PackedRotaryEmbedding: build it with gpu.model.build_critic")


def packed_cos_sin(
    rope: PackedRotaryEmbedding, position_ids: torch.Tensor, max_seqlen: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token float32 (cos, signed sin) [t, 1, d] for position_ids [t] (all < max_seqlen)."""
    cos, sin = rope.cos_sin_table(max_seqlen)
    pos = position_ids.reshape(-1)
    if pos.device != cos.device:
        pos = pos.to(cos.device, non_blocking=True)
    return cos.index_select(0, pos).unsqueeze(1), sin.index_select(0, pos).unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [t, h, d] (any strides); cos / sin_signed [t, 1, r] in x's dtype, r <= d (even).
    Returns x with RoPE on its first r channels: x*cos + rotate_half(x)*sin, as megatron."""
    r = cos.shape[-1]
    d = x.shape[-1]
    xr = x if r == d else x[..., :r]
    # rotate_half(x) = [-x_hi, x_lo]; the sign lives in sin_signed, so only swap the halves.
    swapped = xr.unflatten(-1, (2, r // 2)).flip(-2).flatten(-2)
    out = torch.addcmul(xr * cos, swapped, sin_signed)
    if r != d:
        out = torch.cat((out, x[..., r:]), dim=-1)
    return out


# On CUDA, q's and k's RoPE run as one torch.compile'd kernel each way (the eager `apply_rope` is
# three to four kernels per tensor: the half swap's copy, two multiply(-add)s, the partial-rotary
# concatenation), compiled at the first call with the token count dynamic; if the compiler cannot
# build here, the eager path runs from then on, with one warning (value_assets.gpu). False: the
# eager path everywhere (the bench's same-run comparison). On CPU always eager.
FUSED_ROPE = True


def _rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor):
    return apply_rope(q, cos, sin_signed), apply_rope(k, cos, sin_signed)


_fused_rope_qk = None


def rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rope` on q [t, hq, d] and k [t, hk, d] with the same cos / signed sin [t, 1, r]."""
    global _fused_rope_qk
    if not (FUSED_ROPE and q.is_cuda):
        return _rope_qk(q, k, cos, sin_signed)
    if _fused_rope_qk is None:
        from functools import partial

        import value_assets.gpu as gpu_package  # its deferred-compile wrapper (megatron's jit_fuser)

        _fused_rope_qk = gpu_package._compile_on_first_call(partial(torch.compile, dynamic=True))(_rope_qk)
    return _fused_rope_qk(q, k, cos, sin_signed)


@dataclass
class CriticPackedSeqParams(PackedSeqParams):
    """`PackedSeqParams` (qkv_format 'thd') plus what `PackedCoreAttention` needs without a
    device->host sync: `bounds` (host copy of cu_seqlens) and per-token float32 `rope_cos` /
    `rope_sin` [t, 1, d] (sin with rotate-half's sign folded in), cast per dtype once."""

    bounds: tuple | None = None
    rope_cos: torch.Tensor | None = None
    rope_sin: torch.Tensor | None = None
    _cast: dict = field(default_factory=dict, repr=False, compare=False)

    def rope_for(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        hit = self._cast.get(dtype)
        if hit is None:
            hit = (self.rope_cos.to(dtype), self.rope_sin.to(dtype))
            self._cast[dtype] = hit
        return hit
