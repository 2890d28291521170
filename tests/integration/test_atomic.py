"""A step is atomic: a failure or interruption at any node leaves every value as it was, or completes the step.

The fault-injection fixture raises at every node position of a small model's executed graph in turn (fp32, bf16,
fp16; unlimited and tight budgets). Before the commit point an exception propagates and every value (parameters,
optimizer states and step counts, module buffers, the loss scale, the half-precision chunk homes) is exactly as
before the step, and the next step equals a run that never saw the failed one. From the commit point on, Ctrl-C is
held until the update is complete, then delivered; any other failure there, once an update has begun, is a
CommitError and the step refuses further use (one before the first update is put back).
"""
import os
import signal

import pytest
import torch
import torch.nn as nn

import pstar_fx as px
from pstar_fx.ir import Role

from harness import (assert_values_equal, check_failures_before_the_commit, compiled_step, raiser, step_values,
                     tight_budget)
from models import CASES_BY_NAME, assert_state_close

pytestmark = pytest.mark.cuda

CASE = CASES_BY_NAME["cnn_bn"]       # parameters, BatchNorm buffers mutated in place, an int64 counter
HALF_CASE = CASES_BY_NAME["gpt_tied"]  # tied weights; gradients overwrite half-precision parameters in place


def _case(precision):
    return CASE if precision == "fp32" else HALF_CASE


def _make(precision, tight):
    """tight: True (the least budget), "roomy" (a budget where some chunks stay resident across steps, stale on the
    host, while others move), or False (unlimited: every chunk stays resident)."""
    case = _case(precision)
    budget = tight_budget(case, chunk_size=256, slack=1.6 if tight == "roomy" else 1.05) if tight else None
    return compiled_step(case, budget=budget, chunk_size=256, precision=precision, debug=False)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("tight", [False, True, "roomy"], ids=["unlimited", "tight", "roomy"])
def test_failure_at_every_node_before_the_commit_changes_nothing(precision, tight):
    check_failures_before_the_commit(lambda: _make(precision, tight), _case(precision), f"{precision}, {tight}")


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_failure_after_the_commit_before_any_update_changes_nothing(precision):
    """One rank: from the commit point to the first update nothing has been written yet, so a failure there (a
    signal handler that raises, an out-of-memory error) is put back like one before it, not a CommitError."""
    check_failures_before_the_commit(lambda: _make(precision, True), _case(precision), precision,
                                     through_first_update=True)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("tight", [False, True], ids=["unlimited", "tight"])
def test_ctrl_c_after_the_commit_is_held_until_the_step_is_complete(precision, tight, tmp_path):
    """Each position after the commit point in turn: Ctrl-C there, then the state equals an uninterrupted step's.
    Every trial but the first starts from a checkpoint of the state after the first batch (one compile instead of
    one per position; checkpoints resume exactly, tests/integration/test_checkpoint.py)."""
    CASE = _case(precision)
    ref = _make(precision, tight)
    ref(*CASE.batch(0))
    ref(*CASE.batch(1))
    want = step_values(ref)

    trial = _make(precision, tight)
    trial(*CASE.batch(0))
    trial.save(tmp_path / "after_batch_0")
    nodes = trial.final_graph.nodes
    roles = [trial.final_graph.ann[n.name].role for n in nodes]
    commit = roles.index(Role.COMMIT)
    positions = list(range(commit + 1, len(nodes)))
    assert any(roles[i] is Role.OPTIMIZER_STEP for i in positions)
    snaps = []
    for k, at in enumerate(positions):
        if k:
            trial.load(tmp_path / "after_batch_0")
        trial._before_node = lambda i, n, at=at: signal.raise_signal(signal.SIGINT) if i == at else None
        with pytest.raises(KeyboardInterrupt):
            trial(*CASE.batch(1))
        trial._before_node = None
        snaps.append((at, step_values(trial)))
    for at, snap in snaps:
        assert_values_equal(snap, want, f"{precision}: Ctrl-C before node {at} ({nodes[at].name})")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_failure_after_the_commit_is_a_clear_error_and_the_step_refuses_further_use(tmp_path):
    step = _make("fp32", False)
    step(*CASE.batch(0))
    step.save(tmp_path / "good")
    g = step.final_graph
    roles = [g.ann[n.name].role for n in g.nodes]
    second_update = [i for i, r in enumerate(roles) if r is Role.OPTIMIZER_STEP][1]
    step._before_node = raiser(second_update, RuntimeError("device fault"))
    with pytest.raises(px.CommitError, match=r"the updates of 1 of .* chunks begun"):
        step(*CASE.batch(1))
    step._before_node = None
    with pytest.raises(px.CommitError, match="Load a checkpoint"):
        step(*CASE.batch(2))
    good = sorted(os.listdir(tmp_path / "good"))
    with pytest.raises(px.CommitError, match="save.*refused: the values are not consistent"):
        step.save(tmp_path / "good")           # a crash handler's save would replace the good checkpoint
    assert sorted(os.listdir(tmp_path / "good")) == good
    step.load(tmp_path / "good")
    step(*CASE.batch(1))                       # a load makes the step whole again


def test_failed_step_then_training_matches_eager_that_never_saw_it():
    """fp32, tight budget: a step that fails in backward leaves no trace; training goes on equal to eager."""
    from harness import eager_run
    budget = tight_budget(CASE, chunk_size=256)
    step = compiled_step(CASE, budget=budget, chunk_size=256)
    losses = [step(*CASE.batch(0)).item()]
    g = step.final_graph
    last_write = max(i for i, n in enumerate(g.nodes) if g.ann[n.name].role is Role.WRITE_GRAD)
    step._before_node = raiser(last_write, RuntimeError("injected in backward"))
    with pytest.raises(RuntimeError, match="injected in backward"):
        step(*CASE.batch(1))
    step._before_node = None
    losses += [step(*CASE.batch(i)).item() for i in (1, 2, 3)]
    want_losses, want_sd = eager_run(CASE, 4)
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses)) < 1e-6
    assert_state_close(step.state_dict(), want_sd, rtol=1e-6)


@pytest.mark.parametrize("exc", [RuntimeError("injected"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_a_failed_step_draws_nothing_from_the_random_generators(exc):
    """With dropout, the steps after a failed one draw the masks a run that never saw it draws: the failure puts
    the generators back with the values."""

    def run(fail_at):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.5), nn.ReLU(), nn.Linear(32, 4))
        step = px.compile(model, optimizer=px.AdamW(lr=1e-2), device="cpu")(
            lambda m, x, y: torch.nn.functional.mse_loss(m(x), y))
        g = torch.Generator().manual_seed(1)
        batches = [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(3)]
        losses = [step(*batches[0]).item()]
        if fail_at is not None:
            roles = [step.final_graph.ann[n.name].role for n in step.final_graph.nodes]
            step._before_node = raiser(roles.index(Role.COMMIT) if fail_at == "commit" else fail_at, exc)
            with pytest.raises(type(exc)):
                step(*batches[1])
            step._before_node = None
        losses += [step(*b).item() for b in batches[1:]]
        return losses, step_values(step)
    want, values = run(None)
    for at in (5, "commit"):            # after the dropout mask was drawn, and at the commit
        got, got_values = run(at)
        assert got == want, (at, got, want)
        assert_values_equal(got_values, values, f"failure before node {at}")
