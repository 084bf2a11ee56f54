"""Multi-process CPU tests (gloo): DP training, resume, TP re-sharding checkpoints.

Each test spawns ranks with torch.multiprocessing and a hard deadline; spawned ranks run the
bodies in dist_workers.py.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.multiprocessing as mp

from value_assets.gpu.runtime.parallel import free_port

from . import dist_workers as W

pytestmark = pytest.mark.integration


def spawn(world: int, tp: int, fn: str, *args, pp: int = 1, deadline_s: float = 90.0) -> None:
    ctx = mp.spawn(W.run, args=(world, free_port(), tp, fn, args, pp), nprocs=world, join=False)
    end = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=max(0.1, end - time.monotonic())):
            if time.monotonic() > end:
                raise TimeoutError(f"{fn} with world {world} did not finish in {deadline_s}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


@pytest.mark.timeout(150)
def test_dp2_matches_dp1_and_metrics_are_global(tmp_path):
    """Gradients sum over DP ranks with per-rank division by the GLOBAL row count, so DP=2 takes
    the same steps as DP=1 on the whole batch (up to summation order)."""
    in_process(W.train_dp, 4, 3, str(tmp_path / "dp1.pt"))
    spawn(2, 1, "train_dp", 4, 3, str(tmp_path / "dp2.pt"))
    a, b = torch.load(tmp_path / "dp1.pt"), torch.load(tmp_path / "dp2.pt")
    for ha, hb in zip(a["history"], b["history"]):
        assert ha["rows"] == hb["rows"] == 4
        assert ha["active_targets"] == hb["active_targets"]
        assert hb["loss"] == pytest.approx(ha["loss"], rel=1e-5)
        assert hb["grad_norm"] == pytest.approx(ha["grad_norm"], rel=1e-4)
    for name, p in a["params"].items():
        torch.testing.assert_close(b["params"][name], p, rtol=1e-4, atol=1e-5, msg=name)
    assert a["history"][-1]["loss"] < a["history"][0]["loss"]


@pytest.mark.timeout(150)
def test_resume_is_bitwise_equal_to_uninterrupted_run(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    spawn(2, 1, "train_resume", 4, 3, 2, str(ck), str(tmp_path / "r.pt"))
    r = torch.load(tmp_path / "r.pt")
    assert r["start"] == 2 and len(r["resumed"]) == 1  # only step 3 ran after the resume
    assert r["resumed"][0]["loss"] == r["full"][-1]["loss"]
    assert r["resumed"][0]["grad_norm"] == r["full"][-1]["grad_norm"]
    for name, p in r["full_params"].items():
        assert torch.equal(r["resumed_params"][name], p), name


@pytest.mark.timeout(150)
def test_tp2_checkpoint_reloads_at_tp1_and_tp2(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    spawn(2, 2, "tp_reshard", str(ck), str(tmp_path / "r.pt"))
    r = torch.load(tmp_path / "r.pt")
    saved = r["saved"]
    assert saved.shape[-1] == W.OBJ.num_bins and r["iter1"] == r["iter2"] == 7
    assert not torch.allclose(r["init1"], saved)  # the load really changed something
    assert torch.equal(r["tp2"], saved)  # same topology: bitwise
    torch.testing.assert_close(r["tp1"], saved, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world, tp, pp", [(2, 1, 2), (4, 1, 2), (4, 2, 2)], ids=["pp2", "dp2xpp2", "tp2xpp2"])
def test_pipeline_layouts_match_one_stage(tmp_path, world, tp, pp):
    """Pipeline stages (1F1B over variable-length packed micro-batches), also with data- or
    tensor-parallel peers in each stage, take the same steps as one rank: same initial weights,
    same losses, grad norms and forward-only values, and (after re-sharding the checkpoint to one
    rank) the same trained parameters."""
    steps, rows_per_step = 3, 6
    for name in ("one", "many"):
        (tmp_path / name).mkdir()
    init = str(tmp_path / "init.pt")
    in_process(W.train_layout, rows_per_step, steps, str(tmp_path / "one"), init, str(tmp_path / "r1"))
    spawn(world, tp, "train_layout", rows_per_step, steps, str(tmp_path / "many"), init, str(tmp_path / "r2"), pp=pp,
          deadline_s=200.0)
    one = torch.load(tmp_path / "r1.0")
    ranks = [torch.load(tmp_path / f"r2.{r}") for r in range(world)]
    per_stage = world // pp
    assert [r["first_stage"] for r in ranks] == [True] * per_stage + [False] * (world - per_stage)
    assert [r["last_stage"] for r in ranks] == [False] * (world - per_stage) + [True] * per_stage
    if tp == 1:
        for r in ranks:
            assert r["init_keys_match"] and r["init_equal"]  # each stage holds its part of the same model
    assert len(one["history"]) == steps
    for r in ranks:
        for h1, h2 in zip(one["history"], r["history"], strict=True):
            assert h2["rows"] == h1["rows"] == rows_per_step and h2["tokens"] == h1["tokens"]
            assert h2["loss"] == pytest.approx(h1["loss"], rel=1e-5)  # metrics reach every rank and stage
            assert h2["grad_norm"] == pytest.approx(h1["grad_norm"], rel=1e-4)
        if not r["last_stage"]:
            assert r["values"] == {}  # only the last stage has values
            continue
        assert sorted(r["values"]) == sorted(one["values"]) == list(range(5))
        for rid, v in one["values"].items():
            torch.testing.assert_close(r["values"][rid], v, rtol=1e-4, atol=1e-5)
    assert one["history"][-1]["loss"] < one["history"][0]["loss"]
    in_process(W.load_params, str(tmp_path / "one"), str(tmp_path / "p1.pt"))
    in_process(W.load_params, str(tmp_path / "many"), str(tmp_path / "p2.pt"))
    a, b = torch.load(tmp_path / "p1.pt"), torch.load(tmp_path / "p2.pt")
    assert sorted(a) == sorted(b)
    for name, p in a.items():
        torch.testing.assert_close(b[name], p, rtol=1e-4, atol=1e-5, msg=name)
    init_w = torch.load(init)["decoder.layers.1.mlp.linear_fc2.weight"]
    assert not torch.allclose(a["decoder.layers.1.mlp.linear_fc2.weight"], init_w)  # training moved the second stage


def in_process(fn, *args):
    from value_assets.gpu.runtime.parallel import destroy, init_distributed

    init_distributed(0, 1, master_port=free_port(), seed=1234)
    try:
        fn(0, 1, 1, *args)
    finally:
        destroy()


@pytest.mark.timeout(30)
def test_save_refuses_non_empty_folder(tmp_path):
    from value_assets.gpu.runtime.checkpoint import save_critic

    (tmp_path / "x").write_text("x")
    with pytest.raises(FileExistsError):
        in_process(lambda *a: save_critic(tmp_path, torch.nn.Linear(1, 1)))
