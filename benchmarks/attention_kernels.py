"""Attention kernels on this GPU: forward + backward time of causal bf16 attention at the benchmarks' shapes, per
torch SDPA backend, as TFLOP/s in the cost model's count (pstar_fx/cost.py: 4 B H T^2 D forward, halved by the causal
mask, backward 2.5x the forward), the largest difference from flash attention's output, and whether two runs give
the same gradients bit for bit.

    python benchmarks/attention_kernels.py [--shapes 8x16x2048x128,8x40x2048x128] [--repeat 20]

The cost model's attention_efficiency (the kernel torch picks by default: cuDNN's on the H200 with torch 2.11 and
CUDA 13), flash_attention_efficiency and efficient_attention_efficiency are these rates over its matmul rate
(pstar_fx/cost.py Machine).
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)


def run(q, k, v, g, keep=True):
    for t in (q, k, v):
        t.grad = None
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    o.backward(g)
    return (o.detach(), [t.grad.clone() for t in (q, k, v)]) if keep else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="8x16x2048x128,8x40x2048x128", help="B x heads x tokens x head size, ...")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'shape':22s} {'kernel':20s} {'fwd+bwd ms':>10s} {'TFLOP/s':>8s} {'max |o - flash|':>16s} {'repeatable':>10s}")
    for shape in args.shapes.split(","):
        B, H, T, D = (int(x) for x in shape.split("x"))
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, g = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        flops = 4 * B * H * T * T * D * 0.5 * 3.5
        flash = None
        for backend in BACKENDS:
            try:
                with sdpa_kernel([backend]):
                    o, grads = run(q, k, v, g)
                    again = run(q, k, v, g)
                    for _ in range(2):
                        run(q, k, v, g)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(args.repeat):
                        run(q, k, v, g, keep=False)
                    torch.cuda.synchronize()
                    dt = (time.perf_counter() - t0) / args.repeat
            except RuntimeError as e:
                print(f"{shape:22s} {backend.name:20s} unavailable: {str(e).splitlines()[0][:80]}")
                continue
            same = torch.equal(o, again[0]) and all(torch.equal(a, b) for a, b in zip(grads, again[1]))
            diff = "-" if flash is None else f"{(o - flash).abs().max().item():.3g}"
            flash = o if flash is None else flash
            print(f"{shape:22s} {backend.name:20s} {dt * 1e3:10.3f} {flops / dt / 1e12:8.1f} {diff:>16s} {str(same):>10s}")


if __name__ == "__main__":
    main()
