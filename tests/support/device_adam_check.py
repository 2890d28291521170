"""The GPU's one-pass update of compressed moments (pstar_fx.runtime.device_adam) against the native CPU kernel on
the same inputs: parameter, codes and scales compared bit for bit (NaNs alike) over several steps, with every
option, moments over many orders of magnitude, zeros, NaN and inf, and a tail block. Run on `device` (a CUDA device, or "cpu" under
TRITON_INTERPRET=1, which the test sets for it in a subprocess); prints one line per case and exits 1 on a
difference. Usage: python device_adam_check.py DEVICE"""
import sys

import torch

from pstar_fx.optim import ADAM_STATE, INT8_BLOCK, AdamConfig, StateDtype
from pstar_fx.runtime import device_adam, native
from pstar_fx.runtime.quantize import seed

CHUNK, FIRST = 7, 3 * INT8_BLOCK


def _gradient(n: int, gen: torch.Generator, step: int) -> torch.Tensor:
    g = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-8, 2, (n,), generator=gen).float()
    g[::53] = 0
    if step == 2 and n > 3 * INT8_BLOCK:      # one block's moments turn non-finite
        g[2 * INT8_BLOCK + 5] = float("inf")
        g[INT8_BLOCK + 9] = float("nan")
    return g


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, every NaN alike (a NaN's payload and sign are not the update's: the CPU writes bf16's as 0xFFFF)."""
    a, b = a.reshape(-1), b.reshape(-1)
    if a.is_floating_point():
        if not torch.equal(a.isnan(), b.isnan()):
            return False
        a, b = a[~a.isnan()], b[~b.isnan()]
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def compare(device: str, n: int = 4 * INT8_BLOCK * 8 + 3 * INT8_BLOCK + 17, steps: int = 3) -> list[str]:
    """The differences found (empty: bit for bit)."""
    kernels = native.kernels()
    assert kernels is not None, native.why_not()
    assert device_adam.why_not() is None, device_adam.why_not()
    bad = []
    for dtype in (StateDtype.BF16, StateDtype.INT8):
        for decoupled, maximize, wd in ((True, False, 0.1), (False, True, 0.01), (False, False, 0.0)):
            cfg = AdamConfig(lr=2e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=wd, decoupled=decoupled,
                             maximize=maximize, fused=None)
            layout = ADAM_STATE.with_dtype(dtype)
            gen = torch.Generator().manual_seed(11)
            cpu = layout.parts(torch.zeros(layout.floats(n, False)), n, False)
            dev = layout.parts(torch.zeros(layout.floats(n, False), device=device), n, False)
            p_cpu = torch.randn(n, generator=gen)
            p_dev = p_cpu.to(device, copy=True)
            for step in range(1, steps + 1):
                g = _gradient(n, gen, step)
                cpu["step"] += 1
                dev["step"] += 1
                kernels.adam(cfg, float(cpu["step"]), p_cpu, None, g, cpu, FIRST, int(seed(CHUNK, cpu["step"])))
                device_adam.adam(cfg, p_dev, g.to(device), dev, dev["step"], CHUNK, FIRST)
                what = f"{dtype.value} decoupled={decoupled} maximize={maximize} step {step}"
                diff = [k for k in cpu if not _same(cpu[k], dev[k].cpu())]
                if not _same(p_cpu, p_dev.cpu()):
                    diff.append(f"parameter (largest difference {(p_cpu - p_dev.cpu()).abs().nan_to_num().max():.3g})")
                if diff:
                    bad.append(f"{what}: {', '.join(diff)} differ")
                print(f"{what}: {'differs: ' + ', '.join(diff) if diff else 'bit for bit'}", flush=True)
    return bad


if __name__ == "__main__":
    sys.exit(1 if compare(sys.argv[1]) else 0)
