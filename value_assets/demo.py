"""`make demo`: the whole asset graph, through Dagster, for a learnable manifest and its
shuffled-label control, on the embedded default (SQLite instance in `.dagster_home/`, the GPU job
as a local subprocess on CPU with the tiny backbone).

Steps: write both demo manifests into the watched folder (`manifests/`; their training spec is
`core/demo_data.DEMO_TRAINING`: the tiny backbone, the interval gate), then `run_inbox`: tick the
manifest sensor once as the daemon would (it registers each manifest as a partition and requests the
full job for each partition no run has touched yet), execute each requested run in this process
against the instance, and print one line per lineage from what the instance holds. `make ui` opens
the same instance, so both lineages, their checks and plots are there to see, and its daemon starts
no second run for them. Re-running is idempotent: the same bytes are the same partitions, already
run, so nothing runs again and the table shows them as they are.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from value_assets.core import vocabulary as v
from value_assets.definitions import project_root, resources_for


def main() -> int:
    t0 = time.monotonic()
    # The GPU job subprocesses inherit this: megatron's "no Transformer Engine/Apex" warnings are noise here.
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    from value_assets.run_inbox import lineage_state, run_inbox, use_home

    home = use_home(project_root())
    from dagster import DagsterInstance

    from value_assets.core.demo_data import make_demo_data
    from value_assets.core.hashing import sha256_file
    from value_assets.partitions import partition_key_for

    resources = resources_for("local")
    inbox = Path(resources["inbox"].folder)
    artifacts = Path(resources["artifacts"].root).resolve()
    manifests = [make_demo_data(inbox, seed=0), make_demo_data(inbox, seed=0, shuffle_labels=True)]
    print(f"demo manifests in {inbox}: {', '.join(p.name for p in manifests)}", flush=True)
    wanted = {p.resolve() for p in manifests}
    instance = DagsterInstance.get()
    ran = {s.partition_key: s for s in run_inbox(instance, resources, only=lambda p: p.resolve() in wanted,
                                                 say=lambda m: print(m, flush=True))}  # fmt: skip
    states = []
    for path in sorted(manifests):
        key = partition_key_for(path, sha256_file(path))
        states.append(ran.get(key) or lineage_state(instance, artifacts, key, path))
    return _print(states, home, artifacts, t0)


def _row(state) -> dict:
    meta = state.metadata
    report, ckpt = meta[v.EV_REPORT], meta[v.CRITIC_CHECKPOINT]
    lows = [report[k] for k in ("token_ev_low", "trajectory_ev_low") if report.get(k) is not None]
    optimal = json.loads(state.manifest.read_text())["provenance"]["bayes_optimal_trajectory_ev_heldout"]
    return {
        "partition": state.partition_key,
        "manifest_sha12": str(meta[v.VALUE_MANIFEST].get(v.MANIFEST_SHA256, ""))[:12],
        "steps": ckpt.get("steps"),
        "contract_sha12": str(ckpt.get(v.CONTRACT_SHA256, ""))[:12],
        "token_ev": report.get("token_ev"),
        "trajectory_ev": report.get("trajectory_ev"),
        "low": min(lows) if lows else None,
        "optimal_ev": optimal,
        "gate": {True: "PASSED", False: "FAILED", None: "not run"}[state.gate],
        "promoted": state.promoted,
        "when": f"{state.seconds:5.0f}s" if state.ran_now else "earlier",
    }


def _print(states: list, home: Path, artifacts: Path, t0: float) -> int:
    def f(value, spec=".3f"):
        return "-" if value is None else format(value, spec)

    rows = [_row(s) for s in states]
    print(f"\nvalue_assets demo: {len(rows)} lineages, instance {home}, artifacts {artifacts}\n")
    hdr = (
        f"{'partition':<30} {'manifest':<12} {'steps':>5} {'contract':<12} {'token EV':>8} {'traj EV':>8} {'low':>8} "
        f"{'optimal':>8} {'gate':<7} {'promotion':<9} {'run':>7}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(
            f"{r['partition']:<30} {r['manifest_sha12']:<12} {f(r['steps'], 'd'):>5} {r['contract_sha12']:<12} "
            f"{f(r['token_ev']):>8} {f(r['trajectory_ev']):>8} {f(r['low'], '.4f'):>8} {f(r['optimal_ev']):>8} "
            f"{r['gate']:<7} {'promoted' if r['promoted'] else 'refused':<9} {r['when']:>7}"
        )
    print(
        "\nlow: the lower of the two 95% interval bounds (token, trajectory); the gate (mode 'interval') needs it > 0"
    )
    print(f"artifacts: {artifacts}/<partition>/{{plan,critic,reports}}, promotion records: {artifacts}/registry/")
    for state in states:
        command = state.handoff_command(".venv/bin/value-assets")
        if command:  # the RL side's settings, from the record pinned in the instance
            print(f"hand-off: {command}")
    print(f"total {time.monotonic() - t0:.0f}s; `make ui` shows both lineages, the checks and the plots on "
          "http://127.0.0.1:3000")  # fmt: skip
    by_name = {s.manifest.stem: s for s in states}
    ok = by_name["demo"].promoted and not by_name["demo-shuffled"].promoted
    if not ok:
        print(
            "value-assets demo: expected the learnable critic promoted and the shuffled control refused",
            file=sys.stderr,
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
