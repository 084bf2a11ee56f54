"""Batch plans (docs/rules.md#batch-plan): the Miles-compatible shuffle, the exact-coverage planner, topology checks.

A plan is an artifact with its own sha: the canonical JSON of seed, G, epochs, algorithm and the
step -> row indices table.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from value_assets.core.errors import InputError, require_int, show
from value_assets.core.hashing import sha256_bytes
from value_assets.core.strict_json import canonical_bytes, is_int

ALGORITHM = "miles.epoch_shuffle.v1"
SCHEMA = "value-assets.batch-plan.v1"


@dataclass(frozen=True)
class BatchPlan:
    num_rows: int
    global_batch_size: int
    epochs: int
    seed: int
    steps: tuple[tuple[int, ...], ...]  # steps[k] holds the row indices of step k + 1

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    def spec(self) -> dict[str, Any]:
        """The plan identity a contract binds: what resume compares."""
        return {
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
            "drop_incomplete_batch": True,
            "algorithm": ALGORITHM,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            **self.spec(),
            "num_rows": self.num_rows,
            "epochs": self.epochs,
            "num_steps": self.num_steps,
            "steps": [list(s) for s in self.steps],
        }

    def to_bytes(self) -> bytes:
        return canonical_bytes(self.to_json())

    @property
    def sha256(self) -> str:
        return sha256_bytes(self.to_bytes())

    def batch(self, step: int) -> tuple[int, ...]:
        """Row indices of 1-based `step`."""
        if not 1 <= step <= self.num_steps:
            raise IndexError(f"step {step} outside 1..{self.num_steps}")
        return self.steps[step - 1]

    def coverage(self) -> dict[str, int]:
        return coverage(self.num_rows, self.steps, self.epochs)


def build_plan(num_rows: object, global_batch_size: object, epochs: object = 1, seed: object = 0) -> BatchPlan:
    """The shuffle plan of `num_rows` rows in batches of `global_batch_size`. The arguments are checked here
    (InputError naming the setting), so any value may be given: `plan_from_json` passes parsed JSON."""
    n = require_int(num_rows, "num_rows")
    g = require_int(global_batch_size, "global_batch_size")
    e = require_int(epochs, "epochs")
    if not is_int(seed):
        raise InputError("seed", f"must be an integer, got {show(seed)}")
    if n < g:
        raise InputError(
            "global_batch_size", f"{g} exceeds the {n} rows of the dataset: the plan would have zero steps"
        )
    steps: list[tuple[int, ...]] = []
    per_epoch = n // g
    for epoch in range(e):
        order = list(range(n))
        random.Random(seed + epoch).shuffle(order)
        steps.extend(tuple(order[k * g : (k + 1) * g]) for k in range(per_epoch))
    return BatchPlan(num_rows=n, global_batch_size=g, epochs=e, seed=seed, steps=tuple(steps))


def coverage(num_rows: int, steps: Sequence[Sequence[int]], epochs: int) -> dict[str, int]:
    """Rows dropped (never seen) and repeated (seen more than `epochs` times... per epoch) by a plan.

    `dropped` counts row slots left out: epochs x N minus the rows used; `repeated` counts uses of a
    row beyond its first within the same epoch (zero for the shuffle plan, non-zero for plans that pad).
    """
    used = sum(len(s) for s in steps)
    seen = [0] * num_rows
    for s in steps:
        for i in s:
            seen[i] += 1
    repeated = sum(max(0, c - epochs) for c in seen)
    dropped = epochs * num_rows - (used - repeated)
    return {"dropped": dropped, "repeated": repeated}


@dataclass(frozen=True)
class ExactCoverage:
    dp: int
    global_batch_size: int
    dropped: int
    repeated: int


def choose_exact_coverage(num_rows: int, gpus: int, max_global_batch_size: int) -> ExactCoverage:
    """Largest dp <= min(N, GPUs, max G) dividing N; then the largest multiple of dp <= min(N, max G) dividing N."""
    n = require_int(num_rows, "num_rows")
    gp = require_int(gpus, "gpus")
    mg = require_int(max_global_batch_size, "max_global_batch_size")
    dp = max(d for d in range(1, min(n, gp, mg) + 1) if n % d == 0)
    g = max(m for m in range(dp, min(n, mg) + 1, dp) if n % m == 0)
    return ExactCoverage(dp=dp, global_batch_size=g, dropped=n % g, repeated=0)


def data_parallel_size(*, total_gpus: int, tensor_parallel: int = 1, pipeline_parallel: int = 1) -> int:
    """GPUs / (tp x pp); the GPUs must divide into whole model-parallel groups (docs/rules.md#batch-plan)."""
    total = require_int(total_gpus, "gpus")
    tp = require_int(tensor_parallel, "tensor_parallel")
    pp = require_int(pipeline_parallel, "pipeline_parallel")
    if total % (tp * pp):
        raise InputError(
            "gpus", f"{total} GPUs are not divisible by the model-parallel size tp x pp = {tp} x {pp} = {tp * pp}"
        )
    return total // (tp * pp)


def check_topology(
    *,
    total_gpus: int,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    global_batch_size: int,
    micro_batch_size: int = 1,
) -> int:
    """Check docs/rules.md#batch-plan topology rules before launch; return the data-parallel size."""
    dp = data_parallel_size(total_gpus=total_gpus, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel)
    g = require_int(global_batch_size, "global_batch_size")
    mb = require_int(micro_batch_size, "micro_batch_size")
    if g % dp:
        raise InputError("global_batch_size", f"{g} is not divisible by the data-parallel size {dp}")
    if (g // dp) % mb:
        raise InputError(
            "micro_batch_size", f"the local batch G / dp = {g // dp} is not divisible by the micro-batch size {mb}"
        )
    return dp


def assign_to_ranks(batch: tuple[int, ...] | list[int], dp: int) -> list[list[int]]:
    """Rows of a batch go to dp ranks round-robin by position (docs/rules.md#training-run)."""
    return [list(batch[r::dp]) for r in range(dp)]


def plan_from_json(obj: Any, where: str) -> BatchPlan:
    """Rebuild a plan from its JSON and check it equals the plan its parameters generate."""
    if not isinstance(obj, dict) or obj.get("schema") != SCHEMA:
        raise InputError(where, f"not a {SCHEMA} document")
    plan = build_plan(obj.get("num_rows"), obj.get("global_batch_size"), obj.get("epochs"), obj.get("seed"))
    if obj.get("algorithm") != ALGORITHM or [list(s) for s in plan.steps] != obj.get("steps"):
        raise InputError(where, "steps do not match the plan its seed, global batch size and epochs generate")
    return plan


def load_published_plan(path: Path, sha256: str) -> BatchPlan:
    """The plan published at `path`, read once and checked against the sha the lineage recorded
    (and its sidecar) before it is parsed, then against the plan its own seed, G and epochs
    generate: a plan file changed after publication is refused by name."""
    from value_assets.core.publish import read_published

    obj, _ = read_published(path, "batch plan", expected_sha=sha256)
    return plan_from_json(obj, str(path))


def check_plan_covers(
    plan: BatchPlan, num_rows: int, *, where: str, global_batch_size: int, epochs: int, seed: int
) -> None:
    """A published plan trains a run only if it was made for this train split (same row count)
    and the run's settings name the same G, epochs and seed."""
    if plan.num_rows != num_rows:
        raise InputError(where, f"plans {plan.num_rows} rows, but the validated train split has {num_rows}")
    for name, mine, planned in (
        ("global_batch_size", global_batch_size, plan.global_batch_size),
        ("epochs", epochs, plan.epochs),
        ("seed", seed, plan.seed),
    ):
        if mine != planned:
            raise InputError(name, f"{mine} differs from the published plan's {planned} ({where})")
