"""The `value-assets` command line.

Exit status 0 on success; 2 on invalid input, or on an output the system refused (disk full,
permission denied, read-only file system): a one-paragraph message on stderr naming the value or the
path, and nothing is written; 3 when a gate refused the critic (`evaluate`, `run-manifests`); 1 only
on an unexpected failure, i.e. a bug (a one-paragraph message too; the traceback only with
VALUE_ASSETS_TRACEBACK=1).
"""

from __future__ import annotations

import argparse
import errno
import importlib.metadata
import json
import os
import re
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

from value_assets.core.errors import EXIT_GATE_FAILED, InfrastructureError, InputError, require_int
from value_assets.core.job_configs import TrainJob, data_roots_from_env, field_default, field_doc
from value_assets.core.publish import PublishError

EXIT_INVALID = 2
EXIT_UNEXPECTED = 1
# OSErrors that are the environment's answer, not a bug: exit 2 with the path they name.
ENVIRONMENT_ERRNOS = frozenset(
    {
        errno.ENOSPC,
        errno.EDQUOT,
        errno.EFBIG,
        errno.EACCES,
        errno.EPERM,
        errno.EROFS,
        errno.EIO,
        errno.ENAMETOOLONG,
        errno.EMFILE,
        errno.ENFILE,
    }
)


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits 2 too; keep one message format
        self.print_usage(sys.stderr)
        raise InputError("command line", message)


