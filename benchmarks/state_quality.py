"""Training quality with compressed optimizer states: a GPT (pstar_fx/models/gpt.py; by default about 125M
parameters: 12 layers, 768 hidden, 12 heads) trained on the shipped character corpus (examples/data/tiny_corpus.txt)
for --steps steps with each state_dtype ("fp32", "bf16", "int8"), from the same initialisation on the same batches.
Prints the training loss (mean over the last --every steps) every --every steps, then each state_dtype's final loss
(mean of the last --every steps) and its relative difference against fp32's.

    python3 benchmarks/state_quality.py                                    # the GPU run: 2000 steps, 125M
    python3 benchmarks/state_quality.py --layers 2 --hidden 64 --heads 2 --steps 40 --every 10 --device cpu
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

import pstar_fx as px
from pstar_fx.models.gpt import GPT, GPTConfig, Init

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "data", "tiny_corpus.txt")


def gpt_loss(model, idx, targets):
    logits = model(idx)                                              # (B, T, vocab)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def batches(data: torch.Tensor, seq: int, batch: int, steps: int, seed: int):
    """The same (idx, targets) batches for every run: random windows of the corpus."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ix = torch.randint(len(data) - seq - 1, (batch,), generator=g)
        yield (torch.stack([data[i:i + seq] for i in ix]), torch.stack([data[i + 1:i + 1 + seq] for i in ix]))


def run(state_dtype: str, args, data: torch.Tensor, vocab: int) -> list[float]:
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig(vocab=vocab, seq=args.seq, layers=args.layers, hidden=args.hidden, heads=args.heads,
                          init=Init.MODULES))
    opt = px.AdamW(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, state_dtype=state_dtype)
    step = px.compile(model, optimizer=opt, precision=args.precision, device=args.device,
                      max_grad_norm=1.0)(gpt_loss)
    sched = torch.optim.lr_scheduler.LambdaLR(
        step.optimizer, lambda it: min(1.0, (it + 1) / args.warmup))   # linear warm-up, then constant
    losses, t0 = [], time.perf_counter()
    for i, (x, y) in enumerate(batches(data, args.seq, args.batch, args.steps, args.seed)):
        dev = step.settings.device
        losses.append(step(x.to(dev), y.to(dev)).item())
        sched.step()
        if (i + 1) % args.every == 0:
            window = losses[-args.every:]
            print(f"{state_dtype:>4s} step {i + 1:5d}: loss {sum(window) / len(window):.4f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--every", type=int, default=100, help="print the loss every this many steps")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--device", default=None, help="default: pstar-fx picks (cuda where there is one)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--state-dtypes", default="fp32,bf16,int8")
    args = ap.parse_args()
    with open(CORPUS, encoding="utf-8") as f:
        text = f.read()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    final = {}
    for d in args.state_dtypes.split(","):
        losses = run(d, args, data, len(chars))
        final[d] = sum(losses[-args.every:]) / len(losses[-args.every:])
    ref = final.get("fp32")
    for d, loss in final.items():
        rel = "" if ref is None else f", {100 * (loss - ref) / ref:+.2f}% against fp32"
        print(f"final {d:>4s}: {loss:.4f}{rel}")


if __name__ == "__main__":
    main()
