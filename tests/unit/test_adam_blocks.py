"""A host-side update runs block by block (runtime.adam.host_step); the blocks must round exactly as one pass over
the whole chunk does, whatever the block size, and an update that skips a chunk's zero padding as one over all of
it."""
import pytest
import torch

from pstar_fx.optim import AdamConfig
from pstar_fx.runtime.adam import host_step
from pstar_fx.runtime.optimizers import host_update

CFG = AdamConfig(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, decoupled=True, maximize=False,
                 fused=None)


def _state(n: int, mixed: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g)
    grad = torch.randn(n, generator=g) * 1e-2
    m, v = torch.randn(n, generator=g) * 1e-3, torch.rand(n, generator=g) * 1e-5
    if mixed:
        return dict(param=master.to(torch.bfloat16), grad=grad.to(torch.bfloat16), m=m, v=v, step=torch.tensor(3.0),
                    master=master)
    return dict(param=master, grad=grad, m=m, v=v, step=torch.tensor(3.0), master=None)


@pytest.mark.parametrize("mixed", [True, False])
@pytest.mark.parametrize("block", [4096, 1 << 14])
def test_blocks_round_as_one_pass(mixed, block):
    n = 5 * 4096 + 123            # several blocks and a partial last one
    whole, blocked = _state(n, mixed, 0), _state(n, mixed, 0)
    coef = torch.tensor(0.37)
    for s, b in ((whole, n), (blocked, block)):
        host_step(CFG, s["param"], s["grad"], s["m"], s["v"], s["step"], master=s["master"],
                  inv_scale=0.5 if mixed else None, coef=coef, block=b)
    for k in ("param", "m", "v", "step") + (("master",) if mixed else ()):
        assert torch.equal(whole[k], blocked[k]), k
    assert not torch.equal(whole["m"], _state(n, mixed, 0)["m"])      # it did update


@pytest.mark.parametrize("mixed", [True, False])
@pytest.mark.parametrize("live", [0, 1, 4096, 7168, 3 * 4096 + 5])
def test_padding_skipped_rounds_as_the_whole_chunk(mixed, live):
    """host_update(live=...) updates only the prefix that can hold parameters (runtime.optimizers.live_prefix): a
    chunk whose padding is zero everywhere ends bit for bit as after the update of every element, padding included
    (still +0.0)."""
    n = 5 * 4096
    whole, prefix = _state(n, mixed, 1), _state(n, mixed, 1)
    for s in (whole, prefix):
        for k in ("param", "grad", "m", "v", "master"):
            if s[k] is not None:
                s[k][live:] = 0
    coef = torch.tensor(0.37)
    for s, arg in ((whole, None), (prefix, live)):
        parts = {"exp_avg": s["m"], "exp_avg_sq": s["v"], "step": s["step"],
                 **({"master": s["master"]} if mixed else {})}
        host_update(CFG, s["param"], s["grad"], parts, master=s["master"], inv_scale=0.5 if mixed else None,
                    coef=coef, skip=False, live=arg)
    for k in ("param", "m", "v", "step") + (("master",) if mixed else ()):
        assert torch.equal(whole[k], prefix[k]), k
        if k != "step":
            assert not torch.signbit(prefix[k][live:]).any() and not prefix[k][live:].any(), k
    assert not torch.equal(whole["m"][:live], _state(n, mixed, 1)["m"][:live]) or live == 0    # it did update
