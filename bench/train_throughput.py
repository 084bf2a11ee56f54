"""Critic training / evaluation throughput on one GPU: our megatron critic vs a Hugging Face critic.

For critics shaped like Qwen2.5-0.5B and Qwen2.5-1.5B (random weights), on rows drawn from a
realistic RL length mix (prompt 128-1024, response 64-3072 tokens, lognormal, prompt+response <=
4096, fixed seed), measures per model:

  ours  train  megatron critic (bf16, world size 1), `optimizer_step` over packed micro-batches of
               <= --micro-batch-tokens tokens, a global batch of --global-batch rows, megatron Adam
  ours  eval   `evaluate_rows` (eval mode, no grad; includes the per-row host copy of values)
  ours  fwd    raw packed forward (`critic_forward` + predicted values, copied to host), no grad
  hf    train  transformers Qwen2 `AutoModel` (sdpa, bf16 params) + nn.Linear(h, K) fp32 head,
               padded micro-batches (rows in order, each micro-batch padded to its longest row,
               rows * longest <= --micro-batch-tokens), same loss, grad clip 1.0, fused AdamW
  hf    fwd    the same model forward-only on the same padded micro-batches

tokens/s counts real tokens only (the L-1 model tokens of every row; padding never counts).
TFLOP/s and MFU use the useful-FLOP count in bench/_flops.py (printed in the footer); MFU's
denominator is 790 TFLOP/s, the bf16 matmul rate measured on this workplace's H200.

    python bench/train_throughput.py                      # both shapes, all modes (H200)
    python bench/train_throughput.py --profile            # + torch.profiler of ours-train, 1.5B
    python bench/train_throughput.py --rows all --profile 0.5b,1.5b@32k   # + the rows below, 2 profiles
    python bench/train_throughput.py --smoke --rows all --profile tiny,tiny@224   # tiny model on CPU

Long-row and bigger-critic rows (`--rows long`; `--rows all` = today's rows, then these):

  1.5b@8k / @16k / @32k  ours train on rows of exactly 8k / 16k / 32k tokens (prompt 1024, the rest
               response), micro-batches of max(--micro-batch-tokens, row) tokens, --long-global-batch
               rows per step; activation recompute: the least that the memory model
               (value_assets/core/memory.py) predicts to fit 85 % of the GPU, trying none, selective,
               full of the first K = 1 .. L-1 layers (megatron's block method), full (--long-recompute
               and --long-recompute-layers override). Recomputed FLOPs are not counted in MFU.
  1.5b dist-opt  ours train on the 4k mix with the distributed optimizer (one GPU: dp 1, so nothing
               is sharded; the path runs on the GPU, its peak and speed beside the plain 1.5b row)
  3b           a Qwen2.5-3B-shaped critic (hidden 2048, 36 layers, 16 heads, 2 KV groups, ffn 11008)
               on today's 4k length mix, ours eval / fwd / train; micro-batch: the largest the memory
               model fits (`--micro-batch-tokens auto`), at most --micro-batch-tokens
  hf @8k .. @32k  the Hugging Face critic's train on the same long rows (no recompute, one row per
               padded micro-batch at 16k and up, --long-hf-global-batch rows per step): the floor,
               run last; where it runs out of memory its row says OOM (with the peak reached)

Every ours row also prints the memory model's predicted peak beside the measured one. A row that
runs out of memory prints OOM and the next row runs.

`--profile ROWS` profiles ours-train of the rows labelled in ROWS (as in the table's model column)
and prints, besides the top kernels, the profiled wall time grouped by kind: matmul (gemm) kernels,
attention kernels, normalization kernels, SwiGLU kernels, other elementwise kernels, the optimizer step, copies,
communication, and the idle / launch gaps where no kernel runs (on CPU: op self time, and the
time outside any op); also the part that is recomputed forward. The groups go to --json too.

`--sync-audit ROWS` runs one more ours-train step (and one more evaluation batch) of each row
labelled in ROWS under torch's CUDA sync debug mode and prints every Python line that made the
host wait for the GPU (`.item()`, `.tolist()`, copies from pageable host memory, ...), with its
count per step: each such wait drains the launch queue, and the GPU idles until the host has
queued the next kernels.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import os
import re
import resource
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from value_assets.core.backbone import CriticShape, qwen3_5
from value_assets.core.errors import InputError
from value_assets.core.memory import (
    GIB,
    RECOMPUTE,
    Layout,
    MemoryConfig,
    auto_micro_batch_tokens,
    host_bytes,
    more_recompute,
    predict_peak,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._flops import FORMULA, flops_per_token, matmul_params, s_eff

PEAK_TFLOPS = 790.0  # bf16 dense matmul, measured on this workplace's H200 (docs/operations.md)
CUDA = torch.cuda.is_available()


# --------------------------------------------------------------------------------------- data


def length_mix(n: int, seed: int, smoke: bool) -> list[tuple[int, int]]:
    """(prompt, response) lengths: lognormal, clipped; prompt + response <= cap."""
    rng = np.random.default_rng(seed)
    if smoke:
        (p_lo, p_hi, p_med), (r_lo, r_hi, r_med), cap = (8, 48, 20), (4, 120, 40), 160
    else:
        (p_lo, p_hi, p_med), (r_lo, r_hi, r_med), cap = (128, 1024, 400), (64, 3072, 700), 4096
    out = []
    for _ in range(n):
        p = int(np.clip(rng.lognormal(math.log(p_med), 0.6), p_lo, p_hi))
        r = int(np.clip(rng.lognormal(math.log(r_med), 0.9), r_lo, r_hi))
        r = max(r_lo, min(r, cap - p))
        out.append((p, r))
    return out


def make_batches(num_batches: int, batch_rows: int, vocab: int, seed: int, smoke: bool):
    from value_assets.gpu.model.packing import Row

    lens = length_mix(num_batches * batch_rows, seed, smoke)
    rng = np.random.default_rng(seed + 1)
    rows = []
    for i, (p, r) in enumerate(lens):
        rows.append(
            Row(
                row_id=i, tokens=rng.integers(0, vocab, p + r, dtype=np.int64), response_length=r, returns=rng.random(r)
            )
        )
    return [rows[i * batch_rows : (i + 1) * batch_rows] for i in range(num_batches)]


def fixed_length_batches(num_batches: int, batch_rows: int, vocab: int, seed: int, length: int, prompt: int):
    """Rows of exactly `length` tokens: `prompt` prompt tokens, the rest response."""
    from value_assets.gpu.model.packing import Row

    rng = np.random.default_rng(seed + 2)
    rows = [
        Row(
            row_id=i,
            tokens=rng.integers(0, vocab, length, dtype=np.int64),
            response_length=length - prompt,
            returns=rng.random(length - prompt),
        )
        for i in range(num_batches * batch_rows)
    ]
    return [rows[i * batch_rows : (i + 1) * batch_rows] for i in range(num_batches)]


def model_lens(rows) -> list[int]:
    return [len(r.tokens) - 1 for r in rows]


def pad_groups(rows, budget: int) -> list[list]:
    """Rows in order; a micro-batch closes when (rows + 1) * longest would exceed the budget."""
    groups, cur, longest = [], [], 0
    for row in rows:
        n = len(row.tokens) - 1
        if cur and (len(cur) + 1) * max(longest, n) > budget:
            groups.append(cur)
            cur, longest = [], 0
        cur.append(row)
        longest = max(longest, n)
    if cur:
        groups.append(cur)
    return groups


def pad_batch(rows) -> dict[str, torch.Tensor]:
    """Right-padded [B, T] input_ids / attention_mask / returns / mask (docs/rules.md#critic alignment)."""
    T = max(len(r.tokens) - 1 for r in rows)
    B = len(rows)
    ids = torch.zeros(B, T, dtype=torch.long)
    am = torch.zeros(B, T, dtype=torch.long)
    ret = torch.zeros(B, T, dtype=torch.float32)
    msk = torch.zeros(B, T, dtype=torch.float32)
    for b, row in enumerate(rows):
        L, r = len(row.tokens), row.response_length
        n, p = L - 1, L - r
        ids[b, :n] = torch.from_numpy(row.tokens[:n])
        am[b, :n] = 1
        ret[b, p - 1 : p - 1 + r] = torch.from_numpy(np.asarray(row.returns, dtype=np.float32))
        msk[b, p - 1 : p - 1 + r] = 1.0
    return {"input_ids": ids, "attention_mask": am, "returns": ret, "mask": msk}


# ----------------------------------------------------------------------------------- helpers


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def reset_peak() -> None:
    if CUDA:
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if CUDA else None


def free_memory() -> None:
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def timed(fn_warm: Callable[[], None], fn_run: Callable[[], None]) -> float:
    fn_warm()
    sync()
    t0 = time.perf_counter()
    fn_run()
    sync()
    return time.perf_counter() - t0


class Results:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.profiles: list[dict[str, Any]] = []  # profile_steps' summaries
        self.sync_audits: dict[str, list[dict[str, Any]]] = {}  # sync_audit's rows per model row

    def add(
        self,
        model: str,
        system: str,
        mode: str,
        *,
        seconds: float | None = None,
        tokens: int = 0,
        flops_tok: float = 0.0,
        steps: int = 1,
        error: str | None = None,
        **extra: Any,
    ) -> None:
        rec: dict[str, Any] = dict(model=model, system=system, mode=mode, error=error, **extra)
        if error == "OOM":
            rec["peak_gib"] = peak_gib()  # where it ran out
        elif seconds:
            tps = tokens / seconds
            tflops = tps * flops_tok / 1e12
            rec.update(
                tokens_per_s=tps,
                tflops=tflops,
                mfu=tflops / PEAK_TFLOPS,
                step_time_s=seconds / steps,
                timed_tokens=tokens,
                timed_s=seconds,
                flops_per_token=flops_tok,
                peak_gib=peak_gib(),
            )
        self.rows.append(rec)
        msg = f"  -> {system} {mode}: " + (
            f"{rec['tokens_per_s']:,.0f} tok/s, {rec['tflops']:.1f} TFLOP/s, MFU {100 * rec['mfu']:.1f}%"
            if error is None
            else f"ERROR {error}"
        )
        print(msg, flush=True)

    def get(self, model: str, system: str, mode: str) -> float | None:
        for r in self.rows:
            if (r["model"], r["system"], r["mode"]) == (model, system, mode) and r.get("tokens_per_s"):
                return r["tokens_per_s"]
        return None

    def table(self) -> str:
        w = max([9] + [len(r["model"]) for r in self.rows])
        hdr = (
            f"{'model':<{w}} {'system':<6} {'mode':<6} {'tokens/s':>11} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>9} "
            f"{'pred GiB':>9} {'step s':>8}  notes"
        )
        lines = [hdr, "-" * len(hdr)]
        for r in self.rows:
            pk = "-" if r.get("peak_gib") is None else f"{r['peak_gib']:.1f}"
            pred = "-" if r.get("pred_gib") is None else f"{r['pred_gib']:.1f}"
            if r.get("error"):
                lines.append(
                    f"{r['model']:<{w}} {r['system']:<6} {r['mode']:<6} {'-':>11} {'-':>8} {'-':>6} {pk:>9} "
                    f"{pred:>9} {'-':>8}  {r['error']}  {r.get('notes', '')}"
                )
                continue
            lines.append(
                f"{r['model']:<{w}} {r['system']:<6} {r['mode']:<6} {r['tokens_per_s']:>11,.0f} {r['tflops']:>8.1f} "
                f"{100 * r['mfu']:>5.1f}% {pk:>9} {pred:>9} {r['step_time_s']:>8.3f}  {r.get('notes', '')}"
            )
        return "\n".join(lines)


# ------------------------------------------------------------------------------------- ours


def predicted_gib(bb, obj, memory: MemoryConfig, tokens: int, train: bool) -> float:
    return predict_peak(CriticShape(bb, obj.head_size), Layout(), memory, tokens, train=train, bf16=CUDA) / GIB


def recompute_note(memory: MemoryConfig, num_layers: int) -> str:
    """'recompute full', or 'recompute full (4/28 layers)' for the first K layers."""
    if memory.recompute_layers is None:
        return f"recompute {memory.recompute}"
    return f"recompute full ({memory.recompute_layers}/{num_layers} layers)"


def run_dist_opt(label: str, bb, obj, batches, args, res: Results) -> None:
    """An ours-train row with megatron's distributed optimizer on one GPU (dp 1: nothing to shard; its
    contiguous buffers copy gradients and weights in a few large kernels where the plain optimizer
    copies them per parameter), beside the plain row of the same shape."""
    memory = MemoryConfig(distributed_optimizer=True)
    run_ours(label, bb, obj, batches, args, res, label in args.profile_rows, memory=memory, modes=("train",))


def run_ours(
    name: str,
    bb,
    obj,
    batches,
    args,
    res: Results,
    profile: bool,
    memory: MemoryConfig | None = None,
    modes: tuple[str, ...] = ("eval", "fwd", "train"),
    profile_n: int = 2,
) -> None:
    from value_assets.gpu.model.gpt_critic import build_critic, critic_forward
    from value_assets.gpu.model.losses import predicted_values
    from value_assets.gpu.model.packing import pack_rows
    from value_assets.gpu.runtime.step import evaluate_rows, optimizer_step, wrap_for_training

    G = args.global_batch
    memory = memory or MemoryConfig()
    timed_b = batches[args.warmup :]
    real = sum(sum(model_lens(b)) for b in timed_b)
    lens = [n for b in timed_b for n in model_lens(b)]
    f_train = flops_per_token(bb, obj.head_size, lens, train=True)
    f_fwd = flops_per_token(bb, obj.head_size, lens, train=False)
    mbs = [pack_rows(b, args.micro_batch_tokens) for b in batches]
    emb = [pack_rows(b, args.eval_micro_batch_tokens) for b in batches]
    n_mb = np.mean([len(m) for m in mbs[args.warmup :]])
    train_note = f"{n_mb:.1f} packed mb/step of <= {args.micro_batch_tokens} tok"
    if memory.recompute != "none":
        train_note += ", " + recompute_note(memory, bb.num_layers)
    if memory.distributed_optimizer:
        train_note += ", distributed optimizer (dp 1)"
    if memory.optimizer_offload:
        train_note += f", optimizer offload {memory.optimizer_offload:g}"
    eval_note = f"packed mb <= {args.eval_micro_batch_tokens} tok"
    pred_train = predicted_gib(bb, obj, memory, args.micro_batch_tokens, True)
    pred_eval = predicted_gib(bb, obj, memory, args.eval_micro_batch_tokens, False)

    model = ddp = opt = None
    try:
        t0 = time.perf_counter()
        model = build_critic(bb, obj, memory=memory)
        print(f"  built ours {name} in {time.perf_counter() - t0:.1f}s", flush=True)
        n_model = sum(p.numel() for n_, p in model.named_parameters() if "embedding" not in n_)
        print(
            f"  ours non-embedding params {n_model / 1e6:.1f}M (FLOP count uses matmul "
            f"weights {matmul_params(bb, obj.head_size) / 1e6:.1f}M)",
            flush=True,
        )

        # -- forward-only: evaluate_rows (engine API) and the raw packed forward
        for mode in [m for m in ("eval", "fwd") if m in modes]:
            reset_peak()
            try:
                if mode == "eval":

                    def go(bs):
                        for m in bs:
                            evaluate_rows(model, m, obj)
                else:
                    dev_mbs = [[mb.to(torch.device("cuda") if CUDA else "cpu") for mb in m] for m in emb]

                    def go(bs):
                        with torch.no_grad():
                            for m in bs:
                                for mb in m:
                                    head = critic_forward(
                                        model, mb.tokens, mb.position_ids, mb.cu_seqlens, mb.max_seqlen
                                    )
                                    predicted_values(head, obj).cpu()

                    emb_run = dev_mbs
                src = emb if mode == "eval" else emb_run
                model.eval()
                dt = timed(lambda src=src: go(src[: args.warmup]), lambda src=src: go(src[args.warmup :]))
                if mode == "eval" and name in args.sync_audit_rows:
                    res.sync_audits[f"{name} eval"] = sync_audit(
                        lambda src=src: go(src[args.warmup : args.warmup + 1]), f"ours eval {name}"
                    )
                model.train()
                res.add(
                    name,
                    "ours",
                    mode,
                    seconds=dt,
                    tokens=real,
                    flops_tok=f_fwd,
                    pred_gib=pred_eval,
                    steps=len(timed_b),
                    notes=eval_note + (" (evaluate_rows)" if mode == "eval" else " (raw)"),
                )
            except Exception as exc:  # noqa: BLE001
                if not is_oom(exc):
                    traceback.print_exc()
                res.add(
                    name,
                    "ours",
                    mode,
                    error=("OOM" if is_oom(exc) else type(exc).__name__),
                    pred_gib=pred_eval,
                    notes=eval_note,
                )
            finally:
                src = emb_run = dev_mbs = None
                free_memory()

        # -- training
        if "train" not in modes:
            return
        reset_peak()
        try:
            ddp, opt = wrap_for_training(
                model,
                lr=1e-6,
                weight_decay=0.0,
                clip_grad=1.0,
                distributed_optimizer=memory.distributed_optimizer,
                optimizer_offload=memory.optimizer_offload,
            )

            def steps(bs):
                for m in bs:
                    optimizer_step(ddp, opt, m, G, obj)

            dt = timed(lambda: steps(mbs[: args.warmup]), lambda: steps(mbs[args.warmup :]))
            if getattr(opt, "host_gradients", None):  # optimizer offload: where the gradients' host copies are
                rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
                train_note += f", host gradients {opt.host_gradients}, peak host RSS {rss:.1f} GiB"
            res.add(
                name,
                "ours",
                "train",
                seconds=dt,
                tokens=real,
                flops_tok=f_train,
                pred_gib=pred_train,
                steps=len(timed_b),
                notes=train_note,
            )
            if profile:
                n = min(profile_n, len(mbs) - args.warmup)
                res.profiles.append(
                    profile_steps(lambda: steps(mbs[args.warmup : args.warmup + n]), f"ours train {name}", n, opt)
                )
            if name in args.sync_audit_rows:
                res.sync_audits[name] = sync_audit(
                    lambda: steps(mbs[args.warmup : args.warmup + 1]), f"ours train {name}"
                )
        except Exception as exc:  # noqa: BLE001
            if not is_oom(exc):
                traceback.print_exc()
            res.add(
                name,
                "ours",
                "train",
                error=("OOM" if is_oom(exc) else type(exc).__name__),
                pred_gib=pred_train,
                notes=train_note,
            )
    except Exception as exc:  # noqa: BLE001  (build failed)
        if not is_oom(exc):
            traceback.print_exc()
        for mode in modes:
            if not any((r["model"], r["system"], r["mode"]) == (name, "ours", mode) for r in res.rows):
                res.add(name, "ours", mode, error=("OOM" if is_oom(exc) else type(exc).__name__))
    finally:
        if model is not None and hasattr(model, "config"):
            # wrap_for_training hangs the optimizer off the shared config: drop it.
            model.config.grad_scale_func = None
            model.config.finalize_model_grads_func = None
        model = ddp = opt = None
        free_memory()


OPTIMIZER_RANGE = "bench: optimizer.step"
PROFILE_GROUPS = (
    "matmul (gemm)",
    "attention",
    "norm (RMSNorm / LayerNorm)",
    "SwiGLU",
    "elementwise / other",
    "optimizer step",
    "memcpy / memset",
    "communication",
)
_MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addmv", "aten::mv", "aten::_scaled_mm"}
_ATTN = re.compile(r"flash|fmha|attention|attn|scaled_dot_product|sdpa", re.I)
_GEMM = re.compile(r"gemm|nvjet|cublas|cutlass|xmma|wgmma|sm\d\d_|ampere_|hopper_", re.I)
_COPY = re.compile(r"memcpy|memset", re.I)
_NORM = re.compile(r"rms_?norm|layer_?norm", re.I)
_SWIGLU = re.compile(r"swiglu", re.I)
_COMM = re.compile(r"nccl|gloo|c10d::|all_reduce|allreduce|reduce_scatter|all_gather", re.I)
_SYNC = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def _ancestry(evt) -> list[str]:
    names = []
    while evt is not None:
        names.append(evt.name)
        evt = evt.cpu_parent
    return names


def _hit(pattern: re.Pattern[str], name: str, chain: list[str]) -> bool:
    """Whether the kernel or op `name`, or an op it was launched under, matches `pattern`."""
    return bool(pattern.search(name)) or any(pattern.search(n) for n in chain)


def _group(name: str, chain: list[str]) -> str:
    """The profile group of a kernel (CUDA) or op (CPU) `name` launched under the op `chain`
    (innermost first)."""
    if OPTIMIZER_RANGE in chain:
        return "optimizer step"
    if _hit(_ATTN, name, chain):
        return "attention"
    if _COMM.search(name):
        return "communication"
    if _COPY.search(name):
        return "memcpy / memset"
    if _GEMM.search(name) or (chain and chain[0] in _MATMUL_OPS) or name in _MATMUL_OPS:
        return "matmul (gemm)"
    # Which of the rest a fusion would touch: the norms (torch's fused RMSNorm on CUDA, megatron's
    # LayerNorm) and the MLP's SwiGLU (Triton or megatron's compiled one), by the kernel or its op.
    if _hit(_NORM, name, chain):
        return "norm (RMSNorm / LayerNorm)"
    if _hit(_SWIGLU, name, chain):
        return "SwiGLU"
    return "elementwise / other"


def _recomputed(chain: list[str]) -> bool:
    """Forward work re-run in backward: below megatron's CheckpointFunction backward, not below a
    backward node of its own."""
    for i, n in enumerate(chain):
        if "CheckpointFunctionBackward" in n:
            return i > 0
        if "Backward" in n:
            return False
    return False


def _merged_us(intervals: list[tuple[float, float]]) -> float:
    busy, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        busy += b - max(a, end)
        end = b
    return busy


SCHEDULE_RANGE = "bench: forward+backward schedule"
IDLE_PHASES = ("forward", "backward", "optimizer step", "between (zero grad, copies in, metrics)")


def kernel_phase(chain: list[str]) -> str:
    """The part of the step whose host code launched a kernel, from its launching op's `chain`
    (innermost first): the optimizer range, an autograd backward node (the backward thread),
    megatron's schedule (`SCHEDULE_RANGE`: the forward), or anything else (between those)."""
    if OPTIMIZER_RANGE in chain:
        return "optimizer step"
    if any(n.startswith("autograd::engine::evaluate_function") for n in chain):
        return "backward"
    if SCHEDULE_RANGE in chain:
        return "forward"
    return IDLE_PHASES[-1]


def idle_by_phase(kernels: list[tuple[float, float, str]], start: float, end: float) -> dict[str, float]:
    """Where the GPU idled, by the phase that ended each idle stretch: `kernels` are (start, end,
    phase) device intervals inside a profiled window [start, end] (one stream or several); a
    stretch with no kernel running is charged to the phase of the kernel that ends it (the GPU was
    waiting for that part's host code to launch it); the stretch after the last kernel to 'after
    the last kernel'. The values sum to the window minus the union of kernel intervals."""
    out = dict.fromkeys(IDLE_PHASES, 0.0)
    busy_to = start
    for a, b, phase in sorted(kernels):
        if a > busy_to:
            out[phase] = out.get(phase, 0.0) + (a - busy_to)
        busy_to = max(busy_to, b)
    out["after the last kernel"] = max(0.0, end - busy_to)
    return out


def host_window(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """The profiled window [start, end]: from the first host op's start to the latest end of any."""
    return min(a for a, _ in intervals), max(b for _, b in intervals)


def profile_groups(prof, wall_s: float) -> dict[str, Any]:
    """Where a profiled stretch's wall time went, as seconds and % of wall: on CUDA the kernels'
    device time by group (each kernel attributed through the op that launched it and that op's
    parents: the optimizer is `OPTIMIZER_RANGE`) and the idle/launch gaps (wall minus the union
    of kernel intervals); on CPU the ops' self time by group and the time outside any op. On CUDA
    the wall is the host ops' span (`host_window`); `wall_s`, the time around the profiled block,
    is returned as `block_wall_s`."""
    from torch.autograd import DeviceType

    block_wall_s = wall_s
    events = prof.events()
    groups = dict.fromkeys(PROFILE_GROUPS, 0.0)
    recomputed = host_sync = 0.0
    idle_phase: dict[str, float] = {}
    if CUDA:
        device = [
            e
            for e in events
            if e.device_type == DeviceType.CUDA
            and e.name != OPTIMIZER_RANGE
            and not getattr(e, "is_user_annotation", False)
        ]
        linked = 0.0
        phased = []  # (start, end, phase) of each kernel linked to its launching op
        # A launching op's kernels carry name and duration only: their intervals are the device
        # events of the same name, taken in launch order (one stream runs them in that order).
        by_name: dict[str, list] = {}
        for d in sorted(device, key=lambda d: d.time_range.start, reverse=True):
            by_name.setdefault(d.name, []).append(d)
        host = sorted((e for e in events if e.device_type == DeviceType.CPU), key=lambda e: e.time_range.start)
        for e in host:
            if e.name in _SYNC:
                host_sync += e.self_cpu_time_total
            if not e.kernels:
                continue
            chain = _ancestry(e)
            phase = kernel_phase(chain)
            for k in e.kernels:
                groups[_group(k.name, chain)] += k.duration
                recomputed += k.duration if _recomputed(chain) else 0.0
                linked += k.duration
                queue = by_name.get(k.name)
                if queue:
                    d = queue.pop()
                    phased.append((d.time_range.start, d.time_range.end, phase))
        total = sum(e.time_range.end - e.time_range.start for e in device)
        if linked < 0.5 * total:  # kernels not linked to their ops (another torch): by kernel name only
            groups = dict.fromkeys(PROFILE_GROUPS, 0.0)
            for e in device:
                groups[_group(e.name, [])] += e.time_range.end - e.time_range.start
        busy = _merged_us([(e.time_range.start, e.time_range.end) for e in device])
        rest = "idle / launch gaps (no kernel running)"
        if host:
            # The window is the host ops' span (the last one is the closing sync), not the wall
            # around the `with profile()` block: that includes the profiler's own start and stop,
            # which read as an idle GPU "after the last kernel" (0.30 of 1.57 s on an H100, 0.5B).
            t0, t1 = host_window([(e.time_range.start, e.time_range.end) for e in host])
            wall_s = (t1 - t0) / 1e6
            if phased and linked >= 0.5 * total:
                idle_phase = {k: v / 1e6 for k, v in idle_by_phase(phased, t0, t1).items()}
    else:
        busy = 0.0
        for e in events:
            if e.device_type != DeviceType.CPU:
                continue
            chain = _ancestry(e)
            groups[_group(e.name, chain)] += e.self_cpu_time_total
            recomputed += e.self_cpu_time_total if _recomputed(chain) else 0.0
            busy += e.self_cpu_time_total
        rest = "outside ops (Python, idle)"
    seconds = {g: v / 1e6 for g, v in groups.items()}
    seconds[rest] = max(0.0, wall_s - busy / 1e6)
    return {
        "wall_s": wall_s,
        "block_wall_s": block_wall_s,
        "device": "cuda" if CUDA else "cpu",
        "seconds": seconds,
        "percent_of_wall": {g: 100 * v / wall_s for g, v in seconds.items()},
        "recomputed_forward_s": recomputed / 1e6,
        "host_sync_s": host_sync / 1e6,
        "idle_by_phase_s": idle_phase,
    }


def print_profile_groups(summary: dict[str, Any], label: str) -> None:
    wall = summary["wall_s"]
    block = summary["block_wall_s"]
    print(
        f"---- where the time goes: {label}, % of wall {wall:.3f}s"
        + (f" (host ops' span; {block:.3f}s with the profiler's start and stop)" if block != wall else "")
        + " "
        f"({'kernel device time' if summary['device'] == 'cuda' else 'op self CPU time'}) ----"
    )
    for g, v in summary["seconds"].items():
        print(f"  {g:<40} {100 * v / wall:6.1f}%  {v:8.3f}s")
    if summary["recomputed_forward_s"]:
        print(
            f"  {'(of which recomputed forward)':<40} {100 * summary['recomputed_forward_s'] / wall:6.1f}%  "
            f"{summary['recomputed_forward_s']:8.3f}s"
        )
    if summary["host_sync_s"]:
        print(f"  host blocked in CUDA syncs (CPU side): {summary['host_sync_s']:.3f}s")
    if summary.get("idle_by_phase_s"):
        print("  idle GPU, by the part of the step whose launch ended the wait:")
        for phase, v in summary["idle_by_phase_s"].items():
            print(f"    {phase:<38} {100 * v / wall:6.1f}%  {v:8.3f}s")


def sync_audit(fn: Callable[[], None], label: str) -> list[dict[str, Any]]:
    """Run `fn` (one optimizer step) under `torch.cuda.set_sync_debug_mode("warn")`; print and
    return, most frequent first, each place that synchronised the host with the GPU: the innermost
    frame of this repository's code (or megatron's) on the stack, with the count and the op."""
    import traceback
    import warnings

    if not CUDA:
        print(f"  sync audit {label}: needs CUDA", flush=True)
        return []
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    counts: dict[tuple[str, str], int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):  # other warnings raised during the step
            return
        frames = traceback.extract_stack()[:-1]
        ours = [
            f
            for f in frames
            if ("value_assets" in f.filename or "megatron" in f.filename) and "warnings" not in f.filename
        ]
        where = ours[-1] if ours else frames[-1]
        ours_file = where.filename.startswith(here)
        name = os.path.relpath(where.filename, here) if ours_file else where.filename.split("site-packages/")[-1]
        key = (f"{name}:{where.lineno}", (where.line or "").strip()[:80])
        counts[key] = counts.get(key, 0) + 1

    sync()
    old_show = warnings.showwarning
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            sync()
    finally:
        warnings.showwarning = old_show
    rows = [{"where": w, "code": c, "count": n} for (w, c), n in sorted(counts.items(), key=lambda kv: -kv[1])]
    print(f"\n==== sync audit: {label}, 1 step: {sum(counts.values())} host syncs at {len(rows)} places ====")
    for r in rows:
        print(f"  {r['count']:5d}  {r['where']:<60}  {r['code']}")
    print("=" * 80, flush=True)
    return rows


def profile_steps(fn: Callable[[], None], label: str, steps: int, opt: Any = None) -> dict[str, Any]:
    """torch.profiler over `fn` (`steps` optimizer steps): the top ops and kernels, and the time
    grouped by kind (`profile_groups`), which is returned. `opt.step` is marked as the optimizer."""
    from torch.profiler import ProfilerActivity, profile, record_function

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
    step, had_step = getattr(opt, "step", None), "step" in vars(opt) if opt is not None else False
    if step is not None:

        def marked(*a, **kw):
            with record_function(OPTIMIZER_RANGE):
                return step(*a, **kw)

        opt.step = marked
    from value_assets.gpu.runtime import step as engine_step

    schedule = engine_step._run_schedule

    def marked_schedule(*a, **kw):
        with record_function(SCHEDULE_RANGE):
            return schedule(*a, **kw)

    engine_step._run_schedule = marked_schedule
    sync()
    try:
        t0 = time.perf_counter()
        with profile(activities=acts) as prof:
            fn()
            sync()
        wall = time.perf_counter() - t0
    finally:
        engine_step._run_schedule = schedule
        if step is not None:
            if had_step:
                opt.step = step
            else:
                del opt.step  # the class's method again
    ka = prof.key_averages()
    table = None
    for sort in ("self_device_time_total", "self_cuda_time_total") if CUDA else ("self_cpu_time_total",):
        try:
            table = ka.table(sort_by=sort, row_limit=15)
            break
        except Exception:  # noqa: BLE001  (key names differ between torch versions)
            continue
    print(f"\n==== profile: {label}, {steps} step(s), wall {wall:.3f}s (profiler overhead included) ====")
    print(table)
    if CUDA:
        try:  # host side: syncs (aten::item / _local_scalar_dense, cudaStreamSynchronize) show here
            print(ka.table(sort_by="self_cpu_time_total", row_limit=10))
        except Exception:  # noqa: BLE001
            pass
    summary = profile_groups(prof, wall)
    print_profile_groups(summary, label)
    print("=" * 80, flush=True)
    return {"row": label, "steps": steps, **summary}


# --------------------------------------------------------------------------------------- HF


# The tiny backbone as a Qwen3.5 (a DeltaNet layer, then an attention layer): the hybrid path's CPU smoke.
_Q35_TINY = dict(
    family="qwen3_5",
    qkv_bias=False,
    qk_layernorm=True,
    kv_channels=32,
    layer_types=("linear_attention", "full_attention"),
    linear_attention=dict(key_heads=2, value_heads=4, key_head_dim=16, value_head_dim=16),
    rotary_percent=0.25,
    attention_output_gate=True,
)


def hf_config(bb):
    """transformers' Qwen3.5 text config of a `qwen3_5` backbone (its Gated DeltaNet runs
    flash-linear-attention's kernels where transformers finds them installed, else its torch path)."""
    from transformers import Qwen3_5TextConfig

    la = bb.linear_attention
    return Qwen3_5TextConfig(
        vocab_size=bb.vocab_size,
        hidden_size=bb.hidden_size,
        intermediate_size=bb.ffn_hidden_size,
        num_hidden_layers=bb.num_layers,
        num_attention_heads=bb.num_attention_heads,
        num_key_value_heads=bb.num_query_groups,
        head_dim=bb.head_dim,
        layer_types=list(bb.layer_types),
        linear_num_key_heads=la.key_heads,
        linear_num_value_heads=la.value_heads,
        linear_key_head_dim=la.key_head_dim,
        linear_value_head_dim=la.value_head_dim,
        linear_conv_kernel_dim=la.conv_kernel,
        max_position_embeddings=bb.max_seq_len,
        rms_norm_eps=bb.norm_epsilon,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": bb.rotary_base,
            "partial_rotary_factor": bb.rotary_percent,
        },
        tie_word_embeddings=False,
        use_cache=False,
        attention_dropout=0.0,
    )


def run_hf(name: str, bb, obj, batches, args, res: Results, modes: tuple[str, ...] = ("fwd", "train")) -> None:
    from transformers import AutoModel, Qwen2Config

    from value_assets.gpu.model.losses import predicted_values, token_losses

    G = args.global_batch
    dtype = torch.bfloat16 if CUDA else torch.float32
    dev = torch.device("cuda") if CUDA else torch.device("cpu")
    timed_b = batches[args.warmup :]
    real = sum(sum(model_lens(b)) for b in timed_b)
    lens = [n for b in timed_b for n in model_lens(b)]
    f_train = flops_per_token(bb, obj.head_size, lens, train=True)
    f_fwd = flops_per_token(bb, obj.head_size, lens, train=False)
    groups = [[pad_batch(g) for g in pad_groups(b, args.micro_batch_tokens)] for b in batches]
    egroups = [[pad_batch(g) for g in pad_groups(b, args.eval_micro_batch_tokens)] for b in batches]
    padded = sum(int(p["input_ids"].numel()) for gs in groups[args.warmup :] for p in gs)
    epadded = sum(int(p["input_ids"].numel()) for gs in egroups[args.warmup :] for p in gs)
    n_mb = np.mean([len(g) for g in groups[args.warmup :]])
    train_note = f"{n_mb:.1f} padded mb/step, {100 * (1 - real / padded):.0f}% pad"
    eval_note = f"padded mb, {100 * (1 - real / epadded):.0f}% pad"

    cfg = (
        hf_config(bb)
        if bb.family == "qwen3_5"
        else Qwen2Config(
            vocab_size=bb.vocab_size,
            hidden_size=bb.hidden_size,
            intermediate_size=bb.ffn_hidden_size,
            num_hidden_layers=bb.num_layers,
            num_attention_heads=bb.num_attention_heads,
            num_key_value_heads=bb.num_query_groups,
            max_position_embeddings=bb.max_seq_len,
            rope_theta=bb.rotary_base,
            rms_norm_eps=bb.norm_epsilon,
            tie_word_embeddings=False,
            use_cache=False,
            attention_dropout=0.0,
        )
    )
    model = head = opt = params = None
    try:
        t0 = time.perf_counter()
        with torch.device(dev):
            try:
                model = AutoModel.from_config(cfg, attn_implementation="sdpa", dtype=dtype)
            except TypeError:
                model = AutoModel.from_config(cfg, attn_implementation="sdpa", torch_dtype=dtype)
            head = torch.nn.Linear(bb.hidden_size, obj.head_size, dtype=torch.float32)
        model.config.use_cache = False
        print(
            f"  built hf {name} in {time.perf_counter() - t0:.1f}s "
            f"(attn {getattr(model.config, '_attn_implementation', '?')}, {next(model.parameters()).dtype})",
            flush=True,
        )

        def forward(p):
            hs = model(input_ids=p["input_ids"], attention_mask=p["attention_mask"], use_cache=False).last_hidden_state
            return head(hs.float())

        def to_dev(p):
            return {k: v.to(dev, non_blocking=True) for k, v in p.items()}

        # -- forward-only
        def fwd(gs_list):
            with torch.no_grad():
                for gs in gs_list:
                    for p in gs:
                        d = to_dev(p)
                        v = predicted_values(forward(d), obj)
                        v.cpu()

        for mode in [m for m in ("fwd",) if m in modes]:
            reset_peak()
            try:
                model.eval()
                dt = timed(lambda: fwd(egroups[: args.warmup]), lambda: fwd(egroups[args.warmup :]))
                res.add(name, "hf", mode, seconds=dt, tokens=real, flops_tok=f_fwd, steps=len(timed_b), notes=eval_note)
            except Exception as exc:  # noqa: BLE001
                if not is_oom(exc):
                    traceback.print_exc()
                res.add(name, "hf", mode, error=("OOM" if is_oom(exc) else type(exc).__name__), notes=eval_note)
            finally:
                model.train()
                free_memory()

        # -- training
        if "train" not in modes:
            return
        reset_peak()
        try:
            params = list(model.parameters()) + list(head.parameters())
            kw = {"fused": True} if CUDA else {}
            opt = torch.optim.AdamW(params, lr=1e-6, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, **kw)

            def step(gs):
                opt.zero_grad(set_to_none=True)
                for p in gs:
                    d = to_dev(p)
                    out = forward(d)
                    tl = token_losses(out.reshape(-1, out.shape[-1]), d["returns"].reshape(-1), obj)
                    tl = tl.reshape(d["mask"].shape) * d["mask"]
                    loss = (tl.sum(1) / d["mask"].sum(1)).sum() / G
                    loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()

            def steps(gs_list):
                for gs in gs_list:
                    step(gs)

            dt = timed(lambda: steps(groups[: args.warmup]), lambda: steps(groups[args.warmup :]))
            res.add(
                name, "hf", "train", seconds=dt, tokens=real, flops_tok=f_train, steps=len(timed_b), notes=train_note
            )
        except Exception as exc:  # noqa: BLE001
            if not is_oom(exc):
                traceback.print_exc()
            res.add(name, "hf", "train", error=("OOM" if is_oom(exc) else type(exc).__name__), notes=train_note)
    except Exception as exc:  # noqa: BLE001  (build failed)
        if not is_oom(exc):
            traceback.print_exc()
        for mode in modes:
            if not any((r["model"], r["system"], r["mode"]) == (name, "hf", mode) for r in res.rows):
                res.add(name, "hf", mode, error=("OOM" if is_oom(exc) else type(exc).__name__))
    finally:
        model = head = opt = params = None
        free_memory()


# ------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--models",
        default="0.5b,1.5b",
        help="comma list of 0.5b, 1.5b, 3b, q3.5-0.8b, q3.5-4b (Qwen3.5 shapes); tiny or q3.5-tiny with --smoke",
    )
    ap.add_argument("--systems", default="ours,hf", help="comma list of ours, hf")
    ap.add_argument("--steps", type=int, default=4, help="timed optimizer steps (global batches)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--micro-batch-tokens",
        default="16384",
        help="packed train micro-batch token budget of the 4k-mix rows, or auto: per model the largest "
        "that the memory model fits in 90%% of the free GPU memory (what `value-assets train "
        "--micro-batch-tokens auto` picks); the hf rows keep 16384",
    )
    ap.add_argument(
        "--eval-micro-batch-tokens",
        type=int,
        default=None,
        help="forward-only micro-batch token budget (default: 2x --micro-batch-tokens)",
    )
    ap.add_argument("--global-batch", type=int, default=64, help="rows per optimizer step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU, 2 steps")
    ap.add_argument(
        "--profile",
        nargs="?",
        const="",
        default=None,
        metavar="ROWS",
        help="torch.profiler of ours-train: 2 steps (1 of a long-row row) of each row labelled in the "
        "comma list ROWS (e.g. 0.5b,1.5b@32k,'1.5b dist-opt'); bare: the 1.5B shape (or the last "
        "model). Prints the top kernels and the step time grouped by kind (matmul, attention, "
        "elementwise/norm, optimizer, idle gaps), also written to --json",
    )
    ap.add_argument(
        "--sync-audit",
        default="",
        metavar="ROWS",
        help="comma list of rows (as --profile) whose ours-train step is run once more under CUDA sync "
        "debug mode: prints each source line that synchronised the host with the GPU, and how often",
    )
    ap.add_argument(
        "--dist-opt",
        action="store_true",
        help="default rows: after each model's ours rows, an ours-train row 'NAME dist-opt' on the same "
        "batches and micro-batches with the distributed optimizer (dp 1), for a same-run comparison",
    )
    ap.add_argument(
        "--eager-rope",
        action="store_true",
        help="default rows: after each model's ours rows, an ours-train row 'NAME eager-rope' on the same "
        "batches with RoPE as eager ops instead of the compiled q/k kernel (CUDA), for a same-run comparison",
    )
    ap.add_argument(
        "--megatron-swiglu",
        action="store_true",
        help="default rows: after each model's ours rows, an ours-train row 'NAME megatron-swiglu' on the same "
        "batches with megatron's compiled SwiGLU instead of the Triton one (swiglu.py, the default on CUDA)",
    )
    ap.add_argument(
        "--fused-wgrad",
        action="store_true",
        help="default rows: after each model's ours rows, an ours-train row 'NAME fused-wgrad' on the same "
        "batches with the weight gradients accumulated into main_grad by the GEMM (wgrad.py, off by default; CUDA)",
    )
    ap.add_argument("--json", dest="json_out", default=None)
    ap.add_argument(
        "--rows",
        choices=("default", "long", "all", "7b"),
        default="default",
        help="default: --models x --systems on 4k rows; long: 1.5b on 8k/16k/32k rows (ours, and hf "
        "train as the floor), 1.5b with the distributed optimizer and a 3b critic on 4k rows (ours); all: both; "
        "7b: a Qwen2.5-7B-shaped critic on the 4k mix (ours) with full recompute, the distributed optimizer and "
        "the least optimizer CPU offload the memory model fits (--offload overrides)",
    )
    ap.add_argument(
        "--offload",
        type=float,
        default=None,
        metavar="F",
        help="--rows 7b: the optimizer offload fraction (default: the least of 0, 0.25, .., 1 the memory model fits)",
    )
    ap.add_argument("--long-steps", type=int, default=2, help="timed steps of the long-row rows")
    ap.add_argument("--long-global-batch", type=int, default=16, help="rows per step of the long-row rows")
    ap.add_argument(
        "--long-recompute",
        choices=("auto",) + RECOMPUTE,
        default="auto",
        help="recompute of the long-row rows (auto: the least the memory model fits)",
    )
    ap.add_argument(
        "--long-recompute-layers",
        type=int,
        default=None,
        metavar="K",
        help="with --long-recompute full: recompute only the first K layers",
    )
    ap.add_argument(
        "--long-hf-global-batch",
        type=int,
        default=4,
        help="rows per step of the hf long-row rows (1 warm-up and --long-hf-steps timed steps)",
    )
    ap.add_argument("--long-hf-steps", type=int, default=1, help="timed steps of the hf long-row rows")
    args = ap.parse_args(argv)

    from value_assets.core.objective import Objective
    from value_assets.gpu.model.gpt_critic import BackboneConfig
    from value_assets.gpu.runtime.parallel import destroy, init_distributed

    args.mbt_auto = args.micro_batch_tokens == "auto"
    try:
        args.micro_batch_tokens = 16384 if args.mbt_auto else int(args.micro_batch_tokens)
    except ValueError:
        ap.error(f"--micro-batch-tokens must be an integer or auto, got {args.micro_batch_tokens!r}")
    eval_mbt_given = args.eval_micro_batch_tokens is not None
    if args.smoke:
        args.steps, args.warmup = 2, 1
        args.global_batch = min(args.global_batch, 8)
        args.micro_batch_tokens = min(args.micro_batch_tokens, 256)
        given = args.models != ap.get_default("models")
        names = [m.strip().lower() for m in args.models.split(",") if m.strip()] if given else ["tiny"]
    else:
        names = [m.strip().lower() for m in args.models.split(",") if m.strip()]
    if args.eval_micro_batch_tokens is None:
        args.eval_micro_batch_tokens = 2 * args.micro_batch_tokens
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    presets = {
        "0.5b": BackboneConfig.qwen2_5_0_5b,
        "1.5b": BackboneConfig.qwen2_5_1_5b,
        "3b": lambda: BackboneConfig.qwen2_5("3b"),
        "7b": lambda: BackboneConfig.qwen2_5("7b"),
        "tiny": lambda: BackboneConfig.tiny(max_seq_len=4096),
        "q3.5-0.8b": lambda: qwen3_5("0.8b"),
        "q3.5-4b": lambda: qwen3_5("4b"),
        "q3.5-tiny": lambda: BackboneConfig(
            **{**BackboneConfig.tiny(max_seq_len=4096).to_json(), **_Q35_TINY}  # CPU smoke of the hybrid path
        ),
    }
    for n in names:
        if n not in presets:
            ap.error(f"unknown model {n!r}; choose from {', '.join(presets)}")
    if args.profile is None:
        args.profile_rows = set()
    elif not args.profile.strip():
        args.profile_rows = {"1.5b" if "1.5b" in names else names[-1]}
    else:
        args.profile_rows = {r.strip() for r in args.profile.split(",") if r.strip()}
    args.sync_audit_rows = {r.strip() for r in args.sync_audit.split(",") if r.strip()}
    args.systems_list = systems
    obj = Objective()  # classification, 51 bins, HL-Gauss (the default objective)

    dev_name = torch.cuda.get_device_name() if CUDA else "CPU (smoke; MFU meaningless)"
    print(
        f"device: {dev_name}; torch {torch.__version__}; "
        f"varlen_attn: {_varlen_available()}; MFU denominator {PEAK_TFLOPS:.0f} TFLOP/s "
        "(bf16 matmul rate measured on this workplace's H200)",
        flush=True,
    )
    t_start = time.perf_counter()
    init_distributed(rank=0, world_size=1, master_port=0)
    print(f"init_distributed in {time.perf_counter() - t_start:.1f}s", flush=True)
    res = Results()
    data_lines = []
    try:
        for name in names if args.rows in ("default", "all") else []:
            bb = presets[name]()
            batches = make_batches(args.warmup + args.steps, args.global_batch, bb.vocab_size, args.seed, args.smoke)
            lens = [n for b in batches[args.warmup :] for n in model_lens(b)]
            line = (
                f"{name}: {len(lens)} timed rows, {sum(lens) / args.steps:,.0f} real tokens/step "
                f"(mean row {np.mean(lens):.0f}, max {max(lens)}), s_eff {s_eff(lens):.0f}, "
                f"N {matmul_params(bb, obj.head_size) / 1e9:.3f}B, "
                f"train {flops_per_token(bb, obj.head_size, lens, train=True) / 1e9:.2f} GFLOP/tok, "
                f"fwd {flops_per_token(bb, obj.head_size, lens, train=False) / 1e9:.2f} GFLOP/tok"
            )
            data_lines.append(line)
            print(f"== {line}", flush=True)
            run_args = args
            if args.mbt_auto and CUDA:
                longest = max(n for b in batches for n in model_lens(b))
                try:
                    mbt = auto_micro_batch_tokens(
                        CriticShape(bb, obj.head_size),
                        Layout(),
                        MemoryConfig(),
                        free_bytes=torch.cuda.mem_get_info()[0],
                        longest_row=longest,
                    )
                except InputError as exc:
                    # The memory model says the longest row does not fit this GPU: a row that says so
                    # (and what would fit) instead of a stopped table; the HF critic is still tried.
                    print(f"  micro-batch tokens (auto): {exc}", flush=True)
                    need = predicted_gib(bb, obj, MemoryConfig(), longest, train=True)
                    for mode in ("eval", "fwd", "train") if "ours" in systems else ():
                        res.add(name, "ours", mode, error="does not fit", pred_gib=need, notes="auto: see the log")
                    if "hf" in systems:
                        run_hf(name, bb, obj, batches, args, res)
                    continue
                run_args = argparse.Namespace(
                    **{
                        **vars(args),
                        "micro_batch_tokens": mbt,
                        "eval_micro_batch_tokens": args.eval_micro_batch_tokens if eval_mbt_given else 2 * mbt,
                    }
                )
                print(f"  micro-batch tokens (auto): train {mbt}, eval {run_args.eval_micro_batch_tokens}", flush=True)
            if "ours" in systems:
                run_ours(name, bb, obj, batches, run_args, res, name in args.profile_rows)
                if args.dist_opt:
                    run_dist_opt(f"{name} dist-opt", bb, obj, batches, run_args, res)
                # The same rows with one of the product's kernel choices flipped (RoPE as eager ops;
                # megatron's compiled SwiGLU instead of the Triton one; the fused weight-gradient
                # accumulation): its effect, in the same run.
                for wanted, suffix, module, switch, value in (
                    (args.eager_rope, "eager-rope", "rope", "FUSED_ROPE", False),
                    (args.megatron_swiglu, "megatron-swiglu", "swiglu", "TRITON_SWIGLU", False),
                    (args.fused_wgrad, "fused-wgrad", "wgrad", "FUSED_WGRAD", True),
                ):
                    if wanted:
                        toggled = importlib.import_module(f"value_assets.gpu.model.{module}")
                        label, default = f"{name} {suffix}", getattr(toggled, switch)
                        setattr(toggled, switch, value)
                        try:
                            run_ours(
                                label, bb, obj, batches, run_args, res, label in args.profile_rows, modes=("train",)
                            )
                        finally:
                            setattr(toggled, switch, default)
            if "hf" in systems:
                run_hf(name, bb, obj, batches, args, res)
        if args.rows in ("long", "all"):
            data_lines += run_long_rows(args, presets, obj, res)
        if args.rows == "7b":
            data_lines += run_7b(args, presets, obj, res)
    finally:
        destroy()

    print("\n" + "=" * 100)
    print(
        f"critic throughput on {dev_name}: global batch {args.global_batch} rows, {args.steps} timed steps "
        f"after {args.warmup} warm-up, train micro-batch <= {args.micro_batch_tokens} tokens, "
        f"eval <= {args.eval_micro_batch_tokens}"
    )
    for line in data_lines:
        print("  data " + line)
    print(res.table())
    print(
        f"tokens/s = real (non-pad) tokens / s; MFU = achieved useful TFLOP/s / {PEAK_TFLOPS:.0f} TFLOP/s "
        "(measured bf16 matmul rate on this H200); step s = time per global batch"
    )
    print(FORMULA)
    for name in names if args.rows not in ("long", "7b") else []:
        ot, oe, of_ = res.get(name, "ours", "train"), res.get(name, "ours", "eval"), res.get(name, "ours", "fwd")
        ht, hf_ = res.get(name, "hf", "train"), res.get(name, "hf", "fwd")
        mfu = next(
            (
                r["mfu"]
                for r in res.rows
                if (r["model"], r["system"], r["mode"]) == (name, "ours", "train") and r.get("mfu") is not None
            ),
            None,
        )
        parts = [f"targets {name}:"]
        if mfu is not None:
            parts.append(f"ours train MFU {100 * mfu:.1f}%" + (" (target >= 45% for 1.5b)" if name == "1.5b" else ""))
        if ot and ht:
            parts.append(f"ours/hf train {ot / ht:.2f}x (>= 2x)")
        if of_ and hf_:
            parts.append(f"ours/hf fwd {of_ / hf_:.2f}x")
        if ot and oe:
            parts.append(f"eval/train {oe / ot:.2f}x (>= 3x)")
        if ot and of_:
            parts.append(f"fwd/train {of_ / ot:.2f}x")
        print("  " + ", ".join(parts))
    floor = hf_floor_line(res)
    if floor:
        print("  " + floor)
    for p in res.profiles:
        top = sorted(p["percent_of_wall"].items(), key=lambda kv: -kv[1])
        print(f"  profile {p['row']}: " + ", ".join(f"{g} {v:.0f}%" for g, v in top if v >= 0.5))
    missing = args.profile_rows - {p["row"].removeprefix("ours train ") for p in res.profiles}
    if missing:
        print(f"  --profile: no ours-train row ran with the label(s) {', '.join(sorted(missing))}")
    print(f"total {time.perf_counter() - t_start:.0f}s", flush=True)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(
            json.dumps(
                {
                    "device": dev_name,
                    "peak_tflops": PEAK_TFLOPS,
                    "formula": FORMULA,
                    "args": {k: sorted(v) if isinstance(v, set) else v for k, v in vars(args).items()},
                    "data": data_lines,
                    "results": res.rows,
                    "profiles": res.profiles,
                    "sync_audits": res.sync_audits,
                },
                indent=2,
            )
        )
    return 0


