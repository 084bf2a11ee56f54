"""The Megatron-LM side of the RL tier: Megatron-LM 0.17.0's own code (megatron/training and the
megatron-core 0.17.0 it ships with), run in a process of its own.

`python -m tests.rl.megatron_lm_side JOB.json`, started by tests/rl/conftest.py with the unpacked
megatron-core 0.17.0 wheel (`make rl-deps`: .rl/megatron-lm) first on PYTHONPATH, so that
`megatron.core` and `megatron.training` are one release. Nothing of the product is imported here:
the product runs on megatron-core 0.16.1 in the pytest process, which hands this process plain
inputs (the actors' shapes and tensors, the Miles bundles it exported, token sequences) and reads
back plain results (values, iterations, saved arguments, the actor checkpoints Megatron-LM wrote).

What it runs, for each tiny actor (JOB.json `families`); the actor checkpoints first, while the
pytest process trains and exports the critics, then the bundles once they exist:

* `parse_args` + `validate_args` + `set_global_variables` with the flags Miles' model scripts pass
  for the actor's shape, plus the CPU flags (`CPU_FLAGS`);
* `load_checkpoint([model], None, None, strict=True)` with `--no-load-optim --dist-ckpt-strictness
  raise_all` of both Miles bundles into Miles' critic model (`miles_model`): Megatron-LM's own
  `core_transformer_config_from_args`, a local-spec GPTModel, and Miles' head restated
  (miles/backends/megatron_utils/model_provider.py `LinearForLastLayer(hidden, 1, bias=True)`).
  Megatron-LM's `load_model_state_dict` retries a failed `load_state_dict(strict=True)` with
  strict=False and only prints (`checkpointing.py`), so every call's `strict` is recorded: the tests
  require it was True, once. Transformer Engine cannot be installed here, so the TE bundle's load
  request is emulated: the core_attention `_extra_state` objects a TE spec adds are requested too.
  Then the values of JOB.json's sequences (the head on the final-norm hidden states);
* the same load with Miles' head built without its bias (negative control: must fail);
* `save_checkpoint(7, [ddp], optimizer, None, 0)` of an actor: the HF actor's weights (handed over
  under megatron-core's names) in Miles' actor model, wrapped in megatron DDP with a megatron
  optimizer, as an RL actor checkpoint holds them;
* the arguments `--norm-epsilon` and `--apply-layernorm-1p` are saved under.

CPU shims (this harness only, never in the product; the product's CPU compatibility layer accepts
megatron-core 0.16 / 0.19 only, so this process does its own minimal setup):

  M1 process group: a 1-rank gloo group and megatron's parallel state (TP = PP = 1).
  M2 current device: `torch.cuda.current_device()` answers the CPU device (rotary `inv_freq`,
     attention scratch tensors and the DDP buffers allocate on "the current device");
     `torch.cuda.synchronize()` and `torch.cuda.current_stream()` are inert (DDP, checkpointing).
  M3 RNG tracker: megatron's CUDA RNG tracker is replaced by one over the CPU generator (`fork`
     is entered around attention dropout even at p = 0; `save_checkpoint` collects its states).
  M4 CUDA allocations and RNG state: `read_metadata` all-reduces the iteration in a
     `device='cuda'` tensor, the fp32 optimizer keeps its loss scale in one, and `save_checkpoint`
     always collects `torch.cuda.get_rng_state()`; while Megatron-LM's load, the optimizer's
     construction and the save run, `device='cuda'` factory calls allocate on the CPU and
     `get_rng_state` returns the CPU generator's state.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

# Fusions are CUDA kernels; dropout off for exact values; the local (non-TE) layer spec.
CPU_FLAGS = [
    "--use-cpu-initialization",
    "--no-rope-fusion",
    "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion",
    "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion",
    "--no-persist-layer-norm",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
    "--transformer-impl",
    "local",
]


def arch_flags(cfg: dict[str, Any]) -> list[str]:
    """Megatron-LM's flags for an actor of `cfg` (the product's `read_hf_config` dict), as Miles'
    model scripts pass them; tokenizer-free (`NullTokenizer`, the vocabulary size given)."""
    flags = [
        "--num-layers", str(cfg["num_layers"]),
        "--hidden-size", str(cfg["hidden_size"]),
        "--ffn-hidden-size", str(cfg["ffn_hidden_size"]),
        "--num-attention-heads", str(cfg["num_attention_heads"]),
        "--group-query-attention",
        "--num-query-groups", str(cfg["num_query_groups"]),
        "--kv-channels", str(cfg["kv_channels"]),
        "--max-position-embeddings", str(cfg["max_position_embeddings"]),
        "--seq-length", str(cfg["max_position_embeddings"]),
        "--position-embedding-type", "rope",
        "--rotary-base", str(int(cfg["rope_theta"])),
        "--normalization", "RMSNorm",
        "--norm-epsilon", str(cfg["rms_norm_eps"]),
        "--swiglu",
        "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
        "--vocab-size", str(cfg["vocab_size"]),
        "--tokenizer-type", "NullTokenizer",
        "--micro-batch-size", "1",
        "--global-batch-size", "1",
        "--ckpt-format", "torch_dist",
    ]  # fmt: skip
    if cfg["qkv_bias"]:
        flags.append("--add-qkv-bias")
    if cfg["qk_layernorm"]:
        flags.append("--qk-layernorm")
    return flags


# ----------------------------------------------------------------------------- shims


class _InertStream:
    def wait_stream(self, *a: Any) -> None: ...
    def wait_event(self, *a: Any) -> None: ...
    def record_event(self, *a: Any) -> None: ...
    def synchronize(self) -> None: ...


class CpuRNGTracker:
    """M3: megatron's RNG-tracker interface over the CPU generator."""

    def __init__(self, **_: Any) -> None:
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def is_initialized(self) -> bool:
        return bool(self.states_)

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        gen = torch.Generator()
        gen.manual_seed(seed)
        self.seeds_.add(seed)
        self.states_[name] = gen.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def one_cpu_rank(seed: int = 1234) -> None:
    """M1 + M2 + M3."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_stream = lambda *a, **k: _InertStream()  # type: ignore[assignment]
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    tracker = CpuRNGTracker()
    tracker.add("model-parallel-rng", seed + 2718)
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    torch.manual_seed(seed)


@contextlib.contextmanager
def cuda_allocations_on_cpu():
    """M4."""
    names = ("tensor", "zeros", "ones", "empty", "full", "arange")
    saved = {n: getattr(torch, n) for n in names}

    def wrap(fn):
        def f(*a, **k):
            if k.get("device") is not None and "cuda" in str(k["device"]):
                k["device"] = "cpu"
            return fn(*a, **k)

        return f

    saved_rng = torch.cuda.get_rng_state
    for n in names:
        setattr(torch, n, wrap(saved[n]))
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # type: ignore[assignment]
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(torch, n, fn)
        torch.cuda.get_rng_state = saved_rng  # type: ignore[assignment]


# ----------------------------------------------------------------------------- Megatron-LM


def megatron_lm_args(flags: list[str]):
    """Megatron-LM's own parse_args + validate_args + set_global_variables (no tokenizer built:
    the padded vocabulary from its own `vocab_size_with_padding`)."""
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args, validate_args

    reset_globals()
    os.environ.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
    argv, sys.argv = sys.argv, ["megatron-lm", *flags]
    try:
        args = parse_args()
    finally:
        sys.argv = argv
    validate_args(args, {})
    global_vars.set_global_variables(args, build_tokenizer=False)
    args.padded_vocab_size = vocab_size_with_padding(args.vocab_size, args, logging_enabled=False)
    return args


def reset_globals() -> None:
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
    from megatron.training import global_vars

    for name in [n for n in vars(global_vars) if n.startswith("_GLOBAL_")]:
        setattr(global_vars, name, None)
    destroy_num_microbatches_calculator()


def miles_head(hidden: int, bias: bool = True) -> torch.nn.Module:
    """Miles' critic head (miles/backends/megatron_utils/model_provider.py `LinearForLastLayer`),
    restated: Linear(hidden, 1, bias=True), N(0, 0.02) weight, zero bias, float32 logits."""

    class LinearForLastLayer(torch.nn.Linear):
        def __init__(self) -> None:
            super().__init__(hidden, 1, bias=bias)
            self.weight.data.normal_(0.0, 0.02)
            if bias:
                self.bias.data.zero_()

        def forward(self, x, weight=None, runtime_gather_output=None):
            return super().forward(x).float(), None

    return LinearForLastLayer()


def miles_model(args, role: str = "critic"):
    """Miles' model_provider, local-spec path: a GPTModel from Megatron-LM's own
    `core_transformer_config_from_args`; the critic's output layer is Miles' head."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training.arguments import core_transformer_config_from_args

    config = core_transformer_config_from_args(args)
    spec = get_gpt_layer_local_spec(
        num_experts=args.num_experts,
        moe_grouped_gemm=args.moe_grouped_gemm,
        qk_layernorm=args.qk_layernorm,
        multi_latent_attention=args.multi_latent_attention,
        normalization=args.normalization,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=True,
        post_process=True,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=role != "critic" and not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
    )
    if role == "critic":
        model.output_layer = miles_head(config.hidden_size)
    return model


