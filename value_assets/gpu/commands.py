"""The GPU-job subcommands of `value-assets`: train, evaluate, export-hf.

This module only declares arguments and builds the job config (`value_assets.core.job_configs`) from
them: flag defaults and help come from the config's fields. torch, ray and megatron are imported
when a command runs, so `value-assets validate` stays light.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from value_assets.core.errors import EXIT_GATE_FAILED
from value_assets.core.job_configs import (
    DATA_ROOTS_ENV,
    FREEZE,
    HEAD_BIAS,
    PLACEMENT_STRATEGIES,
    EvaluateJob,
    TrainJob,
    data_roots_from_env,
    field_doc,
)
from value_assets.core.report import GATE_MODES

J = TypeVar("J", TrainJob, EvaluateJob)


def _flag(
    parser: argparse.ArgumentParser, cls: type, name: str, type: Callable[[str], Any] | None = None, **kw: Any
) -> None:
    """`--name-with-dashes` for field `name` of job config `cls`: its default and its help come
    from the field, so the command line cannot disagree with the assets or the Pipes job. A field
    without a default is a required flag. Values are checked by the config, not by argparse."""
    f = cls.__dataclass_fields__[name]
    help_text = field_doc(cls, name).replace("%", "%%")
    if f.default is dataclasses.MISSING:
        kw["required"] = True
    else:
        kw["default"] = f.default
        if f.default is not None and f.default is not False:
            help_text += " (default: %(default)s)"
    if type is bool:
        kw["action"] = "store_true"
    elif type is not None:
        kw["type"] = type
    parser.add_argument("--" + name.replace("_", "-"), dest=name, help=help_text, **kw)


def config_from_args(cls: type[J], args: argparse.Namespace) -> J:
    """The job config from parsed arguments: every attribute named like a field, plus the data
    roots of --data-root and $VALUE_ASSETS_DATA_ROOTS. Validation is the config's own."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values["data_roots"] = data_roots_from_env(getattr(args, "data_root", None))
    return cls(**values)


def cmd_train(args) -> int:
    cfg = config_from_args(TrainJob, args)  # refuses bad settings before torch is imported
    from value_assets.gpu.drivers.train import train

    result = train(cfg, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(
        json.dumps(
            result.to_json()
            if args.json
            else {k: v for k, v in result.to_json().items() if k not in ("metrics", "losses")},
            sort_keys=True,
        )
    )
    return 0


def cmd_evaluate(args) -> int:
    cfg = config_from_args(EvaluateJob, args)
    from value_assets.gpu.drivers.evaluate import evaluate

    res = evaluate(cfg, log=lambda m: print(m, file=sys.stderr, flush=True))
    agg = res.report["aggregates"]
    print(
        json.dumps(
            {
                "report": res.report_path,
                "sha256": res.report_sha256,
                "passed": res.passed,
                "token_ev": agg["token"]["ev"],
                "trajectory_ev": agg["trajectory"]["ev"],
                "auroc": agg["auroc"],
                "gate_mode": res.report["gate"]["mode"],
                "gate_min_ev": res.report["gate"]["min_ev"],
                "intervals": {w: [iv["low"], iv["high"]] for w, iv in res.report["intervals"].items()},
                "plots": res.plots,
            },
            sort_keys=True,
        )
    )
    if not res.passed:
        print(
            f"value-assets: gate failed for {args.split} split; report published at {res.report_path}", file=sys.stderr
        )
        return EXIT_GATE_FAILED
    return 0


def cmd_export_hf(args) -> int:
    from value_assets.gpu.convert.export import export_checkpoint

    tokenizer = Path(args.tokenizer) if args.tokenizer else None
    out = export_checkpoint(Path(args.checkpoint), Path(args.out), args.format, tokenizer=tokenizer)
    print(json.dumps({"out": str(out), "format": args.format}))
    return 0


def cmd_export_miles(args) -> int:
    from value_assets.gpu.convert.export import export_miles

    out, sha = export_miles(Path(args.checkpoint), Path(args.out), args.model_identity, args.layer_spec)
    print(json.dumps({"out": str(out), "contract_sha256": sha, "layer_spec": args.layer_spec}))
    return 0


def _data_root_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data-root",
        action="append",
        help=field_doc(TrainJob, "data_roots") + f" Repeatable; also ${DATA_ROOTS_ENV} ({os.pathsep}-separated).",
    )


