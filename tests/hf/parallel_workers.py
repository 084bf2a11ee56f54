"""Worker for test_hf_parallel: one rank of a 2-rank gloo group that runs the TP=2 conversion cases,
then rebuilds megatron's parallel state at PP=2 in the same group and runs the PP=2 bootstrap cases
(one launch of 2 ranks serves both)."""

from __future__ import annotations

import torch


def run(
    rank: int,
    world: int,
    port: int,
    tp_cases: list[tuple[str, str, str]],
    pp_cases: list[tuple[str, str, str]],
    engine_tp_cases: list[tuple[str, str, str]] = (),
) -> None:
    from megatron.core import parallel_state as ps

    from tests.ranks import join
    from value_assets.gpu.runtime.parallel import destroy, init_distributed

    try:
        init_distributed(rank, world, tp=world, store=join(port, world))
        tensor_parallel(rank, world, tp_cases)
        engine_tensor_parallel(rank, world, engine_tp_cases)
        ps.destroy_model_parallel()
        init_distributed(rank, world, pp=world)  # the process group is kept
        pipeline_parallel(rank, world, pp_cases)
    finally:
        destroy()


def tensor_parallel(rank: int, world: int, cases: list[tuple[str, str, str]]) -> None:
    """TP=world, the converted model run on CPU. cases: (hf folder, input ids .pt, output hidden .pt
    written by rank 0)."""
    from tests.hf.megatron_fixture import build_gpt, final_hidden, load_backbone
    from value_assets.gpu.convert.hf import load_hf_backbone_state, read_hf_config

    for folder, ids_path, out_path in cases:
        cfg = read_hf_config(folder)
        # Vocab padded to a multiple of 64 * tp like Megatron's training scripts do.
        padded = -(-cfg["vocab_size"] // (64 * world)) * 64 * world
        gpt = build_gpt(cfg, padded_vocab_size=padded, tp=world)
        load_backbone(gpt, load_hf_backbone_state(folder, rank, world, padded_vocab_size=padded))
        hidden = final_hidden(gpt, torch.load(ids_path))
        if rank == 0:
            torch.save(hidden, out_path)


def engine_tensor_parallel(rank: int, world: int, cases: list[tuple[str, str, str]]) -> None:
    """TP=world: the engine's critic bootstrapped from an HF checkpoint (each rank its slice), one
    packed micro-batch of rows [13, 20]. cases: (hf folder, input ids .pt [33], values .pt written by
    rank 0, with the head)."""
    from value_assets.core.objective import Objective
    from value_assets.gpu.convert.bootstrap import load_backbone_into
    from value_assets.gpu.convert.hf import backbone_config_kwargs, read_hf_config
    from value_assets.gpu.model.gpt_critic import BackboneConfig, build_critic, critic_forward

    for folder, ids_path, out_path in cases:
        backbone = BackboneConfig(**backbone_config_kwargs(read_hf_config(folder)))
        critic = build_critic(backbone, Objective(num_bins=11), tp=world, bf16=False, head_seed=0).eval()
        load_backbone_into(critic, {"kind": "hf", "path": folder}, tp=world)
        ids = torch.load(ids_path)
        pos = torch.cat([torch.arange(13), torch.arange(20)])
        cu = torch.tensor([0, 13, 33], dtype=torch.int32)
        with torch.no_grad():
            out = critic_forward(critic, ids, pos, cu, 20)
        if rank == 0:
            torch.save(
                {"values": out, "weight": critic.output_layer.weight, "bias": critic.output_layer.bias}, out_path
            )


def pipeline_parallel(rank: int, world: int, cases: list[tuple[str, str, str]]) -> None:
    """PP=world: each stage of the engine's critic bootstrapped from an HF checkpoint, one packed
    sequence passed from stage to stage by hand. cases: (hf folder, input ids .pt [t], output .pt
    written by the last stage)."""
    from megatron.core import parallel_state as ps

    from value_assets.core.objective import Objective
    from value_assets.gpu.convert.bootstrap import load_backbone_into
    from value_assets.gpu.convert.hf import backbone_config_kwargs, read_hf_config
    from value_assets.gpu.model.gpt_critic import BackboneConfig, build_critic, critic_forward

    for folder, ids_path, out_path in cases:
        backbone = BackboneConfig(**backbone_config_kwargs(read_hf_config(folder)))
        critic = build_critic(backbone, Objective(num_bins=11), pp=world, bf16=False, head_seed=0).eval()
        loaded = load_backbone_into(critic, {"kind": "hf", "path": folder}, tp=1)["loaded"]
        ids = torch.load(ids_path)
        t = ids.numel()
        pos, cu = torch.arange(t), torch.tensor([0, t], dtype=torch.int32)
        with torch.no_grad():
            if not ps.is_pipeline_first_stage():
                hidden = torch.empty(t, 1, backbone.hidden_size)
                torch.distributed.recv(hidden, src=rank - 1)
                critic.set_input_tensor(hidden)
            out = critic_forward(critic, ids, pos, cu, t)
            if not ps.is_pipeline_last_stage():
                torch.distributed.send(out.contiguous(), dst=rank + 1)
            else:
                torch.save(
                    {
                        "values": out,
                        "weight": critic.output_layer.weight,
                        "bias": critic.output_layer.bias,
                        "loaded": loaded,
                        "layers": len(critic.decoder.layers),
                    },
                    out_path,
                )
