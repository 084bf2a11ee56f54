"""Finding a partition's contracted save: the contract `<critic>/latest` names, and how a contract
disagrees with its partition's manifest, datasets, objective and plan.

Reads `core/contract.py`'s files only; writing and building contracts stay there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from value_assets.core.errors import InputError

if TYPE_CHECKING:
    from value_assets.core.manifest import Manifest


@dataclass(frozen=True, kw_only=True)
class ContractRef:
    path: Path
    sha256: str
    contract: dict[str, Any]

    @property
    def checkpoint_dir(self) -> Path:
        """The save folder the contract sits in (docs/rules.md#contract: one contract next to each save)."""
        return self.path.parent


def resolve_latest_contract(critic_dir: Path, pinned_sha256: str | None = None) -> ContractRef:
    """The contract ``<critic>/latest`` names, loaded with the pointer's sha pinned.

    `pinned_sha256`, when given (e.g. the sha a materialization recorded), must agree too: the
    newest save is promoted or evaluated only if it is the one the lineage recorded.
    """
    from value_assets.core.contract import CONTRACT_NAME, load_contract, read_latest

    latest = read_latest(critic_dir)
    if latest is None:
        raise InputError(str(Path(critic_dir) / "latest"), "no contracted save: the latest pointer does not exist")
    step_dir, pointer_sha = latest
    if pinned_sha256 is not None and pinned_sha256 != pointer_sha:
        raise InputError(
            str(Path(critic_dir) / "latest"), f"names contract {pointer_sha}, but the lineage recorded {pinned_sha256}"
        )
    contract, sha = load_contract(step_dir / CONTRACT_NAME, pinned_sha256=pointer_sha)
    return ContractRef(path=step_dir / CONTRACT_NAME, sha256=sha, contract=contract)


def contract_disagreements(contract: dict[str, Any], *, manifest: Manifest, plan_sha256: str | None) -> list[str]:
    """Every way a contract disagrees with its partition's manifest, datasets, objective and plan."""
    problems = []
    if contract.get("source_manifest_sha256") != manifest.sha256:
        problems.append(
            f"source_manifest_sha256 {contract.get('source_manifest_sha256')!r} != manifest {manifest.sha256}"
        )
    if contract.get("train_dataset_sha256") != manifest.train.sha256:
        problems.append(
            f"train_dataset_sha256 {contract.get('train_dataset_sha256')!r} != manifest train {manifest.train.sha256}"
        )
    if contract.get("objective") != manifest.objective.canonical():
        problems.append(f"objective {contract.get('objective')!r} != manifest {manifest.objective.canonical()}")
    if plan_sha256 is not None and contract.get("batch_plan_sha256") != plan_sha256:
        problems.append(f"batch_plan_sha256 {contract.get('batch_plan_sha256')!r} != published plan {plan_sha256}")
    return problems
