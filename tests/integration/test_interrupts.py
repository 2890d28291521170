"""Ctrl-C (or an exception) at any moment of any call never breaks a step.

The fuzzer raises a real SIGINT (`signal.raise_signal`, which reaches whatever handler is installed exactly as a
user's Ctrl-C would) from a `sys.settrace` function, at a random trace event of a call: any line of any Python code the
call runs (torch's tracing included) and, after the first call, any bytecode of pstar-fx's own functions. The loop
goes on as a user's would, retrying the batch when the step did not complete, until a fixed number of steps have;
which calls completed is read from the optimizer's step count. At the end every value equals, bit for bit, an
uninterrupted run over the same batches, and both train on alike. Each failure message names the seed, the call and
the event. PSTAR_INTERRUPT_SEEDS (default 1) and PSTAR_INTERRUPT_STEPS (default 6) run more.
"""
import concurrent.futures
import functools
import os
import random
import signal
import sys
import threading

import pytest
import torch

import pstar_fx as px
from pstar_fx.ir import Role
from pstar_fx.runtime import chunk_store, device_pool
from pstar_fx.interrupts import DeferredInterrupt

from harness import DEVICE, HYPER, tight_budget
from models import CASES_BY_NAME

SEEDS = int(os.environ.get("PSTAR_INTERRUPT_SEEDS", "1"))
STEPS = int(os.environ.get("PSTAR_INTERRUPT_STEPS", "6"))
COMPILE_TRIES = 2               # first calls interrupted (each traces again)
_OURS = os.path.dirname(px.__file__)
SET_UP = chunk_store.ChunkStore.__init__.__code__    # the first call's set-up begins with the store
_UNCOUNTED = {threading.__file__, concurrent.futures._base.__file__}


@functools.lru_cache(maxsize=None)
def _budget(name: str) -> int:
    return tight_budget(CASES_BY_NAME[name], chunk_size=256)


def _make(name: str, precision: str, atomic: bool = True):
    case = CASES_BY_NAME[name]
    return px.compile(case.build_model(), optimizer=px.AdamW(**HYPER), device_memory=_budget(name), chunk_size=256,
                      precision=precision, device=DEVICE, atomic=atomic)(case.loss_fn)


class _CtrlCAt:
    """A sys.settrace function: counts the trace events of the thread that installs it (calls, lines, returns,
    exceptions; with `opcodes`, also every bytecode of pstar-fx's functions) and at event `at` (None: never) stops
    tracing and raises a real SIGINT. With `after` (a code object), `at` counts from that code's `nth` call (`mark`:
    the event of that call). Waits on the host-update worker (threading, concurrent.futures) take as many lines as
    the worker takes time, so they are neither traced nor counted: the count of a call is the same from run to run."""

    def __init__(self, at: int | None, opcodes: bool, after=None, nth: int = 1, watch=None):
        self.at = at
        self.opcodes = opcodes
        self.after = after
        self.nth = nth
        self.watch = watch        # a code object: `watched` is the event of its first call
        self.watched = None
        self.events = 0
        self.mark = 0 if after is None else None
        self.fired = False

    def __call__(self, frame, event, arg):
        if event == "call" and frame.f_code.co_filename in _UNCOUNTED:
            return None
        self.events += 1
        if event == "call" and self.watched is None and frame.f_code is self.watch:
            self.watched = self.events
        if self.mark is None:
            if event == "call" and frame.f_code is self.after:
                self.nth -= 1
                if self.nth == 0:
                    self.mark = self.events
        elif self.events - self.mark == self.at:
            sys.settrace(None)
            self.fired = True
            signal.raise_signal(signal.SIGINT)
            return None
        if self.opcodes and event == "call" and frame.f_code.co_filename.startswith(_OURS):
            frame.f_trace_opcodes = True
        return self


def _traced_call(fn, args, tracer: _CtrlCAt):
    """fn(*args) under the tracer; returns (result, the exception it raised or None)."""
    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        out, err = fn(*args), None
    except BaseException as e:  # noqa: BLE001 - judged by the caller
        out, err = None, e
    finally:
        sys.settrace(previous)
    return out, err


