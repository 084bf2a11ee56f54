"""GPU tier: runs on the accelerator machine (CUDA, NCCL, bf16); skipped without CUDA."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest

from tests.gpu.gpu_helpers import two_task_rows
from tests.job.jobtest_helpers import a_weight_byte

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.timeout(900),
]


@pytest.fixture
def single_rank():
    from value_assets.gpu.runtime.parallel import destroy, init_distributed

    init_distributed(0, 1, "127.0.0.1", 0)
    try:
        yield
    finally:
        destroy()


def test_packed_bf16_attention_matches_per_sequence_sdpa(single_rank):
    from value_assets.gpu.model.attention import packed_causal_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = [5, 130, 1, 511, 64]
    t = sum(lengths)
    q = torch.randn(t, 8, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(t, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(t, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device="cuda")
    out = packed_causal_attention(q, k, v, cu, 64**-0.5).float()
    ref = []
    for a, b in pairwise(cu.tolist()):
        qq, kk, vv = (x[a:b].transpose(0, 1).float() for x in (q, k, v))
        kk, vv = kk.repeat_interleave(4, 0), vv.repeat_interleave(4, 0)
        ref.append(torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True).transpose(0, 1))
    ref = torch.cat(ref)
    assert (out - ref).abs().max().item() < 3e-2  # bf16 inputs, fp32 reference


def test_varlen_kernel_matches_sdpa_loop_on_cuda():
    """The varlen kernel (bf16 on CUDA) against the SDPA loop path in float32."""
    from value_assets.gpu.model.attention import packed_causal_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    bounds = torch.tensor([0, 17, 18, 80], dtype=torch.int32, device="cuda")
    q = torch.randn(80, 8, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(80, 2, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(80, 2, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    got = packed_causal_attention(q, k, v, bounds, 0.125).float()
    ref = packed_causal_attention(q.float(), k.float(), v.float(), bounds, 0.125)  # SDPA loop path
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)


def test_long_sequences_on_cudnn_match_varlen_forward_and_backward(monkeypatch):
    """Sequences >= LONG_SEQUENCE take cuDNN's attention, the short ones between them varlen: the
    output against a float32 per-sequence reference, and output and gradients against the
    all-varlen path (the threshold raised), in bf16."""
    from value_assets.gpu.model import attention as A

    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = [100, A.LONG_SEQUENCE, 300, 7, A.LONG_SEQUENCE + 808, 5]
    t = sum(lengths)
    bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    q0 = torch.randn(t, 12, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k0 = torch.randn(t, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v0 = torch.randn(t, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    grad = torch.randn(t, 12, 128, device="cuda", dtype=torch.bfloat16, generator=g)

    def run():
        q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
        out = A.packed_causal_attention(q, k, v, cu, 128**-0.5, bounds=bounds)
        out.backward(grad)
        return out.detach().float(), [x.grad.float() for x in (q, k, v)]

    calls = []
    real = A._long_sequence
    monkeypatch.setattr(A, "_long_sequence", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    hybrid, hybrid_grads = run()
    assert calls == [A.LONG_SEQUENCE, A.LONG_SEQUENCE + 808]  # exactly the two long sequences took cuDNN
    monkeypatch.setattr(A, "LONG_SEQUENCE", 10**9)
    plain, plain_grads = run()
    assert len(calls) == 2
    torch.testing.assert_close(hybrid, plain, rtol=2e-2, atol=2e-2)
    for a, b in zip(hybrid_grads, plain_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2)
    for a, b in pairwise(bounds):
        qq, kk, vv = (x[a:b].transpose(0, 1).float() for x in (q0, k0, v0))
        ref = torch.nn.functional.scaled_dot_product_attention(
            qq, kk.repeat_interleave(6, 0), vv.repeat_interleave(6, 0), is_causal=True, scale=128**-0.5
        ).transpose(0, 1)
        assert (hybrid[a:b] - ref).abs().max().item() < 3e-2


def test_bf16_critic_trains_on_cuda_with_an_fp32_head(single_rank):
    from value_assets.core.objective import Objective
    from value_assets.gpu.model.gpt_critic import BackboneConfig, build_critic
    from value_assets.gpu.model.packing import pack_rows
    from value_assets.gpu.runtime.step import optimizer_step, wrap_for_training

    obj = Objective()
    model = build_critic(BackboneConfig.tiny(), obj)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    from value_assets.gpu.model.gpt_critic import critic_forward

    out = critic_forward(
        model,
        torch.arange(8, device="cuda"),
        torch.arange(8, device="cuda"),
        torch.tensor([0, 8], dtype=torch.int32, device="cuda"),
        8,
    )
    assert out.dtype == torch.float32 and out.shape == (8, obj.head_size)  # the head outputs float32
    ddp, opt = wrap_for_training(model, lr=2e-3, weight_decay=0.0, clip_grad=1.0)
    rows = two_task_rows()
    losses = []
    for _ in range(30):
        m = optimizer_step(ddp, opt, pack_rows(rows, 4096), 32, obj)
        losses.append(m["loss"])
        assert np.isfinite(m["loss"]) and m["grad_norm"] is not None
    assert losses[-1] < 0.5 * losses[0], losses

    # The host waits for the GPU a few times per step (the micro-batch's 8 host->device copies,
    # the step's metrics, megatron's checks), not once per parameter (megatron's grad-norm
    # fallback: grad_norm.py).
    import warnings

    syncs = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *a, **k: syncs.append(str(message))
        torch.cuda.set_sync_debug_mode("warn")
        try:
            optimizer_step(ddp, opt, pack_rows(rows, 4096), 32, obj)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [m for m in syncs if "synchronizing CUDA operation" in m]
    n_params = sum(1 for p in model.parameters() if p.requires_grad)
    assert 0 < len(syncs) <= 14 < n_params, (len(syncs), n_params, syncs[:3])


def test_job_trains_evaluates_and_gates_on_one_gpu(tmp_path):
    """The whole Ray job on the GPU: placement group with a GPU bundle, NCCL, bf16."""
    from value_assets.core.demo_data import make_demo_data
    from value_assets.core.job_configs import EvaluateJob, TrainJob
    from value_assets.gpu.drivers.evaluate import evaluate
    from value_assets.gpu.drivers.train import train

    m = make_demo_data(tmp_path / "data", seed=0)
    out = tmp_path / "critic"
    res = train(
        TrainJob(manifest=m, output=out, backbone="tiny", global_batch_size=32, epochs=1, lr=2e-3, gpus=1), log=print
    )
    ev = evaluate(
        EvaluateJob(
            checkpoint=out, manifest=m, contract_sha256=res.contract_sha256, report=tmp_path / "ev.json", gpus=1
        ),
        log=print,
    )
    optimal = json.loads(Path(m).read_text())["provenance"]["bayes_optimal_trajectory_ev_heldout"]
    agg = ev.report["aggregates"]
    print(
        json.dumps(
            {
                "token_ev": agg["token"]["ev"],
                "trajectory_ev": agg["trajectory"]["ev"],
                "optimal": optimal,
                "tokens_per_s_last": res.metrics[-1]["tokens_per_s"],
            }
        )
    )
    assert ev.passed and agg["trajectory"]["ev"] >= 0.5 * optimal


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("layout", [{"pipeline_parallel": 2}, {"tensor_parallel": 2}, {}], ids=["pp2", "tp2", "dp2"])
def test_two_gpu_layouts_train_like_one_gpu(tmp_path, layout):
    """NCCL across two GPUs (pipeline p2p, tensor-parallel all-reduces, data-parallel gradient
    sums): the same planned steps as one GPU, within bf16 tolerance, and the same report when
    the two-GPU checkpoint is evaluated on two GPUs and re-sharded onto one."""
    from value_assets.core.demo_data import make_demo_data
    from value_assets.core.job_configs import EvaluateJob, TrainJob
    from value_assets.gpu.drivers.evaluate import evaluate
    from value_assets.gpu.drivers.train import train

    m = make_demo_data(tmp_path / "data", seed=0)
    base = dict(manifest=m, backbone="tiny", global_batch_size=32, epochs=1, lr=2e-3, stop_after=8)
    one = train(TrainJob(output=tmp_path / "one", gpus=1, **base), log=print)
    two = train(TrainJob(output=tmp_path / "two", gpus=2, **layout, **base), log=print)
    assert two.losses == pytest.approx(one.losses, rel=2e-2)
    evs = []
    for name, gpus, kw in (("two", 2, layout), ("resharded", 1, {})):
        ev = evaluate(
            EvaluateJob(
                checkpoint=tmp_path / "two",
                manifest=m,
                contract_sha256=two.contract_sha256,
                report=tmp_path / f"{name}.json",
                gpus=gpus,
                **kw,
            ),
            log=print,
        )
        evs.append(ev.report["aggregates"]["trajectory"]["ev"])
    print(json.dumps({"layout": layout, "losses_one": one.losses, "losses_two": two.losses, "traj_ev": evs}))
    assert evs[0] == pytest.approx(evs[1], abs=1e-2)


def test_a_saved_critic_reloads_through_checked_reads_and_a_changed_shard_is_refused(single_rank, tmp_path):
    """megatron-core's loader on the GPU machine goes through the checked reader
    (gpu/runtime/checkpoint.py): model and optimizer come back exactly, and a shard that no
    longer matches the contract's binding is refused by name."""
    from value_assets.core.checkpoint_files import describe_folder
    from value_assets.core.errors import InputError
    from value_assets.core.objective import Objective
    from value_assets.gpu.model.gpt_critic import BackboneConfig, build_critic
    from value_assets.gpu.model.packing import Row, pack_rows
    from value_assets.gpu.runtime.checkpoint import load_critic, load_model_weights, save_critic
    from value_assets.gpu.runtime.step import optimizer_step, wrap_for_training

    obj = Objective()
    rng = np.random.default_rng(0)
    rows = [
        Row(row_id=i, tokens=rng.integers(2000, 49152, size=40), response_length=20, returns=np.full(20, float(i % 2)))
        for i in range(16)
    ]
    ddp, opt = wrap_for_training(build_critic(BackboneConfig.tiny(), obj), lr=2e-3, weight_decay=0.0, clip_grad=1.0)
    for _ in range(2):
        optimizer_step(ddp, opt, pack_rows(rows, 4096), 16, obj)
    save = tmp_path / "iter_0000002"
    save.mkdir()
    save_critic(save, ddp, opt, iteration=2)
    contract = {"checkpoint_files": describe_folder(save)}

    ddp2, opt2 = wrap_for_training(build_critic(BackboneConfig.tiny(), obj), lr=2e-3, weight_decay=0.0, clip_grad=1.0)
    assert load_critic(save, ddp2, opt2, contract=contract) == 2
    for (name, a), b in zip(ddp.module.state_dict().items(), ddp2.module.state_dict().values(), strict=True):
        if torch.is_tensor(a):
            assert torch.equal(a, b), name
    after = [optimizer_step(m, o, pack_rows(rows, 4096), 16, obj)["loss"] for m, o in ((ddp, opt), (ddp2, opt2))]
    assert after[0] == after[1]  # the optimizer state came back too

    shard, offset = a_weight_byte(save)
    data = bytearray(shard.read_bytes())
    data[offset] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(
        InputError, match=rf"{shard.name}: chunk \d+ of \d+ \(bytes [\d.]+\): read sha256 [0-9a-f]{{64}}, the"
    ):
        load_model_weights(save, build_critic(BackboneConfig.tiny(), obj), contract=contract)


