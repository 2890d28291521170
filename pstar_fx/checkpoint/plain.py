"""The plain-files format: a directory of three ordinary torch files and their manifest (see pstar_fx.checkpoint).

- model.pt: the model's state dict, `step.state_dict()`, keyed as `model.state_dict()`;
- optimizer.pt: `step.optimizer.state_dict()`, torch's format;
- meta.pt: the format version, the precision, the device type, the fp16 loss scaler, the RNG states, the
  optimizer's state_dtype (how its moments were stored: "fp32", "bf16", "int8") and `left_out`: the names of the
  frozen parameters model.pt leaves out (`step.save(path, frozen=False)`: a load keeps the model's own values for
  them; a fine-tune's base weights, which its base checkpoint holds).
Each file loads with `torch.load(path, weights_only=True)`, and only so is it read here.
"""
from __future__ import annotations

import dataclasses
import os

import torch

from ..errors import CheckpointError
from . import checks, files, sharded
from .step_state import StepState

FORMAT = 1
FILES = files.DATA_FILES + (files.PLAIN_MANIFEST,)     # the manifest last: a directory without it is not one
META_KEYS = {"format", "precision", "device", "loss_scaler", "rng", "state_dtype", "left_out"}


def contents(state: StepState, left_out: list[str] = ()) -> dict[str, object]:
    """What each data file holds, read whole (with several ranks, collectives: every rank gathers the values); the
    model's values without the `left_out` names."""
    values, leave = state.model_values(), set(left_out)
    return {"model.pt": _to_cpu({k: v for k, v in values.items() if k not in leave}),
            "optimizer.pt": _to_cpu(state.optimizer.state_dict()),
            "meta.pt": _meta(state, left_out)}


def _meta(state: StepState, left_out: list[str]) -> dict:
    scaler = state.scaler
    return {"format": FORMAT, "precision": state.settings.precision.value, "device": state.settings.device.type,
            "loss_scaler": None if scaler is None else dataclasses.asdict(scaler),
            "rng": sharded.rng_state(state.settings.device), "state_dtype": checks.state_dtype_of(state),
            "left_out": list(left_out)}


def _to_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", copy=True)
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(v) for v in x)
    return x


def write(obj, path: str) -> None:
    """One data file, fsynced."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def read_checked(state: StepState, path: str) -> tuple[dict, dict, dict]:
    """(model state dict, optimizer state dict, meta) of the verified checkpoint at `path`, each checked against
    this step (pstar_fx.checkpoint.checks) before anything is applied. With several ranks each maps the files and
    copies only its pieces out of them."""
    meta = checks.meta(state, _read(path, "meta.pt"), os.path.join(path, "meta.pt"), fmt=FORMAT, keys=META_KEYS)
    mmap = state.comm is not None
    model_sd, opt_sd = _read(path, "model.pt", mmap), _read(path, "optimizer.pt", mmap)
    checks.model_state(state, model_sd, os.path.join(path, "model.pt"), meta.get("left_out", ()))
    checks.optimizer_state(state, opt_sd, os.path.join(path, "optimizer.pt"))
    return model_sd, opt_sd, meta


def _read(path: str, name: str, mmap: bool = False):
    """A verified file of a plain checkpoint, read with weights_only=True."""
    file = os.path.join(path, name)
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except OSError as e:
        raise files.described(e, file, "step.load: reading") from e
    except Exception as e:   # noqa: BLE001 - whatever torch.load refused, named with its file
        raise CheckpointError(f"step.load: {file} is not what a save writes (torch.load(weights_only=True) refused "
                              f"it: {type(e).__name__}: {e})") from None
