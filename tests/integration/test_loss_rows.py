"""A large cross-entropy in blocks of rows (passes/loss_rows): the same bits as the whole loss, less memory, and split
only where the step would not fit otherwise unless asked."""
import dataclasses

import pytest
import torch
from hypothesis import given, strategies as st
import torch.nn as nn
import torch.nn.functional as F

import pstar_fx as px
from pstar_fx.ir.graph import REMAT, LossRows, Role

from harness import DEVICE, HYPER, eager_run, host_params, rel_err
from models import CASES_BY_NAME, Case, assert_state_close

pytestmark = pytest.mark.cuda

STEPS = 3
aten = torch.ops.aten


def _compiled(case: Case, when: LossRows, *, block=2048, budget=None, precision="fp32", fuse=False):
    """Unfused unless asked: compiled regions (the default for bf16 on a GPU) make their own sums, which differ in
    the last bits between two graphs that are not the same."""
    return px.compile(case.build_model(), optimizer=px.AdamW(**HYPER), device_memory=budget, precision=precision,
                      device=DEVICE, debug=True, fuse=fuse, _loss_rows=when, _loss_block_bytes=block)(case.loss_fn)


def _train(step, case: Case):
    losses = [step(*case.batch(i)).item() for i in range(STEPS)]
    return losses, step.state_dict()


def _log_softmaxes(g) -> list[tuple[int, ...]]:
    return [tuple(n.meta["val"].shape) for n in g.gm.graph.nodes if n.target is aten._log_softmax.default]


class Head(nn.Module):
    """An embedding and a projection onto a large vocabulary: the loss's tensors are most of the step's memory."""

    def __init__(self, vocab=512, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.out = nn.Linear(d, vocab)

    def forward(self, idx):
        return self.out(torch.tanh(self.mix(self.emb(idx))))


def _head_case(name, loss, vocab=512, ignore=-100, B=4, T=16) -> Case:
    def batch(step, gen):
        idx = torch.randint(0, vocab, (B, T), generator=gen)
        tgt = torch.randint(0, vocab, (B, T), generator=gen)
        tgt[0, : T // 2] = ignore
        if ignore == 0:
            tgt[1:, :3] = 0                 # ignored rows beside the ones above
        return idx, tgt
    return Case(name, lambda: Head(vocab), loss, batch)


def _ce(reduction="mean", ignore=-100, cast=True):
    def loss(model, idx, tgt):
        logits = model(idx)
        logits = logits.float() if cast else logits
        out = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=ignore, reduction=reduction)
        return out if reduction != "none" else (out * torch.linspace(0.5, 1.5, out.numel(), device=out.device)).sum()
    return loss


HEAD_CASES = [
    _head_case("mean", _ce()),
    _head_case("sum_ignore_0", _ce("sum", ignore=0), ignore=0),
    _head_case("none_weighted", _ce("none")),
    _head_case("no_cast_rows_uneven", _ce(cast=False), B=3, T=11),
    # the target flattened after the log-softmax is traced, dim=-1
    _head_case("log_softmax_nll", lambda m, i, t: F.nll_loss(F.log_softmax(m(i).float().flatten(0, 1), -1),
                                                              t.flatten())),
    # the log-softmax in half precision, converted for the loss: CUDA's autocast makes this of F.cross_entropy of
    # bf16 logits (cross_entropy asks log_softmax for the logits' dtype, nll_loss runs in fp32)
    _head_case("half_log_softmax", lambda m, i, t: F.nll_loss(
        torch.log_softmax(m(i).flatten(0, 1).to(torch.bfloat16), -1, dtype=torch.bfloat16).float(), t.flatten())),
]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("case", [CASES_BY_NAME["gpt_tied"], CASES_BY_NAME["hf_llama"]] + HEAD_CASES,
                         ids=lambda c: c.name)
def test_blocks_of_rows_train_the_whole_losss_bits(case, precision):
    """The same losses and final values, bit for bit, as the loss computed whole, under a budget that evicts (on a
    GPU an unlimited one: the blocks' smaller need changes which optimizer states the plan keeps on the device, and
    torch's CPU and CUDA AdamW kernels round differently); the plan's peak measured exactly; in fp32 eager's training
    to 1e-6."""
    whole = _compiled(case, LossRows.NEVER, precision=precision)
    budget = None if DEVICE == "cuda" else int(whole.min_device_memory(*case.batch(0)) * 1.3)
    whole = _compiled(case, LossRows.NEVER, budget=budget, precision=precision)
    blocks = _compiled(case, LossRows.ALWAYS, budget=budget, precision=precision)
    ref_losses, ref_sd = _train(whole, case)
    losses, sd = _train(blocks, case)
    split = _log_softmaxes(blocks.graphs["loss_rows"])
    rows = _log_softmaxes(whole.graphs["loss_rows"])
    assert len(rows) == 1 and len(split) >= 4, (rows, split)
    assert all(s[0] < rows[0][0] for s in split) and sum(s[0] for s in split) == 2 * rows[0][0]   # forward + backward
    assert blocks.graphs["loss_rows"].made_by.startswith("loss_rows (1 cross-entropy loss")
    again = [n for n in blocks.graphs["loss_rows"].gm.graph.nodes
             if n.target is aten._log_softmax.default and REMAT in n.meta]
    assert len(again) == len(split) // 2 and "recompute" in str(blocks.graphs["loss_rows"])
    assert losses == ref_losses
    assert all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd), [k for k in ref_sd if not torch.equal(sd[k], ref_sd[k])]
    assert blocks.last_step.measured_peak == blocks.final_graph.plan.predicted_peak
    assert budget is None or blocks.last_step.measured_peak <= budget
    if precision == "fp32":
        eager_losses, eager_sd = eager_run(case, STEPS)
        assert rel_err(losses, eager_losses) <= 1e-6, (losses, eager_losses)
        assert_state_close(sd, eager_sd, rtol=1e-6)


