"""Miles' own Qwen3.5 code on the product's Qwen3.5 Miles bundle, in a process of its own (run by
tests/rl/test_miles_qwen3_5.py): `python -m tests.rl.miles_qwen3_5_side JOB.json`.

PYTHONPATH: Megatron-LM 0.17.0 (.rl/megatron-lm) first, then .rl/miles (radixark/miles' `miles` and
`miles_plugins` at the commit the Makefile pins, with flash-linear-attention 0.4.2 and triton, which
fla imports; `make rl-deps`), this repository and .rl/site (einops, which fla imports). Nothing of
the product is imported here but the harness' shims.

What it runs, with Megatron-LM's own `parse_args`/`validate_args` on the flags Miles'
scripts/models/qwen3.5-*.py pass (`--spec miles_plugins.models.qwen3_5 get_qwen3_5_spec`,
`--apply-layernorm-1p`, `--attention-output-gate`, `--rotary-percent`, ...) for the actor's shape,
`args.hf_checkpoint` = the actor's HF folder (Miles' own argument), and `core_transformer_config_from_args`:

* Miles' `get_qwen3_5_spec(args, config, None)`: it hard-codes megatron-core's Transformer Engine
  block spec, which cannot be built without Transformer Engine (not installable on CPU); its
  exception is reported (so a later environment that has TE shows up as a change).
* For every linear-attention layer, Miles' own module `miles_plugins.models.qwen3_5.Attention(args,
  config, layer_number)` (Gated DeltaNet with fla's ShortConvolution and FusedRMSNormGated,
  transformers' Qwen3NextRMSNorm as its input norm), built on the CPU: its `sharded_state_dict`
  under `decoder.layers.{i}.self_attention.` (what a TransformerBlock whose layers are numbered
  requests for it), then megatron-core's `dist_checkpointing.load` of that request from the bundle
  and `load_state_dict(strict=True)`. Reported: the request's keys, global shapes and dtypes, and
  the loaded tensors (saved to a file for the test to compare).
* Not run: the forward of Miles' module. fla's kernels (chunk_gated_delta_rule, the convolution
  and the gated norm) are Triton kernels, which need a GPU.

Shims: M1-M3 of tests/rl/megatron_lm_side.py (gloo rank, current device on the CPU, CPU RNG
tracker); `--transformer-impl transformer_engine` is passed as Miles' scripts imply, and the CPU
flags otherwise (`CPU_FLAGS`).
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

from tests.rl.megatron_lm_side import CPU_FLAGS, arch_flags, megatron_lm_args, one_cpu_rank


def miles_flags(cfg: dict[str, Any], actor_flags: list[str]) -> list[str]:
    """Miles' scripts/models/qwen3.5-*.py flags on top of the shape flags, `--transformer-impl
    transformer_engine` (the spec hard-codes TE) in place of the CPU default."""
    cpu = list(CPU_FLAGS)
    cpu[cpu.index("--transformer-impl") + 1] = "transformer_engine"
    extra = ["--apply-layernorm-1p", "--attention-output-gate", "--rotary-percent", str(cfg["rotary_percent"])]
    extra += ["--spec", "miles_plugins.models.qwen3_5", "get_qwen3_5_spec"]
    return actor_flags + cpu + extra


def run(job: dict) -> dict:
    import megatron.core
    import miles_plugins.models.qwen3_5 as plugin
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from megatron.core.transformer.spec_utils import import_module
    from megatron.training.arguments import core_transformer_config_from_args

    one_cpu_rank()
    cfg = job["config"]
    args = megatron_lm_args(miles_flags(cfg, arch_flags(cfg)))
    args.hf_checkpoint = job["actor"]
    config = core_transformer_config_from_args(args)
    out: dict[str, Any] = {
        "megatron_core": megatron.core.__version__,
        "plugin_file": plugin.__file__,
        "config": {
            "layernorm_zero_centered_gamma": config.layernorm_zero_centered_gamma,
            "attention_output_gate": config.attention_output_gate,
            "qk_layernorm": config.qk_layernorm,
        },
    }
    try:
        import_module(args.spec)(args, config, None)
        out["spec"] = "built"
    except Exception as exc:  # noqa: BLE001 - reported: the full model needs Transformer Engine
        out["spec"] = f"{type(exc).__name__}: {exc}"
    out["layers"] = {}
    loaded_all = {}
    for i, kind in enumerate(cfg["layer_types"]):
        if kind != "linear_attention":
            continue
        module = plugin.Attention(args, config, layer_number=i + 1).eval()
        prefix = f"decoder.layers.{i}.self_attention."
        request = module.sharded_state_dict(prefix=prefix)
        got = {
            v.key: {"shape": list(v.global_shape), "dtype": str(v.data.dtype), "offsets": list(v.global_offset)}
            for v in request.values()
        }
        # RETURN_ALL: megatron's "missing" = in the bundle, not requested (the other layers here);
        # "unexpected" = requested, not in the bundle (must be none).
        state, not_requested, not_in_bundle = dist_checkpointing.load(
            request, job["step"], strict=StrictHandling.RETURN_ALL
        )
        # Megatron-LM hands the model the loaded dict under the request's keys (with common.pt's
        # entries beside them); this module sits at `prefix` in the whole model.
        state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        result = module.load_state_dict(state, strict=True)
        loaded_all.update({prefix + k: v.detach().clone() for k, v in module.state_dict().items()})
        out["layers"][str(i)] = {
            "request": got,
            "not_in_bundle": sorted(not_in_bundle),
            "not_requested_here": sorted(k for k in not_requested if k.startswith(prefix)),
            "missing": result.missing_keys,
            "unexpected": result.unexpected_keys,
        }
    torch.save(loaded_all, job["tensors"])
    return out


def main() -> int:
    job = json.loads(Path(sys.argv[1]).read_text())
    try:
        result = run(job)
    except Exception:  # noqa: BLE001 - reported to the test in full
        result = {"error": traceback.format_exc()}
    Path(job["result"]).write_text(json.dumps(result))
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
