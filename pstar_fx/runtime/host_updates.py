"""Host-side optimizer updates on a CPU thread of their own, off the executor's critical path.

One worker thread per ChunkStore runs the updates of chunks whose optimizer states live on the host, in the order
they were submitted (graph order, which place_optimizer chose from the cost model). Torch's fused CPU Adam uses the
worker's threads (`threads`) inside one update and releases the GIL there, so one worker suffices and the
executor's Python keeps running beside it.

Per chunk: `submit(c, fn, after=events)` queues chunk c's update, which the worker starts once those (CUDA) events
are done; `then(c, fn)` runs fn right after chunk c's pending update (on
the worker) or at once (on the caller) when none is pending: a fetch of c's parameters hangs on it, so it waits for
exactly that update; `wait(c)` / `wait_all()` block until c's (every) pending update is done. An update that fails
is re-raised, as a CommitError (the step it belongs to had committed), by the next wait on it; `settle(chunks)`
waits for those chunks' updates and forgets them, failed or not (updates ahead of the commit of a step that failed
before it, whose values are put back: runtime/undo.py). `time` adds up
where the worker's time went: waiting for the updates' events, and updating.

The thread holds no reference to the ChunkStore (nor to this object): when this object is garbage-collected, a
finalizer ends the thread.
"""
from __future__ import annotations

import queue
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import CommitError
from .host_memory import spare_threads


@dataclass
class WorkerTime:
    """Seconds the worker spent, summed over its life: waiting for an update's events (its gradient's copy home),
    updating, and the number of updates."""
    waiting: float = 0.0
    updating: float = 0.0
    updates: int = 0


class _Shared:
    """What the worker thread and the submitting thread share (under `lock`)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.pending: dict[int, Future] = {}                       # chunk -> its latest queued update
        self.after: dict[int, list[tuple[Callable, Future]]] = {}  # chunk -> continuations of its pending update
        self.time = WorkerTime()                                   # written by the worker only


def _work(q: "queue.SimpleQueue", shared: _Shared, threads: int | None) -> None:
    if threads is not None:
        torch.set_num_threads(threads)     # this thread's own OpenMP team; the executor's thread keeps its own
    while True:
        task = q.get()
        if task is None:
            return
        chunk, fut = task[0], task[3]
        error = _update(task, shared.time)
        # the update's closure (and whatever it made) may reference the store, which must be collectable (its
        # finalizer ends this thread and removes a disk tier's files) as soon as the user drops the step: nothing of
        # it stays in this frame once anyone learns the update is done
        del task
        _publish(fut, None, error)
        with shared.lock:
            if shared.pending.get(chunk) is fut:
                del shared.pending[chunk]
            conts = shared.after.pop(chunk, [])
        del fut
        _continue(conts, error)
        del conts, error


def _update(task: tuple, spent: WorkerTime) -> BaseException | None:
    """Run one queued update after its events; its failure, or None."""
    chunk, fn, after, _ = task
    try:
        t0 = time.perf_counter()
        if after:
            with torch.profiler.record_function(f"pstar-fx wait for the copies of chunk {chunk}"):
                for event in after:
                    event.synchronize()
        t1 = time.perf_counter()
        with torch.profiler.record_function(f"pstar-fx host update of chunk {chunk}"):   # for a profiler's trace
            fn()
        spent.waiting += t1 - t0
        spent.updating += time.perf_counter() - t1
        spent.updates += 1
        return None
    except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the chunk
        return e


def _continue(conts: list, error: BaseException | None) -> None:
    """The continuations of a finished update, in order: each fails with the update's failure, or runs."""
    while conts:
        cont, cfut = conts.pop(0)
        result, failure = _call(cont, error)
        del cont
        _publish(cfut, result, failure)


def _call(fn: Callable, error: BaseException | None):
    if error is not None:
        return None, error
    try:
        return fn(), None
    except BaseException as e:  # noqa: BLE001
        return None, e


def _publish(fut: Future, result, error: BaseException | None) -> None:
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def _stop(q: "queue.SimpleQueue", thread: threading.Thread) -> None:
    """End the worker after the updates queued so far."""
    q.put(None)
    if thread is not threading.current_thread():
        thread.join()


class HostUpdates:
    """threads: the worker's intra-op threads for torch's CPU kernels (None: torch's default, every core). Set it
    before the first update."""

    def __init__(self, threads: int | None = None):
        self.threads = threads
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._shared = _Shared()
        self._thread: threading.Thread | None = None

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=_work, args=(self._q, self._shared, self.threads), daemon=True,
                                            name="pstar-fx host updates")
            self._thread.start()
            weakref.finalize(self, _stop, self._q, self._thread)   # also at interpreter exit, before daemons die

    @property
    def time(self) -> WorkerTime:
        return self._shared.time

    def submit(self, chunk: int, fn: Callable[[], None], after=()) -> Future:
        self._start()
        fut: Future = Future()
        with self._shared.lock:
            assert chunk not in self._shared.pending, f"chunk {chunk} already has an update pending"
            self._shared.pending[chunk] = fut
        self._q.put((chunk, fn, tuple(after), fut))
        return fut

    def then(self, chunk: int, fn: Callable):
        """fn() after chunk's pending update (on the worker), or now (on the caller) if none is pending. Returns a
        Future of fn's result, or fn's result itself when it ran now."""
        with self._shared.lock:
            if chunk in self._shared.pending:
                fut: Future = Future()
                self._shared.after.setdefault(chunk, []).append((fn, fut))
                return fut
        return fn()

    def busy(self, chunk: int) -> bool:
        with self._shared.lock:
            return chunk in self._shared.pending

    def wait(self, chunk: int) -> None:
        with self._shared.lock:
            fut = self._shared.pending.get(chunk)
        if fut is not None:
            _result(fut)

    def settle(self, chunks) -> None:
        """Wait for these chunks' pending updates to end, and forget them whether they succeeded or failed (a step
        that failed before its commit puts their values back: their failures are that step's)."""
        with self._shared.lock:
            futs = [(c, self._shared.pending.get(c)) for c in chunks]
        for c, fut in futs:
            if fut is None:
                continue
            try:
                fut.result()
            except BaseException:  # noqa: BLE001 - the step's own failure is being raised
                pass
            with self._shared.lock:
                if self._shared.pending.get(c) is fut:
                    del self._shared.pending[c]

    def wait_all(self) -> None:
        with self._shared.lock:
            futs = list(self._shared.pending.values())
        for fut in futs:
            _result(fut)


def _result(fut: Future) -> None:
    try:
        fut.result()
    except CommitError:
        raise
    except BaseException as e:
        raise CommitError(f"pstar-fx: a host-side optimizer update failed after its step committed "
                          f"({type(e).__name__}: {e}); the compiled step's values are no longer consistent. Load a "
                          "checkpoint (step.load(path) or step.load_state_dict(...)) to continue.") from e


def worker_threads(device: torch.device) -> int:
    """Intra-op threads for the CPU worker's updates beside a GPU: every core but two, which the executor's thread
    (launching kernels, spinning while the launch queue is full) and the CUDA driver's copies keep busy. An OpenMP
    team as large as the machine stalls on whichever of its threads those two push off a core: on the H200 machine
    (16 cores) a 17B step took 5.5 s with 16 threads, 4.6 s with 14 (BENCHMARKS.md). On the CPU, where the executor
    computes on the same cores, half of them: two teams of every core, each stalling on the threads the other
    pushes off, took the example's step (2 cores, benchmarks/fuse_cpu.py) from 50 ms to 84 ms."""
    if device.type != "cuda":
        return max(1, torch.get_num_threads() // 2)
    return spare_threads()
