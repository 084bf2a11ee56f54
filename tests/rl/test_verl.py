"""verl 0.9.1's own critic loading and value read-out on the product's scalar export (`make test-rl`).

What verl runs (FSDP engine, model_type value_model): `HFModelConfig(path=critic.model.path)` builds
the tokenizer (`tokenizer_path` defaults to the same path) and the config; `_build_module` sets
num_labels=1 and calls `verl.utils.model.load_valuehead_model` (AutoModelForTokenClassification);
a batch goes through `left_right_2_no_padding`, `prepare_model_inputs` (use_remove_padding=False:
the padded CPU path; the packed path needs flash-attn), the module, `FSDPEngineWithValueHead.
prepare_model_outputs` and `no_padding_2_padding`, which gives the value of response token j at
absolute position prompt_len + j - 1. Compared with the product's engine values: fp32, 1e-5.

Shims (tests/rl/harness.py): S2 (eager attention instead of flash_attention_2). The engine methods
are called unbound on a stand-in `self` holding only `pad_to_length` and the module, since the
engine itself needs a CUDA device mesh.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.rl.harness import eager_instead_of_flash_attention
from tests.rl.rltest_helpers import FAMILIES, response_values, rollouts

pytestmark = [pytest.mark.rl, pytest.mark.timeout(600)]
ATOL = 1e-5


def verl_values(model_path: str, prompts, responses):
    """(verl's HFModelConfig, values [batch, max response length]) of verl's critic on `model_path`."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.utils.model import load_valuehead_model
    from verl.workers.config.model import HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    mc = HFModelConfig(path=model_path, model_type="value_model", override_config={"attn_implementation": "eager"})
    mc.hf_config.num_labels = 1  # FSDPEngine._build_module for a value model
    mc.hf_config.classifier_dropout = 0.0
    mc.hf_config.hidden_dropout = "0"
    mc.hf_config.summary_dropout_prob = 0.0
    with eager_instead_of_flash_attention():
        module = load_valuehead_model(
            local_path=mc.local_path, torch_dtype=torch.float32, model_config=mc.hf_config, trust_remote_code=False
        ).eval()
    pad = mc.tokenizer.pad_token_id
    P, R = max(map(len, prompts)), max(map(len, responses))
    ids = torch.full((len(prompts), P + R), pad)
    mask = torch.zeros(len(prompts), P + R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):  # prompts left-, responses right-padded
        ids[i, P - len(p) : P], ids[i, P : P + len(r)] = torch.tensor(p), torch.tensor(r)
        mask[i, P - len(p) : P + len(r)] = 1
    batch = TensorDict(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "prompts": ids[:, :P],
            "responses": ids[:, P:],
            "response_mask": mask[:, P:],
        },
        batch_size=[len(prompts)],
    )
    mb = left_right_2_no_padding(batch)
    tu.assign_non_tensor_data(mb, "use_remove_padding", False)
    tu.assign_non_tensor_data(mb, "temperature", 1.0)
    tu.assign_non_tensor_data(mb, "pad_token_id", pad)
    engine = SimpleNamespace(pad_to_length=False, module=module)
    inputs, out_args = FSDPEngineWithLMHead.prepare_model_inputs(engine, mb)
    with torch.no_grad():
        out = module(**inputs)
    values = FSDPEngineWithValueHead.prepare_model_outputs(engine, out, out_args, mb, None)["values"]
    return mc, no_padding_2_padding(values, mb)


@pytest.mark.parametrize("family", FAMILIES)
def test_verl_reads_the_products_values_and_the_actors_tokenizer(critics, family):
    """`critic.model.path=<scalar export>` alone: the values are the product's and the tokenizer verl
    builds from the folder is the actor's (the export carries its files)."""
    from transformers import AutoTokenizer

    from value_assets.gpu.convert.tokenizer import tokenizer_sha256

    paths = critics[family]
    prompts, responses = rollouts()
    mc, got = verl_values(str(paths["scalar"]), prompts, responses)
    want = response_values(paths["critic-trained"], prompts, responses)
    diff = max((got[i, : len(r)] - want[i]).abs().max().item() for i, r in enumerate(responses))
    print(f"verl {family}: max abs diff {diff:.2e}")
    assert diff < ATOL
    actor = AutoTokenizer.from_pretrained(str(paths["actor"]))
    assert tokenizer_sha256(paths["scalar"]) == tokenizer_sha256(paths["actor"])
    assert len(mc.tokenizer) == len(actor) > 1
    assert (mc.tokenizer.pad_token_id, mc.tokenizer.eos_token_id) == (actor.pad_token_id, actor.eos_token_id)
    assert mc.hf_config.pad_token_id == actor.pad_token_id  # verl sets the config's ids from the tokenizer


def test_without_tokenizer_files_verl_builds_an_empty_tokenizer(critics, tmp_path):
    """Why the export carries the tokenizer: verl's default (tokenizer_path = critic.model.path) on
    a folder without tokenizer files, as the old export was, silently builds a tokenizer of length 1."""
    import shutil

    from verl.workers.config.model import HFModelConfig

    from value_assets.gpu.convert.tokenizer import TOKENIZER_FILES

    bare = tmp_path / "bare"
    shutil.copytree(critics["qwen2"]["scalar"], bare, ignore=lambda _d, names: set(names) & set(TOKENIZER_FILES))
    mc = HFModelConfig(path=str(bare), model_type="value_model", override_config={"attn_implementation": "eager"})
    assert len(mc.tokenizer) == 1
