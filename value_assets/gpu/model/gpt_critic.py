"""The critic: a megatron-core `GPTModel` backbone (Llama / Qwen2 / Qwen3 / Qwen3.5 shape) with a value head.

Architecture only; parallel setup lives in `parallel.py`, training in `train.py`.

- Local (non-Transformer-Engine) layer spec, with `PackedCoreAttention` as core attention so
  packed variable-length rows run on PyTorch fused kernels.
- The LM output layer is replaced by `ValueHead` (Linear hidden -> K, bias, weight N(0, 0.02),
  bias 0, computed in float32) on the last pipeline stage only (docs/rules.md#critic). Embeddings untied.
- Forward returns per-token head outputs, float32 [t, K] for a packed row of t tokens.
- Qwen3.5 (`qwen3_5_block_spec`): a per-layer spec, Gated DeltaNet (`gated_delta.py`) or megatron's
  attention with its output gate and partial RoPE, and zero-centred RMSNorms throughout.
- Packed forwards (`critic_forward`) apply RoPE vectorized in `PackedCoreAttention` from per-token
  cos / sin gathered once per micro-batch by `position_ids` (see `rope.py`), and carry a host copy
  of `cu_seqlens`, so no layer syncs the device or loops over sequences in Python.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F

from value_assets.core.backbone import FAMILIES, BackboneConfig  # noqa: F401  (re-exported)
from value_assets.core.memory import MemoryConfig
from value_assets.core.objective import Objective
from value_assets.gpu.model import swiglu, wgrad
from value_assets.gpu.model.attention import PackedCoreAttention
from value_assets.gpu.model.rope import CriticPackedSeqParams, find_rotary, install, packed_cos_sin


def recompute_settings(memory: MemoryConfig) -> dict[str, Any]:
    """megatron's own activation recompute for `memory.recompute`: 'selective' checkpoints
    core attention (`PackedCoreAttention` goes through megatron's `_checkpointed_attention_forward`
    like its own class, RoPE included: our RoPE is applied inside core attention); 'full'
    checkpoints every layer (uniform, one layer per checkpoint), or with `recompute_layers` K the
    first K layers of each pipeline stage (block)."""
    recompute = memory.recompute
    if recompute == "none":
        return {}
    if recompute == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    if recompute == "full" and memory.recompute_layers is not None:
        return {
            "recompute_granularity": "full",
            "recompute_method": "block",
            "recompute_num_layers": memory.recompute_layers,
        }
    if recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")


def transformer_config(
    backbone: BackboneConfig, *, tp: int = 1, pp: int = 1, bf16: bool | None = None, memory: MemoryConfig | None = None
) -> Any:
    """megatron `TransformerConfig` for the backbone. bf16 defaults to "CUDA available";
    `memory` (default: none of the features) sets recompute and sequence parallelism."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    memory = memory or MemoryConfig()
    if memory.sequence_parallel and tp < 2:
        raise ValueError(f"sequence parallelism needs tensor parallel > 1, got tp {tp}")
    memory.check_layers(num_layers=backbone.num_layers, pipeline_parallel=pp)
    if bf16 is None:
        bf16 = torch.cuda.is_available()
    cuda = torch.cuda.is_available()
    fuse_wgrad = wgrad.enabled(cuda)
    if fuse_wgrad:
        wgrad.install()  # before any linear layer checks for the extension
    if backbone.linear_attention is not None and memory.sequence_parallel:
        raise ValueError("sequence parallelism is not supported for Qwen3.5 (Gated DeltaNet) critics")
    if backbone.attention_output_gate and tp > backbone.num_query_groups:
        # megatron-core 0.16.1 re-slices q for tp > groups but not the output gate, so the shapes
        # disagree; untested on 0.19.2: refused on both.
        raise ValueError(
            f"tensor parallel {tp} above the {backbone.num_query_groups} key/value heads is not supported "
            "with gated attention (Qwen3.5)"
        )
    cfg = TransformerConfig(
        num_layers=backbone.num_layers,
        hidden_size=backbone.hidden_size,
        ffn_hidden_size=backbone.ffn_hidden_size,
        num_attention_heads=backbone.num_attention_heads,
        num_query_groups=backbone.num_query_groups,
        kv_channels=backbone.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=backbone.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=backbone.qkv_bias,
        qk_layernorm=backbone.qk_layernorm,
        attention_output_gate=backbone.attention_output_gate,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=memory.sequence_parallel,
        **recompute_settings(memory),
        # Full weights are initialised on CPU and split, so a model is the same for any TP size.
        use_cpu_initialization=True,
        perform_initialization=True,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        bf16=bf16,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        # The loss function does its own (per-row, global-batch) normalisation: megatron must
        # neither divide by the micro-batch count nor average gradients over data parallel.
        calculate_per_token_loss=True,
        variable_seq_lengths=True,  # packed micro-batches differ in length (pipeline p2p)
        moe_token_dispatcher_type="alltoall",  # only to satisfy the variable-length check
        # On CUDA, megatron's fused SwiGLU (one torch.compile'd kernel each way instead of silu, mul
        # and their backward; swiglu.py's Triton kernels by default); on CPU the plain ops.
        bias_activation_fusion=cuda,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        # Weight gradients accumulated into the fp32 main_grad by the GEMM (wgrad.py stands in for
        # Apex's extension; CUDA only, off until measured): megatron's DDP then skips its add.
        gradient_accumulation_fusion=fuse_wgrad,
        # megatron's deterministic_mode embeds by indexing (`weight[ids]`), whose CPU backward is
        # index_put_(accumulate=True): with more than one intra-op thread it adds rows with atomics,
        # in whatever order the threads run, so repeated runs differed in the last bits of the
        # embedding gradient (issue 33, defect 12). F.embedding's CPU backward is bitwise
        # reproducible at any thread count; on CUDA megatron used F.embedding already.
        deterministic_mode=False,
    )
    # The Gated DeltaNet shape rides on the config (gated_delta.GatedDeltaNet reads it), as megatron's
    # own `linear_*` fields would; None for the pure-attention families.
    cfg.critic_linear_attention = backbone.linear_attention
    if backbone.layer_types is not None:
        # Layers of two kinds cannot be stacked under one checkpoint key per tensor (megatron's
        # default): each layer is saved under its own number, as megatron does for its own hybrids.
        cfg.hetereogenous_dist_checkpoint = True
    return cfg


