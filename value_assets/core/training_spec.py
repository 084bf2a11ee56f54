"""The lineage's training spec (docs/rules.md#training-spec): which actor a manifest's critic starts
from, how it trains, how it is gated, and which family's champion it must not fall behind.

A manifest carries it as its top-level `training` object (Miles' manifest loader reads only
`schema`, `train`, `heldout` and `objective`, so a manifest with a spec stays a valid Miles
manifest). A manifest without one takes the deployment's default spec (a JSON file holding such an
object: `ManifestInbox.default_training`, `$VALUE_ASSETS_DEFAULT_TRAINING`); with neither, the
manifest is refused by name, never trained on the random `tiny` backbone. The spec in force is
snapshotted into the partition's registration when the sensor registers the manifest, so a later
change of the deployment default never changes an existing lineage; its sha (of its canonical
JSON) is recorded in the registration, the contract and the report.

    {"schema": "value-assets.training.v1",
     "backbone": "tiny" | {"path": str, "sha256": sha (optional), "hf_config": str (optional)},
     "family": str (optional: the champion/challenger group),
     "plan":     {"global_batch_size", "epochs", "seed"},                         TrainJob's fields
     "train":    {"gpus", "tensor_parallel", "pipeline_parallel", "lr", ...},     TrainJob's fields
     "evaluate": {"num_batches", "global_batch_size", "seed", "gpus", ...},       EvaluateJob's fields
     "gate":     {"mode": "miles" | "interval", "min_ev": float},
     "champion": {"warm_start": bool, "tolerance": float}}

Every section and key is optional except `schema` and `backbone`; an unknown key is an error that
names it (a misspelt setting must not silently take its default). Values are checked by the job
configs themselves (`TrainJob`, `EvaluateJob`), so the spec has no second copy of a rule.
Relative backbone paths resolve against the manifest's folder, like dataset paths.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from value_assets.core.errors import InputError, show
from value_assets.core.hashing import is_sha, sha256_bytes
from value_assets.core.job_configs import EvaluateJob, TrainJob
from value_assets.core.report import GATE_MODE_DEFAULT, GATE_MODES, MIN_EV_DEFAULT, check_min_ev
from value_assets.core.strict_json import canonical_bytes, is_number, loads

SCHEMA = "value-assets.training.v1"
SECTION = "training"
DEFAULT_TRAINING_ENV = "VALUE_ASSETS_DEFAULT_TRAINING"
TINY = "tiny"
DEFAULT_TOLERANCE = 0.0
FAMILY_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")

# What each section may set: the job configs' own fields, minus those the partition decides
# (paths, shas, the split, the resume pins) and those set elsewhere in the spec.
PLAN_FIELDS = ("global_batch_size", "epochs", "seed")
TRAIN_FIELDS = (
    "gpus", "tensor_parallel", "pipeline_parallel", "save_interval", "lr", "warmup_steps", "weight_decay", "clip_grad",
    "micro_batch_tokens", "recompute", "recompute_layers", "distributed_optimizer", "sequence_parallel", "freeze",
    "head_bias", "optimizer_offload", "placement_strategy", "timeout_s",
)  # fmt: skip
EVALUATE_FIELDS = (
    "num_batches", "global_batch_size", "seed", "gpus", "tensor_parallel", "pipeline_parallel", "micro_batch_tokens",
    "placement_strategy", "timeout_s",
)  # fmt: skip
SECTIONS = {"schema", "backbone", "family", "plan", "train", "evaluate", "gate", "champion"}


@dataclass(frozen=True, kw_only=True)
class BackboneRef:
    """The actor a critic starts from: `tiny` (the random demo backbone) or a checkpoint folder."""

    path: Path | None  # None: tiny
    sha256: str | None = None  # the folder's digest as the trainer computes it (gpu/convert/bootstrap.py)
    hf_config: Path | None = None

    @property
    def spec(self) -> str:
        """`TrainJob.backbone`'s value."""
        return TINY if self.path is None else str(self.path)


@dataclass(frozen=True, kw_only=True)
class GatePolicy:
    mode: str = GATE_MODE_DEFAULT
    min_ev: float = MIN_EV_DEFAULT


@dataclass(frozen=True, kw_only=True)
class ChampionPolicy:
    warm_start: bool = False
    """Start from the family champion's weights (head included) instead of the actor's."""
    tolerance: float = DEFAULT_TOLERANCE
    """How much lower (in EV, both weightings) the challenger's interval may reach than the champion's
    before it is refused: the lower bound of the paired 95% interval of EV(challenger) - EV(champion)
    must be >= -tolerance."""


