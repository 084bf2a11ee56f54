"""The asset graph: data assets (CPU, in-process) and critic assets (GPU job through Pipes).

Assets are thin: they read inputs, call a plain function (`value_assets.core`) or the
launcher resource, and return `MaterializeResult`s whose data versions are the artifacts' shas.
"""

from value_assets.assets.critic import (
    EvaluateRunConfig,
    TrainRunConfig,
    canary_receipt,
    critic_training,
    ev_report,
    promoted_critic,
)
from value_assets.assets.data import PlanConfig, batch_plan, heldout_dataset, train_dataset, value_manifest

ALL_ASSETS = [
    value_manifest,
    train_dataset,
    heldout_dataset,
    batch_plan,
    critic_training,
    canary_receipt,
    ev_report,
    promoted_critic,
]

__all__ = [
    "ALL_ASSETS",
    "PlanConfig",
    "TrainRunConfig",
    "EvaluateRunConfig",
    "value_manifest",
    "train_dataset",
    "heldout_dataset",
    "batch_plan",
    "critic_training",
    "canary_receipt",
    "ev_report",
    "promoted_critic",
]
