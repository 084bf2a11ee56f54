"""Process the watched manifest folder once, without the daemon: `value-assets run-manifests`.

Ticks the manifest sensor against the Dagster instance (as the daemon would: it registers each new
manifest with its training spec, and requests a `full` run for each partition no run has touched),
executes each requested run in this process, and says per lineage what happened: the gate, whether
it was promoted, and the command that verifies its hand-off for the RL side. `make demo` is this,
on the demo's two manifests. `make ui` shows the same instance; its daemon's sensor starts nothing
for partitions these runs already ran (docs/rules.md#promotion).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from value_assets.core import vocabulary as v


@dataclass(frozen=True)
class LineageState:
    """What the instance holds for one lineage: the last run of this call (if any), its gate and
    promotion, and the latest metadata of every asset."""

    partition_key: str
    manifest: Path
    ran_now: bool
    run_id: str | None  # the run of this call; None: none ran now
    success: bool | None
    failed_steps: tuple[str, ...]
    gate: bool | None  # the latest ev_gate evaluation; None: none yet
    promoted: bool
    registry_record: Path
    record_sha256: str | None
    metadata: Mapping[str, Mapping[str, Any]]  # asset name -> its latest metadata values
    seconds: float
    # Why the run of this call stopped, when that was bad input or a write the system refused (a
    # step's refusal, or the GPU job's "invalid input"): the command exits 2 with it; None otherwise.
    refusal: str | None = None

    def handoff_command(self, program: str = "value-assets") -> str | None:
        """The command that verifies this lineage's hand-off against its pinned record."""
        if not (self.promoted and self.record_sha256):
            return None
        return f"{program} handoff {self.registry_record} --record-sha256 {self.record_sha256}"


def lineage_state(instance: Any, artifacts: Path, key: str, manifest: Path, **run: Any) -> LineageState:
    from value_assets.lineage import Lineage

    lineage = Lineage(instance, key)
    metadata = {name: lineage.metadata(name) or {} for name in v.ASSETS}
    gate = lineage.last_gate()
    record = artifacts / "registry" / f"{key}.json"
    promotion = metadata[v.PROMOTED_CRITIC]
    return LineageState(
        partition_key=key,
        manifest=manifest,
        ran_now=bool(run),
        run_id=run.get("run_id"),
        success=run.get("success"),
        failed_steps=run.get("failed_steps", ()),
        gate=None if gate is None else gate.passed,
        promoted=bool(promotion) and record.is_file(),
        registry_record=record,
        record_sha256=promotion.get(v.REGISTRY_RECORD_SHA256),
        metadata=metadata,
        seconds=run.get("seconds", 0.0),
        refusal=run.get("refusal"),
    )


# The GPU job's log line for bad input (gpu/pipes_job.py), which it then exits 2 on.
GPU_REFUSAL_PREFIX = "invalid input: "


def run_refusal(instance: Any, run_id: str) -> str | None:
    """The refusal a failed run stopped on: a step's failure marked as one (assets/common.py
    `fail_on_bad_input`: bad input, or a write the system refused), else the GPU job's own
    "invalid input" log line; None when the run failed some other way (a bug)."""
    from dagster import DagsterEventType

    from value_assets.assets.common import REFUSAL_METADATA_KEY

    for record in instance.all_logs(run_id, of_type=DagsterEventType.STEP_FAILURE):
        data = record.dagster_event.step_failure_data
        user = getattr(data, "user_failure_data", None)
        if user is not None and REFUSAL_METADATA_KEY in (user.metadata or {}):
            return user.description
    for record in instance.all_logs(run_id):
        message = record.user_message or ""
        if GPU_REFUSAL_PREFIX in message:
            return message.split(GPU_REFUSAL_PREFIX, 1)[1].strip()
    return None


def use_home(project: Path) -> Path:
    """The Dagster instance folder: $DAGSTER_HOME, else `.dagster_home` in the project, with the
    project's instance template copied in once; exported for Dagster."""
    home = Path(os.environ.get("DAGSTER_HOME") or project / ".dagster_home").resolve()
    home.mkdir(parents=True, exist_ok=True)
    template = project / "deploy" / "dagster.yaml"
    if not (home / "dagster.yaml").exists() and template.is_file():
        shutil.copy(template, home / "dagster.yaml")
    os.environ["DAGSTER_HOME"] = str(home)
    return home


def run_inbox(
    instance: Any,
    resources: Mapping[str, Any],
    *,
    only: Callable[[Path], bool] = lambda _path: True,
    say: Callable[[str], None] = print,
) -> list[LineageState]:
    """Tick the sensor once and run, in process, every `full` run it requests for a manifest that
    `only` accepts; the state of each lineage run, in manifest order. The local launcher's warm Ray
    cluster serves every GPU step and is stopped at the end."""
    from dagster import build_sensor_context

    from value_assets.definitions import make_definitions
    from value_assets.sensors import manifest_sensor

    defs = make_definitions(resources)
    tick = manifest_sensor(build_sensor_context(instance=instance, resources=resources))
    for request in getattr(tick, "dynamic_partitions_requests", None) or []:
        instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
    skip = getattr(tick, "skip_reason", None)
    if skip is not None and skip.skip_message:
        say(f"sensor: {skip.skip_message}")
    requests = sorted(
        (r for r in getattr(tick, "run_requests", None) or [] if only(Path(r.tags["value_assets/manifest"]))),
        key=lambda r: r.tags["value_assets/manifest"],
    )
    artifacts = Path(resources["artifacts"].root).resolve()
    states = []
    try:
        for request in requests:
            key = request.partition_key
            say(f"\n=== {key}: full job (validate -> plan -> train -> evaluate -> gate -> promote) ===")
            started = time.monotonic()
            run = defs.resolve_job_def("full").execute_in_process(
                instance=instance,
                partition_key=key,
                raise_on_error=False,
                # The sensor's run config (the lineage's training spec), quieter on the console.
                run_config={**request.run_config, "loggers": {"console": {"config": {"log_level": "CRITICAL"}}}},
                tags={**request.tags, "dagster/run_key": request.run_key or key},
            )
            failed = tuple(sorted({e.step_key for e in run.all_events if e.is_step_failure and e.step_key}))
            if not run.success:
                say(f"    run {run.run_id[:8]} stopped at {list(failed)}")
            manifest = Path(request.tags["value_assets/manifest"])
            seconds = time.monotonic() - started
            refusal = None if run.success else run_refusal(instance, run.run_id)
            states.append(
                lineage_state(
                    instance,
                    artifacts,
                    key,
                    manifest,
                    run_id=run.run_id,
                    success=run.success,
                    failed_steps=failed,
                    seconds=seconds,
                    refusal=refusal,
                )
            )
    finally:
        stop = getattr(resources["launcher"], "stop_warm_cluster", None)
        if stop is not None:
            stop(instance)  # the local launcher's warm Ray cluster, which the GPU steps shared
    return states
