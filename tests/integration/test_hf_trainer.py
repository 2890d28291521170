"""pstar_fx.integrations.hf.PstarTrainer trains a transformers model as a plain `transformers.Trainer` does.

A 2-layer GPT-2 (hidden 32, no dropout, fp32 on the CPU) on random token ids, with warm-up + linear decay, weight
decay with the Trainer's no-decay groups, max_grad_norm and gradient_accumulation_steps=2, against a plain Trainer on
the same model, seed and data: every logged loss, grad norm and learning rate, every evaluation and the final
weights agree. Tolerance: 1e-5 relative on losses and norms and 1e-6 absolute on weights, the suite's fp32 bound for
a compiled step against eager (docs/design.md#numerics); on this CPU they agree bit for bit. Saving at step k and
`resume_from_checkpoint` continues bit for bit; `save_model` writes safetensors that `from_pretrained` loads.
Under PSTAR_TEST_DEVICE=cuda both trainers run on the GPU (`use_cpu=False`): the logged figures at the same
tolerance, the weights to WEIGHTS_ATOL (see there).
"""
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from pstar_fx.integrations.hf import PstarTrainer  # noqa: E402
from pstar_fx.integrations.hf import _stack  # noqa: E402

from harness import DEVICE  # noqa: E402

pytestmark = pytest.mark.cuda

T, V = 16, 64
# The final weights of a pstar-fx run against a plain Trainer's. On the CPU they agree bit for bit (1e-6 is the
# suite's fp32 bound). On a GPU the compiled step sums some gradients in another order than eager code (the tied
# embedding's two uses, a bias's rows), and Adam turns the last-bit differences of near-zero gradients into visible
# ones: GPT-2's key bias, whose exact gradient is 0 (the softmax ignores it), ended 1.1e-5 apart on an H100.
WEIGHTS_ATOL = 1e-6 if DEVICE == "cpu" else 1e-4


class Tokens(torch.utils.data.Dataset):
    """n sequences of T random token ids (labels = inputs: the model shifts them)."""

    def __init__(self, n: int, seed: int):
        self.ids = torch.randint(0, V, (n, T), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(T, dtype=torch.long),
                "labels": self.ids[i].clone()}


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=T, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0))


class Record(TrainerCallback):
    """The Trainer's logs, and (PstarTrainer) the lr each compiled step ran with."""

    def __init__(self):
        self.logs, self.step_lrs, self.trainer = [], [], None

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))

    def on_step_end(self, args, state, control, **kwargs):
        if self.trainer is not None:
            self.step_lrs.append(self.trainer.step.last_step.lr)


def arguments(out, **kw) -> TrainingArguments:
    base = dict(output_dir=str(out), per_device_train_batch_size=4, per_device_eval_batch_size=4,
                gradient_accumulation_steps=2, learning_rate=1e-2, warmup_steps=2, lr_scheduler_type="linear",
                weight_decay=0.1, max_grad_norm=0.5, num_train_epochs=2, logging_steps=1, eval_strategy="steps",
                eval_steps=4, save_strategy="no", seed=0, use_cpu=DEVICE == "cpu", disable_tqdm=True, report_to=[])
    base.update(kw)
    return TrainingArguments(**base)


def train(cls, out, **kw):
    model, record = tiny_gpt2(), Record()
    trainer = cls(model=model, args=arguments(out, **kw), train_dataset=Tokens(32, seed=1),
                  eval_dataset=Tokens(8, seed=2), callbacks=[record])
    if cls is PstarTrainer:
        record.trainer = trainer
    trainer.train()
    return trainer, record


def cpu_state(model) -> dict[str, torch.Tensor]:
    """model.state_dict() on the CPU (on a GPU the plain Trainer's model is on the device; PstarTrainer's is where
    the step gave its values back)."""
    return {k: v.cpu() for k, v in model.state_dict().items()}


def on_device_of(model, x: torch.Tensor) -> torch.Tensor:
    return x.to(next(model.parameters()).device)