def _steps_done(step) -> int:
    state = step.optimizer.state_dict()["state"]
    return int(state[0]["step"]) if state else 0


def _values(step) -> dict:
    """Every value training changes: parameters and buffers, optimizer states with step counts, optimizer options."""
    out = {f"sd.{k}": v.clone() for k, v in step.state_dict().items()}
    opt = step.optimizer.state_dict()
    for i, s in opt["state"].items():
        out.update({f"opt.{i}.{k}": torch.as_tensor(v).clone() for k, v in s.items()})
    out["groups"] = repr(opt["param_groups"])
    return out


def _assert_equal(got: dict, want: dict, where: str) -> None:
    assert got.keys() == want.keys(), where
    for k, v in want.items():
        same = v == got[k] if isinstance(v, str) else torch.equal(v, got[k])
        assert same, f"{where}: {k} differs from the uninterrupted run"


def _first_value_written(step) -> int | None:
    """The node from which Ctrl-C is held to the end: the commit, or (atomic=False) an earlier host-side step (None
    in an evaluation)."""
    g = step.final_graph
    return next((i for i, n in enumerate(g.nodes) if g.ann[n.name].role in (Role.COMMIT, Role.OPTIMIZER_STEP)),
                None)


def _counted(step, batch, opcodes: bool, after=None) -> tuple[int, int | None, int | None]:
    """Run a call under a tracer that never fires: (its events, the event of `after`'s first call, the event of the
    call of the first value written's operation (None on a first call, or where nothing is written))."""
    at = _first_value_written(step) if step._compiler.latest is not None else None
    watch = None if at is None else step.final_graph.nodes[at].target.__code__
    tracer = _CtrlCAt(None, opcodes, after, watch=watch)
    _, err = _traced_call(step, batch, tracer)
    assert err is None, err
    return tracer.events, tracer.mark, tracer.watched


@pytest.mark.slow
@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "early_updates"])
@pytest.mark.parametrize("name,precision", [("cnn_bn", "fp32"), ("gpt_tied", "bf16")], ids=["cnn_bn-fp32",
                                                                                           "gpt_tied-bf16"])
