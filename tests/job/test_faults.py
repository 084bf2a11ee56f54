"""Fault injection on real saves (issue 9): local Ray, the tiny backbone on CPU, real megatron files.

One small critic is trained once (8 steps, saves at 4 and 8) and copied per test; each test
tampers with its copy the way a tester did, and the job must refuse before deserializing anything,
or recover where the rule says so. Only a few tests train (data changed mid-run, disk full, kill and
resume, a run stopped early and resumed): every training costs seconds on a 2-core machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.job.jobtest_helpers import WEIGHT_ATOL, a_weight_byte, max_weight_difference, quiet, tiny_train_job
from tests.tmpfs import small_tmpfs
from value_assets.cli import main as cli_main
from value_assets.core.contract import CONTRACT_NAME, LATEST_NAME, iter_dirname, load_contract, read_latest
from value_assets.core.demo_data import make_demo_data
from value_assets.core.errors import InputError
from value_assets.core.job_configs import EvaluateJob, TrainJob
from value_assets.gpu.drivers.evaluate import evaluate
from value_assets.gpu.drivers.train import prepare, train

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

STEPS = 8


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    return make_demo_data(tmp_path_factory.mktemp("data"), rows=64, heldout_rows=32, seed=0)


def cfg_for(manifest: Path, output: Path, **kw) -> TrainJob:
    return tiny_train_job(manifest, output, **({"global_batch_size": 8, "save_interval": 4} | kw))


@pytest.fixture(scope="module")
def trained(ray_cluster, manifest, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained") / "critic"
    result = train(cfg_for(manifest, out), log=quiet)
    assert result.completed_steps == STEPS and (out / iter_dirname(4) / CONTRACT_NAME).is_file()
    return out, result


@pytest.fixture
def critic(trained, tmp_path):
    """A private copy of the trained critic folder, to tamper with."""
    dst = tmp_path / "critic"
    shutil.copytree(trained[0], dst)
    return dst


@pytest.fixture
def no_cluster(monkeypatch):
    """Refusals must come before any worker is reserved (and so before any byte is deserialized)."""
    from value_assets.gpu.workers import cluster

    monkeypatch.setattr(cluster, "start_workers", lambda *_, **__: pytest.fail("the cluster must not be reserved"))


def shards(save: Path) -> list[str]:
    """The save's torch_dist data files (one per rank: `checkpoint.in_process_save_strategy`)."""
    return sorted(p.name for p in save.glob("*.distcp"))


def saved_file(save: Path, kind: str) -> str:
    """A file of the save by what it holds: the index, the common state (0.16's common.pt; inside
    the first data file in 0.19), the last data file."""
    if kind == "index":
        return ".metadata"
    if kind == "common":
        return "common.pt" if (save / "common.pt").exists() else shards(save)[0]
    return shards(save)[-1]


def last_save(critic: Path) -> Path:
    return critic / iter_dirname(STEPS)


def eval_cfg(critic: Path, manifest: Path, report: Path, sha: str | None = None) -> EvaluateJob:
    return EvaluateJob(
        checkpoint=critic,
        manifest=manifest,
        report=report,
        gpus=2,
        contract_sha256=sha or load_contract(last_save(critic))[1],
    )


