"""The hand-off to RL (docs/rules.md#hand-off): what a promoted critic's bundles are, and what the RL side sets.

Torch-free: promotion (the Dagster process) and `value-assets handoff` use it; the bundles
themselves are written by the GPU job's `handoff` task (`gpu/convert/export.py`).

A bundle is a folder (`handoff/miles/`: `--critic-load DIR`; `handoff/hf/`: the scalar Hugging
Face critic of an mse objective, verl's `critic.model.path`). The registry record names each
bundle's folder and its files (relative path, size, sha256, sorted by path) with `files_sha256`,
the sha of the canonical JSON of that list, so a reader can verify every byte the RL job will load.

Model identity (the Miles contract's `model_identity`): ``value-assets:<backbone>@<contract sha>``,
where `<backbone>` is the contract's `model.backbone` (the bootstrap: 'tiny' or the actor's folder)
and the contract sha is our training contract's, which itself binds the manifest, the data, the
objective, the plan, the steps and the bootstrap. Deterministic: re-promoting the same contract
gives the same Miles contract bytes, hence the same sha to pin.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from value_assets.core.backbone import TOKENIZER_FILES
from value_assets.core.errors import InputError, show
from value_assets.core.hashing import is_sha, read_pinned, sha256_bytes, sha256_file
from value_assets.core.miles import MILES_CONTRACT_NAME, read_miles_contract
from value_assets.core.objective import Objective
from value_assets.core.strict_json import canonical_bytes, loads

MILES_BUNDLE = "miles"
HF_BUNDLE = "hf"


def model_identity(contract: Mapping[str, Any], contract_sha256: str) -> str:
    """The Miles `model_identity` of the critic that `contract` (with sha `contract_sha256`) binds."""
    model = contract.get("model") or {}
    # The training job records {"kind": "tiny-random" | "huggingface" | ..., ...}; older records
    # and the test stand-in name the backbone directly.
    backbone = model.get("backbone") or model.get("kind") or "unknown"
    return f"value-assets:{backbone}@{contract_sha256}"


def check_bundle_location(folder: str | Path, *, itself: bool = True) -> Path:
    """A bundle folder (`<partition>/handoff/<name>`), its `handoff/` folder and its partition
    folder must be folders of the artifacts store itself, never symlinks: a symlink at any of them
    sends `--critic-load` to a folder the store's permissions do not cover, however identical its
    files (issue 33, defect 5). Symlinks inside a bundle are refused by `describe_files`. Not
    `itself`: only the folders above it (a bundle about to be replaced may be a link: it is moved
    aside, never followed). The artifacts root itself may be a symlink."""
    root = Path(folder)
    for level in ((root,) if itself else ()) + (root.parent, root.parent.parent):
        if level.is_symlink():
            raise InputError(
                str(level),
                "is a symlink: a hand-off bundle is read from the artifacts store itself, never through a link to "
                "another folder",
            )
    return root


def describe_files(folder: str | Path) -> list[dict[str, Any]]:
    """Every regular file under `folder`: [{path (relative, '/'), size, sha256}], sorted by path.
    A symlink anywhere in the bundle, or at its root and the folders above it that the store owns
    (`check_bundle_location`), is refused: the hashes must be of the bytes in the folder."""
    root = check_bundle_location(folder)
    if not root.is_dir():
        raise InputError(str(root), "bundle folder does not exist")
    out = []
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            raise InputError(str(p), "a bundle holds no symlinks")
        if p.is_file():
            out.append({"path": p.relative_to(root).as_posix(), "size": p.stat().st_size, "sha256": sha256_file(p)})
    return sorted(out, key=lambda f: f["path"])


def describe_bundle(folder: str | Path) -> dict[str, Any]:
    """{dir, files, files_sha256} of a bundle folder (see the module docstring)."""
    files = describe_files(folder)
    return {"dir": str(Path(folder)), "files": files, "files_sha256": sha256_bytes(canonical_bytes(files))}


def miles_bundle_record(folder: str | Path, expected_contract: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The Miles bundle's record: `describe_bundle` plus the Miles contract sha the RL job pins.
    The contract is read by Miles' rules (`core.miles.read_miles_contract`); when
    `expected_contract` is given its bytes must be exactly those."""
    contract, sha = read_miles_contract(folder)
    if expected_contract is not None and canonical_bytes(dict(expected_contract)) != canonical_bytes(contract):
        raise InputError(
            str(Path(folder) / MILES_CONTRACT_NAME),
            f"is not the Miles contract of the critic being promoted: {contract} != {dict(expected_contract)}",
        )
    return {**describe_bundle(folder), "contract_sha256": sha}


