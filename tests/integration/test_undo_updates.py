"""Atomic steps that update host-placed chunks before their commit, keeping the previous values in undo buffers.

The CPU worker updates such a chunk (ChunkInfo.undo) right after backward is done with it, first copying its states
(and in fp32 its parameters) into an undo buffer; a step that fails anywhere before its commit (an error, a failed
update, Ctrl-C) puts them back and changes nothing. Checked: training is bit for bit the atomic step's without undo
buffers (bf16 and fp32, at a tight budget that puts every state on the host); the graph puts the undo chunks' steps
right after their chunk's last use; failures injected before the commit at every node from the first undo step on,
a failure inside an update ahead of the commit and a Ctrl-C all leave every value as it was, and the step then trains
on exactly as one that never failed; the verifier refuses undo where it is not allowed; the cost model chooses undo
buffers within the host budget only; px.compile refuses bad `_undo_updates`.
"""
import dataclasses
import signal
import time

import pytest
import torch

import pstar_fx as px
from pstar_fx import cost
from pstar_fx.ir import Role, StateHome
from pstar_fx.ir.graph import BufKind
from pstar_fx.ir.needs import all_needs, host_bytes, state_layout, undo_bytes
from pstar_fx.passes import verify
from pstar_fx.passes.update_sites import undo_room
from pstar_fx.passes.verify import VerificationError
from pstar_fx.runtime import step_runtime

from harness import (DEVICE, HYPER, assert_values_equal, check_failures_before_the_commit, eager_run, host_params,
                     raiser, rel_err, small_batches, step_values, tight_budget)
from models import CASES_BY_NAME, assert_state_close

pytestmark = pytest.mark.cuda

CASE = small_batches(CASES_BY_NAME["gpt_tied"])
ALL = 1000          # _undo_updates: more chunks than the case has: every chunk the CPU updates


def _make(undo, precision="bf16", clip=None, atomic=True):
    budget = tight_budget(CASE, 1024, 1.3)
    return px.compile(CASE.build_model(), optimizer=px.AdamW(**HYPER), device_memory=budget, chunk_size=1024,
                      precision=precision, device=DEVICE, max_grad_norm=clip, atomic=atomic, debug=True, fuse=False,
                      _undo_updates=undo)(CASE.loss_fn)


def _commit(g) -> int:
    return next(i for i, n in enumerate(g.nodes) if g.ann[n.name].role is Role.COMMIT)


def _steps(g):
    return [(i, g.ann[n.name].chunk) for i, n in enumerate(g.nodes) if g.ann[n.name].role is Role.OPTIMIZER_STEP]


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_undo_updates_train_bit_for_bit_as_the_atomic_step(precision):
    runs = {}
    for undo in (0, ALL):
        step = _make(undo, precision)
        losses = torch.stack([step(*CASE.batch(i)) for i in range(3)])
        runs[undo] = (losses, step_values(step), step.final_graph, step)
    assert torch.equal(runs[0][0], runs[ALL][0])
    assert_values_equal(runs[0][1], runs[ALL][1], "after three steps")
    g = runs[ALL][2]
    commit = _commit(g)
    host = [c.id for c in g.chunks if c.state_home is StateHome.HOST]
    assert len(host) >= 2 and sorted(c.id for c in g.chunks if c.undo) == sorted(host)
    early = {c: i for i, c in _steps(g) if i < commit}
    assert sorted(early) == sorted(host)              # every undo chunk's step before the commit, no other
    nd = all_needs(g)
    for c, i in early.items():      # right after the chunk's last use: nothing after it uses the chunk in this step
        assert not any(k.chunk == c for x in nd[i + 1:] for k in x.resident), c
    assert not any(c.undo for c in runs[0][2].chunks)
    assert all(i > _commit(runs[0][2]) for i, _ in _steps(runs[0][2]))
    assert "before the commit (undo buffers)" in str(runs[ALL][3].summary())