class ValueHead(torch.nn.Module):
    """Linear hidden -> K in float32; replaces `GPTModel.output_layer`, so it takes the output
    layer's call signature and returns (values, None). Parameters are named `weight` / `bias`
    because megatron's `LanguageModule.sharded_state_dict` looks up `output_layer.weight`.
    Replicated (not tensor-parallel) on every TP rank."""

    def __init__(self, hidden_size: int, head_size: int, seed: int = 0, sequence_parallel: bool = False):
        super().__init__()
        # With sequence parallelism the final norm's output is split over the tensor-parallel
        # ranks along the tokens; the head gathers it, and since every rank then computes the same
        # loss on all tokens, the backward keeps this rank's slice of the gradient (no reduction).
        self.sequence_parallel = sequence_parallel
        # A dedicated generator: identical on every TP rank and independent of backbone init.
        gen = torch.Generator(device="cpu").manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(head_size, hidden_size, generator=gen) * 0.02)
        self.bias = torch.nn.Parameter(torch.zeros(head_size))

    def forward(
        self, hidden_states: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None
    ) -> tuple[torch.Tensor, None]:
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return F.linear(hidden_states.float(), self.weight.float(), self.bias.float()), None


class SequenceParallelRMSNorm:
    """`torch.nn.RMSNorm` for megatron's local spec under sequence parallelism (its
    `WrappedTorchNorm` refuses SP): each tensor-parallel rank normalises its slice of the tokens,
    so the weight is marked `sequence_parallel` and megatron's `finalize_model_grads` sums its
    gradient over the tensor-parallel group."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.Module:
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm


# megatron-core 0.19 logs "GPTModel IS DEPRECATED ..." each time a GPTModel is built (every worker,
# every load). The critic stays on GPTModel for the pure-attention families it serves (Llama, Qwen2,
# Qwen3): it is the engine every figure in docs/results.md was measured on, and megatron-core still
# ships and fixes it; the hybrid model is for layer patterns GPTModel cannot express
# (docs/architecture.md#engine). The notice says nothing a user can act on, so that one line is
# dropped from megatron's log; every other message of the module passes.
GPT_DEPRECATION_NOTICE = "GPTModel IS DEPRECATED"


class _DropGptDeprecation:
    """A logging filter on megatron's gpt_model logger that drops the deprecation notice only."""

    def filter(self, record: Any) -> bool:
        return not str(record.getMessage()).startswith(GPT_DEPRECATION_NOTICE)