def close(a: dict, b: dict, keys=("loss", "grad_norm", "eval_loss")) -> None:
    assert set(a) == set(b), (a, b)
    for k in keys:
        if k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-5), (k, a, b)
    if "learning_rate" in a:
        assert a["learning_rate"] == b["learning_rate"]


def test_trains_like_a_plain_trainer(tmp_path):
    """Losses, grad norms, lr and evaluations at every logging step, final weights, eager use after train(),
    evaluate() and predict() afterwards, and save_model's safetensors: all as the plain Trainer's."""
    eager, eager_rec = train(Trainer, tmp_path / "eager")
    px_trainer, px_rec = train(PstarTrainer, tmp_path / "px")

    assert len(px_rec.logs) == len(eager_rec.logs) == 8 + 2 + 1      # 8 steps, 2 evaluations, the summary
    assert sum("eval_loss" in log for log in px_rec.logs) == 2
    for a, b in zip(px_rec.logs[:-1], eager_rec.logs[:-1]):
        close(a, b)
    assert px_rec.logs[-1]["train_loss"] == pytest.approx(eager_rec.logs[-1]["train_loss"], rel=1e-5)
    # the compiled steps ran with the lr the plain Trainer's optimizer had at each step (warm-up, then decay)
    used = px_rec.step_lrs
    logged = [log["learning_rate"] for log in eager_rec.logs if "loss" in log and "eval_loss" not in log][:8]
    assert [set(lrs) for lrs in used] == [{lr} for lr in logged] and logged[0] == 0.0 and logged[2] == 1e-2
    # weight decay on matrices, none on biases and norms: the Trainer's groups
    decay = {id(p) for p in eager.optimizer.param_groups[0]["params"]}
    px_groups = px_trainer.step.optimizer.param_groups
    assert [g["weight_decay"] for g in px_groups] == [0.1, 0.0]
    names = {id(p): n for n, p in px_trainer.model.named_parameters()}
    eager_names = {id(p): n for n, p in eager.model.named_parameters()}
    assert {names[id(p)] for p in px_groups[0]["params"]} == {eager_names[i] for i in decay}

    # train() gave the values back: the model is usable eagerly, and equal to the plain Trainer's
    trained = cpu_state(px_trainer.model)
    for k, v in cpu_state(eager.model).items():
        torch.testing.assert_close(trained[k], v, rtol=0, atol=WEIGHTS_ATOL, msg=lambda m, k=k: f"{k}: {m}")
    batch = Tokens(4, seed=3).ids
    torch.testing.assert_close(px_trainer.model(on_device_of(px_trainer.model, batch)).logits.cpu(),
                               eager.model(on_device_of(eager.model, batch)).logits.cpu(), rtol=1e-5, atol=1e-6)

    # evaluate() and predict() outside training: the forward-only pstar-fx function equals eager
    test = Tokens(8, seed=4)
    px_eval, eager_eval = px_trainer.evaluate(test), eager.evaluate(test)
    assert px_eval["eval_loss"] == pytest.approx(eager_eval["eval_loss"], rel=1e-5)
    px_pred, eager_pred = px_trainer.predict(test), eager.predict(test)
    torch.testing.assert_close(torch.as_tensor(px_pred.predictions), torch.as_tensor(eager_pred.predictions),
                               rtol=1e-5, atol=1e-5)
    assert (px_pred.label_ids == eager_pred.label_ids).all()
    px_trainer.model(on_device_of(px_trainer.model, batch))          # usable again after evaluate() / predict()

    px_trainer.save_model(str(tmp_path / "saved"))
    assert os.path.isfile(tmp_path / "saved" / "model.safetensors")
    loaded = GPT2LMHeadModel.from_pretrained(str(tmp_path / "saved")).state_dict()
    for k, v in trained.items():
        assert torch.equal(loaded[k], v), k