def values(model, seq: list[int]) -> list[float]:
    """Miles' critic values of one sequence: the head on the final-norm hidden states (causal)."""
    captured = {}
    handle = model.decoder.register_forward_hook(lambda m, i, o: captured.__setitem__("h", o))
    try:
        ids = torch.tensor([seq])
        s = ids.shape[1]
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]  # True = masked
        with torch.no_grad():
            model(input_ids=ids, position_ids=torch.arange(s)[None], attention_mask=mask)
            h = captured["h"][0] if isinstance(captured["h"], tuple) else captured["h"]  # [s, b, h]
            v = model.output_layer(h.transpose(0, 1).float())[0]
    finally:
        handle.remove()
    return v[0, :, 0].tolist()


def te_request(model, te_modules: list[str], num_layers: int) -> None:
    """Emulate a TE spec's load request: the `_extra_state` objects of the TE modules the local
    spec lacks (core attention) are requested too, and dropped before `load_state_dict`."""
    from megatron.core.transformer.utils import make_sharded_object_for_checkpoint

    request = model.sharded_state_dict

    def sharded_state_dict(*a, **k):
        sd = request(*a, **k)
        have = {getattr(v, "key", None) for v in sd.values()}
        for module in te_modules:
            key = f"decoder.layers.{module}._extra_state"
            if key not in have:
                for i in range(num_layers):
                    sd[f"{key}#{i}"] = make_sharded_object_for_checkpoint(None, key, ((0, i, num_layers),))
        return sd

    model.sharded_state_dict = sharded_state_dict


