"""Worker bodies for the memory-feature tests (ranks started by tests/ranks.py).

Every variant starts from the same layout-invariant weights (`init_layout_invariant`) and trains
on the same rows, so runs with and without a memory feature are comparable step by step.
"""

from __future__ import annotations

import torch

from tests.engine.dist_workers import BACKBONE, OBJ, _reinit, make_rows, probe
from tests.ranks import join
from value_assets.core.memory import MemoryConfig
from value_assets.gpu.model.gpt_critic import build_critic, init_layout_invariant
from value_assets.gpu.model.packing import pack_rows
from value_assets.gpu.runtime.parallel import destroy, init_distributed

ROWS_PER_STEP, STEPS = 6, 3


def run(rank: int, world: int, port: int, tp: int, fn_name: str, args: tuple) -> None:
    init_distributed(rank, world, tp=tp, seed=1234, store=join(port, world))
    try:
        globals()[fn_name](rank, world, tp, *args)
    finally:
        destroy()


def _build(tp: int, memory: MemoryConfig, train: bool = True):
    from value_assets.gpu.runtime.step import wrap_for_training

    model = build_critic(BACKBONE, OBJ, tp=tp, memory=memory)
    init_layout_invariant(model, seed=7)
    if not train:
        return model, None, None
    ddp, opt = wrap_for_training(
        model, lr=1e-3, weight_decay=0.0, clip_grad=1.0, distributed_optimizer=memory.distributed_optimizer
    )
    return model, ddp, opt


def _train(ddp, opt, steps=STEPS, start=0):
    from megatron.core import parallel_state as ps

    from value_assets.gpu.runtime.step import optimizer_step

    dp, dpr = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = make_rows(ROWS_PER_STEP * steps, seed=1)
    history = []
    for step in range(start, steps):
        mine = rows[step * ROWS_PER_STEP : (step + 1) * ROWS_PER_STEP][dpr::dp]
        # 29 tokens: packed micro-batches of odd lengths, so sequence parallelism must pad
        history.append(optimizer_step(ddp, opt, pack_rows(mine, micro_batch_tokens=29), ROWS_PER_STEP, OBJ))
    return history


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _values(model) -> dict[int, torch.Tensor]:
    from value_assets.gpu.runtime.step import evaluate_rows

    out = evaluate_rows(model, pack_rows(make_rows(5, seed=99), micro_batch_tokens=29), OBJ)
    return {k: torch.from_numpy(v["values"]) for k, v in out.items()}


class _CountCheckpoints:
    """Counts megatron's `tensor_parallel.checkpoint` calls (one per recomputed layer and forward
    under full recompute) while in the `with` block."""

    def __enter__(self):
        from megatron.core import tensor_parallel

        self.calls, self.real = 0, tensor_parallel.checkpoint

        def counting(*args, **kwargs):
            self.calls += 1
            return self.real(*args, **kwargs)

        tensor_parallel.checkpoint = counting
        return self

    def __exit__(self, *exc):
        from megatron.core import tensor_parallel

        tensor_parallel.checkpoint = self.real


def dp_features(rank, world, tp, ckpt, out_file):
    """DP=2: plain, selective and full recompute (of every layer, and of the first layer only:
    megatron's block method), and the distributed optimizer (3 steps each); the distributed
    optimizer's checkpoint is then resumed at DP=2 and loaded for evaluation at TP=2 (plain, no
    optimizer state)."""
    from value_assets.gpu.runtime.checkpoint import load_critic, load_model_weights, save_critic

    res = {}
    for name, mem in (
        ("plain", MemoryConfig()),
        ("selective", MemoryConfig(recompute="selective")),
        ("full", MemoryConfig(recompute="full")),
        ("full_first1", MemoryConfig(recompute="full", recompute_layers=1)),
        ("distopt", MemoryConfig(distributed_optimizer=True)),
    ):
        model, ddp, opt = _build(tp, mem)
        with _CountCheckpoints() as counted:
            hist = _train(ddp, opt, steps=STEPS - 1 if name == "distopt" else STEPS)
        if name == "distopt":
            res["saved_probe"] = probe(model)
            save_critic(ckpt, ddp, opt, iteration=STEPS - 1)
            hist += _train(ddp, opt, start=STEPS - 1)
        res[name] = {"history": hist, "params": _params(model), "probe": probe(model)}
        res[name]["optimizers"] = [type(o).__name__ for o in getattr(opt, "chained_optimizers", [opt])]
        res[name]["recompute"] = model.config.recompute_granularity
        res[name]["recompute_block"] = (model.config.recompute_method, model.config.recompute_num_layers)
        res[name]["checkpoints"] = counted.calls
    # Resume: a fresh distributed-optimizer critic picks up at step 2 and takes step 3 exactly.
    model, ddp, opt = _build(tp, MemoryConfig(distributed_optimizer=True))
    start = load_critic(ckpt, ddp, opt)
    res["resumed"] = {"start": start, "history": _train(ddp, opt, start=start), "params": _params(model)}
    # Evaluation at another layout (TP=2, DP=1): model weights only, re-sharded on load.
    _reinit(2)
    fresh, _, _ = _build(2, MemoryConfig(), train=False)
    res["tp2_init_probe"] = probe(fresh)
    res["tp2_iter"] = load_model_weights(ckpt, fresh)
    res["tp2_probe"] = probe(fresh)
    if rank == 0:
        torch.save(res, out_file)


def tp_features(rank, world, tp, ckpt, out_file):
    """TP=2: without and with sequence parallelism (also with full recompute): same steps and
    values; the SP checkpoint loads for evaluation at TP=1 (DP=2), no SP."""
    from value_assets.gpu.runtime.checkpoint import load_model_weights, save_critic

    res = {}
    for name, mem in (
        ("tp2", MemoryConfig()),
        ("sp", MemoryConfig(sequence_parallel=True)),
        ("sp_full", MemoryConfig(sequence_parallel=True, recompute="full")),
    ):
        model, ddp, opt = _build(tp, mem)
        hist = _train(ddp, opt)
        res[name] = {
            "history": hist,
            "values": _values(ddp),
            "probe": probe(model),
            "sequence_parallel": model.config.sequence_parallel,
            "recompute": model.config.recompute_granularity,
        }
        if name == "sp":
            res["saved_probe"] = probe(model)
            save_critic(ckpt, ddp, opt, iteration=STEPS)
    _reinit(1)
    fresh, _, _ = _build(1, MemoryConfig(), train=False)
    res["tp1_iter"] = load_model_weights(ckpt, fresh)
    res["tp1_probe"] = probe(fresh)
    if rank == 0:
        torch.save(res, out_file)