@dataclass(frozen=True, kw_only=True)
class TrainingSpec:
    raw: Mapping[str, Any]
    base: Path
    """The folder relative backbone paths resolve against."""
    backbone: BackboneRef
    family: str | None
    plan: Mapping[str, Any]
    train: Mapping[str, Any]
    evaluate: Mapping[str, Any]
    gate: GatePolicy
    champion: ChampionPolicy

    def canonical(self) -> bytes:
        return canonical_bytes(dict(self.raw))

    @property
    def sha256(self) -> str:
        return sha256_bytes(self.canonical())

    def train_settings(self) -> dict[str, Any]:
        """`TrainJob` keyword arguments: the plan's and the train section's, and the backbone."""
        settings: dict[str, Any] = {**self.plan, **self.train, "backbone": self.backbone.spec}
        if self.backbone.hf_config is not None:
            settings["hf_config"] = self.backbone.hf_config
        return settings

    def evaluate_settings(self) -> dict[str, Any]:
        """`EvaluateJob` keyword arguments: the evaluate section's and the gate policy."""
        return {**self.evaluate, "gate_mode": self.gate.mode, "gate_min_ev": self.gate.min_ev}

    def run_config(self) -> dict[str, Any]:
        """The Dagster run config that states this spec's settings for the `full` job's steps (the
        assets check that a run's config agrees with the lineage's spec)."""
        from value_assets.core import vocabulary as v

        train = {**self.train, "backbone": self.backbone.spec}
        if train.get("micro_batch_tokens") == "auto":
            del train["micro_batch_tokens"]  # Dagster's config has no int-or-string type; the spec holds it
        ops: dict[str, Any] = {v.BATCH_PLAN: {"config": dict(self.plan)}, "critic_training": {"config": train}}
        ops[v.EV_REPORT] = {"config": self.evaluate_settings()}
        return {"ops": ops}


def _section(obj: Mapping[str, Any], name: str, allowed: tuple[str, ...], where: str) -> dict[str, Any]:
    value = obj.get(name, {})
    if not isinstance(value, Mapping):
        raise InputError(f"{where}.{name}", f"must be an object, got {show(value)}")
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise InputError(f"{where}.{name}", f"unknown setting(s) {unknown}; known: {', '.join(allowed)}")
    return dict(value)


def _number(value: Any, where: str, *, minimum: float = 0.0) -> float:
    if not is_number(value) or not math.isfinite(float(value)) or float(value) < minimum:
        raise InputError(where, f"must be a finite number >= {minimum:g}, got {show(value)}")
    return float(value)


def _backbone(value: Any, base: Path, where: str) -> BackboneRef:
    if value == TINY:
        return BackboneRef(path=None)
    if not isinstance(value, Mapping):
        raise InputError(
            f"{where}.backbone",
            f"must be 'tiny' or an object with path (and optionally sha256, hf_config), got {show(value)}",
        )
    unknown = sorted(set(value) - {"path", "sha256", "hf_config"})
    if unknown:
        raise InputError(f"{where}.backbone", f"unknown key(s) {unknown}; known: path, sha256, hf_config")
    path = value.get("path")
    if not isinstance(path, str) or not path or "\x00" in path:
        raise InputError(f"{where}.backbone.path", f"must be a non-empty path string, got {show(path)}")
    sha = value.get("sha256")
    if sha is not None and not is_sha(sha):
        raise InputError(f"{where}.backbone.sha256", f"must be a lowercase 64-hex SHA-256 or absent, got {show(sha)}")
    hf_config = value.get("hf_config")
    if hf_config is not None and (not isinstance(hf_config, str) or not hf_config or "\x00" in hf_config):
        raise InputError(
            f"{where}.backbone.hf_config", f"must be a non-empty path string or absent, got {show(hf_config)}"
        )

    def resolve(p: str) -> Path:
        return Path(p) if Path(p).is_absolute() else base / p

    return BackboneRef(path=resolve(path), sha256=sha, hf_config=resolve(hf_config) if hf_config else None)


