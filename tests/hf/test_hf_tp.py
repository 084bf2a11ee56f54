"""TP=2 on CPU (2 gloo processes): sharded conversion gives the HF hidden states.

Covers tp == num_query_groups (each rank one whole group) and tp > num_query_groups (Megatron
all-gathers the fused qkv and re-slices). Float32, max abs diff < 1e-4.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from .hf_checkpoints import make_hf_checkpoint

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CASES = [("qwen2", 2), ("qwen3", 1)]  # (family, num_key_value_heads); tp = 2


def test_tp2_hidden_states_match(tmp_path):
    from . import tp_worker

    models, cases = [], []
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(5))
    torch.save(ids, tmp_path / "ids.pt")
    for family, kv_heads in CASES:
        folder = tmp_path / f"{family}-{kv_heads}"
        models.append(make_hf_checkpoint(folder, family, num_key_value_heads=kv_heads))
        cases.append((str(folder), str(tmp_path / "ids.pt"), str(folder / "hidden.pt")))
    # One spawn for all cases: each spawn pays the megatron import (~8 s per process here).
    mp.start_processes(tp_worker.run, args=(2, _port(), cases), nprocs=2, join=True, start_method="spawn")
    for (family, kv_heads), hf, (folder, _, out) in zip(CASES, models, cases):
        with torch.no_grad():
            ref = hf.model(ids).last_hidden_state
        diff = (torch.load(out) - ref).abs().max().item()
        print(f"{family} kv_heads={kv_heads} TP=2: max abs diff {diff:.2e}")
        assert diff < 1e-4, (family, kv_heads, diff)