def test_resume_from_checkpoint_continues_bit_for_bit(tmp_path):
    """Saved at step 3 (checkpoint-3, with the step's own checkpoint inside) and resumed by a new trainer on a new
    model: the losses of steps 4..8 and the final weights are those of the uninterrupted run, bit for bit."""
    kw = dict(save_strategy="steps", save_steps=3, eval_strategy="no")
    whole, whole_rec = train(PstarTrainer, tmp_path / "run", **kw)
    ckpt = tmp_path / "run" / "checkpoint-3"
    assert os.path.isfile(ckpt / "model.safetensors") and os.path.isdir(ckpt / "pstar_fx")
    # save_pretrained wrote the architecture into a copy of the config: the model's key is unchanged, no new trace
    assert whole.step._compiler.compiles == 1 and "architectures" in (ckpt / "config.json").read_text()
    # the Trainer's optimizer.pt is written from host memory (on a GPU, step.optimizer.state_dict() gives the states
    # on the device as torch would, where a model larger than the GPU's do not fit at once)
    saved = whole.optimizer.state_dict()["state"]
    assert saved and all(v.device.type == "cpu" for s in saved.values() for v in s.values())
    own = whole.step.optimizer.state_dict()["state"]
    assert all(v.device == next(whole.model.parameters()).device for s in own.values() for k, v in s.items()
               if k != "step")

    model, record = tiny_gpt2(), Record()
    resumed = PstarTrainer(model=model, args=arguments(tmp_path / "resumed", **kw), train_dataset=Tokens(32, seed=1),
                           callbacks=[record])
    resumed.train(resume_from_checkpoint=str(ckpt))
    losses = {round(log["epoch"], 3): log["loss"] for log in whole_rec.logs if "loss" in log}
    again = {round(log["epoch"], 3): log["loss"] for log in record.logs if "loss" in log}
    assert len(again) == 5 and all(again[e] == losses[e] for e in again), (losses, again)
    final = cpu_state(whole.model)
    for k, v in cpu_state(resumed.model).items():
        assert torch.equal(v, final[k]), k


def test_unsupported_arguments_are_refused(tmp_path):
    """What a pstar-fx step cannot do the Trainer's way fails at construction, saying what to change."""
    model, data = tiny_gpt2(), Tokens(8, seed=1)

    def make(**kw):
        return PstarTrainer(model=model, args=arguments(tmp_path, eval_strategy="no", **kw), train_dataset=data)

    with pytest.raises(ValueError, match="optim='sgd'.*adamw_torch_fused"):
        make(optim="sgd")
    with pytest.raises(ValueError, match="torch_compile=True.*set torch_compile=False"):
        make(torch_compile=True)
    with pytest.raises(ValueError, match="an optimizer passed to the Trainer"):
        PstarTrainer(model=model, args=arguments(tmp_path, eval_strategy="no"), train_dataset=data,
                     optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None))


def test_a_group_of_unequal_micro_batches_is_refused():
    a = {"input_ids": torch.ones(4, 16, dtype=torch.long)}
    b = {"input_ids": torch.ones(4, 12, dtype=torch.long)}
    assert _stack([a, a])["input_ids"].shape == (8, 16)
    with pytest.raises(ValueError, match="'input_ids' of shapes.*pad to a fixed length"):
        _stack([a, b])                 # (no attention_mask: padding would not be masked)
    extra = {"input_ids": torch.ones(4, 12, dtype=torch.long), "attention_mask": torch.ones(4, 12, dtype=torch.long),
             "features": torch.ones(4, 12)}
    with pytest.raises(ValueError, match="'features' of shapes"):
        _stack([dict(extra, features=torch.ones(4, 16), input_ids=a["input_ids"],
                     attention_mask=torch.ones(4, 16, dtype=torch.long)), extra])


