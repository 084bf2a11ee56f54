"""Memory settings of a training job and a memory model to plan them (no torch).

`MemoryConfig` holds the knobs Megatron users expect (activation recompute, of every layer or of
the first K of each pipeline stage, the distributed optimizer, sequence parallelism); none of them
changes what is computed, only where memory goes.

`predict_peak` estimates the peak allocated bytes per GPU of one critic training (or forward-only
evaluation) rank; `auto_micro_batch_tokens` picks the largest packed micro-batch that fits a free
memory budget and refuses a row that cannot fit at all, naming what would make it fit.

The model, per GPU of the first pipeline stage (it holds the embedding and, under 1F1B, the
activations of `pp` micro-batches of L/pp layers: as many as one micro-batch through all L layers):

    P_stage   parameters = embedding V*h (first stage) + L/pp * layer + head h*K (last stage);
              matrices split by tp (embedding, qkv, o, fc1, fc2), norms and the head replicated
    static    training, bf16:  2 P (bf16 weights) + 4 P (fp32 grad buffer)
                               + 12 P / d (fp32 master + Adam m, v; d = dp with the distributed
                               optimizer, else 1)
              training, fp32 (CPU): 4 P + 4 P + 8 P / d (no master copy)
              evaluation:      w P (w = 2 bytes bf16, 4 fp32)
    act/token/layer, elements saved for backward (q = heads*d_head, kv = groups*d_head, f = ffn,
    each split by tp; the h-sized ones split by tp too with sequence parallelism):
              none       4h + 3q + 3kv + 3f   (norm in x2, qkv in, qkv out [v keeps it alive],
                                               roped q k, attention out, fc1 out 2f [megatron's
                                               fused SwiGLU keeps only its input], gated product;
                                               fp32 on CPU, unfused, also keeps silu out: 4f)
              selective  4h + 2q + 2kv + 3f   (core attention recomputed: the roped q, k are not
                                               kept; with flash attention that is all it saves)
              full       h per layer kept (its input), plus one layer's `none` set live while
                         that layer is recomputed in backward
              full, K    megatron's block method: the first K layers of each stage keep h, the
                         others the `none` set. With r = min(pp*K, L) input-only layers in flight:
                         r*h + max(L - r, 1) * none (the `none` layers' sets are freed by the
                         time the first K are recomputed); r = 0 is `none`, r = L is `full`
    activations  = c_act * w * tokens * (sum over the layers above) + tokens * (4h + 16K) bytes
              (the head's float32 input and logits / loss temporaries)
    evaluation   = c_eval * w * tokens * (3h + 4f/tp) (one layer's live set, nothing kept); for a
              Qwen3.5 backbone the larger of that and a DeltaNet layer's 2h + its in-projection + 3C +
              6 Hv dv (an estimate from the code, neither counted by a test nor measured yet)
    peak         = static + activations + workspace

Qwen3.5 (hybrid) backbones count each layer by its kind; their norms are zero-centred RMSNorms
computed in float32 (each keeps its float32 input and output, 4h, where the fused norm keeps h: the
layer's shared part is 10h + the MLP's), with, per token (Hk, Hv key and value heads over tp, dk,
dv their dims, K the convolution kernel, C = Hk (2dk + r dv) the convolution's channels; float32
tensors count twice):
    Gated DeltaNet   (K + 2) C (the convolution's input, K - 1 shifted taps, its output, and SiLU's
                     output, which the kernel keeps as v) + 6 Hk dk (q, k in float32 for the L2
                     norm, in bf16 for the kernel) + 10 Hv dv (the output's float32 RMSNorm, the SiLU
                     gate and out_proj's input) + 75 Hv (the gates' float32 steps, the kernel's g and
                     beta, and its A: one 64-token chunk per head); the in-projection's output is
                     not kept (every part of it is copied before use)
    gated attention  10 q + 7 kv (qkv out with the gate rows, float32 QK-norms, roped q k, the
                     attention output, the sigmoid gate and its product); selective recompute
                     drops q + kv, as for plain attention; it does not touch DeltaNet layers
The DeltaNet count outside the kernel is checked against what autograd keeps on CPU
(tests/hf/test_qwen3_5.py); the kernel's share is read off fla 0.6.0's `ChunkGatedDeltaRuleFunction`
(q, k, v, g, beta, A) and the gated-attention count off the code; neither is fitted to a GPU peak yet
(the Qwen3.5 rows of the throughput bench print the prediction beside the measured peak).

`c_act` and `c_eval` (allocator rounding, temporaries the count above misses) and the fixed
workspace are calibrated on the H200 measurements in `MEASURED`: Qwen2.5-0.5B / 1.5B / 3B shapes,
one GPU, bf16, plain Adam, training with the fused SwiGLU on micro-batches of 14,848 to 82,944
tokens (no recompute, and 32k rows with full recompute of 2 layers; the model over-predicts them
by at most 6 %, on the safe side for `--micro-batch-tokens auto`), evaluation on micro-batches of
32,768 tokens.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from value_assets.core.backbone import LINEAR, QWEN2_5_SHAPES, BackboneConfig, CriticShape, LinearAttention
from value_assets.core.errors import InputError
from value_assets.core.objective import Objective

RECOMPUTE = ("none", "selective", "full")
GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class MemoryConfig:
    """Memory features of a training job. None of them changes the result (losses, parameters),
    only the memory / time trade-off; each is recorded in the contract's execution facts."""

    recompute: str = "none"
    """Activation recompute: 'none'; 'selective' (Megatron's: core attention recomputed in
    backward); 'full' (Megatron's uniform recompute of every layer, one layer per checkpoint)."""
    recompute_layers: int | None = None
    """With 'full' only: recompute the first K layers of each pipeline stage (Megatron's block
    method), keep every activation of the others; None: every layer."""
    distributed_optimizer: bool = False
    """Megatron's distributed optimizer: fp32 master weights and Adam moments sharded over the
    data-parallel ranks. Resuming needs the same setting; loading weights for evaluation does not."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs tensor parallel > 1): norms, residuals and dropout
    split the token dimension over the tensor-parallel ranks; packed micro-batches are padded
    to a multiple of tp with masked tokens."""
    optimizer_offload: float = 0.0
    """The fraction (0 to 1) of the optimizer's fp32 master weights, Adam moments and update that
    megatron-core's HybridDeviceOptimizer keeps and computes in host memory (CUDA only; needs the
    distributed optimizer); 0: none. Resuming needs the same fraction."""

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE:
            raise InputError("recompute", f"must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        k = self.recompute_layers
        if k is not None:
            if not isinstance(k, int) or isinstance(k, bool) or k < 1:
                raise InputError("recompute_layers", f"must be an integer >= 1 (unset: every layer), got {k!r}")
            if self.recompute != "full":
                raise InputError("recompute_layers", f"needs recompute 'full', got recompute {self.recompute!r}")
        for name in ("distributed_optimizer", "sequence_parallel"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(name, f"must be true or false, got {getattr(self, name)!r}")
        f = self.optimizer_offload
        if isinstance(f, bool) or not isinstance(f, int | float) or not 0.0 <= f <= 1.0:
            raise InputError("optimizer_offload", f"must be a fraction from 0 to 1, got {f!r}")
        if f > 0 and not self.distributed_optimizer:
            raise InputError(
                "optimizer_offload",
                f"{f:g} needs the distributed optimizer (megatron-core offloads its shards): add "
                "--distributed-optimizer",
            )

    def check_layout(self, *, tensor_parallel: int) -> None:
        """Refuse settings the parallel layout cannot run."""
        if self.sequence_parallel and tensor_parallel < 2:
            raise InputError("sequence_parallel", f"needs tensor_parallel > 1, got tensor_parallel {tensor_parallel}")

    def check_layers(self, *, num_layers: int, pipeline_parallel: int) -> None:
        """Refuse more recomputed layers than a pipeline stage holds (megatron counts per stage)."""
        per_stage = num_layers // pipeline_parallel
        if self.recompute_layers is not None and self.recompute_layers > per_stage:
            raise InputError(
                "recompute_layers",
                (
                    f"counts layers per pipeline stage: at most {per_stage} ({num_layers} layers over "
                    f"{pipeline_parallel} stage(s)), got {self.recompute_layers}"
                ),
            )

    def to_json(self) -> dict[str, Any]:
        """Every setting; `recompute_layers` and `optimizer_offload` only when set (so older
        contracts' bytes are unchanged)."""
        out = asdict(self)
        if self.recompute_layers is None:
            del out["recompute_layers"]
        if not self.optimizer_offload:
            del out["optimizer_offload"]
        else:
            out["optimizer_offload"] = float(self.optimizer_offload)
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> MemoryConfig:
        return cls(**dict(obj))


# ---- the memory model -------------------------------------------------------------------------

DEFAULT_HEAD_SIZE = Objective().head_size  # the default objective's value head (its bins)


# Presets the calibration and the planning table use (core/backbone.py's Qwen2.5 shapes), with the
# default objective's head.
QWEN2_5 = {size: CriticShape(BackboneConfig.qwen2_5(size), DEFAULT_HEAD_SIZE) for size in QWEN2_5_SHAPES}


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How one critic is split over GPUs: tensor- and pipeline-parallel within a replica, dp replicas."""

    tp: int = 1
    pp: int = 1
    dp: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp


# Calibration (see the module docstring). Fitted to MEASURED below; the unit tests hold the
# predictions of those points within 15 %.
C_ACT = 1.1
C_EVAL = 0.95
WORKSPACE_BYTES = int(0.5 * GIB)

# H200, bf16, 1 GPU, plain Adam. Training: bench/results/h200-train-throughput-fused-long.log and
# -fused-pinned.log (the fused SwiGLU); evaluation: h200-train-throughput.json.
MEASURED = (
    {"model": "0.5b", "mode": "train", "micro_batch_tokens": 82944, "peak_gib": 90.6},
    {"model": "1.5b", "mode": "train", "micro_batch_tokens": 32768, "peak_gib": 94.2},
    {"model": "1.5b", "mode": "train", "micro_batch_tokens": 16384, "peak_gib": 60.7},
    {
        "model": "1.5b",
        "mode": "train",
        "micro_batch_tokens": 32767,
        "peak_gib": 88.4,
        "recompute": "full",
        "recompute_layers": 2,
    },
    {"model": "3b", "mode": "train", "micro_batch_tokens": 14848, "peak_gib": 101.8},
    {"model": "0.5b", "mode": "eval", "micro_batch_tokens": 32768, "peak_gib": 2.7},
    {"model": "1.5b", "mode": "eval", "micro_batch_tokens": 32768, "peak_gib": 6.1},
)


def _stage_layers(shape: CriticShape, layout: Layout) -> range:
    """Layer indices of the first pipeline stage."""
    return range(math.ceil(shape.backbone.num_layers / layout.pp))


def stage_params(shape: CriticShape, layout: Layout) -> int:
    """Parameters held by one GPU of the first pipeline stage (the largest one: the embedding)."""
    b, h, tp = shape.backbone, shape.backbone.hidden_size, layout.tp
    n = b.vocab_size * h / tp + sum((b.layer_params(i) - 2 * h) / tp + 2 * h for i in _stage_layers(shape, layout))
    if layout.pp == 1:
        n += h + h * shape.head_size + shape.head_size
    return int(n)


def static_bytes(
    shape: CriticShape, layout: Layout, memory: MemoryConfig, *, train: bool = True, bf16: bool = True
) -> int:
    """Weights (+ grads + optimizer state when training) on one GPU. With `optimizer_offload` f,
    the fraction f of the optimizer's shard (bf16: fp32 master weights and two Adam moments) lives
    in host memory instead (`host_bytes`)."""
    p = stage_params(shape, layout)
    if not train:
        return p * (2 if bf16 else 4)
    shard = layout.dp if memory.distributed_optimizer else 1
    kept = 1.0 - memory.optimizer_offload
    if bf16:
        return int(2 * p + 4 * p + kept * 12 * p / shard)
    return int(4 * p + 4 * p + kept * 8 * p / shard)


def host_bytes(
    shape: CriticShape, layout: Layout, memory: MemoryConfig, *, bf16: bool = True, pinned: bool = False
) -> int:
    """Host memory one GPU's training process holds for the offloaded optimizer: per offloaded
    parameter its fp32 master weight, two Adam moments and an fp32 copy of its gradient (megatron-
    core's HybridDeviceOptimizer); 0 without `optimizer_offload`. `pinned`: the most it can be when
    the gradient copies are pinned (gpu/runtime/step.fit_host_gradients pins them where they fit):
    torch's pinned allocator rounds each buffer up to a power of two, at most doubling it (7B at
    offload 0.75 on an H100: 97.6 GiB against this bound's 98.8 and the pageable 79.0)."""
    shard = layout.dp if memory.distributed_optimizer else 1
    grad = 8 if pinned else 4  # the fp32 gradient copy, rounded up at most to twice its size when pinned
    per_param = (12 if bf16 else 8) + grad  # + fp32 master (bf16 only) + 2 moments
    return int(memory.optimizer_offload * per_param * stage_params(shape, layout) / shard)


def delta_net_elements(la: LinearAttention, tp: int) -> float:
    """Elements a Gated DeltaNet token mixer keeps for backward per token (module docstring)."""
    hk, hv, channels = la.key_heads / tp, la.value_heads / tp, la.conv_channels / tp
    return (la.conv_kernel + 2) * channels + 6 * hk * la.key_head_dim + 10 * hv * la.value_head_dim + 75 * hv


def delta_net_kernel_elements(la: LinearAttention, tp: int) -> float:
    """The share of `delta_net_elements` that flash-linear-attention's kernel saves: q and k in bf16,
    v (a view of SiLU's output, which holds all its channels alive), g (float32), beta and A."""
    hk, hv = la.key_heads / tp, la.value_heads / tp
    return 2 * hk * la.key_head_dim + la.conv_channels / tp + 67 * hv


def saved_elements_per_token_layer(
    shape: CriticShape,
    layout: Layout,
    memory: MemoryConfig,
    recompute: str | None = None,
    *,
    fused_swiglu: bool = True,
    index: int = 0,
) -> float:
    """Elements kept for backward per token by layer `index` (no recompute factor for 'full').
    `fused_swiglu`: megatron's fused SwiGLU (the critic on CUDA) keeps fc1's output only; the
    plain ops (CPU) also keep silu's output."""
    b, tp = shape.backbone, layout.tp
    h = b.hidden_size / (tp if memory.sequence_parallel else 1)
    q, kv, f = b.q_size / tp, b.kv_size / tp, b.ffn_hidden_size / tp
    mlp = (3 if fused_swiglu else 4) * f
    selective = (recompute or memory.recompute) == "selective"
    if b.family != "qwen3_5":
        return 4 * h + (2 if selective else 3) * (q + kv) + mlp
    if b.layer_type(index) == LINEAR:
        assert b.linear_attention is not None
        return 10 * h + delta_net_elements(b.linear_attention, tp) + mlp
    return 10 * h + 10 * q + 7 * kv - (q + kv if selective else 0) + mlp


def recomputed_layers(shape: CriticShape, layout: Layout, memory: MemoryConfig) -> int:
    """Layers in flight on the first stage that keep only their input: pp micro-batches of the
    first K of its layers (block method), all L under plain 'full', none without 'full'."""
    if memory.recompute != "full":
        return 0
    if memory.recompute_layers is None:
        return shape.backbone.num_layers
    return min(layout.pp * memory.recompute_layers, shape.backbone.num_layers)


def _eval_live_elements(shape: CriticShape, layout: Layout) -> float:
    """Elements live per token in the forward of the largest layer (nothing kept): the MLP's 3h + 4f,
    or a Gated DeltaNet's in-projection, convolution and float32 output (module docstring)."""
    b, tp = shape.backbone, layout.tp
    h, f = b.hidden_size, b.ffn_hidden_size
    live = 3 * h + 4 * f / tp
    if b.linear_attention is not None:
        la = b.linear_attention
        vd = la.value_heads * la.value_head_dim / tp
        live = max(live, 2 * h + la.in_proj_width / tp + 3 * la.conv_channels / tp + 6 * vd)
    return live


def activation_bytes(
    shape: CriticShape, layout: Layout, memory: MemoryConfig, tokens: int, *, train: bool = True, bf16: bool = True
) -> int:
    """Activation memory of one packed micro-batch of `tokens` tokens (see the module docstring)."""
    w = 2 if bf16 else 4
    h, tp = shape.backbone.hidden_size, layout.tp
    head = 4 * h + 16 * shape.head_size
    if not train:
        return int(C_EVAL * w * tokens * _eval_live_elements(shape, layout) + tokens * head)
    # 1F1B: the first stage holds min(pp, micro-batches) in flight; with L/pp layers each that is
    # the activations of the whole model for one micro-batch.
    layers = shape.backbone.num_layers
    mode = "selective" if memory.recompute == "selective" else "none"
    kept = [
        saved_elements_per_token_layer(shape, layout, memory, mode, fused_swiglu=bf16, index=i) for i in range(layers)
    ]
    if memory.recompute == "selective":
        per_token = sum(kept)
    else:
        hs = h / (tp if memory.sequence_parallel else 1)
        r = recomputed_layers(shape, layout, memory)
        # The layers past the first r keep everything; with every layer recomputed, one layer's set
        # is live while it is recomputed in backward.
        per_token = r * hs + (sum(kept[r:]) if r < layers else max(kept))
    return int(C_ACT * w * tokens * per_token + tokens * head)


def predict_peak(
    shape: CriticShape, layout: Layout, memory: MemoryConfig, tokens: int, *, train: bool = True, bf16: bool = True
) -> int:
    """Predicted peak allocated bytes per GPU for packed micro-batches of `tokens` tokens."""
    return (
        static_bytes(shape, layout, memory, train=train, bf16=bf16)
        + activation_bytes(shape, layout, memory, tokens, train=train, bf16=bf16)
        + WORKSPACE_BYTES
    )


def max_tokens(
    shape: CriticShape,
    layout: Layout,
    memory: MemoryConfig,
    budget_bytes: int,
    *,
    train: bool = True,
    bf16: bool = True,
) -> int:
    """The largest micro-batch token count whose predicted peak fits `budget_bytes` (0 if none)."""
    room = budget_bytes - static_bytes(shape, layout, memory, train=train, bf16=bf16) - WORKSPACE_BYTES
    if room <= 0:
        return 0
    per_token = activation_bytes(shape, layout, memory, 1_000_000, train=train, bf16=bf16) / 1_000_000
    return max(0, int(room / per_token))


def more_recompute(shape: CriticShape, layout: Layout, memory: MemoryConfig) -> list[MemoryConfig]:
    """The recompute settings that save more activation memory than `memory`'s, cheapest first:
    selective, full of the first K = 1, 2, ... layers of each stage, full of every layer."""
    per_stage = max(1, shape.backbone.num_layers // layout.pp)
    options = [("selective", None)] + [("full", k) for k in range(1, per_stage)] + [("full", None)]
    mine = (memory.recompute, memory.recompute_layers)
    start = 0 if memory.recompute == "none" else options.index(mine) + 1 if mine in options else len(options)
    return [replace(memory, recompute=rc, recompute_layers=k) for rc, k in options[start:]]


def recompute_flags(memory: MemoryConfig) -> str:
    """The command-line flags of `memory`'s recompute setting."""
    flags = f"--recompute {memory.recompute}"
    return flags if memory.recompute_layers is None else f"{flags} --recompute-layers {memory.recompute_layers}"


def auto_micro_batch_tokens(
    shape: CriticShape,
    layout: Layout,
    memory: MemoryConfig,
    *,
    free_bytes: int,
    longest_row: int,
    longest_row_where: str = "the longest row",
    multiple: int = 256,
    safety: float = 0.9,
    bf16: bool = True,
) -> int:
    """`--micro-batch-tokens auto`: the largest packed micro-batch (a multiple of `multiple`
    tokens) that fits `safety * free_bytes`. Refuses, with what would make it fit, when the
    longest row (model tokens) does not fit on its own."""
    budget = int(free_bytes * safety)
    t = max_tokens(shape, layout, memory, budget, bf16=bf16)
    t = (t // multiple) * multiple
    if t >= longest_row:
        return t
    need = predict_peak(shape, layout, memory, longest_row, bf16=bf16) / safety
    hints = []
    for alt in more_recompute(shape, layout, memory):
        if max_tokens(shape, layout, alt, budget, bf16=bf16) >= longest_row:
            hints.append(recompute_flags(alt))
            break
    if not memory.distributed_optimizer and layout.dp > 1:
        alt = replace(memory, distributed_optimizer=True)
        if max_tokens(shape, layout, alt, budget, bf16=bf16) >= longest_row:
            hints.append("--distributed-optimizer")
    linear = shape.backbone.linear_attention
    # Gated DeltaNet (Qwen3.5) layers refuse sequence parallelism and split their key heads by tp.
    sp = linear is None
    for tp in (2, 4, 8):
        if tp <= layout.tp or shape.backbone.num_query_groups % tp or (linear is not None and linear.key_heads % tp):
            continue
        alt_layout = Layout(tp=tp, pp=layout.pp, dp=layout.dp)
        alt = MemoryConfig(
            recompute="full",
            distributed_optimizer=memory.distributed_optimizer,
            sequence_parallel=sp,
            optimizer_offload=memory.optimizer_offload,
        )
        if max_tokens(shape, alt_layout, alt, budget, bf16=bf16) >= longest_row:
            hints.append(
                f"--tensor-parallel {tp}{' --sequence-parallel' if sp else ''} --recompute full (x{tp} the GPUs)"
            )
            break
    if memory.optimizer_offload < 1 and bf16:
        alt = replace(memory, distributed_optimizer=True, optimizer_offload=1.0)
        if max_tokens(shape, layout, alt, budget, bf16=bf16) >= longest_row:
            hints.append(
                f"--distributed-optimizer --optimizer-offload 1 ({host_bytes(shape, layout, alt) / GIB:.0f} to "
                f"{host_bytes(shape, layout, alt, pinned=True) / GIB:.0f} GiB of host memory per GPU)"
            )
    layers = "" if memory.recompute_layers is None else f" of {memory.recompute_layers} layers per stage"
    hints.append(f"a GPU with {need / GIB:.1f} GiB free, or dropping rows longer than {t} tokens")
    raise InputError(
        "micro_batch_tokens",
        (
            f"auto: {longest_row_where} has {longest_row} model tokens but at most {t} fit in "
            f"{free_bytes / GIB:.1f} GiB free (x{safety} safety) with tp {layout.tp}, pp {layout.pp}, dp {layout.dp}, "
            f"recompute {memory.recompute}{layers}, distributed optimizer {memory.distributed_optimizer}"
            f"{f', optimizer offload {memory.optimizer_offload:g}' if memory.optimizer_offload else ''}; "
            f"it would fit with: {'; or '.join(hints)}"
        ),
    )
