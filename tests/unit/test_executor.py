"""The executor's value bookkeeping: which tensors a node's value holds (fx_utils.tensors_in), and values whose
storage is larger than the plan assumed; and the step time its stats read on the device."""
import torch

from pstar_fx.runtime.device_pool import DevicePool
from pstar_fx.ir.fx_utils import tensors_in
from pstar_fx.runtime.executor import Executor
from pstar_fx.runtime.step_runtime import StepStats


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


def test_device_seconds_waits_for_the_steps_end_and_reads_the_events_milliseconds_as_seconds():
    """StepStats.device_seconds (CUDA: the step's time on the device, from events recorded around it) waits for the
    end event, then reads the events' elapsed milliseconds as seconds; None where none were recorded (off CUDA)."""
    calls = []

    class Event:
        def synchronize(self):
            calls.append("synchronize")

        def elapsed_time(self, end):
            calls.append("elapsed")
            return 1234.5

    stats = StepStats(measured_peak=0, h2d_bytes=0, d2h_bytes=0, skipped=False, _events=(Event(), Event()))
    assert stats.device_seconds == 1234.5 / 1000 and calls == ["synchronize", "elapsed"]
    assert StepStats(measured_peak=0, h2d_bytes=0, d2h_bytes=0, skipped=False).device_seconds is None
