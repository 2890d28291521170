"""The device budget at its default, and a device that runs out of memory anyway.

`device_memory=None` on a GPU leaves room beside pstar-fx's tensors (api/device_budget.py): the arithmetic and the
allocator configuration it reads are checked here on any machine. A step whose allocation the device refuses (the
plan kept within the budget, but memory the plan does not see was taken) raises px.DeviceMemoryError, a BudgetError
and a torch.OutOfMemoryError naming the node, the bytes asked and the bytes free, and changes nothing: the next step
equals a run that never saw the failed one. `step.summary()` shows the step's time and, on CUDA, the cost model's
estimate and the allocator's retries.
"""
import pytest
import torch

import pstar_fx as px
from pstar_fx.api import device_budget
from pstar_fx.ir import Role

from harness import assert_values_equal, compiled_step, step_values, tight_budget
from models import CASES_BY_NAME, assert_state_close

pytestmark = pytest.mark.cuda

CASE = CASES_BY_NAME["cnn_bn"]
GiB = 1 << 30


def test_default_budget_leaves_room_for_kernels_allocator_and_nccl():
    one = device_budget.DefaultBudget(free=100 * GiB, kernels=GiB, allocator=3 * GiB, nccl=0)
    assert one.budget == 96 * GiB
    assert str(one).startswith("96.00 GiB = 100.00 GiB free - 1.00 GiB for kernels - 3.00 GiB for the allocator")
    assert "expandable_segments:True" in str(one)         # fixed segments: what the other allocator would give
    small = device_budget.DefaultBudget(free=100 * GiB, kernels=GiB, allocator=device_budget.ALLOCATOR_EXPANDABLE,
                                        nccl=0)
    assert "expandable_segments" not in str(small)
    two = device_budget.DefaultBudget(free=100 * GiB, kernels=GiB, allocator=2 * GiB, nccl=GiB)
    assert two.budget == 96 * GiB and "1.00 GiB for NCCL" in str(two)
    assert device_budget.DefaultBudget(free=GiB, kernels=GiB, allocator=GiB, nccl=0).budget == 0


@pytest.mark.parametrize("conf, want", [("", False), ("expandable_segments:True", True),
                                        ("max_split_size_mb:128,expandable_segments:True", True),
                                        ("expandable_segments:False", False), ("backend:cudaMallocAsync", False)])
def test_expandable_segments_read_from_the_allocator_configuration(monkeypatch, conf, want):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    assert device_budget.expandable_segments() is want


def test_cpu_default_budget_is_the_available_memory():
    step = px.compile(CASE.build_model(), optimizer=px.AdamW(lr=1e-3), device="cpu")(CASE.loss_fn)
    assert 0 < step.settings.budget <= device_budget.default_cpu_budget() * 2
    step(*CASE.batch(0))
    assert "free -" not in str(step.summary())          # the default's breakdown is a GPU's


@pytest.mark.parametrize("tight", [False, True], ids=["unlimited", "tight"])
def test_device_out_of_memory_is_a_budget_error_naming_the_node_and_changes_nothing(tight):
    budget = tight_budget(CASE, chunk_size=256) if tight else None
    ref = compiled_step(CASE, budget=budget, chunk_size=256)
    for i in range(3):
        ref(*CASE.batch(i))

    step = compiled_step(CASE, budget=budget, chunk_size=256)
    step(*CASE.batch(0))
    step(*CASE.batch(1))
    before = step_values(step)
    g = step.final_graph                      # the graph the step runs (fused regions where fuse=True)
    roles = [g.ann[n.name].role for n in g.nodes]
    at = max(i for i, r in enumerate(roles) if r in (Role.COMPUTE, Role.REGION) and i < roles.index(Role.COMMIT))
    message = ("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total capacity of 139.80 GiB of which "
               "1.25 GiB is free.")

    def fail(i, node):
        if i == at:
            raise torch.OutOfMemoryError(message)
    step._before_node = fail
    with pytest.raises(px.DeviceMemoryError) as info:
        step(*CASE.batch(99))
    step._before_node = None
    err = info.value
    assert isinstance(err, px.BudgetError) and isinstance(err, torch.OutOfMemoryError)
    assert err.node == g.nodes[at].name and err.node in str(err)
    assert err.needed == int(2.5 * GiB)
    assert "2.50 GiB asked" in str(err) and "changed nothing" in str(err) and "device_memory" in str(err)
    assert_values_equal(step_values(step), before, "after the out-of-memory error")
    step(*CASE.batch(2))
    assert_state_close(step.state_dict(), ref.state_dict(), rtol=0)


def test_summary_shows_the_step_time():
    """The summary's measured step: on CUDA the step's time on the device, first operation to last (the call may
    return before the device is done), elsewhere the call's wall time."""
    step = compiled_step(CASE, chunk_size=256)
    step(*CASE.batch(0))
    s = step.summary()
    assert s.measured_seconds is not None and s.measured_seconds > 0
    on_cuda = step.settings.device.type == "cuda"
    last = step.last_step
    if on_cuda:
        assert s.measured_seconds == last.device_seconds
    else:
        assert last.device_seconds is None and s.measured_seconds == last.seconds
    assert (s.estimated_seconds is not None) == on_cuda and (s.alloc_retries is not None) == on_cuda
    text = str(s)
    assert "step time" in text and f"{s.measured_seconds:.3f} s measured" in text
