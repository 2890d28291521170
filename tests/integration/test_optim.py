"""Parameter groups, the live optimizer (`step.optimizer`), lr schedulers, and optimizer state dicts that move
between pstar-fx and eager PyTorch, all against eager torch.optim on random data."""
import copy
import math
import warnings

import pytest
import torch
import torch.nn as nn

import pstar_fx as px

from harness import rel_err, small_batches
from models import CASES_BY_NAME, assert_state_close

GPT = CASES_BY_NAME["gpt_tied"]
MLP = CASES_BY_NAME["mlp_ce"]
HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8)


def nanogpt_groups(model, weight_decay=0.1):
    """nanoGPT's configure_optimizers: decay for tensors of 2+ dimensions, none for biases and norms."""
    param_dict = {pn: p for pn, p in model.named_parameters()}
    param_dict = {pn: p for pn, p in param_dict.items() if p.requires_grad}
    decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
    nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
    return [{"params": decay_params, "weight_decay": weight_decay}, {"params": nodecay_params, "weight_decay": 0.0}]


def eager_steps(case, model, opt, steps, start=0, sched=None):
    losses = []
    for i in range(start, start + steps):
        loss = case.loss_fn(model, *case.batch(i))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def px_steps(case, step, steps, start=0, sched=None):
    losses = []
    for i in range(start, start + steps):
        losses.append(step(*case.batch(i)).item())
        if sched is not None:
            sched.step()
    return losses


def px_compile(case, model, optimizer, **kw):
    kw.setdefault("device", "cpu")
    kw.setdefault("debug", True)
    return px.compile(model, optimizer=optimizer, **kw)(case.loss_fn)


def tight_grouped(case, chunk_size=1024, slack=1.05):
    """A budget just above the least the nanoGPT-grouped layout of this case runs in."""
    model = case.build_model()
    probe = px_compile(case, model, px.AdamW(nanogpt_groups(model)), chunk_size=chunk_size)
    return int(probe.min_device_memory(*case.batch(0)) * slack)


# -- parameter groups -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tight", [False, True], ids=["unlimited", "tight"])
def test_nanogpt_configure_optimizers_groups_match_eager(tight):
    case = small_batches(GPT) if tight else GPT
    chunk_size = 1024 if tight else None
    budget = tight_grouped(case, chunk_size) if tight else None
    ref = case.build_model()
    opt = torch.optim.AdamW(nanogpt_groups(ref), **HYPER, fused=True)
    ref_losses = eager_steps(case, ref, opt, 5)

    model = case.build_model()
    step = px_compile(case, model, px.AdamW(nanogpt_groups(model), **HYPER), device_memory=budget,
                      chunk_size=chunk_size)
    losses = px_steps(case, step, 5)
    assert rel_err(losses, ref_losses) <= 1e-6, (losses, ref_losses)
    assert_state_close(step.state_dict(), ref.state_dict(), rtol=1e-6)

    g = step.graphs["scheduled"]
    decay = {n for n, p in model.named_parameters() if p.dim() >= 2}
    trainable = [c for c in g.chunks if c.group.value == "trainable"]
    assert {c.opt_group for c in trainable} == {0, 1}
    for c in trainable:   # a chunk holds parameters of one group only
        assert {p in decay for p in c.params} == {c.opt_group == 0}, (c.params, c.opt_group)
    assert g.chunks[g.param("wte.weight").chunk].opt_group == 0   # tied lm_head/wte: one parameter, decayed
    if tight:
        assert step.last_step.measured_peak <= budget


def test_group_options_default_to_the_constructors_and_adam_l2_per_group():
    """Unspecified options take the constructor's values (torch's rule); Adam's L2 decay per group."""
    def groups(m):
        return [{"params": [m.layers[0].weight, m.layers[0].bias], "lr": 3e-3, "betas": (0.8, 0.99)},
                {"params": [p for layer in list(m.layers)[1:] for p in layer.parameters()], "weight_decay": 0.05}]
    ref = MLP.build_model()
    opt = torch.optim.Adam(groups(ref), lr=1e-3, eps=1e-7, fused=True)
    ref_losses = eager_steps(MLP, ref, opt, 4)
    model = MLP.build_model()
    step = px_compile(MLP, model, px.Adam(groups(model), lr=1e-3, eps=1e-7))
    assert px_steps(MLP, step, 4) == ref_losses
    assert_state_close(step.state_dict(), ref.state_dict(), rtol=1e-6)
    pg = step.optimizer.param_groups
    assert (pg[0]["lr"], pg[0]["betas"], pg[0]["eps"]) == (3e-3, (0.8, 0.99), 1e-7)
    assert (pg[1]["lr"], pg[1]["weight_decay"], pg[1]["betas"]) == (1e-3, 0.05, (0.9, 0.999))


