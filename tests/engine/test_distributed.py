"""Multi-process CPU tests (gloo): DP training, resume, TP re-sharding checkpoints, pipeline layouts.

Ranks, forked from a server that has already imported torch and megatron (tests/ranks.py), run the
bodies in dist_workers.py under a hard deadline. Launches are shared: one of 2 ranks runs the DP,
resume, TP and PP=2 bodies in turn, one of 4 ranks the DPxPP and TPxPP layouts; the tests then
check their own body's results.
"""

from __future__ import annotations

import datetime

import pytest
import torch

from tests.engine import dist_workers as W
from tests.ranks import run_ranks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

# The pipeline-layout runs: optimizer steps and rows per step.
STEPS, ROWS_PER_STEP = 3, 6


def spawn(world: int, calls: list[tuple[str, int, int, tuple]], deadline_s: float) -> None:
    """`world` ranks running `calls` ((body, tp, pp, args), in order) in one process group."""
    run_ranks(W.run, (calls,), world, deadline_s=deadline_s, what=str([c[0] for c in calls]))


@pytest.fixture(scope="module")
def one_stage(tmp_path_factory):
    """The one-rank reference of the pipeline layouts, in this process: it writes the whole model's
    initial state (`init.pt`) the layouts start from, trains, and its parameters are read back."""
    root = tmp_path_factory.mktemp("one-stage")
    (root / "ck").mkdir()
    in_process(W.train_layout, ROWS_PER_STEP, STEPS, str(root / "ck"), str(root / "init.pt"), str(root / "r"))
    in_process(W.load_params, str(root / "ck"), str(root / "params.pt"))
    return root


def _layout(root, name: str, one_stage) -> tuple:
    (root / f"{name}-ck").mkdir()
    return (ROWS_PER_STEP, STEPS, str(root / f"{name}-ck"), str(one_stage / "init.pt"), str(root / name))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, one_stage):
    """One spawn of 2 ranks: DP=2 training, the interrupted and resumed run, TP=2 re-sharding, PP=2."""
    root = tmp_path_factory.mktemp("two-ranks")
    for name in ("resume-ck", "tp-ck"):
        (root / name).mkdir()
    spawn(
        2,
        [
            ("train_dp", 1, 1, (4, 3, str(root / "dp2.pt"))),
            ("train_resume", 1, 1, (4, 3, 2, str(root / "resume-ck"), str(root / "resume.pt"))),
            ("tp_reshard", 2, 1, (str(root / "tp-ck"), str(root / "tp.pt"))),
            ("train_layout", 1, 2, _layout(root, "pp2", one_stage)),
        ],
        deadline_s=600.0,
    )
    return root


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory, one_stage):
    """One spawn of 4 ranks: pipeline stages with data-parallel, then with tensor-parallel peers."""
    root = tmp_path_factory.mktemp("four-ranks")
    spawn(
        4,
        [
            ("train_layout", 1, 2, _layout(root, "dp2xpp2", one_stage)),
            ("train_layout", 2, 2, _layout(root, "tp2xpp2", one_stage)),
        ],
        deadline_s=600.0,
    )
    return root


def test_dp2_matches_dp1_and_metrics_are_global(tmp_path, two_ranks):
    """Gradients sum over DP ranks with per-rank division by the GLOBAL row count, so DP=2 takes
    the same steps as DP=1 on the whole batch (up to summation order)."""
    in_process(W.train_dp, 4, 3, str(tmp_path / "dp1.pt"))
    a, b = torch.load(tmp_path / "dp1.pt"), torch.load(two_ranks / "dp2.pt")
    for ha, hb in zip(a["history"], b["history"], strict=True):
        assert ha["rows"] == hb["rows"] == 4
        assert ha["active_targets"] == hb["active_targets"]
        assert hb["loss"] == pytest.approx(ha["loss"], rel=1e-5)
        assert hb["grad_norm"] == pytest.approx(ha["grad_norm"], rel=1e-4)
    for name, p in a["params"].items():
        torch.testing.assert_close(b["params"][name], p, rtol=1e-4, atol=1e-5, msg=name)
    assert a["history"][-1]["loss"] < a["history"][0]["loss"]


