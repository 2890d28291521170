"""
Soak test: a long CPU run of a small GPT under a tight budget with alternating batch shapes, checked against eager.

    python benchmarks/soak.py                    # 2000 steps (several minutes on 2 cores)
    python benchmarks/soak.py --steps 200        # a quick look

Each step alternates between two sequence lengths (--seqs, default 32 and 64), so the step switches between two
compiled signatures every call. Eager PyTorch (the same model, torch.optim.AdamW(fused=True), same hyperparameters)
runs alongside on the same batches. At the end it prints the figures and checks, exiting 1 if any check fails:
- losses equal to eager: every --compare-every'th step, within 1e-6 relative (fp32; the numerics policy);
- resident memory (RSS, from /proc/self/statm) flat after warm-up: the least-squares slope over the second half of
  the run, times 1000 steps, below --rss-bound-mib (default 1 MiB per 1000 steps, 1 KiB a step);
- step time flat: the median of the last 10% of steps within --time-ratio (default 1.3x) of the median of the 10%
  after warm-up (a shared machine is noisy, hence medians);
- the trace cache bounded: exactly one compile per distinct shape (2), and the cache holds no more;
- the last step's measured device peak equals the plan's prediction, within the budget.
The first --warmup steps (default 10% of the run) are excluded from the RSS and time checks.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import pstar_fx as px  # noqa: E402
from gpt import GPT, GPTConfig, gpt_loss  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")
MiB = 2 ** 20
HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def batch(i: int, seqs: list[int], batch_size: int, vocab: int):
    """Step i's batch: token chains (next = 5 * prev + 1 mod vocab, 10% noise) so the loss can fall; (B, T) each."""
    T = seqs[i % len(seqs)]
    gen = torch.Generator().manual_seed(10_000 + i)
    seq = torch.empty(batch_size, T + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, vocab, (batch_size,), generator=gen)
    noise = torch.randint(0, vocab, (batch_size, T + 1), generator=gen)
    keep = torch.rand(batch_size, T + 1, generator=gen) < 0.9
    for t in range(1, T + 1):
        seq[:, t] = torch.where(keep[:, t], (5 * seq[:, t - 1] + 1) % vocab, noise[:, t])
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def slope(ys: list[float]) -> float:
    """Least-squares slope of ys against their index."""
    n = len(ys)
    mx, my = (n - 1) / 2, sum(ys) / n
    return sum((x - mx) * (y - my) for x, y in enumerate(ys)) / sum((x - mx) ** 2 for x in range(n))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seqs", default="32,64", help="sequence lengths, alternated step by step")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--chunk-size", type=int, default=8192)
    ap.add_argument("--slack", type=float, default=1.05, help="budget = slack x the least the longest shape needs")
    ap.add_argument("--compare-every", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=None, help="steps left out of the flatness checks (10%%)")
    ap.add_argument("--rss-bound-mib", type=float, default=1.0, help="RSS slope bound, MiB per 1000 steps")
    ap.add_argument("--time-ratio", type=float, default=1.3)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a shared machine more threads make step times noisy)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    seqs = [int(s) for s in args.seqs.split(",")]
    warmup = args.warmup if args.warmup is not None else max(args.steps // 10, 2 * len(seqs))

    cfg = GPTConfig(vocab=args.vocab, seq=max(seqs), layers=args.layers, hidden=args.hidden, heads=args.heads)
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    eager = GPT(cfg)
    model = GPT(cfg)
    model.load_state_dict(eager.state_dict())
    opt = torch.optim.AdamW(eager.parameters(), **HYPER, fused=True)

    def compiled(budget):
        return px.compile(model, optimizer=px.AdamW(**HYPER), device_memory=budget, chunk_size=args.chunk_size,
                          precision="fp32", device=cpu)(gpt_loss)

    longest = batch(seqs.index(max(seqs)), seqs, args.batch, args.vocab)
    budget = int(compiled(None).min_device_memory(*longest) * args.slack)
    step = compiled(budget)
    n = sum(p.numel() for p in model.parameters())
    print(f"soak: GPT {n:,} parameters ({args.layers} layers, hidden {args.hidden}), batch {args.batch} x T in {seqs} "
          f"alternating, {args.steps} steps, fp32 on CPU, budget {budget:,} bytes (x{args.slack} the least), "
          f"chunk_size {args.chunk_size}, {torch.get_num_threads()} threads, torch {torch.__version__}", flush=True)

    rss_mib, seconds, worst, compares, compiles = [], [], 0.0, 0, set()
    losses = (None, None)
    t_start = time.perf_counter()
    for i in range(args.steps):
        x, y = batch(i, seqs, args.batch, args.vocab)
        t0 = time.perf_counter()
        loss = step(x, y).item()
        seconds.append(time.perf_counter() - t0)
        compiles.add(id(step._compiler.latest))          # a new compiled object means a new trace
        ref = gpt_loss(eager, x, y)
        ref.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i % args.compare_every == 0:
            r = ref.item()
            worst = max(worst, abs(loss - r) / max(abs(r), 1e-12))
            compares += 1
        rss_mib.append(rss() / MiB)
        if i == 0:
            losses = (loss, None)
        if (i + 1) % max(args.steps // 10, 1) == 0:
            print(f"  step {i + 1:5d}  loss {loss:.4f}  RSS {rss_mib[-1]:7.1f} MiB  step {seconds[-1] * 1e3:6.1f} ms  "
                  f"max rel. diff to eager {worst:.1e}", flush=True)
    losses = (losses[0], loss)
    wall = time.perf_counter() - t_start

    half = rss_mib[max(warmup, args.steps // 2):]
    rss_growth = slope(half) * 1000 if len(half) > 2 else 0.0
    span = max(args.steps // 10, 1)
    early = statistics.median(seconds[warmup:warmup + span])
    late = statistics.median(seconds[-span:])
    peak, planned = step.last_step.measured_peak, step.summary().predicted_peak   # of the last step's signature
    checks = [
        ("losses equal eager (fp32)", worst <= 1e-6, f"max relative difference {worst:.2e} over {compares} steps "
                                                      "(bound 1e-6)"),
        ("RSS flat after warm-up", abs(rss_growth) < args.rss_bound_mib,
         f"slope over steps {max(warmup, args.steps // 2)}..{args.steps}: {rss_growth:+.3f} MiB per 1000 steps "
         f"(bound {args.rss_bound_mib}); RSS {rss_mib[warmup]:.1f} MiB at step {warmup}, {rss_mib[-1]:.1f} MiB at "
         "the end"),
        ("step time flat", late <= args.time_ratio * early,
         f"median {early * 1e3:.1f} ms after warm-up, {late * 1e3:.1f} ms over the last {span} steps "
         f"(ratio {late / early:.2f}, bound {args.time_ratio})"),
        ("trace cache bounded", len(compiles) == len(set(seqs)) and len(step._compiler.cache) == len(set(seqs)),
         f"{len(compiles)} compiles, {len(step._compiler.cache)} cached signatures for {len(set(seqs))} shapes"),
        ("peak as planned, within budget", peak == planned <= budget,
         f"last step's measured peak {peak:,} bytes, predicted {planned:,}, budget {budget:,}"),
    ]
    print(f"\n{args.steps} steps in {wall:.1f} s (compiled + eager); loss {losses[0]:.4f} -> {losses[1]:.4f}")
    ok = True
    for name, passed, detail in checks:
        ok &= passed
        print(f"  [{'ok' if passed else 'FAIL'}] {name}: {detail}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
