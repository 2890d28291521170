"""Checkpoints across world sizes: a run saved at world size 2 resumes at world size 1, and the reverse, and at 2
and 3, continuing bit for bit like the uninterrupted run (losses, parameters, optimizer states), in fp32 and bf16;
the sharded format (torch.distributed.checkpoint, each rank writing its own pieces) and the plain-files format both
load at any world size. Ranks are processes on the CPU with gloo (tests/support/dist_ckpt_worker.py), launched as
torchrun would; world size 1 is a process with no process group.

Why bit for bit is the right bar. Every run here splits the global batch into the same 2 micro-batches: at world size
2 each rank computes one and the reduce-scatter sums the two and halves the sum; at world size 1 the step
accumulates the two (accumulate=2) and halves the sum. Those are the same floating-point operations, and the Adam
update is elementwise, so an uninterrupted run at world size 2 equals one at world size 1 exactly (asserted first:
the premise). A checkpoint moves values without arithmetic, so a resumed run must equal the uninterrupted one
exactly too, whatever world size saved it and whatever loads it. (At world size 3 the split differs, so runs there
only load and save: the values read must equal the values written, bit for bit.)
"""
from __future__ import annotations

import json
import os

import pytest
import torch

import pstar_fx as px
import pstar_fx.checkpoint as ckpt
import pstar_fx.checkpoint.sharded as pdcp

from harness import HYPER
from models import CASES_BY_NAME
from ranks import run_ranks

pytestmark = pytest.mark.slow

K, N = 3, 5          # save before step K of N
BASE = dict(case="gpt_tied", chunk_size=2048, batch=4, units=2)


def launch(tmp, world: int, runs: list[dict], timeout: float = 400) -> list[dict]:
    """Run `world` ranks of the worker on `runs`; every rank's results (each rank must succeed)."""
    tag = f"w{world}-{runs[0]['name']}"
    spec, out = os.path.join(tmp, f"{tag}.json"), os.path.join(tmp, tag)
    with open(spec, "w") as f:
        json.dump(runs, f)
    ranks = run_ranks("dist_ckpt_worker.py", [spec, out], world, out, timeout)
    for r, res in enumerate(ranks.results):
        assert "error" not in res, f"rank {r} of {world}: {res['error'][2]}"
        assert ranks.codes[r] == 0, ranks.logs[r][-3000:]
    return ranks.results