def test_undo_updates_match_eager():
    step = _make(ALL, "fp32")
    losses = [step(*CASE.batch(i)).item() for i in range(3)]
    assert step.last_step.measured_peak == step.final_graph.plan.predicted_peak
    ref_losses, ref_sd = eager_run(CASE, 3, host_params=host_params(step))
    assert rel_err(losses, ref_losses) <= 1e-6, (losses, ref_losses)
    assert_state_close(step.state_dict(), ref_sd, rtol=1e-6)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_failure_anywhere_before_the_commit_puts_the_updates_back(precision):
    """A failure before every node up to the commit (a RuntimeError, a KeyboardInterrupt and an out-of-memory error
    in turn; from the first undo update on, with updates ahead of the commit done or running) changes nothing, and
    the step then trains on as one that never failed (harness.check_failures_before_the_commit)."""
    step = _make(ALL, precision)
    step(*CASE.batch(0))
    g = step.final_graph
    assert min(i for i, _ in _steps(g)) < _commit(g)
    check_failures_before_the_commit(lambda: _make(ALL, precision), CASE, f"undo updates, {precision}")


def _fetched_before_the_commit(g) -> list[int]:
    """The undo chunks whose parameters the schedule fetches again between their step and the commit (on one rank
    such a fetch hangs on the chunk's pending update)."""
    commit = _commit(g)
    out = []
    for i, c in _steps(g):
        if i < commit and any(g.ann[n.name].role is Role.FETCH and g.ann[n.name].chunk == c
                              and g.ann[n.name].buf is BufKind.PARAM for n in g.nodes[i + 1:commit]):
            out.append(c)
    return out


@pytest.mark.parametrize("which", ["first", "fetched"])
def test_a_failed_update_ahead_of_the_commit_fails_the_step_and_changes_nothing(monkeypatch, which):
    """An update ahead of the commit that fails half-way (its states partly written, after a while, so that the
    executor has gone on: to the commit, which waits for it, and for "fetched" to a fetch of the chunk's parameters
    hanging on it) fails the step at the commit; every value is put back, nothing is left to raise later, and the
    next step trains as if the failed one never ran."""
    step, ref = _make(ALL), _make(ALL)
    step(*CASE.batch(0))
    ref(*CASE.batch(0))
    g = step.final_graph
    fetched = _fetched_before_the_commit(g)
    assert fetched, "the tight budget fetches some undo chunk's parameters before the commit"
    victim = next(c for i, c in _steps(g) if i < _commit(g)) if which == "first" else fetched[0]
    real = step_runtime.host_update

    def broken(cfg, param, grad, parts, **kw):
        if kw.get("chunk") == victim:
            time.sleep(0.3)
            parts["exp_avg"].add_(1.0)          # half-way: something written, then the failure
            raise MemoryError("injected")
        return real(cfg, param, grad, parts, **kw)

    before = step_values(step)
    monkeypatch.setattr(step_runtime, "host_update", broken)
    with pytest.raises(RuntimeError, match=f"update of chunk {victim}, run before the commit, failed"):
        step(*CASE.batch(1))
    monkeypatch.setattr(step_runtime, "host_update", real)
    assert_values_equal(before, step_values(step), "after the failed update")
    assert torch.equal(step(*CASE.batch(1)), ref(*CASE.batch(1)))
    assert_values_equal(step_values(ref), step_values(step), "the step after the failed update")


def test_an_update_that_fails_before_its_copy_is_not_put_back_from_an_old_one(monkeypatch):
    """An update ahead of the commit that fails before it copied the chunk's values (its undo buffer still holds the
    previous step's copy) changed nothing, and the rollback leaves the chunk as it is."""
    step = _make(ALL)
    for i in range(2):
        step(*CASE.batch(i))
    g = step.final_graph
    victim = next(c for i, c in _steps(g) if i < _commit(g))
    undo = step._compiler.store.undo
    real = type(undo).keep

    def keep(self, cid, states, params):
        if cid == victim:
            raise MemoryError("injected before the copy")
        return real(self, cid, states, params)

    before = step_values(step)
    monkeypatch.setattr(type(undo), "keep", keep)
    with pytest.raises(RuntimeError, match="injected before the copy"):
        step(*CASE.batch(2))
    monkeypatch.setattr(type(undo), "keep", real)
    assert_values_equal(before, step_values(step), "after an update that failed before its copy")