def test_resume_is_bitwise_equal_to_uninterrupted_run(two_ranks):
    r = torch.load(two_ranks / "resume.pt")
    assert r["start"] == 2 and len(r["resumed"]) == 1  # only step 3 ran after the resume
    assert r["resumed"][0]["loss"] == r["full"][-1]["loss"]
    assert r["resumed"][0]["grad_norm"] == r["full"][-1]["grad_norm"]
    for name, p in r["full_params"].items():
        assert torch.equal(r["resumed_params"][name], p), name


def test_tp2_checkpoint_reloads_at_tp1_and_tp2(two_ranks):
    r = torch.load(two_ranks / "tp.pt")
    saved = r["saved"]
    assert saved.shape[-1] == W.OBJ.num_bins and r["iter1"] == r["iter2"] == 7
    assert not torch.allclose(r["init1"], saved)  # the load really changed something
    assert torch.equal(r["tp2"], saved)  # same topology: bitwise
    torch.testing.assert_close(r["tp1"], saved, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world, tp, pp", [(2, 1, 2), (4, 1, 2), (4, 2, 2)], ids=["pp2", "dp2xpp2", "tp2xpp2"])
def test_pipeline_layouts_match_one_stage(request, one_stage, world, tp, pp):
    """Pipeline stages (1F1B over variable-length packed micro-batches), also with data- or
    tensor-parallel peers in each stage, take the same steps as one rank: same initial weights,
    same losses, grad norms and forward-only values, and (after re-sharding the checkpoint to one
    rank) the same trained parameters."""
    layout = request.node.callspec.id
    root = request.getfixturevalue("two_ranks" if world == 2 else "four_ranks")
    one = torch.load(one_stage / "r.0")
    ranks = [torch.load(root / f"{layout}.{r}") for r in range(world)]
    per_stage = world // pp
    assert [r["first_stage"] for r in ranks] == [True] * per_stage + [False] * (world - per_stage)
    assert [r["last_stage"] for r in ranks] == [False] * (world - per_stage) + [True] * per_stage
    if tp == 1:
        for r in ranks:
            assert r["init_keys_match"] and r["init_equal"]  # each stage holds its part of the same model
    assert len(one["history"]) == STEPS
    for r in ranks:
        for h1, h2 in zip(one["history"], r["history"], strict=True):
            assert h2["rows"] == h1["rows"] == ROWS_PER_STEP and h2["tokens"] == h1["tokens"]
            assert h2["loss"] == pytest.approx(h1["loss"], rel=1e-5)  # metrics reach every rank and stage
            assert h2["grad_norm"] == pytest.approx(h1["grad_norm"], rel=1e-4)
        if not r["last_stage"]:
            assert r["values"] == {}  # only the last stage has values
            continue
        assert sorted(r["values"]) == sorted(one["values"]) == list(range(5))
        for rid, v in one["values"].items():
            torch.testing.assert_close(r["values"][rid], v, rtol=1e-4, atol=1e-5)
    assert one["history"][-1]["loss"] < one["history"][0]["loss"]
    params = root / f"{layout}-params.pt"
    in_process(W.load_params, str(root / f"{layout}-ck"), str(params))
    a, b = torch.load(one_stage / "params.pt"), torch.load(params)
    assert sorted(a) == sorted(b)
    for name, p in a.items():
        torch.testing.assert_close(b[name], p, rtol=1e-4, atol=1e-5, msg=name)
    init_w = torch.load(one_stage / "init.pt")["decoder.layers.1.mlp.linear_fc2.weight"]
    assert not torch.allclose(a["decoder.layers.1.mlp.linear_fc2.weight"], init_w)  # training moved the second stage


def in_process(fn, *args):
    from value_assets.gpu.runtime.parallel import destroy, init_distributed

    init_distributed(0, 1, master_port=0, seed=1234)  # 0: rank 0's store binds a free port itself
    try:
        fn(0, 1, 1, *args)
    finally:
        destroy()


@pytest.mark.timeout(60)
def test_rank_zero_holds_the_rendezvous_port_it_reports_until_it_joins(monkeypatch):
    """A port found free and then closed can be taken by any process before rank 0 binds it (seen
    under load: EADDRINUSE in a worker's setup). The port rank 0 reports is already its store's."""
    import errno
    import os
    import socket

    from value_assets.core.backbone import BackboneConfig
    from value_assets.core.memory import Layout
    from value_assets.core.objective import Objective
    from value_assets.core.worker_spec import WorkerSpec
    from value_assets.gpu.runtime.parallel import destroy, init_distributed, open_rendezvous
    from value_assets.gpu.workers.worker import RENDEZVOUS_ADDR_ENV, CriticWorker

    def taken(host: str, port: int) -> bool:
        with socket.socket() as other:
            try:
                other.bind((host, port))
            except OSError as e:
                assert e.errno == errno.EADDRINUSE, e
                return True
            return False

    monkeypatch.setenv(RENDEZVOUS_ADDR_ENV, "127.0.0.1")
    worker = CriticWorker(
        WorkerSpec(backbone=BackboneConfig.tiny(), objective=Objective(), layout=Layout(), seed=0), rank=0
    )
    host, port = worker.address(timeout_s=42.0)
    assert host == "127.0.0.1" and taken(host, port)
    # the job's deadline (TrainJob/EvaluateJob timeout_s) is the store's: the other ranks may join that late
    assert worker._rendezvous.timeout == datetime.timedelta(seconds=42)
    worker.shutdown()  # drops the store unused: the port is free again
    assert not taken(host, port)

    store = open_rendezvous("127.0.0.1", 60.0)
    assert taken("127.0.0.1", store.port)
    init_distributed(0, 1, "127.0.0.1", store.port, seed=1234, store=store)
    try:
        assert os.environ["MASTER_PORT"] == str(store.port)
        t = torch.ones(3)
        torch.distributed.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0]
    finally:
        destroy()


