"""`export-miles` and `export-hf --format scalar|openrlhf` from a contracted critic checkpoint.

The Miles contract is checked with a reader built from Miles' published rules (`core.miles`), the
key set against the layer spec's names, and the round trip export -> bootstrap reader -> values
identical to the engine's. HF scalar/OpenRLHF values: float32, max abs diff < 1e-4 (as test_hf_export).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from value_assets.core.checkpoint_files import describe_folder
from value_assets.core.errors import InputError
from value_assets.core.objective import Objective

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
ATOL = 1e-4
STEPS = 2


def _contracted(
    root: Path,
    objective: Objective,
    ids: torch.Tensor | None = None,
    *,
    head_bias: str = "trained",
    model: dict | None = None,
    cfg=None,
    backbone_state: dict | None = None,
):
    """A critic folder with one contracted step (as the train job publishes it); returns the
    engine's values for `ids` and its whole state. `head_bias` 'zero': the head's bias stays 0 (as
    `--head-bias zero` trains it); `model`: the contract's backbone identity; `cfg` (default: a tiny
    Qwen2) and `backbone_state` (loaded over the initialisation) another backbone."""
    from value_assets.core.contract import build_contract, iter_dirname, write_contract
    from value_assets.core.plan import build_plan
    from value_assets.gpu.model.gpt_critic import BackboneConfig, build_critic, critic_forward, init_layout_invariant
    from value_assets.gpu.runtime.checkpoint import save_critic
    from value_assets.gpu.runtime.parallel import destroy, init_distributed

    cfg = cfg or BackboneConfig.tiny(family="qwen2", vocab_size=256, max_seq_len=64)
    step = root / iter_dirname(STEPS)
    step.mkdir(parents=True)
    init_distributed(0, 1, "127.0.0.1", 0)
    try:
        critic = build_critic(cfg, objective, bf16=False).eval()
        init_layout_invariant(critic, 0)
        if backbone_state is not None:
            critic.load_state_dict(backbone_state, strict=False)
        if head_bias == "trained":
            with torch.no_grad():  # a dropped bias would show
                critic.output_layer.bias.copy_(torch.linspace(-0.3, 0.4, objective.head_size))
        values = None
        if ids is not None:
            with torch.no_grad():
                values = critic_forward(
                    critic,
                    ids,
                    torch.arange(ids.numel()),
                    torch.tensor([0, ids.numel()], dtype=torch.int32),
                    ids.numel(),
                )
        state = {k: v.detach().clone() for k, v in critic.state_dict().items() if torch.is_tensor(v)}
        save_critic(step, critic, iteration=STEPS)
    finally:
        destroy()
    contract = build_contract(
        manifest_sha256="a" * 64,
        train_sha256="b" * 64,
        objective=objective.canonical(),
        plan=build_plan(8, 4, 1, 0),
        completed_steps=STEPS,
        model=model or {"kind": "tiny-random", "seed": 0},
        backbone_config=cfg.to_json(),
        checkpoint=str(step),
        checkpoint_files=describe_folder(step),
    )
    write_contract(root, contract)
    return cfg, values, state


@pytest.fixture(scope="module")
def mse_critic(tmp_path_factory):
    root = tmp_path_factory.mktemp("critic")
    ids = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(2))
    cfg, values, state = _contracted(root, Objective(loss_type="mse", reward_range=(-1.0, 1.0)), ids)
    return root, cfg, ids, values, state


@pytest.mark.parametrize("spec", ["te", "local"])
def test_export_miles_contract_and_round_trip(tmp_path, mse_critic, spec, capsys):
    from value_assets.core.miles import MILES_KEYS, read_miles_contract
    from value_assets.core.strict_json import canonical_bytes
    from value_assets.gpu.commands import cmd_export_miles
    from value_assets.gpu.convert import megatron_lm

    root, cfg, ids, values, state = mse_critic
    out = tmp_path / "miles"
    assert (
        cmd_export_miles(
            SimpleNamespace(checkpoint=str(root), out=str(out), model_identity="tiny-critic@test", layer_spec=spec)
        )
        == 0
    )
    printed = json.loads(capsys.readouterr().out)
    contract, sha = read_miles_contract(out, printed["contract_sha256"])  # Miles' rules, sha pinned
    raw = (out / "value_pretrain_contract.json").read_bytes()
    assert raw == canonical_bytes(contract) and sorted(contract) == sorted(MILES_KEYS)
    assert contract == {
        "schema": "miles.value-pretrain-checkpoint.v1",
        "source_manifest_sha256": "a" * 64,
        "train_dataset_sha256": "b" * 64,
        "objective": {
            "loss_type": "mse",
            "num_bins": 51,
            "reward_range": [-1.0, 1.0],
            "target_type": "hl_gauss",
            "hl_gauss_sigma_ratio": 0.75,
        },
        "batch_plan": {"seed": 0, "global_batch_size": 4, "drop_incomplete_batch": True},
        "completed_steps": STEPS,
        "model_identity": "tiny-critic@test",
    }
    assert (out / "latest_checkpointed_iteration.txt").read_text().strip() == str(STEPS)
    step = out / f"iter_{STEPS:07d}"
    assert set(megatron_lm.tensor_shapes(step)) == set(megatron_lm.checkpoint_names(cfg)) | set(megatron_lm.HEAD)
    assert megatron_lm.tensor_shapes(step)["output_layer.weight"] == (1, cfg.hidden_size)
    assert megatron_lm.tensor_shapes(step)["embedding.word_embeddings.weight"][0] % 128 == 0
    common = megatron_lm.saved_args(step)
    assert (
        common["tensor_model_parallel_size"] == 1
        and common["no_save_optim"]
        and common["untie_embeddings_and_output_weights"]
    )
    # Round trip: the bootstrap reader gives back every tensor exactly.
    got_cfg, got_step, it, got_spec = megatron_lm.resolve(out)
    assert (got_cfg, got_step, it, got_spec) == (cfg, step, STEPS, spec)
    back = megatron_lm.load_backbone_state(step, got_cfg)
    back.update(megatron_lm.load_head(step))
    assert back.keys() == state.keys()
    for k in state:
        assert torch.equal(back[k], state[k].float()), k
    # ... and a critic bootstrapped from the export (head copied in) gives the engine's values.
    from value_assets.gpu.convert.bootstrap import load_backbone_into, resolve_backbone
    from value_assets.gpu.model.gpt_critic import build_critic, critic_forward
    from value_assets.gpu.runtime.parallel import destroy, init_distributed

    boot_cfg, source, ident = resolve_backbone(str(out))
    assert boot_cfg == cfg and ident["layer_spec"] == spec
    init_distributed(0, 1, "127.0.0.1", 0)
    try:
        model = build_critic(boot_cfg, Objective(loss_type="mse"), bf16=False).eval()
        load_backbone_into(model, source, tp=1)
        model.load_state_dict(megatron_lm.load_head(step), strict=False)
        with torch.no_grad():
            got = critic_forward(
                model, ids, torch.arange(ids.numel()), torch.tensor([0, ids.numel()], dtype=torch.int32), ids.numel()
            )
    finally:
        destroy()
    assert torch.equal(got, values)


def test_export_miles_refuses_a_contract_that_does_not_verify(tmp_path, mse_critic):
    from value_assets.gpu.convert.export import export_miles

    root = tmp_path / "critic"
    shutil.copytree(mse_critic[0], root)
    p = root / f"iter_{STEPS:07d}" / "value_pretrain_contract.json"
    p.write_bytes(p.read_bytes().replace(b'"seed":0', b'"seed":1'))
    with pytest.raises(InputError, match="was pinned"):
        export_miles(root, tmp_path / "out", "x")
    assert not (tmp_path / "out").exists()


def test_scalar_export_loads_in_transformers(tmp_path, mse_critic):
    from transformers import AutoModelForTokenClassification

    from value_assets.gpu.convert.export import export_checkpoint

    root, _, ids, values, _ = mse_critic
    out = export_checkpoint(root, tmp_path / "scalar", "scalar")
    hf = AutoModelForTokenClassification.from_pretrained(str(out)).eval()
    assert hf.config.num_labels == 1
    with torch.no_grad():
        got = hf(input_ids=ids[None]).logits[0, :, 0]
    assert (got - values[:, 0]).abs().max().item() < ATOL


def test_openrlhf_export_reproduces_values(tmp_path, mse_critic):
    """OpenRLHF's critic: base model + `score` Linear(hidden, 1, bias=False), nothing else under its
    default flags. A critic trained with --head-bias zero exports exactly; one whose bias is not 0 is
    refused before anything is written (OpenRLHF's own loader: tests/rl/test_openrlhf.py)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModel

    from value_assets.gpu.convert.export import export_checkpoint

    root, _, ids, _, _ = mse_critic
    with pytest.raises(InputError, match=r"the critic's value head has bias \[-0\.3.*--head-bias zero") as err:
        export_checkpoint(root, tmp_path / "refused", "openrlhf")
    assert err.value.where == "--format openrlhf" and not (tmp_path / "refused").exists()
    _, values, _ = _contracted(
        tmp_path / "zero", Objective(loss_type="mse", reward_range=(-1.0, 1.0)), ids, head_bias="zero"
    )
    out = export_checkpoint(tmp_path / "zero", tmp_path / "orlhf", "openrlhf")
    config = AutoConfig.from_pretrained(str(out))
    weights = load_file(str(out / "model.safetensors"))
    assert "score.bias" not in weights and tuple(weights["score.weight"].shape) == (1, config.hidden_size)
    # OpenRLHF prefers config.json's prefix; nothing for its normalisation, which cannot carry a bias
    assert config.value_head_prefix == "score" and not hasattr(config, "mean") and not hasattr(config, "std")
    base = AutoModel.from_pretrained(str(out)).eval()
    with torch.no_grad():
        got = base(input_ids=ids[None]).last_hidden_state[0] @ weights["score.weight"][0]
    assert (got - values[:, 0]).abs().max().item() < ATOL


def test_scalar_export_refuses_a_classification_critic(tmp_path):
    from value_assets.core.contract import build_contract, iter_dirname, write_contract
    from value_assets.core.plan import build_plan
    from value_assets.gpu.convert.export import export_checkpoint
    from value_assets.gpu.model.gpt_critic import BackboneConfig

    save = tmp_path / iter_dirname(STEPS)
    save.mkdir()
    (save / "common.pt").write_bytes(b"never read: the objective is refused first")
    write_contract(
        tmp_path,
        build_contract(
            checkpoint_files=describe_folder(save),
            manifest_sha256="a" * 64,
            train_sha256="b" * 64,
            objective=Objective(num_bins=51).canonical(),
            plan=build_plan(8, 4, 1, 0),
            completed_steps=STEPS,
            model={"kind": "tiny-random"},
            backbone_config=BackboneConfig.tiny().to_json(),
            checkpoint=save.name,
        ),
    )
    for fmt in ("scalar", "openrlhf"):
        with pytest.raises(InputError, match="not linear in the hidden state"):
            export_checkpoint(tmp_path, tmp_path / "out", fmt)


def test_the_hf_exports_carry_the_actors_tokenizer(tmp_path, mse_critic, capsys):
    """verl reads the tokenizer from critic.model.path: every HF export carries the files of the
    Hugging Face backbone the contract names, if they still hash to the sha recorded at training (or
    of --tokenizer); with none known the export says so by name (and value_head.json records null).
    verl's own loader on such a folder: tests/rl/test_verl.py."""
    from value_assets.gpu.convert.export import export_checkpoint
    from value_assets.gpu.convert.tokenizer import tokenizer_sha256

    actor = tmp_path / "actor"
    actor.mkdir()
    (actor / "tokenizer.json").write_text('{"version": "1.0"}')
    (actor / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    sha = tokenizer_sha256(actor)
    root = tmp_path / "critic"
    identity = {"kind": "huggingface", "path": str(actor), "sha256": "c" * 64, "tokenizer_sha256": sha}
    _contracted(root, Objective(loss_type="mse"), head_bias="zero", model=identity)
    for fmt in ("scalar", "openrlhf", "token-classification"):
        out = export_checkpoint(root, tmp_path / fmt, fmt)
        assert tokenizer_sha256(out) == sha
        assert (out / "tokenizer.json").read_bytes() == (actor / "tokenizer.json").read_bytes()
        assert json.loads((out / "value_head.json").read_text())["tokenizer"] == {
            "files": ["tokenizer.json", "tokenizer_config.json"],
            "sha256": sha,
        }
    # the actor folder's tokenizer changed since training: refused before anything is written
    (actor / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}')
    with pytest.raises(InputError, match=rf"holds tokenizer files with sha256 .*; the critic was trained with {sha}"):
        export_checkpoint(root, tmp_path / "changed", "scalar")
    assert not (tmp_path / "changed").exists()
    with pytest.raises(InputError, match="the critic was trained with"):
        export_checkpoint(root, tmp_path / "changed", "scalar", tokenizer=actor)
    # no tokenizer known (the tiny backbone): exported, and said by name
    capsys.readouterr()
    export_checkpoint(mse_critic[0], tmp_path / "bare", "scalar")
    err = capsys.readouterr().err
    assert "no tokenizer known for this critic" in err and "critic.model.tokenizer_path" in err
    assert json.loads((tmp_path / "bare" / "value_head.json").read_text())["tokenizer"] is None
    # --tokenizer names one (nothing was recorded to check it against)
    out = export_checkpoint(mse_critic[0], tmp_path / "given", "scalar", tokenizer=actor)
    assert tokenizer_sha256(out) == tokenizer_sha256(actor)


@pytest.fixture(scope="module")
def qwen3_5_critic(tmp_path_factory):
    """A contracted Qwen3.5 critic (layers: DeltaNet, DeltaNet, DeltaNet, attention) whose every
    backbone tensor is random (tests/hf/hf_checkpoints.py), so a misplaced tensor shows."""
    from tests.hf.hf_checkpoints import make_qwen3_5_checkpoint
    from value_assets.gpu.convert.hf import backbone_config_kwargs, load_hf_backbone_state, read_hf_config
    from value_assets.gpu.model.gpt_critic import BackboneConfig

    actor, root = tmp_path_factory.mktemp("q35-actor"), tmp_path_factory.mktemp("q35-critic")
    make_qwen3_5_checkpoint(actor, seed=5)
    cfg = BackboneConfig(**backbone_config_kwargs(read_hf_config(actor)))
    objective = Objective(loss_type="mse", reward_range=(-1.0, 1.0))
    _, _, state = _contracted(root, objective, cfg=cfg, backbone_state=load_hf_backbone_state(actor))
    return root, cfg, state


def test_export_miles_writes_a_qwen3_5_critic_in_miles_names(tmp_path, qwen3_5_critic):
    """A Qwen3.5 bundle under the names of Miles' own Qwen3.5 model (`names.miles_qwen3_5_rows`,
    read from radixark/miles 31f1ca96 `miles_plugins/models/qwen3_5.py`): layers numbered; in a
    linear-attention layer `self_attention.input_layernorm.weight` and
    `self_attention.linear_attn.<HF name>` holding exactly the tensors `export-hf` writes under the
    HF names (Miles' mbridge copies them unchanged); attention and MLP under TE's names with the
    local tensors (the gated qkv layout is shared); the head and TE `_extra_state` objects;
    the arguments Miles' scripts pass. What this does not show: that Miles' model loads it (no
    Transformer Engine here; tests/rl checks Miles' own linear-attention module)."""
    from safetensors.torch import load_file

    from value_assets.gpu.convert import megatron_lm, names
    from value_assets.gpu.convert.export import export_checkpoint, export_miles
    from value_assets.gpu.runtime.safe_pickle import load_dcp_metadata

    root, cfg, state = qwen3_5_critic
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    out, hf_out = tmp_path / "miles", tmp_path / "hf"
    export_miles(root, out, "q35@test")
    export_checkpoint(root, hf_out)
    step = out / f"iter_{STEPS:07d}"
    shapes = megatron_lm.tensor_shapes(step)
    want = megatron_lm.miles_qwen3_5_shapes(cfg)
    assert shapes == {**want, "output_layer.weight": (1, cfg.hidden_size), "output_layer.bias": (1,)}
    gdn = "decoder.layers.0.self_attention."
    assert sorted(k[len(gdn) :] for k in shapes if k.startswith(gdn)) == [
        "input_layernorm.weight",
        "linear_attn.A_log",
        "linear_attn.conv1d.weight",
        "linear_attn.dt_bias",
        "linear_attn.in_proj_a.weight",
        "linear_attn.in_proj_b.weight",
        "linear_attn.in_proj_qkv.weight",
        "linear_attn.in_proj_z.weight",
        "linear_attn.norm.weight",
        "linear_attn.out_proj.weight",
    ]
    full = "decoder.layers.3."
    assert sorted(k[len(full) :] for k in shapes if k.startswith(full)) == [
        "mlp.linear_fc1.layer_norm_weight",
        "mlp.linear_fc1.weight",
        "mlp.linear_fc2.weight",
        "self_attention.k_layernorm.weight",
        "self_attention.linear_proj.weight",
        "self_attention.linear_qkv.layer_norm_weight",
        "self_attention.linear_qkv.weight",
        "self_attention.q_layernorm.weight",
    ]
    assert shapes[full + "self_attention.linear_qkv.weight"] == ((2 * 4 + 2 * 2) * 32, 64)  # q, gate, k, v
    objects = {k.split("/")[0] for k, v in load_dcp_metadata(step / ".metadata").state_dict_metadata.items()}
    # megatron-core 0.19 also keeps the common state (arguments, iteration) as an object of the
    # checkpoint itself ("common_state"); 0.16 writes it to common.pt.
    objects -= set(shapes) | {"common_state"}
    assert objects == {
        f"decoder.layers.{i}.{m}._extra_state"
        for i, kind in enumerate(cfg.layer_types)
        for m in names.MILES_QWEN3_5_EXTRA_STATE[kind]
    }
    # The tensors: Miles' linear-attention names hold the HF tensors, the rest the local ones.
    got = megatron_lm._read(step, list(shapes))
    hf = load_file(str(hf_out / "model.safetensors"))
    for i in range(3):
        for k in (n for n in shapes if n.startswith(f"decoder.layers.{i}.self_attention.")):
            rest = k[len(f"decoder.layers.{i}.self_attention.") :]
            assert torch.equal(got[k], hf[f"model.language_model.layers.{i}.{rest}"].float()), k
    for k in (n for n in shapes if not n.startswith(("decoder.layers.0.", "decoder.layers.1.", "decoder.layers.2."))):
        local = {
            "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
            "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
        }
        name = k
        for te, loc in local.items():
            name = name.replace(te, loc)
        t = state[name].float()
        if k == "embedding.word_embeddings.weight":
            assert torch.equal(got[k][: cfg.vocab_size], t) and not got[k][cfg.vocab_size :].any()
        else:
            assert torch.equal(got[k], t), k
    for i in range(3):  # the GDN layers' MLP norm too
        k = f"decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight"
        assert torch.equal(got[k], state[f"decoder.layers.{i}.pre_mlp_layernorm.weight"].float())
    args = megatron_lm.saved_args(step)
    assert args["spec"] == ["miles_plugins.models.qwen3_5", "get_qwen3_5_spec"]
    assert args["apply_layernorm_1p"] and args["layernorm_zero_centered_gamma"] and args["attention_output_gate"]
    assert args["rotary_percent"] == 0.25 and args["transformer_impl"] == "transformer_engine"
    assert args["qk_layernorm"] and args["kv_channels"] == 32


def test_export_miles_refuses_a_qwen3_5_critic_with_the_local_spec(tmp_path, qwen3_5_critic):
    """Miles builds Qwen3.5 only with Transformer Engine: `--layer-spec local` is refused by name,
    nothing written."""
    from value_assets.gpu.convert.export import export_miles

    out = tmp_path / "miles"
    with pytest.raises(InputError, match=r"--layer-spec: 'local': Miles builds a Qwen3.5 model only"):
        export_miles(qwen3_5_critic[0], out, "q35@test", layer_spec="local")
    assert not out.exists() and not list(tmp_path.iterdir())
