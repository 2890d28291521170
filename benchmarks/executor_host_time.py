"""Host time per step, not GPU work: the 1.3B GPT's graph (24 layers) with kernels made
negligible (hidden 64, 2 x 64 tokens, vocab 512), on the CPU, pstar-fx's executor against eager PyTorch. For each, the
median step over 20 after 3 warm-up steps, and one profiled step split into torch operators' self time and the rest
(Python: the executor's interpreter loop and its bookkeeping, or eager's modules and autograd glue).

    python benchmarks/executor_host_time.py [--layers 24] [--threads 1]
    python benchmarks/executor_host_time.py --cpu-time      # only pstar-fx's median CPU time of 40 steps

`--cpu-time` counts the process's CPU time (time.process_time) rather than the wall clock, which a shared machine
makes noisy: compare two commits by running it at each, alternately, several times.
"""
import argparse
import statistics
import time

import torch

import pstar_fx as px
from pstar_fx.models.gpt import GPT, GPTConfig, gpt_loss

from host_pin_and_update import median_seconds  # benchmarks/, beside this file


def split_ms(fn) -> tuple[float, float]:
    """(wall, torch operators' self time) of one profiled step, in ms."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
    ops = sum(a.self_cpu_time_total for a in prof.key_averages() if a.key.startswith("aten::"))
    return wall * 1e3, ops / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: the least noise)")
    ap.add_argument("--cpu-time", action="store_true", help="print pstar-fx's median CPU time of 40 steps only")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=512, seq=64, layers=args.layers, hidden=64, heads=2)
    x, y = torch.randint(0, 512, (2, 64)), torch.randint(0, 512, (2, 64))
    model = GPT(cfg)
    eager_model = GPT(cfg)
    eager_model.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(eager_model.parameters(), lr=1e-4, fused=True)

    def eager_step():
        opt.zero_grad(set_to_none=True)
        gpt_loss(eager_model, x, y).backward()
        opt.step()

    step = px.compile(model, optimizer=px.AdamW(lr=1e-4), precision="fp32", device="cpu")(gpt_loss)
    step(x, y)
    nodes = len(step.final_graph.nodes)
    if args.cpu_time:
        times = []
        for _ in range(43):
            t0 = time.process_time()
            step(x, y)
            times.append(time.process_time() - t0)
        print(f"pstar-fx step {statistics.median(times[3:]) * 1e3:.1f} ms of CPU time (median of 40), {nodes} nodes")
        return
    print(f"GPT {args.layers} layers x d=64 on the CPU, {args.threads} thread(s); pstar-fx's graph: {nodes} nodes")
    for name, fn in (("eager", eager_step), ("pstar-fx", lambda: step(x, y))):
        med = median_seconds(fn, reps=20, warm=3) * 1e3
        wall, ops = split_ms(fn)
        print(f"{name:9s} step {med:6.1f} ms (median of 20); one profiled step {wall:6.1f} ms: torch operators "
              f"{ops:5.1f} ms, the rest {max(0.0, wall - ops):5.1f} ms"
              + (f" ({max(0.0, wall - ops) / nodes * 1e3:.1f} us per node)" if name == "pstar-fx" else ""))


if __name__ == "__main__":
    main()
