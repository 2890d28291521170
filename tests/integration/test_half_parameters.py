"""A model whose parameters are bfloat16 or float16 (a `from_pretrained(..., torch_dtype=torch.bfloat16)` model):
the step holds each one at full precision (fp32, in the chunks or as the fp32 master) and updates it there, so the
model's own half-precision tensor can only hold it rounded. Every way the values leave the step and come back must
keep the full-precision values where nothing changed them: `step.state_dict()` and checkpoints hand them out in fp32,
loading them restores them whether or not the step holds the model yet, and `sync_model()` followed by more steps
trains on as if the model had never been given back. A value the user changes in between is trained on as changed.
Each run is held to an uninterrupted run bit for bit, on random data."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pstar_fx as px

from harness import DEVICE

pytestmark = pytest.mark.cuda

STEPS, BREAK = 6, 3


class _Scaled(nn.Sequential):
    """Two layers, a 0-d trained scale (its Adam states 0-d too) and a frozen shift."""

    def __init__(self):
        super().__init__(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 3))
        self.scale = nn.Parameter(torch.tensor(1.3))
        self.shift = nn.Parameter(torch.randn(3), requires_grad=False)

    def forward(self, x):
        return super().forward(x) * self.scale + self.shift


def _model(dtype):
    torch.manual_seed(0)
    return _Scaled().to(dtype)


def _batches(dtype):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=g).to(DEVICE, dtype), torch.randint(0, 3, (6,), generator=g).to(DEVICE))
            for _ in range(STEPS)]


def _loss(model, x, y):
    return F.cross_entropy(model(x).float(), y)


def _step(dtype, precision, budget=None):
    return px.compile(_model(dtype), optimizer=px.AdamW(lr=3e-4, weight_decay=0.1), device=DEVICE,
                      precision=precision, device_memory=budget)(_loss)


def _run(dtype, precision, between=None, budget=None):
    """Losses and final full-precision values of STEPS steps; `between(step) -> step` runs after BREAK of them."""
    step = _step(dtype, precision, budget)
    batches = _batches(dtype)
    losses = [step(*b).item() for b in batches[:BREAK]]
    if between is not None:
        step = between(step)
    losses += [step(*b).item() for b in batches[BREAK:]]
    return losses, step.state_dict()


def _same(a, b):
    (la, sa), (lb, sb) = a, b
    assert la == lb
    assert sa.keys() == sb.keys() and all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)


CASES = [(torch.bfloat16, "fp32"), (torch.bfloat16, "bf16"), (torch.float16, "fp32")]


@pytest.mark.parametrize("dtype,precision", CASES)
def test_state_dict_hands_out_full_precision(dtype, precision):
    """Parameters in fp32 (what the step holds), not rounded to the model's dtype; a step moved them off its grid."""
    step = _step(dtype, precision)
    for b in _batches(dtype)[:BREAK]:
        step(*b)
    sd = step.state_dict()
    assert all(v.dtype is torch.float32 for k, v in sd.items() if k != "shift")   # (frozen: as it was given)
    assert any(not torch.equal(v, v.to(dtype).float()) for v in sd.values())


@pytest.mark.parametrize("budget,sharded", [(None, False), ("6KiB", False), (None, True)])
@pytest.mark.parametrize("dtype,precision", CASES)
def test_a_checkpoint_resumes_bit_for_bit(tmp_path, dtype, precision, budget, sharded):
    """Saved after BREAK steps (plain files, or the sharded format), loaded into a fresh step (before its first
    step: into the model, which can hold only rounded values), and trained on: the uninterrupted run's losses and
    values; the plain files hold the parameters and Adam's moments in fp32."""
    def resume(step):
        step.save(tmp_path / "ckpt", sharded=sharded)
        fresh = _step(dtype, precision, budget)
        fresh.load(tmp_path / "ckpt")
        return fresh
    _same(_run(dtype, precision, resume, budget), _run(dtype, precision, budget=budget))
    if not sharded:
        values = torch.load(tmp_path / "ckpt" / "model.pt", weights_only=True)
        states = torch.load(tmp_path / "ckpt" / "optimizer.pt", weights_only=True)["state"]
        assert all(v.dtype is torch.float32 for k, v in values.items() if k != "shift")
        assert all(s[k].dtype is torch.float32 for s in states.values() for k in ("exp_avg", "exp_avg_sq"))
        assert len(states) == 5                   # the 0-d scale's states too (the frozen shift has none)