def verify_bundle(bundle: Mapping[str, Any], where: str) -> None:
    """Refuse (InputError naming every difference) unless the folder's files are exactly those
    recorded, byte for byte."""
    recorded = bundle.get("files")
    if not isinstance(recorded, list) or not is_sha(bundle.get("files_sha256")):
        raise InputError(where, f"malformed bundle record {show(dict(bundle))}")
    if sha256_bytes(canonical_bytes(recorded)) != bundle["files_sha256"]:
        raise InputError(where, "the recorded file list does not hash to its files_sha256")
    actual = {f["path"]: f for f in describe_files(bundle["dir"])}
    wanted = {f["path"]: f for f in recorded}
    diffs = [f"missing {p}" for p in sorted(set(wanted) - set(actual))]
    diffs += [f"unexpected {p}" for p in sorted(set(actual) - set(wanted))]
    for p in sorted(set(wanted) & set(actual)):
        if (wanted[p]["size"], wanted[p]["sha256"]) != (actual[p]["size"], actual[p]["sha256"]):
            diffs.append(
                f"changed {p} (recorded size {wanted[p]['size']} sha256 {wanted[p]['sha256']}, "
                f"now size {actual[p]['size']} sha256 {actual[p]['sha256']})"
            )
    if diffs:
        raise InputError(f"{where}: {bundle['dir']}", "does not match the registry record: " + "; ".join(diffs))


def read_registry_record(path: str | Path, pinned_sha256: str) -> tuple[dict[str, Any], str]:
    """(record, sha) of a registry record whose sha256 was pinned, checked before it is parsed.

    The record names the bundles' files and their shas, so whoever can write the artifacts folder
    could rewrite a record and its bundles to match each other: only a record pinned from outside
    that folder (the sha `promoted_critic` recorded in the Dagster instance, shown in its metadata
    as `registry_record_sha256`) vouches for the bundles it names (docs/rules.md#hand-off)."""
    data, sha = read_pinned(Path(path), pinned_sha256, "registry record")
    record = loads(data, str(path))
    if not isinstance(record, dict):
        raise InputError(str(path), "is not a registry record (a JSON object)")
    return record, sha


def verify_handoff(record: Mapping[str, Any], where: str) -> None:
    """Every bundle of a registry record against its recorded files, and the Miles contract
    against its recorded sha (read by Miles' rules)."""
    handoff = record.get("handoff")
    if not isinstance(handoff, dict) or not isinstance(handoff.get(MILES_BUNDLE), dict):
        raise InputError(
            where, "the registry record has no hand-off bundles (promoted before hand-off existed: promote again)"
        )
    for name in (MILES_BUNDLE, HF_BUNDLE):
        if handoff.get(name) is not None:
            verify_bundle(handoff[name], f"{where}: handoff.{name}")
    miles = handoff[MILES_BUNDLE]
    read_miles_contract(miles["dir"], pinned_sha256=miles.get("contract_sha256"))


def objective_flags(objective: Mapping[str, Any]) -> list[str]:
    """Miles' RL-trainer flags for the critic's objective (miles/utils/arguments.py)."""
    obj = Objective.from_json(dict(objective))
    if obj.loss_type == "mse":
        return ["--value-loss-type", "mse"]
    low, high = obj.reward_range
    flags = [
        "--value-loss-type",
        "classification",
        "--value-num-bins",
        str(obj.num_bins),
        "--value-reward-range",
        repr(float(low)),
        repr(float(high)),
        "--value-target-type",
        obj.target_type,
    ]
    if obj.target_type == "hl_gauss":
        flags += ["--hl-gauss-sigma-ratio", repr(float(obj.hl_gauss_sigma_ratio))]
    return flags


# What `handoff` prints for verl's `critic.model.tokenizer_path` when the critic folder has no
# tokenizer files: a value the user must replace (verl would otherwise build an empty tokenizer).
ACTOR_TOKENIZER_PLACEHOLDER = "ACTOR_TOKENIZER_DIR"