def test_optimizer_offload_trains_like_the_gpu_optimizer_and_resumes_exactly(tmp_path):
    """Optimizer CPU offload (megatron-core's HybridDeviceOptimizer) through the whole job on one
    GPU: the first step's loss is the plain distributed optimizer's exactly (same weights), the
    later ones within bf16 noise (the update runs in fp32 on the CPU instead of the GPU), the
    contract records the fraction, and a run stopped after a save resumes from the offloaded
    optimizer state to the uninterrupted run's losses bit for bit."""
    from dataclasses import replace

    from value_assets.core.contract import load_contract, read_latest
    from value_assets.core.demo_data import make_demo_data
    from value_assets.core.job_configs import TrainJob
    from value_assets.gpu.drivers.train import train

    m = make_demo_data(tmp_path / "data", seed=0)
    base = TrainJob(
        manifest=m,
        output=tmp_path / "plain",
        backbone="tiny",
        global_batch_size=32,
        epochs=1,
        lr=2e-3,
        gpus=1,
        distributed_optimizer=True,
        save_interval=32,
    )
    plain = train(base, log=print)
    full = train(replace(base, output=tmp_path / "full", optimizer_offload=1.0), log=print)
    half = train(replace(base, output=tmp_path / "half", optimizer_offload=0.5), log=print)
    print(json.dumps({"plain": plain.losses, "offload_1": full.losses, "offload_0.5": half.losses}))
    for run in (full, half):
        assert run.losses[0] == plain.losses[0]
        np.testing.assert_allclose(run.losses, plain.losses, rtol=0.03)
        assert run.losses[-1] < 0.8 * run.losses[0]  # it learns
    contract, _ = load_contract(*read_latest(tmp_path / "half"))
    assert contract["execution"]["memory"]["optimizer_offload"] == 0.5

    out = tmp_path / "resumed"
    first = train(replace(base, output=out, optimizer_offload=0.5, stop_after=4), log=print)
    assert first.completed_steps == 4
    second = train(replace(base, output=out, optimizer_offload=0.5), log=print)
    assert second.resumed_from == 4 and second.losses == half.losses[4:]