class _Payload:
    """Unpickling this runs code: it creates the folder `marker`."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


# ---- defect 2: code execution on load ---------------------------------------------------------------


def test_a_pickle_planted_as_metadata_is_never_unpickled(critic, manifest, tmp_path, no_cluster, capsys):
    marker = tmp_path / "pwned"
    (last_save(critic) / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    report = tmp_path / "ev.json"
    with pytest.raises(InputError, match=r"do not match their contract.*\.metadata: (size|sha256)"):
        evaluate(eval_cfg(critic, manifest, report), log=quiet)
    with pytest.raises(InputError, match=r"\.metadata"):
        prepare(cfg_for(manifest, critic, epochs=2), log=quiet)
    from value_assets.gpu.convert.export import export_checkpoint

    with pytest.raises(InputError, match=r"\.metadata"):
        export_checkpoint(critic, tmp_path / "hf")
    assert cli_main(["verify", str(critic)]) == 2
    assert ".metadata" in capsys.readouterr().err
    assert not marker.exists() and not report.exists() and not (tmp_path / "hf").exists()


def test_byte_entries_load_without_unpickling_objects(trained):
    """megatron's `_extra_state` entries are read with torch.load(weights_only=True): a planted
    object in one would be refused by torch even if a file slipped past the binding."""
    assert read_byte_entry("x._extra_state", saved_bytes([None])) == [None]
    evil = pickle.dumps(_Payload(Path("/nonexistent/never")))
    with pytest.raises(InputError, match=r"checkpoint entry x\._extra_state: holds a Python object other than tensors"):
        read_byte_entry("x._extra_state", evil)


def saved_bytes(obj) -> bytes:
    import io

    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def read_byte_entry(fqn: str, data: bytes):
    """One byte entry named `fqn` read through megatron's load planner as `safe_byte_entries` sets it."""
    import io

    from megatron.core.dist_checkpointing.strategies.torch import MCoreLoadPlanner

    from value_assets.gpu.runtime.checkpoint import safe_byte_entries

    safe_byte_entries()

    class Planner:
        flatten_state_dict = False
        state_dict: dict = {}

    class Item:
        dest_index = type("Index", (), {"fqn": fqn})

    MCoreLoadPlanner.load_bytes(Planner, Item, io.BytesIO(data))
    return Planner.state_dict[fqn]


