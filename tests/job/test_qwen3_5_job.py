"""A Qwen3.5 critic through the commands a user runs: `value-assets train MANIFEST --backbone
QWEN35_HF_DIR` on local Ray (two CPU workers), `evaluate` and its gate, `export-hf`; `export-miles`
writes it in the names of Miles' own Qwen3.5 model and refuses `--layer-spec local` by name (Miles
builds Qwen3.5 with Transformer Engine only), and a manifest whose token ids the actor's vocabulary
does not have is refused.

The actor is a tiny random Qwen3.5 (transformers' own initialisation) with layers alternating Gated
DeltaNet and gated full attention. Bar fixed before the run: trajectory EV > 0.2 on the demo data's
held-out split (the generator's optimum is ~0.43; measured: 0.36). With the real 3:1 pattern (three
DeltaNet layers before the only attention layer) this random actor learned nothing in 32 steps
(EV ~0), while its gradients equal transformers' (tests/hf/test_qwen3_5.py): a property of the random
actor, recorded here so the layer pattern of the fixture is not mistaken for an accident.

In the system tier (~40 s: two trainings' Ray start-ups and an evaluation).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hf.hf_checkpoints import make_qwen3_5_checkpoint
from value_assets.core.demo_data import make_demo_data

pytestmark = [pytest.mark.system, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
ALTERNATING = ["linear_attention", "full_attention"] * 2
EV_BAR = 0.2


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "value_assets.cli", *args], capture_output=True, text=True, env=env, cwd=ROOT
    )


def test_qwen3_5_critic_trains_evaluates_and_exports(tmp_path):
    actor, critic = tmp_path / "actor", tmp_path / "critic"
    make_qwen3_5_checkpoint(actor, redraw=False, vocab_size=49152, layer_types=ALTERNATING)
    manifest = make_demo_data(tmp_path / "data", rows=1024, seed=0)
    args = ["--global-batch-size", "32", "--epochs", "1", "--lr", "2e-3", "--gpus", "2", "--seed", "0"]
    run = cli("train", str(manifest), "--output", str(critic), "--backbone", str(actor), *args)
    assert run.returncode == 0, run.stderr[-2000:]
    latest = json.loads((critic / "latest").read_text())
    ev = cli(
        "evaluate",
        "--checkpoint",
        str(critic),
        "--manifest",
        str(manifest),
        "--contract-sha256",
        latest["contract_sha256"],
        "--report",
        str(tmp_path / "ev.json"),
        "--gpus",
        "2",
    )
    assert ev.returncode == 0, ev.stderr[-2000:]
    report = json.loads((tmp_path / "ev.json").read_text())
    assert report["passed"] is True
    assert report["aggregates"]["trajectory"]["ev"] > EV_BAR

    out = tmp_path / "hf"
    exported = cli("export-hf", "--checkpoint", str(critic), "--out", str(out))
    assert exported.returncode == 0, exported.stderr[-2000:]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForTokenClassification"]
    assert config["text_config"]["layer_types"] == ALTERNATING

    miles = tmp_path / "miles"
    refused = cli(
        "export-miles",
        "--checkpoint",
        str(critic),
        "--out",
        str(miles),
        "--model-identity",
        "q",
        "--layer-spec",
        "local",
    )
    assert refused.returncode == 2
    assert "--layer-spec" in refused.stderr and "Transformer Engine" in refused.stderr
    assert not miles.exists()
    exported = cli("export-miles", "--checkpoint", str(critic), "--out", str(miles), "--model-identity", "q")
    assert exported.returncode == 0, exported.stderr[-2000:]
    from value_assets.gpu.convert.megatron_lm import tensor_shapes

    step = next(miles.glob("iter_*"))
    assert "decoder.layers.0.self_attention.linear_attn.in_proj_qkv.weight" in tensor_shapes(step)


def test_tokens_beyond_the_qwen3_5_vocabulary_are_refused(tmp_path):
    actor = tmp_path / "actor"
    make_qwen3_5_checkpoint(actor, redraw=False)  # vocabulary 300; the demo data's ids reach 1007+
    manifest = make_demo_data(tmp_path / "data", rows=64, seed=0)
    out = tmp_path / "critic"
    run = cli("train", str(manifest), "--output", str(out), "--backbone", str(actor), "--gpus", "1")
    assert run.returncode == 2, run.stderr[-2000:]
    assert "300" in run.stderr
    assert not out.exists() or not any(out.iterdir())
    check = cli("validate", str(manifest), "--vocab-size", "300")
    assert check.returncode == 2 and "300" in check.stderr
