"""px.plan for a machine: the presets ("h200" measured, "h100" assumed) and user-described machines set the budgets,
the host memory checked and the rates of the estimate; the report gives each tier's bytes, what bounds the step, and
which tier runs out and by how much; bad machine arguments say what to change; the command line takes the machine."""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import pstar_fx as px
from pstar_fx import cost
from pstar_fx.api.plan import Tier, device_headroom
from pstar_fx.api.plan_cli import main
from pstar_fx.cost import GPU, H200, Bound, Lane, Machine, preset
from pstar_fx.ir import BufKind, Role
from pstar_fx.ir.graph import Precision
from pstar_fx.optim import AdamConfig
from models import CASES_BY_NAME

CHUNK = 1024
GiB = 1 << 30


@functools.lru_cache(maxsize=None)
def _case():
    base = CASES_BY_NAME["gpt_tied"]
    return base.__class__(base.name, base.build, base.loss_fn, functools.partial(base.make_batch, B=4))


def _plan(**kw):
    case = _case()
    kw = dict(dict(precision="fp32", chunk_size=CHUNK, device="cpu"), **kw)
    return px.plan(case.build_model(), case.loss_fn, *case.batch(0), **kw)


@functools.lru_cache(maxsize=None)
def _need(world: int) -> tuple[int, int]:
    """The least device budget of the case on `world` ranks, and the host bytes per rank its plan there takes."""
    need = _plan(world_size=world, device_memory=1).device_needed
    at = _plan(world_size=world, device_memory=need)
    return need, max(at.host_bytes, at.host_setup_bytes)


def _scaled(gpu: str, world: int, budget: int, host: int | str | None, per_node: int) -> Machine:
    """A preset whose GPU gives the plan `budget` bytes (the preset's rates; its memory scaled down to the case)."""
    return dataclasses.replace(preset(gpu, gpus_per_node=per_node, host_memory=host),
                               device_memory=budget + device_headroom(world))


def test_presets_are_the_measured_h200_and_an_assumed_h100():
    h200 = preset("h200", gpus_per_node=1, host_memory="1.5TB")
    assert (h200.name, h200.gpus_per_node, h200.host_memory) == ("H200", 1, 1_500_000_000_000)
    assert h200.device_memory == int(139.8 * GiB)
    rates = [f.name for f in dataclasses.fields(Machine) if f.name not in ("device_memory", "host_memory", "name",
                                                                          "gpus_per_node")]
    assert all(getattr(h200, r) == getattr(H200, r) for r in rates)       # the measured machine's rates
    h100 = preset(GPU.H100)
    assert (h100.name, h100.gpus_per_node, h100.host_memory) == ("H100", 8, None)
    assert h100.device_memory < h200.device_memory and h100.hbm_bytes < h200.hbm_bytes
    assert h100.matmul_flops == h200.matmul_flops and h100.h2d_bytes == h200.h2d_bytes
    assert preset("H200") == preset(GPU.H200)
    # px.plan(machine="h200") is the preset, with plan's own gpus_per_node and host_memory
    rep = _plan(machine="h200", gpus_per_node=1, host_memory="1TB")
    assert rep.machine == dataclasses.replace(preset("h200", gpus_per_node=1, host_memory="1TB"))
    assert rep.device_memory == h200.device_memory - device_headroom(1) and rep.device_headroom == device_headroom(1)
    assert rep.host_memory == 10**12 and rep.fits
    assert "1 x H200 (139.80 GiB) per node" in str(rep) and "less 3.20 GiB for the process" in str(rep)


@pytest.mark.parametrize("name,gpu", [("NVIDIA H100 80GB HBM3", GPU.H100), ("NVIDIA H200", GPU.H200),
                                      ("NVIDIA H100 PCIe", None), ("NVIDIA H100 NVL", None),
                                      ("NVIDIA A100-SXM4-80GB", None), ("NVIDIA GH200 480GB", None)])
def test_a_gpu_is_known_by_its_name_and_only_the_parts_a_preset_describes(name, gpu):
    assert cost.gpu_named(name) is gpu


