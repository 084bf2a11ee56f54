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
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from value_assets.core.errors import InfrastructureError, InputError
from value_assets.core.job_configs import PLACEMENT_STRATEGIES
from value_assets.core.warm_folder import POOL_ENV
from value_assets.core.worker_spec import WorkerSpec


class ClusterError(InfrastructureError):
    """The cluster could not be reserved, or a worker died or did not answer in time."""


@dataclass
class Cluster:
    workers: list[Any]
    infos: list[dict[str, Any]]
    timeout_s: float
    rendezvous: str = ""  # host:port of rank 0's torch.distributed store
    in_flight: bool = False  # a call was made that has not returned on every rank

    @property
    def world_size(self) -> int:
        return len(self.workers)

    @property
    def dp(self) -> int:
        return self.infos[0]["dp_size"]

    def placement(self) -> dict[str, Any]:
        """Where the ranks run (JSON): the rendezvous and each rank's node id and address."""
        return {
            "rendezvous": self.rendezvous,
            "ranks": [{k: info[k] for k in ("rank", "node_id", "node_address", "pid")} for info in self.infos],
        }

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `method` with the same arguments on every rank; results in rank order."""
        return self._get([getattr(w, method).remote(*args, **kwargs) for w in self.workers], None, method)

    def call_each(
        self, method: str, per_rank: Sequence[tuple[tuple, dict]], deadline_s: float | None = None
    ) -> list[Any]:
        """Call `method` with rank-specific (args, kwargs)."""
        return self._get(
            [getattr(w, method).remote(*a, **k) for w, (a, k) in zip(self.workers, per_rank, strict=True)],
            deadline_s,
            method,
        )

    def _get(self, refs, timeout_s, method: str = "a call"):
        """The results of `refs` (one call per rank, in rank order). A worker that died (killed by
        the OOM killer, a crash) is a ClusterError naming its rank, pid and the call, whichever rank's
        error came first: its peers then fail too, in a collective with a dead rank."""
        import ray

        self.in_flight = True
        try:
            results = ray.get(refs, timeout=timeout_s or self.timeout_s)
            self.in_flight = False
            return results
        except ray.exceptions.GetTimeoutError:
            raise ClusterError(f"workers did not answer {method} within {timeout_s or self.timeout_s:.0f} s") from None
        except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as exc:
            if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(exc.cause, InputError):
                raise exc.cause from None  # a worker's refusal is the job's refusal (exit 2, its message)
            dead = _dead_ranks(refs)
            if not dead:
                raise
            rank, died = dead[0]
            pid = self.infos[rank]["pid"] if rank < len(self.infos) else "unknown"
            raise ClusterError(
                f"worker rank {rank} (pid {pid}) died during {method}: its process ended (killed, e.g. by the "
                f"kernel's OOM killer, or crashed; Ray: {_first_line(died)}). The job stopped; its workers are "
                "ended, never reused"
            ) from None


def _dead_ranks(refs: Sequence[Any], wait_s: float = 5.0) -> list[tuple[int, BaseException]]:
    """The ranks (indices of `refs`) whose worker died, with Ray's error: a dead actor's call fails
    at once, so `wait_s` only bounds the wait for calls still running on live ranks."""
    import ray

    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=wait_s)
    ready_ids = {r.hex() for r in ready}
    dead = []
    for rank, ref in enumerate(refs):
        if ref.hex() not in ready_ids:
            continue
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayActorError as exc:
            dead.append((rank, exc))
        except Exception:  # noqa: BLE001 - a live rank's own failure (a peer it lost): not a dead worker
            pass
    return dead


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def _start_reaper() -> subprocess.Popen | None:
    """A watchdog that ends the local Ray this driver started if the driver dies without its
    `finally` (SIGKILL); see reaper.py. Best effort: None where Ray's process list is unavailable."""
    import ray

    from value_assets.gpu.workers import reaper

    try:
        node = ray._private.worker._global_node
        pids = [str(info.process.pid) for infos in node.all_processes.values() for info in infos]
    except AttributeError:
        return None
    # Its own session: a Ctrl-C to the driver's process group must not stop it before it acts.
    return subprocess.Popen(
        [sys.executable, reaper.__file__, *pids],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


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
    return sorted(
        range(len(bundle_nodes)), key=lambda b: (_address_key(node_addresses[bundle_nodes[b]]), bundle_nodes[b], b)
    )


def _bundle_ranks(pg, world_size: int) -> list[int]:
    """`rank_order` for a ready placement group, from Ray's view of bundles and nodes."""
    import ray
    from ray.util.placement_group import placement_group_table

    table = placement_group_table(pg)["bundles_to_node_id"]
    addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    return rank_order([table[b] for b in range(world_size)], addresses)


def _reserve(
    world_size: int, bundle: dict[str, float], strategy: str, timeout_s: float, *, purpose: str = "", **pg_options: Any
):
    """A ready placement group of `world_size` x `bundle`; removed again, and a ClusterError, if it
    is not ready within `timeout_s`."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([dict(bundle) for _ in range(world_size)], strategy=strategy, **pg_options)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        with contextlib.suppress(Exception):
            remove_placement_group(pg)
        raise ClusterError(
            f"could not reserve {world_size} x {bundle} ({strategy}){purpose} within {timeout_s:.0f} s "
            f"(cluster resources: {ray.cluster_resources()})"
        )
    return pg


def _place_workers(
    pg, world_size: int, bundle: dict[str, float], options=lambda rank: {}, kwargs=lambda rank: {}
) -> list[Any]:
    """One `CriticWorker` per bundle of `pg`, in rank order (`rank_order`), with per-rank actor
    `options` and constructor `kwargs`."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from value_assets.gpu.workers.worker import CriticWorker

    remote_cls = ray.remote(CriticWorker)
    return [
        remote_cls.options(
            num_cpus=bundle.get("CPU", 1),
            num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=bundle_index
            ),
            **options(rank),
        ).remote(**kwargs(rank))
        for rank, bundle_index in enumerate(_bundle_ranks(pg, world_size))
    ]


