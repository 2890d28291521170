"""What the compile key costs a step on the host: `Compiler.model_key()` (modes, plain attributes, hooks, the step
function's values), read before every call, for a stack of N linear layers without hooks and with a forward hook
(reading a global weight) and a gradient hook on each.

    python benchmarks/model_key_cost.py [--layers 100] [--calls 200]
"""
import argparse
import time

import torch
import torch.nn as nn

import pstar_fx as px

WEIGHT = 1.0


def _hook(module, args, out):
    return out * WEIGHT


def _cost(layers: int, calls: int, hooks: bool) -> float:
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(layers)))
    if hooks:
        for lin in model:
            lin.register_forward_hook(_hook)
            lin.weight.register_hook(lambda g: g)
    step = px.compile(model, optimizer=px.SGD(lr=0.1), device="cpu")(lambda m, x: m(x).sum())
    key = step._compiler.model_key
    key()
    t0 = time.perf_counter()
    for _ in range(calls):
        key()
    return (time.perf_counter() - t0) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=100)
    ap.add_argument("--calls", type=int, default=200)
    a = ap.parse_args()
    torch.manual_seed(0)
    plain = _cost(a.layers, a.calls, hooks=False)
    hooked = _cost(a.layers, a.calls, hooks=True)
    print(f"{a.layers} layers: model_key {plain * 1e3:.3f} ms without hooks, {hooked * 1e3:.3f} ms with 2 hooks a "
          f"layer ({(hooked - plain) / (2 * a.layers) * 1e6:.1f} us a hook)")


if __name__ == "__main__":
    main()
