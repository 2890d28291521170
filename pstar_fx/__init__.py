"""pstar-fx: train models larger than the GPU by compiling the training step and planning every chunk move.

The package follows the pipeline, each folder importing only those before it: ir (the graph every stage shares),
cost (the cost model), frontend (tracing), passes (planning), runtime (running: no planner), checkpoint (files), api
(what users call), integrations (Hugging Face); below them all units, errors, interrupts, optim (optimizer
descriptions) and models (the reference GPT). The public names are these.
"""
from .api.compile import compile
from .api.model_state import sync_model
from .api.plan import PlanReport, plan
from .api.step import CompiledStep
from .api.timeline import plot_memory
from .errors import (BudgetError, CheckpointError, CommitError, DeviceMemoryError, DistributedError, EmptyModelError,
                     ModelHeldError, PstarError, UntraceableError)
from .frontend.init_empty import init_empty
from .ir.graph import TrainGraph
from .optim import SGD, Adam, AdamW, Lion, LionOptimizer, optim_from_torch

__all__ = ["compile", "CompiledStep", "Adam", "AdamW", "SGD", "Lion", "LionOptimizer", "optim_from_torch",
           "BudgetError", "DeviceMemoryError", "UntraceableError", "PstarError", "CommitError", "ModelHeldError",
           "CheckpointError", "DistributedError", "TrainGraph", "plot_memory", "init_empty", "EmptyModelError", "plan",
           "PlanReport", "sync_model"]
__version__ = "0.1.0"
