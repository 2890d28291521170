"""
Train a small character-level GPT on examples/data/tiny_corpus.txt with pstar-fx, under a
device-memory budget smaller than the model's own training data (parameters + gradients +
Adam states), so pstar-fx has to move chunks in and out every step.

Run from the repository root:

    python examples/train_gpt.py

The defaults (1.6M parameters, 24.5 MiB of model data, a 12.25 MiB budget) train on 2 CPU
cores in about 25 seconds; the loss falls from ~4.4 (uniform over the 70 characters is 4.25)
to ~2.0. Try e.g. `--device-memory 16MiB`, `--chunk-size 100000`, `--precision bf16`,
`--model tiny --steps 50` (a quick smoke run), `--model medium` or `--device cuda`.
A budget below what the activations of one step need fails with px.BudgetError, which says
how much is needed.
"""

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

# let the example run from a source checkout without installing pstar-fx
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import pstar_fx as px  # noqa: E402

# -----------------------------------------------------------------------------
# model: nanoGPT, minus dropout (this example is about memory, not regularisation)

@dataclass
class GPTConfig:
    block_size: int
    vocab_size: int
    n_layer: int
    n_head: int
    n_embd: int


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)       # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)                   # (B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying: one parameter, two names
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():  # GPT-2: scale residual projections by depth
            if pn.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx):
        # idx: (B, T) int64 -> logits (B, T, vocab_size)
        B, T = idx.size()
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.wte(idx) + self.wpe(pos)                               # (B, T, C)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, generator=None, temperature=0.8):
        # idx: (B, T0) -> (B, T0 + max_new_tokens), sampling one character at a time
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config.block_size:])[:, -1, :] / temperature  # (B, vocab)
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


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

# -----------------------------------------------------------------------------

def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(PRESETS), default="small", help="size preset")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--device-memory", default="auto",
                        help="budget: bytes, a size like '8MiB', 'none' for unlimited, or 'auto' "
                             "(half of the model data, so chunks must move)")
    parser.add_argument("--chunk-size", type=int, default=None, help="elements per chunk (default: pstar-fx picks)")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=None,
                        help="default: pstar-fx's default")
    parser.add_argument("--device", default=None, help="e.g. cpu, cuda (default: pstar-fx picks)")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--log-every", type=int, default=25)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)  # batch sampling
    preset = PRESETS[args.model]
    train_data, val_data, chars = load_corpus(
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tiny_corpus.txt"))
    config = GPTConfig(block_size=preset["block_size"], vocab_size=len(chars),
                       n_layer=preset["n_layer"], n_head=preset["n_head"], n_embd=preset["n_embd"])
    batch_size = preset["batch_size"]
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
    print(f"model '{args.model}': {n_params:,} parameters, {config.n_layer} layers, n_embd {config.n_embd}, "
          f"batch {batch_size}x{config.block_size}")
    print(f"model data (fp32 params + grads + Adam m, v): {fmt_bytes(data_bytes)}")
    print(f"device memory budget: {budget if budget is None or isinstance(budget, str) else fmt_bytes(budget)}")

    options = dict(device_memory=budget, chunk_size=args.chunk_size, device=args.device)
    if args.precision is not None:
        options["precision"] = args.precision
    step = px.compile(model, optimizer=px.AdamW(lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
                      **options)(gpt_loss)

    t0 = time.time()
    for it in range(args.steps):
        x, y = get_batch(train_data, config.block_size, batch_size, gen)
        loss = step(x, y)
        if it % args.log_every == 0 or it == args.steps - 1:
            print(f"step {it:4d} | loss {loss.item():.4f} | {time.time() - t0:6.1f}s")
    print(f"trained {args.steps} steps in {time.time() - t0:.1f}s")
    print(step.summary())

    # pull the trained weights back into a plain eager model: validate and sample from it
    eval_model = GPT(config)
    eval_model.load_state_dict(step.state_dict())
    eval_model.eval()
    with torch.no_grad():
        val_gen = torch.Generator().manual_seed(0)
        val_loss = sum(gpt_loss(eval_model, *get_batch(val_data, config.block_size, 16, val_gen)).item()
                       for _ in range(10)) / 10
    print(f"val loss {val_loss:.4f}")
    start = torch.zeros((1, 1), dtype=torch.long)  # index 0 is '\n'
    out = eval_model.generate(start, 200, generator=torch.Generator().manual_seed(args.seed))
    print("sample:\n" + "".join(chars[i] for i in out[0].tolist()))


if __name__ == "__main__":
    main()
