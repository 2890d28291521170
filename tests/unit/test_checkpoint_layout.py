"""The fake-kernel fixes (frontend/fake_fixes.py) inside an activation checkpoint, whose recompute runs inside the
backward: batch norm over a transposed (non-contiguous) activation gets the forward's layout fixes there too, so the
recomputed values have their forward twins' layouts and what the graph records after them (a view, a Linear's saved
input) holds at run time; transformers' grouped_mm experts in float32 are routed to pstar::grouped_mm there too. The
compiled step trains what eager PyTorch + torch.optim.AdamW trains (torch without redispatch_function: skipped, the
fixes stop at the backward there)."""
import dataclasses
import enum

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import pstar_fx as px
from harness import DEVICE, HYPER, compiled_run, eager_run, fetch_counts, rel_err, tight_budget
from models import MOE_CASES, Case, assert_state_close
from pstar_fx.frontend import fake_fixes
from pstar_fx.frontend.user_checkpoint import checkpoint_regions

pytestmark = pytest.mark.skipif(not fake_fixes.IN_BACKWARD, reason="this torch has no redispatch_function")

STEPS = 3


class Tail(enum.Enum):
    """What the checkpointed region does with the norm's output, transposed back to (B, T, C)."""
    LINEAR = enum.auto()       # a Linear over the (B, T, C) sequence (folds it into rows with a view)
    ROWS = enum.auto()         # reshape to (B * T, C) rows (a view where the traced strides allow it), then a Linear


class _CheckpointedSequenceNorm(torch.nn.Module):
    """Linear, then transpose -> BatchNorm1d -> transpose -> tail inside one activation checkpoint (whose input
    requires grad, as a reentrant checkpoint needs)."""

    def __init__(self, tail: Tail, reentrant: bool):
        super().__init__()
        self.tail, self.reentrant = tail, reentrant
        # (no bias before the norm: its gradient is 0 but for rounding, which Adam would magnify)
        self.inp, self.bn, self.out = torch.nn.Linear(6, 8, bias=False), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3)

    def region(self, h):
        h = self.bn(h.transpose(1, 2)).transpose(1, 2)
        if self.tail is Tail.LINEAR:
            return self.out(h)
        return self.out(h.reshape(-1, h.shape[-1])).reshape(h.shape[0], h.shape[1], -1)

    def forward(self, x):
        return checkpoint(self.region, self.inp(x), use_reentrant=self.reentrant)


def _case(tail: Tail, reentrant: bool) -> Case:
    return Case(f"checkpointed_bn_{tail.name.lower()}_{'reentrant' if reentrant else 'non_reentrant'}",
                lambda: _CheckpointedSequenceNorm(tail, reentrant),
                lambda m, x, y: torch.nn.functional.mse_loss(m(x), y),
                lambda step, g: (torch.randn(4, 5, 6, generator=g), torch.randn(4, 5, 3, generator=g)))


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("tail", list(Tail), ids=lambda t: t.name.lower())
def test_batch_norm_over_a_transposed_input_inside_a_checkpoint_matches_eager(tail, reentrant):
    """remat=False: the step runs the recompute as the user wrote it (remat would undo the checkpoint here, where
    the activations fit)."""
    case = _case(tail, reentrant)
    ref_losses, ref_sd = eager_run(case, STEPS)
    step = px.compile(case.build_model(), optimizer=px.AdamW(**HYPER), device=DEVICE, remat=False)(case.loss_fn)
    losses = [step(*case.batch(i)).item() for i in range(STEPS)]
    assert checkpoint_regions(step.graphs["scheduled"]), "the step runs no recompute: the test does not test it"
    assert rel_err(losses, ref_losses) <= 1e-6, (losses, ref_losses)
    assert_state_close(step.state_dict(), ref_sd, rtol=1e-6)       # the norm's running statistics included


@pytest.mark.parametrize("tail", list(Tail), ids=lambda t: t.name.lower())
def test_batch_norm_inside_a_checkpoint_under_a_budget_that_evicts_matches_eager(tail):
    case = _case(tail, reentrant=False)
    budget = tight_budget(case, chunk_size=64)
    losses, sd, step = compiled_run(case, STEPS, budget=budget, chunk_size=64)
    ref_losses, ref_sd = eager_run(case, STEPS)
    g = step.final_graph
    assert max(fetch_counts(g).values()) >= 2, "no chunk was evicted and fetched again"
    assert rel_err(losses, ref_losses) <= 1e-6, (losses, ref_losses)
    assert_state_close(sd, ref_sd, rtol=1e-6)
    assert step.last_step.measured_peak <= g.plan.predicted_peak <= budget


def test_grouped_mm_experts_in_float32_under_activation_checkpoints_match_eager():
    """transformers' gradient_checkpointing_enable() over Mixtral's default experts: the recompute's grouped matmuls
    are pstar::grouped_mm, as the forward's (torch's fake kernel refuses float32)."""
    def build():
        model = MOE_CASES[0].build()
        model.gradient_checkpointing_enable()
        return model
    case = dataclasses.replace(MOE_CASES[0], name="hf_mixtral_gc", build=build)
    ref_losses, ref_sd = eager_run(case, STEPS)
    step = px.compile(case.build_model(), optimizer=px.AdamW(**HYPER), device=DEVICE, remat=False)(case.loss_fn)
    losses = [step(*case.batch(i)).item() for i in range(STEPS)]
    g = step.graphs["scheduled"]
    assert checkpoint_regions(g)
    assert any(n.target is torch.ops.pstar.grouped_mm.default for n in g.nodes)
    assert rel_err(losses, ref_losses) <= 1e-6, (losses, ref_losses)
    assert_state_close(step.state_dict(), ref_sd, rtol=1e-6)
