"""Compressed optimizer states: px.AdamW(state_dtype="bf16" | "int8").

The moments are rounded, so a compressed run follows eager AdamW closely rather than exactly; what must hold
exactly: the update is the same wherever it runs (device states, the CPU worker, a streamed update: the random bits
are per chunk element and step), the plan's memory (debug=True: measured == predicted at every node) with the
smaller state bytes, checkpoints and optimizer state dicts that resume bit for bit, and torch's global generator
untouched. Training quality: the small GPT on the shipped corpus reaches the same loss with every state_dtype.
"""
import os

import pytest
import torch

import pstar_fx as px
from pstar_fx.ir.graph import StateHome
from pstar_fx.ir.needs import state_bytes, state_layout
from pstar_fx.runtime import device_adam, native

from harness import HYPER, small_batches
from models import CASES_BY_NAME, GPT, gpt_loss

CASE = small_batches(CASES_BY_NAME["gpt_tied"])
ALL = 1000      # more chunks than the case has: every host-placed chunk that can streams


def _step(state_dtype, precision="bf16", budget=None, device_updates=None, debug=True, case=CASE, device="cpu",
          fuse=None):
    model = case.build_model()
    return px.compile(model.to(device), optimizer=px.AdamW(**HYPER, state_dtype=state_dtype), chunk_size=256,
                      device_memory=budget, precision=precision, device=device, debug=debug,
                      _device_updates=device_updates, fuse=fuse)(case.loss_fn)


def _raw_states(step) -> list[torch.Tensor]:
    store = step._compiler.store
    store.flush()
    return [s.view(torch.uint8).clone() for s in store.states if s is not None]


def _tight(state_dtype, precision, device="cpu"):
    """Just above the least budget: every optimizer state on the host."""
    batch = [t.to(device) for t in CASE.batch(0)]
    return int(_step(state_dtype, precision, device=device).min_device_memory(*batch) * 1.1)


def test_bad_state_dtypes_and_other_optimizers_are_refused():
    with pytest.raises(ValueError, match=r"px.AdamW: state_dtype must be one of 'fp32', 'bf16', 'int8', got 'fp8'"):
        px.AdamW(state_dtype="fp8")
    with pytest.raises(ValueError, match="px.Adam: state_dtype must be one of"):
        px.Adam(state_dtype=torch.bfloat16)
    for called, make in (("px.SGD", lambda: px.SGD(lr=0.1, momentum=0.9, state_dtype="bf16")),
                         ("px.Lion", lambda: px.Lion(state_dtype="int8")),
                         (r"px.optim_from_torch\(RMSprop\)",
                          lambda: px.optim_from_torch(torch.optim.RMSprop, lr=1e-3, state_dtype="bf16"))):
        with pytest.raises(ValueError, match=f"^{called}: state_dtype is supported by px.Adam and px.AdamW only"):
            make()
    assert px.AdamW(state_dtype="fp32").state == px.AdamW().state     # the default is the exact layout


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_update_is_the_same_on_device_host_and_streamed_and_follows_eager(state_dtype):
    """Device-placed states, host-placed ones (the CPU worker's blocked update) and streamed ones (host states,
    updated on the device) give the same bits; the losses follow eager AdamW's closely; the plan's bytes are
    measured exactly (debug=True)."""
    budget = _tight(state_dtype, "bf16")
    steps = {"device": _step(state_dtype), "host": _step(state_dtype, budget=budget, device_updates=0),
             "streamed": _step(state_dtype, budget=budget, device_updates=ALL)}
    losses = {k: [s(*CASE.batch(i)).item() for i in range(5)] for k, s in steps.items()}
    homes = {k: [c.state_home for c in s.graphs["scheduled"].chunks if c.state_home is not None]
             for k, s in steps.items()}
    assert set(homes["device"]) == {StateHome.DEVICE} and set(homes["host"]) == {StateHome.HOST}
    assert any(c.streamed for c in steps["streamed"].graphs["scheduled"].chunks)
    assert losses["device"] == losses["host"] == losses["streamed"]
    raw = {k: _raw_states(s) for k, s in steps.items()}
    for k in ("host", "streamed"):
        assert all(torch.equal(a, b) for a, b in zip(raw["device"], raw[k])), k
    for s in steps.values():
        assert s.last_step.measured_peak == s.graphs["scheduled"].plan.predicted_peak
    exact = _step("fp32", precision="fp32")
    want = [exact(*CASE.batch(i)).item() for i in range(5)]
    got = [_step(state_dtype, precision="fp32")(*CASE.batch(0)).item()]
    assert got[0] == want[0]
    assert max(abs(a - b) / b for a, b in zip(losses["device"], want)) < 2e-3, (losses["device"], want)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or device_adam.why_not() is not None or native.kernels() is None,
                    reason="needs a GPU, Triton (the device's one-pass kernel) and cc (the host's)")
