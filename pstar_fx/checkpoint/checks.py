"""What a checkpoint's contents must be before `step.load` applies any of it, so that a refused checkpoint changes
nothing: the model's values (this model's keys, shapes and dtypes), the optimizer's state dict (torch's structure,
over this optimizer's parameters and groups, options that the optimizer accepts), the loss scaler (finite, positive)
and the RNG states (the generator accepts them). Each check raises CheckpointError naming the file (or entry) and
what is wrong; none changes anything.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math

import torch

from ..errors import CheckpointError
from ..ir.graph import Precision, Role
from ..optim import StateDtype
from ..runtime.step_runtime import LossScaler
from ..runtime.store_values import half_precision
from .step_state import StepState

_SCALER_FIELDS = {f.name for f in dataclasses.fields(LossScaler)}


def _real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def key_differences(saved, model) -> str:
    """Which keys a checkpoint's state dict lacks and which it has beyond the model's, as load_state_dict names
    them: a few of each, with the counts."""
    def listed(keys: list) -> str:
        return f"{len(keys)} ({', '.join(map(str, keys[:4]))}{', ...' if len(keys) > 4 else ''})"
    missing = sorted(set(model) - set(saved), key=str)
    unexpected = sorted(set(saved) - set(model), key=str)
    parts = ([f"missing from the checkpoint: {listed(missing)}"] if missing else []) + \
        ([f"not in this model: {listed(unexpected)}"] if unexpected else [])
    return "; ".join(parts)


def same_model(path: str, saved: dict, model: dict) -> None:
    """A checkpoint's model values, by state_dict name -> shape (`saved`), against this model's (`model`): the keys,
    then the shapes, else CheckpointError naming what differs."""
    if set(saved) != set(model):
        raise CheckpointError(f"step.load: {path!r} was saved from another model: {key_differences(saved, model)}")
    differ = [f"{k} {saved[k]} (the model's {model[k]})" for k in model if saved[k] != model[k]]
    if differ:
        raise CheckpointError(f"step.load: {path!r} was saved from another model: shapes differ: "
                              f"{'; '.join(differ[:3])}{' ...' if len(differ) > 3 else ''}")


def model_state(state: StepState, sd, where: str, left_out=()) -> None:
    """`sd` holds exactly this model's state_dict keys but those `left_out` (parameters this step does not train:
    the model keeps its own values for them), each a tensor of the model's shape and dtype (or fp32, for a parameter
    of a half-precision dtype: saved at the full precision the step holds it at)."""
    ref = state.model.state_dict(keep_vars=True)
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"step.load: {where} is not a state dict of tensors")
    trained = sorted(set(left_out) - set(state.frozen_names()))
    if trained:
        raise CheckpointError(f"step.load: {where} leaves out {trained[:3]}, which this step trains (or this model "
                              "lacks): a checkpoint saved with frozen=False loads into a step that freezes the same "
                              "parameters")
    left_out = set(left_out)
    ref = {k: v for k, v in ref.items() if k not in left_out}
    if set(sd) != set(ref):
        raise CheckpointError(f"step.load: {where} was saved from another model: {key_differences(sd, ref)}")
    for k, v in sd.items():
        like = ref[k].dtype
        # a half-precision parameter is saved at the full precision its chunks hold it at (fp32), or as the model's
        # own value where the model held it
        dtypes = (like, torch.float32) if half_precision(like) and \
            state.names.get(k, (None,))[0] is Role.PARAM else (like,)
        if tuple(v.shape) != tuple(ref[k].shape) or v.dtype not in dtypes:
            raise CheckpointError(f"step.load: {where} was saved from another model: '{k}' is {v.dtype} of shape "
                                  f"{tuple(v.shape)}, this model's is {like} of shape {tuple(ref[k].shape)}")


def _plain(x) -> bool:
    """A value torch.optim keeps among a group's options: numbers, strings, None, and tuples or lists of them."""
    if isinstance(x, (tuple, list)):
        return all(_plain(v) for v in x)
    return x is None or isinstance(x, (bool, int, float, str))


@functools.cache
def _option_names() -> frozenset[str]:
    """The options torch.optim's optimizers' constructors take (lr, betas, momentum, ...): a group key among them
    that this optimizer does not take marks another optimizer's group; any other key (a scheduler's 'initial_lr',
    torch's 'param_names', a name of the user's) rides along, as torch keeps it."""
    names = set()
    for cls in vars(torch.optim).values():
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer):
            names |= set(inspect.signature(cls.__init__).parameters)
    return frozenset(names - {"self", "params", "args", "kwargs"})


