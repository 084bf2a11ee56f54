"""The settings of the two GPU jobs, train and evaluate: one frozen, keyword-only dataclass each.

This module is the one home of every job setting, its default, its documentation and every rule
that a setting must follow on its own. Three entry points build the same classes:

- the command line (`value_assets.gpu.commands`) from argparse: flags take their defaults and help
  from the fields here;
- the Dagster assets from their run config: a run-config field left unset (`None`) means the
  default here, and its description is the field's `doc`;
- the GPU job (`value_assets.gpu.pipes_job`) from the Pipes extras: `from_json(to_json())`.

Construction validates (`__post_init__`): a wrong type or value raises `InputError(field, message
quoting the value)`. Errors name the field as spelled here, in the JSON and in the Dagster run
config (`warmup_steps`, not `--warmup-steps`). Rules that need the data, the backbone or the
files (plan coverage, model split, resume) stay in the jobs' `prepare`.

Paths are `pathlib.Path` here and strings in JSON. Torch-free: the Dagster process imports it.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import os
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

from value_assets.core.backbone import BackboneConfig
from value_assets.core.errors import InputError, require_int, show
from value_assets.core.hashing import require_sha
from value_assets.core.memory import Layout, MemoryConfig
from value_assets.core.objective import Objective
from value_assets.core.plan import data_parallel_size
from value_assets.core.report import GATE_MODE_DEFAULT, GATE_MODES, MIN_EV_DEFAULT, check_min_ev
from value_assets.core.worker_spec import FREEZE, HEAD_BIAS, OptimizerSettings, WorkerSpec

DATA_ROOTS_ENV = "VALUE_ASSETS_DATA_ROOTS"
TINY_BACKBONE = "tiny"
TINY_LR = 2e-3
PRETRAINED_LR = 1e-5
SPLITS = ("heldout", "train")
AUTO = "auto"
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")  # Ray's placement-group strategies
# Settings the train and evaluate jobs share, defined once for both (the layers below take them
# from the job, without defaults of their own: tests/core/test_job_configs.py checks it).
PLACEMENT_STRATEGY = "PACK"
PLACEMENT_DOC = (
    "Ray placement-group strategy of the worker slots: 'PACK' (as few nodes as possible), 'SPREAD' (across nodes "
    "where possible), 'STRICT_PACK' (one node) or 'STRICT_SPREAD' (one slot per node). Ranks are ordered by node "
    "address either way, so tensor-parallel groups stay inside a node."
)
TIMEOUT_S = 900.0
TIMEOUT_DOC = "Deadline in seconds for the workers to start and for each call to them."

_MISSING = dataclasses.MISSING
J = TypeVar("J", bound="_JobConfig")


def setting(default: Any = _MISSING, *, doc: str) -> Any:
    """A config field with its one default and its one documentation string."""
    return dataclasses.field(default=default, metadata={"doc": doc})


def field_doc(cls: type[_JobConfig], name: str) -> str:
    """The documentation of field `name` of a job config (CLI help, Dagster description)."""
    return cast(str, cls.__dataclass_fields__[name].metadata["doc"])  # a str: every field is made by setting()


def field_default(cls: type[_JobConfig], name: str) -> Any:
    """The default of field `name`; KeyError for a required field."""
    default = cls.__dataclass_fields__[name].default
    if default is _MISSING:
        raise KeyError(f"{cls.__name__}.{name} is required")
    return default


def default_lr(backbone: str) -> float:
    """The learning rate when none is given: the randomly initialised tiny demo backbone needs a
    large step (2e-3), a pretrained actor a small one (1e-5)."""
    return TINY_LR if backbone == TINY_BACKBONE else PRETRAINED_LR


def data_roots_from_env(
    given: Iterable[str | Path] | None = None, environ: Mapping[str, str] | None = None
) -> tuple[str, ...] | None:
    """`given` folders plus those of $VALUE_ASSETS_DATA_ROOTS (os.pathsep-separated); None when
    there are none (no restriction)."""
    env = (os.environ if environ is None else environ).get(DATA_ROOTS_ENV, "")
    roots = [str(r) for r in (given or [])] + [r for r in env.split(os.pathsep) if r]
    return tuple(roots) or None


def _is_optional(hint: Any) -> tuple[bool, Any]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(hint)) == 2:
            return True, args[0]
    return False, hint


def _coerce(name: str, value: Any, hint: Any) -> Any:
    """`value` in the field's type (str -> Path, list -> tuple, int -> float), or an InputError."""
    optional, hint = _is_optional(hint)
    if value is None:
        if optional:
            return None
        raise InputError(name, "is required, got None")
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and set(typing.get_args(hint)) == {int, str}:
        # a token budget or the literal 'auto' (micro_batch_tokens of training)
        if (isinstance(value, int) and not isinstance(value, bool)) or value == AUTO:
            return value
        raise InputError(name, f"must be an integer or {AUTO!r}, got {show(value)}")
    if hint is Path:
        if isinstance(value, (str, os.PathLike)) and str(value):
            return Path(value)
        raise InputError(name, f"must be a non-empty path string, got {show(value)}")
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise InputError(name, f"must be true or false, got {show(value)}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise InputError(name, f"must be an integer, got {show(value)}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        raise InputError(name, f"must be a finite number, got {show(value)}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise InputError(name, f"must be a string, got {show(value)}")
    if typing.get_origin(hint) is tuple:  # tuple[str, ...]: folders, or contract shas (resume_from: may be empty)
        empty_ok = name == "resume_from"
        if (
            isinstance(value, (list, tuple))
            and (value or empty_ok)
            and all(isinstance(v, (str, os.PathLike)) and str(v) for v in value)
        ):
            return tuple(str(v) for v in value)
        what = (
            "list of contract sha256s (null: any save that verifies)"
            if empty_ok
            else "non-empty list of folder paths (null: no restriction)"
        )
        raise InputError(name, f"must be a {what}, got {show(value)}")
    raise TypeError(f"{name}: unsupported config field type {hint!r}")  # a programming error


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _positive_number(value: float | None, where: str, *, allow_zero: bool = False) -> None:
    if value is not None and not (value >= 0 if allow_zero else value > 0):
        raise InputError(where, f"must be a finite number {'>=' if allow_zero else '>'} 0, got {show(value)}")


class _JobConfig(abc.ABC):
    """Typing, JSON and the construction order shared by `TrainJob`, `EvaluateJob` and `HandoffJob`."""

    if TYPE_CHECKING:  # what @dataclass sets on each subclass; declared for mypy only
        __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _coerce(f.name, getattr(self, f.name), hints[f.name]))
        self._validate()

    @abc.abstractmethod
    def _validate(self) -> None:
        """The rules of one job's settings: raise `InputError` naming the field and its value."""

    def to_json(self) -> dict[str, Any]:
        """Every field, as plain JSON types (paths as strings, folder lists as lists)."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls: type[J], obj: Any) -> J:
        """The config `to_json` wrote. Strict: an unknown or missing required key, or a value of
        the wrong type, is an InputError naming the key."""
        if not isinstance(obj, Mapping):
            raise InputError(cls.__name__, f"must be a JSON object, got {show(obj)}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for key in obj:
            if key not in fields:
                raise InputError(str(key), f"is not a {cls.__name__} setting (known: {', '.join(fields)})")
        for name, f in fields.items():
            if name not in obj and f.default is _MISSING:
                raise InputError(name, "is required")
            if isinstance(obj.get(name), os.PathLike):
                raise InputError(name, f"must be a string in JSON, got {show(obj[name])}")
        return cls(**obj)


def _layout(cfg: Any) -> Layout:
    """The parallel layout of a job's worker slots (the GPUs must divide into whole model-parallel
    groups: docs/rules.md#topology-checks)."""
    dp = data_parallel_size(
        total_gpus=cfg.gpus, tensor_parallel=cfg.tensor_parallel, pipeline_parallel=cfg.pipeline_parallel
    )
    return Layout(tp=cfg.tensor_parallel, pp=cfg.pipeline_parallel, dp=dp)


def _common_checks(cfg: Any) -> None:
    for name in ("gpus", "tensor_parallel", "pipeline_parallel"):
        require_int(getattr(cfg, name), name)
    if cfg.micro_batch_tokens != AUTO:
        require_int(cfg.micro_batch_tokens, "micro_batch_tokens")
    if cfg.placement_strategy not in PLACEMENT_STRATEGIES:
        raise InputError(
            "placement_strategy",
            f"must be one of {', '.join(PLACEMENT_STRATEGIES)}, got {show(cfg.placement_strategy)}",
        )
    _positive_number(cfg.timeout_s, "timeout_s")


@dataclass(frozen=True, kw_only=True)
class TrainJob(_JobConfig):
    """One training run (docs/rules.md#training-run): `value-assets train`, the `critic_training` and `canary_receipt`
    assets, and the Pipes tasks `train` / `canary`."""

    manifest: Path = setting(doc="Manifest JSON (miles.value-pretrain.v1) naming the train (and heldout) data.")
    output: Path = setting(doc="Critic folder: iter_*/ checkpoints, their contracts, the latest pointer, metrics.")
    backbone: str = setting(
        TINY_BACKBONE, doc="'tiny' (random CPU demo model), a Hugging Face folder or a Megatron checkpoint folder."
    )
    global_batch_size: int = setting(32, doc="G: rows per optimizer step (the batch plan's G).")
    epochs: int = setting(1, doc="Passes over the train split (the batch plan's epochs).")
    seed: int = setting(0, doc="Seed of the batch plan's shuffle and of the tiny backbone's initialisation.")
    plan: Path | None = setting(
        None,
        doc=(
            "A published batch plan (plan.json, with plan_sha256) to train on exactly; its G, epochs and seed must be "
            "the job's. The Dagster assets pass the partition's; unset: the plan is built from G, epochs and seed."
        ),
    )
    plan_sha256: str | None = setting(
        None, doc="The sha256 the lineage recorded for `plan` (checked before it is parsed)."
    )
    save_interval: int = setting(0, doc="Save (and contract) every K steps; 0: at the end only.")
    gpus: int = setting(1, doc="Worker slots: GPUs, or CPU processes without CUDA.")
    tensor_parallel: int = setting(1, doc="Tensor-parallel size (divides gpus and the backbone's heads).")
    pipeline_parallel: int = setting(1, doc="Pipeline stages (divides gpus and the backbone's layers).")
    micro_batch_tokens: int | str = setting(
        4096,
        doc="Tokens packed per micro-batch, at least the longest row; 'auto': the largest that fits the GPU's free "
        "memory (core/memory.py's model).",
    )
    recompute: str = setting(
        "none", doc="Activation recompute (megatron's): 'none', 'selective' (core attention) or 'full' (every layer)."
    )
    recompute_layers: int | None = setting(
        None,
        doc="With recompute 'full': recompute only the first K layers of each pipeline stage (megatron's block "
        "method), keep every activation of the others; unset: every layer.",
    )
    distributed_optimizer: bool = setting(
        False,
        doc="Shard fp32 master weights and Adam state over data-parallel ranks (megatron's distributed optimizer).",
    )
    sequence_parallel: bool = setting(False, doc="Megatron sequence parallelism (needs tensor_parallel > 1).")
    optimizer_offload: float = setting(
        0.0,
        doc="Fraction (0-1) of the optimizer's fp32 master weights and Adam state kept and updated in host memory "
        "(megatron-core's HybridDeviceOptimizer; CUDA only, needs distributed_optimizer): trains a critic whose "
        "optimizer does not fit the GPU; 0: none.",
    )
    freeze: str = setting(
        "none",
        doc="Parameters that do not train: 'none', 'attention' (every self-attention parameter, Miles' "
        "critic_freeze_attention) or 'backbone' (all but the value head: head-only warm-up).",
    )
    head_bias: str = setting(
        "trained",
        doc="The value head's bias: 'trained', or 'zero' (built as 0 and never trained, so the value is exactly "
        "hidden . w: OpenRLHF's bias-free critic head reproduces it under its default flags; export-hf --format "
        "openrlhf needs it).",
    )
    lr: float | None = setting(
        None, doc=f"Peak learning rate; unset: {TINY_LR:g} for the tiny backbone, {PRETRAINED_LR:g} for any other."
    )
    warmup_steps: int = setting(0, doc="Linear warmup from 0 to lr over this many steps; 0: none.")
    weight_decay: float = setting(0.0, doc="AdamW weight decay.")
    clip_grad: float = setting(1.0, doc="Gradient-norm clipping threshold.")
    canary: bool = setting(
        False, doc="Run the first planned step only and publish a non-promotable receipt, no contract."
    )
    stop_after: int | None = setting(
        None, doc="Stop (with a save) after this many steps of this run; unset: run the plan out."
    )
    resume_from: tuple[str, ...] | None = setting(
        None,
        doc=(
            "The contract shas a resume may start from: the saves this lineage recorded (the Dagster asset passes the "
            "ones its runs logged); a newest save not among them is refused. Unset: any save in the output folder "
            "whose files verify against its own contract."
        ),
    )
    manifest_sha256: str | None = setting(None, doc="Pin the manifest's sha256 (checked before it is parsed).")
    backbone_sha256: str | None = setting(
        None,
        doc="Pin the backbone folder's digest (the `sha256` of the contract's model identity); another is refused "
        "before anything is reserved. Unset: not checked.",
    )
    training_spec_sha256: str | None = setting(
        None, doc="The lineage's training spec (docs/rules.md#training-spec), recorded in the contract."
    )
    warm_start_checkpoint: Path | None = setting(
        None,
        doc="A fresh run starts from this contracted critic's weights (head included) instead of the actor's: the "
        "family champion (docs/rules.md#champion). Needs warm_start_contract_sha256; ignored by a resume.",
    )
    warm_start_contract_sha256: str | None = setting(
        None, doc="The sha256 of warm_start_checkpoint's contract (checked before anything is loaded)."
    )
    data_roots: tuple[str, ...] | None = setting(
        None, doc="Refuse dataset paths outside these folders; unset: no restriction."
    )
    ray_address: str | None = setting(None, doc="An existing Ray cluster; unset: start a local one.")
    placement_strategy: str = setting(PLACEMENT_STRATEGY, doc=PLACEMENT_DOC)
    hf_config: Path | None = setting(
        None,
        doc="The actor's Hugging Face config.json, for a Megatron-LM backbone folder: it completes the checkpoint's "
        "saved arguments (where both give a value they must agree) or, without saved arguments, gives the "
        "architecture.",
    )
    timeout_s: float = setting(TIMEOUT_S, doc=TIMEOUT_DOC)

    def _validate(self) -> None:
        if not self.backbone:
            raise InputError("backbone", "must be 'tiny' or a checkpoint folder, got ''")
        for name in ("global_batch_size", "epochs"):
            require_int(getattr(self, name), name)
        require_int(self.save_interval, "save_interval", minimum=0)
        require_int(self.warmup_steps, "warmup_steps", minimum=0)
        _common_checks(self)
        _positive_number(self.lr, "lr")
        _positive_number(self.weight_decay, "weight_decay", allow_zero=True)
        _positive_number(self.clip_grad, "clip_grad")
        if self.stop_after is not None:
            require_int(self.stop_after, "stop_after")
        if self.manifest_sha256 is not None:
            require_sha(self.manifest_sha256, "manifest_sha256")
        if (self.plan is None) != (self.plan_sha256 is None):
            raise InputError(
                "plan_sha256" if self.plan is not None else "plan",
                "plan and plan_sha256 go together: a published plan is read only with the sha its lineage recorded",
            )
        if self.plan_sha256 is not None:
            require_sha(self.plan_sha256, "plan_sha256")
        for name in ("backbone_sha256", "training_spec_sha256", "warm_start_contract_sha256"):
            if getattr(self, name) is not None:
                require_sha(getattr(self, name), name)
        if (self.warm_start_checkpoint is None) != (self.warm_start_contract_sha256 is None):
            raise InputError(
                "warm_start_contract_sha256" if self.warm_start_checkpoint is not None else "warm_start_checkpoint",
                "warm_start_checkpoint and warm_start_contract_sha256 go together: a champion is loaded only against "
                "its pinned contract",
            )
        for sha in self.resume_from or ():
            require_sha(sha, "resume_from")
        if self.recompute_layers is not None:
            require_int(self.recompute_layers, "recompute_layers")
        self.memory.check_layout(tensor_parallel=self.tensor_parallel)
        if self.freeze not in FREEZE:
            raise InputError("freeze", f"must be one of {FREEZE}, got {show(self.freeze)}")
        if self.head_bias not in HEAD_BIAS:
            raise InputError("head_bias", f"must be one of {HEAD_BIAS}, got {show(self.head_bias)}")
        if self.freeze == "backbone" and self.pipeline_parallel > 1:
            raise InputError(
                "freeze",
                f"'backbone' needs pipeline_parallel 1, got {self.pipeline_parallel}: only the last "
                "stage holds the value head, so the other stages would have nothing to train",
            )

    @property
    def memory(self) -> MemoryConfig:
        """The memory settings as core/memory.py's `MemoryConfig` (validated there)."""
        return MemoryConfig(
            recompute=self.recompute,
            recompute_layers=self.recompute_layers,
            distributed_optimizer=self.distributed_optimizer,
            sequence_parallel=self.sequence_parallel,
            optimizer_offload=self.optimizer_offload,
        )

    @property
    def learning_rate(self) -> float:
        """`lr`, or the backbone's default (`default_lr`) when unset."""
        return self.lr if self.lr is not None else default_lr(self.backbone)

    def worker_spec(self, backbone: BackboneConfig, objective: Objective) -> WorkerSpec:
        """What each training worker builds and how it trains (`core/worker_spec.py`)."""
        return WorkerSpec(
            backbone=backbone,
            objective=objective,
            layout=_layout(self),
            seed=self.seed,
            memory=self.memory,
            freeze=self.freeze,
            head_bias=self.head_bias,
            optimizer=OptimizerSettings(
                lr=self.learning_rate, weight_decay=self.weight_decay, clip_grad=self.clip_grad
            ),
        )


@dataclass(frozen=True, kw_only=True)
class EvaluateJob(_JobConfig):
    """One forward-only evaluation (docs/rules.md#evaluation): `value-assets evaluate`, the `ev_report` asset and the
    Pipes task `evaluate`."""

    checkpoint: Path = setting(doc="A contracted iter_* folder, or a critic folder (its latest).")
    manifest: Path = setting(doc="The manifest the checkpoint's contract binds.")
    contract_sha256: str = setting(doc="The sha256 of the checkpoint's contract (checked before anything is loaded).")
    report: Path = setting(doc="Report path (write-once); its three plots are published beside it.")
    split: str = setting("heldout", doc="The split to evaluate: 'heldout' (the gate) or 'train'.")
    num_batches: int = setting(8, doc="B mixed-label batches (docs/rules.md#evaluation).")
    global_batch_size: int | None = setting(
        None,
        doc="G rows per evaluation batch (G x B <= rows); unset: min(64, rows / B), rounded down to a multiple of the "
        "data-parallel size.",
    )
    seed: int = setting(0, doc="Seed of the mixed-label batch selection.")
    gpus: int = setting(1, doc="Worker slots: GPUs, or CPU processes without CUDA.")
    tensor_parallel: int = setting(1, doc="Tensor-parallel size; any layout: the checkpoint is re-sharded on load.")
    pipeline_parallel: int = setting(1, doc="Pipeline stages; any layout: the checkpoint is re-sharded on load.")
    micro_batch_tokens: int = setting(8192, doc="Tokens packed per forward micro-batch (raised to the longest row).")
    data_roots: tuple[str, ...] | None = setting(
        None, doc="Refuse dataset paths outside these folders; unset: no restriction."
    )
    ray_address: str | None = setting(None, doc="An existing Ray cluster; unset: start a local one.")
    placement_strategy: str = setting(PLACEMENT_STRATEGY, doc=PLACEMENT_DOC)
    timeout_s: float = setting(TIMEOUT_S, doc=TIMEOUT_DOC)
    training_spec_sha256: str | None = setting(
        None, doc="The lineage's training spec (docs/rules.md#training-spec), recorded in the report."
    )
    champion_checkpoint: Path | None = setting(
        None,
        doc="The family champion (docs/rules.md#champion): its contracted save is scored on the same batches, and the "
        "gate also needs this critic not to fall behind it beyond champion_tolerance. Needs "
        "champion_contract_sha256.",
    )
    champion_contract_sha256: str | None = setting(None, doc="The sha256 of the champion's contract (pinned).")
    champion_partition: str | None = setting(None, doc="The champion's lineage (its partition key), for the report.")
    champion_tolerance: float = setting(
        0.0,
        doc="How far below the champion (EV, both weightings) the lower bound of the paired 95% interval of the "
        "difference may reach.",
    )
    gate_mode: str = setting(
        GATE_MODE_DEFAULT,
        doc="The gate rule: 'miles' (aggregate EV > 0 and a majority of positive-EV batches, "
        "both weightings) or 'interval' (also the lower bound of each aggregate EV's "
        "bootstrap interval over rows, level 0.95, > 0).",
    )
    gate_min_ev: float = setting(
        MIN_EV_DEFAULT,
        doc=(
            "The least EV that passes, in [0, 1): each aggregate EV ('miles') or each interval's lower bound "
            "('interval') must be above it, for both weightings. 0 is Miles' rule; a small positive value (e.g. "
            "0.005) refuses critics whose EV is real but too small to help RL, and noise that a zero bar passes at "
            "its false-positive rate."
        ),
    )

    def _validate(self) -> None:
        require_sha(self.contract_sha256, "contract_sha256")
        if self.training_spec_sha256 is not None:
            require_sha(self.training_spec_sha256, "training_spec_sha256")
        if (self.champion_checkpoint is None) != (self.champion_contract_sha256 is None):
            raise InputError(
                "champion_contract_sha256" if self.champion_checkpoint is not None else "champion_checkpoint",
                "champion_checkpoint and champion_contract_sha256 go together: a champion is loaded only against its "
                "pinned contract",
            )
        if self.champion_contract_sha256 is not None:
            require_sha(self.champion_contract_sha256, "champion_contract_sha256")
        _positive_number(self.champion_tolerance, "champion_tolerance", allow_zero=True)
        if self.champion_tolerance >= 1:
            raise InputError(
                "champion_tolerance", f"must be below 1 (an EV difference), got {show(self.champion_tolerance)}"
            )
        if self.gate_mode not in GATE_MODES:
            raise InputError(
                "gate_mode", f"must be one of {', '.join(map(repr, GATE_MODES))}, got {show(self.gate_mode)}"
            )
        check_min_ev(self.gate_min_ev)
        if self.split not in SPLITS:
            raise InputError("split", f"must be 'heldout' or 'train', got {show(self.split)}")
        require_int(self.num_batches, "num_batches")
        if self.global_batch_size is not None:
            require_int(self.global_batch_size, "global_batch_size", minimum=2)
        _common_checks(self)

    def worker_spec(self, backbone: BackboneConfig, objective: Objective) -> WorkerSpec:
        """What each forward-only worker builds: the contracted critic, no optimizer."""
        return WorkerSpec(backbone=backbone, objective=objective, layout=_layout(self), seed=self.seed)


LAYER_SPECS = ("te", "local")


@dataclass(frozen=True, kw_only=True)
class HandoffJob(_JobConfig):
    """The hand-off export of a promoted critic (docs/rules.md#hand-off): the Pipes task `handoff` that
    `promoted_critic` launches. Writes `out_dir/miles/` (Miles' `--critic-load` folder) and, with
    `scalar_hf`, `out_dir/hf/` (the scalar Hugging Face critic, verl's `critic.model.path`)."""

    checkpoint: Path = setting(doc="The contracted iter_* folder being promoted.")
    contract_sha256: str = setting(doc="The sha256 of its contract (checked before anything is loaded).")
    out_dir: Path = setting(doc="An empty or absent folder for the bundles.")
    model_identity: str = setting(doc="The Miles contract's model_identity (core.handoff.model_identity).")
    layer_spec: str = setting(
        "te",
        doc="Megatron-LM layer spec of the Miles checkpoint: 'te' (Transformer Engine, Miles' default) or 'local'.",
    )
    scalar_hf: bool = setting(False, doc="Also export the scalar Hugging Face critic (mse critics only).")

    def _validate(self) -> None:
        require_sha(self.contract_sha256, "contract_sha256")
        if not self.model_identity:
            raise InputError("model_identity", "must be a non-empty string, got ''")
        if self.layer_spec not in LAYER_SPECS:
            raise InputError("layer_spec", f"must be one of {LAYER_SPECS}, got {show(self.layer_spec)}")