def test_token_tensors_padded_to_other_lengths_are_padded_to_the_groups_longest():
    ids = torch.arange(24).view(2, 12)
    short = {"input_ids": ids, "attention_mask": torch.ones(2, 12, dtype=torch.long), "labels": ids + 1}
    long = {"input_ids": torch.ones(2, 16, dtype=torch.long), "attention_mask": torch.ones(2, 16, dtype=torch.long),
            "labels": torch.ones(2, 16, dtype=torch.long)}
    out = _stack([short, long])
    assert {k: tuple(v.shape) for k, v in out.items()} == {k: (4, 16) for k in out}
    assert torch.equal(out["input_ids"][:2, :12], ids) and (out["input_ids"][:2, 12:] == 0).all()
    assert (out["attention_mask"][:2, 12:] == 0).all() and (out["labels"][:2, 12:] == -100).all()
    assert torch.equal(out["labels"][:2, :12], ids + 1) and torch.equal(out["labels"][2:], long["labels"])


class Varied(torch.utils.data.Dataset):
    """Sequences of 4 to 16 tokens, padded per batch by `pad_batch` (a collator's dynamic padding)."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.items = [torch.randint(1, V, (int(torch.randint(4, T + 1, (1,), generator=g)),), generator=g)
                      for _ in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return {"input_ids": self.items[i]}


def pad_batch(features):
    n = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), n, dtype=torch.long)
    mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for i, f in enumerate(features):
        k = len(f["input_ids"])
        ids[i, :k], mask[i, :k], labels[i, :k] = f["input_ids"], 1, f["input_ids"]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def test_dynamic_padding_with_accumulation_trains_like_a_plain_trainer(tmp_path):
    """Micro-batches of one group padded to different lengths: padded to one (masked), the same losses and grad
    norms as the plain Trainer at every step. Weights agree to 1e-4, not bit for bit: other shapes sum in another
    order, and Adam magnifies the rounding of near-zero gradients (GPT-2's key bias, whose exact gradient is 0)."""
    runs = []
    for cls in (PstarTrainer, Trainer):
        record = Record()
        trainer = cls(model=tiny_gpt2(), args=arguments(tmp_path / cls.__name__, eval_strategy="no",
                                                        dataloader_drop_last=True, num_train_epochs=1),
                      train_dataset=Varied(32, seed=1), data_collator=pad_batch, callbacks=[record])
        trainer.train()
        runs.append((trainer, record))
    (px_trainer, px_rec), (plain, plain_rec) = runs
    assert len(px_rec.logs) == len(plain_rec.logs) == 4 + 1
    for a, b in zip(px_rec.logs[:-1], plain_rec.logs[:-1]):
        close(a, b)
    trained = cpu_state(px_trainer.model)
    for k, v in cpu_state(plain.model).items():
        torch.testing.assert_close(trained[k], v, rtol=0, atol=1e-4, msg=k)


class Pairs(torch.utils.data.Dataset):
    """A seq2seq task: inputs of 4 to 16 tokens, targets of 2 to 9, each padded per batch on its own."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)

        def tokens(lo, hi):
            return torch.randint(1, V, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g)
        self.items = [{"input_ids": tokens(4, T + 1), "labels": tokens(2, 10)} for _ in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def pad_pairs(features):
    out = pad_batch(features)
    n = max(len(f["labels"]) for f in features)
    out["labels"] = torch.full((len(features), n), -100, dtype=torch.long)
    for i, f in enumerate(features):
        out["labels"][i, :len(f["labels"])] = f["labels"]
    return out


def test_seq2seq_dynamic_padding_pads_inputs_and_labels_each_to_its_longest(tmp_path):
    """A T5's inputs and labels have lengths of their own: each is padded to the group's longest of its own (the
    labels with -100), with the plain Trainer's losses and grad norms."""
    from transformers import T5Config, T5ForConditionalGeneration

    def t5():
        torch.manual_seed(0)
        return T5ForConditionalGeneration(T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                   num_heads=4, dropout_rate=0.0, decoder_start_token_id=0,
                                                   pad_token_id=0))
    runs = []
    for cls in (PstarTrainer, Trainer):
        record = Record()
        trainer = cls(model=t5(), args=arguments(tmp_path / cls.__name__, eval_strategy="no", max_steps=3,
                                                 dataloader_drop_last=True),
                      train_dataset=Pairs(32, seed=1), data_collator=pad_pairs, callbacks=[record])
        trainer.train()
        runs.append(record.logs)
    assert len(runs[0]) == len(runs[1]) == 3 + 1
    for a, b in zip(runs[0][:-1], runs[1][:-1]):
        close(a, b)


