"""One optimizer step per planned batch, and forward-only evaluation, for one rank.

`wrap_for_training` puts the critic in megatron DDP and builds megatron's Adam (fp32 grads;
optionally megatron's distributed optimizer); `optimizer_step` runs megatron's forward-backward schedule
over this rank's packed micro-batches and steps (1F1B across pipeline stages); `evaluate_rows` returns per-row
predicted values aligned with the returns (on the last pipeline stage).

Scaling (why the config sets `calculate_per_token_loss=True`): each micro-batch's loss is already
"sum of row means / global rows" (losses.py), so the schedule must not divide by the micro-batch
count and DDP must sum gradients over data-parallel ranks instead of averaging them; that flag
gives exactly both. Gradient finalisation is megatron's `finalize_model_grads` with
`num_tokens=None` (no further token normalisation).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np
import torch

from value_assets.core.errors import InputError
from value_assets.core.memory import GIB
from value_assets.core.objective import Objective
from value_assets.gpu.model.gpt_critic import critic_forward
from value_assets.gpu.model.losses import STAT_KEYS, finalize_metrics, loss_and_stats, predicted_values
from value_assets.gpu.model.packing import MicroBatch, response_slices
from value_assets.gpu.runtime.checkpoint import inner_optimizers, step_on_device


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def wrap_for_training(
    model: torch.nn.Module,
    *,
    lr: float,
    weight_decay: float,
    clip_grad: float,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    distributed_optimizer: bool = False,
    optimizer_offload: float = 0.0,
    freeze: str = "none",
    head_bias: str = "trained",
) -> tuple[torch.nn.Module, Any]:
    """Wrap the critic in megatron DDP and build the Adam optimizer. Returns (ddp_model, optimizer).

    `freeze` ('none', 'attention', 'backbone'; `frozen_parameter_names`): those parameters get
    `requires_grad=False` before the wrap, so megatron DDP gives them no grad buffer or hook and
    the optimizer (plain or distributed, which shards DDP's buffers) no state: they never change.
    `head_bias` 'zero' adds the value head's bias (built as zeros) to them: it stays exactly 0.

    `distributed_optimizer`: megatron's distributed optimizer (fp32 master weights and Adam
    moments sharded over the data-parallel ranks; gradients reduce-scattered, updated weights
    all-gathered). The same steps as the plain optimizer up to summation order.

    `optimizer_offload` f > 0 (CUDA, with the distributed optimizer): megatron-core's
    HybridDeviceOptimizer keeps the fraction f of the shard's fp32 master weights and Adam moments
    in host memory and runs their update on the CPU (torch's AdamW; the rest on the GPU), copies
    overlapped with the step (megatron's precision-aware path: the bf16 weights' gradients go to
    the host, pinned where they fit: `fit_host_gradients`; the updated weights come back). Weight
    decay is AdamW's (decoupled), as in the plain path."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from value_assets.gpu.runtime import grad_norm

    grad_norm.install()
    frozen = set(frozen_parameter_names(model, freeze, head_bias))
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    cfg = model.config
    ddp = DistributedDataParallel(
        config=cfg,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=distributed_optimizer,
            check_for_nan_in_grad=True,
            bucket_size=None,
        ),
        module=model,
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=lr,
            weight_decay=weight_decay,
            adam_beta1=betas[0],
            adam_beta2=betas[1],
            adam_eps=eps,
            clip_grad=clip_grad,
            bf16=cfg.bf16,
            params_dtype=cfg.params_dtype,
            use_distributed_optimizer=distributed_optimizer,
            **_offload_settings(optimizer_offload, distributed_optimizer),
        ),
        [ddp],
    )
    if distributed_optimizer:
        _init_adam_state(opt)
    if optimizer_offload:
        opt.host_gradients = fit_host_gradients(opt)
    cfg.finalize_model_grads_func = lambda models, num_tokens=None, **kw: finalize_model_grads(models, None, **kw)
    cfg.grad_scale_func = opt.scale_loss
    return ddp, opt


