"""Optimizers other than Adam: px.SGD, px.Lion and torch's elementwise optimizers through px.optim_from_torch, each
against eager torch.optim on random data (fp32, 1e-6), with states on the device and on the host; the plan's state
bytes; checkpoints; and the clear errors for optimizers that cannot run on flat chunks. Under PSTAR_TEST_DEVICE=cuda
the training test runs on the GPU (each optimizer's device update; the host-placed chunks' updates on the CPU)."""
import functools
import os

import pytest
import torch
import torch.nn as nn

import pstar_fx as px
from pstar_fx.api.live_optimizer import build
from pstar_fx.ir import StateHome
from pstar_fx.ir.needs import state_bytes, state_layout
from pstar_fx.optim import probe
from pstar_fx.runtime.optimizers import host_update

from harness import DEVICE, fetch_counts, host_params, rel_err
from models import CASES_BY_NAME, assert_state_close

CASE = CASES_BY_NAME["mlp_ce"]
CHUNK = 1024
STEPS = 7            # RAdam's rectified update starts at its sixth step

# name -> (px description, eager torch class, options)
OPTIMIZERS = {
    "sgd_momentum": (px.SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    "sgd_nesterov": (px.SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.8, nesterov=True, maximize=False)),
    "sgd_plain": (px.SGD, torch.optim.SGD, dict(lr=0.1, weight_decay=0.01)),
    "adagrad": (None, torch.optim.Adagrad, dict(lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1,
                                                weight_decay=0.01)),
    "rmsprop": (None, torch.optim.RMSprop, dict(lr=0.01, alpha=0.9, momentum=0.5, centered=True, weight_decay=0.01)),
    "adamax": (None, torch.optim.Adamax, dict(lr=0.01, betas=(0.8, 0.99), weight_decay=0.01)),
    "nadam": (None, torch.optim.NAdam, dict(lr=0.01, momentum_decay=0.004, weight_decay=0.01,
                                            decoupled_weight_decay=True)),
    "radam": (None, torch.optim.RAdam, dict(lr=0.01, weight_decay=0.01)),
    "lion": (px.Lion, px.LionOptimizer, dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)),
}


def describe(name, params=None, **override):
    make, cls, opts = OPTIMIZERS[name]
    opts = {**opts, **override}
    return make(params, **opts) if make is not None else px.optim_from_torch(cls, params, **opts)


def compiled(name, budget=None, device="cpu", **kw):
    model = CASE.build_model()
    kw.setdefault("chunk_size", CHUNK)
    kw.setdefault("precision", "fp32")           # (px.compile's default on CUDA is bf16)
    return px.compile(model, optimizer=describe(name), device=device, device_memory=budget, debug=True,
                      **kw)(CASE.loss_fn)


class EagerSplit:
    """The eager torch optimizer `cls` over the model on `device`, the parameters named in `host` updated on the CPU
    on copies (as pstar-fx does for chunks whose states it placed on the host: on a GPU, torch's CPU and CUDA kernels
    may round differently). state_dict() as one optimizer over model.parameters() would give it (states on the CPU)."""

    def __init__(self, model, cls, opts, host=()):
        self.order = list(model.named_parameters())
        self.copies = {n: p.detach().cpu().clone() for n, p in self.order if n in host}
        device = [p for n, p in self.order if n not in host]
        self.opts = [cls(ps, **opts) for ps in (device, list(self.copies.values())) if ps]

    def step(self):
        for n, p in self.order:
            if n in self.copies:
                self.copies[n].grad = p.grad.cpu()
        for opt in self.opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for n, p in self.order:
                if n in self.copies:
                    p.copy_(self.copies[n])
                    p.grad = None

    def state_dict(self):
        if not self.copies:
            return self.opts[0].state_dict()
        state = {}
        for i, (n, p) in enumerate(self.order):
            held = self.copies.get(n, p)
            for opt in self.opts:
                if held in opt.state:
                    state[i] = {k: torch.as_tensor(v).cpu() if torch.is_tensor(v) else v
                                for k, v in opt.state[held].items()}
        group = {k: v for k, v in self.opts[0].state_dict()["param_groups"][0].items() if k != "params"}
        return {"state": state, "param_groups": [{**group, "params": list(range(len(self.order)))}]}


