"""Worker for test_miles_megatron_load: one rank loading an exported critic with megatron's own
`dist_checkpointing.load`, requesting exactly what a Megatron-LM / Miles critic requests.

The request is megatron-core's `GPTModel.sharded_state_dict()` of a local-spec model whose
`output_layer` is a plain `nn.Linear(hidden, K)` (Miles' `LinearForLastLayer` is one). The local
spec already requests the norms under TE's fused names and the four linears' `_extra_state`
objects under the names TE's modules use, so for the TE spec (Transformer Engine cannot be
installed here) the request only gains core_attention's `_extra_state` objects, which older
megatron-core TE specs request, built with megatron's own `make_sharded_object_for_checkpoint`
and the layer offsets `TransformerBlock` passes. Strict: any missing or unexpected key fails
(`StrictHandling.RAISE_ALL`).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch


class _ValueHead(torch.nn.Linear):
    """Miles' critic head shape: a plain Linear with the output layer's call signature."""

    def forward(self, x, weight=None, runtime_gather_output=None):
        return super().forward(x).float(), None


def _te_request(sd: dict, num_layers: int) -> dict:
    from megatron.core.transformer.utils import make_sharded_object_for_checkpoint

    from value_assets.gpu.convert import names

    have = {getattr(v, "key", None) for v in sd.values()}
    for module in names.EXTRA_STATE["te"]:
        key = f"decoder.layers.{module}._extra_state"
        if key not in have:
            for i in range(num_layers):
                sd[f"{key}#{i}"] = make_sharded_object_for_checkpoint(None, key, ((0, i, num_layers),))
    return sd


def run(rank: int, world: int, port: int, cases: list[tuple[str, str, str, int, str, str]]) -> None:
    """cases: (export folder, layer spec, hf folder (shape), K, ids .pt, values .pt written by rank 0)."""
    from tests.ranks import join
    from value_assets.gpu.runtime.parallel import destroy, init_distributed

    init_distributed(rank, world, tp=world, store=join(port, world))
    try:
        check(rank, world, cases)
    finally:
        destroy()


def check(rank: int, world: int, cases: list[tuple[str, str, str, int, str, str]]) -> None:
    """The load and forward of `run`, in an already initialised process group of TP `world`."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from tests.hf.megatron_fixture import build_gpt, final_hidden
    from value_assets.gpu.convert import names
    from value_assets.gpu.convert.hf import read_hf_config

    for folder, spec, hf, k, ids_path, out_path in cases:
        cfg = read_hf_config(hf)
        padded = -(-cfg["vocab_size"] // (128 * world)) * 128 * world  # Megatron-LM's padding at this TP
        gpt = build_gpt(cfg, padded_vocab_size=padded, tp=world)
        gpt.output_layer = _ValueHead(cfg["hidden_size"], k)
        sd = gpt.sharded_state_dict(prefix="")
        if spec == "te":
            sd = _te_request(sd, cfg["num_layers"])
        it = int((Path(folder) / "latest_checkpointed_iteration.txt").read_text())
        step = Path(folder) / f"iter_{it:07d}"
        common = dist_checkpointing.load_common_state_dict(str(step))
        assert common["iteration"] == it and common["args"].tensor_model_parallel_size == 1
        loaded = dist_checkpointing.load(sd, str(step), strict=StrictHandling.RAISE_ALL)
        extra = {n: v for n, v in loaded.items() if "_extra_state" in n}
        assert len(extra) == len(names.EXTRA_STATE[spec]) * cfg["num_layers"], sorted(extra)
        for n, v in extra.items():  # local: None; TE's set_extra_state gets pickle.dumps(None) bytes
            assert (v is None) if spec == "local" else pickle.loads(v.numpy().tobytes()) is None, n
        # The returned dict is keyed like the request (the model's own names); the local
        # modules ignore TE's extra-state bytes.
        gpt.load_state_dict({n: loaded[n] for n in gpt.state_dict()}, strict=True)
        hidden = final_hidden(gpt, torch.load(ids_path))
        with torch.no_grad():
            values = gpt.output_layer(hidden.float())[0]
        if rank == 0:
            torch.save(values, out_path)
