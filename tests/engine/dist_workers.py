"""Worker bodies for the multi-process engine tests (ranks started by tests/ranks.py)."""

from __future__ import annotations

import os

import numpy as np
import torch

from tests.ranks import join
from value_assets.core.objective import Objective
from value_assets.gpu.model.gpt_critic import BackboneConfig, build_critic, critic_forward
from value_assets.gpu.model.packing import Row, pack_rows
from value_assets.gpu.runtime.parallel import destroy, init_distributed

OBJ = Objective()
BACKBONE = BackboneConfig.tiny(num_layers=2, hidden_size=32, ffn_hidden_size=64, vocab_size=49152)


def make_rows(n: int, seed: int = 0) -> list[Row]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        L = int(rng.integers(6, 24))
        r = int(rng.integers(1, L - 1))
        ret = np.full(r, float(rng.integers(0, 2)))
        rows.append(Row(row_id=i, tokens=rng.integers(0, 49152, L), response_length=r, returns=ret))
    return rows


def probe(model) -> torch.Tensor:
    rows = make_rows(3, seed=99)
    mb = pack_rows(rows, 10_000)[0]
    model.eval()
    with torch.no_grad():
        out = critic_forward(model, mb.tokens, mb.position_ids, mb.cu_seqlens, mb.max_seqlen)
    return out


def run(rank: int, world: int, port: int, calls: list[tuple[str, int, int, tuple]]) -> None:
    """Run several bodies, in order, in one process group: `calls` holds (body name, tp, pp, args).

    Each body starts from megatron parallel state built afresh at its own tp x pp and the seeds
    `init_distributed` sets, as if it had a process of its own: one launch serves them all."""
    from megatron.core import parallel_state as ps

    try:
        for fn_name, tp, pp, args in calls:
            if ps.model_parallel_is_initialized():
                ps.destroy_model_parallel()
            store = None if torch.distributed.is_initialized() else join(port, world)
            init_distributed(rank, world, tp=tp, pp=pp, seed=1234, store=store)  # keeps the process group
            globals()[fn_name](rank, world, tp, *args)
    finally:
        destroy()


def _reinit(tp: int) -> None:
    """Rebuild megatron parallel state with another TP size inside the same process group."""
    from megatron.core import parallel_state as ps

    from value_assets.gpu.runtime.compat import seed_model_parallel

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    seed_model_parallel(1234)


def tp_reshard(rank, world, tp, ckpt, out_file):
    """Save at TP=2, reload at TP=1 (DP=2) and at TP=2, probing outputs each time."""
    from value_assets.gpu.runtime.checkpoint import load_critic, save_critic

    model = build_critic(BACKBONE, OBJ, tp=2)
    # Perturb away from init so that a load that silently kept init would be caught.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.sin(torch.arange(p.numel(), dtype=torch.float32)).view_as(p))
    saved = probe(model)
    save_critic(ckpt, model, iteration=7)
    res = {"saved": saved}
    for new_tp in (1, 2):
        _reinit(new_tp)
        torch.manual_seed(4321)
        fresh = build_critic(BACKBONE, OBJ, tp=new_tp, head_seed=5)
        res[f"init{new_tp}"] = probe(fresh)
        res[f"iter{new_tp}"] = load_critic(ckpt, fresh)
        res[f"tp{new_tp}"] = probe(fresh)
    if rank == 0:
        torch.save(res, out_file)


def _train(rows, steps, start, ddp, opt, rows_per_step):
    from megatron.core import parallel_state as ps

    from value_assets.gpu.runtime.step import optimizer_step

    dp, dpr = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    history = []
    for step in range(start, steps):
        batch = rows[step * rows_per_step : (step + 1) * rows_per_step]
        mine = batch[dpr::dp]  # round-robin by position
        history.append(optimizer_step(ddp, opt, pack_rows(mine, micro_batch_tokens=30), rows_per_step, OBJ))
    return history


def train_dp(rank, world, tp, rows_per_step, steps, out_file):
    from value_assets.gpu.runtime.step import wrap_for_training

    model = build_critic(BACKBONE, OBJ, tp=tp)
    ddp, opt = wrap_for_training(model, lr=1e-3, weight_decay=0.0, clip_grad=1.0)
    rows = make_rows(rows_per_step * steps, seed=1)
    history = _train(rows, steps, 0, ddp, opt, rows_per_step)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save({"history": history, "params": params}, out_file)


def train_resume(rank, world, tp, rows_per_step, steps, save_at, ckpt, out_file):
    """Uninterrupted run that saves at `save_at`, then a fresh model+optimizer resumed from it."""
    from value_assets.gpu.runtime.checkpoint import load_critic, save_critic
    from value_assets.gpu.runtime.step import wrap_for_training

    rows = make_rows(rows_per_step * steps, seed=1)
    model = build_critic(BACKBONE, OBJ, tp=tp)
    ddp, opt = wrap_for_training(model, lr=1e-3, weight_decay=0.0, clip_grad=1.0)
    full = _train(rows, save_at, 0, ddp, opt, rows_per_step)
    save_critic(ckpt, ddp, opt, iteration=save_at)
    full += _train(rows, steps, save_at, ddp, opt, rows_per_step)
    full_params = {n: p.detach().clone() for n, p in model.named_parameters()}

    torch.manual_seed(999)
    model2 = build_critic(BACKBONE, OBJ, tp=tp, head_seed=3)
    ddp2, opt2 = wrap_for_training(model2, lr=1e-3, weight_decay=0.0, clip_grad=1.0)
    start = load_critic(ckpt, ddp2, opt2)
    resumed = _train(rows, steps, start, ddp2, opt2, rows_per_step)
    params2 = {n: p.detach().clone() for n, p in model2.named_parameters()}
    if rank == 0:
        torch.save(
            {"full": full, "resumed": resumed, "start": start, "full_params": full_params, "resumed_params": params2},
            out_file,
        )


