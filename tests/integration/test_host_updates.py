"""Host-side optimizer updates on the store's worker thread: exact (bit for bit the inline update), overlapped (the
step returns with updates pending), waited for by every reader and by a failed step's rollback, and the thread ends
with its step."""
import gc
import time

import pytest
import torch

import pstar_fx as px
from pstar_fx.ir import Role

from harness import HYPER, small_batches, tight_budget
from models import CASES_BY_NAME

pytestmark = pytest.mark.cuda

CASE = small_batches(CASES_BY_NAME["gpt_tied"])


def _make(precision="fp32", clip=None, slack=1.3):
    budget = tight_budget(CASE, 1024, slack)
    return px.compile(CASE.build_model(), optimizer=px.AdamW(**HYPER), device_memory=budget, chunk_size=1024,
                      precision=precision, device="cpu", max_grad_norm=clip)(CASE.loss_fn)


def _inline(step):
    """From now on the step runs its host-side updates inline, on the executor's thread (after the pending ones)."""
    step._compiler.store.flush()
    step._compiler.store.updates = None


def _slow(step, seconds=0.02):
    """Make every host-side update take a while longer, so that steps return with updates still pending."""
    updates = step._compiler.store.updates
    submit = updates.submit
    updates.submit = lambda chunk, fn, after=(): submit(chunk, lambda: (time.sleep(seconds), fn())[1], after=after)


def _everything(step) -> dict:
    out = {f"sd.{k}": v for k, v in step.state_dict().items()}
    for i, s in step.optimizer.state_dict()["state"].items():
        out.update({f"opt.{i}.{k}": v for k, v in s.items()})
    return out


def _assert_bitwise(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("precision,clip", [("fp32", None), ("fp32", 0.5), ("bf16", 0.5), ("fp16", None)])
def test_worker_equals_inline_update_bit_for_bit(precision, clip):
    threaded, inline = _make(precision, clip), _make(precision, clip)
    threaded(*CASE.batch(0))
    inline(*CASE.batch(0))
    _inline(inline)
    g = threaded.graphs["scheduled"]
    assert any(c.state_home is not None and c.state_home.value == "host" for c in g.chunks)
    _slow(threaded)
    for i in range(1, 4):
        la, lb = threaded(*CASE.batch(i)).item(), inline(*CASE.batch(i)).item()
        assert la == lb, (i, la, lb)
    _assert_bitwise(_everything(threaded), _everything(inline))


def test_step_returns_with_updates_pending_and_readers_wait_for_them():
    step, ref = _make(), _make()
    ref(*CASE.batch(0))
    _inline(ref)
    ref(*CASE.batch(1))
    step(*CASE.batch(0))
    _slow(step, 0.2)
    step(*CASE.batch(1))
    assert step._compiler.store.updates._shared.pending, "the step returned before its host-side updates finished"
    _assert_bitwise(_everything(step), _everything(ref))          # state_dict() and the optimizer's wait
    step(*CASE.batch(2))
    model = step.sync_model()                                      # sync_model() waits too
    ref(*CASE.batch(2))
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


def test_failed_step_completes_the_previous_steps_pending_updates():
    """Step t's updates are committed: if step t+1 fails before its commit, they still complete, and nothing of
    step t+1 remains."""
    step, ref = _make(), _make()
    ref(*CASE.batch(0))
    _inline(ref)
    ref(*CASE.batch(1))
    want = _everything(ref)
    step(*CASE.batch(0))
    _slow(step, 0.1)
    step(*CASE.batch(1))
    g = step.graphs["scheduled"]
    roles = [g.ann[n.name].role for n in g.nodes]
    first_compute = roles.index(Role.COMPUTE)

    def fail(i, node):
        if i == first_compute:
            raise RuntimeError("injected")
    step._before_node = fail
    with pytest.raises(RuntimeError, match="injected"):
        step(*CASE.batch(99))
    step._before_node = None
    assert not step._compiler.store.updates._shared.pending
    _assert_bitwise(_everything(step), want)
    step(*CASE.batch(2))
    ref(*CASE.batch(2))
    _assert_bitwise(_everything(step), _everything(ref))


def test_worker_thread_ends_with_its_step():
    step = _make()
    step(*CASE.batch(0))
    thread = step._compiler.store.updates._thread
    assert thread is not None and thread.is_alive()
    del step
    # an update still running on the worker holds the store until it ends, and the store is freed by a collection
    # after that: collect until the thread ends (at most 10 s)
    deadline = time.monotonic() + 10
    while thread.is_alive() and time.monotonic() < deadline:
        gc.collect()
        thread.join(timeout=0.1)
    assert not thread.is_alive()


def test_the_worker_runs_with_its_own_thread_count():
    """HostUpdates(threads=n): torch's kernels on the worker use n intra-op threads, and the caller keeps its own;
    the worker's time counters add up its updates."""
    from pstar_fx.runtime.host_updates import HostUpdates
    mine = torch.get_num_threads()
    want = 1 if mine > 1 else 2          # not the caller's count
    updates = HostUpdates(threads=want)
    seen = []
    updates.submit(0, lambda: seen.append(torch.get_num_threads()))
    updates.wait_all()
    assert seen == [want] and torch.get_num_threads() == mine
    step = _make("bf16")
    for i in range(2):
        step(*CASE.batch(i))
    step._compiler.store.updates.wait_all()
    spent = step._compiler.store.updates.time
    host = sum(1 for c in step.final_graph.chunks if c.state_home is not None and c.state_home.value == "host")
    assert host > 0 and spent.updates == 2 * host and spent.updating > 0
