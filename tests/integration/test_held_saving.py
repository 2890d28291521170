"""Saving and copying a model a compiled step holds: whatever reads it sees the trained values, or raises
ModelHeldError; never a raw storage error, never stale values.

Each path is checked against eager training of the same model (fp32 on the CPU: bit for bit), and the step is
checked to train on exactly afterwards, still holding the model (nothing was given back).
"""
import copy
import functools

import pytest
import torch

import pstar_fx as px

from harness import HYPER, eager_run
from models import CASES_BY_NAME

STEPS = 2          # steps before the model is saved or copied; one more after


@functools.cache
def _eager(name: str, steps: int) -> dict:
    """Eager training's state dict after `steps` steps (read only)."""
    return eager_run(CASES_BY_NAME[name], steps)[1]


def _trained(name, model=None):
    """A model of the case trained STEPS steps by a compiled step that holds it, and eager's values after STEPS and
    STEPS + 1 steps."""
    case = CASES_BY_NAME[name]
    model = case.build_model() if model is None else model
    step = px.compile(model, optimizer=px.AdamW(**HYPER), device="cpu")(case.loss_fn)
    for i in range(STEPS):
        step(*case.batch(i))
    return case, model, step, _eager(name, STEPS), _eager(name, STEPS + 1)


def _assert_equal(got: dict, want: dict):
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def _assert_trains_on(case, step, want_after):
    """The step still holds the model and its next step is eager's next step, bit for bit."""
    assert step.holds_model()
    step(*case.batch(STEPS))
    _assert_equal(step.state_dict(), want_after)


@pytest.mark.parametrize("name", ["gpt_tied", "cnn_bn"])
def test_torch_save_of_the_state_dict_writes_the_trained_values(name, tmp_path):
    case, model, step, want, want_after = _trained(name)
    sd = model.state_dict()
    assert not any(isinstance(v, px.api.model_state.HeldTensor) for v in sd.values())
    torch.save(sd, tmp_path / "sd.pt")
    _assert_equal(torch.load(tmp_path / "sd.pt"), want)
    if name == "gpt_tied":        # tied tensors stay one tensor, as in eager's state dict
        assert sd["lm_head.weight"].data_ptr() == sd["wte.weight"].data_ptr()
    prefix = "h.0." if name == "gpt_tied" else "bn1."                    # a submodule's state dict too
    block = model.get_submodule(prefix[:-1])
    _assert_equal(block.state_dict(), {k[len(prefix):]: v for k, v in want.items() if k.startswith(prefix)})
    _assert_trains_on(case, step, want_after)
    assert not torch.equal(sd[next(iter(sd))], step.state_dict()[next(iter(sd))])   # a copy, not a live view


def test_state_dict_keep_vars_gives_the_model_tensors_themselves():
    case, model, step, want, want_after = _trained("cnn_bn")
    sd = model.state_dict(keep_vars=True)
    assert sd["conv1.weight"] is model.conv1.weight
    with pytest.raises(px.ModelHeldError, match="sync_model"):
        sd["conv1.weight"].sum()


def test_safetensors_save_file_writes_the_trained_values(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    case, model, step, want, want_after = _trained("cnn_bn")
    st.save_file(model.state_dict(), str(tmp_path / "m.safetensors"))
    _assert_equal(st.load_file(str(tmp_path / "m.safetensors")), want)
    _assert_trains_on(case, step, want_after)


def test_deepcopy_holds_the_trained_values_and_is_independent():
    case, model, step, want, want_after = _trained("gpt_tied")
    twin = copy.deepcopy(model)
    _assert_equal(twin.state_dict(), want)
    assert twin.lm_head.weight is twin.wte.weight                   # ties kept
    assert isinstance(twin.lm_head.weight, torch.nn.Parameter) and twin.lm_head.weight.requires_grad
    ref = case.build_model()
    ref.load_state_dict(want)
    batch = case.batch(STEPS)
    assert torch.equal(case.loss_fn(twin, *batch), case.loss_fn(ref, *batch))   # usable eagerly
    _assert_trains_on(case, step, want_after)
    _assert_equal(twin.state_dict(), want)                                      # its own values, not the step's


def test_torch_save_of_the_model_writes_the_trained_values(tmp_path):
    case, model, step, want, want_after = _trained("gpt_tied")
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    _assert_equal(loaded.state_dict(), want)
    assert loaded.lm_head.weight is loaded.wte.weight
    torch.save(list(model.parameters()), tmp_path / "params.pt")   # a held parameter pickled on its own too
    params = torch.load(tmp_path / "params.pt", weights_only=False)
    assert torch.equal(params[0].detach(), want["wte.weight"])
    _assert_trains_on(case, step, want_after)


def test_reading_a_held_tensors_storage_raises_model_held_error(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    case, model, step, want, want_after = _trained("cnn_bn")
    w = model.conv1.weight
    import numpy as np
    for read in (w.data_ptr, w.untyped_storage, w.detach().numpy, w.tolist, w.share_memory_, w.is_shared,
                 model.share_memory, w.__dlpack__, lambda: np.from_dlpack(w.detach()),
                 lambda: st.save_file(dict(model.named_parameters()), str(tmp_path / "p.safetensors"))):
        with pytest.raises(px.ModelHeldError, match="sync_model"):
            read()
    _assert_trains_on(case, step, want_after)


def test_save_pretrained_writes_the_trained_values(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    case, model, step, want, want_after = _trained("hf_gpt2")
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    _assert_equal(loaded.state_dict(), want)
    _assert_trains_on(case, step, want_after)


def test_accelerate_save_model_and_save_state_write_the_trained_values(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    st = pytest.importorskip("safetensors.torch")
    accelerator = accelerate.Accelerator(cpu=True)
    case, model, step, want, want_after = _trained("hf_gpt2", accelerator.prepare(CASES_BY_NAME["hf_gpt2"].build_model()))
    accelerator.save_model(model, tmp_path / "model")
    saved = st.load_file(str(tmp_path / "model" / "model.safetensors"))
    # safetensors keeps one of two tied tensors (the other is tied again on loading)
    assert saved.keys() <= want.keys() and len(saved) >= len(want) - 1
    _assert_equal(saved, {k: want[k] for k in saved})
    accelerator.save_state(tmp_path / "state")
    saved = st.load_file(str(tmp_path / "state" / "model.safetensors"))
    _assert_equal(saved, {k: want[k] for k in saved})
    _assert_trains_on(case, step, want_after)
