"""fuse=True: the compute between chunk operations runs as compiled regions (passes/regions.py), and the plan holds.

Compiling a region with Inductor takes seconds on the CI machine, so the cases are few and tiny; identical regions
share one compilation and Inductor's FX graph cache keeps them for the next run.

Numerics: Inductor's generated reductions (sums in layer norm, softmax, the loss, bias gradients) add in another
order than eager's kernels, so fp32 results differ from eager in the last bits: losses are held to 1e-5 relative
and parameters to 1e-5 of their largest magnitude after the steps (a few ulps of the reorder, magnified by Adam's
division by sqrt(v)), except the attention key bias, whose gradient is zero in theory (softmax is invariant to it):
Adam turns the reorder's noise there into steps of up to about lr, so it is held to that bound per step (and the
query and value biases, whose gradients are small, to 1e-3 of a step).
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import pstar_fx as px
from pstar_fx import cost
from pstar_fx.ir import Role, ops
from pstar_fx.ir.fx_utils import draws_random, mutated_args
from pstar_fx.ir.graph import REMAT

from harness import HYPER, eager_run, fetch_counts, rel_err, small_batches, tight_budget
from models import CASES_BY_NAME, GPT, Case, _gpt_batch, assert_state_close, gpt_loss

STEPS = 3
CHUNK = 1024
GPT_DROPOUT = Case("gpt_dropout", lambda: GPT(vocab=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1),
                   gpt_loss, _gpt_batch)


def _step(case, budget=None, fuse=True, **kw):
    return px.compile(case.build_model(), optimizer=px.AdamW(**HYPER), device_memory=budget, chunk_size=CHUNK,
                      device="cpu", debug=True, fuse=fuse, **kw)(case.loss_fn)


def _regions(g):
    return [n for n in g.nodes if g.ann[n.name].role is Role.REGION]


def _check_regions(g):
    """Every region holds two or more plain compute nodes: nothing random, nothing in place, no runtime op."""
    regions = _regions(g)
    assert regions, "nothing was fused"
    for r in regions:
        spec = r.kwargs["spec"]
        inner = [n for n in spec.gm.graph.nodes if n.op == "call_function"]
        assert len(inner) == spec.nodes >= 2
        for n in inner:
            assert not draws_random(n) and not mutated_args(n), n.format_node()
            assert n.target not in ops.RUNTIME_OPS


def _close_but_key_bias(sd, ref, n_embd, steps, rtol=1e-5):
    """assert_state_close, the attention key bias held to Adam's step bound instead (see the module docstring)."""
    bound = 2 * HYPER["lr"] * steps
    for k in [k for k in ref if k.endswith("attn.c_attn.bias")]:
        a, b = sd.pop(k), ref.pop(k)
        key = slice(n_embd, 2 * n_embd)
        assert (a[key] - b[key]).abs().max() <= bound
        # the query and value biases: gradients near zero too (a few ulps of the reorder, divided by sqrt(v)),
        # held to 1e-3 of a step
        assert (a - b)[torch.arange(len(a)) // n_embd != 1].abs().max() <= 1e-3 * HYPER["lr"]
    assert_state_close(sd, ref, rtol)


@pytest.mark.slow
def test_gpt_dropout_under_remat_budget_matches_eager():
    """A budget only recomputation fits: chunks evicted and fetched again, activations recomputed, dropout kept
    eager (the same masks as eager's from the same seed), the plan's bytes measured exactly at every node."""
    case = GPT_DROPOUT
    least = [px.compile(case.build_model(), optimizer=px.AdamW(**HYPER), chunk_size=CHUNK, device="cpu",
                        remat=r)(case.loss_fn).min_device_memory(*case.batch(0)) for r in (False, "auto")]
    budget = sum(least) // 2
    step = _step(case, budget)
    torch.manual_seed(5)
    losses = [step(*case.batch(i)).item() for i in range(STEPS)]
    torch.manual_seed(5)
    ref_losses, ref_sd = eager_run(case, STEPS)
    assert rel_err(losses, ref_losses) <= 1e-5, (losses, ref_losses)
    _close_but_key_bias(step.state_dict(), ref_sd, n_embd=32, steps=STEPS)

    g = step.graphs["fused"]
    _check_regions(g)
    sched = step.graphs["scheduled"]
    random_ops = [n for n in g.nodes if n.op == "call_function" and draws_random(n)]
    assert len(random_ops) == len([n for n in sched.nodes if n.op == "call_function" and draws_random(n)]) > 0
    assert any(REMAT in n.meta for n in sched.nodes), "nothing was recomputed"
    assert max(fetch_counts(g).values()) >= 2, "no chunk was evicted and fetched again"
    assert step.last_step.measured_peak == g.plan.predicted_peak <= budget    # debug=True checked every node
    assert str(g).startswith('# stage "fused" made by fuse_regions')
    assert "= region(" in str(g)
    assert "fused" in str(step.summary())


def test_mlp_accumulate_matches_unfused():
    """Two micro-batches under a budget that evicts: fused equals unfused (itself checked against eager in
    test_equivalence), the same chunk traffic, and a plan no larger than the unfused one."""
    case = CASES_BY_NAME["mlp_ce"]
    budget = int(px.compile(case.build_model(), optimizer=px.AdamW(**HYPER), chunk_size=CHUNK, device="cpu",
                            accumulate=2)(case.loss_fn).min_device_memory(*case.batch(0)) * 1.05)
    runs = {}
    for fuse in (False, True):
        step = _step(case, budget, fuse=fuse, accumulate=2)
        runs[fuse] = ([step(*case.batch(i)).item() for i in range(STEPS)], step.state_dict(), step)
    (l0, sd0, s0), (l1, sd1, s1) = runs[False], runs[True]
    assert rel_err(l1, l0) <= 1e-5
    assert_state_close(sd1, sd0, rtol=1e-5)
    g, plain = s1.graphs["fused"], s0.graphs["scheduled"]
    assert "fused" not in s0.graphs
    _check_regions(g)
    assert (g.plan.h2d_bytes, g.plan.d2h_bytes) == (plain.plan.h2d_bytes, plain.plan.d2h_bytes)
    assert max(fetch_counts(g).values()) >= 2
    assert s1.last_step.measured_peak == g.plan.predicted_peak <= budget
    assert sum(r.kwargs["spec"].nodes for r in _regions(g)) > 0.5 * sum(
        1 for n in plain.nodes if plain.ann[n.name].role is Role.COMPUTE)
    # the cost model times the regions: the same matmul FLOPs; the fused compute no longer, nor less than its
    # matmuls; the step estimated within the unfused one's range
    fused_cost, plain_cost = cost.estimate(g), cost.estimate(plain)
    assert fused_cost.flops == plain_cost.flops > 0
    fused_s, plain_s = sum(cost.compute_seconds(g)), sum(cost.compute_seconds(plain))
    matmuls = sum(cost.node_seconds(n) for n in plain.nodes if n.target in cost.MATMUL_FLOPS)
    assert matmuls < fused_s <= plain_s, (matmuls, fused_s, plain_s)
    assert 0.5 * plain_cost.seconds <= fused_cost.seconds <= plain_cost.seconds * 1.01


@pytest.mark.slow
def test_bf16_fused_tracks_unfused_bf16_under_a_budget_that_evicts():
    """Mixed precision (bf16 chunks, fp32 masters) with fused regions under a budget that evicts: the losses follow
    the unfused bf16 run's within the mixed-precision tolerance of the suite (2e-3 relative: Inductor rounds a
    region's bf16 intermediates once, eager kernels each op), and the plan is measured exactly (debug=True)."""
    case = small_batches(CASES_BY_NAME["gpt_tied"])
    budget = int(tight_budget(case, CHUNK) * 1.2)
    losses, steps = {}, {}
    for fuse in (False, True):
        steps[fuse] = _step(case, budget, fuse=fuse, precision="bf16")
        losses[fuse] = [steps[fuse](*case.batch(i)).item() for i in range(5)]
    g = steps[True].graphs["fused"]
    _check_regions(g)
    assert all(c.dtype == torch.bfloat16 for c in g.chunks)
    assert max(fetch_counts(g).values()) >= 2                     # it evicts
    assert steps[True].last_step.measured_peak == g.plan.predicted_peak <= budget
    assert max(abs(a - b) / b for a, b in zip(losses[True], losses[False])) < 2e-3, losses


def test_an_embeddings_gradient_stays_eager():
    """Inductor adds an embedding's gradient with atomics (runs would differ in the last bits): the fused graph keeps
    embedding_dense_backward out of its regions, as eager traced it."""
    case = CASES_BY_NAME["gpt_tied"]
    g = _step(case).lower(*case.batch(0))["fused"]
    _check_regions(g)
    eager = [n for n in g.nodes if n.target is torch.ops.aten.embedding_dense_backward.default]
    assert eager and all(g.ann[n.name].role is Role.COMPUTE for n in eager)
    for r in _regions(g):
        assert all(n.target is not torch.ops.aten.embedding_dense_backward.default
                   for n in r.kwargs["spec"].gm.graph.nodes)


def test_fuse_option_checked():
    case = CASES_BY_NAME["mlp_mse"]
    with pytest.raises(ValueError, match="fuse must be True, False or None"):
        _step(case, fuse="yes")
    with pytest.raises(ValueError, match="fuse belong to training steps"):
        px.compile(case.build_model(), optimizer=None, fuse=True)(case.loss_fn)


def test_the_default_is_per_device_and_precision(monkeypatch):
    """fuse=None: DEFAULT_FUSE's entry for the device type and precision (CUDA mixed precision fused, fp32 and the
    CPU not); a CUDA entry holds only where Triton is installed; an explicit True or False is kept."""
    from pstar_fx.api import options
    from pstar_fx.ir.graph import Precision
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(options, "_has_triton", lambda: True)
    for precision in Precision:
        for device in (cpu, cuda):
            fused = device.type == "cuda" and precision in (Precision.BF16, Precision.FP16)
            assert options.resolve_fuse(None, device, precision) is fused
            assert options.resolve_fuse(True, device, precision) is True
            assert options.resolve_fuse(False, device, precision) is False
    monkeypatch.setitem(options.DEFAULT_FUSE, ("cuda", Precision.BF16), False)
    assert options.resolve_fuse(None, cuda, Precision.BF16) is False
    assert options.resolve_fuse(None, cuda, Precision.FP16, world=2) is False     # not yet run on several GPUs
    assert options.resolve_fuse(True, cuda, Precision.FP16, world=2) is True
    monkeypatch.setattr(options, "_has_triton", lambda: False)
    assert options.resolve_fuse(None, cuda, Precision.FP16) is False
    # fuse=None resolved to fused leaves the choice to the cost model (fuse_if_faster); an explicit True does not
    assert options.fuse_by_estimate(None, True) and not options.fuse_by_estimate(True, True)
    assert not options.fuse_by_estimate(None, False)
    monkeypatch.setattr(options, "FUSE_IF_FASTER", False)
    assert not options.fuse_by_estimate(None, True)


def test_attention_kernels_timed_at_their_measured_rates():
    """Each attention kernel at its measured rate (cost.Machine): cuDNN's, torch's default on the H200, and attention
    traced on the CPU at attention_efficiency; flash and memory-efficient attention at theirs."""
    from types import SimpleNamespace
    m = cost.H200
    rates = {name: cost._attention_efficiency(SimpleNamespace(target=getattr(torch.ops.aten, name).default), m)
             for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
                          "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu")}
    assert rates == {"_scaled_dot_product_flash_attention": m.flash_attention_efficiency,
                     "_scaled_dot_product_cudnn_attention": m.attention_efficiency,
                     "_scaled_dot_product_efficient_attention": m.efficient_attention_efficiency,
                     "_scaled_dot_product_flash_attention_for_cpu": m.attention_efficiency}
    assert m.efficient_attention_efficiency < m.flash_attention_efficiency < m.attention_efficiency <= 1
    with pytest.raises(ValueError, match="at most 1"):
        cost.Machine(flash_attention_efficiency=1.5)


