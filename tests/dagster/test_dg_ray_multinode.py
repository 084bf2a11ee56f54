"""The Ray launcher for real, on a real two-node Ray cluster on one machine: the GPU job (tiny
backbone, gloo) submitted through the Ray launcher (dagster-ray's Pipes job client) from a real
Dagster materialization of `critic_training`, its placement group spread over both nodes; then the
whole `full` job through the same launcher with the Pipes stand-in as the GPU command, its messages
read back from the job logs by dagster-ray's reader.

The nodes are two raylets with distinct loopback addresses (head 127.0.0.3, second node 127.0.0.2,
so rank 0 must be on the node that is *not* the driver's). Both are started with `ray start`
(no `--block`) under a private temp folder and stopped by process id in a `finally`: processes
whose command line names that folder, and their descendants. Never `ray stop`, which would hit
every Ray on the machine.

Ray refuses to join a second node with `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, and with `=1` it
rewrites a bootstrap address of 127.0.0.1 to the machine's network address; hence `=1` only for
the second `ray start`, explicit 127.0.0.x addresses everywhere, and a head that is not 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.dagster.processes import RAY, free_port, stop_ray
from value_assets.core.demo_data import make_demo_data
from value_assets.core.job_configs import TrainJob
from value_assets.gpu.workers.cluster import rank_order

ROOT = Path(__file__).resolve().parents[2]
STANDIN = Path(__file__).resolve().with_name("pipes_standin.py")
HEAD_IP, SECOND_IP = "127.0.0.3", "127.0.0.2"  # the second node sorts first: rank 0 is not on the head
ROWS, G, STEPS = 16, 8, 2


def test_rank_order_groups_nodes_by_address():
    nodes = ["n-b", "n-a", "n-b", "n-c", "n-a"]
    addresses = {"n-a": "127.0.0.10", "n-b": "127.0.0.2", "n-c": "127.0.0.2"}
    # 127.0.0.2 before 127.0.0.10 (numeric); n-b before n-c on the same address; bundle order inside a node
    assert rank_order(nodes, addresses) == [0, 2, 3, 1, 4]


pytestmark = pytest.mark.system


def test_placement_strategy_is_a_validated_job_setting(tmp_path):
    from value_assets.core.errors import InputError

    assert TrainJob(manifest=tmp_path / "m.json", output=tmp_path / "c").placement_strategy == "PACK"
    job = TrainJob(manifest=tmp_path / "m.json", output=tmp_path / "c", placement_strategy="STRICT_SPREAD")
    assert TrainJob.from_json(job.to_json()) == job
    with pytest.raises(InputError, match="placement_strategy.*SPREAD.*got 'spread'"):
        TrainJob(manifest=tmp_path / "m.json", output=tmp_path / "c", placement_strategy="spread")


class TwoNodeRay:
    """`ray start --head` and `ray start --address` under one private temp folder."""

    def __init__(self):
        self.root = tempfile.mkdtemp(prefix="rmn", dir="/tmp")  # short: Ray's socket paths are capped
        self.gcs = f"{HEAD_IP}:{free_port(HEAD_IP)}"
        self.dashboard = f"http://127.0.0.1:{free_port()}"
        self.env = {
            **os.environ,
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "RAY_AUTH_MODE": "disabled",
            "PYTHONPATH": str(ROOT),
        }

    def _ray_start(self, args: list[str], env: dict[str, str]) -> None:
        out = subprocess.run(
            [
                str(RAY),
                "start",
                "--num-cpus",
                "2",
                "--disable-usage-stats",
                "--dashboard-agent-listen-port",
                str(free_port()),
                *args,
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        if out.returncode:
            raise RuntimeError(
                f"ray start {' '.join(args)} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
            )

    def start(self) -> None:
        port = self.dashboard.rsplit(":", 1)[1]
        self._ray_start(
            [
                "--head",
                "--node-ip-address",
                HEAD_IP,
                "--port",
                self.gcs.rsplit(":", 1)[1],
                "--ray-client-server-port",
                str(free_port(HEAD_IP)),
                "--temp-dir",
                f"{self.root}/head",
                "--include-dashboard",
                "true",
                "--dashboard-port",
                port,
            ],
            self.env,
        )
        self._ray_start(
            ["--address", self.gcs, "--node-ip-address", SECOND_IP, "--temp-dir", f"{self.root}/second"],
            {**self.env, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"},
        )
        deadline = time.monotonic() + 120
        while len(self.nodes()) < 2:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the second node did not join within 120 s: {self.nodes()}")
            time.sleep(0.2)

    def nodes(self) -> dict[str, str]:
        """Alive node id -> address, from the dashboard's state API."""
        import urllib.request

        with urllib.request.urlopen(f"{self.dashboard}/api/v0/nodes?limit=10", timeout=30) as r:
            rows = json.load(r)["data"]["result"]["result"]
        return {n["node_id"]: n["node_ip"] for n in rows if n["state"] == "ALIVE"}

    def stop(self) -> list[int]:
        try:
            return stop_ray(self.root, self.gcs)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def _placement(instance, run_id: str) -> dict:
    """The workers' placement the GPU job logged (`cluster.start_workers`), read from Dagster's event log."""
    for record in instance.all_logs(run_id):
        message = record.user_message or ""
        if message.startswith("placement {"):
            return json.loads(message[len("placement ") :])
    raise AssertionError("the GPU job logged no placement")


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_ray_launcher_spreads_a_job_over_two_nodes_and_runs_the_full_job(
    ray_cluster, instance, test_resources, manifests_dir, register, write_manifest, tmp_path
):
    from dagster import materialize

    from value_assets.assets import batch_plan, critic_training, train_dataset, value_manifest
    from value_assets.definitions import make_definitions
    from value_assets.gpu.drivers.train import train
    from value_assets.lineage import Lineage
    from value_assets.resources import RayJobLauncher

    training = {
        "schema": "value-assets.training.v1",
        "backbone": "tiny",
        "plan": {"global_batch_size": G, "epochs": 1, "seed": 0},
        "train": {"gpus": 2, "placement_strategy": "SPREAD"},
    }
    manifest = make_demo_data(manifests_dir, rows=ROWS, heldout_rows=8, seed=0, training=training)

    # One node: the same settings, PACK, on this test process's Ray (the session's `ray_cluster`, whose
    # worker pool later job tests reuse), before the two-node cluster starts.
    one_node_losses = train(
        TrainJob(
            manifest=manifest,
            output=tmp_path / "one_node",
            global_batch_size=G,
            epochs=1,
            seed=0,
            gpus=2,
            placement_strategy="PACK",
            timeout_s=300,
        ),
        log=lambda _m: None,
    ).losses
    assert len(one_node_losses) == STEPS
    cluster = TwoNodeRay()
    try:
        cluster.start()
        nodes = cluster.nodes()
        assert sorted(nodes.values()) == [SECOND_IP, HEAD_IP], nodes
        launcher = RayJobLauncher(
            address=cluster.dashboard,
            python=sys.executable,
            env={"PYTHONPATH": str(ROOT), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"},
            poll_interval_s=0.1,
            entrypoint_num_cpus=0,
            timeout_s=360,
        )
        resources = {**test_resources, "launcher": launcher}
        (key,) = register(instance, resources, manifest)
        result = materialize(
            [value_manifest, train_dataset, batch_plan, critic_training],
            instance=instance,
            resources=resources,
            partition_key=key,
            raise_on_error=False,
        )
        assert result.success, [e.message for e in result.all_events if e.is_failure]
        placement = _placement(instance, result.run_id)

        # The whole graph (training, evaluation, gate, promotion) through the same launcher, the
        # stand-in as the GPU command: every step's Pipes messages come back through Ray's job logs.
        standin = RayJobLauncher(
            address=cluster.dashboard,
            command=[sys.executable, str(STANDIN)],
            env={"PYTHONPATH": str(ROOT), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"},
            poll_interval_s=0.1,
            entrypoint_num_cpus=0,
        )
        (full_key,) = register(instance, test_resources, write_manifest(manifests_dir, "onray", standin={"ev": 0.5}))
        full = (
            make_definitions({**test_resources, "launcher": standin})
            .resolve_job_def("full")
            .execute_in_process(instance=instance, partition_key=full_key, raise_on_error=False)
        )
        assert full.success, [e.message for e in full.all_events if e.is_failure]
    finally:
        left = cluster.stop()
    assert not left, f"processes that outlived SIGKILL: {left}"
    assert (
        Lineage(instance, full_key).metadata("critic_checkpoint")["steps"]
        == Lineage(instance, full_key).metadata("batch_plan")["steps"]
        >= 1
    )
    assert Lineage(instance, full_key).metadata("ev_report")["token_ev"] == pytest.approx(0.5)

    ranks = placement["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    # one worker per node, ordered by node address; the rendezvous is rank 0's node, not the driver's
    assert {r["node_id"] for r in ranks} == set(nodes), (ranks, nodes)
    assert [r["node_address"] for r in ranks] == [SECOND_IP, HEAD_IP]
    assert all(nodes[r["node_id"]] == r["node_address"] for r in ranks)
    host, port = placement["rendezvous"].rsplit(":", 1)
    assert host == ranks[0]["node_address"] == SECOND_IP and int(port) > 0

    (meta,) = [
        m.metadata
        for m in result.asset_materializations_for_node("critic_training")
        if m.asset_key.to_user_string() == "critic_checkpoint"
    ]
    assert meta["steps"].value == STEPS
    # The job's own per-step log (full precision), named in the materialization's metadata.
    records = [json.loads(line) for line in Path(meta["metrics_log"].value).read_text().splitlines() if line.strip()]
    losses = [r["loss"] for r in records]
    assert losses == pytest.approx(one_node_losses, abs=1e-6), (losses, one_node_losses)
