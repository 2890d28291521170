"""The reference GPT: nanoGPT (Karpathy's), configurable enough for every place pstar-fx trains or plans one.

    cfg = GPTConfig(vocab=50304, seq=1024, layers=12, hidden=768, heads=12)
    model = GPT(cfg)                                  # (B, T) token ids -> (B, T, vocab) logits
    loss = gpt_loss(model, idx, targets)

Who uses it: the `pstar-fx-plan` command (pstar_fx.api.plan_cli), benchmarks/gpt.py, the tests' GPT cases and
examples/train_gpt.py. The layout is nanoGPT's, parameter names included: token and learned position embeddings
(`wte`, `wpe`), blocks `h.<i>` of pre-norm attention (`attn.c_attn`, `attn.c_proj`) and MLP (`mlp.c_fc`, GELU,
`mlp.c_proj`), a final `ln_f` and an `lm_head`, tied to `wte` by default (one parameter, two state_dict names).

Options: `dropout` (after the embeddings, inside attention, after each residual branch; 0 traces to nothing),
`bias` (in every Linear and LayerNorm), `tied_head`, `checkpoint` (every block under torch.utils.checkpoint,
`reentrant` choosing its mode; also settable on a built model as `model.checkpoint`), and how the initial values are
drawn (`init`, see Init): every caller keeps the values it was measured with.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint


class Init(enum.Enum):
    """How the initial values are drawn; both give normal(0, 0.02) matrices and embeddings, residual projections
    (`c_proj`) normal(0, 0.02 / sqrt(2 * layers)), zero biases and LayerNorms at ones and zeros."""
    # each parameter drawn once, in registration order (a tied weight once): the least a px.init_empty() replay runs
    PARAMETERS = "parameters"
    # nanoGPT's: every Linear and Embedding drawn in module order (a tied weight twice, as its Embedding and as the
    # head), then the residual projections drawn again, scaled
    MODULES = "modules"


@dataclass(frozen=True)
class GPTConfig:
    vocab: int
    seq: int                         # the longest sequence: rows of the learned position embedding
    layers: int
    hidden: int
    heads: int
    dropout: float = 0.0
    bias: bool = True
    tied_head: bool = True
    checkpoint: bool = False         # every block under torch.utils.checkpoint
    reentrant: bool = False          # ... with use_reentrant=True
    init: Init = Init.PARAMETERS


class CausalSelfAttention(nn.Module):

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.hidden % cfg.heads:
            raise ValueError(f"GPTConfig: hidden {cfg.hidden} is not divisible by heads {cfg.heads}")
        self.heads = cfg.heads
        self.c_attn = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=cfg.bias)   # q, k, v for all heads in one matmul
        self.c_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)   # (B, nh, T, hs)
        k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)   # (B, nh, T, hs)
        v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)   # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)                  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.hidden, 4 * cfg.hidden, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """nanoGPT (see the module docstring). `checkpoint`, when given, overrides cfg.checkpoint; `model.checkpoint` and
    `model.reentrant` may also be changed after building."""

    def __init__(self, cfg: GPTConfig, checkpoint: bool | None = None):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.hidden)
        self.wpe = nn.Embedding(cfg.seq, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tied_head:
            self.lm_head.weight = self.wte.weight   # one parameter, two state_dict names
        self.checkpoint = cfg.checkpoint if checkpoint is None else checkpoint
        self.reentrant = cfg.reentrant
        _initialise(self, cfg)

    def forward(self, idx):
        # idx: (B, T) int64 -> logits (B, T, vocab)
        B, T = idx.size()
        if T > self.cfg.seq:
            raise ValueError(f"GPT: a sequence of {T} tokens is longer than the model's seq {self.cfg.seq}")
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)   # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))                    # (B, T, C)
        for block in self.h:
            x = (torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.reentrant) if self.checkpoint
                 else block(x))
        return self.lm_head(self.ln_f(x))


def _initialise(model: GPT, cfg: GPTConfig) -> None:
    """The initial values (see Init); nothing is allocated where the model is built on the meta device."""
    residual_std = 0.02 / math.sqrt(2 * cfg.layers)
    if cfg.init is Init.PARAMETERS:
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, mean=0.0, std=residual_std if name.endswith("c_proj.weight") else 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        return
    model.apply(_init_module)
    for name, p in model.named_parameters():
        if name.endswith("c_proj.weight"):
            nn.init.normal_(p, mean=0.0, std=residual_std)


def _init_module(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)


def gpt_loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the next-token logits, computed in fp32 (under autocast too)."""
    logits = model(idx)   # (B, T, vocab)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
