"""Worker for test_hf_tp: one rank of a TP=2 gloo group running the converted model on CPU."""

from __future__ import annotations

import torch


def run(rank: int, world: int, port: int, cases: list[tuple[str, str, str]]) -> None:
    """cases: (hf folder, input ids .pt, output hidden .pt written by rank 0)."""
    from value_assets.gpu.convert.hf import load_hf_backbone_state, read_hf_config
    from value_assets.gpu.runtime.parallel import destroy, init_distributed

    from .megatron_fixture import build_gpt, final_hidden, load_backbone

    init_distributed(rank, world, "127.0.0.1", port, tp=world)
    try:
        for folder, ids_path, out_path in cases:
            cfg = read_hf_config(folder)
            # Vocab padded to a multiple of 64 * tp like Megatron's training scripts do.
            padded = -(-cfg["vocab_size"] // (64 * world)) * 64 * world
            gpt = build_gpt(cfg, padded_vocab_size=padded, tp=world)
            load_backbone(gpt, load_hf_backbone_state(folder, rank, world, padded_vocab_size=padded))
            hidden = final_hidden(gpt, torch.load(ids_path))
            if rank == 0:
                torch.save(hidden, out_path)
    finally:
        destroy()