class _ProgressBar:
    """A stderr progress bar that appears only once a file has taken more than a second."""

    def __init__(self, label: str, stream=sys.stderr, delay: float = 1.0):
        self.label = label
        self.stream = stream
        self.start = time.monotonic()
        self.delay = delay
        self.shown = False

    def __call__(self, phase: str, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.start < self.delay or total <= 0:
            return
        self.shown = True
        frac = min(done / total, 1.0)
        bar = "#" * int(frac * 30)
        self.stream.write(f"\r{self.label} {phase:<8} [{bar:<30}] {frac * 100:5.1f}%")
        self.stream.flush()

    def close(self) -> None:
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()


def _data_roots(args) -> tuple[str, ...] | None:
    return data_roots_from_env(args.data_root)


def _load_manifest(args):
    from value_assets.core.manifest import load_manifest

    return load_manifest(
        args.manifest, pinned_sha256=getattr(args, "manifest_sha256", None), data_roots=_data_roots(args)
    )


def cmd_validate(args) -> int:
    from value_assets.core.dataset import DEFAULT_MAX_ROW_BYTES, validate_dataset

    manifest = _load_manifest(args)
    out: dict[str, Any] = {
        "manifest": str(manifest.path),
        "sha256": manifest.sha256,
        "objective": manifest.objective.canonical(),
        "ignored_objective_keys": list(manifest.ignored_objective_keys),
    }
    max_row_bytes = args.max_row_bytes or DEFAULT_MAX_ROW_BYTES
    for ref in manifest.splits():
        bar = _ProgressBar(f"{ref.split}:")
        try:
            ds = validate_dataset(
                ref,
                manifest.objective,
                vocab_size=args.vocab_size,
                max_seq_len=args.max_seq_len,
                max_row_bytes=max_row_bytes,
                progress=bar,
            )
        finally:
            bar.close()
        s = ds.stats
        out[ref.split] = {
            "path": str(ds.path),
            "sha256": ds.sha256,
            "format": ds.format,
            "rows": s.rows,
            "tokens": s.tokens,
            "active_targets": s.active_targets,
            "label_counts": s.label_counts,
            "max_tokens": s.max_tokens,
            "length_quantiles": s.length_quantiles,
        }
    if args.json:
        print(json.dumps(out, sort_keys=True))
        return 0
    print(f"manifest  {out['manifest']}")
    print(f"sha256    {out['sha256']}")
    obj = out["objective"]
    print(
        f"objective {obj['loss_type']}, {obj['num_bins']} bins over {obj['reward_range']}, {obj['target_type']} (sigma "
        f"ratio {obj['hl_gauss_sigma_ratio']})"
    )
    if out["ignored_objective_keys"]:
        keys = ", ".join(repr(k) for k in out["ignored_objective_keys"])
        print(f"          ignored unknown objective key(s): {keys} (as Miles' loader ignores them)")
    print()
    print(
        f"{'split':<8} {'format':<8} {'rows':>8} {'tokens':>10} {'active':>10} {'max len':>8}  labels              "
        "sha256"
    )
    for split in ("train", "heldout"):
        if split not in out:
            continue
        d = out[split]
        labels = ", ".join(f"{k}:{v}" for k, v in d["label_counts"].items()) or "-"
        print(
            f"{split:<8} {d['format']:<8} {d['rows']:>8} {d['tokens']:>10} {d['active_targets']:>10} "
            f"{d['max_tokens']:>8}  {labels:<19} {d['sha256'][:16]}..."
        )
    if "heldout" not in out:
        print("\nnote: no heldout split: a critic trained on this manifest can train but cannot be promoted")
    return 0


def cmd_plan(args) -> int:
    from value_assets.core.plan import build_plan, choose_exact_coverage

    manifest = _load_manifest(args)
    n = manifest.train.num_samples
    if args.gpus is not None or args.max_global_batch_size is not None:
        if args.gpus is None or args.max_global_batch_size is None:
            raise InputError("command line", "--gpus and --max-global-batch-size go together")
        if args.global_batch_size is not None:
            raise InputError(
                "command line",
                "--global-batch-size cannot be combined with --gpus/--max-global-batch-size (they choose it)",
            )
        c = choose_exact_coverage(n, args.gpus, args.max_global_batch_size)
        res = {
            "num_rows": n,
            "gpus": args.gpus,
            "max_global_batch_size": args.max_global_batch_size,
            "dp": c.dp,
            "global_batch_size": c.global_batch_size,
            "dropped": c.dropped,
            "repeated": c.repeated,
        }
        if args.json:
            print(json.dumps(res, sort_keys=True))
        else:
            print(
                f"rows {n}, GPUs {args.gpus}, max G {args.max_global_batch_size}: dp = {c.dp}, G = "
                f"{c.global_batch_size}, steps per epoch = {n // c.global_batch_size}, dropped rows = {c.dropped}, "
                f"repeated rows = {c.repeated}"
            )
        return 0
    if args.global_batch_size is None:
        raise InputError("command line", "give --global-batch-size G, or --gpus N with --max-global-batch-size M")
    plan = build_plan(n, args.global_batch_size, args.epochs, args.seed)
    cov = plan.coverage()
    if args.json:
        print(json.dumps({"sha256": plan.sha256, **plan.to_json(), **cov}, sort_keys=True))
        return 0
    print(f"plan sha256 {plan.sha256}")
    print(
        f"rows {n}, G {plan.global_batch_size}, epochs {plan.epochs}, seed {plan.seed}: {plan.num_steps} steps, "
        f"dropped {cov['dropped']} row slots, repeated {cov['repeated']}"
    )
    for k, batch in enumerate(plan.steps, start=1):
        if k > 6 and k < plan.num_steps:
            if k == 7:
                print("  ...")
            continue
        shown = ", ".join(map(str, batch[:12])) + (", ..." if len(batch) > 12 else "")
        print(f"  step {k:>4}: [{shown}]")
    return 0


def cmd_make_demo_data(args) -> int:
    from value_assets.core.demo_data import make_demo_data

    require_int(args.rows, "--rows")
    require_int(args.heldout_rows, "--heldout-rows", minimum=0)
    path = make_demo_data(
        args.out_dir,
        rows=args.rows,
        heldout_rows=args.heldout_rows,
        seed=args.seed,
        shuffle_labels=args.shuffle_labels,
        fmt=args.format,
        name=args.name,
    )
    print(path)
    return 0


def cmd_verify(args) -> int:
    """Check every file of a save against its contract (the same core code evaluation, export and
    promotion use). Exit 0 when they match, 2 otherwise. Reads and hashes; deserializes nothing."""
    from value_assets.core.checkpoint_files import checkpoint_differences
    from value_assets.core.contract import load_contract, resolve_step_dir

    step_dir, latest_pin = resolve_step_dir(args.checkpoint)
    pin = args.contract_sha256 or latest_pin
    contract, sha = load_contract(step_dir, pinned_sha256=pin)
    diffs = checkpoint_differences(step_dir, contract)
    files = contract.get("checkpoint_files") or []
    if args.json:
        print(
            json.dumps(
                {
                    "checkpoint": str(step_dir),
                    "contract_sha256": sha,
                    "files": len(files),
                    "matches": not diffs,
                    "differences": diffs,
                },
                sort_keys=True,
            )
        )
    if diffs:
        for d in diffs:
            print(f"value-assets: {step_dir}: {d}", file=sys.stderr)
        print(f"value-assets: error: {step_dir}: {len(diffs)} difference(s) from contract {sha}", file=sys.stderr)
        return EXIT_INVALID
    if not args.json:
        print(f"ok {step_dir}: {len(files)} files match contract {sha}")
    return 0


def cmd_handoff(args) -> int:
    """Print the RL-side settings of a promoted critic, after verifying the registry record against
    its pin and its bundles' bytes against the record."""
    import shlex
    from pathlib import Path

    from value_assets.core.handoff import read_registry_record, record_rl_settings, verify_handoff
    from value_assets.core.hashing import require_sha

    path = Path(args.record)
    pin, pinned_by = args.record_sha256, "--record-sha256"
    if pin is not None:
        require_sha(pin, "--record-sha256")
    if args.instance:
        promoted = _instance_record_sha(path)
        if pin is not None and pin != promoted:
            raise InputError(
                "--record-sha256",
                f"{pin} is not the record the Dagster instance's latest promotion of {path.stem!r} wrote ({promoted})",
            )
        pin, pinned_by = promoted, f"the Dagster instance ({_dagster_home()})"
    if pin is None:
        raise InputError(
            str(path),
            "the registry record is not pinned, and whoever can write the artifacts folder can rewrite "
            "it with its bundles: pass --record-sha256 HEX (promoted_critic's registry_record_sha256 in "
            "Dagster) or --instance (the latest promotion in the instance at $DAGSTER_HOME)",
        )
    record, sha = read_registry_record(path, pin)
    verify_handoff(record, str(path))
    settings = record_rl_settings(record)
    if args.json:
        print(
            json.dumps(
                {
                    "registry_record": str(path),
                    "registry_record_sha256": sha,
                    "partition_key": record.get("partition_key"),
                    "training_contract_sha256": record.get("contract_sha256"),
                    "model_identity": record["handoff"]["model_identity"],
                    **settings,
                },
                indent=2,
                sort_keys=True,
            )
        )
        return 0
    print(
        f"# promoted critic of partition {record.get('partition_key')} (training contract "
        f"{record.get('contract_sha256')})"
    )
    print(f"# registry record {sha} pinned by {pinned_by}; bundles verified against it")
    print("# Miles RL trainer (Megatron-LM):")
    print(shlex.join(settings["miles_args"]))
    if settings["verl"] is not None:
        print("# verl (Hugging Face critic):")
        if settings.get("verl_tokenizer_missing"):
            print(f"# {settings['verl_tokenizer_missing']}")
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in settings["verl"].items()))
    return 0