@pytest.mark.timeout(30)
def test_save_refuses_non_empty_folder(tmp_path):
    from value_assets.gpu.runtime.checkpoint import save_critic

    (tmp_path / "x").write_text("x")
    with pytest.raises(FileExistsError):
        in_process(lambda *a: save_critic(tmp_path, torch.nn.Linear(1, 1)))


@pytest.mark.timeout(120)
def test_a_writer_killed_during_a_training_save_cannot_hang_it(tmp_path):
    """megatron-core 0.16's torch_dist save forks a writer process per file and waits for them
    without a deadline: one SIGKILLed (the OOM killer) hung the worker's save for good, and its job
    waited out its whole deadline (900 s by default) before failing. Saves are written in the
    worker's own process (`checkpoint.in_process_save_strategy`): here every process a save forks
    dies at birth, and the save still completes, in the format megatron's own load reads back."""
    spawn(2, [("save_with_writers_killed", 1, 1, (str(tmp_path), str(tmp_path / "r.pt")))], deadline_s=60.0)
    r = torch.load(tmp_path / "r.pt")
    assert r["iteration"] == 2
    assert torch.equal(r["loaded"], r["saved"])
    files = sorted(p.name for p in (tmp_path / "second").iterdir())
    # rank 1 holds replicas only: it writes no data file, as megatron's writer did
    assert ".metadata" in files and [f for f in files if f.endswith(".distcp")] == ["__0_0.distcp"], files


def _check_frozen(r: dict, freeze: str) -> None:
    frozen = set(r["frozen"])
    names = set(r["before"])
    if freeze == "backbone":
        assert frozen == {n for n in names if not n.startswith("output_layer.")}
    else:
        assert frozen and all(".self_attention." in n for n in frozen)
        assert {n for n in names if "linear_qkv" in n or "linear_proj" in n} <= frozen
    for name in names:
        if name in frozen:
            assert torch.equal(r["after"][name], r["before"][name]), f"frozen {name} changed"
            assert r["requires_grad"][name] is False
        else:
            assert not torch.equal(r["after"][name], r["before"][name]), f"trainable {name} did not change"