def eager(name, steps, host=(), device="cpu"):
    """`steps` steps of the eager optimizer on `device`, the parameters named in `host` updated on the CPU."""
    _, cls, opts = OPTIMIZERS[name]
    model = CASE.build_model().to(device)
    opt = EagerSplit(model, cls, opts, host)
    losses = []
    for i in range(steps):
        loss = CASE.loss_fn(model, *[x.to(device) for x in CASE.batch(i)])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict(), opt


@functools.lru_cache(maxsize=None)
def tight_on(device: str, name: str = "sgd_plain", accumulate: int = 1) -> int:
    """A budget just above the least the case runs in on `device` with optimizer `name`: most chunks are evicted and
    most states live on the host."""
    probe_step = compiled(name, accumulate=accumulate, device=device)
    return int(probe_step.min_device_memory(*CASE.batch(0)) * 1.05)


@pytest.fixture(scope="module")
def tight():
    """The CPU's tight budget for the tests on the CPU, probed with two micro-batches, the most any of them asks for
    (a later micro-batch's gradient is made before it is added into its chunk; the first one's is computed in the
    chunk)."""
    return tight_on("cpu", accumulate=2)


def assert_optimizer_state_close(step, opt):
    mine, theirs = step.optimizer.state_dict(), opt.state_dict()
    assert mine["state"].keys() == theirs["state"].keys()
    for i, s in theirs["state"].items():
        assert mine["state"][i].keys() == s.keys(), (mine["state"][i].keys(), s.keys())
        for k, v in s.items():
            assert_state_close({k: mine["state"][i][k]}, {k: v}, rtol=1e-6)
    assert [{k: v for k, v in g.items() if k != "params"} for g in mine["param_groups"]] == \
        [{k: v for k, v in g.items() if k != "params"} for g in theirs["param_groups"]]


@pytest.mark.cuda
@pytest.mark.parametrize("placement", ["device", "host"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_each_optimizer_trains_as_eager(name, placement):
    """On DEVICE (the GPU under PSTAR_TEST_DEVICE=cuda): states on the device, or most on the host (updated by the
    CPU, as the eager reference does for those parameters)."""
    budget = tight_on(DEVICE, name) if placement == "host" else None
    step = compiled(name, budget, device=DEVICE)
    losses = [step(*CASE.batch(i)).item() for i in range(STEPS)]
    ref_losses, ref_sd, opt = eager(name, STEPS, host_params(step), device=DEVICE)
    g = step.graphs["scheduled"]
    homes = {c.state_home for c in g.chunks if c.state_home is not None}
    if placement == "host":
        assert StateHome.HOST in homes and max(fetch_counts(g).values()) >= 2
        assert step.last_step.measured_peak <= budget
    else:
        assert homes == {StateHome.DEVICE}
    assert rel_err(losses, ref_losses) <= 1e-6, (losses, ref_losses)
    assert_state_close(step.state_dict(), ref_sd, rtol=1e-6)
    assert_optimizer_state_close(step, opt)


def test_sgd_without_momentum_plans_no_state_bytes_and_keeps_no_state():
    step = compiled("sgd_plain")
    step(*CASE.batch(0))
    g = step.graphs["scheduled"]
    layout = state_layout(g.settings)
    trainable = [c for c in g.chunks if c.state_home is not None]
    assert trainable and all(state_bytes(c, g.settings.precision, 1, layout) == 0 for c in trainable)
    assert step.summary().model_data_bytes == sum(c.nbytes for c in g.chunks) + sum(
        c.nbytes for c in trainable if not c.grad_inplace)
    assert step.optimizer.state_dict()["state"] == {}
    bf16 = compiled("sgd_plain", precision="bf16")
    bf16(*CASE.batch(0))
    gb = bf16.graphs["scheduled"]
    assert all(state_bytes(c, gb.settings.precision, 1, layout) == c.capacity * 4      # the fp32 master only
               for c in gb.chunks if c.state_home is not None)
    momentum = compiled("sgd_momentum")
    momentum(*CASE.batch(0))
    gm = momentum.graphs["scheduled"]
    assert all(state_bytes(c, gm.settings.precision, 1, state_layout(gm.settings)) == c.capacity * 4 + 4
               for c in gm.chunks if c.state_home is not None)


def _groups(model, lr):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.05}, {"params": rest, "weight_decay": 0.0, "lr": lr / 2}]


