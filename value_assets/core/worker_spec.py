"""What every worker of one GPU job is told: one frozen, torch-free spec.

A job config (`core/job_configs.py`) builds it once its driver knows the backbone and the objective
(`TrainJob.worker_spec`, `EvaluateJob.worker_spec`); `start_workers` hands the same spec to every
worker with its rank. The worker builds its shard of the critic from it and, for a training job,
its optimizer. A forward-only job has no optimizer settings, and only a training job can freeze
parameters or hold the value head's bias at zero: a spec that says otherwise cannot be built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from value_assets.core.backbone import BackboneConfig
from value_assets.core.errors import InputError, show
from value_assets.core.memory import Layout, MemoryConfig
from value_assets.core.objective import Objective
from value_assets.core.strict_json import is_int

FREEZE = ("none", "attention", "backbone")
HEAD_BIAS = ("trained", "zero")


@dataclass(frozen=True, kw_only=True)
class OptimizerSettings:
    """AdamW with gradient-norm clipping; the learning rate of each step is set by the driver
    (warmup), starting from `lr`."""

    lr: float
    weight_decay: float
    clip_grad: float

    def __post_init__(self) -> None:
        for name, allow_zero in (("lr", False), ("weight_decay", True), ("clip_grad", False)):
            value = getattr(self, name)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not ok or not (value >= 0 if allow_zero else value > 0):
                raise InputError(name, f"must be a finite number {'>=' if allow_zero else '>'} 0, got {show(value)}")


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """The critic one job's workers build, how it is split over them, and how it trains (when it
    does)."""

    backbone: BackboneConfig
    objective: Objective
    layout: Layout
    seed: int
    """Seeds the value head (and the tiny backbone's initialisation) and megatron's RNG."""
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    freeze: str = "none"
    head_bias: str = "trained"
    """'zero': the value head's bias is built as zeros and never trained (it stays exactly 0)."""
    optimizer: OptimizerSettings | None = None
    """None: a forward-only job (evaluation, export)."""

    def __post_init__(self) -> None:
        if not is_int(self.seed):
            raise InputError("seed", f"must be an integer, got {show(self.seed)}")
        if self.freeze not in FREEZE:
            raise InputError("freeze", f"must be one of {FREEZE}, got {show(self.freeze)}")
        if self.optimizer is None and self.freeze != "none":
            raise InputError("freeze", f"{self.freeze!r} needs a training job; a forward-only one trains nothing")
        if self.head_bias not in HEAD_BIAS:
            raise InputError("head_bias", f"must be one of {HEAD_BIAS}, got {show(self.head_bias)}")
        if self.optimizer is None and self.head_bias != "trained":
            raise InputError(
                "head_bias", f"{self.head_bias!r} needs a training job; a forward-only one loads the bias it is given"
            )
        self.memory.check_layout(tensor_parallel=self.layout.tp)

    @property
    def train(self) -> bool:
        return self.optimizer is not None

    @property
    def world_size(self) -> int:
        return self.layout.world_size
