"""
Model zoo for pstar-fx equivalence tests, plus the eager reference they are checked against.

Every case is small (runs 5 steps in a fraction of a second on 2 CPU cores), is built
deterministically from a fixed seed, and is fed random (never all-zero) batches that are
a pure function of the step index, so that an eager run and a pstar-fx run of the same
case see exactly the same model and data.

The zoo deliberately covers the awkward bits a planner must get right:
- MLP: the plain case (MSE and cross-entropy heads).
- GPT: nanoGPT with *tied* embeddings (one parameter, two state_dict keys): pstar_fx.models.gpt.
- CNN: BatchNorm in train mode (buffers mutated every step, incl. an int64 counter).
- tiny GPT2 / tiny Llama from transformers: real-world modules (Conv1D, rotary
  embeddings with a non-persistent buffer, GQA, RMSNorm, HF's own loss).
"""

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from pstar_fx.models.gpt import GPT as ReferenceGPT
from pstar_fx.models.gpt import GPTConfig, Init

# -----------------------------------------------------------------------------
# MLP

class MLP(nn.Module):
    """n_layers Linear layers with an activation between them (none after the last)."""

    def __init__(self, d_in, d_hidden, d_out, n_layers, act="gelu"):
        super().__init__()
        assert n_layers >= 1
        dims = [d_in] + [d_hidden] * (n_layers - 1) + [d_out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.act = {"gelu": nn.GELU(), "relu": nn.ReLU()}[act]

    def forward(self, x):
        # x: (B, d_in) -> (B, d_out)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = self.act(x)
        return x


class Stack(nn.Module):
    """n square layers with tanh between, seeded (the CUDA runtime tests): at its least budget each layer's chunk is
    fetched, used and evicted in turn."""

    def __init__(self, d, n, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.Ws = nn.ParameterList(nn.Parameter(torch.randn(d, d, generator=g) / d ** 0.5) for _ in range(n))

    def forward(self, x):
        for W in self.Ws:
            x = torch.tanh(x @ W)
        return x


def mlp_loss(model, x, y):
    """MSE for float targets (B, d_out), cross-entropy for integer class targets (B,)."""
    out = model(x)
    if y.is_floating_point():
        return F.mse_loss(out, y)
    return F.cross_entropy(out, y)

# -----------------------------------------------------------------------------
# GPT: the reference nanoGPT (pstar_fx.models.gpt), tied embeddings, as the tests build it

def GPT(vocab, block_size, n_layer, n_head, n_embd, dropout=0.0):
    """nanoGPT with nanoGPT's initialisation. lm_head shares its weight with wte: one Parameter, two state_dict keys."""
    return ReferenceGPT(GPTConfig(vocab=vocab, seq=block_size, layers=n_layer, hidden=n_embd, heads=n_head,
                                  dropout=dropout, init=Init.MODULES))


def gpt_loss(model, idx, targets):
    logits = model(idx)  # (B, T, vocab)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

# -----------------------------------------------------------------------------
# CNN with BatchNorm (train mode: running stats are updated every step)

class SmallCNN(nn.Module):

    def __init__(self, in_ch=3, width=8, n_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(2 * width)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, n_classes)

    def forward(self, x):
        # x: (B, in_ch, H, W) -> logits (B, n_classes)
        x = F.relu(self.bn1(self.conv1(x)))  # (B, width, H, W)
        x = F.relu(self.bn2(self.conv2(x)))  # (B, 2*width, H, W)
        x = self.pool(x).flatten(1)          # (B, 2*width)
        return self.fc(x)


def cnn_loss(model, x, y):
    return F.cross_entropy(model(x), y)

# -----------------------------------------------------------------------------
# tiny HuggingFace models (random init, no hub access)

HF_VOCAB = 96

# transformers' defaults (sdpa attention, no attention_mask): its mask utilities skip their data-dependent checks
# only for FakeTensors, which pstar-fx's tracer (autograd inside make_fx) hands them. Under torch.func.grad the
# tensors would be functorch wrappers and these models would fail to trace.

def tiny_gpt2():
    """GPT2LMHeadModel: Conv1D layers, tied lm_head/wte, learned positions."""
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=HF_VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                     bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    model.loss_type = "ForCausalLM"  # what HF picks anyway, minus a warning about the class name
    return model


def tiny_llama(attn_implementation="eager"):
    """LlamaForCausalLM: RMSNorm, SwiGLU, GQA (4 q heads / 2 kv heads), rotary inv_freq buffer.

    Eager attention by default: with transformers' default (sdpa + GQA), the aten graph that make_fx records computes
    gradients that already differ from eager autograd's in the last bits (torch itself, before pstar-fx touches the
    graph; test_equivalence covers that configuration separately)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=HF_VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=32, attention_dropout=0.0, use_cache=False,
                      bos_token_id=0, eos_token_id=0, attn_implementation=attn_implementation)
    return LlamaForCausalLM(cfg)


def hf_loss(model, input_ids, labels):
    """HF's own shifted LM loss, called the way users call it."""
    return model(input_ids=input_ids, labels=labels).loss

# -----------------------------------------------------------------------------
# registry

MODEL_SEED = 1337
BATCH_SEED = 2024


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], nn.Module]                               # unseeded constructor
    loss_fn: Callable[..., torch.Tensor]                          # loss_fn(model, *batch) -> scalar
    make_batch: Callable[[int, torch.Generator], tuple]           # random data from the generator

    def build_model(self):
        """Same weights every call; the caller's global RNG state is left untouched."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(MODEL_SEED)
            model = self.build()
        return model.train()

    def batch(self, step):
        """The batch for step `step`: a pure function of the step index (fresh seeded generator)."""
        gen = torch.Generator().manual_seed(BATCH_SEED + step)
        return self.make_batch(step, gen)

    def __repr__(self):  # short ids in pytest output
        return self.name


# Batches are random, but drawn from a fixed "teacher" so that the loss can actually fall
# (a pure-noise target would make "training works" untestable). Teachers use their own
# fixed seed; only the per-step generator varies.
_teacher = torch.Generator().manual_seed(7)
_W_REG = torch.randn(16, 8, generator=_teacher) / 4.0       # (d_in, d_out) linear teacher
_CENTROIDS = torch.randn(8, 16, generator=_teacher)         # (n_classes, d_in) class means
_COLORS = torch.randn(10, 3, generator=_teacher)            # (n_classes, C) per-class channel means
_NEXT = {v: torch.randperm(v, generator=_teacher) for v in (64, HF_VOCAB)}  # vocab -> next-token map


def _regression_batch(step, gen, B=16):
    x = torch.randn(B, 16, generator=gen)                                  # (B, d_in)
    y = x @ _W_REG + 0.1 * torch.randn(B, 8, generator=gen)                # (B, d_out)
    return x, y


def _classify_batch(step, gen, B=16):
    y = torch.randint(0, 8, (B,), generator=gen)                           # (B,) int64
    x = _CENTROIDS[y] + torch.randn(B, 16, generator=gen)                  # (B, d_in)
    return x, y


def _image_batch(step, gen, B=8, H=8, W=8):
    y = torch.randint(0, 10, (B,), generator=gen)                          # (B,) int64
    x = _COLORS[y][:, :, None, None] + torch.randn(B, 3, H, W, generator=gen)  # (B, C, H, W)
    return x, y


def _token_seq(vocab, B, T, gen):
    """(B, T) token chains: random start, then next = perm[prev], with 10% random tokens."""
    seq = torch.empty(B, T, dtype=torch.long)
    seq[:, 0] = torch.randint(0, vocab, (B,), generator=gen)
    noise = torch.randint(0, vocab, (B, T), generator=gen)
    keep = torch.rand(B, T, generator=gen) < 0.9
    for t in range(1, T):
        seq[:, t] = torch.where(keep[:, t], _NEXT[vocab][seq[:, t - 1]], noise[:, t])
    return seq


def _gpt_batch(step, gen, vocab=64, B=4, T=16):
    seq = _token_seq(vocab, B, T + 1, gen)                                 # (B, T+1)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()              # idx, targets: (B, T)


def _hf_batch(step, gen, B=4, T=16):
    input_ids = _token_seq(HF_VOCAB, B, T, gen)                            # (B, T)
    return input_ids, input_ids.clone()                                   # HF shifts labels itself


CASES = [
    Case("mlp_mse", lambda: MLP(16, 64, 8, n_layers=3, act="gelu"), mlp_loss, _regression_batch),
    Case("mlp_ce", lambda: MLP(16, 64, 8, n_layers=4, act="relu"), mlp_loss, _classify_batch),
    Case("gpt_tied", lambda: GPT(vocab=64, block_size=16, n_layer=2, n_head=2, n_embd=32),
         gpt_loss, _gpt_batch),
    Case("cnn_bn", lambda: SmallCNN(in_ch=3, width=8, n_classes=10), cnn_loss, _image_batch),
    Case("hf_gpt2", tiny_gpt2, hf_loss, _hf_batch),
    Case("hf_llama", tiny_llama, hf_loss, _hf_batch),
]
CASES_BY_NAME = {c.name: c for c in CASES}

# -----------------------------------------------------------------------------
# comparison (the eager reference runs live in harness.eager_run)

def assert_state_close(sd_a, sd_b, rtol):
    """Assert two state_dicts match: same keys, same shapes, and per key
    max|a-b| / max(max|b|, tiny) <= rtol (integer/bool tensors must match exactly).
    Values are compared in float64, so dtypes may differ (e.g. bf16 vs fp32)."""
    keys_a, keys_b = set(sd_a), set(sd_b)
    if keys_a != keys_b:
        raise AssertionError(f"state_dict keys differ: only in a: {sorted(keys_a - keys_b)}, "
                             f"only in b: {sorted(keys_b - keys_a)}")
    tiny = 1e-12
    for k in sd_b:
        a, b = torch.as_tensor(sd_a[k]).detach().cpu(), torch.as_tensor(sd_b[k]).detach().cpu()
        if a.shape != b.shape:
            raise AssertionError(f"{k}: shape {tuple(a.shape)} != {tuple(b.shape)}")
        if a.numel() == 0:
            continue
        if not (a.is_floating_point() and b.is_floating_point()):
            if not torch.equal(a.to(torch.int64), b.to(torch.int64)):
                raise AssertionError(f"{k}: integer values differ: {a.flatten()[:8].tolist()} "
                                     f"vs {b.flatten()[:8].tolist()}")
            continue
        a, b = a.to(torch.float64), b.to(torch.float64)
        if not torch.isfinite(a).all():
            raise AssertionError(f"{k}: non-finite values in a (nan/inf)")
        if not torch.isfinite(b).all():
            raise AssertionError(f"{k}: non-finite values in b (nan/inf)")
        err = (a - b).abs().max().item() / max(b.abs().max().item(), tiny)
        if err > rtol:
            raise AssertionError(f"{k}: relative error {err:.3e} > rtol {rtol:.1e} "
                                 f"(max|a-b|={(a - b).abs().max().item():.3e}, "
                                 f"max|b|={b.abs().max().item():.3e})")

# -----------------------------------------------------------------------------
# activation checkpointing in user code (tests/integration/test_checkpointing.py)

def CheckpointedGPT(vocab, block_size, n_layer, n_head, n_embd, dropout=0.0, reentrant=False):
    """nanoGPT with every block run under torch.utils.checkpoint.checkpoint (reentrant or not)."""
    return ReferenceGPT(GPTConfig(vocab=vocab, seq=block_size, layers=n_layer, hidden=n_embd, heads=n_head,
                                  dropout=dropout, init=Init.MODULES, checkpoint=True, reentrant=reentrant))


def hf_checkpointed(build, reentrant):
    """A tiny transformers model after gradient_checkpointing_enable() (use_reentrant as given), the way users turn
    it on (the method is a deprecated alias in recent transformers, hence the warning filter)."""
    import warnings
    model = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model


CHECKPOINT_CASES = [
    Case("gpt_ckpt", lambda: CheckpointedGPT(vocab=64, block_size=16, n_layer=2, n_head=2, n_embd=32),
         gpt_loss, _gpt_batch),
    Case("gpt_ckpt_reentrant", lambda: CheckpointedGPT(vocab=64, block_size=16, n_layer=2, n_head=2, n_embd=32,
                                                       reentrant=True), gpt_loss, _gpt_batch),
    Case("hf_gpt2_gc", lambda: hf_checkpointed(tiny_gpt2, False), hf_loss, _hf_batch),
    Case("hf_gpt2_gc_reentrant", lambda: hf_checkpointed(tiny_gpt2, True), hf_loss, _hf_batch),
    Case("hf_llama_gc", lambda: hf_checkpointed(tiny_llama, False), hf_loss, _hf_batch),
    Case("hf_llama_gc_reentrant", lambda: hf_checkpointed(tiny_llama, True), hf_loss, _hf_batch),
]

# -----------------------------------------------------------------------------
# mixture of experts (tests/integration/test_moe.py)

def tiny_mixtral(experts_implementation=None):
    """MixtralForCausalLM: 4 experts, top-2 routing. experts_implementation=None is transformers' default
    (grouped_mm where torch has it: sort by expert, fixed-shape grouped matmuls); "eager" loops over the experts
    hit, found with nonzero (data-dependent shapes)."""
    from transformers import MixtralConfig, MixtralForCausalLM
    kw = {} if experts_implementation is None else dict(experts_implementation=experts_implementation)
    cfg = MixtralConfig(vocab_size=HF_VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=32, use_cache=False, bos_token_id=0, eos_token_id=0,
                        attn_implementation="eager", **kw)
    return MixtralForCausalLM(cfg)


MOE_CASES = [Case("hf_mixtral", tiny_mixtral, hf_loss, _hf_batch)]