@pytest.mark.parametrize("name", ["sgd_momentum", "rmsprop"])
def test_groups_lr_changes_clipping_and_accumulation_as_eager(name, tight):
    """Two groups, lr set through step.optimizer between steps, clipping by global norm, two micro-batches."""
    lr = OPTIMIZERS[name][2]["lr"]
    model = CASE.build_model()
    step = px.compile(model, optimizer=describe(name, _groups(model, lr)), device="cpu", device_memory=tight,
                      chunk_size=CHUNK, max_grad_norm=0.05, accumulate=2, debug=True)(CASE.loss_fn)
    ref = CASE.build_model()
    opt = OPTIMIZERS[name][1](_groups(ref, lr), **OPTIMIZERS[name][2])
    losses, ref_losses = [], []
    for i in range(4):
        for o in (step.optimizer, opt):
            o.param_groups[0]["lr"] = lr * (1 + i) / 4
        x, y = CASE.batch(i)
        losses.append(step(x, y).item())
        total = 0.0
        for half in (slice(0, len(x) // 2), slice(len(x) // 2, None)):
            loss = CASE.loss_fn(ref, x[half], y[half]) / 2
            loss.backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        assert norm > 0.05            # clipping changes the update
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_losses.append(total)
    assert rel_err(losses, ref_losses) <= 1e-6, (losses, ref_losses)
    assert_state_close(step.state_dict(), ref.state_dict(), rtol=1e-6)
    assert_optimizer_state_close(step, opt)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ["sgd_momentum", "nadam"])
def test_host_device_and_early_updates_agree_bit_for_bit(name, precision, tight):
    """The same steps with every state on the device, on the host (atomic and atomic=False): the same values, bit
    for bit; in bf16 the masters and the states are fp32."""
    runs = []
    for budget, atomic in ((None, True), (tight * 2, True), (tight * 2, False)):
        step = compiled(name, budget, precision=precision, atomic=atomic)
        losses = torch.stack([step(*CASE.batch(i)) for i in range(3)])
        runs.append((losses, step.state_dict(), step.optimizer.state_dict()["state"]))
        if budget is not None:
            assert StateHome.HOST in {c.state_home for c in step.graphs["scheduled"].chunks}
    first = runs[0]
    assert first[0][-1] < first[0][0]
    assert all(v.dtype == torch.float32 for s in first[2].values() for v in s.values())
    for losses, sd, state in runs[1:]:
        assert torch.equal(losses, first[0])
        assert all(torch.equal(sd[k], v) for k, v in first[1].items())
        assert all(torch.equal(state[i][k], v) for i, s in first[2].items() for k, v in s.items())


@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "sharded"])
@pytest.mark.parametrize("name", ["sgd_momentum", "nadam", "adagrad", "lion", "rmsprop"])
def test_checkpoint_round_trip_continues_bit_for_bit(name, sharded, tmp_path, tight):
    """Saved after 2 steps in either format (sharded: torch.distributed.checkpoint's, each state under torch's key,
    0-d ones such as NAdam's mu_product too), loaded into a new step before its first call and after step.lower
    (into its chunks): the next 2 steps, the values and the optimizer's states bit for bit as the run's own."""
    step = compiled(name, tight)
    for i in range(2):
        step(*CASE.batch(i))
    path = os.path.join(tmp_path, "ckpt")
    step.save(path, sharded=sharded)
    assert os.path.exists(os.path.join(path, ".metadata")) == sharded
    after = [step(*CASE.batch(i)).item() for i in range(2, 4)]
    for lowered in (False, True):
        resumed = compiled(name, tight)
        if lowered:
            resumed.lower(*CASE.batch(2))
        resumed.load(path)
        assert [resumed(*CASE.batch(i)).item() for i in range(2, 4)] == after
        sd, rsd = step.state_dict(), resumed.state_dict()
        assert all(torch.equal(v, rsd[k]) for k, v in sd.items())
        state, rstate = step.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
        assert state.keys() == rstate.keys() and all(
            rstate[i].keys() == s.keys() and all(torch.equal(v, rstate[i][k]) for k, v in s.items())
            for i, s in state.items())
    # a checkpoint of one optimizer does not load into a step with another
    other = compiled("rmsprop" if name != "rmsprop" else "adamax", tight)
    with pytest.raises(px.CheckpointError, match="another optimizer"):
        other.load(path)
    adam = px.compile(CASE.build_model(), optimizer=px.AdamW(lr=1e-3), device="cpu", chunk_size=CHUNK)(CASE.loss_fn)
    with pytest.raises(px.CheckpointError):
        adam.load(path)


