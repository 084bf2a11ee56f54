"""Worker bodies for the multi-process engine tests (spawned with torch.multiprocessing)."""

from __future__ import annotations

import os

import numpy as np
import torch

from value_assets.core.objective import Objective
from value_assets.gpu.model import BackboneConfig, build_critic, critic_forward
from value_assets.gpu.packing import Row, pack_rows
from value_assets.gpu.parallel import destroy, init_distributed

OBJ = Objective()
BACKBONE = BackboneConfig.tiny(num_layers=2, hidden_size=32, ffn_hidden_size=64, vocab_size=49152)


def make_rows(n: int, seed: int = 0) -> list[Row]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        L = int(rng.integers(6, 24)); r = int(rng.integers(1, L - 1))
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


def run(rank: int, world: int, port: int, tp: int, fn_name: str, args: tuple) -> None:
    init_distributed(rank, world, master_port=port, tp=tp, seed=1234)
    try:
        globals()[fn_name](rank, world, tp, *args)
    finally:
        destroy()


def save_tp(rank, world, tp, ckpt, out_file):
    from value_assets.gpu.checkpoint import save_critic

    model = build_critic(BACKBONE, OBJ, tp=tp)
    # Perturb away from init so that a load that silently kept init would be caught.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.sin(torch.arange(p.numel(), dtype=torch.float32)).view_as(p))
    out = probe(model)
    save_critic(ckpt, model, iteration=7)
    if rank == 0:
        torch.save(out, out_file)


def load_tp(rank, world, tp, ckpt, out_file):
    from value_assets.gpu.checkpoint import load_critic

    torch.manual_seed(4321)
    model = build_critic(BACKBONE, OBJ, tp=tp, head_seed=5)
    it = load_critic(ckpt, model)
    assert it == 7, it
    out = probe(model)
    if rank == 0:
        torch.save(out, out_file)


def train_dp(rank, world, tp, rows_per_step, steps, ckpt_at, ckpt_dir, resume, out_file):
    """DP training; rows of each batch go to dp ranks round-robin by position."""
    from megatron.core import parallel_state as ps

    from value_assets.gpu.checkpoint import load_critic, save_critic
    from value_assets.gpu.train import train_step, wrap_for_training

    model = build_critic(BACKBONE, OBJ, tp=tp)
    ddp, opt = wrap_for_training(model, lr=1e-3)
    rows = make_rows(rows_per_step * steps, seed=1)
    dp, dpr = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    start = 0
    if resume:
        start = load_critic(ckpt_dir, ddp, opt)
    history = []
    for step in range(start, steps):
        batch = rows[step * rows_per_step:(step + 1) * rows_per_step]
        mine = batch[dpr::dp]
        mbs = pack_rows(mine, micro_batch_tokens=30)
        history.append(train_step(ddp, opt, mbs, rows_per_step, OBJ))
        if ckpt_at is not None and step + 1 == ckpt_at and not resume:
            save_critic(ckpt_dir, ddp, opt, iteration=step + 1)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save({"history": history, "params": params}, out_file)