def _quiet_gpt_deprecation() -> None:
    import logging

    gpt_logger = logging.getLogger("megatron.core.models.gpt.gpt_model")
    if not any(isinstance(f, _DropGptDeprecation) for f in gpt_logger.filters):
        gpt_logger.addFilter(_DropGptDeprecation())


def qwen3_5_block_spec(cfg: Any, backbone: BackboneConfig) -> Any:
    """The decoder block spec of a Qwen3.5 critic for this pipeline stage: per layer megatron's local
    `TransformerLayer` with either the Gated DeltaNet token mixer or self-attention (output gate and
    QK-norm; `PackedCoreAttention` as core attention), every norm zero-centred."""
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from value_assets.core.backbone import LINEAR
    from value_assets.gpu.model.gated_delta import GatedDeltaNet, ZeroCenteredRMSNorm

    full = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    full.submodules.self_attention.submodules.core_attention = PackedCoreAttention
    full.submodules.self_attention.submodules.q_layernorm = ZeroCenteredRMSNorm
    full.submodules.self_attention.submodules.k_layernorm = ZeroCenteredRMSNorm
    full.submodules.input_layernorm = ZeroCenteredRMSNorm
    full.submodules.pre_mlp_layernorm = ZeroCenteredRMSNorm
    linear = copy.deepcopy(full)
    linear.submodules.self_attention = ModuleSpec(module=GatedDeltaNet)
    offset = get_transformer_layer_offset(cfg)
    count = get_num_layers_to_build(cfg)
    specs = [linear if backbone.layer_type(i) == LINEAR else full for i in range(offset, offset + count)]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=ZeroCenteredRMSNorm)


