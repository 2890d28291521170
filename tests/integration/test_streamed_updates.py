"""Streamed updates: a chunk whose optimizer states live on the host is updated on the device (after the commit; with
atomic=False right after its last use), its states copied into a device slot before its step and back to their host
home after it (ChunkInfo.streamed).

On the CPU the "device" is the CPU too, so the copies are real copies between buffers and the device Adam is the
same kernel as the CPU worker's: a streamed step must equal the CPU-updated step bit for bit (fp32, bf16, fp16) and
eager AdamW at the suite's tolerance, under budgets that evict chunks, with the plan's peak measured exactly
(debug=True). A failure before the commit changes nothing; after it, CommitError. Checkpoints do not see where an
update ran. The cost model chooses how many chunks stream when the CPU bounds the step.
"""
import dataclasses
import re

import pytest
import torch

import pstar_fx as px
from pstar_fx.cost import H200, estimate
from pstar_fx.ir import Role, ops
from pstar_fx.ir.graph import BufKind
from pstar_fx.passes import VerificationError, place_optimizer, schedule, verify
from pstar_fx.passes.update_sites import no_stream_reason

from harness import (HYPER, assert_values_equal, eager_run, fetch_counts, rel_err, small_batches, step_values,
                     tight_budget)
from models import CASES_BY_NAME, assert_state_close

CNN = small_batches(CASES_BY_NAME["cnn_bn"])       # BatchNorm buffers, fp32
GPT = small_batches(CASES_BY_NAME["gpt_tied"])     # tied weights, gradients in place in half precision
ALL = 1000                                          # more chunks than any case has: every one that fits streams


def _case(precision):
    return CNN if precision == "fp32" else GPT


def _step(case, precision, budget, device_updates, debug=True, **kw):
    return px.compile(case.build_model(), optimizer=px.AdamW(**HYPER), device_memory=budget, chunk_size=256,
                      precision=precision, device="cpu", debug=debug, _device_updates=device_updates,
                      **kw)(case.loss_fn)


def _budget(case, precision, slack=1.1):
    """Just above the least budget: every optimizer state on the host, chunks evicted and fetched again."""
    return int(_step(case, precision, None, None).min_device_memory(*case.batch(0)) * slack)


def _streamed(step) -> list[int]:
    return [c.id for c in step.graphs["scheduled"].chunks if c.streamed]


def _states(step) -> list[torch.Tensor]:
    store = step._compiler.store
    store.flush()
    return [s.clone() for s in store.states if s is not None]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_streamed_step_equals_the_cpu_updated_step_bit_for_bit(precision):
    case = _case(precision)
    budget = _budget(case, precision)
    cpu, streamed = _step(case, precision, budget, 0), _step(case, precision, budget, ALL)
    for i in range(3):
        assert torch.equal(cpu(*case.batch(i)), streamed(*case.batch(i))), f"loss of step {i}"
        # debug=True: the executor checked measured == predicted device bytes at every node
        assert streamed.last_step.measured_peak == streamed.graphs["scheduled"].plan.predicted_peak <= budget
    g = streamed.graphs["scheduled"]
    host = [c.id for c in g.chunks if c.state_home is not None and c.state_home.value == "host"]
    assert _streamed(cpu) == [] and len(_streamed(streamed)) >= len(host) // 2 > 0, (_streamed(streamed), host)
    assert {c.state_home for c in g.chunks} == {c.state_home for c in cpu.graphs["scheduled"].chunks}
    sd_cpu, sd_streamed = cpu.state_dict(), streamed.state_dict()
    assert all(torch.equal(sd_cpu[k], sd_streamed[k]) for k in sd_cpu)
    assert all(torch.equal(a, b) for a, b in zip(_states(cpu), _states(streamed)))
    # each streamed chunk's states crossed the link both ways in the plan: 4 bytes per state element
    moved = {(g.ann[n.name].chunk, n.target.__name__) for n in g.nodes if g.ann[n.name].buf is BufKind.STATES}
    assert moved == {(c, op) for c in _streamed(streamed) for op in ("fetch", "release")}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_atomic_false_streamed_steps_equal_its_cpu_updated_steps_bit_for_bit(precision):
    """atomic=False: the streamed chunks' steps come right after their last use, before the commit, the CPU's too;
    on the CPU (one kernel for both sites) training equals the step whose CPU updates every host-placed chunk, bit
    for bit, with the plan's peak measured at every node (debug=True) under a budget that evicts."""
    case = _case(precision)
    budget = _budget(case, precision)
    cpu = _step(case, precision, budget, 0, atomic=False)
    streamed = _step(case, precision, budget, ALL, atomic=False)
    for i in range(3):
        assert torch.equal(cpu(*case.batch(i)), streamed(*case.batch(i))), f"loss of step {i}"
        assert streamed.last_step.measured_peak == streamed.graphs["scheduled"].plan.predicted_peak <= budget
    g = streamed.graphs["scheduled"]
    commit = next(i for i, n in enumerate(g.nodes) if g.ann[n.name].role is Role.COMMIT)
    early = [g.ann[n.name].chunk for n in g.nodes[:commit] if g.ann[n.name].role is Role.OPTIMIZER_STEP]
    assert _streamed(streamed) and set(_streamed(streamed)) <= set(early)
    sd_cpu, sd_streamed = cpu.state_dict(), streamed.state_dict()
    assert all(torch.equal(sd_cpu[k], sd_streamed[k]) for k in sd_cpu)
    assert all(torch.equal(a, b) for a, b in zip(_states(cpu), _states(streamed)))


