"""The GPU-job subcommands of `value-assets`: train, evaluate, export-hf.

This module only declares arguments; torch, ray and megatron are imported when a command runs, so
`value-assets validate` stays light.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


EXIT_GATE_FAILED = 3


def _data_roots(args):
    from value_assets.cli import _data_roots as roots

    r = roots(args)
    return tuple(r) if r else None


def train_config(args):
    """The driver's TrainConfig from parsed `train` arguments (the CLI and the Pipes job share it)."""
    from value_assets.gpu.jobs.train import TrainConfig

    return TrainConfig(manifest=Path(args.manifest), output=Path(args.output), backbone=args.backbone,
                       global_batch_size=args.global_batch_size, epochs=args.epochs, seed=args.seed, save_interval=args.save_interval,
                       gpus=args.gpus, tensor_parallel=args.tensor_parallel, pipeline_parallel=args.pipeline_parallel,
                       micro_batch_tokens=args.micro_batch_tokens, lr=args.lr,
                       warmup_steps=args.warmup_steps, canary=args.canary, manifest_sha256=args.manifest_sha256,
                       data_roots=_data_roots(args), ray_address=args.ray_address, memory=memory_config(args))


def memory_config(args):
    """The MemoryConfig from the --recompute / --distributed-optimizer / --sequence-parallel flags."""
    from value_assets.core.memory import MemoryConfig

    return MemoryConfig(recompute=args.recompute, distributed_optimizer=args.distributed_optimizer,
                        sequence_parallel=args.sequence_parallel)


def eval_config(args):
    """The EvalConfig from parsed `evaluate` arguments (the CLI and the Pipes job share it)."""
    from value_assets.gpu.jobs.evaluate import EvalConfig

    return EvalConfig(checkpoint=Path(args.checkpoint), manifest=Path(args.manifest), contract_sha256=args.contract_sha256,
                      report=Path(args.report), split=args.split, num_batches=args.num_batches, global_batch_size=args.global_batch_size,
                      seed=args.seed, gpus=args.gpus, tensor_parallel=args.tensor_parallel, pipeline_parallel=args.pipeline_parallel,
                      data_roots=_data_roots(args),
                      ray_address=args.ray_address)


def cmd_train(args) -> int:
    from value_assets.gpu.jobs.train import train

    cfg = train_config(args)
    result = train(cfg, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(result.to_json() if args.json else {k: v for k, v in result.to_json().items() if k not in ("metrics", "losses")}, sort_keys=True))
    return 0


def cmd_evaluate(args) -> int:
    from value_assets.gpu.jobs.evaluate import evaluate

    cfg = eval_config(args)
    res = evaluate(cfg, log=lambda m: print(m, file=sys.stderr, flush=True))
    agg = res.report["aggregates"]
    print(json.dumps({"report": res.report_path, "sha256": res.report_sha256, "passed": res.passed,
                      "token_ev": agg["token"]["ev"], "trajectory_ev": agg["trajectory"]["ev"], "auroc": agg["auroc"],
                      "plots": res.plots}, sort_keys=True))
    if not res.passed:
        print(f"value-assets: gate failed for {args.split} split; report published at {res.report_path}", file=sys.stderr)
        return EXIT_GATE_FAILED
    return 0


def cmd_export_hf(args) -> int:
    from value_assets.gpu.convert.export import export_checkpoint

    out = export_checkpoint(Path(args.checkpoint), Path(args.out))
    print(json.dumps({"out": str(out)}))
    return 0


def _positive(text: str) -> int:
    from value_assets.cli import _positive as p

    return p(text)


def _tokens_or_auto(text: str):
    return "auto" if text == "auto" else _positive(text)


def add_commands(sub) -> None:
    t = sub.add_parser("train", help="train a critic on the train split (GPU job; CPU without CUDA)")
    t.add_argument("manifest")
    t.add_argument("--output", required=True, help="critic folder: iter_*/ checkpoints, contracts, latest pointer, metrics")
    t.add_argument("--backbone", required=True, help="'tiny', a Hugging Face folder or a Megatron checkpoint folder")
    t.add_argument("--global-batch-size", type=_positive, default=16)
    t.add_argument("--epochs", type=_positive, default=1)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--save-interval", type=int, default=0, help="save every K steps (0: at the end only)")
    t.add_argument("--gpus", type=_positive, default=1, help="worker slots: GPUs, or CPU processes without CUDA")
    t.add_argument("--tensor-parallel", type=_positive, default=1)
    t.add_argument("--pipeline-parallel", type=_positive, default=1, help="pipeline stages (must divide the backbone's layers)")
    t.add_argument("--micro-batch-tokens", type=_tokens_or_auto, default=4096,
                   help="packed micro-batch token budget, or 'auto': the largest that fits the GPU's free memory")
    t.add_argument("--recompute", choices=("none", "selective", "full"), default="none",
                   help="activation recompute (megatron's): selective = core attention, full = every layer")
    t.add_argument("--distributed-optimizer", action="store_true",
                   help="shard fp32 master weights and Adam state over data-parallel ranks (megatron's)")
    t.add_argument("--sequence-parallel", action="store_true", help="megatron sequence parallelism (needs --tensor-parallel > 1)")
    t.add_argument("--lr", type=float, default=1e-4)
    t.add_argument("--warmup-steps", type=int, default=0)
    t.add_argument("--canary", action="store_true", help="run the first planned step only; write a non-promotable receipt")
    t.add_argument("--manifest-sha256")
    t.add_argument("--data-root", action="append")
    t.add_argument("--ray-address", help="an existing Ray cluster (default: start a local one)")
    t.add_argument("--json", action="store_true", help="print per-step metrics too")
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("evaluate", help="forward-only EV report and gate (exit 3 when the gate fails)")
    e.add_argument("--checkpoint", required=True, help="a contracted iter_* folder, or a critic folder (its latest)")
    e.add_argument("--manifest", required=True)
    e.add_argument("--contract-sha256", required=True)
    e.add_argument("--report", required=True, help="report path (write-once)")
    e.add_argument("--split", choices=("heldout", "train"), default="heldout")
    e.add_argument("--num-batches", type=_positive, default=8)
    e.add_argument("--global-batch-size", type=_positive)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--gpus", type=_positive, default=1)
    e.add_argument("--tensor-parallel", type=_positive, default=1)
    e.add_argument("--pipeline-parallel", type=_positive, default=1, help="any layout: the checkpoint is re-sharded on load")
    e.add_argument("--data-root", action="append")
    e.add_argument("--ray-address")
    e.set_defaults(func=cmd_evaluate)

    x = sub.add_parser("export-hf", help="export a critic checkpoint as a Hugging Face token-classification model")
    x.add_argument("--checkpoint", required=True)
    x.add_argument("--out", required=True)
    x.set_defaults(func=cmd_export_hf)