@pytest.mark.parametrize("dtype,precision", CASES)
def test_a_checkpoint_loaded_and_saved_again_before_any_step_keeps_full_precision(tmp_path, dtype, precision):
    step = _step(dtype, precision)
    for b in _batches(dtype)[:BREAK]:
        step(*b)
    step.save(tmp_path / "a")
    fresh = _step(dtype, precision)
    fresh.load(tmp_path / "a")
    fresh.save(tmp_path / "b")
    a = torch.load(tmp_path / "a" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "b" / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("dtype,precision", CASES)
def test_sync_model_then_more_steps_trains_as_if_never_given_back(dtype, precision):
    def sync(step):
        model = step.sync_model()
        assert all(p.dtype is dtype for p in model.parameters())       # the model's own, rounded values
        full = step.state_dict()                                        # still the full-precision ones
        assert all(torch.equal(p, full[n].to(dtype)) for n, p in model.named_parameters())
        assert any(not torch.equal(full[n], p.float()) for n, p in model.named_parameters())
        return step
    _same(_run(dtype, precision, sync), _run(dtype, precision))


@pytest.mark.parametrize("dtype,precision", CASES)
def test_load_state_dict_of_its_own_state_dict_changes_nothing(dtype, precision):
    def reload(step):
        step.load_state_dict(step.state_dict())
        return step
    _same(_run(dtype, precision, reload), _run(dtype, precision))


@pytest.mark.parametrize("dtype,precision", CASES)
def test_a_parameter_edited_after_sync_model_is_trained_as_edited(dtype, precision):
    """A parameter changed in place is taken as the model holds it (the whole tensor: its version counter moved);
    every other one keeps its full values, in state_dict() before the next step and in training after it: the
    same run as one that loads those values into the step."""
    edit = torch.randn(16, generator=torch.Generator().manual_seed(5)).to(dtype)

    def in_the_model(step):
        full = step.state_dict()
        model = step.sync_model()
        with torch.no_grad():
            model[2].weight[1].copy_(edit)
        now = step.state_dict()
        assert torch.equal(now["2.weight"], model[2].weight.float())
        assert all(torch.equal(now[k], full[k]) for k in full if k != "2.weight")
        return step

    def loaded(step):
        sd = step.state_dict()
        sd["2.weight"] = sd["2.weight"].to(dtype)
        sd["2.weight"][1] = edit
        sd["2.weight"] = sd["2.weight"].float()
        step.load_state_dict(sd)
        return step
    _same(_run(dtype, precision, in_the_model), _run(dtype, precision, loaded))


@pytest.mark.parametrize("dtype,precision", CASES)
def test_a_write_through_data_after_sync_model_is_taken_elementwise(dtype, precision):
    """`.data` writes keep the version counter: the values tell, element by element (the row written is taken, the
    rest keeps its full values)."""
    edit = torch.randn(16, generator=torch.Generator().manual_seed(5)).to(dtype)

    def through_data(step):
        step.sync_model()[2].weight.data[1] = edit
        return step

    def loaded(step):
        sd = step.state_dict()
        sd["2.weight"][1] = edit.float()
        step.load_state_dict(sd)
        return step
    _same(_run(dtype, precision, through_data), _run(dtype, precision, loaded))


def _frozen_lr(step):
    """The step's values stay as they are at its next step (what it took is what it holds after)."""
    for g in step.optimizer.param_groups:
        g["lr"] = 0.0
    return step


@pytest.mark.parametrize("dtype,precision", CASES)
def test_values_loaded_into_the_model_after_sync_model_replace_the_full_ones(dtype, precision):
    """A state dict in the model's own dtype, loaded after sync_model() (into the model, through the step or
    eagerly), is what the step trains from: none of its elements falls back to the old full-precision values,
    however many of them round to the same half-precision value."""
    batches = _batches(dtype)
    for how in ("step", "eager"):
        step = _step(dtype, precision)
        for b in batches[:BREAK]:
            step(*b)
        other = {k: (v + 1e-3 * torch.randn_like(v)).to(dtype) for k, v in step.state_dict().items()}
        model = step.sync_model()
        step.load_state_dict(other) if how == "step" else model.load_state_dict(other)
        assert all(torch.equal(v, other[k].float()) for k, v in step.state_dict().items())
        _frozen_lr(step)(*batches[BREAK])
        assert all(torch.equal(v, other[k].float()) for k, v in step.state_dict().items()), how


@pytest.mark.parametrize("dtype,precision", CASES)
def test_a_step_taking_the_model_back_from_another_takes_that_ones_values(dtype, precision):
    """Two training steps on one model: each takes the other's values as the model holds them, never its own older
    full-precision ones (given back or loaded), which the other step's training made stale."""
    batches = _batches(dtype)
    for loads in (False, True):
        a = _step(dtype, precision)
        model = a._model
        b = px.compile(model, optimizer=px.AdamW(lr=1e-2), device=DEVICE, precision=precision)(_loss)
        a(*batches[0])
        if loads:
            sd = a.state_dict()
            a.sync_model()
            a.load_state_dict(sd)                 # full values, into the model (no step holds it)
        for x in batches[1:3]:
            b(*x)
        trained = b.state_dict()
        _frozen_lr(a)(*batches[3])
        assert all(torch.equal(v, trained[k].to(dtype).float()) for k, v in a.state_dict().items()), loads


@pytest.mark.parametrize("dtype,precision", CASES)
def test_a_checkpoint_saved_after_an_evaluation_took_the_model_resumes_as_the_step_goes_on(tmp_path, dtype,
                                                                                        precision):
    """sync_model(), then an evaluation step takes the model (into chunks of its own, as the model holds it), then
    the training step saves: the checkpoint holds what the training step goes on from."""
    batches = _batches(dtype)
    step = _step(dtype, precision)
    for b in batches[:BREAK]:
        step(*b)
    model = step.sync_model()
    px.compile(model, optimizer=None, device=DEVICE, precision=precision)(_loss)(*batches[0])
    step.save(tmp_path / "ckpt")
    fresh = _step(dtype, precision)
    fresh.load(tmp_path / "ckpt")
    assert [step(*b).item() for b in batches[BREAK:]] == [fresh(*b).item() for b in batches[BREAK:]]
    _same(([], step.state_dict()), ([], fresh.state_dict()))


@pytest.mark.parametrize("dtype,precision", CASES)
def test_a_checkpoint_saved_while_another_step_holds_the_model_resumes_as_the_step_goes_on(tmp_path, dtype,
                                                                                          precision):
    """Another training step (on the whole model, or on a part of it) took the model and trained it: this step
    would take its values as the model holds them, so its state_dict() and checkpoint hold those."""
    batches = _batches(dtype)
    for part in (False, True):
        step = _step(dtype, precision)
        model = step._model
        for b in batches[:BREAK]:
            step(*b)
        other = px.compile(model[0] if part else model, optimizer=px.AdamW(lr=1e-2), device=DEVICE,
                           precision=precision)(lambda m, x: m(x).float().square().mean() if part else _loss(m, *x))
        other(batches[0][0]) if part else other(batches[0])
        step.save(tmp_path / f"ckpt{part}")
        fresh = _step(dtype, precision)
        fresh.load(tmp_path / f"ckpt{part}")
        assert [step(*b).item() for b in batches[BREAK:]] == [fresh(*b).item() for b in batches[BREAK:]], part
        _same(([], step.state_dict()), ([], fresh.state_dict()))


@pytest.mark.parametrize("dtype,precision", CASES)
def test_a_float64_state_dict_loaded_before_the_first_step_is_held_in_fp32(tmp_path, dtype, precision):
    step = _step(dtype, precision)
    wide = {k: v.double() + 1e-4 for k, v in _model(dtype).state_dict().items()}
    step.load_state_dict(wide)
    before = step.state_dict()
    assert all(v.dtype is torch.float32 and torch.equal(v, wide[k].float()) for k, v in before.items())
    step.save(tmp_path / "ckpt")
    fresh = _step(dtype, precision)
    fresh.load(tmp_path / "ckpt")
    batches = _batches(dtype)
    assert [step(*b).item() for b in batches] == [fresh(*b).item() for b in batches]


@pytest.mark.parametrize("dtype,precision", CASES)
def test_a_frozen_parameter_keeps_the_full_values_loaded_into_the_step_across_sync_model(dtype, precision):
    step = _step(dtype, precision)
    batches = _batches(dtype)
    step(*batches[0])
    full = {k: v.float() + 1e-3 for k, v in step.state_dict().items()}     # off the half-precision grid
    step.load_state_dict(full)
    step.sync_model()
    step(*batches[1])
    assert torch.equal(step.state_dict()["shift"], full["shift"])