POOL_NAMESPACE = "value_assets_pools"
_LEASE_TIMEOUT_S = 30.0


class WorkerPool:
    """Workers kept alive between jobs on a cluster that outlives them (docs/operations.md#warm-workers).

    Named, detached actors `<name>-w<rank>` in one detached placement group `<name>-pg`, in the Ray
    namespace `value_assets_pools`. A job takes the pool's lease (held by rank 0's worker), checks
    that every worker answers, gives each its rank and settings (`configure`) and, when it ends
    cleanly, `release`s them: process group, parallel state, model and optimizer are gone, torch and
    megatron stay imported. A pool of another shape (world size, bundle, strategy) is replaced; a
    pool whose lease a live job holds is waited for, like any reservation; a job that
    fails ends the pool, so the next starts from fresh processes, unless the failure is a refusal
    the driver raised with no call to the workers outstanding (they are then as after a clean job).
    """

    def __init__(self, name: str, actors: list[Any], token: str, reused: bool):
        self.name, self.actors, self.token, self.reused = name, actors, token, reused

    @staticmethod
    def _groups(name: str) -> list[tuple[Any, dict[str, Any]]]:
        """The pool's live placement groups with their table entries. Looked up by name in the
        cluster's whole table: a group's name is only found from the namespace of the job that made
        it, and every job (driver) has its own."""
        from ray._raylet import PlacementGroupID
        from ray.util.placement_group import PlacementGroup, placement_group_table

        return [
            (PlacementGroup(PlacementGroupID.from_hex(pg_id)), info)
            for pg_id, info in placement_group_table().items()
            if info.get("name") == f"{name}-pg" and info.get("state") != "REMOVED"
        ]

    @classmethod
    def destroy(cls, name: str) -> None:
        """Kill every worker of pool `name` and remove its placement group (whatever its shape)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        prefix = f"{name}-w"
        for entry in ray.util.list_named_actors(all_namespaces=True):
            if entry.get("namespace") == POOL_NAMESPACE and str(entry.get("name", "")).startswith(prefix):
                with contextlib.suppress(Exception):
                    ray.kill(ray.get_actor(entry["name"], namespace=POOL_NAMESPACE), no_restart=True)
        for pg, _ in cls._groups(name):
            with contextlib.suppress(Exception):
                remove_placement_group(pg)

    @classmethod
    def _existing(cls, name: str, world_size: int, bundle: dict[str, float], strategy: str) -> list[Any] | None:
        """The pool's workers in rank order if a pool of exactly this shape exists, else None."""
        import ray

        groups = cls._groups(name)
        if len(groups) != 1:
            return None
        table = groups[0][1]
        try:
            actors = [ray.get_actor(f"{name}-w{rank}", namespace=POOL_NAMESPACE) for rank in range(world_size)]
        except ValueError:  # no such actor
            return None
        bundles = table.get("bundles") or {}
        shape_ok = (
            table.get("strategy") == strategy
            and table.get("state") == "CREATED"
            and len(bundles) == world_size
            and all(
                {k: float(v) for k, v in b.items()} == {k: float(v) for k, v in bundle.items()}
                for b in bundles.values()
            )
        )
        with contextlib.suppress(ValueError):
            ray.get_actor(f"{name}-w{world_size}", namespace=POOL_NAMESPACE)
            shape_ok = False  # a larger pool than this job's
        return actors if shape_ok else None

    @classmethod
    def acquire(
        cls, name: str, *, world_size: int, bundle: dict[str, float], strategy: str, timeout_s: float, log
    ) -> WorkerPool:
        """The pool for this job, made or reused, with its lease held (waiting up to `timeout_s`
        while another live job holds it)."""
        import socket
        import uuid

        import ray

        from value_assets.core.warm_folder import process_started

        holder = {
            "token": uuid.uuid4().hex,
            "pid": os.getpid(),
            "started": process_started(os.getpid()),
            "host": socket.gethostname(),
        }
        actors = cls._existing(name, world_size, bundle, strategy)
        if actors is not None:
            deadline = time.monotonic() + timeout_s
            try:
                waited = False
                while not ray.get(actors[0].acquire_lease.remote(holder), timeout=_LEASE_TIMEOUT_S):
                    # Its workers hold the cluster's slots: wait for the job using them, as for any reservation.
                    if time.monotonic() > deadline:
                        raise ClusterError(f"worker pool {name} stayed in use by another job for {timeout_s:.0f} s")
                    if not waited:
                        log(f"worker pool {name} is in use by another job: waiting up to {timeout_s:.0f} s")
                        waited = True
                    time.sleep(1.0)
                ray.get([a.ping.remote() for a in actors], timeout=_LEASE_TIMEOUT_S)
                return cls(name, actors, holder["token"], reused=True)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as exc:
                log(f"worker pool {name} does not answer ({type(exc).__name__}): replaced")
        cls.destroy(name)
        pg = _reserve(
            world_size,
            bundle,
            strategy,
            timeout_s,
            purpose=f" for worker pool {name}",
            name=f"{name}-pg",
            lifetime="detached",
        )
        actors = _place_workers(
            pg,
            world_size,
            bundle,
            options=lambda rank: dict(
                name=f"{name}-w{rank}", namespace=POOL_NAMESPACE, lifetime="detached", max_restarts=0
            ),
        )
        if not ray.get(actors[0].acquire_lease.remote(holder), timeout=timeout_s):
            raise ClusterError(f"worker pool {name}: a new pool refused its first lease")
        return cls(name, actors, holder["token"], reused=False)

    def finish(self, ok: bool) -> None:
        """After the job: release the workers and return the lease, or, after a failure (or a
        worker that cannot release), end the pool."""
        import ray

        if ok:
            try:
                ray.get([a.release.remote() for a in self.actors], timeout=60)
                ray.get(self.actors[0].return_lease.remote(self.token), timeout=_LEASE_TIMEOUT_S)
                return
            except Exception:  # noqa: BLE001 - a pool that cannot be released is ended below
                pass
        self.destroy(self.name)