def build_critic(
    backbone: BackboneConfig,
    objective: Objective,
    *,
    tp: int = 1,
    pp: int = 1,
    bf16: bool | None = None,
    head_seed: int = 0,
    memory: MemoryConfig | None = None,
) -> torch.nn.Module:
    """Build this rank's critic module (megatron parallel state must be initialised).

    Returns a `GPTModel` whose `output_layer` is a `ValueHead` on the last pipeline stage.
    Parameters are on the current CUDA device (CPU without CUDA); the head stays float32.
    `memory` selects recompute and sequence parallelism (the distributed optimizer is
    `wrap_for_training`'s).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    cfg = transformer_config(backbone, tp=tp, pp=pp, bf16=bf16, memory=memory)
    spec = get_gpt_layer_local_spec(qk_layernorm=backbone.qk_layernorm, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = PackedCoreAttention
    if backbone.family == "qwen3_5":
        spec = qwen3_5_block_spec(cfg, backbone)
    elif cfg.sequence_parallel:
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

        spec.submodules.input_layernorm = SequenceParallelRMSNorm
        spec.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
        spec = TransformerBlockSubmodules(
            layer_specs=[spec] * get_num_layers_to_build(cfg), layer_norm=SequenceParallelRMSNorm
        )
    pre = ps.is_pipeline_first_stage()
    post = ps.is_pipeline_last_stage()
    _quiet_gpt_deprecation()
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=backbone.vocab_size,
        max_sequence_length=backbone.max_seq_len,
        pre_process=pre,
        post_process=post,
        parallel_output=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_percent=backbone.rotary_percent,
        rope_scaling=backbone.rope_scaling,
        rope_scaling_factor=float(backbone.rope_scaling_factor or 8.0),
        rotary_base=int(backbone.rotary_base) if float(backbone.rotary_base).is_integer() else backbone.rotary_base,
    )
    # Packed forwards: megatron's per-sequence RoPE off, ours (PackedCoreAttention) on.
    install(model)
    # megatron's fused SwiGLU (CUDA: bias_activation_fusion) through swiglu.py's dispatch (Triton by default).
    swiglu.install()
    if post:
        # The vocab projection is dropped before it ever reaches a device or an optimizer.
        model.output_layer = ValueHead(
            backbone.hidden_size, objective.head_size, seed=head_seed, sequence_parallel=cfg.sequence_parallel
        )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    if cfg.bf16:
        # Every parameter bf16, as megatron's Float16Module would make it: its mixed-precision
        # optimizer keeps the fp32 master copies (the head's too) and assumes no fp32 parameter
        # sits among the bf16 ones. The head still computes and outputs in float32.
        model.bfloat16()
    return model


def packed_seq_params(
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    position_ids: torch.Tensor | None = None,
    model: Any = None,
    cu_seqlens_host: torch.Tensor | None = None,
) -> Any:
    """`PackedSeqParams` (qkv_format 'thd') for one packed micro-batch of the critic.

    With `model` and `position_ids` [t] (restarting at 0 per sequence), also the per-token RoPE
    cos / sin that `PackedCoreAttention` applies (megatron's own packed RoPE is switched off by
    `build_critic`). `cu_seqlens_host`: a CPU copy of cu_seqlens, if the caller has one; else
    cu_seqlens is read back once here (one sync per micro-batch, none per layer).
    """
    host = cu_seqlens_host if cu_seqlens_host is not None else cu_seqlens
    bounds = tuple(int(b) for b in host.tolist())  # host tensor: no device sync
    if len(bounds) < 2 or bounds[0] != 0 or any(b < a for a, b in pairwise(bounds)):
        raise ValueError(f"cu_seqlens must be non-decreasing from 0, got {list(bounds)}")
    if max_seqlen < max(b - a for a, b in pairwise(bounds)):
        raise ValueError(f"max_seqlen {max_seqlen} below the longest sequence in {list(bounds)}")
    cos = sin = None
    if model is not None:
        if position_ids is None:
            raise ValueError("packed RoPE needs position_ids")
        pos = position_ids.reshape(-1)
        if pos.numel() != bounds[-1]:
            raise ValueError(f"{pos.numel()} position_ids for {bounds[-1]} packed tokens")
        if not pos.is_cuda:  # cheap on the host: positions must restart at 0 per sequence
            want = torch.cat([torch.arange(b - a) for a, b in pairwise(bounds)])
            if not torch.equal(pos.cpu().long(), want):
                raise ValueError("position_ids must restart at 0 for every packed sequence")
        cos, sin = packed_cos_sin(find_rotary(model), pos, max_seqlen)
    return CriticPackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
        bounds=bounds,
        rope_cos=cos,
        rope_sin=sin,
    )


def critic_forward(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    position_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    cu_seqlens_host: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run one packed micro-batch.

    tokens int64 [t], position_ids int64 [t] (restart at 0 per sequence), cu_seqlens int32 [n+1]
    (on the model's device), cu_seqlens_host: optional CPU copy of cu_seqlens (saves the one
    device->host read-back per micro-batch when cu_seqlens lives on the GPU).
    Returns float32 [t, K] on the last pipeline stage (hidden states [t, 1, h] elsewhere).

    With sequence parallelism the packed tokens must split evenly over the tensor-parallel
    ranks: the micro-batch is padded to a multiple of tp with one extra pseudo-sequence (token 0,
    positions from 0), which attends only to itself, is never attended to, and is cut off the
    head's output, so it cannot reach a loss or a metric. Other stages then pass on
    [t_padded / tp, 1, h].
    """
    t = tokens.numel()
    cfg = _unwrap(model).config
    multiple = cfg.tensor_model_parallel_size if cfg.sequence_parallel else 1
    pad = (-t) % multiple
    if pad:
        host = cu_seqlens_host if cu_seqlens_host is not None else cu_seqlens.cpu()
        tokens = torch.cat([tokens, tokens.new_zeros(pad)])
        position_ids = torch.cat(
            [position_ids, torch.arange(pad, dtype=position_ids.dtype, device=position_ids.device)]
        )
        cu_seqlens_host = torch.cat([host, host.new_tensor([t + pad])])
        cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_tensor([t + pad])])
        max_seqlen = max(max_seqlen, pad)
    params = packed_seq_params(
        cu_seqlens, max_seqlen, position_ids=position_ids, model=model, cu_seqlens_host=cu_seqlens_host
    )
    out = model(tokens.unsqueeze(0), position_ids.unsqueeze(0), None, packed_seq_params=params)
    if _unwrap(model).post_process:  # GPTModel returns [b=1, t, K] on the last stage
        return out[0, :t] if pad else out[0]
    return out  # hidden states [t, 1, h] for the next pipeline stage


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model


