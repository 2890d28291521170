"""The model's values are never lost and never another model's.

Whatever holds a model gives its values back when it is dropped or collected: a training function that returns the
model without sync_model(), a notebook cell that compiles again, a throwaway evaluation step, a Ctrl-C unwinding the
training loop. And state_dict() / save() / sync_model() return this step's model, every key, each value from
whichever step holds that tensor now: steps on a model and on one of its blocks, steps on two models sharing a tensor.
"""
import gc
import signal

import pytest
import torch
import torch.nn as nn

import pstar_fx as px
from pstar_fx.ir import Role

from harness import HYPER, eager_run
from models import CASES_BY_NAME, assert_state_close

CASE = CASES_BY_NAME["cnn_bn"]          # parameters and BatchNorm buffers (mutated every step)


def _compile(model, **kw):
    return px.compile(model, optimizer=px.AdamW(**HYPER), device="cpu", **kw)(CASE.loss_fn)


def _train(model, steps: int, **kw):
    """A training function that returns the model and forgets to call sync_model()."""
    step = _compile(model, **kw)
    for i in range(steps):
        step(*CASE.batch(i))
    return model


def _assert_usable_with(model, want: dict) -> None:
    assert_state_close(model.state_dict(), want, rtol=1e-6)
    model(CASE.batch(0)[0])                              # eager use works
    torch.save(model.state_dict(), "/dev/null")          # and so does saving


@pytest.mark.parametrize("budget", [None, "tight"])
def test_a_step_dropped_by_its_function_gives_the_trained_values_back(budget):
    model = CASE.build_model()
    kw = {}
    if budget:
        probe = _compile(CASE.build_model(), chunk_size=256)
        kw = dict(chunk_size=256, device_memory=int(probe.min_device_memory(*CASE.batch(0)) * 1.05))
    model = _train(model, 3, **kw)
    _, want = eager_run(CASE, 3)
    _assert_usable_with(model, want)
    _compile(model)(*CASE.batch(3))                      # and a new step compiles and trains on it


def _fresh_optimizer_step(values: dict, i: int) -> dict:
    """Eager: the model at `values`, one AdamW step (a new optimizer) on batch i."""
    ref = CASE.build_model()
    ref.load_state_dict(values)
    opt = torch.optim.AdamW(ref.parameters(), **HYPER, fused=True)
    CASE.loss_fn(ref, *CASE.batch(i)).backward()
    opt.step()
    return ref.state_dict()


def test_a_step_collected_in_a_reference_cycle_gives_the_values_back():
    model = CASE.build_model()
    step = _compile(model)
    for i in range(2):
        step(*CASE.batch(i))
    step.cycle = [step]                                  # only the cycle collector can free it
    del step
    gc.collect()
    _, want = eager_run(CASE, 2)
    _assert_usable_with(model, want)


def test_compiling_again_over_the_same_name_keeps_the_trained_values():
    """A notebook cell `step = px.compile(model, ...)(loss_fn)` run twice, with training in between."""
    model = CASE.build_model()
    step = _compile(model)
    for i in range(2):
        step(*CASE.batch(i))
    step = _compile(model)                               # the first step is dropped here
    step(*CASE.batch(2))
    # the second step started from the first one's values; its optimizer starts afresh
    _, trained = eager_run(CASE, 2)
    assert_state_close(step.state_dict(), _fresh_optimizer_step(trained, 2), rtol=1e-6)


def test_a_throwaway_evaluation_gives_the_model_back():
    model = CASE.build_model().eval()                    # BatchNorm reads its statistics, writes nothing
    evaluate = px.compile(model, optimizer=None, device="cpu")(CASE.loss_fn)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    evaluate(*CASE.batch(0))
    with pytest.raises(px.ModelHeldError):               # held while the evaluation lives
        model(CASE.batch(0)[0])
    del evaluate
    _assert_usable_with(model, before)


@pytest.mark.parametrize("where", ["before_commit", "after_commit"])
def test_ctrl_c_unwinding_the_training_loop_leaves_the_latest_values_in_the_model(where):
    """Ctrl-C in the third step: before its commit point the step is rolled back (two steps' values), after it the
    step completes first (three steps' values). Either way the model has them once the loop is gone."""
    model = CASE.build_model()

    def train():
        step = _compile(model)
        step(*CASE.batch(0))
        step(*CASE.batch(1))
        g = step.graphs["scheduled"]
        roles = [g.ann[n.name].role for n in g.nodes]
        commit = roles.index(Role.COMMIT)
        at = commit - 3 if where == "before_commit" else commit + 2
        step._before_node = lambda i, n: signal.raise_signal(signal.SIGINT) if i == at else None
        for i in range(2, 10):
            step(*CASE.batch(i))

    try:
        train()
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("no KeyboardInterrupt")
    _, want = eager_run(CASE, 2 if where == "before_commit" else 3)
    _assert_usable_with(model, want)