_CACHE_RUN = textwrap.dedent("""
    import sys
    sys.path.insert(0, {support!r})
    import pstar_fx as px
    from models import CASES_BY_NAME
    case = CASES_BY_NAME["mlp_mse"]
    step = px.compile(case.build_model(), optimizer=px.AdamW(lr=1e-3), device="cpu", fuse=True)(case.loss_fn)
    step(*case.batch(0))
    stats = step._compiler.latest.executor.region_stats
    print("REGIONS", stats.compiled, stats.cache_hits)
""")


@pytest.mark.slow
def test_second_process_finds_regions_in_cache(tmp_path):
    """Inductor's FX graph cache keeps compiled regions across processes: a second process compiling the same
    model compiles nothing again."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
               PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    support = os.path.join(os.path.dirname(os.path.dirname(__file__)), "support")
    counts = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _CACHE_RUN.format(support=support)], env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        line = next(ln for ln in out.stdout.splitlines() if ln.startswith("REGIONS"))
        counts.append(tuple(int(x) for x in line.split()[1:]))
    (compiled0, hits0), (compiled1, hits1) = counts
    assert compiled0 >= 1 and hits0 == 0
    assert hits1 == compiled1 == compiled0


def _rotary_region():
    """A region like a rotary embedding's: the two halves of x's last dimension, one negated, put back together."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    from torch._subclasses.fake_tensor import FakeTensorMode

    def f(x, y):
        a = torch.ops.aten.neg.default(torch.ops.aten.slice.Tensor(x, -1, 16, 32))
        b = torch.ops.aten.mul.Tensor(torch.ops.aten.slice.Tensor(x, -1, 0, 16), y)
        return (a, torch.ops.aten.cat.default([a, b], -1))

    x, y = torch.randn(3, 5, 32), torch.randn(3, 5, 16)
    gm = make_fx(f)(x, y)
    FakeTensorProp(gm, FakeTensorMode()).propagate(x, y)
    return ops.RegionSpec(index=0, gm=gm, nodes=5, workspace=0), f


