"""Sharded conversion on CPU: one spawn of 2 gloo ranks runs TP=2, then PP=2 (parallel_workers.py).

TP=2: sharded conversion gives the HF hidden states. Covers tp == num_query_groups (each rank one
whole group) and tp > num_query_groups (Megatron all-gathers the fused qkv and re-slices).

PP=2: the engine's critic bootstrapped stage by stage from an HF checkpoint gives, on the last
stage, the HF final hidden states times the value head. Each stage must take exactly its own layers
(renumbered from the whole model's), the first stage the embedding, the last the final norm; a
wrong mapping changes the output.

Float32, max abs diff < 1e-4. (Merged from test_hf_tp.py and test_hf_pp.py: one spawn, not two.)
"""

from __future__ import annotations

import pytest
import torch

from tests.hf.hf_checkpoints import TINY, make_hf_checkpoint
from tests.ranks import start_ranks
from value_assets.gpu.runtime.parallel import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

TP_CASES = [("qwen2", 2), ("qwen3", 1)]  # (family, num_key_value_heads); tp = 2
PP_FAMILIES = ["llama", "qwen3"]


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """The HF models and the outputs the 2 ranks wrote for them."""
    from tests.hf import parallel_workers

    root = tmp_path_factory.mktemp("hf-parallel")
    tp_ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(5))
    pp_ids = torch.randint(0, TINY["vocab_size"], (13,), generator=torch.Generator().manual_seed(6))
    torch.save(tp_ids, root / "tp-ids.pt")
    torch.save(pp_ids, root / "pp-ids.pt")
    tp, pp = [], []
    for family, kv_heads in TP_CASES:
        folder = root / f"tp-{family}-{kv_heads}"
        tp.append(
            (
                make_hf_checkpoint(folder, family, num_key_value_heads=kv_heads),
                (str(folder), str(root / "tp-ids.pt"), str(folder / "hidden.pt")),
            )
        )
    for family in PP_FAMILIES:
        folder = root / f"pp-{family}"
        pp.append(
            (make_hf_checkpoint(folder, family), (str(folder), str(root / "pp-ids.pt"), str(folder / "values.pt")))
        )
    start_ranks(parallel_workers.run, (2, free_port(), [c for _, c in tp], [c for _, c in pp]), 2)
    return {"tp": tp, "pp": pp, "tp_ids": tp_ids, "pp_ids": pp_ids}


def test_tp2_hidden_states_match(spawned):
    ids = spawned["tp_ids"]
    for (family, kv_heads), (hf, (_, _, out)) in zip(TP_CASES, spawned["tp"], strict=True):
        with torch.no_grad():
            ref = hf.model(ids).last_hidden_state
        diff = (torch.load(out) - ref).abs().max().item()
        print(f"{family} kv_heads={kv_heads} TP=2: max abs diff {diff:.2e}")
        assert diff < 1e-4, (family, kv_heads, diff)


def test_pp2_bootstrap_matches_hf(spawned):
    ids = spawned["pp_ids"]
    for family, (hf, (_, _, out)) in zip(PP_FAMILIES, spawned["pp"], strict=True):
        got = torch.load(out)
        assert got["layers"] == TINY["num_hidden_layers"] // 2  # the last stage built only its half
        with torch.no_grad():
            hidden = hf.model(ids[None]).last_hidden_state[0]
        ref = hidden @ got["weight"].T + got["bias"]
        diff = (got["values"] - ref).abs().max().item()
        print(f"{family} PP=2: max abs diff {diff:.2e}")
        assert diff < 1e-4, (family, diff)