@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_on_the_gpu_device_host_and_streamed_updates_give_the_same_bits(state_dtype):
    """On a GPU the device's update (the Triton kernel) and the CPU worker's (the native kernel) are the same
    arithmetic: a chunk's states and the losses are the same bits wherever the plan updates it."""
    budget = _tight(state_dtype, "bf16", "cuda")
    # unfused: the three plans differ, and fused regions end where each plan's chunk operations fall, rounding bf16
    # intermediates in different places
    steps = {"device": _step(state_dtype, device="cuda", fuse=False),
             "host": _step(state_dtype, budget=budget, device_updates=0, device="cuda", fuse=False),
             "streamed": _step(state_dtype, budget=budget, device_updates=ALL, device="cuda", fuse=False)}
    batches = [[t.cuda() for t in CASE.batch(i)] for i in range(4)]
    losses = {k: [s(*b).item() for b in batches] for k, s in steps.items()}
    assert losses["device"] == losses["host"] == losses["streamed"], losses
    raw = {k: _raw_states(s) for k, s in steps.items()}
    for k in ("host", "streamed"):
        assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(raw["device"], raw[k])), k


def test_plan_counts_the_smaller_states():
    """state_bytes, the summary's model data and px.plan's host bytes shrink; at a budget that holds every int8
    state on the device, the exact states do not all fit."""
    fp32, bf16, int8 = (_step(d, precision="fp32") for d in ("fp32", "bf16", "int8"))
    for s in (fp32, bf16, int8):
        s(*CASE.batch(0))
    g = {k: s.graphs["scheduled"] for k, s in (("fp32", fp32), ("bf16", bf16), ("int8", int8))}
    trainable = [c for c in g["fp32"].chunks if c.state_home is not None]
    sizes = {k: sum(state_bytes(c, gr.settings.precision, 1, state_layout(gr.settings)) for c in trainable)
             for k, gr in g.items()}
    numel = sum(c.capacity for c in trainable)
    assert sizes["fp32"] == 8 * numel + 4 * len(trainable)
    assert sizes["bf16"] < 4.2 * numel and sizes["int8"] < 2.3 * numel
    data = {k: s.summary().model_data_bytes for k, s in (("fp32", fp32), ("bf16", bf16), ("int8", int8))}
    assert data["fp32"] - data["int8"] == sizes["fp32"] - sizes["int8"]

    budget = sizes["fp32"]           # the exact states alone would fill it
    placed = {d: _step(d, precision="fp32", budget=budget) for d in ("fp32", "int8")}
    on_device = {}
    for d, s in placed.items():
        s(*CASE.batch(0))
        on_device[d] = sum(c.state_home is StateHome.DEVICE for c in s.graphs["scheduled"].chunks)
    assert on_device["int8"] == len(trainable) > on_device["fp32"], on_device

    reports = {d: px.plan(CASE.build_model(), CASE.loss_fn, *CASE.batch(0), precision="fp32", device="cpu",
                          chunk_size=256, device_memory=_tight("fp32", "fp32"),
                          optimizer=px.AdamW(**HYPER, state_dtype=d)) for d in ("fp32", "int8")}
    assert reports["int8"].host_bytes < reports["fp32"].host_bytes


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_checkpoints_and_state_dicts_resume_bit_for_bit(state_dtype, tmp_path):
    budget = _tight(state_dtype, "bf16")
    a = _step(state_dtype, budget=budget, debug=False)
    for i in range(2):
        a(*CASE.batch(i))
    a.save(tmp_path / "plain")
    a.save(tmp_path / "sharded", sharded=True)
    opt_sd = a.optimizer.state_dict()
    saved = _raw_states(a)
    want = [a(*CASE.batch(i)).item() for i in range(2, 4)]
    after = _raw_states(a)
    meta = torch.load(os.path.join(tmp_path, "plain", "meta.pt"), weights_only=True)
    assert meta["state_dtype"] == state_dtype
    for how in ("plain", "sharded", "state_dict"):
        b = _step(state_dtype, budget=budget, debug=False)
        b(*CASE.batch(7))
        if how == "state_dict":
            b.load(tmp_path / "plain")            # the model's values; then the optimizer's state from the dict
            b.optimizer.load_state_dict(opt_sd)
        else:
            b.load(tmp_path / how)
        assert all(torch.equal(x, y) for x, y in zip(saved, _raw_states(b))), how
        assert [b(*CASE.batch(i)).item() for i in range(2, 4)] == want, how
        assert all(torch.equal(x, y) for x, y in zip(after, _raw_states(b))), how