def test_px_compile_plans_and_estimates_at_its_machines_rates(monkeypatch):
    """px.compile's passes weigh their choices at the rates api/options.resolve_machine gives (the preset of the
    GPU by name; the H200's on the CPU), and the summary names them: with a host 4,000 times slower at updates the
    placement's reasoning is the CPU's, not the copies'."""
    import pstar_fx.api.step as step_module
    from pstar_fx.api.options import resolve_machine

    assert resolve_machine(torch.device("cpu"), Precision.FP32) is H200
    case = CASES_BY_NAME["gpt_tied"]
    why = {}
    for machine in (H200, dataclasses.replace(H200, cpu_adam=1e6, cpu_adam_mixed=1e6, name="slow host")):
        monkeypatch.setattr(step_module, "resolve_machine", lambda device, prec, configs=(), m=machine: m)
        step = px.compile(case.build_model(), optimizer=px.AdamW(lr=1e-3), device_memory="300KiB")(case.loss_fn)
        step(*case.batch(0))
        summary = step.summary()
        assert summary.rates == machine.name
        why[machine.name] = " ".join(summary.choices)
        assert "1 of 7 chunks on the device" in why[machine.name]
    assert "no fewer device states tried: its step is estimated" in why["H200"]
    assert "the CPU's updates" in why["slow host"] and "the CPU's updates" not in why["H200"]


@pytest.mark.parametrize("gpu,world,per_node", [("h200", 1, 1), ("h100", 2, 8), ("h200", 4, 2)])
def test_a_preset_machine_plans_the_model_to_its_tiers(gpu, world, per_node):
    """The machine's GPU sets the budget (its memory less the process's headroom), its host memory is checked per
    node, and the plan is the one an explicit budget makes; the tiers are the plan's bytes."""
    need, host_per_rank = _need(world)
    budget = need * 13 // 10
    ranks = min(world, per_node)
    machine = _scaled(gpu, world, budget, host_per_rank * ranks * 2, per_node)
    rep = _plan(world_size=world, machine=machine)
    same = _plan(world_size=world, device_memory=budget, host_memory=machine.host_memory, gpus_per_node=per_node,
                 machine=machine)
    assert rep.device_memory == budget and str(rep.graph) == str(same.graph) and rep.cost == same.cost
    assert rep.fits and rep.shortfalls == () and rep.ranks_per_node == ranks
    assert rep.machine == dataclasses.replace(machine, gpus_per_node=ranks)
    device, host, disk = rep.tiers
    assert (device.tier, host.tier, disk.tier) == (Tier.DEVICE, Tier.HOST, Tier.DISK)
    assert (device.used, device.capacity) == (rep.peak_device, budget) and 0 < device.used <= budget
    assert (host.used, host.capacity) == (rep.host_per_node, machine.host_memory) and host.fits
    assert host.used == ranks * max(rep.host_bytes, rep.host_setup_bytes) > 0
    assert (disk.used, disk.capacity, rep.disk_per_node) == (0, None, 0)
    assert rep.step_seconds > 0 and rep.tflops > 0
    assert rep.bounded_by is cost.LANE_BOUND[rep.cost.bound]
    text = str(rep)
    for line in (f"machine: {ranks} x {machine.name}", "verdict: FITS", "disk: 0 B per node",
                 f"bound by {rep.bounded_by.value}", "TFLOP/s per GPU"):
        assert line in text, (line, text)