@pytest.mark.timeout(120)
def test_head_only_warmup_changes_only_the_head_and_the_loss_decreases(tmp_path):
    in_process(W.train_frozen, "backbone", False, 4, 8, str(tmp_path / "r.pt"))
    r = torch.load(tmp_path / "r.pt")
    _check_frozen(r, "backbone")
    losses = [h["loss"] for h in r["history"]]
    assert losses[-1] < losses[0], losses


@pytest.mark.timeout(150)
def test_frozen_attention_is_bitwise_unchanged_with_the_distributed_optimizer(tmp_path):
    spawn(2, [("train_frozen", 1, 1, ("attention", True, 4, 3, str(tmp_path / "r.pt")))], deadline_s=120)
    _check_frozen(torch.load(tmp_path / "r.pt"), "attention")


@pytest.mark.timeout(120)
def test_weights_loaded_after_the_optimizer_survive_the_first_bf16_step(monkeypatch):
    """A training worker bootstraps (or warm-starts) its critic after the optimizer exists. Under
    bf16 (every GPU run) megatron's optimizer steps fp32 master copies it took when it was built and
    writes them back: without `reload_model_params` the first step put the random initial weights
    back and the actor's backbone was gone (found by trying; the CPU suite trains in fp32, which has
    no master copies). Shim, test only: megatron's bf16 optimizer accepts only CUDA tensor types, so
    `Tensor.type()` names CPU tensors as their CUDA types here."""
    import numpy as np

    from value_assets.core.backbone import BackboneConfig
    from value_assets.core.memory import Layout
    from value_assets.core.objective import Objective
    from value_assets.core.worker_spec import WorkerSpec
    from value_assets.gpu.model.gpt_critic import build_critic
    from value_assets.gpu.model.packing import Row, pack_rows
    from value_assets.gpu.runtime.parallel import destroy, init_distributed
    from value_assets.gpu.runtime.step import optimizer_step, wrap_for_training
    from value_assets.gpu.workers.worker import CriticWorker

    plain_type = torch.Tensor.type

    def cuda_named(self, *args, **kwargs):
        name = plain_type(self, *args, **kwargs)
        return name.replace("torch.", "torch.cuda.", 1) if not args and not kwargs and ".cuda." not in name else name

    monkeypatch.setattr(torch.Tensor, "type", cuda_named)
    backbone = BackboneConfig.tiny(num_layers=2, hidden_size=32, ffn_hidden_size=64, vocab_size=1000)
    init_distributed(0, 1, master_port=0, tp=1, pp=1, seed=1)  # 0: rank 0's store binds a free port itself
    try:
        worker = CriticWorker(WorkerSpec(backbone=backbone, objective=Objective(), layout=Layout(), seed=0), rank=0)
        model = build_critic(backbone, Objective(), bf16=True)
        worker.model, worker.optimizer = wrap_for_training(model, lr=1e-6, weight_decay=0.0, clip_grad=1.0)
        inner = getattr(worker.optimizer, "chained_optimizers", [worker.optimizer])
        assert {type(o).__name__ for o in inner} == {"Float16OptimizerWithFloat16Params"}
        worker.bootstrap({"kind": "tiny", "seed": 7})  # another initialisation than the one the optimizer copied
        expected = {n: p.detach().float().clone() for n, p in model.named_parameters() if "decoder" in n}
        rng = np.random.default_rng(0)
        rows = [
            Row(row_id=i, tokens=rng.integers(0, 1000, 12), response_length=4, returns=np.ones(4)) for i in range(2)
        ]
        optimizer_step(worker.model, worker.optimizer, pack_rows(rows, 4096), 2, Objective())
        # lr 1e-6 moves a weight by about 1e-6: each stays at its loaded value to bf16 precision
        drift = max(
            float((p.detach().float() - expected[n]).abs().max()) for n, p in model.named_parameters() if n in expected
        )
        assert drift < 1e-2, drift
    finally:
        destroy()
