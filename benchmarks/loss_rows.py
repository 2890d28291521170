"""
What computing a large vocabulary's cross-entropy in blocks of rows (passes/loss_rows) does to a step's memory and
time, measured on this machine (the CPU by default): a small GPT whose loss tensors are most of its memory.

    python benchmarks/loss_rows.py                       # 2 x 128 GPT, 32,768 vocabulary, 4 x 256 tokens, fp32
    python benchmarks/loss_rows.py --device cuda --precision bf16 --batch 8 --seq 2048 --vocab 128256 --block-mib 256 \
        --layers 4 --hidden 2048 --heads 16 --fuse off

Prints:
  least budgets   step.min_device_memory with the loss whole (px.compile's private _loss_rows=NEVER) and with the
                  default (split where the step would not fit otherwise)
  tight           at the default's least budget (+2%): the whole loss raises BudgetError; the default trains, its
                  measured peak against the plan's, its losses against the whole loss's at a budget it fits
  time            at an unlimited budget, the median step of the loss always in blocks (ALWAYS) against whole
                  (NEVER), the two in turn step by step on the same batches: the cost of the backward's second
                  log-softmax
--block-mib sets the blocks' fp32 size (the library's is 256 MiB; the default here is smaller, so that a model this
small splits).
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
from pstar_fx.ir.graph import LossRows  # noqa: E402
from pstar_fx.models.gpt import GPT, GPTConfig  # noqa: E402


def loss_fn(model, idx, tgt):
    return F.cross_entropy(model(idx).flatten(0, 1).float(), tgt.flatten())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--block-mib", type=float, default=16.0)
    ap.add_argument("--fuse", default="default", choices=["default", "on", "off"],
                    help="px.compile's fuse: None (its default: on a GPU in bf16, fused where estimated faster), "
                         "True or False")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per system (after 2 warm-up steps)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, hidden=args.hidden, heads=args.heads)
    block = int(args.block_mib * 2 ** 20)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen),
                torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)) for _ in range(4)]

    def compiled(when, budget=None, debug=False):
        torch.manual_seed(0)
        model = GPT(cfg)
        return px.compile(model, optimizer=px.AdamW(lr=1e-3), device_memory=budget, precision=args.precision,
                          device=args.device, debug=debug, fuse={"default": None, "on": True, "off": False}[args.fuse],
                          _loss_rows=when, _loss_block_bytes=block)(loss_fn)

    rows, mib = args.batch * args.seq, 2 ** 20
    print(f"GPT {args.layers} x {args.hidden}, vocabulary {args.vocab}, {args.batch} x {args.seq} tokens, "
          f"{args.precision} on {args.device}, torch {torch.__version__}: one fp32 tokens x vocabulary tensor "
          f"{rows * args.vocab * 4 / mib:.1f} MiB, blocks of {args.block_mib:g} MiB")
    whole = compiled(LossRows.NEVER).min_device_memory(*batches[0])
    split = compiled(LossRows.WHERE_NEEDED).min_device_memory(*batches[0])
    print(f"least budgets: whole loss {whole / mib:.2f} MiB, default {split / mib:.2f} MiB ({split / whole:.3f}x)")

    tight = int(split * 1.02)
    try:
        compiled(LossRows.NEVER, tight)(*batches[0])
        print(f"tight {tight / mib:.2f} MiB: the whole loss trained (not expected)")
    except px.BudgetError:
        print(f"tight {tight / mib:.2f} MiB: the whole loss raises BudgetError")
    step = compiled(LossRows.WHERE_NEEDED, tight, debug=True)
    losses = [step(*b).item() for b in batches]
    ref = compiled(LossRows.NEVER, int(whole * 1.02))
    ref_losses = [ref(*b).item() for b in batches]
    plan = step.final_graph.plan.predicted_peak
    print(f"tight, default: measured peak {step.last_step.measured_peak / mib:.2f} MiB, planned {plan / mib:.2f} MiB; "
          f"losses {'equal' if losses == ref_losses else 'NOT equal'} to the whole loss's at "
          f"{int(whole * 1.02) / mib:.2f} MiB: {losses}")

    systems = {"whole (NEVER)": compiled(LossRows.NEVER), "blocks (ALWAYS)": compiled(LossRows.ALWAYS)}
    times = {k: [] for k in systems}
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    for i in range(2 + args.steps):
        for name, s in systems.items():
            sync()
            t0 = time.perf_counter()
            s(*batches[i % len(batches)])
            sync()
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    a, b = med["blocks (ALWAYS)"], med["whole (NEVER)"]
    print(f"time, unlimited budget, median of {args.steps}: whole {b * 1e3:.1f} ms, blocks {a * 1e3:.1f} ms "
          f"({a / b:.3f}x)")


if __name__ == "__main__":
    main()