def test_the_machines_rates_estimate_the_step_and_say_what_bounds_it():
    """One plan (the H200's) estimated on machines whose copies or CPU updates are slower: never faster, and the
    slowed resource is what bounds the step; each machine's own plan (px.plan weighs its choices at its rates) is
    not slower at its rates than the H200's plan."""
    need, _ = _need(1)
    base = preset("h200", gpus_per_node=1)
    reports = {}
    for name, machine in (("h200", base), ("slow pcie", base.with_pcie(base.h2d_bytes / 1e5)),
                          ("slow cpu", base.with_cpu_adam(base.cpu_adam / 1e5))):
        reports[name] = _plan(device_memory=need, machine=machine)
    fast, pcie, cpu = reports["h200"], reports["slow pcie"], reports["slow cpu"]
    assert fast.h2d_bytes > 0 and fast.cost.busy[Lane.CPU] > 0
    at = {name: cost.estimate(fast.graph, reports[name].machine) for name in ("slow pcie", "slow cpu")}
    assert at["slow pcie"].bounded_by is Bound.PCIE and at["slow cpu"].bounded_by is Bound.CPU_UPDATES
    assert min(c.seconds for c in at.values()) > fast.step_seconds
    assert pcie.step_seconds <= at["slow pcie"].seconds * (1 + 1e-9)
    assert cpu.step_seconds <= at["slow cpu"].seconds * (1 + 1e-9)
    assert pcie.machine.d2h_bytes == pytest.approx(base.d2h_bytes / 1e5)
    assert cpu.machine.cpu_adam_mixed == pytest.approx(base.cpu_adam_mixed / 1e5)
    roomy = _plan(machine=base)                       # everything on the GPU: nothing crosses PCIe
    assert roomy.h2d_bytes == 0 and roomy.bounded_by in (Bound.COMPUTE, Bound.ISSUING)


def test_the_hosts_exact_mixed_update_runs_at_the_native_kernels_rate_where_it_runs():
    """Exact Adam moments in mixed precision: the CPU lane of one plan takes native_exact_speedup times as long on a
    host that updates them by torch's route; fp32 steps and compressed moments, which that kernel does not update,
    take the same time on both."""
    need, _ = _need(1)
    # (a CPU update slowed by the copies beside it would make the lane's time depend on how they overlap)
    base = dataclasses.replace(preset("h200", gpus_per_node=1), cpu_adam_under_copies=1.0)
    torch_route = dataclasses.replace(base, native_update=False)
    for precision, optimizer, ratio in (("bf16", None, base.native_exact_speedup), ("fp32", None, 1.0),
                                        ("bf16", px.AdamW(lr=1e-3, state_dtype="bf16"), 1.0)):
        rep = _plan(device_memory=need, machine=base, precision=precision, optimizer=optimizer)
        native_s, torch_s = (cost.estimate(rep.graph, m).busy[Lane.CPU] for m in (base, torch_route))
        assert native_s > 0 and torch_s == pytest.approx(native_s * ratio), (precision, optimizer)
    report = main([*GPT_ARGS, "--no-native-update"])
    assert report.machine.native_update is False
    assert "machine: 1 x H200 (139.80 GiB) per node, host memory not given, host updates by torch's route " \
           "(not the native kernel)" in str(report)
    with pytest.raises(ValueError, match="Machine.native_update must be True or False"):
        Machine(native_update=1)


def test_px_compile_estimates_torchs_host_update_where_the_native_kernels_do_not_load(monkeypatch):
    """resolve_machine: in mixed precision the rates are the torch route's where the native kernels cannot be
    loaded, and the summary says so; fp32 steps do not ask for the kernels."""
    import pstar_fx.api.options as options

    if options.native.kernels() is not None:
        assert options.resolve_machine(torch.device("cpu"), Precision.BF16).native_update is True
    monkeypatch.setattr(options.native, "kernels", lambda: None)
    assert options.resolve_machine(torch.device("cpu"), Precision.FP32) is H200
    assert options.resolve_machine(torch.device("cpu"), Precision.BF16).native_update is False
    case = CASES_BY_NAME["gpt_tied"]
    step = px.compile(case.build_model(), optimizer=px.AdamW(lr=1e-3), precision="bf16",
                      device_memory="300KiB")(case.loss_fn)
    step(*case.batch(0))
    assert step.summary().rates == "H200, host updates by torch's route (not the native kernel)"