@contextlib.contextmanager
def start_workers(
    spec: WorkerSpec, *, timeout_s: float, placement_strategy: str, ray_address: str | None = None, log=print
) -> Iterator[Cluster]:
    """Workers for one job, each told `spec` and its rank, wired and set up; ended (or, with a
    pool, released) on exit.

    `spec`, the deadline and the placement come from the job's config (core/job_configs.py), which
    holds their one default.

    With `$VALUE_ASSETS_WORKER_POOL` set and a Ray cluster that outlives this driver (joined by
    address, or already initialized in this process), the workers come from that pool
    (`WorkerPool`): no process start and no torch/megatron import after the first job.
    """
    import ray
    from ray.util.placement_group import remove_placement_group

    started_ray = False
    reaper = None
    pg = None
    actors: list[Any] = []
    pool: WorkerPool | None = None
    ok = False
    try:
        ray_address = ray_address or os.environ.get("RAY_ADDRESS")  # set inside a submitted Ray job
        if not ray.is_initialized():
            if ray_address:
                ray.init(address=ray_address, log_to_driver=True)
            else:
                cpus = max(spec.world_size, os.cpu_count() or 1)
                # Worker output stays in Ray's session logs; failures reach the driver as exceptions.
                # "local": a new Ray of this driver's own, even where `ray start` left a cluster's
                # address in Ray's temp folder (ray.init would join that one, or fail on a stale one).
                ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
                reaper = _start_reaper()
            started_ray = True
        # GPU bundles where the cluster has GPUs; CPU slots otherwise (laptop, CI).
        use_gpu = ray.cluster_resources().get("GPU", 0) > 0 if ray_address else _use_gpu()
        bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
        if placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"placement_strategy must be one of {PLACEMENT_STRATEGIES}, got {placement_strategy!r}")
        world_size = spec.world_size
        threads = None if use_gpu else max(1, (os.cpu_count() or 1) // world_size)
        job = dict(spec=spec, threads=threads)
        pool_name = os.environ.get(POOL_ENV) or None
        # A pool only on a cluster this driver did not start (one it started ends with it).
        if pool_name and not (started_ray and not ray_address):
            pool = WorkerPool.acquire(
                pool_name,
                world_size=world_size,
                bundle=bundle,
                strategy=placement_strategy,
                timeout_s=timeout_s,
                log=log,
            )
        if pool is not None:
            cluster = Cluster(workers=pool.actors, infos=[], timeout_s=timeout_s)
            cluster.call_each("configure", [((), {**job, "rank": rank}) for rank in range(world_size)], timeout_s)
        else:
            pg = _reserve(world_size, bundle, placement_strategy, timeout_s)
            actors = _place_workers(pg, world_size, bundle, kwargs=lambda rank: {**job, "rank": rank})
            cluster = Cluster(workers=actors, infos=[], timeout_s=timeout_s)
        addr, port = cluster._get([cluster.workers[0].address.remote(timeout_s)], timeout_s)[0]
        cluster.rendezvous = f"{addr}:{port}"
        cluster.infos = cluster.call_all("setup", addr, port, timeout_s=timeout_s)
        nodes = len({info["node_id"] for info in cluster.infos})
        source = "" if pool is None else f", pool {pool.name} ({'reused' if pool.reused else 'new'})"
        log(
            f"workers up: world {world_size}, dp {cluster.dp}, tp {spec.layout.tp}, pp {spec.layout.pp}, "
            f"{'GPU' if use_gpu else 'CPU'} bundles "
            f"on {nodes} node(s) ({placement_strategy}), rendezvous {addr}:{port}{source}"
        )
        log("placement " + json.dumps(cluster.placement(), sort_keys=True))
        try:
            yield cluster
        except InputError:
            # A refusal the driver raised while every call it made had returned on every rank (the
            # data changed mid-run, ...): the workers are as after a clean job, so a pool is kept.
            ok = not cluster.in_flight
            raise
        ok = True
    finally:
        if pool is not None:
            pool.finish(ok)
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
