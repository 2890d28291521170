"""The executor's value bookkeeping: which tensors a node's value holds (fx_utils.tensors_in), and values whose
storage is larger than the plan assumed."""
import torch

from pstar_fx.runtime.device_pool import DevicePool
from pstar_fx.ir.fx_utils import tensors_in
from pstar_fx.runtime.executor import Executor


def test_tensors_of_plain_and_nested_values_in_pytree_order():
    a, b = torch.randn(3), torch.randn(2)
    one = tensors_in(a)
    assert len(one) == 1 and one[0] is a
    got = tensors_in((a, [None, 1.5, {"k": b}]))
    assert len(got) == 2 and got[0] is a and got[1] is b
    assert tensors_in(None) == [] and tensors_in(2) == []
    p = torch.nn.Parameter(torch.randn(2))          # a tensor subclass counts as a tensor
    assert tensors_in(p)[0] is p


def test_compact_copies_values_whose_storage_is_larger_than_planned():
    pool = DevicePool(torch.device("cpu"), None)
    base = torch.randn(100)
    view = base[3]                                   # a 0-d view of a 400-byte storage
    planned = [4]
    out = Executor._compact(view, planned, pool)
    assert out is not view and out.untyped_storage().nbytes() == 4 and out.item() == view.item()
    assert Executor._compact(base, [400], pool) is base               # as planned
    slot = pool.take(100, torch.float32)
    assert Executor._compact(slot[3], planned, pool).untyped_storage().data_ptr() == slot.untyped_storage().data_ptr()
    pair = Executor._compact((view, base), [4, 400], pool)           # nested: each leaf on its own
    assert pair[0] is not view and pair[0].untyped_storage().nbytes() == 4 and pair[1] is base
    assert Executor._compact((view, base), [4], pool)[0] is view      # a plan that does not match: left alone


def test_out_overloads_match_arguments_and_types():
    from pstar_fx.runtime.pooled_outputs import out_overload
    aten = torch.ops.aten
    assert out_overload(aten.mm.default) == (aten.mm.out, "out")
    assert out_overload(aten.gelu_backward.default) == (aten.gelu_backward.grad_input, "grad_input")
    assert out_overload(aten.pow.Tensor_Scalar) == (aten.pow.Tensor_Scalar_out, "out")   # not Tensor_Tensor_out
    assert out_overload(aten.view.default) is None           # a view of its input
    assert out_overload(aten.add_.Tensor) is None            # in place
    assert out_overload(aten.native_dropout.default) is None  # two outputs


def test_large_activations_are_written_into_pool_buffers_equal_to_eager_and_as_planned():
    """Outputs of at least half a parameter slot go to the device pool through their ops' out= overloads: the step
    equals the same step with every output left to torch (bit for bit, fp32 on the CPU) and eager (1e-6), the plan's
    bytes are measured exactly (debug=True), and every buffer lent in a step is given back by its end."""
    import pstar_fx as px

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))

    def loss_fn(m, x):
        return m(x).square().mean()

    def compiled(pooled: bool):
        step = px.compile(build(), optimizer=px.AdamW(lr=1e-2), device="cpu", chunk_size=512, debug=True)(loss_fn)
        step.lower(xs[0])
        ex = step._compiler.cache.get(step._compiler.cache.last).executor
        if not pooled:
            ex.pooled = [None] * len(ex.pooled)
        return step, ex

    xs = [torch.randn(16, 32) for _ in range(3)]
    step, ex = compiled(True)
    assert [p for p in ex.pooled if p is not None], "the (16, 64) activations are at least half a 512-element slot"
    got = [step(x).item() for x in xs]
    plain, _ = compiled(False)
    assert got == [plain(x).item() for x in xs]
    assert all(torch.equal(a, b) for a, b in zip(step.state_dict().values(), plain.state_dict().values()))
    ref = build()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    want = []
    for x in xs:
        loss = loss_fn(ref, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) <= 1e-6
    store = step._compiler.store
    counted = store.pool.in_use
    store.recount()                      # the count rebuilt from what the store holds
    assert store.pool.in_use == counted, "nothing lent stays counted after the step"
