"""px.compile(atomic=False): host-side updates start as soon as the step is done with their chunk, during backward.

Bit for bit the atomic step's training (losses, parameters, optimizer states), in bf16 and fp32 at a tight budget
that puts states on the host; the graph puts each host-side step right after its chunk's last use, before the commit,
and the verifier allows that only there; clipping and fp16 keep every step after the commit; a failure before the
first early update changes nothing, one after it is a CommitError. Chunks streamed to the device (their states
fetched over the link) update there right after their last use too, as the atomic step's streamed chunks do after
the commit. With PSTAR_TEST_DEVICE=cuda the steps run on the GPU (copy streams, events, the CPU worker taking
updates while backward runs).
"""
import dataclasses

import pytest
import torch

import pstar_fx as px
from pstar_fx.ir import Role, StateHome
from pstar_fx.ir.graph import BufKind, ChunkGroup
from pstar_fx.ir.needs import all_needs
from pstar_fx.passes import verify
from pstar_fx.passes.verify import VerificationError

from harness import DEVICE, HYPER, eager_run, host_params, rel_err, small_batches, tight_budget
from models import CASES_BY_NAME, assert_state_close

pytestmark = pytest.mark.cuda

CASE = small_batches(CASES_BY_NAME["gpt_tied"])


ALL = 1000          # _device_updates: more chunks than the case has, so every host-placed one that fits streams


def _make(atomic, precision="bf16", clip=None, fuse=None, device_updates=None):
    budget = tight_budget(CASE, 1024, 1.3)
    return px.compile(CASE.build_model(), optimizer=px.AdamW(**HYPER), device_memory=budget, chunk_size=1024,
                      precision=precision, device=DEVICE, atomic=atomic, max_grad_norm=clip,
                      debug=True, fuse=fuse, _device_updates=device_updates)(CASE.loss_fn)


def _everything(step) -> dict:
    step._compiler.store.flush()
    out = {f"sd.{k}": v.clone() for k, v in step.state_dict().items()}
    for i, s in step.optimizer.state_dict()["state"].items():
        out.update({f"opt.{i}.{k}": v.clone() for k, v in s.items()})
    return out


def _steps(g):
    return [(i, g.ann[n.name]) for i, n in enumerate(g.nodes) if g.ann[n.name].role is Role.OPTIMIZER_STEP]


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_early_updates_train_bit_for_bit_as_the_atomic_step(precision):
    runs = {}
    for atomic in (True, False):
        # unfused: the two plans place the host-side steps apart, and fused regions end at them, rounding bf16
        # intermediates in different places
        step = _make(atomic, precision, fuse=False)
        losses = [step(*CASE.batch(i)) for i in range(3)]
        runs[atomic] = (torch.stack(losses), _everything(step), step.final_graph)
    assert torch.equal(runs[True][0], runs[False][0])
    assert runs[True][1].keys() == runs[False][1].keys()
    for k, v in runs[True][1].items():
        assert torch.equal(v, runs[False][1][k]), k
    g = runs[False][2]
    commit = next(i for i, n in enumerate(g.nodes) if g.ann[n.name].role is Role.COMMIT)
    early = [(i, a.chunk) for i, a in _steps(g) if i < commit]
    host = [c.id for c in g.chunks if c.state_home is StateHome.HOST]
    assert len(host) >= 2 and sorted(c for _, c in early) == sorted(host)     # every host-side step is early
    assert all(g.chunks[a.chunk].state_home is StateHome.DEVICE for i, a in _steps(g) if i > commit)
    nd = all_needs(g)
    for i, c in early:         # nothing after a chunk's update uses the chunk's device buffers in this step
        assert not any(k.chunk == c for x in nd[i + 1:commit] for k in x.resident)
    atomic = runs[True][2]
    commit = next(i for i, n in enumerate(atomic.nodes) if atomic.ann[n.name].role is Role.COMMIT)
    assert all(i > commit for i, _ in _steps(atomic))


def test_the_verifier_allows_early_steps_only_for_host_states_with_atomic_false():
    step = _make(False)
    step.lower(*CASE.batch(0))
    placed = step.graphs["optimizer_placed"]
    verify(placed)
    with pytest.raises(VerificationError, match="before the commit"):
        verify(placed.evolve(settings=dataclasses.replace(placed.settings, atomic=True)))
    with pytest.raises(VerificationError, match="before the commit"):   # a device-side step is never early
        first_host = next(a.chunk for _, a in _steps(placed))
        chunks = list(placed.chunks)
        chunks[first_host] = dataclasses.replace(chunks[first_host], state_home=StateHome.DEVICE)
        device = next((c for c in placed.chunks if c.state_home is StateHome.DEVICE), None)
        if device is not None:    # the same number of states on the device as planned
            chunks[device.id] = dataclasses.replace(device, state_home=StateHome.HOST)
        verify(placed.evolve(chunks=tuple(chunks)))


@pytest.mark.parametrize("precision,clip", [("bf16", 1.0), ("fp16", None)])
def test_when_the_commit_decides_every_step_waits_for_it(precision, clip):
    step = _make(False, precision, clip)
    step(*CASE.batch(0))
    g = step.final_graph
    commit = next(i for i, n in enumerate(g.nodes) if g.ann[n.name].role is Role.COMMIT)
    assert _steps(g) and all(i > commit for i, _ in _steps(g))


