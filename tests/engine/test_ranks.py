"""The multi-process tests' rendezvous (tests/ranks.py): its port is bound before any rank hears of
it, so another process cannot take it in between (the EADDRINUSE a CI run hit when the port was
picked free, closed, and bound later by rank 0)."""

from __future__ import annotations

import errno
import socket

import pytest

from tests.ranks import HOST, rendezvous

# Every multi-rank test (test_distributed, test_memory_features, tests/hf) meets at this rendezvous.
pytestmark = pytest.mark.integration


def test_the_port_is_held_before_any_rank_is_told_it():
    with rendezvous() as port, socket.socket() as other:
        with pytest.raises(OSError) as taken:
            other.bind((HOST, port))
        assert taken.value.errno == errno.EADDRINUSE
