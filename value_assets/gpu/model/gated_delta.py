"""Qwen3.5's linear-attention layer (Gated DeltaNet) for the critic, on packed rows, and its norms.

Why our own layer and not megatron-core's `GatedDeltaNet`: megatron-core 0.16.1 (the CPU suite's
engine) refuses packed sequences (`NotImplementedError`), builds its convolution and gates with
`torch.cuda.current_device()` (no CPU) and needs `flash-linear-attention` at construction; the critic
trains packed rows on both engines (0.16.1 and 0.19.2) and is checked on CPU against transformers.
This layer takes megatron's tensor-parallel linears and the same `(output, bias)` contract, so it
sits in a megatron `TransformerLayer` like `SelfAttention` does (`gpt_critic.qwen3_5_block_spec`).

What one layer computes, for each packed sequence on its own (transformers' `Qwen3_5GatedDeltaNet`):

- projections of the normed hidden state: q, k (key heads x dk), v and the output gate z (value heads
  x dv), b and a (one per value head);
- a causal depthwise convolution (kernel `conv_kernel`, no bias) over the channels [q, k, v], then
  SiLU; the convolution never reads a token of another packed sequence (`packed_causal_conv`);
- q and k L2-normalised per head (eps 1e-6), q scaled by dk^-0.5; value head h reads key head
  h // (value heads / key heads);
- the gated delta rule with beta = sigmoid(b) and log-decay g = -exp(A_log) * softplus(a + dt_bias),
  state starting at zero for every sequence: `gated_delta_rule` (torch, chunked, float32), or on CUDA
  with flash-linear-attention installed its Triton kernel, all packed rows in one call;
- per value head an RMSNorm with a plain weight (eps = the model's), times SiLU(z), then `out_proj`.

Parameter layout (the local names `hf.py`'s table maps): `in_proj.weight` holds, for each key-head
group j in turn, the rows [q_j; k_j; v of j's value heads; z of them; b of them; a of them], and
`conv1d.weight` the channels [q_j; k_j; v of j's value heads] per group. Grouping by key head is what
makes a contiguous tensor-parallel cut (megatron's column-parallel split) hand each rank whole
groups, as megatron's fused `linear_qkv` does for attention; `A_log` and `dt_bias` (one per value
head) are in value-head order, which is the same order.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

# The gated delta rule's chunk length (tokens): the within-chunk part is dense matrix algebra, the
# chunks are a sequential scan.
CHUNK = 64
_L2_EPS = 1e-6


class ZeroCenteredRMSNorm(torch.nn.Module):
    """Qwen3.5's RMSNorm: x / rms(x) * (1 + weight), computed in float32, weight stored as HF stores it
    (initialised to 0). Takes megatron's norm constructor arguments, so a layer spec can name it."""

    def __init__(self, config: Any = None, hidden_size: int = 0, eps: float = 1e-6, **_: Any):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last dim (fla's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + _L2_EPS)


def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, chunk: int = CHUNK
) -> torch.Tensor:
    """The gated delta rule over one sequence, state starting at zero, in float32.

    q, k [T, H, dk] (already normalised and q scaled), v [T, H, dv], g (log decay, <= 0) and beta
    [T, H]. Returns o [T, H, dv] with, per head and token t (state S [dk, dv]):
        S_t = exp(g_t) S_{t-1} + k_t u_t^T,  u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t),  o_t = S_t^T q_t.

    Chunked: within a chunk of C tokens with cumulative log decay c (c_t = sum of g up to t), the
    corrections u solve the unit lower-triangular system (I + A) u = beta v - beta e^c (K S0), with
    A[t, j] = beta_t e^(c_t - c_j) k_t.k_j for j < t; then O = e^c (Q S0) + (QK^T * D) U with
    D[t, j] = e^(c_t - c_j) for j <= t, and the chunk's end state is e^(c_C) S0 + (K e^(c_C - c))^T U.
    """
    t_len, heads, dk = k.shape
    dv = v.shape[-1]
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    pad = (-t_len) % chunk
    if pad:  # padded tokens: k = v = 0, g = 0 (no decay), beta = 0: they change nothing
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    n = (t_len + pad) // chunk
    # [H, n, C, d]
    q, k, v = (x.reshape(n, chunk, heads, -1).permute(2, 0, 1, 3) for x in (q, k, v))
    g, beta = (x.reshape(n, chunk, heads).permute(2, 0, 1) for x in (g, beta))
    c = g.cumsum(-1)  # [H, n, C]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    diff = (c.unsqueeze(-1) - c.unsqueeze(-2)).masked_fill(~lower, float("-inf"))
    decay = diff.exp()  # D[t, j] = e^(c_t - c_j), 0 above the diagonal
    kb = k * beta.unsqueeze(-1)
    a = (kb @ k.transpose(-1, -2)) * decay
    system = a.masked_fill(~lower, 0.0).tril(-1) + torch.eye(chunk, dtype=a.dtype, device=a.device)
    u0 = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * c.exp().unsqueeze(-1), upper=False, unitriangular=True)
    qk = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * c.exp().unsqueeze(-1)
    k_end = k * (c[..., -1:] - c).exp().unsqueeze(-1)
    end_decay = c[..., -1].exp()  # [H, n]
    state = q.new_zeros(heads, dk, dv)
    outs = []
    for i in range(n):
        u = u0[:, i] - w[:, i] @ state
        outs.append(q_dec[:, i] @ state + qk[:, i] @ u)
        state = state * end_decay[:, i, None, None] + k_end[:, i].transpose(-1, -2) @ u
    o = torch.stack(outs, dim=1).reshape(heads, n * chunk, dv).transpose(0, 1)
    return o[:t_len]