def param_groups(opt, groups, where: str, call: str = "step.load") -> None:
    """Saved param_groups fit this optimizer: as many groups, each over the same parameter indices as its state_dict()
    packs them, with the options the optimizer takes (and no other optimizer's: `_option_names`)."""
    index: dict[int, int] = {}
    want = [[index.setdefault(id(t), len(index)) for t in g["params"]] for g in opt.param_groups]
    if not isinstance(groups, list) or len(groups) != len(want):
        raise CheckpointError(f"{call}: {where}: the optimizer's param_groups are not {len(want)} groups like "
                              "this optimizer's (saved from another model or another grouping)")
    for i, (g, w) in enumerate(zip(groups, want)):
        if not isinstance(g, dict) or not all(isinstance(k, str) for k in g) or g.get("params") != w:
            raise CheckpointError(f"{call}: {where}: param_groups[{i}] does not hold the parameters this "
                                  "optimizer's group holds (saved from another model or another grouping)")
        if not all(_plain(v) for k, v in g.items() if k != "params"):
            raise CheckpointError(f"{call}: {where}: param_groups[{i}] has options that are not plain values")
        mine, saved = set(opt.defaults), set(g) - {"params"}
        if mine - saved or (saved - mine) & _option_names():
            raise CheckpointError(
                f"{call}: {where}: param_groups[{i}] has the options {sorted(saved & _option_names())}, "
                f"torch.optim.{opt.torch_class.__name__}'s are {sorted(mine)}: saved from another optimizer (load it "
                "into a step compiled with that optimizer)")
        try:
            opt.check_group(f"{call}: {where}: param_groups[{i}]", g)
        except KeyError as e:
            raise CheckpointError(f"{call}: {where}: param_groups[{i}] lacks the option {e}") from None
        except ValueError as e:
            raise CheckpointError(str(e)) from None


def optimizer_state(state: StepState, sd, where: str) -> None:
    """optimizer_state_dict over the step's optimizer, for step.load."""
    optimizer_state_dict(state.optimizer, sd, where)


def optimizer_state_dict(opt, sd, where: str, call: str = "step.load") -> None:
    """The optimizer's state dict in torch's format over this optimizer: groups as `param_groups` checks, and each
    state entry an index of one of its parameters with the keys its group keeps (`state_keys`): floating tensors of
    its shape (Adam's 'exp_avg', 'exp_avg_sq'), finite 0-d numbers (Adam's 'step' a whole number >= 1)."""
    if not isinstance(sd, dict) or set(sd) != {"state", "param_groups"} or not isinstance(sd["state"], dict):
        raise CheckpointError(f"{call}: {where} is not an optimizer state dict ({{'state', 'param_groups'}})")
    param_groups(opt, sd["param_groups"], where, call)
    index = opt.entries()
    for i, s in sd["state"].items():
        if not _count(i) or not 0 <= i < len(index):
            raise CheckpointError(f"{call}: {where}: state for parameter index {i!r}, this optimizer has "
                                  f"{len(index)} parameters")
        shape = tuple(index[i][0].shape)
        group = next(gi for gi, g in enumerate(opt.param_groups) if any(t is index[i][0] for t in g["params"]))
        vectors, scalars = opt.state_keys(group, sd["param_groups"][group])
        if not isinstance(s, dict) or set(s) != set(vectors + scalars) \
                or not all(isinstance(v, torch.Tensor) for v in s.values()):
            raise CheckpointError(f"{call}: {where}: the state of parameter {i} ('{index[i][1]}') is not "
                                  f"{opt.torch_class.__name__}'s {', '.join(scalars + vectors)} tensors (saved from "
                                  "another optimizer, or with other options)")
        for key in scalars:
            value = s[key]
            if value.numel() != 1 or value.dtype.is_complex or value.dtype == torch.bool \
                    or not math.isfinite(float(value.reshape(()))):
                raise CheckpointError(f"{call}: {where}: '{key}' of parameter {i} ('{index[i][1]}') is not a "
                                      "finite number")
        if opt.is_adam and not _whole(float(s["step"].reshape(()))):
            raise CheckpointError(f"{call}: {where}: the step count of parameter {i} ('{index[i][1]}') is not a "
                                  "whole number >= 1")
        for key in vectors:
            v = s[key]
            if not v.is_floating_point() or tuple(v.shape) != shape:
                raise CheckpointError(f"{call}: {where}: '{key}' of parameter {i} ('{index[i][1]}') is {v.dtype} "
                                      f"of shape {tuple(v.shape)}, not a floating tensor of shape {shape}")


def _whole(x: float) -> bool:
    return math.isfinite(x) and x >= 1 and x == int(x)


