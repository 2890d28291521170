"""
Step time of the GPT of BENCHMARKS.md's 1.3B row (24 layers x 2048, 16 heads, vocab 50304, sequence 2048, batch 8,
bf16 autocast, fused AdamW) on one GPU: eager PyTorch, torch.compile'd eager, pstar-fx with fuse=False and with
fuse=True; the same model, batch and optimizer settings; median step times, ratios to eager, compile times.

    python benchmarks/fuse_gpu.py                                        # the 1.3B GPT, unlimited budget
    python benchmarks/fuse_gpu.py --layers 32 --hidden 4096 --heads 32 --batch 4   # the 6.66B shape (BENCHMARKS.md)
    python benchmarks/fuse_gpu.py --device cpu --layers 1 --hidden 64 --heads 2 --seq 32 --batch 2 --vocab 128 \\
        --steps 2 --warmup 1 --precision fp32                            # a smoke run on the CPU

Each system runs in this process one after the other, the model rebuilt from the same seed for each; memory is
freed between them. Eager: the model on the device in fp32, torch.autocast(bf16), torch.optim.AdamW(fused=True).
torch.compile: the same with the model's forward compiled (default mode). eager-cudnn and torch.compile-cudnn (not run
unless named in --systems): the same with cuDNN's attention kernel first (torch 2.11 with CUDA 13 already puts it
first on Hopper GPUs; older builds put flash attention first). torch.compile-autotune (named only): mode
"max-autotune-no-cudagraphs" (matrix products chosen among cuBLAS and Triton templates by timing them; on an H100
cuBLAS won every one of the 1.3B GPT's, and the step was no faster). pstar-fx: px.compile(precision=bf16,
device_memory=--budget), px.AdamW(fused=None), fuse=False and fuse=True; its compile time is the first step's, and
for fuse=True the summary's line (regions, nodes fused, seconds compiling, cache hits) is printed; each pstar-fx
system's step.summary() is printed after its steps.
"""
import argparse
import contextlib
import gc
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import pstar_fx as px  # noqa: E402
from pstar_fx.models.gpt import GPT, GPTConfig  # noqa: E402

HYPER = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def loss_fn(model, idx, targets):
    logits = model(idx)
    return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(args):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, hidden=args.hidden, heads=args.heads))


def eager(args, device, data, compiled: bool, cudnn: bool = False, mode: str | None = None):
    """cudnn: torch's SDPA with cuDNN's attention kernel first (benchmarks/attention_kernels.py times the kernels);
    mode: torch.compile's."""
    model = build(args).to(device)
    opt = torch.optim.AdamW(model.parameters(), **HYPER, fused=device.type == "cuda")
    fwd = torch.compile(model, mode=mode) if compiled else model
    half = args.precision != "fp32"

    def step(x, y):
        kernels = (sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH], set_priority=True)
                   if cudnn else contextlib.nullcontext())
        with kernels:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=half):
                loss = loss_fn(fwd, x, y)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def pstar(args, device, data, fuse: bool):
    model = build(args)
    return px.compile(model, optimizer=px.AdamW(**HYPER), device_memory=args.budget, device=device,
                      precision=args.precision, fuse=fuse)(loss_fn)


def timed(make, device, data, warmup):
    t0 = time.perf_counter()
    step = make()
    times = []
    for x, y in data:
        t = time.perf_counter()
        step(x, y)
        sync(device)
        times.append(time.perf_counter() - t)
    compile_s = time.perf_counter() - t0 - sum(times[1:])     # building it and the first step
    fused = step.summary().fused if isinstance(step, px.CompiledStep) else None
    if isinstance(step, px.CompiledStep):
        print(step.summary(), flush=True)     # the plan, the estimate, what moved, the allocator's retries
    del step
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(times[warmup:]), compile_s, fused


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--budget", default=None, help="pstar-fx's device_memory (default: unlimited)")
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--systems", default="eager,torch.compile,pstar,pstar-fused")
    args = ap.parse_args()
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(args.vocab, (args.batch, args.seq), generator=g).to(device),
             torch.randint(args.vocab, (args.batch, args.seq), generator=g).to(device))
            for _ in range(args.warmup + args.steps)]
    if args.budget is None and device.type == "cpu":
        args.budget = "none"
    args.budget = None if args.budget in (None, "none") else args.budget
    print(f"GPT {args.layers} x {args.hidden}, {args.heads} heads, vocab {args.vocab}, batch {args.batch} x "
          f"{args.seq}, {args.precision}, budget {args.budget or 'unlimited'}, on {device}, torch {torch.__version__}")
    makers = {"eager": lambda: eager(args, device, data, False),
              "torch.compile": lambda: eager(args, device, data, True),
              "eager-cudnn": lambda: eager(args, device, data, False, cudnn=True),
              "torch.compile-cudnn": lambda: eager(args, device, data, True, cudnn=True),
              "torch.compile-autotune": lambda: eager(args, device, data, True, mode="max-autotune-no-cudagraphs"),
              "pstar": lambda: pstar(args, device, data, False),
              "pstar-fused": lambda: pstar(args, device, data, True)}
    medians = {}
    for name in args.systems.split(","):
        med, compile_s, fused = timed(makers[name], device, data, args.warmup)
        medians[name] = med
        print(f"{name:>22s}: median step {med:.4f} s, compile + first step {compile_s:.1f} s"
              + (f"; fused: {fused}" if fused else ""), flush=True)
    if "eager" in medians:
        for name, m in medians.items():
            if name != "eager":
                print(f"{name:>22s} / eager: {m / medians['eager']:.3f}")


if __name__ == "__main__":
    main()
