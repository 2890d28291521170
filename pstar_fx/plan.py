"""Command line: will a GPT train on a cluster, and how fast? (`px.plan` for the GPT of benchmarks/gpt.py)

    python -m pstar_fx.plan --layers 96 --d-model 12288 --heads 96 --seq 2048 --batch 1 --world-size 32 \\
        --gpus-per-node 8 --device-memory 80GB --host-memory 1TB --checkpoint

Runs on any machine (no GPU, no process group): the model is built on the meta device, the step traced and planned as
each of the --world-size ranks would, and the cost model (pstar_fx/cost.py) estimates the step time. The GPT is
nanoGPT's, as in benchmarks/gpt.py: vocab 50304 (--vocab), tied head, learned positions, biases and LayerNorms, no
dropout, loss cross-entropy; --checkpoint wraps every block in torch.utils.checkpoint. --batch is per GPU. Exit
status: 0 when the model fits, 1 when it does not.
"""
from __future__ import annotations

import argparse
import math
import sys
import types
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import planning
from .cost import H200, Machine


@dataclass
class GPTConfig:
    vocab: int
    seq: int
    layers: int
    hidden: int
    heads: int


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.c_attn = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.c_proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden)
        self.c_fc = nn.Linear(cfg.hidden, 4 * cfg.hidden)
        self.c_proj = nn.Linear(4 * cfg.hidden, cfg.hidden)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, checkpoint: bool = False):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab, cfg.hidden)
        self.wpe = nn.Embedding(cfg.seq, cfg.hidden)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.lm_head.weight = self.wte.weight   # tied
        self.checkpoint = checkpoint            # per-block activation checkpointing (torch.utils.checkpoint)
        for name, p in self.named_parameters():   # nanoGPT's initialisation (nothing is allocated on "meta")
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx):
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))   # (B, T, C)
        for block in self.h:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if self.checkpoint else block(x)
        return self.lm_head(self.ln_f(x))


def gpt_loss(model, idx, targets):
    logits = model(idx)   # (B, T, vocab)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m pstar_fx.plan", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--d-model", type=int, required=True)
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--batch", type=int, default=1, help="sequences per GPU per step")
    ap.add_argument("--accumulate", type=int, default=1, help="micro-batches per step (--batch is split into them)")
    ap.add_argument("--checkpoint", action="store_true", help="activation checkpointing per block")
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--device-memory", default=None, help="per GPU, e.g. 80GB (default: unlimited)")
    ap.add_argument("--host-memory", default=None, help="per node, e.g. 1TB (default: not checked)")
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--chunk-size", type=int, default=None, help="elements per chunk (default: chosen)")
    ap.add_argument("--max-grad-norm", type=float, default=None)
    ap.add_argument("--no-atomic", action="store_true",
                    help="px.compile(atomic=False): host-side updates may start during backward (one GPU)")
    ap.add_argument("--network-gbps", type=float, default=None,
                    help="NCCL bus bandwidth across nodes in GB/s (default: the cost model's assumption, "
                         f"{H200.network_bus_bytes / 1e9:.0f})")
    return ap


def main(argv=None) -> planning.PlanReport:
    args = _parser().parse_args(argv)
    if args.d_model % args.heads:
        raise SystemExit(f"--d-model {args.d_model} is not divisible by --heads {args.heads}")
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, hidden=args.d_model, heads=args.heads)
    with torch.device("meta"):
        model = GPT(cfg, checkpoint=args.checkpoint)
    machine: Machine = H200
    if args.network_gbps is not None:
        machine = Machine(network_bus_bytes=args.network_gbps * 1e9)
    tokens = ((args.batch, args.seq), torch.long)
    report = planning.plan(model, gpt_loss, tokens, tokens, world_size=args.world_size,
                           device_memory=args.device_memory, host_memory=args.host_memory, precision=args.precision,
                           chunk_size=args.chunk_size, accumulate=args.accumulate, max_grad_norm=args.max_grad_norm,
                           gpus_per_node=args.gpus_per_node, machine=machine, atomic=not args.no_atomic)
    print(f"GPT {args.layers} layers x d={args.d_model}, {args.heads} heads, seq {args.seq}, vocab {args.vocab}"
          f"{', activation checkpointing' if args.checkpoint else ''}; batch {args.batch} per GPU")
    print(report)
    return report


def run(argv=None) -> int:
    """The console script (`pstar-fx-plan`, `python -m pstar_fx.plan`): exit status 0 when the model fits, 1 when
    it does not."""
    return 0 if main(argv).fits else 1


class _CallableModule(types.ModuleType):
    """`import pstar_fx.plan` binds this module to the name `pstar_fx.plan`, where `px.plan` (the function) lives:
    calling the module calls the function, so both keep working."""

    def __call__(self, *args, **kwargs):
        return planning.plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(run())
