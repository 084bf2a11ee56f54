"""Training contracts (docs/rules.md#contract) and the resume rules (docs/rules.md#training-run) as pure functions.

A contract binds a saved checkpoint to the manifest, the train data, the objective and the batch
plan it was trained with. It is canonical JSON; its sha is the sha of those bytes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from value_assets.core.checkpoint_files import (
    CONTRACT_NAME as CONTRACT_NAME,  # re-exported: callers name it with the contract API
)
from value_assets.core.checkpoint_files import verify_checkpoint
from value_assets.core.errors import InputError, show
from value_assets.core.hashing import read_pinned, require_sha, sha256_bytes
from value_assets.core.plan import BatchPlan
from value_assets.core.publish import atomic_write
from value_assets.core.strict_json import canonical_bytes, is_int, loads

SCHEMA = "value-assets.training-contract.v1"
LATEST_NAME = "latest"
RECEIPT_SCHEMA = "value-assets.canary-receipt.v1"
REQUIRED = (
    "schema",
    "source_manifest_sha256",
    "train_dataset_sha256",
    "objective",
    "batch_plan",
    "batch_plan_sha256",
    "completed_steps",
    "model",
    "backbone_config",
    "checkpoint",
    "checkpoint_files",
)


_ITER_RE = re.compile(r"iter_(\d{7})")


def iter_dirname(step: int) -> str:
    return f"iter_{step:07d}"


def existing_iterations(critic_dir: str | Path) -> list[int]:
    """The iterations of the `iter_*` folders in a critic folder, ascending."""
    root = Path(critic_dir)
    if not root.is_dir():
        return []
    return sorted(
        int(m.group(1))
        for p in root.iterdir()
        if (m := _ITER_RE.fullmatch(p.name)) and p.is_dir() and not p.is_symlink()
    )


def build_contract(
    *,
    manifest_sha256: str,
    train_sha256: str,
    objective: Mapping[str, Any],
    plan: BatchPlan,
    completed_steps: int,
    model: Mapping[str, Any],
    backbone_config: Mapping[str, Any],
    checkpoint: str,
    checkpoint_files: Sequence[Mapping[str, Any]],
    execution: Mapping[str, Any] | None = None,
    training_spec_sha256: str | None = None,
    warm_start: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """`checkpoint_files` is `checkpoint_files.describe_folder(step_dir)`, taken once the save is
    complete. `execution`: optional execution facts (parallel layout, memory features, micro-batch
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
        "checkpoint_files": [dict(f) for f in checkpoint_files],
    }
    if execution is not None:
        contract["execution"] = dict(execution)
    if training_spec_sha256 is not None:
        contract["training_spec_sha256"] = training_spec_sha256  # docs/rules.md#training-spec
    if warm_start is not None:
        contract["warm_start"] = dict(warm_start)  # the champion whose weights it started from
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
    point_latest(root, step_dir, sha)
    return sha


def point_latest(critic_dir: str | Path, step_dir: Path, sha: str) -> None:
    atomic_write(Path(critic_dir) / LATEST_NAME, canonical_bytes({"iteration": step_dir.name, "contract_sha256": sha}))


def load_contract(path: str | Path, pinned_sha256: str | None = None) -> tuple[dict[str, Any], str]:
    """Load a contract file (or a step folder holding one); verify a pinned sha before parsing."""
    p = Path(path)
    if p.is_dir():
        p = p / CONTRACT_NAME
    data, sha = read_pinned(p, pinned_sha256, "contract")
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


def resolve_step_dir(path: str | Path) -> tuple[Path, str | None]:
    """A contracted `iter_*` folder as is; a critic folder -> the step folder its `latest` names,
    with the contract sha that `latest` pins (None for a step folder given directly)."""
    p = Path(path)
    if (p / CONTRACT_NAME).is_file():
        return p, None
    latest = read_latest(p) if p.is_dir() else None
    if latest is None:
        found = existing_iterations(p)
        hint = f" (it holds {', '.join(iter_dirname(i) for i in found)}: name one of them)" if found else ""
        raise InputError(
            str(p),
            f"is neither a contracted checkpoint folder nor a critic folder with a '{LATEST_NAME}' pointer{hint}",
        )
    return latest


