"""Fixtures for the HF conversion tests: a 1-rank Megatron setup (checkpoint builders: hf_checkpoints.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def megatron_single_rank():
    from tests.hf.megatron_fixture import init_single_rank, teardown_single_rank

    init_single_rank()
    try:
        yield
    finally:
        # Later tests (the job's export) set up their own process group in this process.
        teardown_single_rank()
