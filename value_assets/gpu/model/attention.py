"""Core attention for megatron's local layer spec, on PyTorch fused kernels, with packed sequences.

`PackedCoreAttention` replaces `DotProductAttention` in `get_gpt_layer_local_spec()`. Megatron
0.16.1 hands core attention:

- unpacked ('sbhd'): query [s, b, np, hn], key/value [s, b, ng, hn]; we run causal SDPA;
- packed ('thd', `PackedSeqParams` given to `GPTModel.forward`): the attention module squeezes the
  dummy batch dim, so query is [t, np, hn] and key/value [t, ng, hn] for t packed tokens, with
  `cu_seqlens_q/kv` (int32 [n+1]) marking sequence starts. Megatron's own packed RoPE is
  switched off for the critic (`rope.PackedRotaryEmbedding`); the `CriticPackedSeqParams` built
  by `model.critic_forward` carry per-token cos / sin (positions restart at 0 per sequence) and
  we apply RoPE to q and k here, vectorized (`rope.apply_rope`), then attention that is causal
  within each sequence and blind across sequences. They also carry a host copy of cu_seqlens
  (`bounds`) and `max_seqlen_q`, so no layer reads cu_seqlens back from the device.

Kernels: on CUDA with bf16/fp16, `torch.nn.attention.varlen.varlen_attn` (flash-attention varlen:
no compute on other sequences or padding), except for sequences of at least `LONG_SEQUENCE`
tokens, which get one SDPA call each on cuDNN's attention (measured on an H200, 1.5B critic heads,
forward + backward: 1.5x varlen at 8k tokens, 1.75x at 16k-32k, equal at 4k (the threshold), slower below;
`bench/attention_kernels.py`); where cuDNN does not take the call, varlen runs it. Everywhere
else (CPU, fp32) one causal SDPA call per packed sequence: exact, no cross-sequence compute, deterministic on CPU;
the Python loop costs one kernel launch per sequence, which is negligible at critic batch sizes on CPU.
Output is [s, b, np*hn] (unpacked) or [t, np*hn] (packed). Dropout is not supported (a critic
is pretrained with attention dropout 0); GQA is handled without materialising repeated K/V where
the kernel allows.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide
from torch.nn.attention import SDPBackend, sdpa_kernel

from value_assets.gpu.model.rope import rope_qk

# Sequences at least this long go to cuDNN's attention on CUDA (see the module docstring).
LONG_SEQUENCE = 4096


@functools.cache
def _varlen_kernel() -> tuple[Any, frozenset[str]]:
    """torch.nn.attention.varlen.varlen_attn and its parameter names, or (None, {}) on an older
    torch. Imported on first use: the module imports torch._dynamo (~0.5 s of CPU), which a CPU
    process never needs."""
    try:  # torch >= 2.9
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # pragma: no cover - older torch
        return None, frozenset()
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def packed_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    *,
    bounds: Sequence[int] | None = None,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    """Causal attention within each packed sequence, none across.

    q [t, nq, d], k/v [t, nkv, d] (nq % nkv == 0), cu_seqlens int [n+1] with cu_seqlens[0] == 0
    and cu_seqlens[-1] == t. `bounds`: the same values on the host (else read back from
    cu_seqlens: a device sync); `max_seqlen`: the longest sequence (else from bounds).
    Returns [t, nq, d] in q's dtype.
    """
    if bounds is None:
        bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != q.shape[0]:
        raise ValueError(f"cu_seqlens must run from 0 to {q.shape[0]}, got {list(bounds)}")
    nq, nkv = q.shape[1], k.shape[1]
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and _varlen_kernel()[0] is not None:
        bounds = [int(b) for b in bounds]
        if max_seqlen is None:
            max_seqlen = max(b - a for a, b in pairwise(bounds))
        if max_seqlen < LONG_SEQUENCE:
            return _varlen(q, k, v, cu_seqlens, max_seqlen, scale)
        outs = []
        for kind, run in kernel_spans(bounds, LONG_SEQUENCE):
            if kind == "varlen":
                outs.append(_varlen_span(q, k, v, run, scale))
            else:
                a, b = run
                outs.append(_long_sequence(q[a:b], k[a:b], v[a:b], scale))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
    outs = []
    for a, b in pairwise(bounds):
        # SDPA wants [batch, heads, seq, dim]
        qs = q[a:b].transpose(0, 1).unsqueeze(0)
        ks = k[a:b].transpose(0, 1).unsqueeze(0)
        vs = v[a:b].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=nq != nkv)
        outs.append(o.squeeze(0).transpose(0, 1))
    return torch.cat(outs, dim=0)


def kernel_spans(bounds: Sequence[int], long: int) -> list[tuple[str, list[int]]]:
    """Split packed sequences (host `bounds`, [0, ..., t]) into the calls that run them, in order:
    ("varlen", [a, ..., b]) for a run of consecutive sequences shorter than `long` (their bounds),
    ("long", [a, b]) for each sequence of at least `long` tokens."""
    spans: list[tuple[str, list[int]]] = []
    run = [bounds[0]]
    for a, b in pairwise(bounds):
        if b - a < long:
            run.append(b)
            continue
        if len(run) > 1:
            spans.append(("varlen", run))
        spans.append(("long", [a, b]))
        run = [b]
    if len(run) > 1:
        spans.append(("varlen", run))
    return spans


def _varlen(q, k, v, cu_seqlens, max_len: int, scale: float) -> torch.Tensor:
    varlen_attn, params = _varlen_kernel()
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    nq, nkv = q.shape[1], k.shape[1]
    kwargs: dict[str, Any] = {"scale": scale}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    if nq != nkv:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k = k.repeat_interleave(nq // nkv, dim=1)
            v = v.repeat_interleave(nq // nkv, dim=1)
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)


def _varlen_span(q, k, v, run: Sequence[int], scale: float) -> torch.Tensor:
    """varlen over the consecutive sequences whose host bounds are `run` (absolute offsets)."""
    a, b = run[0], run[-1]
    cu = torch.tensor([x - a for x in run], dtype=torch.int32).to(q.device, non_blocking=True)
    return _varlen(q[a:b], k[a:b], v[a:b], cu, max(y - x for x, y in pairwise(run)), scale)


def _long_sequence(q, k, v, scale: float) -> torch.Tensor:
    """One long sequence [s, heads, d] on cuDNN's attention; varlen where cuDNN refuses it."""
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            o = F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
            )
    except RuntimeError:  # no cuDNN kernel for this case (GPU, head size, dtype)
        cu = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
        return _varlen(q, k, v, cu, q.shape[0], scale)
    return o.squeeze(0).transpose(0, 1)


