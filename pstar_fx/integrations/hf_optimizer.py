"""The optimizer a transformers `Trainer` holds when a pstar-fx step trains: `step.optimizer` seen through a door
whose `step()` does nothing.

The Trainer calls `optimizer.step()` after each accumulation group's last micro-batch, and its learning-rate
scheduler writes `param_groups[i]["lr"]` after that. In a PstarTrainer the compiled step has already run the update
by then (with the lr the scheduler set after the previous update, as the Trainer's own optimizer would), so `step()`
and `zero_grad()` do nothing, while `param_groups`, `defaults`, `state_dict()` and `load_state_dict()` are
`step.optimizer`'s own: the scheduler drives the lr the next compiled step reads, and the Trainer's checkpoints
hold the optimizer in torch.optim.AdamW's format.
"""
from __future__ import annotations

import torch


class TrainerOptimizer(torch.optim.Optimizer):
    """`live` (a compiled step's optimizer) as the Trainer's optimizer; see the module docstring. torch.optim's
    `Optimizer.__init__` is not called: there are no tensors of its own, every group and state is `live`'s."""

    def __init__(self, live: torch.optim.Optimizer):    # torch's Optimizer.__init__ deliberately not called
        self._live = live

    @property
    def param_groups(self):
        return self._live.param_groups

    @param_groups.setter
    def param_groups(self, groups):
        self._live.param_groups = groups

    @property
    def defaults(self):
        return self._live.defaults

    @defaults.setter
    def defaults(self, defaults):
        self._live.defaults = defaults

    @property
    def state(self):
        return self._live.state

    @state.setter
    def state(self, state):
        self._live.state = state

    def step(self, closure=None):
        """Nothing: the compiled step ran this update (a closure cannot run again and is refused)."""
        if closure is not None:
            raise RuntimeError("a pstar-fx step runs the update itself: optimizer.step(closure) cannot evaluate "
                               "the closure; call the PstarTrainer's training_step instead")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: a compiled step's gradients live in its chunks, one step long."""

    def state_dict(self):
        """`live`'s, with its states in host memory: the Trainer writes them to a file, and the states of a model
        larger than the GPU do not fit there at once (torch's load_state_dict moves them to the parameters' device
        when they are loaded)."""
        return self._live.state_dict(device="cpu")

    def load_state_dict(self, state_dict) -> None:
        self._live.load_state_dict(state_dict)

    def add_param_group(self, param_group) -> None:
        raise RuntimeError("a pstar-fx step's parameter groups are fixed when it is compiled; build a new "
                           "PstarTrainer to train other parameters")

    def __repr__(self) -> str:
        return f"TrainerOptimizer({self._live!r})"