def test_streamed_early_updates_match_eager_right_after_their_chunks_last_use():
    """atomic=False with chunks streamed: each streamed step right after its chunk's last use, before the commit,
    its states fetched and written back around it (the verifier's order); training equals eager AdamW (on a GPU the
    CPU-updated chunks' reference update also runs on the CPU, whose kernel rounds otherwise) and the plan's peak is
    measured at every node (debug=True)."""
    step = _make(False, "fp32", fuse=False, device_updates=ALL)
    losses = [step(*CASE.batch(i)).item() for i in range(3)]
    g = step.final_graph
    assert step.last_step.measured_peak == g.plan.predicted_peak
    ref_losses, ref_sd = eager_run(CASE, 3, host_params=host_params(step))
    assert rel_err(losses, ref_losses) <= 1e-6, (losses, ref_losses)
    assert_state_close(step.state_dict(), ref_sd, rtol=1e-6)
    streamed = [c.id for c in g.chunks if c.streamed]
    commit = next(i for i, n in enumerate(g.nodes) if g.ann[n.name].role is Role.COMMIT)
    early = {a.chunk: i for i, a in _steps(g) if i < commit}
    assert streamed and set(streamed) <= set(early), (streamed, early)
    nd = all_needs(g)
    for c in streamed:          # right after the chunk's last use: no computation between them
        last = max(i for i, x in enumerate(nd[:early[c]])
                   if any(k.chunk == c and k.buf is not BufKind.STATES for k in x.resident))
        assert all(g.ann[n.name].role is not Role.COMPUTE for n in g.nodes[last + 1:early[c]]), c


def _first_update_failures(step, case):
    """A failure at the step's first update changes nothing; one right after it is a CommitError. Returns the chunk
    that update is of."""
    step(*case.batch(0))
    g = step.final_graph                    # node positions index the graph the step runs
    first, a = _steps(g)[0]
    before = _everything(step)
    step._before_node = lambda i, n: (_ for _ in ()).throw(RuntimeError("injected")) if i == first else None
    with pytest.raises(RuntimeError, match="injected"):
        step(*case.batch(1))
    step._before_node = None
    after = _everything(step)
    for k, v in before.items():
        assert torch.equal(v, after[k]), k
    step._before_node = lambda i, n: (_ for _ in ()).throw(RuntimeError("injected")) if i == first + 1 else None
    with pytest.raises(px.CommitError, match="after its first update"):
        step(*case.batch(1))
    return g.chunks[a.chunk]


@pytest.mark.parametrize("device_updates", [None, ALL], ids=["cpu", "streamed"])
def test_a_failure_before_the_first_update_changes_nothing_and_after_it_is_a_commit_error(device_updates):
    _first_update_failures(_make(False, device_updates=device_updates), CASE)


def test_a_failure_right_after_a_streamed_first_update_is_a_commit_error():
    """A streamed step counts as an update: where the step's first update is a streamed chunk's (the MLP's at the
    tightest of a few budgets where it is: on a GPU, bf16 chunks leave room for more device states than fp32 ones on
    the CPU at the same slack), a failure at it changes nothing and one right after it is a CommitError."""
    mlp = small_batches(CASES_BY_NAME["mlp_mse"])
    least = tight_budget(mlp, 256, 1.0)
    tried = []
    for slack in (1.1, 1.2, 1.3, 1.5, 2.0):
        step = px.compile(mlp.build_model(), optimizer=px.AdamW(**HYPER), device_memory=int(least * slack),
                          chunk_size=256, device=DEVICE, atomic=False, debug=True, _device_updates=ALL)(mlp.loss_fn)
        step(*mlp.batch(0))
        g = step.final_graph
        first = g.chunks[_steps(g)[0][1].chunk]
        tried.append((slack, first.update_site))
        if first.streamed:
            break
    else:
        raise AssertionError(f"no budget made the first update a streamed chunk's (slack, its update site): {tried}")
    assert _first_update_failures(step, mlp).streamed


def test_bad_atomic_arguments_say_what_to_change():
    with pytest.raises(ValueError, match="atomic must be True or False"):
        px.compile(CASE.build_model(), optimizer=px.AdamW(**HYPER), device="cpu", atomic="no")(CASE.loss_fn)
    with pytest.raises(ValueError, match="atomic"):
        px.compile(CASE.build_model(), optimizer=None, device="cpu", atomic=False)(CASE.loss_fn)
    with pytest.raises(ValueError, match="atomic must be True or False"):
        px.plan(CASE.build_model(), CASE.loss_fn, *CASE.batch(0), world_size=2, atomic=None, device="cpu")


def test_a_plan_for_two_ranks_updates_during_backward_after_each_reduce_scatter():
    """px.plan(world_size=2, atomic=False) under a budget that keeps states on the host: each host-placed chunk's
    step comes before the commit and after its chunk's reduce-scatter (the verifier holds the shard pass's order)."""
    model = CASE.build_model()
    least = px.plan(model, CASE.loss_fn, *CASE.batch(0), world_size=2, device="cpu", chunk_size=256,
                    device_memory=1).device_needed
    report = px.plan(model, CASE.loss_fn, *CASE.batch(0), world_size=2, atomic=False, device="cpu", chunk_size=256,
                     device_memory=int(least * 1.05))
    g = report.graph
    at = {n.name: i for i, n in enumerate(g.nodes)}
    commit = next(i for i, n in enumerate(g.nodes) if g.ann[n.name].role is Role.COMMIT)
    reduced = {g.ann[n.name].chunk: i for i, n in enumerate(g.nodes) if g.ann[n.name].role is Role.REDUCE_SCATTER}
    early = [(at[n.name], g.ann[n.name].chunk) for n in g.nodes
             if g.ann[n.name].role is Role.OPTIMIZER_STEP and at[n.name] < commit]
    host = [c.id for c in g.chunks if c.state_home is not StateHome.DEVICE and c.group is ChunkGroup.TRAINABLE]
    assert host and sorted(c for _, c in early) == sorted(host), (early, host)
    assert all(reduced[c] < i for i, c in early)
