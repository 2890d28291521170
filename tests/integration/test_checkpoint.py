"""step.save / step.load: a run stopped after step k and resumed in a new process equals the uninterrupted run, bit for
bit (losses, parameters, optimizer states, loss scale), in fp32, bf16 and fp16, with dropout (the RNG state matters)
and a forced fp16 overflow (the loss scaler's state matters), at unlimited and tight budgets, and into a step compiled
with another chunk size and budget. Saves are atomic; a checkpoint is plain torch files.
"""
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import pstar_fx as px
import pstar_fx.checkpoint as ckpt
from pstar_fx.checkpoint import plain
from pstar_fx.ir import Role

import resume_script as rs
from models import GPT
from ranks import SUPPORT, child_env

pytestmark = pytest.mark.slow

K, STEPS = 3, 6
CONFIGS = [(p, b) for p in ("fp32", "bf16", "fp16") for b in (None, "tight")]


def _run(name, mode, precision, budget, ckpt_dir, chunk_size=2048):
    return dict(name=name, mode=mode, precision=precision, budget=budget, chunk_size=chunk_size, dropout=0.1,
                overflow_at=1, k=K, steps=STEPS, ckpt=ckpt_dir)


def _subprocess(runs: list[dict], tmp) -> dict:
    spec, out = os.path.join(tmp, f"spec-{runs[0]['mode']}.json"), os.path.join(tmp, f"out-{runs[0]['mode']}.pt")
    with open(spec, "w") as f:
        json.dump(runs, f)
    env = child_env()
    r = subprocess.run([sys.executable, os.path.join(SUPPORT, "resume_script.py"), spec, out], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Two processes. The first runs every configuration for STEPS steps, saving after step K on the way (save only
    reads), and once more without saving at all (fp16, tight: the uninterrupted reference of the hardest case). The
    second loads each checkpoint into a freshly built model and step and runs steps K..STEPS; also into steps
    compiled with other chunk sizes and budgets."""
    tmp = str(tmp_path_factory.mktemp("resume"))
    saving = [_run(_name(p, b), "save", p, b, os.path.join(tmp, _name(p, b))) for p, b in CONFIGS]
    plain = dict(_run("fp16-tight", "full", "fp16", "tight", None), name="fp16-tight-nosave")
    first = _subprocess(saving + [plain], tmp)
    resume = [dict(r, mode="resume", budget=first[r["name"]]["budget"]) for r in saving]
    # another layout: saved at a tight budget with 2048-element chunks, resumed unlimited with 5000-element chunks;
    # saved unlimited, resumed at a tight budget with 1000-element chunks
    resume.append(dict(_run("fp32-relayout", "resume", "fp32", None, os.path.join(tmp, "fp32-tight"), 5000)))
    resume.append(dict(_run("bf16-relayout", "resume", "bf16", "tight", os.path.join(tmp, "bf16-unlimited"), 1000)))
    return first, _subprocess(resume, tmp), tmp


def _name(precision, budget):
    return f"{precision}-{budget or 'unlimited'}"


def _assert_equal_state(a: dict, b: dict, where: str) -> None:
    assert a.keys() == b.keys(), where
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), \
            f"{where}: {k} differs (max |a-b| {(a[k].double() - b[k].double()).abs().max().item():.3e})"


def _assert_equal_optimizer(a: dict, b: dict, where: str) -> None:
    assert a["param_groups"] == b["param_groups"], where
    assert a["state"].keys() == b["state"].keys(), where
    for i in a["state"]:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a["state"][i][key], b["state"][i][key]), f"{where}: state {i} {key} differs"


def test_saving_does_not_disturb_the_run(results):
    first, _, _ = results
    a, b = first["fp16-tight"], first["fp16-tight-nosave"]
    assert a["losses"] == b["losses"]
    _assert_equal_state(a["state"], b["state"], "save vs no save")


@pytest.mark.parametrize("precision,budget", CONFIGS, ids=[_name(p, b) for p, b in CONFIGS])
def test_resumed_in_a_new_process_equals_the_uninterrupted_run_bit_for_bit(results, precision, budget):
    first, resume, _ = results
    name = _name(precision, budget)
    want, got = first[name], resume[name]
    assert got["losses"] == want["losses"][K:], name
    _assert_equal_state(got["state"], want["state"], name)
    _assert_equal_optimizer(got["optimizer"], want["optimizer"], name)
    assert got["loss_scale"] == want["loss_scale"], name
    if budget == "tight":
        assert want["budget"] is not None
    if precision == "fp16":
        # the forced overflow at step 1 was skipped and halved the scale: the scaler's state was needed
        assert want["losses"][1] > 1e3 and want["loss_scale"] == 2.0 ** 15


@pytest.mark.parametrize("name,source", [("fp32-relayout", "fp32-tight"), ("bf16-relayout", "bf16-unlimited")])
def test_a_checkpoint_loads_into_a_step_with_another_chunk_size_and_budget(results, name, source):
    """Values are per parameter: another chunk layout resumes the run. Equal to 1e-6 relative (the numerics
    policy; on this machine the result is bit-equal, asserted too in fp32 where the kernels are elementwise)."""
    first, resume, _ = results
    want, got = first[source], resume[name]
    for a, b in zip(got["losses"], want["losses"][K:]):
        assert abs(a - b) <= 1e-6 * abs(b), (name, got["losses"], want["losses"][K:])
    for k, v in want["state"].items():
        assert (got["state"][k].double() - v.double()).abs().max() <= 1e-6 * v.double().abs().max().clamp_min(1e-12)
    if name.startswith("fp32"):
        _assert_equal_state(got["state"], want["state"], name)


def test_a_checkpoint_is_plain_torch_files(results):
    """model.pt is model.state_dict()'s keys at full precision (loads into the eager model), optimizer.pt is
    torch.optim.AdamW's format (loads into an eager AdamW), meta.pt holds the scaler and the RNG state."""
    _, _, tmp = results
    d = os.path.join(tmp, "bf16-tight")
    assert sorted(os.listdir(d)) == sorted(ckpt.FILES)
    assert not [n for n in os.listdir(tmp) if ".tmp-" in n or ".old-" in n]
    sd = torch.load(os.path.join(d, "model.pt"), weights_only=True)
    model = GPT(vocab=64, block_size=16, n_layer=1, n_head=2, n_embd=32)
    assert sd.keys() == model.state_dict().keys() and all(v.dtype == torch.float32 for v in sd.values())
    model.load_state_dict(sd)
    opt = torch.optim.AdamW(model.parameters())
    opt.load_state_dict(torch.load(os.path.join(d, "optimizer.pt"), weights_only=True))
    assert len(opt.state) == len(list(model.parameters()))
    assert all(float(s["step"]) == K for s in opt.state.values())
    meta = torch.load(os.path.join(d, "meta.pt"), weights_only=True)
    assert meta["precision"] == "bf16" and meta["loss_scaler"] is None
    assert meta["rng"]["torch_cpu"].dtype == torch.uint8 and "torch_cuda" not in meta["rng"]
    fp16 = torch.load(os.path.join(tmp, "fp16-tight", "meta.pt"), weights_only=True)
    assert fp16["loss_scaler"]["scale"] == 2.0 ** 15 and fp16["loss_scaler"]["good_steps"] == 1


# -- in this process: the same script's model, data and loss ---------------------------------------------------------
RUN = _run("x", "full", "fp32", None, None)


def _trained(steps=K, **over):
    run = dict(RUN, **over)
    step, _ = rs.build(run)
    torch.manual_seed(rs.SEED)
    losses = [step(*rs.batch(run, i)).item() for i in range(steps)]
    return step, losses, run


def test_the_rng_state_matters_and_is_restored(tmp_path):
    """Negative control for the dropout runs: after load, reseeding the generator changes the next loss; without
    reseeding it equals the uninterrupted run's."""
    step, _, run = _trained()
    step.save(tmp_path / "c")
    want = step(*rs.batch(run, K)).item()
    for reseed, equal in ((False, True), (True, False)):
        other = rs.build(run)[0]
        other.load(tmp_path / "c")
        if reseed:
            torch.manual_seed(99)
        assert (other(*rs.batch(run, K)).item() == want) is equal


def test_a_checkpoint_of_another_precision_says_what_becomes_of_the_loss_scale(tmp_path):
    """fp16 -> bf16: the saved scale is not used; bf16 -> fp16: the step keeps its own scale; each says so. The same
    precision on both sides: no warning."""
    fp16, _, _ = _trained(steps=2, precision="fp16", overflow_at=1)
    bf16, _, _ = _trained(steps=2, precision="bf16")
    fp16.save(tmp_path / "fp16")
    bf16.save(tmp_path / "bf16")
    with pytest.warns(UserWarning, match=r"saved in fp16 and this step trains in bf16: its fp16 loss scale \(32768\) "
                                         "is not used"):
        _trained(steps=1, precision="bf16")[0].load(tmp_path / "fp16")
    fresh = _trained(steps=1, precision="fp16", overflow_at=0)[0]
    assert fresh.loss_scale == 2.0 ** 15
    with pytest.warns(UserWarning, match=r"saved in bf16 and this step trains in fp16: it has no loss scale, so this "
                                         r"step keeps its own \(32768\)"):
        fresh.load(tmp_path / "bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _trained(steps=1, precision="fp16")[0].load(tmp_path / "fp16")


def test_load_after_sync_model_and_after_a_failed_commit(tmp_path):
    """A step that gave the model back (sync_model) trains on the loaded values, not the model's; a step broken by a
    failure after its commit point (CommitError) is usable again after load, and continues exactly."""
    step, _, run = _trained()
    step.save(tmp_path / "c")
    want = [step(*rs.batch(run, i)).item() for i in range(K, K + 2)]

    other, _, _ = _trained(steps=1)
    other.sync_model()
    other.load(tmp_path / "c")
    assert [other(*rs.batch(run, i)).item() for i in range(K, K + 2)] == want

    broken, _, _ = _trained(steps=1)
    g = broken.graphs["scheduled"]
    first_update = next(i for i, n in enumerate(g.nodes) if g.ann[n.name].role is Role.OPTIMIZER_STEP)
    second_update = first_update + 1 + next(i for i, n in enumerate(g.nodes[first_update + 1:])
                                            if g.ann[n.name].role is Role.OPTIMIZER_STEP)

    def fail(i, node):
        if i == second_update:
            raise RuntimeError("injected device fault")
    broken._before_node = fail
    with pytest.raises(px.CommitError):
        broken(*rs.batch(run, 1))
    broken._before_node = None
    broken.load(tmp_path / "c")
    assert [broken(*rs.batch(run, i)).item() for i in range(K, K + 2)] == want


def test_load_before_the_first_step(tmp_path):
    step, _, run = _trained()
    step.save(tmp_path / "c")
    want_sd = step.state_dict()
    want = step(*rs.batch(run, K)).item()
    fresh = rs.build(run)[0]
    fresh.load(tmp_path / "c")
    assert fresh._compiler.store is None
    _assert_equal_state(fresh.state_dict(), want_sd, "before the first step")
    assert fresh(*rs.batch(run, K)).item() == want


def test_a_first_call_refused_after_a_load_keeps_nothing_and_the_next_call_resumes(tmp_path):
    """A step loaded before its first call, whose first call is refused (its checkpoint has moments for a parameter
    the user froze since): the refused call lays nothing out and drops nothing loaded, so with the flag restored the
    next call resumes the saved run bit for bit."""
    step, _, run = _trained()
    step.save(tmp_path / "c")
    want = step(*rs.batch(run, K)).item()
    want_sd = step.state_dict()
    fresh = rs.build(run)[0]
    fresh.load(tmp_path / "c")
    frozen = next(p for p in fresh._compiler.model.parameters() if p.dim() == 2)
    frozen.requires_grad_(False)
    with pytest.raises(ValueError, match="does not train"):
        fresh(*rs.batch(run, K))
    assert fresh._compiler.store is None and fresh._compiler.layout is None
    frozen.requires_grad_(True)
    assert fresh(*rs.batch(run, K)).item() == want
    _assert_equal_state(fresh.state_dict(), want_sd, "after the refused first call")


def test_an_interrupted_save_never_leaves_a_checkpoint_that_load_accepts(tmp_path, monkeypatch):
    step, _, run = _trained(steps=1)
    path = tmp_path / "c"
    step.save(path)
    good = torch.load(path / "model.pt", weights_only=True)
    step(*rs.batch(run, 1))

    # interrupted while writing the second file: the old checkpoint stays whole, no temporary is left
    real_write, calls = plain.write, []

    def write_then_fail(obj, p):
        calls.append(p)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real_write(obj, p)
    monkeypatch.setattr(plain, "write", write_then_fail)
    with pytest.raises(KeyboardInterrupt):
        step.save(path)
    monkeypatch.setattr(plain, "write", real_write)
    assert sorted(os.listdir(tmp_path)) == ["c"]
    _assert_equal_state(torch.load(path / "model.pt", weights_only=True), good, "old checkpoint")
    rs.build(run)[0].load(path)

    # interrupted between the two renames: nothing under the name, and load says where both copies are
    real_replace, renames = os.replace, []

    def replace_then_fail(a, b):
        renames.append((a, b))
        if len(renames) == 2:
            raise KeyboardInterrupt
        real_replace(a, b)
    monkeypatch.setattr(os, "replace", replace_then_fail)
    with pytest.raises(KeyboardInterrupt):
        step.save(path)
    monkeypatch.setattr(os, "replace", real_replace)
    with pytest.raises(FileNotFoundError, match=r"c\.old-.*c\.tmp-|c\.tmp-.*c\.old-"):
        rs.build(run)[0].load(path)

    # a directory with other files in it is not replaced
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a pstar-fx checkpoint"):
        step.save(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_a_checkpoint_of_another_model_is_refused_and_changes_nothing(tmp_path):
    step, _, run = _trained(steps=1)
    step.save(tmp_path / "c")
    other = px.compile(GPT(vocab=64, block_size=16, n_layer=2, n_head=2, n_embd=32),
                       optimizer=px.AdamW(lr=1e-2), device="cpu")(rs.loss_fn)
    other(*rs.batch(run, 0))
    before = other.state_dict()
    with pytest.raises(ValueError, match="another model"):
        other.load(tmp_path / "c")
    _assert_equal_state(other.state_dict(), before, "refused load")


@pytest.mark.parametrize("sharded", [False, True])
def test_another_models_keys_are_named_missing_and_unexpected(tmp_path, sharded):
    """As nn.Module.load_state_dict names them: the keys the checkpoint lacks, and those this model lacks."""
    def make(last):
        torch.manual_seed(0)
        model = torch.nn.Sequential()
        model.add_module("body", torch.nn.Linear(8, 8))
        model.add_module(last, torch.nn.Linear(8, 4))
        return px.compile(model, optimizer=px.AdamW(lr=1e-2), device="cpu")(
            lambda m, x, y: torch.nn.functional.cross_entropy(m(x), y))
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    saved = make("head")
    saved(x, y)
    saved.save(tmp_path / "c", sharded=sharded)
    other = make("head2")
    other(x, y)
    with pytest.raises(px.CheckpointError, match=r"missing from the checkpoint: 2 \(head2.bias, head2.weight\); "
                                                 r"not in this model: 2 \(head.bias, head.weight\)"):
        other.load(tmp_path / "c")


def _frozen_base_step(train_first: bool = False, precision: str = "fp32"):
    """A small model whose first layer is frozen (a fine-tune's base weights), or trained with train_first."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model[0].weight.requires_grad_(train_first)
    model[0].bias.requires_grad_(train_first)
    return px.compile(model, optimizer=px.AdamW(lr=1e-2), device="cpu", precision=precision)(
        lambda m, x, y: torch.nn.functional.mse_loss(m(x), y))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("first", ["before-first-step", "after"])
def test_frozen_parameters_left_out_of_a_checkpoint_resume_exactly_from_the_models_own(tmp_path, precision, first):
    """step.save(path, frozen=False): model.pt holds the trained parameters only (the frozen ones named in the
    meta), and a step on a model built with the same frozen values resumes bit for bit, loaded before its first step
    (into the model) or after (into the chunks)."""
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(6)]
    a = _frozen_base_step(precision=precision)
    for b in batches[:3]:
        a(*b)
    a.save(tmp_path / "c", frozen=False)
    assert sorted(torch.load(tmp_path / "c" / "model.pt", weights_only=True)) == ["2.bias", "2.weight"]
    assert torch.load(tmp_path / "c" / "meta.pt", weights_only=True)["left_out"] == ["0.bias", "0.weight"]
    want = [a(*b).item() for b in batches[3:]]
    resumed = _frozen_base_step(precision=precision)
    if first == "after":
        resumed(*batches[0])
    resumed.load(tmp_path / "c")
    assert [resumed(*b).item() for b in batches[3:]] == want
    assert all(torch.equal(v, resumed.state_dict()[k]) for k, v in a.state_dict().items())


def test_a_checkpoint_leaving_out_what_the_step_trains_is_refused(tmp_path):
    a = _frozen_base_step()
    a(torch.randn(4, 8), torch.randn(4, 4))
    a.save(tmp_path / "c", frozen=False)
    trains_all = _frozen_base_step(train_first=True)
    trains_all(torch.randn(4, 8), torch.randn(4, 4))
    before = trains_all.state_dict()
    with pytest.raises(px.CheckpointError, match=r"leaves out \['0.bias', '0.weight'\], which this step trains"):
        trains_all.load(tmp_path / "c")
    assert all(torch.equal(v, trains_all.state_dict()[k]) for k, v in before.items())
    with pytest.raises(ValueError, match=r"frozen=False\) leaves frozen parameters out of plain files"):
        a.save(tmp_path / "s", sharded=True, frozen=False)
    assert not (tmp_path / "s").exists()


def test_a_checkpoint_that_froze_what_this_step_trains_says_to_freeze_them(tmp_path):
    """Saved whole (frozen=True) by a step that froze the first layer, loaded by one that trains it in one chunk with
    the second: the optimizer state has moments for some of the chunk's parameters only. Refused, saying that the
    run which saved it did not train them, and what to do."""
    a = _frozen_base_step()
    a(torch.randn(4, 8), torch.randn(4, 4))
    a.save(tmp_path / "c")
    trains_all = _frozen_base_step(train_first=True)
    trains_all(torch.randn(4, 8), torch.randn(4, 4))
    with pytest.raises(px.CheckpointError, match=r"did not train \['0.weight', '0.bias'\].*freeze them here too"):
        trains_all.load(tmp_path / "c")


@pytest.mark.parametrize("scheduler_at", ["save", "load"])
def test_a_schedulers_initial_lr_does_not_make_the_checkpoint_anothers(tmp_path, scheduler_at):
    """A scheduler adds 'initial_lr' to the groups. A checkpoint saved with one loads into a step that has none yet
    (its scheduler made after the load), and one saved without into a step that has one, as eager torch's
    load_state_dict takes them; the run goes on as the uninterrupted one."""
    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
        return px.compile(model, optimizer=px.AdamW(lr=1e-2), device="cpu")(
            lambda m, x, y: torch.nn.functional.cross_entropy(m(x), y))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(4)]
    step = make()
    if scheduler_at == "save":
        torch.optim.lr_scheduler.LambdaLR(step.optimizer, lambda i: 1.0)
    for b in batches[:2]:
        step(*b)
    step.save(tmp_path / "ckpt")
    fresh = make()
    if scheduler_at == "load":
        torch.optim.lr_scheduler.LambdaLR(fresh.optimizer, lambda i: 1.0)
    fresh.load(tmp_path / "ckpt")
    assert [step(*b).item() for b in batches[2:]] == [fresh(*b).item() for b in batches[2:]]