def test_importing_pstar_fx_does_not_import_transformers():
    import subprocess
    import sys
    code = "import sys, pstar_fx; assert 'transformers' not in sys.modules, 'transformers imported'"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr[-2000:]


def test_a_plain_trainer_resumes_a_pstar_fx_checkpoint_exactly(tmp_path):
    """The optimizer state a PstarTrainer checkpoint saves names the kernel the step ran (torch's fused AdamW): a
    plain Trainer resuming from it trains what the uninterrupted pstar-fx run trained."""
    kw = dict(save_strategy="steps", save_steps=3, eval_strategy="no")
    whole, _ = train(PstarTrainer, tmp_path / "run", **kw)
    ckpt = tmp_path / "run" / "checkpoint-3"
    groups = torch.load(ckpt / "optimizer.pt", weights_only=True)["param_groups"]
    assert all(g["fused"] is True for g in groups)
    plain = Trainer(model=tiny_gpt2(), args=arguments(tmp_path / "plain", **kw), train_dataset=Tokens(32, seed=1))
    plain.train(resume_from_checkpoint=str(ckpt))
    final = cpu_state(whole.model)
    for k, v in cpu_state(plain.model).items():
        torch.testing.assert_close(v, final[k], rtol=0, atol=WEIGHTS_ATOL, msg=lambda m, k=k: f"{k}: {m}")


class Interrupt(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2:
            raise KeyboardInterrupt


def test_train_interrupted_gives_the_model_back_with_the_trained_values(tmp_path):
    model = tiny_gpt2()
    trainer = PstarTrainer(model=model, args=arguments(tmp_path, eval_strategy="no"), train_dataset=Tokens(32, seed=1),
                           callbacks=[Interrupt()])
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    trained = {k: v.cpu() for k, v in trainer.step.state_dict().items()}
    assert trainer.step.last_step is not None
    for k, v in cpu_state(model).items():          # the model's own tensors: no step holds it
        assert torch.equal(v, trained[k]), k
    model(on_device_of(model, Tokens(2, seed=3).ids))       # usable eagerly (a held model raises ModelHeldError)


def test_a_lora_checkpoint_holds_the_adapters_and_resumes_bit_for_bit(tmp_path):
    """peft LoRA through PstarTrainer: checkpoint-N's pstar_fx/ holds the trained adapters, not the frozen base
    (which the resumed model brings, as a plain Trainer's LoRA checkpoint assumes), and the run continues exactly."""
    peft = pytest.importorskip("peft")

    def lora():
        return peft.get_peft_model(tiny_gpt2(), peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True,
                                                                 task_type="CAUSAL_LM"))
    kw = dict(save_strategy="steps", save_steps=3, eval_strategy="no")
    whole = PstarTrainer(model=lora(), args=arguments(tmp_path / "run", **kw), train_dataset=Tokens(32, seed=1))
    whole.train()
    ckpt = tmp_path / "run" / "checkpoint-3"
    saved = torch.load(ckpt / "pstar_fx" / "model.pt", weights_only=True)
    trained = {n for n, p in whole.model.named_parameters() if p.requires_grad}
    assert trained and set(saved) == trained, "the frozen base is left out"
    resumed = PstarTrainer(model=lora(), args=arguments(tmp_path / "resumed", **kw), train_dataset=Tokens(32, seed=1))
    resumed.train(resume_from_checkpoint=str(ckpt))
    final = cpu_state(whole.model)
    for k, v in cpu_state(resumed.model).items():
        assert torch.equal(v, final[k]), k


