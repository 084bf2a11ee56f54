"""The product's side of the RL tier (`make test-rl`; tests/rl/harness.py says where the trainers'
code comes from). For a tiny Qwen2 and a tiny Llama actor (a Hugging Face folder with a tokenizer):

* two mse critics trained by the product's own job on the session's Ray, one with its head's bias
  trained (`critic-trained`), one with `--head-bias zero` (`critic-zero`);
* every export the RL side reads, through the command line: `export-hf --format scalar` (verl),
  `--format openrlhf`, `export-miles` at both layer specs;
* the job of the Megatron-LM side (tests/rl/megatron_lm_side.py): the actors' weights and shapes,
  the bundles' paths and token sequences;
* the product's own values of token sequences, the reference every trainer is compared with.

The fixtures that build these once per session are in tests/rl/conftest.py.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from tests.hf.hf_checkpoints import make_hf_checkpoint
from tests.rl import harness

FAMILIES = ("qwen2", "llama")
VOCAB = 128  # tests/hf/hf_checkpoints.py TINY


def save_tokenizer(folder: Path) -> None:
    """A word-level tokenizer over the tiny vocabulary (t3 .. t127; <pad> 0, <s> 1, </s> 2)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(folder))


def write_manifest(root: Path, seed: int = 0) -> Path:
    """An mse manifest of random rows over the tiny vocabulary (16 train rows: 2 steps of 8)."""
    rng = np.random.default_rng(seed)
    splits = {}
    (root / "data").mkdir(parents=True)
    for split, n in (("train", 16), ("heldout", 8)):
        lines = []
        for i in range(n):
            plen, rlen = int(rng.integers(3, 8)), int(rng.integers(3, 10))
            r = float(rng.random())
            row = {
                "sample_id": f"{split}-{i}",
                "tokens": rng.integers(3, VOCAB, plen + rlen).tolist(),
                "response_length": rlen,
                "returns": [r] * rlen,
            }
            lines.append(json.dumps(row))
        p = root / "data" / f"{split}.jsonl"
        p.write_text("\n".join(lines) + "\n")
        sha = hashlib.sha256(p.read_bytes()).hexdigest()
        splits[split] = {"path": f"data/{split}.jsonl", "sha256": sha, "num_samples": n}
    objective = {"loss_type": "mse", "num_bins": 51, "reward_range": [0.0, 1.0], "target_type": "hl_gauss"}
    manifest = root / "manifest.json"
    manifest.write_text(json.dumps({"schema": "miles.value-pretrain.v1", **splits, "objective": objective}))
    return manifest


def cli(*argv: str) -> None:
    from value_assets.cli import main

    assert main(list(argv)) == 0, argv


TRAIN_FLAGS = ("--gpus", "1", "--global-batch-size", "8", "--lr", "1e-2", "--seed", "0")


def train_critic(manifest: Path, output: Path, backbone: Path, *flags: str) -> Path:
    """`value-assets train` (the product's command line), the tier's settings."""
    cli("train", str(manifest), "--backbone", str(backbone), "--output", str(output), *TRAIN_FLAGS, *flags)
    return output


def make_actor(root: Path, family: str) -> dict[str, Path]:
    """A tiny HF actor with a tokenizer, and an mse manifest over its vocabulary."""
    actor = root / "actor"
    make_hf_checkpoint(actor, family)
    save_tokenizer(actor)
    return {"root": root, "actor": actor, "manifest": write_manifest(root)}


def train_and_export(family: str, paths: dict[str, Path]) -> None:
    """The family's critics (head bias trained / zero) and every export of them, into `paths`."""
    root, actor, manifest = paths["root"], paths["actor"], paths["manifest"]
    for bias in ("trained", "zero"):
        paths[f"critic-{bias}"] = train_critic(manifest, root / f"critic-{bias}", actor, "--head-bias", bias)
    cli("export-hf", "--checkpoint", str(paths["critic-trained"]), "--out", str(paths["scalar"]), "--format", "scalar")
    cli("export-hf", "--checkpoint", str(paths["critic-zero"]), "--out", str(paths["openrlhf"]), "--format", "openrlhf")
    for spec in ("te", "local"):
        miles = ("--out", str(paths[f"miles-{spec}"]), "--model-identity", f"tiny-{family}", "--layer-spec", spec)
        cli("export-miles", "--checkpoint", str(paths["critic-trained"]), *miles)