def test_ctrl_c_at_random_moments_never_breaks_a_step(name, precision, atomic):
    case = CASES_BY_NAME[name]
    # a first compile of the case in the process runs more Python (imports, caches filled once) than the later
    # ones the test interrupts: counted on a later one, the positions aimed into the compile all fall inside it
    _make(name, precision, atomic)(*case.batch(0))
    ref = _make(name, precision, atomic)
    # the first call: trace and plan, then (from the store's making) set up and run; interrupted in the atomic
    # runs only (atomic=False traces the same)
    compile_tries = COMPILE_TRIES if atomic else 0
    if compile_tries:
        first, set_up_from, _ = _counted(ref, case.batch(0), opcodes=False, after=SET_UP)
    else:
        ref(*case.batch(0))
    later, _, held_from = _counted(ref, case.batch(1), opcodes=True)
    if not atomic:      # the budget puts states on the host: some update runs before the commit
        roles = [ref.final_graph.ann[n.name].role for n in ref.final_graph.nodes]
        assert roles.index(Role.OPTIMIZER_STEP) < roles.index(Role.COMMIT)
    for i in range(2, STEPS):
        ref(*case.batch(i))
    want = _values(ref)
    want_loss = ref(*case.batch(STEPS))
    want_after = _values(ref)

    kinds = {"compile": 0, "rolled back": 0, "completed": 0} if atomic else {"rolled back": 0, "completed": 0}
    for seed in range(SEEDS):
        rng = random.Random(seed)
        step = _make(name, precision, atomic)
        done = calls = tries = 0
        while done < STEPS:
            where = f"{name} {precision} atomic={atomic}, seed {seed}, call {calls} (batch {done})"
            compiled = step._compiler.latest is not None
            after = None
            if not compiled:       # the first call: in the trace or the passes; then in the set-up or the run
                tries += 1
                at = (None if tries > compile_tries else rng.randint(1, set_up_from) if tries == 1 else
                      rng.randint(1, first - set_up_from))
                after = SET_UP if tries > 1 else None
            else:                  # before the first value written (rolls back), after it (completes), or never
                region = ("before", "after", "before", "after", None)[calls % 5] if calls < 4 * STEPS else None
                at = (rng.randint(1, held_from) if region == "before" else
                      rng.randint(held_from, later) if region == "after" else None)
            tracer = _CtrlCAt(at, opcodes=compiled, after=after)
            _, err = _traced_call(step, case.batch(done), tracer)
            where += f", SIGINT at trace event {at}{' after the set-up began' if after else ''} of {tracer.events}"
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, where
            if tracer.fired:
                assert isinstance(err, KeyboardInterrupt), f"{where}: raised {err!r}"
            else:
                assert err is None, f"{where}: raised {err!r}"
            now = _steps_done(step)
            assert now in (done, done + 1), where
            if tracer.fired:
                kinds["completed" if now > done else "compile" if not compiled else "rolled back"] += 1
            done, calls = now, calls + 1
        _assert_equal(_values(step), want, f"{name} {precision} atomic={atomic}, seed {seed}: after {calls} calls")
        loss = step(*case.batch(STEPS))
        assert torch.equal(loss, want_loss), f"seed {seed}: the next step's loss"
        _assert_equal(_values(step), want_after, f"{name} {precision} atomic={atomic}, seed {seed}: the next step")
    if DEVICE == "cpu":
        # every kind of interrupted call was seen. On CUDA the event counts of a call depend on timing (whether a
        # copy's event is done when the executor asks), so a position aimed after the commit may land before it:
        # every call there is still checked, but which kinds a seed reaches is not fixed
        assert all(kinds.values()), kinds


class _Spans:
    """A sys.settrace function counting as _CtrlCAt does (opcodes of pstar-fx's functions included) that records,
    for each code object in `codes`, the events of each of its calls, from the call to its return."""

    def __init__(self, codes):
        self.spans = {c: [] for c in codes}
        self.events = 0
        self._open = {}

    def __call__(self, frame, event, arg):
        if event == "call" and frame.f_code.co_filename in _UNCOUNTED:
            return None
        self.events += 1
        if event == "call":
            if frame.f_code in self.spans:
                self._open[frame] = self.events
            if frame.f_code.co_filename.startswith(_OURS):
                frame.f_trace_opcodes = True
        elif event == "return" and frame in self._open:
            self.spans[frame.f_code].append(self.events - self._open.pop(frame))
        return self


# (the function, which of its calls in a step: 0 the first, -1 the last, how many events apart the positions are)
BOOKKEEPING = [(device_pool.DevicePool.take, 0, 1), (device_pool.DevicePool.give, -1, 1),
               (chunk_store.ChunkStore.release, -1, 3)]


def test_ctrl_c_at_every_bytecode_of_the_device_pool_bookkeeping():
    """Ctrl-C at each bytecode of the device pool's allocation (its first call in a step) and give-back (its last)
    and at every third of the last release of a step (with its write-back), at a tight budget: the step rolls back
    (or completes), and trains on equal to an uninterrupted run of the steps that completed."""
    name, case = "cnn_bn", CASES_BY_NAME["cnn_bn"]
    ref = _make(name, "fp32")
    ref(*case.batch(0))
    spans = _Spans([f.__code__ for f, _, _ in BOOKKEEPING])
    _, err = _traced_call(ref, case.batch(1), spans)
    assert err is None, err
    ref_done = 2

    step = _make(name, "fp32")
    step(*case.batch(0))
    done = 1
    kinds = {"rolled back": 0, "completed": 0}
    for f, which, stride in BOOKKEEPING:
        calls = spans.spans[f.__code__]
        nth = which % len(calls) + 1
        for at in range(1, calls[nth - 1] + 1, stride):
            tracer = _CtrlCAt(at, opcodes=True, after=f.__code__, nth=nth)
            _, err = _traced_call(step, case.batch(done), tracer)
            where = f"Ctrl-C at event {at} of call {nth} of {f.__qualname__}"
            assert tracer.fired and isinstance(err, KeyboardInterrupt), f"{where}: raised {err!r}"
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, where
            now = _steps_done(step)
            assert now in (done, done + 1), where
            kinds["completed" if now > done else "rolled back"] += 1
            done = now
    for i in range(done, ref_done):         # the two even up, uninterrupted
        step(*case.batch(i))
    for i in range(ref_done, done):
        ref(*case.batch(i))
    done = max(done, ref_done)
    _assert_equal(_values(step), _values(ref), f"after {sum(kinds.values())} interrupted steps")
    loss = step(*case.batch(done))
    assert torch.equal(loss, ref(*case.batch(done)))
    _assert_equal(_values(step), _values(ref), "the next step")


