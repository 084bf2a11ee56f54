"""The training job (docs/rules.md#training-run): validate on the CPU, then train on a Ray placement group.

Everything that can refuse a run is checked before the cluster is reserved: manifest, data,
objective, topology, the resume contract. Then one optimizer step per planned batch, checkpoints
at `save_interval` and at the end, each published by its contract (docs/rules.md#contract) once its files are
complete. Canary mode runs the first step only and writes a non-promotable receipt instead.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from value_assets.core.backbone import CriticShape
from value_assets.core.checkpoint_files import describe_folder
from value_assets.core.contract import (
    CONTRACT_NAME,
    build_contract,
    build_receipt,
    check_resume,
    check_resume_recorded,
    existing_iterations,
    find_resume_point,
    iter_dirname,
    point_latest,
    read_latest,
    saved_line,
    write_contract,
)
from value_assets.core.dataset import Dataset, validate_dataset
from value_assets.core.errors import InfrastructureError, InputError
from value_assets.core.hashing import sha256_file
from value_assets.core.job_configs import TrainJob
from value_assets.core.manifest import Manifest, load_manifest
from value_assets.core.memory import Layout, auto_micro_batch_tokens
from value_assets.core.paths import exclusive_folder, write_refusal
from value_assets.core.plan import (
    BatchPlan,
    assign_to_ranks,
    build_plan,
    check_plan_covers,
    check_topology,
    load_published_plan,
)
from value_assets.core.publish import publish_once
from value_assets.core.strict_json import canonical_bytes

RECEIPT_NAME = "canary_receipt.json"


@dataclass
class TrainResult:
    critic_dir: str
    checkpoint: str | None
    contract_sha256: str | None
    receipt: str | None
    completed_steps: int
    plan_steps: int
    plan_sha256: str
    manifest_sha256: str
    train_sha256: str
    resumed_from: int
    losses: list[float] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    state_sha256: list[str] = field(default_factory=list)

    @property
    def final_loss(self) -> float | None:
        return self.losses[-1] if self.losses else None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["final_loss"] = self.final_loss
        return d


@dataclass
class _Prepared:
    manifest: Manifest
    train: Dataset
    plan: BatchPlan
    dp: int
    backbone_cfg: Any
    backbone_source: dict[str, Any]
    backbone_identity: dict[str, Any]
    resume_contract: dict[str, Any] | None
    resume_dir: Path | None
    start_step: int
    micro_batch_tokens: int  # resolved (an int also when the config said "auto")
    resume_sha256: str | None = None
    warm_start: dict[str, Any] | None = None  # the contract's record of the champion a fresh run starts from
    warm_start_dir: Path | None = None
    warm_start_contract: dict[str, Any] | None = None


def prepare(cfg: TrainJob, log: Callable[[str], None] = print) -> _Prepared:
    """Every CPU-side check of docs/rules.md#training-run, before anything is reserved. Writes nothing."""
    from value_assets.gpu.convert.bootstrap import resolve_backbone

    manifest = load_manifest(cfg.manifest, pinned_sha256=cfg.manifest_sha256, data_roots=cfg.data_roots)
    backbone_cfg, source, identity = resolve_backbone(cfg.backbone, seed=cfg.seed, hf_config=cfg.hf_config)
    if cfg.backbone_sha256 is not None and identity.get("sha256") != cfg.backbone_sha256:
        raise InputError(
            "backbone_sha256",
            f"the backbone {cfg.backbone} hashes to {identity.get('sha256')!r}, but {cfg.backbone_sha256} was pinned "
            "(the lineage's training spec names another actor, or its files changed)",
        )
    train = validate_dataset(
        manifest.train, manifest.objective, vocab_size=backbone_cfg.vocab_size, max_seq_len=backbone_cfg.max_seq_len
    )
    log(f"train data ok: {len(train)} rows, {train.stats.tokens} tokens, {train.stats.active_targets} active targets")
    if cfg.plan is not None:
        # The published plan is the input (docs/rules.md#plan-artifact): read against the lineage's
        # sha, checked against this train split, trained on exactly.
        plan = load_published_plan(cfg.plan, cfg.plan_sha256)
        check_plan_covers(
            plan,
            len(train),
            where=str(cfg.plan),
            global_batch_size=cfg.global_batch_size,
            epochs=cfg.epochs,
            seed=cfg.seed,
        )
        log(f"published plan {cfg.plan} ({plan.sha256[:12]}): {plan.num_steps} steps")
    else:
        plan = build_plan(len(train), cfg.global_batch_size, cfg.epochs, cfg.seed)
    dp = check_topology(
        total_gpus=cfg.gpus,
        tensor_parallel=cfg.tensor_parallel,
        pipeline_parallel=cfg.pipeline_parallel,
        global_batch_size=cfg.global_batch_size,
    )
    check_model_split(backbone_cfg, cfg.tensor_parallel, cfg.pipeline_parallel)
    cfg.memory.check_layout(tensor_parallel=cfg.tensor_parallel)
    cfg.memory.check_layers(num_layers=backbone_cfg.num_layers, pipeline_parallel=cfg.pipeline_parallel)
    _check_offload_device(cfg)
    longest = int(train.lengths.max()) - 1
    micro_batch_tokens = cfg.micro_batch_tokens
    if micro_batch_tokens == "auto":
        micro_batch_tokens = _auto_micro_batch_tokens(cfg, backbone_cfg, manifest, train, dp, longest)
        log(f"--micro-batch-tokens auto: {micro_batch_tokens}")
    elif cfg.micro_batch_tokens < longest:
        raise InputError(
            "micro_batch_tokens",
            f"{cfg.micro_batch_tokens} is smaller than the longest row ({longest} model tokens, "
            f"{train.location(int(train.lengths.argmax()))})",
        )
    critic_dir = cfg.output
    contract = resume_dir = resume_sha = None
    start = 0
    if cfg.canary:
        if read_latest(critic_dir) is not None or any(
            (critic_dir / iter_dirname(i) / CONTRACT_NAME).exists() for i in existing_iterations(critic_dir)
        ):
            raise InputError(
                str(critic_dir), "refusing a canary run: the output folder already holds a contracted checkpoint"
            )
        if (critic_dir / RECEIPT_NAME).exists() or (critic_dir / RECEIPT_NAME).is_symlink():
            raise InputError(
                str(critic_dir / RECEIPT_NAME), "refusing a canary run: a receipt is already published here"
            )
    elif (found := find_resume_point(critic_dir, log)) is not None:
        # Verified file by file against its contract here, before anything is reserved, and again
        # right before the workers deserialize it.
        resume_dir, contract, resume_sha = found
        check_resume_recorded(resume_sha, cfg.resume_from, where=str(resume_dir))
        start = check_resume(
            contract,
            where=str(resume_dir),
            manifest_sha256=manifest.sha256,
            train_sha256=train.sha256,
            objective=manifest.objective.canonical(),
            plan=plan,
            model=identity,
            loaded_iterations=[contract["completed_steps"]],
        )
        check_resume_execution(contract, cfg, where=str(resume_dir))
        log(f"resuming after step {start} from {resume_dir}")
    prep = _Prepared(
        manifest,
        train,
        plan,
        dp,
        backbone_cfg,
        source,
        identity,
        contract,
        resume_dir,
        start,
        micro_batch_tokens,
        resume_sha,
    )
    if cfg.warm_start_checkpoint is not None and resume_dir is None:
        _prepare_warm_start(cfg, prep, log)
    return prep


