"""
Train a small character-level GPT on examples/data/tiny_corpus.txt with pstar-fx, as a real run does it (nanoGPT's
train.py): warmup + cosine learning-rate schedule, two parameter groups (weight decay on matrices only), gradient
clipping at 1.0, gradient accumulation, periodic evaluation, a checkpoint to resume from (written at every evaluation,
at the end and on Ctrl-C), and sampling at the end.
The device-memory budget is smaller than the model's own training data (parameters + gradients + Adam states), so
pstar-fx moves chunks in and out every step; the memory plan is printed, and plotted when matplotlib is there.

Run from the repository root:

    python examples/train_gpt.py                 # train, evaluate, checkpoint to out/ckpt, sample
    python examples/train_gpt.py --resume        # continue from out/ckpt (same losses as an uninterrupted run)

The defaults (1.6M parameters, 24.5 MiB of model data, a 12.25 MiB budget) train on 2 CPU cores in about half a
minute; the loss falls from ~4.4 (uniform over the 70 characters is 4.25) to ~1.8. Try `--device-memory 16MiB`,
`--precision bf16`, `--model tiny --steps 50` (a quick smoke run), `--model medium` or `--device cuda`. A budget below
what the activations of one micro-batch need fails with px.BudgetError, which says how much is needed.
"""

import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

# let the example run from a source checkout without installing pstar-fx
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import pstar_fx as px  # noqa: E402
from pstar_fx.models.gpt import GPT, GPTConfig, Init  # noqa: E402

# -----------------------------------------------------------------------------
# model: nanoGPT (pstar_fx/models/gpt.py: the reference GPT, nanoGPT's layout and initialisation), minus dropout

def gpt_loss(model, idx, targets):
    logits = model(idx)  # (B, T, vocab)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

# Wide and shallow on purpose: parameters (which pstar-fx chunks and moves) outweigh the
# activations of the small per-step batch, so a budget below the model data is a real squeeze.
PRESETS = {
    "tiny":   dict(n_layer=2, n_head=2, n_embd=128, block_size=16, batch_size=4),
    "small":  dict(n_layer=2, n_head=4, n_embd=256, block_size=32, batch_size=8),
    "medium": dict(n_layer=4, n_head=6, n_embd=384, block_size=32, batch_size=8),
}

# -----------------------------------------------------------------------------
# data: characters of tiny_corpus.txt, 90% train / 10% val

def load_corpus(path):
    text = open(path, encoding="utf-8").read()
    chars = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(chars)}
    data = torch.tensor([stoi[ch] for ch in text], dtype=torch.long)  # (N,)
    n = int(0.9 * len(data))
    return data[:n], data[n:], chars


def get_batch(data, block_size, batch_size, generator):
    # random windows; targets are the inputs shifted by one character
    ix = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
    x = torch.stack([data[i:i + block_size] for i in ix])          # (B, T)
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])  # (B, T)
    return x, y


def model_data_bytes(model):
    """fp32 parameters + gradients + Adam's two moments: 16 bytes per (unique) parameter."""
    n_params = sum(p.numel() for p in model.parameters())  # tied weights counted once
    return n_params, 4 * n_params * 4