def cmd_run_manifests(args) -> int:
    """Process the watched manifest folder once, as the daemon's sensor would, running each
    requested `full` run in this process (value_assets/run_inbox.py)."""
    from value_assets.definitions import deployment_name, project_root, resources_for
    from value_assets.run_inbox import run_inbox, use_home

    home = use_home(project_root())
    from dagster import DagsterInstance

    resources = resources_for(deployment_name())
    print(f"# instance {home}; watched folder {resources['inbox'].folder_path}", file=sys.stderr)
    with DagsterInstance.get() as instance:
        states = run_inbox(instance, resources, say=lambda m: print(m, file=sys.stderr, flush=True))
    rows = [
        {
            "partition_key": st.partition_key,
            "manifest": str(st.manifest),
            "success": st.success,
            "failed_steps": list(st.failed_steps),
            "gate": st.gate,
            "promoted": st.promoted,
            "registry_record": str(st.registry_record) if st.promoted else None,
            "registry_record_sha256": st.record_sha256 if st.promoted else None,
            "handoff_command": st.handoff_command(),
        }
        for st in states
    ]
    if args.json:
        print(json.dumps(rows, indent=2, sort_keys=True))
    else:
        for st in states:
            verdict = "promoted" if st.promoted else ("refused by the gate" if st.gate is False else "failed")
            print(f"{st.partition_key}: {verdict}" + (f" (run {st.run_id})" if st.success is False else ""))
            if st.handoff_command():
                print(f"  {st.handoff_command()}")
        if not states:
            print("nothing to run: no new manifest, or every partition was run already")
    refused = [st for st in states if st.refusal]
    for st in refused:  # bad input or a write the system refused: exit 2, named
        print(f"value-assets: error: {st.partition_key}: {st.refusal}", file=sys.stderr)
    if refused:
        return 2
    if any(st.gate is False for st in states):
        return EXIT_GATE_FAILED
    return 0 if all(st.success for st in states) else 1