def test_parameter_in_no_group_is_not_updated_as_in_torch():
    """torch.optim never updates a parameter it was not given (its .grad fills, nothing reads it)."""
    def groups(m):
        return [{"params": [p for layer in list(m.layers)[1:] for p in layer.parameters()]}]
    ref = MLP.build_model()
    opt = torch.optim.AdamW(groups(ref), **HYPER, fused=True)
    ref_losses = eager_steps(MLP, ref, opt, 3)
    model = MLP.build_model()
    before = model.layers[0].weight.detach().clone()
    step = px_compile(MLP, model, px.AdamW(groups(model), **HYPER))
    assert px_steps(MLP, step, 3) == ref_losses
    sd = step.state_dict()
    assert torch.equal(sd["layers.0.weight"], before)
    assert_state_close(sd, ref.state_dict(), rtol=1e-6)
    assert "layers.0.weight" not in step.graphs["scheduled"].grad_outputs   # its gradient is not even computed


def test_group_errors_are_clear():
    model = MLP.build_model()
    other = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="not a parameter of the model"):
        px_compile(MLP, model, px.AdamW([{"params": [model.layers[0].weight]}, {"params": [other.weight]}]))
    with pytest.raises(ValueError, match="more than one parameter group"):
        px_compile(MLP, model, px.AdamW([{"params": [model.layers[0].weight]}, {"params": [model.layers[0].weight]}]))
    with pytest.raises(TypeError, match="lr=0.001"):
        px.AdamW(1e-3)
    with pytest.raises(TypeError, match="sets"):
        px.AdamW([{"params": set(model.parameters())}])
    with pytest.raises(ValueError, match="empty parameter list"):
        px.AdamW([])


def test_changing_a_groups_parameters_after_compile_is_rejected_at_the_step():
    model = MLP.build_model()
    step = px_compile(MLP, model, px.AdamW(nanogpt_groups(model)))
    step(*MLP.batch(0))
    step.optimizer.param_groups[1]["params"].append(step.optimizer.param_groups[0]["params"].pop())
    with pytest.raises(ValueError, match="parameters of the groups changed"):
        step(*MLP.batch(1))


def test_adding_a_param_group_to_a_compiled_step_is_refused_at_once():
    model = MLP.build_model()
    step = px_compile(MLP, model, px.AdamW(list(model.parameters())[1:], lr=1e-3))
    step(*MLP.batch(0))
    with pytest.raises(ValueError, match="add_param_group: .*compile a new step"):
        step.optimizer.add_param_group({"params": [next(model.parameters())], "lr": 0.1})
    assert len(step.optimizer.param_groups) == 1
    step(*MLP.batch(1))                  # nothing changed: the step runs on


def test_a_write_into_the_live_optimizers_state_is_refused_not_ignored():
    """step.optimizer.state stays empty (the states live in the chunks): a write there would be ignored by the
    update and handed out by state_dict(); it is refused (and dropped) at the next step or state_dict(). Reading an
    entry (torch's state is a defaultdict, which leaves an empty one) is fine."""
    model = MLP.build_model()
    step = px_compile(MLP, model, px.AdamW(lr=1e-3))
    step(*MLP.batch(0))
    p = next(model.parameters())
    assert step.optimizer.state[p] == {}                 # a read, as loggers do
    step(*MLP.batch(1))
    before = step.optimizer.state_dict()["state"][0]["step"]
    for call in (lambda: step(*MLP.batch(2)), step.optimizer.state_dict):
        step.optimizer.state[p] = {"step": torch.tensor(50.0)}
        with pytest.raises(ValueError, match=r"step.optimizer.state was written to.*load_state_dict"):
            call()
    assert step.optimizer.state_dict()["state"][0]["step"] == before
    step(*MLP.batch(2))


# -- the live optimizer and lr schedulers ----------------------------------------------------------------------------