def _round_trip(make, batch, tmp_path, steps=2):
    """`make()`'s step trained `steps` steps, saved in both formats, then 2 more; each checkpoint loaded into a new
    step before its first call and after step.lower: the optimizer's state dict right after the load is the one at
    the save, and the next 2 losses are the uninterrupted run's, bit for bit."""
    step = make()
    for i in range(steps):
        step(*batch(i))
    saved = step.optimizer.state_dict()["state"]
    for sharded in (False, True):
        step.save(os.path.join(tmp_path, f"ckpt-{sharded}"), sharded=sharded)
    after = [step(*batch(i)).item() for i in range(steps, steps + 2)]
    for sharded in (False, True):
        for lowered in (False, True):
            resumed = make()
            if lowered:
                resumed.lower(*batch(steps))
            resumed.load(os.path.join(tmp_path, f"ckpt-{sharded}"))
            state = resumed.optimizer.state_dict()["state"]
            assert state.keys() == saved.keys(), (sharded, lowered)
            for i, s in saved.items():
                assert state[i].keys() == s.keys() and all(torch.equal(state[i][k], v) for k, v in s.items()), \
                    (sharded, lowered, i, {k: (v, state[i].get(k)) for k, v in s.items() if v.dim() == 0})
            assert [resumed(*batch(i)).item() for i in range(steps, steps + 2)] == after, (sharded, lowered)


def test_0d_states_of_a_half_precision_model_load_exactly(tmp_path):
    """A bf16 model's fp32 states come back fp32 from either format and either load: NAdam's 0-d mu_product too
    (torch's load_state_dict casts every state but 'step' to the parameter's dtype)."""
    def make():
        model = CASE.build_model().to(torch.bfloat16)
        return px.compile(model, optimizer=describe("nadam"), device="cpu", chunk_size=CHUNK,
                          precision="bf16")(CASE.loss_fn)

    def batch(i):
        return tuple(t.to(torch.bfloat16) if t.is_floating_point() else t for t in CASE.batch(i))
    _round_trip(make, batch, tmp_path, steps=3)