def test_a_region_called_with_inputs_in_another_layout_is_compiled_for_it():
    """The compiled code checks its inputs' strides; an input in another layout than traced (a view into a wider
    buffer, here) gets a variant compiled for it, once, and the same values."""
    from pstar_fx.runtime.compiled_regions import RegionCompiler

    spec, f = _rotary_region()
    (fn,), stats = RegionCompiler().compile_all([spec])
    assert stats.compiled == 1 and stats.relaid == 0
    x, y = torch.randn(3, 5, 32), torch.randn(3, 5, 16)
    for got, want in zip(fn([x, y]), f(x, y)):
        assert torch.equal(got, want) and got.stride() == want.stride()
    wide = torch.randn(3, 5, 2, 16)
    y2 = wide[:, :, 1]                       # strides (160, 32, 1), not the traced (80, 16, 1)
    for _ in range(2):
        for got, want in zip(fn([x, y2]), f(x, y2)):
            assert torch.equal(got, want)
    assert stats.compiled == 2 and stats.relaid == 1
    assert "1 again for another input layout at run time" in str(stats)


def test_inductors_compile_workers_are_shut_down_after_regions_compile(monkeypatch):
    """Inductor's pool of compile worker processes is shut down once a graph's regions are compiled, and after a
    variant compiled at run time for another input layout (compiled_regions.py says why); not before the compile."""
    from torch._inductor import async_compile
    from pstar_fx.runtime.compiled_regions import RegionCompiler
    import torch._inductor.compile_fx as compile_fx

    events = []
    inner = compile_fx.compile_fx_inner
    monkeypatch.setattr(async_compile, "shutdown_compile_workers", lambda: events.append("shutdown"), raising=False)
    monkeypatch.setattr(compile_fx, "compile_fx_inner", lambda *a, **k: (events.append("compile"), inner(*a, **k))[1])
    spec, f = _rotary_region()
    (fn,), stats = RegionCompiler().compile_all([spec])
    assert events == ["compile", "shutdown"]
    x, y = torch.randn(3, 5, 32), torch.randn(3, 5, 16)
    fn([x, y])
    assert events == ["compile", "shutdown"]                      # the traced layout: nothing compiled
    fn([x, torch.randn(3, 5, 2, 16)[:, :, 1]])                    # another layout: compiled, then shut down
    assert events == ["compile", "shutdown", "compile", "shutdown"] and stats.relaid == 1