def packed_causal_conv(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Causal depthwise convolution along dim 0 of packed rows, blind across rows.

    x [t, ..., C], weight [C, K] (HF's `conv1d.weight[:, 0, :]`: tap K-1 reads the current token),
    positions [t] (each token's index in its own sequence). out[t] = sum_j weight[:, K-1-j] * x[t-j]
    over the j <= positions[t]: a tap that would reach into the previous sequence reads zero, as a
    convolution zero-padded per sequence does."""
    kernel = weight.shape[-1]
    out = x * weight[:, kernel - 1]
    shape = (-1,) + (1,) * (x.dim() - 1)
    for j in range(1, min(kernel, x.shape[0] + 1)):
        shifted = torch.cat([x.new_zeros(j, *x.shape[1:]), x[:-j]]) if j < x.shape[0] else torch.zeros_like(x)
        keep = (positions >= j).to(x.dtype).view(shape)
        out = out + shifted * keep * weight[:, kernel - 1 - j]
    return out


@functools.cache
def _fla_delta_rule() -> Any:
    """flash-linear-attention's `chunk_gated_delta_rule` (fla-core, pure Triton; CUDA only), or None
    where it is not installed: the torch path above then runs, on CUDA too."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:  # not installed, or no Triton: the torch path
        return None
    return chunk_gated_delta_rule


def fla_backward_problem(capability: tuple[int, int], triton_version: str, has_tilelang: bool) -> str | None:
    """Why fla's gated backward cannot run here, or None. fla-core 0.6.0 refuses `chunk_bwd_dqkwg` with
    a gate on Hopper (compute capability 9.x) under Triton >= 3.4.0 and < 3.7.1 unless tilelang is
    installed (fla issue #640: those Triton releases compute wrong gradients there). Seen on the H100
    of 2026-12-06 (Triton 3.6.0, torch 2.11's pin): the forward ran, the first backward raised deep in
    a training step. Checked before the first training forward instead, with the fix named."""
    if capability[0] != 9 or has_tilelang:
        return None
    parts = [int(p) for p in re.findall(r"\d+", triton_version)[:3]]
    version = tuple(parts + [0] * (3 - len(parts)))
    if not (3, 4, 0) <= version < (3, 7, 1):
        return None
    return (
        f"Qwen3.5 training on this GPU (compute capability {capability[0]}.{capability[1]}, Hopper) needs "
        f"Triton >= 3.7.1 or tilelang for flash-linear-attention's gated delta-rule backward; found Triton "
        f"{triton_version} and no tilelang (fla issue #640: these Triton releases give wrong gradients "
        "on Hopper). Install tilelang (`pip install tilelang`) or a Triton >= 3.7.1 that your torch "
        "accepts; evaluation (forward only) is not affected."
    )


@functools.cache
def _fla_training_problem(device_index: int | None) -> str | None:
    import triton

    capability = torch.cuda.get_device_capability(device_index)
    return fla_backward_problem(capability, triton.__version__, importlib.util.find_spec("tilelang") is not None)


def _positions(bounds: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Each packed token's index in its own sequence."""
    return torch.cat([torch.arange(b - a, device=device) for a, b in pairwise(bounds)])


class GatedDeltaNet(MegatronModule):
    """One Gated DeltaNet token mixer with megatron's attention contract: forward(hidden [s, b, h] or
    packed [t, 1, h], packed_seq_params=...) -> (output, None); built by megatron's `build_module`
    from a `TransformerLayer` spec (config, layer_number, and whatever else that megatron release
    passes). The linear-attention shape comes from `config.critic_linear_attention` (a
    `core.backbone.LinearAttention`), set by `gpt_critic.transformer_config`."""

    def __init__(self, config: Any, layer_number: int = 1, **_: Any):
        super().__init__(config=config)
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        la = config.critic_linear_attention
        tp = config.tensor_model_parallel_size
        if la.key_heads % tp:
            raise ValueError(f"tensor parallel {tp} does not divide the {la.key_heads} linear-attention key heads")
        if config.sequence_parallel:
            raise ValueError("sequence parallelism is not supported with Gated DeltaNet layers")
        self.layer_number = layer_number
        self.dk, self.dv, self.ratio, self.kernel = la.key_head_dim, la.value_head_dim, la.ratio, la.conv_kernel
        self.groups = la.key_heads // tp  # key-head groups on this rank
        self.value_heads = self.groups * self.ratio
        self.eps = config.layernorm_epsilon
        self.group_width = la.in_proj_width // la.key_heads  # [q, k, v, z, b, a] of one key-head group
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.in_proj = ColumnParallelLinear(
            config.hidden_size,
            la.in_proj_width,
            config=config,
            init_method=config.init_method,
            bias=False,
            gather_output=False,
            skip_bias_add=True,
        )
        channels = la.conv_channels // tp
        self.conv1d = torch.nn.Conv1d(channels, channels, self.kernel, groups=channels, bias=False)
        # A in [1, 16] spread over the value heads (a deterministic stand-in for a random init: the
        # same model for any tensor-parallel size); dt_bias 1, as transformers initialises it.
        rank = ps.get_tensor_model_parallel_rank()
        heads = torch.arange(rank * self.value_heads, (rank + 1) * self.value_heads, dtype=torch.float32)
        a_init = 1.0 + 15.0 * (heads + 0.5) / (la.key_heads * self.ratio)
        self.A_log = torch.nn.Parameter(a_init.log())
        self.dt_bias = torch.nn.Parameter(torch.ones(self.value_heads))
        self.out_norm = torch.nn.Parameter(torch.ones(self.dv))
        self.out_proj = RowParallelLinear(
            la.value_heads * self.dv,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=True,
        )
        for p in (self.conv1d.weight, self.A_log, self.dt_bias):
            p.tensor_model_parallel = True
            p.partition_dim = 0
            p.partition_stride = 1
        dtype = config.params_dtype
        self.conv1d.to(dtype)
        for p in (self.A_log, self.dt_bias, self.out_norm):
            p.data = p.data.to(dtype)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Any = None, **kwargs: Any) -> tuple:
        packed = kwargs.get("packed_seq_params")
        if kwargs.get("inference_context") is not None or kwargs.get("inference_params") is not None:
            raise NotImplementedError("the critic's Gated DeltaNet has no inference cache")
        s, b, _ = hidden_states.shape
        if packed is not None and packed.qkv_format == "thd":
            bounds = tuple(int(x) for x in packed.bounds)
            rows = [(0, lo, hi) for lo, hi in pairwise(bounds)]
            positions = _positions(bounds, hidden_states.device)
        else:  # unpacked: each batch column is one sequence
            rows = [(col, 0, s) for col in range(b)]
            positions = torch.arange(s, device=hidden_states.device)
        r, dk, dv, groups = self.ratio, self.dk, self.dv, self.groups
        heads = groups * r
        proj, _ = self.in_proj(hidden_states)  # [s, b, groups * width]
        q, k, v, z, b_in, a_in = proj.view(s, b, groups, self.group_width).split([dk, dk, r * dv, r * dv, r, r], dim=-1)
        qkv = torch.cat([q, k, v], dim=-1).reshape(s, b, -1)  # channels grouped as conv1d.weight
        x = F.silu(packed_causal_conv(qkv, self.conv1d.weight[:, 0, :], positions))
        q, k, v = x.view(s, b, groups, -1).split([dk, dk, r * dv], dim=-1)
        q = l2_normalize(q.float())  # [s, b, groups, dk]: value head h reads key head h // r
        k = l2_normalize(k.float())
        v = v.reshape(s, b, heads, dv)
        g = -self.A_log.float().exp() * F.softplus(a_in.reshape(s, b, heads).float() + self.dt_bias.float())
        beta = torch.sigmoid(b_in.reshape(s, b, heads).float())
        kernel = _fla_delta_rule() if hidden_states.is_cuda else None
        if kernel is not None and torch.is_grad_enabled():
            problem = _fla_training_problem(hidden_states.device.index)
            if problem is not None:
                raise RuntimeError(problem)
        if kernel is not None:
            # flash-linear-attention's chunked kernel (Triton): all rows in one call, [1, tokens, heads, d]
            # in sequence order, each row's state starting at zero at its cu_seqlens bound.
            def flat(t: torch.Tensor) -> torch.Tensor:
                return t.transpose(0, 1).reshape(1, s * b, *t.shape[2:])

            bounds_all = [lo + col * s for col, lo, _ in rows] + [rows[-1][2] + rows[-1][0] * s]
            cu = torch.tensor(bounds_all, dtype=torch.int32).to(hidden_states.device, non_blocking=True)
            dtype = hidden_states.dtype
            out, _ = kernel(
                flat(q.to(dtype)),
                flat(k.to(dtype)),
                flat(v),
                flat(g),
                flat(beta.to(dtype)),
                scale=dk**-0.5,
                cu_seqlens=cu,
            )
            core = out.reshape(b, s, heads, dv).transpose(0, 1).float()
        else:
            q = q.repeat_interleave(r, dim=2) * dk**-0.5  # [s, b, heads, dk]
            k = k.repeat_interleave(r, dim=2)
            core = torch.empty(s, b, heads, dv, dtype=torch.float32, device=hidden_states.device)
            for col, lo, hi in rows:
                core[lo:hi, col] = gated_delta_rule(
                    q[lo:hi, col], k[lo:hi, col], v[lo:hi, col], g[lo:hi, col], beta[lo:hi, col]
                )
        # Per-head RMSNorm (plain weight), then the SiLU output gate, as transformers' RMSNormGated.
        normed = (core * torch.rsqrt(core.pow(2).mean(-1, keepdim=True) + self.eps)).to(hidden_states.dtype)
        gated = (self.out_norm * normed).float() * F.silu(z.reshape(s, b, heads, dv).float())
        return self.out_proj(gated.to(hidden_states.dtype).reshape(s, b, heads * dv))

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """megatron's default, except that conv1d.weight, A_log and dt_bias are cut along dim 0 by
        tensor parallelism (the default would record them as replicated)."""
        from megatron.core.transformer.utils import (
            ensure_metadata_has_dp_cp_group,
            make_sharded_tensors_for_checkpoint,
            sharded_state_dict_default,
        )

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        dp_cp = metadata["dp_cp_group"]
        own: dict[str, Any] = {}
        self._save_to_state_dict(own, "", keep_vars=True)
        axis = {"A_log": 0, "dt_bias": 0}
        out = make_sharded_tensors_for_checkpoint(
            own, prefix, axis, sharded_offsets, tp_group=self.tp_group, dp_cp_group=dp_cp
        )
        conv = {"weight": self.conv1d.weight}
        out.update(
            make_sharded_tensors_for_checkpoint(
                conv, f"{prefix}conv1d.", {"weight": 0}, sharded_offsets, tp_group=self.tp_group, dp_cp_group=dp_cp
            )
        )
        for name in ("in_proj", "out_proj"):
            out.update(
                sharded_state_dict_default(
                    getattr(self, name), f"{prefix}{name}.", sharded_offsets, metadata, tp_group=self.tp_group
                )
            )
        return out
