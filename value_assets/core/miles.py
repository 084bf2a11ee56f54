"""The Miles hand-off contract (docs/rules.md#hand-off): build it from ours, read it back by Miles' own rules.

Pure JSON, no torch: the export job writes it, promotion can re-read it.

Miles' RL trainer takes a pretrained critic with `--critic-load DIR` and pins
`--critic-value-pretrain-contract-sha256` (agentenv/miles `miles/utils/arguments.py`); it reads
`DIR/value_pretrain_contract.json` with `load_value_pretrain_contract` (`miles/value_pretraining.py`),
which checks: schema `miles.value-pretrain-checkpoint.v1`, the two shas lowercase 64-hex, the
objective by its manifest rules, `batch_plan.seed` an int (not bool), `global_batch_size` a
positive int, `drop_incomplete_batch` exactly true, `completed_steps` a positive int,
`model_identity` a non-empty string. Its writer emits exactly the keys of `MILES_KEYS` as canonical
JSON (sorted keys, `,`/`:` separators, UTF-8, no ASCII escaping, trailing newline), the same bytes
as our `strict_json.canonical_bytes`. `read_miles_contract` applies those rules plus two of ours
(exactly these keys, canonical bytes), so whatever passes it passes Miles'.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from value_assets.core.errors import InputError, show
from value_assets.core.hashing import is_sha, read_pinned
from value_assets.core.objective import Objective
from value_assets.core.strict_json import canonical_bytes, is_int, loads

MILES_CONTRACT_SCHEMA = "miles.value-pretrain-checkpoint.v1"
MILES_CONTRACT_NAME = "value_pretrain_contract.json"
MILES_TRACKER_NAME = "latest_checkpointed_iteration.txt"
MILES_KEYS = (
    "batch_plan",
    "completed_steps",
    "model_identity",
    "objective",
    "schema",
    "source_manifest_sha256",
    "train_dataset_sha256",
)
_PLAN_KEYS = ("drop_incomplete_batch", "global_batch_size", "seed")


def miles_iter_dirname(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def build_miles_contract(contract: Mapping[str, Any], model_identity: str) -> dict[str, Any]:
    """The docs/rules.md#hand-off contract for a checkpoint that our `value-assets.training-contract.v1`
    `contract` describes. `model_identity`: the non-empty string the RL run knows the critic by."""
    if not isinstance(model_identity, str) or not model_identity:
        raise InputError("--model-identity", f"must be a non-empty string, got {show(model_identity)}")
    steps = contract.get("completed_steps")
    if not is_int(steps) or steps < 1:
        raise InputError("contract.completed_steps", f"a Miles contract needs an integer >= 1, got {show(steps)}")
    plan = contract.get("batch_plan") or {}
    out = {
        "schema": MILES_CONTRACT_SCHEMA,
        "source_manifest_sha256": contract["source_manifest_sha256"],
        "train_dataset_sha256": contract["train_dataset_sha256"],
        "objective": Objective.from_json(contract["objective"]).canonical(),
        "batch_plan": {
            "seed": plan.get("seed"),
            "global_batch_size": plan.get("global_batch_size"),
            "drop_incomplete_batch": True,
        },
        "completed_steps": steps,
        "model_identity": model_identity,
    }
    check_miles_contract(out, "miles contract")
    return out


def check_miles_contract(obj: Any, where: str) -> None:
    """Miles' `load_value_pretrain_contract` rules, plus: exactly the docs/rules.md#hand-off keys."""
    if not isinstance(obj, dict):
        raise InputError(where, f"must be a JSON object, got {show(obj)}")
    if sorted(obj) != sorted(MILES_KEYS):
        raise InputError(
            where,
            f"keys must be exactly {sorted(MILES_KEYS)}; missing {sorted(set(MILES_KEYS) - set(obj))}, "
            f"unexpected {sorted(set(obj) - set(MILES_KEYS))}",
        )
    if obj["schema"] != MILES_CONTRACT_SCHEMA:
        raise InputError(f"{where}: schema", f"must be {MILES_CONTRACT_SCHEMA!r}, got {show(obj['schema'])}")
    for key in ("source_manifest_sha256", "train_dataset_sha256"):
        if not is_sha(obj[key]):
            raise InputError(f"{where}: {key}", f"must be a lowercase SHA-256 hex digest, got {show(obj[key])}")
    objective = Objective.from_json(obj["objective"], f"{where}: objective")
    if canonical_bytes(obj["objective"]) != canonical_bytes(objective.canonical()):  # floats stay floats
        raise InputError(
            f"{where}: objective", f"must be the canonical objective {objective.canonical()}, got {obj['objective']}"
        )
    plan = obj["batch_plan"]
    if not isinstance(plan, dict) or sorted(plan) != sorted(_PLAN_KEYS):
        raise InputError(f"{where}: batch_plan", f"must have exactly the keys {sorted(_PLAN_KEYS)}, got {show(plan)}")
    if not is_int(plan["seed"]):
        raise InputError(f"{where}: batch_plan.seed", f"must be an integer, got {show(plan['seed'])}")
    if not is_int(plan["global_batch_size"]) or plan["global_batch_size"] < 1:
        raise InputError(
            f"{where}: batch_plan.global_batch_size",
            f"must be a positive integer, got {show(plan['global_batch_size'])}",
        )
    if plan["drop_incomplete_batch"] is not True:
        raise InputError(
            f"{where}: batch_plan.drop_incomplete_batch", f"must be true, got {show(plan['drop_incomplete_batch'])}"
        )
    if not is_int(obj["completed_steps"]) or obj["completed_steps"] < 1:
        raise InputError(f"{where}: completed_steps", f"must be a positive integer, got {show(obj['completed_steps'])}")
    if not isinstance(obj["model_identity"], str) or not obj["model_identity"]:
        raise InputError(f"{where}: model_identity", f"must be a non-empty string, got {show(obj['model_identity'])}")


def miles_contract_bytes(obj: Mapping[str, Any]) -> bytes:
    check_miles_contract(dict(obj), "miles contract")
    return canonical_bytes(dict(obj))


def read_miles_contract(folder: str | Path, pinned_sha256: str | None = None) -> tuple[dict[str, Any], str]:
    """(contract, sha) of `folder/value_pretrain_contract.json`, the way the RL side reads it: the
    pinned sha is checked before parsing; then Miles' rules, exactly the docs/rules.md#hand-off keys, canonical
    bytes, and `completed_steps` equal to the iteration in `latest_checkpointed_iteration.txt`."""
    root = Path(folder)
    p = root / MILES_CONTRACT_NAME
    data, sha = read_pinned(p, pinned_sha256, "Miles contract")
    obj = loads(data, str(p))
    check_miles_contract(obj, str(p))
    if data != canonical_bytes(obj):
        raise InputError(str(p), "contract bytes are not canonical JSON")
    tracker = root / MILES_TRACKER_NAME
    if tracker.is_file():
        text = tracker.read_text().strip()
        if text != str(obj["completed_steps"]):
            raise InputError(
                str(tracker),
                f"names iteration {text!r}, but the contract says {obj['completed_steps']} completed steps",
            )
    return obj, sha