def load_bundle(cfg: dict, bundle: str, spec: str, te_modules: list[str], seqs, *, bias: bool = True) -> dict:
    from megatron.training.checkpointing import load_checkpoint

    load_flags = ["--load", bundle, "--no-load-optim", "--dist-ckpt-strictness", "raise_all"]
    args = megatron_lm_args(arch_flags(cfg) + CPU_FLAGS + load_flags)
    model = miles_model(args).eval()
    if not bias:
        model.output_layer = miles_head(args.hidden_size, bias=False)
    if spec == "te":
        te_request(model, te_modules, args.num_layers)
    strict_loads = []
    load = model.load_state_dict

    def load_state_dict(state, strict=True):
        state = {k: v for k, v in state.items() if "core_attention._extra_state" not in k}
        strict_loads.append(strict)
        return load(state, strict=strict)

    model.load_state_dict = load_state_dict
    with cuda_allocations_on_cpu():
        iteration, _ = load_checkpoint([model], None, None, strict=True)
    return {"iteration": iteration, "strict_loads": strict_loads, "values": [values(model, s) for s in seqs]}


def save_actor(cfg: dict, state_file: str, out: str) -> dict:
    """The actor's weights in Miles' actor model, saved by Megatron-LM's `save_checkpoint` with a
    megatron optimizer (what an RL actor checkpoint holds)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.training.checkpointing import save_checkpoint

    flags = ["--save", out, "--save-interval", "1", "--train-iters", "10", "--lr", "1e-5"]
    args = megatron_lm_args(arch_flags(cfg) + CPU_FLAGS + flags)
    model = miles_model(args, role="actor")
    state = torch.load(state_file, weights_only=True)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):  # rows up to the padded vocabulary
        t = state[name]
        state[name] = torch.cat([t, t.new_zeros(args.padded_vocab_size - t.shape[0], t.shape[1])])
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not [k for k in missing if not k.endswith("_extra_state")] and not unexpected, (missing, unexpected)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    with cuda_allocations_on_cpu():
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-5, params_dtype=torch.float32), [ddp])
        save_checkpoint(7, [ddp], opt, None, 0)
    return {"padded_vocab_size": args.padded_vocab_size}


def saved_names(cfg: dict) -> dict:
    """What `--norm-epsilon 1e-6 --apply-layernorm-1p` are saved as (Megatron-LM's own parser)."""
    keys = ("norm_epsilon", "layernorm_epsilon", "apply_layernorm_1p", "layernorm_zero_centered_gamma")
    cfg = {**cfg, "rms_norm_eps": 1e-6}
    plain = vars(megatron_lm_args(arch_flags(cfg)))
    gamma = vars(megatron_lm_args(arch_flags(cfg) + ["--apply-layernorm-1p"]))
    return {"plain": {k: plain[k] for k in keys if k in plain}, "gamma": {k: gamma[k] for k in keys if k in gamma}}


def wait_for(marker: Path, timeout_s: float = 600.0) -> None:
    """Until the pytest process has written the Miles bundles (it writes `marker` after them)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not marker.exists():
        if time.monotonic() > deadline or os.getppid() == 1:
            raise TimeoutError(f"{marker} did not appear: the pytest process wrote no bundles")
        time.sleep(0.1)


def run(job: dict) -> dict:
    """The actors first (they need only the actors' weights), while the pytest process trains the
    critics and exports them; then the bundles, once `job["bundles_ready"]` exists."""
    import time

    import megatron.core
    import megatron.training

    clock = [("start", time.monotonic())]
    one_cpu_rank()
    out: dict[str, Any] = {
        "megatron_core": megatron.core.__version__,
        "files": [megatron.core.__file__, megatron.training.__file__],
        "families": {family: {} for family in job["families"]},
    }
    for family, fam in job["families"].items():
        out["families"][family]["actor"] = save_actor(fam["config"], fam["actor_state"], fam["actor_out"])
    out["saved_names"] = saved_names(next(iter(job["families"].values()))["config"])
    clock.append(("actors", time.monotonic()))
    wait_for(Path(job["bundles_ready"]))
    clock.append(("waiting for the bundles", time.monotonic()))
    for family, fam in job["families"].items():
        got = out["families"][family]
        for spec, bundle in fam["miles"].items():
            got[spec] = load_bundle(fam["config"], bundle, spec, job["te_modules"], fam["seqs"])
        try:
            load_bundle(fam["config"], fam["miles"]["local"], "local", [], [], bias=False)
            got["headless"] = None
        except Exception as exc:  # noqa: BLE001 - the negative control reports whatever Megatron-LM raised
            got["headless"] = f"{type(exc).__name__}: {exc}"
    reset_globals()
    clock.append(("bundles", time.monotonic()))
    out["seconds"] = {name: round(t - clock[i][1], 2) for i, (name, t) in enumerate(clock[1:])}
    return out


def main() -> int:
    job = json.loads(Path(sys.argv[1]).read_text())
    try:
        result = run(job)
    except Exception:  # noqa: BLE001 - reported to the tests in full
        result = {"error": traceback.format_exc()}
    Path(job["result"]).write_text(json.dumps(result))
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
