"""Ray placement group and worker lifecycle for the GPU job.

`start_workers` reserves one bundle per GPU (per CPU slot without GPUs), starts one `CriticWorker`
per bundle, wires torch.distributed between them and yields a `Cluster`. Everything it started is
ended in its `finally`, on success and on failure alike; every wait has a deadline.

Ranks follow `rank_order` (node address, node id, bundle index); the rendezvous is rank 0's node
address as that worker reports it, on one node and on many alike.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from value_assets.core.jobs import PLACEMENT_STRATEGIES

DEFAULT_TIMEOUT_S = 900.0


class ClusterError(RuntimeError):
    """The cluster could not be reserved or a worker failed."""


@dataclass
class Cluster:
    workers: list[Any]
    infos: list[dict[str, Any]]
    timeout_s: float
    rendezvous: str = ""  # host:port of rank 0's torch.distributed store

    @property
    def world_size(self) -> int:
        return len(self.workers)

    @property
    def dp(self) -> int:
        return self.infos[0]["dp_size"]

    def placement(self) -> dict[str, Any]:
        """Where the ranks run (JSON): the rendezvous and each rank's node id and address."""
        return {"rendezvous": self.rendezvous,
                "ranks": [{k: info[k] for k in ("rank", "node_id", "node_address")} for info in self.infos]}

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `method` with the same arguments on every rank; results in rank order."""
        return self._get([getattr(w, method).remote(*args, **kwargs) for w in self.workers], None)

    def call_each(self, method: str, per_rank: Sequence[tuple[tuple, dict]], deadline_s: float | None = None) -> list[Any]:
        """Call `method` with rank-specific (args, kwargs)."""
        return self._get([getattr(w, method).remote(*a, **k) for w, (a, k) in zip(self.workers, per_rank)], deadline_s)

    def _get(self, refs, timeout_s):
        import ray

        try:
            return ray.get(refs, timeout=timeout_s or self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise ClusterError(f"workers did not answer within {timeout_s or self.timeout_s:.0f} s") from None


def _start_reaper() -> subprocess.Popen | None:
    """A watchdog that ends the local Ray this driver started if the driver dies without its
    `finally` (SIGKILL); see reaper.py. Best effort: None where Ray's process list is unavailable."""
    import ray

    from value_assets.gpu.runtime import reaper

    try:
        node = ray._private.worker._global_node
        pids = [str(info.process.pid) for infos in node.all_processes.values() for info in infos]
    except AttributeError:
        return None
    # Its own session: a Ctrl-C to the driver's process group must not stop it before it acts.
    return subprocess.Popen([sys.executable, reaper.__file__, *pids], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def _use_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _address_key(address: str) -> tuple:
    """Sort key of a node address: numeric for IP addresses (127.0.0.2 before 127.0.0.10)."""
    try:
        ip = ipaddress.ip_address(address)
        return (0, ip.version, int(ip))
    except ValueError:
        return (1, 0, address)


def rank_order(bundle_nodes: Sequence[str], node_addresses: dict[str, str]) -> list[int]:
    """The bundle index of each rank: bundles sorted by (node address, node id, bundle index).

    Megatron builds its groups from consecutive ranks, tensor-parallel groups first: with the
    ranks of one node contiguous, a tensor-parallel group (the most communication-heavy, every
    layer) stays inside one node and its NVLink, and only data-parallel and pipeline traffic
    crosses nodes. Sorting by address (then node id, for several nodes on one host) also makes
    rank 0, whose node address is the rendezvous, the same node for the same cluster and
    placement, whatever order Ray listed the bundles in.

    `bundle_nodes[i]` is the node id of bundle i; `node_addresses` maps node id to address.
    """
    return sorted(range(len(bundle_nodes)),
                  key=lambda b: (_address_key(node_addresses[bundle_nodes[b]]), bundle_nodes[b], b))


def _bundle_ranks(pg, world_size: int) -> list[int]:
    """`rank_order` for a ready placement group, from Ray's view of bundles and nodes."""
    import ray
    from ray.util.placement_group import placement_group_table

    table = placement_group_table(pg)["bundles_to_node_id"]
    addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    return rank_order([table[b] for b in range(world_size)], addresses)


@contextlib.contextmanager
def start_workers(*, world_size: int, tp: int, pp: int, seed: int, backbone: dict[str, Any], objective: dict[str, Any],
                  train: bool, lr: float = 1e-4, weight_decay: float = 0.0, clip_grad: float = 1.0,
                  ray_address: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, log=print,
                  memory: dict[str, Any] | None = None, freeze: str = "none", placement_strategy: str = "PACK") -> Iterator[Cluster]:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from value_assets.gpu.runtime.worker import CriticWorker

    started_ray = False
    reaper = None
    pg = None
    actors: list[Any] = []
    try:
        ray_address = ray_address or os.environ.get("RAY_ADDRESS")  # set inside a submitted Ray job
        if not ray.is_initialized():
            if ray_address:
                ray.init(address=ray_address, log_to_driver=True)
            else:
                cpus = max(world_size, os.cpu_count() or 1)
                # Worker output stays in Ray's session logs; failures reach the driver as exceptions.
                ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
                reaper = _start_reaper()
            started_ray = True
        # GPU bundles where the cluster has GPUs; CPU slots otherwise (laptop, CI).
        use_gpu = ray.cluster_resources().get("GPU", 0) > 0 if ray_address else _use_gpu()
        bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
        if placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"placement_strategy must be one of {PLACEMENT_STRATEGIES}, got {placement_strategy!r}")
        pg = placement_group([dict(bundle) for _ in range(world_size)], strategy=placement_strategy)
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
        if not ready:
            raise ClusterError(f"could not reserve {world_size} x {bundle} ({placement_strategy}) within {timeout_s:.0f} s "
                               f"(cluster resources: {ray.cluster_resources()})")
        threads = None if use_gpu else max(1, (os.cpu_count() or 1) // world_size)
        remote_cls = ray.remote(CriticWorker)
        for rank, bundle_index in enumerate(_bundle_ranks(pg, world_size)):
            actors.append(remote_cls.options(
                num_cpus=1, num_gpus=1 if use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle_index),
            ).remote(rank=rank, world_size=world_size, tp=tp, pp=pp, seed=seed, backbone=backbone, objective=objective, threads=threads,
                              memory=memory, freeze=freeze))
        cluster = Cluster(workers=actors, infos=[], timeout_s=timeout_s)
        addr, port = cluster._get([actors[0].address.remote()], timeout_s)[0]
        cluster.rendezvous = f"{addr}:{port}"
        cluster.infos = cluster.call_all("setup", addr, port, train=train, lr=lr, weight_decay=weight_decay, clip_grad=clip_grad, timeout_s=timeout_s)
        nodes = len({info["node_id"] for info in cluster.infos})
        log(f"workers up: world {world_size}, dp {cluster.dp}, tp {tp}, pp {pp}, {'GPU' if use_gpu else 'CPU'} bundles "
            f"on {nodes} node(s) ({placement_strategy}), rendezvous {addr}:{port}")
        log("placement " + json.dumps(cluster.placement(), sort_keys=True))
        yield cluster
    finally:
        if actors:
            try:
                ray.get([a.shutdown.remote() for a in actors], timeout=60)
            except Exception:  # noqa: BLE001 - teardown must go on; the actors are killed next
                pass
            for a in actors:
                with contextlib.suppress(Exception):
                    ray.kill(a)
        if pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
        if started_ray:
            ray.shutdown()
        if reaper is not None:
            reaper.stdin.close()  # EOF: it ends whatever of this Ray is still running, then exits
            with contextlib.suppress(subprocess.TimeoutExpired):
                reaper.wait(timeout=30)