def test_state_dict_shows_fp32_moments_and_other_state_dtypes_convert(tmp_path):
    """optimizer.state_dict() holds torch's fp32 exp_avg / exp_avg_sq (dequantised), close to eager AdamW's; a
    checkpoint of exact states loads into an int8 step (quantised) and the reverse (dequantised)."""
    model = CASE.build_model()
    opt = torch.optim.AdamW(model.parameters(), **HYPER)
    for i in range(3):
        CASE.loss_fn(model, *CASE.batch(i)).backward()
        opt.step()
        opt.zero_grad()
    want = opt.state_dict()["state"]
    step = _step("int8", precision="fp32")
    for i in range(3):
        step(*CASE.batch(i))
    got = step.optimizer.state_dict()["state"]
    assert got.keys() == want.keys()
    weights = {i for i, p in enumerate(model.parameters()) if p.dim() == 2}
    for i in want:
        assert got[i]["exp_avg"].dtype == torch.float32 and float(got[i]["step"]) == 3.0
        for k in ("exp_avg", "exp_avg_sq"):
            err = ((got[i][k] - want[i][k]).norm() / want[i][k].norm()).item()
            # a block can span two parameters: a LayerNorm's small moments beside a bias's large ones get coarse
            # codes (unbiased, but 10-30% off after three steps here); the matrices' own blocks about 1.5%
            assert err < (0.03 if i in weights else 0.35), (i, k, err)
    # torch's own state dict, loaded into an int8 step: quantised, then shown back within one code
    fresh = _step("int8", precision="fp32")
    fresh(*CASE.batch(0))
    fresh.optimizer.load_state_dict(opt.state_dict())
    back = fresh.optimizer.state_dict()["state"]
    for i in want:
        for k in ("exp_avg", "exp_avg_sq"):
            err = ((back[i][k] - want[i][k]).norm() / want[i][k].norm()).item()
            assert err < (0.03 if i in weights else 0.35), (i, k, err)

    exact = _step("fp32", precision="fp32")
    exact(*CASE.batch(0))
    exact.save(tmp_path / "exact")
    step.save(tmp_path / "int8")
    exact.load(tmp_path / "int8")      # int8 -> fp32: the dequantised values, exactly
    assert all(torch.equal(exact.optimizer.state_dict()["state"][i][k], got[i][k])
               for i in got for k in ("exp_avg", "exp_avg_sq"))
    step.load(tmp_path / "exact")      # fp32 -> int8: quantised
    assert float(step.optimizer.state_dict()["state"][0]["step"]) == 1.0


def test_a_compressed_step_leaves_the_global_generator_alone():
    step = _step("bf16", precision="fp32")
    step(*CASE.batch(0))
    exact = _step("fp32", precision="fp32")
    exact(*CASE.batch(0))
    torch.manual_seed(1234)
    step(*CASE.batch(1))
    after = torch.get_rng_state()
    torch.manual_seed(1234)
    exact(*CASE.batch(1))
    assert torch.equal(after, torch.get_rng_state())


def _corpus(block: int, batch: int, steps: int):
    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "data", "tiny_corpus.txt")
    with open(path) as f:
        text = f.read()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        ix = torch.randint(len(data) - block - 1, (batch,), generator=g)
        out.append((torch.stack([data[i:i + block] for i in ix]), torch.stack([data[i + 1:i + 1 + block] for i in ix])))
    return len(chars), out


def test_training_quality_holds_with_compressed_states():
    """The small GPT on the shipped corpus, 60 steps at a high learning rate: the final losses (mean of the last
    ten) with bf16 and int8 states are within 3% of the exact states'."""
    vocab, batches = _corpus(block=32, batch=16, steps=60)
    final = {}
    for d in ("fp32", "bf16", "int8"):
        torch.manual_seed(0)
        model = GPT(vocab=vocab, block_size=32, n_layer=2, n_head=2, n_embd=64)
        step = px.compile(model, optimizer=px.AdamW(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, state_dtype=d),
                          precision="fp32", device="cpu")(gpt_loss)
        losses = [step(x, y).item() for x, y in batches]
        final[d] = sum(losses[-10:]) / 10
    assert final["fp32"] < 0.8 * losses[0], (final, losses[0])      # it learned
    for d in ("bf16", "int8"):
        assert abs(final[d] - final["fp32"]) / final["fp32"] < 0.03, final
