"""Ray placement group and worker lifecycle for the GPU job.

`start_workers` reserves one bundle per GPU (per CPU slot without GPUs), starts one `CriticWorker`
per bundle, wires torch.distributed between them and yields a `Cluster`. Everything it started is
ended in its `finally`, on success and on failure alike; every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

DEFAULT_TIMEOUT_S = 900.0


class ClusterError(RuntimeError):
    """The cluster could not be reserved or a worker failed."""


@dataclass
class Cluster:
    workers: list[Any]
    infos: list[dict[str, int]]
    timeout_s: float

    @property
    def world_size(self) -> int:
        return len(self.workers)

    @property
    def dp(self) -> int:
        return self.infos[0]["dp_size"]

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


@contextlib.contextmanager
def start_workers(*, world_size: int, tp: int, pp: int, seed: int, backbone: dict[str, Any], objective: dict[str, Any],
                  train: bool, lr: float = 1e-4, weight_decay: float = 0.0, clip_grad: float = 1.0,
                  ray_address: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, log=print,
                  memory: dict[str, Any] | None = None, freeze: str = "none") -> Iterator[Cluster]:
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
                ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False,
                         runtime_env={"env_vars": {"VALUE_ASSETS_LOOPBACK": "1"}})
                reaper = _start_reaper()
            started_ray = True
        # GPU bundles where the cluster has GPUs; CPU slots otherwise (laptop, CI).
        use_gpu = ray.cluster_resources().get("GPU", 0) > 0 if ray_address else _use_gpu()
        bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
        pg = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
        if not ready:
            raise ClusterError(f"could not reserve {world_size} x {bundle} within {timeout_s:.0f} s (cluster resources: {ray.cluster_resources()})")
        threads = None if use_gpu else max(1, (os.cpu_count() or 1) // world_size)
        remote_cls = ray.remote(CriticWorker)
        for rank in range(world_size):
            actors.append(remote_cls.options(
                num_cpus=1, num_gpus=1 if use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=rank),
            ).remote(rank=rank, world_size=world_size, tp=tp, pp=pp, seed=seed, backbone=backbone, objective=objective, threads=threads,
                              memory=memory, freeze=freeze))
        cluster = Cluster(workers=actors, infos=[], timeout_s=timeout_s)
        addr, port = cluster._get([actors[0].address.remote()], timeout_s)[0]
        cluster.infos = cluster.call_all("setup", addr, port, train=train, lr=lr, weight_decay=weight_decay, clip_grad=clip_grad, timeout_s=timeout_s)
        log(f"workers up: world {world_size}, dp {cluster.dp}, tp {tp}, pp {pp}, {'GPU' if use_gpu else 'CPU'} bundles")
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