def test_offloaded_optimizer_groups_are_saved_without_their_classes():
    """megatron-core's HybridDeviceOptimizer (--optimizer-offload) keeps torch's AdamW class (and
    its GPU optimizer's) in every param group. Saved as they were, the distributed optimizer's
    groups entry held two classes, and the checked loader's weights_only read refused the resume
    (found on an H100: 'Unsupported global: GLOBAL torch.optim.adamw.AdamW'). The save leaves
    class values out, on a copy: the live optimizer keeps its groups."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from value_assets.gpu.runtime.checkpoint import without_classes

    groups = [{"lr": 1e-3, "params": [0, 1], "cpu_optimizer_cls": torch.optim.AdamW, "offload_fraction": 0.5}]
    entry = ShardedObject(
        "optimizer.distributed.dp_group_idx_0.optimizer", {"param_groups": groups, "state": {}}, (1,), (0,)
    )
    tensor = torch.zeros(2)
    tree = {"optimizer": entry, "param_state": {"w": tensor}, "param_state_sharding_type": "dp_reshardable"}
    saved = without_classes(tree)
    assert saved["optimizer"].data["param_groups"] == [{"lr": 1e-3, "params": [0, 1], "offload_fraction": 0.5}]
    assert saved["optimizer"].key == entry.key and saved["param_state"]["w"] is tensor
    assert groups[0]["cpu_optimizer_cls"] is torch.optim.AdamW  # the live groups are untouched
    plain = {"optimizer": ShardedObject("o", {"param_groups": [{"lr": 1.0}]}, (1,), (0,))}
    assert without_classes(plain) is plain

    key = entry.key
    assert read_byte_entry(key, saved_bytes(saved["optimizer"].data))["param_groups"][0]["offload_fraction"] == 0.5
    with pytest.raises(InputError, match=r"dp_group_idx_0\.optimizer: holds a Python object .*AdamW"):
        read_byte_entry(key, saved_bytes(entry.data))


def test_a_loaded_offloaded_optimizer_keeps_each_state_on_its_parameters_device():
    """megatron-core's HybridDeviceOptimizer places its loaded state by class: without Transformer
    Engine or Apex its GPU and CPU sub-optimizers are both torch's AdamW, so the GPU part's moments
    went to the host and the first step after a resume failed on an H100 ('exp_avgs is on cpu,
    different from other tensors on cuda:0'). `place_offloaded_state` puts each tensor on its
    parameter's device. Real torch AdamW sub-optimizers; the 'GPU' parameter lives on torch's meta
    device here (this machine has no CUDA), so the wrong placement is visible on CPU."""
    import torch

    from value_assets.gpu.runtime.checkpoint import place_offloaded_state

    gpu_p = torch.nn.Parameter(torch.empty(4, device="meta"))
    cpu_p = torch.nn.Parameter(torch.zeros(4))
    gpu_opt, cpu_opt = torch.optim.AdamW([gpu_p]), torch.optim.AdamW([cpu_p])
    gpu_opt.param_groups[0]["fused"] = True  # the GPU part runs fused: its step lives on the device
    for opt, p in ((gpu_opt, gpu_p), (cpu_opt, cpu_p)):  # as megatron's load left them: all on the host
        opt.state[p] = {"step": torch.tensor(3.0), "exp_avg": torch.ones(4), "exp_avg_sq": torch.ones(4)}
    hybrid_state = {gpu_p: gpu_opt.state[gpu_p]}  # the hybrid optimizer shares these dicts
    inner = type("Hybrid", (), {"sub_optimizers": [gpu_opt, cpu_opt]})()
    place_offloaded_state(type("Distributed", (), {"optimizer": inner})())
    assert {k: v.device.type for k, v in gpu_opt.state[gpu_p].items()} == dict.fromkeys(
        ("step", "exp_avg", "exp_avg_sq"), "meta"
    )
    assert all(v.device.type == "cpu" for v in cpu_opt.state[cpu_p].values())
    assert hybrid_state[gpu_p]["exp_avg"].device.type == "meta"
    plain = torch.optim.AdamW([torch.nn.Parameter(torch.empty(2, device="meta"))])
    p = plain.param_groups[0]["params"][0]
    plain.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.ones(2)}
    place_offloaded_state(type("Distributed", (), {"optimizer": type("H", (), {"sub_optimizers": [plain]})()})())
    assert plain.state[p]["step"].device.type == "cpu" and plain.state[p]["exp_avg"].device.type == "meta"
    place_offloaded_state(type("Plain", (), {"optimizer": torch.optim.AdamW([cpu_p])})())  # no sub-optimizers


def test_a_loaded_offloaded_optimizer_gives_each_parameter_its_own_step_count():
    """After a load, megatron writes the saved step into the parameter states as one shared tensor;
    torch's AdamW then advances it once per parameter per step, so a resumed offloaded run's counts
    drifted apart and its first save failed megatron's one-step check (`assert len(steps) == 1`, on
    an H100). `_own_adam_steps` gives each sub-optimizer state of the HybridDeviceOptimizer its own
    tensor of the saved step (taken from the hybrid's param groups). Real torch AdamW sub-optimizers
    (not fused: CPU), the hybrid's shell as a stand-in (it needs CUDA to be built)."""
    import torch

    from value_assets.gpu.runtime.checkpoint import _own_adam_steps

    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(3)]
    subs = [torch.optim.AdamW(params[:2]), torch.optim.AdamW(params[2:])]
    shared = torch.tensor(7.0)  # as megatron's load leaves it
    for sub in subs:
        for p in sub.param_groups[0]["params"]:
            sub.state[p] = {"step": shared, "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}
    inner = type("Hybrid", (), {"sub_optimizers": subs, "param_groups": [{"step": 7, "params": params}]})()
    _own_adam_steps(type("Distributed", (), {"optimizer": inner})())
    for p in params:
        p.grad = torch.ones(3)
    for _ in range(2):
        for sub in subs:
            sub.step()
    steps = [float(sub.state[p]["step"]) for sub in subs for p in sub.param_groups[0]["params"]]
    assert steps == [9.0, 9.0, 9.0], steps  # shared, all read 13 (on a GPU the fused part had its own copies)
    inner.param_groups.append({"step": 3, "params": []})
    with pytest.raises(ValueError, match="different steps"):
        _own_adam_steps(type("Distributed", (), {"optimizer": inner})())


# ---- defect 3: corrupted or swapped shards ---------------------------------------------------------------


def test_a_corrupted_shard_is_refused_before_resume_and_evaluation(critic, manifest, tmp_path, no_cluster):
    shard = last_save(critic) / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    for i in range(4096, 8192):
        data[i] ^= 0xFF
    shard.write_bytes(bytes(data))
    chunk0 = (
        r"__0_0\.distcp: chunk 0 of \d+ \(\d+ bytes each\), bytes 0\.\.\d+: sha256 [0-9a-f]{64}, the contract binds"
    )
    with pytest.raises(InputError, match=chunk0):
        prepare(cfg_for(manifest, critic, epochs=2), log=quiet)
    with pytest.raises(InputError, match=chunk0):
        evaluate(eval_cfg(critic, manifest, tmp_path / "ev.json"), log=quiet)


def test_shards_of_another_step_are_refused(critic, manifest, no_cluster):
    for f in (critic / iter_dirname(4)).glob("*.distcp"):
        shutil.copy(f, last_save(critic) / f.name)
    every = ".*".join(re.escape(name) + r": chunks? \d+" for name in shards(last_save(critic)))
    with pytest.raises(InputError, match=every):  # every data file is named
        prepare(cfg_for(manifest, critic, epochs=2), log=quiet)


# ---- defect 12: a deleted file is a clear refusal, before any worker starts ---------------------------------


@pytest.mark.parametrize("kind", ["index", "common", "shard"])
def test_a_deleted_checkpoint_file_is_named(critic, manifest, tmp_path, no_cluster, kind):
    name = saved_file(last_save(critic), kind)
    (last_save(critic) / name).unlink()
    with pytest.raises(InputError, match=f"missing file {name}"):
        prepare(cfg_for(manifest, critic, epochs=2), log=quiet)
    with pytest.raises(InputError, match=f"missing file {name}"):
        evaluate(eval_cfg(critic, manifest, tmp_path / "ev.json"), log=quiet)


def test_an_unwritable_report_folder_is_refused_before_the_workers(critic, manifest, tmp_path, no_cluster):
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() == 0:  # root ignores permission bits: use a read-only mount
        if subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(folder)], capture_output=True
        ).returncode:
            pytest.skip("cannot mount a read-only folder here")
    else:
        folder.chmod(0o555)
    try:
        with pytest.raises(InputError, match="not writable"):
            evaluate(eval_cfg(critic, manifest, folder / "ev.json"), log=quiet)
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(folder)], check=False)
        else:
            folder.chmod(0o755)