def test_a_group_that_keeps_no_state_round_trips_in_both_formats(tmp_path, tight):
    """SGD with momentum in one group and none in the other: the second group's parameters have stepped with no
    state (torch's empty state in the plain format, the chunks' step counter in the sharded one)."""
    def make():
        model = CASE.build_model()
        groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "momentum": 0.9},
                  {"params": [p for p in model.parameters() if p.dim() < 2], "momentum": 0.0}]
        return px.compile(model, optimizer=px.SGD(groups, lr=0.05), device="cpu", chunk_size=CHUNK,
                          device_memory=tight)(CASE.loss_fn)
    _round_trip(make, CASE.batch, tmp_path)


def test_a_checkpoint_with_states_the_step_has_no_room_for_names_them(tmp_path):
    step = compiled("sgd_momentum")
    step(*CASE.batch(0))
    step.save(os.path.join(tmp_path, "ckpt"), sharded=True)
    plain = compiled("sgd_plain")
    with pytest.raises(px.CheckpointError, match=r"optimizer states \['momentum_buffer'\] that this step's SGD has no "
                                                 r"room for .*momentum > 0"):
        plain.load(os.path.join(tmp_path, "ckpt"))


def test_eager_state_loads_and_continues_like_eager():
    losses, _, opt = eager("rmsprop", 2)
    step = compiled("rmsprop")
    step.load_state_dict(eager_model_after("rmsprop", 2))
    step.optimizer.load_state_dict(opt.state_dict())
    ref_losses, _, _ = eager("rmsprop", 4)
    assert rel_err([step(*CASE.batch(i)).item() for i in range(2, 4)], ref_losses[2:]) <= 1e-6


def eager_model_after(name, steps):
    return eager(name, steps)[1]


@pytest.mark.parametrize("cls, why", [(torch.optim.Adafactor, "factored"), (torch.optim.Muon, "orthogonalises"),
                                      (torch.optim.LBFGS, "closure"), (torch.optim.SparseAdam, "sparse")])
def test_non_elementwise_torch_optimizers_are_refused_with_the_reason(cls, why):
    with pytest.raises(ValueError, match=why) as e:
        px.optim_from_torch(cls, lr=0.01)
    assert "flat, elementwise slices" in str(e.value) and "px.AdamW" in str(e.value)


class PerTensorNorm(torch.optim.Optimizer):
    """A LAMB-like update scaled by each tensor's norm: not elementwise."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                p.add_(p.grad / (p.grad.norm() + 1e-6), alpha=-g["lr"])


def _named_groups(model):
    """named_parameters() groups with a user's key: torch adds 'param_names', a scheduler 'initial_lr' and more."""
    named = list(model.named_parameters())
    return [{"params": [(n, p) for n, p in named if p.dim() >= 2], "name": "decay"},
            {"params": [(n, p) for n, p in named if p.dim() < 2], "name": "rest", "weight_decay": 0.0}]


@pytest.mark.parametrize("sched", ["StepLR", "OneCycleLR"])
@pytest.mark.parametrize("name", ["sgd_momentum", "lion", "adagrad"])
def test_schedulers_and_groups_keys_the_update_never_reads_work_as_in_torch(name, sched):
    """Keys torch's constructors do not take (a scheduler's initial_lr and max_lr, param_names, a user's 'name')
    ride along in the groups, as in torch, and never reach the update."""
    def make_sched(o):
        if sched == "StepLR":
            return torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)
        return torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.02, total_steps=8,
                                                   cycle_momentum=name == "sgd_momentum")
    model = CASE.build_model()
    step = px.compile(model, optimizer=describe(name, _named_groups(model)), device="cpu", chunk_size=CHUNK,
                      debug=True)(CASE.loss_fn)
    schedule = make_sched(step.optimizer)
    ref = CASE.build_model()
    opt = OPTIMIZERS[name][1](_named_groups(ref), **OPTIMIZERS[name][2])
    ref_schedule = make_sched(opt)
    losses, ref_losses = [], []
    for i in range(4):
        losses.append(step(*CASE.batch(i)).item())
        schedule.step()
        loss = CASE.loss_fn(ref, *CASE.batch(i))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_schedule.step()
        ref_losses.append(loss.item())
    assert "initial_lr" in step.optimizer.param_groups[0] and step.optimizer.param_groups[1]["name"] == "rest"
    assert step.optimizer.param_groups[1]["param_names"] == opt.param_groups[1]["param_names"]
    assert [g["lr"] for g in step.optimizer.param_groups] == [g["lr"] for g in opt.param_groups]
    assert rel_err(losses, ref_losses) <= 1e-6, (losses, ref_losses)
    assert_state_close(step.state_dict(), ref.state_dict(), rtol=1e-6)


