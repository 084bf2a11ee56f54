"""CPU compatibility layer for megatron-core 0.16.1 and 0.19.2 (tests, CI and the CPU demo only).

megatron-core assumes CUDA everywhere. On a machine without CUDA, `apply_cpu_compat()` redirects
the few spots that the critic's code paths hit (local layer spec, Megatron DDP, the plain and the distributed
optimizer, activation recompute, the pipeline schedules, dist_checkpointing), and nothing else:

1. `torch.cuda.current_device()` -> `torch.device("cpu")`: the global memory buffer, the DDP
   grad buffers, rotary `inv_freq` and attention scratch tensors allocate on "the current device".
2. `torch.cuda.synchronize()` -> no-op, `torch.cuda.current_stream()` -> an inert stream object:
   the DDP and checkpoint code synchronise streams that do not exist on CPU.
3. A module-scoped `torch` proxy in the megatron modules that allocate with a literal
   `device="cuda"` (pipeline schedules' token counters, grad-clipping/optimizer scalars, the
   local multi-tensor l2 norm): the proxy rewrites that device to CPU. The real `torch` module is
   untouched, so code outside those modules still fails loudly on a CUDA device.
4. The CUDA RNG tracker is replaced by `CpuRNGStatesTracker`, which forks the CPU generator; it is
   seeded by `seed_model_parallel` exactly like Megatron's `model_parallel_cuda_manual_seed`
   (data-parallel seed = seed, tensor-parallel seed = seed + 2718 + tp_rank, expert seed =
   seed + 1024 + 100 * ep_rank + etp_rank).
5. `clip_grad_by_total_norm_fp32` asserts `grad.type() == 'torch.cuda.FloatTensor'`; a CPU version
   with the same arithmetic replaces it in the optimizer module.
6. Activation recompute (`tensor_parallel.checkpoint`) saves and restores the CUDA generator's
   state around the recomputed forward; on CPU there is none, so those two helpers do nothing
   (the CPU generator and the tracker's states are still saved and restored).
7. The distributed optimizer sorts parameters by `param.type()` against CUDA type names
   ('torch.cuda.FloatTensor', ...) while it builds its shards; during its constructor only, a CPU
   tensor's `type()` answers with the CUDA name of the same dtype.

The function is idempotent and does nothing when `torch.cuda.is_available()`.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

import torch

_APPLIED = False


def cuda_available() -> bool:
    return torch.cuda.is_available()


class _InertStream:
    """Stands in for a CUDA stream on CPU: every wait/sync is already satisfied."""

    def wait_stream(self, other: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None


def _cpu_device(device: Any) -> Any:
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, int):  # a CUDA ordinal
        return torch.device("cpu")
    return device


class _TorchProxy(types.ModuleType):
    """A stand-in for `torch` inside one megatron module: factory calls with a CUDA device land
    on CPU; everything else is the real torch."""

    _FACTORIES = ("zeros", "ones", "empty", "tensor", "full", "arange", "zeros_like", "empty_like")

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        attr = getattr(torch, name)
        if name in self._FACTORIES:

            def factory(*args: Any, **kwargs: Any) -> Any:
                if "device" in kwargs:
                    kwargs["device"] = _cpu_device(kwargs["device"])
                kwargs.pop("pin_memory", None)
                return attr(*args, **kwargs)

            return factory
        return attr


class CpuRNGStatesTracker:
    """Megatron's RNG-tracker interface (add / fork / get_states / set_states / reset) over the
    CPU default generator. `fork(name)` swaps the named state in, runs the block, stores the
    advanced state back under the name and restores the caller's state."""

    def __init__(self, **_: Any) -> None:
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        gen = torch.Generator(device="cpu")
        gen.manual_seed(seed)
        self.states_[name] = gen.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise KeyError(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


@contextlib.contextmanager
def _cuda_type_names():
    """`Tensor.type()` (no arguments) answers 'torch.cuda.<Kind>Tensor' for CPU tensors."""
    orig = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and not self.is_cuda:
            return orig(self).replace("torch.", "torch.cuda.", 1)
        return orig(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.type = orig  # type: ignore[method-assign]


def _patch_distributed_optimizer(distrib_optimizer: Any) -> None:
    cls = distrib_optimizer.DistributedOptimizer
    init = cls.__init__

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with _cuda_type_names():
            init(self, *args, **kwargs)

    cls.__init__ = __init__


def _clip_grad_by_total_norm_fp32_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff >= 1.0:
        return
    for p in parameters:
        g = getattr(p, "decoupled_grad", None) if use_decoupled_grad else p.grad
        if g is not None:
            assert g.dtype == torch.float32, g.dtype
            g.detach().mul_(clip_coeff)


# The megatron-core releases whose internals these patches were written against and tested on
# (major, minor): 0.16 (Python 3.11: the CPU suite, the demo) and 0.19 (Python 3.12: the GPU image;
# `make test-mcore-next` runs the CPU suite's GPU code paths on it).
SUPPORTED_MEGATRON = ((0, 16), (0, 19))


def check_megatron_version(version: str) -> None:
    """Refuse to patch a megatron-core release the compatibility layer was not written for."""
    try:
        major_minor = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        major_minor = ()
    if major_minor not in SUPPORTED_MEGATRON:
        supported = ", ".join(f"{a}.{b}" for a, b in SUPPORTED_MEGATRON)
        raise RuntimeError(
            f"megatron-core {version}: the CPU compatibility layer patches megatron internals and "
            f"supports {supported} only; pin one of these for CPU runs (CUDA runs are unaffected)"
        )


def apply_cpu_compat() -> bool:
    """Patch megatron-core for CPU. Returns True when patches are (or already were) in place,
    False when CUDA is available and nothing was done."""
    global _APPLIED
    if cuda_available():
        return False
    if _APPLIED:
        return True
    import megatron.core

    check_megatron_version(megatron.core.__version__)

    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    _stream = _InertStream()
    torch.cuda.current_stream = lambda *a, **k: _stream  # type: ignore[assignment]
    torch.cuda.default_stream = lambda *a, **k: _stream  # type: ignore[assignment]

    import megatron.core.distributed.param_and_grad_buffer as pgb
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer
    import megatron.core.optimizer.optimizer as optimizer
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.tensor_parallel.random as tp_random
    import megatron.core.utils as mcore_utils

    proxy = _TorchProxy()
    for mod in (schedules, clip_grads, optimizer, mcore_utils, pgb):
        mod.torch = proxy

    tp_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    tp_random.CudaRNGStatesTracker = CpuRNGStatesTracker  # a forced re-initialisation stays on CPU

    _patch_distributed_optimizer(distrib_optimizer)
    tp_random._get_cuda_rng_state = lambda *a, **k: None
    tp_random._set_cuda_rng_state = lambda *a, **k: None

    optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32_cpu
    clip_grads.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32_cpu

    _APPLIED = True
    return True


def seed_model_parallel(seed: int) -> None:
    """Seed the default generators and the model-parallel RNG tracker like Megatron's
    `model_parallel_cuda_manual_seed` (CUDA path uses it directly)."""
    import random

    import numpy as np
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if cuda_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return
    apply_cpu_compat()
    import megatron.core.tensor_parallel.random as tp_random

    tracker = tp_random._CUDA_RNG_STATE_TRACKER
    tracker.reset()
    tp_rank = ps.get_tensor_model_parallel_rank()
    ep_rank = ps.get_expert_model_parallel_rank()
    etp_rank = ps.get_expert_tensor_parallel_rank()
    tracker.add(tp_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(tp_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(tp_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)
