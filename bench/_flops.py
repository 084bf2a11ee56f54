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

Qwen3.5 (layers of two kinds): N counts each layer's own projections (attention layers: q with
its output gate, k, v, o; Gated DeltaNet layers: q, k, v, z, b, a in and the output projection;
the short convolution and norms ignored); the softmax term counts the attention layers only
(L_attn), and each DeltaNet layer adds 6*Hv*dk*dv per token forward (the recurrence's three
products S^T k, k u^T and S^T q, per value head; the chunked kernels do more arithmetic than this,
which is not useful work and not counted).

Recomputation is never counted: it is not useful work, so a row with activation recompute shows
an MFU below the GPU's achieved FLOP rate (full recompute runs one more forward, a third more work
than the 3 forwards counted; recomputing the first K of L layers, K/L of that).
"""

from __future__ import annotations

from collections.abc import Iterable

FORMULA = (
    "FLOPs/real token: train = 6*N + 12*L*d_attn*s_eff, forward = 2*N + 4*L*d_attn*s_eff; "
    "N = non-embedding matmul weights (qkv, o, gate/up/down, value head), "
    "s_eff = sum_seq s(s+1)/2 / tokens (mean causal context); padding and recomputed FLOPs not counted; "
    "Qwen3.5: L = attention layers only, plus 6*Hv*dk*dv per DeltaNet layer forward"
)


def _kinds(backbone) -> list[str]:
    types = getattr(backbone, "layer_types", None)
    return list(types) if types else ["full_attention"] * backbone.num_layers


def matmul_params(backbone, head_size: int) -> int:
    h, ffn = backbone.hidden_size, backbone.ffn_hidden_size
    d = backbone.head_dim
    q = backbone.num_attention_heads * d
    kv = backbone.num_query_groups * d
    gate = q if getattr(backbone, "attention_output_gate", False) else 0
    attn = h * (q + gate + 2 * kv) + q * h + 3 * h * ffn
    la = getattr(backbone, "linear_attention", None)
    total = 0
    for kind in _kinds(backbone):
        if kind == "full_attention":
            total += attn
        else:
            qk, vd = la.key_heads * la.key_head_dim, la.value_heads * la.value_head_dim
            total += h * (2 * qk + 2 * vd + 2 * la.value_heads) + vd * h + 3 * h * ffn
    return total + h * head_size


def s_eff(seq_lens: Iterable[int]) -> float:
    lens = [int(s) for s in seq_lens]
    tokens = sum(lens)
    return sum(s * (s + 1) / 2 for s in lens) / tokens if tokens else 0.0


def flops_per_token(backbone, head_size: int, seq_lens: Iterable[int], *, train: bool) -> float:
    n = matmul_params(backbone, head_size)
    d_attn = backbone.num_attention_heads * backbone.head_dim
    kinds = _kinds(backbone)
    fwd = 2 * n + 4 * kinds.count("full_attention") * d_attn * s_eff(seq_lens)
    la = getattr(backbone, "linear_attention", None)
    if la is not None:
        fwd += 6 * la.value_heads * la.key_head_dim * la.value_head_dim * (len(kinds) - kinds.count("full_attention"))
    return 3 * fwd if train else fwd