def _run(name, **kw):
    return dict(BASE, name=name, **kw)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Four launches, in order: world 2 trains and saves; world 1 runs the uninterrupted references, saves, and
    resumes world 2's checkpoints; world 3 loads checkpoints of both and saves one of its own; world 2 resumes
    checkpoints of worlds 1, 2 and 3. Returns {world-tag: [rank results]} and the checkpoint directory."""
    tmp = str(tmp_path_factory.mktemp("dcp"))

    def d(name):
        return os.path.join(tmp, name)

    out = {}
    out["w2"] = launch(tmp, 2, [
        _run("fp32", precision="fp32", start=0, stop=N, saves=[[K, d("w2-fp32"), None], [K, d("w2-plain"), False]],
             optimizer_round_trip=True),
        _run("bf16", precision="bf16", start=0, stop=N, saves=[[K, d("w2-bf16"), None]]),
        _run("fresh", precision="fp32", start=0, stop=0, saves=[[0, d("w2-fresh"), None]]),
        _run("nadam", precision="fp32", optimizer="nadam", start=0, stop=N, saves=[[K, d("w2-nadam"), None]]),
        _run("sgd", precision="bf16", optimizer="sgd", start=0, stop=N, saves=[[K, d("w2-sgd"), None]]),
    ])
    out["w1"] = launch(tmp, 1, [
        _run("fp32", precision="fp32", start=0, stop=N, saves=[[K, d("w1-plain"), None], [K, d("w1-fp32"), True]]),
        _run("bf16", precision="bf16", start=0, stop=N, saves=[[K, d("w1-bf16"), True]]),
        _run("from-w2-fp32", precision="fp32", start=K, stop=N, load=d("w2-fp32")),
        _run("from-w2-fp32-lowered", precision="fp32", start=K, stop=N, load=d("w2-fp32"), load_when="lowered"),
        _run("from-w2-plain", precision="fp32", start=K, stop=N, load=d("w2-plain"), load_when="lowered"),
        _run("from-w2-bf16", precision="bf16", start=K, stop=N, load=d("w2-bf16"), load_when="lowered"),
        _run("from-w2-bf16-relayout", precision="bf16", start=K, stop=N, load=d("w2-bf16"), load_when="lowered",
             chunk_size=1000),
        _run("from-w2-fresh", precision="fp32", start=0, stop=2, load=d("w2-fresh"), load_when="lowered"),
        _run("nadam", precision="fp32", optimizer="nadam", start=0, stop=N, saves=[[K, d("w1-nadam"), True]]),
        _run("sgd", precision="bf16", optimizer="sgd", start=0, stop=N),
        _run("from-w2-nadam", precision="fp32", optimizer="nadam", start=K, stop=N, load=d("w2-nadam"),
             load_when="lowered"),
        _run("from-w2-sgd", precision="bf16", optimizer="sgd", start=K, stop=N, load=d("w2-sgd")),
    ])
    three = dict(batch=6, units=6)     # world 3 only loads and saves: any batch that splits in 3 compiles
    out["w3"] = launch(tmp, 3, [
        _run("from-w2-fp32", precision="fp32", start=K, stop=K, load=d("w2-fp32"), load_when="lowered",
             saves=[[K, d("w3-fp32"), None]], **three),
        _run("from-w1-bf16", precision="bf16", start=K, stop=K, load=d("w1-bf16"), load_when="lowered", **three),
        _run("from-w1-plain", precision="fp32", start=K, stop=K, load=d("w1-plain"), load_when="lowered", **three),
    ])
    out["w2r"] = launch(tmp, 2, [
        _run("from-w1-plain", precision="fp32", start=K, stop=N, load=d("w1-plain"), load_when="lowered"),
        _run("from-w1-fp32", precision="fp32", start=K, stop=N, load=d("w1-fp32")),
        _run("from-w2-fp32", precision="fp32", start=K, stop=N, load=d("w2-fp32"), load_when="lowered"),
        _run("from-w3-fp32", precision="fp32", start=K, stop=N, load=d("w3-fp32"), load_when="lowered"),
        _run("from-w1-bf16", precision="bf16", start=K, stop=N, load=d("w1-bf16"), load_when="lowered"),
        _run("from-w1-nadam", precision="fp32", optimizer="nadam", start=K, stop=N, load=d("w1-nadam"),
             load_when="lowered"),
    ])
    return out, tmp


def _equal_state(a: dict, b: dict, where: str) -> None:
    assert a.keys() == b.keys(), where
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), \
            f"{where}: {k} differs (max |a-b| {(a[k].double() - b[k].double()).abs().max().item():.3e})"


def _equal_optimizer(a: dict, b: dict, where: str) -> None:
    assert a["param_groups"] == b["param_groups"], where
    assert a["state"].keys() == b["state"].keys(), where
    for i in a["state"]:
        assert a["state"][i].keys() == b["state"][i].keys(), f"{where}: state {i}"
        for key in a["state"][i]:
            assert torch.equal(a["state"][i][key], b["state"][i][key]), f"{where}: state {i} {key} differs"


def _ranks_agree(results: list[dict], name: str) -> dict:
    """Every rank reports the same losses and the same gathered values; returns rank 0's."""
    first = results[0][name]
    for r, res in enumerate(results[1:], 1):
        assert res[name]["losses"] == first["losses"], (name, r)
        _equal_state(res[name]["state"], first["state"], f"{name}: rank {r} vs rank 0")
    return first


def test_world_2_equals_world_1_on_the_same_micro_batches(runs):
    """The premise: the uninterrupted runs at world sizes 2 and 1 are the same floating-point computation."""
    out, _ = runs
    for prec in ("fp32", "bf16", "nadam", "sgd"):
        a, b = _ranks_agree(out["w2"], prec), out["w1"][0][prec]
        assert a["losses"] == b["losses"], prec
        _equal_state(a["state"], b["state"], prec)
        _equal_optimizer(a["optimizer"], b["optimizer"], prec)
        assert len(set(a["losses"])) == N and a["losses"][-1] < a["losses"][0], "the run must train"