def test_live_optimizer_is_a_torch_optimizer_whose_step_explains():
    model = MLP.build_model()
    step = px_compile(MLP, model, px.AdamW(lr=2e-3))
    opt = step.optimizer
    assert isinstance(opt, torch.optim.AdamW) and isinstance(opt, torch.optim.Optimizer)
    assert [p for g in opt.param_groups for p in g["params"]] == list(model.parameters())
    assert opt.param_groups[0]["lr"] == 2e-3 and "betas" in opt.defaults
    with pytest.raises(RuntimeError, match="driven by the compiled step"):
        opt.step()
    assert isinstance(px_compile(MLP, model, px.Adam()).optimizer, torch.optim.Adam)


def test_lr_set_between_steps_takes_effect_at_the_next_step_without_retrace():
    lrs = [1e-3, 5e-3, 0.0, 2e-3]
    ref = MLP.build_model()
    opt = torch.optim.AdamW(nanogpt_groups(ref), **HYPER, fused=True)
    model = MLP.build_model()
    step = px_compile(MLP, model, px.AdamW(nanogpt_groups(model), **HYPER))
    ref_losses, losses = [], []
    traced = None
    for i, lr in enumerate(lrs):
        for o in (opt, step.optimizer):
            o.param_groups[0]["lr"] = lr
            o.param_groups[1]["betas"] = (0.85, 0.95 + i / 100)
        ref_losses += eager_steps(MLP, ref, opt, 1, start=i)
        losses += px_steps(MLP, step, 1, start=i)
        traced = traced or step.graphs["traced"]
        assert step.graphs["traced"] is traced and len(step._compiler.cache) == 1   # no retrace
    assert losses == ref_losses
    assert_state_close(step.state_dict(), ref.state_dict(), rtol=1e-6)


def _warmup_cosine(it, warmup=2, total=8):
    if it < warmup:
        return (it + 1) / warmup
    return 0.1 + 0.45 * (1 + math.cos(math.pi * (it - warmup) / (total - warmup)))


SCHEDULERS = {
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, _warmup_cosine),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=[4e-3, 2e-3], total_steps=8,
                                                                base_momentum=0.8, max_momentum=0.95),
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "CosineAnnealingLR": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=8, eta_min=1e-4),
}


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_torch_lr_schedulers_drive_the_live_optimizer_like_eager(name):
    ref = GPT.build_model()
    opt = torch.optim.AdamW(nanogpt_groups(ref), **HYPER, fused=True)
    sched = SCHEDULERS[name](opt)
    ref_losses = eager_steps(GPT, ref, opt, 6, sched=sched)
    ref_lrs = [g["lr"] for g in opt.param_groups]

    model = GPT.build_model()
    step = px_compile(GPT, model, px.AdamW(nanogpt_groups(model), **HYPER))
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # e.g. "lr_scheduler.step() before optimizer.step()"
        sched = SCHEDULERS[name](step.optimizer)
        losses = px_steps(GPT, step, 6, sched=sched)
    assert [g["lr"] for g in step.optimizer.param_groups] == ref_lrs
    if name == "OneCycleLR":   # it cycles betas[0] too
        assert step.optimizer.param_groups[0]["betas"] == opt.param_groups[0]["betas"] != HYPER["betas"]
    assert rel_err(losses, ref_losses) <= 1e-6, (losses, ref_losses)
    assert_state_close(step.state_dict(), ref.state_dict(), rtol=1e-6)
    assert len(step._compiler.cache) == 1


# -- optimizer state dicts: torch's format, both ways ------------------------------------------------------------------

def _assert_same_format(ours, theirs):
    assert list(ours) == list(theirs) == ["state", "param_groups"]
    assert [g["params"] for g in ours["param_groups"]] == [g["params"] for g in theirs["param_groups"]]
    for a, b in zip(ours["param_groups"], theirs["param_groups"]):
        assert set(a) == set(b)
    assert list(ours["state"]) == list(theirs["state"])
    for i, s in theirs["state"].items():
        assert list(ours["state"][i]) == list(s)
        for k, v in s.items():
            o = ours["state"][i][k]
            assert (o.shape, o.dtype, o.device) == (v.shape, v.dtype, v.device), (i, k)


def test_state_dict_before_the_first_step_is_torchs_empty_state():
    model = GPT.build_model()
    step = px_compile(GPT, model, px.AdamW(nanogpt_groups(model), **HYPER))
    fresh = torch.optim.AdamW(nanogpt_groups(GPT.build_model()), **HYPER)
    sd = step.optimizer.state_dict()
    assert sd["state"] == {}
    _assert_same_format(sd, fresh.state_dict())