def _offload_settings(fraction: float, distributed_optimizer: bool) -> dict[str, Any]:
    """megatron-core's OptimizerConfig fields for optimizer CPU offload (none at 0)."""
    if not fraction:
        return {}
    if not distributed_optimizer or not torch.cuda.is_available():
        raise ValueError(f"optimizer_offload {fraction:g} needs CUDA and the distributed optimizer")
    return {
        "optimizer_cpu_offload": True,
        "optimizer_offload_fraction": float(fraction),
        "use_precision_aware_optimizer": True,
        "overlap_cpu_optimizer_d2h_h2d": True,
    }


def _pinned_bytes(nbytes: int) -> int:
    """What torch's pinned host allocator reserves for `nbytes`: the next power of two."""
    return 1 << max(nbytes - 1, 0).bit_length()


def _available_host_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line")


def fit_host_gradients(optimizer: Any, available: int | None = None, ranks_on_node: int | None = None) -> str:
    """Choose where the offloaded parameters' fp32 gradients land before the first step allocates them.

    megatron-core's HybridDeviceOptimizer copies each offloaded parameter's gradient into a pinned
    host buffer (the copy then overlaps the step), and torch's pinned allocator rounds every buffer
    up to a power of two: for a 7B critic at offload 1 that is 49.5 GiB instead of 26.3, and with
    the fp32 master weights and Adam moments (79 GiB, allocated by now) the first step outgrew a
    128 GiB host: the kernel killed the worker (found on an H100). Here, with the rest of the
    optimizer already allocated, the gradients are pinned if they fit the host's available memory
    (shared by the node's training processes), else they go to pageable memory (same values, the
    copy no longer overlaps); if not even that fits, a clear error before any step. Returns
    'pinned' or 'pageable'."""
    subs = [inner for inner in inner_optimizers(optimizer) if hasattr(inner, "cpu_copys_map_gpu_param")]
    cpu_params = [p for inner in subs for p in inner.cpu_copys_map_gpu_param]
    exact = sum(p.numel() * p.element_size() for p in cpu_params)
    pinned = sum(_pinned_bytes(p.numel() * p.element_size()) for p in cpu_params)
    if ranks_on_node is None:
        ranks_on_node = _ranks_on_this_node()
    if available is None:
        available = _available_host_bytes()
    share = available // max(ranks_on_node, 1)
    if exact > share:
        raise InputError(
            "optimizer_offload",
            f"the offloaded optimizer's gradients need {exact / GIB:.1f} GiB of host memory per GPU, but "
            f"{available / GIB:.1f} GiB is available to the {ranks_on_node} training process(es) on this node "
            f"after its master weights and moments: offload less (or add host memory)",
        )
    mode = "pinned" if pinned <= share else "pageable"
    for inner in subs:
        inner.pin_cpu_grads = mode == "pinned"
    return mode


def _ranks_on_this_node() -> int:
    """Training processes on this machine (they share its host memory), gathered once."""
    import socket

    if not torch.distributed.is_initialized():
        return 1
    names: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(names, socket.gethostname())
    return names.count(socket.gethostname())


def frozen_parameter_names(model: torch.nn.Module, freeze: str, head_bias: str = "trained") -> list[str]:
    """Names of the critic's parameters that `freeze` keeps fixed: 'attention': every parameter
    of a layer's `self_attention` (QKV, output projection, q/k norms); 'backbone': every parameter
    but the value head's (`output_layer.*`); 'none': nothing. `head_bias` 'zero' adds the value
    head's bias (`output_layer.bias`, on the last pipeline stage)."""
    names = [n for n, _ in model.named_parameters()]
    if head_bias == "zero":
        return sorted(set(frozen_parameter_names(model, freeze)) | {n for n in names if n == "output_layer.bias"})
    if head_bias != "trained":
        raise ValueError(f"head_bias must be 'trained' or 'zero', got {head_bias!r}")
    if freeze == "none":
        return []
    if freeze == "attention":
        return [n for n in names if ".self_attention." in n]
    if freeze == "backbone":
        return [n for n in names if not n.startswith("output_layer.")]
    raise ValueError(f"freeze must be 'none', 'attention' or 'backbone', got {freeze!r}")


