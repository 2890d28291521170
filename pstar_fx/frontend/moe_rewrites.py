"""Module forwards that loop in Python over a data-dependent list, traced as an equal loop over a static range.

Why. transformers' eager Mixture-of-Experts code (`experts_implementation="eager"`; Mixtral's, copied verbatim into
some 50 other families) finds the experts hit with `nonzero` and loops over them in Python,
`for expert_idx in expert_hit:`. One static graph cannot hold a loop whose trip count is decided by the data: tracing
it needs the number of experts hit, which no fake tensor knows.

What is traced instead. The same computation looping over every expert (`_all_experts`). For an expert no token
chose, `torch.where(expert_mask[expert_idx])` selects no token, its matmuls have zero rows and `index_add_` adds
nothing, so the forward result is eager's bit for bit; in backward such an expert contributes exact zeros to the
gradients (x + 0 == x), so the gradients are eager's too. Indexing the expert weights with a Python int (a view)
instead of a 0-d tensor (a copy) reads the same values. Each expert's token selection stays a data-dependent size
(`nonzero`), planned at its upper bound: tokens x top-k (see ir/fx_utils).

When it applies. Only to a module whose forward is, bytecode for bytecode, the loop copied below (`_EAGER_LOOP`),
reached through transformers' dispatch set to "eager" (or None, which dispatches to it), or as the plain forward.
Anything else is traced as written; a data-dependent loop there fails with the tracer's error naming the op and the
line. The substitution is an attribute of the module instance for the length of the trace only (`rewritten`),
removed whatever happens: the model and its class are never changed.
"""
from __future__ import annotations

import contextlib
import types

import torch
from torch import nn


def _EAGER_LOOP(self, hidden_states, top_k_index, top_k_weights):
    # verbatim transformers.models.mixtral.modeling_mixtral.MixtralExperts.forward (5.x), the reference the
    # fingerprint below recognises: do not edit
    final_hidden_states = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1)
        expert_mask = expert_mask.permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()

    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        if expert_idx == self.num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        current_state = hidden_states[token_idx]
        gate, up = nn.functional.linear(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
        current_hidden_states = self.act_fn(gate) * up
        current_hidden_states = nn.functional.linear(current_hidden_states, self.down_proj[expert_idx])
        current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))

    return final_hidden_states


def _all_experts(self, hidden_states, top_k_index, top_k_weights):
    """_EAGER_LOOP over every expert 0..E-1 instead of the hit ones (E, the padding class, is never computed)."""
    final_hidden_states = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1)
        expert_mask = expert_mask.permute(2, 1, 0)

    for expert_idx in range(self.num_experts):
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])     # (n,), n <= tokens x top-k
        current_state = hidden_states[token_idx]
        gate, up = nn.functional.linear(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
        current_hidden_states = self.act_fn(gate) * up
        current_hidden_states = nn.functional.linear(current_hidden_states, self.down_proj[expert_idx])
        current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))

    return final_hidden_states


def fingerprint(fn) -> tuple | None:
    """What a function computes, up to names of its file and lines: its bytecode, the names it reads, its locals and
    constants (the docstring left out). None for what is not a plain Python function."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    consts = tuple(c for c in code.co_consts if not (isinstance(c, str) and c == fn.__doc__))
    return code.co_code, code.co_names, code.co_varnames, consts


# forward fingerprint -> the forward traced in its place (same signature, same results, static control flow)
REWRITES = {fingerprint(_EAGER_LOOP): _all_experts}


def _eager_dispatch(m: nn.Module) -> bool:
    """transformers' `use_experts_implementation` wrapper runs the wrapped forward for "eager" (and None)."""
    impl = getattr(getattr(m, "config", None), "_experts_implementation", "unknown")
    return impl in ("eager", None)


def rewrite_for(m: nn.Module):
    """The forward to trace in place of m's own, or None to trace m as written."""
    fn = type(m).forward
    inner = getattr(fn, "__wrapped__", None)
    if inner is None:
        return REWRITES.get(fingerprint(fn))
    return REWRITES.get(fingerprint(inner)) if _eager_dispatch(m) else None


@contextlib.contextmanager
def rewritten(model: nn.Module):
    """While the block runs, every submodule with a rewrite (see the module docstring) runs it as its forward."""
    done = []
    try:
        for m in model.modules():
            new = rewrite_for(m)
            if new is not None and "forward" not in vars(m):
                m.forward = types.MethodType(new, m)
                done.append(m)
        yield
    finally:
        for m in done:
            del m.forward
