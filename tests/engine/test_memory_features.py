"""Memory features on CPU (gloo, forked ranks): activation recompute, the distributed optimizer
and sequence parallelism take the same steps as the plain run, and their checkpoints re-shard
for evaluation at another layout. Two rank launches in all, from the preloaded fork server
(tests/ranks.py)."""

from __future__ import annotations

import pytest
import torch

from tests.engine import memory_workers as MW
from tests.ranks import run_ranks
from value_assets.gpu.model.packing import pack_rows

pytestmark = pytest.mark.integration


def spawn(world: int, tp: int, fn: str, *args, deadline_s: float = 280.0) -> None:
    """`world` ranks running memory_workers' body `fn` (forked from the preloaded server)."""
    run_ranks(MW.run, (tp, fn, args), world, deadline_s=deadline_s, what=fn)


def same_steps(a: list[dict], b: list[dict]) -> None:
    for ha, hb in zip(a, b, strict=True):
        assert hb["rows"] == ha["rows"] and hb["tokens"] == ha["tokens"]
        assert hb["loss"] == pytest.approx(ha["loss"], rel=1e-5)
        assert hb["grad_norm"] == pytest.approx(ha["grad_norm"], rel=1e-5)


def same_params(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name, p in a.items():
        torch.testing.assert_close(b[name], p, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.timeout(320)
def test_recompute_and_distributed_optimizer_match_plain_dp2(tmp_path):
    """DP=2: selective and full recompute (every layer, or only the first: `recompute_layers` 1)
    and the distributed optimizer give the plain run's losses, grad norms and parameters over 3
    steps; the distributed optimizer's checkpoint resumes exactly (step 3 again) and loads without
    optimizer state at TP=2 for evaluation."""
    ck = tmp_path / "ck"
    ck.mkdir()
    spawn(2, 1, "dp_features", str(ck), str(tmp_path / "r.pt"))
    r = torch.load(tmp_path / "r.pt")
    plain = r["plain"]
    assert len(plain["history"]) == MW.STEPS
    assert plain["history"][-1]["loss"] < plain["history"][0]["loss"]
    assert [r[n]["recompute"] for n in ("plain", "selective", "full", "full_first1")] == [
        None,
        "selective",
        "full",
        "full",
    ]
    assert r["full"]["recompute_block"] == ("uniform", 1) and r["full_first1"]["recompute_block"] == ("block", 1)
    # the forward really checkpoints 1 of the 2 layers: half of full recompute's checkpoints
    assert MW.BACKBONE.num_layers == 2 and r["plain"]["checkpoints"] == 0
    assert r["full"]["checkpoints"] == 2 * r["full_first1"]["checkpoints"] > 0
    assert r["distopt"]["optimizers"] == ["DistributedOptimizer"] and r["plain"]["optimizers"] != [
        "DistributedOptimizer"
    ]
    for name in ("selective", "full", "full_first1", "distopt"):
        same_steps(plain["history"], r[name]["history"])
        same_params(plain["params"], r[name]["params"])
    # Resume from the distributed optimizer's checkpoint (step 2 of 3): step 3 exactly as uninterrupted.
    assert r["resumed"]["start"] == MW.STEPS - 1
    assert r["resumed"]["history"][0]["loss"] == r["distopt"]["history"][-1]["loss"]
    assert r["resumed"]["history"][0]["grad_norm"] == r["distopt"]["history"][-1]["grad_norm"]
    for name, p in r["distopt"]["params"].items():
        assert torch.equal(r["resumed"]["params"][name], p), name
    # Evaluation at TP=2 from the DP=2 distributed-optimizer checkpoint (model weights only).
    assert r["tp2_iter"] == MW.STEPS - 1
    assert not torch.allclose(r["tp2_init_probe"], r["saved_probe"])
    torch.testing.assert_close(r["tp2_probe"], r["saved_probe"], rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(320)
def test_sequence_parallel_matches_tp2(tmp_path):
    """TP=2 with sequence parallelism (micro-batches padded to a multiple of 2 with a masked
    pseudo-sequence), also with full recompute, takes the same steps and gives the same values as
    TP=2 without; its checkpoint loads at TP=1 (no SP) for evaluation."""
    rows = MW.make_rows(MW.ROWS_PER_STEP * MW.STEPS, seed=1)
    odd = [
        mb.num_tokens % 2
        for s in range(MW.STEPS)
        for d in range(2)
        for mb in pack_rows(rows[s * MW.ROWS_PER_STEP : (s + 1) * MW.ROWS_PER_STEP][d::2], 29)
    ]
    assert any(odd)  # the padding path really runs
    ck = tmp_path / "ck"
    ck.mkdir()
    spawn(2, 2, "tp_features", str(ck), str(tmp_path / "r.pt"))
    r = torch.load(tmp_path / "r.pt")
    assert [r[n]["sequence_parallel"] for n in ("tp2", "sp", "sp_full")] == [False, True, True]
    assert r["sp_full"]["recompute"] == "full"
    for name in ("sp", "sp_full"):
        same_steps(r["tp2"]["history"], r[name]["history"])
        assert sorted(r[name]["values"]) == sorted(r["tp2"]["values"]) == list(range(5))
        for rid, v in r["tp2"]["values"].items():
            torch.testing.assert_close(r[name]["values"][rid], v, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r[name]["probe"], r["tp2"]["probe"], rtol=1e-5, atol=1e-6)
    assert r["tp1_iter"] == MW.STEPS
    torch.testing.assert_close(r["tp1_probe"], r["saved_probe"], rtol=1e-5, atol=1e-5)