RESUMED = [("w1", "from-w2-fp32", "fp32"), ("w1", "from-w2-fp32-lowered", "fp32"), ("w1", "from-w2-plain", "fp32"),
           ("w1", "from-w2-bf16", "bf16"), ("w2r", "from-w1-plain", "fp32"), ("w2r", "from-w1-fp32", "fp32"),
           ("w2r", "from-w2-fp32", "fp32"), ("w2r", "from-w3-fp32", "fp32"), ("w2r", "from-w1-bf16", "bf16"),
           # other optimizers' states in the sharded format: NAdam's 0-d mu_product, SGD's momentum alone
           ("w1", "from-w2-nadam", "nadam"), ("w1", "from-w2-sgd", "sgd"), ("w2r", "from-w1-nadam", "nadam")]


@pytest.mark.parametrize("launch_tag,name,ref", RESUMED, ids=[f"{t}-{n}" for t, n, _ in RESUMED])
def test_a_resumed_run_equals_the_uninterrupted_run_bit_for_bit(runs, launch_tag, name, ref):
    """2 -> 1, 1 -> 2, 2 -> 2 and 3 -> 2, sharded and plain-files checkpoints, loaded before the first step
    (whole, into the model) or after step.lower (each rank its own pieces)."""
    out, _ = runs
    want = out["w1"][0][ref]
    got = _ranks_agree(out[launch_tag], name)
    assert got["losses"] == want["losses"][K:], (name, got["losses"], want["losses"][K:])
    _equal_state(got["state"], want["state"], name)
    _equal_optimizer(got["optimizer"], want["optimizer"], name)


def test_a_relayout_across_world_sizes_resumes_too(runs):
    """Saved at world 2 with 2048-element chunks, resumed at world 1 with 1000-element chunks (bf16): the
    numerics policy's 1e-6; bit-equal on this machine, asserted too."""
    out, _ = runs
    want, got = out["w1"][0]["bf16"], out["w1"][0]["from-w2-bf16-relayout"]
    for a, b in zip(got["losses"], want["losses"][K:]):
        assert abs(a - b) <= 1e-6 * abs(b), (got["losses"], want["losses"][K:])
    _equal_state(got["state"], want["state"], "relayout")


def test_loading_reads_exactly_what_was_saved_at_any_world_size(runs):
    """Right after a load, the gathered values and optimizer state equal what the saving run held when it saved:
    2 -> 3, 1 -> 3 (sharded and plain files), 3 -> 2 (through the run that resumed from it)."""
    out, tmp = runs
    cases = [("w3", "from-w2-fp32", out["w2"][0]["fp32"]["saved"][os.path.join(tmp, "w2-fp32")]),
             ("w3", "from-w1-bf16", out["w1"][0]["bf16"]["saved"][os.path.join(tmp, "w1-bf16")]),
             ("w3", "from-w1-plain", out["w1"][0]["fp32"]["saved"][os.path.join(tmp, "w1-plain")]),
             ("w2r", "from-w3-fp32", out["w3"][0]["from-w2-fp32"]["saved"][os.path.join(tmp, "w3-fp32")]),
             ("w1", "from-w2-fresh", out["w2"][0]["fresh"]["saved"][os.path.join(tmp, "w2-fresh")])]
    for tag, name, saved in cases:
        for r, res in enumerate(out[tag]):
            _equal_state(res[name]["loaded_state"], saved["state"], f"{tag} {name} rank {r}")
            _equal_optimizer(res[name]["loaded_optimizer"], saved["optimizer"], f"{tag} {name} rank {r}")
    assert out["w3"][0]["from-w2-fp32"]["saved"][os.path.join(tmp, "w3-fp32")]["optimizer"]["state"], \
        "the checkpoint read at world 3 has optimizer state"
    # saved before the first step at world 2 (the model's own values, no optimizer state), then trained at world 1
    fresh = out["w1"][0]["from-w2-fresh"]
    assert fresh["losses"] == out["w1"][0]["fp32"]["losses"][:2]
    assert not fresh["loaded_optimizer"]["state"]


