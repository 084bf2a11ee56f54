"""The three jobs: full pipeline, evaluation only, and canary.

Run tags: `dagster/max_runtime` (seconds, enforced by run monitoring) bounds every run, and
`dagster/max_retries` = 0 because a failed gate is a verdict, not a transient error: retrying the
run could only repeat it. GPU steps share the `gpu` concurrency pool (set on the assets).
"""

from __future__ import annotations

from dagster import AssetSelection, define_asset_job

from value_assets.assets import (
    batch_plan,
    canary_receipt,
    critic_training,
    ev_report,
    heldout_dataset,
    promoted_critic,
    train_dataset,
    value_manifest,
)

DAY_S = 24 * 3600

# Selecting assets selects their checks too (dataset_integrity, contract_integrity, ev_gate).
full_job = define_asset_job(
    "full",
    selection=AssetSelection.assets(
        value_manifest, train_dataset, heldout_dataset, batch_plan, critic_training, ev_report, promoted_critic
    ),
    description="validate -> plan -> train -> evaluate -> gate -> promote, for one manifest.",
    tags={"dagster/max_runtime": str(7 * DAY_S), "dagster/max_retries": "0"},
)

evaluation_job = define_asset_job(
    "evaluate",
    selection=AssetSelection.assets(ev_report, promoted_critic),
    description="Re-evaluate the latest contracted critic of a manifest, gate it, promote it if it passes.",
    tags={"dagster/max_runtime": str(DAY_S), "dagster/max_retries": "0"},
)

canary_job = define_asset_job(
    "canary",
    selection=AssetSelection.assets(value_manifest, train_dataset, batch_plan, canary_receipt),
    description="Validate, plan and run exactly one training step; writes a receipt, never a contract.",
    tags={"dagster/max_runtime": str(3600), "dagster/max_retries": "0"},
)

ALL_JOBS = [full_job, evaluation_job, canary_job]