def test_ctrl_c_while_tracing_is_held_until_the_trace_ends():
    """A Ctrl-C that arrives while the step traces the user's function (here: raised by the function itself) never
    interrupts the trace: the function runs to its end, the step raises KeyboardInterrupt at the next safe point
    with nothing changed, and the next call traces again and trains as if nothing happened."""
    name, case = "cnn_bn", CASES_BY_NAME["cnn_bn"]
    ran_after_the_signal = []

    def loss_fn(model, x, y):
        if not ran_after_the_signal:
            signal.raise_signal(signal.SIGINT)
        ran_after_the_signal.append(True)
        return case.loss_fn(model, x, y)

    model = case.build_model()
    step = px.compile(model, optimizer=px.AdamW(**HYPER), device_memory=_budget(name), chunk_size=256,
                      precision="fp32", device=DEVICE)(loss_fn)
    with pytest.raises(KeyboardInterrupt):
        step(*case.batch(0))
    assert ran_after_the_signal == [True]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert _steps_done(step) == 0 and step._compiler.store is None       # nothing set up, nothing trained
    ref = _make(name, "fp32")
    for i in range(2):
        assert torch.equal(step(*case.batch(i)), ref(*case.batch(i)))
    _assert_equal(_values(step), _values(ref), "after the interrupted trace")


@pytest.mark.parametrize("previous", ["handler", "ignored"])
def test_ctrl_c_reaches_the_handler_installed_before_the_step(previous):
    """A handler of the user's own (that does not raise) gets every Ctrl-C once, where the step delivers it, and
    the step goes on; SIG_IGN drops it. Either way the step completes and the handler is put back."""
    name, case = "cnn_bn", CASES_BY_NAME["cnn_bn"]
    got = []
    handler = (lambda signum, frame: got.append(signum)) if previous == "handler" else signal.SIG_IGN
    ref = _make(name, "fp32")
    step = _make(name, "fp32")
    step(*case.batch(0))
    held_from = _first_value_written(step)
    old = signal.signal(signal.SIGINT, handler)
    try:
        # before the commit point (where the default handler's KeyboardInterrupt rolls back) and after it
        for b, at in enumerate((1, held_from - 1, held_from + 1), start=1):
            step._before_node = lambda i, n, at=at: signal.raise_signal(signal.SIGINT) if i == at else None
            step(*case.batch(b))
        step._before_node = None
        assert signal.getsignal(signal.SIGINT) is handler
    finally:
        signal.signal(signal.SIGINT, old)
    assert got == ([signal.SIGINT] * 3 if previous == "handler" else [])
    for b in range(4):
        ref(*case.batch(b))
    _assert_equal(_values(step), _values(ref), f"previous handler: {previous}")