def test_streamed_training_under_eviction_equals_eager():
    budget = _budget(CNN, "fp32", slack=1.05)
    step = _step(CNN, "fp32", budget, ALL)
    losses = [step(*CNN.batch(i)).item() for i in range(4)]
    want_losses, want_sd = eager_run(CNN, 4)
    assert _streamed(step)
    assert max(fetch_counts(step.graphs["scheduled"]).values()) >= 2, "no chunk was evicted and fetched again"
    assert rel_err(losses, want_losses) <= 1e-6, (losses, want_losses)
    assert_state_close(step.state_dict(), want_sd, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_failure_at_every_node_before_the_commit_changes_nothing_after_it_is_a_commit_error(precision, tmp_path):
    case = _case(precision)
    budget = _budget(case, precision)
    ref = _step(case, precision, budget, ALL, debug=False)
    for i in range(3):
        ref(*case.batch(i))
    want = step_values(ref)

    step = _step(case, precision, budget, ALL, debug=False)
    step(*case.batch(0))
    step(*case.batch(1))
    g = step.graphs["scheduled"]
    roles = [g.ann[n.name].role for n in g.nodes]
    commit = roles.index(Role.COMMIT)
    before = step_values(step)
    for at in range(commit + 1):
        def fail(i, node, at=at):
            if i == at:
                raise RuntimeError("injected")
        step._before_node = fail
        with pytest.raises(RuntimeError, match="injected"):
            step(*case.batch(99))
        step._before_node = None
        assert_values_equal(step_values(step), before, f"failure before node {at}")
    step(*case.batch(2))
    assert_values_equal(step_values(step), want, "the step after the failed ones")

    # after the commit: between a streamed chunk's states fetch and their write-back, and at its step
    step.save(tmp_path / "ckpt")
    streamed = set(_streamed(step))
    after = [i for i in range(commit + 1, len(g.nodes)) if g.ann[g.nodes[i].name].chunk in streamed
             and (roles[i] is Role.OPTIMIZER_STEP or g.ann[g.nodes[i].name].buf is BufKind.STATES)]
    assert after
    for at in after:
        step.load(tmp_path / "ckpt")
        step._before_node = lambda i, node, at=at: (_ for _ in ()).throw(RuntimeError("device fault")) \
            if i == at else None
        with pytest.raises(px.CommitError, match="device fault"):
            step(*case.batch(3))
        step._before_node = None
        with pytest.raises(px.CommitError, match="Load a checkpoint"):
            step(*case.batch(4))


@pytest.mark.slow
def test_checkpoints_do_not_see_where_updates_ran(tmp_path):
    """Saved from a streamed step, loaded into a CPU-updated one (and the other way): equal to the uninterrupted
    run."""
    budget = _budget(GPT, "bf16")
    whole = _step(GPT, "bf16", budget, 0)
    for i in range(4):
        whole(*GPT.batch(i))
    for first, second in ((ALL, 0), (0, ALL)):
        a = _step(GPT, "bf16", budget, first)
        a(*GPT.batch(0))
        a(*GPT.batch(1))
        a.save(tmp_path / f"from-{first}")
        b = _step(GPT, "bf16", budget, second)
        b.load(tmp_path / f"from-{first}")
        b(*GPT.batch(2))
        b(*GPT.batch(3))
        sd, want = b.state_dict(), whole.state_dict()
        assert all(torch.equal(sd[k], want[k]) for k in want)
        assert all(torch.equal(x, y) for x, y in zip(_states(b), _states(whole)))


def test_a_retrace_places_its_own_streamed_updates():
    """A retrace (another batch shape) inherits the first plan's chunks, not which of them stream: its placement
    decides again, and the step runs and verifies."""
    case = CASES_BY_NAME["gpt_tied"]
    step = px.compile(case.build_model(), optimizer=px.AdamW(**HYPER), device="cpu", chunk_size=512,
                      device_memory=tight_budget(case, chunk_size=512), debug=True, _device_updates=ALL)(case.loss_fn)
    x, y = case.batch(0)
    step(x, y)
    assert any(c.streamed for c in step.graphs["scheduled"].chunks)
    loss = step(x[:1], y[:1])
    assert torch.isfinite(loss)
    g = step.graphs["scheduled"]
    verify(g)
    assert all(c.state_home is not None and c.state_home.value == "host" for c in g.chunks if c.streamed)


def test_verifier_checks_the_streamed_states_moves():
    step = _step(CNN, "fp32", _budget(CNN, "fp32"), ALL)
    step(*CNN.batch(0))
    g = step.graphs["scheduled"]
    verify(g)
    back = next(n for n in g.nodes if n.target is ops.release and g.ann[n.name].buf is BufKind.STATES)
    fetch = next(n for n in g.nodes if n.target is ops.fetch and g.ann[n.name].buf is BufKind.STATES)
    back.kwargs = {**back.kwargs, "writeback": False}
    with pytest.raises(VerificationError, match="dropped without write-back"):
        verify(g)
    back.kwargs = {**back.kwargs, "writeback": True}
    fetch.target = ops.alloc
    with pytest.raises(VerificationError, match="allocated zeroed"):
        verify(g)
    fetch.target = ops.fetch
    verify(g)


def _slow_cpu_graph():
    """The optimizer stage's input of a step whose budget keeps every optimizer state on the host."""
    step = _step(GPT, "bf16", _budget(GPT, "bf16", slack=1.5), None)
    step(*GPT.batch(0))
    return step.graphs["remat"]


def test_the_cost_model_streams_when_the_cpu_bounds_the_step_and_not_when_it_does_not():
    g = _slow_cpu_graph()
    slow = dataclasses.replace(H200, cpu_adam=1e4, cpu_adam_mixed=1e4)      # the CPU bounds the step
    fast = dataclasses.replace(H200, cpu_adam=1e15, cpu_adam_mixed=1e15)    # the CPU costs nothing
    chosen = place_optimizer(g, slow)
    none = place_optimizer(g.evolve(settings=dataclasses.replace(g.settings, device_updates=0)), slow)
    k = sum(c.streamed for c in chosen.chunks)
    assert k > 0
    assert estimate(schedule(chosen), slow).seconds < estimate(schedule(none), slow).seconds
    # why, with the candidates' estimates, is recorded for step.summary()
    why = [c.why for c in chosen.choices if c.made_by == "place_optimizer"]
    assert any(re.match(rf"{k} of \d+ host-placed chunks updated on the device", w) and f"{k}: " in w
               for w in why), why
    assert sum(c.streamed for c in place_optimizer(g, fast).chunks) == 0
    # atomic=False: the CPU updates during backward, and the cost model streams there too when the CPU bounds the
    # step, each streamed step right after its chunk's last use, before the commit
    early_settings = dataclasses.replace(g.settings, atomic=False)
    early = place_optimizer(g.evolve(settings=early_settings), slow)
    assert sum(c.streamed for c in early.chunks) > 0
    roles = [early.ann[n.name].role for n in early.nodes]
    commit = roles.index(Role.COMMIT)
    assert all(i < commit for i, n in enumerate(early.nodes)
               if roles[i] is Role.OPTIMIZER_STEP and early.chunks[early.ann[n.name].chunk].streamed)
    verify(schedule(early))
    none_early = place_optimizer(g.evolve(settings=dataclasses.replace(early_settings, device_updates=0)), slow)
    assert estimate(schedule(early), slow).seconds < estimate(schedule(none_early), slow).seconds
    assert sum(c.streamed for c in place_optimizer(g.evolve(settings=early_settings), fast).chunks) == 0


def test_several_ranks_do_not_stream_and_say_why():
    g = _slow_cpu_graph()
    two = dataclasses.replace(g.settings, world=2)
    assert "several ranks" in no_stream_reason(two)
    with pytest.raises(ValueError, match="several ranks"):
        place_optimizer(g.evolve(settings=dataclasses.replace(two, device_updates=ALL)))
    roomy = g.evolve(settings=dataclasses.replace(two, device_updates=ALL, budget=None))   # every state on the device
    with pytest.raises(ValueError, match="several ranks"):
        place_optimizer(roomy)


def test_summary_and_plan_say_how_many_chunks_stream():
    step = _step(GPT, "bf16", _budget(GPT, "bf16"), ALL)
    step(*GPT.batch(0))
    n = len(_streamed(step))
    assert n and f"{n} updated on the device (states streamed)" in str(step.summary())
    assert step.summary().states_streamed == n
    # and why the plan is what it is: remat's and place_optimizer's choices, in pass order, under "why"
    text = str(step.summary())
    why = text[text.index("              why: "):].splitlines()
    assert why[0].strip().startswith("why: remat: ")
    assert [w.strip().split(":")[0] for w in why[1:]] == ["place_optimizer"] * (len(why) - 1) and len(why) >= 3
    assert any("_device_updates asks" in w for w in why), why


@pytest.mark.parametrize("make_opt", [lambda: px.SGD(lr=1e-2, momentum=0.9, weight_decay=1e-2),
                                      lambda: px.optim_from_torch(torch.optim.RMSprop, lr=1e-3, alpha=0.9),
                                      lambda: px.Lion(lr=1e-4, weight_decay=0.1)],
                         ids=["sgd_momentum", "rmsprop", "lion"])
def test_streamed_step_of_other_optimizers_equals_the_cpu_updated_step(make_opt):
    """Streamed updates go through the same device update as device-state chunks, whatever the optimizer: its own
    state layout is fetched, updated and written back."""
    def step(updates, budget):
        return px.compile(CNN.build_model(), optimizer=make_opt(), device_memory=budget, chunk_size=256,
                          precision="fp32", device="cpu", debug=True, _device_updates=updates)(CNN.loss_fn)
    budget = int(step(None, None).min_device_memory(*CNN.batch(0)) * 1.1)
    cpu, streamed = step(0, budget), step(ALL, budget)
    for i in range(3):
        assert torch.equal(cpu(*CNN.batch(i)), streamed(*CNN.batch(i))), f"loss of step {i}"
    assert _streamed(streamed)
    sd_cpu, sd_streamed = cpu.state_dict(), streamed.state_dict()
    assert all(torch.equal(sd_cpu[k], sd_streamed[k]) for k in sd_cpu)
    assert all(torch.equal(a, b) for a, b in zip(_states(cpu), _states(streamed)))


def test_a_tie_in_the_estimate_goes_to_fewer_streamed_chunks():
    """Candidates whose estimates differ only in the last bits (the same times summed in another order) tie; the
    one that streams fewer chunks, moving fewer bytes, is kept."""
    from pstar_fx.passes.update_sites import _fastest
    step = 0.0036899999999998488
    assert _fastest({0: (step * (1 + 1e-15),), 2: (step,), 5: (step * 0.999,)}) == 5
    assert _fastest({0: (step * (1 + 1e-15),), 2: (step,), 5: (step * 1.01,)}) == 0