def train_layout(rank, world, tp, rows_per_step, steps, ckpt, init_file, out_file):
    """Layout-invariant init, `steps` optimizer steps, a checkpoint and forward-only values, at
    whatever TP x PP this process group was started with. With `init_file` absent (the one-stage
    reference), the whole model's initial state is written there; otherwise this stage's initial
    weights are compared with that state through `stage_state`."""
    from megatron.core import parallel_state as ps

    from value_assets.gpu.model.gpt_critic import init_layout_invariant, stage_state
    from value_assets.gpu.runtime.checkpoint import save_critic
    from value_assets.gpu.runtime.step import evaluate_rows, wrap_for_training

    pp = ps.get_pipeline_model_parallel_world_size()
    torch.manual_seed(1000 + rank)  # megatron's own init differs per rank; the re-draw must not
    model = build_critic(BACKBONE, OBJ, tp=tp, pp=pp)
    init_layout_invariant(model, seed=7)
    init = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    res = {}
    if os.path.exists(init_file):
        ref = stage_state(model, torch.load(init_file))
        res["init_keys_match"] = sorted(ref) == sorted(init)
        res["init_equal"] = all(torch.equal(ref[k], v) for k, v in init.items() if k in ref)
    else:
        torch.save(init, init_file)
    ddp, opt = wrap_for_training(model, lr=1e-3, weight_decay=0.0, clip_grad=1.0)
    res["history"] = _train(make_rows(rows_per_step * steps, seed=1), steps, 0, ddp, opt, rows_per_step)
    save_critic(ckpt, ddp, opt, iteration=steps)
    values = evaluate_rows(ddp, pack_rows(make_rows(5, seed=99), micro_batch_tokens=30), OBJ)
    res["values"] = {k: torch.from_numpy(v["values"]) for k, v in values.items()}
    res["last_stage"] = ps.is_pipeline_last_stage()
    res["first_stage"] = ps.is_pipeline_first_stage()
    torch.save(res, f"{out_file}.{rank}")


def save_with_writers_killed(rank, world, tp, ckpt, out_file):
    """A worker's second training save (its first started megatron-core 0.16's results manager,
    which a process keeps) with every process the save forks SIGKILLed at birth, as the OOM killer
    would a torch_dist writer: megatron's writer waited for it without a deadline. Then the save is
    read back with megatron's own `dist_checkpointing.load` (`load_critic`) into a fresh critic.
    Run last in its process: the kill stays registered."""
    import signal

    from value_assets.gpu.runtime.checkpoint import load_critic, save_critic
    from value_assets.gpu.runtime.step import wrap_for_training

    model = build_critic(BACKBONE, OBJ, tp=tp)
    ddp, opt = wrap_for_training(model, lr=1e-3, weight_decay=0.0, clip_grad=1.0)
    _train(make_rows(8, seed=1), 2, 0, ddp, opt, 4)
    first, second = os.path.join(ckpt, "first"), os.path.join(ckpt, "second")
    if rank == 0:
        os.makedirs(first)
        os.makedirs(second)
    torch.distributed.barrier()
    save_critic(first, ddp, opt, iteration=1)
    os.register_at_fork(after_in_child=lambda: os.kill(os.getpid(), signal.SIGKILL))
    save_critic(second, ddp, opt, iteration=2)
    saved = probe(model)
    torch.manual_seed(4321)
    fresh = build_critic(BACKBONE, OBJ, tp=tp, head_seed=5)
    ddp2, opt2 = wrap_for_training(fresh, lr=1e-3, weight_decay=0.0, clip_grad=1.0)
    iteration = load_critic(second, ddp2, opt2)
    if rank == 0:
        torch.save({"iteration": iteration, "saved": saved, "loaded": probe(fresh)}, out_file)


def load_params(rank, world, tp, ckpt, out_file):
    """Every parameter of a checkpoint, loaded into a one-stage critic (re-sharded on load)."""
    from value_assets.gpu.runtime.checkpoint import load_model_weights

    model = build_critic(BACKBONE, OBJ, tp=tp)
    load_model_weights(ckpt, model)
    if rank == 0:
        torch.save(
            {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}, out_file
        )


def train_frozen(rank, world, tp, freeze, distributed_optimizer, rows_per_step, steps, out_file):
    """Train with `freeze`; record every parameter before and after, and which were frozen."""
    from value_assets.gpu.runtime.step import frozen_parameter_names, wrap_for_training

    model = build_critic(BACKBONE, OBJ, tp=tp)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    frozen = frozen_parameter_names(model, freeze)
    ddp, opt = wrap_for_training(
        model, lr=1e-2, weight_decay=0.0, clip_grad=1.0, freeze=freeze, distributed_optimizer=distributed_optimizer
    )
    history = _train(make_rows(rows_per_step * steps, seed=1), steps, 0, ddp, opt, rows_per_step)
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save(
            {
                "before": before,
                "after": after,
                "frozen": frozen,
                "history": history,
                "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
            },
            out_file,
        )