def test_nested_holders_deliver_to_the_outer_one():
    """An inner DeferredInterrupt's delivery is recorded by the outer one, which delivers it when it ends: the
    outermost holder decides where Ctrl-C lands."""
    with pytest.raises(KeyboardInterrupt):
        with DeferredInterrupt() as outer:
            with DeferredInterrupt() as inner:
                signal.raise_signal(signal.SIGINT)
                assert inner.pending and not outer.pending
            assert outer.pending and signal.getsignal(signal.SIGINT) == outer._record
            inner.deliver()          # nothing pending: nothing happens
            reached = True
    assert reached
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_during_an_evaluation_changes_nothing():
    """Interrupted evaluations (their first call too) between the steps of a training step at a tight budget: the
    training equals one that never evaluated, and a completed evaluation returns what an uninterrupted one does."""
    name, case = "cnn_bn", CASES_BY_NAME["cnn_bn"]
    ref = _make(name, "fp32")
    evaluate_ref = px.compile(ref._model, optimizer=None, device=DEVICE)(case.loss_fn)
    ref(*case.batch(0))
    ref._model.eval()
    first, _, _ = _counted(evaluate_ref, case.batch(50), opcodes=False)
    later, _, _ = _counted(evaluate_ref, case.batch(50), opcodes=True)
    want_eval = evaluate_ref(*case.batch(50))
    ref._model.train()
    ref(*case.batch(1))
    want = _values(ref)

    rng = random.Random(0)
    step = _make(name, "fp32")
    evaluate = px.compile(step._model, optimizer=None, device=DEVICE)(case.loss_fn)
    step(*case.batch(0))
    fired = 0
    for k in range(8):
        compiled = evaluate._compiler.latest is not None
        tracer = _CtrlCAt(rng.randint(1, later if compiled else first), opcodes=compiled)
        step._model.eval()
        out, err = _traced_call(evaluate, case.batch(50), tracer)
        step._model.train()
        where = f"evaluation {k}, SIGINT at trace event {tracer.at} of {tracer.events}"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, where
        assert isinstance(err, KeyboardInterrupt) if tracer.fired else err is None, f"{where}: raised {err!r}"
        fired += tracer.fired
        if err is None:
            assert torch.equal(out, want_eval), where
    assert fired >= 6
    step(*case.batch(1))
    _assert_equal(_values(step), want, "after the interrupted evaluations")


class _FailingEmpty:
    """device_pool's view of torch: torch itself, except that `empty` raises torch.OutOfMemoryError at its call
    number `fail_at` (counting from 1; None: never), as a device allocation that runs out of memory does."""

    def __init__(self):
        self.calls = 0
        self.fail_at = None

    def __getattr__(self, name):
        return getattr(torch, name)

    def empty(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise torch.OutOfMemoryError("injected: out of memory")
        return torch.empty(*args, **kwargs)


@pytest.mark.parametrize("name,precision", [("cnn_bn", "fp32"), ("gpt_tied", "bf16")], ids=["cnn_bn-fp32",
                                                                                           "gpt_tied-bf16"])
def test_out_of_memory_in_any_pool_allocation_before_the_commit_changes_nothing(name, precision, monkeypatch):
    """Each device allocation of a step before its commit point in turn runs out of memory: the step raises it and
    changes nothing, and training goes on equal to a run without the failed steps (no byte stays counted)."""
    case = CASES_BY_NAME[name]
    fake = _FailingEmpty()
    monkeypatch.setattr(device_pool, "torch", fake)
    ref = _make(name, precision)
    ref(*case.batch(0))
    held_from = _first_value_written(ref)
    counted = []                  # the allocations of a step before its commit point
    ref._before_node = lambda i, n: counted.append(fake.calls) if i == held_from else None
    fake.calls = 0
    ref._compiler.store.pool.trim(0)   # every slot allocated anew, none taken from the pool's free list
    ref(*case.batch(1))
    ref._before_node = None
    want = _values(ref)
    allocations = counted[0]
    assert allocations >= 4

    step = _make(name, precision)
    step(*case.batch(0))
    for k in range(1, allocations + 1):
        fake.calls, fake.fail_at = 0, k
        step._compiler.store.pool.trim(0)
        with pytest.raises(torch.OutOfMemoryError):
            step(*case.batch(99))     # a batch the reference never sees
    fake.fail_at = None
    step(*case.batch(1))
    _assert_equal(_values(step), want, f"{name} {precision}: after {allocations} failed steps")