def loss_scaler(value, where: str) -> dict | None:
    """None, or the fp16 loss scaler's fields, finite and in range; returned with their types."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != _SCALER_FIELDS:
        raise CheckpointError(f"step.load: {where}: the loss scaler is not {sorted(_SCALER_FIELDS)}")
    ok = (_real(value["scale"]) and value["scale"] > 0 and _real(value["growth_factor"])
          and value["growth_factor"] >= 1 and _real(value["backoff_factor"]) and 0 < value["backoff_factor"] <= 1
          and _count(value["growth_interval"]) and value["growth_interval"] >= 1
          and _count(value["good_steps"]) and 0 <= value["good_steps"] < value["growth_interval"])
    if not ok:
        raise CheckpointError(f"step.load: {where}: the loss scaler's values are out of range ({value}): a scale must "
                              "be finite and > 0, good steps a count below the growth interval")
    return {k: (int if k in ("growth_interval", "good_steps") else float)(v) for k, v in value.items()}


def rng(value, device: torch.device, where: str) -> dict:
    """RNG states that this process's generators accept: torch's CPU state (checked on a fresh generator) and, when
    the step runs on CUDA, the device's when saved."""
    if not isinstance(value, dict) or "torch_cpu" not in value or not set(value) <= {"torch_cpu", "torch_cuda"} \
            or not all(isinstance(v, torch.Tensor) and v.dtype == torch.uint8 and v.dim() == 1
                       for v in value.values()):
        raise CheckpointError(f"step.load: {where}: the RNG states are not torch's (uint8 tensors under 'torch_cpu' "
                              "and 'torch_cuda')")
    cpu = value["torch_cpu"]
    try:
        if cpu.shape != torch.get_rng_state().shape:
            raise ValueError(f"{cpu.numel()} bytes")
        torch.Generator().set_state(cpu)
    except (RuntimeError, ValueError) as e:
        raise CheckpointError(f"step.load: {where}: the CPU generator refuses the saved RNG state ({e})") from None
    if "torch_cuda" in value and device.type == "cuda" \
            and value["torch_cuda"].shape != torch.cuda.get_rng_state(device).shape:
        raise CheckpointError(f"step.load: {where}: the saved CUDA RNG state has {value['torch_cuda'].numel()} bytes, "
                              "this device's generator another size")
    return value


def state_dtype_of(state: StepState) -> str:
    """How the step's optimizer stores its moments ("fp32", "bf16", "int8"), for the meta. A checkpoint holds the
    moments in fp32 whatever it was (compressed ones dequantised, which quantise back to the same codes), so one
    saved with any state_dtype loads into a step with any other: the moments are converted, rounded to the loading
    step's state_dtype."""
    layout = getattr(state.optimizer, "layout", None)
    return (layout.state.dtype if layout is not None else StateDtype.FP32).value


def meta(state: StepState, value, where: str, *, fmt: int, keys: set[str]) -> dict:
    """A meta dict of format `fmt` with exactly `keys`: format, precision, device and loss scaler checked (and the
    RNG states and optimizer groups when it holds them); returned with the scaler's values typed."""
    if not isinstance(value, dict) or value.get("format") != fmt:
        raise CheckpointError(f"step.load: {where} is not a pstar-fx checkpoint's meta of format {fmt}")
    later = {"state_dtype", "left_out"}         # entries a meta written before them lacks (fp32; nothing left out)
    if set(value) - later != keys - later or not set(value) <= keys:
        raise CheckpointError(f"step.load: {where}: the meta has the entries {sorted(value)}, not {sorted(keys)}")
    left_out = value.get("left_out", [])
    if not isinstance(left_out, list) or not all(isinstance(n, str) for n in left_out):
        raise CheckpointError(f"step.load: {where}: left_out is not a list of parameter names")
    if value.get("state_dtype", StateDtype.FP32.value) not in {d.value for d in StateDtype}:
        raise CheckpointError(f"step.load: {where}: unknown state_dtype {value['state_dtype']!r} (one of "
                              f"{[d.value for d in StateDtype]})")
    if value["precision"] not in {p.value for p in Precision} or value["device"] not in ("cpu", "cuda"):
        raise CheckpointError(f"step.load: {where}: unknown precision {value['precision']!r} or device "
                              f"{value['device']!r}")
    out = dict(value, loss_scaler=loss_scaler(value["loss_scaler"], where))
    if "rng" in value:
        rng(value["rng"], state.settings.device, where)
    if "param_groups" in value:
        param_groups(state.optimizer, value["param_groups"], where)
    if "world" in value and not (_count(value["world"]) and value["world"] >= 1):
        raise CheckpointError(f"step.load: {where}: the saved world size {value['world']!r} is not a count >= 1")
    return out
