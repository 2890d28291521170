"""Holding Ctrl-C over a step, so that an interrupt lands only where the step can take it.

Python turns SIGINT into a KeyboardInterrupt at an arbitrary bytecode of the main thread: inside the device pool's
bookkeeping it would leave a buffer counted that nothing owns, and inside one of torch's C++ callbacks during tracing
it can abort the whole process. So a step holds SIGINT for its whole call: the handler installed here only records
that one arrived, and the step delivers it at safe points of its own (between compile phases, between nodes before
its commit point, at its end), where a KeyboardInterrupt rolls the step back or comes after it is complete.
"""
from __future__ import annotations

import signal
import threading


class DeferredInterrupt:
    """While active, SIGINT is recorded (`pending`) instead of raised; `deliver()` hands a recorded one to the
    handler that was installed before, exactly as a new Ctrl-C would reach it (Python's default raises
    KeyboardInterrupt there and then; SIG_IGN drops it; a user's or IPython's handler is called).

    As a context manager: active inside the block; on leaving it the previous handler is restored, then a
    recorded interrupt is delivered (also when the block raised: a KeyboardInterrupt then replaces the error, with
    the error as its context).

    Active only in the main thread (Python runs signal handlers there, and elsewhere no SIGINT arrives), and only
    over a handler installed from Python (`signal.getsignal` is not None: one installed from C could not be put
    back). Nesting composes: an inner one's previous handler is the outer one's recorder, so what the inner one
    delivers is recorded by the outer one, which delivers it at its own safe point.

    While active, a Ctrl-C waits for the holder's next safe point. A step that hangs inside one operation (a
    collective whose peer died) is ended by the process group's timeout, which turns the collective into
    px.DistributedError; a held interrupt is delivered after that error. A holder must never hold it for longer
    than the work it protects."""

    def __init__(self):
        self.pending = False      # a cheap attribute read for the executor's per-node check
        self.active = False
        self._old = None

    def start(self) -> None:
        if self.active or threading.current_thread() is not threading.main_thread():
            return
        old = signal.getsignal(signal.SIGINT)
        if old is None:           # installed from C: it could not be restored, so it is left alone
            return
        self._old = old
        signal.signal(signal.SIGINT, self._record)
        self.active = True

    def _record(self, signum, frame) -> None:
        self.pending = True

    def stop(self) -> None:
        """Restore the previous handler; a recorded interrupt stays pending for `deliver`."""
        if self.active:
            signal.signal(signal.SIGINT, self._old)
            self.active = False

    def deliver(self) -> None:
        """Hand a recorded interrupt to the previous handler (nothing when none is pending). While active, that
        handler is put back for the delivery and this one reinstalled after it, if it returns."""
        if not self.pending:
            return
        self.pending = False
        if not self.active:
            signal.raise_signal(signal.SIGINT)     # the restored handler takes it at once (main thread)
            return
        signal.signal(signal.SIGINT, self._old)
        try:
            signal.raise_signal(signal.SIGINT)
        finally:
            signal.signal(signal.SIGINT, self._record)

    def __enter__(self) -> "DeferredInterrupt":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        self.deliver()
