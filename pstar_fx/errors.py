"""Exceptions a user can cause. Internal invariants are asserts, not these."""
from __future__ import annotations


class PstarError(Exception):
    """Base class of every error pstar-fx raises for bad input."""


class UntraceableError(PstarError):
    """The training step cannot be captured as one static graph.

    The message names the operation and the user's source line that caused it.
    """


class BudgetError(PstarError):
    """The device-memory budget cannot hold what some node needs.

    Raised at compile time, before anything runs. Carries the node, the bytes it needs and the bytes available.
    """

    def __init__(self, message: str, *, node: str, needed: int, available: int):
        super().__init__(message)
        self.node = node
        self.needed = needed
        self.available = available
