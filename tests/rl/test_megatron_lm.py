"""Megatron-LM 0.17.0's own megatron/training on the product's Miles bundles, and the product on an
actor checkpoint Megatron-LM saved itself (`make test-rl`).

Megatron-LM runs in its own process (tests/rl/megatron_lm_side.py, with megatron-core 0.17.0 +
megatron/training 0.17.0 first on its PYTHONPATH); the product (megatron-core 0.16.1) runs here.

* `load_checkpoint(strict=True)` with `--dist-ckpt-strictness raise_all` of both Miles bundles (local
  and TE layer-spec names) into Miles' critic model, asserting that the model's
  `load_state_dict(strict=True)` did not fall back to strict=False (Megatron-LM does so silently on
  an exception); the TE request is emulated (Transformer Engine cannot be installed here). Values
  vs the product's engine: fp32, 1e-5. Negative control: Miles' head without its bias does not load.
* `save_checkpoint` of an actor (the HF actor's weights in Miles' actor model, with a megatron
  optimizer), then the product's bootstrap on that folder: Megatron-LM 0.17 saves `layernorm_epsilon`
  (and no `norm_epsilon`), the architecture and every backbone tensor equal the HF path's, a
  contradicting `--hf-config` is refused by name, and `value-assets train --backbone <it>` trains the
  critic the HF folder trains, bitwise.

Shims (tests/rl/megatron_lm_side.py): M1 (gloo group + parallel state), M2 (current device,
synchronize, streams on the CPU), M3 (CPU RNG tracker), M4 (CUDA allocations and RNG state during
load, optimizer construction and save).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.rl.rltest_helpers import FAMILIES, product_values, train_critic

pytestmark = [pytest.mark.rl, pytest.mark.timeout(600)]
ATOL = 1e-5


def _actor(megatron_lm_results, family: str) -> Path:
    return Path(megatron_lm_results["job"]["families"][family]["actor_out"])


def test_the_megatron_lm_side_ran_megatron_lm_0_17(megatron_lm_results):
    """One release on the Megatron-LM side: megatron.core and megatron.training both from the
    unpacked megatron-core 0.17.0 wheel (.rl/megatron-lm)."""
    from tests.rl.harness import MEGATRON_LM, MEGATRON_LM_VERSION

    print(f"Megatron-LM side (s): {megatron_lm_results['seconds']}")
    assert megatron_lm_results["megatron_core"] == MEGATRON_LM_VERSION
    assert all(Path(f).is_relative_to(MEGATRON_LM) for f in megatron_lm_results["files"])


@pytest.mark.parametrize("spec", ["te", "local"])
@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_lm_loads_the_miles_bundle(critics, megatron_lm_results, family, spec):
    got = megatron_lm_results["families"][family][spec]
    assert got["strict_loads"] == [True]  # Megatron-LM retries with strict=False after a failed strict load
    bundle = critics[family][f"miles-{spec}"]
    assert got["iteration"] == int((bundle / "latest_checkpointed_iteration.txt").read_text())  # Miles compares it
    want = product_values(critics[family]["critic-trained"], megatron_lm_results["job"]["families"][family]["seqs"])
    diff = max((torch.tensor(g) - w).abs().max().item() for g, w in zip(got["values"], want, strict=True))
    print(f"Megatron-LM {family} {spec}: iteration {got['iteration']}, max abs diff {diff:.2e}")
    assert diff < ATOL


def test_megatron_lm_refuses_a_head_without_bias(megatron_lm_results):
    """The strictness is real: Miles' head without its bias does not load the bundle."""
    for family in FAMILIES:
        assert "output_layer.bias" in (megatron_lm_results["families"][family]["headless"] or "")


@pytest.mark.parametrize("family", FAMILIES)
def test_bootstrap_from_a_megatron_lm_actor(critics, megatron_lm_results, family, tmp_path):
    """Megatron-LM 0.17's `save_checkpoint` names the norm epsilon `layernorm_epsilon`; the product
    reads it (the old reader refused: 'lack norm_epsilon'), and the backbone equals the HF path's."""
    from value_assets.core.errors import InputError
    from value_assets.gpu.convert import megatron_lm
    from value_assets.gpu.convert.bootstrap import resolve_backbone
    from value_assets.gpu.convert.hf import load_hf_backbone_state, read_hf_config

    actor = critics[family]["actor"]
    out = _actor(megatron_lm_results, family)
    saved = megatron_lm.saved_args(out / "iter_0000007")
    assert saved["layernorm_epsilon"] == read_hf_config(actor)["rms_norm_eps"] and "norm_epsilon" not in saved
    assert saved["layernorm_zero_centered_gamma"] is False and "apply_layernorm_1p" not in saved
    hf_cfg = resolve_backbone(str(actor))[0]
    got, _, ident = resolve_backbone(str(out))
    assert got == hf_cfg and ident["iteration"] == 7 and ident["layer_spec"] == "local"
    assert resolve_backbone(str(out), hf_config=str(actor))[0] == hf_cfg  # --hf-config agrees: same
    back = megatron_lm.load_backbone_state(out / "iter_0000007", got)
    ref = load_hf_backbone_state(actor)
    assert back.keys() == ref.keys() and all(torch.equal(back[k], ref[k]) for k in ref)
    # --hf-config completes the saved arguments; where both speak they must agree.
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((actor / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-3}))
    with pytest.raises(InputError, match=r"--hf-config .*: norm_epsilon: is 0\.001, but the checkpoint's saved"):
        resolve_backbone(str(out), hf_config=str(other))


def test_megatron_lm_saves_the_renamed_arguments_the_product_reads(megatron_lm_results):
    """Megatron-LM 0.17's own parser: --norm-epsilon and --apply-layernorm-1p are saved as
    `layernorm_epsilon` / `layernorm_zero_centered_gamma` (0.12-0.15: `norm_epsilon` /
    `apply_layernorm_1p`); the product reads the first and refuses a zero-centered gamma by name."""
    from value_assets.core.errors import InputError
    from value_assets.gpu.convert.megatron_lm import backbone_from_args, saved_args

    names = megatron_lm_results["saved_names"]
    assert names["plain"] == {"layernorm_epsilon": 1e-6, "layernorm_zero_centered_gamma": False}
    assert names["gamma"] == {"layernorm_epsilon": 1e-6, "layernorm_zero_centered_gamma": True}
    args = saved_args(_actor(megatron_lm_results, FAMILIES[0]) / "iter_0000007")
    assert backbone_from_args({**args, **names["plain"]}, "common.pt").norm_epsilon == 1e-6
    with pytest.raises(InputError, match=r"args\.layernorm_zero_centered_gamma: is True; the critic computes with"):
        backbone_from_args({**args, **names["gamma"]}, "common.pt")


@pytest.mark.parametrize("family", FAMILIES)
def test_train_from_the_megatron_lm_actor_equals_the_hf_path(critics, megatron_lm_results, family, tmp_path):
    """`value-assets train --backbone <Megatron-LM actor>` trains the same critic, bitwise, as the
    same run from the actor's Hugging Face folder (the fixture's critic-trained)."""
    from tests.job.jobtest_helpers import model_weights
    from value_assets.gpu.convert.export import contracted_step

    paths = critics[family]
    critic = train_critic(paths["manifest"], tmp_path / "critic", _actor(megatron_lm_results, family))
    mine, theirs = contracted_step(critic)[0], contracted_step(paths["critic-trained"])[0]
    a, b = model_weights(mine, tmp_path), model_weights(theirs, tmp_path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), [
        k for k in a if not torch.equal(a[k], b[k])
    ]