def _int_or_auto(text: str) -> int | str:
    """A token budget or 'auto'; anything else stays a string for the config to refuse with its message."""
    try:
        return int(text)
    except ValueError:
        return text


def add_commands(sub) -> None:
    t = sub.add_parser("train", help="train a critic on the train split (GPU job; CPU without CUDA)")
    t.add_argument("manifest", help=field_doc(TrainJob, "manifest"))
    _flag(t, TrainJob, "output")
    _flag(t, TrainJob, "backbone")
    _flag(t, TrainJob, "plan")
    _flag(t, TrainJob, "plan_sha256")
    for name in (
        "global_batch_size",
        "epochs",
        "seed",
        "save_interval",
        "gpus",
        "tensor_parallel",
        "pipeline_parallel",
    ):
        _flag(t, TrainJob, name, int)
    _flag(t, TrainJob, "micro_batch_tokens", _int_or_auto)
    _flag(t, TrainJob, "recompute", choices=("none", "selective", "full"))
    _flag(t, TrainJob, "recompute_layers", int, metavar="K")
    _flag(t, TrainJob, "distributed_optimizer", bool)
    _flag(t, TrainJob, "optimizer_offload", float, metavar="FRACTION")
    _flag(t, TrainJob, "freeze", choices=FREEZE)
    _flag(t, TrainJob, "head_bias", choices=HEAD_BIAS)
    _flag(t, TrainJob, "sequence_parallel", bool)
    _flag(t, TrainJob, "lr", float)
    _flag(t, TrainJob, "warmup_steps", int)
    _flag(t, TrainJob, "canary", bool)
    _flag(t, TrainJob, "manifest_sha256")
    t.add_argument(
        "--resume-from",
        dest="resume_from",
        action="append",
        metavar="SHA",
        help=field_doc(TrainJob, "resume_from") + " Repeatable.",
    )
    _data_root_flag(t)
    _flag(t, TrainJob, "ray_address")
    _flag(t, TrainJob, "placement_strategy", choices=PLACEMENT_STRATEGIES)
    _flag(t, TrainJob, "hf_config")
    t.add_argument("--json", action="store_true", help="print per-step metrics too")
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("evaluate", help="forward-only EV report and gate (exit 3 when the gate fails)")
    for name in ("checkpoint", "manifest", "contract_sha256", "report", "split"):
        _flag(e, EvaluateJob, name)
    for name in (
        "num_batches",
        "global_batch_size",
        "seed",
        "gpus",
        "tensor_parallel",
        "pipeline_parallel",
        "micro_batch_tokens",
    ):
        _flag(e, EvaluateJob, name, int)
    _data_root_flag(e)
    _flag(e, EvaluateJob, "ray_address")
    _flag(e, EvaluateJob, "gate_mode", choices=GATE_MODES)
    _flag(e, EvaluateJob, "gate_min_ev", float)
    _flag(e, EvaluateJob, "placement_strategy", choices=PLACEMENT_STRATEGIES)
    e.set_defaults(func=cmd_evaluate)

    x = sub.add_parser("export-hf", help="export a critic checkpoint as a Hugging Face token-classification model")
    x.add_argument("--checkpoint", required=True, help="critic folder or one of its contracted iter_* saves")
    x.add_argument("--out", required=True, help="new (or empty) output folder")
    x.add_argument(
        "--format",
        choices=("token-classification", "scalar", "openrlhf"),
        default="token-classification",
        help="scalar: mse critics as num_labels=1 (verl reads logits[..., 0]); openrlhf: OpenRLHF's critic layout "
        "(default: %(default)s)",
    )
    x.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="the actor's Hugging Face folder whose tokenizer files the export carries (default: the Hugging Face "
        "backbone the critic was trained from, checked against the tokenizer sha its contract recorded)",
    )
    x.set_defaults(func=cmd_export_hf)

    m = sub.add_parser(
        "export-miles",
        help="export a critic checkpoint for Miles' --critic-load (docs/rules.md#hand-off); prints the contract sha",
    )
    m.add_argument("--checkpoint", required=True, help="critic folder or one of its contracted iter_* saves")
    m.add_argument("--out", required=True, help="new (or empty) output folder: Miles' --critic-load")
    m.add_argument(
        "--model-identity",
        required=True,
        help="the name the RL run knows the critic by (the contract's model_identity)",
    )
    m.add_argument(
        "--layer-spec",
        choices=("te", "local"),
        default="te",
        help="Megatron layer spec of the written weights: te (Transformer Engine) or local (default: %(default)s)",
    )
    m.set_defaults(func=cmd_export_miles)

    add_import_command(sub)