def test_the_step_splits_its_loss_only_where_it_would_not_fit_otherwise():
    """The default (WHERE_NEEDED): at a budget the whole loss fits, nothing is split; below the least budget of the
    whole loss, where NEVER raises BudgetError, remat splits it and the step trains as eager does (on the CPU bit for
    bit as the whole loss at the larger budget); the least budget step.min_device_memory names is the split one's."""
    case = _head_case("mean", _ce(), vocab=2048)
    never = _compiled(case, LossRows.NEVER).min_device_memory(*case.batch(0))
    needed = _compiled(case, LossRows.WHERE_NEEDED).min_device_memory(*case.batch(0))
    assert needed < 0.85 * never, (needed, never)

    roomy = _compiled(case, LossRows.WHERE_NEEDED, budget=int(never * 1.2))
    ref_losses, ref_sd = _train(_compiled(case, LossRows.NEVER, budget=int(never * 1.2)), case)
    assert _train(roomy, case)[0] == ref_losses
    assert len(_log_softmaxes(roomy.final_graph)) == 1
    assert not any("cross-entropy" in str(c) for c in roomy.final_graph.choices)

    tight = int((needed + never) / 2)
    with pytest.raises(px.BudgetError):
        _train(_compiled(case, LossRows.NEVER, budget=tight), case)
    step = _compiled(case, LossRows.WHERE_NEEDED, budget=tight)
    losses, sd = _train(step, case)
    eager_losses, eager_sd = eager_run(case, STEPS, host_params=host_params(step))
    assert rel_err(losses, eager_losses) <= 1e-6, (losses, eager_losses)
    assert_state_close(sd, eager_sd, rtol=1e-6)
    if DEVICE == "cpu":             # one AdamW kernel wherever the states live
        assert losses == ref_losses
        assert all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd)
    assert len(_log_softmaxes(step.final_graph)) > 2
    assert any("cross-entropy loss computed in blocks of rows" in str(c) for c in step.final_graph.choices)
    assert step.last_step.measured_peak == step.final_graph.plan.predicted_peak <= tight


@pytest.mark.parametrize("loss", [
    lambda m, i, t: F.cross_entropy(m(i).float().flatten(0, 1), t.flatten(), label_smoothing=0.1),
    lambda m, i, t: F.cross_entropy(m(i).float().flatten(0, 1), t.flatten(), weight=torch.linspace(
        0.5, 1.5, 512, device=t.device)),
], ids=["label_smoothing", "class_weights"])
def test_losses_outside_the_pattern_stay_whole_and_train(loss):
    case = dataclasses.replace(_head_case("other", loss), loss_fn=loss)
    step = _compiled(case, LossRows.ALWAYS)
    losses, _ = _train(step, case)
    assert step.graphs["loss_rows"].made_by == "loss_rows (nothing split)"
    eager_losses, _ = eager_run(case, STEPS)
    assert rel_err(losses, eager_losses) <= 1e-6