@pytest.mark.parametrize("when", ["before_first_step", "after_a_step"])
def test_eager_state_loads_into_pstar_fx_and_continues_like_eager(when):
    k = 3
    ref = GPT.build_model()
    opt = torch.optim.AdamW(nanogpt_groups(ref), **HYPER, fused=True)
    eager_steps(GPT, ref, opt, k)
    model_sd = copy.deepcopy(ref.state_dict())
    opt_sd = copy.deepcopy(opt.state_dict())
    ref_losses = eager_steps(GPT, ref, opt, 4, start=k)

    model = GPT.build_model()
    step = px_compile(GPT, model, px.AdamW(nanogpt_groups(model), lr=0.5, weight_decay=0.3))
    if when == "after_a_step":
        step(*GPT.batch(99))   # a step that the loaded state replaces
    step.load_state_dict(model_sd)
    step.optimizer.load_state_dict(opt_sd)
    assert step.optimizer.param_groups[0]["lr"] == HYPER["lr"]   # options come from the state dict, as in torch
    if when == "before_first_step":
        _assert_same_format(step.optimizer.state_dict(), opt_sd)   # kept until the store exists
    losses = px_steps(GPT, step, 4, start=k)
    assert rel_err(losses, ref_losses) <= 1e-6, (losses, ref_losses)
    assert_state_close(step.state_dict(), ref.state_dict(), rtol=1e-6)
    ours, theirs = step.optimizer.state_dict(), opt.state_dict()
    _assert_same_format(ours, theirs)
    for i, s in theirs["state"].items():
        assert ours["state"][i]["step"].item() == s["step"].item() == k + 4
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours["state"][i][key], s[key], rtol=1e-6, atol=1e-12)


def test_pstar_fx_state_loads_into_eager_and_continues_like_pstar_fx():
    k = 3
    case = small_batches(GPT)
    model = case.build_model()
    step = px_compile(case, model, px.AdamW(nanogpt_groups(model), **HYPER), device_memory=tight_grouped(case, slack=3),
                      chunk_size=1024)   # some states on the host, some on the device
    px_steps(case, step, k)
    homes = {c.state_home for c in step.graphs["scheduled"].chunks if c.state_home is not None}
    assert len(homes) == 2, homes
    opt_sd = step.optimizer.state_dict()
    model_sd = step.state_dict()
    losses = px_steps(case, step, 4, start=k)
    # the kernel pstar-fx ran (its fused=None is torch's fused kernel): an eager optimizer loading this runs it too
    assert all(g["fused"] is True for g in opt_sd["param_groups"])
    assert all(g["fused"] is None for g in step.optimizer.param_groups)    # (the live groups as given)

    ref = case.build_model()
    ref.load_state_dict(model_sd)
    opt = torch.optim.AdamW(nanogpt_groups(ref), lr=0.5)       # torch's default kernel, until the load
    opt.load_state_dict(opt_sd)
    ref_losses = eager_steps(case, ref, opt, 4, start=k)
    assert rel_err(losses, ref_losses) <= 1e-6, (losses, ref_losses)
    assert_state_close(step.state_dict(), ref.state_dict(), rtol=1e-6)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_state_is_fp32_and_round_trips_exactly(precision):
    """The moments are fp32 (as eager autocast keeps them beside fp32 parameters); a new step loaded with the
    model and optimizer state continues exactly as the uninterrupted one."""
    model = GPT.build_model()
    step = px_compile(GPT, model, px.AdamW(nanogpt_groups(model), **HYPER), precision=precision)
    px_steps(GPT, step, 3)
    model_sd, opt_sd = step.state_dict(), step.optimizer.state_dict()
    assert all(s[k].dtype == torch.float32 for s in opt_sd["state"].values() for k in ("exp_avg", "exp_avg_sq"))
    assert len(opt_sd["state"]) == sum(len(g["params"]) for g in opt_sd["param_groups"])
    again = GPT.build_model()
    resumed = px_compile(GPT, again, px.AdamW(nanogpt_groups(again), **HYPER), precision=precision)
    resumed.load_state_dict(model_sd)
    resumed.optimizer.load_state_dict(opt_sd)
    if step._scaler is not None:
        resumed._scaler.scale = step._scaler.scale
    assert px_steps(GPT, resumed, 3, start=3) == px_steps(GPT, step, 3, start=3)
    for k, v in step.state_dict().items():
        assert torch.equal(resumed.state_dict()[k], v), k