def _prepare_warm_start(cfg: TrainJob, prep: _Prepared, log: Callable[[str], None]) -> None:
    """A fresh run that starts from a champion's weights (head included) instead of the actor's
    (docs/rules.md#champion): the champion's save is verified against its pinned contract, and must
    be a critic of the same backbone and objective."""
    from value_assets.core.contract import load_verified, resolve_step_dir

    assert cfg.warm_start_checkpoint is not None and cfg.warm_start_contract_sha256 is not None
    step_dir, _ = resolve_step_dir(cfg.warm_start_checkpoint)
    contract, sha = load_verified(step_dir, pinned_sha256=cfg.warm_start_contract_sha256)
    where = f"warm_start_checkpoint {step_dir}"
    if contract.get("backbone_config") != prep.backbone_cfg.to_json():
        raise InputError(where, "the champion's backbone differs from this run's: it is not a critic of the same actor")
    if contract.get("objective") != prep.manifest.objective.canonical():
        raise InputError(where, "the champion's objective differs from this manifest's: its value head does not fit")
    prep.warm_start = {"contract_sha256": sha, "checkpoint": str(step_dir)}
    prep.warm_start_dir, prep.warm_start_contract = step_dir, contract
    log(f"warm start from the champion {step_dir} (contract {sha[:12]})")