def test_px_compile_estimates_torchs_host_update_where_adam_asks_for_the_reference_formula():
    """Adam's fused=False keeps torch.optim's formula op by op on the host (runtime/adam.py), not the native kernel:
    px.compile then plans the step at torch's route's rate, and the summary says so; fused=None keeps the kernel's."""
    import pstar_fx.api.options as options

    if options.native.kernels() is None:
        pytest.skip(f"the native kernels do not build here: {options.native.why_not()}")
    case = CASES_BY_NAME["gpt_tied"]
    rates = {}
    for fused in (None, False):
        step = px.compile(case.build_model(), optimizer=px.AdamW(lr=1e-3, fused=fused), precision="bf16",
                          device_memory="300KiB")(case.loss_fn)
        step(*case.batch(0))
        rates[fused] = step.summary().rates
    assert rates == {None: "H200", False: "H200, host updates by torch's route (not the native kernel)"}
    groups = (AdamConfig(1e-3, 0.9, 0.999, 1e-8, 0.0, True, False, None),
              AdamConfig(1e-3, 0.9, 0.999, 1e-8, 0.0, True, False, False))
    assert options.resolve_machine(torch.device("cpu"), Precision.BF16, groups[:1]).native_update is True
    assert options.resolve_machine(torch.device("cpu"), Precision.BF16, groups).native_update is False
    assert options.resolve_machine(torch.device("cpu"), Precision.FP32, groups) is H200


def test_a_model_that_does_not_fit_says_which_tier_and_by_how_much():
    need, host_per_rank = _need(2)
    # the device: 1000 bytes short per GPU (the host estimate then counts every state on the host)
    short_device = _plan(world_size=2, machine=_scaled("h200", 2, need - 1000, None, 8))
    (device,) = short_device.shortfalls
    assert device.tier is Tier.DEVICE and device.short_by == 1000 and device.used == need
    assert not short_device.fits and short_device.cost is None and short_device.bounded_by is None
    assert "verdict: DOES NOT FIT: device memory short by 1000 B per GPU" in str(short_device)
    # the host: one byte short per node of two ranks
    at = _plan(world_size=2, machine=_scaled("h100", 2, need, None, 8))
    per_node = at.host_per_node
    assert per_node == 2 * host_per_rank
    # a gradient written back before its reduce-scatter is held whole: the planner counts it so before the shard pass
    # puts the reduce-scatter in (else the sharded plan would fail the verifier's host check at per_node - 1)
    g = at.graph
    reduce_at = {g.ann[n.name].chunk: i for i, n in enumerate(g.nodes) if g.ann[n.name].role is Role.REDUCE_SCATTER}
    assert any(g.ann[n.name].role is Role.RELEASE and g.ann[n.name].buf is BufKind.GRAD and n.kwargs.get("writeback")
               and i < reduce_at[g.ann[n.name].chunk] for i, n in enumerate(g.nodes))
    short_host = _plan(world_size=2, machine=_scaled("h100", 2, need, per_node - 1, 8))
    (host,) = short_host.shortfalls
    assert host.tier is Tier.HOST and host.short_by == 1 and host.capacity == per_node - 1
    assert short_host.fits_device and not short_host.fits and short_host.step_seconds > 0
    assert "verdict: DOES NOT FIT: host memory short by 1 B per node" in str(short_host)
    # both
    both = _plan(world_size=2, machine=_scaled("h200", 2, need - 1000, 1000, 8))
    assert [t.tier for t in both.shortfalls] == [Tier.DEVICE, Tier.HOST]
    assert both.shortfalls[1].short_by == both.host_per_node - 1000 > 0


