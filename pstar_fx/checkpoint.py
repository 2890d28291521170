"""Checkpoints that resume exactly: `step.save(path)` / `step.load(path)`.

A checkpoint is a directory of three ordinary files, each loadable with `torch.load(path, weights_only=True)`:
- model.pt: the model's state dict, `step.state_dict()` (parameters at full precision, fp32 masters in mixed
  precision, and buffers), keyed as `model.state_dict()`: `model.load_state_dict(torch.load(...))` works in eager
  PyTorch too;
- optimizer.pt: `step.optimizer.state_dict()`, torch.optim.AdamW's (or Adam's) format, options and moments;
- meta.pt: the format version, the precision, the fp16 loss scaler (scale, good steps, growth settings) and the RNG
  states the step draws from: torch's CPU generator, and the device's CUDA generator when the step runs on CUDA.

Not in it: Python's `random` and NumPy's generators, a data loader's position and an lr scheduler's state (save
`sched.state_dict()` yourself) are the user's business; the compiled graphs are not saved (the first step after a
load traces again). Values are per parameter, not per chunk, so a checkpoint loads into a step compiled with another
chunk_size or budget (or into eager PyTorch).

A save is atomic: the files are written into a fresh sibling directory (each fsynced), which then takes the
checkpoint's name by rename; an existing checkpoint there is renamed aside first and removed after. A save that is
interrupted leaves either the old checkpoint or the new one under `path`, or, between the two renames, nothing under
`path` and both beside it (the load error names them): never a half-written checkpoint that `load` accepts.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import uuid

import torch

from .ownership import holder, model_tensors

FORMAT = 1
FILES = ("model.pt", "optimizer.pt", "meta.pt")     # meta.pt last: a directory without it is not a checkpoint


def _norm(path) -> str:
    p = os.path.normpath(os.fspath(path))
    if p in (".", "/", ""):
        raise ValueError(f"step.save/load: give a checkpoint directory name (e.g. 'ckpt'), got {path!r}")
    return p


def _to_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", copy=True)
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(v) for v in x)
    return x


def _model_values(step) -> dict[str, torch.Tensor]:
    """The values the next step would train on: the step's chunks when it holds the model, the holder's when
    another step does, the model's own when no step does (before the first step, or after sync_model())."""
    owners = {holder(t) for t in model_tensors(step._model).values()}
    owners.discard(None)
    if not owners:
        return {k: v.detach().clone() for k, v in step._model.state_dict().items()}
    (owner,) = owners
    return owner.state_dict()


def _rng_state(device: torch.device) -> dict:
    out = {"torch_cpu": torch.get_rng_state()}
    if device.type == "cuda":
        out["torch_cuda"] = torch.cuda.get_rng_state(device)
    return out


def _meta(step) -> dict:
    scaler = step._scaler
    return {"format": FORMAT, "precision": step.settings.precision.value, "device": step.settings.device.type,
            "loss_scaler": None if scaler is None else dataclasses.asdict(scaler),
            "rng": _rng_state(step.settings.device)}


def _write(obj, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(step, path) -> None:
    """Write model values, optimizer state, loss scaler and RNG states to the directory `path` (see the module
    docstring). Reads values only; the step's state is not changed."""
    path = _norm(path)
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ValueError(f"step.save: {path!r} exists and is not a directory; pass a directory name")
        foreign = sorted(set(os.listdir(path)) - set(FILES))
        if foreign:
            raise ValueError(f"step.save: {path!r} holds files that are not a pstar-fx checkpoint's "
                             f"({foreign[:3]}); save into a new or an old checkpoint directory, which is replaced "
                             "as a whole")
    # read everything before writing anything
    contents = {"model.pt": _to_cpu(_model_values(step)),
                "optimizer.pt": _to_cpu(step.optimizer.state_dict()),
                "meta.pt": _meta(step)}
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    tmp, old = f"{path}.tmp-{tag}", f"{path}.old-{tag}"
    os.mkdir(tmp)
    try:
        for name in FILES:
            _write(contents[name], os.path.join(tmp, name))
        _fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync_dir(parent)
    shutil.rmtree(old, ignore_errors=True)


def _read(path: str, name: str):
    return torch.load(os.path.join(path, name), map_location="cpu", weights_only=True)


def load(step, path) -> None:
    """Restore everything `save` wrote: model values, optimizer state, loss scaler, RNG states. Works before the
    first step (values wait in the model and the optimizer until the chunks exist) and after a failed step
    (CommitError): every value is replaced, and the step may be called again."""
    path = _norm(path)
    missing = [n for n in FILES if not os.path.isfile(os.path.join(path, n))]
    if missing:
        parent = os.path.dirname(os.path.abspath(path))
        base = os.path.basename(path)
        aside = sorted(n for n in os.listdir(parent) if n.startswith(base + ".old-") or n.startswith(base + ".tmp-")) \
            if os.path.isdir(parent) else []
        hint = (f"; an interrupted save left {aside} beside it: '.old-*' is the previous checkpoint, a complete "
                "'.tmp-*' the new one; rename the one you want to " + repr(base)) if aside else ""
        raise FileNotFoundError(f"step.load: {path!r} is not a complete pstar-fx checkpoint (missing {missing})"
                                + hint)
    meta = _read(path, "meta.pt")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"step.load: {path!r}/meta.pt is not a pstar-fx checkpoint of format {FORMAT}")
    model_sd = _read(path, "model.pt")
    opt_sd = _read(path, "optimizer.pt")

    ref = step._model.state_dict()
    if set(model_sd) != set(ref) or any(tuple(v.shape) != tuple(ref[k].shape) for k, v in model_sd.items()):
        wrong = sorted(set(model_sd) ^ set(ref)) or [k for k, v in model_sd.items() if v.shape != ref[k].shape]
        raise ValueError(f"step.load: {path!r} was saved from another model: keys or shapes differ ({wrong[:3]})")
    # optimizer first: it checks everything before it changes anything, so a refused checkpoint changes nothing
    step.optimizer.load_state_dict(opt_sd)
    # model values: into the chunks when this step holds the model, else into the model, which the next step takes
    # (another step holding the model gives it back first)
    tensors = model_tensors(step._model).values()
    if step._store is not None and all(holder(t) is step for t in tensors):
        step.load_state_dict(model_sd)
    else:
        for other in {holder(t) for t in tensors} - {None}:
            other.sync_model()
        step._model.load_state_dict(model_sd)
    if step._scaler is not None and meta["loss_scaler"] is not None:
        for k, v in meta["loss_scaler"].items():
            setattr(step._scaler, k, v)
    rng = meta["rng"]
    torch.set_rng_state(rng["torch_cpu"])
    if "torch_cuda" in rng and step.settings.device.type == "cuda":
        torch.cuda.set_rng_state(rng["torch_cuda"], step.settings.device)
    step._broken = None
