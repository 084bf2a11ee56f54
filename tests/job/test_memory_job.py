"""Memory settings through the driver (CPU, local Ray, two workers, the tiny backbone): refused
before anything is reserved when the layout cannot run them, passed to the workers, recorded in
the contract's execution facts, and a resume with another optimizer layout is refused.

The jobs run on the session's Ray cluster and its two-worker pool (`ray_cluster`,
tests/conftest.py), like the other job tests: the jobs that start their own Ray and fresh workers
are test_faults' driver run by hand and its killed driver."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.job.jobtest_helpers import quiet, tiny_train_job
from value_assets.core.contract import load_contract, read_latest
from value_assets.core.demo_data import make_demo_data
from value_assets.core.errors import InputError
from value_assets.core.job_configs import TrainJob
from value_assets.core.memory import MemoryConfig
from value_assets.gpu.drivers.train import check_resume_execution, prepare, train

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    return make_demo_data(tmp_path_factory.mktemp("data"), rows=256, heldout_rows=32, seed=0)


def mem(config: MemoryConfig) -> dict:
    """TrainJob keyword arguments of a MemoryConfig (the job config holds the knobs flat)."""
    return config.to_json()


def cfg(manifest, output, **kw) -> TrainJob:
    return tiny_train_job(manifest, output, **({"stop_after": 1} | kw))


def test_sequence_parallel_without_tensor_parallel_is_refused_by_the_config(manifest, tmp_path):
    with pytest.raises(InputError, match=r"sequence_parallel.*tensor_parallel 1"):
        cfg(manifest, tmp_path / "c", **mem(MemoryConfig(sequence_parallel=True)))
    assert not (tmp_path / "c").exists()


def test_auto_micro_batch_tokens_resolves_before_reserving(manifest, tmp_path):
    prep = prepare(cfg(manifest, tmp_path / "c", micro_batch_tokens="auto"), log=quiet)
    assert isinstance(prep.micro_batch_tokens, int)
    assert prep.micro_batch_tokens >= int(prep.train.lengths.max()) - 1
    assert not (tmp_path / "c").exists()  # prepare writes nothing


def test_recompute_layers_beyond_a_pipeline_stage_are_refused_in_prepare(manifest, tmp_path):
    run = cfg(manifest, tmp_path / "c", pipeline_parallel=2, **mem(MemoryConfig(recompute="full", recompute_layers=2)))
    with pytest.raises(InputError, match=r"recompute_layers: .*at most 1 \(2 layers over 2 stage\(s\)\), got 2"):
        prepare(run, log=quiet)
    prepare(replace(run, recompute_layers=1), log=quiet)
    assert not (tmp_path / "c").exists()


def test_resume_execution_check():
    dist = {"execution": {"tensor_parallel": 2, "pipeline_parallel": 1, "memory": {"distributed_optimizer": True}}}
    base = dict(manifest="m", output="o", gpus=4, tensor_parallel=2)
    check_resume_execution(dist, TrainJob(**base, **mem(MemoryConfig(distributed_optimizer=True))), where="ck")
    check_resume_execution({}, TrainJob(**base), where="ck")  # no facts: the plain optimizer
    with pytest.raises(InputError, match="distributed_optimizer"):
        check_resume_execution(dist, TrainJob(**base), where="ck")
    with pytest.raises(InputError, match="distributed_optimizer"):
        check_resume_execution({}, TrainJob(**base, **mem(MemoryConfig(distributed_optimizer=True))), where="ck")
    with pytest.raises(InputError, match="tensor_parallel"):
        check_resume_execution(
            dist,
            TrainJob(**{**base, "tensor_parallel": 1}, **mem(MemoryConfig(distributed_optimizer=True))),
            where="ck",
        )


def test_optimizer_offload_without_cuda_is_refused_in_prepare_naming_the_flag(manifest, tmp_path):
    run = cfg(manifest, tmp_path / "c", **mem(MemoryConfig(distributed_optimizer=True, optimizer_offload=0.5)))
    with pytest.raises(InputError, match=r"optimizer_offload: 0.5 moves the optimizer .* no CUDA GPU"):
        prepare(run, log=quiet)
    assert not (tmp_path / "c").exists()


def test_resume_refuses_another_optimizer_offload():
    base = dict(manifest="m.json", output="o", backbone="tiny", distributed_optimizer=True)
    off = {"execution": {"memory": {"distributed_optimizer": True, "optimizer_offload": 0.5}}}
    check_resume_execution(off, TrainJob(**base, optimizer_offload=0.5), where="ck")
    with pytest.raises(InputError, match=r"optimizer_offload: ck was saved with optimizer offload 0.5; .* 0\b"):
        check_resume_execution(off, TrainJob(**base), where="ck")
    plain = {"execution": {"memory": {"distributed_optimizer": True}}}  # saved before the setting: none
    check_resume_execution(plain, TrainJob(**base), where="ck")
    with pytest.raises(InputError, match=r"run with --optimizer-offload 0 "):
        check_resume_execution(plain, TrainJob(**base, optimizer_offload=1.0), where="ck")


def test_offloaded_gradients_are_pinned_only_where_the_host_holds_them():
    """HybridDeviceOptimizer pins one host buffer per offloaded parameter for its fp32 gradient and
    torch's pinned allocator rounds each up to a power of two: a 7B critic's 26.3 GiB of gradients
    took 49.5 GiB and the first step of `--optimizer-offload 1` was killed for host memory on a
    128 GiB H100 machine. `fit_host_gradients` pins them where the pinned size fits the host's
    available memory (divided between the node's training processes), else keeps them pageable,
    else refuses naming the setting. The optimizer here is a stand-in holding real tensors:
    megatron's HybridDeviceOptimizer cannot be built without CUDA (tests/gpu runs the real one)."""
    import torch

    from value_assets.gpu.runtime.step import fit_host_gradients

    class Hybrid:
        pin_cpu_grads = True

        def __init__(self, sizes):
            self.cpu_copys_map_gpu_param = {torch.zeros(n): None for n in sizes}

    class Distributed:
        def __init__(self, inner):
            self.optimizer = inner

    def offloaded(*sizes):
        return Distributed(Hybrid(sizes))

    # 3 + 5 fp32 elements: 32 bytes exact, pinned 16 + 32 = 48 (powers of two)
    opt = offloaded(3, 5)
    assert fit_host_gradients(opt, available=48, ranks_on_node=1) == "pinned" and opt.optimizer.pin_cpu_grads
    assert fit_host_gradients(opt, available=47, ranks_on_node=1) == "pageable" and not opt.optimizer.pin_cpu_grads
    assert fit_host_gradients(opt, available=96, ranks_on_node=2) == "pinned"  # two processes share the host
    assert fit_host_gradients(opt, available=95, ranks_on_node=2) == "pageable"
    with pytest.raises(InputError, match=r"optimizer_offload: .*gradients need 0\.0 GiB .* 2 training process") as err:
        fit_host_gradients(opt, available=63, ranks_on_node=2)
    assert err.value.where == "optimizer_offload"
    chained = type("Chained", (), {"chained_optimizers": [offloaded(4), offloaded(4)]})()
    assert fit_host_gradients(chained, available=32, ranks_on_node=1) == "pinned"  # 16 + 16, exact
    with pytest.raises(InputError, match="optimizer_offload"):
        fit_host_gradients(chained, available=31, ranks_on_node=1)  # both optimizers' gradients count


def test_resume_refuses_another_freeze_setting():
    frozen = {"execution": {"freeze": "attention", "memory": {"distributed_optimizer": False}}}
    check_resume_execution(frozen, TrainJob(manifest="m", output="o", freeze="attention"), where="ck")
    check_resume_execution({}, TrainJob(manifest="m", output="o"), where="ck")  # older contracts froze nothing
    with pytest.raises(InputError, match="trained with freeze 'attention'; this run asks for 'none'") as err:
        check_resume_execution(frozen, TrainJob(manifest="m", output="o"), where="ck")
    assert err.value.where == "freeze"
    with pytest.raises(InputError, match="freeze 'none'; this run asks for 'backbone'"):
        check_resume_execution({}, TrainJob(manifest="m", output="o", freeze="backbone"), where="ck")


def test_resume_refuses_another_head_bias_setting():
    zero = {"execution": {"freeze": "none", "head_bias": "zero", "memory": {"distributed_optimizer": False}}}
    check_resume_execution(zero, TrainJob(manifest="m", output="o", head_bias="zero"), where="ck")
    with pytest.raises(InputError, match="trained with head_bias 'zero'; this run asks for 'trained'") as err:
        check_resume_execution(zero, TrainJob(manifest="m", output="o"), where="ck")
    assert err.value.where == "head_bias"
    with pytest.raises(InputError, match=r"head_bias 'trained'; this run asks for 'zero'.*--head-bias trained"):
        check_resume_execution({}, TrainJob(manifest="m", output="o", head_bias="zero"), where="ck")  # older: trained


def test_memory_features_run_through_the_job_unchanged(ray_cluster, manifest, tmp_path):
    """One step with full recompute of the first layer (of the tiny backbone's two) and the
    distributed optimizer on two workers gives the plain run's loss; the contract records the
    execution facts (`recompute_layers` beside `recompute`); resuming without the distributed
    optimizer is refused in `prepare`."""
    memory = MemoryConfig(recompute="full", recompute_layers=1, distributed_optimizer=True)
    plain = train(cfg(manifest, tmp_path / "plain"), log=quiet)
    run = cfg(manifest, tmp_path / "mem", **mem(memory))
    feat = train(run, log=quiet)
    assert feat.losses == pytest.approx(plain.losses, rel=1e-5)
    contract, _ = load_contract(*read_latest(tmp_path / "mem"))
    assert contract["execution"] == {
        "tensor_parallel": 1,
        "pipeline_parallel": 1,
        "data_parallel": 2,
        "micro_batch_tokens": 4096,
        "memory": memory.to_json(),
        "freeze": "none",
        "head_bias": "trained",
    }
    assert contract["execution"]["memory"]["recompute_layers"] == 1
    with pytest.raises(InputError, match="distributed_optimizer"):
        prepare(
            replace(run, distributed_optimizer=False, recompute="none", recompute_layers=None, stop_after=None),
            log=quiet,
        )


def test_freeze_and_head_bias_are_recorded_in_the_contract_and_resume_must_match(ray_cluster, manifest, tmp_path):
    """Through the driver and Ray workers: a head-only run with the head's bias held at zero records
    `freeze` and `head_bias` in the contract's execution facts, trains the head's weight and leaves
    its bias exactly 0 (what OpenRLHF's bias-free head needs); resuming it with another setting of
    either is refused in `prepare`."""
    import torch

    from tests.job.jobtest_helpers import model_weights

    run = cfg(manifest, tmp_path / "frozen", freeze="backbone", head_bias="zero")
    result = train(run, log=quiet)
    assert len(result.losses) == 1
    step_dir, sha = read_latest(tmp_path / "frozen")
    contract, _ = load_contract(step_dir, sha)
    assert (contract["execution"]["freeze"], contract["execution"]["head_bias"]) == ("backbone", "zero")
    weights = model_weights(step_dir, tmp_path)
    assert torch.equal(weights["output_layer.bias"], torch.zeros_like(weights["output_layer.bias"]))
    assert weights["output_layer.weight"].abs().sum() > 0
    with pytest.raises(InputError, match="trained with freeze 'backbone'; this run asks for 'none'"):
        prepare(replace(run, freeze="none", stop_after=None), log=quiet)
    with pytest.raises(InputError, match="trained with head_bias 'zero'; this run asks for 'trained'"):
        prepare(replace(run, head_bias="trained", stop_after=None), log=quiet)