def test_regions_compile_deterministic_and_with_tritons_launcher(monkeypatch):
    """Inductor would pick a reduction's configuration by timing it at the first call (on a GPU: two compiles of one
    region could sum in different orders); regions compile with torch._inductor.config.deterministic set, which the
    generated kernels carry. And with Triton's own kernel launcher, which lets the GIL go while it launches, not
    Inductor's static one (compiled_regions.py says why). Both settings are left as they were."""
    import torch._inductor.compile_fx as compile_fx
    import torch._inductor.config as inductor_config
    from pstar_fx.runtime.compiled_regions import RegionCompiler

    names = [n for n in ("deterministic", "use_static_cuda_launcher") if hasattr(inductor_config, n)]
    if not names:
        pytest.skip("this torch's Inductor has neither setting")
    seen = []
    inner = compile_fx.compile_fx_inner

    def spy(*args, **kwargs):
        seen.append({n: getattr(inductor_config, n) for n in names})
        return inner(*args, **kwargs)
    monkeypatch.setattr(compile_fx, "compile_fx_inner", spy)
    before = {n: getattr(inductor_config, n) for n in names}
    spec, f = _rotary_region()
    (fn,), stats = RegionCompiler().compile_all([spec])
    x, y = torch.randn(3, 5, 32), torch.randn(3, 5, 16)
    for got, want in zip(fn([x, y]), f(x, y)):
        assert torch.equal(got, want)
    want = {"deterministic": True, "use_static_cuda_launcher": False}
    assert seen == [{n: want[n] for n in names}]
    assert {n: getattr(inductor_config, n) for n in names} == before


