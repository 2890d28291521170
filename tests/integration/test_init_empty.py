"""px.init_empty(): models built without memory, initialised in their chunks at the first step.

Every model here is built twice from the same RNG state: eagerly, and under px.init_empty(). The values pstar-fx makes
in its chunks must equal the eager ones bit for bit, and training from them must equal training from the eager model
(bit for bit against pstar-fx on the eager model, to 1e-6 against eager PyTorch), under unlimited and tight budgets."""
import functools
import gc
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pstar_fx as px
from pstar_fx.frontend.init_empty import EmptyTensor
from pstar_fx.api.model_state import HeldTensor

from harness import DEVICE, HYPER, eager_run, fetch_counts, host_params, rel_err, tight_budget
from models import CASES_BY_NAME, GPT, MODEL_SEED, assert_state_close, gpt_loss
from ranks import child_env

pytestmark = pytest.mark.cuda

INIT_CASES = ["gpt_tied", "hf_gpt2", "hf_llama", "cnn_bn"]


def built_empty(build, seed=MODEL_SEED):
    """build() under px.init_empty() from torch.manual_seed(seed); the caller's RNG state is left untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with px.init_empty():
            model = build()
    return model.train()


def built_eager(build, seed=MODEL_SEED):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build()
    return model.train()


def assert_equal_exactly(got: dict, want: dict) -> None:
    """Every value bit for bit; a half-precision parameter comes out of a step at the full precision the step holds
    it at (fp32), holding the eager value exactly."""
    assert set(got) == set(want), set(got) ^ set(want)
    for k, v in want.items():
        if v.dtype in (torch.bfloat16, torch.float16) and got[k].dtype is torch.float32:
            v = v.float()
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k].cpu(), v.cpu()), f"{k}: differs from eager (max |diff| " \
            f"{(got[k].cpu().double() - v.cpu().double()).abs().max().item():.3e})"


def compiled(model, case, precision="fp32", budget=None, chunk_size=None, optimizer=True):
    return px.compile(model, optimizer=px.AdamW(**HYPER) if optimizer else None, precision=precision,
                      device=DEVICE, device_memory=budget, chunk_size=chunk_size, debug=True)(case.loss_fn)


# -- initialisation equals eager -------------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", INIT_CASES)
def test_initial_values_equal_eager_bit_for_bit(name, precision):
    case = CASES_BY_NAME[name]
    eager = built_eager(case.build)
    model = built_empty(case.build)
    floating = [t for t in list(model.parameters()) + list(model.buffers()) if t.is_floating_point()]
    assert floating and all(isinstance(t, EmptyTensor) for t in floating)    # nothing was allocated
    step = compiled(model, case, precision)
    step.lower(*case.batch(0))
    assert_equal_exactly(step.state_dict(), eager.state_dict())   # before any step: made in the chunks now
    step.sync_model()
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())    # non-persistent buffers too
    want = dict(eager.named_parameters()) | dict(eager.named_buffers())
    assert not any(isinstance(t, (EmptyTensor, HeldTensor)) for t in tensors.values())
    assert_equal_exactly({k: t.detach() for k, t in tensors.items()}, {k: t.detach() for k, t in want.items()})


class Zoo(nn.Module):
    """Initialisation patterns beyond nn.Linear's: parameters from expressions, trunc_normal_ / orthogonal_ /
    sparse_ (which torch skips on meta tensors and whose real paths depend on values), xavier, writes through .data,
    a parameter that reads another, buffers computed from arange, a bf16 parameter, a frozen one, two parameters
    sharing one storage, a padding row, and a tied weight whose own initialisation was drawn and thrown away."""

    def __init__(self, d=16, vocab=10):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        self.a = nn.Parameter(torch.randn(d, d) * 0.02)
        self.b = nn.Linear(d, d)
        nn.init.trunc_normal_(self.b.weight, std=0.02)
        self.c = nn.Linear(d, d, bias=False)
        nn.init.orthogonal_(self.c.weight)
        self.e = nn.Linear(d, d)
        nn.init.xavier_uniform_(self.e.weight)
        nn.init.sparse_(self.e.weight.data, sparsity=0.5)
        self.e.bias.data.uniform_(-0.1, 0.1)
        self.gain = nn.Parameter(torch.rand(d) + 0.5)
        self.scale = nn.Parameter(torch.randn(d).to(torch.bfloat16))
        self.frozen = nn.Parameter(torch.randn(d), requires_grad=False)
        flat = torch.randn(2 * d)
        self.lo, self.hi = nn.Parameter(flat[:d]), nn.Parameter(flat[d:])
        self.register_buffer("freq", 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)))
        self.register_buffer("mask", torch.tril(torch.ones(d, d)), persistent=False)
        self.register_buffer("count", torch.tensor(3))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        with torch.no_grad():
            self.b.weight.mul_(0.5).add_(self.a)

    def forward(self, idx):
        x = self.emb(idx) @ self.a                                    # (B, T, d)
        x = self.b(x) + self.c(x) * self.gain * self.scale.float() + self.frozen
        x = self.e(x) @ self.mask + self.freq.repeat(2) + self.lo * self.hi
        return self.head(x)                                           # (B, T, vocab)


def zoo_loss(model, idx, targets):
    return F.cross_entropy(model(idx).flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_initialisation_patterns_equal_eager(precision):
    eager = built_eager(Zoo)
    model = built_empty(Zoo)
    assert isinstance(model.count, torch.Tensor) and not isinstance(model.count, EmptyTensor)   # torch.tensor: real
    gen = torch.Generator().manual_seed(0)
    idx, targets = torch.randint(0, 10, (2, 5), generator=gen), torch.randint(0, 10, (2, 5), generator=gen)
    step = px.compile(model, optimizer=px.AdamW(**HYPER), precision=precision, device=DEVICE)(zoo_loss)
    ref = px.compile(eager, optimizer=px.AdamW(**HYPER), precision=precision, device=DEVICE)(zoo_loss)
    step.lower(idx, targets)
    assert_equal_exactly(step.state_dict(), eager.state_dict())
    for _ in range(2):
        assert step(idx, targets).item() == ref(idx, targets).item()
    assert_equal_exactly(step.state_dict(), ref.state_dict())
    step.sync_model()
    ref.sync_model()
    assert torch.equal(model.mask, eager.mask) and torch.equal(model.freq, eager.freq)


# -- training from it equals training from the eager model -------------------------------------------------------
def _train(step, case, steps):
    losses, after_one = [], None
    for i in range(steps):
        losses.append(step(*case.batch(i)).item())
        if i == 0:
            after_one = step.state_dict()
    return losses, after_one, step.state_dict()


@pytest.mark.parametrize("tight", [False, True], ids=["unlimited", "tight"])
@pytest.mark.parametrize("name", ["gpt_tied", "hf_gpt2", "hf_llama"])
def test_training_fp32_equals_eager(name, tight):
    case = CASES_BY_NAME[name]
    chunk = 1024
    budget = tight_budget(case, chunk) if tight else None
    steps = 3
    got = _train(compiled(built_empty(case.build), case, budget=budget, chunk_size=chunk), case, steps)
    ref_step = compiled(case.build_model(), case, budget=budget, chunk_size=chunk)
    want = _train(ref_step, case, steps)
    assert got[0] == want[0]                                  # losses, bit for bit
    assert_equal_exactly(got[1], want[1])                     # after one step
    assert_equal_exactly(got[2], want[2])                     # after several
    if tight:
        assert max(fetch_counts(ref_step.graphs["scheduled"]).values()) >= 2, "no chunk was evicted and fetched again"
    # and eager PyTorch, to the numerics policy's 1e-6 (on a GPU, its host-stepped parameters updated on the CPU)
    eager_losses, eager_sd = eager_run(case, steps, host_params=host_params(ref_step))
    assert rel_err(got[0], eager_losses) <= 1e-6
    assert_state_close(got[2], eager_sd, rtol=1e-6)


@pytest.mark.parametrize("tight", [False, True], ids=["unlimited", "tight"])
@pytest.mark.parametrize("name", ["gpt_tied", "hf_llama"])
def test_training_bf16_equals_training_the_eager_model(name, tight):
    """Mixed precision: the fp32 masters and the bf16 chunks rounded from them are what the eager model gives."""
    case = CASES_BY_NAME[name]
    budget = tight_budget(case, 1024) if tight else None
    got = _train(compiled(built_empty(case.build), case, "bf16", budget, 1024), case, 2)
    want = _train(compiled(case.build_model(), case, "bf16", budget, 1024), case, 2)
    assert got[0] == want[0]
    assert_equal_exactly(got[1], want[1])
    assert_equal_exactly(got[2], want[2])


def test_sync_model_gives_real_tensors_back():
    case = CASES_BY_NAME["gpt_tied"]
    model = built_empty(case.build)
    step = compiled(model, case)
    for i in range(2):
        step(*case.batch(i))
    sd = step.state_dict()
    assert step.sync_model() is model
    for name, p in model.named_parameters():
        assert type(p) is nn.Parameter and p.device.type == "cpu" and torch.equal(p.detach(), sd[name])
    assert model.wte.weight is model.lm_head.weight
    x, y = case.batch(5)
    case.loss_fn(model, x, y).backward()                      # an ordinary eager model again
    step(*case.batch(2))                                      # and the step takes it back


def test_load_state_dict_into_an_empty_model():
    case = CASES_BY_NAME["gpt_tied"]
    trained = case.build_model()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    step = compiled(built_empty(case.build), case)
    step.lower(*case.batch(0))
    step.load_state_dict(trained.state_dict())
    assert_equal_exactly(step.state_dict(), trained.state_dict())
    step(*case.batch(0))


def _logits(m, idx):
    return m(idx)


def test_evaluation_of_an_empty_model():
    case = CASES_BY_NAME["gpt_tied"]
    x, _ = case.batch(0)
    fn = _logits
    got = px.compile(built_empty(case.build), optimizer=None, device=DEVICE, precision="fp32")(fn)(x)
    want = px.compile(case.build_model(), optimizer=None, device=DEVICE, precision="fp32")(fn)(x)
    assert torch.equal(got, want)
    with torch.no_grad():
        torch.testing.assert_close(got, case.build_model().to(DEVICE)(x.to(DEVICE)), rtol=1e-5, atol=1e-6)


# -- the RNG ----------------------------------------------------------------------------------------------------
class Reseeded(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        torch.manual_seed(99)              # inside the build: the ops after it draw from the new state, as in eager
        self.b = nn.Linear(8, 8)


def test_manual_seed_inside_the_block_and_the_global_rng_after_it():
    torch.manual_seed(5)
    eager = Reseeded()
    after_eager = torch.get_rng_state()
    torch.manual_seed(5)
    with px.init_empty():
        model = Reseeded()
    after_block = torch.get_rng_state()
    # building on meta draws nothing: the global RNG is where the block's last manual_seed left it, not advanced
    assert torch.equal(after_block, torch.manual_seed(99).get_state())
    assert not torch.equal(after_block, after_eager)
    step = px.compile(model, optimizer=px.AdamW(lr=1e-3), device=DEVICE)(lambda m, x: m.b(m.a(x)).square().mean())
    torch.manual_seed(123)
    before = torch.get_rng_state()
    step.lower(torch.randn(4, 8, generator=torch.Generator().manual_seed(0)))
    assert_equal_exactly(step.state_dict(), eager.state_dict())
    assert torch.equal(torch.get_rng_state(), before)         # the replay used its own generator


# -- host memory: the model is never materialised ---------------------------------------------------------------
_MEMORY_SCRIPT = textwrap.dedent("""
    import gc, json, sys
    import torch
    import pstar_fx as px
    from models import GPT, gpt_loss

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    def reset():                     # the peak resident size (VmHWM) starts again from the current one
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return status("VmRSS")

    cfg = dict(vocab=2048, block_size=16, n_layer=2, n_head=8, n_embd=1024)
    batch = (torch.randint(0, 2048, (1, 8)), torch.randint(0, 2048, (1, 8)))
    with px.init_empty():            # warm up every code path on a tiny model, so imports are not measured
        tiny = GPT(vocab=64, block_size=16, n_layer=1, n_head=2, n_embd=32)
    px.compile(tiny, optimizer=px.AdamW(lr=1e-3), device="cpu")(gpt_loss).lower(*[b % 64 for b in batch])
    del tiny

    before = reset()
    torch.manual_seed(0)
    with px.init_empty():
        model = GPT(**cfg)
    step = px.compile(model, optimizer=px.AdamW(lr=1e-3), device="cpu", precision="fp32")(gpt_loss)
    step.lower(*batch)               # traces, plans, allocates the chunks' host homes and optimizer states
    store = step._compiler.store
    store_bytes = sum(t.nbytes for t in store.host_param) + sum(t.nbytes for t in store.states if t is not None)
    lowered = reset()
    step._model_state.take()               # the first step's initialisation, into the chunks
    take = status("VmHWM") - lowered
    compile_total = status("VmHWM") - before
    before = reset()                 # the control: an eager build, measured the same way
    torch.manual_seed(0)
    eager = GPT(**cfg)
    eager_growth = status("VmHWM") - before
    sd, ref = step.state_dict(), eager.state_dict()
    print(json.dumps(dict(model=sum(p.numel() * 4 for p in eager.parameters()), store=store_bytes, take=take,
                          compile_total=compile_total, eager=eager_growth,
                          equal=all(torch.equal(sd[k], ref[k]) for k in ref))))