def _check_offload_device(cfg: TrainJob) -> None:
    """Optimizer CPU offload is megatron-core's CUDA path (streams, pinned host copies): refuse it
    on a machine without CUDA before anything is reserved."""
    import torch

    if cfg.optimizer_offload and not torch.cuda.is_available():
        raise InputError(
            "optimizer_offload",
            f"{cfg.optimizer_offload:g} moves the optimizer from the GPU to host memory, but this machine has no "
            "CUDA GPU (CPU training keeps the optimizer in host memory already): run with --optimizer-offload 0",
        )


def _auto_micro_batch_tokens(
    cfg: TrainJob, backbone_cfg, manifest: Manifest, train: Dataset, dp: int, longest: int
) -> int:
    """`--micro-batch-tokens auto` from the memory model and this machine's free memory (the
    first GPU's; without CUDA, the host's available memory shared by the CPU workers). Runs in
    `prepare`, before anything is reserved; refuses a row that cannot fit at all."""
    import torch

    if torch.cuda.is_available():
        free, bf16 = _free_gpu_bytes(), True
    else:
        import psutil

        free, bf16 = psutil.virtual_memory().available // cfg.gpus, False
    where = f"the longest row ({train.location(int(train.lengths.argmax()))})"
    return auto_micro_batch_tokens(
        CriticShape(backbone_cfg, manifest.objective.head_size),
        Layout(tp=cfg.tensor_parallel, pp=cfg.pipeline_parallel, dp=dp),
        cfg.memory,
        free_bytes=int(free),
        longest_row=longest,
        longest_row_where=where,
        bf16=bf16,
    )


def _free_gpu_bytes() -> int:
    """Free memory of the first GPU, read without a CUDA context in this process (a driver's
    context would hold ~0.5 GiB of the GPU its worker then runs on): nvidia-smi, else a
    short-lived child process."""
    import subprocess
    import sys

    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        return int(float(out.split()[0]) * 2**20)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        out = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.cuda.mem_get_info(0)[0])"],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
        return int(out.split()[-1])


def execution_facts(cfg: TrainJob, dp: int, micro_batch_tokens: int) -> dict[str, Any]:
    """How the steps were run (recorded in the contract). None of it changes the result (up to
    summation order) except `freeze` and `head_bias`, the parameters that did not train, which resume
    must match."""
    return {
        "tensor_parallel": cfg.tensor_parallel,
        "pipeline_parallel": cfg.pipeline_parallel,
        "data_parallel": dp,
        "micro_batch_tokens": micro_batch_tokens,
        "memory": cfg.memory.to_json(),
        "freeze": cfg.freeze,
        "head_bias": cfg.head_bias,
    }


def check_resume_execution(contract: dict[str, Any], cfg: TrainJob, *, where: str) -> None:
    """A resume loads the optimizer state, whose layout follows the distributed-optimizer
    setting (and, with the distributed optimizer, tp and pp): refuse a mismatch before anything
    is reserved. Contracts without execution facts were written by the plain optimizer."""
    facts = contract.get("execution") or {}
    frozen = facts.get("freeze", "none")  # contracts before the setting froze nothing
    if frozen != cfg.freeze:
        raise InputError(
            "freeze",
            (
                f"{where} was trained with freeze {frozen!r}; this run asks for {cfg.freeze!r}. Resuming would change "
                f"which parameters train mid-plan: run with --freeze {frozen}, or train a new critic"
            ),
        )
    head_bias = facts.get("head_bias", "trained")  # contracts before the setting trained the bias
    if head_bias != cfg.head_bias:
        raise InputError(
            "head_bias",
            (
                f"{where} was trained with head_bias {head_bias!r}; this run asks for {cfg.head_bias!r}. Resuming "
                f"would change whether the value head's bias trains mid-plan: run with --head-bias {head_bias}, or "
                "train a new critic"
            ),
        )
    saved_memory = facts.get("memory") or {}
    saved = bool(saved_memory.get("distributed_optimizer", False))
    if saved != cfg.memory.distributed_optimizer:
        raise InputError(
            "distributed_optimizer",
            (
                f"{where} was saved {'with' if saved else 'without'} the distributed optimizer; resuming needs the "
                f"same optimizer state layout: run {'with' if saved else 'without'} --distributed-optimizer "
                "(evaluation loads the weights at any setting)"
            ),
        )
    offload = float(saved_memory.get("optimizer_offload", 0.0))
    if offload != cfg.memory.optimizer_offload:
        raise InputError(
            "optimizer_offload",
            (
                f"{where} was saved with optimizer offload {offload:g}; this run asks for "
                f"{cfg.memory.optimizer_offload:g}. Its optimizer state is split between GPU and host by that "
                f"fraction: run with --optimizer-offload {offload:g} (evaluation loads the weights at any setting)"
            ),
        )
    if saved:
        for key in ("tensor_parallel", "pipeline_parallel"):
            if key in facts and facts[key] != getattr(cfg, key):
                raise InputError(
                    key,
                    (
                        f"{where} holds distributed-optimizer state for {key.replace('_', ' ')} {facts[key]}, got "
                        f"{getattr(cfg, key)}; its optimizer state re-shards over data parallel only"
                    ),
                )