def test_ctrl_c_after_an_update_ahead_of_the_commit_undoes_the_step():
    """A Ctrl-C between the first undo update and the commit (sent before a node, delivered at the next one's
    check) undoes the step; one sent from the commit on is held until the step is complete (it counts as done)."""
    step, ref = _make(ALL), _make(ALL)
    step(*CASE.batch(0))
    ref(*CASE.batch(0))
    g = step.final_graph
    first, commit = min(i for i, _ in _steps(g)), _commit(g)
    for n, at in enumerate(sorted({first, (first + commit) // 2, commit - 1})):
        before = step_values(step)
        step._before_node = lambda i, node, at=at: signal.raise_signal(signal.SIGINT) if i == at else None
        with pytest.raises(KeyboardInterrupt):
            step(*CASE.batch(1 + n))
        step._before_node = None
        assert_values_equal(before, step_values(step), f"after Ctrl-C at node {at}, before the commit")
        assert torch.equal(step(*CASE.batch(1 + n)), ref(*CASE.batch(1 + n)))
    step._before_node = lambda i, node: signal.raise_signal(signal.SIGINT) if i == commit else None
    with pytest.raises(KeyboardInterrupt):
        step(*CASE.batch(9))
    step._before_node = None
    ref(*CASE.batch(9))
    assert_values_equal(step_values(ref), step_values(step), "after Ctrl-C past the commit (the step completes)")


def test_the_verifier_allows_undo_only_where_a_failure_can_be_put_back():
    step = _make(ALL)
    step.lower(*CASE.batch(0))
    placed = step.graphs["optimizer_placed"]
    verify(placed)
    undo = next(c for c in placed.chunks if c.undo)
    for settings, what in ((dataclasses.replace(placed.settings, max_grad_norm=1.0), "clipping"),
                           (dataclasses.replace(placed.settings, atomic=False), "atomic=False")):
        with pytest.raises(VerificationError, match="keeps an undo buffer"):
            verify(placed.evolve(settings=settings))
    chunks = list(placed.chunks)           # an undo chunk's states on the device: its step may not come early
    chunks[undo.id] = dataclasses.replace(undo, state_home=StateHome.DEVICE)
    with pytest.raises(VerificationError, match="keeps an undo buffer"):
        verify(placed.evolve(chunks=tuple(chunks)))
    chunks = list(placed.chunks)           # a step before the commit without an undo buffer
    chunks[undo.id] = dataclasses.replace(undo, undo=False)
    with pytest.raises(VerificationError, match="before the commit"):
        verify(placed.evolve(chunks=tuple(chunks)))


def test_undo_buffers_are_counted_in_host_memory_and_kept_within_its_budget():
    step = _make(ALL)
    step(*CASE.batch(0))
    g = step.final_graph
    st = g.settings
    plain = g.evolve(chunks=tuple(dataclasses.replace(c, undo=False) for c in g.chunks))
    extra = sum(undo_bytes(c, st.precision, st.world, state_layout(st)) for c in g.chunks if c.undo)
    assert extra > 0 and host_bytes(g) == host_bytes(plain) + extra
    made = step._compiler.store.undo.of
    assert sum(t.numel() * t.element_size() for bufs in made.values() for t in bufs) == extra
    # a host budget with room for the other host bytes and less than the smallest undo buffer: the cost model keeps
    # none
    each = min(undo_bytes(c, st.precision, st.world, state_layout(st)) for c in g.chunks if c.undo)
    tight = px.compile(CASE.build_model(), optimizer=px.AdamW(**HYPER), device_memory=st.budget, chunk_size=1024,
                       precision="bf16", device=DEVICE, fuse=False,
                       host_memory=host_bytes(plain) + each // 2)(CASE.loss_fn)
    tight(*CASE.batch(0))
    assert not any(c.undo for c in tight.final_graph.chunks)
    assert any("spare, less than an undo buffer" in c.why for c in tight.final_graph.choices)


@pytest.mark.parametrize("precision,clip,atomic", [("bf16", 1.0, True), ("bf16", None, False)])
def test_undo_is_refused_where_the_commit_decides_or_updates_are_early_anyway(precision, clip, atomic):
    with pytest.raises(ValueError, match="_undo_updates=1000: no chunk updates before the commit"):
        _make(ALL, precision, clip, atomic)(*CASE.batch(0))
    step = _make(None, precision, clip, atomic)
    step(*CASE.batch(0))
    assert not any(c.undo for c in step.final_graph.chunks)


def test_bad_undo_updates_say_what_to_change():
    for bad in (-1, 1.5, True, "all"):
        with pytest.raises(ValueError, match="_undo_updates must be a number of chunks"):
            px.compile(CASE.build_model(), optimizer=px.AdamW(**HYPER), device="cpu", _undo_updates=bad)


def test_the_cost_model_chooses_undo_buffers_where_the_host_has_room():
    """px.plan of a 510M GPT on the H200's rates at an 8 GiB budget (most states on the host): with 64 GiB of host
    memory the cost model updates some of the CPU's chunks before the commit, estimating the step faster so (2 here);
    with room for the smaller of their buffers only (which the CPU could not update in time alone) it updates none,
    within the budget, and says why."""
    from pstar_fx.models.gpt import GPT, GPTConfig, gpt_loss
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab=50304, seq=2048, layers=8, hidden=2048, heads=16))
    tokens = ((4, 2048), torch.long)

    def plan(host):
        return px.plan(model, gpt_loss, tokens, tokens, machine="h200", gpus_per_node=1, host_memory=host,
                       device_memory="8GiB", device="cpu")
    roomy = plan("64GiB")
    g = roomy.graph
    assert roomy.states_undo > 0 and roomy.states_undo == sum(c.undo for c in g.chunks)
    why = next(c.why for c in g.choices if "updated before the commit" in c.why)
    kept, without = (float(x) for x in why.split("the step estimated ")[1].split(" s without")[0].split(" s against "))
    assert kept < without and roomy.cost.seconds == pytest.approx(kept, rel=1e-3)
    st = g.settings
    each = [undo_bytes(c, st.precision, st.world, state_layout(st)) for c in g.chunks if c.undo]
    tight = plan(roomy.host_bytes - sum(each) + min(each) // 2)     # room for at most the smaller buffer
    assert tight.states_undo == 0 and tight.host_bytes <= tight.host_memory
    assert any(c.why.startswith("no chunk updated before the commit: ") for c in tight.graph.choices)


def test_the_default_host_budget_keeps_a_tenth_free_of_undo_buffers():
    """With host_memory=None (the host's memory less a tenth, a guess) undo buffers also leave a tenth of that
    budget free; a host_memory given is theirs to the byte."""
    step = _make(0)
    step(*CASE.batch(0))
    g = step.final_graph
    plain = g.evolve(chunks=tuple(dataclasses.replace(c, undo=False, streamed=False) for c in g.chunks))
    budget = host_bytes(plain) + (64 << 20)
    given = plain.evolve(settings=dataclasses.replace(g.settings, host_budget=budget, host_default=False))
    default = plain.evolve(settings=dataclasses.replace(g.settings, host_budget=budget, host_default=True))
    assert undo_room(given) == 64 << 20
    assert undo_room(default) == max(0, (64 << 20) - budget // 10)
    # the default's budget is the host's whole memory: undo buffers also stay within what was free at px.compile
    roomy = plain.evolve(settings=dataclasses.replace(g.settings, host_budget=budget + (1 << 30), host_default=True))
    assert undo_room(roomy) > 32 << 20
    shared = roomy.evolve(settings=dataclasses.replace(roomy.settings, host_spare=host_bytes(plain) + (32 << 20)))
    assert undo_room(shared) == 32 << 20
    full = roomy.evolve(settings=dataclasses.replace(roomy.settings, host_spare=host_bytes(plain) // 2))
    assert undo_room(full) == 0
    given_too = shared.evolve(settings=dataclasses.replace(shared.settings, host_default=False))
    assert undo_room(given_too) == budget + (1 << 30) - host_bytes(plain)      # a host_memory given is theirs


def test_px_compile_reads_the_spare_host_memory_for_the_default_budget_only():
    """host_memory=None on one rank: Settings.host_spare is what the system could give at px.compile (less the
    margin); a host_memory given, or a disk tier, leaves it None."""
    default = _make(0).settings
    assert default.host_default and default.host_spare is not None
    assert 0 < default.host_spare <= default.host_budget
    given = px.compile(CASE.build_model(), optimizer=px.AdamW(**HYPER), device=DEVICE, host_memory="8GiB")(
        CASE.loss_fn).settings
    assert not given.host_default and given.host_spare is None


def test_batch_signatures_with_other_undo_sets_share_the_buffers_and_stay_exact():
    """Two batch shapes planned with different undo sets (3 and 1 chunks) alternate on one store: the second plan
    does not inherit the first's undo flags (it verifies), the buffers made for the first serve both (nothing is
    allocated again as they alternate), training equals a reference run step for step, and a failure before the
    second plan's commit puts everything back."""
    a = CASE
    b = dataclasses.replace(a, make_batch=lambda step, gen: tuple(t[:, :6] for t in a.make_batch(step, gen)))
    step, ref = _make(3), _make(3)
    for s in (step, ref):
        s(*a.batch(0))
        s._compiler.settings = dataclasses.replace(s._compiler.settings, undo_updates=1)   # the next plan's
        s(*b.batch(1))
    store = step._compiler.store
    assert sum(c.undo for c in step.final_graph.chunks) == 1
    owned = {t.data_ptr() for bufs in [*store.undo.of.values(), *(x for v in store.undo.spare.values() for x in v)]
             for t in bufs}
    for i, case in enumerate([a, b, a, b], start=2):
        step(*case.batch(i))
        ref(*case.batch(i))
        assert_values_equal(step_values(ref), step_values(step), f"step {i}")
    now = {t.data_ptr() for bufs in [*store.undo.of.values(), *(x for v in store.undo.spare.values() for x in v)]
           for t in bufs}
    assert now == owned
    before = step_values(step)
    step._before_node = raiser(_commit(step.final_graph), RuntimeError("injected"))   # the last step ran b's plan
    with pytest.raises(RuntimeError, match="injected"):
        step(*b.batch(9))
    step._before_node = None
    assert_values_equal(before, step_values(step), "after a failure before the second plan's commit")


def test_the_cost_model_has_the_commit_wait_for_the_updates_ahead_of_it():
    """On a machine whose CPU is slow, the executor's thread waits at the commit for the undo chunks' updates, and the
    step returns after them: the estimated first step (each update from its chunk's last use in backward on) lasts at
    least their chain on the CPU, and so does every later one."""
    step = _make(ALL)
    step(*CASE.batch(0))
    g = step.final_graph
    st = g.settings
    slow = dataclasses.replace(cost.H200, cpu_adam_mixed=cost.H200.cpu_adam_mixed / 1e5,
                               host_copy_bytes=cost.H200.host_copy_bytes / 1e5)
    rate = cost.cpu_update_rate(st, slow, beside_backward=True)
    chain = sum(c.capacity / rate + undo_bytes(c, st.precision, st.world, state_layout(st)) / slow.host_copy_bytes
                for c in g.chunks if c.undo)
    est = cost.estimate(g, slow)
    assert est.first_seconds >= chain and est.seconds >= chain


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_undo_buffers_keep_compressed_states_exactly(state_dtype):
    """Compressed moments (their state buffers hold bf16 or int8 bits, compared here as raw bytes): with every
    host-placed chunk updated ahead of the commit, training is bit for bit the atomic step's without undo buffers,
    and a failure at the commit (after every such update) puts the raw states back."""
    def make(undo):
        budget = tight_budget(CASE, 1024, 1.3)
        return px.compile(CASE.build_model(), optimizer=px.AdamW(**HYPER, state_dtype=state_dtype),
                          device_memory=budget, chunk_size=1024, precision="bf16", device=DEVICE, fuse=False,
                          _undo_updates=undo)(CASE.loss_fn)

    def raw(step):
        store = step._compiler.store
        store.flush()
        return [s.view(torch.uint8).clone() for s in store.states if s is not None] + \
            [h.view(torch.uint8).clone() for h in store.host_param if h is not None]

    plain, undo = make(0), make(ALL)
    for i in range(3):
        assert torch.equal(plain(*CASE.batch(i)), undo(*CASE.batch(i)))
    assert any(c.undo for c in undo.final_graph.chunks)
    assert all(torch.equal(a, b) for a, b in zip(raw(plain), raw(undo)))
    before = raw(undo)
    undo._before_node = raiser(_commit(undo.final_graph), RuntimeError("injected"))
    with pytest.raises(RuntimeError, match="injected"):
        undo(*CASE.batch(3))
    undo._before_node = None
    assert all(torch.equal(a, b) for a, b in zip(before, raw(undo)))
    assert torch.equal(plain(*CASE.batch(3)), undo(*CASE.batch(3)))
