"""Process-group setup and teardown for one critic worker (one rank).

`init_distributed` starts torch.distributed (gloo on CPU, NCCL on CUDA), megatron's model-parallel
groups and the seeds; `destroy` undoes all of it and is safe to call from a `finally` whether or
not init got that far.
"""

from __future__ import annotations

import datetime
import os

import torch

from value_assets.gpu.runtime.compat import apply_cpu_compat, seed_model_parallel


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(
    rank: int,
    world_size: int,
    master_addr: str = "127.0.0.1",
    master_port: int = 29500,
    tp: int = 1,
    pp: int = 1,
    backend: str | None = None,
    seed: int = 1234,
    timeout_s: float = 600.0,
    local_rank: int | None = None,
    store: torch.distributed.TCPStore | None = None,
) -> None:
    """Join the process group and build megatron's parallel state (dp = world / (tp * pp)).

    The rendezvous is a TCP store at `master_addr:master_port`, served by rank 0: `store` is the
    one `open_rendezvous` already bound (rank 0), else rank 0 binds the port here (0: any free one)
    and the other ranks connect to it. On CUDA the device is `local_rank` (default: rank modulo
    visible devices); on CPU the megatron compatibility layer is applied first.
    """
    if world_size % (tp * pp):
        raise ValueError(f"world_size {world_size} not divisible by tp*pp = {tp}*{pp}")
    backend = backend or default_backend()
    if torch.cuda.is_available():
        dev = local_rank if local_rank is not None else rank % torch.cuda.device_count()
        torch.cuda.set_device(dev)
    else:
        if backend == "nccl":
            raise ValueError("NCCL needs CUDA; use backend='gloo' on CPU")
        apply_cpu_compat()
    from megatron.core import parallel_state as ps

    if not torch.distributed.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            store = torch.distributed.TCPStore(
                master_addr, master_port, world_size, rank == 0, timeout=timeout, wait_for_workers=False
            )
        # Assigned, not defaulted: a pooled worker joins a new rendezvous for every job.
        os.environ["MASTER_ADDR"] = master_addr
        os.environ["MASTER_PORT"] = str(store.port)
        torch.distributed.init_process_group(
            backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    seed_model_parallel(seed)


def destroy() -> None:
    """Tear down megatron parallel state and the process group; idempotent."""
    try:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def open_rendezvous(host: str, timeout_s: float) -> torch.distributed.TCPStore:
    """Rank 0's rendezvous store, listening from now on a port the system picks (`.port`), for
    `init_distributed(store=...)`. Bound before its port is told to anyone, so no other process
    can take the port in between (as it could if a free port were picked first and bound later:
    seen as EADDRINUSE under load). A single process passes `master_port=0` instead."""
    return torch.distributed.TCPStore(
        host, 0, None, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )
