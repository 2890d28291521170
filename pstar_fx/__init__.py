"""pstar-fx: train models larger than the GPU by compiling the training step and planning every chunk move."""
from .errors import (BudgetError, CheckpointError, CommitError, DistributedError, ModelHeldError, PstarError,
                     UntraceableError)
from .optim import Adam, AdamW
from .api import compile, CompiledStep
from .frontend.init_empty import EmptyModelError, init_empty
from .ir.graph import TrainGraph
from .ownership import sync_model
from .planning import PlanReport, plan
from .timeline import plot_memory

__all__ = ["compile", "CompiledStep", "Adam", "AdamW", "BudgetError", "UntraceableError", "PstarError", "CommitError", "ModelHeldError",
           "CheckpointError",
           "DistributedError", "TrainGraph", "plot_memory", "init_empty", "EmptyModelError", "plan",
           "PlanReport", "sync_model"]
__version__ = "0.1.0"