def test_a_compiled_region_keeps_its_outputs_traced_strides():
    from pstar_fx.runtime.compiled_regions import _keep_output_strides
    from torch.fx.experimental.proxy_tensor import make_fx

    spec, _ = _rotary_region()
    copy = make_fx(spec.gm)(torch.randn(3, 5, 32), torch.randn(3, 5, 16))
    _keep_output_strides(copy, spec.gm)
    out = copy.graph.find_nodes(op="output")[0]
    assert out.meta["user_visible_output_idxs"] == [0, 1]
    assert out.meta["original_output_strides"] == [(80, 16, 1), (160, 32, 1)]


def test_the_cost_model_charges_a_region_part_of_its_elementwise_time():
    """region_seconds: a region's matmuls as unfused, its other work in one launch, at Machine.fused_fraction of its
    unfused memory time but never below one pass over its inputs and outputs nor above its unfused time: at 1 fusion
    is modelled to save the launches only, near 0 everything but that pass."""
    from pstar_fx.passes import fuse_regions

    step = _step(CASES_BY_NAME["mlp_mse"], fuse=False)
    step(*CASES_BY_NAME["mlp_mse"].batch(0))
    g = fuse_regions(step.graphs["scheduled"])
    regions = _regions(g)
    assert regions
    for r in regions:
        inner = [x for x in r.kwargs["spec"].gm.graph.nodes if x.op == "call_function"]
        heavy = sum(cost.node_seconds(x) for x in inner if x.target in cost.MATMUL_FLOPS)
        launches = sum(cost.node_seconds(x) > 0 for x in inner if x.target not in cost.MATMUL_FLOPS)
        light = sum(cost.node_seconds(x) for x in inner) - heavy - launches * cost.H200.kernel_s   # memory time
        whole = cost.region_seconds(r, cost.Machine(fused_fraction=1.0))
        assert whole == pytest.approx(heavy + light + cost.H200.kernel_s)     # every launch but one saved
        io_only = cost.region_seconds(r, cost.Machine(fused_fraction=1e-9))
        assert heavy < io_only <= whole
        default = cost.region_seconds(r)
        assert io_only <= default <= whole
        io = io_only - heavy - cost.H200.kernel_s
        assert default == pytest.approx(heavy + min(light, max(io, 0.9 * light)) + cost.H200.kernel_s)
    with pytest.raises(ValueError, match="Machine.fused_fraction must be a positive finite number at most 1"):
        cost.Machine(fused_fraction=1.5)