""")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc peak-RSS reset")
def test_host_memory_growth_stays_below_the_model_size():
    """A 104 MiB (fp32) GPT: compiling it and initialising it in its chunks grows the peak resident memory by the
    chunks' own buffers plus less than a quarter of the model; an eager build of it grows it by the whole model
    (which shows the measurement sees a materialised model). Run in a fresh process, peak RSS reset before each."""
    import json
    here = os.path.dirname(__file__)
    env = child_env()
    out = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT], capture_output=True, text=True, env=env, cwd=here,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    model = r["model"]
    assert model > 100 * 2**20
    assert r["equal"], "the values initialised in the chunks differ from eager's"
    assert r["eager"] >= 0.9 * model, r                              # the control sees a materialised model
    assert r["take"] < model / 4, r                                   # initialising: one tensor at a time at most
    assert r["compile_total"] - r["store"] < model / 4, r            # compiling: the chunks and little else


# -- errors ----------------------------------------------------------------------------------------------------
def test_an_empty_model_used_eagerly_says_what_to_do():
    case = CASES_BY_NAME["gpt_tied"]
    model = built_empty(case.build)
    x, _ = case.batch(0)
    with pytest.raises(px.EmptyModelError, match=r"built under px.init_empty\(\).*px.compile"):
        model(x)
    with pytest.raises(px.EmptyModelError, match="saved"):
        torch.save(model.state_dict(), os.devnull)
    with pytest.raises(px.EmptyModelError):
        model.to(torch.bfloat16)
    step = compiled(model, case)
    with pytest.raises(px.EmptyModelError, match="no values yet"):
        step.state_dict()                    # nothing compiled yet: no chunks to make the values in
    assert isinstance(model.wte.weight, EmptyTensor) and model.training


def test_a_meta_model_not_built_under_init_empty():
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    step = px.compile(model, optimizer=px.AdamW(lr=1e-3), device=DEVICE)(lambda m, x: m(x).sum())
    with pytest.raises(ValueError, match=r"meta device.*px.init_empty\(\)"):
        step(torch.randn(2, 4))


def test_what_cannot_be_recorded_names_the_op():
    with pytest.raises(px.EmptyModelError, match=r"_local_scalar_dense.*Python numbers"):
        with px.init_empty():
            lin = nn.Linear(4, 4)
            lin.weight.sum().item()
    with pytest.raises(px.EmptyModelError, match=r"normal_.*explicit generator"):
        with px.init_empty():
            nn.init.normal_(nn.Linear(4, 4).weight, generator=torch.Generator())
    with pytest.raises(px.EmptyModelError, match=r"trunc_normal_.*explicit generator"):
        with px.init_empty():
            nn.init.trunc_normal_(nn.Linear(4, 4).weight, generator=torch.Generator())
    with pytest.raises(px.EmptyModelError, match="real CPU tensor"):
        with px.init_empty():
            torch.randn(3, device="cpu")
    with pytest.raises(px.EmptyModelError, match="writes a real tensor"):
        real = torch.zeros(4)
        with px.init_empty():
            real.add_(nn.Linear(4, 4).bias)
    with pytest.raises(px.EmptyModelError, match="do not nest"):
        with px.init_empty(), px.init_empty():
            pass
    with px.init_empty():                     # after a failed block, the next one works
        lin = nn.Linear(4, 4)
    assert isinstance(lin.weight, EmptyTensor)


def _bias_model(bias: torch.Tensor) -> nn.Linear:
    with px.init_empty():
        lin = nn.Linear(4, 4)
        with torch.no_grad():
            lin.bias.copy_(bias)              # a real tensor read while building
    return lin


def _square_loss(m, x):
    return m(x).square().mean()


def test_real_tensors_read_while_building():
    loss = _square_loss
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    bias = torch.arange(4.0)
    step = px.compile(_bias_model(bias), optimizer=px.AdamW(lr=1e-3), device=DEVICE)(loss)
    step.lower(x)
    assert torch.equal(step.state_dict()["bias"], bias)
    changed = torch.arange(4.0)
    step = px.compile(_bias_model(changed), optimizer=px.AdamW(lr=1e-3), device=DEVICE)(loss)
    changed.add_(1)
    with pytest.raises(px.EmptyModelError, match=r"aten.copy_.*modified since"):
        step(x)
    outside = torch.empty(4, 4, device="meta")
    with px.init_empty():
        lin = nn.Linear(4, 4)
        with torch.no_grad():
            lin.weight.copy_(outside)
    step = px.compile(lin, optimizer=px.AdamW(lr=1e-3), device=DEVICE)(loss)
    with pytest.raises(px.EmptyModelError, match="not made inside"):
        step(x)


def test_the_block_is_cheap_and_allocates_nothing():
    """A GPT far larger than this machine could hold in fp32 (12 x 8192 wide: 9.7B parameters, 39 GB) builds in
    the block without allocating it."""
    with px.init_empty():
        model = GPT(vocab=50304, block_size=64, n_layer=12, n_head=64, n_embd=8192)
    n = sum(p.numel() for p in model.parameters())
    assert n > 9e9 and math.isfinite(n)
    assert all(isinstance(p, EmptyTensor) for p in model.parameters())


# -- px.init_empty(device="cuda"): the initialisation made on the GPU, storage by storage ------------------------
ON_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="px.init_empty(device='cuda') needs a CUDA device")
STREAMED_CASES = INIT_CASES + ["zoo"]


def _case_parts(name):
    """(build, loss_fn, batch(i)) of a test case, or of the Zoo."""
    if name == "zoo":
        gen = torch.Generator().manual_seed(0)
        batch = (torch.randint(0, 10, (2, 5), generator=gen), torch.randint(0, 10, (2, 5), generator=gen))
        return Zoo, zoo_loss, lambda i: batch
    case = CASES_BY_NAME[name]
    return case.build, case.loss_fn, case.batch


def streamed_on_the_cpu(model):
    """Make the model's recording replay as px.init_empty(device=...) does (storage by storage, each value dropped,
    kept or parked on the host between its uses, and copied into its chunk after its last), but on the CPU: its
    recorded RNG states are the CPU's, so the values must still equal an eager CPU build's."""
    for t in [*model.parameters(), *model.buffers()]:
        if isinstance(t, EmptyTensor):
            t._pstar_recording.device = torch.device("cpu")
    return model


def _values_equal_after_sync(step, model, eager):
    step.sync_model()
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    want = dict(eager.named_parameters()) | dict(eager.named_buffers())
    assert not any(isinstance(t, (EmptyTensor, HeldTensor)) for t in tensors.values())
    assert_equal_exactly({k: t.detach() for k, t in tensors.items()}, {k: t.detach() for k, t in want.items()})


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", STREAMED_CASES)
def test_the_streamed_replay_run_on_the_cpu_equals_eager(name, precision):
    """The Zoo parks values between uses (a parameter that a later op reads) and drops dead ones (Linear's
    kaiming_uniform_ replaced by trunc_normal_, a tied weight's own initialisation)."""
    build, loss_fn, batch = _case_parts(name)
    eager = built_eager(build)
    model = streamed_on_the_cpu(built_empty(build))
    step = px.compile(model, optimizer=px.AdamW(**HYPER), precision=precision, device=DEVICE)(loss_fn)
    step.lower(*batch(0))
    assert_equal_exactly(step.state_dict(), eager.state_dict())
    _values_equal_after_sync(step, model, eager)


def test_the_device_argument():
    with pytest.raises(ValueError, match="CPU .*or on a CUDA device"):
        px.init_empty(device="mps")
    with px.init_empty(device="cpu") as block:           # the CPU: the in-place replay, as with no device
        lin = nn.Linear(4, 4)
    assert block._recorder.rec.device is None and isinstance(lin.weight, EmptyTensor)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            px.init_empty(device="cuda")


def built_on_cuda(build, empty: bool, seed=MODEL_SEED):
    """build() from torch.manual_seed(seed) on the current GPU: under px.init_empty(device="cuda"), or eagerly under
    torch.device("cuda"); the caller's CPU and CUDA RNG states are left untouched."""
    with torch.random.fork_rng(devices=[torch.cuda.current_device()]):
        torch.manual_seed(seed)
        if empty:
            with px.init_empty(device="cuda"):
                model = build()
        else:
            with torch.device("cuda"):
                model = build()
    return model.train()


@ON_CUDA
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", STREAMED_CASES)
def test_cuda_initial_values_equal_an_eager_cuda_build(name, precision):
    build, loss_fn, batch = _case_parts(name)
    eager = built_on_cuda(build, empty=False)
    model = built_on_cuda(build, empty=True)
    assert all(isinstance(p, EmptyTensor) for p in model.parameters())       # nothing was allocated
    step = px.compile(model, optimizer=px.AdamW(**HYPER), precision=precision, device="cuda")(loss_fn)
    step.lower(*batch(0))
    assert_equal_exactly(step.state_dict(), eager.state_dict())
    on_cpu = built_eager(build).state_dict()       # the CPU generator makes other values: the CUDA one was replayed
    assert any(not torch.equal(v, eager.state_dict()[k].cpu()) for k, v in on_cpu.items() if v.is_floating_point())
    # training from it equals pstar-fx training the eager CUDA model, bit for bit
    ref = px.compile(eager, optimizer=px.AdamW(**HYPER), precision=precision, device="cuda")(loss_fn)
    for i in range(2):
        assert step(*batch(i)).item() == ref(*batch(i)).item()
    assert_equal_exactly(step.state_dict(), ref.state_dict())
    _values_equal_after_sync(step, model, ref.sync_model())


@ON_CUDA
@pytest.mark.parametrize("name", ["gpt_tied", "hf_llama"])
def test_cuda_initial_values_with_states_on_the_host_equal_an_eager_cuda_build(name):
    """bf16 under a budget that puts optimizer states on the host: the fp32 masters there are copied from the GPU
    through each chunk's pinned home (StoreValues.load_params) and still equal the eager CUDA build bit for bit."""
    from pstar_fx.ir import StateHome
    build, loss_fn, batch = _case_parts(name)
    eager = built_on_cuda(build, empty=False)
    model = built_on_cuda(build, empty=True)
    least = px.compile(built_on_cuda(build, empty=True), optimizer=px.AdamW(**HYPER), precision="bf16",
                       device="cuda", chunk_size=1024)(loss_fn).min_device_memory(*batch(0))
    step = px.compile(model, optimizer=px.AdamW(**HYPER), precision="bf16", device="cuda", chunk_size=1024,
                      device_memory=int(least * 1.3))(loss_fn)
    step.lower(*batch(0))
    assert StateHome.HOST in {c.state_home for c in step.graphs["scheduled"].chunks}
    assert_equal_exactly(step.state_dict(), eager.state_dict())
    ref = px.compile(eager, optimizer=px.AdamW(**HYPER), precision="bf16", device="cuda", chunk_size=1024,
                     device_memory=int(least * 1.3))(loss_fn)
    for i in range(2):
        assert step(*batch(i)).item() == ref(*batch(i)).item()
    assert_equal_exactly(step.state_dict(), ref.state_dict())


class ReseededOnCuda(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        torch.manual_seed(99)              # seeds the CUDA generators too
        self.b = nn.Linear(8, 8)
        torch.cuda.manual_seed(7)          # this GPU's only
        self.c = nn.Linear(8, 8)
        nn.init.trunc_normal_(self.c.weight, std=0.1)    # a torch.nn.init call replayed whole, on the GPU


def _chain_loss(m, x):
    return m.c(m.b(m.a(x))).square().mean()


@ON_CUDA
def test_cuda_manual_seed_inside_the_block_and_the_global_rngs():
    eager = built_on_cuda(ReseededOnCuda, empty=False)
    model = built_on_cuda(ReseededOnCuda, empty=True)
    step = px.compile(model, optimizer=px.AdamW(lr=1e-3), device="cuda")(_chain_loss)
    torch.manual_seed(123)
    cpu_rng, cuda_rng = torch.get_rng_state(), torch.cuda.get_rng_state()
    step.lower(torch.randn(4, 8, generator=torch.Generator().manual_seed(0)))
    assert_equal_exactly(step.state_dict(), eager.state_dict())
    assert torch.equal(torch.get_rng_state(), cpu_rng)              # the replay used its own generator
    assert torch.equal(torch.cuda.get_rng_state(), cuda_rng)
    with pytest.raises(px.EmptyModelError, match="real CUDA tensor"), px.init_empty(device="cuda"):
        torch.randn(3, device="cuda")                              # would move the CUDA generator the replay emulates
    with px.init_empty(device="cuda"):
        torch.randn(3, device="cpu")                               # the CPU generator is not replayed: allowed


@ON_CUDA
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_replay_holds_a_few_tensors_on_the_device(precision):
    """A GPT of 59M parameters (236 MB in fp32; the largest tensor, wte, 32 MB): building it under
    px.init_empty(device="cuda") allocates nothing on the GPU, and initialising it at the first step raises the GPU's
    allocated memory beyond what the compiled step holds by at most its largest tensor and that tensor's bf16 copy
    on its way to the chunk (the whole model never is on the GPU; nor are two of its tensors at once, such as the
    tied lm_head's own dead initialisation and wte's); the values equal an eager CUDA build's."""
    build = functools.partial(GPT, vocab=8192, block_size=64, n_layer=4, n_head=8, n_embd=1024)
    gc.collect()                           # an earlier test's garbage freed during the build would read as a change
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    model = built_on_cuda(build, empty=True)
    assert torch.cuda.memory_allocated() == before
    gen = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, 8192, (1, 16), generator=gen), torch.randint(0, 8192, (1, 16), generator=gen))
    step = px.compile(model, optimizer=px.AdamW(**HYPER), precision=precision, device="cuda")(gpt_loss)
    step.lower(*batch)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step._model_state.take()                     # what the first step does first: the initialisation
    torch.cuda.synchronize()
    grew = torch.cuda.max_memory_allocated() - base
    largest = max(p.numel() for p in model.parameters()) * 4
    total = sum(p.numel() for p in model.parameters()) * 4
    assert 2 * largest < total / 3
    assert largest <= grew <= 1.5 * largest + 2**20, (grew, largest, total)
    assert_equal_exactly(step.state_dict(), built_on_cuda(build, empty=False).state_dict())


def test_values_go_in_once_the_chunks_exist_and_too_early_is_a_clear_error(tmp_path):
    """An empty model's values live in the chunks: save, load and load_state_dict before they exist raise ValueError
    saying to call step.lower(*batch) first; after it, load_state_dict puts the given values in and save writes
    them."""
    def build():
        return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    torch.manual_seed(1)
    values = {k: v.detach().clone() for k, v in build().state_dict().items()}
    with px.init_empty():
        model = build()
    step = px.compile(model, optimizer=px.AdamW(lr=1e-3), device="cpu")(lambda m, x, y: F.cross_entropy(m(x), y))
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    for call in (lambda: step.load_state_dict(values), lambda: step.save(tmp_path / "c"),
                 lambda: step.load(tmp_path / "c")):
        with pytest.raises(ValueError, match=r"px.init_empty\(\).*step.lower\(\*batch\)"):
            call()
    step.lower(x, y)
    step.load_state_dict(values)
    assert all(torch.equal(v, values[k]) for k, v in step.state_dict().items())
    step.save(tmp_path / "c")
    assert all(torch.equal(v, values[k]) for k, v in torch.load(tmp_path / "c" / "model.pt").items())