def test_the_model_is_given_back_after_a_step_dropped_where_it_could_not_give_it_back():
    """A step dropped on a thread where giving back is not safe (pstar-fx's own workers) leaves the values with the
    model: its next eager use gives it back."""
    import threading

    model = CASE.build_model()
    step = _compile(model)
    for i in range(2):
        step(*CASE.batch(i))
    box = [step]
    del step

    def drop():
        box.clear()                                      # the last reference goes on this thread
    t = threading.Thread(target=drop, name="pstar-fx test worker")
    t.start()
    t.join()
    gc.collect()
    _, want = eager_run(CASE, 2)
    model.eval()                                         # (in train mode the use below would update BatchNorm)
    out = model(CASE.batch(0)[0])                        # given back on use
    assert out.shape[0] == CASE.batch(0)[0].shape[0]
    assert_state_close(model.state_dict(), want, rtol=1e-6)


def test_sync_model_without_the_step():
    model = CASE.build_model()
    step = _compile(model)
    step(*CASE.batch(0))
    keep = step                                          # alive, but imagine it out of reach
    assert px.sync_model(model) is model
    _, want = eager_run(CASE, 1)
    _assert_usable_with(model, want)
    assert not keep.holds_model()


# -- several holders ---------------------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(torch.tanh(self.fc(x)))


class Net(nn.Module):
    def __init__(self, d=16, seed=0, shared: nn.Linear | None = None):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = shared if shared is not None else nn.Linear(d, d)
        self.block = Block(d)
        self.out = nn.Linear(d, 1)

    def forward(self, x):
        return self.out(self.block(self.inp(x)))


def _mse(model, x, y):
    return (model(x) - y).pow(2).mean()


def _block_loss(block, x, y):
    return (block(x).sum(-1, keepdim=True) - y).pow(2).mean()


def _batch(i, d=16):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(8, d, generator=g), torch.randn(8, 1, generator=g)


def _step(model, fn):
    return px.compile(model, optimizer=px.AdamW(**HYPER), device="cpu")(fn)


def test_state_dict_of_a_model_whose_block_another_step_holds():
    model = Net()
    whole = _step(model, _mse)
    part = _step(model.block, _block_loss)
    whole(*_batch(0))
    whole(*_batch(1))
    part(*_batch(2))                                     # takes the block (the whole model is given back first)

    # eager: two steps on the whole model, then one on the block with a fresh optimizer
    ref = Net()
    opt = torch.optim.AdamW(ref.parameters(), **HYPER, fused=True)
    for i in range(2):
        _mse(ref, *_batch(i)).backward()
        opt.step()
        opt.zero_grad()
    opt_b = torch.optim.AdamW(ref.block.parameters(), **HYPER, fused=True)
    _block_loss(ref.block, *_batch(2)).backward()
    opt_b.step()
    want = ref.state_dict()

    got = whole.state_dict()
    assert got.keys() == want.keys()                     # every key of the model, not the block's four
    assert_state_close(got, want, rtol=1e-6)
    assert_state_close(part.state_dict(), ref.block.state_dict(), rtol=1e-6)
    assert whole.sync_model() is model                   # gives the block back too
    assert_state_close(model.state_dict(), want, rtol=1e-6)
    model(_batch(0)[0])


def _sharing_pair() -> tuple[Net, Net]:
    torch.manual_seed(7)
    shared = nn.Linear(16, 16)
    return Net(seed=1, shared=shared), Net(seed=2, shared=shared)


def test_checkpoint_of_a_model_sharing_a_tensor_holds_its_own_values(tmp_path):
    m1, m2 = _sharing_pair()
    s1, s2 = _step(m1, _mse), _step(m2, _mse)
    s1(*_batch(0))
    s2(*_batch(1))                                       # takes the shared layer, with s1's trained value of it

    r1, r2 = _sharing_pair()
    for ref, i in ((r1, 0), (r2, 1)):
        opt = torch.optim.AdamW(ref.parameters(), **HYPER, fused=True)
        opt.zero_grad()                                  # (the shared layer's gradient of the first model)
        _mse(ref, *_batch(i)).backward()
        opt.step()
    want1 = r1.state_dict()                              # model 1: its own block and head, the shared layer's latest
    assert_state_close(s1.state_dict(), want1, rtol=1e-6)
    s1.save(tmp_path / "m1")
    saved = torch.load(tmp_path / "m1" / "model.pt", weights_only=True)
    assert_state_close(saved, want1, rtol=1e-6)
    assert not torch.equal(saved["out.weight"], r2.state_dict()["out.weight"])


def test_a_dropped_step_whose_model_does_not_fit_in_free_memory_keeps_the_values_with_the_model(monkeypatch):
    """Giving back copies every value before the chunks are freed; where the copies would not fit in the memory free
    now (a 17B model's 64 GiB beside a 100 GiB store), a finalizer must not try: the process would be killed. The
    values stay with the model, which gives them back at its next use."""
    from pstar_fx.api import model_state

    model = CASE.build_model()
    step = _compile(model)
    for i in range(2):
        step(*CASE.batch(i))
    monkeypatch.setattr(model_state, "_free_bytes", lambda device: 1024)
    with pytest.warns(RuntimeWarning, match="stay with the model"):
        del step
        gc.collect()
    assert any(model_state.holder(t) is not None for t in model.parameters())
    monkeypatch.undo()
    _, want = eager_run(CASE, 2)
    model.eval()
    model(CASE.batch(0)[0])                              # given back on use
    assert all(model_state.holder(t) is None for t in model.parameters())
    assert_state_close(model.state_dict(), want, rtol=1e-6)
