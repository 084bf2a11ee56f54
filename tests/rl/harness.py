"""The RL trainers' own code on CPU, for tests/rl (`make test-rl`): where it comes from, and the
shims it needs here. Shims live only in this harness and in tests/rl/megatron_lm_side.py, never in
the product; each is listed in the docstring of the test that relies on it.

Where the code comes from (`make rl-deps`, Makefile; nothing of it goes into the project's venv):

* verl 0.9.1 and OpenRLHF 0.11.2 with the light dependencies their loaders import on CPU, pinned
  (requirements-rl.txt), installed `--no-deps --target .rl/site`; `make test-rl` puts .rl/site on
  the pytest process's PYTHONPATH. Everything else they import is the venv's (torch 2.13 CPU,
  transformers 5.25, megatron-core 0.16.1 for verl's engine module). The one package both hold is
  antlr4-python3-runtime: hydra's 4.9.3 shadows the venv's 4.13.2 there, which Dagster's
  asset-selection grammar needs; nothing the tier runs imports Dagster.
* Megatron-LM's megatron/training is in no megatron-core 0.16.1 wheel or sdist; the megatron-core
  wheels ship it from 0.17.0 on, as tagged core_v0.17.0. The 0.17.0 wheel (cp312; pure Python but
  for a datasets helper not loaded here), checked against its pinned sha256, is unpacked whole into
  .rl/megatron-lm and put first on PYTHONPATH of the Megatron-LM side process only
  (`start_megatron_lm_side`), so megatron.core and megatron.training are one release, 0.17.0; the
  product keeps its megatron-core 0.16.1 in the pytest process.

Shims of the pytest process:

  S1 flash_attn import stub (OpenRLHF): openrlhf.models imports flash_attn.bert_padding and
     flash_attn.utils.distributed at module level; flash-attn has CUDA wheels only. Inert modules
     (with a `__spec__`: transformers probes `find_spec("flash_attn")`) are in sys.modules only
     while openrlhf imports; every function raises if called (only `packing_samples=True` calls
     them). They are removed again so that verl takes its own pure-torch fallbacks
     (verl/utils/attention_utils.py) on the ImportError.
  S2 attention implementation (verl): `load_valuehead_model` hard-codes
     `attn_implementation="flash_attention_2"`; on CPU the same `from_pretrained` call gets "eager".
     (OpenRLHF takes it as an argument, --ds.attn_implementation eager: no shim.)
  S3 fp32 (OpenRLHF): --ds.param_dtype knows bf16 / fp16 only; `convert_to_torch_dtype("fp32")`
     gives float32 too, for a comparison at 1e-5.

The Megatron-LM side's shims (M1-M4) are listed in tests/rl/megatron_lm_side.py.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RL_SITE = REPO / ".rl" / "site"
MEGATRON_LM = REPO / ".rl" / "megatron-lm"
MEGATRON_LM_VERSION = "0.17.0"
# radixark/miles' `miles` and `miles_plugins` at this commit, with flash-linear-attention and triton
# (`make rl-deps`): only the Miles side process puts it on its PYTHONPATH (tests/rl/miles_qwen3_5_side.py).
MILES = REPO / ".rl" / "miles"
MILES_COMMIT = "31f1ca961a94cb860cec3b2dea34ec332bfa8f76"
# The keys of the product's `read_hf_config` dict the Megatron-LM side builds its flags from.
ARCH_KEYS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "max_position_embeddings",
    "rope_theta",
    "rms_norm_eps",
    "vocab_size",
    "qkv_bias",
    "qk_layernorm",
)


def require_installed() -> None:
    """Fail (not skip: the tier exists to run them) when the trainers' code is not there."""
    import pytest

    missing = [m for m in ("verl", "openrlhf", "deepspeed", "tensordict") if importlib.util.find_spec(m) is None]
    if not (MEGATRON_LM / "megatron" / "training" / "checkpointing.py").is_file():
        missing.append(f"megatron/training ({MEGATRON_LM})")
    if missing:
        pytest.fail(
            f"the RL trainers' code is not installed: {missing}; run `make test-rl` (it installs "
            f"requirements-rl.txt into {RL_SITE} and Megatron-LM {MEGATRON_LM_VERSION} into {MEGATRON_LM})"
        )