def pick_recompute(bb, obj, tokens: int, args, index: int) -> MemoryConfig:
    """The least recompute the memory model fits in 85 % of this GPU, trying none, selective, full
    of the first K = 1 .. L-1 layers, full (--long-recompute overrides; on CPU (smoke) selective,
    full of the first layer and full in turn, so each path runs)."""
    if args.long_recompute != "auto":
        return MemoryConfig(recompute=args.long_recompute, recompute_layers=args.long_recompute_layers)
    if not CUDA:
        return (
            MemoryConfig(recompute="selective"),
            MemoryConfig(recompute="full", recompute_layers=1),
            MemoryConfig(recompute="full"),
        )[index % 3]
    total = torch.cuda.get_device_properties(0).total_memory
    shape = CriticShape(bb, obj.head_size)
    for mem in [MemoryConfig()] + more_recompute(shape, Layout(), MemoryConfig()):
        if predict_peak(shape, Layout(), mem, tokens) <= 0.85 * total:
            return mem
    return MemoryConfig(recompute="full")  # predicted not to fit: run it anyway and report OOM


def fitted_micro_batch(shape: CriticShape, memory: MemoryConfig, longest: int, cap: int, what: str = "") -> int | None:
    """What `--micro-batch-tokens auto` picks on this GPU's free memory (one GPU), at most `cap`;
    None, printing why, where the memory model says no micro-batch fits (the row runs anyway)."""
    try:
        free = torch.cuda.mem_get_info()[0]
        return min(cap, auto_micro_batch_tokens(shape, Layout(), memory, free_bytes=free, longest_row=longest))
    except Exception as exc:  # noqa: BLE001  (the model says no micro-batch fits: run it and see)
        print(f"  memory model{what}: {exc}", flush=True)
        return None


