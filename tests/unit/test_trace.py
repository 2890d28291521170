"""Tracing: names, tied weights, buffers, retracing by signature, and clear errors for untraceable steps."""
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pstar_fx as px
from pstar_fx.ir import Role

from harness import line_of
from models import CASES_BY_NAME


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _compile(model, fn, **kw):
    return px.compile(model, optimizer=px.AdamW(lr=1e-3), device="cpu", **kw)(fn)


def test_loop_over_dynamic_shape_names_op_and_line():
    # a boolean mask itself compiles (tests/integration/test_moe.py), and so does an `if` on its size
    # (tests/integration/test_guards.py); a Python loop over the rows it selects cannot
    def step(model, x):
        rows = x[x[:, 0] > 0]  # MARK-mask
        for row in rows:  # MARK-loop
            x = x + row
        return model(x).sum()
    with pytest.raises(px.UntraceableError) as e:
        _compile(_mlp(), step)(torch.randn(3, 4))
    assert "aten.nonzero" in str(e.value)
    assert f"test_trace.py:{line_of(__file__, 'MARK-mask')}" in str(e.value)
    assert f"test_trace.py:{line_of(__file__, 'MARK-loop')}" in str(e.value)


def test_inplace_parameter_update_names_op_param_and_line():
    def step(model, x):
        with torch.no_grad():
            model[0].weight.mul_(2.0)  # MARK-inplace
        return model(x).sum()
    with pytest.raises(px.UntraceableError) as e:
        _compile(_mlp(), step)(torch.randn(3, 4))
    msg = str(e.value)
    assert "aten.mul_" in msg and "'0.weight'" in msg
    assert f"test_trace.py:{line_of(__file__, 'MARK-inplace')}" in msg


def test_embedding_max_norm_names_the_users_call_and_what_to_do():
    """F.embedding's max_norm renormalises the weight in place inside torch, out of the recorder's sight: the error
    names the user's line that called it, and says to drop max_norm or bound the norms out of place."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 16, max_norm=1.0), nn.Flatten(), nn.Linear(16 * 7, 3))

    def step(m, x, y):
        return F.cross_entropy(m(x), y)  # MARK-embedding
    with pytest.raises(px.UntraceableError) as e:
        _compile(model, step)(torch.randint(0, 20, (4, 7)), torch.randint(0, 3, (4,)))
    msg = str(e.value)
    assert "aten.embedding_renorm_" in msg and "'0.weight'" in msg and "drop max_norm" in msg
    assert f"test_trace.py\", line {line_of(__file__, 'MARK-embedding')}" in msg


def test_non_scalar_loss_is_rejected():
    with pytest.raises(px.UntraceableError, match="0-d tensor"):
        _compile(_mlp(), lambda m, x: m(x))(torch.randn(3, 4))


def test_tied_weights_live_once_and_state_dict_has_both_names():
    case = CASES_BY_NAME["gpt_tied"]
    model = case.build_model()
    step = _compile(model, case.loss_fn)
    step(*case.batch(0))
    traced = step.graphs["traced"]
    names = [p.name for p in traced.params]
    assert "wte.weight" in names or "lm_head.weight" in names
    assert not ("wte.weight" in names and "lm_head.weight" in names), names
    sd = step.state_dict()
    assert set(sd) == set(model.state_dict())
    assert torch.equal(sd["wte.weight"], sd["lm_head.weight"])


def test_param_and_buffer_names_match_state_dict():
    case = CASES_BY_NAME["cnn_bn"]
    model = case.build_model()
    step = _compile(model, case.loss_fn)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    step(*case.batch(0))
    sd = step.state_dict()
    assert list(sd) == list(ref)
    assert all(sd[k].shape == ref[k].shape and sd[k].dtype == ref[k].dtype for k in ref)
    # BatchNorm running stats and the counter changed during the step
    counters = [k for k in ref if k.endswith("num_batches_tracked")]
    assert counters and all(sd[k].item() == ref[k].item() + 1 for k in counters)
    changed = [k for k in ref if "running_mean" in k and not torch.equal(sd[k], ref[k])]
    assert changed, "running statistics should have been updated"


def test_new_shape_retraces_and_same_shape_hits_cache():
    model = _mlp()
    step = _compile(model, lambda m, x, y: F.mse_loss(m(x), y))
    step(torch.randn(3, 4), torch.randn(3, 2))
    first = step.graphs["traced"]
    step(torch.randn(3, 4), torch.randn(3, 2))
    assert step.graphs["traced"] is first
    step(torch.randn(5, 4), torch.randn(5, 2))
    assert step.graphs["traced"] is not first
    x_shape = [n.meta["val"].shape for n in step.graphs["traced"].nodes
               if step.graphs["traced"].ann[n.name].role is Role.INPUT][0]
    assert tuple(x_shape) == (5, 4)


def test_new_dtype_retraces():
    model = _mlp()
    step = _compile(model, lambda m, x: m(x.float()).sum())
    step(torch.randn(3, 4))
    a = step.graphs["traced"]
    step(torch.randn(3, 4, dtype=torch.float64))
    assert step.graphs["traced"] is not a


def test_tracing_allocates_nothing_real():
    """Fake tensors only: tracing a model far larger than this machine's memory succeeds (meta parameters)."""
    with torch.device("meta"):
        big = nn.Linear(100_000, 100_000)   # 40 GB of fp32 weights if it were real
    from pstar_fx.ir import Precision, Settings
    from pstar_fx.frontend.trace import trace_step
    settings = Settings(Precision.FP32, torch.device("cpu"), None, None, px.AdamW())
    g = trace_step(lambda m, x: m(x).sum(), big, (torch.randn(2, 100_000),), settings)
    assert any(g.ann[n.name].role is Role.PARAM for n in g.nodes)