def test_evaluate_takes_a_collators_batch_encoding(tmp_path):
    """transformers' collators return a BatchEncoding (a mapping, not a dict): evaluation takes it as the plain
    Trainer does (training already did: the group is stacked into a dict)."""
    def collate(features):
        return transformers.BatchEncoding({k: torch.stack([f[k] for f in features]) for k in features[0]})
    losses = {}
    for cls in (PstarTrainer, Trainer):
        trainer = cls(model=tiny_gpt2(), args=arguments(tmp_path / cls.__name__), eval_dataset=Tokens(8, seed=2),
                      data_collator=collate)
        losses[cls] = trainer.evaluate()["eval_loss"]
    assert losses[PstarTrainer] == pytest.approx(losses[Trainer], rel=1e-5)


def test_model_init_evaluates_each_trials_model(tmp_path):
    """model_init (what hyperparameter_search uses) builds a new model at each train(): evaluation scores that one,
    as the plain Trainer's does, not the model evaluated first."""
    scores = {}
    for cls in (PstarTrainer, Trainer):
        seeds = iter(range(4))

        def init():
            torch.manual_seed(next(seeds))
            return GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=T, n_embd=32, n_layer=2, n_head=2,
                                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
        trainer = cls(model_init=init, args=arguments(tmp_path / cls.__name__, max_steps=3, eval_strategy="no"),
                      train_dataset=Tokens(32, seed=1), eval_dataset=Tokens(8, seed=2))
        scores[cls] = []
        for _ in range(2):
            trainer.train()
            scores[cls].append(trainer.evaluate()["eval_loss"])
    assert scores[Trainer][0] != scores[Trainer][1]
    assert scores[PstarTrainer] == pytest.approx(scores[Trainer], rel=1e-5)


def test_a_short_last_accumulation_group_is_refused_before_training(tmp_path):
    """8 batches an epoch at gradient_accumulation_steps=3 leave a group of 2, which the compiled step cannot take:
    refused before the first step, saying what to change (dataloader_drop_last=True does not help); with max_steps
    ending before the epoch's last group the run goes ahead."""
    def make(**kw):
        return PstarTrainer(model=tiny_gpt2(), args=arguments(tmp_path, gradient_accumulation_steps=3,
                                                              eval_strategy="no", dataloader_drop_last=True, **kw),
                            train_dataset=Tokens(32, seed=1))
    trainer = make(num_train_epochs=1)
    with pytest.raises(ValueError, match=r"8 batches per epoch leave a last accumulation group of 2 .*12 examples"):
        trainer.train()
    assert trainer.state.global_step == 0 and (trainer.step is None or trainer.step.last_step is None)
    ahead = make(max_steps=2)
    ahead.train()
    assert ahead.state.global_step == 2


def test_a_short_last_batch_in_an_accumulation_group_is_refused_before_training(tmp_path):
    """30 examples in batches of 4 at gradient_accumulation_steps=2: 8 batches an epoch, the last of 2 examples in a
    group beside one of 4, which one compiled step cannot split evenly. Refused before the first step (not at the
    epoch's end); a run that stops before the epoch's last group trains."""
    def make(**kw):
        return PstarTrainer(model=tiny_gpt2(), args=arguments(tmp_path, eval_strategy="no", num_train_epochs=1, **kw),
                            train_dataset=Tokens(30, seed=1))
    trainer = make()
    with pytest.raises(ValueError, match=r"30 training examples in batches of 4 end each epoch with a batch of 2.*"
                                         r"dataloader_drop_last=True"):
        trainer.train()
    assert trainer.state.global_step == 0 and (trainer.step is None or trainer.step.last_step is None)
    ahead = make(max_steps=3)
    ahead.train()
    assert ahead.state.global_step == 3