def _init_adam_state(optimizer: Any) -> None:
    """Give torch's Adam inside megatron's distributed optimizer its state (step 0, zero moments)
    up front, as its first step would. megatron reads the step count from that state to save or
    load the optimizer (without Transformer Engine or Apex), so a fresh optimizer could not load
    a checkpoint before its first step otherwise. The first step computes the same either way.

    With optimizer offload the inner optimizer is megatron-core's HybridDeviceOptimizer: its GPU
    and CPU sub-optimizers (torch AdamW, fused) get the state, then it gathers their state into its
    own (with the fp32 master weights), as it does after each step."""
    for inner in inner_optimizers(optimizer):
        subs = getattr(inner, "sub_optimizers", None)
        for adam in subs if subs is not None else [inner]:
            if isinstance(adam, torch.optim.Adam):  # Transformer Engine / Apex FusedAdam keep their step elsewhere
                _zero_adam_state(adam)
        if subs is not None:
            inner._sync_sub_optimizers_state_to_hdo()


def _zero_adam_state(adam: torch.optim.Adam) -> None:
    """Step 0 and zero moments for every parameter without state, where torch's Adam would put
    them at its first step (a fused or capturable Adam keeps `step` on the parameter's device)."""
    for group in adam.param_groups:
        on_device = step_on_device(group)
        for p in group["params"]:
            if not adam.state[p]:
                step = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
                adam.state[p].update(step=step, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))


def set_lr(optimizer: Any, lr: float) -> None:
    """Set the learning rate of every param group (the driver owns the schedule)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def _dp_all_reduce(t: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    if ps.get_data_parallel_world_size() > 1:
        torch.distributed.all_reduce(t, group=ps.get_data_parallel_group())
    return t


def _from_last_stage(t: torch.Tensor) -> torch.Tensor:
    """Sum over the pipeline group: only the last stage computes losses, the others hold zeros,
    so every stage ends with the last stage's values."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(t, group=ps.get_pipeline_model_parallel_group())
    return t


def _forward_step(dev: torch.device, bind_loss):
    """megatron's `forward_step_func`: the next packed micro-batch to `dev`, the critic's forward,
    and the loss function `bind_loss(host_mb, device_mb)` returns (used on the last stage)."""

    def forward_step(data_iterator, m):
        host = next(data_iterator)
        mb = host.to(dev)
        out = critic_forward(
            m, mb.tokens, mb.position_ids, mb.cu_seqlens, mb.max_seqlen, cu_seqlens_host=host.cu_seqlens
        )
        return out, bind_loss(host, mb)

    return forward_step