# ---- issue 33, defect 10: two runs into one output folder ------------------------------------------------------


def test_a_second_run_into_a_folder_a_run_is_writing_is_refused_before_it_reads_it(critic, manifest, no_cluster):
    """Two `train` runs into one --output: the loser was refused only at its save, after writing its
    steps into the winner's metrics.jsonl (the published critic's curve and loss metadata)."""
    import fcntl

    metrics = (critic / "metrics.jsonl").read_bytes()
    fd = os.open(critic, os.O_RDONLY)  # a run in progress holds the folder
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(InputError, match="another training run is writing into this folder now") as err:
            train(cfg_for(manifest, critic, epochs=2), log=quiet)
        assert err.value.where == str(critic)
    finally:
        os.close(fd)
    assert (critic / "metrics.jsonl").read_bytes() == metrics
    with pytest.raises(InputError, match="descends from bootstrap model"):  # free again: judged by its settings
        train(cfg_for(manifest, critic, epochs=2, backbone=str(critic / iter_dirname(4))), log=quiet)
    fresh = critic.parent / "fresh"
    with pytest.raises(InputError, match="micro_batch_tokens"):  # refused before any write: no folder is left
        train(cfg_for(manifest, fresh / "deep", micro_batch_tokens=8), log=quiet)
    assert not fresh.exists()


# ---- issue 33, defect 11: an export the system refuses ---------------------------------------------------------


@pytest.mark.parametrize("command", ["export-hf", "export-miles"])
def test_an_export_that_cannot_be_written_exits_2_and_leaves_nothing(critic, tmp_path, capsys, command):
    """Every command that writes, on a write the system refuses (here a file-size limit: EFBIG; a
    full disk takes the same path, tests/core/test_command_faults.py): exit 2 naming the output, and
    no partial export (export-hf/export-miles wrote straight into --out and exited 1: safetensors'
    'os error 27', torch_dist's CheckpointException)."""
    from tests.core.test_command_faults import file_size_limit

    out = tmp_path / "exported"
    extra = ["--model-identity", "x"] if command == "export-miles" else []
    with file_size_limit(1 << 20):
        rc = cli_main([command, "--checkpoint", str(critic), "--out", str(out), *extra])
    err = capsys.readouterr().err
    assert rc == 2 and f"{out}: could not publish" in err, err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".exported")]


@contextlib.contextmanager
def _without_dac_override():
    """This thread (and threads it starts) loses CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH for the
    block: root then meets permission bits as any user does (EACCES), the rest of the process not."""
    import ctypes

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    libc = ctypes.CDLL(None, use_errno=True)
    header, caps = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3, this thread
    if libc.capget(ctypes.byref(header), caps):
        pytest.skip("cannot read this thread's capabilities")
    saved = caps[0].effective
    caps[0].effective &= ~((1 << 1) | (1 << 2))  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
    if libc.capset(ctypes.byref(header), caps):
        pytest.skip("cannot drop this thread's capabilities")
    try:
        yield
    finally:
        caps[0].effective = saved
        assert libc.capset(ctypes.byref(header), caps) == 0