def test_blocks_in_compiled_regions_train_as_eager():
    """fuse=True: the blocks' nodes compile into regions like any compute (Inductor's own sums: eager's training
    to 1e-5, as tests/integration/test_fuse.py holds fused steps), under a budget that evicts, the plan's peak
    measured exactly. Blocks of 8 rows: 8 of them (one row a block would make 64, and twice the compile time)."""
    case = HEAD_CASES[0]
    whole = _compiled(case, LossRows.NEVER)
    budget = None if DEVICE == "cuda" else int(whole.min_device_memory(*case.batch(0)) * 1.3)
    step = _compiled(case, LossRows.ALWAYS, budget=budget, fuse=True, block=16384)
    losses, sd = _train(step, case)
    assert len(_log_softmaxes(step.graphs["loss_rows"])) >= 8
    regions = [n for n in step.final_graph.nodes if step.final_graph.ann[n.name].role is Role.REGION]
    assert step.final_graph.stage == "fused" and regions
    eager_losses, eager_sd = eager_run(case, STEPS, host_params=host_params(step))
    assert rel_err(losses, eager_losses) <= 1e-5, (losses, eager_losses)
    assert_state_close(sd, eager_sd, rtol=1e-5)
    assert step.last_step.measured_peak == step.final_graph.plan.predicted_peak


class _Logits(nn.Module):
    """Logits of any shape from a parameter, so that the loss's rows, vocabulary and dtype are the test's to choose."""

    def __init__(self, rows, vocab, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = nn.Parameter(torch.randn(rows, vocab, generator=g) * 3)

    def forward(self, x):
        return self.w * x


@given(rows=st.integers(1, 40), vocab=st.integers(2, 96), block_rows=st.integers(1, 12),
       reduction=st.sampled_from(["mean", "sum", "none"]), ignore=st.sampled_from([-100, 0, 3]),
       ignored=st.sampled_from(["some", "none", "all"]), form=st.sampled_from(["fp32", "cast", "half"]),
       seed=st.integers(0, 2 ** 16))
def test_any_shape_and_targets_give_the_whole_losss_bits(rows, vocab, block_rows, reduction, ignore, ignored, form,
                                                         seed):
    """Property: whatever the rows, the vocabulary, the rows a block holds (uneven last blocks, one row a block,
    blocks of every row), the reduction and the ignored targets (none, some, all: a mean over no rows is NaN both
    ways), the blocks give the whole loss's value and gradient bit for bit, in each of the pattern's forms (fp32
    logits, half logits converted to fp32, a half log-softmax converted for the loss)."""
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.rand(rows, vocab, generator=gen) + 0.5
    tgt = torch.randint(0, vocab, (rows,), generator=gen)
    if ignored == "some":
        tgt[torch.rand(rows, generator=gen) < 0.3] = ignore
    elif ignored == "all":
        tgt[:] = ignore

    def loss_fn(m, x, t):
        z = m(x)
        if form == "cast":
            z = z.to(torch.bfloat16).float()
        if form == "half":
            ls = torch.log_softmax(z.to(torch.bfloat16), -1, dtype=torch.bfloat16).float()
            out = F.nll_loss(ls, t, ignore_index=ignore, reduction=reduction)
        else:
            out = F.cross_entropy(z, t, ignore_index=ignore, reduction=reduction)
        return out.sum() if reduction == "none" else out

    def run(when):
        step = px.compile(_Logits(rows, vocab, seed), optimizer=px.SGD(lr=0.5), device="cpu", fuse=False,
                          _loss_rows=when, _loss_block_bytes=block_rows * vocab * 4)(loss_fn)
        losses = [step(x, tgt).item() for _ in range(2)]
        return step, losses, step.state_dict()["w"]

    whole, whole_losses, whole_w = run(LossRows.NEVER)
    blocks, losses, w = run(LossRows.ALWAYS)
    blocks_made = len(_log_softmaxes(blocks.graphs["loss_rows"])) // 2     # forward's and backward's
    assert blocks_made == (-(-rows // block_rows) if rows >= 2 * block_rows else 0)
    assert torch.equal(torch.tensor(losses), torch.tensor(whole_losses)) or \
        (torch.isnan(torch.tensor(losses)).all() and torch.isnan(torch.tensor(whole_losses)).all())
    assert torch.equal(w, whole_w) or torch.equal(w.isnan(), whole_w.isnan()) and \
        torch.equal(w.nan_to_num(), whole_w.nan_to_num()), (w - whole_w).abs().max()
