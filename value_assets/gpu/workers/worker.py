"""The per-GPU worker: one Ray actor per placement-group bundle.

Each worker joins torch.distributed (NCCL on GPU, gloo on CPU) and megatron's parallel state,
builds its shard of the critic, and executes what the driver asks, step by step: bootstrap or
resume, one optimizer step over its rows, save, forward-only evaluation. Rows arrive from the
driver already assigned to this worker's data-parallel rank.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from value_assets.core.stats import RankReport
from value_assets.core.worker_spec import WorkerSpec

RENDEZVOUS_ADDR_ENV = "VALUE_ASSETS_RENDEZVOUS_ADDR"


def node_address() -> str:
    """The address the other ranks reach this worker's node by: the node's address as Ray knows
    it (`ray.util.get_node_ip_address()`, the raylet's `--node-ip-address`), on one host and on
    many alike; never an assumed loopback. Only rank 0's is used (the rendezvous).

    `$VALUE_ASSETS_RENDEZVOUS_ADDR` in the workers' environment (e.g. the Ray job's
    `runtime_env.env_vars`) forces the rendezvous address, for clusters whose torch.distributed
    traffic should use another network than Ray's. It must be an address of rank 0's node.
    """
    forced = os.environ.get(RENDEZVOUS_ADDR_ENV)
    if forced:
        return forced
    import ray

    return ray.util.get_node_ip_address()


class CriticWorker:
    """Methods are called by the driver through Ray; every collective method is called on all ranks."""

    def __init__(self, spec: WorkerSpec | None = None, *, rank: int = 0, threads: int | None = None):
        self.spec: WorkerSpec | None = None
        self.rank = rank
        self.model = None
        self.optimizer = None
        self._lease: dict[str, Any] | None = None
        self._rendezvous = None  # rank 0: the store `address` bound, until `setup` joins through it
        self._in_use = False  # configured for a job that has not released it
        if spec is not None:
            self.configure(spec, rank=rank, threads=threads)

    def configure(self, spec: WorkerSpec, *, rank: int, threads: int | None = None) -> int:
        """Take on one job's rank and spec (a fresh worker in its constructor, a pooled one per
        job); returns this process's id. `threads`: torch's intra-op threads (CPU workers share the
        host's cores).

        A pooled worker is reset first if the last job left anything behind: a job whose driver died
        (SIGKILL, OOM) never called `release`, and its process group, megatron's parallel state,
        model and optimizer are still there (`setup` then failed: "data parallel group is already
        initialized"). Whatever state the worker is found in, it is reset here, never reused as is
        (issue 33, defect 1). A worker still busy in the dead job's call does not get here: the next
        driver's lease call times out and the pool is replaced."""
        if self._in_use:
            print(
                f"worker {os.getpid()}: the previous job left its state (its driver did not release it): reset",
                flush=True,
            )
            self.release()
        self._in_use = True  # until `release` completes: any state between is unknown to the next job
        self.spec = spec
        self.rank = rank
        self.model = None
        self.optimizer = None
        if threads:
            import torch

            torch.set_num_threads(threads)
        return os.getpid()

    # -- setup ------------------------------------------------------------------------------
    def address(self, timeout_s: float) -> tuple[str, int]:
        """Rank 0's rendezvous: its node's address and the port of the store it now listens on
        (held until `setup`, so that no other process takes the port in between)."""
        from value_assets.gpu.runtime.parallel import open_rendezvous

        host = node_address()
        self._rendezvous = open_rendezvous(host, timeout_s)
        return host, self._rendezvous.port

    def setup(self, master_addr: str, master_port: int, *, timeout_s: float) -> dict[str, Any]:
        import torch

        from value_assets.gpu.model.gpt_critic import build_critic
        from value_assets.gpu.runtime.parallel import init_distributed

        spec = self._spec()
        store, self._rendezvous = (self._rendezvous if self.rank == 0 else None), None
        init_distributed(
            self.rank,
            spec.world_size,
            master_addr,
            master_port,
            tp=spec.layout.tp,
            pp=spec.layout.pp,
            seed=spec.seed,
            timeout_s=timeout_s,
            store=store,
        )
        from megatron.core import parallel_state as ps

        torch.manual_seed(spec.seed)
        model = build_critic(
            spec.backbone, spec.objective, tp=spec.layout.tp, pp=spec.layout.pp, head_seed=spec.seed, memory=spec.memory
        )
        if spec.optimizer is not None:
            from value_assets.gpu.runtime.step import wrap_for_training

            opt = spec.optimizer
            self.model, self.optimizer = wrap_for_training(
                model,
                lr=opt.lr,
                weight_decay=opt.weight_decay,
                clip_grad=opt.clip_grad,
                distributed_optimizer=spec.memory.distributed_optimizer,
                optimizer_offload=spec.memory.optimizer_offload,
                freeze=spec.freeze,
                head_bias=spec.head_bias,
            )
        else:
            self.model = model
        return {
            "rank": self.rank,
            "dp_rank": ps.get_data_parallel_rank(),
            "tp_rank": ps.get_tensor_model_parallel_rank(),
            "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "last_stage": int(ps.is_pipeline_last_stage()),
            "dp_size": ps.get_data_parallel_world_size(),
            "pid": os.getpid(),
            "host_gradients": getattr(self.optimizer, "host_gradients", None),
            **placement(),
        }

    def _spec(self) -> WorkerSpec:
        if self.spec is None:
            raise RuntimeError("worker has no job: configure it first")
        return self.spec

    def _module(self):
        return self.model.module if hasattr(self.model, "module") else self.model

    # -- weights ----------------------------------------------------------------------------
    def bootstrap(self, source: dict[str, Any]) -> dict[str, Any]:
        """Fresh critic: the backbone strictly from the actor checkpoint, only the head new."""
        from value_assets.gpu.convert.bootstrap import load_backbone_into

        loaded = load_backbone_into(self._module(), source, tp=self._spec().layout.tp)
        self._weights_changed()
        return loaded

    def _weights_changed(self) -> None:
        """The model's weights were replaced after the optimizer was built (bootstrap, a warm
        start): give the optimizer the new ones. Under bf16 megatron's optimizer steps fp32 master
        copies taken when it was built and writes them back after each step, so without this the
        first step put the initial random weights back, discarding the actor's."""
        if self.optimizer is not None:
            self.optimizer.reload_model_params()

    def load(self, path: str, with_optimizer: bool, contract: dict[str, Any]) -> int:
        """Load a saved critic (model and, for a resume, optimizer); return its iteration. Only
        bytes that match `contract` (the save's, verified by the driver) are used."""
        if with_optimizer:
            from value_assets.gpu.runtime.checkpoint import load_critic

            return load_critic(path, self.model, self.optimizer, contract=contract)
        # The model's tensors only (forward-only use, or a training run's warm start): they must all be
        # there; the optimizer state is left unread.
        from value_assets.gpu.runtime.checkpoint import load_model_weights

        iteration = load_model_weights(path, self.model, contract=contract)
        self._weights_changed()
        return iteration

    def save(self, path: str, iteration: int) -> None:
        from value_assets.gpu.runtime.checkpoint import save_critic

        save_critic(path, self.model, self.optimizer, iteration=iteration)

    def state_digest(self) -> str:
        """sha256 over this rank's parameters (names and bytes), for bitwise comparisons."""
        import hashlib

        h = hashlib.sha256()
        for name, p in sorted(self._module().state_dict().items()):
            if p is None or not hasattr(p, "detach"):
                continue
            h.update(name.encode())
            h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()

    # -- work -------------------------------------------------------------------------------
    def train_step(
        self, rows: Sequence[dict[str, Any]], global_rows: int, micro_batch_tokens: int, lr: float
    ) -> dict[str, Any]:
        from value_assets.gpu.model.packing import pack_rows
        from value_assets.gpu.runtime.step import optimizer_step, set_lr

        set_lr(self.optimizer, lr)
        mbs = pack_rows([_packing_row(r) for r in rows], micro_batch_tokens)
        return optimizer_step(self.model, self.optimizer, mbs, global_rows, self._spec().objective)

    def evaluate(self, rows: Sequence[dict[str, Any]], micro_batch_tokens: int, dp_rank: int) -> dict[str, Any] | None:
        """Float64 sufficient statistics over this rank's rows (docs/rules.md#evaluation), with its rank and row
        indices, totals and per-row statistics (`RankReport.from_rows`); None on pipeline stages
        before the last (they only pass activations on)."""
        from megatron.core import parallel_state as ps

        from value_assets.gpu.model.packing import pack_rows
        from value_assets.gpu.runtime.step import evaluate_rows

        out = (
            evaluate_rows(
                self.model, pack_rows([_packing_row(r) for r in rows], micro_batch_tokens), self._spec().objective
            )
            if rows
            else {}
        )
        if not ps.is_pipeline_last_stage():
            return None
        # Statistics use the dataset's float64 returns and mask; the model gives the values.
        return RankReport.from_rows(
            dp_rank,
            [
                (
                    int(r["row_id"]),
                    np.asarray(r["returns"], dtype=np.float64),
                    out[int(r["row_id"])]["values"],
                    np.asarray(r["loss_mask"], dtype=np.float64),
                )
                for r in rows
            ],
        ).to_json()

    def shutdown(self) -> None:
        from value_assets.gpu.runtime.parallel import destroy

        self._rendezvous = None
        destroy()

    # -- pooled use (cluster.start_workers with a worker pool) --------------------------------
    def ping(self) -> int:
        return os.getpid()

    def release(self) -> None:
        """End this job's part and keep the process (torch and megatron stay imported): the process
        group and megatron's parallel state are destroyed, the model and optimizer dropped, so the
        next `configure` + `setup` starts exactly as a fresh worker does."""
        import gc

        import torch

        try:
            self.shutdown()
        finally:
            self.model = None
            self.optimizer = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        self._in_use = False

    def acquire_lease(self, holder: dict[str, Any]) -> bool:
        """The pool's lease (kept by its first worker): granted when free, or when its holder, a
        process on this host, has died without returning it."""
        if self._lease is not None and self._lease["token"] != holder["token"] and _alive(self._lease):
            return False
        self._lease = dict(holder)
        return True

    def return_lease(self, token: str) -> None:
        if self._lease is not None and self._lease["token"] == token:
            self._lease = None


def _alive(holder: dict[str, Any]) -> bool:
    """Whether a lease holder still runs (same host: the process with its pid and start time, so a
    pid reused by another process does not hold the pool forever; another host: assumed alive)."""
    import socket

    from value_assets.core.warm_folder import process_alive

    return holder.get("host") != socket.gethostname() or process_alive(int(holder["pid"]), holder.get("started"))


def placement() -> dict[str, str]:
    """Where this worker runs: its Ray node's id and address (recorded in the setup infos)."""
    import ray

    return {"node_id": ray.get_runtime_context().get_node_id(), "node_address": ray.util.get_node_ip_address()}


def _packing_row(r: dict[str, Any]):
    from value_assets.gpu.model.packing import Row

    return Row(
        row_id=int(r["row_id"]),
        tokens=np.asarray(r["tokens"], dtype=np.int64),
        response_length=int(r["response_length"]),
        returns=np.asarray(r["returns"], dtype=np.float64),
        loss_mask=np.asarray(r["loss_mask"], dtype=np.int64),
    )
