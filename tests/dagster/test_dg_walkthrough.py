"""The README's "Bring your own rollouts" walkthrough, command by command, so it cannot rot: an
actor's Hugging Face folder and text rollouts in; a spec file; `import-rollouts` straight into the
watched folder; `run-manifests` (the real sensor registers the manifest with its spec, the `full`
job trains the actor's critic with the real engine on CPU, evaluates, gates, promotes and exports);
`handoff --instance` prints the RL side's settings from the record the instance pinned.

The actor is a tiny random Llama with SmolLM2's tokenizer (tests/data/smollm2_tokenizer); the
rollouts are synthetic text whose reward the prompt decides (a "blue" question is answered right,
a "green" one wrong), so any critic that reads its prompt is promoted."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# The system tier (make test-system, which CI runs after make test): five CLI processes and a Ray cluster of
# their own, 46 s of the CPU suite's 4-minute budget on 2 cores.
pytestmark = [pytest.mark.system, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "tests" / "data" / "smollm2_tokenizer"


def write_actor(folder: Path) -> None:
    """A tiny random Llama (SmolLM2's vocabulary) with the tokenizer files: an actor folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(str(folder))
    for f in TOKENIZER.iterdir():
        if f.name != "SOURCE.md":
            shutil.copy(f, folder / f.name)


def write_rollouts(path: Path, n: int = 96) -> None:
    lines = []
    for i in range(n):
        colour = ("blue", "green")[i % 2]
        prompt = [{"role": "user", "content": f"Question {i // 4}: is the sky {colour}? Answer yes or no."}]
        lines.append(json.dumps({"prompt": prompt, "response": "yes", "reward": 1.0 if colour == "blue" else 0.0}))
    path.write_text("\n".join(lines) + "\n")


def cli(*args: str, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "value_assets.cli", *args], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=540)  # fmt: skip
    assert out.returncode == 0, f"{args[0]} exited {out.returncode}:\n{out.stderr[-3000:]}"
    return out


def test_rollouts_and_an_actor_to_a_promoted_critic_and_the_rl_settings(tmp_path):
    project = tmp_path / "project"
    (project / "models").mkdir(parents=True)
    actor = project / "models" / "my-actor"
    actor.mkdir()
    write_actor(actor)
    write_rollouts(project / "rollouts.jsonl")
    env = {
        **os.environ,
        "DAGSTER_HOME": str(project / ".dagster_home"),
        "VALUE_ASSETS_MANIFESTS": str(project / "manifests"),
        "VALUE_ASSETS_ARTIFACTS": str(project / "artifacts"),
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    # A plain shell, not the Makefile's or the test session's: no Ray settings (Ray's own defaults:
    # token authentication for the cluster the launcher starts), and a home of its own (Ray keeps
    # its token in ~/.ray).
    for name in ("VALUE_ASSETS_DEFAULT_TRAINING", "RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"):
        env.pop(name, None)
    env["HOME"] = str(tmp_path / "home")

    # 1. The lineage's training spec (README): which actor, how it trains, how it is gated.
    (project / "spec.json").write_text(json.dumps({
        "schema": "value-assets.training.v1", "backbone": {"path": "models/my-actor"},
        "plan": {"global_batch_size": 8, "epochs": 3}, "train": {"lr": 3e-3}, "evaluate": {"num_batches": 2},
        "gate": {"mode": "miles"},
    }))  # fmt: skip
    # 2. Tokenize into the watched folder: datasets under data/, the manifest into manifests/.
    cli("import-rollouts", "rollouts.jsonl", "--tokenizer", "models/my-actor", "--out", "data/my-rollouts",
        "--inbox", "manifests", "--name", "my-rollouts", "--training", "spec.json", "--loss-type", "mse",
        "--heldout-fraction", "0.25", env=env, cwd=project)  # fmt: skip
    manifest = project / "manifests" / "my-rollouts.json"
    assert sorted(p.name for p in (project / "manifests").iterdir()) == ["my-rollouts.json"]
    assert json.loads(manifest.read_text())["train"]["path"] == "../data/my-rollouts/train.jsonl"
    # 3. Train, evaluate, gate and promote once, as the daemon would.
    ran = json.loads(cli("run-manifests", "--json", env=env, cwd=project).stdout)
    (lineage,) = ran
    assert lineage["success"] and lineage["gate"] is True and lineage["promoted"], lineage
    # 4. The RL side's settings, verified against the record the instance pinned.
    handoff = cli("handoff", lineage["registry_record"], "--instance", env=env, cwd=project).stdout
    assert "--critic-load" in handoff and "critic.model.path=" in handoff

    # The critic was trained from the actor the spec named: the contract's model identity is that
    # folder and its digest (the trainer's own), not the tiny random backbone.
    from value_assets.core.contract import load_contract, read_latest
    from value_assets.gpu.convert.bootstrap import resolve_backbone

    step_dir, sha = read_latest(project / "artifacts" / lineage["partition_key"] / "critic")
    contract, _ = load_contract(step_dir, sha)
    assert contract["model"] == resolve_backbone(str(actor.resolve()))[2]
    assert contract["model"]["kind"] == "huggingface" and contract["model"]["path"] == str(actor.resolve())
    # Again: nothing new to run (the partition was run), and the pin stays the same.
    again = json.loads(cli("run-manifests", "--json", env=env, cwd=project).stdout)
    assert again == []
    assert lineage["registry_record_sha256"] in cli("handoff", lineage["registry_record"], "--instance", env=env,
                                                    cwd=project).stdout  # fmt: skip