def _run_schedule(model: torch.nn.Module, forward_step, microbatches: Sequence[MicroBatch], forward_only: bool) -> None:
    """megatron's forward(-backward) schedule over the packed micro-batches: no pipelining for one
    stage, 1F1B across stages (activation shapes differ per micro-batch: the config's
    `variable_seq_lengths` makes the stages exchange them first)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(microbatches),
        model=model,
        num_microbatches=len(microbatches),
        seq_length=max(mb.num_tokens for mb in microbatches),
        micro_batch_size=1,
        forward_only=forward_only,
    )


def optimizer_step(
    model: torch.nn.Module,
    optimizer: Any,
    microbatches: Sequence[MicroBatch],
    global_num_rows: int,
    objective: Objective,
    *,
    per_token: bool = False,
    global_num_active: int | None = None,
) -> dict[str, Any]:
    """One optimizer step over this rank's micro-batches (rows of the global batch assigned to this
    dp rank, already packed). `global_num_rows` is the planned global batch size G.

    Every pipeline stage of a data-parallel rank gets the same rows (and so the same micro-batches).
    Returns metrics (global, identical on every rank and stage): loss, value_accuracy, entropy,
    explained_variance (None where undefined), grad_norm, lr, update_successful, rows,
    active_targets, tokens (global packed tokens), tokens_per_s, step_time_s.
    """
    if not microbatches:
        raise ValueError("optimizer_step needs at least one micro-batch on every rank")
    t0 = time.perf_counter()
    dev = _device()
    model.train()
    model.zero_grad_buffer()
    optimizer.zero_grad()
    stats_acc = torch.zeros(len(STAT_KEYS), dtype=torch.float64, device=dev)

    def loss_func(host: MicroBatch, mb: MicroBatch, head_out: torch.Tensor):
        loss, stats = loss_and_stats(
            head_out,
            mb.returns,
            mb.mask,
            mb.cu_seqlens,
            objective,
            global_num_rows,
            per_token,
            global_num_active,
            host_mask=(host.mask, host.cu_seqlens),
        )
        stats_acc.add_(stats.to(dev))
        # (loss, num_tokens, reporting): with calculate_per_token_loss the schedule backprops
        # `loss` unscaled; num_tokens is ignored by our finalize function.
        return loss, torch.tensor(mb.num_tokens, dtype=torch.int), {}

    _run_schedule(
        model, _forward_step(dev, lambda host, mb: partial(loss_func, host, mb)), microbatches, forward_only=False
    )
    update_successful, grad_norm, _ = optimizer.step()
    tokens = torch.full((1,), float(sum(mb.num_tokens for mb in microbatches)), dtype=torch.float64, device=dev)
    _from_last_stage(stats_acc)
    _dp_all_reduce(stats_acc)
    _dp_all_reduce(tokens)
    metrics: dict[str, Any] = finalize_metrics(stats_acc, objective)
    total_tokens = float(tokens.item())
    dt = time.perf_counter() - t0
    metrics.update(
        grad_norm=None if grad_norm is None else float(grad_norm),
        lr=float(optimizer.param_groups[0]["lr"]),
        update_successful=bool(update_successful),
        tokens=total_tokens,
        step_time_s=dt,
        tokens_per_s=total_tokens / dt if dt > 0 else None,
    )
    return metrics


@torch.no_grad()
def evaluate_rows(
    model: torch.nn.Module, microbatches: Sequence[MicroBatch], objective: Objective
) -> dict[int, dict[str, np.ndarray]]:
    """Forward-only (eval mode, no grad). Returns {row_id: {"values": float64 [r],
    "returns": float64 [r], "mask": float64 [r]}}, values[j] = V at the position that predicts
    response token j (docs/rules.md#critic). With pipeline stages, only the last stage has values; the other
    stages return {} (they still run their part of every forward)."""
    from megatron.core import parallel_state as ps

    microbatches = list(microbatches)
    out: dict[int, dict[str, np.ndarray]] = {}
    if not microbatches:
        return out
    dev = _device()
    was_training = model.training
    model.eval()

    def collect(mb: MicroBatch, head_out: torch.Tensor):
        v = predicted_values(head_out, objective).to(torch.float64).cpu().numpy()
        for rid, sl in response_slices(mb):
            out[rid] = {
                "values": v[sl].copy(),
                "returns": mb.returns[sl].to(torch.float64).numpy(),
                "mask": mb.mask[sl].to(torch.float64).numpy(),
            }
        return head_out.new_zeros(()), torch.tensor(mb.num_tokens, dtype=torch.int), {}

    forward_step = _forward_step(dev, lambda host, mb: partial(collect, host))
    try:
        if ps.get_pipeline_model_parallel_world_size() == 1:
            # One stage: the same forward without the schedule's bookkeeping.
            for mb in microbatches:
                head, fn = forward_step(iter([mb]), model)
                fn(head)
        else:
            _run_schedule(model, forward_step, microbatches, forward_only=True)
    finally:
        model.train(was_training)
    return out
