"""Rank processes for the multi-process CPU tests, forked from a server that has already imported
torch and megatron-core.

A `spawn`ed rank starts a fresh interpreter and imports torch and megatron again (several seconds
of CPU per rank, most of a small distributed test's time). `start_ranks` starts them with the
`forkserver` method instead: the server process is started once per test process, imports the
modules below once, and forks every rank from there. It never initialises a process group, CUDA
or megatron's parallel state, so each rank starts as clean as a spawned one.

The ranks meet at a TCP store this process serves (`rendezvous`): it is bound to a port the system
picks before the port is told to any rank, so no other process can take it in between. A rank
joins with `join(port, world)`. (Picking a free port and letting rank 0 bind it later lost that
race under load: EADDRINUSE in CI.)
"""

from __future__ import annotations

import datetime
import multiprocessing
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.multiprocessing as mp

from value_assets.gpu.runtime.parallel import open_rendezvous

PRELOAD = [
    "torch",
    "value_assets.gpu",
    "megatron.core",
    "value_assets.gpu.model.gpt_critic",
    "value_assets.gpu.runtime.parallel",
]
multiprocessing.set_forkserver_preload(PRELOAD)


HOST = "127.0.0.1"
TIMEOUT_S = 600.0


@contextmanager
def rendezvous() -> Iterator[int]:
    """The port of a TCP store served by this process while the block runs, already listening
    (the product's `open_rendezvous`, which a job's rank 0 serves)."""
    store = open_rendezvous(HOST, TIMEOUT_S)
    try:
        yield store.port
    finally:
        del store


def join(port: int, world: int) -> torch.distributed.TCPStore:
    """A rank's connection to the `rendezvous` store, for `init_distributed(store=...)`."""
    return torch.distributed.TCPStore(HOST, port, world, False, timeout=datetime.timedelta(seconds=TIMEOUT_S))


def start_ranks(fn: Callable[..., Any], args: tuple, nprocs: int) -> None:
    """Run `fn(rank, nprocs, port, *args)` in `nprocs` ranks on the preloaded fork server and wait
    for them; `port` is that of a `rendezvous` held until they end."""
    with rendezvous() as port:
        mp.start_processes(fn, args=(nprocs, port, *args), nprocs=nprocs, join=True, start_method="forkserver")


def run_ranks(fn: Callable[..., Any], args: tuple, nprocs: int, *, deadline_s: float, what: str) -> None:
    """`start_ranks`, killing every rank if they have not all ended after `deadline_s`."""
    with rendezvous() as port:
        ctx = mp.start_processes(fn, args=(nprocs, port, *args), nprocs=nprocs, join=False, start_method="forkserver")
        end = time.monotonic() + deadline_s
        try:
            while not ctx.join(timeout=max(0.1, end - time.monotonic())):
                if time.monotonic() > end:
                    raise TimeoutError(f"{what} with world {nprocs} did not finish in {deadline_s}s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