def test_bad_machine_arguments_say_what_to_change(capsys):
    with pytest.raises(ValueError, match="unknown machine 'a100': use one of 'h200', 'h100'"):
        _plan(machine="a100")
    with pytest.raises(ValueError, match="machine must be a pstar_fx.cost.Machine"):
        _plan(machine=42)
    with pytest.raises(ValueError, match="gpus_per_node must be an integer >= 1"):
        _plan(machine="h200", gpus_per_node=0)
    with pytest.raises(ValueError, match="cannot read 'lots' as a size"):
        _plan(machine="h100", host_memory="lots")
    with pytest.raises(ValueError, match="Machine.host_memory must be bytes"):
        preset("h200", host_memory=-1)
    with pytest.raises(ValueError, match="Machine.gpus_per_node must be an integer >= 1"):
        preset("h200", gpus_per_node=2.5)
    with pytest.raises(ValueError, match="Machine.h2d_bytes must be a positive finite number"):
        Machine(h2d_bytes=0)
    with pytest.raises(ValueError, match="Machine.cpu_adam_under_copies must be a positive finite number at most 1"):
        Machine(cpu_adam_under_copies=1.5)
    with pytest.raises(ValueError, match="PCIe rate must be positive"):
        H200.with_pcie(float("inf"))
    with pytest.raises(ValueError, match="CPU update rate must be positive"):
        H200.with_cpu_adam(-1)
    with pytest.raises(ValueError, match="the process needs beside the plan: give device_memory"):
        _plan(machine=dataclasses.replace(preset("h200"), device_memory=GiB))
    with pytest.raises(SystemExit):                   # argparse: not one of the presets
        main(["--layers", "1", "--d-model", "8", "--heads", "2", "--machine", "a100"])
    with pytest.raises(SystemExit) as refused:         # a usage error: exit status 2 and one line saying why
        main(["--layers", "1", "--d-model", "8", "--heads", "2", "--pcie-gbps", "0"])
    assert refused.value.code == 2 and "pstar-fx-plan: error: a PCIe rate must be positive" in capsys.readouterr().err


GPT_ARGS = ["--layers", "2", "--d-model", "64", "--heads", "4", "--seq", "32", "--vocab", "256", "--batch", "2"]


def test_command_line_plans_for_the_machine(capsys):
    rep = main([*GPT_ARGS, "--machine", "h100", "--gpus-per-node", "1", "--host-memory", "1GB", "--pcie-gbps", "10",
                "--cpu-adam-gparams", "2", "--network-gbps", "100"])
    m = rep.machine
    assert (m.name, m.gpus_per_node, m.host_memory) == ("H100", 1, 10**9)
    assert (m.h2d_bytes, m.cpu_adam, m.network_bus_bytes) == (10e9, 2e9, 100e9)
    assert rep.device_memory == preset("h100").device_memory - device_headroom(1) and rep.fits
    out = capsys.readouterr().out
    for line in ("machine: 1 x H100 (79.10 GiB) per node, 953.67 MiB of host memory per node", "disk: 0 B per node",
                 "verdict: FITS", "bound by"):
        assert line in out, (line, out)
    # without --machine: the H200's memory is the budget
    assert main(GPT_ARGS).device_memory == preset("h200").device_memory - device_headroom(1)


def test_a_large_meta_gpt_plans_on_the_preset_h200_with_a_large_host():
    """A 3.05B-parameter GPT (d=10240, the width of a 120B one) on one H200 given 16 GiB of it: most optimizer states
    live on the host, whose 1.5 TB holds them; the step time is estimated at the H200's rates."""
    from pstar_fx.models.gpt import GPT, GPTConfig, gpt_loss
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab=50304, seq=2048, layers=2, hidden=10240, heads=80))
    tokens = ((1, 2048), torch.long)
    rep = px.plan(model, gpt_loss, tokens, tokens, machine="h200", gpus_per_node=1, host_memory="1.5TB",
                  device_memory="16GiB", device="cpu")
    assert 3e9 < rep.params < 3.1e9 and rep.fits and rep.peak_device <= 16 * GiB
    assert rep.states_on_device < rep.trainable_chunks
    assert 16 * rep.params * 0.3 < rep.host_per_node < 16 * rep.params      # most of the 16 bytes per parameter
    assert rep.step_seconds > 0 and rep.bounded_by is not None
    assert all(p.is_meta for p in model.parameters())


