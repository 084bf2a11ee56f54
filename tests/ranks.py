"""Rank processes for the multi-process CPU tests, forked from a server that has already imported
torch and megatron-core.

A `spawn`ed rank starts a fresh interpreter and imports torch and megatron again (several seconds
of CPU per rank, most of a small distributed test's time). `start_ranks` starts them with the
`forkserver` method instead: the server process is started once per test process, imports the
modules below once, and forks every rank from there. It never initialises a process group, CUDA
or megatron's parallel state, so each rank starts as clean as a spawned one.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

PRELOAD = [
    "torch",
    "value_assets.gpu",
    "megatron.core",
    "value_assets.gpu.model.gpt_critic",
    "value_assets.gpu.runtime.parallel",
]
multiprocessing.set_forkserver_preload(PRELOAD)


def start_ranks(fn: Callable[..., Any], args: tuple, nprocs: int, *, join: bool = True):
    """`torch.multiprocessing.start_processes` on the preloaded fork server (`fn(rank, *args)`)."""
    return mp.start_processes(fn, args=args, nprocs=nprocs, join=join, start_method="forkserver")


def run_ranks(fn: Callable[..., Any], args: tuple, nprocs: int, *, deadline_s: float, what: str) -> None:
    """Start `nprocs` ranks and wait for them, killing them all if they exceed `deadline_s`."""
    ctx = start_ranks(fn, args, nprocs, join=False)
    end = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=max(0.1, end - time.monotonic())):
            if time.monotonic() > end:
                raise TimeoutError(f"{what} with world {nprocs} did not finish in {deadline_s}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
