"""Multi-process CPU tests (gloo): DP training, resume, TP re-sharding checkpoints.

Each test spawns ranks with torch.multiprocessing and a hard deadline; spawned ranks run the
bodies in dist_workers.py.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
import dist_workers as W  # noqa: E402

from value_assets.gpu.parallel import free_port  # noqa: E402

pytestmark = pytest.mark.integration


def spawn(world: int, tp: int, fn: str, *args, deadline_s: float = 90.0) -> None:
    ctx = mp.spawn(W.run, args=(world, free_port(), tp, fn, args), nprocs=world, join=False)
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
    spawn(1, 1, "train_dp", 4, 3, None, str(tmp_path), False, str(tmp_path / "dp1.pt"))
    spawn(2, 1, "train_dp", 4, 3, None, str(tmp_path), False, str(tmp_path / "dp2.pt"))
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
    spawn(2, 1, "train_dp", 4, 3, 2, str(ck), False, str(tmp_path / "full.pt"))
    spawn(2, 1, "train_dp", 4, 3, 2, str(ck), True, str(tmp_path / "resumed.pt"))
    full, resumed = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "resumed.pt")
    assert len(resumed["history"]) == 1  # only step 3 ran after the resume
    assert resumed["history"][0]["loss"] == full["history"][-1]["loss"]
    for name, p in full["params"].items():
        assert torch.equal(resumed["params"][name], p), name


@pytest.mark.timeout(200)
def test_tp2_checkpoint_reloads_at_tp1_and_tp2(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    spawn(2, 2, "save_tp", str(ck), str(tmp_path / "saved.pt"))
    spawn(1, 1, "load_tp", str(ck), str(tmp_path / "tp1.pt"))
    spawn(2, 2, "load_tp", str(ck), str(tmp_path / "tp2.pt"))
    saved = torch.load(tmp_path / "saved.pt")
    assert saved.shape[-1] == W.OBJ.num_bins
    assert torch.equal(torch.load(tmp_path / "tp2.pt"), saved)  # same topology: bitwise
    torch.testing.assert_close(torch.load(tmp_path / "tp1.pt"), saved, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(30)
def test_save_refuses_non_empty_folder(tmp_path):
    (tmp_path / "x").write_text("x")
    with pytest.raises(FileExistsError):
        spawn_inline_save(tmp_path)


def spawn_inline_save(path):
    from value_assets.gpu.checkpoint import save_critic
    from value_assets.gpu.parallel import destroy, init_distributed

    init_distributed(0, 1, master_port=free_port())
    try:
        save_critic(path, torch.nn.Linear(1, 1))
    finally:
        destroy()