def test_a_fused_plan_times_its_regions():
    """px.plan(fuse=True) runs the fuse pass (nothing compiled): the same chunk traffic, regions in the graph (their
    internal storages counted as workspace, within the budget), the report says how many, and the estimate charges
    them as regions; pstar-fx-plan --fuse passes it on. fuse=None (--fuse-if-faster) keeps them only where the
    estimate is faster, and says so."""
    plain, fused = _plan(device_memory="1GB"), _plan(device_memory="1GB", fuse=True)
    assert fused.fused is not None and plain.fused is None
    regions, nodes = fused.fused
    assert regions == sum(1 for n in fused.graph.nodes if fused.graph.ann[n.name].role.value == "region") > 0
    assert nodes >= 2 * regions
    assert fused.peak_device <= 1e9
    assert (fused.h2d_bytes, fused.d2h_bytes) == (plain.h2d_bytes, plain.d2h_bytes)
    assert fused.cost.flops == plain.cost.flops
    assert fused.cost.busy[Lane.COMPUTE] < plain.cost.busy[Lane.COMPUTE]   # launches saved, at least
    assert f"{regions} regions of {nodes} nodes, timed as compiled" in str(fused)
    assert "fused" not in str(plain).split("planned in")[0].split("speed")[-1]
    two = _plan(device_memory="1GB", fuse=True, world_size=2)      # after the shard pass, its collectives kept
    assert two.fused is not None and two.fused[0] > 0 and two.gathered_bytes > 0
    rep = main([*GPT_ARGS, "--device-memory", "1GB", "--fuse"])
    assert rep.fused is not None and rep.fused[0] > 0
    auto = _plan(device_memory="1GB", fuse=None, precision="bf16")   # px.compile's default on a GPU
    assert any(str(c).startswith("fuse_if_faster: ") for c in auto.graph.choices)
    kept = sum(1 for n in auto.graph.nodes if auto.graph.ann[n.name].role.value == "region")
    assert (auto.fused is not None) == (kept > 0) == auto.graph.settings.fused
    for unfused in (_plan(device_memory="1GB", fuse=None, precision="bf16", world_size=2),   # as px.compile: one
                    _plan(device_memory="1GB", fuse=None)):                                  # rank, bf16 or fp16
        assert unfused.fused is None and not any(str(c).startswith("fuse_if_faster") for c in unfused.graph.choices)
    rep = main([*GPT_ARGS, "--device-memory", "1GB", "--fuse-if-faster"])          # (the command plans bf16)
    assert any(str(c).startswith("fuse_if_faster: ") for c in rep.graph.choices)
    with pytest.raises(SystemExit):                                                  # one or the other
        main([*GPT_ARGS, "--fuse", "--fuse-if-faster"])
    with pytest.raises(ValueError, match="fuse must be True, False or None"):
        _plan(fuse="yes")


@pytest.mark.parametrize("world", [1, 2])
def test_the_placement_search_estimates_the_step_as_it_runs(world):
    """place_optimizer compares its placements by the estimate of the step as it will run: on several ranks after
    the shard pass (all-gathers of shards, host copies of shards), not one rank's view of whole chunks, whose copies
    are world times larger. The placement kept is estimated in its why line at the plan's final step time."""
    need, _ = _need(world)
    slow = dataclasses.replace(H200, matmul_flops=H200.matmul_flops / 1e4, hbm_bytes=H200.hbm_bytes / 1e4,
                               fp32_matmul_flops=H200.fp32_matmul_flops / 1e4, h2d_bytes=H200.h2d_bytes / 1e3,
                               d2h_bytes=H200.d2h_bytes / 1e3, host_node_s=1e-8)
    rep = _plan(world_size=world, device_memory=int(need * 1.3), machine=slow)
    why = [c.why for c in rep.graph.choices if c.made_by == "place_optimizer"]
    assert why[1].startswith("that placement's step is estimated"), why     # copies bound it: fewer were tried
    kept = rep.states_on_device
    assert f"{kept} kept ({rep.step_seconds:.4g} s)" in why[1], (why[1], rep.step_seconds)