def test_frozen_parameters_get_no_update_and_unused_ones_are_skipped():
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4), "unused": nn.Linear(4, 4)})
    model["b"].weight.requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step = _compile(model, lambda m, x: m["b"](m["a"](x)).pow(2).sum())
    step(torch.randn(3, 4))
    sd = step.state_dict()
    assert torch.equal(sd["b.weight"], before["b.weight"])            # frozen
    assert torch.equal(sd["unused.weight"], before["unused.weight"])  # no gradient: AdamW skips it, so do we
    assert not torch.equal(sd["a.weight"], before["a.weight"])
    assert not re.search("unused", " ".join(step.graphs["scheduled"].grad_outputs))


def test_batch_may_be_a_pytree_with_constants():
    torch.manual_seed(0)
    model = _mlp()
    ref = _mlp()
    ref.load_state_dict(model.state_dict())

    def step_fn(m, batch, reduction):
        return F.mse_loss(m(batch["x"]), batch["y"][0], reduction=reduction)

    step = _compile(model, step_fn)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    for _ in range(3):
        x, y = torch.randn(3, 4), torch.randn(3, 2)
        loss = step({"y": [y], "x": x}, "sum")
        eager = step_fn(ref, {"y": [y], "x": x}, "sum")
        eager.backward()
        opt.step()
        opt.zero_grad()
        assert loss.item() == eager.item()
    first = step.graphs["traced"]
    step({"y": [torch.randn(3, 2)], "x": torch.randn(3, 4)}, "mean")   # a new constant retraces
    assert step.graphs["traced"] is not first
    with pytest.raises(TypeError, match="neither a tensor nor hashable"):
        step({"y": [torch.randn(3, 2)], "x": torch.randn(3, 4)}, bytearray(b"sum"))


def test_tensor_constants_made_in_forward_are_graph_constants():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x) * torch.tensor([1.5, 2.0, 0.5, 1.0])

    torch.manual_seed(0)
    model, ref = Scaled(), Scaled()
    ref.load_state_dict(model.state_dict())
    step = _compile(model, lambda m, x: m(x).pow(2).sum(), debug=True)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    for _ in range(3):
        x = torch.randn(3, 4)
        loss = step(x)
        eager = ref(x).pow(2).sum()
        eager.backward()
        opt.step()
        opt.zero_grad()
        assert loss.item() == eager.item()
    g = step.graphs["scheduled"]
    assert any(g.ann[n.name].role is Role.CONSTANT for n in g.nodes)
    assert "constant(_tensor_constant0)" in str(g)


