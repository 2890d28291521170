"""`PstarTrainer`: a transformers `Trainer` whose training step is a pstar-fx compiled step.

    from pstar_fx.integrations.hf import PstarTrainer
    trainer = PstarTrainer(model=model, args=TrainingArguments(...), train_dataset=..., device_memory="40GiB")
    trainer.train()

The model is a plain transformers model (or a peft model: only parameters with requires_grad train). What the
Trainer does, and what pstar-fx does instead:

- The step: `px.compile(model, optimizer=px.AdamW(<the Trainer's two groups>), max_grad_norm=args.max_grad_norm,
  accumulate=args.gradient_accumulation_steps, precision=<args' bf16 / fp16 / fp32>)` over the Trainer's own
  `compute_loss` (label smoothing, `compute_loss_func` and subclass overrides included), compiled lazily at the first
  batch, whose keys become the model's keyword arguments. The Trainer collects an accumulation group's micro-batches
  (`get_batch_samples`); its last `training_step` call runs the whole group as one pstar-fx step on the micro-batches
  stacked along dimension 0 (so they must have equal shapes: pad to a fixed length), and returns the group's loss
  (the earlier calls return 0: the Trainer's logged loss, a sum over the group, is the same). Each micro-batch's loss
  is scaled as the Trainer scales it: divided by the group's label-token count (`num_items_in_batch`, transformers
  5.x) where the model takes it, else by the number of micro-batches.
- The optimizer: `step.optimizer` (torch.optim.AdamW) behind `TrainerOptimizer`, whose `step()` does nothing (the
  compiled step updated already), so the Trainer's scheduler sets the lr every compiled step reads.
- `max_grad_norm`: clipping inside the step; the logged grad_norm is `step.last_step.grad_norm`.
- Evaluation (`evaluate()`, `eval_strategy`, `predict()`): a forward-only pstar-fx function
  (`px.compile(model, optimizer=None)`) over the same `compute_loss`, reading the training step's chunks in place;
  compiled again for a new model (`model_init`).
- Saving (`save_steps`, `save_model`): the values are given back to the model (`sync_model`) and saved by the Trainer
  in Hugging Face format (safetensors); a checkpoint-N folder also holds `pstar_fx/` (`step.save`: model, optimizer,
  loss scaler, RNG), which `resume_from_checkpoint` loads (`step.load`), so a resumed run continues bit for bit.
- After `train()`, and after an `evaluate()` / `predict()` outside training, the model holds its values again: it
  can be used eagerly (`generate`, `save_pretrained`).
- Several processes (`torchrun`, one per GPU; gloo ranks on the CPU): the step is pstar-fx's data parallel one, each
  rank training on its share of the batches (the Trainer's distributed sampler) with every chunk sharded over the
  ranks; the model is not wrapped in DistributedDataParallel (`_wrap_model`: pstar-fx reduces the gradients in its
  chunks). Saving and evaluation are collectives there as the Trainer's are: every rank gives the model its values
  back before rank 0 writes it, every rank reads the optimizer's state dict (gathered from their shards) before rank
  0 writes it, and every rank writes its own pieces of `pstar_fx/` (a sharded checkpoint: `output_dir` on a file
  system the ranks share). Token tensors a collator padded per batch are padded to the longest over the ranks (one
  shape on every rank). An exception on one rank ends train() there without giving the model back (a collective
  the other ranks would never join).
Refused at construction, with what to change (hf_args.check_supported): DeepSpeed, FSDP, torch_compile, several
GPUs in one process (DataParallel), optimizers other than AdamW, an optimizer or scheduler passed in,
fp16/bf16_full_eval, auto_find_batch_size, NEFTune, Liger kernels.
"""
from __future__ import annotations

import contextlib
import copy
import math
import os

import torch
import torch.nn as nn
from transformers import Trainer
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME
from transformers.training_args import ParallelMode

from ..api.compile import compile as px_compile
from ..api.model_state import holders, sync_model
from ..api.step import CompiledStep
from .hf_args import StepOptions, adamw_spec, check_supported, compile_options
from .hf_optimizer import TrainerOptimizer

