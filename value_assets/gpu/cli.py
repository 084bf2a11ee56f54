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
                       data_roots=_data_roots(args), ray_address=args.ray_address)


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
    t.add_argument("--micro-batch-tokens", type=_positive, default=4096)
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

    add_import_command(sub)


def cmd_import_rollouts(args) -> int:
    from value_assets.core.rollouts import PRESETS, Fields, import_rollouts
    from value_assets.gpu.convert.tokenizer import HFTokenizer

    base = PRESETS[args.preset]
    fields = Fields(prompt=args.prompt_field or base.prompt, response=args.response_field or base.response,
                    reward=args.reward_field or base.reward, sample_id=args.id_field, group=args.group_field)
    if args.reward_range is None:
        reward_range = None
    elif args.reward_range == ["auto"]:
        reward_range = "auto"
    else:
        if len(args.reward_range) != 2:
            from value_assets.core.errors import InputError

            raise InputError("--reward-range", f"give LOW HIGH or auto, got {' '.join(args.reward_range)!r}")
        try:
            reward_range = (float(args.reward_range[0]), float(args.reward_range[1]))
        except ValueError:
            from value_assets.core.errors import InputError

            raise InputError("--reward-range", f"LOW and HIGH must be numbers, got {' '.join(args.reward_range)!r}") from None
    tok = HFTokenizer(args.tokenizer, append_eos=not args.no_eos)
    res = import_rollouts(args.inputs, tok, args.out, fields=fields, preset=args.preset, chat_template=args.chat_template,
                          heldout_fraction=args.heldout_fraction, seed=args.seed, reward_range=reward_range,
                          loss_type=args.loss_type, num_bins=args.num_bins, name=args.name, tokenizer_path=str(args.tokenizer))
    if res.reward_range_source == "auto":
        print(f"value-assets: reward range taken from the data: [{res.reward_range[0]!r}, {res.reward_range[1]!r}]", file=sys.stderr)
    print(json.dumps({"manifest": str(res.manifest), "train_rows": res.train_rows, "heldout_rows": res.heldout_rows,
                      "train_prompts": res.train_groups, "heldout_prompts": res.heldout_groups,
                      "reward_range": list(res.reward_range), "reward_range_source": res.reward_range_source,
                      "label_counts": res.label_counts}, sort_keys=True))
    return 0


def add_import_command(sub) -> None:
    from value_assets.core.rollouts import PRESETS

    r = sub.add_parser("import-rollouts", help="tokenize text rollouts (JSONL/Parquet) into Miles-format datasets and a manifest")
    r.add_argument("inputs", nargs="+", metavar="INPUT", help="rollout files (.jsonl or .parquet)")
    r.add_argument("--tokenizer", required=True, help="the actor's Hugging Face folder (tokenizer files; local only)")
    r.add_argument("--out", required=True, help="new output folder: train.jsonl, heldout.jsonl, NAME.json")
    r.add_argument("--preset", choices=sorted(PRESETS), default="generic",
                   help="field names of a known dump: " + "; ".join(f"{k}: {v.prompt}/{v.response}/{v.reward}" for k, v in sorted(PRESETS.items())) + " (default: %(default)s)")
    r.add_argument("--prompt-field", help="field holding the prompt text or chat messages (overrides the preset)")
    r.add_argument("--response-field", help="field holding the response text (overrides the preset)")
    r.add_argument("--reward-field", help="field holding the scalar reward (overrides the preset)")
    r.add_argument("--id-field", help="field holding a unique sample id (default: FILE-STEM:LINE)")
    r.add_argument("--group-field", help="field naming the prompt group for the split (default: the rendered prompt text)")
    r.add_argument("--chat-template", choices=("auto", "always", "never"), default="auto",
                   help="auto: chat messages are rendered with the tokenizer's template, text is taken as is (default: %(default)s)")
    r.add_argument("--no-eos", action="store_true", help="do not append the EOS token to each response")
    r.add_argument("--heldout-fraction", type=float, default=0.1, help="fraction of prompt groups held out (default: %(default)s)")
    r.add_argument("--seed", type=int, default=0, help="seed of the by-prompt split (default: %(default)s)")
    r.add_argument("--reward-range", nargs="+", metavar="LOW HIGH|auto",
                   help="the objective's reward range; 'auto' takes [min, max] of the data (default: [0, 1])")
    r.add_argument("--loss-type", choices=("classification", "mse"), default="classification", help="(default: %(default)s)")
    r.add_argument("--num-bins", type=int, default=51, help="value bins for classification (default: %(default)s)")
    r.add_argument("--name", default="rollouts", help="manifest stem (default: %(default)s)")
    r.set_defaults(func=cmd_import_rollouts)
