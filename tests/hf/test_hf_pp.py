"""PP=2 on CPU (2 gloo processes): the engine's critic bootstrapped stage by stage from an HF
checkpoint gives, on the last stage, the HF final hidden states times the value head.

Each stage must take exactly its own layers (renumbered from the whole model's), the first stage
the embedding, the last the final norm; a wrong mapping changes the output. Float32, < 1e-4.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from .hf_checkpoints import TINY, make_hf_checkpoint

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

FAMILIES = ["llama", "qwen3"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_pp2_bootstrap_matches_hf(tmp_path):
    from . import pp_worker

    ids = torch.randint(0, TINY["vocab_size"], (13,), generator=torch.Generator().manual_seed(6))
    torch.save(ids, tmp_path / "ids.pt")
    models, cases = [], []
    for family in FAMILIES:
        folder = tmp_path / family
        models.append(make_hf_checkpoint(folder, family))
        cases.append((str(folder), str(tmp_path / "ids.pt"), str(folder / "values.pt")))
    mp.start_processes(pp_worker.run, args=(2, _port(), cases), nprocs=2, join=True, start_method="spawn")
    for family, hf, (_, _, out) in zip(FAMILIES, models, cases):
        got = torch.load(out)
        assert got["layers"] == TINY["num_hidden_layers"] // 2  # the last stage built only its half
        with torch.no_grad():
            hidden = hf.model(ids[None]).last_hidden_state[0]
        ref = hidden @ got["weight"].T + got["bias"]
        diff = (got["values"] - ref).abs().max().item()
        print(f"{family} PP=2: max abs diff {diff:.2e}")
        assert diff < 1e-4, (family, diff)