def rollouts(seed: int = 5) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts and responses of different lengths (padded on both sides in the trainers' batches)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (4, 7, 2)]
    responses = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 3, 8)]
    return prompts, responses


def megatron_lm_job(root: Path, critics: dict[str, dict[str, Path]]) -> Path:
    """JOB.json of tests/rl/megatron_lm_side.py: plain inputs only (it imports nothing of the
    product). Sets the paths of every export in `critics`; the side process waits for the bundles
    until `bundles_ready` exists."""
    from safetensors import safe_open

    from value_assets.gpu.convert import names
    from value_assets.gpu.convert.hf import load_hf_backbone_state, read_hf_config

    prompts, responses = rollouts()
    families = {}
    for family, paths in critics.items():
        for name in ("scalar", "openrlhf", "miles-te", "miles-local"):
            paths[name] = paths["root"] / name
        cfg = read_hf_config(paths["actor"])
        # The actor's weights under megatron-core's names (the product's HF mapping), its LM head too.
        state = load_hf_backbone_state(paths["actor"])
        with safe_open(str(paths["actor"] / "model.safetensors"), "pt") as f:
            state["output_layer.weight"] = f.get_tensor("lm_head.weight")
        torch.save(state, root / f"{family}-actor-state.pt")
        families[family] = {
            "config": {k: cfg[k] for k in harness.ARCH_KEYS},
            "miles": {spec: str(paths[f"miles-{spec}"]) for spec in ("te", "local")},
            "seqs": [p + r for p, r in zip(prompts, responses, strict=True)],
            "actor_state": str(root / f"{family}-actor-state.pt"),
            "actor_out": str(root / f"{family}-megatron-lm-actor"),
        }
    job = root / "megatron-lm-job.json"
    spec = {
        "families": families,
        "te_modules": list(names.EXTRA_STATE["te"]),
        "bundles_ready": str(root / "bundles-ready"),
        "result": str(root / "result.json"),
    }
    job.write_text(json.dumps(spec))
    return job


def product_values(critic: Path, seqs: list[list[int]]) -> list[torch.Tensor]:
    """The product's own values (its engine, its contracted checkpoint) of each token sequence."""
    from value_assets.core.objective import Objective
    from value_assets.gpu.convert.export import contracted_step
    from value_assets.gpu.model.gpt_critic import BackboneConfig, build_critic, critic_forward
    from value_assets.gpu.model.losses import predicted_values
    from value_assets.gpu.runtime.checkpoint import load_model_weights
    from value_assets.gpu.runtime.parallel import destroy, init_distributed

    step, contract, _ = contracted_step(Path(critic))
    cfg = BackboneConfig.from_json(contract["backbone_config"])
    objective = Objective.from_json(contract["objective"])
    init_distributed(0, 1, "127.0.0.1", 0, backend="gloo")
    try:
        model = build_critic(cfg, objective, bf16=False).eval()
        load_model_weights(step, model, contract=contract)
        tokens = torch.tensor([t for s in seqs for t in s])
        positions = torch.cat([torch.arange(len(s)) for s in seqs])
        cu = torch.tensor([0, *np.cumsum([len(s) for s in seqs]).tolist()], dtype=torch.int32)
        with torch.no_grad():
            values = predicted_values(critic_forward(model, tokens, positions, cu, max(map(len, seqs))), objective)
    finally:
        destroy()
    return list(values.split([len(s) for s in seqs]))


def response_values(critic: Path, prompts, responses) -> list[torch.Tensor]:
    """The product's value of response token j of each rollout: its value at absolute position
    prompt_len + j - 1 (value_head.json `read_position`)."""
    full = product_values(critic, [p + r for p, r in zip(prompts, responses, strict=True)])
    return [v[len(p) - 1 : len(p) + len(r) - 1] for v, p, r in zip(full, prompts, responses, strict=True)]
