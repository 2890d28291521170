"""Recomputation (remat) on a GPU: a GPT under a budget that only fits with remat, against the same GPT unlimited.

    python3 benchmarks/remat_check.py --layers 12 --hidden 1024 --heads 16 --batch 8 --seq 1024

Prints the least budget without and with remat (step.min_device_memory), then per run: the recomputed nodes, the
plan's predicted peak, torch.cuda.max_memory_allocated, bytes moved and the median step time; the first step's loss
must be bit for bit the unlimited run's (same forward), the first step is also run with debug=True (the executor's
measured bytes after every node equal the plan's).
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "support"))
import pstar_fx as px                                   # noqa: E402
from pstar_fx.ir import REMAT                           # noqa: E402
from models import GPT, gpt_loss                        # noqa: E402


def run(model_fn, batches, budget, remat, steps):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    step = px.compile(model_fn(), optimizer=px.AdamW(lr=1e-4), device_memory=budget, precision="bf16",
                      device="cuda", debug=True, remat=remat)(gpt_loss)
    t0 = time.perf_counter()
    losses = [step(*batches[0]).item()]
    compile_s = time.perf_counter() - t0
    step.debug = False
    times = []
    for i in range(1, steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        losses.append(step(*batches[i % len(batches)]).item())
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    g = step.graphs["scheduled"]
    print(f"  budget {budget}: remat={remat} recomputed nodes {sum(REMAT in n.meta for n in g.nodes)} "
          f"(segments {len({n.meta[REMAT].segment for n in g.nodes if REMAT in n.meta})}), predicted peak "
          f"{g.plan.predicted_peak / 2**30:.2f} GiB, max_memory_allocated {torch.cuda.max_memory_allocated() / 2**30:.2f}"
          f" GiB, h2d {g.plan.h2d_bytes / 2**30:.2f} GiB, d2h {g.plan.d2h_bytes / 2**30:.2f} GiB per step, "
          f"first step {compile_s:.1f} s, median step {statistics.median(times):.3f} s, remat pass "
          f"{step.graphs['remat'].seconds:.2f} s", flush=True)
    return losses


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()

    def model_fn():
        torch.manual_seed(0)
        return GPT(vocab=a.vocab, block_size=a.seq, n_layer=a.layers, n_head=a.heads, n_embd=a.hidden)

    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, a.vocab, (a.batch, a.seq), generator=gen),
                torch.randint(0, a.vocab, (a.batch, a.seq), generator=gen)) for _ in range(3)]
    probe = px.compile(model_fn(), optimizer=px.AdamW(lr=1e-4), precision="bf16", device="cuda", remat=False)(gpt_loss)
    without = probe.min_device_memory(*batches[0])
    probe = px.compile(model_fn(), optimizer=px.AdamW(lr=1e-4), precision="bf16", device="cuda")(gpt_loss)
    t = time.perf_counter()
    with_remat = probe.min_device_memory(*batches[0])
    print(f"least budget: without remat {without / 2**30:.2f} GiB, with remat {with_remat / 2**30:.2f} GiB "
          f"({time.perf_counter() - t:.1f} s)", flush=True)
    free = run(model_fn, batches, None, "auto", a.steps)
    budget = (without + with_remat) // 2
    try:
        px.compile(model_fn(), optimizer=px.AdamW(lr=1e-4), device_memory=budget, precision="bf16", device="cuda",
                   remat=False)(gpt_loss).lower(*batches[0])
        print("  remat=False compiled at that budget (unexpected)")
    except px.BudgetError as e:
        print(f"  remat=False at {budget}: BudgetError ({str(e)[:80]}...)")
    tight = run(model_fn, batches, budget, "auto", a.steps)
    print("losses unlimited", [round(x, 5) for x in free])
    print("losses remat    ", [round(x, 5) for x in tight])
    print("first-step loss bit for bit:", tight[0] == free[0])


if __name__ == "__main__":
    main()
