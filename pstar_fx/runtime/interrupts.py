"""Holding Ctrl-C while a step applies its update, so that an interrupt never leaves it half-applied."""
from __future__ import annotations

import signal
import threading


class DeferredInterrupt:
    """While active (main thread only: Python delivers signals there), SIGINT is recorded instead of raised;
    `finish()` restores the previous handler and then delivers what arrived."""

    def __init__(self):
        self.pending = False
        self._old = None
        self.active = False

    def start(self) -> None:
        if self.active or threading.current_thread() is not threading.main_thread():
            return
        self._old = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, self._record)
        self.active = True

    def _record(self, signum, frame) -> None:
        self.pending = True

    def stop(self) -> None:
        """Restore the previous handler; the pending flag stays for `deliver`."""
        if self.active:
            signal.signal(signal.SIGINT, self._old)
            self.active = False

    def deliver(self) -> None:
        """Raise (or hand to the previous handler) an interrupt that arrived while active."""
        if not self.pending:
            return
        self.pending = False
        old = self._old
        if old is signal.default_int_handler or old is None:
            raise KeyboardInterrupt
        if callable(old):
            old(signal.SIGINT, None)
