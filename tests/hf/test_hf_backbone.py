"""HF checkpoint -> Megatron local-spec GPTModel: same final hidden states, strict tensor accounting.

Tolerance: float32, max |HF - Megatron| over final-norm hidden states < 1e-4 (measured ~2e-6; the
hidden states are O(1..5)).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.hf.hf_checkpoints import FAMILIES, make_hf_checkpoint
from value_assets.core.errors import InputError
from value_assets.gpu.convert.hf import load_hf_backbone_state, megatron_backbone_names, read_hf_config

pytestmark = pytest.mark.unit
ATOL = 1e-4


def hf_hidden(model, ids):
    with torch.no_grad():
        return model.model(ids).last_hidden_state


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hidden_states_match(tmp_path, megatron_single_rank, family):
    from tests.hf.megatron_fixture import build_gpt, final_hidden, load_backbone

    hf = make_hf_checkpoint(tmp_path, family)
    cfg = read_hf_config(tmp_path)
    state = load_hf_backbone_state(tmp_path)
    assert list(state) == megatron_backbone_names(cfg)
    gpt = build_gpt(cfg)
    load_backbone(gpt, state)
    ids = torch.randint(0, cfg["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    diff = (final_hidden(gpt, ids) - hf_hidden(hf, ids)).abs().max().item()
    print(f"{family}: max abs diff {diff:.2e}")
    assert diff < ATOL


def test_tied_embeddings_and_sharded_checkpoint(tmp_path, megatron_single_rank):
    from tests.hf.megatron_fixture import build_gpt, final_hidden, load_backbone

    hf = make_hf_checkpoint(tmp_path, "llama", tie=True, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    cfg = read_hf_config(tmp_path)
    assert cfg["tie_word_embeddings"]
    state = load_hf_backbone_state(tmp_path)
    gpt = build_gpt(cfg)
    load_backbone(gpt, state)
    ids = torch.randint(0, cfg["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(2))
    assert (final_hidden(gpt, ids) - hf_hidden(hf, ids)).abs().max().item() < ATOL


def test_tensor_parallel_shards_tile_the_full_tensors(tmp_path):
    """TP shards: column-parallel rows (qkv per query group, fc1 as [gate_r; up_r]), row-parallel
    columns, vocab rows (padded); norms replicated."""
    make_hf_checkpoint(tmp_path, "qwen2")
    cfg = read_hf_config(tmp_path)
    full = load_hf_backbone_state(tmp_path, padded_vocab_size=130)
    tp = 2
    shards = [load_hf_backbone_state(tmp_path, r, tp, padded_vocab_size=130) for r in range(tp)]
    ffn = cfg["ffn_hidden_size"]
    for name, t in full.items():
        parts = [s[name] for s in shards]
        if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            torch.testing.assert_close(torch.cat(parts, 1), t, rtol=0, atol=0)
        elif name.endswith("linear_fc1.weight"):
            gate = torch.cat([p[: ffn // tp] for p in parts])
            up = torch.cat([p[ffn // tp :] for p in parts])
            torch.testing.assert_close(torch.cat([gate, up]), t, rtol=0, atol=0)
        elif name.endswith(("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight")):
            torch.testing.assert_close(torch.cat(parts), t, rtol=0, atol=0)
            if name.endswith("linear_qkv.bias"):
                # rank 0 holds query group 0 entirely: q heads 0-1, k0, v0 (head dim 16).
                hf_q = load_file(str(tmp_path / "model.safetensors"))
                q = hf_q["model.layers.0.self_attn.q_proj.bias"] if ".0." in name else None
                if q is not None:
                    torch.testing.assert_close(parts[0][:32], q[:32], rtol=0, atol=0)
        else:
            assert all(torch.equal(p, t) for p in parts), name
    assert full["embedding.word_embeddings.weight"].shape[0] == 130
    assert full["embedding.word_embeddings.weight"][128:].abs().sum() == 0


def _rewrite(folder, drop=(), add=None, reshape=None):
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    for name in drop:
        del tensors[name]
    tensors.update(add or {})
    for name, shape in (reshape or {}).items():
        tensors[name] = torch.zeros(shape)
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize(
    "edit, fragment",
    [
        (dict(drop=["model.layers.1.mlp.up_proj.weight"]), "model.layers.1.mlp.up_proj.weight: missing"),
        (dict(add={"model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}), "model.layers.0.self_attn.o_proj.bias"),
        (dict(add={"model.layers.2.input_layernorm.weight": torch.zeros(64)}), "unexpected tensor"),
        (dict(reshape={"model.layers.0.self_attn.k_proj.weight": (64, 64)}), "has shape (64, 64), expected (32, 64)"),
    ],
)
def test_strict_missing_unexpected_and_shape(tmp_path, edit, fragment):
    make_hf_checkpoint(tmp_path, "llama")
    _rewrite(tmp_path, **edit)
    with pytest.raises(InputError) as info:
        load_hf_backbone_state(tmp_path)
    assert fragment in str(info.value)


def test_pickle_checkpoints_are_refused(tmp_path):
    make_hf_checkpoint(tmp_path, "llama")
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(InputError, match="refusing to unpickle"):
        load_hf_backbone_state(tmp_path)


def test_bad_index_shard(tmp_path):
    make_hf_checkpoint(tmp_path, "llama", max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    (tmp_path / first).unlink()
    with pytest.raises(InputError, match=f"names shard '{first}', which does not exist"):
        load_hf_backbone_state(tmp_path)


def test_the_hf_backbone_identity_records_the_actors_tokenizer(tmp_path):
    """The contract's `model` of an HF backbone records the sha of its tokenizer files (export-hf
    carries them, checked against it), or None when the folder has none; the weights' digest does
    not depend on them."""
    import shutil
    from pathlib import Path

    from value_assets.gpu.convert.bootstrap import resolve_backbone
    from value_assets.gpu.convert.tokenizer import tokenizer_sha256

    make_hf_checkpoint(tmp_path, "qwen2")
    _, _, bare = resolve_backbone(str(tmp_path))
    assert bare["kind"] == "huggingface" and bare["tokenizer_sha256"] is None
    data = Path(__file__).resolve().parents[1] / "data" / "smollm2_tokenizer"
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copyfile(data / name, tmp_path / name)
    _, _, ident = resolve_backbone(str(tmp_path))
    assert ident["tokenizer_sha256"] == tokenizer_sha256(data) and ident["sha256"] == bare["sha256"]
