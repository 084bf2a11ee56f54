"""`make demo`: the whole asset graph, through Dagster, for a learnable manifest and its
shuffled-label control, on the embedded default (SQLite instance in `.dagster_home/`, the GPU job
as a local subprocess on CPU with the tiny backbone).

Steps: write both demo manifests into the watched folder (`manifests/`), tick the manifest sensor
once as the daemon would (it registers each manifest as a partition and requests the full job),
execute each requested run in this process against the instance, then print one line per lineage.
`make ui` opens the same instance, so both lineages, their checks and plots are there to see.
Re-running is idempotent: the same bytes are the same partitions, the critic resumes (nothing
left to do), the report is reused and promotion re-verified.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

from value_assets.core import vocabulary as v
from value_assets.definitions import project_root, resources_by_deployment_name


def _home(root: Path) -> Path:
    home = Path(os.environ.get("DAGSTER_HOME") or root / ".dagster_home")
    home.mkdir(parents=True, exist_ok=True)
    if not (home / "dagster.yaml").exists():
        shutil.copy(root / "dagster.yaml", home / "dagster.yaml")
    os.environ["DAGSTER_HOME"] = str(home)
    return home


def main() -> int:
    t0 = time.monotonic()
    # The GPU job subprocesses inherit this: megatron's "no Transformer Engine/Apex" warnings are noise here.
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    root = project_root()
    home = _home(root)
    from dagster import DagsterInstance, build_sensor_context

    from value_assets.core.demo_data import make_demo_data
    from value_assets.definitions import make_definitions
    from value_assets.sensors import manifest_sensor

    resources = resources_by_deployment_name()["local"]
    inbox = Path(resources["inbox"].folder)
    artifacts = Path(resources["artifacts"].root)
    manifests = [make_demo_data(inbox, seed=0), make_demo_data(inbox, seed=0, shuffle_labels=True)]
    print(f"demo manifests in {inbox}: {', '.join(p.name for p in manifests)}", flush=True)

    instance = DagsterInstance.get()
    defs = make_definitions(resources)
    result = manifest_sensor(build_sensor_context(instance=instance, resources=resources))
    for request in result.dynamic_partitions_requests or []:
        instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
    wanted = {str(p.resolve()) for p in manifests}
    requests = [r for r in result.run_requests if r.tags.get("value_assets/manifest") in wanted]
    if len(requests) != len(manifests):
        print(
            f"value-assets demo: the sensor requested {len(requests)} runs for {len(manifests)} demo manifests",
            file=sys.stderr,
        )
        return 1

    rows = []
    try:
        _run_lineages(defs, instance, requests, artifacts, rows)
    finally:
        resources["launcher"].stop_warm_cluster(instance)  # the warm Ray cluster the GPU steps shared
    return _print_rows(rows, requests, home, artifacts, t0)


def _run_lineages(defs, instance, requests, artifacts: Path, rows: list) -> None:
    from value_assets.lineage import Lineage

    for request in sorted(requests, key=lambda r: r.tags["value_assets/manifest"]):
        key = request.partition_key
        print(f"\n=== {key}: full job (validate -> plan -> train -> evaluate -> gate -> promote) ===", flush=True)
        t = time.monotonic()
        run = defs.resolve_job_def("full").execute_in_process(
            instance=instance,
            partition_key=key,
            raise_on_error=False,
            # The sensor's run config (the lineage's training spec: core/demo_data.DEMO_TRAINING), quieter.
            run_config={**request.run_config, "loggers": {"console": {"config": {"log_level": "CRITICAL"}}}},
            tags={**request.tags, "dagster/run_key": request.run_key or key},
        )
        if not run.success:
            failed = sorted({e.step_key for e in run.all_events if e.is_step_failure})
            print(
                f"    run {run.run_id[:8]} stopped at {failed} (for the shuffled control this is the blocking gate at "
                "work)",
                flush=True,
            )
        gate = {e.check_name: e.passed for e in run.get_asset_check_evaluations()}.get(v.EV_GATE)
        lineage = Lineage(instance, key)
        manifest_meta = lineage.metadata(v.VALUE_MANIFEST) or {}
        ckpt = lineage.metadata(v.CRITIC_CHECKPOINT) or {}
        report = lineage.metadata(v.EV_REPORT) or {}
        promotion = lineage.metadata(v.PROMOTED_CRITIC) or {}
        record = artifacts / "registry" / f"{key}.json"
        rows.append(
            {
                "partition": key,
                "manifest_sha12": str(manifest_meta.get(v.MANIFEST_SHA256, ""))[:12],
                "steps": ckpt.get("steps"),
                "contract_sha12": str(ckpt.get(v.CONTRACT_SHA256, ""))[:12],
                "token_ev": report.get("token_ev"),
                "trajectory_ev": report.get("trajectory_ev"),
                "optimal_ev": json.loads(Path(request.tags["value_assets/manifest"]).read_text())["provenance"][
                    "bayes_optimal_trajectory_ev_heldout"
                ],
                "gate": {True: "PASSED", False: "FAILED", None: "not run"}[gate],
                "token_ev_low": report.get("token_ev_low"),
                "trajectory_ev_low": report.get("trajectory_ev_low"),
                "promoted": record.is_file(),
                "record": record,
                "record_sha256": promotion.get(v.REGISTRY_RECORD_SHA256),
                "seconds": time.monotonic() - t,
            }
        )


def _lowest(row: dict):
    lows = [row[k] for k in ("token_ev_low", "trajectory_ev_low") if row.get(k) is not None]
    return min(lows) if lows else None


def _print_rows(rows: list, requests, home: Path, artifacts: Path, t0: float) -> int:
    def f(v, spec=".3f"):
        return "-" if v is None else format(v, spec)

    print(f"\nvalue_assets demo: {len(rows)} lineages, instance {home}, artifacts {artifacts}\n")
    hdr = (
        f"{'partition':<30} {'manifest':<12} {'steps':>5} {'contract':<12} {'token EV':>8} {'traj EV':>8} {'low':>8} "
        f"{'optimal':>8} {'gate':<7} {'promotion':<9} {'time':>6}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(
            f"{r['partition']:<30} {r['manifest_sha12']:<12} {f(r['steps'], 'd'):>5} {r['contract_sha12']:<12} "
            f"{f(r['token_ev']):>8} {f(r['trajectory_ev']):>8} {f(_lowest(r), '.4f'):>8} {f(r['optimal_ev']):>8} "
            f"{r['gate']:<7} {'promoted' if r['promoted'] else 'refused':<9} {r['seconds']:>5.0f}s"
        )
    print(
        "\nlow: the lower of the two 95% interval bounds (token, trajectory); the gate (mode 'interval') needs it > 0"
    )
    print(f"artifacts: {artifacts}/<partition>/{{plan,critic,reports}}, promotion records: {artifacts}/registry/")
    for r in rows:
        if r["promoted"] and r["record_sha256"]:  # the RL side's settings, from the record pinned in the instance
            print(f"hand-off: .venv/bin/value-assets handoff {r['record']} --record-sha256 {r['record_sha256']}")
    print(
        f"total {time.monotonic() - t0:.0f}s; `make ui` shows both lineages, the checks and the plots on http://127.0.0.1:3000"
    )
    by_name = {
        Path(r.tags["value_assets/manifest"]).stem: row
        for r, row in zip(sorted(requests, key=lambda r: r.tags["value_assets/manifest"]), rows, strict=True)
    }
    ok = by_name["demo"]["promoted"] and not by_name["demo-shuffled"]["promoted"]
    if not ok:
        print(
            "value-assets demo: expected the learnable critic promoted and the shuffled control refused",
            file=sys.stderr,
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
