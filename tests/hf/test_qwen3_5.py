"""Qwen3.5 critics: config, the Gated DeltaNet pieces against naive references, and the whole
backbone against transformers' own Qwen3.5 (its torch path) on CPU in float32.

Tolerances: the chunked delta rule and the packed convolution against their per-token references
1e-5 (float32, values of order 1); the critic's final hidden states against transformers'
`Qwen3_5TextModel` 2e-5 absolute (seen: ~6e-7, hidden states of order 1).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tests.hf.hf_checkpoints import QWEN3_5_TEXT, make_qwen3_5_checkpoint
from value_assets.core.errors import InputError
from value_assets.core.objective import Objective
from value_assets.gpu.convert.hf import backbone_config_kwargs, load_hf_backbone_state, read_hf_config

pytestmark = pytest.mark.unit
model_mod = pytest.importorskip("value_assets.gpu.model.gpt_critic")
from value_assets.gpu.model.gated_delta import gated_delta_rule, packed_causal_conv  # noqa: E402

TOL = 2e-5


def _recurrent_delta_rule(q, k, v, g, beta):
    """Token by token: S = e^g S; u = beta (v - S^T k); S += k u^T; o = S^T q (per head)."""
    t_len, heads, dk = k.shape
    state = torch.zeros(heads, dk, v.shape[-1], dtype=torch.float64)
    out = []
    for t in range(t_len):
        state = state * g[t].exp()[:, None, None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", state, k[t]))
        state = state + k[t][:, :, None] * u[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", state, q[t]))
    return torch.stack(out)


@pytest.mark.parametrize("length,chunk", [(1, 64), (5, 4), (64, 64), (130, 64), (37, 16)])
def test_chunked_delta_rule_equals_the_recurrence(length, chunk):
    gen = torch.Generator().manual_seed(length)
    heads, dk, dv = 3, 8, 5
    q = F.normalize(torch.randn(length, heads, dk, generator=gen), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(length, heads, dk, generator=gen), dim=-1)
    v = torch.randn(length, heads, dv, generator=gen)
    g = -torch.rand(length, heads, generator=gen) * 2  # decays down to e^-2 per token
    beta = torch.rand(length, heads, generator=gen)
    got = gated_delta_rule(q, k, v, g, beta, chunk=chunk)
    want = _recurrent_delta_rule(*(x.double() for x in (q, k, v, g, beta)))
    assert got.shape == (length, heads, dv)
    assert (got.double() - want).abs().max().item() < 1e-5


def test_packed_convolution_equals_a_convolution_per_sequence():
    gen = torch.Generator().manual_seed(0)
    lengths, channels, kernel = [7, 1, 2, 12], 6, 4
    x = torch.randn(sum(lengths), channels, generator=gen)
    w = torch.randn(channels, kernel, generator=gen)
    positions = torch.cat([torch.arange(n) for n in lengths])
    got = packed_causal_conv(x, w, positions)
    want, a = [], 0
    for n in lengths:  # zero-padded causal depthwise convolution of each sequence alone
        seq = x[a : a + n].T[None]
        want.append(F.conv1d(seq, w[:, None, :], padding=kernel - 1, groups=channels)[0, :, :n].T)
        a += n
    assert (got - torch.cat(want)).abs().max().item() < 1e-5
    # Read as one sequence, the later rows would see the earlier ones: the positions are what cut them.
    assert (packed_causal_conv(x, w, torch.arange(x.shape[0])) - got).abs().max().item() > 0.1


def _write_config(folder, cfg):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_config_of_an_image_text_and_a_text_checkpoint(tmp_path):
    text = {"model_type": "qwen3_5_text", **QWEN3_5_TEXT}
    a = read_hf_config(_write_config(tmp_path / "a", text))
    b = read_hf_config(_write_config(tmp_path / "b", {"model_type": "qwen3_5", "text_config": text}))
    assert a == b
    assert a["family"] == "qwen3_5" and a["qk_layernorm"] and a["attention_output_gate"]
    assert a["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert a["linear_attention"] == {
        "key_heads": 2,
        "value_heads": 4,
        "key_head_dim": 16,
        "value_head_dim": 8,
        "conv_kernel": 4,
    }
    assert a["rotary_percent"] == 0.25 and a["kv_channels"] == 32 and a["rope_theta"] == 10000.0
    # Keys left out take transformers' Qwen3.5 defaults (a 3:1 pattern from full_attention_interval 4).
    bare = {k: v for k, v in text.items() if k not in ("linear_num_value_heads", "rope_parameters")}
    c = read_hf_config(_write_config(tmp_path / "c", {**bare, "num_hidden_layers": 8}))
    assert c["linear_attention"]["value_heads"] == 32 and c["rotary_percent"] == 0.25
    assert c["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 2


@pytest.mark.parametrize(
    "change,key",
    [
        (
            {"layer_types": ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]},
            "layer_types",
        ),
        ({"layer_types": ["full_attention"] * 3}, "layer_types"),
        ({"attn_output_gate": False}, "attn_output_gate"),
        ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.3}},
            "partial_rotary_factor",
        ),
        ({"linear_key_head_dim": 0}, "linear_key_head_dim"),
    ],
)
def test_config_refusals_name_the_key(tmp_path, change, key):
    folder = _write_config(tmp_path, {"model_type": "qwen3_5", "text_config": {**QWEN3_5_TEXT, **change}})
    with pytest.raises(InputError) as err:
        read_hf_config(folder)
    assert "text_config" in err.value.where and key in err.value.where


class _Hidden(torch.nn.Module):
    """In place of the value head: hand back the final-norm hidden states (float32)."""

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        return hidden.float(), None


def _critic(folder):
    backbone = model_mod.BackboneConfig(**backbone_config_kwargs(read_hf_config(folder)))
    critic = model_mod.build_critic(backbone, Objective(loss_type="mse"), bf16=False).eval()
    result = critic.load_state_dict(load_hf_backbone_state(folder), strict=False)
    assert [k for k in result.missing_keys if not k.endswith("_extra_state")] == [
        "output_layer.weight",
        "output_layer.bias",
    ]
    assert result.unexpected_keys == []
    return backbone, critic


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory, megatron_single_rank):
    folder = tmp_path_factory.mktemp("qwen35")
    hf = make_qwen3_5_checkpoint(folder)
    backbone, critic = _critic(folder)
    critic.output_layer = _Hidden()
    return folder, hf, backbone, critic


def _packed(critic, tokens, lengths):
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        return model_mod.critic_forward(critic, tokens, pos, cu, max(lengths))


def test_backbone_equals_transformers_packed_and_alone(qwen35):
    _, hf, _, critic = qwen35
    lengths = [70, 5, 33]  # one row longer than a delta-rule chunk (64)
    tokens = torch.randint(0, QWEN3_5_TEXT["vocab_size"], (sum(lengths),), generator=torch.Generator().manual_seed(1))
    got = _packed(critic, tokens, lengths)
    with torch.no_grad():
        want = torch.cat([hf(input_ids=row[None]).last_hidden_state[0] for row in tokens.split(lengths)])
    assert got.shape == want.shape == (108, QWEN3_5_TEXT["hidden_size"])
    assert (got - want).abs().max().item() < TOL
    alone = _packed(critic, tokens[:70], [70])  # one row, unpacked by nobody
    assert (alone - want[:70]).abs().max().item() < TOL


def test_backbone_equals_transformers_unpacked_batch(qwen35):
    _, hf, _, critic = qwen35
    tokens = torch.randint(0, QWEN3_5_TEXT["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(40).expand(2, 40)
    with torch.no_grad():
        got = critic(tokens, positions, None)  # [b, s, h], megatron's own RoPE path
        want = hf(input_ids=tokens).last_hidden_state
    assert (got - want).abs().max().item() < TOL


def test_no_state_crosses_packed_rows(qwen35):
    """The convolution and the delta rule restart at each row: changing the first row leaves the
    second row's hidden states as they were, and packing equals running each row alone."""
    _, _, _, critic = qwen35
    gen = torch.Generator().manual_seed(3)
    first, second = torch.randint(0, 300, (50,), generator=gen), torch.randint(0, 300, (20,), generator=gen)
    a = _packed(critic, torch.cat([first, second]), [50, 20])
    b = _packed(critic, torch.cat([torch.randint(0, 300, (50,), generator=gen), second]), [50, 20])
    alone = _packed(critic, second, [20])
    assert (a[:50] - b[:50]).abs().max().item() > 0.1  # the first rows did differ
    assert (a[50:] - b[50:]).abs().max().item() < 1e-5
    assert (a[50:] - alone).abs().max().item() < 1e-5  # float32 matmuls over other row counts
    # The same 70 tokens as one row: the second part now reads the first, as it should.
    joined = _packed(critic, torch.cat([first, second]), [70])
    assert (joined[50:] - a[50:]).abs().max().item() > 0.1