def _dagster_home():
    """$DAGSTER_HOME as an absolute path: a relative one (the README's `DAGSTER_HOME=.dagster_home`)
    is taken from the working directory, where Dagster itself would refuse it."""
    from pathlib import Path

    given = os.environ.get("DAGSTER_HOME")
    if not given:
        raise InputError(
            "--instance", "DAGSTER_HOME is not set: it names the Dagster instance that recorded the promotion"
        )
    return Path(given).expanduser().absolute()


def _instance_record_sha(record_path) -> str:
    """The record sha the latest promotion of the record's partition (its file name,
    `registry/<partition>.json`) wrote, read from the Dagster instance at $DAGSTER_HOME.

    A folder that holds no instance is refused (exit 2, naming it) before Dagster opens it, which
    would create an empty instance there; so is an instance Dagster cannot read."""
    home = _dagster_home()
    where = f"--instance: DAGSTER_HOME={os.environ['DAGSTER_HOME']}"
    if not home.is_dir():
        raise InputError(where, f"{home} is not a folder: it must name the Dagster instance that made the promotion")
    if not ((home / "dagster.yaml").is_file() or (home / "storage").is_dir()):
        raise InputError(where, f"{home} holds no Dagster instance (no dagster.yaml, no storage/)")
    from dagster import DagsterError, DagsterInstance

    from value_assets.lineage import Lineage

    try:
        with DagsterInstance.from_config(str(home)) as instance:
            return Lineage(instance, record_path.stem).promoted_record_sha()
    except DagsterError as exc:  # an unreadable dagster.yaml, storage of another version, ...
        raise InputError(where, f"cannot read the Dagster instance in {home}: {type(exc).__name__}: {exc}") from None


def _positive(text: str) -> int:
    """argparse type of the count flags of validate and plan (core's `require_int` rule)."""
    try:
        return require_int(int(text), "")
    except ValueError as exc:  # int() of a non-number, or an InputError (a ValueError too)
        message = exc.message if isinstance(exc, InputError) else f"must be an integer, got {text!r}"
        raise argparse.ArgumentTypeError(message) from None


