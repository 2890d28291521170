"""px.plan and the cost model: a plan made without running (and without a process group) is the plan the compiled step
makes and runs, on one rank and on two gloo ranks; fit / no-fit at budgets just above and below the need; the
command line; the cost model's FLOP counts and its response to slower copies and collectives."""
from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import pstar_fx as px
from pstar_fx import cost
from pstar_fx.cost import H200, Lane
from pstar_fx.ir.flops import FORWARD_ATTENTION
from pstar_fx.ir import ChunkGroup, Role, StateHome
from pstar_fx.passes import verify
from pstar_fx.passes.place_optimizer import (WAITS, _choose_homes, _fewer_states, _placed, device_priority, moved_back,
                                             place_optimizer, update_order, with_steps)
from pstar_fx.passes.schedule import schedule
from harness import HYPER, tight_budget
from models import CASES_BY_NAME
from plan_worker import store_host_bytes
from ranks import ROOT, child_env, run_ranks

CHUNK = 1024


def _case(name: str, batch: int):
    base = CASES_BY_NAME[name]
    return base.__class__(base.name, base.build, base.loss_fn, functools.partial(base.make_batch, B=batch))


def _plan(case, batch, **kw):
    kw = dict(dict(precision="fp32", chunk_size=CHUNK, device="cpu"), **kw)
    return px.plan(case.build_model(), case.loss_fn, *batch, **kw)


def _compiled(case, budget, **kw):
    return px.compile(case.build_model(), optimizer=px.AdamW(**HYPER), device_memory=budget, device="cpu",
                      precision="fp32", chunk_size=CHUNK, debug=True, **kw)(case.loss_fn)


# -- one rank: the plan is the compiled step's plan ------------------------------------------------------------------

@pytest.mark.parametrize("name", ["gpt_tied", "mlp_ce", "cnn_bn"])
@pytest.mark.parametrize("budget", ["none", "tight"])
def test_plan_is_the_compiled_steps_plan(name, budget):
    case = _case(name, 4)
    limit = None if budget == "none" else tight_budget(case, CHUNK)
    step = _compiled(case, limit, max_grad_norm=1.0)
    for i in range(2):
        step(*case.batch(i))
    p = step.final_graph.plan
    # the batch given as meta tensors and as (shape, dtype) pairs: the same plan as from the real batch
    real = case.batch(0)
    as_meta = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in real]
    as_pairs = [(tuple(t.shape), t.dtype) for t in real]
    for batch in (real, as_meta, as_pairs):
        rep = _plan(case, batch, device_memory=step.settings.budget, max_grad_norm=1.0)   # None: free memory
        assert rep.fits and rep.traced_on == "cpu"
        assert rep.peak_device == p.predicted_peak == step.last_step.measured_peak
        assert (rep.h2d_bytes, rep.d2h_bytes) == (p.h2d_bytes, p.d2h_bytes)
        assert (rep.h2d_bytes, rep.d2h_bytes) == (step.last_step.h2d_bytes, step.last_step.d2h_bytes)  # step 2
        assert rep.host_bytes == store_host_bytes(step._compiler.store)
        assert rep.chunks == len(step.final_graph.chunks)
        assert rep.states_on_device == step.summary().states_on_device
        assert str(rep.graph) == str(step.final_graph)
    if budget == "tight":
        assert p.h2d_bytes > 0 and rep.states_on_device < rep.trainable_chunks
        assert rep.cost.busy[Lane.H2D] > 0 and rep.cost.busy[Lane.CPU] > 0
    else:
        assert p.h2d_bytes == 0 and rep.cost.busy[Lane.H2D] == 0


@pytest.mark.host_is_device
def test_a_plan_is_for_the_gpu_even_where_a_cpu_device_is_the_host():
    """px.plan answers for a preset GPU: traced on a CPU machine, where a CPU step's slots are their host homes, its
    plan still copies to the device and streams updates as a GPU step would."""
    case = _case("gpt_tied", 4)
    rep = _plan(case, case.batch(0), device_memory=tight_budget(case, CHUNK))
    assert rep.graph.settings.host_is_device is False and rep.h2d_bytes > 0
    assert "a CPU device is the host" not in str(rep)