@contextlib.contextmanager
def _refusing_folder(folder: Path, fault: str):
    """`folder`, whose writes the system refuses: `full` a small tmpfs filled up to its last 16 KiB
    (ENOSPC once a write needs more), `read-only` a read-only tmpfs (EROFS), `denied` a folder of
    mode 0555 (EACCES; as root, with this thread's permission override dropped)."""
    folder.mkdir()
    if fault == "denied":
        folder.chmod(0o555)
        try:
            with _without_dac_override() if os.geteuid() == 0 else contextlib.nullcontext():
                yield folder
        finally:
            folder.chmod(0o755)
        return
    with small_tmpfs(folder, "1m", ",ro" if fault == "read-only" else ""):
        if fault == "full":
            with (folder / ".filler").open("wb") as f:
                f.write(b"\0" * (shutil.disk_usage(folder).free - (16 << 10)))
        yield folder


def _writer_argv(command: str, out: Path, critic: Path, manifest: Path, inputs: Path) -> list[str]:
    """`command`'s argv with `out` as the one path it writes."""
    from tests.core.test_rollouts_hf import TOKENIZER

    sha = load_contract(last_save(critic))[1]
    return {
        "make-demo-data": ["make-demo-data", out, "--rows", 64],
        "import-rollouts": ["import-rollouts", inputs, "--tokenizer", TOKENIZER, "--out", out],
        "train": ["train", manifest, "--output", out, "--global-batch-size", 32, "--save-interval", 1, "--gpus", 1],
        "evaluate": ["evaluate", "--checkpoint", critic, "--manifest", manifest, "--contract-sha256", sha]
        + ["--report", out, "--gpus", 1],
        "export-hf": ["export-hf", "--checkpoint", critic, "--out", out],
        "export-miles": ["export-miles", "--checkpoint", critic, "--out", out, "--model-identity", "x"],
    }[command]


# Every command that writes x every refusal, but train on a full disk: that one trains until its first
# save, which test_disk_full_during_a_save_is_a_clear_refusal below already does on a real full tmpfs.
WRITE_FAULTS = [
    (command, fault)
    for command in ("make-demo-data", "import-rollouts", "train", "evaluate", "export-hf", "export-miles")
    for fault in ("full", "read-only", "denied")
    if (command, fault) != ("train", "full")
]


@pytest.mark.parametrize(("command", "fault"), WRITE_FAULTS)
def test_every_command_that_writes_on_a_disk_that_refuses_exits_2_and_leaves_nothing(
    ray_cluster, critic, manifest, tmp_path, capsys, command, fault
):
    """Issue 33: each command that writes, its output on a real full disk (ENOSPC), a read-only
    one (EROFS) and a folder it may not write (EACCES): exit 2 naming the output path (evaluate may
    name a plot it publishes with its report, `ev-*.png` beside `ev.json`), and nothing left there,
    whole, partial or staged. make-demo-data left its new, empty output folder."""
    from tests.core.test_rollouts import records, write_jsonl

    inputs = write_jsonl(tmp_path / "r.jsonl", records(prompts=64, samples=8))
    with _refusing_folder(tmp_path / "disk", fault) as disk:
        out = disk / ("ev.json" if command == "evaluate" else "out")
        rc = cli_main([str(a) for a in _writer_argv(command, out, critic, manifest, inputs)])
        err = capsys.readouterr().err
        left = sorted(str(p.relative_to(disk)) for p in disk.rglob("*") if p.name != ".filler")
    assert rc == 2 and f"{out.with_suffix('')}" in err, f"exit {rc}: {err[-2000:]}"
    assert left == [], left


