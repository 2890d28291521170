"""What a transformers `Trainer`'s arguments mean for a pstar-fx step, and which of them pstar-fx refuses.

`compile_options` turns `TrainingArguments` into `px.compile`'s options (precision, device, clipping, accumulation)
and `adamw_spec` into `px.AdamW` over the Trainer's two parameter groups (weight decay on the names
`Trainer.get_decay_parameter_names` returns, none on biases and norms; trainable parameters only, as the Trainer's
`create_optimizer` does). `check_supported` raises a ValueError, at the Trainer's construction, for what a pstar-fx
step cannot do the Trainer's way, naming the argument and what to give instead.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from ..optim import AdamW, OptimizerSpec

# TrainingArguments.optim values pstar-fx runs, and the px.AdamW `fused` that matches each: "adamw_torch" is
# torch.optim.AdamW's single-tensor / foreach formula (pstar-fx's fused=False is bit for bit its single-tensor one),
# "adamw_torch_fused" its fused kernel (pstar-fx's default, named fused=True so that the optimizer state a checkpoint
# saves says so: a plain Trainer resuming from it runs the same kernel).
_OPTIMS = {"adamw_torch": False, "adamw_torch_fused": True}


@dataclass(frozen=True)
class StepOptions:
    """px.compile's options decided by the TrainingArguments (the memory options are the PstarTrainer's own)."""
    precision: str             # "fp32", "bf16" or "fp16"
    device: str                # "cpu", "cuda", "cuda:1", ...
    max_grad_norm: float | None
    accumulate: int
    fused: bool | None


def _optim_name(args) -> str:
    optim = args.optim
    return getattr(optim, "value", optim)


def check_supported(trainer, args) -> None:
    """Refuse, with what to change, what a pstar-fx step cannot do the Trainer's way."""
    def refuse(what: str, instead: str) -> None:
        raise ValueError(f"PstarTrainer: {what} is not supported: pstar-fx compiles the whole training step itself "
                         f"(forward, backward, clipping, the AdamW update); {instead}")

    if args.deepspeed:
        refuse("deepspeed", "leave TrainingArguments.deepspeed unset (pstar-fx places parameters, gradients and "
                            "optimizer states in GPU and host memory itself)")
    if args.fsdp:
        refuse("fsdp", "leave TrainingArguments.fsdp unset")
    if args.torch_compile:
        refuse("torch_compile=True", "set torch_compile=False")
    if args.n_gpu > 1:
        refuse(f"training on {args.n_gpu} GPUs from one process (torch.nn.DataParallel)",
               "launch one process per GPU with torchrun (pstar-fx's data parallelism over its ranks), or make one "
               "GPU visible (CUDA_VISIBLE_DEVICES=0)")
    if _optim_name(args) not in _OPTIMS:
        refuse(f"optim={_optim_name(args)!r}", "use optim='adamw_torch_fused' (the default) or 'adamw_torch'; "
                                               "pstar-fx's update is Adam / AdamW only")
    if args.optim_args:
        refuse(f"optim_args={args.optim_args!r}", "leave optim_args unset")
    if trainer.optimizer is not None or getattr(trainer, "optimizer_cls_and_kwargs", None) is not None:
        refuse("an optimizer passed to the Trainer",
               "pass optimizers=(None, None) and set AdamW's options through TrainingArguments (learning_rate, "
               "weight_decay, adam_beta1, ...)")
    if trainer.lr_scheduler is not None:
        refuse("a learning-rate scheduler passed to the Trainer (it would drive another optimizer)",
               "choose one with TrainingArguments.lr_scheduler_type and lr_scheduler_kwargs")
    if args.fp16_full_eval or args.bf16_full_eval:
        refuse("fp16_full_eval / bf16_full_eval (they cast the model)", "evaluation runs at the step's precision")
    if args.auto_find_batch_size:
        refuse("auto_find_batch_size", "choose the batch size; a memory budget too small for it raises "
                                       "px.BudgetError at compile time, before anything runs")
    if args.neftune_noise_alpha is not None:
        refuse("neftune_noise_alpha (a forward hook adding noise outside the traced step)", "leave it unset")
    if getattr(args, "use_liger_kernel", False):
        refuse("use_liger_kernel (it patches the model's modules)", "leave it unset")


def compile_options(args) -> StepOptions:
    """The TrainingArguments' clipping, accumulation, precision, device and AdamW kernel as px.compile options.
    Mixed precision: the Trainer's bf16 / fp16 (autocast over fp32 weights) becomes pstar-fx's (half-precision
    chunks, fp32 master weights and Adam states, fp16 with dynamic loss scaling), on the CPU too."""
    mixed = getattr(args, "mixed_precision", None) or ("bf16" if args.bf16 else "fp16" if args.fp16 else "no")
    precision = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}.get(str(mixed))
    if precision is None:
        raise ValueError(f"PstarTrainer: mixed precision {mixed!r} is not supported; use bf16=True, fp16=True or "
                         "neither (fp32)")
    norm = args.max_grad_norm
    return StepOptions(precision=precision, device=str(args.device),
                       max_grad_norm=float(norm) if norm is not None and norm > 0 else None,
                       accumulate=int(args.gradient_accumulation_steps), fused=_OPTIMS[_optim_name(args)])


def adamw_spec(model: nn.Module, args, decay_names, fused: bool | None) -> OptimizerSpec:
    """px.AdamW with the Trainer's groups: weight_decay on the parameters named in `decay_names`, 0 on the others
    (biases, norms), trainable parameters only; a group left empty is dropped."""
    decay_names = set(decay_names)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params:
        raise ValueError("PstarTrainer: the model has no parameter with requires_grad=True; nothing would train")
    groups = [{"params": [p for n, p in params if n in decay_names], "weight_decay": args.weight_decay},
              {"params": [p for n, p in params if n not in decay_names], "weight_decay": 0.0}]
    return AdamW([g for g in groups if g["params"]], lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                 eps=args.adam_epsilon, weight_decay=args.weight_decay, fused=fused)
