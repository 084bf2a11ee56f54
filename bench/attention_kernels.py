"""Causal attention kernels on one GPU: what the packed path uses (flash-attention varlen) against
SDPA's backends (cuDNN, flash, memory-efficient) and FlexAttention, forward + backward, on the 1.5B
critic's heads.

    python bench/attention_kernels.py [--lengths 4096,8192,32768] [--heads 12 --kv-heads 2 --dim 128]

Each row is one micro-batch of `tokens` tokens made of sequences of `length` tokens (so a 32k
micro-batch of 4k rows holds 8 sequences); SDPA runs one call per sequence (the packed path's
alternative), GQA by `enable_gqa` or by repeating K/V (what Hugging Face's sdpa attention does).
Prints ms per forward + backward and the achieved TFLOP/s (causal: 2 * 2 * s^2/2 * heads * dim
forward, 2.5x that for forward + backward). Also checks each kernel's output against varlen's.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn, warmup: int = 2, iters: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def flex(q, k, v, cu, t: int):
    """FlexAttention (torch.compile'd Triton kernel) over the whole packed micro-batch: one call,
    a block mask that is causal within each sequence (the document mask of packed rows), GQA by
    `enable_gqa`. Built lazily, so a torch without it prints n/a like any unsupported backend."""
    state: dict = {}

    def run():
        if not state:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            doc = torch.searchsorted(cu[1:], torch.arange(t, device=cu.device), right=True)

            def causal_doc(b, h, qi, ki):
                return (doc[qi] == doc[ki]) & (qi >= ki)

            state["mask"] = create_block_mask(causal_doc, None, None, t, t, device=str(cu.device))
            state["fn"] = torch.compile(flex_attention)
        o = state["fn"](
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            block_mask=state["mask"],
            scale=q.shape[-1] ** -0.5,
            enable_gqa=True,
        )
        return o.squeeze(0).transpose(0, 1)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="2048,4096,8192,16384,32768")
    ap.add_argument("--tokens", type=int, default=32768, help="tokens per micro-batch")
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=128)
    args = ap.parse_args()
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    params = set(inspect.signature(varlen_attn).parameters)

    h, g, d = args.heads, args.kv_heads, args.dim
    scale = d**-0.5
    print(
        f"torch {torch.__version__}, {torch.cuda.get_device_name()}, heads {h}/{g}, dim {d}, {args.tokens} tokens per "
        "micro-batch"
    )
    print(f"{'length':>7} {'seqs':>4}  {'kernel':<28} {'ms fwd+bwd':>10} {'TFLOP/s':>8} {'max |diff|':>10}")
    for length in [int(x) for x in args.lengths.split(",")]:
        n = max(1, args.tokens // length)
        t = n * length
        torch.manual_seed(0)
        q = torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(t, g, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(t, g, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16)
        cu = torch.arange(0, t + 1, length, device="cuda", dtype=torch.int32)
        flops = 2.5 * 2 * 2 * (length * (length + 1) / 2) * h * d * n

        def varlen(q=q, k=k, v=v, cu=cu, length=length):  # as value_assets/gpu/model/attention.py calls it (K/V
            # repeated where it has no GQA); the loop's tensors bound now
            kw = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
            if "enable_gqa" in params:
                return varlen_attn(q, k, v, cu, cu, length, length, scale=scale, enable_gqa=True, **kw)
            kr, vr = k.repeat_interleave(h // g, dim=1), v.repeat_interleave(h // g, dim=1)
            return varlen_attn(q, kr, vr, cu, cu, length, length, scale=scale, **kw)

        def sdpa(backend, repeat, q=q, k=k, v=v, n=n, length=length):
            def run():
                outs = []
                for i in range(n):
                    s = slice(i * length, (i + 1) * length)
                    qs = q[s].transpose(0, 1).unsqueeze(0)
                    ks, vs = k[s].transpose(0, 1).unsqueeze(0), v[s].transpose(0, 1).unsqueeze(0)
                    if repeat:
                        ks, vs = ks.repeat_interleave(h // g, dim=1), vs.repeat_interleave(h // g, dim=1)
                    with sdpa_kernel([backend]):
                        o = F.scaled_dot_product_attention(
                            qs, ks, vs, is_causal=True, scale=scale, enable_gqa=not repeat
                        )
                    outs.append(o.squeeze(0).transpose(0, 1))
                return torch.cat(outs)

            return run

        ref = varlen().detach().float()
        kernels = [("varlen (flash, packed path)", varlen)]
        for name, backend in (
            ("cudnn", SDPBackend.CUDNN_ATTENTION),
            ("flash", SDPBackend.FLASH_ATTENTION),
            ("efficient", SDPBackend.EFFICIENT_ATTENTION),
        ):
            for repeat in (False, True):
                kernels.append((f"sdpa {name} {'repeat kv' if repeat else 'gqa'}", sdpa(backend, repeat)))
        kernels.append(("flex (packed, document mask)", flex(q, k, v, cu, t)))
        for name, fn in kernels:
            try:
                out = fn()
                diff = (out.detach().float() - ref).abs().max().item()
                ms = timed(lambda fn=fn, grad=grad: fn().backward(grad))
                print(f"{length:>7} {n:>4}  {name:<28} {ms:>10.2f} {flops / ms / 1e9:>8.1f} {diff:>10.2e}", flush=True)
            except Exception as exc:  # noqa: BLE001  (a backend that does not support the case)
                print(
                    f"{length:>7} {n:>4}  {name:<28} {'n/a':>10} {'':>8} {type(exc).__name__}: {str(exc)[:60]}",
                    flush=True,
                )
            q.grad = k.grad = v.grad = None


if __name__ == "__main__":
    main()