def parse_training_spec(obj: Any, *, base: Path, where: str) -> TrainingSpec:
    """A spec object (see the module docstring), checked against the job configs' own rules.
    `base`: the folder relative backbone paths resolve against; `where`: names it in errors."""
    if not isinstance(obj, Mapping):
        raise InputError(where, f"must be an object, got {show(obj)}")
    if obj.get("schema") != SCHEMA:
        raise InputError(f"{where}.schema", f"must be {SCHEMA!r}, got {show(obj.get('schema'))}")
    unknown = sorted(set(obj) - SECTIONS)
    if unknown:
        raise InputError(where, f"unknown section(s) {unknown}; known: {', '.join(sorted(SECTIONS))}")
    if "backbone" not in obj:
        raise InputError(f"{where}.backbone", "is required: 'tiny' (the random demo backbone) or the actor's folder")
    backbone = _backbone(obj["backbone"], base, where)
    family = obj.get("family")
    if family is not None and (not isinstance(family, str) or not FAMILY_PATTERN.fullmatch(family)):
        raise InputError(f"{where}.family", f"must match {FAMILY_PATTERN.pattern}, got {show(family)}")
    plan = _section(obj, "plan", PLAN_FIELDS, where)
    train = _section(obj, "train", TRAIN_FIELDS, where)
    evaluate = _section(obj, "evaluate", EVALUATE_FIELDS, where)
    gate_obj = _section(obj, "gate", ("mode", "min_ev"), where)
    champion_obj = _section(obj, "champion", ("warm_start", "tolerance"), where)
    mode = gate_obj.get("mode", GATE_MODE_DEFAULT)
    if mode not in GATE_MODES:
        raise InputError(f"{where}.gate.mode", f"must be one of {', '.join(map(repr, GATE_MODES))}, got {show(mode)}")
    min_ev = _number(gate_obj.get("min_ev", MIN_EV_DEFAULT), f"{where}.gate.min_ev")
    check_min_ev(min_ev)
    warm = champion_obj.get("warm_start", False)
    if not isinstance(warm, bool):
        raise InputError(f"{where}.champion.warm_start", f"must be true or false, got {show(warm)}")
    tolerance = _number(champion_obj.get("tolerance", DEFAULT_TOLERANCE), f"{where}.champion.tolerance")
    if champion_obj and family is None:
        raise InputError(f"{where}.champion", "needs a family: the champion is the family's last promoted critic")
    spec = TrainingSpec(
        raw=dict(obj), base=base, backbone=backbone, family=family, plan=plan, train=train, evaluate=evaluate,
        gate=GatePolicy(mode=mode, min_ev=min_ev), champion=ChampionPolicy(warm_start=warm, tolerance=tolerance),
    )  # fmt: skip
    _check_with_the_job_configs(spec, where)
    return spec


def _check_with_the_job_configs(spec: TrainingSpec, where: str) -> None:
    """Build the job configs the spec would give, so a bad value is refused now, by the configs' own
    rules, and named as the spec's."""
    section_of = {**{k: "plan" for k in PLAN_FIELDS}, **{k: "train" for k in TRAIN_FIELDS}}
    try:
        TrainJob(manifest=Path("manifest.json"), output=Path("critic"), **spec.train_settings())
    except InputError as exc:
        raise InputError(f"{where}.{section_of.get(exc.where, 'train')}.{exc.where}", exc.message) from None
    try:
        EvaluateJob(
            checkpoint=Path("critic"), manifest=Path("manifest.json"), contract_sha256="0" * 64, report=Path("r.json"),
            champion_tolerance=spec.champion.tolerance, **spec.evaluate_settings(),
        )  # fmt: skip
    except InputError as exc:
        if exc.where == "champion_tolerance":
            raise InputError(f"{where}.champion.tolerance", exc.message) from None
        section = "gate" if exc.where.startswith("gate_") else "evaluate"
        raise InputError(f"{where}.{section}.{exc.where}", exc.message) from None


def spec_of_manifest(raw: Mapping[str, Any], manifest_path: Path) -> TrainingSpec | None:
    """The spec a parsed manifest carries (its `training` object), or None."""
    if SECTION not in raw:
        return None
    return parse_training_spec(raw[SECTION], base=manifest_path.parent, where=f"{manifest_path}: {SECTION}")


def load_spec_file(path: Path) -> TrainingSpec:
    """A deployment's default spec: a JSON file holding one spec object; relative backbone paths
    resolve against the file's folder."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(str(path), f"cannot read the training spec: {exc.strerror or exc}") from None
    return parse_training_spec(loads(data, str(path)), base=path.parent, where=str(path))


def field_names() -> dict[str, tuple[str, ...]]:
    """The settings each section may hold (for documentation and tests)."""
    return {"plan": PLAN_FIELDS, "train": TRAIN_FIELDS, "evaluate": EVALUATE_FIELDS}


def _assert_fields_exist() -> None:
    known_train = {f.name for f in dataclasses.fields(TrainJob)}
    known_eval = {f.name for f in dataclasses.fields(EvaluateJob)}
    missing = [f for f in PLAN_FIELDS + TRAIN_FIELDS if f not in known_train] + [
        f for f in EVALUATE_FIELDS if f not in known_eval
    ]
    if missing:  # a programming error: the spec names a setting the job configs do not have
        raise RuntimeError(f"training spec fields unknown to the job configs: {missing}")


_assert_fields_exist()
