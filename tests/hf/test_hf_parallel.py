"""Sharded conversion on CPU: one spawn of 2 gloo ranks runs TP=2, then PP=2 (parallel_workers.py).

TP=2: sharded conversion gives the HF hidden states. Covers tp == num_query_groups (each rank one
whole group) and tp > num_query_groups (Megatron all-gathers the fused qkv and re-slices).

PP=2: the engine's critic bootstrapped stage by stage from an HF checkpoint gives, on the last
stage, the HF final hidden states times the value head. Each stage must take exactly its own layers
(renumbered from the whole model's), the first stage the embedding, the last the final norm; a
wrong mapping changes the output.

Qwen3.5 (the engine's critic, Gated DeltaNet and gated attention layers): TP=2 cuts the DeltaNet's
key-head groups between the ranks; PP=2 puts two DeltaNet layers on the first stage and a DeltaNet
and the attention layer on the last, each stage building its own layers' kinds.

Float32, max abs diff < 1e-4. (Merged from test_hf_tp.py and test_hf_pp.py: one spawn, not two.)
"""

from __future__ import annotations

import pytest
import torch

from tests.hf.hf_checkpoints import QWEN3_5_TEXT, TINY, make_hf_checkpoint, make_qwen3_5_checkpoint
from tests.ranks import start_ranks

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
    q35 = root / "qwen3_5"
    q35_model = make_qwen3_5_checkpoint(q35, seed=11)
    q35_ids = torch.randint(0, QWEN3_5_TEXT["vocab_size"], (33,), generator=torch.Generator().manual_seed(7))
    torch.save(q35_ids, root / "q35-ids.pt")
    pp.append((q35_model, (str(q35), str(root / "q35-ids.pt"), str(q35 / "pp-values.pt"))))
    engine_tp = [(str(q35), str(root / "q35-ids.pt"), str(q35 / "tp-values.pt"))]
    start_ranks(parallel_workers.run, ([c for _, c in tp], [c for _, c in pp], engine_tp), 2)
    return {"tp": tp, "pp": pp, "tp_ids": tp_ids, "pp_ids": pp_ids, "q35": (q35_model, q35_ids, q35)}


def test_tp2_hidden_states_match(spawned):
    ids = spawned["tp_ids"]
    for (family, kv_heads), (hf, (_, _, out)) in zip(TP_CASES, spawned["tp"], strict=True):
        with torch.no_grad():
            ref = hf.model(ids).last_hidden_state
        diff = (torch.load(out) - ref).abs().max().item()
        print(f"{family} kv_heads={kv_heads} TP=2: max abs diff {diff:.2e}")
        assert diff < 1e-4, (family, kv_heads, diff)


def test_qwen3_5_tp2_and_pp2_match_transformers(spawned):
    text, ids, folder = spawned["q35"]
    with torch.no_grad():
        hidden = torch.cat([text(input_ids=row[None]).last_hidden_state[0] for row in ids.split([13, 20])])
    tp = torch.load(folder / "tp-values.pt")
    diff = (tp["values"] - (hidden @ tp["weight"].T + tp["bias"])).abs().max().item()
    print(f"qwen3_5 TP=2: max abs diff {diff:.2e}")
    assert diff < 1e-4
    pp = torch.load(folder / "pp-values.pt")
    assert pp["layers"] == QWEN3_5_TEXT["num_hidden_layers"] // 2
    with torch.no_grad():
        whole = text(input_ids=ids[None]).last_hidden_state[0]  # the PP case runs the 33 ids as one row
    diff = (pp["values"] - (whole @ pp["weight"].T + pp["bias"])).abs().max().item()
    print(f"qwen3_5 PP=2: max abs diff {diff:.2e}")
    assert diff < 1e-4


def test_pp2_bootstrap_matches_hf(spawned):
    ids = spawned["pp_ids"]
    for family, (hf, (_, _, out)) in zip(PP_FAMILIES, spawned["pp"][: len(PP_FAMILIES)], strict=True):
        got = torch.load(out)
        assert got["layers"] == TINY["num_hidden_layers"] // 2  # the last stage built only its half
        with torch.no_grad():
            hidden = hf.model(ids[None]).last_hidden_state[0]
        ref = hidden @ got["weight"].T + got["bias"]
        diff = (got["values"] - ref).abs().max().item()
        print(f"{family} PP=2: max abs diff {diff:.2e}")
        assert diff < 1e-4, (family, diff)