# -- pipeline stages: local parameter names <-> the whole model's ------------------------------------


def _layer_map(module: torch.nn.Module) -> dict[int, int]:
    """{local layer index: global layer index} of this stage's decoder layers."""
    return {i: layer.layer_number - 1 for i, layer in enumerate(_unwrap(module).decoder.layers)}


def global_name(module: torch.nn.Module, name: str, layer_map: dict[int, int] | None = None) -> str:
    """The whole model's name of this stage's parameter `name` (decoder layers renumbered)."""
    if not name.startswith("decoder.layers."):
        return name
    local, rest = name[len("decoder.layers.") :].split(".", 1)
    lm = layer_map if layer_map is not None else _layer_map(module)
    return f"decoder.layers.{lm[int(local)]}.{rest}"


def stage_state(module: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """The entries of a whole-model state dict (global layer numbers) that this pipeline stage
    holds, under the stage's own names; entries of other stages are left out. The caller's strict
    load still finds any tensor of this stage that `state` lacks."""
    lm = _layer_map(module)
    own = {global_name(module, k, lm): k for k in _unwrap(module).state_dict()}
    return {own[k]: v for k, v in state.items() if k in own}


def init_layout_invariant(module: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """Re-draw every backbone weight matrix from a generator seeded by (seed, its whole-model
    name), then take this rank's tensor-parallel slice the way megatron's CPU initialisation does.
    The same seed gives the same model for every TP x PP layout (megatron's own init draws in
    build order, so a later pipeline stage would repeat the first stage's weights). Norms stay 1,
    biases 0, the value head is left alone. Output projections use megatron's scaled std
    (std / sqrt(2 * num_layers))."""
    import hashlib
    import math

    from megatron.core import parallel_state as ps

    m = _unwrap(module)
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    lm = _layer_map(m)
    scaled = std / math.sqrt(2.0 * m.config.num_layers)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.startswith("output_layer.") or p.dim() < 2:
                continue
            g = global_name(m, name, lm)
            dim = getattr(p, "partition_dim", 0) if getattr(p, "tensor_model_parallel", False) else None
            shape = list(p.shape)
            if dim is not None:
                shape[dim] *= tp
            digest = hashlib.sha256(f"{seed}:{g}".encode()).digest()
            gen = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
            s = scaled if g.endswith(("linear_proj.weight", "linear_fc2.weight")) else std
            full = torch.randn(shape, generator=gen) * s
            if dim is not None:
                stride = getattr(p, "partition_stride", 1)
                pieces = torch.split(full, p.shape[dim] // stride, dim=dim)
                full = torch.cat(pieces[tp_rank::tp], dim=dim)
            p.copy_(full.to(dtype=p.dtype))
