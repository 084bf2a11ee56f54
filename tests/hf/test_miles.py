"""Megatron-LM / Miles layouts: the same weights through a Hugging Face folder, a Transformer-Engine
layout and a local-spec layout give the same critic; the reader is strict and never runs pickles.

The layouts are built from a small HF model with the same name tables and writer `export-miles`
uses (`megatron_lm.write_critic`). Equality is exact (same float32 tensors, same forward).
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path

import pytest
import torch

from tests.hf.hf_checkpoints import make_hf_checkpoint
from value_assets.core.errors import InputError
from value_assets.core.objective import Objective

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def _critic_state(hf_folder: Path, k: int) -> dict:
    from value_assets.gpu.convert.hf import load_hf_backbone_state

    state = load_hf_backbone_state(hf_folder)
    g = torch.Generator().manual_seed(5)
    state["output_layer.weight"] = torch.randn(k, state["decoder.final_layernorm.weight"].shape[0], generator=g) * 0.02
    state["output_layer.bias"] = torch.randn(k, generator=g)
    return state


def _write_layout(folder: Path, state: dict, cfg, spec: str, iteration: int = 7) -> Path:
    from value_assets.gpu.convert.megatron_lm import write_critic

    step = folder / f"iter_{iteration:07d}"
    step.mkdir(parents=True)
    write_critic(step, state, cfg, spec, iteration)
    (folder / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")
    return step


def _critic_values(cfg, source, ids: torch.Tensor) -> tuple[dict, torch.Tensor]:
    from value_assets.gpu.convert.bootstrap import load_backbone_into
    from value_assets.gpu.model.gpt_critic import build_critic, critic_forward

    model = build_critic(cfg, Objective(loss_type="mse"), bf16=False, head_seed=3).eval()
    load_backbone_into(model, source, tp=1)
    cu = torch.tensor([0, ids.numel()], dtype=torch.int32)
    with torch.no_grad():
        out = critic_forward(model, ids, torch.arange(ids.numel()), cu, ids.numel())
    return {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}, out


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_hf_te_and_local_layouts_give_the_same_critic(tmp_path, megatron_single_rank, family):
    from value_assets.gpu.convert.bootstrap import resolve_backbone
    from value_assets.gpu.convert.megatron_lm import checkpoint_names, saved_args, tensor_shapes, write_critic

    hf = tmp_path / "hf"
    make_hf_checkpoint(hf, family)
    cfg_hf, src_hf, ident_hf = resolve_backbone(str(hf))
    state = _critic_state(hf, 1)
    ids = torch.randint(0, cfg_hf.vocab_size, (24,), generator=torch.Generator().manual_seed(1))
    want_state, want = _critic_values(cfg_hf, src_hf, ids)
    for spec in ("te", "local"):
        folder = tmp_path / spec
        step = _write_layout(folder, state, cfg_hf, spec)
        # The tensor names are the checkpoint names for this shape, plus the head; both specs save
        # the norms under TE's fused names (megatron-core's local spec maps them there too).
        names = set(tensor_shapes(step))
        assert names == set(checkpoint_names(cfg_hf)) | {"output_layer.weight", "output_layer.bias"}
        assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in names
        assert not any("input_layernorm" in n or "pre_mlp_layernorm" in n for n in names)
        saved = saved_args(step)  # the epsilon under Megatron-LM 0.12-0.15's and 0.16+'s names
        assert saved["norm_epsilon"] == saved["layernorm_epsilon"] == cfg_hf.norm_epsilon
        cfg, src, ident = resolve_backbone(str(folder))
        assert cfg == cfg_hf, (cfg, cfg_hf)  # the architecture from the saved arguments
        assert ident["kind"] == "megatron-lm" and ident["layer_spec"] == spec and ident["iteration"] == 7
        got_state, got = _critic_values(cfg, src, ids)
        assert got_state.keys() == want_state.keys()
        for k in want_state:
            assert torch.equal(got_state[k], want_state[k]), (spec, k)
        assert torch.equal(got, want), spec
    # Another writer's unfused norm names (`input_layernorm.weight`, ...) read the same.
    folder = tmp_path / "unfused"
    step = folder / "iter_0000003"
    step.mkdir(parents=True)
    write_critic(step, state, cfg_hf, "local", 3, fused_norms=False)
    (folder / "latest_checkpointed_iteration.txt").write_text("3")
    assert "decoder.layers.input_layernorm.weight" in tensor_shapes(step)
    cfg, src, _ = resolve_backbone(str(folder))
    assert torch.equal(_critic_values(cfg, src, ids)[1], want)


def test_strict_errors_list_unexpected_and_missing(tmp_path, megatron_single_rank):
    import dataclasses

    from value_assets.gpu.convert.bootstrap import resolve_backbone
    from value_assets.gpu.convert.megatron_lm import load_backbone_state

    hf = tmp_path / "hf"
    make_hf_checkpoint(hf, "qwen2")
    cfg, _, _ = resolve_backbone(str(hf))
    step = _write_layout(tmp_path / "te", _critic_state(hf, 1), cfg, "te")
    wrong = dataclasses.replace(cfg, family="qwen3", qkv_bias=False, qk_layernorm=True)
    with pytest.raises(InputError) as err:
        load_backbone_state(step, wrong)
    msg = str(err.value)
    assert "unexpected ['decoder.layers.self_attention.linear_qkv.bias']" in msg
    assert (
        "missing ['decoder.layers.self_attention.k_layernorm.weight', "
        "'decoder.layers.self_attention.q_layernorm.weight']"
    ) in msg


def test_architecture_from_hf_config_when_args_are_absent(tmp_path, megatron_single_rank):
    from value_assets.gpu.convert.bootstrap import resolve_backbone

    hf = tmp_path / "hf"
    make_hf_checkpoint(hf, "llama")
    cfg, _, _ = resolve_backbone(str(hf))
    folder = tmp_path / "te"
    step = _write_layout(folder, _critic_state(hf, 1), cfg, "te")
    torch.save({"iteration": 7, "checkpoint_version": 3.0}, step / "common.pt")  # a checkpoint without args
    with pytest.raises(InputError, match="no saved arguments.*--hf-config"):
        resolve_backbone(str(folder))
    got, _, _ = resolve_backbone(str(folder), hf_config=str(hf / "config.json"))
    assert got == cfg


class _Evil:
    def __init__(self, target: str):
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


def test_pickles_are_never_run(tmp_path):
    """common.pt: foreign globals become inert records; .metadata: refused by name."""
    import argparse

    from value_assets.gpu.runtime.safe_pickle import Opaque, load_common, load_dcp_metadata

    marker = tmp_path / "pwned"
    torch.save(
        {"args": argparse.Namespace(num_layers=2, evil=_Evil(str(marker))), "iteration": 3}, tmp_path / "common.pt"
    )
    obj = load_common(tmp_path / "common.pt")
    assert not marker.exists()
    assert obj["iteration"] == 3 and obj["args"].num_layers == 2 and isinstance(obj["args"].evil, Opaque)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Evil(str(marker))))
    with pytest.raises(InputError, match="refusing to unpickle posix.system"):
        load_dcp_metadata(tmp_path / ".metadata")
    assert not marker.exists()


def test_real_megatron_lm_arguments_are_read(tmp_path):
    """Megatron-LM namespaces hold dtypes and Megatron enums: rebuilt or kept inert, the
    architecture still comes out (here a Qwen3-shaped one)."""
    import argparse

    from megatron.core.transformer.enums import AttnBackend

    from value_assets.gpu.convert.megatron_lm import backbone_from_args
    from value_assets.gpu.runtime.safe_pickle import Opaque, load_common

    args = argparse.Namespace(
        num_layers=4,
        hidden_size=64,
        ffn_hidden_size=96,
        num_attention_heads=4,
        group_query_attention=True,
        num_query_groups=2,
        kv_channels=32,
        vocab_size=None,
        padded_vocab_size=256,
        max_position_embeddings=128,
        rotary_base=1000000,
        norm_epsilon=1e-6,
        normalization="RMSNorm",
        swiglu=True,
        add_qkv_bias=False,
        qk_layernorm=True,
        position_embedding_type="rope",
        use_rope_scaling=False,
        num_experts=None,
        params_dtype=torch.bfloat16,
        attention_backend=AttnBackend.auto,
        transformer_impl="transformer_engine",
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=1,
    )
    torch.save({"args": args, "iteration": 10, "checkpoint_version": 3.0}, tmp_path / "common.pt")
    read = vars(load_common(tmp_path / "common.pt")["args"])
    assert read["params_dtype"] is torch.bfloat16 and isinstance(read["attention_backend"], Opaque)
    cfg = backbone_from_args(read, "common.pt")
    assert (cfg.family, cfg.num_query_groups, cfg.kv_channels, cfg.vocab_size, cfg.rotary_base) == (
        "qwen3",
        2,
        32,
        256,
        1e6,
    )
    with pytest.raises(
        InputError, match="args.swiglu: is an object of megatron.core.transformer.enums.AttnBackend, not a plain value"
    ):
        backbone_from_args({**read, "swiglu": read["attention_backend"]}, "common.pt")
    with pytest.raises(InputError, match="MoE backbones are not supported"):
        backbone_from_args({**read, "num_experts": 8}, "common.pt")
    # Settings without a trace in the tensors, which the critic would silently compute otherwise.
    for key, value in (
        ("rotary_interleaved", True),
        ("rotary_percent", 0.5),
        ("apply_layernorm_1p", True),
        ("rotary_seq_len_interpolation_factor", 4),
        ("window_size", (4096, 0)),
        ("no_rope_freq", 4),
        ("apply_residual_connection_post_layernorm", True),
        ("qk_l2_norm", True),
        ("softmax_type", "off-by-one"),
        ("layernorm_zero_centered_gamma", True),
        ("experimental_attention_variant", "gated_delta_net"),
        ("attention_output_gate", True),
        ("use_mup", True),
    ):
        with pytest.raises(
            InputError, match=rf"common\.pt: args\.{key}: is {re.escape(repr(value))}; the critic computes with"
        ):
            backbone_from_args({**read, key: value}, "common.pt")
    assert (
        backbone_from_args(
            {
                **read,
                "rotary_interleaved": False,
                "rotary_percent": 1.0,
                "window_size": None,
                "softmax_type": "vanilla",
            },
            "common.pt",
        )
        == cfg
    )


def test_megatron_lm_argument_names_of_every_version_and_the_hf_config_rule():
    """Megatron-LM 0.12-0.15 save `norm_epsilon` / `apply_layernorm_1p`, 0.16 and 0.17
    `layernorm_epsilon` / `layernorm_zero_centered_gamma` (tests/rl/test_megatron_lm.py reads them from
    Megatron-LM 0.17's own parser and save_checkpoint). --hf-config completes what the saved arguments
    lack and must agree with what they say."""
    import dataclasses

    from value_assets.core.backbone import BackboneConfig
    from value_assets.gpu.convert.megatron_lm import backbone_from_args

    v15 = dict(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=96,
        num_attention_heads=4,
        group_query_attention=True,
        num_query_groups=2,
        kv_channels=16,
        vocab_size=None,
        padded_vocab_size=128,
        max_position_embeddings=64,
        rotary_base=1000000,
        norm_epsilon=1e-6,
        apply_layernorm_1p=False,
        normalization="RMSNorm",
        swiglu=True,
        add_qkv_bias=True,
        qk_layernorm=False,
        position_embedding_type="rope",
        use_rope_scaling=False,
    )
    v16 = {k: v for k, v in v15.items() if k not in ("norm_epsilon", "apply_layernorm_1p")}
    v16 |= {"layernorm_epsilon": 1e-6, "layernorm_zero_centered_gamma": False}
    a, b = backbone_from_args(v15, "c.pt"), backbone_from_args(v16, "c.pt")
    assert a == b and a.norm_epsilon == 1e-6 and a.family == "qwen2" and a.vocab_size == 128
    assert backbone_from_args({**v16, "norm_epsilon": 1e-6}, "c.pt") == a  # both names, one value
    with pytest.raises(InputError, match=r"c\.pt: args\.layernorm_zero_centered_gamma: is True"):
        backbone_from_args({**v16, "layernorm_zero_centered_gamma": True}, "c.pt")
    with pytest.raises(InputError, match=r"c\.pt: args: hold layernorm_epsilon=1e-06 and norm_epsilon=1e-05"):
        backbone_from_args({**v16, "norm_epsilon": 1e-5}, "c.pt")
    no_eps = {k: v for k, v in v16.items() if k != "layernorm_epsilon"}
    with pytest.raises(InputError, match=r"lack \['layernorm_epsilon / norm_epsilon'\]; pass --hf-config"):
        backbone_from_args(no_eps, "c.pt")
    hf = BackboneConfig(
        family="qwen2",
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=96,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=120,
        max_seq_len=32768,
        rotary_base=1e6,
        norm_epsilon=1e-6,
        qkv_bias=True,
    )
    # completes: the unpadded vocabulary and a missing epsilon; max_seq_len: the saved arguments win
    got = backbone_from_args(no_eps, "c.pt", hf=hf, hf_where="cfg")
    assert (got.vocab_size, got.norm_epsilon, got.max_seq_len) == (120, 1e-6, 64)
    assert backbone_from_args(v16, "c.pt", hf=hf, hf_where="cfg") == dataclasses.replace(a, vocab_size=120)
    for field, value in (
        ("norm_epsilon", 1e-5),
        ("rotary_base", 1e4),
        ("num_query_groups", 4),
        ("qkv_bias", False),
        ("rope_scaling_factor", 8.0),
        ("num_layers", 3),
    ):
        with pytest.raises(
            InputError, match=rf"cfg: {field}: is .*, but the checkpoint's saved arguments \(c\.pt\) say"
        ):
            backbone_from_args(v16, "c.pt", hf=dataclasses.replace(hf, **{field: value}), hf_where="cfg")