def check_model_split(backbone, tp: int, pp: int) -> None:
    """The backbone must split evenly over the model-parallel layout (megatron builds equal
    pipeline stages and equal tensor-parallel shards)."""
    if backbone.num_layers % pp:
        raise InputError(
            "pipeline_parallel", f"{pp} stages do not split the backbone's {backbone.num_layers} layers evenly"
        )
    for name in ("num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size"):
        if getattr(backbone, name) % tp:
            raise InputError(
                "tensor_parallel", f"{tp} does not divide the backbone's {name} ({getattr(backbone, name)})"
            )


def row_payload(ds: Dataset, index: int) -> dict[str, Any]:
    """One dataset row as a worker receives it (numpy arrays; `row_id` = the dataset index)."""
    r = ds.row(index)
    return {
        "row_id": index,
        "tokens": r.tokens,
        "response_length": r.response_length,
        "returns": r.returns,
        "loss_mask": r.loss_mask,
    }


def _lr_at(cfg: TrainJob, step: int) -> float:
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.learning_rate * step / cfg.warmup_steps
    return cfg.learning_rate


def _check_data_unchanged(ds: Dataset) -> None:
    """A contract names only bytes that were trained on: re-hash the train file before each save.
    (Rows are also checked one by one as they are read; this covers the bytes no step read yet.)"""
    sha = sha256_file(ds.path)
    if sha != ds.sha256:
        raise InputError(
            str(ds.path),
            f"the train dataset changed while the run read it (sha256 now {sha}, validated {ds.sha256}); "
            "stopping without publishing another contract",
        )


def _save(cluster, critic_dir: Path, step: int, backbone_cfg) -> Path:
    from value_assets.gpu.convert.bootstrap import write_backbone_json

    step_dir = critic_dir / iter_dirname(step)
    if step_dir.exists():
        # A folder without a contract was never published (an interrupted save): start it afresh.
        if (step_dir / CONTRACT_NAME).exists():
            raise InputError(str(step_dir), "refusing to overwrite a contracted checkpoint")
        shutil.rmtree(step_dir)
    step_dir.mkdir(parents=True)
    try:
        cluster.call_all("save", str(step_dir), step)
        write_backbone_json(step_dir, backbone_cfg)
    except Exception as exc:
        refused = write_refusal(exc, step_dir)
        if refused is None:
            raise
        shutil.rmtree(step_dir, ignore_errors=True)  # never published: free what it took
        last = str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else ""
        raise InputError(
            str(step_dir),
            f"{_refusal(refused)} while saving the checkpoint; nothing was published (the save failed with: {last})",
        ) from None
    return step_dir


def _refusal(exc: OSError) -> str:
    """'no space left on device (ENOSPC)', 'file too large (EFBIG)', ...: the system's refusal of a
    write (`core.paths.write_refusal`: the writers lose the errno; torch reports a short write as
    'unexpected pos', torch_dist as a CheckpointException, so the chain, the text and the free space
    decide)."""
    code = errno.errorcode.get(exc.errno, str(exc.errno)) if exc.errno is not None else "?"
    return f"{(exc.strerror or str(exc)).lower()} ({code})"


