"""The GPU's one-pass update of compressed moments (pstar_fx.runtime.device_adam, a Triton kernel): bit for bit the
native CPU kernel's on the same inputs (on a GPU, or on the CPU through Triton's interpreter where Triton is installed
without a GPU); taken by a device update on the GPU, not elsewhere; refused with a reason."""
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pstar_fx.optim import ADAM_STATE, AdamConfig, StateDtype
from pstar_fx.runtime import device_adam, native
from pstar_fx.runtime.optimizers import device_step
from pstar_fx.runtime.quantize import Packed, scratch_floats

import device_adam_check

HAVE_TRITON = device_adam.why_not() is None
CUDA = torch.cuda.is_available()
CFG = AdamConfig(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, decoupled=True, maximize=False,
                 fused=None)


@pytest.mark.cuda
@pytest.mark.skipif(not (CUDA and HAVE_TRITON and native.kernels() is not None), reason="needs a GPU, Triton and cc")
def test_gpu_kernel_is_the_native_kernel_bit_for_bit():
    assert device_adam_check.compare("cuda") == []


@pytest.mark.skipif(CUDA or not HAVE_TRITON or native.kernels() is None,
                    reason="the interpreter's run, for machines with Triton and cc but no GPU")
def test_interpreted_kernel_is_the_native_kernel_bit_for_bit():
    env = dict(os.environ, TRITON_INTERPRET="1")
    script = Path(device_adam_check.__file__)
    done = subprocess.run([sys.executable, str(script), "cpu"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("bit for bit") == 18, done.stdout


def _device_parts(dtype: StateDtype, n: int, device) -> dict:
    layout = ADAM_STATE.with_dtype(dtype)
    parts = layout.parts(torch.zeros(layout.floats(n, False), device=device), n, False)
    return parts


def test_taken_only_for_fused_updates_of_fp32_gpu_tensors():
    p, g = torch.randn(1000), torch.randn(1000)
    assert not device_adam.takes(CFG, p, g)                      # the CPU: the native kernel's
    if CUDA:
        pc, gc = p.cuda(), g.cuda()
        assert device_adam.takes(CFG, pc, gc) == HAVE_TRITON
        assert not device_adam.takes(dataclasses.replace(CFG, fused=False), pc, gc)
        assert not device_adam.takes(CFG, pc.half(), gc.half())


def test_reason_given_when_not_used(monkeypatch):
    monkeypatch.setenv("PSTAR_FX_NATIVE", "0")
    device_adam._triton.cache_clear()
    try:
        assert device_adam.why_not() == "PSTAR_FX_NATIVE=0"
    finally:
        monkeypatch.delenv("PSTAR_FX_NATIVE")
        device_adam._triton.cache_clear()
    reason = device_adam.why_not()
    assert reason is None or "triton" in reason.lower(), reason


@pytest.mark.cuda
@pytest.mark.skipif(not (CUDA and HAVE_TRITON), reason="needs a GPU and Triton")
@pytest.mark.parametrize("dtype", [StateDtype.BF16, StateDtype.INT8])
def test_device_step_runs_the_kernel_and_follows_the_torch_route(dtype):
    """device_step on the GPU (what the runtime calls) gives the kernel's bits; the torch route (fused=False: op by
    op through scratch) lands within the moments' rounding of it."""
    n = 300_000
    gen = torch.Generator().manual_seed(5)
    p0, grads = torch.randn(n, generator=gen), [torch.randn(n, generator=gen) * 1e-2 for _ in range(3)]
    runs = {}
    for name, cfg in (("kernel", CFG), ("direct", CFG), ("torch", dataclasses.replace(CFG, fused=False))):
        parts = _device_parts(dtype, n, "cuda")
        p = p0.cuda()
        scratch = torch.empty(scratch_floats(n), device="cuda")
        for g in grads:
            if name == "direct":
                parts["step"] += 1
                device_adam.adam(cfg, p, g.cuda(), parts, parts["step"], 4, 0)
            else:
                device_step(cfg, p, g.cuda(), parts, Packed(parts, 4, 0, scratch))
        runs[name] = p.cpu()
    assert torch.equal(runs["kernel"], runs["direct"])
    assert (runs["kernel"] - runs["torch"]).abs().max() < 1e-4 * 3