def run_7b(args, presets, obj, res: Results) -> list[str]:
    """A Qwen2.5-7B-shaped critic on the 4k mix (ours): full recompute, the distributed optimizer
    and optimizer CPU offload (megatron-core's HybridDeviceOptimizer), the least fraction of 0,
    0.25, .., 1 whose predicted peak fits 90 % of the free GPU memory with micro-batches of the
    longest row, or --offload. The memory model's GPU peak and host bytes are printed beside the
    measured peak. On CPU (--smoke: the tiny shape) offload is CUDA-only, so it runs without."""
    name = "tiny" if args.smoke else "7b"
    bb = presets[name]()
    shape = CriticShape(bb, obj.head_size)
    batches = make_batches(args.warmup + args.steps, args.global_batch, bb.vocab_size, args.seed, args.smoke)
    longest = max(n for b in batches for n in model_lens(b))
    memory = MemoryConfig(recompute="full", distributed_optimizer=True)  # on CPU: no offload (CUDA-only)
    mbt = args.micro_batch_tokens
    fractions = [args.offload] if args.offload is not None else [0.0, 0.25, 0.5, 0.75, 1.0]
    for f in fractions if CUDA else []:
        memory = MemoryConfig(recompute="full", distributed_optimizer=True, optimizer_offload=f)
        fitted = fitted_micro_batch(shape, memory, longest, args.micro_batch_tokens, f", offload {f:g}")
        if fitted is not None:
            mbt = fitted
            break
    host = host_bytes(shape, Layout(), memory) / GIB
    host_pinned = host_bytes(shape, Layout(), memory, pinned=True) / GIB
    label = f"{name} offload {memory.optimizer_offload:g}"
    line = (
        f"{label}: {args.steps} timed steps of {args.global_batch} rows of the 4k mix (max {longest}), micro-batch "
        f"{mbt} tokens, recompute full, distributed optimizer, optimizer offload {memory.optimizer_offload:g} "
        f"(predicted host memory {host:.1f} GiB, at most {host_pinned:.1f} with pinned gradients), "
        f"N {matmul_params(bb, obj.head_size) / 1e9:.3f}B"
    )
    print(f"== {line}", flush=True)
    run_args = argparse.Namespace(**{**vars(args), "micro_batch_tokens": mbt, "eval_micro_batch_tokens": 2 * mbt})
    run_ours(label, bb, obj, batches, run_args, res, label in args.profile_rows, memory=memory)
    return [line]


