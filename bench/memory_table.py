"""Planning table: predicted peak memory per GPU of critic training, from the memory model.

For Qwen2.5-shaped critics (0.5B .. 14B; the LM head replaced by a 51-bin value head), prints a
markdown table of the predicted peak GiB per GPU (`value_assets.core.memory.predict_peak`, bf16,
Adam) for packed micro-batches of 4k / 16k / 32k tokens, under data / tensor / pipeline parallel
layouts, activation recompute, the distributed optimizer and sequence parallelism. Cells over the
H200's 139 GiB are marked; measured H200 peaks (bench/results/h200-train-throughput.json) are
shown beside the prediction they check.

    python bench/memory_table.py            # markdown on stdout (no GPU, no torch needed)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from value_assets.core.memory import GIB, MEASURED, QWEN2_5, Layout, MemoryConfig, host_bytes, predict_peak

H200_GIB = 139.0
TOKENS = (4096, 16384, 32768)

# (label, layout, memory, train)
SETTINGS = [
    ("1 GPU", Layout(), MemoryConfig(), True),
    ("1 GPU", Layout(), MemoryConfig(recompute="selective"), True),
    ("1 GPU", Layout(), MemoryConfig(recompute="full"), True),
    ("1 GPU", Layout(), MemoryConfig(recompute="full", recompute_layers=4), True),
    ("1 GPU", Layout(), MemoryConfig(recompute="full", distributed_optimizer=True, optimizer_offload=0.5), True),
    ("1 GPU", Layout(), MemoryConfig(recompute="full", distributed_optimizer=True, optimizer_offload=0.75), True),
    ("1 GPU", Layout(), MemoryConfig(recompute="full", distributed_optimizer=True, optimizer_offload=1.0), True),
    ("8 GPUs dp8", Layout(dp=8), MemoryConfig(distributed_optimizer=True), True),
    ("8 GPUs dp8", Layout(dp=8), MemoryConfig(recompute="full", distributed_optimizer=True), True),
    (
        "8 GPUs dp4 tp2",
        Layout(dp=4, tp=2),
        MemoryConfig(recompute="full", distributed_optimizer=True, sequence_parallel=True),
        True,
    ),
    (
        "8 GPUs dp2 tp2 pp2",
        Layout(dp=2, tp=2, pp=2),
        MemoryConfig(recompute="full", distributed_optimizer=True, sequence_parallel=True),
        True,
    ),
    ("8 GPUs dp1 tp8", Layout(tp=8), MemoryConfig(recompute="full", sequence_parallel=True), True),
    ("1 GPU, evaluation", Layout(), MemoryConfig(), False),
]


def _measured(model: str, train: bool, tokens: int, layout: Layout, memory: MemoryConfig) -> float | None:
    if layout != Layout() or memory != MemoryConfig():
        return None
    for p in MEASURED:
        if (p["model"], p["mode"] == "train", p["micro_batch_tokens"]) == (model, train, tokens):
            return p["peak_gib"]
    return None


def _fits(model: str, layout: Layout) -> bool:
    s = QWEN2_5[model].backbone
    return s.num_query_groups % layout.tp == 0 and s.num_layers % layout.pp == 0


def table() -> str:
    hdr = ["model", "layout", "recompute", "dist. opt", "seq. par.", "offload (host GiB)"] + [
        f"{t // 1024}k tokens" for t in TOKENS
    ]
    lines = ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    for model in QWEN2_5:
        for label, layout, memory, train in SETTINGS:
            if not _fits(model, layout):
                continue
            cells = []
            for t in TOKENS:
                gib = predict_peak(QWEN2_5[model], layout, memory, t, train=train) / GIB
                cell = f"{gib:.1f}" + (" ✗" if gib > H200_GIB else "")
                meas = _measured(model, train, t, layout, memory)
                if meas is not None:
                    cell = f"**{cell}** (measured {meas})"
                cells.append(cell)
            rc = (
                (
                    memory.recompute
                    if memory.recompute_layers is None
                    else f"full, first {memory.recompute_layers} layers"
                )
                if train
                else "-"
            )
            lines.append(
                "| "
                + " | ".join(
                    [
                        model,
                        label,
                        rc,
                        "yes" if memory.distributed_optimizer else "-",
                        "yes" if memory.sequence_parallel else "-",
                        (
                            f"{memory.optimizer_offload:g} ({host_bytes(QWEN2_5[model], layout, memory) / GIB:.1f}"
                            f"-{host_bytes(QWEN2_5[model], layout, memory, pinned=True) / GIB:.1f})"
                            if memory.optimizer_offload
                            else "-"
                        ),
                    ]
                    + cells
                )
                + " |"
            )
    return "\n".join(lines)


def main() -> int:
    print(table())
    print()
    print(
        "Predicted peak GiB per GPU (first pipeline stage), bf16 weights, fp32 grads, Adam (fp32 master "
        "+ 2 moments), packed micro-batches of the given size; ✗ = over an H200's 139 GiB. Model and "
        "formula: value_assets/core/memory.py; calibrated on the measured points in its MEASURED (H200, 1 GPU, "
        "bench/train_throughput.py: training with megatron's fused SwiGLU on micro-batches of 15k-83k tokens, "
        "evaluation on 32k), bold where one falls on a column. Selective "
        "recompute saves little with flash attention (only the roped q, k); full recompute keeps one "
        "layer input per layer, and with --recompute-layers K only for the first K layers of each stage. Pipeline "
        "stages under 1F1B hold as many activations as one micro-batch "
        "through all layers, so pp splits weights but not activations. Optimizer offload F keeps the fraction F "
        "of the fp32 master weights and Adam moments in host memory (the host column: 16 bytes a parameter "
        "with a pageable fp32 gradient copy, at most 20 with pinned copies, which torch rounds up to powers "
        "of two); measured: 7B at offload 0.75, "
        "16k tokens, on an H100 (GPU 66.0 GiB, host 97.6 GiB of optimizer with pinned gradients)."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
