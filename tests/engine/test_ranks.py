"""The multi-process tests' rendezvous (tests/ranks.py): its port is bound before any rank hears of
it, so another process cannot take it in between (the EADDRINUSE a CI run hit when the port was
picked free, closed, and bound later by rank 0)."""

from __future__ import annotations

import errno
import socket

import pytest
import torch

from tests.ranks import HOST, join, rendezvous, start_ranks


def _sum_ranks(rank: int, world: int, port: int, out: str) -> None:
    torch.distributed.init_process_group("gloo", store=join(port, world), rank=rank, world_size=world)
    try:
        t = torch.tensor([rank + 1.0])
        torch.distributed.all_reduce(t)
        if rank == 0:
            torch.save(t, out)
    finally:
        torch.distributed.destroy_process_group()


def test_the_port_is_held_before_any_rank_is_told_it():
    with rendezvous() as port, socket.socket() as other:
        with pytest.raises(OSError) as taken:
            other.bind((HOST, port))
        assert taken.value.errno == errno.EADDRINUSE


def test_ranks_meet_at_the_held_port(tmp_path):
    start_ranks(_sum_ranks, (str(tmp_path / "sum.pt"),), 3)
    assert torch.load(tmp_path / "sum.pt").item() == 6.0
