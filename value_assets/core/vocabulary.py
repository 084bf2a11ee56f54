"""The names both sides of the Pipes boundary use: the asset graph's assets and checks, the GPU
job's tasks, and the metadata keys that carry a lineage's shas.

The Dagster code location (`value_assets/assets`, `checks.py`, `lineage.py`, the launchers) and the
GPU job (`gpu/pipes_job.py`) import these; neither spells them itself. `tests/test_vocabulary.py`
checks that every asset a task reports exists in the graph and that no other module of the
package writes an asset name as a string.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from value_assets.core.errors import InputError, show
from value_assets.core.job_configs import EvaluateJob, HandoffJob, TrainJob

# ---- assets (their keys in the graph) and checks

VALUE_MANIFEST: Final = "value_manifest"
TRAIN_DATASET: Final = "train_dataset"
HELDOUT_DATASET: Final = "heldout_dataset"
BATCH_PLAN: Final = "batch_plan"
CRITIC_CHECKPOINT: Final = "critic_checkpoint"
TRAINING_CONTRACT: Final = "training_contract"
CANARY_RECEIPT: Final = "canary_receipt"
EV_REPORT: Final = "ev_report"
PROMOTED_CRITIC: Final = "promoted_critic"
ASSETS: Final = (
    VALUE_MANIFEST,
    TRAIN_DATASET,
    HELDOUT_DATASET,
    BATCH_PLAN,
    CRITIC_CHECKPOINT,
    TRAINING_CONTRACT,
    CANARY_RECEIPT,
    EV_REPORT,
    PROMOTED_CRITIC,
)

DATASET_INTEGRITY: Final = "dataset_integrity"
CONTRACT_INTEGRITY: Final = "contract_integrity"
EV_GATE: Final = "ev_gate"

# ---- metadata keys that carry what a lineage recorded (read back by `value_assets/lineage.py`)

MANIFEST_SHA256: Final = "manifest_sha256"
PLAN_SHA256: Final = "plan_sha256"
PLAN_PATH: Final = "plan_path"
CONTRACT_SHA256: Final = "contract_sha256"
REPORT_SHA256: Final = "report_sha256"
REPORT_PATH: Final = "report_path"
REUSED: Final = "reused"
RECEIPT_SHA256: Final = "receipt_sha256"
MILES_CONTRACT_SHA256: Final = "miles_contract_sha256"
REGISTRY_RECORD_SHA256: Final = "registry_record_sha256"
FAMILY: Final = "family"
TRAINING_SPEC_SHA256: Final = "training_spec_sha256"

# ---- the GPU job's tasks

JobConfig = TrainJob | EvaluateJob | HandoffJob


@dataclass(frozen=True)
class Task:
    """One thing the GPU job does: the config it takes (as JSON in the Pipes extras) and the assets
    it reports a materialization for."""

    name: str
    config: type[TrainJob] | type[EvaluateJob] | type[HandoffJob]
    reports: tuple[str, ...]
    canary: bool | None = None
    """For the training tasks: the value the config's `canary` flag must have."""

    def check(self, config: Any) -> None:
        """Refuse a config of the wrong type, or a training config whose canary flag is the other task's."""
        if not isinstance(config, self.config):
            raise InputError(
                "config", f"task {self.name!r} takes a {self.config.__name__}, got {type(config).__name__}"
            )
        if self.canary is not None and isinstance(config, TrainJob) and config.canary != self.canary:
            raise InputError("canary", f"is {str(config.canary).lower()} in the config of a {self.name!r} task")

    def config_from_json(self, obj: Any) -> JobConfig:
        """The task's config from the extras' ``config`` object; an InputError names the bad key."""
        config = self.config.from_json(obj)
        self.check(config)
        return config


TRAIN = Task("train", TrainJob, (CRITIC_CHECKPOINT, TRAINING_CONTRACT), canary=False)
CANARY = Task("canary", TrainJob, (CANARY_RECEIPT,), canary=True)
EVALUATE = Task("evaluate", EvaluateJob, (EV_REPORT,))
HANDOFF = Task("handoff", HandoffJob, (PROMOTED_CRITIC,))
TASKS: Final = {task.name: task for task in (TRAIN, CANARY, EVALUATE, HANDOFF)}


def task_named(name: Any) -> Task:
    """The task called `name`; an InputError for any other value."""
    if not isinstance(name, str) or name not in TASKS:
        raise InputError("task", f"must be one of {', '.join(TASKS)}, got {show(name)}")
    return TASKS[name]
