"""Training contracts (SPEC 6) and the resume rules (SPEC 5) as pure functions.

A contract binds a saved checkpoint to the manifest, the train data, the objective and the batch
plan it was trained with. It is canonical JSON; its sha is the sha of those bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from .errors import InputError, show
from .hashing import require_sha, sha256_bytes
from .plan import BatchPlan
from .publish import atomic_write
from .strict_json import canonical_bytes, is_int, loads

SCHEMA = "value-assets.training-contract.v1"
CONTRACT_NAME = "value_pretrain_contract.json"
LATEST_NAME = "latest"
RECEIPT_SCHEMA = "value-assets.canary-receipt.v1"
REQUIRED = ("schema", "source_manifest_sha256", "train_dataset_sha256", "objective", "batch_plan",
            "batch_plan_sha256", "completed_steps", "model", "backbone_config", "checkpoint")


def iter_dirname(step: int) -> str:
    return f"iter_{step:07d}"


def build_contract(*, manifest_sha256: str, train_sha256: str, objective: Mapping[str, Any], plan: BatchPlan,
                   completed_steps: int, model: Mapping[str, Any], backbone_config: Mapping[str, Any],
                   checkpoint: str, execution: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`execution`: optional execution facts (parallel layout, memory features, micro-batch
    budget): how the steps were run, none of which changes the result; stored as given."""
    contract = {
        "schema": SCHEMA,
        "source_manifest_sha256": manifest_sha256,
        "train_dataset_sha256": train_sha256,
        "objective": dict(objective),
        "batch_plan": plan.spec(),
        "batch_plan_sha256": plan.sha256,
        "plan_steps": plan.num_steps,
        "completed_steps": completed_steps,
        "model": dict(model),
        "backbone_config": dict(backbone_config),
        "checkpoint": checkpoint,
    }
    if execution is not None:
        contract["execution"] = dict(execution)
    return contract


def write_contract(critic_dir: str | Path, contract: Mapping[str, Any]) -> str:
    """Write the contract beside its step's checkpoint, then point `latest` at it; return its sha.

    Call only after the checkpoint itself is fully saved: the contract is what publishes it.
    """
    root = Path(critic_dir)
    step_dir = root / iter_dirname(int(contract["completed_steps"]))
    if not step_dir.is_dir():
        raise InputError(str(step_dir), "no checkpoint folder to bind a contract to")
    data = canonical_bytes(dict(contract))
    sha = atomic_write(step_dir / CONTRACT_NAME, data)
    atomic_write(root / LATEST_NAME, canonical_bytes({"iteration": step_dir.name, "contract_sha256": sha}))
    return sha


def load_contract(path: str | Path, pinned_sha256: str | None = None) -> tuple[dict[str, Any], str]:
    """Load a contract file (or a step folder holding one); verify a pinned sha before parsing."""
    p = Path(path)
    if p.is_dir():
        p = p / CONTRACT_NAME
    if pinned_sha256 is not None:
        require_sha(pinned_sha256, "pinned contract sha256")
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise InputError(str(p), "contract file does not exist") from None
    sha = sha256_bytes(data)
    if pinned_sha256 is not None and sha != pinned_sha256:
        raise InputError(str(p), f"contract sha256 is {sha}, but {pinned_sha256} was pinned")
    obj = loads(data, str(p))
    if not isinstance(obj, dict) or obj.get("schema") != SCHEMA:
        raise InputError(str(p), f"not a {SCHEMA} document")
    missing = [k for k in REQUIRED if k not in obj]
    if missing:
        raise InputError(str(p), f"contract lacks field(s) {missing}")
    if data != canonical_bytes(obj):
        raise InputError(str(p), "contract bytes are not canonical JSON")
    return obj, sha


def read_latest(critic_dir: str | Path) -> tuple[Path, str] | None:
    """(step folder, contract sha) that `latest` names, or None when nothing was published yet."""
    root = Path(critic_dir)
    p = root / LATEST_NAME
    if not p.exists():
        return None
    obj = loads(p.read_bytes(), str(p))
    if not isinstance(obj, dict) or not isinstance(obj.get("iteration"), str):
        raise InputError(str(p), f"malformed latest pointer {show(obj)}")
    return root / obj["iteration"], require_sha(obj.get("contract_sha256"), f"{p}: contract_sha256")


def check_resume(contract: Mapping[str, Any], *, where: str, manifest_sha256: str, train_sha256: str,
                 objective: Mapping[str, Any], plan: BatchPlan, loaded_iterations: Sequence[int]) -> int:
    """Return the number of completed steps to skip, or refuse (InputError) with one message per rule."""
    if contract["source_manifest_sha256"] != manifest_sha256:
        raise InputError(where, f"refusing to resume: the checkpoint was trained from manifest {contract['source_manifest_sha256']}, this run's manifest is {manifest_sha256}")
    if contract["train_dataset_sha256"] != train_sha256:
        raise InputError(where, f"refusing to resume: the checkpoint was trained on train dataset {contract['train_dataset_sha256']}, this run's is {train_sha256}")
    if dict(contract["objective"]) != dict(objective):
        raise InputError(where, f"refusing to resume: objective differs: checkpoint {dict(contract['objective'])}, this run {dict(objective)}")
    if dict(contract["batch_plan"]) != plan.spec():
        raise InputError(where, f"refusing to resume: batch plan differs: checkpoint {dict(contract['batch_plan'])}, this run {plan.spec()}")
    its = sorted(set(int(i) for i in loaded_iterations))
    if len(its) != 1:
        raise InputError(where, f"refusing to resume: ranks loaded different iterations {list(loaded_iterations)}")
    steps = contract["completed_steps"]
    if not is_int(steps) or steps < 0:
        raise InputError(where, f"contract completed_steps must be an integer >= 0, got {show(steps)}")
    if its[0] != steps:
        raise InputError(where, f"refusing to resume: the loaded checkpoint is at iteration {its[0]}, but its contract says {steps} completed steps")
    if steps > plan.num_steps:
        raise InputError(where, f"refusing to resume: the contract has {steps} completed steps, beyond the plan's {plan.num_steps} (extend --epochs to train further)")
    return steps


def refuse_uncontracted(iteration: int, where: str) -> None:
    """A checkpoint at a non-zero iteration without a contract is ambiguous: refuse it."""
    if iteration != 0:
        raise InputError(where, f"refusing to resume: a checkpoint at iteration {iteration} has no contract; cannot tell what it was trained on")


def build_receipt(*, manifest_sha256: str, train_sha256: str, plan: BatchPlan, first_batch_sample_ids: Sequence[str]) -> dict[str, Any]:
    """The canary's non-promotable receipt."""
    return {
        "schema": RECEIPT_SCHEMA,
        "promotable": False,
        "source_manifest_sha256": manifest_sha256,
        "train_dataset_sha256": train_sha256,
        "batch_plan_sha256": plan.sha256,
        "first_batch_sample_ids_sha256": sha256_bytes(canonical_bytes(list(first_batch_sample_ids))),
        "executed_steps": 1,
    }