def test_adam_with_decoupled_weight_decay_is_adamw_and_another_optimizers_state_is_refused_by_name():
    spec = px.optim_from_torch(torch.optim.Adam, lr=1e-3, weight_decay=0.1, decoupled_weight_decay=True)
    assert spec.is_adam and spec.decoupled
    assert not px.optim_from_torch(torch.optim.Adam, lr=1e-3, decoupled_weight_decay=False).decoupled
    step = px.compile(CASE.build_model(), optimizer=px.AdamW(lr=1e-3), device="cpu")(CASE.loss_fn)
    step(*CASE.batch(0))
    model = CASE.build_model()
    adagrad = torch.optim.Adagrad(model.parameters(), lr=0.1)
    CASE.loss_fn(model, *CASE.batch(0)).backward()
    adagrad.step()
    sgd = px.compile(CASE.build_model(), optimizer=px.SGD(lr=0.1, momentum=0.9), device="cpu")(CASE.loss_fn)
    sgd(*CASE.batch(0))
    before = step.optimizer.state_dict()
    for other in (adagrad.state_dict(), sgd.optimizer.state_dict()):
        refused = (r"load_state_dict: the state dict: param_groups\[0\] has the options \[.*\], "
                   r"torch.optim.AdamW's are \[.*'betas'.*saved from another optimizer")
        with pytest.raises(ValueError, match=refused):
            step.optimizer.load_state_dict(other)
        after = step.optimizer.state_dict()            # checked before anything was applied: nothing changed
        assert after["param_groups"] == before["param_groups"]
        assert all(torch.equal(v, after["state"][i][k]) for i, s in before["state"].items() for k, v in s.items())
    step(*CASE.batch(1))


def test_an_update_that_reads_whole_tensors_is_detected():
    with pytest.raises(ValueError, match="not elementwise"):
        px.optim_from_torch(PerTensorNorm, lr=0.01)


def test_torch_optimizer_objects_and_classes_get_their_px_equivalent():
    model = CASE.build_model()
    with pytest.raises(TypeError, match=r"AdamW object; pass px\.AdamW\(lr="):
        px.compile(model, optimizer=torch.optim.AdamW(model.parameters()))(CASE.loss_fn)
    with pytest.raises(TypeError, match=r"px\.SGD\(lr="):
        px.compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))(CASE.loss_fn)
    with pytest.raises(TypeError, match=r"px\.optim_from_torch\(torch\.optim\.rmsprop\.RMSprop"):
        px.compile(model, optimizer=torch.optim.RMSprop)(CASE.loss_fn)
    with pytest.raises(TypeError, match="optimizer class"):
        px.optim_from_torch(torch.optim.SGD(model.parameters(), lr=0.1))
    assert px.optim_from_torch(torch.optim.AdamW, lr=1e-3).is_adam      # Adam keeps its fused kernels