def run_long_rows(args, presets, obj, res: Results) -> list[str]:
    """1.5b on rows of 8k / 16k / 32k tokens (ours train), 1.5b with the distributed optimizer and
    the 3b critic on the 4k mix, then the hf critic's train on the long rows (the floor; last, so
    that its out-of-memory failures cannot disturb the rows before)."""
    lines = []
    systems = args.systems_list
    steps, warm = (2, 1) if args.smoke else (args.long_steps, 1)
    lengths, prompt, big = ((96, 160, 224), 32, "tiny") if args.smoke else ((8192, 16384, 32768), 1024, "3b")
    base = "tiny" if args.smoke else "1.5b"
    bb = presets[base]()
    labels = [f"{base}@{length // 1024 or length}{'k' if length >= 1024 else ''}" for length in lengths]
    for i, (label, length) in enumerate(zip(labels, lengths, strict=True)):
        if "ours" not in systems:
            break
        run_args = argparse.Namespace(
            **{
                **vars(args),
                "steps": steps,
                "warmup": warm,
                "global_batch": args.long_global_batch if not args.smoke else 4,
                "micro_batch_tokens": max(args.micro_batch_tokens, length - 1),
            }
        )
        run_args.eval_micro_batch_tokens = run_args.micro_batch_tokens
        mem = pick_recompute(bb, obj, run_args.micro_batch_tokens, args, i)
        batches = fixed_length_batches(warm + steps, run_args.global_batch, bb.vocab_size, args.seed, length, prompt)
        lens = [n for b in batches[warm:] for n in model_lens(b)]
        line = (
            f"{label}: {len(lens)} timed rows of {length} tokens, {sum(lens) / steps:,.0f} tokens/step, "
            f"s_eff {s_eff(lens):.0f}, train {flops_per_token(bb, obj.head_size, lens, train=True) / 1e9:.2f} "
            f"GFLOP/tok (recompute not counted in MFU), {recompute_note(mem, bb.num_layers)}"
        )
        lines.append(line)
        print(f"== {line}", flush=True)
        run_ours(
            label,
            bb,
            obj,
            batches,
            run_args,
            res,
            label in args.profile_rows,
            memory=mem,
            modes=("train",),
            profile_n=1,
        )
    if "ours" in systems:
        # The distributed optimizer on one GPU (dp 1: nothing to shard): its path runs on the GPU,
        # with its peak and throughput beside the plain 1.5b row.
        label = f"{base} dist-opt"
        batches = make_batches(warm + steps, args.global_batch, bb.vocab_size, args.seed, args.smoke)
        lens = [n for b in batches[warm:] for n in model_lens(b)]
        line = (
            f"{label}: {len(lens)} timed rows of the 4k mix (mean {np.mean(lens):.0f}, max {max(lens)}), "
            f"distributed optimizer, dp 1, {warm} warm-up + {steps} timed steps"
        )
        lines.append(line)
        print(f"== {line}", flush=True)
        run_dist_opt(label, bb, obj, batches, argparse.Namespace(**{**vars(args), "steps": steps, "warmup": warm}), res)

        bbig = presets[big]()
        batches = make_batches(args.warmup + args.steps, args.global_batch, bbig.vocab_size, args.seed, args.smoke)
        longest = max(n for b in batches for n in model_lens(b))
        mbt = args.micro_batch_tokens
        if CUDA:
            mbt = fitted_micro_batch(CriticShape(bbig, obj.head_size), MemoryConfig(), longest, mbt) or mbt
        run_args = argparse.Namespace(**{**vars(args), "micro_batch_tokens": mbt, "eval_micro_batch_tokens": 2 * mbt})
        lens = [n for b in batches[args.warmup :] for n in model_lens(b)]
        label = "3b" if not args.smoke else "tiny-3b"
        line = (
            f"{label}: {len(lens)} timed rows (mean {np.mean(lens):.0f}, max {max(lens)}), micro-batch {mbt} tokens "
            f"(auto), N {matmul_params(bbig, obj.head_size) / 1e9:.3f}B, "
            f"train {flops_per_token(bbig, obj.head_size, lens, train=True) / 1e9:.2f} GFLOP/tok"
        )
        lines.append(line)
        print(f"== {line}", flush=True)
        run_ours(label, bbig, obj, batches, run_args, res, label in args.profile_rows)
    if "hf" in systems:
        g = args.long_hf_global_batch if not args.smoke else 2
        hf_steps = args.long_hf_steps if not args.smoke else 1
        for label, length in zip(labels, lengths, strict=True):
            mbt = max(args.micro_batch_tokens, length - 1)
            run_args = argparse.Namespace(
                **{
                    **vars(args),
                    "steps": hf_steps,
                    "warmup": 1,
                    "global_batch": g,
                    "micro_batch_tokens": mbt,
                    "eval_micro_batch_tokens": mbt,
                }
            )
            batches = fixed_length_batches(1 + hf_steps, g, bb.vocab_size, args.seed, length, prompt)
            line = (
                f"{label} hf: {hf_steps * g} timed rows of {length} tokens, padded micro-batches of <= {mbt} "
                "tokens, no recompute (the Hugging Face floor)"
            )
            lines.append(line)
            print(f"== {line}", flush=True)
            run_hf(label, bb, obj, batches, run_args, res, modes=("train",))
    return lines


def hf_floor_line(res: Results) -> str | None:
    """Where the Hugging Face critic's training runs on the long rows, and from which length it
    runs out of memory."""
    parts, oom = [], None
    for r in res.rows:
        if r["system"] != "hf" or r["mode"] != "train" or "@" not in r["model"]:
            continue
        length = r["model"].split("@")[-1]
        if r.get("error"):
            parts.append(f"{length} {r['error']}")
            oom = oom or (length if r["error"] == "OOM" else None)
        else:
            parts.append(f"{length} {r['tokens_per_s']:,.0f} tok/s")
    if not parts:
        return None
    return (
        "hf floor (train, no recompute): "
        + ", ".join(parts)
        + (f"; out of memory from {oom} tokens" if oom else "; no out-of-memory")
    )


def _varlen_available() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401

        return True
    except Exception:  # noqa: BLE001
        return False


if __name__ == "__main__":
    sys.exit(main())