@torch.jit.script
def _bucketed(rel, mid: int):
    # as transformers' DeBERTa-v2 make_log_bucket_position: a constant made by torch.tensor inside a script
    return torch.where((rel < mid) & (rel > -mid), torch.tensor(mid - 1).type_as(rel), torch.abs(rel))


class _CallsAScript(nn.Module):
    """A relative-position bias, its buckets computed by a scripted function."""
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.rel = nn.Embedding(8, 4)

    def forward(self, x):                                                  # (B, T, 4)
        pos = torch.arange(x.shape[1])
        bias = self.rel(_bucketed(pos[:, None] - pos[None, :], 2)).mean(1)    # (T, 4)
        return self.lin(x) + bias


def test_scripted_functions_trace_as_their_python_and_train_like_eager():
    """A torch.jit.script function called by the model's code (its torch.tensor constants are real tensors, which
    fake tensors refuse) is traced as the Python it was compiled from, and put back after the trace."""
    torch.manual_seed(0)
    model, ref = _CallsAScript(), _CallsAScript()
    ref.load_state_dict(model.state_dict())
    step = _compile(model, lambda m, x: m(x).pow(2).sum(), debug=True)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    for _ in range(3):
        x = torch.randn(3, 6, 4)
        loss = step(x)
        eager = ref(x).pow(2).sum()
        eager.backward()
        opt.step()
        opt.zero_grad()
        assert loss.item() == eager.item()
    assert isinstance(_bucketed, torch.jit.ScriptFunction)     # the module's name is the script again
    sd, ref_sd = step.state_dict(), ref.state_dict()
    assert all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd)


def test_closed_over_real_tensor_names_the_line():
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.k = torch.ones(4)    # a plain attribute, not a registered buffer

        def forward(self, x):
            return self.lin(x) * self.k  # MARK-closed

    with pytest.raises(px.UntraceableError) as e:
        _compile(Holder(), lambda m, x: m(x).sum())(torch.randn(3, 4))
    assert f"test_trace.py:{line_of(__file__, 'MARK-closed')}" in str(e.value)
    assert "register_buffer" in str(e.value)


def test_user_frame_is_the_innermost_frame_outside_torch_and_pstar_fx():
    """The source line error messages name (trace's untraceable-op errors, the executor's failing node): the last
    'File' line of a node's recorded stack that is not in torch or pstar-fx, with its code line."""
    import os
    import torch.fx as fx
    import pstar_fx
    from pstar_fx.ir.fx_utils import user_frame
    torch_file = os.path.join(os.path.dirname(torch.__file__), "nn", "functional.py")
    ours = os.path.join(os.path.dirname(pstar_fx.__file__), "frontend", "trace.py")
    g = fx.Graph()
    n = g.placeholder("x")
    n.meta["stack_trace"] = (f'  File "/home/me/train.py", line 10, in main\n    loss = step(model, x)\n'
                             f'  File "/home/me/model.py", line 42, in forward\n    h = F.embedding(x, w)\n'
                             f'  File "{torch_file}", line 2500, in embedding\n    return torch.embedding(...)\n'
                             f'  File "{ours}", line 150, in __torch_function__\n    return func(*args)\n')
    assert user_frame(n) == ('File "/home/me/model.py", line 42, in forward', "h = F.embedding(x, w)")
    n.meta["stack_trace"] = f'  File "{torch_file}", line 2500, in embedding\n    return torch.embedding(...)\n'
    assert user_frame(n) is None
    del n.meta["stack_trace"]
    assert user_frame(n) is None


def test_a_sparse_embedding_is_refused_with_its_line():
    class SparseEmbedding(nn.Module):
        def __init__(self):
            super().__init__()
            self.e = nn.Embedding(10, 4, sparse=True)
            self.o = nn.Linear(4, 10)

        def forward(self, x):
            return self.o(self.e(x))    # the sparse embedding's line

    step = px.compile(SparseEmbedding(), optimizer=px.SGD(lr=0.1), device="cpu")(
        lambda m, x, y: F.cross_entropy(m(x), y))
    with pytest.raises(px.UntraceableError, match=r"sparse_coo tensor.*nn.Embedding\(sparse=True\).*test_trace.py.*"
                                                  r"the sparse embedding's line.*use sparse=False"):
        step(torch.randint(10, (6,)), torch.randint(10, (6,)))