def load_verified(step_dir: str | Path, pinned_sha256: str | None = None) -> tuple[dict[str, Any], str]:
    """Load a step folder's contract (pin checked before parsing) and verify every checkpoint file
    against it, before anything in the folder is deserialized. Refuses on any difference."""
    contract, sha = load_contract(step_dir, pinned_sha256=pinned_sha256)
    verify_checkpoint(step_dir, contract)
    return contract, sha


def find_resume_point(
    critic_dir: str | Path, log: Callable[[str], None] = lambda _m: None
) -> tuple[Path, dict[str, Any], str] | None:
    """The save a run resumes from: the newest contracted `iter_*` folder, verified against its
    contract (step folder, contract, contract sha); None when nothing was ever contracted.

    `latest` is written after the contract, so a crash between the two leaves `latest` one save
    behind (or absent): the newest contracted save still wins, when its files verify. A newer
    contracted save that does not verify is refused rather than skipped (resuming from an older one
    would train up to it and then refuse to overwrite it). Uncontracted folders are interrupted saves,
    overwritten when the run reaches their step; without any contracted save they are ambiguous.
    """
    root = Path(critic_dir)
    latest = read_latest(root) if root.is_dir() else None
    its = existing_iterations(root)
    contracted = [i for i in its if (root / iter_dirname(i) / CONTRACT_NAME).is_file()]
    if not contracted:
        if latest is not None:
            raise InputError(
                str(root / LATEST_NAME),
                f"refusing to resume: '{LATEST_NAME}' names {latest[0].name}, which holds no contract",
            )
        if its:
            refuse_uncontracted(its[-1], str(root / iter_dirname(its[-1])))
        return None
    step_dir = root / iter_dirname(contracted[-1])
    pinned = None
    if latest is not None:
        named = _ITER_RE.fullmatch(latest[0].name)
        if latest[0].parent != root or named is None:
            raise InputError(str(root / LATEST_NAME), f"malformed latest pointer: names {latest[0].name!r}")
        if int(named.group(1)) > contracted[-1]:
            raise InputError(
                str(root / LATEST_NAME),
                f"refusing to resume: '{LATEST_NAME}' names {latest[0].name}, which holds no contract",
            )
        if latest[0] == step_dir:
            pinned = latest[1]
    # (Its completed_steps are checked against the iteration the workers load, by check_resume.)
    contract, sha = load_verified(step_dir, pinned_sha256=pinned)
    if latest is None:
        log(
            f"'{LATEST_NAME}' is missing; {step_dir.name} holds the newest contract and its files verify: resuming "
            "from it"
        )
    elif pinned is None:
        log(
            f"'{LATEST_NAME}' names {latest[0].name}, but {step_dir.name} holds a newer contract and its files verify "
            f"(a crash between contract and pointer): resuming from {step_dir.name}"
        )
    return step_dir, contract, sha


# The line a training run logs after each save's contract (its event log keeps it in Dagster):
# the record, outside the artifacts folder, of which saves this lineage wrote.
_SAVED_LINE = re.compile(r"saved (?P<step_dir>.+) with contract (?P<sha>[0-9a-f]{64})")


def saved_line(step_dir: Path, sha256: str) -> str:
    return f"saved {step_dir} with contract {sha256}"


def saved_contracts(lines: Iterable[str], critic_dir: str | Path) -> set[str]:
    """The contract shas of the saves into `critic_dir` that these log lines (a lineage's runs'
    event logs) record; lines about other folders, and any other text, count for nothing."""
    root = Path(critic_dir)
    found = set()
    for line in lines:
        m = _SAVED_LINE.fullmatch(line or "")
        if m and Path(m["step_dir"]).parent == root:
            found.add(m["sha"])
    return found


