"""The CPU worker's Adam update rate per state_dtype: one mixed-precision host-side update (bf16 parameters and
gradient, fp32 master) of a chunk of --chunk elements through `pstar_fx.runtime.optimizers.host_update`, the moments
fp32 (exact), bf16 or int8, in Gparam/s (median of --repeat after one warm-up) on --threads intra-op threads
(default: torch's). Every kind goes through a native one-pass kernel where it is built (the first line says whether;
exact moments only where it reproduces torch's fused kernel here, which the first line says too), else (or with
PSTAR_FX_NATIVE=0) through the torch route: exact moments block by block around torch's fused kernel, compressed
ones dequantised, updated and quantised back block by block, in blocks of each of --blocks elements.

    python3 benchmarks/state_update_rate.py [--chunk 16777216] [--threads 14] [--repeat 3] [--blocks 262144,1048576]
    PSTAR_FX_NATIVE=0 python3 benchmarks/state_update_rate.py      # the torch route
    python3 benchmarks/state_update_rate.py --device cuda          # device-placed states (fp32 parameters)

--device cuda times the update of device-placed states instead (optimizers.device_step: fp32 parameter and
gradient on the GPU, compressed moments through the one-pass Triton kernel, runtime/device_adam.py, or with
PSTAR_FX_NATIVE=0 the torch route and its scratch), each update synchronised.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from pstar_fx.optim import ADAM_STATE, AdamConfig, StateDtype
from pstar_fx.runtime.adam import HOST_PACKED_BLOCK
from pstar_fx.runtime import native
from pstar_fx.runtime.optimizers import device_step, host_update
from pstar_fx.runtime.quantize import Packed, scratch_floats

CFG = AdamConfig(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, decoupled=True, maximize=False,
                 fused=None)


def rate(dtype: StateDtype, numel: int, repeat: int, block: int) -> float:
    layout = ADAM_STATE.with_dtype(dtype)
    buf = torch.zeros(layout.floats(numel, True))
    parts = layout.parts(buf, numel, True)
    parts["master"].normal_()
    param = parts["master"].to(torch.bfloat16)
    grad = torch.randn(numel).to(torch.bfloat16)
    times = []
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        host_update(CFG, param, grad, parts, master=parts["master"], inv_scale=None, coef=None, skip=False,
                    packed_block=block)
        times.append(time.perf_counter() - t0)
    return numel / statistics.median(times[1:]) / 1e9


def device_rate(dtype: StateDtype, numel: int, repeat: int, device: torch.device) -> float:
    layout = ADAM_STATE.with_dtype(dtype)
    parts = layout.parts(torch.zeros(layout.floats(numel, False), device=device), numel, False)
    param, grad = torch.randn(numel, device=device), torch.randn(numel, device=device)
    scratch = torch.empty(scratch_floats(numel), device=device) if dtype.compressed else None
    times = []
    for _ in range(repeat + 1):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        device_step(CFG, param, grad, parts, None if scratch is None else Packed(parts, 0, 0, scratch))
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return numel / statistics.median(times[1:]) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunk", type=int, default=1 << 24, help="elements of the updated chunk")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--blocks", default=str(HOST_PACKED_BLOCK),
                    help="comma-separated elements per block of a compressed update (default: the CPU worker's)")
    ap.add_argument("--device", default="cpu", help="cpu: the CPU worker's update; cuda: device-placed states")
    args = ap.parse_args()
    if args.device != "cpu":
        device = torch.device(args.device)
        from pstar_fx.runtime import device_adam
        print(f"device {torch.cuda.get_device_name(device)}, chunk {args.chunk:,} elements, fp32 parameters, "
              "compressed moments through " + ("the one-pass Triton kernel" if device_adam.why_not() is None else
                                               f"the torch route ({device_adam.why_not()})"))
        base = device_rate(StateDtype.FP32, args.chunk, args.repeat, device)
        print(f"state_dtype fp32: {base:7.2f} Gparam/s", flush=True)
        for dtype in (StateDtype.BF16, StateDtype.INT8):
            r = device_rate(dtype, args.chunk, args.repeat, device)
            print(f"state_dtype {dtype.value:>4s}: {r:7.2f} Gparam/s ({base / r:4.1f}x the time of fp32)", flush=True)
        return
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    kernels = native.kernels()
    print(f"chunk {args.chunk:,} elements, {torch.get_num_threads()} threads, compressed moments through "
          + ("the native kernel" if kernels else f"the torch route ({native.why_not()})"))
    base = rate(StateDtype.FP32, args.chunk, args.repeat, HOST_PACKED_BLOCK)
    if kernels is not None:
        exact = kernels.verified.get(native.exact_kind(CFG, torch.bfloat16, torch.bfloat16))
        print("exact moments through " + ("the native kernel (torch's bits, checked)" if exact else
                                          "the torch route (the native kernel's bits differ from torch's here)"))
    blocks = [int(b) for b in args.blocks.split(",")] if kernels is None else [HOST_PACKED_BLOCK]
    print(f"state_dtype fp32: {base:6.3f} Gparam/s", flush=True)
    for dtype in (StateDtype.BF16, StateDtype.INT8):
        for block in blocks:
            r = rate(dtype, args.chunk, args.repeat, block)
            how = "one pass" if kernels else f"blocks of {block:>9,}"
            print(f"state_dtype {dtype.value:>4s}, {how}: {r:6.3f} Gparam/s ({base / r:4.1f}x the time of fp32)",
                  flush=True)


if __name__ == "__main__":
    main()