def test_an_export_writes_in_its_own_process_so_no_killed_writer_can_hang_it(critic, tmp_path, monkeypatch):
    """export-miles waited without a deadline for the processes megatron's torch_dist save forks
    (a writer per file, a manager for their results): one SIGKILLed mid-export (the OOM killer) hung
    the command for good. It now writes in its own process: here any process start fails the
    export (the old code's forked writers did), and the bundle is complete without one."""
    import multiprocessing.context
    import multiprocessing.process

    def no_process(*_args, **_kwargs):
        raise AssertionError("export-miles started a process")

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", no_process)
    monkeypatch.setattr(multiprocessing.context.BaseContext, "Manager", no_process)
    monkeypatch.setattr(os, "fork", no_process)
    out = tmp_path / "miles"
    assert cli_main(["export-miles", "--checkpoint", str(critic), "--out", str(out), "--model-identity", "x"]) == 0
    assert (out / "value_pretrain_contract.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".miles")]


# ---- defect 5: another backbone ------------------------------------------------------------------------------


def test_resume_refuses_another_backbone(critic, manifest, no_cluster):
    # The step-4 save is itself a valid Megatron backbone: a different model identity.
    with pytest.raises(InputError, match="descends from bootstrap model .*tiny-random.*--backbone is .*megatron"):
        prepare(cfg_for(manifest, critic, epochs=2, backbone=str(critic / iter_dirname(4))), log=quiet)


# ---- defect 6 and 12: the crash window between contract and `latest` ----------------------------------------


def test_a_lagging_latest_recovers_to_the_newest_verified_save(critic, manifest, trained, no_cluster):
    sha4 = load_contract(critic / iter_dirname(4))[1]
    (critic / LATEST_NAME).write_text(
        json.dumps({"contract_sha256": sha4, "iteration": iter_dirname(4)}, separators=(",", ":")) + "\n"
    )
    logs: list[str] = []
    prep = prepare(cfg_for(manifest, critic), log=logs.append)
    assert prep.start_step == STEPS and prep.resume_dir == last_save(critic)
    assert any("newer contract" in m for m in logs)
    # the retry does not retrain 5-8 into a refusal: nothing is left to do, and `latest` is repaired
    result = train(cfg_for(manifest, critic), log=quiet)
    assert result.completed_steps == STEPS and result.contract_sha256 == trained[1].contract_sha256
    assert read_latest(critic) == (last_save(critic), trained[1].contract_sha256)


def test_a_deleted_latest_recovers_too(critic, manifest, no_cluster):
    (critic / LATEST_NAME).unlink()
    logs: list[str] = []
    prep = prepare(cfg_for(manifest, critic), log=logs.append)
    assert prep.start_step == STEPS
    assert not any("has no contract" in m for m in logs) and any("missing" in m for m in logs)


# ---- defect 13: kill and resume
# ---------------------------------------------------------------------------------------
# Before the tests whose jobs a worker refuses: that ends the session's worker pool, and this job
# would then start fresh worker processes.


def test_resume_after_a_kill_logs_each_step_once_and_matches_the_uninterrupted_run(critic, manifest, trained, tmp_path):
    """A run killed after step 6 (metrics for 5-6 written, no save at 8) resumes from step 4."""
    full = trained[1]
    shutil.rmtree(last_save(critic))
    sha4 = load_contract(critic / iter_dirname(4))[1]
    (critic / LATEST_NAME).write_text(
        json.dumps({"contract_sha256": sha4, "iteration": iter_dirname(4)}, separators=(",", ":")) + "\n"
    )
    log = critic / "metrics.jsonl"
    log.write_text("".join(log.read_text().splitlines(keepends=True)[:6]) + '{"step": 7, "lo')  # killed mid-line
    resumed = train(cfg_for(manifest, critic), log=quiet)
    assert resumed.resumed_from == 4 and resumed.completed_steps == STEPS
    assert [json.loads(x)["step"] for x in log.read_text().splitlines()] == list(range(1, STEPS + 1))
    # Losses are bitwise those of the uninterrupted run; parameters agree within WEIGHT_ATOL
    # (not always bitwise on CPU: see jobtest_helpers).
    assert resumed.losses == full.losses[4:]
    diff = max_weight_difference(last_save(critic), last_save(trained[0]), tmp_path)
    print(f"resume: max weight difference {diff:.3g}, state digests equal: {resumed.state_sha256 == full.state_sha256}")
    assert diff <= WEIGHT_ATOL


def test_a_run_stopped_early_then_resumed_matches_the_uninterrupted_one(manifest, trained, tmp_path):
    """`stop_after` between saves (step 2, saves every 4): the run saves where it stopped, and the
    next run resumes there, skips the completed batches and ends where the uninterrupted run did."""
    full = trained[1]
    out = tmp_path / "critic"
    first = train(cfg_for(manifest, out, stop_after=2), log=quiet)
    assert first.completed_steps == 2 and read_latest(out)[0].name == iter_dirname(2)
    second = train(cfg_for(manifest, out), log=quiet)
    assert second.resumed_from == 2 and second.completed_steps == STEPS
    assert len(second.losses) == STEPS - 2  # completed batches are skipped, never replayed
    assert second.losses == full.losses[2:]  # bitwise
    assert max_weight_difference(last_save(out), last_save(trained[0]), tmp_path) <= WEIGHT_ATOL


def test_a_resumed_run_that_fails_before_its_next_save_leaves_the_folder_as_it_found_it(critic, manifest):
    """Issue 33: a failed run takes back what it wrote and did not publish (its run log kept the
    failed steps' lines and TensorBoard events). Here a resumed run (one more epoch) fails in its
    first step, before a save: the earlier run's saves, `latest`, metrics.jsonl and TensorBoard files
    stay byte for byte. (A new run that fails before a save leaves no folder at all: the test of
    data changed in rows no step read, below; a worker killed mid-run: test_worker_pool.py.)"""

    def files() -> dict[str, bytes]:
        return {str(p.relative_to(critic)): p.read_bytes() for p in sorted(critic.rglob("*")) if p.is_file()}

    def refuse(step, _metrics):
        raise InputError(f"step {step}", "planted refusal")  # a refusal: the session's pool is kept

    before = files()
    assert "metrics.jsonl" in before and any(name.startswith("tensorboard/") for name in before)
    with pytest.raises(InputError, match="planted refusal"):
        train(cfg_for(manifest, critic, epochs=2), log=quiet, on_step=refuse)
    assert files() == before


# ---- defect 3, after the driver's check: files swapped while the workers start ----------------------------
# Each of these jobs is refused by a worker, which ends the session's worker pool.


def _swap_after_the_driver_checked(monkeypatch, swap, method: str = "load"):
    """Run `swap()` in the window an attacker with write access has: after the driver verified the
    save and its workers started, right before the workers read the files (`method`)."""
    from value_assets.gpu.workers.cluster import Cluster

    call_all = getattr(Cluster.call_all, "__wrapped__", Cluster.call_all)  # one swap at a time

    def planted(self, called, *args, **kwargs):
        if called == method:
            swap()
        return call_all(self, called, *args, **kwargs)

    planted.__wrapped__ = call_all
    monkeypatch.setattr(Cluster, "call_all", planted)


def test_a_file_swapped_after_the_driver_checked_it_is_never_used(
    ray_cluster, trained, critic, manifest, tmp_path, monkeypatch
):
    """The workers use only bytes they checked themselves: a pickle planted as the index is never
    unpickled (evaluation), a changed weight shard is never loaded (resume)."""
    marker = tmp_path / "pwned"
    index = last_save(critic) / ".metadata"
    _swap_after_the_driver_checked(monkeypatch, lambda: index.write_bytes(pickle.dumps(_Payload(marker))))
    report = tmp_path / "ev.json"
    with pytest.raises(InputError, match=r"\.metadata: size \d+, the contract binds \d+; the file changed after"):
        evaluate(eval_cfg(critic, manifest, report), log=quiet)
    assert not marker.exists() and not report.exists()

    shutil.copy(last_save(trained[0]) / ".metadata", index)
    shard = last_save(critic) / "__0_0.distcp"

    def flip():
        data = bytearray(shard.read_bytes())
        data[-4096:] = bytes(b ^ 0xFF for b in data[-4096:])
        shard.write_bytes(bytes(data))

    _swap_after_the_driver_checked(monkeypatch, flip)
    with pytest.raises(
        InputError,
        match=r"__0_0\.distcp: chunk \d+ of \d+ \(bytes \d+\.\.\d+\): read sha256 [0-9a-f]{64}, the contract binds "
        r"[0-9a-f]{64}; the file changed",
    ):
        train(cfg_for(manifest, critic, epochs=2), log=quiet)
    assert read_latest(critic)[0] == last_save(critic) and sorted(p.name for p in critic.glob("iter_*")) == [
        iter_dirname(4),
        iter_dirname(8),
    ]


def test_a_critic_reused_as_backbone_is_read_through_the_same_check(
    ray_cluster, critic, manifest, tmp_path, monkeypatch
):
    """A contracted save named as another critic's backbone: its workers check the bytes they read
    against its contract too (gpu/convert/bootstrap.py), so a weight changed after the driver's check
    is refused."""
    shard, offset = a_weight_byte(last_save(critic))

    def flip():
        data = bytearray(shard.read_bytes())
        data[offset] ^= 1
        shard.write_bytes(bytes(data))

    _swap_after_the_driver_checked(monkeypatch, flip, method="bootstrap")
    out = tmp_path / "next"
    with pytest.raises(
        InputError,
        match=re.escape(shard.name)
        + r": chunk \d+ of \d+ \(bytes \d+\.\.\d+\): read sha256 [0-9a-f]{64}, the contract binds [0-9a-f]{64}; "
        r"the file changed",
    ):
        train(cfg_for(manifest, out, backbone=str(last_save(critic)), stop_after=1, gpus=1), log=quiet)
    assert read_latest(out) is None and not list(out.glob("iter_*"))


# ---- defect 4: the training data changes mid-run --------------------------------------------------------------
# The driver checks the data, so one worker is enough; its refusal keeps the pool of one worker
# (started here), which the next two tests reuse.


def _swap_labels(path: Path) -> None:
    data = path.read_bytes()
    swapped = data.replace(b"1.0", b"\0").replace(b"0.0", b"1.0").replace(b"\0", b"0.0")
    assert len(swapped) == len(data) and swapped != data
    path.write_bytes(swapped)


def test_training_stops_when_its_data_changes_and_publishes_nothing_later(ray_cluster, manifest, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(manifest.parent, data)
    m = data / manifest.name
    out = tmp_path / "critic"

    def rewrite(step, _metrics):
        if step == 3:
            _swap_labels(data / "demo" / "train.jsonl")

    with pytest.raises(InputError, match="changed since the dataset was validated"):
        train(cfg_for(m, out, save_interval=2, gpus=1), log=quiet, on_step=rewrite)
    # steps 1-3 read the validated bytes; step 4 never ran, and the only contract is step 2's
    assert read_latest(out)[0].name == iter_dirname(2)
    assert sorted(p.parent.name for p in out.glob(f"iter_*/{CONTRACT_NAME}")) == [iter_dirname(2)]
    lines = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert lines == [1, 2, 3]


def test_a_change_in_rows_no_step_read_stops_the_next_save(ray_cluster, manifest, tmp_path):
    from value_assets.core.plan import build_plan

    data = tmp_path / "data"
    shutil.copytree(manifest.parent, data)
    m = data / manifest.name
    train_file = data / "demo" / "train.jsonl"
    plan = build_plan(64, 8, 1, 0)
    untouched = sorted(set(range(64)) - set(plan.batch(1)) - set(plan.batch(2)))[0]

    def rewrite(step, _metrics):
        if step == 1:  # a row that neither step 1 nor step 2 reads
            lines = train_file.read_bytes().splitlines(keepends=True)
            lines[untouched] = lines[untouched].replace(b"1.0", b"\0").replace(b"0.0", b"1.0").replace(b"\0", b"0.0")
            train_file.write_bytes(b"".join(lines))

    out = tmp_path / "critic"
    with pytest.raises(InputError, match="changed while the run read it"):
        train(cfg_for(m, out, save_interval=2, gpus=1), log=quiet, on_step=rewrite)
    assert read_latest(out) is None and not list(out.glob(f"iter_*/{CONTRACT_NAME}"))
    assert not list(out.glob("iter_*"))  # the check runs before the save
    assert not out.exists()  # nor is its run log kept: it published nothing (issue 33)


# ---- defect 12: disk full during a save ------------------------------------------------------------------------


def test_disk_full_during_a_save_is_a_clear_refusal(ray_cluster, manifest, tmp_path):
    with small_tmpfs(tmp_path / "small", "16m") as small:
        out = small / "critic"
        with pytest.raises(InputError, match=r"iter_0000001: no space left on device \(ENOSPC\)") as ei:
            train(cfg_for(manifest, out, stop_after=1, gpus=1), log=quiet)
        assert "nothing was published" in ei.value.message
        assert read_latest(out) is None and not list(out.glob("iter_*"))