def test_parameter_count_matches_the_shape(qwen35):
    _, _, backbone, critic = qwen35
    backbone_params = sum(p.numel() for n, p in critic.named_parameters())
    h = backbone.hidden_size
    assert backbone_params == backbone.vocab_size * h + backbone.layers_params() + h


def test_image_text_checkpoint_loads_its_text_tower(tmp_path, qwen35, megatron_single_rank):
    folder = tmp_path / "vl"
    text = make_qwen3_5_checkpoint(folder, image_text=True, seed=5)
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    assert any(n.startswith("model.visual.") for n in names)
    assert any(n.startswith("model.language_model.layers.0.linear_attn.") for n in names)
    _, critic = _critic(folder)
    critic.output_layer = _Hidden()
    tokens = torch.randint(0, 300, (30,), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = text(input_ids=tokens[None]).last_hidden_state[0]
    assert (_packed(critic, tokens, [30]) - want).abs().max().item() < TOL


def test_load_refuses_a_missing_or_unexpected_tensor(tmp_path, megatron_single_rank):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "t"
    make_qwen3_5_checkpoint(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({**tensors, "model.layers.0.linear_attn.extra.weight": torch.zeros(2)}, str(folder / "model.safetensors"))
    with pytest.raises(InputError, match="linear_attn.extra.weight"):
        load_hf_backbone_state(folder)
    del tensors["model.layers.2.linear_attn.A_log"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(InputError) as err:
        load_hf_backbone_state(folder)
    assert "model.layers.2.linear_attn.A_log" in err.value.where


@pytest.mark.parametrize("objective", [Objective(loss_type="mse"), Objective(num_bins=5)], ids=["mse", "bins"])
def test_export_loads_in_transformers_and_bootstraps_back(tmp_path, megatron_single_rank, objective):
    """bootstrap -> export -> bootstrap gives the same tensors; transformers'
    AutoModelForTokenClassification reads the export with nothing missing or left over, and its
    logits equal the critic's head outputs (float32, 2e-5)."""
    from transformers import AutoModelForTokenClassification

    from value_assets.gpu.convert.hf import export_critic_to_hf, load_hf_value_head

    src, out = tmp_path / "src", tmp_path / "out"
    make_qwen3_5_checkpoint(src, seed=7)
    backbone = model_mod.BackboneConfig(**backbone_config_kwargs(read_hf_config(src)))
    critic = model_mod.build_critic(backbone, objective, bf16=False, head_seed=3).eval()
    critic.load_state_dict(load_hf_backbone_state(src), strict=False)
    with torch.no_grad():
        critic.output_layer.bias.uniform_(-1, 1)
    export_critic_to_hf(critic.state_dict(), backbone, objective.head_size, out, objective=objective)

    back = {**load_hf_backbone_state(out), **load_hf_value_head(out)}
    mine = {k: v for k, v in critic.state_dict().items() if not k.endswith("_extra_state")}
    assert sorted(back) == sorted(mine)
    assert all(torch.equal(back[k], mine[k]) for k in mine)
    assert read_hf_config(out)["layer_types"] == list(backbone.layer_types)

    hf, info = AutoModelForTokenClassification.from_pretrained(str(out), output_loading_info=True)
    assert type(hf).__name__ == "Qwen3_5ForTokenClassification"
    assert info["missing_keys"] == set() or not info["missing_keys"]
    assert not info["unexpected_keys"]
    tokens = torch.randint(0, 300, (45,), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        want = hf.eval()(input_ids=tokens[None]).logits[0]
        got = _packed(critic, tokens, [45])
    assert got.shape == want.shape == (45, objective.head_size)
    assert (got - want).abs().max().item() < TOL


def test_gradients_equal_transformers(qwen35):
    """Training sees what transformers would: every backbone parameter's gradient of a fixed
    projection of the hidden states equals transformers' (mapped through the name table), 1e-4
    relative to the largest entry (seen ~1e-5)."""
    from value_assets.gpu.convert.hf import _field, _to_local
    from value_assets.gpu.convert.names import dims_of, rows

    folder, hf, _, critic = qwen35
    lengths = [70, 20]
    tokens = torch.randint(0, 300, (90,), generator=torch.Generator().manual_seed(9))
    weights = torch.randn(90, QWEN3_5_TEXT["hidden_size"], generator=torch.Generator().manual_seed(10))
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, 70, 90], dtype=torch.int32)
    mine = dict(critic.named_parameters())
    ours = (model_mod.critic_forward(critic, tokens, pos, cu, 70) * weights).sum()
    g_ours = dict(zip(mine, torch.autograd.grad(ours, list(mine.values())), strict=True))
    theirs_params = dict(hf.named_parameters())
    hidden = torch.cat([hf(input_ids=row[None]).last_hidden_state[0] for row in tokens.split(lengths)])
    g_hf = dict(
        zip(theirs_params, torch.autograd.grad((hidden * weights).sum(), list(theirs_params.values())), strict=True)
    )
    d = dims_of(_field, read_hf_config(folder))
    checked = 0
    for local, hf_names, rule, _ in rows(d):
        want = _to_local(rule, [g_hf[n] for n in hf_names], d)
        scale = want.abs().max().item()
        assert scale > 0, local
        assert (g_ours[local] - want).abs().max().item() < 1e-4 * scale, local
        checked += 1
    assert checked == len(mine)  # every parameter of the backbone (the head is replaced here)


def test_a_deltanet_tensor_of_the_wrong_shape_is_refused_by_name(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "t"
    make_qwen3_5_checkpoint(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.1.linear_attn.conv1d.weight"
    tensors[name] = tensors[name][:, :, :3].contiguous()  # a kernel of 3 where config.json says 4
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(InputError, match=r"has shape \(96, 1, 3\), expected \(96, 1, 4\)") as err:
        load_hf_backbone_state(folder)
    assert name in err.value.where


def test_memory_model_counts_what_a_deltanet_layer_keeps_for_backward(qwen35, monkeypatch):
    """core.memory's Gated DeltaNet count, less the share fla's kernel keeps, equals the bytes
    autograd really keeps for one bf16 DeltaNet layer outside the delta rule (saved-tensor hooks,
    each storage counted once, parameters and the layer's input left out) within 2 %. On CPU the
    torch delta rule runs in the kernel's place: what it keeps is counted apart and left out."""
    from value_assets.core import memory
    from value_assets.gpu.model import gated_delta

    _, _, backbone, _ = qwen35
    critic = model_mod.build_critic(backbone, Objective(loss_type="mse"), bf16=True)
    layer = critic.decoder.layers[backbone.layer_types.index("linear_attention")].self_attention
    params = {p.untyped_storage().data_ptr() for p in critic.parameters()}
    kept: dict[int, int] = {}
    in_rule: set[int] = set()
    rule = gated_delta.gated_delta_rule

    def counted_rule(*args, **kwargs):
        def note(t):
            in_rule.add(t.untyped_storage().data_ptr())
            return t

        with torch.autograd.graph.saved_tensors_hooks(note, lambda t: t):
            return rule(*args, **kwargs)

    def keep(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    monkeypatch.setattr(gated_delta, "gated_delta_rule", counted_rule)
    tokens = 640
    x = torch.randn(tokens, 1, backbone.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        layer(x)
    left_out = params | in_rule | {x.untyped_storage().data_ptr()}
    measured = sum(n for ptr, n in kept.items() if ptr not in left_out) / 2 / tokens  # bf16 elements per token
    la = backbone.linear_attention
    predicted = memory.delta_net_elements(la, 1) - memory.delta_net_kernel_elements(la, 1)
    assert measured == pytest.approx(predicted, rel=0.02)


@pytest.mark.parametrize(
    "capability, triton_version, tilelang, refused",
    [
        ((9, 0), "3.6.0", False, True),  # the H100/H200 image of 2026-12-06: torch 2.11's pin
        ((9, 0), "3.4.0", False, True),
        ((9, 0), "3.7.0+git1234", False, True),
        ((9, 0), "3.7.1", False, False),
        ((9, 0), "3.8", False, False),
        ((9, 0), "3.3.1", False, False),
        ((9, 0), "3.6.0", True, False),  # tilelang takes the kernel
        ((8, 0), "3.6.0", False, False),  # A100: not affected
        ((10, 0), "3.6.0", False, False),  # Blackwell: not affected
    ],
)
def test_fla_gated_backward_refused_where_fla_refuses_it(capability, triton_version, tilelang, refused):
    """fla 0.6.0's own condition (fla/ops/common/chunk_o.py, chunk_bwd_dqkwg), asked before the first
    training forward so the error names the versions and the fix instead of a kernel trace."""
    from value_assets.gpu.model.gated_delta import fla_backward_problem

    problem = fla_backward_problem(capability, triton_version, tilelang)
    assert (problem is not None) == refused
    if refused:
        assert triton_version in problem and "3.7.1" in problem and "tilelang" in problem