class PackedCoreAttention(MegatronModule):
    """Drop-in for megatron's `DotProductAttention` (same constructor and forward signature)."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("PackedCoreAttention does not support context parallelism")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout != 0.0:
            raise ValueError(f"PackedCoreAttention needs attention_dropout 0, got {dropout}")
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"PackedCoreAttention is causal only, got {attn_mask_type}")
        tp = config.tensor_model_parallel_size
        head_dim = config.kv_channels
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups, tp)
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        no_rope = getattr(config, "no_rope_freq", None)
        self.rope = not (no_rope and no_rope[layer_number - 1])

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("PackedCoreAttention does not support attention_bias")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            if query.dim() == 4:  # [t, 1, np, hn] if megatron did not squeeze
                query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
            p = packed_seq_params
            cu_q, cu_kv = p.cu_seqlens_q, p.cu_seqlens_kv
            bounds = getattr(p, "bounds", None)
            if bounds is None or getattr(p, "rope_cos", None) is None:
                raise ValueError(
                    "PackedCoreAttention needs the CriticPackedSeqParams of "
                    "value_assets.gpu.model.gpt_critic.packed_seq_params(..., position_ids=, model=) "
                    "(host cu_seqlens and per-token RoPE; megatron's packed RoPE is off)"
                )
            if cu_kv is not None and cu_kv is not cu_q and not torch.equal(cu_q.cpu(), cu_kv.cpu()):
                raise ValueError("PackedCoreAttention needs cu_seqlens_q == cu_seqlens_kv")
            if self.rope:
                cos, sin = p.rope_for(query.dtype)
                query, key = rope_qk(query, key, cos, sin)
            out = packed_causal_attention(query, key, value, cu_q, self.scale, bounds=bounds, max_seqlen=p.max_seqlen_q)
            return out.reshape(out.shape[0], -1)
        # [s, b, h, d] -> [b, h, s, d]
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        o = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.scale, enable_gqa=q.shape[1] != k.shape[1]
        )
        s, b = query.shape[0], query.shape[1]
        return o.permute(2, 0, 1, 3).reshape(s, b, -1)
