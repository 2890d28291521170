"""examples/hf_trainer.py (the Trainer through pstar-fx) and examples/finetune_lora.py (peft LoRA through px.compile)
run from a checkout on tiny configurations: the loss falls, and what they save holds the trained values."""
import os
import re
import subprocess
import sys

import pytest
import torch

from ranks import ROOT

pytest.importorskip("transformers")


def run(*args) -> str:
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_hf_trainer_example_trains_and_saves(tmp_path):
    text = run("examples/hf_trainer.py", "--steps", "8", "--seq-len", "32", "--out", str(tmp_path))
    losses = [float(x) for x in re.findall(r"'loss': '?([\d.]+)", text)]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.5, text
    assert re.search(r"'eval_loss': '?[\d.]+", text) and "predicted peak" in text, text
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"))
    corpus = open(os.path.join(ROOT, "examples", "data", "tiny_corpus.txt"), "rb").read()
    ids = torch.tensor(list(corpus[100_000:100_064]), dtype=torch.long).view(2, 32)
    assert model(input_ids=ids, labels=ids).loss.item() < losses[-1] + 0.3      # the saved values are the trained ones


def test_finetune_lora_example_trains_the_adapters_only(tmp_path):
    pytest.importorskip("peft")
    from safetensors.torch import load_file
    text = run("examples/finetune_lora.py", "--steps", "8", "--seq-len", "32", "--log-every", "7",
               "--out", str(tmp_path))
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", text)]
    assert len(losses) == 2 and losses[-1] < losses[0], text
    assert "base weights unchanged" in text, text
    adapter = load_file(str(tmp_path / "adapter_model.safetensors"))
    lora_b = [v for k, v in adapter.items() if "lora_B" in k]
    assert lora_b and all(v.abs().max() > 0 for v in lora_b)          # peft initialises lora_B to zeros
