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
