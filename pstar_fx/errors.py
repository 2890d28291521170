"""Exceptions and warnings a user can cause. Internal invariants are asserts, not these."""
from __future__ import annotations

import os
import sys
import warnings

import torch

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_MODELS = os.path.join(_PACKAGE, "models") + os.sep


def is_own_file(filename: str) -> bool:
    """Whether a source file is pstar-fx's own machinery. Its reference models (pstar_fx/models) are not: they are
    user code like any other, and errors and warnings point into them."""
    f = os.path.abspath(filename)
    return f.startswith(_PACKAGE) and not f.startswith(_MODELS)


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """warnings.warn attributed to the user's line: the first frame outside pstar-fx's own files, however many
    pstar-fx frames lie between, so that moving code inside pstar-fx never changes where a warning points."""
    frame, level = sys._getframe(0), 1
    while frame is not None and is_own_file(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


class PstarError(Exception):
    """Base class of every error pstar-fx raises for bad input."""


class UntraceableError(PstarError):
    """The training step cannot be captured as one static graph.

    The message names the operation and the user's source line that caused it.
    """


class BudgetError(PstarError):
    """The device-memory budget cannot hold what some node needs.

    Raised at compile time, before anything runs, when the plan cannot fit; and at run time when the device could not
    give what the plan counted on (memory the plan does not see: another process, tensors kept outside the step, the
    allocator's fragmentation), in which case the step changed nothing. Carries the node, the bytes it needs (at run
    time: the allocation that failed, 0 if torch did not say) and the bytes available (at run time: the device's free
    memory then).
    """

    def __init__(self, message: str, *, node: str, needed: int, available: int, tier=None):
        super().__init__(message)
        self.node = node
        self.needed = needed
        self.available = available
        self.tier = tier       # the memory that does not fit: None for the device's budget, else its StateHome
        #                        (host_memory, the disk tier's disk_memory); node is "" then


class DeviceMemoryError(BudgetError, torch.OutOfMemoryError):
    """A BudgetError at run time: the device refused an allocation the plan counted within the budget. It is also a
    torch.OutOfMemoryError, so code that already handles the device running out of memory (a batch-size finder, a
    retry loop) handles it too. The step changed nothing."""


class CommitError(PstarError):
    """A step failed after its commit point, while applying the update (a device fault or a bug: nothing of the
    user's runs there), or, with px.compile(atomic=False), after its first host-side update began. Some chunks were
    updated and others not, so the compiled step refuses further use until a checkpoint is loaded
    (`step.load(path)`: parameters, optimizer states and step count together; `load_state_dict` restores only the
    parameters and does not make the step usable again)."""


class ModelHeldError(PstarError):
    """A parameter or buffer of a model that a compiled step holds was used directly. Its current value lives in the
    step's chunks: `step.sync_model()` writes the values back into the model, `step.state_dict()` returns them."""


class DistributedError(PstarError):
    """Multi-GPU: the ranks disagree (on a step's batch shapes and dtypes, the model's modes, its initial values, or
    the compiled graph's settings: raised on every rank before any collective of the step), or a collective failed
    because another rank failed or exited. Every rank must call the step with batches of the same shapes, from a
    model built the same way; when one rank fails, the others get this error (within the process group's timeout)
    instead of waiting for ever."""


class EmptyModelError(PstarError):
    """A model built under `px.init_empty()` was used before pstar-fx gave it values, or its construction did
    something the recording cannot replay exactly. The message names the tensor or op and what to change."""


class CheckpointError(PstarError, ValueError):
    """`step.load` refused a checkpoint directory: a file is truncated or corrupted (its checksum differs from the
    manifest's), the directory has no manifest, the checkpoint is another model's, or a file holds something other
    than what a save writes. The message names the file and the cause. It is raised before anything is applied:
    the step, the model, the optimizer, the loss scaler and the RNG states are as they were before the call. (Only
    a failure while verified files are being read into the step's chunks, such as an I/O error or a file changed
    since it was verified, comes later; the step then refuses to run until a load succeeds, as after CommitError.)"""
