"""Worker for test_hf_pp: one stage of a PP=2 gloo group, the engine's critic bootstrapped from an
HF checkpoint, one packed sequence passed from stage 0 to stage 1 by hand."""

from __future__ import annotations

import torch


def run(rank: int, world: int, port: int, cases: list[tuple[str, str, str]]) -> None:
    """cases: (hf folder, input ids .pt [t], output .pt written by the last stage)."""
    from megatron.core import parallel_state as ps

    from value_assets.core.objective import Objective
    from value_assets.gpu.convert.bootstrap import load_backbone_into
    from value_assets.gpu.convert.hf import backbone_config_kwargs, read_hf_config
    from value_assets.gpu.model.critic import BackboneConfig, build_critic, critic_forward
    from value_assets.gpu.runtime.parallel import destroy, init_distributed

    init_distributed(rank, world, "127.0.0.1", port, pp=world)
    try:
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
                    torch.save({"values": out, "weight": critic.output_layer.weight, "bias": critic.output_layer.bias,
                                "loaded": loaded, "layers": len(critic.decoder.layers)}, out_path)
    finally:
        destroy()