def test_fuse_if_faster_keeps_the_regions_only_where_the_estimate_is_faster():
    """fuse=None's pass: where the CPU worker's updates, slowed beside a fused backward, bound the step, the scheduled
    graph unfused (stage "fused", no region, settings unfused); where they are not slowed, the regions. Both verify,
    and a Choice gives the two estimates."""
    from pstar_fx.ir.graph import UpdateSite
    from pstar_fx.passes import fuse_if_faster, verify

    case = CASES_BY_NAME["mlp_mse"]
    step = _step(case, budget=tight_budget(case, CHUNK, 1.3), fuse=False, atomic=False)
    step(*case.batch(0))
    sched = step.graphs["scheduled"]
    assert any(c.update_site is UpdateSite.CPU for c in sched.chunks), "the plan should update chunks on the CPU"
    slow = fuse_if_faster(sched, cost.Machine(cpu_adam_beside_fused=1e-3))
    verify(slow)
    assert slow.stage == "fused" and not _regions(slow) and not slow.settings.fused
    assert [n.name for n in slow.nodes] == [n.name for n in sched.nodes]
    assert str(slow.choices[-1]).startswith("fuse_if_faster: not fused (fuse=None)")
    fast = fuse_if_faster(sched, cost.Machine(cpu_adam_beside_fused=1.0))
    verify(fast)
    assert _regions(fast) and fast.settings.fused
    assert str(fast.choices[-1]).startswith("fuse_if_faster: fused: the step estimated")


def test_the_default_fusion_goes_through_fuse_if_faster(monkeypatch):
    """fuse=None where DEFAULT_FUSE fuses: the optimizer is placed for an unfused step and the step's "fused" stage
    comes from fuse_if_faster, whose choice the summary prints; fuse=True fuses without asking. Where the estimate
    says unfused, the step trains as fuse=False does, bit for bit, and the summary's fused line says none ran."""
    import dataclasses

    from pstar_fx.api import options
    from pstar_fx.ir.graph import Precision

    case = CASES_BY_NAME["mlp_mse"]
    monkeypatch.setitem(options.DEFAULT_FUSE, ("cpu", Precision.FP32), True)
    monkeypatch.setattr(options, "FUSE_IF_FASTER", True)          # (PSTAR_TEST_FUSE=1 turns it off)
    auto = _step(case, budget=tight_budget(case, CHUNK, 1.3), fuse=None)
    auto(*case.batch(0))
    assert not auto.settings.fused                      # the optimizer placed for an unfused step
    assert auto.graphs["fused"].settings.fused == bool(_regions(auto.graphs["fused"]))
    assert any(str(c).startswith("fuse_if_faster: ") for c in auto.graphs["fused"].choices)
    assert "fuse_if_faster: " in str(auto.summary())
    forced = _step(case, budget=tight_budget(case, CHUNK, 1.3), fuse=True)
    forced(*case.batch(0))
    assert _regions(forced.graphs["fused"])
    assert not any(str(c).startswith("fuse_if_faster") for c in forced.graphs["fused"].choices)
    # where the estimate goes the other way (forced here), the step runs unfused and the summary says so
    from pstar_fx.passes import regions

    def slower_fused(g, machine=cost.H200):
        return dataclasses.replace(cost.estimate(g, machine), seconds=2.0 if g.settings.fused else 1.0)
    monkeypatch.setattr(regions, "estimate", slower_fused)
    plain = _step(case, budget=tight_budget(case, CHUNK, 1.3), fuse=None)
    unfused = _step(case, budget=tight_budget(case, CHUNK, 1.3), fuse=False)
    for i in range(2):
        assert torch.equal(plain(*case.batch(i)), unfused(*case.batch(i)))
    g = plain.graphs["fused"]
    assert not _regions(g) and not g.settings.fused and g.plan is plain.graphs["scheduled"].plan
    assert plain.summary().fused.startswith("none: ")
    assert "fuse_if_faster: not fused (fuse=None): the step estimated 1.00000 s unfused against 2.00000 s" in \
        str(plain.summary())