def test_a_meta_model_plans_like_the_real_one():
    case = _case("gpt_tied", 4)
    real = _plan(case, case.batch(0), device_memory=200_000)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = case.build_model()
    meta = px.plan(model, case.loss_fn, *case.batch(0), device_memory=200_000, precision="fp32", chunk_size=CHUNK,
                   device="cpu")
    assert str(meta.graph) == str(real.graph)
    assert meta.peak_device == real.peak_device and meta.cost == real.cost
    assert all(p.is_meta for p in model.parameters()), "planning allocates nothing in the model"
    # parameter groups of a meta model: chunks hold one group each, laid out as px.compile lays them out
    grouped = px.plan(model, case.loss_fn, *case.batch(0), precision="fp32", chunk_size=CHUNK, device="cpu",
                      optimizer=px.AdamW(_two_groups(model)))
    real_model = case.build_model()
    step = px.compile(real_model, optimizer=px.AdamW(_two_groups(real_model)), device="cpu", precision="fp32",
                      chunk_size=CHUNK)(case.loss_fn)
    step.lower(*case.batch(0))
    layout = [(c.params, c.opt_group) for c in grouped.graph.chunks]
    assert layout == [(c.params, c.opt_group) for c in step.final_graph.chunks]
    assert {group for _, group in layout if group is not None} == {0, 1}