def _version() -> str:
    """The installed distribution's version; a checkout run from source (PYTHONPATH) has none."""
    try:
        return importlib.metadata.version("value-assets")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed: run from source)"


def build_parser() -> argparse.ArgumentParser:
    p = _ArgumentParser(
        prog="value-assets", description="Offline critic pretraining with an explained-variance promotion gate."
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_ArgumentParser)

    def manifest_args(sp):
        sp.add_argument("manifest", help="manifest JSON (miles.value-pretrain.v1)")
        sp.add_argument(
            "--data-root",
            action="append",
            help="refuse dataset paths outside these folders (repeatable; also VALUE_ASSETS_DATA_ROOTS)",
        )

    v = sub.add_parser("validate", help="validate a manifest and every dataset it names")
    manifest_args(v)
    v.add_argument("--manifest-sha256", help="pin the manifest's sha256 (checked before parsing)")
    v.add_argument("--vocab-size", type=_positive, help="refuse a token id >= this (the backbone's vocabulary size)")
    v.add_argument("--max-seq-len", type=_positive, help="refuse a row with more tokens than this")
    v.add_argument(
        "--max-row-bytes",
        type=_positive,
        help="refuse a row larger than this many bytes (JSONL line; Parquet decoded row); default 64 MiB",
    )
    v.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    v.set_defaults(func=cmd_validate)

    pl = sub.add_parser("plan", help="print the batch plan, or choose G and dp for exact coverage")
    manifest_args(pl)
    pl.add_argument("--manifest-sha256", help="pin the manifest's sha256 (checked before parsing)")
    pl.add_argument("--global-batch-size", type=_positive, help="G, rows per optimizer step: print this plan")
    # The plan's settings are training's (core.job_configs.TrainJob): same defaults, same meaning.
    pl.add_argument(
        "--epochs",
        type=_positive,
        default=field_default(TrainJob, "epochs"),
        help=field_doc(TrainJob, "epochs") + " (default: %(default)s)",
    )
    pl.add_argument(
        "--seed",
        type=int,
        default=field_default(TrainJob, "seed"),
        help=field_doc(TrainJob, "seed") + " (default: %(default)s)",
    )
    pl.add_argument(
        "--gpus",
        type=_positive,
        help="with --max-global-batch-size: choose dp and G for exact coverage on this many GPUs",
    )
    pl.add_argument("--max-global-batch-size", type=_positive, help="with --gpus: the largest G to consider")
    pl.add_argument("--json", action="store_true", help="print one JSON object")
    pl.set_defaults(func=cmd_plan)

    d = sub.add_parser("make-demo-data", help="write synthetic rollouts with a learnable value signal")
    d.add_argument("out_dir")
    d.add_argument("--rows", type=int, default=2048, help="train rows (default: %(default)s)")
    d.add_argument("--heldout-rows", type=int, default=256, help="heldout rows; 0 for none (default: %(default)s)")
    d.add_argument("--seed", type=int, default=0, help="seed of the synthetic data (default: %(default)s)")
    d.add_argument("--shuffle-labels", action="store_true", help="negative control: permute rewards across rows")
    d.add_argument(
        "--format", choices=("jsonl", "parquet"), default="jsonl", help="dataset file format (default: %(default)s)"
    )
    d.add_argument(
        "--name",
        help="manifest stem, a plain file name inside OUT_DIR (default: demo, or demo-shuffled with --shuffle-labels)",
    )
    d.set_defaults(func=cmd_make_demo_data)

    vf = sub.add_parser(
        "verify", help="check every file of a saved checkpoint against its contract (exit 0: match, 2: differs)"
    )
    vf.add_argument("checkpoint", help="an iter_* folder, or a critic folder (its latest)")
    vf.add_argument("--contract-sha256", help="pin the contract's sha256 (checked before parsing)")
    vf.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    vf.set_defaults(func=cmd_verify)

    h = sub.add_parser(
        "handoff",
        help="print the RL-side settings of a promoted critic (verifies the pinned record and its bundles first)",
    )
    h.add_argument("record", help="registry record (<artifacts>/registry/<partition>.json)")
    h.add_argument(
        "--record-sha256", help="pin the record's sha256 (promoted_critic's registry_record_sha256 in Dagster)"
    )
    h.add_argument(
        "--instance",
        action="store_true",
        help="pin the record the latest promotion of its partition wrote, read from the Dagster instance at "
        "$DAGSTER_HOME",
    )
    h.add_argument("--json", action="store_true", help="print the settings as one JSON object")
    h.set_defaults(func=cmd_handoff)

    rm = sub.add_parser(
        "run-manifests",
        help="register the watched folder's new manifests and run each lineage's full job in this process, as the "
        "daemon would (DAGSTER_HOME, else .dagster_home in the project; VALUE_ASSETS_MANIFESTS, "
        "VALUE_ASSETS_ARTIFACTS)",
    )
    rm.add_argument("--json", action="store_true", help="print one JSON object per lineage")
    rm.set_defaults(func=cmd_run_manifests)

    _add_engine_commands(sub)
    return p