def test_loaded_state_with_unequal_steps_in_one_chunk_is_rejected_and_changes_nothing():
    model = MLP.build_model()
    step = px_compile(MLP, model, px.AdamW(**HYPER))   # one chunk holds every parameter
    px_steps(MLP, step, 2)
    before = step.optimizer.state_dict()
    bad = copy.deepcopy(before)
    bad["state"][1]["step"] = torch.tensor(7.0)
    bad["param_groups"][0]["lr"] = 0.5
    with pytest.raises(ValueError, match="different step counts"):
        step.optimizer.load_state_dict(bad)
    after = step.optimizer.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for i, s in before["state"].items():
        assert all(torch.equal(after["state"][i][k], v) for k, v in s.items())
    partial = copy.deepcopy(before)
    del partial["state"][0]
    with pytest.raises(ValueError, match="of the same pstar-fx chunk have none"):
        step.optimizer.load_state_dict(partial)


def test_state_dict_round_trip_before_the_first_step_and_an_empty_state_resets():
    model = MLP.build_model()
    step = px_compile(MLP, model, px.AdamW(**HYPER))
    px_steps(MLP, step, 2)
    fresh = torch.optim.AdamW(MLP.build_model().parameters(), **HYPER).state_dict()
    step.optimizer.load_state_dict(fresh)   # no state: moments and step counts back to zero
    assert step.optimizer.state_dict()["state"] == {}
    ref = MLP.build_model()
    ref.load_state_dict(step.state_dict())
    opt = torch.optim.AdamW(ref.parameters(), **HYPER, fused=True)
    assert px_steps(MLP, step, 2, start=2) == eager_steps(MLP, ref, opt, 2, start=2)


# -- hyperparameters are checked like torch.optim (and NaN / inf always) ------------------------------------------------

@pytest.mark.parametrize("kwargs,message", [
    (dict(lr=math.nan), "Invalid learning rate: nan"), (dict(lr=math.inf), "Invalid learning rate: inf"),
    (dict(eps=math.nan), "Invalid epsilon value: nan"), (dict(eps=math.inf), "Invalid epsilon value: inf"),
    (dict(weight_decay=math.nan), "Invalid weight_decay value: nan"),
    (dict(weight_decay=math.inf), "Invalid weight_decay value: inf"),
    (dict(betas=(math.nan, 0.9)), "Invalid beta parameter at index 0: nan"),
    (dict(betas=(0.9, math.inf)), "Invalid beta parameter at index 1: inf"),
])
def test_nan_and_inf_hyperparameters_are_rejected(kwargs, message):
    for make in (px.Adam, px.AdamW):
        with pytest.raises(ValueError, match=message):
            make(**kwargs)
    model = MLP.build_model()
    with pytest.raises(ValueError, match="parameter group 1: " + message):
        px.AdamW([{"params": [model.layers[0].weight]}, {"params": [model.layers[0].bias], **kwargs}])
    if "inf" not in message:   # torch accepts an inf lr, eps or weight_decay; pstar-fx does not
        with pytest.raises(ValueError, match=message):
            torch.optim.AdamW(model.parameters(), **kwargs)


@pytest.mark.parametrize("option,value,message", [
    ("lr", math.nan, "Invalid learning rate: nan"), ("eps", math.inf, "Invalid epsilon value: inf"),
    ("weight_decay", math.nan, "Invalid weight_decay value: nan"),
    ("betas", (0.9, math.nan), "Invalid beta parameter at index 1: nan"),
    ("lr", torch.tensor(0.1), "tensor learning rates"), ("amsgrad", True, "amsgrad"),
])
def test_bad_options_set_between_steps_are_rejected_before_anything_changes(option, value, message):
    model = MLP.build_model()
    step = px_compile(MLP, model, px.AdamW(nanogpt_groups(model), **HYPER))
    px_steps(MLP, step, 1)
    before, opt_before = step.state_dict(), step.optimizer.state_dict()
    step.optimizer.param_groups[1][option] = value
    with pytest.raises(ValueError, match=r"param_groups\[1\]: .*" + message):
        step(*MLP.batch(1))
    assert all(torch.equal(v, before[k]) for k, v in step.state_dict().items())
    after = step.optimizer.state_dict()
    for i, s in opt_before["state"].items():
        assert all(torch.equal(after["state"][i][k], v) for k, v in s.items())
    step.optimizer.param_groups[1][option] = opt_before["param_groups"][1][option]
    step(*MLP.batch(1))   # usable again once the option is fixed
