"""Optimizer descriptions for `px.compile`: what each optimizer's states are per chunk and how its options are
checked. px.Adam / px.AdamW (adam.py) run pstar-fx's own fused chunk kernels; px.SGD, px.Lion and
px.optim_from_torch (elementwise.py, lion.py) run torch's own update on flat chunk views, for any optimizer whose
update is elementwise. spec.py holds what they share: the chunk state layout and the description itself.
"""
from .adam import Adam, AdamConfig, AdamW, check_options
from .elementwise import SGD, TorchConfig, check_group, optim_from_torch, probe
from .lion import Lion, LionOptimizer
from .spec import ADAM_STATE, NO_STATE, STEPS, OptimizerLayout, OptimizerSpec, StateLayout, is_adam
from .state_dtype import INT8_BLOCK, StateDtype, parse_state_dtype

__all__ = ["Adam", "AdamW", "AdamConfig", "check_options", "is_adam", "SGD", "Lion", "LionOptimizer",
           "optim_from_torch", "TorchConfig", "check_group", "probe", "OptimizerSpec", "OptimizerLayout", "StateLayout",
           "ADAM_STATE", "NO_STATE", "STEPS", "StateDtype", "INT8_BLOCK", "parse_state_dtype"]