def rl_settings(
    *,
    miles_dir: str,
    miles_contract_sha256: str,
    objective: Mapping[str, Any],
    hf_dir: str | None,
    hf_has_tokenizer: bool = True,
) -> dict[str, Any]:
    """The RL side's settings for a promoted critic: Miles' flags (the exported checkpoint has no
    optimizer state, so Megatron-LM loads it with `--no-load-optim`; not `--finetune`, which would
    reset the iteration) and, for an mse critic, verl's critic `model.path` (it loads
    AutoModelForTokenClassification and reads logits[..., 0]). verl reads the tokenizer from
    `critic.model.tokenizer_path`, by default the model path: where the critic folder holds no
    tokenizer files (no tokenizer was known at export), `critic.model.tokenizer_path` is named with
    a placeholder for the actor's tokenizer folder and `verl_tokenizer_missing` says why."""
    miles_args = [
        "--critic-load",
        miles_dir,
        "--critic-value-pretrain-contract-sha256",
        miles_contract_sha256,
        "--no-load-optim",
        *objective_flags(objective),
    ]
    out: dict[str, Any] = {
        "miles_args": miles_args,
        "critic_load": miles_dir,
        "contract_sha256_to_pin": miles_contract_sha256,
        "verl": None,
    }
    if hf_dir is not None:
        out["verl"] = {"critic.model.path": hf_dir}
        if not hf_has_tokenizer:
            out["verl"]["critic.model.tokenizer_path"] = ACTOR_TOKENIZER_PLACEHOLDER
            out["verl_tokenizer_missing"] = (
                f"{hf_dir} holds no tokenizer files: set critic.model.tokenizer_path to the actor's tokenizer "
                "folder (or export again with --tokenizer)"
            )
    return out


def record_rl_settings(record: Mapping[str, Any]) -> dict[str, Any]:
    """`rl_settings` of a registry record with hand-off bundles."""
    handoff = record["handoff"]
    hf = handoff.get(HF_BUNDLE)
    return rl_settings(
        miles_dir=handoff[MILES_BUNDLE]["dir"],
        miles_contract_sha256=handoff[MILES_BUNDLE]["contract_sha256"],
        objective=handoff["objective"],
        hf_dir=hf["dir"] if hf else None,
        hf_has_tokenizer=bool(hf) and any(f["path"] in TOKENIZER_FILES for f in hf["files"]),
    )


def reusable_handoff(
    previous: Mapping[str, Any] | None, *, contract_sha256: str, miles_contract: Mapping[str, Any], scalar_hf: bool
) -> dict[str, Any] | None:
    """The hand-off of a previous registry record for the same contract whose bundles still match
    it byte for byte (re-promotion is then idempotent: nothing is exported again); else None."""
    if not previous or previous.get("contract_sha256") != contract_sha256:
        return None
    handoff = previous.get("handoff")
    if not isinstance(handoff, dict) or (handoff.get(HF_BUNDLE) is not None) != scalar_hf:
        return None
    try:
        verify_handoff(previous, "previous registry record")
        contract, _ = read_miles_contract(handoff[MILES_BUNDLE]["dir"])
    except (InputError, KeyError, TypeError):
        return None
    return dict(handoff) if canonical_bytes(contract) == canonical_bytes(dict(miles_contract)) else None


def install_bundles(staging: str | Path, handoff_dir: str | Path, names: tuple[str, ...]) -> None:
    """Move freshly exported bundles `staging/<name>` to `handoff_dir/<name>`, each old one moved
    aside into `staging` first (the caller removes `staging`). Renames within one filesystem."""
    staging, handoff_dir = Path(staging), Path(handoff_dir)
    check_bundle_location(handoff_dir / MILES_BUNDLE, itself=False)  # never installed through a link
    for name in (MILES_BUNDLE, HF_BUNDLE):
        final = handoff_dir / name
        if final.exists() or final.is_symlink():
            final.rename(staging / f"replaced-{name}")
        if name in names:
            (staging / name).rename(final)


def build_handoff(
    *, handoff_dir: str | Path, miles_contract: Mapping[str, Any], objective: Mapping[str, Any], scalar_hf: bool
) -> dict[str, Any]:
    """The registry record's `handoff` of the installed bundles, read back from the files: the
    Miles contract must be exactly `miles_contract` (by Miles' rules)."""
    root = Path(handoff_dir)
    return {
        "model_identity": miles_contract["model_identity"],
        "objective": dict(objective),
        MILES_BUNDLE: miles_bundle_record(root / MILES_BUNDLE, miles_contract),
        HF_BUNDLE: describe_bundle(root / HF_BUNDLE) if scalar_hf else None,
    }