def _two_groups(model):
    return [{"params": [p for p in model.parameters() if p.dim() >= 2]},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


# -- two gloo ranks: px.plan(world_size=2) is the plan each rank compiled and ran -------------------------------------

def _launch(tmp_path, world: int, *args, timeout: float = 240) -> list[dict]:
    out = str(tmp_path / "result")
    return run_ranks("plan_worker.py", ["--out", out, *args], world, out, timeout).results


@pytest.mark.slow
@pytest.mark.parametrize("budget", ["none", "tight"])
def test_plan_for_two_ranks_is_what_a_gloo_run_plans_and_measures(tmp_path, budget):
    world, batch = 2, 8
    results = _launch(tmp_path, world, "--case", "gpt_tied", "--batch", batch, "--budget", budget,
                      "--chunk-size", CHUNK, "--clip", 1.0)
    case = _case("gpt_tied", batch)
    local = tuple(t[:batch // world] for t in case.batch(0))
    rep = _plan(case, local, world_size=world, device_memory=results[0]["budget"], max_grad_norm=1.0,
                host_memory="1GB")
    assert rep.graph.stage == "sharded" and rep.fits
    for r in results:
        assert r["stage"] == "sharded"
        assert rep.peak_device == r["predicted_peak"] == r["measured_peak"]
        assert (rep.h2d_bytes, rep.d2h_bytes, rep.gathered_bytes, rep.reduced_bytes) == (
            r["h2d"], r["d2h"], r["gathered"], r["reduced"])
        assert rep.host_bytes == r["host_bytes"]
        assert (rep.chunks, rep.states_on_device) == (r["chunks"], r["states_on_device"])
    assert rep.gathered_bytes > 0 and rep.reduced_bytes > 0 and rep.communicated_bytes > 0
    assert rep.cost.busy[Lane.COMM] > 0
    assert rep.host_per_node == world * max(rep.host_bytes, rep.host_setup_bytes)


# -- fit / no fit ---------------------------------------------------------------------------------------------------

def test_fit_decisions_just_above_and_below_the_need():
    case = _case("gpt_tied", 4)
    batch = case.batch(0)
    probe = _plan(case, batch, device_memory=1)
    need = probe.device_needed
    assert not probe.fits_device and not probe.fits and probe.cost is None
    step = _compiled(case, None)
    assert need == step.min_device_memory(*batch)

    below = _plan(case, batch, device_memory=need - 1)
    assert not below.fits_device and below.device_needed == need
    with pytest.raises(px.BudgetError):
        _compiled(case, need - 1)(*batch)

    at = _plan(case, batch, device_memory=need)
    assert at.fits_device and at.peak_device <= need
    run = _compiled(case, need)
    run(*batch)
    assert run.last_step.measured_peak == at.peak_device

    host = at.host_per_node
    assert _plan(case, batch, device_memory=need, host_memory=host).fits
    short = _plan(case, batch, device_memory=need, host_memory=host - 1)
    assert short.fits_host is False and not short.fits
    assert "DOES NOT FIT" in str(short) and "DOES NOT FIT" in str(below)


def test_bad_arguments_say_what_to_change():
    case = _case("mlp_ce", 4)
    with pytest.raises(ValueError, match="world_size"):
        _plan(case, case.batch(0), world_size=0)
    with pytest.raises(ValueError, match="precision"):
        _plan(case, case.batch(0), precision="int8")
    with pytest.raises(ValueError, match="cannot read"):
        _plan(case, case.batch(0), device_memory="lots")
    if not torch.cuda.is_available():     # tracing for CUDA without it would abort the process: refused first
        with pytest.raises(ValueError, match="sees no CUDA"):
            _plan(case, case.batch(0), device="cuda")
        _plan(case, case.batch(0), device=None)
        assert not torch.cuda.is_initialized()


# -- the command line -----------------------------------------------------------------------------------------------

GPT_ARGS = ["--layers", "2", "--d-model", "64", "--heads", "4", "--seq", "32", "--vocab", "256", "--batch", "2"]


def test_command_line_prints_the_table():
    cmd = [sys.executable, "-m", "pstar_fx.api.plan_cli", *GPT_ARGS, "--world-size", "4", "--gpus-per-node", "2",
           "--device-memory", "64MB", "--host-memory", "1GB", "--checkpoint"]
    out = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    for line in ("verdict: FITS", "device memory: fits", "host memory: fits", "communicated:", "step time:",
                 "TFLOP/s per GPU", "4 GPUs, 2 per node", "activation checkpointing"):
        assert line in out.stdout, (line, out.stdout)


def test_command_line_no_fit_and_px_plan_survive_importing_the_module(capsys):
    from pstar_fx.api.plan_cli import main, run
    rep = main([*GPT_ARGS, "--device-memory", "10KB"])
    assert not rep.fits_device and rep.device_needed > 10_000
    assert "verdict: DOES NOT FIT" in capsys.readouterr().out
    assert run([*GPT_ARGS, "--device-memory", "10KB"]) == 1     # the exit status says it
    case = _case("mlp_ce", 4)
    assert callable(px.plan) and px.plan(case.build_model(), case.loss_fn, *case.batch(0), device="cpu").fits


def test_command_line_plans_compressed_states_and_a_disk_tier(tmp_path, capsys):
    """--state-dtype int8 plans smaller optimizer states (less host memory than exact ones at the same budget);
    --disk-memory with --host-memory plans the states that do not fit it on disk (the tier's capacity in `tiers`);
    --disk-memory alone is refused."""
    from pstar_fx.api.plan_cli import main, run
    tight = [*GPT_ARGS, "--device-memory", "1MB", "--gpus-per-node", "1"]
    exact, int8 = main(tight), main([*tight, "--state-dtype", "int8"])
    assert 0 < int8.host_bytes < exact.host_bytes
    on_disk = main([*tight, "--host-memory", str(exact.host_bytes * 2 // 3), "--disk-memory", "1GB"])
    assert on_disk.states_on_disk > 0 and on_disk.disk_bytes > 0 and on_disk.fits
    disk = next(t for t in on_disk.tiers if t.tier.name == "DISK")
    assert disk.capacity == 10**9 and disk.used == on_disk.disk_per_node and disk.fits
    with pytest.raises(SystemExit) as refused:
        main([*tight, "--disk-memory", "1GB"])
    assert refused.value.code == 2 and "--disk-memory plans a disk tier" in capsys.readouterr().err
    # a disk tier too small: no plan; the reason on stderr and exit status 1 (does not fit), no traceback
    small = [*tight, "--host-memory", str(exact.host_bytes * 2 // 3), "--disk-memory", "1KB"]
    assert main(small) is None
    err = capsys.readouterr().err
    assert "DOES NOT FIT: disk_memory 1000 B (1000 bytes) is too small" in err and "Traceback" not in err
    assert run(small) == 1


@pytest.mark.parametrize("flags, says", [
    (["--layers", "0"], "argument --layers: must be >= 1, got 0"),
    (["--heads", "0"], "argument --heads: must be >= 1"),
    (["--batch", "0"], "argument --batch: must be >= 1"),
    (["--chunk-size", "-5"], "argument --chunk-size: must be >= 1"),
    (["--heads", "3"], "is not divisible by --heads 3"),
    (["--max-grad-norm", "-1"], "max_grad_norm must be a positive finite number"),
    (["--device-memory=-1GB"], "device_memory: cannot read '-1GB'"),
    (["--host-memory=-5GB"], "host_memory: cannot read '-5GB'"),
])
def test_command_line_refuses_impossible_inputs_as_usage_errors(flags, says, capsys):
    """One line naming the flag and exit status 2 (1 says "does not fit"), never a traceback or a plan."""
    from pstar_fx.api.plan_cli import main
    with pytest.raises(SystemExit) as refused:
        main([*GPT_ARGS, *flags])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and says in err and "Traceback" not in err, err


def test_px_plan_checks_its_options_as_px_compile_does():
    case = _case("mlp_ce", 4)
    for bad in (dict(chunk_size=0), dict(chunk_size=-5), dict(max_grad_norm=-1.0), dict(accumulate=0)):
        with pytest.raises(ValueError):
            px.plan(case.build_model(), case.loss_fn, *case.batch(0), device="cpu", **bad)
    with pytest.raises(ValueError, match="host_memory"):
        px.plan(case.build_model(), case.loss_fn, *case.batch(0), device="cpu", host_memory=-5)


def test_benchmark_flops_are_the_plans_model_flops():
    """benchmarks/gpt.py runs the reference GPT that `pstar-fx-plan` plans (it imports it), and counts a step's
    FLOPs as the plan does: 6 N tokens + 12 layers hidden seq tokens."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gpt as bench
    from pstar_fx.models.gpt import GPT
    cfg = bench.GPTConfig(vocab=256, seq=32, layers=2, hidden=64, heads=4)
    with torch.device("meta"):
        model = bench.models.make(bench.models.ModelSpec(bench.models.Kind.GPT, cfg))
    assert type(model) is GPT
    batch = ((2, 32), torch.long)
    report = px.plan(model, bench.models.loss, batch, batch, device="cpu", device_memory="1GB")
    assert report.model_flops == bench.flops_per_step(bench.n_params(model), cfg, 2)


def test_model_flops_leave_out_what_remat_recomputes():
    """A budget that makes the remat pass recompute attention does not make the model's FLOPs larger."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gpt as bench
    from pstar_fx.ir import REMAT
    cfg = bench.GPTConfig(vocab=256, seq=512, layers=2, hidden=64, heads=4)
    with torch.device("meta"):
        model = bench.models.make(bench.models.ModelSpec(bench.models.Kind.GPT, cfg))
    batch = ((8, 512), torch.long)
    roomy = px.plan(model, bench.models.loss, batch, batch, device="cpu", device_memory="1GB")
    tight = px.plan(model, bench.models.loss, batch, batch, device="cpu", device_memory=roomy.peak_device * 6 // 10)
    recomputed = [n for n in tight.graph.nodes if REMAT in n.meta]
    assert any(n.target in FORWARD_ATTENTION for n in recomputed)
    assert tight.model_flops == roomy.model_flops == bench.flops_per_step(bench.n_params(model), cfg, 8)


def test_model_flops_count_the_attention_a_fused_region_holds():
    """fuse=True groups the attention with the compute around it into regions: the model's FLOPs stay those of the
    unfused plan (they were once counted from the final graph's nodes, and a region hid its attention)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gpt as bench
    cfg = bench.GPTConfig(vocab=256, seq=64, layers=2, hidden=64, heads=4)
    with torch.device("meta"):
        model = bench.models.make(bench.models.ModelSpec(bench.models.Kind.GPT, cfg))
    batch = ((4, 64), torch.long)
    fused = px.plan(model, bench.models.loss, batch, batch, device="cpu", device_memory="1GB", fuse=True)
    assert fused.fused and not any(n.target in FORWARD_ATTENTION for n in fused.graph.nodes)
    assert fused.model_flops == bench.flops_per_step(bench.n_params(model), cfg, 4)
    assert fused.model_flops > 6.0 * fused.params * fused.tokens


# -- the cost model -------------------------------------------------------------------------------------------------

def _traced(fn, *shapes, dtype=torch.bfloat16):
    gm = make_fx(fn, tracing_mode="fake")(*[torch.randn(s).to(dtype) for s in shapes])
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def test_matmul_and_attention_cost_by_their_flops():
    (mm,) = _traced(lambda a, b: a @ b, (256, 512), (512, 128))
    assert cost.flops(mm) == 2 * 256 * 512 * 128
    moved = (256 * 512 + 512 * 128 + 256 * 128) * 2
    assert cost.node_seconds(mm) == pytest.approx(max(2 * 256 * 512 * 128 / H200.matmul_flops,
                                                      moved / H200.hbm_bytes) + H200.kernel_s)
    B, H, T, D = 2, 4, 64, 32
    nodes = _traced(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), *[(B, H, T, D)] * 3)
    (att,) = [n for n in nodes if n.target in cost.ATTENTION_FLOPS]
    assert cost.flops(att) == 4 * B * H * T * T * D / 2          # causal: half
    (view,) = _traced(lambda a: a.view(-1), (8, 8))
    assert cost.node_seconds(view) == 0.0                        # views move nothing
    (add,) = _traced(lambda a, b: a + b, (1024,), (1024,))
    assert cost.node_seconds(add) == pytest.approx(3 * 1024 * 2 / H200.hbm_bytes + H200.kernel_s)


@functools.lru_cache(maxsize=None)
def _moving_graphs():
    """Scheduled graphs that move chunks both ways and update on the CPU: one rank, and two ranks (sharded)."""
    case = _case("gpt_tied", 4)
    batch = case.batch(0)
    budget = tight_budget(case, CHUNK)
    return tuple(_plan(case, batch, device_memory=budget, world_size=w, max_grad_norm=1.0).graph for w in (1, 2))


@given(world=st.sampled_from([1, 2]), h2d=st.floats(1, 1e4), d2h=st.floats(1, 1e4), cpu=st.floats(1, 1e4),
       comm=st.floats(1, 1e4))
def test_step_time_grows_when_moving_bytes_gets_slower(world, h2d, d2h, cpu, comm):
    """The same plan on a machine whose copies, CPU updates or collectives are slower (the same bytes take longer,
    as more bytes would) never gets faster, and the slowed lanes are busy at least as long."""
    g = _moving_graphs()[world - 1]
    fast = cost.estimate(g, H200)
    duplex = max(h2d, d2h)
    slow_machine = dataclasses.replace(
        H200, h2d_bytes=H200.h2d_bytes / h2d, d2h_bytes=H200.d2h_bytes / d2h, duplex_bytes=H200.duplex_bytes / duplex,
        duplex_cpu_bytes=H200.duplex_cpu_bytes / duplex, cpu_adam=H200.cpu_adam / cpu,
        nvlink_bus_bytes=H200.nvlink_bus_bytes / comm, network_bus_bytes=H200.network_bus_bytes / comm)
    slow = cost.estimate(g, slow_machine)
    assert slow.seconds >= fast.seconds * (1 - 1e-9)
    for lane in (Lane.H2D, Lane.D2H, Lane.CPU, Lane.COMM):
        assert slow.busy[lane] >= fast.busy[lane] * (1 - 1e-9)
    assert slow.flops == fast.flops


@given(world=st.sampled_from([1, 2]), slowed=st.sampled_from([None, Lane.H2D, Lane.D2H, Lane.CPU, Lane.COMM]),
       factor=st.floats(10, 1e4), atomic=st.booleans())
def test_the_compute_streams_idle_time_is_the_step_less_its_work_by_what_it_waits_for(world, slowed, factor,
                                                                                        atomic):
    """StepCost.waits accounts for the step: the compute lane's busy time plus its waits is the step, every wait is
    one of the lanes, never negative; and slowing one lane far enough makes the compute stream wait for that lane
    most (a copy, the CPU's updates, or the collectives)."""
    g = _moving_graphs()[world - 1]
    if not atomic:
        if world > 1:
            return
        g = g.evolve(settings=dataclasses.replace(g.settings, atomic=False))
    rates = {Lane.H2D: ("h2d_bytes", "duplex_bytes", "duplex_cpu_bytes"), Lane.D2H: ("d2h_bytes",),
             Lane.CPU: ("cpu_adam", "cpu_adam_mixed"), Lane.COMM: ("nvlink_bus_bytes", "network_bus_bytes")}
    m = H200 if slowed is None else dataclasses.replace(
        H200, **{f: getattr(H200, f) / factor for f in rates[slowed]})
    c = cost.estimate(g, m)
    assert set(c.waits) == set(Lane) and min(c.waits.values()) >= 0
    assert c.busy[Lane.COMPUTE] + sum(c.waits.values()) == pytest.approx(c.seconds, rel=1e-9)
    assert c.waits_line().startswith(f"{sum(c.waits.values()):.3f} s of the {c.seconds:.3f} s step")
    if slowed is not None and factor >= 1000 and (slowed is not Lane.COMM or world > 1):
        assert max(c.waits, key=c.waits.get) is slowed, (slowed, dict(c.waits))
        assert f"waiting for {slowed.value} " in c.waits_line()


def test_fewer_bytes_moved_take_less_time():
    """Budgets from tight to unlimited: the estimated step never gets slower (what the planner minimises; the bytes
    moved need not fall with it: streamed states and device-state chunks may move more bytes for a shorter step),
    the tightest plan moves the most bytes and the unlimited one none; a step is never shorter than its compute or
    its issuing thread."""
    case = _case("gpt_tied", 4)
    batch = case.batch(0)
    need = _plan(case, batch, device_memory=1).device_needed
    reports = [_plan(case, batch, device_memory=b) for b in (need, int(need * 1.3), int(need * 2), None)]
    moved = [r.h2d_bytes + r.d2h_bytes for r in reports]
    seconds = [r.cost.seconds for r in reports]
    assert moved[0] == max(moved) > moved[-1] == 0
    assert seconds == sorted(seconds, reverse=True) and seconds[0] > seconds[-1]
    for r in reports:
        slack = 1 + 1e-9      # sums of the same times in another order differ in the last bit
        assert r.cost.seconds * slack >= r.cost.busy[Lane.COMPUTE] and r.cost.seconds * slack >= r.cost.busy[Lane.HOST]



# -- the order of host-side updates ------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _placed_and_before(clip, atomic=True):
    """The optimizer-placed graph of the tied GPT in bf16 at a tight budget (host and device states), and the graph
    the pass placed them into."""
    case = _case("gpt_tied", 4)
    step = px.compile(case.build_model(), optimizer=px.AdamW(**HYPER), device_memory=tight_budget(case, CHUNK, 1.3),
                      chunk_size=CHUNK, precision="bf16", device="cpu", max_grad_norm=clip,
                      atomic=atomic)(case.loss_fn)
    step.lower(*case.batch(0))
    return step.graphs["optimizer_placed"], step.graphs["remat"]


def _host_steps(g):
    return [g.ann[n.name].chunk for n in g.nodes if g.ann[n.name].role is Role.OPTIMIZER_STEP
            and g.chunks[g.ann[n.name].chunk].state_home is StateHome.HOST]


def test_host_updates_start_with_the_first_final_gradients_only_before_the_commit():
    """With atomic=False (updates during backward) the CPU takes chunks as their gradients become final (the last
    layers first); in an atomic step every update is issued at the commit, and with clipping waits for its norm:
    then the order is the next forward's (chunk order)."""
    placed, _ = _placed_and_before(None, atomic=False)
    order = _host_steps(placed)
    assert len(order) > 2
    last_grad = {}
    for i, n in enumerate(placed.nodes):
        if placed.ann[n.name].role is Role.WRITE_GRAD:
            last_grad[placed.chunk_of(placed.ann[n.name].param).id] = i
    assert last_grad[order[0]] == min(last_grad[c] for c in order)
    assert order != sorted(order)
    for clip in (None, 1.0):
        after_commit, _ = _placed_and_before(clip)
        assert len(_host_steps(after_commit)) > 2
        assert _host_steps(after_commit) == sorted(_host_steps(after_commit))


@pytest.mark.parametrize("cpu_slower", [100, 300, 1000])
def test_update_order_is_not_slower_than_chunk_order(cpu_slower):
    """With updates during backward (atomic=False), on a machine whose CPU updates take from a seventh to more than
    the device's compute (the regime that decides the step time of the largest models), the cost model's order gives
    an estimated step no longer than updating in chunk order (to 0.1%: a list schedule is not optimal to the last
    bit), and clearly shorter when the CPU's work is about the compute's (chunk order waits for the first layers'
    gradients, the last to become final)."""
    placed, before = _placed_and_before(None, atomic=False)
    m = dataclasses.replace(H200, matmul_flops=H200.matmul_flops / 1e4, fp32_matmul_flops=H200.fp32_matmul_flops / 1e4,
                            hbm_bytes=H200.hbm_bytes / 1e4, cpu_adam_mixed=H200.cpu_adam_mixed / cpu_slower,
                            host_node_s=1e-8)
    device = [c.id for c in placed.chunks if c.state_home is StateHome.DEVICE]
    host = update_order(placed, m)
    assert sorted(host) == sorted(_host_steps(placed))

    def estimate(order):
        g = schedule(with_steps(before, device, order, early=True).evolve(chunks=placed.chunks))
        verify(g)
        return cost.estimate(g, m)
    chosen, chunk_order = estimate(host), estimate(sorted(host))
    assert chosen.seconds <= chunk_order.seconds * 1.001
    if cpu_slower == 1000:
        assert chosen.busy[Lane.CPU] > chosen.busy[Lane.COMPUTE]
        assert chosen.seconds < 0.9 * chunk_order.seconds


def _all_host(before):
    chunks = tuple(dataclasses.replace(c, state_home=StateHome.HOST) if c.group is ChunkGroup.TRAINABLE else c
                   for c in before.chunks)
    trainable = [c.id for c in chunks if c.group is ChunkGroup.TRAINABLE]
    return with_steps(before, trainable).evolve(chunks=chunks), trainable


def test_the_embedding_ranks_first_for_the_device():
    """The tied embedding is read first in the forward (and its gradient is final last in the backward): its update
    window on the CPU is the tightest, so its states are the first the device holds. In an atomic step every update
    is released at the commit and the rank is the next forward's order; with atomic=False, where the last layers'
    updates start during backward, it is not chunk order."""
    for atomic in (True, False):
        _, before = _placed_and_before(None, atomic=atomic)
        all_host, trainable = _all_host(before)
        ranked = device_priority(all_host)
        assert sorted(ranked) == trainable
        assert ranked[0] == before.param("wte.weight").chunk
        if not atomic:
            assert ranked != trainable           # not chunk order


@pytest.mark.parametrize("cpu_slower, copies_slower", [(1, 1), (100, 1), (1000, 1), (1, 1e4)])
def test_state_placement_is_not_slower_than_chunk_order(cpu_slower, copies_slower):
    """The cost model's placement of optimizer states (ranked by window slack; fewer device states where copies
    bound the step and the CPU has room) gives an estimated step no longer than the greedy fill in chunk order, on
    machines whose CPU is as fast as the H200 host's, 100 and 1000 times slower, and whose copies are 10^4 times
    slower."""
    _, before = _placed_and_before(None)
    m = dataclasses.replace(H200, matmul_flops=H200.matmul_flops / 1e4, fp32_matmul_flops=H200.fp32_matmul_flops / 1e4,
                            hbm_bytes=H200.hbm_bytes / 1e4, cpu_adam_mixed=H200.cpu_adam_mixed / cpu_slower,
                            h2d_bytes=H200.h2d_bytes / copies_slower, d2h_bytes=H200.d2h_bytes / copies_slower,
                            host_node_s=1e-8)
    all_host, trainable = _all_host(before)
    chosen = schedule(place_optimizer(before, m))
    in_chunk_order = schedule(_placed(before, all_host, _choose_homes(all_host, trainable).chunks, m))
    for g in (chosen, in_chunk_order):
        verify(g)
        assert sum(c.state_home is StateHome.DEVICE for c in g.chunks) < len(trainable)
    assert cost.estimate(chosen, m).seconds <= cost.estimate(in_chunk_order, m).seconds * 1.001
    # fewer device states are estimated where the fullest placement's step waits beyond its compute and the CPU's
    # updates are shorter than the compute; then the fastest placement tried is kept
    ranked = device_priority(all_host, m)
    most = _choose_homes(all_host, ranked)
    fewer = _fewer_states(most, ranked, m)
    fullest = cost.estimate(schedule(_placed(before, all_host, most.chunks, m)), m)
    compute = sum(cost.compute_seconds(all_host, m))
    assert bool(fewer) == (cpu_slower < 1000)
    why = [c.why for c in chosen.choices if c.made_by == "place_optimizer"]
    on_device = sum(c.state_home is StateHome.DEVICE for c in most.chunks)
    assert why[0].startswith(f"optimizer states of {on_device} of {len(trainable)} chunks on the device"), why
    if fewer and fullest.seconds > compute * (1 + WAITS):
        # every placement the why line lists was estimated at what it says, and none tried is faster than the kept
        listed = why[1].split("(device states: estimated step) ")[1].rsplit(": ", 1)[0]
        estimates = {}
        for item in listed.split("; "):
            count, value = item.split(": ")
            if value.endswith(" s"):
                estimates[int(count)] = float(value[:-2])
        assert on_device in estimates and len(estimates) >= 2, why[1]
        for count, seconds in estimates.items():
            homes = moved_back(most, fewer, on_device - count)
            again = cost.estimate(schedule(_placed(before, all_host, homes, m)), m).seconds
            assert f"{again:.4g}" == f"{seconds:.4g}", (count, again, seconds)
        kept = sum(c.state_home is StateHome.DEVICE for c in chosen.chunks)
        assert estimates[kept] == min(estimates.values()) and f"{kept} kept" in why[1], why
        # the streamed and undo updates chosen on it after: none, or estimated no slower
        assert cost.estimate(chosen, m).seconds <= min(estimates.values()) * 1.001
        assert why[1].startswith("that placement's step is estimated"), why
    else:
        assert [c.state_home for c in chosen.chunks] == [c.state_home for c in most.chunks]
    if not fewer:
        assert why[1].startswith("no fewer device states tried: the CPU's updates"), why
    if copies_slower > 1:       # copies 10^4 times slower: the fullest waits for them, and fewer were tried
        assert fewer and fullest.seconds > compute * (1 + WAITS)


@given(queue=st.integers(1, 4096), world=st.sampled_from([1, 2]))
def test_a_shorter_launch_queue_never_makes_a_step_faster(queue, world):
    """The executor may run at most `launch_queue` kernels ahead of the compute stream: a shorter queue holds it back
    more (never less), and the compute lane's work is the same."""
    g = _moving_graphs()[world - 1]
    free = cost.estimate(g, dataclasses.replace(H200, launch_queue=10 ** 9))
    held = cost.estimate(g, dataclasses.replace(H200, launch_queue=queue))
    assert held.seconds >= free.seconds * (1 - 1e-9)
    assert held.busy[Lane.COMPUTE] == pytest.approx(free.busy[Lane.COMPUTE])


def test_a_queue_of_one_kernel_serialises_issuing_and_compute():
    """With room for one kernel, the executor issues each kernel only after the previous one ran: the step takes at
    least the compute stream's work plus the executor's time for every kernel. With an unbounded queue the same
    plan (compute-bound here) takes less than that."""
    g = _moving_graphs()[0]
    slow = dataclasses.replace(H200, kernel_s=3e-4, host_node_s=2e-5)     # kernels outlast issuing them
    kernels = sum(1 for n in g.nodes if g.ann[n.name].role is Role.COMPUTE and cost.node_seconds(n, slow) > 0)
    one = cost.estimate(g, dataclasses.replace(slow, launch_queue=1))
    free = cost.estimate(g, dataclasses.replace(slow, launch_queue=10 ** 9))
    serial = one.busy[Lane.COMPUTE] + kernels * slow.host_node_s
    assert one.seconds >= serial * (1 - 1e-9)
    assert free.seconds < serial


@pytest.mark.parametrize("atomic", [True, False])
def test_steps_moved_into_place_are_what_with_steps_inserts(atomic):
    """place_optimizer moves the step nodes of its own all-host graph into place instead of copying the graph again:
    the roles and chunks of every node, in order, are those with_steps builds from the pass's input."""
    _, before = _placed_and_before(None)
    before = before.evolve(settings=dataclasses.replace(before.settings, atomic=atomic))
    all_host, trainable = _all_host(before)
    homes = _choose_homes(all_host, device_priority(all_host)).chunks
    moved = _placed(before, all_host, homes, H200, reuse=True)
    fresh_all_host, _ = _all_host(before)
    inserted = _placed(before, fresh_all_host, homes, H200)
    verify(moved.evolve(stage="optimizer_placed"))

    def shape(g):
        return [(g.ann[n.name].role, g.ann[n.name].chunk, n.name if g.ann[n.name].role is Role.COMPUTE else None)
                for n in g.nodes]
    assert shape(moved) == shape(inserted)
    steps = [g.ann[n.name].chunk for g in (moved,) for n in g.nodes if g.ann[n.name].role is Role.OPTIMIZER_STEP]
    assert sorted(steps) == trainable
    if not atomic:       # host steps come before the commit
        roles = [moved.ann[n.name].role for n in moved.nodes]
        assert roles.index(Role.OPTIMIZER_STEP) < roles.index(Role.COMMIT)


def test_plan_weighs_its_choices_at_its_machines_rates():
    """px.plan's machine reaches the passes, not only the final estimate: at a budget where the CPU updates every
    host-placed chunk on the H200's rates, a machine whose CPU updates 1000x slower streams some chunks' states to
    the device for their update, and its plan is not slower at its own rates than the H200's plan would be."""
    case = _case("gpt_tied", 4)
    budget = tight_budget(case, CHUNK)
    slow = dataclasses.replace(H200, cpu_adam=H200.cpu_adam / 1000, cpu_adam_mixed=H200.cpu_adam_mixed / 1000)
    fast_plan, slow_plan = (_plan(case, case.batch(0), device_memory=budget, machine=m) for m in (H200, slow))
    streamed = [sum(c.streamed for c in r.graph.chunks) for r in (fast_plan, slow_plan)]
    assert streamed[0] == 0 < streamed[1], streamed
    assert any("streamed over and back" in str(c) for c in slow_plan.graph.choices)
    assert slow_plan.cost.seconds <= cost.estimate(fast_plan.graph, slow).seconds


def test_fewer_device_states_are_not_chosen_over_a_host_budget_the_fullest_placement_fits():
    """Where copies bound the step, place_optimizer tries keeping fewer optimizer states on the device (more
    parameters resident); without a disk tier it keeps none that puts more in host memory than the host budget
    holds, so a host that holds the fullest placement is never refused for a faster one it does not."""
    from pstar_fx.ir.needs import host_bytes
    slow_copies = dataclasses.replace(
        H200, matmul_flops=H200.matmul_flops / 100, fp32_matmul_flops=H200.fp32_matmul_flops / 100,
        hbm_bytes=H200.hbm_bytes / 100, h2d_bytes=H200.h2d_bytes / 1e4, d2h_bytes=H200.d2h_bytes / 1e4,
        cpu_adam_mixed=H200.cpu_adam_mixed * 10, host_node_s=1e-8)
    _, before = _placed_and_before(None)
    all_host, _ = _all_host(before)
    fullest = _placed(before, all_host, _choose_homes(all_host, device_priority(all_host, slow_copies)).chunks,
                      slow_copies)
    on_device = [sum(c.state_home is StateHome.DEVICE for c in g.chunks)
                 for g in (fullest, place_optimizer(before, slow_copies))]
    assert on_device[1] < on_device[0]                  # unbounded, a placement with fewer is faster
    budget = host_bytes(schedule(fullest))
    placed = place_optimizer(before.evolve(settings=dataclasses.replace(before.settings, host_budget=budget)),
                             slow_copies)
    assert sum(c.state_home is StateHome.DEVICE for c in placed.chunks) == on_device[0]
    assert host_bytes(placed.scheduled.result) <= budget
