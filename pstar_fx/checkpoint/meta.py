"""What both checkpoint formats keep beside the values: each rank's RNG states and the fp16 loss scaler, taken by
`rng_state` when saving and put back by `apply_meta`, the last thing a load does (after every check has passed and
every value is in)."""
from __future__ import annotations

import torch

from .step_state import StepState


def rng_state(device: torch.device) -> dict:
    """This process's RNG states: torch's CPU generator, and the device's where it is a GPU."""
    out = {"torch_cpu": torch.get_rng_state()}
    if device.type == "cuda":
        out["torch_cuda"] = torch.cuda.get_rng_state(device)
    return out


def apply_meta(state: StepState, meta: dict) -> None:
    """The loss scaler and this rank's RNG states."""
    if state.scaler is not None and meta["loss_scaler"] is not None:
        for k, v in meta["loss_scaler"].items():
            setattr(state.scaler, k, v)
    rng = meta["rng"]
    torch.set_rng_state(rng["torch_cpu"])
    if "torch_cuda" in rng and state.settings.device.type == "cuda":
        torch.cuda.set_rng_state(rng["torch_cuda"], state.settings.device)
