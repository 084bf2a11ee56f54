"""SwiGLU of megatron's MLP on CUDA as two Triton kernels that move each byte once.

Megatron's fused SwiGLU (`megatron.core.fusions.fused_bias_swiglu.SwiGLUFunction`, used with
`bias_activation_fusion` and no MLP bias) runs `swiglu` / `swiglu_back` through torch.compile. With
the token count of packed micro-batches dynamic, the kernels inductor generates for them ran far
below the memory bandwidth on an H100 (bench/train_throughput.py --profile, 2026-12-07): the
backward (`g * sigmoid(a) * (1 + a * (1 - sigmoid(a))) * b` and `g * silu(a)`, concatenated) took
1.73 ms per call on a 17k-token 1.5B micro-batch, 13.5% of the training step, where reading g, a, b
and writing the two gradients at HBM speed takes about 0.5 ms.

Here, with `TRITON_SWIGLU` on (the default), for a
contiguous [tokens, 2 * I] input on CUDA, the forward is one kernel (read a and b,
write silu(a) * b) and the backward one (read g, a, b, write both halves of the gradient in place,
no concatenation). Both compute in float32 and round once to the input dtype, as inductor's kernels
do. Everything else (CPU tensors, other shapes, megatron's fp8 input store or activation offload,
`TRITON_SWIGLU = False`, Triton missing or failing to build) goes to megatron's own function.

`install()` makes megatron's `bias_swiglu_impl` (which megatron's MLP calls) use this for the
bias-free SwiGLU: the module global `SwiGLUFunction` it looks up at each call is replaced by
`SwiGLUDispatch`. The biased and weighted variants (not used by the critic families) are untouched.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from value_assets.core.errors import exc_summary

# On since they passed the GPU tier (tests/gpu/test_swiglu_gpu.py) and paid in the bench on an H100,
# 2026-12-08 (bench/results/h100-train-throughput-triton-swiglu-2026-12-08.log): 1.5B train 48,078 ->
# 53,649 tok/s, the backward 1.73 -> 0.49 ms a call; `--megatron-swiglu` gives the comparison row.
# False: megatron's compiled SwiGLU on CUDA too. On CPU always megatron's.
TRITON_SWIGLU = True
_BLOCK = 1024
_kernels: Any = None  # None: not loaded yet; False: unavailable here (megatron's path from then on)
_launched: set[int] = set()  # the kernels (0 forward, 1 backward) that have run once: a later failure raises


def _load_kernels() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def forward_kernel(y_ptr, out_ptr, half, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < half
        src = y_ptr + row * 2 * half + cols
        a = tl.load(src, mask=mask).to(tl.float32)
        b = tl.load(src + half, mask=mask).to(tl.float32)
        out = a * tl.sigmoid(a) * b
        tl.store(out_ptr + row * half + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def backward_kernel(g_ptr, y_ptr, dy_ptr, half, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < half
        g = tl.load(g_ptr + row * half + cols, mask=mask).to(tl.float32)
        src = y_ptr + row * 2 * half + cols
        a = tl.load(src, mask=mask).to(tl.float32)
        b = tl.load(src + half, mask=mask).to(tl.float32)
        s = tl.sigmoid(a)
        da = g * s * (1 + a * (1 - s)) * b
        db = g * a * s
        dst = dy_ptr + row * 2 * half + cols
        tl.store(dst, da.to(dy_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + half, db.to(dy_ptr.dtype.element_ty), mask=mask)

    return forward_kernel, backward_kernel


def _grid(rows: int, half: int) -> tuple[int, int]:
    return rows, -(-half // _BLOCK)


def _run(which: int, *tensors: torch.Tensor) -> torch.Tensor | None:
    """Launch kernel `which` (0 forward, 1 backward) on `tensors` (inputs, then the output), or
    None where the kernels cannot be had here: Triton missing, or a kernel's first launch failing
    (it does not build for this GPU / Triton). Then one warning and megatron's path from then on;
    a later failure of a kernel that has run raises."""
    global _kernels
    if _kernels is None:
        try:
            _kernels = _load_kernels()
        except Exception as exc:  # noqa: BLE001  (no Triton, an unsupported install)
            _disable(exc)
    if _kernels is False:
        return None
    y = tensors[-2]
    half = y.shape[-1] // 2
    try:
        _kernels[which][_grid(y.shape[0], half)](*tensors, half, BLOCK=_BLOCK)
    except Exception as exc:
        if which in _launched:
            raise
        _disable(exc)
        return None
    _launched.add(which)
    return tensors[-1]


def _disable(exc: Exception) -> None:
    global _kernels
    _kernels = False
    warnings.warn(
        f"the Triton SwiGLU is not available here ({exc_summary(exc)}); megatron's SwiGLU runs instead",
        RuntimeWarning,
        stacklevel=3,
    )


def eligible(y: torch.Tensor) -> bool:
    """Whether `y` ([tokens, 2 * I]) takes the Triton kernels."""
    return (
        TRITON_SWIGLU
        and _kernels is not False
        and y.is_cuda
        and y.dim() == 2
        and y.shape[-1] % 2 == 0
        and y.is_contiguous()
        and y.dtype in (torch.bfloat16, torch.float16, torch.float32)
    )


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """silu(a) * b for y = [a, b] split on the last dimension (megatron's `swiglu`)."""
    from megatron.core.fusions import fused_bias_swiglu as mf

    if eligible(y):
        out = _run(0, y, torch.empty((y.shape[0], y.shape[1] // 2), dtype=y.dtype, device=y.device))
        if out is not None:
            return out
    return mf.swiglu(y)


def swiglu_back(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The gradient of `swiglu` at y for the output gradient g, [da, db] (megatron's `swiglu_back`)."""
    from megatron.core.fusions import fused_bias_swiglu as mf

    if eligible(y) and g.dtype == y.dtype and g.shape == (y.shape[0], y.shape[1] // 2):
        out = _run(1, g.contiguous(), y, torch.empty_like(y))
        if out is not None:
            return out
    return mf.swiglu_back(g, y)


class TritonSwiGLUFunction(torch.autograd.Function):
    """SwiGLU with the input saved for the backward (as megatron's `SwiGLUFunction` without its
    fp8 store and offload, which `SwiGLUDispatch` leaves to megatron)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(y)
        return swiglu(y)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return swiglu_back(g, y)


class SwiGLUDispatch:
    """Stands in for megatron's `SwiGLUFunction` in `fused_bias_swiglu` (`install`): eligible
    inputs without fp8 store or offload take `TritonSwiGLUFunction`, the rest megatron's class."""

    megatron_function: Any = None

    @classmethod
    def apply(cls, y: torch.Tensor, fp8_input_store: bool = False, cpu_offload_input: bool = False) -> torch.Tensor:
        if not fp8_input_store and not cpu_offload_input and eligible(y):
            return TritonSwiGLUFunction.apply(y)
        return cls.megatron_function.apply(y, fp8_input_store, cpu_offload_input)


def install() -> None:
    """Route megatron's bias-free fused SwiGLU through `SwiGLUDispatch`. Idempotent."""
    from megatron.core.fusions import fused_bias_swiglu as mf

    if mf.SwiGLUFunction is SwiGLUDispatch:
        return
    SwiGLUDispatch.megatron_function = mf.SwiGLUFunction
    mf.SwiGLUFunction = SwiGLUDispatch