def test_options_are_checked_at_compile_and_at_every_step():
    with pytest.raises(ValueError, match="Invalid learning rate"):
        px.SGD(lr=-1.0)
    with pytest.raises(ValueError, match="foreach=True"):
        px.optim_from_torch(torch.optim.RMSprop, lr=0.01, foreach=True)
    with pytest.raises(ValueError, match="finite"):
        px.optim_from_torch(torch.optim.Adagrad, lr=float("nan"))
    step = compiled("sgd_plain")
    step(*CASE.batch(0))
    step.optimizer.param_groups[0]["momentum"] = 0.9      # needs a momentum buffer the chunks have no room for
    before = step.state_dict()
    with pytest.raises(ValueError, match="momentum_buffer"):
        step(*CASE.batch(1))
    assert all(torch.equal(v, step.state_dict()[k]) for k, v in before.items())
    with pytest.raises(RuntimeError, match="driven by the compiled step"):
        step.optimizer.step()


def test_probe_tells_the_states_of_each_option_set():
    assert probe(torch.optim.SGD, dict(lr=0.1), "t") == ((), ())
    assert probe(torch.optim.SGD, dict(lr=0.1, momentum=0.9), "t") == (("momentum_buffer",), ())
    assert probe(torch.optim.NAdam, dict(lr=0.1), "t") == (("exp_avg", "exp_avg_sq"), ("step", "mu_product"))
    assert probe(torch.optim.RMSprop, dict(lr=0.1, centered=True), "t") == (("square_avg", "grad_avg"), ("step",))


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("name", ["nadam", "sgd_momentum", "adagrad"])
def test_host_update_in_blocks_equals_one_pass(name, mixed):
    """The general route's blocks (each over the same starting 0-d states) give one pass's values, at the first step
    (torch makes the states) and at later ones."""
    model = nn.Linear(1, 1)
    spec = describe(name, [model.weight])
    cfg = build(spec, model).configs()[0]
    n = 5 * 4096 + 123
    gen = torch.Generator().manual_seed(0)
    master = torch.randn(n, generator=gen)
    buffers = {}
    for block in (n, 4096):
        state = torch.zeros(spec.state.floats(n, mixed))
        parts = spec.state.parts(state, n, mixed)
        param = master.clone()
        if mixed:
            parts["master"].copy_(master)
            param = master.to(torch.bfloat16)
        for i in range(3):
            grad = torch.randn(n, generator=torch.Generator().manual_seed(i))
            grad = grad.to(param.dtype)
            host_update(cfg, param, grad, parts, master=parts["master"] if mixed else None,
                        inv_scale=0.5 if mixed else None, coef=torch.tensor(0.37), skip=False, block=block)
        buffers[block] = (param, state)
    assert torch.equal(buffers[n][0], buffers[4096][0]) and torch.equal(buffers[n][1], buffers[4096][1])
    assert not torch.equal(buffers[n][0].float(), master)


@pytest.mark.parametrize("cls", [torch.optim.Adagrad, torch.optim.SGD])
def test_a_second_compile_over_a_held_model_takes_it_with_an_optimizer_whose_constructor_reads_parameters(cls):
    """torch.optim.Adagrad's constructor makes its sums with full_like(p): the live optimizer is built on shape-only
    stand-ins, so a second px.compile of a model the first step holds takes it (from the trained values) as with
    any other optimizer, and trains on."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x, y = torch.randn(8, 4), torch.randn(8, 3)

    def loss(m, x, y):
        return nn.functional.mse_loss(m(x), y)
    first = px.compile(model, optimizer=px.AdamW(lr=1e-2), device="cpu")(loss)
    first(x, y)
    trained = first.state_dict()
    second = px.compile(model, optimizer=px.optim_from_torch(cls, lr=1e-2), device="cpu")(loss)
    ref = nn.Linear(4, 3)
    ref.load_state_dict(trained)
    opt = cls(ref.parameters(), lr=1e-2)
    got = second(x, y)
    want = loss(ref, x, y)
    want.backward()
    opt.step()
    assert rel_err([got.item()], [want.item()]) <= 1e-6
    assert_state_close(second.state_dict(), ref.state_dict(), rtol=1e-6)
    assert all(p.device.type != "meta" for g in second.optimizer.param_groups for p in g["params"])
