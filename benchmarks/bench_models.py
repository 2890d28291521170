"""The models the benchmark runner (gpt.py) trains: the reference GPT, or transformers' LlamaForCausalLM.

    --model gpt     pstar_fx.models.gpt.GPT: nanoGPT without dropout, vocab 50304, tied head
    --model llama   transformers.LlamaForCausalLM of --layers x --hidden, --heads (as many key-value heads),
                    --intermediate (SwiGLU), --vocab (pass 32000 for Llama-2's), untied head, RMSNorm, rotary,
                    SDPA attention; per-layer checkpoints through gradient_checkpointing_enable()

Llama-2-13B's shape: --model llama --layers 40 --hidden 5120 --heads 40 --intermediate 13824 --vocab 32000.
Both models take (idx, targets) batches of token ids and return the mean next-token cross-entropy in fp32.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from pstar_fx.models.gpt import GPT, GPTConfig, gpt_loss


class Kind(enum.Enum):
    GPT = "gpt"
    LLAMA = "llama"


@dataclass(frozen=True)
class ModelSpec:
    kind: Kind
    cfg: GPTConfig                # layers, hidden, heads, vocab, seq (the Llama's too)
    intermediate: int = 0         # the Llama's MLP width (0: 8/3 x hidden rounded up to 256)
    kv_heads: int = 0             # the Llama's key/value heads (0: as many as its heads; Llama 3 8B's: 8)

    @property
    def ffn(self) -> int:
        if self.intermediate:
            return self.intermediate
        return -(-int(8 * self.cfg.hidden / 3) // 256) * 256

    def __str__(self) -> str:
        c = self.cfg
        if self.kind is Kind.GPT:
            return f"GPT {c}"
        kv = f", kv_heads={self.kv_heads}" if self.kv_heads else ""
        return (f"transformers Llama (layers={c.layers}, hidden={c.hidden}, heads={c.heads}{kv}, "
                f"intermediate={self.ffn}, vocab={c.vocab}, seq={c.seq})")


def make(spec: ModelSpec) -> nn.Module:
    """The model, built in the current default device / init_empty context (seed it before)."""
    if spec.kind is Kind.GPT:
        return GPT(spec.cfg)
    from transformers import LlamaConfig, LlamaForCausalLM
    c = spec.cfg
    conf = LlamaConfig(vocab_size=c.vocab, hidden_size=c.hidden, intermediate_size=spec.ffn,
                       num_hidden_layers=c.layers, num_attention_heads=c.heads,
                       num_key_value_heads=spec.kv_heads or c.heads,
                       max_position_embeddings=c.seq, tie_word_embeddings=False, attn_implementation="sdpa",
                       use_cache=False)
    return LlamaForCausalLM(conf)


def set_checkpoint(model: nn.Module, on: bool) -> None:
    """Per-block activation checkpoints (torch.utils.checkpoint), as each model spells it."""
    if isinstance(model, GPT):
        model.checkpoint = on
    elif on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks (FSDP2 shards one per block)."""
    return list(model.h) if isinstance(model, GPT) else list(model.model.layers)


def loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if isinstance(model, GPT):
        return gpt_loss(model, idx, targets)
    logits = model(input_ids=idx).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