def fmt_bytes(n):
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def configure_optimizer(model, lr, weight_decay, state_dtype="fp32"):
    """nanoGPT's two groups: decay for matrices (2+ dims), none for biases and norms. state_dtype: Adam's moments
    exact ("fp32") or compressed ("bf16", "int8")."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return px.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                    lr=lr, betas=(0.9, 0.95), eps=1e-8, state_dtype=state_dtype)


def warmup_cosine(warmup, total, min_ratio=0.1):
    """LambdaLR factor: linear warmup, then cosine down to min_ratio of the peak."""
    def factor(it):
        if it < warmup:
            return (it + 1) / warmup
        progress = min(1.0, (it - warmup) / max(1, total - warmup))
        return min_ratio + 0.5 * (1 - min_ratio) * (1 + math.cos(math.pi * progress))
    return factor


def progress(iterable, enabled):
    """tqdm when it is installed (pip install tqdm), plain iteration otherwise."""
    if enabled:
        try:
            from tqdm import tqdm
            return tqdm(iterable, dynamic_ncols=True)
        except ImportError:
            pass
    return iterable


def sample(generate, chars, block_size, n_tokens, generator, temperature=0.8):
    """One character at a time from the compiled forward-only function. The context window always has the shape
    (1, block_size), filled from the left: attention is causal, so the logits at position t depend only on the
    tokens up to t and the padding after it changes nothing; one shape means one trace."""
    seq = [0]                                                   # index 0 is '\n'
    for _ in range(n_tokens):
        ctx = seq[-block_size:]
        window = torch.zeros((1, block_size), dtype=torch.long)
        window[0, :len(ctx)] = torch.tensor(ctx)
        logits = generate(window)[0, len(ctx) - 1].float() / temperature  # (vocab,)
        seq.append(int(torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)))
    return "".join(chars[i] for i in seq)

# -----------------------------------------------------------------------------

def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(PRESETS), default="small", help="size preset")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--clip", type=float, default=1.0, help="max gradient norm")
    parser.add_argument("--device-memory", default="auto",
                        help="budget: bytes, a size like '8MiB', 'none' for unlimited, or 'auto' "
                             "(half of the model data, so chunks must move)")
    parser.add_argument("--chunk-size", type=int, default=None, help="elements per chunk (default: pstar-fx picks)")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=None,
                        help="default: pstar-fx's default")
    parser.add_argument("--device", default=None, help="e.g. cpu, cuda (default: pstar-fx picks)")
    parser.add_argument("--state-dtype", choices=["fp32", "bf16", "int8"], default="fp32",
                        help="AdamW's moments: exact, or compressed to bf16 / int8 (docs/memory.md)")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--out", default="out", help="checkpoint and plot directory")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/ckpt")
    parser.add_argument("--stop-after", type=int, default=None, help="stop after this step (to try --resume)")
    parser.add_argument("--no-progress", action="store_true", help="plain log lines instead of a tqdm bar")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    preset = PRESETS[args.model]
    train_data, val_data, chars = load_corpus(
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tiny_corpus.txt"))
    config = GPTConfig(vocab=len(chars), seq=preset["block_size"], layers=preset["n_layer"], heads=preset["n_head"],
                       hidden=preset["n_embd"], init=Init.MODULES)
    batch_size = preset["batch_size"] * args.accumulate         # split into micro-batches by pstar-fx
    model = GPT(config)

    n_params, data_bytes = model_data_bytes(model)
    if args.device_memory == "auto":
        budget = data_bytes // 2
    elif args.device_memory.lower() == "none":
        budget = None
    elif args.device_memory.isdigit():
        budget = int(args.device_memory)
    else:
        budget = args.device_memory  # a size string such as "8MiB": pstar-fx parses it
    print(f"corpus: {len(train_data) + len(val_data):,} characters, vocab {len(chars)}")
    print(f"model '{args.model}': {n_params:,} parameters, {config.layers} layers, n_embd {config.hidden}, "
          f"batch {batch_size}x{config.seq} in {args.accumulate} micro-batches")
    print(f"model data (fp32 params + grads + Adam m, v): {fmt_bytes(data_bytes)}")
    print(f"device memory budget: {budget if budget is None or isinstance(budget, str) else fmt_bytes(budget)}")

    options = dict(device_memory=budget, chunk_size=args.chunk_size, device=args.device)
    if args.precision is not None:
        options["precision"] = args.precision
    optimizer = configure_optimizer(model, args.lr, 0.1, args.state_dtype)
    step = px.compile(model, optimizer=optimizer, max_grad_norm=args.clip, accumulate=args.accumulate,
                      **options)(gpt_loss)
    evaluate = px.compile(model, optimizer=None, **options)(gpt_loss)          # forward only, shares the chunks
    generate = px.compile(model, optimizer=None, **options)(lambda m, idx: m(idx))
    sched = torch.optim.lr_scheduler.LambdaLR(step.optimizer, warmup_cosine(args.warmup, args.steps))

    ckpt = os.path.join(args.out, "ckpt")
    first = 0
    if args.resume:
        step.load(ckpt)
        sched.load_state_dict(torch.load(os.path.join(args.out, "scheduler.pt"), weights_only=True))
        first = sched.last_epoch
        print(f"resumed from {ckpt} at step {first}")

    def save_checkpoint():
        """The step's checkpoint (model, optimizer, RNG) and the schedule's position beside it (step.save owns
        ckpt/): --resume continues from here with the losses of an uninterrupted run."""
        os.makedirs(args.out, exist_ok=True)
        step.save(ckpt)
        torch.save(sched.state_dict(), os.path.join(args.out, "scheduler.pt"))

    def val_loss():
        model.eval()
        vgen = torch.Generator().manual_seed(0)
        loss = sum(evaluate(*get_batch(val_data, config.seq, 16, vgen)).item() for _ in range(10)) / 10
        model.train()
        return loss

    t0 = time.time()
    last = min(args.steps, args.stop_after + 1) if args.stop_after is not None else args.steps
    if first >= last:
        print(f"the checkpoint is at step {first}: nothing left to train (--steps {args.steps})")
    bar = progress(range(first, last), not args.no_progress)
    try:
        for it in bar:
            gen = torch.Generator().manual_seed(args.seed * 100_003 + it)   # a step's batch depends on the step only
            x, y = get_batch(train_data, config.seq, batch_size, gen)
            before = step.last_step
            try:
                loss = step(x, y)
            finally:
                # a completed step has new stats (Ctrl-C after its commit too: pstar-fx completes the step first)
                if step.last_step is not before:
                    sched.step()
            s = step.last_step
            tokens_per_s = x.numel() / max(s.seconds, 1e-9)
            if hasattr(bar, "set_postfix_str"):
                bar.set_postfix_str(f"loss {loss.item():.4f} lr {s.lr[0]:.2e} norm {s.grad_norm:.2f} "
                                    f"{tokens_per_s:,.0f} tok/s peak {fmt_bytes(s.measured_peak)}")
            if it % args.log_every == 0 or it == last - 1:
                line = (f"step {it:4d} | loss {loss.item():.4f} | lr {s.lr[0]:.2e} | grad norm {s.grad_norm:.3f} | "
                        f"{tokens_per_s:,.0f} tok/s | peak {fmt_bytes(s.measured_peak)} | {time.time() - t0:6.1f}s")
                (bar.write if hasattr(bar, "write") else print)(line)
            if (it + 1) % args.eval_every == 0:
                (bar.write if hasattr(bar, "write") else print)(f"step {it:4d} | val loss {val_loss():.4f}")
                save_checkpoint()
    except KeyboardInterrupt:
        save_checkpoint()       # (a step Ctrl-C interrupted changed nothing, or completed)
        print(f"\ninterrupted: checkpoint of the {sched.last_epoch} steps done in {ckpt}; --resume continues")
        raise SystemExit(130) from None
    if first < last:
        print(f"trained steps {first}..{last - 1} in {time.time() - t0:.1f}s")
        save_checkpoint()
        print(f"checkpoint: {ckpt}")
    else:
        step.lower(*get_batch(train_data, config.seq, batch_size, torch.Generator().manual_seed(0)))   # (its plan)
    print(step.summary())
    try:
        px.plot_memory(step, os.path.join(args.out, "memory.png"))
        print(f"memory plot: {os.path.join(args.out, 'memory.png')}")
    except ImportError as e:
        print(f"no memory plot: {e}")

    print(f"val loss {val_loss():.4f}")
    model.eval()
    print("sample:\n" + sample(generate, chars, config.seq, 200, torch.Generator().manual_seed(args.seed)))


if __name__ == "__main__":
    main()