def start_megatron_lm_side(job: Path) -> subprocess.Popen:
    """tests/rl/megatron_lm_side.py on `job`, in a process whose PYTHONPATH puts Megatron-LM 0.17.0
    (.rl/megatron-lm) first, then this repository; its output goes to `<job>.log` (`.log` attribute)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(MEGATRON_LM), str(REPO)])
    log = job.with_suffix(".log")
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.rl.megatron_lm_side", str(job)],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    proc.log = log  # type: ignore[attr-defined]
    return proc


def run_miles_side(job: Path, timeout_s: float = 300.0) -> subprocess.CompletedProcess:
    """tests/rl/miles_qwen3_5_side.py on `job`: Megatron-LM 0.17.0 first on PYTHONPATH, then Miles
    (.rl/miles), this repository and .rl/site (einops for fla)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(MEGATRON_LM), str(MILES), str(REPO), str(RL_SITE)])
    return subprocess.run(
        [sys.executable, "-m", "tests.rl.miles_qwen3_5_side", str(job)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


# ----------------------------------------------------------------------------- S1 + S3: OpenRLHF


def import_openrlhf():
    """(get_llm_for_sequence_regression, openrlhf.utils.utils) with S1 and S3 applied."""
    import einops
    import torch

    def unavailable(*a, **k):
        raise RuntimeError("flash_attn is stubbed on CPU (tests/rl/harness.py S1): packing_samples needs the real one")

    names = ("flash_attn", "flash_attn.bert_padding", "flash_attn.utils", "flash_attn.utils.distributed")
    mods = {n: types.ModuleType(n) for n in names}
    for m in mods.values():
        m.__spec__ = importlib.machinery.ModuleSpec(m.__name__, None)
    bp = mods["flash_attn.bert_padding"]
    bp.index_first_axis = bp.pad_input = bp.unpad_input = unavailable
    bp.rearrange = einops.rearrange
    mods["flash_attn.utils.distributed"].all_gather = unavailable
    saved = {n: sys.modules.get(n) for n in mods}
    sys.modules.update(mods)
    try:
        import openrlhf.utils.utils as ou
        from openrlhf.models.model import get_llm_for_sequence_regression
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
    if not getattr(ou.convert_to_torch_dtype, "fp32_shim", False):
        orig = ou.convert_to_torch_dtype

        def convert_to_torch_dtype(param_dtype):
            return torch.float32 if param_dtype == "fp32" else orig(param_dtype)

        convert_to_torch_dtype.fp32_shim = True
        ou.convert_to_torch_dtype = convert_to_torch_dtype
    return get_llm_for_sequence_regression, ou


# ----------------------------------------------------------------------------- S2: verl


def import_verl() -> None:
    """The verl modules the tests use (imported once; their first import takes seconds)."""
    for name in ("verl.utils.model", "verl.workers.config.model", "verl.workers.engine.fsdp.transformer_impl"):
        importlib.import_module(name)
    importlib.import_module("verl.workers.utils.padding")


@contextlib.contextmanager
def eager_instead_of_flash_attention():
    import transformers

    cls = transformers.AutoModelForTokenClassification
    orig = cls.__dict__["from_pretrained"]

    def from_pretrained(klass, *a, **k):
        if k.get("attn_implementation") == "flash_attention_2":
            k["attn_implementation"] = "eager"
        return orig.__func__(klass, *a, **k)

    cls.from_pretrained = classmethod(from_pretrained)
    try:
        yield
    finally:
        cls.from_pretrained = orig