def check_resume_recorded(sha256: str, recorded: Sequence[str] | None, *, where: str) -> None:
    """A resume point must be one of the saves the lineage recorded (`recorded`; None: a run by hand,
    any save whose files verify). Whoever can write the critic folder can plant a complete,
    self-consistent save; only a record kept elsewhere tells it from the lineage's own."""
    if recorded is not None and sha256 not in recorded:
        raise InputError(
            where,
            f"refusing to resume: its contract {sha256} is not one of the {len(recorded)} saves this "
            "lineage's runs recorded (a save planted in the folder, or written by another run): remove it "
            "to resume from an earlier save, or train into an empty folder",
        )


def check_resume(
    contract: Mapping[str, Any],
    *,
    where: str,
    manifest_sha256: str,
    train_sha256: str,
    objective: Mapping[str, Any],
    plan: BatchPlan,
    model: Mapping[str, Any],
    loaded_iterations: Sequence[int],
) -> int:
    """Return the number of completed steps to skip, or refuse (InputError) with one message per rule."""
    if contract["source_manifest_sha256"] != manifest_sha256:
        raise InputError(
            where,
            f"refusing to resume: the checkpoint was trained from manifest {contract['source_manifest_sha256']}, this "
            f"run's manifest is {manifest_sha256}",
        )
    if contract["train_dataset_sha256"] != train_sha256:
        raise InputError(
            where,
            f"refusing to resume: the checkpoint was trained on train dataset {contract['train_dataset_sha256']}, "
            f"this run's is {train_sha256}",
        )
    if dict(contract["objective"]) != dict(objective):
        raise InputError(
            where,
            f"refusing to resume: objective differs: checkpoint {dict(contract['objective'])}, this run "
            f"{dict(objective)}",
        )
    if dict(contract["batch_plan"]) != plan.spec():
        raise InputError(
            where,
            f"refusing to resume: batch plan differs: checkpoint {dict(contract['batch_plan'])}, this run "
            f"{plan.spec()}",
        )
    if _identity(contract["model"]) != _identity(model):
        raise InputError(
            where,
            f"refusing to resume: the checkpoint descends from bootstrap model {dict(contract['model'])}, this run's "
            f"--backbone is {dict(model)}",
        )
    its = sorted(set(int(i) for i in loaded_iterations))
    if len(its) != 1:
        raise InputError(where, f"refusing to resume: ranks loaded different iterations {list(loaded_iterations)}")
    steps = contract["completed_steps"]
    if not is_int(steps) or steps < 0:
        raise InputError(where, f"contract completed_steps must be an integer >= 0, got {show(steps)}")
    if its[0] != steps:
        raise InputError(
            where,
            f"refusing to resume: the loaded checkpoint is at iteration {its[0]}, but its contract says {steps} "
            "completed steps",
        )
    if steps > plan.num_steps:
        raise InputError(
            where,
            f"refusing to resume: the contract has {steps} completed steps, beyond the plan's {plan.num_steps} (extend "
            "--epochs to train further)",
        )
    return steps


def _identity(model: Mapping[str, Any]) -> dict[str, Any]:
    # A content digest identifies a backbone wherever its folder lives; the path alone does not.
    # The actor's tokenizer (recorded for the hand-off's exports) is no part of the weights.
    m = dict(model)
    if "sha256" in m:
        m.pop("path", None)
    m.pop("tokenizer_sha256", None)
    return m


def refuse_uncontracted(iteration: int, where: str) -> None:
    """A checkpoint at a non-zero iteration without a contract is ambiguous: refuse it."""
    if iteration != 0:
        raise InputError(
            where,
            f"refusing to resume: a checkpoint at iteration {iteration} has no contract; cannot tell what it was "
            "trained on",
        )


def build_receipt(
    *, manifest_sha256: str, train_sha256: str, plan: BatchPlan, first_batch_sample_ids: Sequence[str]
) -> dict[str, Any]:
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