STEP_STATE_DIR = "pstar_fx"      # the step's checkpoint (step.save) inside the Trainer's checkpoint-N folder


class PstarTrainer(Trainer):
    """A `transformers.Trainer` that trains through a pstar-fx compiled step (see the module docstring).

    Takes the Trainer's arguments, plus pstar-fx's memory options: `device_memory` (the device budget, bytes or a
    string such as "40GiB"; None: the device's free memory), `chunk_size`, `remat` and `atomic` (as in px.compile).
    """

    def __init__(self, *args, device_memory=None, chunk_size: int | None = None, remat="auto", atomic: bool = True,
                 **kwargs):
        self._memory = dict(device_memory=device_memory, chunk_size=chunk_size)
        self._remat, self._atomic = remat, atomic
        self._step: CompiledStep | None = None
        self._eval = None                          # the forward-only function, compiled at the first evaluation
        self._eval_model = None                    # the model it was compiled for (model_init may build another)
        self._group: list[dict] = []               # micro-batches of the accumulation group so far
        self._group_size = 0
        self._group_items = None                   # the group's num_items_in_batch
        super().__init__(*args, **kwargs)
        check_supported(self, self.args)
        self._options: StepOptions = compile_options(self.args)
        # pstar-fx places the model's tensors itself: accelerate must not move the whole model to the device
        self.accelerator.device_placement = False

    # -- what the Trainer sets up ------------------------------------------------------------------------------
    def _build_accelerator_args(self, **kwargs):
        """No autocast from accelerate: the mixed precision is the pstar-fx step's (hf_args.compile_options)."""
        args = super()._build_accelerator_args(**kwargs)
        args["mixed_precision"] = "no"
        return args

    def _move_model_to_device(self, model: nn.Module, device) -> None:
        """Nothing: the compiled step copies the model into its chunks on the device."""

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader=None) -> nn.Module:
        """With several ranks, the model as the training and evaluation loops hold it: not in DistributedDataParallel
        (which would hold every parameter's gradient node, and reduce gradients pstar-fx reduces in its chunks), in
        a module of its own (`_Unwrapped`) so that the Trainer does not ask accelerate to prepare it (for an
        evaluation too: that would set attributes on the model, a new compile key for the step)."""
        if self.args.parallel_mode == ParallelMode.DISTRIBUTED:       # (torchrun, one process too: accelerate
            return model if isinstance(model, _Unwrapped) else _Unwrapped(self.model)   # wraps that on the CPU)
        return super()._wrap_model(model, training, dataloader)

    def create_optimizer(self, model=None):
        """The pstar-fx step (compiled at its first batch) and its optimizer as the Trainer's."""
        if self.optimizer is None:
            model = self.model
            opts = self._options
            spec = adamw_spec(model, self.args, self.get_decay_parameter_names(model), opts.fused)
            self._step = px_compile(model, optimizer=spec, precision=opts.precision, device=opts.device,
                                    max_grad_norm=opts.max_grad_norm, accumulate=opts.accumulate, remat=self._remat,
                                    atomic=self._atomic, **self._memory)(self._micro_batch_loss)
            self.optimizer = TrainerOptimizer(self._step.optimizer)
        return self.optimizer

    @property
    def step(self) -> CompiledStep | None:
        """The pstar-fx step (None before training set it up): its summary(), graphs, last_step, ..."""
        return self._step

    # -- training ---------------------------------------------------------------------------------------------
    def _loss_is_scaled(self, num_items) -> bool:
        """Whether the Trainer takes the loss as already normalised over the accumulation group (its rule)."""
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is not None:
            return scaled
        return (self.model_accepts_loss_kwargs and num_items is not None) or self.compute_loss_func is not None

    def _micro_batch_loss(self, model, inputs: dict, num_items, scale: int):
        """Traced by pstar-fx once per micro-batch: the Trainer's loss times `scale`, the number of micro-batches
        (pstar-fx divides each micro-batch's loss by it), where the Trainer does not divide the loss itself."""
        n = None if num_items is None else num_items[0]          # (1,) slice of the group's count -> 0-d
        loss = self.compute_loss(model, inputs, num_items_in_batch=n)
        return loss * scale if scale != 1 else loss

    def get_train_dataloader(self):
        """The Trainer's, checked before training starts: every accumulation group the run reaches must be whole."""
        loader = super().get_train_dataloader()
        try:
            batches = len(loader)
        except TypeError:            # an iterable dataset: get_batch_samples checks each group as it comes
            return loader
        k, args = self.args.gradient_accumulation_steps, self.args
        per_epoch = max(math.ceil(batches / k), 1)                  # the Trainer's updates per epoch
        steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * per_epoch)
        if batches % k and steps >= per_epoch:
            raise ValueError(self._short_group(batches % k, f"{batches} batches per epoch"))
        b = self._train_batch_size
        examples = len(self.train_dataset) if hasattr(self.train_dataset, "__len__") else None
        if (k > 1 and not args.dataloader_drop_last and args.world_size == 1 and examples is not None
                and examples % b and steps >= per_epoch):
            raise ValueError(
                f"PstarTrainer: {examples} training examples in batches of {b} end each epoch with a batch of "
                f"{examples % b}, in an accumulation group beside batches of {b}: the pstar-fx step runs a group as "
                "one batch split into equal micro-batches. Train on a multiple of per_device_train_batch_size x "
                f"gradient_accumulation_steps = {b * k} examples, or set dataloader_drop_last=True where the full "
                f"batches per epoch are a multiple of {k}")
        return loader

    def _short_group(self, size: int, where: str) -> str:
        k, b, w = self.args.gradient_accumulation_steps, self.args.per_device_train_batch_size, self.args.world_size
        ranks = f" x {w} ranks" if w > 1 else ""
        return (f"PstarTrainer: {where} leave a last accumulation group of {size} micro-batches, not "
                f"gradient_accumulation_steps={k}: the pstar-fx step is compiled for groups of {k}. Make the batches "
                f"per epoch a multiple of {k}: train on a multiple of per_device_train_batch_size x "
                f"gradient_accumulation_steps{ranks} = {b * k * w} examples (dataloader_drop_last=True alone drops "
                "only a short last batch, not a short group), choose a gradient_accumulation_steps that divides "
                "the batches per epoch, or stop before the epoch's end with max_steps")

    def get_batch_samples(self, epoch_iterator, num_batches: int, device):
        batch_samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        if batch_samples and len(batch_samples) != self.args.gradient_accumulation_steps:
            raise ValueError(self._short_group(len(batch_samples), "the training data's batches"))
        self._group, self._group_size, self._group_items = [], len(batch_samples), num_items
        return batch_samples, num_items

    def training_step(self, model: nn.Module, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
        """Collects the group's micro-batches; the last runs the pstar-fx step on all of them and returns the group's
        loss (the earlier ones return 0)."""
        model.train()
        self._group.append(self._prepare_inputs(inputs))
        if len(self._group) < self._group_size:
            return torch.zeros((), device=self.args.device)
        k = self._group_size
        batch = _stack(self._group, self._ranks_longest(self._group))
        self._group = []
        items = self._group_items
        if items is not None:
            items = torch.as_tensor(items, device=self.args.device).reshape(1).expand(k).contiguous()
        scale = k if self._loss_is_scaled(items) else 1
        loss = self._step(batch, items, scale)
        stats = self._step.last_step
        if stats is not None and stats.skipped and hasattr(self.optimizer, "_is_overflow"):
            self.optimizer._is_overflow = True     # fp16 overflow: accelerate's flag, so the scheduler waits too
        elif hasattr(self.optimizer, "_is_overflow"):
            self.optimizer._is_overflow = False
        return loss.to(self.args.device)

    def _ranks_longest(self, micro_batches: list[dict]) -> list[int] | None:
        """With several ranks, each padded sequence's longest length over every rank's micro-batches (a collective:
        the ranks' steps need batches of one shape, where a collator pads each batch to its own longest); None with
        one."""
        if self.args.world_size == 1:
            return None
        local = torch.tensor(_longest(micro_batches), device=self.args.device)
        return self.accelerator.gather(local).reshape(-1, len(PADDING)).amax(0).tolist()

    def _clip_grad_norm(self, model):
        """The norm the step measured before clipping (it clipped inside)."""
        return self._grad_norm()

    def _get_grad_norm(self, model, grad_norm=None):
        return grad_norm if grad_norm is not None else self._grad_norm()

    def _grad_norm(self) -> float | None:
        stats = self._step.last_step if self._step is not None else None
        return None if stats is None else getattr(stats, "grad_norm", None)

    def train(self, *args, **kwargs):
        with self._giving_back():   # (an exception or Ctrl-C too: the model is the user's again, trained values)
            return super().train(*args, **kwargs)

    @contextlib.contextmanager
    def _giving_back(self, when: bool = True):
        """Gives the model its values back after the block (`when`). After an exception with several ranks, not:
        giving back gathers every rank's shards, and the other ranks are elsewhere (in a collective of the
        Trainer's, or gone), so it would wait for them for ever; the exception goes on, the step keeps the model
        (`trainer.step.sync_model()` on every rank gives it back)."""
        try:
            yield
        except BaseException:
            if when and self.args.world_size == 1:
                self._give_back()
            raise
        if when:
            self._give_back()

    # -- evaluation -------------------------------------------------------------------------------------------
    def _eval_outputs(self, model, inputs: dict, num_items, has_loss: bool, loss_only: bool):
        """Traced by pstar-fx, forward only: the loss and the model's tensor outputs (what prediction_step keeps)."""
        if has_loss:
            loss, outputs = self.compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items)
        else:
            loss, outputs = None, model(**inputs)
        out = {} if loss is None else {"loss": loss.detach().mean()}
        if not loss_only:
            items = outputs.items() if isinstance(outputs, dict) else enumerate(outputs[1 if has_loss else 0:])
            out["outputs"] = {str(k): v for k, v in items if k != "loss" and _is_tensors(v)}
        return out

    def prediction_step(self, model: nn.Module, inputs: dict, prediction_loss_only: bool, ignore_keys=None):
        """The Trainer's prediction_step, with the forward run as a pstar-fx forward-only function."""
        has_labels = bool(self.label_names) and all(inputs.get(k) is not None for k in self.label_names)
        return_loss = inputs.get("return_loss")
        if return_loss is None:
            return_loss = self.can_return_loss
        has_loss = has_labels or (not self.label_names and bool(return_loss))
        inputs = dict(self._prepare_inputs(inputs))       # (a collator's BatchEncoding is a mapping, not a dict)
        if self.args.world_size > 1:
            inputs = _padded_alike([inputs], self._ranks_longest([inputs]))[0]
        if ignore_keys is None:
            config = getattr(self.model, "config", None)
            ignore_keys = [] if config is None else getattr(config, "keys_to_ignore_at_inference", ["cache"])
        labels = None
        if has_loss:
            labels = tuple(inputs.get(name).detach() if inputs.get(name) is not None else None
                           for name in self.label_names)
            labels = labels[0] if len(labels) == 1 else labels
        num_items = self._get_num_items_in_batch([inputs], self.args.device) if has_loss else None
        if self._eval is None or self._eval_model is not self.model:
            opts = self._options
            self._eval = px_compile(self.model, optimizer=None, precision=opts.precision, device=opts.device,
                                    **self._memory)(self._eval_outputs)
            self._eval_model = self.model
        out = self._eval(inputs, num_items, has_loss, prediction_loss_only)
        loss = out.get("loss")
        if prediction_loss_only:
            return loss, None, None
        logits = tuple(v for k, v in out["outputs"].items() if k not in list(ignore_keys) + ["loss"])
        return loss, (logits[0] if len(logits) == 1 else logits), labels

    def evaluate(self, *args, **kwargs):
        with self._giving_back(not self.is_in_train):
            return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        with self._giving_back(not self.is_in_train):
            return super().predict(*args, **kwargs)

    # -- saving and resuming ----------------------------------------------------------------------------------
    def _give_back(self) -> None:
        """The model holds its own (trained) values again; the next step takes them back."""
        if holders(self.model):
            sync_model(self.model)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The Trainer's, with the trained values given back to the model first, on every rank (with several, a
        collective: rank 0 alone writes the files)."""
        self._give_back()
        super().save_model(output_dir, _internal_call)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Hugging Face format, with the trained values (given back to the model first). `save_pretrained` writes
        the architecture and dtype into the model's config as it saves: into a copy's (`_configs_kept`), so the
        step's key of the model stays as it was (no new trace after each save; with several ranks only rank 0
        saves, and the ranks must keep one model)."""
        self._give_back()
        with _configs_kept(self.model):
            super()._save(output_dir, state_dict=state_dict)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The Trainer's optimizer (torch format) and scheduler, and the pstar-fx step's own checkpoint (frozen
        parameters, a LoRA fine-tune's base weights, left out: the resumed model has them). With several ranks the
        optimizer's state dict is gathered from every rank's shards, a collective, so every rank reads it (the
        Trainer's own code reads it on the main process only), and every rank writes its pieces of the step's
        sharded checkpoint, which holds the frozen parameters too (the format holds every value)."""
        if self._step is None or self.args.world_size == 1:
            super()._save_optimizer_and_scheduler(output_dir)
            if self._step is not None and self.args.should_save:
                self._step.save(os.path.join(output_dir, STEP_STATE_DIR), frozen=False)
            return
        optimizer = self.optimizer.state_dict()
        if self.args.should_save:
            torch.save(optimizer, os.path.join(output_dir, OPTIMIZER_NAME))
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
        self._step.save(os.path.join(output_dir, STEP_STATE_DIR))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        self._give_back()            # the Trainer loads the weights into the model itself
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self) -> None:
        self._give_back()
        super()._load_best_model()

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The Trainer's optimizer and scheduler states, then the step's checkpoint where there is one (model,
        optimizer, loss scaler and RNG exactly as they were)."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and self._step is not None:
            path = os.path.join(checkpoint, STEP_STATE_DIR)
            if os.path.isdir(path):
                self._step.load(path)


@contextlib.contextmanager
def _configs_kept(model: nn.Module):
    """Within: each configuration object a module of `model` holds as `config` (transformers' PreTrainedConfig,
    shared by many modules) replaced by one copy of it; after, the originals back, as they were."""
    held = [(m, m.__dict__["config"]) for m in model.modules() if callable(getattr(m.__dict__.get("config"),
                                                                                    "to_dict", None))]
    copies: dict[int, object] = {}
    for m, cfg in held:
        m.__dict__["config"] = copies.setdefault(id(cfg), copy.deepcopy(cfg))
    try:
        yield
    finally:
        for m, cfg in held:
            m.__dict__["config"] = cfg


class _Unwrapped(nn.Module):
    """The model the Trainer's loop holds with several ranks (PstarTrainer._wrap_model): the model itself as
    `module`, called through."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def _is_tensors(v) -> bool:
    """A tensor, or a tuple / list of tensors (hidden states, attentions): outputs a prediction step gathers."""
    if isinstance(v, torch.Tensor):
        return True
    return isinstance(v, (tuple, list)) and len(v) > 0 and all(isinstance(x, torch.Tensor) for x in v)


# what a padded position holds in each token tensor a collator pads (with attention_mask, the padding is masked),
# by the sequence it belongs to: the input's, and the labels' (a seq2seq model's decoder side; for a causal or
# masked LM the same length as the input's, in each micro-batch)
PADDING = ({"input_ids": 0, "attention_mask": 0, "token_type_ids": 0},
           {"labels": -100, "decoder_input_ids": 0, "decoder_attention_mask": 0})


def _longest(micro_batches: list[dict]) -> list[int]:
    """For each of PADDING's sequences, the longest length its 2-d token tensors have in the micro-batches (0: none
    has one), where every micro-batch has an attention_mask (what _padded_alike pads)."""
    if not all(isinstance(mb.get("attention_mask"), torch.Tensor) for mb in micro_batches):
        return [0] * len(PADDING)
    return [max((mb[k].shape[1] for mb in micro_batches for k in keys
                 if isinstance(mb.get(k), torch.Tensor) and mb[k].dim() == 2), default=0) for keys in PADDING]


def _padded_alike(micro_batches: list[dict], at_least: list[int] | None = None) -> list[dict]:
    """Micro-batches of one group padded per batch to different lengths (a collator's dynamic padding): their token
    tensors (PADDING's keys, all 2-d) right-padded to the group's longest, each sequence on its own (a seq2seq
    batch's labels may be shorter or longer than its input_ids), the padding masked (attention_mask 0, labels -100:
    the loss and its token count are those of the unpadded micro-batch; a decoder's padded inputs come after its
    real ones, which a causal decoder does not let them change). Only where every micro-batch has an
    attention_mask and each sequence's tensors share one length in it; otherwise, and for any other tensor, as
    given. `at_least`: for each of PADDING's sequences, a length to pad to where it is longer than the group's (the
    longest of every rank's, so that the ranks' batches have one shape)."""
    if not all(isinstance(mb.get("attention_mask"), torch.Tensor) for mb in micro_batches):
        return micro_batches
    out = [dict(mb) for mb in micro_batches]
    for keys in PADDING:
        lengths = [{mb[k].shape[1] for k in keys if isinstance(mb.get(k), torch.Tensor) and mb[k].dim() == 2}
                   for mb in micro_batches]
        seen = set().union(*lengths)
        if any(len(ls) > 1 for ls in lengths) or not seen:
            continue
        longest = max(seen | {0 if at_least is None else at_least[PADDING.index(keys)]})
        if seen == {longest}:
            continue
        for mb in out:
            for k, fill in keys.items():
                t = mb.get(k)
                if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[1] < longest:
                    mb[k] = torch.cat([t, t.new_full((t.shape[0], longest - t.shape[1]), fill)], dim=1)
    return out


def _stack(micro_batches: list[dict], at_least: list[int] | None = None) -> dict:
    """The group's micro-batches as one batch, each tensor concatenated along dimension 0 (pstar-fx's accumulate
    splits it back), token tensors padded to one length first (_padded_alike). Other values must be equal in every
    micro-batch."""
    micro_batches = _padded_alike(micro_batches, at_least)
    first = micro_batches[0]
    out = {}
    for key, value in first.items():
        values = [mb.get(key) for mb in micro_batches]
        if isinstance(value, torch.Tensor):
            shapes = {tuple(v.shape) for v in values if isinstance(v, torch.Tensor)}
            if len(shapes) != 1 or any(not isinstance(v, torch.Tensor) for v in values):
                raise ValueError(
                    f"PstarTrainer: the micro-batches of one accumulation group have '{key}' of shapes "
                    f"{sorted(shapes)}; a pstar-fx step runs the group as one batch split along dimension 0, so "
                    "they need equal shapes (token tensors of different lengths are padded to one where the batch "
                    "has an attention_mask): pad to a fixed length (a tokenizer with padding='max_length') and "
                    "set dataloader_drop_last=True (the last group may be short)")
            out[key] = torch.cat(values, dim=0) if len(values) > 1 else value
        else:
            if any(v != value for v in values[1:]):
                raise ValueError(f"PstarTrainer: the micro-batches of one accumulation group differ in '{key}' "
                                 f"({values}); non-tensor inputs must be equal within a group")
            out[key] = value
    if any(set(mb) != set(first) for mb in micro_batches[1:]):
        raise ValueError("PstarTrainer: the micro-batches of one accumulation group have different keys")
    return out


__all__ = ["PstarTrainer", "TrainerOptimizer"]
