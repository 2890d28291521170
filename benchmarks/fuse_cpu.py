"""
Step time on the CPU of the example's GPT (examples/train_gpt.py: its preset, batch, two micro-batches, clipping at
1.0, AdamW with two groups, a budget of half the model data): eager PyTorch, pstar-fx with fuse=False and with
fuse=True, and the ratios to eager.

    python benchmarks/fuse_cpu.py                    # the example's default preset ("small"), 30 timed steps
    python benchmarks/fuse_cpu.py --model tiny --steps 10 --budget none

The systems run in turn, step by step, on the same batches (so that the machine's drift touches each alike): --warmup
steps (the compile and the first steps), then --steps timed ones. Each system's median step time is printed, and its
ratio to eager's (below 1: faster than eager), as the ratio of the medians and as the median of the per-step ratios.
Step by step, pstar-fx's host-side updates, which the step leaves running, overlap eager's next step and slow it: with
--run N each system instead runs N + 1 steps back to back per turn, as a training loop does (the first, which the
other system's leftover work may slow, not counted), the order rotating each round; the ratio is then each round's
ratio of medians, its median and quartiles over the --steps / N rounds.
Eager is nanoGPT's loop: backward per micro-batch (the loss divided by their number), clip_grad_norm_,
torch.optim.AdamW (its CPU default, foreach) with set_to_none zeroing. pstar-fx's step does the same in one compiled
call. fuse=True also prints its compile line (regions, nodes fused, seconds, cache hits).
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import pstar_fx as px  # noqa: E402
from pstar_fx.models.gpt import GPT, GPTConfig, Init  # noqa: E402

PRESETS = {   # examples/train_gpt.py's
    "tiny":   dict(n_layer=2, n_head=2, n_embd=128, block_size=16, batch_size=4),
    "small":  dict(n_layer=2, n_head=4, n_embd=256, block_size=32, batch_size=8),
    "medium": dict(n_layer=4, n_head=6, n_embd=384, block_size=32, batch_size=8),
}
VOCAB = 70      # the example corpus's characters


def gpt_loss(model, idx, targets):
    logits = model(idx)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def groups(model, opt_cls, **kw):
    params = [p for p in model.parameters() if p.requires_grad]
    return opt_cls([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                    {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                   lr=1e-3, betas=(0.9, 0.95), eps=1e-8, **kw)


def batches(cfg, n, accumulate):
    g = torch.Generator().manual_seed(0)
    b = cfg["batch_size"] * accumulate
    return [(torch.randint(VOCAB, (b, cfg["block_size"]), generator=g),
             torch.randint(VOCAB, (b, cfg["block_size"]), generator=g)) for _ in range(n)]


def build(cfg):
    torch.manual_seed(1337)
    return GPT(GPTConfig(vocab=VOCAB, seq=cfg["block_size"], layers=cfg["n_layer"], heads=cfg["n_head"],
                         hidden=cfg["n_embd"], init=Init.MODULES))


def eager_system(cfg, accumulate):
    """eager PyTorch: (a function running one step on a batch, a line to print after the run or None)."""
    model = build(cfg)
    opt = groups(model, torch.optim.AdamW)

    def one(x, y):
        for xs, ys in zip(x.chunk(accumulate), y.chunk(accumulate)):
            (gpt_loss(model, xs, ys) / accumulate).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return one, lambda: None


def pstar_system(cfg, accumulate, budget, fuse):
    model = build(cfg)
    step = px.compile(model, optimizer=groups(model, px.AdamW), device_memory=budget, device="cpu",
                      max_grad_norm=1.0, accumulate=accumulate, fuse=fuse)(gpt_loss)
    return step, lambda: step.summary().fused


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    ap.add_argument("--model", choices=sorted(PRESETS), default="small")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--accumulate", type=int, default=2)
    ap.add_argument("--budget", default="auto", help="'auto' (half the model data, as the example), 'none', or a "
                                                     "size such as 8MiB")
    ap.add_argument("--systems", default="eager,pstar,pstar-fused")
    ap.add_argument("--run", type=int, default=1, metavar="N",
                    help="steps each system runs back to back per turn (1: the systems alternate step by step)")
    args = ap.parse_args()
    cfg = PRESETS[args.model]
    n_params = sum(p.numel() for p in build(cfg).parameters())
    budget = {"auto": 16 * n_params // 2, "none": None}.get(args.budget.lower(), args.budget)
    data = batches(cfg, args.warmup + args.steps, args.accumulate)
    print(f"model '{args.model}': {n_params:,} parameters, batch {cfg['batch_size'] * args.accumulate}x"
          f"{cfg['block_size']} in {args.accumulate} micro-batches, budget {budget}, {torch.get_num_threads()} "
          f"threads, torch {torch.__version__}")
    makers = {"eager": lambda: eager_system(cfg, args.accumulate),
              "pstar": lambda: pstar_system(cfg, args.accumulate, budget, False),
              "pstar-fused": lambda: pstar_system(cfg, args.accumulate, budget, True)}
    names = args.systems.split(",")
    systems = {name: makers[name]() for name in names}
    if args.run > 1:
        by_runs(systems, names, data, args)
        return
    times: dict[str, list[float]] = {name: [] for name in names}
    for x, y in data:          # the systems in turn, step by step: drift hits each alike
        for name in names:
            t0 = time.perf_counter()
            systems[name][0](x, y)
            times[name].append(time.perf_counter() - t0)
    medians = {}
    for name in names:
        timed = times[name][args.warmup:]
        medians[name] = statistics.median(timed)
        fused = systems[name][1]()
        extra = f"  compile: {fused}" if fused else ""
        print(f"{name:>12s}: median {medians[name] * 1e3:8.2f} ms  (min {min(timed) * 1e3:.2f}, max "
              f"{max(timed) * 1e3:.2f}; first step {times[name][0]:.2f} s){extra}")
    if "eager" in medians:
        for name in names:
            if name != "eager":
                pairs = [a / b for a, b in zip(times[name][args.warmup:], times["eager"][args.warmup:])]
                print(f"{name:>12s} / eager: {medians[name] / medians['eager']:.3f} (ratio of medians); "
                      f"{statistics.median(pairs):.3f} (median of the {len(pairs)} steps' ratios)")


def by_runs(systems, names, data, args) -> None:
    """--run N: after --warmup steps of each, rounds of N + 1 back-to-back steps per system (the order rotating), the
    first of each not counted; per round each system's median, and the ratio to eager's."""
    for name in names:
        for x, y in data[:args.warmup]:
            systems[name][0](x, y)
    timed = data[args.warmup:]
    rounds = max(1, len(timed) // args.run)
    medians: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t = []
            for k in range(args.run + 1):
                x, y = timed[(r * args.run + k) % len(timed)]
                t0 = time.perf_counter()
                systems[name][0](x, y)
                t.append(time.perf_counter() - t0)
            medians[name].append(statistics.median(t[1:]))
    for name in names:
        print(f"{name:>12s}: median {statistics.median(medians[name]) * 1e3:8.2f} ms over {rounds} rounds of "
              f"{args.run} steps")
    if "eager" in medians:
        for name in names:
            if name != "eager":
                ratios = sorted(a / b for a, b in zip(medians[name], medians["eager"]))
                q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0], ratios[0], ratios[0])
                print(f"{name:>12s} / eager: {statistics.median(ratios):.3f} (median of the {len(ratios)} rounds' "
                      f"ratios; quartiles {q[0]:.3f}, {q[2]:.3f})")


if __name__ == "__main__":
    main()
