"""Useful-FLOP count for the critic throughput benchmark (dense decoder, causal attention).

Per real token (padding never counts):

    N      = matmul weights, embedding excluded (a lookup):
             per layer  h*(h + 2*kv) [q,k,v] + h*h [o] + 3*h*ffn [gate, up, down];  plus the value
             head h*K.  (kv = num_query_groups * head_dim; biases and norm weights ignored.)
    s_eff  = mean causal context length per token = sum over sequences of s*(s+1)/2, divided by
             the number of tokens (a sequence of s tokens: token i attends to i+1 keys).
    forward  FLOPs/token = 2*N + 4*L*d_attn*s_eff     (QK^T and PV: 2*d_attn FLOPs per key each;
                                                       d_attn = num_attention_heads * head_dim)
    training FLOPs/token = 3 * forward = 6*N + 12*L*d_attn*s_eff   (backward = 2x forward)

Recomputation is never counted: it is not useful work, so a row with activation recompute shows
an MFU below the GPU's achieved FLOP rate (full recompute runs one more forward, a third more work
than the 3 forwards counted; recomputing the first K of L layers, K/L of that).
"""

from __future__ import annotations

from collections.abc import Iterable

FORMULA = (
    "FLOPs/real token: train = 6*N + 12*L*d_attn*s_eff, forward = 2*N + 4*L*d_attn*s_eff; "
    "N = non-embedding matmul weights (qkv, o, gate/up/down, value head), "
    "s_eff = sum_seq s(s+1)/2 / tokens (mean causal context); padding and recomputed FLOPs not counted"
)


def matmul_params(backbone, head_size: int) -> int:
    h, L, ffn = backbone.hidden_size, backbone.num_layers, backbone.ffn_hidden_size
    d = backbone.head_dim
    q = backbone.num_attention_heads * d
    kv = backbone.num_query_groups * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * ffn
    return L * per_layer + h * head_size


def s_eff(seq_lens: Iterable[int]) -> float:
    lens = [int(s) for s in seq_lens]
    tokens = sum(lens)
    return sum(s * (s + 1) / 2 for s in lens) / tokens if tokens else 0.0


def flops_per_token(backbone, head_size: int, seq_lens: Iterable[int], *, train: bool) -> float:
    n = matmul_params(backbone, head_size)
    d_attn = backbone.num_attention_heads * backbone.head_dim
    fwd = 2 * n + 4 * backbone.num_layers * d_attn * s_eff(seq_lens)
    return 3 * fwd if train else fwd