def train(
    cfg: TrainJob, log: Callable[[str], None] = print, on_step: Callable[[int, dict], None] | None = None
) -> TrainResult:
    """Train into `cfg.output`, held for this run alone (`core.paths.exclusive_folder`): a second run
    into the same folder is refused before it reads the folder, so it never resumes from, nor writes
    metrics into, a folder another run is writing."""
    with exclusive_folder(cfg.output, "training run"):
        written = _Written(cfg.output)
        try:
            return _train(cfg, log, on_step, written)
        except BaseException as exc:
            undone = written.take_back()
            if undone:
                log(f"the run failed: removed what it wrote and did not publish: {', '.join(undone)}")
            if isinstance(exc, InfrastructureError):  # a worker died, a deadline passed: say what stands
                published = f"published up to {written.published[-1]}" if written.published else "published nothing"
                raise type(exc)(f"{exc}; this run {published}") from exc
            raise


class _Written:
    """What a run wrote into its output folder, for a run that fails to take back (docs/rules.md#saves:
    nothing is written on error): the saves it did not publish (a contract or, for a canary, the
    receipt, publishes one) and, when it published none, what it added to the run log (metrics.jsonl,
    tensorboard/). Saves and logs that an earlier run left, and saves this run published, stay.

    `take_back` runs once the run's workers have ended (after `start_workers`' `finally`), so no
    worker still writes into a save it removes."""

    def __init__(self, folder: Path):
        from value_assets.gpu.drivers.metrics_log import RunLogBefore

        self.folder = folder
        self.run_log = RunLogBefore.of(folder)
        self.log_after: int | None = None  # once the run opened its log: the step it resumed after
        self.saves: list[Path] = []  # step folders this run made
        self.published: list[Path] = []  # those of them it published

    def take_back(self) -> list[str]:
        undone = []
        for step_dir in self.saves:
            # A folder with a contract is published: by this run, or left by an earlier one.
            if step_dir in self.published or (step_dir / CONTRACT_NAME).exists() or not step_dir.exists():
                continue
            shutil.rmtree(step_dir, ignore_errors=True)
            undone.append(str(step_dir))
        if not self.published and self.log_after is not None:
            undone += self.run_log.take_back(self.log_after)
        return undone


