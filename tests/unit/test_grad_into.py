"""Gradients computed straight into their chunks (passes/grad_into.py): which writes fold, which do not, and that a
folded step trains bit for bit as the unfolded one."""
import pytest
import torch
import torch.fx as fx

import pstar_fx as px
from pstar_fx.ir import Role, ops
from pstar_fx.passes import grad_into
from pstar_fx.passes.grad_into import fold_grad_producers

from harness import DEVICE, HYPER, tight_budget
from models import CASES_BY_NAME

aten = torch.ops.aten
CPU = torch.device("cpu")


def _write_graph(producer, views=(), *, accumulate=False, extra_user=False, dtype=torch.float32):
    """placeholders a (4 x 6), b (6 x 5) -> producer -> views -> write_grad; meta vals are real tensors (views share
    their storage), as the tracer's fake ones would."""
    graph = fx.Graph()
    a = graph.placeholder("a")
    a.meta["val"] = torch.randn(4, 6, dtype=dtype)
    b = graph.placeholder("b")
    b.meta["val"] = torch.randn(6, 5, dtype=dtype)
    n = graph.call_function(producer[0], producer[1](a, b))
    n.meta["val"] = producer[0](*[x.meta["val"] if isinstance(x, fx.Node) else x for x in n.args])
    for target, args in views:
        n = graph.call_function(target, (n, *args))
        n.meta["val"] = target(n.args[0].meta["val"], *args)
    if extra_user:
        u = graph.call_function(aten.neg.default, (n,))
        u.meta["val"] = -n.meta["val"]
    w = graph.call_function(ops.write_grad, (n,), {"param": "w", "accumulate": accumulate, "final": True})
    graph.output(None)
    ann = {x.name: object() for x in graph.nodes}
    ann[w.name] = "the write's annotation"
    return graph, ann, (a, b)


MM = (aten.mm.default, lambda a, b: (a, b))
TT = ((aten.t.default, ()), (aten.t.default, ()))


def test_a_contiguous_gradient_from_mm_folds_into_the_write():
    graph, ann, _ = _write_graph(MM, TT)
    assert fold_grad_producers(graph, ann, torch.float32, {}, CPU) == 1
    calls = [n for n in graph.nodes if n.op == "call_function"]
    assert [n.target for n in calls] == [ops.compute_grad]
    c = calls[0]
    assert c.kwargs["op"] is aten.mm.out and c.kwargs["shape"] == (4, 5) and c.kwargs["param"] == "w"
    assert c.kwargs["accumulate"] is False and c.kwargs["final"] is True
    assert [a.name for a in c.args] == ["a", "b"]
    assert ann[c.name] == "the write's annotation"       # the write's role and phase, under the new node's name


@pytest.mark.parametrize("why", ["transposed", "accumulates", "second user", "reads a parameter", "other dtype",
                                 "on CUDA"])
def test_writes_that_do_not_fold(why):
    views = ((aten.t.default, ()),) if why == "transposed" else TT
    graph, ann, (a, b) = _write_graph(MM, views, accumulate=why == "accumulates", extra_user=why == "second user")
    alias = {a: a} if why == "reads a parameter" else {}
    dtype = torch.bfloat16 if why == "other dtype" else torch.float32
    device = torch.device("cuda") if why == "on CUDA" else CPU
    before = [n.target for n in graph.nodes]
    assert fold_grad_producers(graph, ann, dtype, alias, device) == 0
    assert [n.target for n in graph.nodes] == before


@pytest.mark.parametrize("op", ["mm", "add", "sum"])
def test_an_out_form_writes_the_same_bits_into_a_chunk_range(op):
    """The folded write's kernel call against the functional one, into a range of a larger buffer at an aligned
    offset, as a chunk's is."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(96, 257, generator=gen)
    b = torch.randn(257, 33, generator=gen)
    fn, args, kwargs = {"mm": (aten.mm.default, (a, b), {}),
                        "add": (aten.add.Tensor, (a, a.flip(0)), {"alpha": 0.5}),
                        "sum": (aten.sum.dim_IntList, (a, [0]), {})}[op]
    want = fn(*args, **kwargs)
    chunk = torch.full((want.numel() + 96,), float("nan"))
    out = chunk[32:32 + want.numel()].view(want.shape)
    ops.OUT_FORMS[fn](*args, **kwargs, out=out)
    assert torch.equal(out, want)


def _train(case, monkeypatch, fold: bool, steps: int, **kw):
    with monkeypatch.context() as m:
        if not fold:
            m.setattr(grad_into, "_producer", lambda *args: None)
        model = case.build_model()
        step = px.compile(model, optimizer=px.AdamW(**HYPER), device=DEVICE, debug=True, **kw)(case.loss_fn)
        losses = [step(*case.batch(i)) for i in range(steps)]
    folded = sum(n.target is ops.compute_grad for n in step.final_graph.nodes)
    return losses, step.state_dict(), folded, step


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("budget", ["none", "tight"])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_folded_step_trains_bit_for_bit_as_the_unfolded_one(monkeypatch, precision, budget, accumulate):
    """The same model, batches and budget with gradients folded into their writes and without: equal losses and
    state bit for bit over 3 steps (a tight budget evicts chunks between uses); debug=True checks each plan's
    peak against the memory measured. On CUDA nothing folds (grad_into.fold_grad_producers says why)."""
    case = CASES_BY_NAME["gpt_tied"]
    kw = dict(precision=precision, chunk_size=1024, accumulate=accumulate,
              device_memory=tight_budget(case, 1024) if budget == "tight" else None)
    losses, state, folded, step = _train(case, monkeypatch, True, 3, **kw)
    ref_losses, ref_state, none, _ = _train(case, monkeypatch, False, 3, **kw)
    assert none == 0
    assert folded >= 8 if DEVICE == "cpu" else folded == 0     # on the CPU each Linear weight's first write at least
    assert all(torch.equal(x, y) for x, y in zip(losses, ref_losses)), (losses, ref_losses)
    assert state.keys() == ref_state.keys()
    for k in state:
        assert torch.equal(state[k], ref_state[k]), k
    writes = [n for n in step.final_graph.nodes if step.final_graph.ann[n.name].role is Role.WRITE_GRAD]
    assert all(not n.kwargs.get("accumulate") for n in writes if n.target is ops.compute_grad)
