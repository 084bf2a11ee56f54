"""The GPU job's Dagster Pipes entry: ``python -m value_assets.gpu.pipes_job``.

Dagster's launcher (local subprocess, Ray job or Kubernetes pod) starts this module with Pipes
extras ``{"task": "train" | "canary" | "evaluate" | "handoff", "config": {...}, "partition_key": ...}``.
The config is the job's settings as data: `TrainJob.to_json()` (with ``canary: true`` exactly when
the task is ``canary``), `EvaluateJob.to_json()` or `HandoffJob.to_json()`, read back with `from_json`. The job runs the
driver and reports, through Pipes, one materialization per asset it produced (metadata and data
version = the sha of what it published). While training it sends a progress line every K steps
(`core.progress`) as a Pipes log message, which the run's event log shows as it arrives; the
checkpoint's materialization carries the loss/EV plot (`jobs.training_curve`). Bad input ends the job with a
Pipes-visible error and exit status 2; nothing is reported then, so the step fails.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from typing import Any

from dagster_pipes import open_dagster_pipes

from value_assets.core import vocabulary as v
from value_assets.core.errors import InputError
from value_assets.core.job_configs import EvaluateJob, HandoffJob, TrainJob
from value_assets.core.progress import TrainProgress

# The driver logs every step; those lines go to the job's stderr (the step's captured logs) and
# the event log gets `TrainProgress`'s lines, every K steps, instead.
_STEP_LINE = re.compile(r"step \d+/\d+ ")


def _job_log(pipes) -> Callable[[str], None]:
    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)
        if not _STEP_LINE.match(message):
            pipes.log.info(message)

    return log


def _json(value: Any) -> dict[str, Any]:
    return {"raw_value": value, "type": "json"}  # Pipes needs nested values typed


def planned_steps(cfg: TrainJob) -> int:
    """The plan's step count, from the manifest alone (the driver validates everything later)."""
    from value_assets.core.manifest import load_manifest

    manifest = load_manifest(cfg.manifest, pinned_sha256=cfg.manifest_sha256, data_roots=cfg.data_roots)
    return max(1, manifest.train.num_samples // cfg.global_batch_size * cfg.epochs)


def _train(pipes, cfg: TrainJob) -> None:
    from value_assets.gpu.drivers.train import train
    from value_assets.gpu.drivers.training_curve import write_training_curve

    progress = TrainProgress(pipes.log.info, planned_steps(cfg))
    result = train(cfg, log=_job_log(pipes), on_step=progress)
    progress.finish()
    tokens_per_s = [m.get("tokens_per_s") for m in result.metrics if m.get("tokens_per_s")]
    common: dict[str, Any] = {
        "steps": result.completed_steps,
        "plan_steps": result.plan_steps,
        "resumed_from": result.resumed_from,
        "final_loss": result.final_loss,
        "tokens_per_s": (sum(tokens_per_s) / len(tokens_per_s)) if tokens_per_s else None,
        "checkpoint": result.checkpoint,
        "plan_sha256": result.plan_sha256,
    }
    if cfg.canary:
        from value_assets.core.hashing import sha256_file

        sha = sha256_file(result.receipt)
        pipes.report_asset_materialization(
            asset_key=v.CANARY_RECEIPT,
            data_version=sha,
            metadata={**common, "receipt": result.receipt, v.RECEIPT_SHA256: sha, "executed_steps": 1},
        )
        return
    sha = result.contract_sha256
    curve: dict[str, Any] = {}
    written = write_training_curve(cfg.output)
    if written is not None:
        # The whole logged history (across resumes), not only this run's steps.
        summary, plots = written
        curve = {"final_ev": summary["final_ev"], "loss_summary": _json(summary), "plots": _json(plots)}
    tensorboard = cfg.output / "tensorboard"
    if tensorboard.is_dir():
        curve["tensorboard"] = {"raw_value": str(tensorboard), "type": "path"}
    curve["metrics_log"] = {"raw_value": str(cfg.output / "metrics.jsonl"), "type": "path"}
    pipes.report_asset_materialization(
        asset_key=v.CRITIC_CHECKPOINT, data_version=sha, metadata={**common, **curve, v.CONTRACT_SHA256: sha}
    )
    pipes.report_asset_materialization(
        asset_key=v.TRAINING_CONTRACT,
        data_version=sha,
        metadata={v.CONTRACT_SHA256: sha, "completed_steps": result.completed_steps},
    )


def _evaluate(pipes, cfg: EvaluateJob) -> None:
    from value_assets.gpu.drivers.evaluate import evaluate

    res = evaluate(cfg, log=pipes.log.info)
    agg = res.report["aggregates"]
    pipes.report_asset_materialization(
        asset_key=v.EV_REPORT,
        data_version=res.report_sha256,
        metadata={
            v.REPORT_SHA256: res.report_sha256,
            "passed": res.passed,
            "token_ev": agg["token"]["ev"],
            "trajectory_ev": agg["trajectory"]["ev"],
            "auroc": agg["auroc"],
        },
    )


def _handoff(pipes, cfg: HandoffJob) -> None:
    """Export the promoted checkpoint's bundles; `promoted_critic` verifies them from the files."""
    from value_assets.core.contract import load_contract
    from value_assets.core.handoff import HF_BUNDLE, MILES_BUNDLE
    from value_assets.gpu.convert.export import export_checkpoint, export_miles

    load_contract(cfg.checkpoint, cfg.contract_sha256)  # the very contract promoted, before any export
    _, miles_sha = export_miles(cfg.checkpoint, cfg.out_dir / MILES_BUNDLE, cfg.model_identity, cfg.layer_spec)
    pipes.log.info(f"wrote {cfg.out_dir / MILES_BUNDLE} (Miles contract {miles_sha})")
    if cfg.scalar_hf:
        export_checkpoint(cfg.checkpoint, cfg.out_dir / HF_BUNDLE, "scalar", warn=pipes.log.warning)
        pipes.log.info(f"wrote {cfg.out_dir / HF_BUNDLE} (scalar Hugging Face critic)")
    pipes.report_asset_materialization(
        asset_key=v.PROMOTED_CRITIC, data_version=miles_sha, metadata={v.MILES_CONTRACT_SHA256: miles_sha}
    )


def main() -> int:
    with open_dagster_pipes() as pipes:
        extras = pipes.extras
        try:
            cfg = v.task_named(extras.get("task")).config_from_json(extras.get("config"))
            if isinstance(cfg, EvaluateJob):
                _evaluate(pipes, cfg)
            elif isinstance(cfg, HandoffJob):
                _handoff(pipes, cfg)
            else:
                _train(pipes, cfg)
        except InputError as exc:
            pipes.log.error(f"invalid input: {exc}")
            print(f"value-assets: error: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