def _train(
    cfg: TrainJob, log: Callable[[str], None], on_step: Callable[[int, dict], None] | None, written: _Written
) -> TrainResult:
    from value_assets.gpu.drivers.metrics_log import MetricsLog
    from value_assets.gpu.workers.cluster import start_workers

    prep = prepare(cfg, log)
    plan, train_ds, manifest = prep.plan, prep.train, prep.manifest
    critic_dir = cfg.output
    last_step = 1 if cfg.canary else plan.num_steps
    if cfg.stop_after is not None:
        last_step = min(last_step, prep.start_step + cfg.stop_after)
    result = TrainResult(
        critic_dir=str(critic_dir),
        checkpoint=None,
        contract_sha256=None,
        receipt=None,
        completed_steps=prep.start_step,
        plan_steps=plan.num_steps,
        plan_sha256=plan.sha256,
        manifest_sha256=manifest.sha256,
        train_sha256=train_ds.sha256,
        resumed_from=prep.start_step,
    )
    if prep.resume_dir is not None and read_latest(critic_dir) != (prep.resume_dir, prep.resume_sha256):
        point_latest(critic_dir, prep.resume_dir, prep.resume_sha256)  # recovered: the verified newest save
    if prep.start_step >= last_step:
        result.checkpoint, result.contract_sha256 = str(prep.resume_dir), prep.resume_sha256
        log(f"nothing to do: {prep.start_step} of {plan.num_steps} planned steps are already done")
        return result
    objective_json = manifest.objective.canonical()
    spec = cfg.worker_spec(prep.backbone_cfg, manifest.objective)
    with start_workers(
        spec, ray_address=cfg.ray_address, timeout_s=cfg.timeout_s, placement_strategy=cfg.placement_strategy, log=log
    ) as cluster:
        dp_of_rank = [info["dp_rank"] for info in cluster.infos]
        host = sorted({str(info.get("host_gradients")) for info in cluster.infos if info.get("host_gradients")})
        if host:
            log(f"optimizer offload: the offloaded gradients' host copies are {' and '.join(host)}")
        if prep.resume_dir is not None:
            # The files may have changed since `prepare` verified them: the workers use only bytes
            # that match the contract (gpu/runtime/checkpoint.py).
            loaded = cluster.call_all("load", str(prep.resume_dir), True, prep.resume_contract)
            check_resume(
                prep.resume_contract,
                where=str(prep.resume_dir),
                manifest_sha256=manifest.sha256,
                train_sha256=train_ds.sha256,
                objective=objective_json,
                plan=plan,
                model=prep.backbone_identity,
                loaded_iterations=loaded,
            )
        elif prep.warm_start_dir is not None:
            # The champion's weights, head included; only bytes matching its contract are used.
            cluster.call_all("load", str(prep.warm_start_dir), False, prep.warm_start_contract)
        else:
            cluster.call_all("bootstrap", prep.backbone_source)
        critic_dir.mkdir(parents=True, exist_ok=True)
        written.log_after = prep.start_step
        metrics_log = MetricsLog(critic_dir, after_step=prep.start_step)
        try:
            for step in range(prep.start_step + 1, last_step + 1):
                batch = plan.batch(step)
                per_dp = assign_to_ranks(batch, prep.dp)
                payload = {d: [row_payload(train_ds, i) for i in rows] for d, rows in enumerate(per_dp)}
                lr = _lr_at(cfg, step)
                metrics = cluster.call_each(
                    "train_step",
                    [((payload[d], plan.global_batch_size, prep.micro_batch_tokens, lr), {}) for d in dp_of_rank],
                )[0]
                metrics["step"] = step
                result.losses.append(float(metrics["loss"]))
                result.metrics.append(metrics)
                metrics_log.write(step, metrics)
                log(
                    f"step {step}/{plan.num_steps} loss {metrics['loss']:.4f} acc "
                    f"{_fmt(metrics.get('value_accuracy'))} ev {_fmt(metrics.get('explained_variance'))} grad "
                    f"{_fmt(metrics.get('grad_norm'))} lr {lr:.2e} tok/s {_fmt(metrics.get('tokens_per_s'), '.0f')}"
                )
                if on_step:
                    on_step(step, metrics)
                due = cfg.save_interval and step % cfg.save_interval == 0
                if step == last_step or due:
                    _check_data_unchanged(train_ds)
                    written.saves.append(critic_dir / iter_dirname(step))
                    step_dir = _save(cluster, critic_dir, step, prep.backbone_cfg)
                    result.checkpoint = str(step_dir)
                    result.completed_steps = step
                    if cfg.canary:
                        receipt = build_receipt(
                            manifest_sha256=manifest.sha256,
                            train_sha256=train_ds.sha256,
                            plan=plan,
                            first_batch_sample_ids=[train_ds.row(i).sample_id for i in plan.batch(1)],
                        )
                        path = critic_dir / RECEIPT_NAME
                        publish_once(path, canonical_bytes(receipt))
                        written.published.append(step_dir)
                        result.receipt = str(path)
                        log(f"canary: saved {step_dir}, receipt {path} (not promotable)")
                    else:
                        contract = build_contract(
                            manifest_sha256=manifest.sha256,
                            train_sha256=train_ds.sha256,
                            objective=objective_json,
                            plan=plan,
                            completed_steps=step,
                            model=prep.backbone_identity,
                            backbone_config=prep.backbone_cfg.to_json(),
                            checkpoint=step_dir.name,
                            checkpoint_files=describe_folder(step_dir),
                            execution=execution_facts(cfg, prep.dp, prep.micro_batch_tokens),
                            training_spec_sha256=cfg.training_spec_sha256,
                            warm_start=prep.warm_start,
                        )
                        try:
                            result.contract_sha256 = write_contract(critic_dir, contract)
                        except OSError as exc:
                            refused = write_refusal(exc, step_dir)
                            if refused is None:
                                raise
                            raise InputError(
                                str(step_dir),
                                f"{_refusal(refused)} while publishing the contract; nothing was published ({exc})",
                            ) from None
                        written.published.append(step_dir)
                        log(saved_line(step_dir, result.contract_sha256))
            # Every rank's parameter digest: equal across data-parallel ranks, and the bitwise
            # fingerprint that resume tests compare.
            result.state_sha256 = cluster.call_all("state_digest")
        finally:
            metrics_log.close()
    return result


def _fmt(v, spec: str = ".4f") -> str:
    return "n/a" if v is None else format(v, spec)