def test_the_sharded_format_writes_each_rank_its_own_pieces(runs):
    """At world 2: one data file per rank, each holding about half of the elements of the values and moments (no
    rank wrote them all) and together each element once; every parameter is stored at its own shape and some are
    split between the ranks. The plain-files checkpoint saved at world 2 is torch files."""
    _, tmp = runs
    d = os.path.join(tmp, "w2-fp32")
    assert sorted(os.listdir(d)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    md = pdcp.read_metadata(d)
    per_file: dict[str, int] = {}
    for index, where in md.storage_data.items():
        if index.fqn.startswith("model.") or index.fqn.endswith(("exp_avg", "exp_avg_sq")):
            n = md.state_dict_metadata[index.fqn].chunks[index.index].sizes.numel()
            per_file[where.relative_path] = per_file.get(where.relative_path, 0) + n
    model = CASES_BY_NAME["gpt_tied"].build_model()
    total = 3 * sum(p.numel() for p in model.parameters())          # values, exp_avg, exp_avg_sq
    assert sum(per_file.values()) == total
    assert sorted(per_file) == ["__0_0.distcp", "__1_0.distcp"]
    assert all(0.3 * total < n < 0.7 * total for n in per_file.values()), (per_file, total)
    for name, p in model.named_parameters():
        meta = md.state_dict_metadata[f"model.{name}"]
        assert tuple(meta.size) == tuple(p.shape) and sum(c.sizes.numel() for c in meta.chunks) == p.numel()
    assert any(len({md.storage_data[i].relative_path for i in md.storage_data if i.fqn == f"model.{n}"}) == 2
               for n, _ in model.named_parameters()), "some parameter is split between the ranks"
    assert sorted(os.listdir(os.path.join(tmp, "w2-plain"))) == sorted(ckpt.FILES)
    assert not [n for n in os.listdir(tmp) if ".tmp-" in n or ".old-" in n]


def test_optimizer_state_dict_round_trip_across_ranks(runs):
    """step.optimizer.state_dict() at world 2 (a collective) equals world 1's, loads back into the step (a
    collective) unchanged, and loads into eager torch.optim.AdamW."""
    out, _ = runs
    for r, res in enumerate(out["w2"]):
        _equal_optimizer(res["fp32"]["round_trip_optimizer"], res["fp32"]["optimizer"], f"rank {r}")
    sd = out["w2"][0]["fp32"]["optimizer"]
    model = CASES_BY_NAME["gpt_tied"].build_model()
    opt = torch.optim.AdamW(model.parameters(), **HYPER)
    opt.load_state_dict(sd)
    assert len(opt.state) == len(list(model.parameters()))
    assert all(float(s["step"]) == N for s in opt.state.values())


def test_state_dict_gathered_to_rank_0_only(runs):
    """step.state_dict(rank0_only=True): rank 0 gets what every rank gets from step.state_dict(), the others {}."""
    out, _ = runs
    for tag in ("w2", "w3", "w2r"):
        for name in out[tag][0]:
            _equal_state(out[tag][0][name]["rank0_state"], out[tag][0][name]["state"], f"{tag} {name}")
            assert all(res[name]["rank0_state"] == {} for res in out[tag][1:])


# -- one process ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ndim", [1, 2, 3, 4])
def test_boxes_tile_exactly_the_range(ndim):
    gen = torch.Generator().manual_seed(ndim)
    for _ in range(200):
        shape = tuple(int(s) for s in torch.randint(1, 5, (ndim,), generator=gen))
        n = 1
        for s in shape:
            n *= s
        a, b = sorted(int(x) for x in torch.randint(0, n + 1, (2,), generator=gen))
        boxes = pdcp.boxes(shape, a, b)
        assert len(boxes) <= max(1, 2 * ndim - 1)
        hit = torch.zeros(shape, dtype=torch.int64)
        flat = torch.arange(n).view(shape)
        at = a
        for offsets, sizes, first in boxes:
            region = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
            hit[region] += 1
            run = flat[region].reshape(-1).tolist()
            assert first == at and run == list(range(at, at + len(run)))      # a contiguous run, in order
            at += len(run)
        assert at == b
        assert hit.reshape(-1)[a:b].eq(1).all() and hit.sum() == b - a, (shape, a, b, boxes)


def _step(precision="fp32", chunk_size=2048):
    case = CASES_BY_NAME["gpt_tied"]
    model = case.build_model()
    return px.compile(model, optimizer=px.AdamW(**HYPER), chunk_size=chunk_size, precision=precision,
                      device="cpu")(case.loss_fn), case


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_one_process_writes_either_format_and_reads_both(tmp_path, precision):
    """Either format resumes bit for bit in one process, into another chunk size, with the fp16 loss scaler's
    state (set to what overflows would have left) and the RNG state carried."""
    step, case = _step(precision)
    for i in range(2):
        step(*case.batch(i))
    if precision == "fp16":
        step._scaler.scale, step._scaler.good_steps = 2.0 ** 9, 7
    torch.manual_seed(123)
    step.save(tmp_path / "sharded", sharded=True)
    step.save(tmp_path / "plain")
    assert sorted(os.listdir(tmp_path / "plain")) == sorted(ckpt.FILES)
    assert pdcp.MARKER in os.listdir(tmp_path / "sharded")
    want = [step(*case.batch(i)).item() for i in (2, 3)] + [torch.rand(()).item()]
    for name in ("sharded", "plain"):
        again, _ = _step(precision, chunk_size=1000)
        torch.manual_seed(0)
        again.load(tmp_path / name)
        if precision == "fp16":
            assert (again._scaler.scale, again._scaler.good_steps) == (2.0 ** 9, 7), name
        assert [again(*case.batch(i)).item() for i in (2, 3)] + [torch.rand(()).item()] == want, name
        _equal_state(again.state_dict(), step.state_dict(), name)
    # a sharded checkpoint is replaced by the next save under its name, atomically
    step.save(tmp_path / "sharded", sharded=True)
    assert sorted(os.listdir(tmp_path)) == ["plain", "sharded"]


def test_a_failed_sharded_save_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    step, case = _step()
    step(*case.batch(0))
    step.save(tmp_path / "c", sharded=True)
    before = step.state_dict()
    step(*case.batch(1))

    def broken(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(pdcp.dcp, "save", broken)
    with pytest.raises(OSError, match="disk full"):
        step.save(tmp_path / "c", sharded=True)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["c"]
    fresh, _ = _step()
    fresh.load(tmp_path / "c")
    _equal_state(fresh.state_dict(), before, "old checkpoint")


def test_a_sharded_checkpoint_of_another_model_is_refused_and_changes_nothing(tmp_path):
    step, case = _step()
    step(*case.batch(0))
    step.save(tmp_path / "c", sharded=True)
    from models import GPT
    other = px.compile(GPT(vocab=64, block_size=16, n_layer=1, n_head=2, n_embd=32),
                       optimizer=px.AdamW(**HYPER), device="cpu")(case.loss_fn)
    other(*case.batch(0))
    before, opt_before = other.state_dict(), other.optimizer.state_dict()
    with pytest.raises(ValueError, match="another model"):
        other.load(tmp_path / "c")
    _equal_state(other.state_dict(), before, "refused load")
    _equal_optimizer(other.optimizer.state_dict(), opt_before, "refused load")


def test_a_model_built_under_init_empty_saves_and_loads_once_its_chunks_exist(tmp_path):
    """The values of a px.init_empty() model exist only in the chunks: save and load need them (after step.lower or
    a step) and say so before; then both formats carry them like any other."""
    case = CASES_BY_NAME["gpt_tied"]

    def empty_step():
        with px.init_empty():
            model = case.build()
        return px.compile(model, optimizer=px.AdamW(**HYPER), chunk_size=2048, device="cpu")(case.loss_fn)

    a = empty_step()
    with pytest.raises(ValueError, match="init_empty"):
        a.save(tmp_path / "early", sharded=True)
    a.lower(*case.batch(0))
    a(*case.batch(0))                                    # trained: the values differ from a fresh replay's
    a.save(tmp_path / "sharded", sharded=True)
    a.save(tmp_path / "plain")
    want = a.state_dict()
    want_loss = a(*case.batch(1)).item()
    for name in ("sharded", "plain"):
        b = empty_step()
        with pytest.raises(ValueError, match="step.lower"):
            b.load(tmp_path / name)
        b.lower(*case.batch(0))
        assert not torch.equal(b.state_dict()["wte.weight"], want["wte.weight"])
        b.load(tmp_path / name)
        _equal_state(b.state_dict(), want, name)
        assert b(*case.batch(1)).item() == want_loss, name