def _add_engine_commands(sub) -> None:
    """The GPU-job commands live in value_assets.gpu; they register only where it is importable."""
    try:
        from value_assets.gpu.commands import add_commands
    except ImportError:
        return
    add_commands(sub)


def _paragraph(text: str, limit: int = 2000) -> str:
    """One paragraph: line breaks inside a message (a pyarrow error, a quoted value) become spaces."""
    text = re.sub(r"\s*\n\s*", " ", text).strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return int(args.func(args) or 0)
    except InputError as exc:
        print(f"value-assets: error: {_paragraph(str(exc))}", file=sys.stderr)
        return EXIT_INVALID
    except PublishError as exc:  # the system refused the output (a full disk, permissions): named; nothing published
        print(f"value-assets: error: {_paragraph(str(exc))}", file=sys.stderr)
        return EXIT_INVALID
    except KeyboardInterrupt:
        return 130
    except InfrastructureError as exc:  # a worker that died, a deadline: not a bug, not bad input
        if os.environ.get("VALUE_ASSETS_TRACEBACK") == "1":
            traceback.print_exception(exc, file=sys.stderr)
        print(f"value-assets: infrastructure failure: {_paragraph(str(exc))}", file=sys.stderr)
        return EXIT_UNEXPECTED
    except OSError as exc:
        # The environment's refusal of a named path is located like bad input; one without a path
        # is a writer that failed to name its file: a bug (exit 1).
        if exc.errno not in ENVIRONMENT_ERRNOS or exc.filename is None:
            return _unexpected(exc)
        where = " -> ".join(str(f) for f in (exc.filename, exc.filename2) if f is not None)
        code = errno.errorcode.get(exc.errno, exc.errno)
        print(f"value-assets: error: {where}: {exc.strerror or exc} ({code})", file=sys.stderr)
        return EXIT_INVALID
    except Exception as exc:  # noqa: BLE001 - no raw traceback: bad input is refused as InputError above
        return _unexpected(exc)
    except BaseException as exc:  # torch_dist's CheckpointException is one; SystemExit is not ours
        if isinstance(exc, (SystemExit, GeneratorExit)):
            raise
        return _unexpected(exc)


def _unexpected(exc: BaseException) -> int:
    if os.environ.get("VALUE_ASSETS_TRACEBACK") == "1":
        traceback.print_exception(exc, file=sys.stderr)
    print(
        f"value-assets: unexpected failure (please report it): {type(exc).__name__}: {_paragraph(str(exc))} "
        "(set VALUE_ASSETS_TRACEBACK=1 for the traceback)",
        file=sys.stderr,
    )
    return EXIT_UNEXPECTED


if __name__ == "__main__":
    sys.exit(main())
