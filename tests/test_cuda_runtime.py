"""CUDA-only runtime checks, run on the GPU machine with PSTAR_TEST_DEVICE=cuda by benchmarks/cuda_check.sh
(skipped, and reported as skipped, on a machine without CUDA)."""
import pytest
import torch
import torch.nn as nn

import pstar_fx as px

from harness import host_params
from models import Case, assert_state_close

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class _DetachedReuse(nn.Module):
    """W is read again (detached) in backward after its gradient is final, so under a tight budget its chunk is
    fetched again right before a host-side optimizer step of that chunk."""

    def __init__(self, d):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.W0 = nn.Parameter(torch.randn(d, d, generator=g) / d ** 0.5)
        self.W = nn.Parameter(torch.randn(d, d, generator=g) / d ** 0.5)

    def forward(self, x):
        return torch.relu(torch.relu(x @ self.W0) @ self.W.detach()) @ self.W


def test_host_step_waits_for_copies_still_reading_its_host_buffer():
    """A host-side step must not write a host buffer that an async host->device copy is still reading."""
    d = 4096
    x = torch.randn(64, d, generator=torch.Generator().manual_seed(1))
    fn = lambda m, x: m(x).pow(2).mean()   # noqa: E731
    make = lambda budget: px.compile(_DetachedReuse(d), optimizer=px.AdamW(lr=1e-2), device="cuda",  # noqa: E731
                                     precision="fp32", chunk_size=d * d, device_memory=budget)(fn)
    step = make(int(make(None).min_device_memory(x)))
    losses = [step(x).item() for _ in range(3)]
    assert host_params(step), "the budget should put some optimizer states on the host"

    case = Case("detached_reuse", lambda: _DetachedReuse(d), fn, lambda i, gen: (x,))
    from harness import eager_run
    ref_losses, ref_sd = eager_run(case, 3, hyper=dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8,
                                                                             weight_decay=1e-2),
                                   host_params=host_params(step))
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    assert_state_close(step.state_dict(), ref_sd, rtol=1e-6)
