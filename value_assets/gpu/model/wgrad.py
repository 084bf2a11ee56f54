"""Weight gradients accumulated into megatron's fp32 `main_grad` by the GEMM itself, on CUDA.

Without Apex, megatron's linear layers (`ColumnParallelLinear`, `RowParallelLinear`) run with
`gradient_accumulation_fusion=False`: each micro-batch's weight-gradient GEMM writes a bf16
`weight.grad`, and megatron's DDP hook then adds it into the fp32 `main_grad` buffer
(`main_grad.add_(grad)`): one more kernel per weight per micro-batch that reads the bf16 gradient
and reads and writes the fp32 buffer, and a rounding of every micro-batch's gradient to bf16 before
it is summed. The 1.5B critic's step spent 3.3% of its kernel time in those adds on an H100
(bench/results/h100-train-throughput-triton-swiglu-2026-12-08.log, `aten::add_`).

With the fusion, megatron calls Apex's `fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(input,
grad_output, main_grad)` instead and hands DDP a placeholder gradient (`grad_added_to_main_grad`).
This module stands in for that Apex extension with torch's own cuBLAS GEMM that takes bf16/fp16
inputs and accumulates into an fp32 output in place (`torch.addmm(main_grad, g.T, x, torch.float32,
out=main_grad)`, torch >= 2.8): the product is accumulated in fp32 and added to the buffer in the
GEMM's epilogue, with no bf16 rounding of the micro-batch's gradient.

Off (`FUSED_WGRAD = False`) until it has passed the GPU tier (tests/gpu/test_wgrad_gpu.py) and paid in
the bench (`bench/train_throughput.py --fused-wgrad`); written 2026-12-08 with no GPU lent. megatron's
fused path allocates its placeholder on CUDA, so on CPU the fusion is never configured
(`enabled(cuda=False)` is False).
"""

from __future__ import annotations

import types
import warnings

import torch

from value_assets.core.errors import exc_summary

# Off until the GPU tier and the bench have run it (see the module docstring). True: on CUDA the
# critic's linear layers accumulate their weight gradients into main_grad through `wgrad_gemm_accum_fp32`.
FUSED_WGRAD = False
# None: the fp32-output GEMM not tried yet; True: it ran; False: unavailable here (the unfused sum from then on)
_dtype_gemm: bool | None = None


def enabled(cuda: bool) -> bool:
    """Whether a critic built now (on CUDA or not) sets megatron's `gradient_accumulation_fusion`."""
    return bool(FUSED_WGRAD and cuda)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad (fp32, [out, in]) += grad_output^T @ total_input ([tokens, out], [tokens, in]; 3-D
    inputs are flattened over their leading dimensions), the product accumulated in fp32."""
    if main_grad.dtype != torch.float32:
        raise TypeError(f"wgrad_gemm_accum_fp32: main_grad must be float32, got {main_grad.dtype}")
    g, x = _flat(grad_output), _flat(total_input)
    if g.dtype == torch.float32 and x.dtype == torch.float32:
        main_grad.addmm_(g.t(), x)
    elif g.is_cuda:
        _fp32_output_gemm(main_grad, g, x)
    else:  # CPU bf16/fp16 (tests): the same sum, in fp32 operands
        main_grad.addmm_(g.t().float(), x.float())


def _fp32_output_gemm(main_grad: torch.Tensor, g: torch.Tensor, x: torch.Tensor) -> None:
    """main_grad += g^T @ x by cuBLAS with bf16/fp16 inputs and the fp32 output accumulated in place;
    where this torch lacks that GEMM (the first call fails), megatron's unfused numerics (the product
    in the inputs' dtype, then added), with a warning, from then on."""
    global _dtype_gemm
    if _dtype_gemm is not False:
        try:
            torch.addmm(main_grad, g.t(), x, torch.float32, out=main_grad)
        except (TypeError, RuntimeError) as exc:
            if _dtype_gemm:  # it ran before: a later failure is a real one
                raise
            _dtype_gemm = False
            warnings.warn(
                f"torch's fp32-output GEMM is not available here ({exc_summary(exc)}); the weight gradients "
                "are computed in the inputs' dtype and added to main_grad (megatron's unfused numerics)",
                RuntimeWarning,
                stacklevel=2,
            )
        else:
            _dtype_gemm = True
            return
    main_grad.add_(torch.mm(g.t(), x))


def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad (bf16/fp16, the inputs' dtype) += grad_output^T @ total_input."""
    main_grad.addmm_(_flat(grad_output).t(), _flat(total_input))


EXTENSION = types.SimpleNamespace(
    wgrad_gemm_accum_fp32=wgrad_gemm_accum_fp32, wgrad_gemm_accum_fp16=wgrad_gemm_accum_fp16
)


def install() -> None:
    """Make megatron's linear layers find `EXTENSION` where they look for Apex's
    `fused_weight_gradient_mlp_cuda` (their module global, read at each backward; and the flag their
    constructors check). Only where megatron has no extension of its own. Idempotent."""
    from megatron.core.tensor_parallel import layers

    if (
        getattr(layers, "_grad_accum_fusion_available", False)
        and getattr(layers, "fused_weight_gradient_mlp_cuda", EXTENSION) is not EXTENSION
    ):
        return  # Apex is installed: megatron uses its own kernel
    layers.fused_weight_gradient_mlp_cuda = EXTENSION  # type: ignore[attr-defined]
    layers._grad_accum_fusion_available = True