def test_the_cost_model_slows_the_cpu_worker_beside_a_fused_steps_backward():
    """Beside a fused step's backward (atomic=False) the CPU worker's updates ran slower (Machine.cpu_adam_beside_fused,
    fitted on H100s); after the commit (atomic) they did not. A step compiled with fuse=True carries it in its
    settings, and the CPU's rate is that fraction of the unfused one where it updates beside backward."""
    import dataclasses

    case = CASES_BY_NAME["mlp_mse"]
    fused, unfused = _step(case, fuse=True, atomic=False), _step(case, fuse=False, atomic=False)
    assert fused.settings.fused and not unfused.settings.fused and fused.settings.early_updates
    m = cost.Machine(cpu_adam_beside_fused=0.5)
    assert cost.cpu_update_rate(fused.settings, m) == pytest.approx(0.5 * cost.cpu_update_rate(unfused.settings, m))
    assert cost.cpu_update_rate(dataclasses.replace(unfused.settings, fused=True), cost.H200) == pytest.approx(
        cost.H200.cpu_adam_beside_fused * cost.cpu_update_rate(unfused.settings, cost.H200))
    atomic = _step(case, fuse=True).settings
    assert cost.cpu_update_rate(atomic, m) == cost.cpu_update_rate(dataclasses.replace(atomic, fused=False), m)
    with pytest.raises(ValueError, match="Machine.cpu_adam_beside_fused must be a positive finite number at most 1"):
        cost.Machine(cpu_adam_beside_fused=0.0)


@pytest.mark.parametrize("slack", [1.02, 1.2])
def test_gradient_writes_moved_after_a_region_split_it_where_they_pass_the_budget(slack):
    """A region's gradient writes are made after it, so their gradients live longer than scheduled: where that
    passes the budget the region's run is split like any over-budget region (it failed an assertion). The fuse pass
    alone, through px.plan (nothing is compiled); the case a user met: bf16, checkpointed blocks with dropout, two
    micro-batches, a budget near the least."""
    from pstar_fx.models.gpt import GPT as RefGPT, GPTConfig, gpt_loss as ref_loss
    torch.manual_seed(0)
    model = RefGPT(GPTConfig(vocab=64, seq=16, layers=2, hidden=64, heads=4, dropout=0.1, checkpoint=True))
    batch = (torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16)))
    kw = dict(device="cpu", precision="bf16", accumulate=2)
    least = px.compile(model, optimizer=px.AdamW(lr=1e-3), fuse=False, **kw)(ref_loss).min_device_memory(*batch)
    report = px.plan(model, ref_loss, *batch, device_memory=int(least * slack), fuse=True, **kw)
    assert report.fits and report.fused is not None and report.fused[0] > 0
    assert report.peak_device <= int(least * slack)


def test_ctrl_c_is_taken_between_region_compiles_and_what_compiled_is_kept(monkeypatch):
    """Compiling a step's regions can take minutes: a Ctrl-C held over it is taken after the region compiling when it
    arrived (the `between` safe point), not after all of them, and the regions compiled stay in the compiler."""
    from pstar_fx.runtime import compiled_regions
    compiled_now = []
    monkeypatch.setattr(compiled_regions, "_compile",      # (no Inductor: the region's own graph, eagerly)
                        lambda gm, vals: compiled_now.append(gm) or (lambda args: gm(*args)))
    case = small_batches(CASES_BY_NAME["gpt_tied"])
    budget = tight_budget(case, chunk_size=256)          # (chunk moves between the compute: several regions)
    step = px.compile(case.build_model(), optimizer=px.AdamW(**HYPER), device="cpu", fuse=True, chunk_size=256,
                      device_memory=budget)(case.loss_fn)
    regions = step._compiler.regions
    calls = []

    def ctrl_c_after_the_first():
        calls.append(len(compiled_now))
        if len(calls) == 1:
            raise KeyboardInterrupt
    real = compiled_regions.RegionCompiler.compile_all
    monkeypatch.setattr(compiled_regions.RegionCompiler, "compile_all",
                        lambda self, specs, between=None: real(self, specs, ctrl_c_after_the_first))
    with pytest.raises(KeyboardInterrupt):
        step.lower(*case.batch(0))
    assert calls == [1] and len(regions._cache) == 1, (calls, len(regions._cache))
    monkeypatch.setattr(compiled_regions.RegionCompiler, "compile_all", real)
    step(*case.batch(0))             # the next call compiles the rest; the first region comes from the compiler
    assert len(compiled_now) == len(regions._cache) >= 2, "each region compiled once"