def cmd_import_rollouts(args) -> int:
    from value_assets.core.rollouts import PRESETS, Fields, import_rollouts
    from value_assets.gpu.convert.tokenizer import HFTokenizer

    base = PRESETS[args.preset]
    fields = Fields(
        prompt=args.prompt_field or base.prompt,
        response=args.response_field or base.response,
        reward=args.reward_field or base.reward,
        sample_id=args.id_field,
        group=args.group_field,
    )
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

            raise InputError(
                "--reward-range", f"LOW and HIGH must be numbers, got {' '.join(args.reward_range)!r}"
            ) from None
    if args.max_seq_len is not None and args.max_seq_len < 2:
        from value_assets.core.errors import InputError

        raise InputError("--max-seq-len", f"must be an integer >= 2, got {args.max_seq_len}")
    training = _training_spec_to_embed(args.training) if args.training else None
    tok = HFTokenizer(args.tokenizer, append_eos=not args.no_eos)
    res = import_rollouts(
        args.inputs,
        tok,
        args.out,
        fields=fields,
        preset=args.preset,
        chat_template=args.chat_template,
        heldout_fraction=args.heldout_fraction,
        seed=args.seed,
        reward_range=reward_range,
        loss_type=args.loss_type,
        num_bins=args.num_bins,
        name=args.name,
        tokenizer_path=str(args.tokenizer),
        max_seq_len=args.max_seq_len,
        inbox=args.inbox,
        training=training,
    )
    if res.reward_range_source == "auto":
        print(
            f"value-assets: reward range taken from the data: [{res.reward_range[0]!r}, {res.reward_range[1]!r}]",
            file=sys.stderr,
        )
    limit = tok.model_max_length
    if args.max_seq_len is None and limit is not None and res.longest_row_tokens > limit:
        print(
            f"value-assets: warning: the longest row ({res.longest_row_where}) has {res.longest_row_tokens} tokens, "
            f"more than the tokenizer's model_max_length {limit}: training refuses rows longer than the backbone's "
            "maximum sequence length; give --max-seq-len to refuse them here",
            file=sys.stderr,
        )
    print(
        json.dumps(
            {
                "manifest": str(res.manifest),
                "train_rows": res.train_rows,
                "heldout_rows": res.heldout_rows,
                "train_prompts": res.train_groups,
                "heldout_prompts": res.heldout_groups,
                "reward_range": list(res.reward_range),
                "reward_range_source": res.reward_range_source,
                "label_counts": res.label_counts,
                "longest_row_tokens": res.longest_row_tokens,
            },
            sort_keys=True,
        )
    )
    return 0


