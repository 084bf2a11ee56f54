"""The GPU-job subcommands of `value-assets`: train, evaluate, export-hf.

This module only declares arguments and builds the job config (`value_assets.core.jobs`) from
them: flag defaults and help come from the config's fields. torch, ray and megatron are imported
when a command runs, so `value-assets validate` stays light.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, TypeVar

from value_assets.core.jobs import DATA_ROOTS_ENV, EvaluateJob, TrainJob, data_roots_from_env, field_doc

J = TypeVar("J", TrainJob, EvaluateJob)


EXIT_GATE_FAILED = 3


def _flag(parser: argparse.ArgumentParser, cls: type, name: str, type: Callable[[str], Any] | None = None, **kw: Any) -> None:
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
    from value_assets.gpu.jobs.train import train

    result = train(cfg, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(result.to_json() if args.json else {k: v for k, v in result.to_json().items() if k not in ("metrics", "losses")}, sort_keys=True))
    return 0


def cmd_evaluate(args) -> int:
    cfg = config_from_args(EvaluateJob, args)
    from value_assets.gpu.jobs.evaluate import evaluate

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


def _data_root_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-root", action="append",
                        help=field_doc(TrainJob, "data_roots") + f" Repeatable; also ${DATA_ROOTS_ENV} ({os.pathsep}-separated).")


def add_commands(sub) -> None:
    t = sub.add_parser("train", help="train a critic on the train split (GPU job; CPU without CUDA)")
    t.add_argument("manifest", help=field_doc(TrainJob, "manifest"))
    _flag(t, TrainJob, "output")
    _flag(t, TrainJob, "backbone")
    for name in ("global_batch_size", "epochs", "seed", "save_interval", "gpus", "tensor_parallel", "pipeline_parallel",
                 "micro_batch_tokens"):
        _flag(t, TrainJob, name, int)
    _flag(t, TrainJob, "lr", float)
    _flag(t, TrainJob, "warmup_steps", int)
    _flag(t, TrainJob, "canary", bool)
    _flag(t, TrainJob, "manifest_sha256")
    _data_root_flag(t)
    _flag(t, TrainJob, "ray_address")
    t.add_argument("--json", action="store_true", help="print per-step metrics too")
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("evaluate", help="forward-only EV report and gate (exit 3 when the gate fails)")
    for name in ("checkpoint", "manifest", "contract_sha256", "report", "split"):
        _flag(e, EvaluateJob, name)
    for name in ("num_batches", "global_batch_size", "seed", "gpus", "tensor_parallel", "pipeline_parallel", "micro_batch_tokens"):
        _flag(e, EvaluateJob, name, int)
    _data_root_flag(e)
    _flag(e, EvaluateJob, "ray_address")
    e.set_defaults(func=cmd_evaluate)

    x = sub.add_parser("export-hf", help="export a critic checkpoint as a Hugging Face token-classification model")
    x.add_argument("--checkpoint", required=True)
    x.add_argument("--out", required=True)
    x.set_defaults(func=cmd_export_hf)