def _training_spec_to_embed(path: str) -> dict[str, Any]:
    """The spec file's object, checked (docs/rules.md#training-spec), with its relative backbone
    paths made absolute (they were relative to the spec file; the manifest may live elsewhere)."""
    from value_assets.core.training_spec import load_spec_file

    spec = load_spec_file(Path(path))
    raw = dict(spec.raw)
    if spec.backbone.path is not None:
        backbone = dict(raw["backbone"])
        backbone["path"] = str(spec.backbone.path.resolve())
        if spec.backbone.hf_config is not None:
            backbone["hf_config"] = str(spec.backbone.hf_config.resolve())
        raw["backbone"] = backbone
    return raw


def add_import_command(sub) -> None:
    from value_assets.core.rollouts import PRESETS

    r = sub.add_parser(
        "import-rollouts", help="tokenize text rollouts (JSONL/Parquet) into Miles-format datasets and a manifest"
    )
    r.add_argument("inputs", nargs="+", metavar="INPUT", help="rollout files (.jsonl or .parquet)")
    r.add_argument("--tokenizer", required=True, help="the actor's Hugging Face folder (tokenizer files; local only)")
    r.add_argument("--out", required=True, help="new output folder: train.jsonl, heldout.jsonl, NAME.json")
    r.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="generic",
        help="field names of a known dump: "
        + "; ".join(f"{k}: {v.prompt}/{v.response}/{v.reward}" for k, v in sorted(PRESETS.items()))
        + " (default: %(default)s)",
    )
    r.add_argument("--prompt-field", help="field holding the prompt text or chat messages (overrides the preset)")
    r.add_argument("--response-field", help="field holding the response text (overrides the preset)")
    r.add_argument("--reward-field", help="field holding the scalar reward (overrides the preset)")
    r.add_argument(
        "--id-field",
        help="field holding a unique sample id (default: FILE-STEM:LINE; where two inputs share a stem, their "
        "paths relative to the inputs' common folder replace the stems: d1/r:1, d2/r:1)",
    )
    r.add_argument(
        "--group-field", help="field naming the prompt group for the split (default: the rendered prompt text)"
    )
    r.add_argument(
        "--chat-template",
        choices=("auto", "always", "never"),
        default="auto",
        help="auto: chat messages are rendered with the tokenizer's template, text is taken as is (default: "
        "%(default)s)",
    )
    r.add_argument("--no-eos", action="store_true", help="do not append the EOS token to each response")
    r.add_argument(
        "--heldout-fraction", type=float, default=0.1, help="fraction of prompt groups held out (default: %(default)s)"
    )
    r.add_argument("--seed", type=int, default=0, help="seed of the by-prompt split (default: %(default)s)")
    r.add_argument(
        "--reward-range",
        nargs="+",
        metavar="LOW HIGH|auto",
        help="the objective's reward range; 'auto' takes [min, max] of the data (default: [0, 1])",
    )
    r.add_argument(
        "--loss-type", choices=("classification", "mse"), default="classification", help="(default: %(default)s)"
    )
    r.add_argument("--num-bins", type=int, default=51, help="value bins for classification (default: %(default)s)")
    r.add_argument(
        "--name",
        default="rollouts",
        help="manifest stem, a plain file name inside --out (or --inbox) (default: %(default)s)",
    )
    r.add_argument(
        "--max-seq-len",
        type=int,
        metavar="N",
        help="refuse a row of more than N tokens, as training refuses rows longer than the backbone's maximum "
        "sequence length (default: no limit; a warning names a row beyond the tokenizer's model_max_length)",
    )
    r.add_argument(
        "--inbox",
        help="write the manifest into this folder (the one the sensor watches), its dataset paths relative to it, "
        "instead of into --out; written last, so the sensor never sees it before its data",
    )
    r.add_argument(
        "--training",
        metavar="SPEC_JSON",
        help="a training spec file (docs/rules.md#training-spec) to embed as the manifest's `training`: the actor, "
        "the training and the gate of the lineage",
    )
    r.set_defaults(func=cmd_import_rollouts)
